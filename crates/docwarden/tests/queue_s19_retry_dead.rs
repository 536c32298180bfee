//! `retry_dead` returns the true number of jobs it revived when some dead jobs cannot be
//! revived (their dedupe key is taken by a newer unfinished job: a duplicate-key error).
//!
//! Until session 19 it sent one `updateMany` and, on a duplicate-key error, revived the
//! jobs still dead one by one, counting only those. MongoDB's multi-update stops at the
//! first failing document and keeps the documents it updated before it (and reports none
//! of them: SERVER-25716), so those were revived but not counted. The embedded server
//! runs the whole `updateMany` as one transaction and rolls it back, so there the old
//! code counted right; this test asserts the exact count on both.

use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{EnqueueOptions, Enqueued, JobQueue, JobState, QueueOptions};
use docwarden_testkit::TestDb;
use mongodb::bson::{Document, doc, oid::ObjectId};

async fn open(t: &TestDb) -> anyhow::Result<JobQueue> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let opts = QueueOptions::default()
        .lease_ttl(Duration::from_secs(5))
        .partitions(1);
    Ok(JobQueue::open(&t.db, "jobs", time, opts).await?)
}

/// A dead job (enqueued with one attempt, claimed, failed) that stores dedupe key `key`
/// if given. Two dead jobs may share a key (the index is partial on the unfinished
/// states): a job of key `k` died, a newer one of `k` was enqueued and died too. The key
/// is written by deleting the dead job and inserting it again with the key, because the
/// embedded server keeps a finished job's key in the index, so the newer enqueue would be
/// refused there (`docs/queue.md`, "Differences of the embedded surrogate").
async fn dead_job(t: &TestDb, q: &JobQueue, key: Option<&str>) -> anyhow::Result<ObjectId> {
    let Enqueued::Created(id) = q
        .enqueue(
            doc! { "key": key },
            &EnqueueOptions::default().max_attempts(1),
        )
        .await?
    else {
        anyhow::bail!("{key:?}: not created");
    };
    let job = q
        .claim("w")
        .await?
        .ok_or_else(|| anyhow::anyhow!("{key:?}: nothing to claim"))?;
    anyhow::ensure!(job.id() == id, "{key:?}: claimed another job");
    q.fail(&job, "boom").await?;
    if let Some(key) = key {
        let jobs = t.db.collection::<Document>("jobs");
        let mut d = jobs
            .find_one_and_delete(doc! { "_id": id })
            .await?
            .ok_or_else(|| anyhow::anyhow!("{id} is gone"))?;
        d.insert("dedupe_key", key);
        jobs.insert_one(d).await?;
    }
    // Distinct `finished_at`, so a multi-update meets the jobs in the order they died.
    tokio::time::sleep(Duration::from_millis(5)).await;
    Ok(id)
}

async fn state(q: &JobQueue, id: ObjectId) -> anyhow::Result<JobState> {
    Ok(q.get(id)
        .await?
        .ok_or_else(|| anyhow::anyhow!("{id} is gone"))?
        .state)
}

/// Five dead jobs, in the order they died: `k1`, `k1`, no key, `k2`, `k2`. Three can be
/// revived (one per key, and the one without): `retry_dead` revives three and says 3,
/// for all dead jobs and by ids. On MongoDB the old code's `updateMany` revived the
/// first, stopped at the second, and the one-by-one fallback counted 2 of the 3.
#[tokio::test]
async fn retry_dead_counts_every_job_it_revived() -> anyhow::Result<()> {
    let t = TestDb::new("queue_s19_retry_dead").await?;
    let q = open(&t).await?;
    for by_ids in [false, true] {
        let k1 = format!("k1-{by_ids}");
        let k2 = format!("k2-{by_ids}");
        let mut dead = Vec::new();
        for key in [Some(&k1), Some(&k1), None, Some(&k2), Some(&k2)] {
            dead.push(dead_job(&t, &q, key.map(String::as_str)).await?);
        }
        let revived = if by_ids {
            q.retry_dead(Some(&dead)).await?
        } else {
            q.retry_dead(None).await?
        };
        let mut states = Vec::new();
        for id in &dead {
            states.push(state(&q, *id).await?);
        }
        let ready = |range: std::ops::Range<usize>| {
            states[range]
                .iter()
                .filter(|s| **s == JobState::Ready)
                .count()
        };
        assert_eq!(
            (ready(0..2), ready(2..3), ready(3..5)),
            (1, 1, 1),
            "one job per key and the one without are revived (by ids: {by_ids}): {states:?}"
        );
        assert_eq!(revived, 3, "by ids: {by_ids}; states {states:?}");
        // Again: nothing more can be revived (each key is taken by its revived job).
        assert_eq!(q.retry_dead(None).await?, 0);
        t.db.collection::<Document>("jobs")
            .delete_many(doc! {})
            .await?;
    }
    Ok(())
}
