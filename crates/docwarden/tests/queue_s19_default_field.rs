//! Jobs stored with `queue: "default"` (a foreign producer or a hand edit) are in no
//! queue: the default queue's jobs carry no `queue` field, and the claim filters (bound
//! to the claim indexes) are not widened for them. `JobQueue::stats` of the default queue
//! counts them (`misnamed_default`) so they are visible; after the documented fix (one
//! `updateMany` that `$unset`s `queue`) they are ordinary default-queue jobs.

use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{EnqueueOptions, JobListFilter, JobQueue, QueueOptions};
use docwarden_testkit::TestDb;
use mongodb::bson::{Document, doc, oid::ObjectId};

#[tokio::test]
async fn jobs_stored_with_queue_default_are_counted_by_stats() -> anyhow::Result<()> {
    let t = TestDb::new("queue_s19_default_field").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let opts = QueueOptions::default().lease_ttl(Duration::from_secs(5));
    let q = JobQueue::open(&t.db, "jobs", time, opts.clone()).await?;
    let emails = q.named("emails", opts)?;
    q.enqueue(doc! { "n": 0 }, &EnqueueOptions::default())
        .await?;
    emails
        .enqueue(doc! { "n": 1 }, &EnqueueOptions::default())
        .await?;
    // Two foreign jobs: copies of the default queue's job with `queue: "default"`.
    let jobs = t.db.collection::<Document>("jobs");
    let model = jobs
        .find_one(doc! { "queue": null })
        .await?
        .ok_or_else(|| anyhow::anyhow!("no job"))?;
    for n in 2..4 {
        let mut foreign = model.clone();
        foreign.insert("_id", ObjectId::new());
        foreign.insert("queue", "default");
        foreign.insert("payload", doc! { "n": n });
        jobs.insert_one(foreign).await?;
    }

    // Invisible to the handle's claims and listing: that is the problem.
    assert_eq!(q.list(&JobListFilter::default()).await?.len(), 1);
    let stats = q.stats().await?;
    assert_eq!(stats.total, 1, "{stats:?}");
    assert_eq!(stats.misnamed_default, 2, "{stats:?}");
    // A named queue's stats never count them.
    assert_eq!(emails.stats().await?.misnamed_default, 0);

    // The documented fix: they join the default queue.
    let fixed = jobs
        .update_many(
            JobQueue::misnamed_default_filter(),
            doc! { "$unset": { "queue": "" } },
        )
        .await?;
    assert_eq!(fixed.modified_count, 2);
    let stats = q.stats().await?;
    assert_eq!((stats.total, stats.misnamed_default), (3, 0), "{stats:?}");
    let claimed = q.claim_batch("w", 10).await?;
    assert_eq!(claimed.len(), 3, "every default-queue job is claimable now");
    Ok(())
}
