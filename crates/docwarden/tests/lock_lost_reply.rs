//! An acquire whose write applied but whose reply was lost (`lock/deadline.rs`): the
//! blocking acquire tries again within its wait, and must recognise the acquisition the
//! lost reply made instead of waiting behind it, as "someone else", until its ttl.
//!
//! The lost reply is MongoDB's `failCommand` fail point with a `writeConcernError`: the
//! command runs, then the reply carries a retryable write concern error (91,
//! ShutdownInProgress), and the driver's own retry gets one too — what a failover between
//! the write and its acknowledgement looks like to the client. Fail points are server-wide,
//! so this file is its own test binary with one test that runs its cases in turn. They are
//! turned off through the test's own client: each injected error clears the pool of the
//! client that met it, and a blocking acquire still retrying on that client cleared it
//! again before each try of the command turning the fail point off (session 34: CI failed
//! with five tries in a row meeting a cleared pool).

use std::time::Duration;

use anyhow::Context;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{
    DocumentLockOptions, DocumentLocks, LockCollection, LockOptions, Owner, RwLockOptions, RwLocks,
    Semaphore, SemaphoreOptions,
};
use docwarden_testkit::{TestDb, fail_commands_off, lose_replies};
use mongodb::bson::{Bson, Document, doc};

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
        lose_replies(
            &client,
            &["findAndModify"],
            Bson::Document(doc! { "times": 2 }),
        )
        .await?;
        let got = locks.acquire(&owner, resource, ttl, wait).await;
        fail_commands_off(&t.client).await?;
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

    // A document lock: the lost reply's lock id is this call's own (never handed out),
    // so the next attempt takes it over instead of waiting until `max_duration`.
    let docs = DocumentLocks::open(
        &db,
        "entities",
        time.clone(),
        DocumentLockOptions::default()
            .max_duration(ttl)
            .backoff(Duration::from_millis(5), Duration::from_millis(50)),
    )
    .await?;
    let entities = db.collection::<Document>("entities");
    entities.insert_one(doc! { "_id": "e1", "n": 1 }).await?;
    lose_replies(
        &client,
        &["findAndModify"],
        Bson::Document(doc! { "times": 2 }),
    )
    .await?;
    let got = docs.lock("e1", wait).await;
    fail_commands_off(&t.client).await?;
    let stored = entities
        .find_one(doc! { "_id": "e1" })
        .await?
        .context("entity")?;
    let stored_lock = stored.get_str("lock_id").ok().map(str::to_owned);
    match got {
        Ok(Some(guard)) if stored_lock.as_deref() == Some(guard.lock_id.as_str()) => {
            let released = docs.release(guard).await?;
            anyhow::ensure!(released.is_applied(), "document lock: release {released:?}");
        }
        other => violations.push(format!(
            "document lock: lock said {other:?}, the document is locked by this call's lost attempt until max_duration: {stored}"
        )),
    }

    // The semaphore (one permit): the lost reply's holder entry counts.
    let sem_owner = Owner::random();
    let seed = semaphore
        .try_acquire(&sem_owner, "s", ttl)
        .await?
        .context("seed")?;
    semaphore.release(&seed).await?;
    lose_replies(
        &client,
        &["findAndModify"],
        Bson::Document(doc! { "times": 2 }),
    )
    .await?;
    let got = semaphore.acquire(&sem_owner, "s", ttl, wait).await;
    fail_commands_off(&t.client).await?;
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
    // replies: its copy of the lease lapses and `write` gives up (`Ok(None)`, or the last
    // attempt's transient error). The intent the renewals extended must not stay behind,
    // keeping readers out for a ttl.
    let rw = RwLocks::new(
        LockCollection::open(&db, "rw", time.clone(), fast).await?,
        RwLockOptions::default().poll_interval(Duration::from_millis(50)),
    )?;
    let reader = rw
        .try_read(&Owner::random(), "w", Duration::from_secs(3))
        .await?
        .context("reader")?;
    let writer = Owner::random();
    lose_replies(&client, &["update"], Bson::from("alwaysOn")).await?;
    let got = rw
        .write(
            &writer,
            "w",
            Duration::from_secs(1),
            Duration::from_millis(2_500),
        )
        .await;
    fail_commands_off(&t.client).await?;
    let rw_docs = db.collection::<Document>("rw");
    let mut stored = rw_docs
        .find_one(doc! { "_id": "w" })
        .await?
        .context("rw document")?;
    // What `write` left is freed in the background, not when it returns: a withdrawal
    // that failed (each injected error clears the client's pool, so the withdrawal can
    // fail before it is sent) is retried at once, and an attempt that ended without an
    // answer is cleaned up once its landing deadline (sent + 2 s) has passed (both
    // `lock/landing.rs`). Session 35: read at once, 1 run in 24 under CPU load saw the
    // intent; the withdrawal had failed and was dropped, and the intent stayed until its
    // ttl (now retried: `tests/lock_s35_release_later.rs`). Give both that long.
    if got.is_err() {
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while stored.get_str("owner").ok() == Some(writer.id()) && std::time::Instant::now() < until
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
            stored = rw_docs
                .find_one(doc! { "_id": "w" })
                .await?
                .context("rw document")?;
        }
    }
    match got {
        Ok(None) if stored.get_str("owner").ok() == Some(writer.id()) => violations.push(format!(
            "rwlock: write gave up with Ok(None) and left its intent in place: {stored}"
        )),
        Ok(None) => {}
        // Since session 18 a writer whose intent lapses registers it again for the rest of
        // its wait; those attempts lose their replies too, so the wait ends with the last
        // attempt's transient error (as every blocking acquire's does, `lock/deadline.rs`).
        // What matters is the same: no intent of ours left behind.
        Err(e) if e.is_retryable() && stored.get_str("owner").ok() != Some(writer.id()) => {}
        other => violations.push(format!("rwlock: write said {other:?}: {stored}")),
    }
    rw.release_read(&reader).await.ok();

    // A blocking read whose attempts enter but lose their replies, while a writer's
    // intent arrives behind the lost entry (issue 17, hole 2): the read must take that
    // entry back as its own instead of waiting behind the writer, which itself waits for
    // the lost entry until its ttl; and the writer must then wait only for the reader's
    // real lease.
    let owner = Owner::random();
    let seed = rw
        .try_write(&owner, "lost-read", ttl)
        .await?
        .context("seed")?;
    rw.release_write(&seed).await?;
    // Read with the test's own client: the fail-point client's pool is cleared by every
    // injected state-change error, failing whatever else it has in flight.
    let rw_docs = t.db.collection::<Document>("rw");
    lose_replies(&client, &["update"], Bson::from("alwaysOn")).await?;
    let read_ttl = Duration::from_secs(10);
    let reading = {
        let (rw, owner) = (rw.clone(), owner.clone());
        tokio::spawn(async move {
            let got = rw
                .read(&owner, "lost-read", read_ttl, Duration::from_secs(6))
                .await;
            (got, std::time::Instant::now())
        })
    };
    let until = std::time::Instant::now() + Duration::from_secs(10);
    let entered = doc! { "_id": "lost-read", "readers.owner": owner.id() };
    while rw_docs.find_one(entered.clone()).await?.is_none() {
        anyhow::ensure!(std::time::Instant::now() < until, "the read never entered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let writer = Owner::random();
    let writing = {
        let (rw, writer) = (rw.clone(), writer.clone());
        tokio::spawn(async move {
            rw.write(&writer, "lost-read", read_ttl, Duration::from_secs(10))
                .await
        })
    };
    let intent = doc! { "_id": "lost-read", "owner": writer.id() };
    while rw_docs.find_one(intent.clone()).await?.is_none() {
        anyhow::ensure!(
            std::time::Instant::now() < until,
            "the writer never registered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let the read try (and lose its reply) under the writer's intent too.
    tokio::time::sleep(Duration::from_secs(1)).await;
    fail_commands_off(&t.client).await?;
    let off = std::time::Instant::now();
    let (got, at) = reading.await?;
    let stored = rw_docs
        .find_one(doc! { "_id": "lost-read" })
        .await?
        .context("rw document")?;
    match got {
        Ok(Some(lease)) if at.duration_since(off) < Duration::from_secs(3) => {
            let entries = stored
                .get_array("readers")
                .map(|rs| {
                    rs.iter()
                        .filter_map(|r| r.as_document())
                        .filter(|r| r.get_str("owner").ok() == Some(owner.id()))
                        .count()
                })
                .unwrap_or(0);
            if entries != 1 {
                violations.push(format!(
                    "rwlock read: {entries} entries of the reader, not 1: {stored}"
                ));
            }
            rw.release_read(&lease).await?;
            let released = std::time::Instant::now();
            match writing.await? {
                Ok(Some(w)) if released.elapsed() < Duration::from_secs(3) => {
                    rw.release_write(&w).await?;
                }
                other => violations.push(format!(
                    "rwlock read: the writer behind the reader got {other:?} {:?} after its release",
                    released.elapsed()
                )),
            }
        }
        other => {
            writing.abort();
            violations.push(format!(
                "rwlock read: read said {other:?} {:?} after the outage (ttl {read_ttl:?}): {stored}",
                at.duration_since(off)
            ));
        }
    }

    assert!(
        violations.is_empty(),
        "{} acquires misreported a lost reply:\n{}",
        violations.len(),
        violations.join("\n")
    );
    Ok(())
}
