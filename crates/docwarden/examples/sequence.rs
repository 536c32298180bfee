//! Out-of-order, duplicated enroll/unenroll messages converge to one document per student.
//!
//! `cargo run -p docwarden --example sequence` (against `MONGODB_URI`, or an embedded
//! server).

use std::time::Duration;

use docwarden::sequence::{SequencedSet, SetOptions};
use docwarden_server::{Target, connect};
use mongodb::bson::doc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let target = Target::resolve(None, None).await?; // MONGODB_URI, or an embedded server
    let client = connect(&target.uri(), Duration::from_secs(10)).await?;
    let db = client.database("docwarden_example_sequence");

    let options = SetOptions::default()
        .key_field("student_id")
        .field("classes");
    let classes = SequencedSet::open(&db, "students", options).await?;
    // Sent as: enroll (1), unenroll (2), enroll (3). Delivered as 1, 3, 2, and 3 twice:
    // the seed's own counter-example, which loses the last enrollment there.
    println!("{:?}", classes.add(7, "CS 101", 1).await?);
    println!("{:?}", classes.add(7, "CS 101", 3).await?);
    println!("{:?}", classes.remove(7, "CS 101", 2).await?); // older than 3: Stale
    println!("{:?}", classes.add(7, "CS 101", 3).await?); // a redelivery: Duplicate
    let student = db
        .collection::<mongodb::bson::Document>("students")
        .find_one(doc! { "student_id": 7 })
        .await?
        .ok_or_else(|| anyhow::anyhow!("one document per student"))?;
    println!(
        "classes of student 7: {}",
        student.get_array("classes")?.len()
    );
    db.drop().await?;
    Ok(())
}
