//! Session 24: a lock collection's acquire attempt that ends without an answer — its reply
//! lost, or its future dropped by a timeout around the call — must not leave the lock held
//! by an acquisition nobody was told about until its ttl (`lock/landing.rs`). Before, every
//! other contender waited out the ttl (here 60 s); now the attempt's write takes the lock
//! only before its landing deadline (sent + 2 s), and what an unanswered attempt took is
//! freed once that deadline has passed.
//!
//! Three cases:
//! 1. `try_acquire` whose write applies and whose reply is lost (a retryable write concern
//!    error on the write and on the driver's retry, MongoDB's `failCommand`): the caller
//!    gets an error; another owner must get the lock within [`BOUND`]; the same for a
//!    document lock's `try_lock` (its `max_duration` 60 s), its `lock_or_create` (of a
//!    new document and of an existing one; session 25) and a read lock's `try_read` (a
//!    writer must get in);
//! 2. `try_acquire` of a new resource (the slow path) whose future is dropped between its
//!    first write (the lock taken, `pending` stored) and its token commit: another owner
//!    must get the lock within [`BOUND`];
//! 3. the acquire's write (`LockCollection::acquire_update`) sent after its landing
//!    deadline takes nothing, and before it takes the free lock.
//!
//! Each counts violations. Without the clean-up, cases 1 and 2 wait out the ttl (4
//! violations with the document lock's and the read lock's; `lock_or_create` before
//! session 25, one upsert without deadline or clean-up: 1, the existing document's; with
//! its insert's clean-up left out: 1, the new one's); without the landing deadline in the write, case 3
//! takes the lock (1; the document lock's takeover has the same check as a unit test,
//! `a_takeover_after_its_landing_deadline_takes_nothing`).
//! Fail points are server-wide, so this file is its own test binary with one test.

use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{
    AcquirePause, DocumentLockOptions, DocumentLocks, LockCollection, LockOptions, Owner,
    RwLockOptions, RwLocks,
};
use docwarden_testkit::{TestDb, fail_commands_off, lose_replies};
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::options::ReturnDocument;

/// How soon another owner must get the lock after the unanswered attempt: the 2 s landing
/// window, the clock's bound and a wake-up, with room for a slow machine; far below the
/// 60 s ttl the acquisition would otherwise hold it for.
const BOUND: Duration = Duration::from_secs(8);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_acquire_attempt_frees_the_lock_soon_after_its_landing_deadline()
-> anyhow::Result<()> {
    let test = "an_unanswered_acquire_attempt_frees_the_lock_soon_after_its_landing_deadline";
    let t = TestDb::new(test).await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let fast = LockOptions::default().backoff(Duration::from_millis(5), Duration::from_millis(100));
    let locks = LockCollection::open(&t.db, "locks", time.clone(), fast.clone()).await?;
    let ttl = Duration::from_secs(60);
    let mut violations = Vec::new();

    // Another owner's blocking acquire of `resource`, started at `since`: a violation
    // unless it gets the lock within BOUND.
    let contend = |case: &'static str, resource: &'static str, since: Instant| {
        let locks = locks.clone();
        let coll = t.db.collection::<Document>("locks");
        async move {
            let other = Owner::random();
            let got = locks
                .acquire(&other, resource, ttl, BOUND + Duration::from_secs(4))
                .await?;
            let waited = since.elapsed();
            let stored = coll.find_one(doc! { "_id": resource }).await?;
            let verdict = match got {
                Some(lease) => {
                    locks.release(&lease).await?;
                    (waited > BOUND).then(|| {
                        format!("{case}: the other owner got the lock only after {waited:?}")
                    })
                }
                None => Some(format!(
                    "{case}: the other owner did not get the lock within {waited:?}: {stored:?}"
                )),
            };
            anyhow::Ok(verdict)
        }
    };

    // 1. A lost reply (needs the fail point).
    if let Some(client) = docwarden_testkit::fail_point_client(&t, test).await? {
        let db = client.database(t.db.name());
        let lossy = LockCollection::open(&db, "locks", time.clone(), fast.clone()).await?;
        lose_replies(
            &client,
            &["findAndModify"],
            Bson::Document(doc! { "times": 2 }),
        )
        .await?;
        let started = Instant::now();
        let answered = lossy.try_acquire(&Owner::random(), "lost", ttl).await;
        fail_commands_off(&client).await?;
        match &answered {
            Err(e) if e.is_retryable() => {
                violations.extend(contend("lost reply", "lost", started).await?);
            }
            other => violations.push(format!("lost reply: the attempt answered {other:?}")),
        }

        // 1b. The same for a document lock: `DocumentLocks::try_lock` of `e1`, and (session
        // 25) `lock_or_create` of `e2`, which does not exist yet (the lost write is the
        // insert that creates it locked), and of `e3`, which exists, free. Without the
        // clean-up the entity stays locked until `max_duration`.
        let doc_options = DocumentLockOptions::default()
            .max_duration(ttl)
            .backoff(Duration::from_millis(5), Duration::from_millis(100));
        let lossy_docs =
            DocumentLocks::open(&db, "entities", time.clone(), doc_options.clone()).await?;
        let docs = DocumentLocks::open(&t.db, "entities", time.clone(), doc_options).await?;
        t.db.collection::<Document>("entities")
            .insert_many([doc! { "_id": "e1", "n": 1 }, doc! { "_id": "e3", "n": 3 }])
            .await?;
        for (case, entity, write) in [
            ("document lock", "e1", "findAndModify"),
            ("lock_or_create, new document", "e2", "insert"),
            ("lock_or_create, existing document", "e3", "findAndModify"),
        ] {
            lose_replies(&client, &[write], Bson::Document(doc! { "times": 2 })).await?;
            let started = Instant::now();
            let answered = if entity == "e1" {
                lossy_docs.try_lock(entity).await
            } else {
                lossy_docs.lock_or_create(entity, doc! { "n": 0 }).await
            };
            fail_commands_off(&client).await?;
            match &answered {
                Err(e) if e.is_retryable() => {
                    match docs.lock(entity, BOUND + Duration::from_secs(4)).await? {
                        Some(guard) if started.elapsed() <= BOUND => {
                            let released = docs.release(guard).await?;
                            if !released.is_applied() {
                                violations.push(format!(
                                    "{case}, lost reply: the other locker's release {released:?}"
                                ));
                            }
                        }
                        other => violations.push(format!(
                            "{case}, lost reply: after {:?} the other locker got {:?}",
                            started.elapsed(),
                            other.map(|g| g.lock_id)
                        )),
                    }
                }
                // The creating insert answered after all (a server that recognised the
                // driver's retry): nothing is held unknowingly.
                Ok(Some(guard)) if entity == "e2" => {
                    let released = lossy_docs.release(guard.clone()).await?;
                    if !released.is_applied() {
                        violations.push(format!("{case}: its own release {released:?}"));
                    }
                }
                other => violations.push(format!(
                    "{case}, lost reply: the attempt answered {:?}",
                    other.as_ref().map(|g| g.as_ref().map(|g| &g.lock_id))
                )),
            }
        }

        // 1c. The same for a read lock (`RwLocks::try_read`): without the clean-up its
        // entry holds writers out until its ttl.
        let rw_options = RwLockOptions::default().poll_interval(Duration::from_millis(50));
        let lossy_rw = RwLocks::new(
            LockCollection::open(&db, "rw", time.clone(), fast.clone()).await?,
            rw_options.clone(),
        )?;
        let rw = RwLocks::new(
            LockCollection::open(&t.db, "rw", time.clone(), fast.clone()).await?,
            rw_options,
        )?;
        lose_replies(&client, &["update"], Bson::Document(doc! { "times": 2 })).await?;
        let started = Instant::now();
        let answered = lossy_rw.try_read(&Owner::random(), "rw1", ttl).await;
        fail_commands_off(&client).await?;
        match &answered {
            Err(e) if e.is_retryable() => {
                let writer = rw
                    .write(&Owner::random(), "rw1", ttl, BOUND + Duration::from_secs(4))
                    .await?;
                match writer {
                    Some(lease) if started.elapsed() <= BOUND => rw.release_write(&lease).await?,
                    other => violations.push(format!(
                        "read lock, lost reply: after {:?} the writer got {:?}",
                        started.elapsed(),
                        other.map(|l| l.token)
                    )),
                }
            }
            other => violations.push(format!(
                "read lock, lost reply: the attempt answered {:?}",
                other.as_ref().map(|r| r.as_ref().map(|l| &l.id))
            )),
        }
    }

    // 2. The future dropped between the slow path's two writes.
    let pause = Arc::new(AcquirePause::default());
    let paused = locks.with_acquire_pause(pause.clone());
    let owner = Owner::random();
    let started = Instant::now();
    let task = tokio::spawn(async move { paused.try_acquire(&owner, "dropped", ttl).await });
    tokio::time::timeout(Duration::from_secs(10), pause.reached()).await?;
    task.abort();
    let _ = task.await;
    violations.extend(contend("dropped mid-acquire", "dropped", started).await?);

    // 3. The landing deadline in the write itself, on a free lock.
    let coll = t.db.collection::<Document>("locks");
    coll.insert_one(doc! { "_id": "late", "owner": null, "token": 1_i64, "ceiling": 100_i64 })
        .await?;
    let now = DateTime::now().timestamp_millis();
    for (land_by, should_take) in [(now - 1_000, false), (now + 60_000, true)] {
        let (filter, update) = LockCollection::acquire_update(
            "late",
            "late-owner",
            "late-nonce",
            DateTime::from_millis(now),
            DateTime::from_millis(land_by),
            DateTime::from_millis(now),
            DateTime::from_millis(now + 60_000),
        );
        let after = coll
            .find_one_and_update(filter, update)
            .upsert(true)
            .return_document(ReturnDocument::After)
            .await?
            .unwrap_or_default();
        let took = after.get_str("owner").ok() == Some("late-owner");
        if took != should_take {
            violations.push(format!(
                "landing deadline: a write {} its deadline {} the lock: {after}",
                if should_take { "before" } else { "after" },
                if took { "took" } else { "did not take" },
            ));
        }
    }

    assert!(
        violations.is_empty(),
        "{} violations: {violations:#?}",
        violations.len()
    );
    Ok(())
}
