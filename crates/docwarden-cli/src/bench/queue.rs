//! Queue workloads: a [`Worker`] with `workers` handlers draining a backlog kept at
//! 100, 10,000 and 100,000 due jobs, next to seed 002's own claim loop
//! (`docwarden_workloads::seed_claim`, `update_one` + `find_one`, then the final
//! `update_one`) with `workers` threads on the same backlog.
//!
//! The 10,000 and 100,000 rows drain a prefilled backlog: `backlog` jobs plus the
//! most the row can take in its duration (20,000 jobs/s for the Worker, 2,000 for the
//! seed loop), so at least `backlog` jobs are due throughout and no insert competes with
//! the claims (the shape of the probe). The 100 row cannot be prefilled (it
//! drains in milliseconds): a producer tops it up in the background (jobs enqueued minus
//! jobs started, counted locally, so it never scans the collection), and its inserts go
//! through the bench's client and count in `rt/op`. A job counts once its completion
//! is acknowledged. The Worker rows' latency is per job, from its claim to its completion
//! (both server time, as the queue wrote them: `finished_at − (lease.until − lease
//! TTL)`, millisecond resolution); the seed rows' latency is per loop iteration
//! (claim, fetch, final update).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::format::{JobState, field};
use docwarden::queue::{JobQueue, QueueOptions, Worker, WorkerOptions};
use docwarden_workloads::jobs::Producer;
use docwarden_workloads::seed_claim::SeedQueue;
use hdrhistogram::Histogram;
use mongodb::Database;
use mongodb::bson::{Bson, Document, doc};
use tokio_util::sync::CancellationToken;

use super::{BenchRow, Load, measure, per_op};

/// The backlogs the rows keep.
const BACKLOGS: [usize; 3] = [100, 10_000, 100_000];
/// Backlogs below this are kept by a producer; larger ones are prefilled.
const PRODUCED_BELOW: usize = 1_000;

/// Jobs to prefill for a row keeping `backlog` jobs due while draining at most `rate`
/// jobs/s for `load.duration`.
fn prefill(load: &Load, backlog: usize, rate: u64) -> anyhow::Result<usize> {
    if backlog < PRODUCED_BELOW {
        return Ok(backlog);
    }
    Ok(backlog + usize::try_from(rate.saturating_mul(load.duration.as_secs()))?)
}

/// Keeps `enqueued − started` at about `keep` until `stop`: `top` enqueues `n` more.
async fn keep_backlog<F, Fut>(
    keep: u64,
    started: Arc<AtomicU64>,
    stop: CancellationToken,
    mut enqueued: u64,
    mut top: F,
) -> anyhow::Result<()>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let step = (keep / 10).max(1);
    while !stop.is_cancelled() {
        let waiting = enqueued.saturating_sub(started.load(Ordering::Relaxed));
        let missing = keep.saturating_sub(waiting);
        if missing >= step {
            top(usize::try_from(missing)?).await?;
            enqueued += missing;
        } else {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    Ok(())
}

async fn worker_row(db: &Database, load: &Load, backlog: usize) -> anyhow::Result<BenchRow> {
    let name = format!("queue Worker, backlog {backlog}");
    load.progress
        .set_message(format!("{name} × {} handlers", load.workers));
    let time = TimeSource::server(db.client().clone(), ClockOptions::default())?;
    let options = QueueOptions::default();
    let ttl_ms = i64::try_from(options.lease_ttl.as_millis())?;
    let coll = format!("bench_queue_{backlog}");
    let q = JobQueue::open(db, &coll, time, options).await?;
    let filled = prefill(load, backlog, 20_000)?;
    Producer::new().enqueue(&q, filled).await?;
    let started = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let produced = backlog < PRODUCED_BELOW;
    let top_up = {
        let q = q.clone();
        let started = Arc::clone(&started);
        let stop = stop.clone();
        tokio::spawn(async move {
            if !produced {
                return Ok(());
            }
            keep_backlog(
                u64::try_from(backlog)?,
                started,
                stop,
                u64::try_from(backlog)?,
                |n| {
                    let q = q.clone();
                    // The payloads' numbers repeat across top-ups; nothing checks them.
                    async move { Ok(Producer::new().enqueue(&q, n).await?) }
                },
            )
            .await
        })
    };
    let commands_before = load.commands_sent();
    let counter = Arc::clone(&started);
    let mut options = WorkerOptions::default()
        .name("bench")
        .concurrency(load.workers);
    if let Some(n) = load.batch_size {
        options = options.batch_size(n);
    }
    let worker = Worker::spawn(q.clone(), options, move |_job| {
        counter.fetch_add(1, Ordering::Relaxed);
        async { Ok(Bson::Null) }
    })?;
    let t0 = Instant::now();
    let cpu_before = load.server_cpu();
    let done_before = worker.report().succeeded;
    tokio::time::sleep(load.duration).await;
    let ops = worker.report().succeeded - done_before;
    let server_cpu_us_per_op = load.server_cpu_per_op(cpu_before, ops);
    let elapsed = t0.elapsed().as_secs_f64();
    let commands = load.commands_sent() - commands_before;
    let left = u64::try_from(filled)?.saturating_sub(started.load(Ordering::Relaxed));
    if !produced && left < u64::try_from(backlog)? {
        eprintln!(
            "bench: {name}: only {left} jobs were left due at the end (drained faster than the prefill allows)"
        );
    }
    stop.cancel();
    worker.shutdown().await;
    top_up.await??;
    let hist = claim_to_completion(&q, ttl_ms).await?;
    #[allow(clippy::cast_precision_loss)]
    let ops_per_sec = ops as f64 / elapsed;
    Ok(BenchRow {
        name,
        workers: load.workers,
        ops,
        ops_per_sec,
        p50_us: hist.value_at_quantile(0.5),
        p99_us: hist.value_at_quantile(0.99),
        ratio: f64::NAN,
        round_trips_per_op: per_op(commands, ops),
        server_cpu_us_per_op,
    })
}

/// Claim → completion latency of every succeeded job, microseconds (server time).
async fn claim_to_completion(q: &JobQueue, ttl_ms: i64) -> anyhow::Result<Histogram<u64>> {
    let mut hist = Histogram::<u64>::new(3)?;
    let mut cursor = q
        .collection()
        .find(doc! { field::STATE: JobState::Succeeded.as_str() })
        .projection(doc! { field::LEASE_UNTIL: 1, field::FINISHED_AT: 1 })
        .await?;
    while cursor.advance().await? {
        let d = cursor.deserialize_current()?;
        let until = d
            .get_document(field::LEASE)
            .ok()
            .and_then(|l| l.get_datetime(field::lease::UNTIL).ok().copied());
        if let (Some(until), Ok(done)) = (until, d.get_datetime(field::FINISHED_AT)) {
            let claimed = until.timestamp_millis() - ttl_ms;
            let ms = u64::try_from(done.timestamp_millis() - claimed).unwrap_or(0);
            hist.record(ms.saturating_mul(1000).max(1))?;
        }
    }
    Ok(hist)
}

async fn seed_row(db: &Database, load: &Load, backlog: usize) -> anyhow::Result<BenchRow> {
    let seed = SeedQueue::setup(db, &format!("bench_seed_{backlog}")).await?;
    seed.insert(prefill(load, backlog, 2_000)?).await?;
    let started = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let produced = backlog < PRODUCED_BELOW;
    let top_up = {
        let seed = seed.clone();
        let started = Arc::clone(&started);
        let stop = stop.clone();
        tokio::spawn(async move {
            if !produced {
                return anyhow::Ok(());
            }
            let backlog = u64::try_from(backlog)?;
            keep_backlog(backlog, started, stop, backlog, |n| {
                let seed = seed.clone();
                async move { seed.insert(n).await }
            })
            .await
        })
    };
    let counter = Arc::clone(&started);
    let row = measure(
        &format!("seed 002 claim loop, backlog {backlog}"),
        load,
        move |_| {
            let seed = seed.clone();
            let counter = Arc::clone(&counter);
            async move {
                let n = seed.step().await?;
                counter.fetch_add(n, Ordering::Relaxed);
                Ok(n)
            }
        },
    )
    .await;
    stop.cancel();
    top_up.await??;
    row
}

/// The rows: per backlog the `Worker` and, with `anchor`, the seed loop.
pub(crate) async fn run(db: &Database, load: &Load, anchor: bool) -> anyhow::Result<Vec<BenchRow>> {
    let mut rows = Vec::new();
    let backlogs = load.backlogs.clone().unwrap_or_else(|| BACKLOGS.to_vec());
    for backlog in backlogs {
        rows.push(worker_row(db, load, backlog).await?);
        if anchor {
            rows.push(seed_row(db, load, backlog).await?);
        }
        db.collection::<Document>(&format!("bench_queue_{backlog}"))
            .drop()
            .await?;
        db.collection::<Document>(&format!("bench_seed_{backlog}"))
            .drop()
            .await?;
    }
    Ok(rows)
}
