//! `docwarden demo locks`: seed 003 (document locks in the entity) and seed 004 (a lock
//! collection with leases), narrated, each ending in a counted check.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use docwarden::Error;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::format::document::{LOCK_ID, LOCK_TIME};
use docwarden::lock::{
    DocumentLockOptions, DocumentLocks, Fence, FenceOptions, FenceOutcome, Owner,
};
use docwarden_workloads::counters::{self, Counters, Increment};
use docwarden_workloads::{Mode, RunConfig, run_tasks};
use mongodb::Database;
use mongodb::bson::{Bson, DateTime, Document, doc};

use super::ScenarioReport;

const TASKS: usize = 4;
const ROUNDS: usize = 25;

pub(crate) async fn run(
    session: &crate::conn::Session,
    db: &Database,
) -> anyhow::Result<Vec<ScenarioReport>> {
    let time = TimeSource::server(session.client.clone(), ClockOptions::default())?;
    Ok(vec![
        document_lock(db, time.clone()).await?,
        lock_collection(db, time).await?,
    ])
}

/// Seed 003: `Dummy(Id, Value, LockId, LockTime)`, locked by an upsert, released by a
/// write fenced by the lock id.
async fn document_lock(db: &Database, time: TimeSource) -> anyhow::Result<ScenarioReport> {
    let started = Instant::now();
    let mut ops = 0_u64;
    let mut violations = 0_u64;
    crate::demo::narrate!(
        "== document-lock (seed 003): the lock lives in the document (lock_id, lock_time)"
    );
    let coll = db.collection::<Document>("dummies");
    let locks = DocumentLocks::new(
        coll.clone(),
        time,
        DocumentLockOptions::default().max_duration(Duration::from_secs(30)),
    )?;

    let guard = locks
        .lock_or_create("dummy-1", doc! { "value": "created" })
        .await?
        .context("dummy-1 is new, nobody holds it")?;
    ops += 1;
    crate::demo::narrate!(
        "   lock_or_create(dummy-1) created and locked it with a random lock id {}…",
        &guard.lock_id[..8]
    );
    match locks.try_lock("dummy-1").await {
        Ok(None) => {
            crate::demo::narrate!("   a second lock(dummy-1): already locked")
        }
        other => {
            violations += 1;
            crate::demo::narrate!("   ! a second lock(dummy-1) returned {other:?}");
        }
    }
    let released = locks
        .release_with(guard, doc! { "$set": { "value": "changed" } })
        .await?;
    anyhow::ensure!(released.is_applied(), "release_with(dummy-1): {released:?}");
    ops += 2;
    crate::demo::narrate!(
        "   release_with wrote value=changed and cleared the lock in one fenced update"
    );

    // Eight creators race on a new document.
    let mut tasks = Vec::new();
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    for i in 0..8 {
        let (locks, barrier) = (locks.clone(), Arc::clone(&barrier));
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            locks
                .lock_or_create("dummy-race", doc! { "value": i })
                .await
        }));
    }
    let (mut winners, mut already) = (0_u64, 0_u64);
    for t in tasks {
        match t.await? {
            Ok(Some(_)) => winners += 1,
            Ok(None) => already += 1,
            Err(e) => return Err(e.into()),
        }
    }
    ops += 8;
    let docs = coll.count_documents(doc! { "_id": "dummy-race" }).await?;
    crate::demo::narrate!(
        "   8 tasks race lock_or_create on a new id: {winners} winner, {already} already locked, {docs} document"
    );
    violations += winners.abs_diff(1) + docs.abs_diff(1);

    // Concurrent read-modify-write under the document lock.
    coll.insert_one(doc! { "_id": "counter", "n": 0_i64 })
        .await?;
    let per_task = run_tasks(TASKS, |_| {
        let locks = locks.clone();
        async move {
            let mut ops = 0_u64;
            for _ in 0..ROUNDS {
                loop {
                    ops += 1;
                    match counters::document_increment(&locks, "counter").await? {
                        Increment::Done => {
                            ops += 1;
                            break;
                        }
                        Increment::Busy => tokio::time::sleep(Duration::from_millis(2)).await,
                    }
                }
            }
            anyhow::Ok(ops)
        }
    })
    .await?;
    ops += per_task.iter().sum::<u64>();
    let n = coll
        .find_one(doc! { "_id": "counter" })
        .await?
        .context("counter")?
        .get_i64("n")?;
    let expected = i64::try_from(TASKS * ROUNDS)?;
    crate::demo::narrate!(
        "   {TASKS} tasks × {ROUNDS} locked read-modify-writes: counter {n} of {expected}, lost {}",
        expected - n
    );
    violations += u64::try_from((expected - n).abs())?;

    // A holder that crashed long ago: its lock has expired and is taken over.
    let stale = locks.try_lock("dummy-1").await?.context("dummy-1")?;
    coll.update_one(
        doc! { "_id": "dummy-1" },
        doc! { "$set": { LOCK_TIME: DateTime::from_millis(DateTime::now().timestamp_millis() - 3_600_000) } },
    )
    .await?;
    let seed_and = coll
        .count_documents(
            doc! { "_id": "dummy-1", LOCK_ID: Bson::Null, LOCK_TIME: { "$lt": DateTime::now() } },
        )
        .await?;
    crate::demo::narrate!(
        "   a holder crashed an hour ago; the seed's AND filter (lock_id null AND lock_time expired) matches {seed_and} document: it would say 'already locked' forever"
    );
    let taker = locks.try_lock("dummy-1").await?.context("takeover")?;
    ops += 2;
    crate::demo::narrate!("   the OR filter takes the expired lock over");
    match locks
        .release_with(
            stale,
            doc! { "$set": { "value": "from the crashed holder" } },
        )
        .await
    {
        Ok(FenceOutcome::Lost) => {
            crate::demo::narrate!(
                "   the old holder wakes up: its release_with is refused (lock lost), nothing written"
            );
        }
        other => {
            violations += 1;
            crate::demo::narrate!("   ! the old holder's release returned {other:?}");
        }
    }
    let released = locks.release(taker).await?;
    anyhow::ensure!(released.is_applied(), "release(dummy-1): {released:?}");
    ops += 2;
    crate::demo::narrate!("   violations: {violations}");
    Ok(ScenarioReport {
        scenario: "document-lock",
        operations: ops,
        violations,
        elapsed: started.elapsed(),
    })
}

/// Seed 004: a separate `workitem.lock` collection, leases with fencing tokens.
async fn lock_collection(db: &Database, time: TimeSource) -> anyhow::Result<ScenarioReport> {
    let started = Instant::now();
    let mut ops = 0_u64;
    let mut violations = 0_u64;
    crate::demo::narrate!(
        "== lock-collection (seed 004): leases in workitem.lock, tokens in workitem.lock.tokens"
    );
    let locks = counters::open_locks(db, "workitem.lock", time).await?;
    let workitems = Counters::new(db.collection::<Document>("workitem"));
    workitems.setup(4).await?;

    // Mutual exclusion with unsynchronized read-modify-writes.
    let owners = TASKS * 2;
    let locked = counters::run_locked(
        &locks,
        &workitems,
        4,
        RunConfig {
            workers: owners,
            ops_per_worker: u64::try_from(ROUNDS)?,
            mode: Mode::Safe,
        },
    )
    .await?;
    ops += locked.report().operations;
    let expected = i64::try_from(owners * ROUNDS)?;
    crate::demo::narrate!(
        "   {owners} owners × {ROUNDS} leased read-modify-writes on 4 work items: {} of {expected}, lost {}, token regressions {}",
        expected - locked.lost,
        locked.lost,
        locked.regressions
    );
    violations += locked.report().violations;

    // A holder paused past its ttl.
    let accounts = db.collection::<Document>("account");
    let fence = Fence::new(accounts.clone(), FenceOptions::default())?;
    crate::demo::narrate!("   owner A leases account-1 for 1 s, writes, and pauses for 2.5 s…");
    let paused = counters::paused_holder(&locks, &accounts, &fence).await?;
    crate::demo::narrate!(
        "   owner B takes it over with token {} (A had {}) and writes (fenced)",
        paused.taker.token,
        paused.paused.token
    );
    let (renew, release, write, lb) = (
        paused.renew,
        paused.release,
        paused.late_write,
        paused.taker,
    );
    ops += 6;
    let refused = [
        matches!(renew, Err(Error::LeaseLost { .. })),
        matches!(release, Err(Error::LeaseLost { .. })),
        matches!(write, FenceOutcome::Stale { .. }),
    ];
    crate::demo::narrate!(
        "   A wakes up: renew {}, release {}, fenced write {}",
        if refused[0] {
            "refused (lease lost)"
        } else {
            "ACCEPTED"
        },
        if refused[1] {
            "refused (lease lost)"
        } else {
            "ACCEPTED"
        },
        if refused[2] {
            "refused (stale token)"
        } else {
            "ACCEPTED"
        },
    );
    violations += u64::try_from(refused.iter().filter(|r| !**r).count())?;
    locks.release(&lb).await?;

    // A crash, and the lock document deleted (what the TTL index does, later).
    let c = Owner::random();
    let (lc, _, ld) = counters::crash_and_delete(
        &locks,
        &db.collection::<Document>("workitem.lock"),
        "account-1",
        &c,
        &Owner::random(),
    )
    .await?;
    ops += 3;
    crate::demo::narrate!(
        "   owner C (token {}) crashes and its lock document is deleted; the next owner gets token {}",
        lc.token,
        ld.token
    );
    if ld.token <= lc.token {
        violations += 1;
    }
    locks.release(&ld).await?;

    // The seed's "release by session" becomes release_all(owner).
    for i in 0..3 {
        locks
            .try_acquire(&c, &format!("batch-{i}"), Duration::from_secs(30))
            .await?
            .context("batch")?;
    }
    let released = locks.release_all(&c).await?;
    ops += 4;
    crate::demo::narrate!("   release_all(owner C) released {released} lease(s)");
    if released != 3 {
        violations += 1;
    }
    crate::demo::narrate!("   violations: {violations}");
    Ok(ScenarioReport {
        scenario: "lock-collection",
        operations: ops,
        violations,
        elapsed: started.elapsed(),
    })
}
