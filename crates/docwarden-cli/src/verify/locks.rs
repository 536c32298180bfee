//! The locks workload: read-modify-write of counters under leases, every write fenced.
//!
//! Each worker repeatedly acquires one of four resources with a 1 s lease, registers its
//! token on the counter document (a fenced touch, so no older holder can write after this
//! point), reads the counter, possibly pauses past its lease, and writes `value + 1`
//! fenced by its token. The control run trusts client clocks and writes unfenced.
//!
//! Checked: tokens strictly increase per resource, no stale write accepted, and every
//! counter equals its acknowledged increments (give or take uncertain ones).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use docwarden::check::{OpOutcome, lease};
use docwarden::lock::{Fence, FenceOptions, FenceOutcome, LockCollection, LockOptions, Owner};
use mongodb::bson::{Document, doc};
use rand::Rng;

use super::{Ctx, Findings};

const RESOURCES: usize = 4;
const TTL: Duration = Duration::from_secs(1);

#[derive(Default)]
struct Tally {
    acked: BTreeMap<String, i64>,
    uncertain: BTreeMap<String, i64>,
}

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    let counters = ctx.db.collection::<Document>("counters");
    for r in 0..RESOURCES {
        counters
            .insert_one(doc! { "_id": format!("r{r}"), "value": 0_i64 })
            .await?;
    }
    let tally = Arc::new(Mutex::new(Tally::default()));
    let (c, t) = (Arc::clone(&ctx), Arc::clone(&tally));
    ctx.supervise("locks", move |process| {
        let (ctx, tally) = (Arc::clone(&c), Arc::clone(&t));
        async move { worker(&ctx, &tally, process).await }
    })
    .await;

    let mut finals = BTreeMap::new();
    let direct = ctx.db.collection::<Document>("counters");
    for r in 0..RESOURCES {
        let key = format!("r{r}");
        let value = read_value(&direct, &key).await?;
        finals.insert(key, value);
    }
    let events = ctx.history.events();
    let (acked, uncertain) = {
        let t = tally.lock().unwrap_or_else(|p| p.into_inner());
        (t.acked.clone(), t.uncertain.clone())
    };
    let mut violations = lease::check_tokens(&events);
    violations.extend(lease::check_counters(&acked, &uncertain, &finals));
    Ok(Findings {
        operations: u64::try_from(events.len()).unwrap_or(u64::MAX),
        violations,
    })
}

async fn read_value(coll: &mongodb::Collection<Document>, key: &str) -> anyhow::Result<i64> {
    let d = coll
        .find_one(doc! { "_id": key })
        .await?
        .ok_or_else(|| anyhow::anyhow!("counter {key} is missing"))?;
    Ok(d.get_i64("value").unwrap_or_default())
}

async fn worker(ctx: &Ctx, tally: &Mutex<Tally>, process: u32) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let mut rng = ctx.rng(process);
    let locks = LockCollection::open(
        &ctx.db,
        "verify_locks",
        ctx.clock(process)?,
        LockOptions::default(),
    )
    .await?;
    let fence = Fence::new(ctx.db.collection("counters"), FenceOptions::default())?;
    let counters = ctx.db.collection::<Document>("counters");
    let owner = Owner::random();
    let h = &ctx.history;
    while Instant::now() < deadline {
        let key = format!("r{}", rng.random_range(0..RESOURCES));
        let acquired = h
            .record(
                process,
                "acquire",
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
        if !ctx.control {
            let touched = h
                .record(
                    process,
                    "touch",
                    &key,
                    fence.apply(
                        &lease,
                        doc! { "_id": &key },
                        doc! { "$set": { "holder": owner.id() } },
                    ),
                    |r, e| {
                        let e = e.token(lease.token.get());
                        match r {
                            Ok(FenceOutcome::Applied) => e,
                            Ok(other) => e.outcome(OpOutcome::Failed).detail(format!("{other:?}")),
                            Err(err) => e.outcome(Ctx::outcome_of(r)).detail(err.to_string()),
                        }
                    },
                )
                .await;
            if !matches!(touched, Ok(FenceOutcome::Applied)) {
                let _ = locks.release(&lease).await;
                continue;
            }
        }
        let Ok(value) = read_value(&counters, &key).await else {
            let _ = locks.release(&lease).await;
            continue;
        };
        ctx.maybe_pause(&mut rng, process, 0.05, TTL + Duration::from_millis(700))
            .await;
        tally_add(tally, |t| &mut t.uncertain, &key, 1);
        let written = if ctx.control {
            h.record(
                process,
                "write",
                &key,
                async {
                    counters
                        .update_one(
                            doc! { "_id": &key },
                            doc! { "$set": { "value": value + 1 } },
                        )
                        .await
                        .map(|_| FenceOutcome::Applied)
                        .map_err(docwarden::Error::from)
                },
                |r, e| classify_write(r, e.token(lease.token.get()).value(value + 1)),
            )
            .await
        } else {
            h.record(
                process,
                "write",
                &key,
                fence.apply(
                    &lease,
                    doc! { "_id": &key },
                    doc! { "$set": { "value": value + 1 } },
                ),
                |r, e| classify_write(r, e.token(lease.token.get()).value(value + 1)),
            )
            .await
        };
        match written {
            Ok(FenceOutcome::Applied) => {
                tally_add(tally, |t| &mut t.uncertain, &key, -1);
                tally_add(tally, |t| &mut t.acked, &key, 1);
            }
            Ok(_) => tally_add(tally, |t| &mut t.uncertain, &key, -1),
            Err(ref e) if !e.is_retryable() => tally_add(tally, |t| &mut t.uncertain, &key, -1),
            Err(_) => {} // may or may not have landed: stays uncertain
        }
        h.record(process, "release", &key, locks.release(&lease), |r, e| {
            e.token(lease.token.get()).outcome(Ctx::outcome_of(r))
        })
        .await
        .ok();
    }
    Ok(())
}

fn classify_write(
    r: &docwarden::Result<FenceOutcome>,
    e: docwarden::check::Event,
) -> docwarden::check::Event {
    match r {
        Ok(FenceOutcome::Applied) => e,
        Ok(other) => e.outcome(OpOutcome::Failed).detail(format!("{other:?}")),
        Err(err) => e.outcome(Ctx::outcome_of(r)).detail(err.to_string()),
    }
}

fn tally_add(
    tally: &Mutex<Tally>,
    field: impl Fn(&mut Tally) -> &mut BTreeMap<String, i64>,
    key: &str,
    n: i64,
) {
    let mut t = tally.lock().unwrap_or_else(|p| p.into_inner());
    *field(&mut t).entry(key.to_owned()).or_default() += n;
}
