//! Records seeds 003/004's counters under leases (`docwarden_workloads::counters`):
//! read-modify-write of counters under leases, every write fenced.
//!
//! Each worker repeatedly acquires one of four resources with a 1 s lease, registers its
//! token on the counter document (a fenced touch, so no older holder can write after this
//! point), reads the counter, possibly pauses past its lease, and writes `n + 1` fenced by
//! its token. The control run trusts client clocks and its fence checks no token.
//!
//! Checked: tokens strictly increase per resource, no stale write accepted, and every
//! counter equals its acknowledged increments (give or take uncertain ones).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden::check::{Event, OpOutcome};
use docwarden::lock::{FenceOutcome, LockCollection, LockOptions, Owner};
use docwarden_workloads::Process;
use docwarden_workloads::counters::{self, Counters, Op};
use mongodb::bson::Document;
use rand::Rng;

use super::context::{Ctx, Findings};

const RESOURCES: usize = 4;
/// The lease of each acquire.
pub(super) const TTL: Duration = Duration::from_secs(1);
const COUNTERS: &str = "counters";

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    let counters = Counters::new(ctx.db.collection::<Document>(COUNTERS));
    counters.setup(RESOURCES).await?;
    let c = Arc::clone(&ctx);
    ctx.supervise("locks", move |process| {
        let ctx = Arc::clone(&c);
        async move { worker(&ctx, process).await }
    })
    .await;

    let finals = counters.finals().await?;
    let events = ctx.history.events();
    let (acked, uncertain) = tally(&events);
    Ok(Findings {
        operations: u64::try_from(events.len()).unwrap_or(u64::MAX),
        violations: counters::check(&events, &acked, &uncertain, &finals),
    })
}

/// The increments per counter from the history: acknowledged (an applied write) and
/// uncertain (an indeterminate one: an error that may have landed, a worker killed or
/// aborted mid-write).
fn tally(events: &[Event]) -> (BTreeMap<String, i64>, BTreeMap<String, i64>) {
    let (mut acked, mut uncertain) = (BTreeMap::new(), BTreeMap::new());
    for e in events.iter().filter(|e| e.op == Op::Write.as_str()) {
        let map = match e.outcome {
            OpOutcome::Ok => &mut acked,
            OpOutcome::Indeterminate => &mut uncertain,
            OpOutcome::Failed => continue,
        };
        *map.entry(e.key.clone()).or_default() += 1;
    }
    (acked, uncertain)
}

fn classify(r: &docwarden::Result<FenceOutcome>, e: Event) -> Event {
    match r {
        Ok(FenceOutcome::Applied) => e,
        Ok(other) => e.outcome(OpOutcome::Failed).detail(format!("{other:?}")),
        Err(err) => e.outcome(Ctx::outcome_of(r)).detail(err.to_string()),
    }
}

pub(super) async fn worker(ctx: &Ctx, process: Process) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let counters = Counters::new(ctx.db.collection::<Document>(COUNTERS));
    let mut rng = ctx.rng(process);
    let locks = LockCollection::open(
        &ctx.db,
        "verify_locks",
        ctx.clock(process)?,
        LockOptions::default(),
    )
    .await?;
    let fence = counters.fence(ctx.mode)?;
    let owner = Owner::random();
    let (h, p) = (&ctx.history, process.id());
    while Instant::now() < deadline {
        let key = counters::resource(rng.random_range(0..RESOURCES));
        let acquired = h
            .record(
                p,
                Op::Acquire.as_str(),
                &key,
                locks.try_acquire(&owner, &key, TTL),
                |r, e| match r {
                    Ok(Some(l)) => e.token(l.token.get()),
                    Ok(None) => e.outcome(OpOutcome::Failed).detail("held"),
                    Err(err) => e.outcome(Ctx::outcome_of(r)).detail(err.to_string()),
                },
            )
            .await;
        let lease = match acquired {
            Ok(Some(lease)) => lease,
            Ok(None) => {
                tokio::time::sleep(Duration::from_millis(rng.random_range(1..10))).await;
                continue;
            }
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // The fenced touch registers our token before we read.
        let touched = h
            .record(
                p,
                Op::Touch.as_str(),
                &key,
                counters.touch(&fence, &lease, &key, &owner),
                |r, e| classify(r, e.token(lease.token.into())),
            )
            .await;
        let read = match touched {
            Ok(FenceOutcome::Applied) => counters.read(&key).await.ok(),
            _ => None,
        };
        let Some(value) = read else {
            let _ = locks.release(&lease).await;
            continue;
        };
        ctx.maybe_pause(&mut rng, process, 0.05, TTL + Duration::from_millis(700))
            .await;
        h.record(
            p,
            Op::Write.as_str(),
            &key,
            counters.write(&fence, &lease, &key, value + 1),
            |r, e| classify(r, e.token(lease.token.into()).value(value + 1)),
        )
        .await
        .ok();
        h.record(
            p,
            Op::Release.as_str(),
            &key,
            locks.release(&lease),
            |r, e| e.token(lease.token.into()).outcome(Ctx::outcome_of(r)),
        )
        .await
        .ok();
    }
    Ok(())
}
