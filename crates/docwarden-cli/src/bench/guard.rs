//! Guarded updates: seed 000's toggles (`docwarden_workloads::on_call`) on random shifts,
//! each guarded by "at least one doctor on call" (refused and unchanged outcomes included:
//! every call counts as one operation).

use docwarden_workloads::Mode;
use docwarden_workloads::on_call::{self, OnCall, Toggle};
use mongodb::Database;
use mongodb::bson::Document;

use super::{BenchRow, Load, measure};

const SHIFTS: i64 = 1_000;

pub(crate) async fn run(db: &Database, load: &Load) -> anyhow::Result<Vec<BenchRow>> {
    let coll = db.collection::<Document>("bench_guard");
    on_call::setup(&coll, SHIFTS).await?;
    let workload = OnCall::new(coll)?;
    let row = measure("guard: on/off call (≥1 on call)", load, move |_| {
        let workload = workload.clone();
        async move {
            let toggle = Toggle::random(&mut rand::rng(), SHIFTS);
            workload.toggle(&toggle, Mode::Safe).await?;
            Ok(1)
        }
    })
    .await?;
    Ok(vec![row])
}
