//! Guarded updates: seed 000's toggles (`docwarden_workloads::on_call`) on random shifts,
//! each guarded by "at least one doctor on call" (refused and unchanged outcomes included:
//! every call counts as one operation), one per call and in batches of 64 per
//! `Guarded::update_many` (one `bulkWrite` per batch on MongoDB 8.0+; ops/s counts toggles).
//!
//! With `--stages`, two more rows of the same toggles:
//! - written unguarded (seed 000's own `update_one` by `_id` and `$elemMatch`,
//!   `Mode::Control` without its read): the floor a guarded update is compared with;
//! - the guarded update's own command sent raw (the library's filter and pipeline, built
//!   per call by `Toggle::change`, `Change::filter` and `Change::pipeline`, without the
//!   read that explains a refused toggle, the retry and the outcome): what the guard's one
//!   write costs, apart from what the library does around it (since session 32).

use docwarden_workloads::Mode;
use docwarden_workloads::on_call::{self, OnCall, Toggle};
use mongodb::Database;
use mongodb::bson::{DateTime, Document, doc};

/// The guarded toggle, one `update` per call (an issue 14 target row).
pub(crate) const ONE_PER_CALL: &str = "guard: on/off call (≥1 on call)";
/// The same toggles written unguarded (its floor, `--stages`).
pub(crate) const UNGUARDED: &str = "guard stage: unguarded toggle (update_one)";
/// The guarded update's command sent raw (`--stages`).
pub(crate) const COMMAND_RAW: &str =
    "guard stage: the guarded update's command raw (no diagnosing read)";

use super::{BenchRow, Load, measure};

const SHIFTS: i64 = 1_000;

/// Toggles per `update_many` call in the batched row.
const BATCH: usize = 64;

pub(crate) async fn run(db: &Database, load: &Load) -> anyhow::Result<Vec<BenchRow>> {
    let coll = db.collection::<Document>("bench_guard");
    on_call::setup(&coll, SHIFTS).await?;
    let mut rows = Vec::new();
    if load.stages {
        let c = coll.clone();
        rows.push(
            measure(UNGUARDED, load, move |_| {
                let c = c.clone();
                async move {
                    let t = Toggle::random(&mut rand::rng(), SHIFTS);
                    c.update_one(
                        doc! { "_id": t.shift, "doctors": { "$elemMatch": { "name": t.doctor } } },
                        doc! { "$set": { "doctors.$.on_call": t.on, "doctors.$.updated": DateTime::now() } },
                    )
                    .await?;
                    Ok(1)
                }
            })
            .await?,
        );
        let c = coll.clone();
        let rules = std::sync::Arc::new([on_call::rule()?]);
        rows.push(
            measure(COMMAND_RAW, load, move |_| {
                let c = c.clone();
                let rules = std::sync::Arc::clone(&rules);
                async move {
                    let t = Toggle::random(&mut rand::rng(), SHIFTS);
                    let change = t.change()?;
                    c.update_one(change.filter(&t.shift.into()), change.pipeline(&*rules))
                        .await?;
                    Ok(1)
                }
            })
            .await?,
        );
    }
    let workload = OnCall::new(coll)?;
    let batched = workload.clone();
    rows.push(
        measure(ONE_PER_CALL, load, move |_| {
            let workload = workload.clone();
            async move {
                let toggle = Toggle::random(&mut rand::rng(), SHIFTS);
                workload.toggle(&toggle, Mode::Safe).await?;
                Ok(1)
            }
        })
        .await?,
    );
    rows.push(
        measure(
            "guard: on/off call, batches of 64 (update_many)",
            load,
            move |_| {
                let workload = batched.clone();
                async move {
                    let toggles: Vec<Toggle> = {
                        let mut rng = rand::rng();
                        (0..BATCH)
                            .map(|_| Toggle::random(&mut rng, SHIFTS))
                            .collect()
                    };
                    workload.toggle_batch(&toggles, Mode::Safe).await?;
                    Ok(BATCH as u64)
                }
            },
        )
        .await?,
    );
    Ok(rows)
}
