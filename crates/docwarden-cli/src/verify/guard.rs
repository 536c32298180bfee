//! Records seed 000 (`docwarden_workloads::on_call`): doctors going on and off call on 10
//! shifts; the rule "at least one doctor on call" is checked by a read after every
//! operation and at the end. The safe run uses one guarded update per change; the control
//! run reads, decides in the client, and writes unconditionally.

use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden_workloads::Process;
use docwarden_workloads::on_call::{self, OnCall, Toggle};
use mongodb::bson::Document;

use super::context::{Ctx, Findings};

const SHIFTS: i64 = 10;
const SHIFTS_COLLECTION: &str = "shifts";

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    let coll = ctx.db.collection::<Document>(SHIFTS_COLLECTION);
    on_call::setup(&coll, SHIFTS).await?;
    let workload = OnCall::new(coll)?;
    let c = Arc::clone(&ctx);
    ctx.supervise("guard", move |process| {
        let ctx = Arc::clone(&c);
        async move { worker(&ctx, process).await }
    })
    .await;
    // The final read of every shift.
    for shift in 0..SHIFTS {
        let at = ctx.history.now_us();
        ctx.history
            .push(workload.check_event(Process::Drain.id(), shift, at).await?);
    }
    let events = ctx.history.events();
    Ok(Findings {
        operations: u64::try_from(
            events
                .iter()
                .filter(|e| e.op != on_call::Op::Check.as_str())
                .count(),
        )
        .unwrap_or(u64::MAX),
        violations: on_call::check(&events),
    })
}

/// Toggles random shifts until the deadline, each followed by a check.
pub(super) async fn worker(ctx: &Ctx, process: Process) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let workload = OnCall::new(ctx.db.collection::<Document>(SHIFTS_COLLECTION))?;
    let mut rng = ctx.rng(process);
    while Instant::now() < deadline {
        let toggle = Toggle::random(&mut rng, SHIFTS);
        let key = on_call::shift_key(toggle.shift);
        ctx.history
            .record(
                process.id(),
                toggle.op().as_str(),
                &key,
                workload.toggle(&toggle, ctx.mode),
                |r, e| match r {
                    Ok(outcome) => e.detail(format!("{outcome:?}")),
                    Err(err) => e.outcome(Ctx::outcome_of(r)).detail(err.to_string()),
                },
            )
            .await
            .ok();
        ctx.maybe_pause(&mut rng, process, 0.01, Duration::from_millis(200))
            .await;
        // The check after every operation.
        let at = ctx.history.now_us();
        if let Ok(event) = workload.check_event(process.id(), toggle.shift, at).await {
            ctx.history.push(event);
        }
    }
    Ok(())
}
