//! Session 35: a release docwarden sends itself, with nobody waiting for its answer, is
//! finished in the background when it fails with a transient error (`lock/landing.rs`,
//! "Releases that failed").
//!
//! Two such releases:
//! - a writer that gives up waiting for the readers withdraws its intent
//!   (`RwLocks::write`); a failed withdrawal was dropped, and the intent kept every new
//!   reader out until its ttl;
//! - a `JobQueue` gives back a job's concurrency permits (`release_permits`, which the
//!   `Worker` calls after a job's last transition); a failed release was dropped, and the
//!   permit held a slot of the limit until its ttl;
//! - a batch claim whose jobs cannot be read back gives them back (`ready`, the attempt
//!   returned); a failed give-back was dropped, and the jobs waited for their lease to
//!   expire, charged an attempt they never ran;
//! - a limited claim that fails after its rate start was admitted takes the start back; a
//!   failed take-back was dropped, and the start counted against the rate until it left
//!   its interval.
//!
//! Each release's `update` is refused three times with `NotWritablePrimary` (a primary
//! stepping down), matched by the releasing client's application name so that the test's
//! own client is not affected: the release's try and the driver's retry fail, so the
//! call's release fails (in the last two cases every matching command fails from the
//! claim on, until the fail point is turned off). The lease must then be free within
//! [`BOUND`], far below its ttl (60 s for the intent and the jobs, 45 s for the permits,
//! an hour for the start). Without the background retry (the release as before session
//! 35) each case is a violation: 4 in all. Fail points are server-wide,
//! so this file is its own test binary with one test that runs its cases in turn.

use std::time::{Duration, Instant};

use anyhow::Context;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{LockCollection, LockOptions, Owner, RwLockOptions, RwLocks};
use docwarden::queue::{EnqueueOptions, JobQueue, LimitOptions, QueueOptions};
use docwarden_testkit::{fail_commands_of, fail_commands_off};
use mongodb::bson::{Bson, Document, doc};

/// The application name of the client whose releases fail.
const APP: &str = "release-later";

/// How soon the lease must be free after the call that released it returned: a few
/// refused tries with backoff, with room for a slow machine.
const BOUND: Duration = Duration::from_secs(5);

/// `NotWritablePrimary`: what a primary stepping down answers a write.
const NOT_WRITABLE_PRIMARY: i32 = 10107;

/// Whether `freed` answers `true` within [`BOUND`] of `since`, asked every 50 ms.
async fn freed_within<F, Fut>(since: Instant, mut freed: F) -> anyhow::Result<bool>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    loop {
        if freed().await? {
            return Ok(true);
        }
        if since.elapsed() > BOUND {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether `q` can claim a limited job now (it is completed and its permits released).
async fn claim_next(q: &JobQueue) -> anyhow::Result<bool> {
    let next = q.claim_limited("next", 1).await?;
    let Some(job) = next.first() else {
        return Ok(false);
    };
    q.complete(job, Bson::Null).await?;
    q.release_permits(job).await;
    Ok(true)
}

/// `commands` of [`APP`]'s client are refused as by a stepping-down primary, in `mode`
/// (`{times: n}`: the next `n`; `{skip: n}`: all after the next `n`).
async fn refuse(admin: &mongodb::Client, commands: &[&str], mode: Document) -> anyhow::Result<()> {
    fail_commands_of(
        admin,
        APP,
        commands,
        NOT_WRITABLE_PRIMARY,
        Bson::Document(mode),
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_release_nobody_waits_for_is_finished_in_the_background() -> anyhow::Result<()> {
    let test = "a_failed_release_nobody_waits_for_is_finished_in_the_background";
    let Some((t, admin, lossy_client)) = docwarden_testkit::app_faults(test, APP).await? else {
        return Ok(());
    };
    let lossy_db = lossy_client.database(t.db.name());
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let lossy_time = TimeSource::server(lossy_client.clone(), ClockOptions::default())?;
    let mut violations = Vec::new();

    // A writer that gives up: its intent's withdrawal fails.
    let ttl = Duration::from_secs(60);
    let rw = RwLocks::new(
        LockCollection::open(&t.db, "rw", time.clone(), LockOptions::default()).await?,
        RwLockOptions::default(),
    )?;
    let lossy_rw = RwLocks::new(
        LockCollection::open(&lossy_db, "rw", lossy_time.clone(), LockOptions::default()).await?,
        RwLockOptions::default().poll_interval(Duration::from_millis(50)),
    )?;
    // A first write lease and release, so that the resource has its token block and the
    // writer's intent is one `findAndModify` (no `update` of the fail point's).
    let first = rw
        .try_write(&Owner::random(), "w", ttl)
        .await?
        .context("the first write lease")?;
    rw.release_write(&first).await?;
    let reader = rw
        .try_read(&Owner::random(), "w", ttl)
        .await?
        .context("reader")?;
    let writer = Owner::random();
    refuse(&admin, &["update"], doc! { "times": 3 }).await?;
    let got = lossy_rw
        .write(&writer, "w", ttl, Duration::from_secs(1))
        .await;
    let gave_up = Instant::now();
    if !matches!(got, Ok(None)) {
        violations.push(format!(
            "rwlock: the writer's wait should end with Ok(None), got {got:?}"
        ));
    }
    let rw_docs = t.db.collection::<Document>("rw");
    let intent = doc! { "_id": "w", "owner": writer.id() };
    let withdrawn = freed_within(gave_up, || async {
        Ok(rw_docs.find_one(intent.clone()).await?.is_none())
    })
    .await?;
    if !withdrawn {
        violations.push(format!(
            "rwlock: {BOUND:?} after the writer gave up, its intent (ttl {ttl:?}) still keeps readers out: {:?}",
            rw_docs.find_one(doc! { "_id": "w" }).await?
        ));
    }
    fail_commands_off(&admin).await?;
    rw.release_read(&reader).await?;

    // A job's concurrency permits given back: the releases fail.
    let limits = QueueOptions::default().limits(LimitOptions::default().queue_concurrency(1));
    let lossy_q = JobQueue::open(&lossy_db, "jobs", lossy_time.clone(), limits.clone()).await?;
    let q = JobQueue::open(&t.db, "jobs", time.clone(), limits).await?;
    let (lossy_time_q, time_q) = (lossy_time, time);
    for i in 0..2 {
        q.enqueue(
            doc! { "i": i },
            &EnqueueOptions::default().concurrency_key("k"),
        )
        .await?;
    }
    let first = lossy_q.claim_limited("first", 1).await?;
    let first = first.first().context("the first limited claim")?;
    lossy_q.complete(first, Bson::Null).await?;
    refuse(&admin, &["update"], doc! { "times": 3 }).await?;
    lossy_q.release_permits(first).await;
    let gave_back = Instant::now();
    if !freed_within(gave_back, || claim_next(&q)).await? {
        violations.push(format!(
            "limits: {BOUND:?} after the permits were given back, the next job of the key still cannot be claimed: {:?}",
            q.concurrency_limits().await?
        ));
    }
    fail_commands_off(&admin).await?;

    // A claim whose jobs cannot be read back gives them back, and that fails too.
    let opts = QueueOptions::default()
        .lease_ttl(Duration::from_secs(60))
        .reap_interval(Duration::from_secs(3600))
        .partitions(1);
    let lossy_q = JobQueue::open(&lossy_db, "claims", lossy_time_q.clone(), opts.clone()).await?;
    let q = JobQueue::open(&t.db, "claims", time_q.clone(), opts).await?;
    // A first claim, so that the handle's sweep is behind it: the next batch claim sends a
    // `find` (the candidates, of the one partition), an `update` (the claim) and a `find`
    // (the read-back).
    q.enqueue(doc! { "warm": true }, &EnqueueOptions::default())
        .await?;
    let warm = lossy_q.claim_batch("w", 4).await?;
    lossy_q
        .complete(warm.first().context("the first claim")?, Bson::Null)
        .await?;
    let id = q
        .enqueue(doc! { "i": 1 }, &EnqueueOptions::default())
        .await?
        .created()
        .context("the job")?;
    // The candidates' read and the claim pass; the read-back and the give-back fail
    // (with the driver's retries) until the fail point is turned off.
    refuse(&admin, &["update", "find"], doc! { "skip": 2 }).await?;
    let claimed = lossy_q.claim_batch("r", 4).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    fail_commands_off(&admin).await?;
    let recovered = Instant::now();
    let jobs = t.db.collection::<Document>("claims");
    match claimed {
        Err(e) if e.is_retryable() => {
            let given_back = doc! { "_id": id, "state": "ready", "attempts": 0_i64 };
            if !freed_within(recovered, || async {
                Ok(jobs.find_one(given_back.clone()).await?.is_some())
            })
            .await?
            {
                violations.push(format!(
                    "claim: {BOUND:?} after the server recovered, the job not read back is still not given back (lease 60 s): {:?}",
                    jobs.find_one(doc! { "_id": id }).await?
                ));
            }
        }
        other => violations.push(format!(
            "claim: the claim whose read-back failed answered {other:?}"
        )),
    }

    // A limited claim that fails after its rate start was admitted takes the start back,
    // and that fails too.
    let opts = QueueOptions::default()
        .reap_interval(Duration::from_secs(3600))
        .limits(LimitOptions::default().rate(2, Duration::from_secs(3600)));
    let lossy_q = JobQueue::open(&lossy_db, "rated", lossy_time_q.clone(), opts.clone()).await?;
    let q = JobQueue::open(&t.db, "rated", time_q.clone(), opts).await?;
    for i in 0..3 {
        q.enqueue(doc! { "i": i }, &EnqueueOptions::default().rate_key("r"))
            .await?;
    }
    // A first claim takes one of the hour's two starts (and puts the sweep behind the
    // handle): the next limited claim sends a `findAndModify` admitting a start, then a
    // `findAndModify` claiming the job.
    let warm = lossy_q.claim_limited("w", 1).await?;
    lossy_q
        .complete(warm.first().context("the first rated claim")?, Bson::Null)
        .await?;
    // The admission passes; the claim and the start's take-back fail (with the driver's
    // retries) until the fail point is turned off.
    refuse(&admin, &["findAndModify", "update"], doc! { "skip": 1 }).await?;
    let failed = lossy_q.claim_limited("r", 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    fail_commands_off(&admin).await?;
    let recovered = Instant::now();
    match failed {
        Err(e) if e.is_retryable() => {
            if !freed_within(recovered, || claim_next(&q)).await? {
                let rates =
                    t.db.collection::<Document>("rated.rates")
                        .find_one(doc! { "_id": "r" })
                        .await?;
                violations.push(format!(
                    "rate: {BOUND:?} after the server recovered, the failed claim's start still counts (2 per hour): {rates:?}"
                ));
            }
        }
        other => violations.push(format!(
            "rate: the limited claim that failed answered {other:?}"
        )),
    }

    assert!(
        violations.is_empty(),
        "{} violations: {violations:#?}",
        violations.len()
    );
    Ok(())
}
