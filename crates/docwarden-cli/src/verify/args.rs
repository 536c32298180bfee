//! The command line of `docwarden verify`: the module, the faults, the run's shape.

use std::path::PathBuf;

use crate::conn::ConnArgs;

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
    /// Seconds each workload runs.
    #[arg(long, default_value_t = 20)]
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
    /// Without --faults, a control run injects `pause`.
    #[arg(long)]
    pub(super) control: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    pub(super) json: bool,
    /// Write a self-contained HTML report with a timeline to this file.
    #[arg(long)]
    pub(super) report: Option<PathBuf>,
}

/// A module to verify.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum Module {
    Locks,
    Queue,
    Sequence,
    Guard,
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

    /// The name in summaries, reports and database names.
    pub(super) fn name(self) -> &'static str {
        match self {
            Module::Locks => "locks",
            Module::Queue => "queue",
            Module::Sequence => "sequence",
            Module::Guard => "guard",
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
                        Fault::ALL.map(Fault::name).join(", ")
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
    Skew,
    Step,
    Drift,
    Restart,
    Latency,
    Reset,
    FailpointNetwork,
    FailpointNotprimary,
    FailpointLatency,
    SlowReply,
}

impl Fault {
    /// Every fault, in the order of `--faults list`.
    pub(super) const ALL: [Fault; 12] = [
        Fault::Pause,
        Fault::Kill,
        Fault::Skew,
        Fault::Step,
        Fault::Drift,
        Fault::Restart,
        Fault::Latency,
        Fault::Reset,
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
            Fault::Skew => "skew",
            Fault::Step => "step",
            Fault::Drift => "drift",
            Fault::Restart => "restart",
            Fault::Latency => "latency",
            Fault::Reset => "reset",
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
            Fault::Skew => "each worker's wall clock is shifted by up to ±30 s",
            Fault::Step => "a worker's wall clock steps by ±20 s mid-run (monotonic runs on)",
            Fault::Drift => "each worker's wall clock walks 2-10 % fast or slow",
            Fault::Restart => "the server is restarted on the same data",
            Fault::Latency => "the TCP proxy delays every packet by 5-40 ms for a while",
            Fault::Reset => "the TCP proxy resets every connection",
            Fault::FailpointNetwork => {
                "failCommand closeConnection on findAndModify/update/insert (indeterminate)"
            }
            Fault::FailpointNotprimary => {
                "failCommand errorCode 10107 (NotWritablePrimary) / 91 (ShutdownInProgress)"
            }
            Fault::FailpointLatency => "failCommand blockConnection: commands block 50-200 ms",
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
                | Fault::Latency
                | Fault::Reset
                | Fault::FailpointNetwork
                | Fault::FailpointNotprimary
                | Fault::FailpointLatency
                | Fault::SlowReply
        )
    }

    /// Whether the fault is a `failCommand` fail point (the server needs test commands).
    pub(super) fn is_failpoint(self) -> bool {
        matches!(
            self,
            Fault::FailpointNetwork | Fault::FailpointNotprimary | Fault::FailpointLatency
        )
    }
}
