//! Session 19, item 1: every entry point that takes a lease ttl refuses one not longer
//! than the time source's skew margin (250 ms by default), as `RwLocks::write` and
//! `Election::new` already did: such a lease, permit or read lease is never certainly
//! valid, so its holder could never act on it. Before, `LockCollection::try_acquire` /
//! `acquire` / `renew` / `watch`, `Watchdog::start`, `Semaphore::try_acquire` / `acquire`
//! / `renew` / `renew_many` and `RwLocks::try_read` / `read` / `renew_read` accepted it
//! and wrote it. Counts: entry points that accepted such a ttl (0), documents written by
//! the refused calls (0), stored expiries moved by a refused renewal (0).

use std::time::{Duration, Instant};

use docwarden::Error;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{
    LockCollection, LockOptions, Owner, RwLockOptions, RwLocks, Semaphore, SemaphoreOptions,
    Watchdog, WatchdogOptions,
};
use docwarden_testkit::TestDb;
use mongodb::bson::{Document, doc};

/// Exactly the default skew margin, and below it.
const WITHIN: [Duration; 2] = [Duration::from_millis(250), Duration::from_millis(100)];
const LONG: Duration = Duration::from_secs(30);
const WAIT: Duration = Duration::from_secs(2);

/// What one entry point answered: refused as it must be, or accepted.
fn refused<T>(name: &str, result: docwarden::Result<T>, accepted: &mut Vec<String>) {
    match result {
        Err(Error::InvalidInput {
            what: "ttl",
            reason,
        }) => {
            assert!(
                reason.contains("250 ms"),
                "{name}: names the margin: {reason}"
            );
        }
        Ok(_) => accepted.push(format!("{name}: accepted")),
        Err(e) => accepted.push(format!("{name}: {e}")),
    }
}

async fn count(t: &TestDb, name: &str) -> anyhow::Result<u64> {
    Ok(t.db
        .collection::<Document>(name)
        .count_documents(doc! {})
        .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_entry_point_refuses_a_ttl_within_the_skew_margin() -> anyhow::Result<()> {
    let t = TestDb::new("s19_ttl_within_margin").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    assert_eq!(time.skew_margin_ms(), 250);
    let locks = LockCollection::open(&t.db, "locks", time.clone(), LockOptions::default()).await?;
    let sem = Semaphore::open(&t.db, "sem", time.clone(), SemaphoreOptions::default()).await?;
    let rw_locks = LockCollection::open(&t.db, "rw", time.clone(), LockOptions::default()).await?;
    let rw = RwLocks::new(rw_locks, RwLockOptions::default())?;
    let me = Owner::random();
    let mut accepted = Vec::new();
    let mut slow = 0;

    for ttl in WITHIN {
        let started = Instant::now();
        refused(
            "LockCollection::try_acquire",
            locks.try_acquire(&me, "fresh", ttl).await,
            &mut accepted,
        );
        refused(
            "LockCollection::acquire",
            locks.acquire(&me, "fresh", ttl, WAIT).await,
            &mut accepted,
        );
        refused(
            "Semaphore::try_acquire",
            sem.try_acquire(&me, "fresh", ttl).await,
            &mut accepted,
        );
        refused(
            "Semaphore::acquire",
            sem.acquire(&me, "fresh", ttl, WAIT).await,
            &mut accepted,
        );
        refused(
            "RwLocks::try_read",
            rw.try_read(&me, "fresh", ttl).await,
            &mut accepted,
        );
        refused(
            "RwLocks::read",
            rw.read(&me, "fresh", ttl, WAIT).await,
            &mut accepted,
        );
        refused(
            "RwLocks::write",
            rw.write(&me, "fresh", ttl, WAIT).await,
            &mut accepted,
        );
        // Refused at once, not after a wait.
        slow += usize::from(started.elapsed() >= WAIT);
    }
    // Nothing of the refused acquisitions was written.
    let written = count(&t, "locks").await?
        + count(&t, "locks.tokens").await?
        + count(&t, "sem").await?
        + count(&t, "rw").await?
        + count(&t, "rw.tokens").await?;

    // Renewals and watchdogs of held leases: refused, the stored expiry left as it was.
    // (Another owner: without the check, the refused calls above may have taken "fresh".)
    let me = Owner::random();
    let lease = locks.try_acquire(&me, "held", LONG).await?.expect("free");
    let mut permit = sem.try_acquire(&me, "held", LONG).await?.expect("free");
    let mut read = rw.try_read(&me, "held", LONG).await?.expect("free");
    let stored = |coll: &'static str| {
        let db = t.db.clone();
        async move {
            anyhow::Ok(
                db.collection::<Document>(coll)
                    .find_one(doc! { "_id": "held" })
                    .await?,
            )
        }
    };
    let before = (
        stored("locks").await?,
        stored("sem").await?,
        stored("rw").await?,
    );
    let mut moved = 0;
    for ttl in WITHIN {
        let mut renewed = lease.clone();
        refused(
            "LockCollection::renew",
            locks.renew(&mut renewed, ttl).await,
            &mut accepted,
        );
        // A refused renewal leaves the lease in hand as it was.
        moved += usize::from(renewed != lease);
        refused(
            "LockCollection::watch",
            locks.watch(lease.clone(), ttl, WatchdogOptions::default()),
            &mut accepted,
        );
        refused(
            "Watchdog::start",
            Watchdog::start(
                locks.clone(),
                lease.clone(),
                ttl,
                WatchdogOptions::default(),
            ),
            &mut accepted,
        );
        refused(
            "Semaphore::renew",
            sem.renew(&mut permit, ttl).await,
            &mut accepted,
        );
        refused(
            "Semaphore::renew_many",
            sem.renew_many(std::slice::from_mut(&mut permit), ttl).await,
            &mut accepted,
        );
        refused(
            "RwLocks::renew_read",
            rw.renew_read(&mut read, ttl).await,
            &mut accepted,
        );
    }
    let after = (
        stored("locks").await?,
        stored("sem").await?,
        stored("rw").await?,
    );
    moved += usize::from(before.0 != after.0)
        + usize::from(before.1 != after.1)
        + usize::from(before.2 != after.2);

    println!(
        "accepted within the margin: {} {accepted:#?}; documents written by refused calls: \
         {written}; leases changed by refused renewals: {moved}; rounds that waited: \
         {slow}",
        accepted.len()
    );
    assert_eq!(slow, 0, "rounds that waited instead of refusing");
    assert!(accepted.is_empty(), "accepted: {accepted:#?}");
    assert_eq!(written, 0, "documents written by refused calls");
    assert_eq!(moved, 0, "leases changed by refused renewals");

    // Just over the margin: accepted everywhere.
    let over = Duration::from_millis(300);
    let short = locks.try_acquire(&me, "over", over).await?.expect("free");
    locks.release(&short).await?;
    let p = sem.try_acquire(&me, "over", over).await?.expect("free");
    sem.release(&p).await?;
    let r = rw.try_read(&me, "over", over).await?.expect("free");
    rw.release_read(&r).await?;
    let dog = locks.watch(lease.clone(), over, WatchdogOptions::default())?;
    dog.release().await?;
    Ok(())
}
