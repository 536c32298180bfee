//! The runner contract shared by demo, verify, bench and the tests.

use std::future::Future;

/// Whether the workload runs with docwarden's safeguard, or with exactly one safeguard off
/// (the control, which must produce violations).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// docwarden as shipped.
    #[default]
    Safe,
    /// One safeguard off; see each workload's `Mode::Control` description.
    Control,
}

impl Mode {
    /// `Control` when `control` is set.
    #[must_use]
    pub fn control_if(control: bool) -> Self {
        if control { Mode::Control } else { Mode::Safe }
    }
}

/// How a fixed-size run is shaped: concurrent workers, operations each, and the mode.
#[derive(Clone, Copy, Debug)]
pub struct RunConfig {
    /// Concurrent tasks.
    pub workers: usize,
    /// Operations per worker.
    pub ops_per_worker: u64,
    /// Safe or control.
    pub mode: Mode,
}

/// What a fixed-size run did: its operations and the violations its checker counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunReport {
    /// Operations performed.
    pub operations: u64,
    /// Violations the checker counted.
    pub violations: u64,
}

/// Runs `body(worker)` on `workers` tokio tasks and returns their results in worker order.
///
/// # Errors
/// The first error of a task, or a task's panic.
pub async fn run_tasks<T, F, Fut>(workers: usize, body: F) -> anyhow::Result<Vec<T>>
where
    T: Send + 'static,
    F: Fn(usize) -> Fut,
    Fut: Future<Output = anyhow::Result<T>> + Send + 'static,
{
    let tasks: Vec<_> = (0..workers).map(|w| tokio::spawn(body(w))).collect();
    let mut out = Vec::with_capacity(workers);
    for task in tasks {
        out.push(task.await??);
    }
    Ok(out)
}
