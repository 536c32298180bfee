//! Records periodic jobs (`docwarden_workloads::schedule`): every worker runs a
//! [`docwarden::queue::Worker`] with its scheduler on, all racing for the ticks of one
//! 1 s interval schedule, under the run's faults (worker kills and pauses among them).
//! After the run one clean scheduler pass enqueues what a killed scheduler left behind;
//! then every tick up to the schedule's `last_tick` must have exactly one job. The
//! control run gives tick jobs random `_id`s, so racing schedulers enqueue ticks twice.

use std::sync::Arc;
use std::time::Instant;

use docwarden::check::Event;
use docwarden::queue::{JobQueue, Worker};
use docwarden_workloads::Process;
use docwarden_workloads::schedule::{self as workload, Op};
use mongodb::bson::Bson;

use super::args::Module;
use super::context::{Ctx, Findings};

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    let time = docwarden::clock::TimeSource::server(ctx.client.clone(), Default::default())?;
    let queue = JobQueue::open(
        &ctx.db,
        workload::COLLECTION,
        time,
        workload::queue_options(ctx.mode),
    )
    .await?;
    workload::setup(&queue).await?;
    let c = Arc::clone(&ctx);
    ctx.supervise(Module::Schedule.name(), move |process| {
        let ctx = Arc::clone(&c);
        async move { worker(&ctx, process).await }
    })
    .await;
    // One clean pass: a scheduler killed between a tick's insert and its compare-and-set
    // left `last_tick` behind; the pass re-inserts that tick (a no-op) and catches up.
    let start = ctx.history.now_us();
    let pass = queue.run_due_ticks().await;
    let end = ctx.history.now_us();
    let mut ev = Event::new(Process::Drain.id(), Op::Pass.as_str(), "-", start, end);
    ev = match &pass {
        Ok(r) => ev.detail(format!(
            "{} enqueued, {} duplicates, {} skipped",
            r.enqueued, r.duplicates, r.skipped
        )),
        Err(e) => ev.detail(e.to_string()),
    };
    ctx.history.push(ev);
    pass?;
    let read_at = queue.time().now().await?.estimate_ms;
    let observed = workload::observe(&queue).await?;
    let violations = workload::check(&observed, read_at);
    let jobs: u64 = observed.per_tick.values().sum();
    tracing::info!(
        ticks = (observed.last_tick_ms - observed.anchor_ms)
            / i64::try_from(workload::EVERY.as_millis()).unwrap_or(1000),
        jobs,
        "schedule read back"
    );
    Ok(Findings {
        operations: jobs,
        violations,
    })
}

/// One worker process: a worker whose scheduler races the others' for every tick (and
/// whose handlers complete the tick jobs), until the run's deadline.
pub(super) async fn worker(ctx: &Ctx, process: Process) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let queue = JobQueue::new(
        ctx.db.collection(workload::COLLECTION),
        ctx.clock(process)?,
        workload::queue_options(ctx.mode),
    )?;
    let worker = Worker::spawn(
        queue,
        workload::worker_options(format!("verify-{}", process.id())),
        |_job| async move { Ok(Bson::Null) },
    )?;
    tokio::time::sleep_until(tokio::time::Instant::from_std(deadline)).await;
    let report = worker.shutdown().await;
    let at = ctx.history.now_us();
    ctx.history.push(
        Event::new(process.id(), Op::Report.as_str(), "-", at, at)
            .value(i64::try_from(report.succeeded).unwrap_or(i64::MAX))
            .detail(format!("{} tick jobs completed", report.succeeded)),
    );
    Ok(())
}
