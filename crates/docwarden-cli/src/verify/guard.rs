//! The guard workload: doctors going on and off call on 10 shifts; the rule "at least one
//! doctor on call" is checked by a read after every operation and at the end.
//!
//! The safe run uses one guarded update per change; the control run reads, decides in the
//! client, and writes unconditionally — the write skew the seed article demonstrates.

use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden::check::OpOutcome;
use docwarden::check::state::check_invariant_reads;
use docwarden::guard::{Change, GuardOptions, Guarded};
use mongodb::bson::{Document, doc};
use rand::Rng;

use super::{Ctx, Findings};

const SHIFTS: i64 = 10;

fn on_call_count(d: &Document) -> usize {
    d.get_array("doctors")
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_document())
                .filter(|x| x.get_bool("on_call").unwrap_or(false))
                .count()
        })
        .unwrap_or(0)
}

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    let coll = ctx.db.collection::<Document>("shifts");
    crate::shifts::insert(&coll, SHIFTS).await?;
    let c = Arc::clone(&ctx);
    ctx.supervise("guard", move |process| {
        let ctx = Arc::clone(&c);
        async move { worker(&ctx, process).await }
    })
    .await;
    // The final read of every shift.
    for s in 0..SHIFTS {
        if let Some(d) = coll.find_one(doc! { "_id": s }).await? {
            let holds = on_call_count(&d) >= 1;
            let at = ctx.history.now_us();
            ctx.history.push(
                docwarden::check::Event::new(u32::MAX - 1, "check", &format!("shift {s}"), at, at)
                    .outcome(if holds {
                        OpOutcome::Ok
                    } else {
                        OpOutcome::Failed
                    }),
            );
        }
    }
    let events = ctx.history.events();
    let reads = events.iter().filter(|e| e.op == "check").map(|e| {
        (
            e.key.as_str(),
            "at least one doctor on call",
            e.outcome == OpOutcome::Ok,
        )
    });
    let violations = check_invariant_reads(reads);
    Ok(Findings {
        operations: u64::try_from(events.iter().filter(|e| e.op != "check").count())
            .unwrap_or(u64::MAX),
        violations,
    })
}

async fn worker(ctx: &Ctx, process: u32) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let coll = ctx.db.collection::<Document>("shifts");
    let guarded = Guarded::new(coll.clone(), GuardOptions::default())?;
    let rule = crate::shifts::at_least_one_on_call()?;
    let mut rng = ctx.rng(process);
    while Instant::now() < deadline {
        let shift = rng.random_range(0..SHIFTS);
        let name = crate::shifts::DOCTORS[rng.random_range(0..crate::shifts::DOCTORS.len())];
        let on = rng.random_bool(0.5);
        let op = if on { "on-call" } else { "off-call" };
        let key = format!("shift {shift}");
        if ctx.control {
            // Read, decide, write unconditionally.
            let Ok(Some(d)) = coll.find_one(doc! { "_id": shift }).await else {
                continue;
            };
            let others = d
                .get_array("doctors")
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_document())
                        .filter(|x| {
                            x.get_str("name") != Ok(name) && x.get_bool("on_call").unwrap_or(false)
                        })
                        .count()
                })
                .unwrap_or(0);
            if on || others >= 1 {
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..3))).await;
                let start = ctx.history.now_us();
                let r = coll
                    .update_one(
                        doc! { "_id": shift, "doctors.name": name },
                        doc! { "$set": { "doctors.$.on_call": on } },
                    )
                    .await;
                ctx.history.push(
                    docwarden::check::Event::new(process, op, &key, start, ctx.history.now_us())
                        .outcome(if r.is_ok() {
                            OpOutcome::Ok
                        } else {
                            OpOutcome::Indeterminate
                        }),
                );
            }
        } else {
            let change = Change::set_member("doctors", "name", name, doc! { "on_call": on })?;
            let rule = rule.clone();
            ctx.history
                .record(
                    process,
                    op,
                    &key,
                    guarded.update(shift, &change, std::slice::from_ref(&rule)),
                    |r, e| match r {
                        Ok(outcome) => e.detail(format!("{outcome:?}")),
                        Err(err) => e.outcome(Ctx::outcome_of(r)).detail(err.to_string()),
                    },
                )
                .await
                .ok();
        }
        ctx.maybe_pause(&mut rng, process, 0.01, Duration::from_millis(200))
            .await;
        // The check after every operation.
        if let Ok(Some(d)) = coll.find_one(doc! { "_id": shift }).await {
            let at = ctx.history.now_us();
            ctx.history.push(
                docwarden::check::Event::new(process, "check", &key, at, at).outcome(
                    if on_call_count(&d) >= 1 {
                        OpOutcome::Ok
                    } else {
                        OpOutcome::Failed
                    },
                ),
            );
        }
    }
    Ok(())
}
