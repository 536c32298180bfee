//! Errors MongoDB's retryable reads and writes specifications call transient are classed as
//! retryable by [`docwarden::Error::is_retryable`], whatever labels the server attached
//! (finding 13 of the lease-safety review). The faults come from MongoDB's `failCommand`
//! fail point, the tool the official drivers' test suites use; this file is its own test
//! binary, so the fail points (which are server-wide) touch no other test.

use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{LockCollection, LockOptions, Owner};
use docwarden::queue::{EnqueueOptions, JobQueue, QueueOptions};
use docwarden_testkit::{TestDb, fail_commands_off};
use mongodb::bson::{Document, doc};

/// Makes the next `times` runs of `command` fail with `code` (and no error labels).
async fn fail_next(
    client: &mongodb::Client,
    command: &str,
    code: i32,
    times: i32,
) -> mongodb::error::Result<Document> {
    docwarden_testkit::fail_commands(client, &[command], code, doc! { "times": times }.into()).await
}

#[tokio::test]
async fn not_primary_and_shutdown_errors_are_retryable_on_every_write_path() -> anyhow::Result<()> {
    let test = "not_primary_and_shutdown_errors_are_retryable_on_every_write_path";
    let t = TestDb::new(test).await?;
    let Some(client) = docwarden_testkit::fail_point_client(&t, test).await? else {
        return Ok(());
    };
    let db = client.database(t.db.name());
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let locks = LockCollection::open(&db, "locks", time.clone(), LockOptions::default()).await?;
    let queue = JobQueue::open(&db, "jobs", time, QueueOptions::default()).await?;
    let owner = Owner::random();
    let mut not_retryable = Vec::new();
    // 10107 NotWritablePrimary, 91 ShutdownInProgress, 11602 InterruptedDueToReplStateChange,
    // 189 PrimarySteppedDown: each fails twice, so the driver's own single retry fails too.
    for code in [10107, 91, 11602, 189] {
        fail_next(&client, "findAndModify", code, 2).await?;
        match locks
            .try_acquire(&owner, &format!("r{code}"), Duration::from_secs(5))
            .await
        {
            Err(e) if e.is_retryable() => {}
            other => not_retryable.push(format!("try_acquire with {code}: {other:?}")),
        }
        fail_commands_off(&client).await?;
        let mut lease = loop {
            // The caller's retry succeeds once the fault is gone.
            if let Some(l) = locks
                .try_acquire(&owner, &format!("r{code}"), Duration::from_secs(5))
                .await?
            {
                break l;
            }
        };
        fail_next(&client, "update", code, 2).await?;
        match locks.renew(&mut lease, Duration::from_secs(5)).await {
            Err(e) if e.is_retryable() => {}
            other => not_retryable.push(format!("renew with {code}: {other:?}")),
        }
        fail_commands_off(&client).await?;
        fail_next(&client, "insert", code, 2).await?;
        match queue
            .enqueue(doc! { "code": code }, &EnqueueOptions::default())
            .await
        {
            Err(e) if e.is_retryable() => {}
            other => not_retryable.push(format!("enqueue with {code}: {other:?}")),
        }
        fail_commands_off(&client).await?;
        // A multi-document update is not a retryable write: the server attaches no
        // RetryableWriteError label, so only the code tells.
        fail_next(&client, "update", code, 2).await?;
        match locks.release_all(&owner).await {
            Err(e) if e.is_retryable() => {}
            other => not_retryable.push(format!("release_all with {code}: {other:?}")),
        }
        fail_commands_off(&client).await?;
        // Reads carry no write label either.
        fail_next(&client, "find", code, 2).await?;
        match queue.get(mongodb::bson::oid::ObjectId::new()).await {
            Err(e) if e.is_retryable() => {}
            other => not_retryable.push(format!("get with {code}: {other:?}")),
        }
        fail_commands_off(&client).await?;
    }
    assert!(
        not_retryable.is_empty(),
        "{} calls failed with a non-retryable error or did not fail:\n{}",
        not_retryable.len(),
        not_retryable.join("\n")
    );
    Ok(())
}

#[tokio::test]
async fn a_duplicate_key_or_a_validation_failure_is_not_retryable() -> anyhow::Result<()> {
    let t = TestDb::new("duplicate_key_is_not_retryable").await?;
    let c = t.db.collection::<Document>("c");
    c.insert_one(doc! { "_id": 1 }).await?;
    let err: docwarden::Error = c
        .insert_one(doc! { "_id": 1 })
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("duplicate"))?
        .into();
    assert!(err.is_duplicate_key());
    assert!(!err.is_retryable());
    Ok(())
}
