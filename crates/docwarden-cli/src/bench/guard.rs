//! Guarded updates: doctors toggled on and off call on random shifts, each update guarded
//! by "at least one doctor on call" (refused and unchanged outcomes included: every call
//! counts as one operation).

use docwarden::guard::{Change, Condition, Guarded, Invariant};
use mongodb::Database;
use mongodb::bson::{DateTime, Document, doc};

use super::{BenchRow, Load, measure};

const SHIFTS: i64 = 1_000;
const DOCTORS: [&str; 3] = ["Alice", "Bob", "Carol"];

pub(crate) async fn run(db: &Database, load: &Load) -> anyhow::Result<Vec<BenchRow>> {
    let coll = db.collection::<Document>("bench_guard");
    let shifts: Vec<Document> = (0..SHIFTS)
        .map(|s| {
            let doctors: Vec<Document> = DOCTORS
                .iter()
                .map(|n| doc! { "name": *n, "on_call": true, "updated": DateTime::now() })
                .collect();
            doc! { "_id": s, "doctors": doctors }
        })
        .collect();
    coll.insert_many(shifts).await?;
    let guarded = Guarded::new(coll)?;
    let rule = Invariant::at_least(
        "at least one doctor on call",
        "doctors",
        1,
        Condition::eq("on_call", true),
    )?;
    let row = measure("guard: on/off call (≥1 on call)", load, move |_| {
        let guarded = guarded.clone();
        let rule = rule.clone();
        async move {
            let shift = rand::random_range(0..SHIFTS);
            let doctor = DOCTORS[rand::random_range(0..DOCTORS.len())];
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
