//! `open` refuses what docwarden cannot honour: a collection with a non-simple default
//! collation (finding 9) and a server older than the minimum version (finding 10).

use std::time::Duration;

use docwarden::Error;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{LockCollection, LockOptions};
use docwarden::preflight::{self, MIN_WIRE_VERSION};
use docwarden::queue::{JobQueue, QueueOptions};
use docwarden::sequence::{SequencedSet, SetOptions};
use docwarden_testkit::TestDb;
use mongodb::options::{Collation, CollationStrength};

/// Creates `name` with a case-insensitive default collation; `None` if the server refuses
/// collations (the test is then skipped, loudly).
async fn case_insensitive(t: &TestDb, test: &str, name: &str) -> anyhow::Result<bool> {
    let collation = Collation::builder()
        .locale("en")
        .strength(CollationStrength::Secondary)
        .build();
    if let Err(e) = t.db.create_collection(name).collation(collation).await {
        docwarden_testkit::skip(test, &format!("the server refuses collations: {e}"));
        return Ok(false);
    }
    match preflight::default_collation(&t.db, name).await? {
        Some(_) => Ok(true),
        None => {
            docwarden_testkit::skip(test, "the server ignores a collection's default collation");
            Ok(false)
        }
    }
}

fn is_incompatible(r: &docwarden::Result<impl Sized>) -> bool {
    matches!(r, Err(Error::Incompatible { reason }) if reason.contains("collation"))
}

#[tokio::test]
async fn every_open_refuses_a_case_insensitive_collection() -> anyhow::Result<()> {
    let test = "every_open_refuses_a_case_insensitive_collection";
    let t = TestDb::new(test).await?;
    for name in ["locks", "jobs", "sets"] {
        if !case_insensitive(&t, test, name).await? {
            return Ok(());
        }
    }
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let locks = LockCollection::open(&t.db, "locks", time.clone(), LockOptions::default()).await;
    assert!(is_incompatible(&locks), "lock collection: {locks:?}");
    let jobs = JobQueue::open(&t.db, "jobs", time, QueueOptions::default()).await;
    assert!(is_incompatible(&jobs), "queue: {:?}", jobs.err());
    let sets = SequencedSet::open(&t.db, "sets", SetOptions::default()).await;
    assert!(is_incompatible(&sets), "sequenced set: {:?}", sets.err());
    // Nothing was written: no index was created on the refused collections.
    let indexes =
        t.db.collection::<mongodb::bson::Document>("locks")
            .list_index_names()
            .await?;
    assert_eq!(indexes, vec!["_id_".to_owned()]);
    Ok(())
}

#[tokio::test]
async fn a_simple_collation_collection_is_accepted() -> anyhow::Result<()> {
    let t = TestDb::new("a_simple_collation_collection_is_accepted").await?;
    t.db.create_collection("locks")
        .collation(Collation::builder().locale("simple").build())
        .await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    LockCollection::open(&t.db, "locks", time, LockOptions::default()).await?;
    Ok(())
}

#[tokio::test]
async fn the_server_meets_the_minimum_version() -> anyhow::Result<()> {
    let t = TestDb::new("the_server_meets_the_minimum_version").await?;
    let v = tokio::time::timeout(
        Duration::from_secs(10),
        preflight::require_min_version(&t.client),
    )
    .await??;
    assert!(v.max_wire_version >= MIN_WIRE_VERSION, "{v}");
    Ok(())
}
