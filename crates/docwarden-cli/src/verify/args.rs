//! The command line of `docwarden verify`: the module, the faults, the run's shape.

use std::path::PathBuf;

use crate::conn::ConnArgs;

/// Arguments of `docwarden verify`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Which module to verify.
    pub(super) module: Module,
    #[command(flatten)]
    pub(super) conn: ConnArgs,
    /// Concurrent workers per workload.
    #[arg(long, default_value_t = 8)]
    pub(super) workers: usize,
    /// Seconds each workload runs.
    #[arg(long, default_value_t = 20)]
    pub(super) duration: u64,
    /// Faults to inject, comma separated: pause, kill, skew, restart, latency, reset.
    #[arg(long, value_delimiter = ',')]
    pub(super) faults: Vec<Fault>,
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

/// A fault to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub(super) enum Fault {
    Pause,
    Kill,
    Skew,
    Restart,
    Latency,
    Reset,
}

impl Fault {
    /// The name in summaries and in the history.
    pub(super) fn name(self) -> &'static str {
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
