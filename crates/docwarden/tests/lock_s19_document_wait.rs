//! Session 19, item 3: the blocking document lock, `DocumentLocks::lock(id, wait)` (named `lock_within` on its branch; `try_lock` is the single try)
//! (before, `lock` was try-only and every caller wrote its own retry loop). A waiter is
//! woken by the release (change stream on the document) and gets the lock at once; the
//! wait ends with `Ok(None)` while the holder keeps the lock; racing waiters never hold
//! the lock at once (counted), with a control that takes over held locks
//! (`unsafe_ignore_lock`) and does overlap.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{DocumentLockOptions, DocumentLocks};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, Document, doc};

const BACKOFF_MAX: Duration = Duration::from_millis(1_000);

async fn locks(t: &TestDb, options: DocumentLockOptions) -> anyhow::Result<DocumentLocks> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let locks = DocumentLocks::open(
        &t.db,
        "docs",
        time,
        options
            .max_duration(Duration::from_secs(30))
            .backoff(Duration::from_millis(5), BACKOFF_MAX),
    )
    .await?;
    t.db.collection::<Document>("docs")
        .insert_one(doc! { "_id": "d", "v": 0_i64, "lock_id": Bson::Null, "lock_time": Bson::Null })
        .await?;
    Ok(locks)
}

/// Hand-offs: a holder releases while a waiter waits; the delay from the release's reply
/// to the waiter's guard, `ROUNDS` times, sorted.
async fn handoffs(locks: &DocumentLocks) -> anyhow::Result<Vec<Duration>> {
    const ROUNDS: usize = 8;
    let mut delays = Vec::new();
    for _ in 0..ROUNDS {
        let held = locks.try_lock("d").await?.expect("free");
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move {
                let got = locks.lock("d", Duration::from_secs(10)).await;
                (Instant::now(), got)
            })
        };
        // Let the waiter find it held and go to sleep (its backoff grows meanwhile).
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(locks.release(held).await?.is_applied());
        let released = Instant::now();
        let (at, got) = waiter.await?;
        let guard = got?.expect("the waiter gets the released lock");
        delays.push(at.saturating_duration_since(released));
        assert!(locks.release(guard).await?.is_applied());
    }
    delays.sort();
    Ok(delays)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_gets_the_lock_right_after_the_release() -> anyhow::Result<()> {
    let t = TestDb::new("s19_doc_wait_handoff").await?;
    let woken = handoffs(&locks(&t, DocumentLockOptions::default()).await?).await?;
    let t2 = TestDb::new("s19_doc_wait_handoff_poll").await?;
    let polled = handoffs(&locks(&t2, DocumentLockOptions::default().poll_only()).await?).await?;
    let p50 = |d: &[Duration]| d[d.len() / 2];
    println!(
        "hand-off after release, backoff max {BACKOFF_MAX:?}: woken p50 {:?} max {:?}; \
         polling only p50 {:?} max {:?}",
        p50(&woken),
        woken[woken.len() - 1],
        p50(&polled),
        polled[polled.len() - 1],
    );
    // Change streams exist on the embedded server (and on any replica set): the waiter
    // is woken by the release, well under the backoff maximum.
    assert!(p50(&woken) < Duration::from_millis(100), "{woken:?}");
    assert!(woken[woken.len() - 1] < BACKOFF_MAX / 2, "{woken:?}");
    Ok(())
}

#[tokio::test]
async fn the_wait_passes_with_none_while_the_holder_keeps_it() -> anyhow::Result<()> {
    let t = TestDb::new("s19_doc_wait_none").await?;
    let locks = locks(&t, DocumentLockOptions::default()).await?;
    let held = locks.try_lock("d").await?.expect("free");
    let started = Instant::now();
    let got = locks.lock("d", Duration::from_millis(700)).await?;
    let took = started.elapsed();
    println!("held: {got:?} after {took:?}");
    assert!(got.is_none());
    assert!(took >= Duration::from_millis(700), "{took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    // A missing document: `Ok(None)` when the wait passes, as `lock` answers.
    assert!(
        locks
            .lock("missing", Duration::from_millis(200))
            .await?
            .is_none()
    );
    // A zero wait tries once.
    assert!(locks.lock("d", Duration::ZERO).await?.is_none());
    assert!(locks.release(held).await?.is_applied());
    let again = locks.lock("d", Duration::ZERO).await?.expect("free");
    assert!(locks.release(again).await?.is_applied());
    Ok(())
}

/// `WAITERS` tasks, `ROUNDS` each: wait for the lock, count who is inside, work, leave,
/// release. Returns (rounds locked, overlaps: a holder that found another inside).
async fn race(locks: DocumentLocks) -> anyhow::Result<(usize, usize)> {
    const WAITERS: usize = 8;
    const ROUNDS: usize = 10;
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..WAITERS {
        let (locks, inside, overlaps) = (locks.clone(), inside.clone(), overlaps.clone());
        tasks.push(tokio::spawn(async move {
            let mut locked = 0;
            for _ in 0..ROUNDS {
                let Some(guard) = locks.lock("d", Duration::from_secs(30)).await? else {
                    continue;
                };
                locked += 1;
                if inside.fetch_add(1, Ordering::SeqCst) > 0 {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(3)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                // `Lost` under the control, whose locks are taken over.
                let _released = locks.release(guard).await?;
            }
            anyhow::Ok(locked)
        }));
    }
    let mut locked = 0;
    for task in tasks {
        locked += task.await??;
    }
    Ok((locked, overlaps.load(Ordering::SeqCst)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_waiters_never_hold_the_lock_at_once() -> anyhow::Result<()> {
    let t = TestDb::new("s19_doc_wait_race").await?;
    let (locked, overlaps) = race(locks(&t, DocumentLockOptions::default()).await?).await?;
    let t2 = TestDb::new("s19_doc_wait_race_control").await?;
    let (c_locked, c_overlaps) =
        race(locks(&t2, DocumentLockOptions::default().unsafe_ignore_lock()).await?).await?;
    println!(
        "8 waiters x 10 rounds: {locked} locked, {overlaps} overlaps; control (held locks \
         taken over): {c_locked} locked, {c_overlaps} overlaps"
    );
    assert_eq!(locked, 80, "every waiter got the lock every round");
    assert_eq!(overlaps, 0, "holders inside at once");
    assert!(
        c_overlaps > 0,
        "the control must overlap: the test can fail"
    );
    Ok(())
}
