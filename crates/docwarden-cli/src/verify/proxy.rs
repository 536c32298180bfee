//! A small TCP proxy in front of the server: adds latency to every chunk (or only to the
//! server-to-client direction: an asymmetric delay) and can reset every open connection
//! at once. Only ever listens on and connects to 127.0.0.1.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// A running proxy; stops when dropped.
pub(crate) struct Proxy {
    addr: SocketAddr,
    latency_ms: Arc<AtomicU64>,
    reply_latency_ms: Arc<AtomicU64>,
    reset: watch::Sender<u64>,
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
        let cancel = CancellationToken::new();
        let (lat, rst, stop) = (Arc::clone(&latency_ms), reset.clone(), cancel.clone());
        let reply = Arc::clone(&reply_latency_ms);
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = stop.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((client, _)) = accepted else { continue };
                let (lat, mut reset_rx, stop) = (Arc::clone(&lat), rst.subscribe(), stop.clone());
                let reply = Arc::clone(&reply);
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::select! {
                        _ = pump(cr, sw, Arc::clone(&lat), None) => {}
                        _ = pump(sr, cw, lat, Some(reply)) => {}
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
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    latency_ms: Arc<AtomicU64>,
    extra_ms: Option<Arc<AtomicU64>>,
) {
    let mut buf = vec![0_u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let delay = latency_ms.load(Ordering::Relaxed)
            + extra_ms.as_ref().map_or(0, |e| e.load(Ordering::Relaxed));
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
