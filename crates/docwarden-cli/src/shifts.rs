//! The on-call data of seed 000, shared by `demo on-call`, `bench` and `verify guard`:
//! shifts with three doctors each, all on call, and the rule "at least one doctor on call".

use docwarden::guard::{Condition, Invariant};
use mongodb::Collection;
use mongodb::bson::{DateTime, Document, doc};

/// The doctors of every shift.
pub(crate) const DOCTORS: [&str; 3] = ["Alice", "Bob", "Carol"];

/// The business rule of the seed.
pub(crate) fn at_least_one_on_call() -> docwarden::Result<Invariant> {
    Invariant::at_least(
        "at least one doctor on call",
        "doctors",
        1,
        Condition::eq("on_call", true),
    )
}

/// Inserts shifts `0..n`, every doctor on call.
pub(crate) async fn insert(coll: &Collection<Document>, n: i64) -> anyhow::Result<()> {
    let shifts: Vec<Document> = (0..n)
        .map(|s| {
            let doctors: Vec<Document> = DOCTORS
                .iter()
                .map(|name| doc! { "name": *name, "on_call": true, "updated": DateTime::now() })
                .collect();
            doc! { "_id": s, "doctors": doctors }
        })
        .collect();
    coll.insert_many(shifts).await?;
    Ok(())
}
