//! Queue workloads: a [`Worker`] with `workers` handlers draining a backlog kept at
//! 100, 10,000 and 100,000 due jobs, next to seed 002's own claim loop
//! (`docwarden_workloads::seed_claim`, `update_one` + `find_one`, then the final
//! `update_one`) with `workers` threads on the same backlog. With the 10,000 backlog a
//! second `Worker` row whose handler awaits 1 ms per job (a call to another service):
//! the rows above measure the claim path with handlers that do nothing, which one
//! handler can already keep the server busy with; this one shows how the rate scales
//! with handlers when the handler is the bound.
//!
//! The 10,000 and 100,000 rows keep between `backlog` and 1.5 × `backlog` jobs due while
//! they are timed, and no insert competes with the claims (the shape of the issue's
//! probe): the `Worker` row runs in rounds (the queue topped up untimed, a new `Worker`
//! warmed up on 1,000 jobs, then timed until it has started `backlog / 2` more), the seed
//! loop starts from 1.5 ×
//! `backlog` (it drains a few hundred jobs in a row). The 100 row cannot be prefilled (it
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
use futures::TryStreamExt;
use hdrhistogram::Histogram;
use mongodb::Database;
use mongodb::bson::{Bson, Document, doc};
use tokio_util::sync::CancellationToken;

use super::{BenchRow, Load, measure, per_item, per_op};

/// A job's two writes and nothing else (the `Worker` rows' floor, `--stages`).
pub(crate) const TWO_WRITES: &str =
    "queue stage: a job's two writes only (2 updateMany of 64 by _id)";

/// The name of the `Worker` row at `backlog` (issue 14 target rows at 10,000 and
/// 100,000).
pub(crate) fn worker_name(backlog: usize) -> String {
    format!("queue Worker, backlog {backlog}")
}

/// The backlogs the rows keep.
const BACKLOGS: [usize; 3] = [100, 10_000, 100_000];
/// Backlogs below this are kept by a producer; larger ones are prefilled.
const PRODUCED_BELOW: usize = 1_000;

/// Jobs the seed loop's row starts with: `backlog` when a producer keeps it, 1.5 ×
/// `backlog` otherwise (the seed loop drains a few hundred jobs of a large backlog in a
/// row's duration, so between `backlog` and 1.5 × `backlog` stay due, as in the `Worker`
/// rows' rounds).
fn prefill(backlog: usize) -> usize {
    if backlog < PRODUCED_BELOW {
        backlog
    } else {
        backlog + backlog / 2
    }
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

/// How long the I/O handler row's handler awaits per job (a call to another service).
/// tokio's timer wheel ticks every millisecond and a sleep ends on the first tick after
/// its deadline, so this sleep lasts about 2.1 ms on the bench machine (2,000 sleeps:
/// p10 2,086 µs, p90 2,138 µs): the row's bound is about 476 jobs/s per handler
/// (`docs/benchmarks.md`, session 34).
const IO_HANDLER: Duration = Duration::from_millis(1);

/// The backlog of the I/O handler row.
const IO_BACKLOG: usize = 10_000;

async fn worker_row(
    db: &Database,
    load: &Load,
    backlog: usize,
    handler: Option<Duration>,
) -> anyhow::Result<BenchRow> {
    let name = match handler {
        None => worker_name(backlog),
        Some(d) => format!(
            "queue Worker, backlog {backlog}, handler awaits {} ms",
            d.as_millis()
        ),
    };
    load.progress
        .set_message(format!("{name} × {} handlers", load.workers));
    let time = TimeSource::server(db.client().clone(), ClockOptions::default())?;
    let mut options = QueueOptions::default();
    if let Some(n) = load.partitions {
        options = options.partitions(n);
    }
    let ttl_ms = i64::try_from(options.lease_ttl.as_millis())?;
    let coll = format!(
        "bench_queue_{backlog}{}",
        if handler.is_some() { "_io" } else { "" }
    );
    let q = JobQueue::open(db, &coll, time, options).await?;
    let mut options = WorkerOptions::default()
        .name("bench")
        .concurrency(load.workers);
    if let Some(n) = load.batch_size {
        options = options.batch_size(n);
    }
    let timed = if backlog < PRODUCED_BELOW {
        produced_run(&q, load, backlog, options, handler).await?
    } else {
        rounds(&q, load, backlog, options, handler).await?
    };
    let hist = claim_to_completion(&q, ttl_ms).await?;
    if handler.is_some() {
        q.collection().drop().await?;
    }
    #[allow(clippy::cast_precision_loss)]
    let ops_per_sec = timed.ops as f64 / timed.elapsed.as_secs_f64();
    let reference = load.reference_around().await?.unwrap_or(f64::NAN);
    Ok(BenchRow {
        name,
        workers: load.workers,
        ops: timed.ops,
        ops_per_sec,
        p50_us: hist.value_at_quantile(0.5),
        p99_us: hist.value_at_quantile(0.99),
        ratio: ops_per_sec / reference,
        reference_ops_per_sec: reference,
        round_trips_per_op: per_op(timed.commands, timed.ops),
        server_cpu_us_per_op: timed.server_cpu.and_then(|cpu| per_item(cpu, timed.ops)),
        client_cpu_us_per_op: timed.client_cpu.and_then(|cpu| per_item(cpu, timed.ops)),
        rounds: 1,
        ratios: Vec::new(),
        ratio_min: f64::NAN,
        ratio_max: f64::NAN,
    })
}

/// What a `Worker` row measured: jobs completed, and the time, commands and server CPU
/// they took.
#[derive(Debug, Default)]
struct Timed {
    ops: u64,
    elapsed: Duration,
    commands: u64,
    server_cpu: Option<Duration>,
    client_cpu: Option<Duration>,
}

/// The small backlog: one `Worker` for `load.duration` while a producer keeps `backlog`
/// jobs due (its inserts count in the row's commands and server CPU).
async fn produced_run(
    q: &JobQueue,
    load: &Load,
    backlog: usize,
    options: WorkerOptions,
    handler: Option<Duration>,
) -> anyhow::Result<Timed> {
    Producer::new().enqueue(q, backlog).await?;
    let started = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let top_up = {
        let q = q.clone();
        let started = Arc::clone(&started);
        let stop = stop.clone();
        tokio::spawn(async move {
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
    let worker = counting_worker(q, options, &started, handler)?;
    let mark = Mark::now(load, &worker).await?;
    tokio::time::sleep(load.duration).await;
    let mut timed = Timed::zero();
    timed.add_since(load, &worker, &mark).await?;
    stop.cancel();
    worker.shutdown().await;
    top_up.await??;
    Ok(timed)
}

/// A `Worker` whose handler counts the jobs it started in `started` and then, with
/// `handler`, awaits that long (an I/O call), otherwise returns at once.
fn counting_worker(
    q: &JobQueue,
    options: WorkerOptions,
    started: &Arc<AtomicU64>,
    handler: Option<Duration>,
) -> anyhow::Result<Worker> {
    let counter = Arc::clone(started);
    Ok(Worker::spawn(q.clone(), options, move |_job| {
        counter.fetch_add(1, Ordering::Relaxed);
        async move {
            if let Some(d) = handler {
                tokio::time::sleep(d).await;
            }
            Ok(Bson::Null)
        }
    })?)
}

/// The readings a timed stretch starts from.
struct Mark {
    done: u64,
    commands: u64,
    server_cpu: Option<Duration>,
    client_cpu: Option<Duration>,
    at: Instant,
}

impl Mark {
    async fn now(load: &Load, worker: &Worker) -> anyhow::Result<Self> {
        let commands = load.commands_sent().await?;
        Ok(Self {
            done: worker.report().succeeded,
            commands,
            server_cpu: load.server_cpu(),
            client_cpu: load.client_cpu(),
            at: Instant::now(),
        })
    }
}

impl Timed {
    /// Nothing timed yet (CPU readings present until one is missing).
    fn zero() -> Self {
        Self {
            server_cpu: Some(Duration::ZERO),
            client_cpu: Some(Duration::ZERO),
            ..Self::default()
        }
    }

    /// Adds what `worker` did since `mark`: jobs completed, time, commands, CPU.
    async fn add_since(&mut self, load: &Load, worker: &Worker, mark: &Mark) -> anyhow::Result<()> {
        let cpu = |sum: Option<Duration>, now: Option<Duration>, then: Option<Duration>| {
            Some(sum? + now?.saturating_sub(then?))
        };
        self.ops += worker.report().succeeded - mark.done;
        self.elapsed += mark.at.elapsed();
        self.commands += load.commands_sent().await?.saturating_sub(mark.commands);
        self.server_cpu = cpu(self.server_cpu, load.server_cpu(), mark.server_cpu);
        self.client_cpu = cpu(self.client_cpu, load.client_cpu(), mark.client_cpu);
        Ok(())
    }
}

/// Jobs a round's new `Worker` starts before it is timed (its claim span and prefetch
/// settle meanwhile, as in a worker that has been running).
const WARM_UP: usize = 1_000;

/// A large backlog, in rounds: each round tops the queue up (untimed, so no insert
/// competes with the claims), starts a new `Worker`, lets it start [`WARM_UP`] jobs, then
/// times it until it has started `backlog / 2` more (or `load.duration` has been timed
/// in all), so between `backlog` and 1.5 × `backlog` jobs are due while it is timed.
/// Rounds repeat until `load.duration` has been timed. (Until session 5 of 2026-11-22
/// the row prefilled `backlog` plus 20,000 jobs per second of the row, so a "10,000" row
/// ran with 50,000–90,000 jobs due.)
async fn rounds(
    q: &JobQueue,
    load: &Load,
    backlog: usize,
    options: WorkerOptions,
    handler: Option<Duration>,
) -> anyhow::Result<Timed> {
    let timed_jobs = (backlog / 2).max(1);
    let top = backlog + timed_jobs + WARM_UP;
    let (warm, last) = (
        u64::try_from(WARM_UP)?,
        u64::try_from(WARM_UP + timed_jobs)?,
    );
    let ready = doc! { field::STATE: JobState::Ready.as_str() };
    let mut producer = Producer::new();
    let mut timed = Timed::zero();
    while timed.elapsed < load.duration {
        let due = usize::try_from(q.collection().count_documents(ready.clone()).await?)?;
        producer.enqueue(q, top.saturating_sub(due)).await?;
        let started = Arc::new(AtomicU64::new(0));
        let worker = counting_worker(q, options.clone(), &started, handler)?;
        // Until the worker has started `n` jobs, or `stop` has passed.
        let until = |n: u64, stop: Option<Instant>| {
            let started = Arc::clone(&started);
            async move {
                let since = Instant::now();
                while started.load(Ordering::Relaxed) < n
                    && stop.is_none_or(|stop| Instant::now() < stop)
                {
                    anyhow::ensure!(
                        since.elapsed() < Duration::from_secs(120),
                        "the Worker started only {} of {n} jobs in 120 s",
                        started.load(Ordering::Relaxed)
                    );
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                anyhow::Ok(())
            }
        };
        until(warm, None).await?;
        let mark = Mark::now(load, &worker).await?;
        until(
            last,
            Some(mark.at + load.duration.saturating_sub(timed.elapsed)),
        )
        .await?;
        timed.add_since(load, &worker, &mark).await?;
        worker.shutdown().await;
    }
    Ok(timed)
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
    seed.insert(prefill(backlog)).await?;
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

/// The rows: per backlog the `Worker` and, with `anchor`, the seed loop; with the 10,000
/// backlog also a `Worker` whose handler awaits [`IO_HANDLER`] per job (what a handler
/// calling another service does), which shows how the rate scales with handlers when
/// the handler, not the server, is the bound.
pub(crate) async fn run(db: &Database, load: &Load, anchor: bool) -> anyhow::Result<Vec<BenchRow>> {
    let mut rows = Vec::new();
    let backlogs = load.backlogs.clone().unwrap_or_else(|| BACKLOGS.to_vec());
    for backlog in backlogs {
        rows.push(worker_row(db, load, backlog, None).await?);
        if backlog == IO_BACKLOG {
            rows.push(worker_row(db, load, backlog, Some(IO_HANDLER)).await?);
        }
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
    if load.stages {
        rows.push(two_writes_row(db, load).await?);
    }
    Ok(rows)
}

/// Jobs per write of [`two_writes_row`]: the `Worker`'s default claim size.
const STAGE_BATCH: usize = 64;

/// The floor of any design that writes each job twice: every task takes 64 jobs of its
/// own and writes them twice, as two `updateMany` by `_id` — ready → running with a
/// lease, then back to ready — on a job collection with the queue's indexes (each job
/// moves out of the two claim indexes into the lease index and back, as a claim and a
/// completion move it). No candidate read, no read-back, no fence, no handler: what a
/// job's two writes cost this server, for the `Worker` rows to be read against
/// (`docs/benchmarks.md`).
async fn two_writes_row(db: &Database, load: &Load) -> anyhow::Result<BenchRow> {
    let time = TimeSource::server(db.client().clone(), ClockOptions::default())?;
    let q = JobQueue::open(db, "bench_queue_stage", time, QueueOptions::default()).await?;
    let jobs = STAGE_BATCH * 8 * load.workers;
    Producer::new().enqueue(&q, jobs).await?;
    let coll = q.collection().clone();
    let ids: Vec<Bson> = coll
        .find(doc! {})
        .projection(doc! { field::ID: 1 })
        .await?
        .try_collect::<Vec<Document>>()
        .await?
        .into_iter()
        .filter_map(|d| d.get(field::ID).cloned())
        .collect();
    let per_task = ids.len() / load.workers;
    anyhow::ensure!(
        per_task >= STAGE_BATCH,
        "the stage's jobs were not all enqueued"
    );
    let ids = Arc::new(ids);
    let rounds: Arc<Vec<AtomicU64>> =
        Arc::new((0..load.workers).map(|_| AtomicU64::new(0)).collect());
    let row = measure(TWO_WRITES, load, move |worker| {
        let (coll, ids, rounds) = (coll.clone(), Arc::clone(&ids), Arc::clone(&rounds));
        async move {
            let round = rounds[worker].fetch_add(1, Ordering::Relaxed);
            let slots = u64::try_from(per_task / STAGE_BATCH)?;
            let start = worker * per_task + usize::try_from(round % slots)? * STAGE_BATCH;
            let batch = ids[start..start + STAGE_BATCH].to_vec();
            let until = mongodb::bson::DateTime::from_millis(
                mongodb::bson::DateTime::now().timestamp_millis() + 30_000,
            );
            let claim = coll
                .update_many(
                    doc! { field::ID: { "$in": &batch } },
                    doc! { "$set": {
                        field::STATE: JobState::Running.as_str(),
                        field::LEASE: {
                            field::lease::OWNER: "stage",
                            field::lease::TOKEN: "t",
                            field::lease::UNTIL: until,
                        },
                    } },
                )
                .await?;
            coll.update_many(
                doc! { field::ID: { "$in": &batch } },
                doc! {
                    "$set": { field::STATE: JobState::Ready.as_str() },
                    "$unset": { field::LEASE: "" },
                },
            )
            .await?;
            Ok(claim.modified_count)
        }
    })
    .await?;
    q.collection().drop().await?;
    Ok(row)
}
