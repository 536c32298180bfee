//! Session 33: the clean-up of an unanswered lock attempt tries again after a transient
//! failure (`lock/landing.rs`).
//!
//! `docwarden verify all --faults all` logged "cannot clean up an unanswered attempt; it
//! expires with its ttl" at its stepdowns: an acquire's reply was lost, and the one write
//! that frees what it took met the server stepping down (`NotWritablePrimary`). The clean-up
//! gave up at once, so every other contender waited out the acquisition's ttl instead of
//! the 2 s landing window. Now a retryable failure is tried again with backoff, for up to
//! a minute.
//!
//! Here an acquire's reply is lost (MongoDB's `failCommand` fail point, as in
//! `tests/lock_s24_unanswered_attempt.rs`), then the clean-up's `update` is refused four
//! times with `NotWritablePrimary` (matched by the lossy client's application name, so
//! the contender is not affected). Another owner must get the lock within [`BOUND`], far
//! below the 60 s ttl. Without the retry (the clean-up as before session 33) it waits out
//! the ttl: 1 violation. Fail points are server-wide, so this file is its own test binary
//! with one test.

use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{LockCollection, LockOptions, Owner};
use docwarden_testkit::{fail_commands_off, lose_replies};
use mongodb::bson::{Bson, doc};

/// The application name of the client whose acquire goes unanswered.
const APP: &str = "cleanup-retry";

/// How soon another owner must get the lock: the 2 s landing window, the clock's bound,
/// a few refused clean-up tries and a wake-up, with room for a slow machine.
const BOUND: Duration = Duration::from_secs(10);

/// `NotWritablePrimary`: what a primary stepping down answers a write.
const NOT_WRITABLE_PRIMARY: i32 = 10107;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_up_refused_by_a_stepping_down_primary_tries_again() -> anyhow::Result<()> {
    let test = "a_clean_up_refused_by_a_stepping_down_primary_tries_again";
    let Some((t, admin, lossy_client)) = docwarden_testkit::app_faults(test, APP).await? else {
        return Ok(());
    };

    let fast = LockOptions::default().backoff(Duration::from_millis(5), Duration::from_millis(100));
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let locks = LockCollection::open(&t.db, "locks", time, fast.clone()).await?;
    let lossy_time = TimeSource::server(lossy_client.clone(), ClockOptions::default())?;
    let lossy = LockCollection::open(
        &lossy_client.database(t.db.name()),
        "locks",
        lossy_time,
        fast,
    )
    .await?;
    let ttl = Duration::from_secs(60);
    let mut violations = Vec::new();

    // A first acquire and release, so that the resource has its token block and the lost
    // acquire is one `findAndModify`.
    let first = locks.try_acquire(&Owner::random(), "r", ttl).await?;
    let first = first.ok_or_else(|| anyhow::anyhow!("the first acquire found the lock held"))?;
    locks.release(&first).await?;

    // The acquire applies and its reply is lost (its try and the driver's retry).
    lose_replies(
        &admin,
        &["findAndModify"],
        Bson::Document(doc! { "times": 2 }),
    )
    .await?;
    let started = Instant::now();
    let answered = lossy.try_acquire(&Owner::random(), "r", ttl).await;
    // The clean-up, armed by the unanswered attempt, writes once the 2 s landing window
    // has passed: its first four `update`s are refused as by a primary stepping down.
    docwarden_testkit::fail_commands_of(
        &admin,
        APP,
        &["update"],
        NOT_WRITABLE_PRIMARY,
        Bson::Document(doc! { "times": 4 }),
    )
    .await?;
    match &answered {
        Err(e) if e.is_retryable() => {
            let got = locks
                .acquire(&Owner::random(), "r", ttl, BOUND + Duration::from_secs(4))
                .await?;
            let waited = started.elapsed();
            match got {
                Some(lease) => {
                    locks.release(&lease).await?;
                    if waited > BOUND {
                        violations.push(format!(
                            "the other owner got the lock only after {waited:?}"
                        ));
                    }
                }
                None => violations.push(format!(
                    "the other owner did not get the lock within {waited:?}: the clean-up gave up"
                )),
            }
        }
        other => violations.push(format!("the lost acquire answered {other:?}")),
    }
    fail_commands_off(&admin).await?;
    assert!(
        violations.is_empty(),
        "{} violations: {violations:#?}",
        violations.len()
    );
    Ok(())
}
