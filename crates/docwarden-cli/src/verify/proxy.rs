//! A small TCP proxy in front of the server: adds latency to every chunk (and, as a lost
//! segment's retransmission does, holds one chunk in a hundred for 2.5 s), can reset every
//! open connection at once, and can partition the clients from the server. Only ever
//! listens on and connects to 127.0.0.1.
//!
//! A partition is a blackhole, as a dropped link or a firewall rule makes it: nothing is
//! forwarded and nothing is closed, so clients see no error, only silence (their requests
//! and new connections hang). When it heals, what was held is delivered, as TCP would
//! after retransmitting, connection by connection in random order over up to 1 s: a
//! request sent during the partition lands after it, long after its sender's lease
//! expired and possibly after another client took the lease over.

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
const SPIKE_ONE_IN: u32 = 100;

/// A running proxy; stops when dropped.
pub(crate) struct Proxy {
    addr: SocketAddr,
    latency_ms: Arc<AtomicU64>,
    reset: watch::Sender<u64>,
    /// `true` while partitioned.
    partition: watch::Sender<bool>,
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
        let (reset, _) = watch::channel(0_u64);
        let (partition, _) = watch::channel(false);
        let cancel = CancellationToken::new();
        let (lat, rst, stop) = (Arc::clone(&latency_ms), reset.clone(), cancel.clone());
        let part = partition.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = stop.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((client, _)) = accepted else { continue };
                let (lat, mut reset_rx, stop) = (Arc::clone(&lat), rst.subscribe(), stop.clone());
                let (part_a, part_b) = (part.subscribe(), part.subscribe());
                tokio::spawn(async move {
                    // A connection opened during a partition reaches the server after it.
                    healed(part_a.clone()).await;
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::select! {
                        _ = pump(cr, sw, Arc::clone(&lat), part_a) => {}
                        _ = pump(sr, cw, lat, part_b) => {}
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

    /// Closes every open connection.
    pub(crate) fn reset_all(&self) {
        self.reset.send_modify(|n| *n += 1);
    }

    /// Starts (`true`) or heals (`false`) a full partition: while it lasts nothing is
    /// forwarded either way and new connections wait; nothing is closed.
    pub(crate) fn set_partitioned(&self, on: bool) {
        self.partition.send_replace(on);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Returns once the proxy is not partitioned (at once if it is not). After a partition,
/// each direction of each connection comes back after its own random delay of up to 1 s
/// (links heal one by one), so what one client sent during the partition may land after
/// another client's later requests.
async fn healed(mut partition: watch::Receiver<bool>) {
    if !*partition.borrow() {
        return;
    }
    // An error means the proxy is gone: nothing to wait for.
    let _ = partition.wait_for(|on| !on).await;
    tokio::time::sleep(Duration::from_millis(rand::random_range(0..1000))).await;
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    latency_ms: Arc<AtomicU64>,
    partition: watch::Receiver<bool>,
) {
    let mut buf = vec![0_u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // Held, not dropped, during a partition: TCP delivers it after the heal.
        healed(partition.clone()).await;
        let mut delay = latency_ms.load(Ordering::Relaxed);
        // Under latency, one chunk in SPIKE_ONE_IN waits for a retransmission instead.
        if delay > 0 && rand::random_range(0..SPIKE_ONE_IN) == 0 {
            delay = u64::try_from(SPIKE.as_millis()).unwrap_or(u64::MAX);
        }
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
