//! Records seed 000 (`docwarden_workloads::on_call`): doctors going on and off call on 10
//! shifts; the rule "at least one doctor on call" is checked by a read after every
//! operation and at the end. The safe run uses one guarded update per change (half the
//! workers: batches of guarded updates, `Guarded::update_many`); the control run reads,
//! decides in the client, and writes unconditionally (the batching workers: the same
//! batches without the rule).

use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden_workloads::Process;
use docwarden_workloads::on_call::{self, OnCall, Toggle};
use mongodb::bson::Document;

use super::context::{Ctx, Findings};

const SHIFTS: i64 = 10;
const SHIFTS_COLLECTION: &str = "shifts";
/// Toggles per batch of the batching workers.
const BATCH: usize = 4;
/// The history's name of a batch of toggles.
const BATCH_OP: &str = "toggle-batch";

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

/// Toggles random shifts until the deadline, each followed by a check. Workers with an
/// odd id send their toggles [`BATCH`] at a time (`Guarded::update_many`, one event per
/// batch), each toggled shift checked after the batch.
pub(super) async fn worker(ctx: &Ctx, process: Process) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let workload = OnCall::new(ctx.db.collection::<Document>(SHIFTS_COLLECTION))?;
    let mut rng = ctx.rng(process);
    let batches = process.id() % 2 == 1;
    while Instant::now() < deadline && batches {
        let toggles: Vec<Toggle> = (0..BATCH)
            .map(|_| Toggle::random(&mut rng, SHIFTS))
            .collect();
        let key = toggles
            .iter()
            .map(|t| on_call::shift_key(t.shift))
            .collect::<Vec<_>>()
            .join(",");
        ctx.history
            .record(
                process.id(),
                BATCH_OP,
                &key,
                workload.toggle_batch(&toggles, ctx.mode),
                |r, e| match r {
                    Ok(outcomes) => e.detail(format!("{outcomes:?}")),
                    Err(err) => e.outcome(Ctx::outcome_of(r)).detail(err.to_string()),
                },
            )
            .await
            .ok();
        ctx.maybe_pause(&mut rng, process, 0.01, Duration::from_millis(200))
            .await;
        for t in &toggles {
            let at = ctx.history.now_us();
            if let Ok(event) = workload.check_event(process.id(), t.shift, at).await {
                ctx.history.push(event);
            }
        }
    }
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
