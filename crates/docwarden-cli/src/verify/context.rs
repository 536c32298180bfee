//! What a workload run gets: where to write, the history to record into, the faults to
//! inject in the workers (pause, kill, skew), their clocks, and the supervisor that runs
//! and replaces workers — as tasks of this process, or as child processes (see
//! [`super::process`]), which the supervisor can also `SIGSTOP` and `SIGKILL`.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use docwarden::check::{Event, History, OpOutcome, Violation};
use docwarden::clock::{ClockOptions, LocalClock, TimeSource};
use docwarden_workloads::{Mode, Process};
use indicatif::ProgressBar;
use mongodb::{Client, Database};
use rand::{Rng, SeedableRng};

use super::args::{Fault, Module, WorkersAs};
use super::process;

/// The history's name of an injected fault (its key is the fault's name).
pub(super) const FAULT_OP: &str = "fault";

/// What a workload needs: where to write, what to record, which faults to inject.
/// The pause between two attempts of a worker's setup ([`Ctx::setup`]).
const SETUP_RETRY: Duration = Duration::from_millis(200);

pub(super) struct Ctx {
    /// A client for the workers (through the proxy when latency/reset are on).
    pub(super) client: Client,
    /// The workload's database.
    pub(super) db: Database,
    /// The server's own URI (not the proxy's), for workers that open their own path.
    pub(super) server_uri: String,
    pub(super) history: Arc<History>,
    pub(super) faults: Vec<Fault>,
    pub(super) mode: Mode,
    pub(super) workers: usize,
    pub(super) duration: Duration,
    pub(super) seed: u64,
    pub(super) injected: Mutex<BTreeMap<&'static str, u64>>,
    pub(super) progress: ProgressBar,
    /// The workers' wall clocks (with their drift in ms per 100 ms), for the clock nemesis.
    pub(super) clocks: Mutex<Vec<(Process, LocalClock, i64)>>,
    /// Whether workers run as tasks or as child processes.
    pub(super) workers_as: WorkersAs,
    /// The workers' URI (child processes connect to it themselves).
    pub(super) uri: String,
    /// How long a `sigstop` must last to outlive the workload's lease.
    pub(super) lease: Duration,
    /// In a worker process: the process it runs and the worker slot it fills. `None` in
    /// the verify process itself.
    pub(super) slot: Option<Slot>,
}

/// What a worker process runs: one process, in one worker slot.
#[derive(Debug, Clone, Copy)]
pub(super) struct Slot {
    /// The slot, `0..workers` (a replacement inherits its victim's slot).
    pub(super) index: usize,
    /// The process (a replacement gets a new one).
    pub(super) process: Process,
}

/// A worker body: given its process, runs until the deadline.
type WorkerFn = Arc<dyn Fn(Process) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

impl Ctx {
    pub(super) fn has(&self, fault: Fault) -> bool {
        self.faults.contains(&fault)
    }

    /// Counts an injected fault and records it in the history (for the timeline).
    pub(super) fn injected(&self, fault: Fault, process: Process, start_us: u64, end_us: u64) {
        self.count_injected(fault);
        self.history.push(Event::new(
            process.id(),
            FAULT_OP,
            fault.name(),
            start_us,
            end_us,
        ));
    }

    /// Counts an injected fault without recording it (a worker process recorded it).
    pub(super) fn count_injected(&self, fault: Fault) {
        *self
            .injected
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(fault.name())
            .or_default() += 1;
    }

    /// The faults injected so far, by name.
    pub(super) fn injected_counts(&self) -> BTreeMap<&'static str, u64> {
        self.injected
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// A deterministic random generator for `process` (from `--seed`).
    pub(super) fn rng(&self, process: Process) -> rand::rngs::StdRng {
        process.rng(self.seed)
    }

    /// The clock of one worker: shifted by up to ±30 s under `skew`, stepped by the clock
    /// nemesis under `step`, walking fast or slow under `drift`. Safe runs estimate the
    /// server clock from a sample projected on the monotonic clock; control runs trust the
    /// wall clock (under `step`/`drift`: the server sample projected on the wall clock, the
    /// one safeguard those faults test; otherwise the wall clock alone).
    pub(super) fn clock(&self, process: Process) -> anyhow::Result<TimeSource> {
        let mut rng = self.rng(process);
        let offset_ms = if self.has(Fault::Skew) {
            let offset = rng.random_range(-30_000..=30_000_i64);
            self.injected(Fault::Skew, process, 0, 0);
            offset
        } else {
            0
        };
        let local = LocalClock::with_offset_ms(offset_ms);
        let clock_faults = self.has(Fault::Step) || self.has(Fault::Drift);
        if clock_faults {
            let drift = if self.has(Fault::Drift) {
                // 20-50 ms per 100 ms: a badly broken clock (a VM's lost ticks), so that
                // over a short run the wall clock strays further than a lease.
                let ms = rng.random_range(20..=50_i64);
                self.injected(Fault::Drift, process, 0, 0);
                if rng.random_bool(0.5) { ms } else { -ms }
            } else {
                0
            };
            self.clocks.lock().unwrap_or_else(|p| p.into_inner()).push((
                process,
                local.clone(),
                drift,
            ));
        }
        let options = ClockOptions::default();
        Ok(match self.mode {
            Mode::Control if clock_faults => TimeSource::server_with_local(
                self.client.clone(),
                local,
                options.unsafe_wall_clock_projection(),
            )?,
            Mode::Control => TimeSource::local_unchecked(local, options)?,
            Mode::Safe => TimeSource::server_with_local(self.client.clone(), local, options)?,
        })
    }

    /// Under `step` and `drift`, until the deadline: every 100 ms moves each drifting
    /// clock by its drift, and a few times a run steps one live worker's clock by ±20 s.
    pub(super) async fn clock_nemesis(&self) {
        if !self.has(Fault::Step) && !self.has(Fault::Drift) {
            return;
        }
        let deadline = Instant::now() + self.duration;
        // In a worker process, the nemesis steps only that process's clock: its own random
        // stream, and steps as rare per process as one among `workers` in a single process.
        let (seed, every) = match self.slot {
            None => (self.seed.rotate_left(41), self.duration / 8),
            Some(slot) => {
                let id = slot.process.id();
                let workers = u32::try_from(self.workers).unwrap_or(u32::MAX);
                (
                    self.seed.rotate_left(41) ^ (u64::from(id) << 20),
                    self.duration / 8 * workers,
                )
            }
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let step_every = every.max(Duration::from_millis(300));
        let mut next_step = Instant::now() + step_every.mul_f64(rng.random_range(0.2..1.0));
        while Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let clocks = self
                .clocks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            for (_, clock, drift) in &clocks {
                clock.step_ms(*drift);
            }
            if self.has(Fault::Step) && Instant::now() >= next_step && !clocks.is_empty() {
                next_step += step_every;
                // The last `workers` registered are the live ones (replacements append).
                let live = &clocks[clocks.len().saturating_sub(self.workers)..];
                let (process, clock, _) = &live[rng.random_range(0..live.len())];
                let delta = if rng.random_bool(0.5) {
                    20_000
                } else {
                    -20_000
                };
                clock.step_ms(delta);
                let at = self.history.now_us();
                self.injected(Fault::Step, *process, at, at);
                tracing::debug!(process = process.id(), delta, "wall clock stepped");
            }
        }
    }

    /// Under `pause`, with probability `p`, sleeps for `how_long` and records the fault.
    pub(super) async fn maybe_pause(
        &self,
        rng: &mut impl Rng,
        process: Process,
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

    /// Runs a worker's setup (opening its handle, which creates indexes) and runs it again
    /// after a pause while it fails with a retryable error — no primary during a
    /// `stepdown`, a connection reset — and `deadline` is ahead. A worker process started
    /// (or replaced after `sigkill`) during a failover then waits for the new primary, as a
    /// real worker would, instead of exiting and leaving its slot empty for the rest of the
    /// run. `Ok(None)` if the retryable error lasts until the deadline: the run ended
    /// before the worker could start (a replacement started late in the run, during a
    /// stepdown), which leaves it nothing to do — not a failure. Any other error is
    /// returned.
    pub(super) async fn setup<T, F, Fut>(
        &self,
        process: Process,
        deadline: Instant,
        mut open: F,
    ) -> anyhow::Result<Option<T>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = docwarden::Result<T>>,
    {
        loop {
            match open().await {
                Ok(handle) => return Ok(Some(handle)),
                Err(e) if e.is_retryable() && Instant::now() + SETUP_RETRY < deadline => {
                    tracing::debug!(process = process.id(), %e, "worker setup failed: retrying");
                    tokio::time::sleep(SETUP_RETRY).await;
                }
                Err(e) if e.is_retryable() => {
                    tracing::info!(process = process.id(), %e, "the run ended before this worker could open its handle");
                    return Ok(None);
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Runs `body` on `self.workers` worker processes until the deadline. Under `kill`,
    /// every few seconds one worker is aborted mid-operation and replaced by a new process.
    ///
    /// With `--workers-as processes`, `body` is not used: each worker is a child process
    /// running the module's own `worker` (see [`super::process`]), and the supervisor also
    /// injects `sigstop` and `sigkill`.
    pub(super) async fn supervise<F, Fut>(&self, workload: &'static str, body: F)
    where
        F: Fn(Process) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        if self.workers_as == WorkersAs::Processes {
            let module = Module::each().into_iter().find(|m| m.name() == workload);
            match module {
                Some(module) => process::supervise(self, module).await,
                None => tracing::error!(workload, "no module of this name: no workers ran"),
            }
            return;
        }
        let worker: WorkerFn = Arc::new(move |process| {
            let run = body(process);
            Box::pin(async move {
                if let Err(e) = run.await {
                    tracing::warn!(process = process.id(), %e, workload, "worker stopped");
                }
            })
        });
        let deadline = Instant::now() + self.duration;
        let mut tasks: Vec<(Process, tokio::task::JoinHandle<()>)> = (0..self.workers)
            .map(|p| {
                let p = Process::worker(p);
                (p, tokio::spawn(worker(p)))
            })
            .collect();
        let mut next_worker = self.workers;
        // The supervisor's own random stream (which worker to kill).
        let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed.rotate_left(17));
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
                let replacement = Process::worker(next_worker);
                tasks[i] = (replacement, tokio::spawn(worker(replacement)));
                next_worker += 1;
            }
        }
        for (_, handle) in tasks {
            let _ = handle.await;
        }
    }

    /// The control's guess about a write whose outcome is unknown (`err`, retryable), with
    /// the settlement off: no read-back. Refused by the server (`NotWritablePrimary`,
    /// `ShutdownInProgress`…): taken as applied ("the driver retries those"). No reply at
    /// all (the connection closed or reset, no server): half the time re-sent blindly,
    /// half the time taken as applied.
    pub(super) fn guess_resend(err: &docwarden::Error) -> bool {
        let no_reply = matches!(
            err,
            docwarden::Error::Database { source } if matches!(
                *source.kind,
                mongodb::error::ErrorKind::Io(_)
                    | mongodb::error::ErrorKind::ServerSelection { .. }
                    | mongodb::error::ErrorKind::ConnectionPoolCleared { .. }
            )
        );
        no_reply && rand::random_bool(0.5)
    }

    /// Records an operation's outcome from a `Result`: `Ok` → Ok, a retryable/network error
    /// → Indeterminate, any other error → Failed.
    pub(super) fn outcome_of<T>(result: &docwarden::Result<T>) -> OpOutcome {
        match result {
            Ok(_) => OpOutcome::Ok,
            Err(e) if e.is_retryable() => OpOutcome::Indeterminate,
            Err(_) => OpOutcome::Failed,
        }
    }
}

/// What one workload found.
#[derive(Debug, serde::Serialize)]
pub(super) struct WorkloadResult {
    pub(super) workload: &'static str,
    pub(super) operations: u64,
    /// Operations whose outcome is unknown (a lost reply, a retryable error): recorded as
    /// indeterminate, and the checkers accept either outcome for them.
    pub(super) indeterminate: u64,
    pub(super) faults: BTreeMap<&'static str, u64>,
    pub(super) violations_by_kind: BTreeMap<&'static str, usize>,
    /// The first violations found (at most 20).
    pub(super) violations: Vec<Violation>,
    #[serde(skip)]
    pub(super) events: Vec<Event>,
}

/// A workload's own findings, before faults are added.
pub(super) struct Findings {
    pub(super) operations: u64,
    pub(super) violations: Vec<Violation>,
}
