//! Records seed 002 (`docwarden_workloads::jobs`): a producer enqueues jobs while workers
//! claim them with 2 s leases, sometimes pause past the lease, and commit their effect.
//!
//! The committed effect of a job is its fenced completion. The control run claims with
//! client clocks and completes unfenced (by `_id` only), which double-commits jobs whose
//! lease was taken over. Checked: every enqueued job completed exactly once, none lost,
//! none left running after the drain.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden::check::{Event, OpOutcome};
use docwarden::queue::JobQueue;
use docwarden::validate::random_id;
use docwarden_workloads::jobs::{self, Op, Producer};
use docwarden_workloads::{Mode, Process};
use rand::Rng;

use super::context::{Ctx, Findings};

const COLLECTION: &str = "verify_jobs";
/// Jobs per enqueued batch, and the backlog above which the producer waits.
const BATCH: usize = 20;
const MAX_BACKLOG: u64 = 16;

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    let producer_clock =
        docwarden::clock::TimeSource::server(ctx.client.clone(), Default::default())?;
    let queue = JobQueue::open(
        &ctx.db,
        COLLECTION,
        producer_clock,
        jobs::short_lease_options(),
    )
    .await?;
    // Jobs are produced during the first 60 % of the run; workers go on until everything
    // is finished (or a drain limit of the run + 4 leases).
    let produce_until = Instant::now() + ctx.duration.mul_f64(0.6);
    let producer = {
        let (queue, ctx) = (queue.clone(), Arc::clone(&ctx));
        tokio::spawn(async move { produce(&ctx, &queue, produce_until).await })
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

    let events = ctx.history.events();
    let mut effects: BTreeMap<String, u64> = BTreeMap::new();
    for e in events
        .iter()
        .filter(|e| e.op == Op::Complete.as_str() && e.outcome == OpOutcome::Ok)
    {
        *effects.entry(e.key.clone()).or_default() += 1;
    }
    let mut observed = jobs::observe(&queue, &effects).await?;
    // A completion whose outcome is unknown (an error that may have landed, a worker killed
    // mid-call) may be the job's one effect: if no other completion is known and the job
    // is succeeded, it landed.
    for e in events
        .iter()
        .filter(|e| e.op == Op::Complete.as_str() && e.outcome == OpOutcome::Indeterminate)
    {
        if let Some(job) = observed.get_mut(&e.key)
            && job.effects == 0
            && job.state.as_deref() == Some(docwarden::format::job::JobState::Succeeded.as_str())
        {
            job.effects = 1;
        }
    }
    Ok(Findings {
        operations: u64::try_from(events.len()).unwrap_or(u64::MAX),
        violations: jobs::check(&observed),
    })
}

/// The producer: batches of [`BATCH`] jobs while the backlog is small, so that re-claims
/// of expired leases happen during the run, not after it.
async fn produce(ctx: &Ctx, queue: &JobQueue, until: Instant) {
    let mut producer = Producer::new();
    while Instant::now() < until {
        if jobs::backlog(queue).await.unwrap_or(0) > MAX_BACKLOG {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        ctx.history
            .record(
                Process::Producer.id(),
                Op::Enqueue.as_str(),
                "batch",
                producer.enqueue(queue, BATCH),
                |r, e| e.outcome(Ctx::outcome_of(r)),
            )
            .await
            .ok();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Records one completion of `job` by `process`.
async fn complete(
    ctx: &Ctx,
    queue: &JobQueue,
    job: &docwarden::queue::ClaimedJob,
    process: Process,
    mode: Mode,
) {
    let token = job.lease.token.clone();
    ctx.history
        .record(
            process.id(),
            Op::Complete.as_str(),
            &job.id().to_hex(),
            jobs::complete(queue, job, token.as_str(), mode),
            |r, e| match r {
                Ok(true) => e.detail(token.to_string()),
                Ok(false) => e.outcome(OpOutcome::Failed).detail("lease lost"),
                Err(err) => e.outcome(Ctx::outcome_of(r)).detail(err.to_string()),
            },
        )
        .await
        .ok();
}

/// One claim → (pause?) → complete loop until the run's deadline.
pub(super) async fn worker(ctx: &Ctx, process: Process) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let queue = JobQueue::new(
        ctx.db.collection(COLLECTION),
        ctx.clock(process)?,
        jobs::short_lease_options(),
    )?;
    let owner = format!("verify-{}-{}", process.id(), random_id());
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
                    Event::new(process.id(), Op::Claim.as_str(), "-", at, at)
                        .outcome(Ctx::outcome_of::<()>(&Err(e)))
                        .detail(detail),
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let at = ctx.history.now_us();
        ctx.history.push(
            Event::new(
                process.id(),
                Op::Claim.as_str(),
                &claimed.id().to_hex(),
                at,
                at,
            )
            .detail(claimed.lease.token.to_string()),
        );
        // The handler's work, sometimes paused past the lease.
        tokio::time::sleep(Duration::from_millis(rng.random_range(2..15))).await;
        ctx.maybe_pause(
            &mut rng,
            process,
            0.03,
            jobs::LEASE + Duration::from_millis(1500),
        )
        .await;
        complete(ctx, &queue, &claimed, process, ctx.mode).await;
    }
    Ok(())
}

/// Completes every job still unfinished, with fault-free claims (fenced in safe runs).
async fn drain(ctx: &Ctx, queue: &JobQueue) -> anyhow::Result<()> {
    let limit = Instant::now() + jobs::LEASE * 4 + Duration::from_secs(20);
    let owner = format!("verify-drain-{}", random_id());
    while Instant::now() < limit {
        match queue.claim(&owner).await {
            Ok(Some(job)) => complete(ctx, queue, &job, Process::Drain, Mode::Safe).await,
            Ok(None) | Err(_) => {
                if jobs::unfinished(queue).await? == 0 {
                    return Ok(());
                }
                // Leases of paused or killed workers expire within one lease.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    Ok(())
}
