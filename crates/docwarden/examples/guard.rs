//! Doctors on call (seed 000): racing "go off call" requests never leave a shift uncovered.
//!
//! `cargo run -p docwarden --example guard` (against `MONGODB_URI`, or an embedded server).

use std::time::Duration;

use docwarden::guard::{
    self, Change, Condition, GuardOptions, Guarded, Invariant, ValidatorOptions,
};
use docwarden_server::{Target, connect};
use mongodb::bson::doc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let target = Target::resolve(None, None).await?; // MONGODB_URI, or an embedded server
    let client = connect(&target.uri(), Duration::from_secs(10)).await?;
    let db = client.database("docwarden_example_guard");

    let shifts = Guarded::open(&db, "shifts", GuardOptions::default()).await?;
    shifts
        .collection()
        .insert_one(doc! { "_id": 1, "doctors": [
            { "name": "Alice", "on_call": true },
            { "name": "Bob", "on_call": true },
        ] })
        .await?;
    let rule = Invariant::at_least(
        "someone on call",
        "doctors",
        1,
        Condition::eq("on_call", true),
    )?;

    // Alice and Bob both ask to go off call at the same time: exactly one succeeds.
    let off = |name: &str| Change::set_member("doctors", "name", name, doc! { "on_call": false });
    let (alice, bob) = (off("Alice")?, off("Bob")?);
    let rules = [rule.clone()];
    let (a, b) = tokio::join!(
        shifts.update(1, &alice, &rules),
        shifts.update(1, &bob, &rules)
    );
    println!("Alice off call: {:?}", a?);
    println!("Bob off call:   {:?}", b?);

    // The same rule as the collection's validator refuses a write that bypasses docwarden.
    guard::install_validator(shifts.collection(), &[rule], &ValidatorOptions::default()).await?;
    let bypass = shifts
        .collection()
        .update_one(
            doc! { "_id": 1 },
            doc! { "$set": { "doctors.$[].on_call": false } },
        )
        .await;
    // Code 121 (DocumentValidationFailure) is the validator's refusal; any other error
    // is something else (the server unreachable, …) and is reported as such.
    match bypass {
        Err(e) if docwarden::error::error_code(&e) == Some(121) => {
            println!("a bypassing write: refused by the validator (code 121)");
        }
        Err(e) => return Err(e.into()),
        Ok(_) => println!("a bypassing write: accepted!"),
    }
    db.drop().await?;
    Ok(())
}
