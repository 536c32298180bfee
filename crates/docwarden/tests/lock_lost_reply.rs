//! An acquire whose write applied but whose reply was lost (`lock/deadline.rs`): the
//! blocking acquire tries again within its wait, and must recognise the acquisition the
//! lost reply made instead of waiting behind it, as "someone else", until its ttl.
//!
//! The lost reply is MongoDB's `failCommand` fail point with a `writeConcernError`: the
//! command runs, then the reply carries a retryable write concern error (91,
//! ShutdownInProgress), and the driver's own retry gets one too — what a failover between
//! the write and its acknowledgement looks like to the client. Fail points are server-wide,
//! so this file is its own test binary with one test that runs its cases in turn.

use std::time::Duration;

use anyhow::Context;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{
    LockCollection, LockOptions, Owner, RwLockOptions, RwLocks, Semaphore, SemaphoreOptions,
};
use docwarden_testkit::{TestDb, fail_commands_off};
use mongodb::bson::{Document, doc};

/// The next `times` runs of `command` apply, then answer with a retryable write concern
/// error.
async fn lose_replies(client: &mongodb::Client, command: &str, times: i32) -> anyhow::Result<()> {
    client
        .database("admin")
        .run_command(doc! {
            "configureFailPoint": "failCommand",
            "mode": { "times": times },
            "data": {
                "failCommands": [command],
                "writeConcernError": { "code": 91, "errmsg": "injected: reply lost" },
            },
        })
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_blocking_acquire_recognises_the_acquisition_a_lost_reply_made() -> anyhow::Result<()> {
    let test = "a_blocking_acquire_recognises_the_acquisition_a_lost_reply_made";
    let t = TestDb::new(test).await?;
    let Some(client) = docwarden_testkit::fail_point_client(&t, test).await? else {
        return Ok(());
    };
    let db = client.database(t.db.name());
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let fast = LockOptions::default().backoff(Duration::from_millis(5), Duration::from_millis(50));
    let locks = LockCollection::open(&db, "locks", time.clone(), fast.clone()).await?;
    let semaphore = Semaphore::open(
        &db,
        "permits",
        time.clone(),
        SemaphoreOptions::default().backoff(Duration::from_millis(5), Duration::from_millis(50)),
    )
    .await?;
    let ttl = Duration::from_secs(60);
    let wait = Duration::from_secs(3);
    let mut violations = Vec::new();

    // The lock collection: fast path (a block exists) and slow path (a new resource).
    let owner = Owner::random();
    let first = locks
        .try_acquire(&owner, "fast", ttl)
        .await?
        .context("seed")?;
    locks.release(&first).await?;
    for resource in ["fast", "slow"] {
        lose_replies(&client, "findAndModify", 2).await?;
        let got = locks.acquire(&owner, resource, ttl, wait).await;
        fail_commands_off(&client).await?;
        let stored = db
            .collection::<Document>("locks")
            .find_one(doc! { "_id": resource })
            .await?
            .context("lock document")?;
        let held_by_us = stored.get_str("owner").ok() == Some(owner.id());
        match got {
            Ok(Some(lease)) => {
                if stored.get_i64("token").ok() != Some(lease.token.get()) {
                    violations.push(format!("{resource}: lease {lease:?}, stored {stored}"));
                }
                locks.release(&lease).await?;
            }
            other if held_by_us => violations.push(format!(
                "{resource}: acquire said {other:?}, the lock is held by this owner until its ttl: {stored}"
            )),
            other => violations.push(format!("{resource}: {other:?}, stored {stored}")),
        }
    }

    // The semaphore (one permit): the lost reply's holder entry counts.
    let sem_owner = Owner::random();
    let seed = semaphore
        .try_acquire(&sem_owner, "s", ttl)
        .await?
        .context("seed")?;
    semaphore.release(&seed).await?;
    lose_replies(&client, "findAndModify", 2).await?;
    let got = semaphore.acquire(&sem_owner, "s", ttl, wait).await;
    fail_commands_off(&client).await?;
    let status = semaphore.status("s").await?.context("semaphore document")?;
    let ours = status
        .holders
        .iter()
        .filter(|h| h.owner == sem_owner.id())
        .count();
    match got {
        Ok(Some(permit)) if ours == 1 => semaphore.release(&permit).await?,
        other => violations.push(format!(
            "semaphore: acquire said {other:?}, {ours} holder entries of this owner: {status:?}"
        )),
    }

    // A writer waiting for a reader, whose renewals of its intent all apply but lose their
    // replies: its copy of the lease lapses and `write` gives up with `Ok(None)`. The
    // intent the renewals extended must not stay behind, keeping readers out for a ttl.
    let rw = RwLocks::new(
        LockCollection::open(&db, "rw", time.clone(), fast).await?,
        RwLockOptions::default().poll_interval(Duration::from_millis(50)),
    )?;
    let reader = rw
        .try_read(&Owner::random(), "w", Duration::from_secs(3))
        .await?
        .context("reader")?;
    let writer = Owner::random();
    client
        .database("admin")
        .run_command(doc! {
            "configureFailPoint": "failCommand",
            "mode": "alwaysOn",
            "data": {
                "failCommands": ["update"],
                "writeConcernError": { "code": 91, "errmsg": "injected: reply lost" },
            },
        })
        .await?;
    let got = rw
        .write(
            &writer,
            "w",
            Duration::from_secs(1),
            Duration::from_millis(2_500),
        )
        .await;
    fail_commands_off(&client).await?;
    let stored = db
        .collection::<Document>("rw")
        .find_one(doc! { "_id": "w" })
        .await?
        .context("rw document")?;
    match got {
        Ok(None) if stored.get_str("owner").ok() == Some(writer.id()) => violations.push(format!(
            "rwlock: write gave up with Ok(None) and left its intent in place: {stored}"
        )),
        Ok(None) => {}
        other => violations.push(format!("rwlock: write said {other:?}: {stored}")),
    }
    rw.release_read(&reader).await.ok();

    assert!(
        violations.is_empty(),
        "{} acquires misreported a lost reply:\n{}",
        violations.len(),
        violations.join("\n")
    );
    Ok(())
}
