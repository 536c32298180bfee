//! Records the queue-limit workloads (`docwarden_workloads::queue_limits`): every worker
//! runs a [`docwarden::queue::Worker`] with a queue handle of its own on one queue of jobs of
//! three keys.
//!
//! - `limits`: concurrency keys, 2 running jobs per key. Each handler records its running
//!   stretch in the server's order (a marker write after it started, one before it
//!   confirms its claim's lease still certainly valid; none if it cannot); checked: never
//!   more than 2 of one key at one instant of that order. The control claims without
//!   permits.
//! - `rate`: rate keys, 4 starts per 500 ms per key. Each handler records the server time
//!   its start was admitted (`limits.admitted_at`); checked: never more than 4 starts of
//!   one key in a window of the interval. The control admits every start.

use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden::queue::{JobQueue, Worker, WorkerOptions};
use docwarden_workloads::Process;
use docwarden_workloads::marker::Markers;
use docwarden_workloads::queue_limits::{self, LimitRun, Op};
use mongodb::bson::Bson;

use super::context::{Ctx, Findings};

const QUEUE: &str = "verify_limits";
/// The module name (`supervise` finds the worker by it).
const MODULE: &str = "limits"; // not a stored field: the module name
const KEYS: usize = 3;
const JOBS_PER_KEY: usize = 5_000;
/// The job lease (what a `sigstop` must outlive).
pub(super) const LEASE: Duration = Duration::from_secs(2);

fn shape(ctx: &Ctx) -> LimitRun {
    LimitRun {
        limit: 2,
        interval: Duration::from_millis(500),
        mode: ctx.mode,
        ..LimitRun::default()
    }
}

fn options(ctx: &Ctx, rate: bool) -> docwarden::queue::QueueOptions {
    let mut run = shape(ctx);
    if rate {
        run.limit = 4;
    }
    queue_limits::queue_options(&run, rate).lease_ttl(LEASE)
}

pub(super) async fn run(ctx: Arc<Ctx>, rate: bool) -> anyhow::Result<Findings> {
    let q = JobQueue::open(
        &ctx.db,
        QUEUE,
        docwarden::clock::TimeSource::server(ctx.client.clone(), Default::default())?,
        options(&ctx, rate),
    )
    .await?;
    queue_limits::enqueue_verify(&q, KEYS, JOBS_PER_KEY, rate).await?;
    let c = Arc::clone(&ctx);
    ctx.supervise(if rate { "rate" } else { MODULE }, move |process| {
        let ctx = Arc::clone(&c);
        async move { worker(&ctx, process, rate).await }
    })
    .await;
    let events = ctx.history.events();
    let violations = if rate {
        queue_limits::rate_violations(&events, 4, 500)
    } else {
        queue_limits::concurrency_violations(&events, 2)
    };
    Ok(Findings {
        operations: u64::try_from(events.len()).unwrap_or(u64::MAX),
        violations,
    })
}

/// One worker: a queue handle and a `Worker` until the deadline, then a graceful shutdown.
pub(super) async fn worker(ctx: &Ctx, process: Process, rate: bool) -> anyhow::Result<()> {
    let time = ctx.clock(process)?;
    let q = JobQueue::new(ctx.db.collection(QUEUE), time.clone(), options(ctx, rate))?;
    let history = Arc::clone(&ctx.history);
    let id = process.id();
    let coll = ctx.db.collection(QUEUE);
    let markers = Markers::new(&ctx.db);
    let w = Worker::spawn(
        q,
        WorkerOptions::default()
            .name(format!("limits-{id}"))
            .concurrency(4)
            .batch_size(4)
            .poll(Duration::from_millis(5), Duration::from_millis(50)),
        move |job| {
            let (history, time, coll, markers) = (
                Arc::clone(&history),
                time.clone(),
                coll.clone(),
                markers.clone(),
            );
            async move {
                let key = queue_limits::job_key(job.payload());
                let at = history.now_us();
                if rate {
                    if let Some(admitted) = queue_limits::admitted_at(&coll, job.id()).await? {
                        history.push(
                            docwarden::check::Event::new(id, Op::Start.as_str(), &key, at, at)
                                .value(admitted),
                        );
                    }
                    return Ok(Bson::Null);
                }
                // The server's order, never this process's clock: a marker after the
                // handler started, one before it confirms its claim's lease.
                let from = markers.stamp(id).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
                let to = markers.stamp(id).await;
                let (Ok(from), Ok(to)) = (from, to) else {
                    return Ok(Bson::Null);
                };
                // Past the claim's lease (a stopped process) the handler no longer holds
                // its place: it claims nothing it cannot vouch for.
                let valid = time
                    .now()
                    .await
                    .is_ok_and(|now| now.certainly_before(job.lease.until, time.skew_margin_ms()));
                if valid
                    && let Some(event) =
                        queue_limits::run_event(id, &key, at, history.now_us(), from, to)
                {
                    history.push(event);
                }
                Ok(Bson::Null)
            }
        },
    )?;
    let deadline = Instant::now() + ctx.duration;
    tokio::time::sleep_until(deadline.into()).await;
    w.shutdown().await;
    Ok(())
}
