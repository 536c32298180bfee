//! Session 19, item 4: a read attempt whose write lands after the client saw its error
//! must not leave a reader entry nobody holds.
//!
//! A TCP proxy between the reader's client and the server holds the first two `update`
//! commands on `rw` (the read attempt and the driver's own retry of it), resets the
//! client's connections at once (the client sees a network error, the driver's retry
//! fails too, the blocking `read` retries with a new attempt that enters, about 1 s later)
//! and forwards the held commands later: 1.5 s (inside the attempt's 2 s landing window,
//! after the read entered: the entry lands and is removed once the window has passed)
//! and 3 s (after the window: the write appends nothing). Counts: reader entries left
//! live after the reader released (0), and whether a writer gets the lock within 1 s.
//! Without the landing deadline and the removal (`RwLocks::read`), 1 stray entry in each
//! case and the writer gets `Ok(None)`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{LockCollection, LockOptions, Owner, RwLockOptions, RwLocks};
use docwarden_testkit::TestDb;
use mongodb::Client;
use mongodb::bson::{DateTime, Document, doc};
use mongodb::options::{ClientOptions, ServerAddress};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Holds the next `remaining` client messages that contain `needle`, for `delay_ms`.
struct Hold {
    remaining: AtomicUsize,
    delay_ms: AtomicU64,
    needle: Vec<u8>,
}

/// A proxy to `upstream` on 127.0.0.1; returns its port.
async fn proxy(upstream: String, hold: Arc<Hold>) -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let (upstream, hold) = (upstream.clone(), hold.clone());
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    return;
                };
                let (mut c_read, mut c_write) = client.into_split();
                let (mut s_read, mut s_write) = server.into_split();
                let back = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut s_read, &mut c_write).await;
                    s_read
                });
                let mut buf = vec![0_u8; 1 << 16];
                loop {
                    let n = match c_read.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    let chunk = buf[..n].to_vec();
                    let matches = chunk.windows(hold.needle.len()).any(|w| w == hold.needle);
                    if matches
                        && hold
                            .remaining
                            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| r.checked_sub(1))
                            .is_ok()
                    {
                        // Reset the client's side now; deliver the command later.
                        back.abort();
                        drop(c_read);
                        let delay = Duration::from_millis(hold.delay_ms.load(Ordering::SeqCst));
                        tokio::spawn(async move {
                            tokio::time::sleep(delay).await;
                            let _ = s_write.write_all(&chunk).await;
                            // Keep the connection until the server has answered.
                            tokio::time::sleep(Duration::from_secs(2)).await;
                            drop(s_write);
                        });
                        return;
                    }
                    if s_write.write_all(&chunk).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok(port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_attempt_landing_late_leaves_no_entry_behind() -> anyhow::Result<()> {
    let t = TestDb::new("s19_late_read").await?;
    let direct = ClientOptions::parse(t.uri()).await?;
    let upstream = direct.hosts.first().context("a host")?.to_string();
    // The command `update` on collection `rw`: `update: "rw"` as the first BSON element.
    let mut needle = vec![0x02];
    needle.extend_from_slice(b"update\0");
    needle.extend_from_slice(&3_i32.to_le_bytes());
    needle.extend_from_slice(b"rw\0");
    let hold = Arc::new(Hold {
        remaining: AtomicUsize::new(0),
        delay_ms: AtomicU64::new(0),
        needle,
    });
    let port = proxy(upstream, hold.clone()).await?;
    let mut proxied = direct.clone();
    proxied.hosts = vec![ServerAddress::Tcp {
        host: "127.0.0.1".into(),
        port: Some(port),
    }];
    proxied.direct_connection = Some(true);
    let proxied = Client::with_options(proxied)?;

    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let fast = LockOptions::default().backoff(Duration::from_millis(5), Duration::from_millis(50));
    let writers = RwLocks::new(
        LockCollection::open(&t.db, "rw", time.clone(), fast.clone()).await?,
        RwLockOptions::default(),
    )?;
    let proxied_time = TimeSource::server(proxied.clone(), ClockOptions::default())?;
    let readers = RwLocks::new(
        LockCollection::new(
            proxied.database(t.db.name()).collection("rw"),
            proxied_time,
            fast,
        )?,
        RwLockOptions::default(),
    )?;
    // The document exists (the held command is then an update of it, not an insert).
    let first = readers
        .try_read(&Owner::random(), "r", Duration::from_secs(1))
        .await?
        .context("free")?;
    readers.release_read(&first).await?;

    // Held 1.5 s: the attempts land inside their landing window (2 s), after the read
    // entered (about 1 s: the driver selects the server again), and are removed after it.
    // Held 3 s: they land after it and apply nothing.
    let mut failures = Vec::new();
    for (resource, delay) in [("r", 1_500_u64), ("s", 3_000)] {
        if resource != "r" {
            let first = readers
                .try_read(&Owner::random(), resource, Duration::from_secs(1))
                .await?
                .context("free")?;
            readers.release_read(&first).await?;
        }
        hold.delay_ms.store(delay, Ordering::SeqCst);
        hold.remaining.store(2, Ordering::SeqCst);
        let started = std::time::Instant::now();
        let lease = readers
            .read(
                &Owner::random(),
                resource,
                Duration::from_secs(10),
                Duration::from_secs(5),
            )
            .await?
            .context("the reader enters with a later attempt")?;
        let held = 2 - hold.remaining.load(Ordering::SeqCst);
        let entered = started.elapsed();
        readers.release_read(&lease).await?;
        // The held attempts land (and the landing window passes).
        tokio::time::sleep(Duration::from_millis(delay.max(2_000) + 1_000)).await;
        let d =
            t.db.collection::<Document>("rw")
                .find_one(doc! { "_id": resource })
                .await?
                .context("lock document")?;
        let now = DateTime::now();
        let strays = d
            .get_array("readers")
            .map(|rs| {
                rs.iter()
                    .filter_map(|r| r.as_document())
                    .filter(|r| r.get_datetime("expires_at").is_ok_and(|e| *e > now))
                    .count()
            })
            .unwrap_or(0);
        let writer = writers
            .write(
                &Owner::random(),
                resource,
                Duration::from_secs(5),
                Duration::from_secs(1),
            )
            .await?;
        println!(
            "held {delay} ms: commands held {held}, read entered after {entered:?}; live reader \
             entries after the release: {strays}; writer within 1 s: {}",
            writer.is_some()
        );
        if let Some(w) = &writer {
            writers.release_write(w).await?;
        }
        if held != 2 || strays != 0 || writer.is_none() {
            failures.push(format!(
                "{delay} ms: held {held}, strays {strays}, writer {}",
                writer.is_some()
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
    Ok(())
}
