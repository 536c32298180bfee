//! Session 24: `LockCollection::release` is idempotent. A release whose write applied but
//! whose reply was lost (MongoDB's `failCommand` with a retryable write concern error on
//! the write and on the driver's retry), sent again by its caller, answered `LeaseLost`
//! although the lease had been released and nobody else held the resource; so did a retry
//! the server ran twice (the embedded server re-executes a retried write). Now a release
//! that changes nothing reads the document once: free, with this lease's token and no
//! acquisition pending, is `Ok(())`; taken over or deleted is still `LeaseLost`.
//!
//! Counts the answers that are wrong; fails without the read-back (the release sent again
//! after the lost reply, and the plain second release: 2 violations). Fail points are
//! server-wide, so this file is its own test binary with one test.

use std::time::Duration;

use anyhow::Context;
use docwarden::Error;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{LockCollection, LockOptions, Owner};
use docwarden_testkit::{TestDb, fail_commands_off};
use mongodb::bson::{Document, doc};

#[tokio::test]
async fn a_release_sent_again_is_answered_by_what_the_document_shows() -> anyhow::Result<()> {
    let test = "a_release_sent_again_is_answered_by_what_the_document_shows";
    let t = TestDb::new(test).await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let locks = LockCollection::open(&t.db, "locks", time.clone(), LockOptions::default()).await?;
    let ttl = Duration::from_secs(60);
    let owner = Owner::random();
    let mut violations = Vec::new();
    let lost = |r: &docwarden::Result<()>| matches!(r, Err(Error::LeaseLost { .. }));

    // A release sent twice: the second is answered Ok (nothing else happened).
    let lease = locks
        .try_acquire(&owner, "twice", ttl)
        .await?
        .context("free")?;
    locks.release(&lease).await?;
    let again = locks.release(&lease).await;
    if again.is_err() {
        violations.push(format!("second release of a released lease: {again:?}"));
    }
    // Acquired by someone else since: LeaseLost, and their lease untouched.
    let theirs = locks
        .try_acquire(&Owner::random(), "twice", ttl)
        .await?
        .context("free after the release")?;
    let stale = locks.release(&lease).await;
    if !lost(&stale) {
        violations.push(format!(
            "release of a lease taken over since: {stale:?} (LeaseLost expected)"
        ));
    }
    locks.release(&theirs).await?;
    // Deleted: LeaseLost.
    let gone = locks
        .try_acquire(&owner, "deleted", ttl)
        .await?
        .context("free")?;
    t.db.collection::<Document>("locks")
        .delete_one(doc! { "_id": "deleted" })
        .await?;
    let r = locks.release(&gone).await;
    if !lost(&r) {
        violations.push(format!(
            "release of a deleted lock: {r:?} (LeaseLost expected)"
        ));
    }

    // A release whose reply is lost, sent again by its caller.
    if let Some(client) = docwarden_testkit::fail_point_client(&t, test).await? {
        let db = client.database(t.db.name());
        let lossy =
            LockCollection::open(&db, "locks", time.clone(), LockOptions::default()).await?;
        let lease = lossy
            .try_acquire(&owner, "lost", ttl)
            .await?
            .context("free")?;
        client
            .database("admin")
            .run_command(doc! {
                "configureFailPoint": "failCommand",
                "mode": { "times": 2 },
                "data": {
                    "failCommands": ["update"],
                    "writeConcernError": { "code": 91, "errmsg": "injected: reply lost" },
                },
            })
            .await?;
        let first = lossy.release(&lease).await;
        fail_commands_off(&client).await?;
        match first {
            Err(e) if e.is_retryable() => {
                let again = lossy.release(&lease).await;
                if again.is_err() {
                    violations.push(format!(
                        "release sent again after a lost reply: {again:?} (the lock is free)"
                    ));
                }
            }
            other => violations.push(format!("release with a lost reply answered {other:?}")),
        }
        let stored =
            t.db.collection::<Document>("locks")
                .find_one(doc! { "_id": "lost" })
                .await?
                .context("lock document")?;
        if !matches!(stored.get("owner"), Some(mongodb::bson::Bson::Null)) {
            violations.push(format!("the lock is not free after the release: {stored}"));
        }
    }

    assert!(
        violations.is_empty(),
        "{} violations: {violations:#?}",
        violations.len()
    );
    Ok(())
}
