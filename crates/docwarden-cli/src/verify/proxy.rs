//! A small TCP proxy in front of the server: adds latency to every chunk (or only to the
//! server-to-client direction: an asymmetric delay; and, as a lost
//! segment's retransmission does, holds one chunk in fifty for 2.5 s), can reset every
//! open connection at once, and can partition the clients from the server. Only ever
//! listens on and connects to 127.0.0.1.
//!
//! A partition is a blackhole, as a failed network path makes it: nothing is forwarded and
//! nothing is closed, so clients see no error, only silence. It cuts all traffic of every
//! connection open when it starts (the pool's idle connections too), in both directions;
//! connections opened during it take a working path (a route that converged), so the
//! clients that reconnect run on and take over the leases of those that hang. When it
//! heals, what was held is delivered, as TCP would after retransmitting, connection by
//! connection at random moments over up to 2 s: a request sent during the partition
//! lands after it, long after its sender's lease expired and after another client took
//! the lease over.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Under latency, how long a chunk waits when its segment was "lost" and retransmitted:
/// longer than the locks' (1 s) and the queue's (2 s) leases.
pub(crate) const SPIKE: Duration = Duration::from_millis(2500);
/// Under latency, one chunk in this many waits [`SPIKE`].
const SPIKE_ONE_IN: u32 = 50;

/// After a partition, connections resume within this long of the heal, each at its own
/// moment.
pub(crate) const HEAL_SPREAD: Duration = Duration::from_secs(2);

/// A running proxy; stops when dropped.
pub(crate) struct Proxy {
    addr: SocketAddr,
    latency_ms: Arc<AtomicU64>,
    reply_latency_ms: Arc<AtomicU64>,
    reset: watch::Sender<u64>,
    /// The current (or last) partition.
    partition: watch::Sender<Partition>,
    cancel: CancellationToken,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub(crate) async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        anyhow::ensure!(
            upstream.ip().is_loopback(),
            "the proxy only forwards to loopback"
        );
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let latency_ms = Arc::new(AtomicU64::new(0));
        let reply_latency_ms = Arc::new(AtomicU64::new(0));
        let (reset, _) = watch::channel(0_u64);
        let (partition, _) = watch::channel(Partition::default());
        let cancel = CancellationToken::new();
        let (lat, rst, stop) = (Arc::clone(&latency_ms), reset.clone(), cancel.clone());
        let part = partition.clone();
        let reply = Arc::clone(&reply_latency_ms);
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = stop.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((client, _)) = accepted else { continue };
                let (lat, mut reset_rx, stop) = (Arc::clone(&lat), rst.subscribe(), stop.clone());
                let (part_a, part_b) = (part.subscribe(), part.subscribe());
                // A connection opened during a partition is on the working side of it.
                let link = Link {
                    born: part.borrow().epoch,
                };
                let reply = Arc::clone(&reply);
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::select! {
                        _ = pump(cr, sw, Arc::clone(&lat), None, link, part_a) => {}
                        _ = pump(sr, cw, lat, Some(reply), link, part_b) => {}
                        _ = reset_rx.changed() => {}
                        _ = stop.cancelled() => {}
                    }
                    // Dropping both halves closes the connection (a reset as the client sees it).
                });
            }
        });
        Ok(Self {
            addr,
            latency_ms,
            reply_latency_ms,
            reset,
            partition,
            cancel,
        })
    }

    /// The URI to give clients instead of the server's.
    pub(crate) fn uri(&self) -> String {
        format!("mongodb://{}/?directConnection=true", self.addr)
    }

    /// Sets the delay added to every forwarded chunk.
    pub(crate) fn set_latency(&self, latency: Duration) {
        let ms = u64::try_from(latency.as_millis()).unwrap_or(u64::MAX);
        self.latency_ms.store(ms, Ordering::Relaxed);
    }

    /// Sets the delay added to every chunk from the server to the client only (on top of
    /// [`Proxy::set_latency`]): replies arrive late, requests do not.
    pub(crate) fn set_reply_latency(&self, latency: Duration) {
        let ms = u64::try_from(latency.as_millis()).unwrap_or(u64::MAX);
        self.reply_latency_ms.store(ms, Ordering::Relaxed);
    }

    /// Closes every open connection.
    pub(crate) fn reset_all(&self) {
        self.reset.send_modify(|n| *n += 1);
    }

    /// Starts (`true`) or heals (`false`) a partition: while it lasts nothing is forwarded
    /// either way on the connections open when it started; nothing is closed.
    pub(crate) fn set_partitioned(&self, on: bool) {
        self.partition.send_modify(|p| {
            if on && !p.on {
                p.epoch += 1;
            }
            p.on = on;
        });
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// A partition: its number (1, 2, …) and whether it is on.
#[derive(Clone, Copy, Debug, Default)]
struct Partition {
    epoch: u64,
    on: bool,
}

/// One proxied connection, for the partition: the partition number when it was opened.
#[derive(Clone, Copy, Debug)]
struct Link {
    born: u64,
}

impl Link {
    /// Whether `p` cuts this connection: it is on and the connection is older than it.
    fn cut_by(self, p: Partition) -> bool {
        p.on && p.epoch > self.born
    }
}

/// Returns at once unless a partition cuts `link`; then when it heals, after a random
/// delay of up to [`HEAL_SPREAD`], as TCP resumes a connection at its next retransmission
/// (after a 3 s outage the backoff is 1.6–3.2 s): what one client sent during the
/// partition may land after another client's later requests.
async fn healed(link: Link, mut partition: watch::Receiver<Partition>) {
    if !link.cut_by(*partition.borrow()) {
        return;
    }
    // An error means the proxy is gone: nothing to wait for.
    let _ = partition.wait_for(|p| !link.cut_by(*p)).await;
    let spread = u64::try_from(HEAL_SPREAD.as_millis()).unwrap_or(u64::MAX);
    tokio::time::sleep(Duration::from_millis(rand::random_range(0..spread))).await;
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    latency_ms: Arc<AtomicU64>,
    extra_ms: Option<Arc<AtomicU64>>,
    link: Link,
    partition: watch::Receiver<Partition>,
) {
    let mut buf = vec![0_u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // Held, not dropped, during a partition: TCP delivers it after the heal.
        healed(link, partition.clone()).await;
        let mut delay = latency_ms.load(Ordering::Relaxed);
        let extra = extra_ms.as_ref().map_or(0, |e| e.load(Ordering::Relaxed));
        // Under latency, one chunk in SPIKE_ONE_IN waits for a retransmission instead.
        if delay > 0 && rand::random_range(0..SPIKE_ONE_IN) == 0 {
            delay = u64::try_from(SPIKE.as_millis()).unwrap_or(u64::MAX);
        }
        let delay = delay + extra;
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_cuts_the_connections_open_when_it_started() {
        let on = Partition { epoch: 3, on: true };
        assert!(Link { born: 2 }.cut_by(on));
        assert!(Link { born: 0 }.cut_by(on));
        assert!(
            !Link { born: 3 }.cut_by(on),
            "a connection opened during the partition runs on"
        );
        let healed = Partition {
            epoch: 3,
            on: false,
        };
        assert!(!Link { born: 2 }.cut_by(healed));
    }
}
