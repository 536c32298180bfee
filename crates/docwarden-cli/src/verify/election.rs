//! Records leader election (`docwarden_workloads::election`): every worker campaigns in a
//! loop; a leader claims its validity and appends its term to a log with writes fenced by
//! the term, then resigns. Under `pause`, a leader now and then stops renewing, sleeps past
//! its term and writes with its old term (`sigstop` does the same to a whole process, and
//! `kill` kills leaders mid-term). The control run's fence checks no term.
//!
//! Checked: one leader per term, terms strictly increasing, no newer term won within a
//! leader's validity claim, and the fenced log never goes down.

use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::Owner;
use docwarden_workloads::election::{self, Leaders};
use docwarden_workloads::{Mode, Process};
use rand::Rng;

use super::args::Fault;
use super::context::{Ctx, Findings};

/// The lease a `sigstop` must outlive.
pub(super) const TTL: Duration = election::TERM_TTL;

/// The safe run uses the worker's clock (skewed, stepped under the clock faults); the
/// control switches only the fence's term check off, so it keeps the server clock.
fn time(ctx: &Ctx, process: Process) -> anyhow::Result<TimeSource> {
    Ok(match ctx.mode {
        Mode::Safe => ctx.clock(process)?,
        Mode::Control => TimeSource::server(ctx.client.clone(), ClockOptions::default())?,
    })
}

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    Leaders::setup(
        &ctx.db,
        TimeSource::server(ctx.client.clone(), ClockOptions::default())?,
    )
    .await?;
    let c = Arc::clone(&ctx);
    ctx.supervise("election", move |process| {
        let ctx = Arc::clone(&c);
        async move { worker(&ctx, process).await }
    })
    .await;
    let log = Leaders::log(&ctx.db).await?;
    let events = ctx.history.events();
    Ok(Findings {
        operations: u64::try_from(events.len()).unwrap_or(u64::MAX),
        violations: election::check(&events, &log),
    })
}

/// One worker: campaign, lead (fenced writes), resign, until the deadline.
pub(super) async fn worker(ctx: &Ctx, process: Process) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let leaders = Leaders::new(&ctx.db, time(ctx, process)?, ctx.mode)?;
    let owner = Owner::random();
    let mut rng = ctx.rng(process);
    while Instant::now() < deadline {
        let pause = (ctx.has(Fault::Pause) && rng.random_bool(0.3)).then_some(TTL * 2);
        let start = ctx.history.now_us();
        let paused = leaders
            .round(&ctx.history, process.id(), &owner, pause)
            .await?;
        if paused {
            ctx.injected(Fault::Pause, process, start, ctx.history.now_us());
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(1..20))).await;
    }
    Ok(())
}
