//! `docwarden bench`: throughput and latency of each module, as a ratio to raw
//! `update_one` measured in the same run on the same server.
//!
//! Every workload is a closure run by `workers` tasks in a loop for a fixed duration
//! ([`measure`]); latencies go into an HDR histogram. The reference row (`update_one` by
//! `_id`) is measured first with the same worker count; then, right after every row, the
//! reference runs again for a quarter of the duration, and the row's ratio is its ops/s
//! over the mean of the reference's rate just before and just after it
//! ([`Load::reference_around`], the `ref ops/s` column). A machine whose speed drifts
//! during a run (a shared VM: the reference moved by a third within an hour here) would
//! otherwise make the rows measured last read slower than they are.
//!
//! Round trips per operation: each row divides the commands sent while it was measured
//! (setup excluded, background tasks of the workload included) by the items it completed.
//! On the embedded server (only the bench talks to it) the commands are counted by the
//! server itself (`serverStatus.metrics.commands`, the bench's own `serverStatus` and the
//! driver's `hello` heartbeats left out), which costs the client nothing; on a server given
//! with `--uri` (possibly shared) by the driver's command monitoring, which makes the
//! driver turn every command and reply into a `Document` for its event: ~10 µs of client
//! CPU per `update_one` and ~45 µs per guarded update, in proportion to their size
//! ([`Commands`]).
//!
//! Rounds (`--rounds N`): the reference around each row corrects the drift within a run,
//! not the noise between runs. On this shared 2-core VM one row's ratio moves by ±15 %
//! from one run to the next (the same build read 0.51× and 1.08× in two runs), so one run
//! cannot say whether a target is met. With `N` rounds the whole sweep runs `N` times
//! (each round: every worker count on a fresh database, the reference row, the
//! workloads), and each row reports the median of its rounds ([`aggregate`]), with every
//! round's ratio (`ratios`) and their range (`ratio_min`, `ratio_max`, the table's `ratio
//! range` column). Each number is its own median, so with rounds a row's ratio is no
//! longer exactly its ops/s over its reference's.

use std::collections::HashMap;
use std::future::Future;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use mongodb::bson::{Document, doc};
use mongodb::event::EventHandler;
use mongodb::event::command::CommandEvent;
use mongodb::options::ClientOptions;
use mongodb::{Client, Database};

use crate::conn::ConnArgs;

mod guard;
mod limits;
mod locks;
mod queue;
mod sequence;
mod targets;
mod wakeup;

/// The load one workload runs under.
#[derive(Debug, Clone)]
pub(crate) struct Load {
    /// Concurrent tasks.
    pub(crate) workers: usize,
    /// How long each workload runs.
    pub(crate) duration: Duration,
    /// The spinner that shows which workload runs (hidden with `--json`).
    pub(crate) progress: indicatif::ProgressBar,
    /// How the commands sent are counted.
    pub(crate) commands: Commands,
    /// Also run the rows that time the stages of a guarded update and a sequenced apply.
    pub(crate) stages: bool,
    /// The queue `Worker` rows' batch size (`WorkerOptions::batch_size`); `None` keeps the
    /// library's default.
    pub(crate) batch_size: Option<usize>,
    /// The queue `Worker` rows' partitions (`QueueOptions::partitions`); `None` keeps the
    /// library's default.
    pub(crate) partitions: Option<u32>,
    /// The queue `Worker` rows' backlogs (`None`: 100, 10,000 and 100,000).
    pub(crate) backlogs: Option<Vec<usize>>,
    /// The server's process id when it runs on this machine (the embedded server), for
    /// the server-CPU column.
    pub(crate) server_pid: Option<u32>,
    /// The reference measured around every row (`None` while the reference row itself
    /// runs).
    pub(crate) reference: Option<Arc<Reference>>,
}

/// The reference workload and its latest rate, for [`Load::reference_around`].
#[derive(Debug)]
pub(crate) struct Reference {
    coll: mongodb::Collection<Document>,
    /// The reference's ops/s in its latest measurement (the reference row, then the burst
    /// after each row).
    last: std::sync::Mutex<f64>,
}

impl Load {
    /// CPU time the server process has used so far (user + system), when it runs on this
    /// machine and `/proc` is readable; the difference of two readings is what a row cost
    /// the server, which other load on the machine disturbs far less than wall-clock time.
    pub(crate) fn server_cpu(&self) -> Option<Duration> {
        process_cpu(&self.server_pid?.to_string())
    }

    /// CPU time this process (the bench's client: the driver, the workers, the handlers)
    /// has used so far, like [`Load::server_cpu`]. On this 2-core machine the two share
    /// the cores, so client time per item bounds the rate as much as the server's.
    pub(crate) fn client_cpu(&self) -> Option<Duration> {
        process_cpu("self")
    }

    /// Server CPU microseconds per item between `before` (a [`Load::server_cpu`]
    /// reading) and now.
    pub(crate) fn server_cpu_per_op(&self, before: Option<Duration>, ops: u64) -> Option<f64> {
        per_item(self.server_cpu()?.checked_sub(before?)?, ops)
    }

    /// Client CPU microseconds per item between `before` (a [`Load::client_cpu`]
    /// reading) and now.
    pub(crate) fn client_cpu_per_op(&self, before: Option<Duration>, ops: u64) -> Option<f64> {
        per_item(self.client_cpu()?.checked_sub(before?)?, ops)
    }

    /// The reference's rate around a row that has just ended: the reference runs again
    /// (same workers, a quarter of the duration, at least 250 ms), and the result is the
    /// mean of that rate and the one measured just before the row. `None` without a
    /// reference (the reference row itself).
    ///
    /// # Errors
    /// A database error of the reference's writes.
    pub(crate) async fn reference_around(&self) -> anyhow::Result<Option<f64>> {
        let Some(reference) = &self.reference else {
            return Ok(None);
        };
        let before = *reference
            .last
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?;
        let burst = (self.duration / 4).max(Duration::from_millis(250));
        let coll = reference.coll.clone();
        let (ops, elapsed, _) =
            run_tasks(self.workers, burst, move |_| reference_op(coll.clone())).await?;
        #[allow(clippy::cast_precision_loss)]
        let after = ops as f64 / elapsed;
        *reference
            .last
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))? = after;
        Ok(Some((before + after) / 2.0))
    }

    /// Commands sent so far; the difference of two readings is the round trips sent in
    /// between.
    ///
    /// # Errors
    /// The server's `serverStatus` error ([`Commands::Server`]).
    pub(crate) async fn commands_sent(&self) -> anyhow::Result<u64> {
        match &self.commands {
            Commands::Driver(started) => Ok(started.load(Ordering::Relaxed)),
            Commands::Server(client) => server_commands(client).await,
        }
    }
}

/// How the bench counts the commands (round trips) a row sends.
#[derive(Debug, Clone)]
pub(crate) enum Commands {
    /// The server's own counters (`serverStatus.metrics.commands`), for the embedded
    /// server, which only this bench talks to: exact, and no cost on the client.
    Server(Client),
    /// Driver command monitoring (a server given with `--uri` may have other clients):
    /// every started command increments the counter. The driver then builds each event's
    /// command and reply as a `Document`, client time that grows with their size.
    Driver(Arc<AtomicU64>),
}

/// Commands the server has received, by its `serverStatus.metrics.commands` counters,
/// leaving out `serverStatus` (these readings) and the handshake/heartbeat commands
/// (driver monitoring does not report those either).
async fn server_commands(client: &Client) -> anyhow::Result<u64> {
    const NOT_COUNTED: [&str; 4] = ["serverStatus", "hello", "isMaster", "ismaster"];
    let status = client
        .database("admin")
        .run_command(doc! { "serverStatus": 1 })
        .await?;
    let commands = status
        .get_document("metrics")
        .and_then(|m| m.get_document("commands"))
        .map_err(|e| anyhow::anyhow!("serverStatus without metrics.commands: {e}"))?;
    // Each command's counters are `{total, failed, …}`; MongoDB and the embedded server
    // report `total` as an int64 (an int32 is taken too).
    let total = commands
        .iter()
        .filter(|(name, _)| !NOT_COUNTED.contains(&name.as_str()))
        .filter_map(
            |(_, counters)| match counters.as_document()?.get("total")? {
                mongodb::bson::Bson::Int64(n) => u64::try_from(*n).ok(),
                mongodb::bson::Bson::Int32(n) => u64::try_from(*n).ok(),
                _ => None,
            },
        )
        .sum();
    Ok(total)
}

/// User + system CPU time of process `pid` (`self` for this one) from `/proc/<pid>/stat`.
fn process_cpu(pid: &str) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) closed by ')'.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on every Linux this runs on.
    Some(Duration::from_millis(ticks * 10))
}

/// Microseconds of `used` per item (`None` without items).
pub(crate) fn per_item(used: Duration, ops: u64) -> Option<f64> {
    #[allow(clippy::cast_precision_loss)]
    (ops > 0).then(|| used.as_secs_f64() * 1e6 / ops as f64)
}

/// Round trips per item: `commands` started for `ops` items (NaN without items).
pub(crate) fn per_op(commands: u64, ops: u64) -> f64 {
    if ops == 0 {
        return f64::NAN;
    }
    #[allow(clippy::cast_precision_loss)]
    let r = commands as f64 / ops as f64;
    r
}

/// One measured workload.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct BenchRow {
    pub(crate) name: String,
    pub(crate) workers: usize,
    /// Items completed (jobs, applies, acquire+release pairs…).
    pub(crate) ops: u64,
    pub(crate) ops_per_sec: f64,
    /// Latency of one call of the workload's operation, microseconds.
    pub(crate) p50_us: u64,
    pub(crate) p99_us: u64,
    /// ops/s divided by the reference `update_one` ops/s around this row
    /// ([`Load::reference_around`]).
    pub(crate) ratio: f64,
    /// The reference's ops/s the ratio divides by (the mean of its rate just before and
    /// just after the row).
    pub(crate) reference_ops_per_sec: f64,
    /// Commands sent to the server per item, while measured ([`Commands`]).
    pub(crate) round_trips_per_op: f64,
    /// The server process's CPU time per item, microseconds (embedded server only: it
    /// runs on this machine), while measured.
    pub(crate) server_cpu_us_per_op: Option<f64>,
    /// The bench process's own CPU time per item (client side: driver, workers,
    /// handlers), microseconds, while measured.
    pub(crate) client_cpu_us_per_op: Option<f64>,
    /// Rounds this row's numbers are the median of (1 for a single run). The last four
    /// fields are [`aggregate`]'s, which every run's rows go through: a row as measured
    /// has 1 round, no `ratios` and a NaN range.
    pub(crate) rounds: usize,
    /// Each round's ratio, in round order (one entry for a single run).
    pub(crate) ratios: Vec<f64>,
    /// The lowest of `ratios` (the ratio itself for a single run).
    pub(crate) ratio_min: f64,
    /// The highest of `ratios` (the ratio itself for a single run).
    pub(crate) ratio_max: f64,
}

/// Runs `op(worker)` on `load.workers` tasks until `load.duration` has passed. Each call
/// is one measured operation; its `Ok(n)` counts `n` items (a batch claim of 10 jobs
/// returns 10, a failed attempt that did no work returns 0).
pub(crate) async fn measure<F, Fut>(name: &str, load: &Load, op: F) -> anyhow::Result<BenchRow>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<u64>> + Send,
{
    load.progress
        .set_message(format!("{name} × {} workers", load.workers));
    let commands_before = load.commands_sent().await?;
    let cpu_before = load.server_cpu();
    let client_before = load.client_cpu();
    let (ops, elapsed, hist) = run_tasks(load.workers, load.duration, op).await?;
    let commands = load.commands_sent().await?.saturating_sub(commands_before);
    let server_cpu_us_per_op = load.server_cpu_per_op(cpu_before, ops);
    let client_cpu_us_per_op = load.client_cpu_per_op(client_before, ops);
    #[allow(clippy::cast_precision_loss)]
    let ops_per_sec = ops as f64 / elapsed;
    let reference = load.reference_around().await?.unwrap_or(f64::NAN);
    Ok(BenchRow {
        name: name.to_owned(),
        workers: load.workers,
        ops,
        ops_per_sec,
        p50_us: hist.value_at_quantile(0.5),
        p99_us: hist.value_at_quantile(0.99),
        ratio: ops_per_sec / reference,
        reference_ops_per_sec: reference,
        round_trips_per_op: per_op(commands, ops),
        server_cpu_us_per_op,
        client_cpu_us_per_op,
        rounds: 1,
        ratios: Vec::new(),
        ratio_min: f64::NAN,
        ratio_max: f64::NAN,
    })
}

/// Runs `op(worker)` on `workers` tasks until `duration` has passed: the items counted,
/// the seconds it took, and the latency histogram of the calls.
async fn run_tasks<F, Fut>(
    workers: usize,
    duration: Duration,
    op: F,
) -> anyhow::Result<(u64, f64, Histogram<u64>)>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<u64>> + Send,
{
    let op = Arc::new(op);
    let items = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::new();
    for worker in 0..workers {
        let op = Arc::clone(&op);
        let items = Arc::clone(&items);
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new(3)?;
            while Instant::now() < deadline {
                let t = Instant::now();
                let n = op(worker).await?;
                let us = u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX);
                hist.record(us.max(1))?;
                items.fetch_add(n, Ordering::Relaxed);
            }
            anyhow::Ok(hist)
        }));
    }
    let mut hist = Histogram::<u64>::new(3)?;
    for task in tasks {
        hist.add(task.await??)?;
    }
    Ok((
        items.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64(),
        hist,
    ))
}

/// The reference row's name.
pub(crate) const REFERENCE: &str = "update_one (reference)";

/// The reference: `update_one({_id}, {$inc})` on one of 1,000 documents. Returns the
/// reference row and the handle [`Load::reference_around`] measures it again with.
pub(crate) async fn reference(
    db: &Database,
    load: &Load,
) -> anyhow::Result<(BenchRow, Arc<Reference>)> {
    let coll = db.collection::<Document>("bench_reference");
    let docs: Vec<Document> = (0..1000_i64)
        .map(|i| doc! { "_id": i, "n": 0_i64 })
        .collect();
    coll.insert_many(docs).await?;
    let c = coll.clone();
    let row = measure(REFERENCE, load, move |_| reference_op(c.clone())).await?;
    let reference = Arc::new(Reference {
        coll,
        last: std::sync::Mutex::new(row.ops_per_sec),
    });
    let row = BenchRow {
        ratio: 1.0,
        reference_ops_per_sec: row.ops_per_sec,
        ..row
    };
    Ok((row, reference))
}

/// One call of the reference workload.
async fn reference_op(coll: mongodb::Collection<Document>) -> anyhow::Result<u64> {
    let id = rand::random_range(0..1000_i64);
    coll.update_one(doc! { "_id": id }, doc! { "$inc": { "n": 1 } })
        .await?;
    Ok(1)
}

/// Arguments of `docwarden bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    conn: ConnArgs,
    /// Worker counts to sweep, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "8")]
    workers: Vec<usize>,
    /// Seconds per workload.
    #[arg(long, default_value_t = 5)]
    duration: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also write the markdown table of the same rows to this file.
    #[arg(long)]
    markdown: Option<std::path::PathBuf>,
    /// Also time the stages of a guarded update and a sequenced apply (extra rows).
    #[arg(long)]
    stages: bool,
    /// Run only these modules' rows (comma separated: guard, locks, queue, sequence,
    /// wakeup, limits; `worker` is the queue's `Worker` rows without the seed loop's); the
    /// reference row always runs.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Batch size of the queue `Worker` rows (jobs per claim; default: the library's).
    #[arg(long)]
    batch_size: Option<usize>,
    /// Partitions of the queue `Worker` rows' queues (1 to 1024; default: the library's,
    /// 256). On the embedded server a batch claim's read costs about one partition's due
    /// jobs, so a backlog of millions wants more partitions (`docs/queue.md`, "Partitions").
    #[arg(long)]
    partitions: Option<u32>,
    /// Backlogs of the queue rows, comma separated [default: 100,10000,100000].
    #[arg(long, value_delimiter = ',')]
    backlogs: Vec<usize>,
    /// Run the whole sweep this many times (1 to 50) and report each row's median, with
    /// every round's ratio and their range: one run's ratios move by ±15 % between runs
    /// on a shared machine.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
}

/// Most rounds `--rounds` accepts.
const MAX_ROUNDS: usize = 50;

/// `docwarden bench`: the sweep `--rounds` times, then one table (or JSON array) of the
/// rows' medians.
pub(crate) async fn run(args: Args) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.duration > 0, "--duration must be at least 1 second");
    anyhow::ensure!(
        (1..=MAX_ROUNDS).contains(&args.rounds),
        "--rounds must be between 1 and {MAX_ROUNDS} (got {})",
        args.rounds
    );
    anyhow::ensure!(
        !args.workers.is_empty() && args.workers.iter().all(|w| *w > 0),
        "--workers must list counts of at least 1"
    );
    if let Some(n) = args.partitions {
        anyhow::ensure!(
            (1..=docwarden::queue::MAX_PARTITIONS).contains(&n),
            "--partitions must be between 1 and {} (got {n})",
            docwarden::queue::MAX_PARTITIONS
        );
    }
    let session = args.conn.open(args.json).await?;
    let timeout = Duration::from_secs(30);
    let (client, commands) = if session.embedded() {
        let client = bench_client(&session.uri(), timeout, None).await?;
        (client.clone(), Commands::Server(client))
    } else {
        let started = Arc::new(AtomicU64::new(0));
        let client = bench_client(&session.uri(), timeout, Some(&started)).await?;
        (client, Commands::Driver(started))
    };
    anyhow::ensure!(
        args.backlogs.iter().all(|b| *b > 0),
        "--backlogs must list backlogs of at least 1 job"
    );
    let server_pid = if session.embedded() {
        server_pid(&client).await
    } else {
        None
    };
    let progress = if args.json {
        indicatif::ProgressBar::hidden()
    } else {
        let bar = indicatif::ProgressBar::new_spinner();
        bar.set_style(indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed}] {prefix}{msg}",
        )?);
        bar.enable_steady_tick(Duration::from_millis(200));
        bar
    };
    // Every worker count's load; `sweep` sets the worker count and the reference.
    let load = Load {
        workers: 0,
        duration: Duration::from_secs(args.duration),
        progress: progress.clone(),
        commands,
        stages: args.stages,
        batch_size: args.batch_size,
        partitions: args.partitions,
        backlogs: (!args.backlogs.is_empty()).then(|| args.backlogs.clone()),
        server_pid,
        reference: None,
    };
    let mut rounds = Vec::with_capacity(args.rounds);
    for round in 1..=args.rounds {
        if args.rounds > 1 {
            progress.set_prefix(format!("round {round}/{} · ", args.rounds));
        }
        rounds.push(sweep(&client, &load, &args.workers, &args.only).await?);
    }
    progress.finish_and_clear();
    let rows = aggregate(rounds);
    if let Some(path) = &args.markdown {
        std::fs::write(path, markdown(&rows) + &targets::markdown(&rows))?;
    }
    if args.json {
        crate::output::print_json(&rows)?;
    } else {
        print!("{}{}", markdown(&rows), targets::markdown(&rows));
    }
    Ok(ExitCode::SUCCESS)
}

/// One round: for every worker count, a fresh database, the reference row and the
/// workloads. `load` is every worker count's load; the worker count and the reference
/// are set here.
async fn sweep(
    client: &Client,
    load: &Load,
    worker_counts: &[usize],
    only: &[String],
) -> anyhow::Result<Vec<BenchRow>> {
    let mut rows = Vec::new();
    for &workers in worker_counts {
        let load = Load {
            workers,
            reference: None,
            ..load.clone()
        };
        let db = client.database(&format!("docwarden_bench_{:08x}", rand::random::<u32>()));
        let (row, reference) = reference(&db, &load).await?;
        let base = row.ops_per_sec;
        let load = Load {
            reference: Some(reference),
            ..load
        };
        let mut measured = vec![row];
        for row in workloads(&db, &load, only).await? {
            // Rows without a reference of their own (the wake-up latencies) divide by the
            // column's first reference.
            measured.push(if row.ratio.is_nan() {
                BenchRow {
                    ratio: row.ops_per_sec / base,
                    reference_ops_per_sec: base,
                    ..row
                }
            } else {
                row
            });
        }
        db.drop().await?;
        rows.extend(measured);
    }
    Ok(rows)
}

/// The rows of every round (each in the order it was measured) as one row per workload:
/// each number the median of its rounds, with each round's ratio and their range.
///
/// A row is matched across rounds by its name, its worker count and which occurrence of
/// that pair in its round it is (the wake-up rows run with one worker in every worker
/// count's sweep, so `--workers 1,8` has them twice per round, each with its own
/// reference). Rows keep the first round's order; a row missing from some round (not
/// expected) is the median of the rounds it has, and its `rounds` says how many.
pub(crate) fn aggregate(rounds: Vec<Vec<BenchRow>>) -> Vec<BenchRow> {
    let mut groups: Vec<Vec<BenchRow>> = Vec::new();
    let mut group_of: HashMap<(String, usize, usize), usize> = HashMap::new();
    for round in rounds {
        let mut seen: HashMap<(String, usize), usize> = HashMap::new();
        for row in round {
            let occurrence = seen.entry((row.name.clone(), row.workers)).or_default();
            let key = (row.name.clone(), row.workers, *occurrence);
            *occurrence += 1;
            let group = *group_of.entry(key).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            if let Some(group) = groups.get_mut(group) {
                group.push(row);
            }
        }
    }
    groups.into_iter().filter_map(combine).collect()
}

/// One row's rounds as one row (`None` for no rounds): see [`aggregate`].
fn combine(rows: Vec<BenchRow>) -> Option<BenchRow> {
    let f = |field: fn(&BenchRow) -> f64| median(rows.iter().map(field)).unwrap_or(f64::NAN);
    let opt = |field: fn(&BenchRow) -> Option<f64>| median(rows.iter().filter_map(field));
    let int = |field: fn(&BenchRow) -> u64| median_u64(rows.iter().map(field).collect());
    let ratios: Vec<f64> = rows.iter().map(|r| r.ratio).collect();
    let first = rows.first()?;
    Some(BenchRow {
        name: first.name.clone(),
        workers: first.workers,
        ops: int(|r| r.ops),
        ops_per_sec: f(|r| r.ops_per_sec),
        p50_us: int(|r| r.p50_us),
        p99_us: int(|r| r.p99_us),
        ratio: f(|r| r.ratio),
        reference_ops_per_sec: f(|r| r.reference_ops_per_sec),
        round_trips_per_op: f(|r| r.round_trips_per_op),
        server_cpu_us_per_op: opt(|r| r.server_cpu_us_per_op),
        client_cpu_us_per_op: opt(|r| r.client_cpu_us_per_op),
        rounds: rows.len(),
        // `f64::min`/`max` skip a NaN operand, so NaN stays only when every ratio is NaN.
        ratio_min: ratios.iter().copied().fold(f64::NAN, f64::min),
        ratio_max: ratios.iter().copied().fold(f64::NAN, f64::max),
        ratios,
    })
}

/// The median of `values`, NaNs left out (a round without items has a NaN round trips
/// per item): the middle value, or the mean of the two middle values of an even count;
/// `None` when no value is left.
fn median(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.filter(|x| !x.is_nan()).collect();
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if !v.len().is_multiple_of(2) {
        v.get(mid).copied()
    } else {
        Some((v.get(mid.checked_sub(1)?)? + v.get(mid)?) / 2.0)
    }
}

/// The median of `values` rounded to an integer (half up); 0 for no values.
fn median_u64(mut values: Vec<u64>) -> u64 {
    values.sort_unstable();
    let mid = values.len() / 2;
    match (
        mid.checked_sub(1).and_then(|m| values.get(m)),
        values.get(mid),
    ) {
        // `midpoint` rounds down; an odd sum is a half, rounded up.
        (Some(&a), Some(&b)) if values.len().is_multiple_of(2) => a.midpoint(b) + ((a ^ b) & 1),
        (_, Some(&m)) => m,
        _ => 0,
    }
}

/// The server's process id from `serverStatus` (MongoDB and secantusd-rs both report
/// it); used only for a server this command started on this machine.
async fn server_pid(client: &Client) -> Option<u32> {
    let status = client
        .database("admin")
        .run_command(doc! { "serverStatus": 1 })
        .await
        .ok()?;
    let pid = match status.get("pid")? {
        mongodb::bson::Bson::Int64(p) => *p,
        mongodb::bson::Bson::Int32(p) => i64::from(*p),
        _ => return None,
    };
    u32::try_from(pid).ok()
}

/// The bench's client to the same server (the session's client has already checked that
/// it answers); with `started`, every command it starts increments that counter (driver
/// command monitoring, see [`Commands::Driver`]).
async fn bench_client(
    uri: &str,
    timeout: Duration,
    started: Option<&Arc<AtomicU64>>,
) -> anyhow::Result<Client> {
    let mut options = ClientOptions::parse(uri).await?;
    options.server_selection_timeout = Some(timeout);
    options.connect_timeout = Some(timeout);
    options.app_name = Some("docwarden bench".into());
    if let Some(started) = started {
        let counter = Arc::clone(started);
        options.command_event_handler = Some(EventHandler::callback(move |event| {
            if let CommandEvent::Started(_) = event {
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    Ok(Client::with_options(options)?)
}

/// Every module's workloads (or those `only` names), in a fixed order.
async fn workloads(_db: &Database, _load: &Load, only: &[String]) -> anyhow::Result<Vec<BenchRow>> {
    let on = |m: &str| only.is_empty() || only.iter().any(|o| o == m);
    let mut rows = Vec::new();
    if on("guard") {
        rows.extend(guard::run(_db, _load).await?);
    }
    if on("locks") {
        rows.extend(locks::run(_db, _load).await?);
    }
    if on("queue") || on("worker") {
        // `worker`: the queue `Worker` rows without the seed loop's anchor rows.
        rows.extend(queue::run(_db, _load, on("queue")).await?);
    }
    if on("sequence") {
        rows.extend(sequence::run(_db, _load).await?);
    }
    if on("wakeup") {
        rows.extend(wakeup::run(_db, _load).await?);
    }
    if on(limits::NAME) {
        rows.extend(limits::run(_db, _load).await?);
    }
    Ok(rows)
}

/// Microseconds as a table cell, `—` when not measured.
fn micros(us: Option<f64>) -> String {
    us.map_or_else(|| "—".to_owned(), |us| format!("{us:.0}"))
}

/// The rows as a markdown table. With rounds (a row of more than one), a `ratio range`
/// column follows the ratio (the median): each row's lowest and highest ratio.
pub(crate) fn markdown(rows: &[BenchRow]) -> String {
    let rounds = rows.iter().map(|r| r.rounds).max().unwrap_or(1);
    let (range_head, range_align) = if rounds > 1 {
        (format!(" ratio range ({rounds} rounds) |"), "---:|")
    } else {
        (String::new(), "")
    };
    let mut out = format!(
        "| workload | workers | ops | ops/s | p50 (µs) | p99 (µs) | ratio to update_one |{range_head} rt/op | server CPU µs/op | client CPU µs/op | ref ops/s |\n|---|---:|---:|---:|---:|---:|---:|{range_align}---:|---:|---:|---:|\n",
    );
    for r in rows {
        let range = if rounds == 1 {
            String::new()
        } else if r.rounds == rounds {
            format!(" {:.2}–{:.2}× |", r.ratio_min, r.ratio_max)
        } else {
            format!(
                " {:.2}–{:.2}× ({} of {rounds} rounds) |",
                r.ratio_min, r.ratio_max, r.rounds
            )
        };
        out.push_str(&format!(
            "| {} | {} | {} | {:.0} | {} | {} | {:.2}× |{range} {:.2} | {} | {} | {:.0} |\n",
            r.name,
            r.workers,
            r.ops,
            r.ops_per_sec,
            r.p50_us,
            r.p99_us,
            r.ratio,
            r.round_trips_per_op,
            micros(r.server_cpu_us_per_op),
            micros(r.client_cpu_us_per_op),
            r.reference_ops_per_sec,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row as measured: `ratio` and `ops`, server CPU when given, no client CPU.
    fn row(name: &str, workers: usize, ratio: f64, ops: u64, cpu: Option<f64>) -> BenchRow {
        BenchRow {
            name: name.to_owned(),
            workers,
            ops,
            ops_per_sec: ratio * 1000.0,
            p50_us: ops,
            p99_us: ops,
            ratio,
            reference_ops_per_sec: 1000.0,
            round_trips_per_op: 1.0,
            server_cpu_us_per_op: cpu,
            client_cpu_us_per_op: None,
            rounds: 1,
            ratios: Vec::new(),
            ratio_min: f64::NAN,
            ratio_max: f64::NAN,
        }
    }

    #[test]
    fn an_odd_count_of_rounds_takes_the_middle_value_and_keeps_the_first_rounds_order() {
        let rows = aggregate(vec![
            vec![
                row(REFERENCE, 1, 1.0, 10, Some(5.0)),
                row("a", 1, 0.9, 7, None),
            ],
            // Another order in this round: the first round's stands.
            vec![
                row("a", 1, 0.5, 3, Some(2.0)),
                row(REFERENCE, 1, 1.0, 30, Some(1.0)),
            ],
            vec![
                row(REFERENCE, 1, 1.0, 20, Some(3.0)),
                row("a", 1, 0.6, 5, Some(4.0)),
            ],
        ]);
        let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, [REFERENCE, "a"]);
        let [reference, a] = rows.as_slice() else {
            panic!("two rows: {rows:?}");
        };
        assert_eq!((reference.ops, reference.p50_us), (20, 20));
        assert_eq!(reference.server_cpu_us_per_op, Some(3.0));
        assert_eq!(a.rounds, 3);
        assert_eq!(a.ratios, [0.9, 0.5, 0.6], "in round order");
        assert!((a.ratio - 0.6).abs() < 1e-12, "{a:?}");
        assert!((a.ops_per_sec - 600.0).abs() < 1e-9, "{a:?}");
        assert_eq!((a.ratio_min, a.ratio_max), (0.5, 0.9));
        assert_eq!(a.ops, 5);
        // The median of the two rounds that measured it.
        assert_eq!(a.server_cpu_us_per_op, Some(3.0));
        assert_eq!(a.client_cpu_us_per_op, None, "no round measured it");
    }

    #[test]
    fn an_even_count_of_rounds_takes_the_mean_of_the_two_middle_values() {
        let rows = aggregate(vec![
            vec![row("a", 8, 0.4, 3, Some(4.0))],
            vec![row("a", 8, 1.0, 10, None)],
            vec![row("a", 8, 0.6, 4, Some(8.0))],
            vec![row("a", 8, 0.5, 6, None)],
        ]);
        let [a] = rows.as_slice() else {
            panic!("one row: {rows:?}");
        };
        assert_eq!(a.rounds, 4);
        assert!((a.ratio - 0.55).abs() < 1e-12, "{a:?}");
        assert_eq!((a.ratio_min, a.ratio_max), (0.4, 1.0));
        // (4 + 6) / 2 = 5; two values of an odd sum round up: (4 + 8) / 2 = 6 below.
        assert_eq!(a.ops, 5);
        // Two rounds have a server CPU reading: their mean.
        assert_eq!(a.server_cpu_us_per_op, Some(6.0));
        let rows = aggregate(vec![
            vec![row("b", 1, 0.5, 3, None)],
            vec![row("b", 1, 0.5, 4, None)],
        ]);
        assert_eq!(rows.first().map(|r| r.ops), Some(4), "3.5 rounds up");
    }

    #[test]
    fn a_single_round_is_the_row_as_measured_with_one_ratio() {
        let measured = row("a", 4, 0.7, 9, Some(2.5));
        let rows = aggregate(vec![vec![measured.clone()]]);
        let [a] = rows.as_slice() else {
            panic!("one row: {rows:?}");
        };
        assert_eq!((a.rounds, a.ratios.as_slice()), (1, [0.7].as_slice()));
        assert_eq!((a.ratio, a.ratio_min, a.ratio_max), (0.7, 0.7, 0.7));
        assert_eq!((a.ops, a.ops_per_sec), (measured.ops, measured.ops_per_sec));
        assert_eq!(a.server_cpu_us_per_op, Some(2.5));
        assert_eq!(
            markdown(&rows),
            markdown(std::slice::from_ref(&measured)),
            "the table of one round has no range column"
        );
        assert!(!markdown(&rows).contains("range"));
    }

    #[test]
    fn rows_repeated_within_a_round_stay_apart_and_a_missing_row_counts_its_rounds() {
        // The wake-up rows run with one worker in every worker count's sweep.
        let rows = aggregate(vec![
            vec![
                row("wake", 1, 0.2, 1, None),
                row("x", 8, 0.9, 1, None),
                row("wake", 1, 0.4, 1, None),
            ],
            vec![row("wake", 1, 0.3, 1, None), row("wake", 1, 0.5, 1, None)],
        ]);
        let got: Vec<(&str, usize, f64)> = rows
            .iter()
            .map(|r| (r.name.as_str(), r.rounds, r.ratio))
            .collect();
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got.get(1), Some(&("x", 1, 0.9)));
        for ((_, rounds, ratio), want) in [got[0], got[2]].into_iter().zip([0.25, 0.45]) {
            assert_eq!(rounds, 2);
            assert!((ratio - want).abs() < 1e-12, "{got:?}");
        }
        let table = markdown(&rows);
        assert!(table.contains("| ratio range (2 rounds) |"), "{table}");
        assert!(
            table.contains("| 0.90× | 0.90–0.90× (1 of 2 rounds) |"),
            "{table}"
        );
        assert!(table.contains("| 0.25× | 0.20–0.30× |"), "{table}");
    }
}
