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
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use docwarden::check::{Event, OpOutcome};
use docwarden::lock::{FenceOutcome, LockCollection, LockOptions, Owner};
use docwarden_workloads::Process;
use docwarden_workloads::counters::{self, Counters, Op};
use mongodb::bson::Document;
use rand::Rng;

use super::context::{Ctx, Findings};

const RESOURCES: usize = 4;
const TTL: Duration = Duration::from_secs(1);

#[derive(Default)]
struct Tally {
    acked: BTreeMap<String, i64>,
    uncertain: BTreeMap<String, i64>,
}

impl Tally {
    fn add(this: &Mutex<Tally>, acked: bool, key: &str, n: i64) {
        let mut t = this.lock().unwrap_or_else(|p| p.into_inner());
        let map = if acked {
            &mut t.acked
        } else {
            &mut t.uncertain
        };
        *map.entry(key.to_owned()).or_default() += n;
    }
}

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    let counters = Counters::new(ctx.db.collection::<Document>("counters"));
    counters.setup(RESOURCES).await?;
    let tally = Arc::new(Mutex::new(Tally::default()));
    let (c, t, k) = (Arc::clone(&ctx), Arc::clone(&tally), counters.clone());
    ctx.supervise("locks", move |process| {
        let (ctx, tally, counters) = (Arc::clone(&c), Arc::clone(&t), k.clone());
        async move { worker(&ctx, &counters, &tally, process).await }
    })
    .await;

    let finals = counters.finals().await?;
    let events = ctx.history.events();
    let t = tally.lock().unwrap_or_else(|p| p.into_inner());
    Ok(Findings {
        operations: u64::try_from(events.len()).unwrap_or(u64::MAX),
        violations: counters::check(&events, &t.acked, &t.uncertain, &finals),
    })
}

fn classify(r: &docwarden::Result<FenceOutcome>, e: Event) -> Event {
    match r {
        Ok(FenceOutcome::Applied) => e,
        Ok(other) => e.outcome(OpOutcome::Failed).detail(format!("{other:?}")),
        Err(err) => e.outcome(Ctx::outcome_of(r)).detail(err.to_string()),
    }
}

async fn worker(
    ctx: &Ctx,
    counters: &Counters,
    tally: &Mutex<Tally>,
    process: Process,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
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
        Tally::add(tally, false, &key, 1);
        let written = h
            .record(
                p,
                Op::Write.as_str(),
                &key,
                counters.write(&fence, &lease, &key, value + 1),
                |r, e| classify(r, e.token(lease.token.into()).value(value + 1)),
            )
            .await;
        match written {
            Ok(FenceOutcome::Applied) => {
                Tally::add(tally, false, &key, -1);
                Tally::add(tally, true, &key, 1);
            }
            Ok(_) => Tally::add(tally, false, &key, -1),
            Err(ref e) if !e.is_retryable() => Tally::add(tally, false, &key, -1),
            Err(_) => {} // may or may not have landed: stays uncertain
        }
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
