//! Workers as OS processes: `verify` starts each worker as a child process (its own
//! binary, in the hidden `verify-worker` mode), which runs one module's `worker` and
//! streams its history back as JSON lines on stdout ([`docwarden::check::Entry`]: an
//! `invoke` when an operation starts, the event when it ends). The supervisor merges every
//! process's history into the run's, and its nemesis can `SIGSTOP` a process past its lease
//! and `SIGCONT` it (a real pause: GC, swap, VM migration), `SIGKILL` it mid-operation and
//! start a replacement with a new process id, or ask it to abort its worker task (`kill`).
//!
//! An operation announced but never completed by a process that died is recorded as
//! indeterminate, ending when the supervisor saw the process's output close (Jepsen's
//! `:info`). A control run records it as failed instead — what a client that takes "no
//! reply" for "not applied" believes — and the checkers must then find the operations
//! that landed all the same (the control of `sigkill`: a crash breaks no guarantee of
//! docwarden by itself, but it does break a history that forgets it cannot know). Limits: the processes share a time base through `CLOCK_MONOTONIC`, which is
//! system-wide on Linux (and on macOS), so the run stays on one machine; a worker process
//! exits when its stdin closes, so it does not outlive a verify that died.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use docwarden::check::{Entry, Event, History, OpOutcome};
use docwarden_workloads::{Mode, Process};
use indicatif::ProgressBar;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::args::{Fault, FaultArg, Module, WorkersAs};
use super::context::{Ctx, FAULT_OP, Slot};
use super::{election, guard, locks, queue, rwlock, sequence};

/// The hidden subcommand that runs one worker process.
pub(crate) const SUBCOMMAND: &str = "verify-worker";

/// The line on a worker's stdin that asks it to abort its worker task (the `kill` fault).
const ABORT: &str = "abort";

/// How long the supervisor waits for a worker process to finish after the deadline before
/// it kills it.
const GRACE: Duration = Duration::from_secs(30);

/// Arguments of the hidden `docwarden verify-worker`: one worker of one module, as a
/// process started by `docwarden verify` (not meant to be run by hand).
#[derive(Debug, clap::Args)]
pub(crate) struct WorkerArgs {
    /// The module whose worker to run.
    #[arg(long, value_enum)]
    module: Module,
    /// The process id in the history.
    #[arg(long)]
    process: u32,
    /// The worker slot the process fills.
    #[arg(long)]
    slot: usize,
    /// The workers' URI.
    #[arg(long)]
    uri: String,
    /// The server's own URI (not through the proxy), for a worker with a proxy of its own
    /// (`slow-reply`).
    #[arg(long)]
    server_uri: String,
    /// The workload's database.
    #[arg(long)]
    db: String,
    /// The run's seed.
    #[arg(long)]
    seed: u64,
    /// The run's faults.
    #[arg(long, value_delimiter = ',')]
    faults: Vec<FaultArg>,
    /// A control run.
    #[arg(long)]
    control: bool,
    /// Workers per workload.
    #[arg(long)]
    workers: usize,
    /// Milliseconds left until the run's deadline.
    #[arg(long)]
    duration_ms: u64,
    /// The run's origin, in microseconds of `CLOCK_MONOTONIC`.
    #[arg(long)]
    origin_us: u64,
}

/// Microseconds of `CLOCK_MONOTONIC` now (the clock behind [`Instant`] on Linux).
fn monotonic_us() -> anyhow::Result<u64> {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)?;
    Ok(u64::try_from(Duration::from(now).as_micros()).unwrap_or(u64::MAX))
}

/// A bracket of [`bracket`] is accepted as soon as it is this tight.
const TIME_BASE_TIGHT_US: u64 = 20;
/// How many brackets [`bracket`] tries at most before it keeps the tightest.
const TIME_BASE_TRIES: usize = 200;
/// A time base less certain than this is reported (a warning in the worker's log).
const TIME_BASE_WARN_US: u64 = 1_000;

/// A reading of another clock between two readings of `CLOCK_MONOTONIC`: the other
/// reading was taken at some instant in `before..=after`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Bracket<T> {
    before: u64,
    value: T,
    after: u64,
}

impl<T> Bracket<T> {
    /// The monotonic instant taken for the other reading: the middle, off by at most
    /// [`Bracket::error_us`].
    fn mid(&self) -> u64 {
        self.before + (self.after - self.before) / 2
    }
    fn error_us(&self) -> u64 {
        (self.after - self.before).div_ceil(2)
    }
}

/// Reads `other` between two readings of `monotonic`, again and again until the two are
/// at most [`TIME_BASE_TIGHT_US`] apart (at most [`TIME_BASE_TRIES`] times; the tightest
/// wins). Translating between two clocks by reading one and then the other is off by
/// however long the thread stalled between the reads — a preemption or a page fault on a
/// loaded machine, tens of milliseconds and more, always in the same direction — which
/// shifted a whole worker process's history early (issue 13: 105 false violations, all
/// naming that process). A bracket bounds the error, and a stalled one is taken again.
fn bracket<T>(
    mut monotonic: impl FnMut() -> anyhow::Result<u64>,
    mut other: impl FnMut() -> T,
) -> anyhow::Result<Bracket<T>> {
    let mut best: Option<Bracket<T>> = None;
    let mut first_us = None;
    for _ in 0..TIME_BASE_TRIES {
        let before = monotonic()?;
        let value = other();
        let after = monotonic()?.max(before);
        let b = Bracket {
            before,
            value,
            after,
        };
        first_us.get_or_insert(b.after - b.before);
        if best
            .as_ref()
            .is_none_or(|best| b.error_us() < best.error_us())
        {
            best = Some(b);
        }
        if best
            .as_ref()
            .is_some_and(|b| b.after - b.before <= TIME_BASE_TIGHT_US)
        {
            break;
        }
    }
    let best = best.context("no clock reading")?;
    if let Some(first) = first_us.filter(|us| *us > TIME_BASE_TIGHT_US) {
        tracing::debug!(
            target: "docwarden::time_base",
            first_us = first,
            error_us = best.error_us(),
            "the first clock reads stalled: taken again"
        );
    }
    if best.error_us() > TIME_BASE_WARN_US {
        tracing::warn!(
            error_us = best.error_us(),
            "the run's time base is uncertain: the clock reads kept stalling"
        );
    }
    Ok(best)
}

/// The origin of `history` in microseconds of `CLOCK_MONOTONIC`.
fn origin_us(history: &History) -> anyhow::Result<u64> {
    let since = bracket(monotonic_us, || {
        u64::try_from(history.origin().elapsed().as_micros()).unwrap_or(u64::MAX)
    })?;
    Ok(since.mid().saturating_sub(since.value))
}

/// The [`Instant`] of an origin in microseconds of `CLOCK_MONOTONIC`.
fn origin_instant(origin_us: u64) -> anyhow::Result<Instant> {
    let now = bracket(monotonic_us, Instant::now)?;
    let ago = Duration::from_micros(now.mid().saturating_sub(origin_us));
    now.value
        .checked_sub(ago)
        .context("the run's origin is before this machine's monotonic clock began")
}

/// Writes one entry as a line on stdout, flushed.
fn emit(entry: &Entry) {
    let line = match serde_json::to_string(entry) {
        Ok(line) => line,
        Err(e) => {
            tracing::warn!(%e, "history entry not serialized");
            return;
        }
    };
    let mut out = std::io::stdout().lock();
    // A closed stdout means the supervisor is gone; stdin's end stops this process.
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// Runs one worker process: `docwarden verify-worker`.
/// How long a worker process waits for its client to end its sessions before it exits.
const DISCONNECT_WITHIN: Duration = Duration::from_millis(500);

pub(crate) async fn child(args: WorkerArgs) -> anyhow::Result<ExitCode> {
    let origin = origin_instant(args.origin_us)?;
    let history = Arc::new(
        History::streaming(origin, emit).abandoned_as(super::orchestrate::in_flight(args.control)),
    );
    let client = connect(
        &args.uri,
        args.slot,
        Instant::now() + Duration::from_millis(args.duration_ms),
    )
    .await?;
    let faults = args
        .faults
        .iter()
        .filter_map(|f| match f {
            FaultArg::One(f) => Some(*f),
            FaultArg::All | FaultArg::List => None,
        })
        .collect();
    let process = Process::from_id(args.process);
    let ctx = Arc::new(Ctx {
        db: client.database(&args.db),
        client,
        history,
        faults,
        mode: Mode::control_if(args.control),
        workers: args.workers,
        duration: Duration::from_millis(args.duration_ms),
        seed: args.seed,
        injected: std::sync::Mutex::new(BTreeMap::new()),
        progress: ProgressBar::hidden(),
        clocks: std::sync::Mutex::new(Vec::new()),
        workers_as: WorkersAs::Processes,
        uri: args.uri,
        server_uri: args.server_uri,
        lease: Duration::ZERO,
        slot: Some(Slot {
            index: args.slot,
            process,
        }),
    });
    let module = args.module;
    let mut work = {
        let ctx = Arc::clone(&ctx);
        tokio::spawn(async move {
            let (result, ()) = tokio::join!(worker(module, &ctx, process), ctx.clock_nemesis());
            result
        })
    };
    // The control channel: `abort`, or the end of stdin (the supervisor is gone). A thread,
    // not tokio's stdin, whose blocking read would hold up the runtime's shutdown.
    let (abort_tx, abort_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut line = String::new();
        loop {
            line.clear();
            match std::io::stdin().read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) if line.trim() == ABORT => break,
                Ok(_) => {}
            }
        }
        let _ = abort_tx.send(());
    });
    let result = tokio::select! {
        result = &mut work => Some(result),
        _ = abort_rx => {
            // Dropping the worker's futures records what was in flight as indeterminate.
            work.abort();
            let _ = (&mut work).await;
            None
        }
    };
    // The process exits next: end the client's sessions now, not in a task the driver
    // spawns from `Drop` while the runtime shuts down.
    docwarden_server::disconnect(ctx.client.clone(), DISCONNECT_WITHIN).await;
    let Some(result) = result else {
        return Ok(ExitCode::SUCCESS);
    };
    match result {
        Ok(Ok(())) => Ok(ExitCode::SUCCESS),
        Ok(Err(e)) => {
            tracing::warn!(process = process.id(), %e, workload = module.name(), "worker stopped");
            Ok(ExitCode::from(1))
        }
        Err(e) => Err(e.into()),
    }
}

/// Connects to `uri` as the worker of `slot` (named in the handshake: the proxy's
/// partition cuts whole hosts), retrying until `deadline` (a replacement may start while
/// the server restarts or the proxy resets every connection).
async fn connect(uri: &str, slot: usize, deadline: Instant) -> anyhow::Result<mongodb::Client> {
    loop {
        match connect_once(uri, slot).await {
            Ok(client) => return Ok(client),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(e) => {
                tracing::debug!(%e, "worker process not connected yet: retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// One attempt of [`connect`]: the options `docwarden_server::connect` uses, plus the
/// slot's driver information, and a `hello` to check the server answers. Workers as tasks
/// connect with it too, each as its own host.
pub(super) async fn connect_once(uri: &str, slot: usize) -> anyhow::Result<mongodb::Client> {
    let timeout = Duration::from_secs(10);
    let mut options = tokio::time::timeout(timeout, mongodb::options::ClientOptions::parse(uri))
        .await
        .context("timed out resolving the URI")??;
    options.server_selection_timeout = Some(timeout);
    options.connect_timeout = Some(timeout);
    options.driver_info = Some(super::proxy::host_driver_info(slot));
    let client = mongodb::Client::with_options(options)?;
    tokio::time::timeout(
        timeout + Duration::from_secs(1),
        client
            .database("admin")
            .run_command(mongodb::bson::doc! { "hello": 1 }),
    )
    .await
    .context("no answer to hello")??;
    Ok(client)
}

/// The module's worker body (what a worker task runs too).
async fn worker(module: Module, ctx: &Ctx, process: Process) -> anyhow::Result<()> {
    match module {
        Module::Locks => locks::worker(ctx, process).await,
        Module::Queue => queue::worker(ctx, process).await,
        Module::Sequence => sequence::worker(ctx, process).await,
        Module::Guard => guard::worker(ctx, process).await,
        Module::Schedule => super::schedule::worker(ctx, process).await,
        Module::Semaphore => super::semaphore::worker(ctx, process).await,
        Module::Limits => super::limits::worker(ctx, process, false).await,
        Module::Rate => super::limits::worker(ctx, process, true).await,
        Module::Election => election::worker(ctx, process).await,
        Module::Rwlock => rwlock::worker(ctx, process).await,
        Module::All => anyhow::bail!("a worker process runs one module"),
    }
}

/// What a worker process has reported so far (the nemesis times its signals on it).
#[derive(Debug, Clone, Copy, Default)]
struct Activity {
    invokes: u64,
    /// Invokes of the module's commit (see [`Aim`]).
    commits: u64,
    /// Completions of the module's entry into its critical section (see [`Aim`]).
    entries: u64,
    completions: u64,
    /// A moving average of its commits' latency, in microseconds.
    commit_us: u64,
}

/// One running worker process.
struct Running {
    process: Process,
    slot: usize,
    pid: Pid,
    child: Child,
    /// Held open: the process exits when its stdin closes.
    stdin: ChildStdin,
    activity: watch::Receiver<Activity>,
    reader: JoinHandle<Vec<Fault>>,
}

/// A `sigstop` window: who, from when to when.
struct Stopped {
    process: Process,
    start_us: u64,
    end_us: u64,
}

/// Starts the worker process `process` in `slot`, running until `deadline`.
fn spawn(
    ctx: &Ctx,
    module: Module,
    process: Process,
    slot: usize,
    deadline: Instant,
) -> anyhow::Result<Running> {
    let left = deadline.saturating_duration_since(Instant::now());
    let mut command = Command::new(std::env::current_exe()?);
    command
        .arg(SUBCOMMAND)
        .args(["--module", module.name()])
        .args(["--process", &process.id().to_string()])
        .args(["--slot", &slot.to_string()])
        .args(["--uri", &ctx.uri])
        .args(["--server-uri", &ctx.server_uri])
        .args(["--db", ctx.db.name()])
        .args(["--seed", &ctx.seed.to_string()])
        .args(["--workers", &ctx.workers.to_string()])
        .args(["--duration-ms", &left.as_millis().to_string()])
        .args(["--origin-us", &origin_us(&ctx.history)?.to_string()]);
    if !ctx.faults.is_empty() {
        let faults: Vec<&str> = ctx.faults.iter().map(|f| f.name()).collect();
        command.args(["--faults", &faults.join(",")]);
    }
    if ctx.mode == Mode::Control {
        command.arg("--control");
    }
    command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let mut child = command
        .spawn()
        .context("starting a worker process (docwarden verify-worker)")?;
    let pid = child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .context("a worker process without a pid")?;
    let stdout = child.stdout.take().context("a worker's stdout")?;
    let stdin = child.stdin.take().context("a worker's stdin")?;
    let (tx, activity) = watch::channel(Activity::default());
    let in_flight = super::orchestrate::in_flight(ctx.mode == Mode::Control);
    let reader = tokio::spawn(read(
        Arc::clone(&ctx.history),
        process,
        stdout,
        tx,
        in_flight,
        Aim::of(module),
    ));
    Ok(Running {
        process,
        slot,
        pid: Pid::from_raw(pid),
        child,
        stdin,
        activity,
        reader,
    })
}

/// Where the process faults aim, three times in four, in the lease workloads: `sigstop`
/// right after a worker enters its critical section (a claim, a registered token), so that
/// it wakes up past its lease still believing it holds it; `sigkill` during the fenced
/// write that commits its work.
#[derive(Debug, Clone, Copy)]
struct Aim {
    entry: Option<&'static str>,
    commit: Option<&'static str>,
}

impl Aim {
    fn of(module: Module) -> Self {
        use docwarden_workloads::{counters, jobs};
        match module {
            Module::Queue => Aim {
                entry: Some(jobs::Op::Handle.as_str()),
                commit: Some(jobs::Op::Effect.as_str()),
            },
            Module::Locks => Aim {
                entry: Some(counters::Op::Touch.as_str()),
                commit: Some(counters::Op::Write.as_str()),
            },
            Module::Election => Aim {
                entry: Some(docwarden_workloads::election::Op::Hold.as_str()),
                commit: Some(docwarden_workloads::election::Op::Write.as_str()),
            },
            Module::Rwlock => Aim {
                entry: Some(docwarden_workloads::rwlock::Op::Write.as_str()),
                commit: None,
            },
            Module::Sequence
            | Module::Guard
            | Module::Schedule
            | Module::Semaphore
            | Module::Limits
            | Module::Rate
            | Module::All => Aim {
                entry: None,
                commit: None,
            },
        }
    }
}

/// Reads a worker's history into `history` until its stdout closes; then records each
/// operation still in flight with the outcome `in_flight` (indeterminate; failed in a
/// control run). Returns the faults the worker injected.
async fn read(
    history: Arc<History>,
    process: Process,
    stdout: ChildStdout,
    activity: watch::Sender<Activity>,
    in_flight: OpOutcome,
    aim: Aim,
) -> Vec<Fault> {
    let mut lines = BufReader::new(stdout).lines();
    let mut open: BTreeMap<u64, Event> = BTreeMap::new();
    let mut faults = Vec::new();
    loop {
        let line = match lines.next_line().await {
            Ok(Some(line)) => line,
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(process = process.id(), %e, "worker output unreadable");
                break;
            }
        };
        match serde_json::from_str::<Entry>(&line) {
            Ok(Entry::Invoke { id, event }) => {
                let commit = aim.commit.is_some_and(|op| op == event.op);
                open.insert(id, event);
                activity.send_modify(|a| {
                    a.invokes += 1;
                    a.commits += u64::from(commit);
                });
            }
            Ok(Entry::Complete { id, event }) => {
                if let Some(id) = id
                    && open.remove(&id).is_some()
                    && aim.commit.is_some_and(|op| op == event.op)
                {
                    let took = event.end_us.saturating_sub(event.start_us);
                    activity.send_modify(|a| a.commit_us = (a.commit_us * 7 + took) / 8);
                }
                if event.op == FAULT_OP
                    && let Some(f) = Fault::ALL.iter().find(|f| f.name() == event.key)
                {
                    faults.push(*f);
                }
                let entry =
                    aim.entry.is_some_and(|op| op == event.op) && event.outcome == OpOutcome::Ok;
                history.push(event);
                activity.send_modify(|a| {
                    a.completions += 1;
                    a.entries += u64::from(entry);
                });
            }
            // A line cut short by SIGKILL, or a stray print.
            Err(e) => tracing::debug!(process = process.id(), %e, line, "not a history entry"),
        }
    }
    let end = history.now_us();
    for event in open.into_values() {
        tracing::debug!(
            process = process.id(),
            op = event.op,
            "in flight when the process died"
        );
        let mut event = event
            .outcome(in_flight)
            .detail(format!("{} died mid-operation", process.label()));
        event.end_us = end;
        history.push(event);
    }
    faults
}

/// Waits (at most `within`) until `what` of `activity` grows: the process just started
/// (invokes) or finished (completions) an operation. False if it did not.
async fn next(
    activity: &mut watch::Receiver<Activity>,
    what: fn(&Activity) -> u64,
    within: Duration,
) -> bool {
    let before = what(&activity.borrow_and_update());
    tokio::time::timeout(within, async {
        while activity.changed().await.is_ok() {
            if what(&activity.borrow_and_update()) > before {
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or(false)
}

/// Sends `signal` to `pid`; a process already gone is not an error.
fn signal(pid: Pid, signal: Signal) {
    if let Err(e) = kill(pid, signal) {
        tracing::debug!(%pid, ?signal, %e, "signal not delivered");
    }
}

/// `sigstop`: right after `victim` completes an operation (`aim`: one that enters its
/// critical section), stops it for `how_long`, then continues it.
async fn stop(
    pid: Pid,
    process: Process,
    mut activity: watch::Receiver<Activity>,
    aim: fn(&Activity) -> u64,
    history: Arc<History>,
    how_long: Duration,
) -> Stopped {
    next(&mut activity, aim, Duration::from_secs(1)).await;
    let start_us = history.now_us();
    signal(pid, Signal::SIGSTOP);
    tokio::time::sleep(how_long).await;
    signal(pid, Signal::SIGCONT);
    Stopped {
        process,
        start_us,
        end_us: history.now_us(),
    }
}

/// Runs `ctx.workers` worker processes of `module` until the deadline, with the process
/// faults: `sigstop`, `sigkill` and `kill` (the worker aborts its own task).
pub(super) async fn supervise(ctx: &Ctx, module: Module) {
    if let Err(e) = run(ctx, module).await {
        tracing::error!(%e, workload = module.name(), "worker processes failed");
    }
}

async fn run(ctx: &Ctx, module: Module) -> anyhow::Result<()> {
    let started = Instant::now();
    let deadline = started + ctx.duration;
    let mut running = Vec::with_capacity(ctx.workers);
    for slot in 0..ctx.workers {
        running.push(spawn(ctx, module, Process::worker(slot), slot, deadline)?);
    }
    let mut next_worker = ctx.workers;
    let aims = Aim::of(module);
    let mut gone: Vec<Running> = Vec::new();
    let mut stops: Vec<(Process, JoinHandle<Stopped>)> = Vec::new();
    // The supervisor's own random stream (victims, pause lengths).
    let mut rng = rand::rngs::StdRng::seed_from_u64(ctx.seed.rotate_left(23));
    let kill_every = (ctx.duration / 12).max(Duration::from_millis(400));
    let stop_every = (ctx.duration / 6).max(Duration::from_millis(700));
    let mut next_kill = started + kill_every;
    let mut next_stop = started + stop_every / 2;
    while Instant::now() < deadline {
        let step =
            Duration::from_millis(50).min(deadline.saturating_duration_since(Instant::now()));
        tokio::time::sleep(step).await;
        ctx.progress
            .set_position(started.elapsed().as_secs().min(ctx.duration.as_secs()));
        let stopped = |p: Process, stops: &[(Process, JoinHandle<Stopped>)]| {
            stops.iter().any(|(s, h)| *s == p && !h.is_finished())
        };
        if ctx.has(Fault::Sigstop) && Instant::now() >= next_stop {
            next_stop += stop_every;
            let free: Vec<usize> = (0..running.len())
                .filter(|i| !stopped(running[*i].process, &stops))
                .collect();
            if !free.is_empty() {
                let victim = &running[free[rng.random_range(0..free.len())]];
                let how_long = ctx.lease + Duration::from_millis(rng.random_range(500..1500));
                let aim: fn(&Activity) -> u64 = if aims.entry.is_some() && rng.random_bool(0.75) {
                    |a| a.entries
                } else {
                    |a| a.completions
                };
                let handle = tokio::spawn(stop(
                    victim.pid,
                    victim.process,
                    victim.activity.clone(),
                    aim,
                    Arc::clone(&ctx.history),
                    how_long,
                ));
                stops.push((victim.process, handle));
            }
        }
        if Instant::now() < next_kill {
            continue;
        }
        next_kill += kill_every;
        for fault in [Fault::Sigkill, Fault::Kill] {
            if !ctx.has(fault) {
                continue;
            }
            let free: Vec<usize> = (0..running.len())
                .filter(|i| !stopped(running[*i].process, &stops))
                .collect();
            if free.is_empty() {
                continue;
            }
            let i = free[rng.random_range(0..free.len())];
            let victim = &mut running[i];
            // Mid-operation: after it announces one, within the first half of a commit's
            // usual latency (the request on its way or at the server, no reply yet).
            let aim: fn(&Activity) -> u64 = if aims.commit.is_some() && rng.random_bool(0.75) {
                |a| a.commits
            } else {
                |a| a.invokes
            };
            next(&mut victim.activity, aim, Duration::from_secs(1)).await;
            // Sub-millisecond, which tokio's timer cannot do: a short blocking sleep of the
            // supervisor (at most half a commit's latency, a few times a run).
            let latency = victim.activity.borrow().commit_us.min(20_000);
            std::thread::sleep(Duration::from_micros(rng.random_range(0..=latency / 2)));
            let at = ctx.history.now_us();
            if fault == Fault::Sigkill {
                signal(victim.pid, Signal::SIGKILL);
            } else {
                let line = format!("{ABORT}\n");
                if let Err(e) = victim.stdin.write_all(line.as_bytes()).await {
                    tracing::debug!(%e, "worker already gone");
                }
            }
            ctx.injected(fault, victim.process, at, at);
            let replacement = spawn(
                ctx,
                module,
                Process::worker(next_worker),
                victim.slot,
                deadline,
            )?;
            next_worker += 1;
            gone.push(std::mem::replace(victim, replacement));
        }
    }
    for (_, handle) in stops {
        let window = handle.await?;
        ctx.injected(
            Fault::Sigstop,
            window.process,
            window.start_us,
            window.end_us,
        );
    }
    for mut worker in gone.into_iter().chain(running) {
        let status = match tokio::time::timeout(GRACE, worker.child.wait()).await {
            Ok(status) => status?,
            Err(_) => {
                tracing::warn!(
                    process = worker.process.id(),
                    "worker process still running: killed"
                );
                worker.child.kill().await?;
                worker.child.wait().await?
            }
        };
        if !status.success() && status.code().is_some() {
            tracing::warn!(process = worker.process.id(), %status, workload = module.name(), "worker process failed");
        }
        drop(worker.stdin);
        for fault in worker.reader.await? {
            ctx.count_injected(fault);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use docwarden::check::lease;

    use super::*;

    /// One fake clock read as both clocks (so the true offset is 0): each read takes 1 µs,
    /// and the thread stalls `stall_us` right after its first read of the other clock (a
    /// preemption or a page fault on a loaded machine).
    fn stalled_clock(stall_us: u64) -> (impl FnMut() -> anyhow::Result<u64>, impl FnMut() -> u64) {
        let now = std::rc::Rc::new(Cell::new(1_000_000_u64));
        let stalled = std::rc::Rc::new(Cell::new(false));
        let mono = {
            let now = std::rc::Rc::clone(&now);
            move || {
                let t = now.get();
                now.set(t + 1);
                Ok(t)
            }
        };
        let other = move || {
            let t = now.get();
            now.set(t + 1);
            if !stalled.replace(true) {
                now.set(now.get() + stall_us);
            }
            t
        };
        (mono, other)
    }

    /// Issue 13: a worker's time base came from one read of each clock, so a stall between
    /// them shifted every event of that process by the stall. With `TIME_BASE_TRIES = 1`
    /// (one bracket) this fails: "time base off by 25000 µs" (the single unbracketed read of
    /// before the fix is off by the whole stall, 50 ms).
    #[test]
    fn a_stall_between_the_clock_reads_does_not_shift_the_time_base() -> anyhow::Result<()> {
        let (mono, other) = stalled_clock(50_000);
        let b = bracket(mono, other)?;
        let off = b.mid().abs_diff(b.value);
        assert!(
            off <= TIME_BASE_TIGHT_US,
            "time base off by {off} µs (bracket {b:?})"
        );
        assert!(off <= b.error_us());
        Ok(())
    }

    #[test]
    fn the_time_base_round_trips_between_processes() -> anyhow::Result<()> {
        let history = History::new();
        std::thread::sleep(Duration::from_millis(5));
        // What the supervisor passes, and what the worker makes of it.
        let origin = origin_instant(origin_us(&history)?)?;
        let off = if origin > history.origin() {
            origin - history.origin()
        } else {
            history.origin() - origin
        };
        assert!(off < Duration::from_millis(1), "origin off by {off:?}");
        Ok(())
    }

    /// The signature seen in issue 13 — every stale write, overlap and token regression
    /// naming one process — is what one worker's time base shifted early by a few
    /// milliseconds produces in a clean history.
    #[test]
    fn one_process_shifted_early_looks_like_stale_writes_by_everyone_else() {
        let op = |p: u32, op: &str, s: u64, e: u64, token: i64| {
            Event::new(p, op, "counter-0", s, e).token(token)
        };
        // Process 3 holds token 1, writes and releases; process 5 then acquires token 2
        // and touches, 100 µs after process 3's write ended.
        let clean = |shift: u64| {
            let early = |e: Event| Event {
                start_us: e.start_us.saturating_sub(shift),
                end_us: e.end_us.saturating_sub(shift),
                ..e
            };
            vec![
                op(3, "acquire", 10_000, 10_500, 1),
                op(3, "touch", 10_600, 11_000, 1),
                op(3, "write", 11_500, 12_000, 1),
                op(3, "release", 12_000, 12_100, 1),
                early(op(5, "acquire", 12_200, 12_600, 2)),
                early(op(5, "touch", 12_700, 13_000, 2)),
                early(op(5, "write", 13_100, 13_500, 2)),
            ]
        };
        assert!(lease::check_tokens(&clean(0)).is_empty());
        let found = lease::check_tokens(&clean(5_000));
        let kinds: Vec<&str> = found.iter().map(|v| v.kind).collect();
        // Since session 16 a stale touch is judged like a stale write: process 3's touch
        // and write both look accepted after token 2.
        assert_eq!(
            kinds,
            vec![
                "token-not-increasing",
                "stale-write-accepted",
                "stale-write-accepted"
            ],
            "{found:?}"
        );
        // Off by one token, the newer one process 5's, the accused the honest process 3.
        assert!(
            found[1].detail.contains("token 2 from process 5"),
            "{found:?}"
        );
        assert!(found.iter().all(|v| v.detail.starts_with("process 3")));
    }
}
