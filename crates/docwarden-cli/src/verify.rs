//! `docwarden verify`: runs each module's workload under concurrency and faults, records
//! every operation, and checks the history (see `docwarden::check`).
//!
//! Workers run as OS processes by default (`--workers-as processes`, see [`process`]): the
//! `docwarden` binary in a hidden worker mode, each streaming its history back.
//!
//! Faults: `pause` (a worker sleeps past its lease in the middle of its critical section),
//! `kill` (a worker task is aborted mid-operation and replaced), `sigstop` (a worker process
//! is stopped past its lease, then continued), `sigkill` (a worker process is killed
//! mid-operation and replaced), `skew` (each worker's clock
//! is shifted by up to ±30 s), `step` (a worker's wall clock steps by ±20 s mid-run), `drift`
//! (each worker's wall clock walks fast or slow), `restart` (the embedded server is restarted
//! on the same data), `crash` (SIGKILL and restart on the same data, durable), `stepdown`
//! (`replSetStepDown`), `latency`, `reset` and `partition` (through a TCP proxy in front of
//! the server), and
//! `failpoint-network`, `failpoint-notprimary`, `failpoint-latency` (MongoDB's `failCommand`
//! fail point on the workers' writes, matched by their `appName`). `--faults all` runs every
//! fault the setting allows, `--faults list` prints them. `--control` runs the same
//! workloads with the safeguard disabled, and must report violations (under `step` and
//! `drift`: the server-time sample projected on the wall clock; under `crash`: a server
//! without `--sync-on-commit`). `docs/verify.md` lists every fault and its control.
//!
//! The workloads themselves are `docwarden_workloads`'; the files here only record them:
//! [`args`] (the command line), [`context`] (what a workload run gets: history, faults,
//! clocks, the supervisor), [`process`] (workers as child processes, their signals and
//! history streams), [`orchestrate`] (one run per module), [`nemesis`] (server-side
//! faults), [`summary`] (printing), [`proxy`] and [`report`] (the HTML timeline), and one
//! recorder per module.

mod args;
mod context;
mod election;
mod guard;
mod limits;
mod locks;
mod nemesis;
mod orchestrate;
mod process;
mod proxy;
mod queue;
mod report;
mod rwlock;
mod schedule;
mod semaphore;
mod sequence;
mod summary;

pub(crate) use args::Args;
pub(crate) use orchestrate::run;
pub(crate) use process::{SUBCOMMAND as WORKER_SUBCOMMAND, WorkerArgs, child as run_worker};
