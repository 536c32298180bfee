//! Queue limits (issue 15, items 6–8): concurrency limits per key, rate limits per key,
//! and tenant fairness, each run by several [`Worker`]s with handles of their own (so the
//! limit is enforced by the database, not by one process's memory).
//!
//! - **Concurrency**: jobs of a few keys, `N` per key; every handler counts the handlers of
//!   its key running at once (in this process, where every worker runs) and records a
//!   violation when it starts beyond `N`. `Mode::Control` claims limited jobs without
//!   permits ([`Safeguard::ConcurrencyLimit`]).
//! - **Rate**: jobs of a few keys, at most `N` starts per interval; every handler records
//!   the server time its start was admitted (`limits.admitted_at`, the rate document's
//!   `$$NOW`), and the checker counts windows of the interval that hold more than `N`
//!   starts. `Mode::Control` admits every start
//!   ([`Safeguard::RateLimit`]).
//! - **Fairness**: one tenant's backlog and another tenant's single job, both with fairness
//!   keys; the run measures how long the single job waits.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use docwarden::clock::TimeSource;
use docwarden::queue::{
    EnqueueOptions, JobQueue, LimitOptions, QueueOptions, Safeguard, Worker, WorkerOptions,
};
use mongodb::Database;
use mongodb::bson::{Bson, doc};

use crate::run::Mode;

/// How a concurrency or rate run is shaped.
#[derive(Clone, Copy, Debug)]
pub struct LimitRun {
    /// Worker processes (each with its own queue handle).
    pub workers: usize,
    /// Handlers per worker.
    pub concurrency: usize,
    /// Keys.
    pub keys: usize,
    /// Jobs per key.
    pub jobs_per_key: usize,
    /// The limit: running jobs per key, or starts per interval.
    pub limit: u32,
    /// The rate interval (rate runs only).
    pub interval: Duration,
    /// How long a handler works.
    pub hold: Duration,
    /// Safe or control.
    pub mode: Mode,
}

impl Default for LimitRun {
    fn default() -> Self {
        Self {
            workers: 8,
            concurrency: 4,
            keys: 3,
            jobs_per_key: 30,
            limit: 2,
            interval: Duration::from_millis(500),
            hold: Duration::from_millis(20),
            mode: Mode::Safe,
        }
    }
}

/// What a run counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitReport {
    /// Jobs completed.
    pub completed: u64,
    /// Most handlers of one key running at once (concurrency), or most starts of one key
    /// in one checked window (rate).
    pub max_seen: u64,
    /// Handler starts beyond the limit.
    pub violations: u64,
    /// Wall time of the run, milliseconds.
    pub elapsed_ms: u64,
}

/// The queue options of a limit run for `mode`.
pub fn queue_options(run: &LimitRun, rate: bool) -> QueueOptions {
    let limits = if rate {
        LimitOptions::default().rate(run.limit, run.interval)
    } else {
        LimitOptions::default().key_concurrency(run.limit)
    };
    let mut o = QueueOptions::default()
        .lease_ttl(Duration::from_secs(5))
        .limits(limits);
    if run.mode == Mode::Control {
        o = o.unsafe_without(if rate {
            Safeguard::RateLimit
        } else {
            Safeguard::ConcurrencyLimit
        });
    }
    o
}

fn worker_options(run: &LimitRun, w: usize) -> WorkerOptions {
    WorkerOptions::default()
        .name(format!("limit-{w}"))
        .concurrency(run.concurrency)
        .batch_size(run.concurrency)
        .poll(Duration::from_millis(5), Duration::from_millis(50))
}

fn key_of(payload: &Bson) -> String {
    payload
        .as_document()
        .and_then(|d| d.get_str("key").ok())
        .unwrap_or_default()
        .to_owned()
}

async fn enqueue(q: &JobQueue, run: &LimitRun, rate: bool) -> anyhow::Result<()> {
    let mut jobs = Vec::new();
    for k in 0..run.keys {
        let key = format!("tenant-{k}");
        for n in 0..run.jobs_per_key {
            let opts = if rate {
                EnqueueOptions::default().rate_key(key.clone())
            } else {
                EnqueueOptions::default().concurrency_key(key.clone())
            };
            jobs.push((
                Bson::Document(doc! { "key": key.as_str(), "n": i64::try_from(n)? }),
                opts,
            ));
        }
    }
    q.enqueue_many(jobs).await?;
    Ok(())
}

async fn wait_done(
    q: &JobQueue,
    done: &AtomicU64,
    total: u64,
    limit: Duration,
) -> anyhow::Result<()> {
    let started = Instant::now();
    while done.load(Ordering::Relaxed) < total {
        if started.elapsed() > limit {
            anyhow::bail!(
                "{} of {total} jobs done after {limit:?} ({:?})",
                done.load(Ordering::Relaxed),
                q.stats().await.ok()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// The concurrency run: `workers` workers, each with its own handle on queue `name`.
///
/// # Errors
/// A database error, or the jobs not done in time.
pub async fn run_concurrency(
    db: &Database,
    name: &str,
    time: TimeSource,
    run: LimitRun,
) -> anyhow::Result<LimitReport> {
    let options = queue_options(&run, false);
    let q = JobQueue::open(db, name, time.clone(), options.clone()).await?;
    enqueue(&q, &run, false).await?;
    let running: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let max_seen = Arc::new(AtomicU64::new(0));
    let violations = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let limit = u64::from(run.limit);
    let started = Instant::now();
    let mut workers = Vec::new();
    for w in 0..run.workers {
        let handle = JobQueue::open(db, name, time.clone(), options.clone()).await?;
        let (running, max_seen, violations, done) = (
            running.clone(),
            max_seen.clone(),
            violations.clone(),
            done.clone(),
        );
        let hold = run.hold;
        workers.push(Worker::spawn(
            handle,
            worker_options(&run, w),
            move |job| {
                let (running, max_seen, violations, done) = (
                    running.clone(),
                    max_seen.clone(),
                    violations.clone(),
                    done.clone(),
                );
                async move {
                    let key = key_of(job.payload());
                    let now = {
                        let mut r = running.lock().unwrap_or_else(|p| p.into_inner());
                        let n = r.entry(key.clone()).or_default();
                        *n += 1;
                        *n
                    };
                    max_seen.fetch_max(now, Ordering::Relaxed);
                    if now > limit {
                        violations.fetch_add(1, Ordering::Relaxed);
                    }
                    tokio::time::sleep(hold).await;
                    if let Some(n) = running
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_mut(&key)
                    {
                        *n -= 1;
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                    Ok(Bson::Null)
                }
            },
        )?);
    }
    let total = u64::try_from(run.keys * run.jobs_per_key)?;
    let waited = wait_done(&q, &done, total, Duration::from_secs(120)).await;
    for w in workers {
        w.shutdown().await;
    }
    waited?;
    Ok(LimitReport {
        completed: done.load(Ordering::Relaxed),
        max_seen: max_seen.load(Ordering::Relaxed),
        violations: violations.load(Ordering::Relaxed),
        elapsed_ms: u64::try_from(started.elapsed().as_millis())?,
    })
}

/// Counts starts beyond `limit` in any window shorter than `window_ms` (starts in server
/// milliseconds, any order). Returns (violations, most starts in one window).
pub fn check_rate(starts: &[i64], limit: usize, window_ms: i64) -> (u64, u64) {
    let mut s = starts.to_vec();
    s.sort_unstable();
    let mut violations = 0;
    let mut most = 0;
    let mut lo = 0;
    for hi in 0..s.len() {
        while s[hi] - s[lo] >= window_ms {
            lo += 1;
        }
        let n = hi - lo + 1;
        most = most.max(n);
        if n > limit {
            violations += 1;
        }
    }
    (
        u64::try_from(violations).unwrap_or(u64::MAX),
        u64::try_from(most).unwrap_or(u64::MAX),
    )
}

/// Slack subtracted from the rate interval in the check: none, the admission times are
/// the server's own (`$$NOW`, stored by the claim in `limits.admitted_at`).
pub const RATE_SLACK_MS: i64 = 0;

/// The server time (`$$NOW`, milliseconds) the rate document admitted the last start of
/// job `id`, read from the job document (`limits.admitted_at`).
///
/// # Errors
/// A database error.
pub async fn admitted_at(
    coll: &mongodb::Collection<mongodb::bson::Document>,
    id: mongodb::bson::oid::ObjectId,
) -> anyhow::Result<Option<i64>> {
    use docwarden::queue::format::field;
    let d = coll
        .find_one(doc! { field::ID: id })
        .projection(doc! { field::LIMITS: 1 })
        .await?;
    Ok(d.and_then(|d| {
        d.get_document(field::LIMITS)
            .ok()?
            .get_datetime(field::limits::ADMITTED_AT)
            .ok()
            .map(|t| t.timestamp_millis())
    }))
}

/// The rate run: jobs of `keys` rate keys, `limit` starts per `interval` each.
///
/// # Errors
/// A database error, or the jobs not done in time.
pub async fn run_rate(
    db: &Database,
    name: &str,
    time: TimeSource,
    run: LimitRun,
) -> anyhow::Result<LimitReport> {
    let options = queue_options(&run, true);
    let q = JobQueue::open(db, name, time.clone(), options.clone()).await?;
    enqueue(&q, &run, true).await?;
    let starts: Arc<Mutex<HashMap<String, Vec<i64>>>> = Arc::default();
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for w in 0..run.workers {
        let handle = JobQueue::open(db, name, time.clone(), options.clone()).await?;
        let (starts, done) = (starts.clone(), done.clone());
        let hold = run.hold;
        let coll = q.collection().clone();
        workers.push(Worker::spawn(
            handle,
            worker_options(&run, w),
            move |job| {
                let (starts, done, coll) = (starts.clone(), done.clone(), coll.clone());
                async move {
                    let key = key_of(job.payload());
                    let at = admitted_at(&coll, job.id()).await?.unwrap_or(i64::MIN);
                    starts
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(key)
                        .or_default()
                        .push(at);
                    tokio::time::sleep(hold).await;
                    done.fetch_add(1, Ordering::Relaxed);
                    Ok(Bson::Null)
                }
            },
        )?);
    }
    let total = u64::try_from(run.keys * run.jobs_per_key)?;
    let waited = wait_done(&q, &done, total, Duration::from_secs(180)).await;
    for w in workers {
        w.shutdown().await;
    }
    waited?;
    let window = i64::try_from(run.interval.as_millis())? - RATE_SLACK_MS;
    let mut report = LimitReport {
        completed: done.load(Ordering::Relaxed),
        elapsed_ms: u64::try_from(started.elapsed().as_millis())?,
        ..LimitReport::default()
    };
    for s in starts.lock().unwrap_or_else(|p| p.into_inner()).values() {
        let (v, most) = check_rate(s, usize::try_from(run.limit)?, window);
        report.violations += v;
        report.max_seen = report.max_seen.max(most);
    }
    Ok(report)
}

/// What the fairness run measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FairnessReport {
    /// Jobs in the big tenant's backlog.
    pub backlog: u64,
    /// How long the small tenant's single job waited from its enqueue to its handler.
    pub small_wait_ms: u64,
    /// Jobs of the big tenant that ran before it.
    pub big_before: u64,
}

/// The fairness run: `backlog` jobs of tenant `big` enqueued first, then one job of tenant
/// `small`, both with fairness keys; `workers` workers start after both are stored. With
/// `fair = false` the jobs carry no fairness key (random partitions), for comparison.
///
/// # Errors
/// A database error, or the small job not run in time.
pub async fn run_fairness(
    db: &Database,
    name: &str,
    time: TimeSource,
    backlog: usize,
    workers: usize,
    fair: bool,
) -> anyhow::Result<FairnessReport> {
    let options = QueueOptions::default().partitions(64);
    let q = JobQueue::open(db, name, time.clone(), options.clone()).await?;
    let opts = |tenant: &str| {
        if fair {
            EnqueueOptions::default().fairness_key(tenant)
        } else {
            EnqueueOptions::default()
        }
    };
    let mut left = backlog;
    while left > 0 {
        let n = left.min(5_000);
        let batch: Vec<_> = (0..n)
            .map(|_| (Bson::Document(doc! { "tenant": "big" }), opts("big")))
            .collect();
        q.enqueue_many(batch).await?;
        left -= n;
    }
    let enqueued = Instant::now();
    q.enqueue(doc! { "tenant": "small" }, &opts("small"))
        .await?;
    let big_ran = Arc::new(AtomicU64::new(0));
    let small_at: Arc<Mutex<Option<(Instant, u64)>>> = Arc::default();
    let mut ws = Vec::new();
    for w in 0..workers {
        let handle = JobQueue::open(db, name, time.clone(), options.clone()).await?;
        let (big_ran, small_at) = (big_ran.clone(), small_at.clone());
        ws.push(Worker::spawn(
            handle,
            WorkerOptions::default()
                .name(format!("fair-{w}"))
                .concurrency(4)
                .batch_size(16),
            move |job| {
                let (big_ran, small_at) = (big_ran.clone(), small_at.clone());
                async move {
                    let tenant = job
                        .payload()
                        .as_document()
                        .and_then(|d| d.get_str("tenant").ok())
                        .unwrap_or_default()
                        .to_owned();
                    if tenant == "small" {
                        *small_at.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some((Instant::now(), big_ran.load(Ordering::Relaxed)));
                    } else {
                        big_ran.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(Bson::Null)
                }
            },
        )?);
    }
    let limit = Duration::from_secs(120);
    let result = loop {
        if let Some((at, before)) = *small_at.lock().unwrap_or_else(|p| p.into_inner()) {
            break Ok((at, before));
        }
        if enqueued.elapsed() > limit {
            break Err(anyhow::anyhow!(
                "the small tenant's job did not run in {limit:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    for w in ws {
        w.kill().await;
    }
    let (at, before) = result?;
    Ok(FairnessReport {
        backlog: u64::try_from(backlog)?,
        small_wait_ms: u64::try_from(at.duration_since(enqueued).as_millis())?,
        big_before: before,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_windows_are_counted() {
        assert_eq!(check_rate(&[0, 100, 200, 600, 700], 2, 500), (1, 3));
        assert_eq!(check_rate(&[0, 500, 1000], 1, 500), (0, 1));
    }

    fn stamp(inc: u32) -> docwarden::check::order::Stamp {
        docwarden::check::order::Stamp::new(1_800_000_000, inc)
    }

    /// A handler run of `tenant-0` recorded at `at_us` on the history's clock, holding
    /// its place over `from..to` of the server's order.
    fn run(at_us: u64, from: u32, to: u32) -> docwarden::check::Event {
        run_event(1, "tenant-0", at_us, at_us + 10_000, stamp(from), stamp(to)).expect("a span")
    }

    /// A handler stopped past its lease (a SIGSTOP outliving it) cannot confirm its lease
    /// afterwards, so its stretch ends at its last marker before it was stopped: it is no
    /// third holder of a limit of 2 next to the handlers that took its job's place. Had it
    /// confirmed later, it would be.
    #[test]
    fn a_handler_stopped_past_its_lease_is_counted_up_to_its_last_confirmed_marker() {
        let events = [run(0, 1, 2), run(2_500_000, 3, 6), run(2_500_000, 4, 7)];
        assert!(concurrency_violations(&events, 2).is_empty());
        let events = [run(0, 1, 5), run(2_500_000, 3, 6), run(2_500_000, 4, 7)];
        assert_eq!(concurrency_violations(&events, 2).len(), 1);
    }

    /// The handlers' clocks (and the history's) take no part: three handlers of one key
    /// at one instant of the server's order are over the limit however far apart their
    /// recorded times are, and handlers one after the other in that order are not,
    /// however their recorded times overlap.
    #[test]
    fn the_servers_order_decides_not_the_handlers_clocks() {
        let apart_by_clock = [run(0, 1, 9), run(20_000_000, 2, 9), run(40_000_000, 3, 9)];
        assert_eq!(concurrency_violations(&apart_by_clock, 2).len(), 1);
        let together_by_clock = [run(0, 1, 2), run(0, 3, 4), run(0, 5, 6)];
        assert!(concurrency_violations(&together_by_clock, 1).is_empty());
    }
}

/// The history operations of the verify workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A handler ran and confirmed its claim's lease still certainly valid: key, span =
    /// from its marker write after it started to its marker write before it confirmed (the
    /// server's order, [`docwarden::check::order`]). A handler stopped past its lease
    /// cannot confirm: it records nothing, as its job's place went to others.
    Run,
    /// A job started: key, `value` = the claim's server time (`updated_at`).
    Start,
}

impl Op {
    /// The name in histories and reports.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Op::Run => "run",
            Op::Start => "start",
        }
    }
}

/// Enqueues the verify jobs: `jobs_per_key` jobs of each of `keys` keys, limited by
/// concurrency key or by rate key.
///
/// # Errors
/// A database error.
pub async fn enqueue_verify(
    q: &JobQueue,
    keys: usize,
    jobs_per_key: usize,
    rate: bool,
) -> anyhow::Result<()> {
    let run = LimitRun {
        keys,
        jobs_per_key,
        ..LimitRun::default()
    };
    enqueue(q, &run, rate).await
}

/// The key of a job's payload (verify handlers name their events by it).
pub fn job_key(payload: &Bson) -> String {
    key_of(payload)
}

/// The history event of a handler of `key` that held its job's place from stamp `from`
/// (a marker write after it started) to stamp `to` (one before it confirmed its claim's
/// lease still certainly valid); recorded at `start_us..end_us` on the history's clock
/// (the report's timeline). `None` unless `from < to`.
pub fn run_event(
    process: u32,
    key: &str,
    start_us: u64,
    end_us: u64,
    from: docwarden::check::order::Stamp,
    to: docwarden::check::order::Stamp,
) -> Option<docwarden::check::Event> {
    Some(
        docwarden::check::Event::new(process, Op::Run.as_str(), key, start_us, end_us)
            .span(docwarden::check::order::Span::new(from, to)?),
    )
}

/// The verify checker of the concurrency workload: handlers of one key running at one
/// instant of the server's order beyond `limit` (`over-concurrency-limit`), from
/// [`Op::Run`] events. A handler's stretch ends at its last marker before it confirmed its
/// claim's lease (the equivalent, in the server's order, of cutting it at the lease's
/// expiry): a handler stopped past its lease, its place given to another, is not counted
/// beyond it.
pub fn concurrency_violations(
    events: &[docwarden::check::Event],
    limit: usize,
) -> Vec<docwarden::check::Violation> {
    let mut by_key: HashMap<&str, Vec<docwarden::check::order::Span>> = HashMap::new();
    for e in events.iter().filter(|e| e.op == Op::Run.as_str()) {
        if let Some(span) = e.span {
            by_key.entry(e.key.as_str()).or_default().push(span);
        }
    }
    let mut out = Vec::new();
    for (key, spans) in by_key {
        let c = docwarden::check::order::crowding(spans.iter().map(|s| (s.from, s.to)), limit);
        for _ in 0..c.beyond {
            out.push(docwarden::check::Violation::new(
                "over-concurrency-limit",
                key,
                format!(
                    "{} jobs of the key ran at one instant of the server's order (limit {limit})",
                    c.most
                ),
            ));
        }
    }
    out
}

/// The verify checker of the rate workload: starts of one key beyond `limit` in a window
/// of `interval_ms − RATE_SLACK_MS` (`over-rate-limit`), from [`Op::Start`] events.
pub fn rate_violations(
    events: &[docwarden::check::Event],
    limit: usize,
    interval_ms: i64,
) -> Vec<docwarden::check::Violation> {
    let mut by_key: HashMap<&str, Vec<i64>> = HashMap::new();
    for e in events.iter().filter(|e| e.op == Op::Start.as_str()) {
        if let Some(v) = e.value {
            by_key.entry(e.key.as_str()).or_default().push(v);
        }
    }
    let mut out = Vec::new();
    for (key, starts) in by_key {
        let (v, most) = check_rate(&starts, limit, interval_ms - RATE_SLACK_MS);
        for _ in 0..v {
            out.push(docwarden::check::Violation::new(
                "over-rate-limit",
                key,
                format!("{most} starts in one window (limit {limit} per {interval_ms} ms)"),
            ));
        }
    }
    out
}
