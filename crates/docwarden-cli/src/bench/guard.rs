//! Guarded updates: doctors toggled on and off call on random shifts, each update guarded
//! by "at least one doctor on call" (refused and unchanged outcomes included: every call
//! counts as one operation).

use docwarden::guard::{Change, GuardOptions, Guarded};
use mongodb::Database;
use mongodb::bson::{DateTime, Document, doc};

use super::{BenchRow, Load, measure};

const SHIFTS: i64 = 1_000;

pub(crate) async fn run(db: &Database, load: &Load) -> anyhow::Result<Vec<BenchRow>> {
    let coll = db.collection::<Document>("bench_guard");
    crate::shifts::insert(&coll, SHIFTS).await?;
    let guarded = Guarded::new(coll, GuardOptions::default())?;
    let rule = crate::shifts::at_least_one_on_call()?;
    let row = measure("guard: on/off call (≥1 on call)", load, move |_| {
        let guarded = guarded.clone();
        let rule = rule.clone();
        async move {
            let shift = rand::random_range(0..SHIFTS);
            let doctor =
                crate::shifts::DOCTORS[rand::random_range(0..crate::shifts::DOCTORS.len())];
            let change = Change::set_member(
                "doctors",
                "name",
                doctor,
                doc! { "on_call": rand::random_bool(0.5), "updated": DateTime::now() },
            )?;
            guarded.update(shift, &change, &[rule]).await?;
            Ok(1)
        }
    })
    .await?;
    Ok(vec![row])
}
