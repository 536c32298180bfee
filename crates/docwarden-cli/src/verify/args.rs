//! The command line of `docwarden verify`: the module, the faults, the run's shape.

use std::path::PathBuf;

use crate::conn::ConnArgs;

/// The longest `--duration` accepted, in seconds (a week).
const MAX_DURATION_SECS: u64 = 7 * 24 * 3600;

/// Arguments of `docwarden verify`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Which module to verify (not needed with `--list-faults` / `--faults list`).
    pub(super) module: Option<Module>,
    #[command(flatten)]
    pub(super) conn: ConnArgs,
    /// Concurrent workers per workload.
    #[arg(long, default_value_t = 8)]
    pub(super) workers: usize,
    /// Seconds each workload runs (1 to 604800, a week; a number without a unit).
    #[arg(long, default_value_t = 20,
          value_parser = clap::value_parser!(u64).range(1..=MAX_DURATION_SECS))]
    pub(super) duration: u64,
    /// Faults to inject, comma separated (`all`: every fault the setting allows; `list`:
    /// print them and exit).
    #[arg(long, value_delimiter = ',')]
    pub(super) faults: Vec<FaultArg>,
    /// Print the faults and which need the embedded server, and exit.
    #[arg(long)]
    pub(super) list_faults: bool,
    /// Seed of the random choices (workers' clocks, fault timing, operations).
    #[arg(long)]
    pub(super) seed: Option<u64>,
    /// Disable the safeguards (no fencing, read-then-write, client clocks): must fail.
    /// Without --faults, a control run injects `pause` (and `sigstop` with workers as processes).
    #[arg(long)]
    pub(super) control: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    pub(super) json: bool,
    /// Write a self-contained HTML report with a timeline to this file.
    #[arg(long)]
    pub(super) report: Option<PathBuf>,
    /// Run each worker as its own OS process (the `docwarden` binary in a hidden worker
    /// mode, needed by `sigstop` and `sigkill`), or as a task of this process.
    #[arg(long, value_enum, default_value_t = WorkersAs::Processes)]
    pub(super) workers_as: WorkersAs,
}

/// How workers run: `--workers-as`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum WorkersAs {
    /// Each worker is a child process streaming its history back.
    Processes,
    /// Each worker is a tokio task of the verify process.
    Tasks,
}

/// A module to verify. `all` runs the first four; the others run only when named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum Module {
    /// Leases kept by a watchdog, writes fenced by their token: no overlapping leases, no
    /// stale write accepted, tokens increasing (part of `all`).
    Locks,
    /// The job queue: every job's effect committed once, none by a stale holder, no job
    /// lost (part of `all`).
    Queue,
    /// Sequenced sets: the same state for any delivery order of the same messages (part
    /// of `all`).
    Sequence,
    /// Guarded updates: the business rule holds after every write (part of `all`).
    Guard,
    /// Periodic jobs: every tick enqueued once (not part of `all`).
    Schedule,
    /// The semaphore: never more than N holders (not part of `all`).
    Semaphore,
    /// Queue concurrency limits: never more than N running jobs per key (not part of
    /// `all`).
    Limits,
    /// Queue rate limits: never more than N starts per interval per key (not part of
    /// `all`).
    Rate,
    /// Leader election: one leader per term, writes fenced by the term (not part of
    /// `all`).
    Election,
    /// Read/write locks: many readers or one writer (not part of `all`).
    Rwlock,
    /// `locks`, `queue`, `sequence` and `guard`.
    All,
}

impl Module {
    /// The modules a run covers (`all` expands to the four).
    pub(super) fn expand(self) -> Vec<Module> {
        match self {
            Module::All => vec![
                Module::Locks,
                Module::Queue,
                Module::Sequence,
                Module::Guard,
            ],
            m => vec![m],
        }
    }

    /// Every single module: the four of `all`, and `schedule` (periodic jobs, issue 15),
    /// `semaphore`, `limits`, `rate`, `election` and `rwlock` (issues 15, 16), which run on their own
    /// (`docwarden verify schedule`, …) and are not part of `all`.
    pub(super) fn each() -> Vec<Module> {
        let mut every = Module::All.expand();
        every.extend([
            Module::Schedule,
            Module::Semaphore,
            Module::Limits,
            Module::Rate,
            Module::Election,
            Module::Rwlock,
        ]);
        every
    }

    /// The name in summaries, reports and database names.
    pub(super) fn name(self) -> &'static str {
        match self {
            Module::Locks => "locks",
            Module::Queue => "queue",
            Module::Sequence => "sequence",
            Module::Guard => "guard",
            Module::Schedule => "schedule", // not a stored field: the module name
            Module::Semaphore => "semaphore",
            Module::Limits => "limits", // not a stored field: the module name
            Module::Rate => "rate",
            Module::Election => "election",
            Module::Rwlock => "rwlock",
            Module::All => "all",
        }
    }
}

/// A `--faults` value: one fault, every fault, or the list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FaultArg {
    One(Fault),
    All,
    List,
}

impl std::str::FromStr for FaultArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "all" => Ok(FaultArg::All),
            "list" => Ok(FaultArg::List),
            name => Fault::ALL
                .iter()
                .find(|f| f.name() == name)
                .map(|f| FaultArg::One(*f))
                .ok_or_else(|| {
                    format!(
                        "unknown fault `{name}` (faults: {}, all, list)",
                        Fault::ALL
                            .iter()
                            .map(|f| f.name())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }),
        }
    }
}

/// A fault to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Fault {
    Pause,
    Kill,
    Sigstop,
    Sigkill,
    Skew,
    Step,
    Drift,
    Restart,
    Crash,
    Stepdown,
    Latency,
    Reset,
    Partition,
    FailpointNetwork,
    FailpointNotprimary,
    FailpointLatency,
    SlowReply,
}

impl Fault {
    /// Every fault, in the order of `--faults list`.
    pub(super) const ALL: &[Fault] = &[
        Fault::Pause,
        Fault::Kill,
        Fault::Sigstop,
        Fault::Sigkill,
        Fault::Skew,
        Fault::Step,
        Fault::Drift,
        Fault::Restart,
        Fault::Crash,
        Fault::Stepdown,
        Fault::Latency,
        Fault::Reset,
        Fault::Partition,
        Fault::FailpointNetwork,
        Fault::FailpointNotprimary,
        Fault::FailpointLatency,
        Fault::SlowReply,
    ];

    /// The name in summaries and in the history.
    pub(super) fn name(self) -> &'static str {
        match self {
            Fault::Pause => "pause",
            Fault::Kill => "kill",
            Fault::Sigstop => "sigstop",
            Fault::Sigkill => "sigkill",
            Fault::Skew => "skew",
            Fault::Step => "step",
            Fault::Drift => "drift",
            Fault::Restart => "restart",
            Fault::Crash => "crash",
            Fault::Stepdown => "stepdown",
            Fault::Latency => "latency",
            Fault::Reset => "reset",
            Fault::Partition => "partition", // not a stored field: the fault's name
            Fault::FailpointNetwork => "failpoint-network",
            Fault::FailpointNotprimary => "failpoint-notprimary",
            Fault::FailpointLatency => "failpoint-latency",
            Fault::SlowReply => "slow-reply",
        }
    }

    /// What the fault does (for `--faults list`).
    pub(super) fn describe(self) -> &'static str {
        match self {
            Fault::Pause => "a worker sleeps past its lease inside its critical section",
            Fault::Kill => "a worker task is aborted mid-operation and replaced",
            Fault::Sigstop => {
                "a worker process is SIGSTOPped past its lease, then SIGCONTed (processes)"
            }
            Fault::Sigkill => {
                "a worker process is SIGKILLed mid-operation and replaced (processes)"
            }
            Fault::Skew => "each worker's wall clock is shifted by up to ±30 s",
            Fault::Step => "a worker's wall clock steps by ±20 s mid-run (monotonic runs on)",
            Fault::Drift => "each worker's wall clock runs 20-50 % fast or slow",
            Fault::Restart => "the server is restarted on the same data",
            Fault::Crash => "the server is SIGKILLed and restarted on the same data",
            Fault::Stepdown => "replSetStepDown: the server is not primary for 1-2 s",
            Fault::Latency => {
                "the TCP proxy delays every chunk by 5-40 ms, 1 in 50 by 2.5 s, for 0.8 s"
            }
            Fault::Reset => "the TCP proxy resets every connection",
            Fault::Partition => {
                "the TCP proxy blackholes every open connection for 3 s (1.5 queue leases)"
            }
            Fault::FailpointNetwork => {
                "failCommand closeConnection: every other round every update for 0.4 s, else 3 findAndModify/update/insert (indeterminate)"
            }
            Fault::FailpointNotprimary => {
                "failCommand errorCode 10107 (NotWritablePrimary) / 91 (ShutdownInProgress), aimed as failpoint-network"
            }
            Fault::FailpointLatency => {
                "failCommand blockConnection: writes block 50-200 ms; every other round 2.5 s"
            }
            Fault::SlowReply => {
                "locks: one worker's own proxy delays only server-to-client bytes by 2.4 s while its clock samples (its estimate falls ~1.2 s behind, within its bound)"
            }
        }
    }

    /// Whether the fault needs the embedded server (restart, proxy, test commands).
    pub(super) fn needs_embedded(self) -> bool {
        matches!(
            self,
            Fault::Restart
                | Fault::Crash
                | Fault::Stepdown
                | Fault::Latency
                | Fault::Reset
                | Fault::Partition
                | Fault::FailpointNetwork
                | Fault::FailpointNotprimary
                | Fault::FailpointLatency
                | Fault::SlowReply
        )
    }

    /// Whether the fault needs workers as OS processes (`--workers-as processes`).
    pub(super) fn needs_processes(self) -> bool {
        matches!(self, Fault::Sigstop | Fault::Sigkill)
    }

    /// The safeguard `--control` turns off under this fault (for `--faults list`). Every
    /// control run also runs the workloads' own controls (`Mode::Control`: no fencing,
    /// client clocks, read-then-write, unsequenced applies).
    pub(super) fn control(self) -> &'static str {
        match self {
            Fault::Pause | Fault::Sigstop | Fault::Partition | Fault::Latency => {
                "fencing: a holder that outlived its lease still writes"
            }
            Fault::Kill => {
                "rescue (queue: expired leases never swept back, a killed worker's jobs stay running); locks: an aborted task's in-flight writes counted as failed"
            }
            Fault::Sigkill => {
                "indeterminate outcomes: a killed process's in-flight writes counted as failed"
            }
            Fault::Skew => "server time: leases computed on the worker's own wall clock",
            Fault::Step | Fault::Drift => {
                "monotonic projection: the server sample is projected on the wall clock"
            }
            Fault::Restart
            | Fault::Reset
            | Fault::Stepdown
            | Fault::FailpointNetwork
            | Fault::FailpointNotprimary => {
                "settlement: an unknown outcome is guessed, not read back (refused: taken as applied; no reply: re-sent blindly, non-idempotent, or taken as applied; retryWrites=false)"
            }
            Fault::Crash => {
                "durability: the server runs without --sync-on-commit (and settlement, as restart)"
            }
            Fault::SlowReply => {
                "fencing (the lock workload's control): a holder past its lease writes"
            }
            Fault::FailpointLatency => "fencing: a write stalled past its lease still lands",
        }
    }

    /// Whether the fault needs the verify-started server (a restart with other flags).
    pub(super) fn needs_own_server(self) -> bool {
        self.is_failpoint() || self == Fault::Crash
    }

    /// Whether the fault goes through the TCP proxy.
    pub(super) fn needs_proxy(self) -> bool {
        matches!(self, Fault::Latency | Fault::Reset | Fault::Partition)
    }

    /// Whether the fault is a `failCommand` fail point (the server needs test commands).
    pub(super) fn is_failpoint(self) -> bool {
        matches!(
            self,
            Fault::FailpointNetwork | Fault::FailpointNotprimary | Fault::FailpointLatency
        )
    }
}
