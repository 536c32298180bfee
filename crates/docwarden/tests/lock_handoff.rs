//! Hand-off latency of a blocking acquire (issue 16, item 4): from the instant a holder's
//! release is acknowledged to the instant the next waiter's acquire returns, over
//! `HANDOFFS` hand-offs between `WAITERS` tasks contending for one resource. With the
//! change-stream wake-up (`lock/wake.rs`) the waiter retries on the release itself; the
//! control is the same run with backoff polling only (`LockOptions::poll_only`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{LockCollection, LockOptions, Owner};
use docwarden_testkit::TestDb;
use tokio::sync::Mutex;

const WAITERS: usize = 8;
const HANDOFFS: usize = 120;
const RESOURCE: &str = "handoff";
const HOLD: Duration = Duration::from_millis(20);

/// Percentile `p` (0..=100) of sorted latencies.
fn percentile(sorted: &[Duration], p: usize) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = (sorted.len() * p).div_ceil(100).saturating_sub(1);
    sorted[i.min(sorted.len() - 1)]
}

/// Runs the hand-offs and returns the sorted latencies (release acknowledged → next
/// acquire returned, by the one monotonic clock of this process) and the number of
/// mutual-exclusion violations seen (two tasks inside at once).
async fn handoffs(t: &TestDb, options: LockOptions) -> anyhow::Result<(Vec<Duration>, usize)> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let locks = LockCollection::open(&t.db, "locks", time, options).await?;
    // (last release instant, hand-offs so far, latencies, tasks inside)
    let state = Arc::new(Mutex::new((None::<Instant>, 0_usize, Vec::new(), 0_usize)));
    let mut overlaps = 0;
    let mut tasks = Vec::new();
    let handed = Arc::new(tokio::sync::watch::Sender::new(0_usize));
    for _ in 0..WAITERS {
        let locks = locks.clone();
        let state = Arc::clone(&state);
        let handed = Arc::clone(&handed);
        tasks.push(tokio::spawn(async move {
            let owner = Owner::random();
            let mut overlaps = 0_usize;
            loop {
                let Some(lease) = locks
                    .acquire(
                        &owner,
                        RESOURCE,
                        Duration::from_secs(30),
                        Duration::from_secs(60),
                    )
                    .await?
                else {
                    anyhow::bail!("no hand-off within 60 s");
                };
                let acquired = Instant::now();
                {
                    let mut s = state.lock().await;
                    if s.3 > 0 {
                        overlaps += 1;
                    }
                    s.3 += 1;
                    if s.1 >= HANDOFFS {
                        s.3 -= 1;
                        // Wake the releasers still waiting for a hand-off.
                        handed.send_replace(usize::MAX);
                        drop(s);
                        locks.release(&lease).await?;
                        return Ok(overlaps);
                    }
                    if let Some(released) = s.0.take() {
                        s.2.push(acquired - released);
                        s.1 += 1;
                    }
                    handed.send_replace(s.1);
                }
                // Hold a while, as real work does: the others are waiting (polling waiters
                // have backed off) when it is released.
                tokio::time::sleep(HOLD).await;
                let mut s = state.lock().await;
                s.3 -= 1;
                let before = s.1;
                locks.release(&lease).await?;
                s.0 = Some(Instant::now());
                drop(s);
                // Only the waiters compete for this release: the releaser comes back once
                // another task has taken the lock (or the run is over).
                let mut counted = handed.subscribe();
                counted.wait_for(|n| *n != before).await?;
            }
        }));
    }
    for task in tasks {
        overlaps += task.await??;
    }
    let mut latencies = std::mem::take(&mut state.lock().await.2);
    latencies.sort();
    Ok((latencies, overlaps))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_acquires_within_milliseconds_of_the_release() -> anyhow::Result<()> {
    let t = TestDb::new("lock_handoff").await?;
    let (woken, overlaps) = handoffs(&t, LockOptions::default()).await?;
    assert_eq!(overlaps, 0, "two holders at once");
    assert!(woken.len() >= 100, "only {} hand-offs", woken.len());
    let (p50, p99) = (percentile(&woken, 50), percentile(&woken, 99));

    let control = TestDb::new("lock_handoff_poll").await?;
    let (polled, overlaps) = handoffs(&control, LockOptions::default().poll_only()).await?;
    assert_eq!(overlaps, 0, "two holders at once (polling)");
    let (poll50, poll99) = (percentile(&polled, 50), percentile(&polled, 99));
    println!(
        "hand-off latency over {} hand-offs, {WAITERS} waiters: change stream p50 {:.2} ms p99 {:.2} ms; backoff polling p50 {:.2} ms p99 {:.2} ms",
        woken.len(),
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
        poll50.as_secs_f64() * 1e3,
        poll99.as_secs_f64() * 1e3,
    );
    // The target is 5 ms on the embedded server; the bound leaves room for a loaded
    // machine, and the wake-up must beat polling.
    assert!(p50 <= Duration::from_millis(20), "p50 {p50:?}");
    assert!(
        p50 < poll50,
        "woken p50 {p50:?} not below polled {poll50:?}"
    );
    Ok(())
}
