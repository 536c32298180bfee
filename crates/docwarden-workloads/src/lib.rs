//! The seed workloads of docwarden, each written once.
//!
//! A workload is its setup (collections and fixtures), its operation in [`Mode::Safe`]
//! (docwarden's safeguard on) and in [`Mode::Control`] (the same operation with one
//! safeguard off, which must produce violations), its final read, and its checker (which
//! calls [`docwarden::check`] or the module's own checker). `docwarden demo`, `verify`,
//! `bench` and the integration tests all run these definitions; none of them imports
//! another.
//!
//! | module | seed | docwarden module |
//! |---|---|---|
//! | [`on_call`] | 000, doctors on call | `guard` |
//! | [`enrollment`] | 001, enroll/unenroll messages | `sequence` |
//! | [`jobs`] | 002, job producers and the queue effect | `queue` |
//! | [`counters`] | 003/004, counters under document locks and leases | `lock` |
//! | [`schedule`] | — , periodic jobs (issue 15) | `queue` (schedules) |
//! | [`election`] | issue 16, leader election with fenced writes | `lock` (election) |
//! | [`rwlock`] | issue 16, many readers or one writer | `lock` (rw locks) |
//! | [`seed_claim`] | 002, the article's own claim loop (bench anchor only) | — |
//! | [`semaphore`] | issue 16, N holders per resource | `lock::Semaphore` |
//! | [`queue_limits`] | issue 15, concurrency and rate limits, fairness | `queue` limits |
//!
//! Workloads whose checkers judge holders' stretches (semaphore, limits, rwlock) read
//! the server's order with [`marker`] writes, never a holder's own clock.
//!
//! Every history event names its process with a typed [`Process`] and its operation with
//! the workload's own `Op` enum (`as_str()` is what the history and the report show).
//!
//! This is harness code for the binary and the tests: it returns `anyhow` errors where a
//! run fails, and `docwarden::Result` where the caller classifies the library's outcome.

pub mod counters;
pub mod election;
pub mod enrollment;
pub mod jobs;
pub mod marker;
pub mod on_call;
mod process;
pub mod queue_limits;
mod run;
pub mod rwlock;
pub mod schedule;
pub mod seed_claim;
pub mod semaphore;

pub use process::Process;
pub use run::{Mode, RunConfig, RunReport, run_tasks};
