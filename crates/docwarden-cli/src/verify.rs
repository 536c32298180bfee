//! `docwarden verify`: runs each module's workload under concurrency and faults, records
//! every operation, and checks the history (see `docwarden::check`).
//!
//! Faults: `pause` (a worker sleeps past its lease in the middle of its critical section),
//! `kill` (a worker task is aborted mid-operation and replaced), `skew` (each worker's clock
//! is shifted by up to ±30 s), `restart` (the embedded server is restarted on the same data),
//! `latency` and `reset` (through a TCP proxy in front of the server). `--control` runs the
//! same workloads with the safeguard disabled, and must report violations.

mod guard;
mod locks;
mod proxy;
mod queue;
mod report;
mod sequence;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use docwarden::check::{Event, History, OpOutcome, Violation, count_by_kind};
use docwarden::clock::{ClockOptions, LocalClock, TimeSource};
use indicatif::{ProgressBar, ProgressStyle};
use mongodb::{Client, Database};
use rand::{Rng, SeedableRng};

use crate::conn::ConnArgs;

/// Arguments of `docwarden verify`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Which module to verify.
    module: Module,
    #[command(flatten)]
    conn: ConnArgs,
    /// Concurrent workers per workload.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Seconds each workload runs.
    #[arg(long, default_value_t = 20)]
    duration: u64,
    /// Faults to inject, comma separated: pause, kill, skew, restart, latency, reset.
    #[arg(long, value_delimiter = ',')]
    faults: Vec<Fault>,
    /// Seed of the random choices (workers' clocks, fault timing, operations).
    #[arg(long)]
    seed: Option<u64>,
    /// Disable the safeguards (no fencing, read-then-write, client clocks): must fail.
    /// Without --faults, a control run injects `pause`.
    #[arg(long)]
    control: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// Write a self-contained HTML report with a timeline to this file.
    #[arg(long)]
    report: Option<PathBuf>,
}

/// A module to verify.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Module {
    Locks,
    Queue,
    Sequence,
    Guard,
    All,
}

/// A fault to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub(crate) enum Fault {
    Pause,
    Kill,
    Skew,
    Restart,
    Latency,
    Reset,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Pause => "pause",
            Fault::Kill => "kill",
            Fault::Skew => "skew",
            Fault::Restart => "restart",
            Fault::Latency => "latency",
            Fault::Reset => "reset",
        }
    }
}

/// What a workload needs: where to write, what to record, which faults to inject.
pub(crate) struct Ctx {
    /// A client for the workers (through the proxy when latency/reset are on).
    pub(crate) client: Client,
    /// The workload's database.
    pub(crate) db: Database,
    pub(crate) history: Arc<History>,
    pub(crate) faults: Vec<Fault>,
    pub(crate) control: bool,
    pub(crate) workers: usize,
    pub(crate) duration: Duration,
    pub(crate) seed: u64,
    injected: Mutex<BTreeMap<&'static str, u64>>,
    pub(crate) progress: ProgressBar,
}

/// A worker body: given its process number, runs until the deadline.
type WorkerFn = Arc<dyn Fn(u32) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

impl Ctx {
    pub(crate) fn has(&self, fault: Fault) -> bool {
        self.faults.contains(&fault)
    }

    /// Counts an injected fault and records it in the history (for the timeline).
    pub(crate) fn injected(&self, fault: Fault, process: u32, start_us: u64, end_us: u64) {
        *self
            .injected
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(fault.name())
            .or_default() += 1;
        self.history
            .push(Event::new(process, "fault", fault.name(), start_us, end_us));
    }

    /// A deterministic random generator for `process` (from `--seed`).
    pub(crate) fn rng(&self, process: u32) -> rand::rngs::StdRng {
        rand::rngs::StdRng::seed_from_u64(self.seed ^ (u64::from(process) << 32) ^ 0x9E37_79B9)
    }

    /// The clock of one worker: shifted by up to ±30 s under `skew`. Safe runs estimate
    /// the server clock from it; control runs trust it.
    pub(crate) fn clock(&self, process: u32) -> anyhow::Result<TimeSource> {
        let offset_ms = if self.has(Fault::Skew) {
            let offset = self.rng(process).random_range(-30_000..=30_000_i64);
            self.injected(Fault::Skew, process, 0, 0);
            offset
        } else {
            0
        };
        let local = LocalClock::with_offset_ms(offset_ms);
        let options = ClockOptions::default();
        Ok(if self.control {
            TimeSource::local_unchecked(local, options)?
        } else {
            TimeSource::server_with_local(self.client.clone(), local, options)?
        })
    }

    /// Under `pause`, with probability `p`, sleeps for `how_long` and records the fault.
    pub(crate) async fn maybe_pause(
        &self,
        rng: &mut impl Rng,
        process: u32,
        p: f64,
        how_long: Duration,
    ) -> bool {
        if !self.has(Fault::Pause) || !rng.random_bool(p) {
            return false;
        }
        let start = self.history.now_us();
        tokio::time::sleep(how_long).await;
        self.injected(Fault::Pause, process, start, self.history.now_us());
        true
    }

    /// Runs `worker` on `self.workers` tasks until the deadline. Under `kill`, every few
    /// seconds one worker is aborted mid-operation and replaced by a new process.
    pub(crate) async fn supervise<F, Fut>(&self, workload: &'static str, body: F)
    where
        F: Fn(u32) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let worker: WorkerFn = Arc::new(move |process| {
            let run = body(process);
            Box::pin(async move {
                if let Err(e) = run.await {
                    tracing::warn!(process, %e, workload, "worker stopped");
                }
            })
        });
        let deadline = Instant::now() + self.duration;
        let mut tasks: Vec<(u32, tokio::task::JoinHandle<()>)> = (0..self.workers)
            .map(|p| {
                let p = u32::try_from(p).unwrap_or(u32::MAX);
                (p, tokio::spawn(worker(p)))
            })
            .collect();
        let mut next_process = u32::try_from(self.workers).unwrap_or(u32::MAX);
        let mut rng = self.rng(u32::MAX);
        let kill_every = (self.duration / 6).max(Duration::from_millis(500));
        let started = Instant::now();
        let mut next_kill = started + kill_every;
        while Instant::now() < deadline {
            let step =
                Duration::from_millis(250).min(deadline.saturating_duration_since(Instant::now()));
            tokio::time::sleep(step).await;
            self.progress
                .set_position(started.elapsed().as_secs().min(self.duration.as_secs()));
            if Instant::now() < next_kill {
                continue;
            }
            next_kill += kill_every;
            if self.has(Fault::Kill) && Instant::now() < deadline && !tasks.is_empty() {
                let i = rng.random_range(0..tasks.len());
                let (victim, handle) = &tasks[i];
                let at = self.history.now_us();
                handle.abort();
                self.injected(Fault::Kill, *victim, at, at);
                tasks[i] = (next_process, tokio::spawn(worker(next_process)));
                next_process += 1;
            }
        }
        for (_, handle) in tasks {
            let _ = handle.await;
        }
    }

    /// Records an operation's outcome from a `Result`: `Ok` → Ok, a retryable/network error
    /// → Indeterminate, any other error → Failed.
    pub(crate) fn outcome_of<T>(result: &docwarden::Result<T>) -> OpOutcome {
        match result {
            Ok(_) => OpOutcome::Ok,
            Err(e) if e.is_retryable() => OpOutcome::Indeterminate,
            Err(_) => OpOutcome::Failed,
        }
    }
}

/// What one workload found.
#[derive(Debug, serde::Serialize)]
pub(crate) struct WorkloadResult {
    pub(crate) workload: &'static str,
    pub(crate) operations: u64,
    pub(crate) faults: BTreeMap<&'static str, u64>,
    pub(crate) violations_by_kind: BTreeMap<&'static str, usize>,
    /// The first violations found (at most 20).
    pub(crate) violations: Vec<Violation>,
    #[serde(skip)]
    pub(crate) events: Vec<Event>,
}

/// A workload's own findings, before faults are added.
pub(crate) struct Findings {
    pub(crate) operations: u64,
    pub(crate) violations: Vec<Violation>,
}

pub(crate) async fn run(args: Args) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
    anyhow::ensure!(args.duration > 0, "--duration must be at least 1 second");
    let mut session = args.conn.open(args.json).await?;
    let needs_embedded = args.faults.contains(&Fault::Restart);
    anyhow::ensure!(
        !needs_embedded || session.embedded(),
        "the restart fault needs the embedded server (run without --uri / MONGODB_URI)"
    );
    let seed = args.seed.unwrap_or_else(rand::random);
    let mut args = args;
    if args.control && args.faults.is_empty() {
        // The safeguards exist for paused holders: a control run without pauses would prove
        // little, so it brings them along. (`--faults pause,skew` adds wrong client clocks,
        // which the control trusts; under skew the queue control mostly starves instead.)
        args.faults = vec![Fault::Pause];
    }
    let modules = match args.module {
        Module::All => vec![
            Module::Locks,
            Module::Queue,
            Module::Sequence,
            Module::Guard,
        ],
        m => vec![m],
    };
    if !args.json {
        eprintln!(
            "docwarden verify: {} workload(s) × {} s, {} workers, faults [{}], seed {seed}{}",
            modules.len(),
            args.duration,
            args.workers,
            args.faults
                .iter()
                .map(|f| f.name())
                .collect::<Vec<_>>()
                .join(","),
            if args.control {
                ", CONTROL (safeguards off)"
            } else {
                ""
            }
        );
    }
    let mut results = Vec::new();
    for module in modules {
        let result = run_module(&args, &mut session, module, seed).await?;
        results.push(result);
    }
    let total: usize = results
        .iter()
        .map(|r| r.violations_by_kind.values().sum::<usize>())
        .sum();
    if let Some(path) = &args.report {
        std::fs::write(path, report::html(&results, args.control, seed))?;
        if !args.json {
            eprintln!("docwarden verify: report written to {}", path.display());
        }
    }
    if args.json {
        crate::output::print_json(&serde_json::json!({
            "seed": seed,
            "control": args.control,
            "faults": args.faults.iter().map(|f| f.name()).collect::<Vec<_>>(),
            "violations": total,
            "workloads": results,
        }))?;
    } else {
        print_summary(&results);
        println!(
            "\n{}",
            if total == 0 {
                "verify: 0 violations".to_owned()
            } else {
                format!("verify: {total} violation(s)")
            }
        );
    }
    Ok(if total == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

async fn run_module(
    args: &Args,
    session: &mut crate::conn::Session,
    module: Module,
    seed: u64,
) -> anyhow::Result<WorkloadResult> {
    let direct_uri = session.uri();
    let proxy = if args.faults.contains(&Fault::Latency) || args.faults.contains(&Fault::Reset) {
        let addr = upstream_addr(&direct_uri)?;
        Some(proxy::Proxy::start(addr).await?)
    } else {
        None
    };
    let uri = proxy
        .as_ref()
        .map_or_else(|| direct_uri.clone(), proxy::Proxy::uri);
    let client = docwarden_server::connect(&uri, Duration::from_secs(10)).await?;
    let db_name = format!(
        "docwarden_verify_{}_{:08x}",
        module_name(module),
        rand::random::<u32>()
    );
    let progress = if args.json {
        ProgressBar::hidden()
    } else {
        let bar = ProgressBar::new(args.duration);
        bar.set_style(
            ProgressStyle::with_template("{prefix:>9} [{bar:30}] {pos}/{len} s {msg}")?
                .progress_chars("=> "),
        );
        bar.set_prefix(module_name(module));
        bar
    };
    let ctx = Arc::new(Ctx {
        db: client.database(&db_name),
        client: client.clone(),
        history: Arc::new(History::new()),
        faults: args.faults.clone(),
        control: args.control,
        workers: args.workers,
        duration: Duration::from_secs(args.duration),
        seed,
        injected: Mutex::new(BTreeMap::new()),
        progress: progress.clone(),
    });
    let nemesis = nemesis(&ctx, session, proxy.as_ref());
    let workload = workloads::run(module, Arc::clone(&ctx));
    let (findings, nemesis) = tokio::join!(workload, nemesis);
    nemesis?;
    let findings = findings?;
    progress.finish_and_clear();
    // Clean up through a direct connection (the proxy may be resetting).
    let direct = docwarden_server::connect(&direct_uri, Duration::from_secs(10)).await?;
    direct.database(&db_name).drop().await?;
    let faults = ctx
        .injected
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let mut violations = findings.violations;
    let violations_by_kind = count_by_kind(&violations).into_iter().collect();
    violations.truncate(20);
    Ok(WorkloadResult {
        workload: module_name(module),
        operations: findings.operations,
        faults,
        violations_by_kind,
        violations,
        events: ctx.history.events(),
    })
}

/// Server-side faults on a schedule: restart the embedded server, add latency, reset
/// connections. Runs for the workload's duration.
async fn nemesis(
    ctx: &Ctx,
    session: &mut crate::conn::Session,
    proxy: Option<&proxy::Proxy>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let mut rng = ctx.rng(u32::MAX - 1);
    let period = (ctx.duration / 4).max(Duration::from_secs(1));
    tokio::time::sleep(period / 2).await;
    while Instant::now() + Duration::from_secs(1) < deadline {
        if ctx.has(Fault::Restart)
            && let Some(server) = session.target.embedded()
        {
            let start = ctx.history.now_us();
            server.restart().await?;
            ctx.injected(Fault::Restart, u32::MAX, start, ctx.history.now_us());
        }
        if let Some(proxy) = proxy {
            if ctx.has(Fault::Latency) {
                let start = ctx.history.now_us();
                proxy.set_latency(Duration::from_millis(rng.random_range(5..40)));
                tokio::time::sleep(Duration::from_millis(800)).await;
                proxy.set_latency(Duration::ZERO);
                ctx.injected(Fault::Latency, u32::MAX, start, ctx.history.now_us());
            }
            if ctx.has(Fault::Reset) {
                let at = ctx.history.now_us();
                proxy.reset_all();
                ctx.injected(Fault::Reset, u32::MAX, at, at);
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::time::sleep(period.min(left)).await;
    }
    Ok(())
}

fn upstream_addr(uri: &str) -> anyhow::Result<std::net::SocketAddr> {
    let rest = uri.split_once("://").map_or(uri, |(_, r)| r);
    let host = rest.split(['/', '?']).next().unwrap_or(rest);
    let host = host.rsplit('@').next().unwrap_or(host);
    host.parse().map_err(|_| {
        anyhow::anyhow!("latency/reset faults need a single 127.0.0.1:PORT server, not {host}")
    })
}

fn module_name(m: Module) -> &'static str {
    match m {
        Module::Locks => "locks",
        Module::Queue => "queue",
        Module::Sequence => "sequence",
        Module::Guard => "guard",
        Module::All => "all",
    }
}

fn print_summary(results: &[WorkloadResult]) {
    println!(
        "\n{:<9} {:>10}  {:<36} violations",
        "workload", "operations", "faults injected"
    );
    for r in results {
        let faults = if r.faults.is_empty() {
            "-".to_owned()
        } else {
            r.faults
                .iter()
                .map(|(k, n)| format!("{k}={n}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let violations = if r.violations_by_kind.is_empty() {
            "0".to_owned()
        } else {
            r.violations_by_kind
                .iter()
                .map(|(k, n)| format!("{k}={n}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        println!(
            "{:<9} {:>10}  {:<36} {violations}",
            r.workload, r.operations, faults
        );
    }
    for r in results {
        for v in r.violations.iter().take(5) {
            println!("  {}: {} on {}: {}", r.workload, v.kind, v.key, v.detail);
        }
    }
}

mod workloads {
    //! Dispatch to one workload per module.
    use super::{Ctx, Findings, Module, guard, locks, queue, sequence};
    use std::sync::Arc;

    pub(super) async fn run(module: Module, ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
        match module {
            Module::Locks => locks::run(ctx).await,
            Module::Queue => queue::run(ctx).await,
            Module::Sequence => sequence::run(ctx).await,
            Module::Guard => guard::run(ctx).await,
            Module::All => {
                anyhow::bail!("`all` is expanded into the four modules before this point")
            }
        }
    }
}
