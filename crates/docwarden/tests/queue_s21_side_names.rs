//! A queue keeps side collections next to its jobs collection `<name>`: `<name>.meta`,
//! `<name>.schedules`, `<name>.rates`, `<name>.limits` and `<name>.limits.tokens`
//! (`queue::format::SIDE_COLLECTION_SUFFIXES`). Until session 21 `JobQueue::open`
//! accepted a name ending in one of those suffixes: a queue `jobs.meta` next to a queue
//! `jobs` kept its jobs in `jobs`'s options collection (its indexes built there, its
//! options document written among `jobs`'s options and control documents), and `jobs`
//! its options in `jobs.meta`'s jobs collection: two queues writing into one collection.
//! Now such a name is refused with `Error::InvalidInput` naming the suffix, before
//! anything is written. Without the fix both tests fail (checked by reverting it, see
//! the commit message).

use docwarden::Error;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::format::SIDE_COLLECTION_SUFFIXES;
use docwarden::queue::{JobQueue, QueueOptions};
use docwarden_testkit::TestDb;
use futures::TryStreamExt;
use mongodb::bson::Document;

/// The reason of an `InvalidInput` about the queue collection, or a panic.
fn refused<T: std::fmt::Debug>(r: docwarden::Result<T>, name: &str) -> String {
    match r {
        Err(Error::InvalidInput { what, reason }) => {
            assert_eq!(what, "queue collection", "{name}: {reason}");
            reason
        }
        other => panic!("queue `{name}` was not refused: {other:?}"),
    }
}

#[tokio::test]
async fn a_name_ending_in_a_side_collection_suffix_is_refused_and_nothing_is_created()
-> anyhow::Result<()> {
    let t = TestDb::new("queue_s21_side_names").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    for suffix in SIDE_COLLECTION_SUFFIXES {
        let name = format!("jobs{suffix}");
        let reason = refused(
            JobQueue::open(&t.db, &name, time.clone(), QueueOptions::default()).await,
            &name,
        );
        assert!(reason.contains(&format!("`{suffix}`")), "{reason}");
        // `new` (no server round trip) refuses it too, and so does a named queue of it.
        refused(
            JobQueue::new(
                t.db.collection::<Document>(&name),
                time.clone(),
                QueueOptions::default().queue("emails"),
            ),
            &name,
        );
    }
    let created = t.db.list_collection_names().await?;
    assert!(created.is_empty(), "collections created: {created:?}");

    // A name with dots that ends in none of them still opens.
    let q = JobQueue::open(&t.db, "app.jobs", time, QueueOptions::default()).await?;
    assert!(JobQueue::stored_options(&t.db, "app.jobs").await?.is_some());
    drop(q);
    Ok(())
}

#[tokio::test]
async fn a_queue_named_after_another_queues_options_collection_leaves_it_alone()
-> anyhow::Result<()> {
    let t = TestDb::new("queue_s21_side_names_pair").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let _jobs = JobQueue::open(&t.db, "jobs", time.clone(), QueueOptions::default()).await?;
    let meta = t.db.collection::<Document>("jobs.meta");
    let before: Vec<Document> = meta.find(Document::new()).await?.try_collect().await?;
    let indexes_before = meta.list_index_names().await?;

    refused(
        JobQueue::open(&t.db, "jobs.meta", time, QueueOptions::default()).await,
        "jobs.meta",
    );

    let after: Vec<Document> = meta.find(Document::new()).await?.try_collect().await?;
    assert_eq!(after, before, "jobs.meta's documents changed");
    assert_eq!(meta.list_index_names().await?, indexes_before);
    let mut names = t.db.list_collection_names().await?;
    names.sort();
    assert_eq!(names, ["jobs", "jobs.meta"]);
    Ok(())
}
