//! The queue workload: a producer enqueues jobs while workers claim them with 2 s leases,
//! sometimes pause past the lease, and complete them fenced by the claim's token.
//!
//! The committed effect of a job is its fenced completion. The control run claims with
//! client clocks and completes unfenced (by `_id` only), which double-commits jobs whose
//! lease was taken over. Checked: every enqueued job completed exactly once, none lost,
//! none left running after the drain.

use std::collections::BTreeMap;
use std::future::IntoFuture;
use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden::check::OpOutcome;
use docwarden::check::queue::{JobObservation, check_jobs};
use docwarden::queue::format::field;
use docwarden::queue::{EnqueueOptions, JobQueue, JobState, QueueOptions};
use docwarden::validate::random_id;
use futures::TryStreamExt;
use mongodb::bson::{Document, doc};
use rand::Rng;

use super::{Ctx, Findings};

const LEASE: Duration = Duration::from_secs(2);

/// The queue collection of the workload.
const JOBS: &str = "verify_jobs";

fn options() -> QueueOptions {
    QueueOptions::default()
        .lease_ttl(LEASE)
        .reap_interval(Duration::from_millis(500))
}

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    let producer_clock =
        docwarden::clock::TimeSource::server(ctx.client.clone(), Default::default())?;
    let queue = JobQueue::open(&ctx.db, JOBS, producer_clock, options()).await?;
    // Jobs are produced during the first 60 % of the run; workers go on until everything
    // is finished (or a drain limit of the run + 4 leases).
    let produce_until = Instant::now() + ctx.duration.mul_f64(0.6);
    let producer = {
        let (queue, ctx) = (queue.clone(), Arc::clone(&ctx));
        tokio::spawn(async move {
            let mut n = 0_i64;
            let raw = ctx.db.collection::<Document>(JOBS);
            while Instant::now() < produce_until {
                // Backpressure: keep the backlog small so that re-claims of expired
                // leases happen during the run, not after it.
                let backlog = raw
                    .count_documents(doc! { field::STATE: { "$in": [JobState::Ready.as_str(), JobState::Retrying.as_str()] } })
                    .await
                    .unwrap_or(0);
                if backlog > 16 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                let batch: Vec<(Document, EnqueueOptions)> = (0..20)
                    .map(|i| (doc! { "n": n + i }, EnqueueOptions::default()))
                    .collect();
                let start = ctx.history.now_us();
                let r = queue.enqueue_many(batch).await;
                let outcome = match &r {
                    Ok(_) => OpOutcome::Ok,
                    Err(e) if e.is_retryable() => OpOutcome::Indeterminate,
                    Err(_) => OpOutcome::Failed,
                };
                ctx.history.push(
                    docwarden::check::Event::new(
                        u32::MAX - 2,
                        "enqueue",
                        "batch",
                        start,
                        ctx.history.now_us(),
                    )
                    .outcome(outcome),
                );
                if r.is_ok() {
                    n += 20;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let c = Arc::clone(&ctx);
    ctx.supervise("queue", move |process| {
        let ctx = Arc::clone(&c);
        async move { worker(&ctx, process).await }
    })
    .await;
    producer.await?;
    // Drain: the workers have stopped; finish what is left with fresh, fault-free workers.
    let drainers: Vec<_> = (0..ctx.workers)
        .map(|_| {
            let (ctx, queue) = (Arc::clone(&ctx), queue.clone());
            tokio::spawn(async move { drain(&ctx, &queue).await })
        })
        .collect();
    for d in drainers {
        d.await??;
    }

    let mut jobs: BTreeMap<String, JobObservation> = BTreeMap::new();
    let mut cursor = ctx.db.collection::<Document>(JOBS).find(doc! {}).await?;
    while let Some(d) = cursor.try_next().await? {
        let id = d
            .get_object_id("_id")
            .map(|o| o.to_hex())
            .unwrap_or_default();
        jobs.insert(
            id,
            JobObservation {
                effects: 0,
                state: d.get_str(field::STATE).ok().map(str::to_owned),
            },
        );
    }
    let events = ctx.history.events();
    for e in events
        .iter()
        .filter(|e| e.op == "complete" && e.outcome == OpOutcome::Ok)
    {
        jobs.entry(e.key.clone()).or_default().effects += 1;
    }
    Ok(Findings {
        operations: u64::try_from(events.len()).unwrap_or(u64::MAX),
        violations: check_jobs(&jobs),
    })
}

/// One claim → (pause?) → complete loop until the run's deadline.
async fn worker(ctx: &Ctx, process: u32) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let queue = JobQueue::new(ctx.db.collection(JOBS), ctx.clock(process)?, options())?;
    let raw = ctx.db.collection::<Document>(JOBS);
    let owner = format!("verify-{process}-{}", random_id());
    let mut rng = ctx.rng(process);
    while Instant::now() < deadline {
        let claimed = match queue.claim(&owner).await {
            Ok(Some(job)) => job,
            Ok(None) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            Err(e) => {
                let at = ctx.history.now_us();
                let detail = e.to_string();
                ctx.history.push(
                    docwarden::check::Event::new(process, "claim", "-", at, at)
                        .outcome(Ctx::outcome_of::<()>(&Err(e)))
                        .detail(detail),
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let key = claimed.id().to_hex();
        ctx.history.push(
            docwarden::check::Event::new(
                process,
                "claim",
                &key,
                ctx.history.now_us(),
                ctx.history.now_us(),
            )
            .detail(claimed.lease.token.to_string()),
        );
        // The handler's work, sometimes paused past the lease.
        tokio::time::sleep(Duration::from_millis(rng.random_range(2..15))).await;
        ctx.maybe_pause(&mut rng, process, 0.03, LEASE + Duration::from_millis(1500))
            .await;
        let token = claimed.lease.token.to_string();
        if ctx.control {
            ctx.history
                .record(
                    process,
                    "complete",
                    &key,
                    raw.update_one(doc! { "_id": claimed.id() }, doc! { "$set": { field::STATE: JobState::Succeeded.as_str(), field::RESULT: &token }, "$unset": { field::LEASE: "" } })
                        .into_future(),
                    |r, e| match r {
                        Ok(u) if u.matched_count == 1 => e.detail(token.clone()),
                        Ok(_) => e.outcome(OpOutcome::Failed),
                        Err(_) => e.outcome(OpOutcome::Indeterminate),
                    },
                )
                .await
                .ok();
        } else {
            ctx.history
                .record(
                    process,
                    "complete",
                    &key,
                    queue.complete(&claimed, token.as_str()),
                    |r, e| {
                        e.outcome(Ctx::outcome_of(r)).detail(match r {
                            Ok(()) => token.clone(),
                            Err(err) => err.to_string(),
                        })
                    },
                )
                .await
                .ok();
        }
    }
    Ok(())
}

/// Completes every job still unfinished, with fault-free claims (fenced in safe runs).
async fn drain(ctx: &Ctx, queue: &JobQueue) -> anyhow::Result<()> {
    let limit = Instant::now() + LEASE * 4 + Duration::from_secs(20);
    let owner = format!("verify-drain-{}", random_id());
    let raw = ctx.db.collection::<Document>(JOBS);
    while Instant::now() < limit {
        match queue.claim(&owner).await {
            Ok(Some(job)) => {
                let key = job.id().to_hex();
                let token = job.lease.token.to_string();
                ctx.history
                    .record(
                        u32::MAX - 1,
                        "complete",
                        &key,
                        queue.complete(&job, token.as_str()),
                        |r, e| e.outcome(Ctx::outcome_of(r)).detail(token.clone()),
                    )
                    .await
                    .ok();
            }
            Ok(None) | Err(_) => {
                let unfinished = raw
                    .count_documents(doc! { field::STATE: { "$in": [JobState::Ready.as_str(), JobState::Running.as_str(), JobState::Retrying.as_str()] } })
                    .await?;
                if unfinished == 0 {
                    return Ok(());
                }
                // Leases of paused or killed workers expire within one lease.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    Ok(())
}
