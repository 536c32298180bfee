//! A small TCP proxy in front of the server: adds latency to every chunk (or, with
//! `set_reply_latency`, to the server-to-client direction only) (and, as a lost
//! segment's retransmission does, holds one chunk in fifty for 2.5 s), can reset every
//! open connection at once, and can partition clients from the server. Only ever listens
//! on and connects to 127.0.0.1.
//!
//! A partition is a blackhole, as a failed network path makes it: nothing is forwarded and
//! nothing is closed, so clients see no error, only silence. It cuts whole hosts: a worker
//! process names its worker slot in its handshake ([`host_driver_info`]), and every
//! connection of a cut slot — open at the start or opened during the partition, the
//! process's background lease renewals included — is blackholed, in both directions, while
//! the other slots' processes run on and take over the leases of those that hang. (Cutting
//! only the connections open at its start, as this proxy first did, let a holder's
//! watchdog renew its lease over a fresh connection while the holder's write hung: nobody
//! took the lease over, and the late write was still its holder's.) A connection that
//! names no slot (workers as tasks share one client; the verify process's own client) is
//! cut if it was open when the partition started, and runs on if opened during it.
//!
//! When it heals, what was held is delivered, as TCP would after retransmitting,
//! connection by connection at random moments over up to 2 s: a request sent during the
//! partition lands after it, long after its sender's lease expired and after another
//! client took the lease over.

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

/// What a worker process appends to the driver name of its handshake, followed by its
/// worker slot: how the proxy tells which host a connection comes from.
const HOST_MARK: &str = "docwarden-verify-host-";

/// The driver information a worker process in `slot` connects with (its host, for the
/// partition).
pub(crate) fn host_driver_info(slot: usize) -> mongodb::options::DriverInfo {
    mongodb::options::DriverInfo::builder()
        .name(format!("{HOST_MARK}{slot}"))
        .build()
}

/// The worker slot a connection's first chunk (its handshake) names, if any.
fn host_of(chunk: &[u8]) -> Option<usize> {
    let mark = HOST_MARK.as_bytes();
    let at = chunk.windows(mark.len()).position(|w| w == mark)? + mark.len();
    let digits: String = chunk[at..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .map(|&b| char::from(b))
        .collect();
    digits.parse().ok()
}

/// The size of the buffer of each direction of a connection.
const BUF: usize = 64 * 1024;

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
        let reply_all = Arc::clone(&reply_latency_ms);
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
                let born = part.borrow().epoch;
                let reply = Arc::clone(&reply_all);
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (mut cr, cw) = client.into_split();
                    let (sr, mut sw) = server.into_split();
                    // The host is known from the handshake, the client's first chunk; the
                    // server says nothing before it.
                    let (link_tx, link_rx) = tokio::sync::oneshot::channel::<Link>();
                    let lat_b = Arc::clone(&lat);
                    let upstream = async move {
                        let mut buf = vec![0_u8; BUF];
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        let link = Link {
                            born,
                            host: host_of(&buf[..n]),
                        };
                        let _ = link_tx.send(link);
                        if forward(&buf[..n], &mut sw, &lat, None, link, &part_a).await {
                            pump(cr, sw, lat, None, link, part_a).await;
                        }
                    };
                    let downstream = async move {
                        if let Ok(link) = link_rx.await {
                            pump(sr, cw, lat_b, Some(reply), link, part_b).await;
                        }
                    };
                    tokio::select! {
                        () = upstream => {}
                        () = downstream => {}
                        _ = reset_rx.changed() => {}
                        () = stop.cancelled() => {}
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

    /// Starts a partition that cuts the worker slots in the bitmask `hosts` (slot `s` is bit
    /// `s % 64`) and the connections that name no slot and are open now: while it lasts
    /// nothing is forwarded either way on them; nothing is closed.
    pub(crate) fn partition(&self, hosts: u64) {
        self.partition.send_modify(|p| {
            if !p.on {
                p.epoch += 1;
            }
            p.on = true;
            p.hosts = hosts;
        });
    }

    /// Heals the partition: what was held is delivered (see [`healed`]).
    pub(crate) fn heal(&self) {
        self.partition.send_modify(|p| p.on = false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// A partition: its number (1, 2, …), whether it is on, and the worker slots it cuts (a
/// bitmask, slot `s` is bit `s % 64`).
#[derive(Clone, Copy, Debug, Default)]
struct Partition {
    epoch: u64,
    on: bool,
    hosts: u64,
}

/// One proxied connection, for the partition: the partition number when it was opened, and
/// the worker slot its handshake named.
#[derive(Clone, Copy, Debug)]
struct Link {
    born: u64,
    host: Option<usize>,
}

impl Link {
    /// Whether `p` cuts this connection: it is on, and it cuts the connection's host (every
    /// connection of it, new ones too) or, for a connection that names no host, the
    /// connection is older than it.
    fn cut_by(self, p: Partition) -> bool {
        p.on && match self.host {
            Some(slot) => p.hosts & (1_u64 << (slot % 64)) != 0,
            None => p.epoch > self.born,
        }
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

/// Forwards one chunk: held while a partition cuts `link`, delayed under latency. `false`
/// when the other end is gone.
async fn forward(
    chunk: &[u8],
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    latency_ms: &AtomicU64,
    extra_ms: Option<&AtomicU64>,
    link: Link,
    partition: &watch::Receiver<Partition>,
) -> bool {
    // Held, not dropped, during a partition: TCP delivers it after the heal.
    healed(link, partition.clone()).await;
    let mut delay = latency_ms.load(Ordering::Relaxed);
    // Under latency, one chunk in SPIKE_ONE_IN waits for a retransmission instead.
    if delay > 0 && rand::random_range(0..SPIKE_ONE_IN) == 0 {
        delay = u64::try_from(SPIKE.as_millis()).unwrap_or(u64::MAX);
    }
    // A one-direction delay (`set_reply_latency`) comes on top.
    let delay = delay + extra_ms.map_or(0, |e| e.load(Ordering::Relaxed));
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    to.write_all(chunk).await.is_ok()
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    latency_ms: Arc<AtomicU64>,
    extra_ms: Option<Arc<AtomicU64>>,
    link: Link,
    partition: watch::Receiver<Partition>,
) {
    let mut buf = vec![0_u8; BUF];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if !forward(
            &buf[..n],
            &mut to,
            &latency_ms,
            extra_ms.as_deref(),
            link,
            &partition,
        )
        .await
        {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_cuts_its_hosts_and_the_unnamed_connections_open_when_it_started() {
        let on = Partition {
            epoch: 3,
            on: true,
            hosts: 0b101,
        };
        let unnamed = |born| Link { born, host: None };
        let named = |born, slot| Link {
            born,
            host: Some(slot),
        };
        assert!(unnamed(2).cut_by(on));
        assert!(unnamed(0).cut_by(on));
        assert!(
            !unnamed(3).cut_by(on),
            "an unnamed connection opened during the partition runs on"
        );
        assert!(named(2, 0).cut_by(on));
        assert!(
            named(3, 2).cut_by(on),
            "a cut host's connection opened during the partition is cut too"
        );
        assert!(!named(2, 1).cut_by(on), "the other hosts run on");
        let healed = Partition { on: false, ..on };
        assert!(!unnamed(2).cut_by(healed));
        assert!(!named(2, 0).cut_by(healed));
    }

    #[test]
    fn the_host_is_read_from_the_handshake() {
        let hello = b"\x02name\x00\x30\x00\x00\x00mongo-rust-driver|docwarden-verify-host-12\x00";
        assert_eq!(host_of(hello), Some(12));
        assert_eq!(host_of(b"mongo-rust-driver\x00"), None);
    }
}
