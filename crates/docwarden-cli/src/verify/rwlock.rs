//! Records read/write locks (`docwarden_workloads::rwlock`): every worker reads (three
//! times in four) or writes one resource in a loop, and after its work inside confirms its
//! lease still certainly valid and records the stretch. Under `pause`, a holder now and
//! then stays inside past its lease (it then cannot confirm; `sigstop` and `kill` do the
//! same to whole processes). The control run's writer does not wait for the readers inside.
//!
//! Checked: no confirmed write stretch overlaps a confirmed read or write stretch.

use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::Owner;
use docwarden_workloads::rwlock::{self, Shared};
use docwarden_workloads::{Mode, Process};
use rand::Rng;

use super::args::Fault;
use super::context::{Ctx, Findings};

/// The lease a `sigstop` must outlive.
pub(super) const TTL: Duration = rwlock::TTL;

/// The safe run uses the worker's clock (skewed, stepped under the clock faults); the
/// control switches only the writer's wait for readers off, so it keeps the server clock.
fn time(ctx: &Ctx, process: Process) -> anyhow::Result<TimeSource> {
    Ok(match ctx.mode {
        Mode::Safe => ctx.clock(process)?,
        Mode::Control => TimeSource::server(ctx.client.clone(), ClockOptions::default())?,
    })
}

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    Shared::setup(
        &ctx.db,
        TimeSource::server(ctx.client.clone(), ClockOptions::default())?,
    )
    .await?;
    let c = Arc::clone(&ctx);
    ctx.supervise("rwlock", move |process| {
        let ctx = Arc::clone(&c);
        async move { worker(&ctx, process).await }
    })
    .await;
    let events = ctx.history.events();
    Ok(Findings {
        operations: u64::try_from(events.len()).unwrap_or(u64::MAX),
        violations: rwlock::check(&events),
    })
}

/// One worker: read or write, until the deadline.
pub(super) async fn worker(ctx: &Ctx, process: Process) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let shared = Shared::new(&ctx.db, time(ctx, process)?, ctx.mode)?;
    let owner = Owner::random();
    let mut rng = ctx.rng(process);
    while Instant::now() < deadline {
        let write = rng.random_bool(0.25);
        let pause = (ctx.has(Fault::Pause) && rng.random_bool(0.05)).then_some(TTL * 2);
        let start = ctx.history.now_us();
        shared
            .round(&ctx.history, process.id(), &owner, write, pause)
            .await?;
        if pause.is_some() {
            ctx.injected(Fault::Pause, process, start, ctx.history.now_us());
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(1..5))).await;
    }
    Ok(())
}
