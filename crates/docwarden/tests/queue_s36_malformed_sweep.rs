//! The claims' sweep of waiting jobs that no claim can take (`run_at` not a date, `limits`
//! neither a document nor null) reads one partition at a time (`queue/malformed.rs`).
//!
//! Until session 36 every handle's first claim, and then one claim a minute, sent two
//! `updateMany`s over *every* waiting job of the queue: at a backlog of 1,000,000 jobs
//! they took 3–4 s each on the embedded server, which holds the collection's write lock
//! while it scans, and the eight-handler `Worker` fell from 0.84× at 100,000 jobs to
//! 0.37× (`docs/benchmarks.md`, session 36). On MongoDB neither condition can be answered
//! from an index, so each was a fetch of every waiting job, per worker, every minute.
//!
//! The first test records every command a queue handle's claims send (driver command
//! monitoring) and counts the sweep's reads and writes that name neither a partition nor
//! `_id`s: the old sweep sends 2 at the first claim (checked against the library of
//! 811371e, see the commit message). It also checks that the slices reach every hand
//! edit, including jobs of format 1 (no `partition`) and out-of-range partitions.

use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{EnqueueOptions, JobQueue, QueueOptions};
use docwarden_testkit::{TestDb, counting_client};
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};

/// Whether `b` holds a document with the key `key`, at any depth.
fn has_key(b: &Bson, key: &str) -> bool {
    match b {
        Bson::Document(d) => d.iter().any(|(k, v)| k == key || has_key(v, key)),
        Bson::Array(a) => a.iter().any(|v| has_key(v, key)),
        _ => false,
    }
}

/// The filters of a command on collection `coll`: a `find`'s, each `update` statement's,
/// a `count`'s, and an `aggregate`'s `$match` stages.
fn filters(name: &str, body: &Document, coll: &str) -> Vec<Bson> {
    if body.get_str(name) != Ok(coll) {
        return Vec::new();
    }
    let field = |d: &Document, key: &str| d.get(key).cloned().into_iter().collect::<Vec<_>>();
    match name {
        "find" => field(body, "filter"),
        "count" => field(body, "query"),
        "update" => body
            .get_array("updates")
            .map(|u| {
                u.iter()
                    .filter_map(|s| s.as_document().and_then(|s| s.get("q")).cloned())
                    .collect()
            })
            .unwrap_or_default(),
        "aggregate" => body
            .get_array("pipeline")
            .map(|p| {
                p.iter()
                    .filter_map(|s| s.as_document().and_then(|s| s.get("$match")).cloned())
                    .collect()
            })
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

async fn enqueued(q: &JobQueue) -> anyhow::Result<ObjectId> {
    q.enqueue(doc! {}, &EnqueueOptions::default())
        .await?
        .created()
        .ok_or_else(|| anyhow::anyhow!("not created"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claims_sweep_reads_one_partition_at_a_time_and_reaches_every_job() -> anyhow::Result<()>
{
    let t = TestDb::new("queue_s36_malformed_sweep").await?;
    let (client, log) = counting_client(t.uri()).await?;
    let db = client.database(t.db.name());
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let partitions = 8;
    let q = JobQueue::open(
        &db,
        "jobs",
        time,
        QueueOptions::default()
            .reap_interval(Duration::from_millis(1))
            .partitions(partitions),
    )
    .await?;
    // Observed through the test's own client, so that only the handle's commands are
    // in the log.
    let coll = t.db.collection::<Document>("jobs");
    let observer = JobQueue::new(
        coll.clone(),
        TimeSource::server(t.client.clone(), ClockOptions::default())?,
        QueueOptions::default().partitions(partitions),
    )?;
    for _ in 0..40 {
        enqueued(&q).await?;
    }
    let edits = [
        doc! { "$set": { "run_at": "tomorrow" } },
        doc! { "$set": { "limits": 5 } },
        // Format 1: no partition.
        doc! { "$set": { "run_at": Bson::Null }, "$unset": { "partition": "" } },
        // A partition the handle's options do not name.
        doc! { "$set": { "run_at": "x", "partition": 99_i64 } },
        doc! { "$set": { "limits": ["api"], "partition": -1_i64 } },
    ];
    let mut bad = Vec::new();
    for edit in edits {
        let id = enqueued(&q).await?;
        coll.update_one(doc! { "_id": id }, edit).await?;
        bad.push(id);
    }
    let before = observer.stats().await?;
    assert_eq!(
        (before.undatable, before.malformed_limits),
        (3, 2),
        "{before:?}"
    );
    log.take();

    let started = Instant::now();
    let mut claims = 0;
    loop {
        let dead = coll
            .count_documents(doc! { "_id": { "$in": &bad }, "state": "dead" })
            .await?;
        if dead == bad.len() as u64 {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(20),
            "after 20 s and {claims} claims only {dead} of {} hand-edited jobs are dead",
            bad.len()
        );
        q.claim_batch("w", 2).await?;
        claims += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let (mut sweeps, mut unbounded) = (0, Vec::new());
    for (name, body) in log.take_bodies() {
        for filter in filters(&name, &body, "jobs") {
            let sweep = has_key(&filter, "$not")
                && (has_key(&filter, "run_at") || has_key(&filter, "limits"));
            if !sweep {
                continue;
            }
            sweeps += 1;
            if !has_key(&filter, "partition") && !has_key(&filter, "_id") {
                unbounded.push(format!("{name}: {filter}"));
            }
        }
    }
    println!(
        "{claims} claims; {sweeps} sweep reads or writes; {} over every waiting job",
        unbounded.len()
    );
    assert!(sweeps > 0, "no sweep seen: the test observed nothing");
    assert!(
        unbounded.is_empty(),
        "{} sweep commands read every waiting job: {unbounded:#?}",
        unbounded.len()
    );
    for id in &bad {
        let d = coll
            .find_one(doc! { "_id": id })
            .await?
            .ok_or_else(|| anyhow::anyhow!("job {id} gone"))?;
        let reason = d.get_str("last_error")?;
        assert!(reason.starts_with("malformed job document"), "{reason}");
    }
    let after = observer.stats().await?;
    assert_eq!(
        (after.undatable, after.malformed_limits),
        (0, 0),
        "{after:?}"
    );
    Ok(())
}

#[tokio::test]
async fn reap_expired_still_sweeps_the_whole_queue_in_one_call() -> anyhow::Result<()> {
    let t = TestDb::new("queue_s36_reap_all").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time, QueueOptions::default()).await?;
    let coll = t.db.collection::<Document>("jobs");
    let mut bad = Vec::new();
    for i in 0..6 {
        let id = enqueued(&q).await?;
        let edit = if i % 2 == 0 {
            doc! { "$set": { "run_at": "soon", "partition": i64::from(i) * 40 } }
        } else {
            doc! { "$set": { "limits": "api", "partition": i64::from(i) * 40 } }
        };
        coll.update_one(doc! { "_id": id }, edit).await?;
        bad.push(id);
    }
    assert_eq!(q.reap_expired().await?, 6);
    assert_eq!(
        coll.count_documents(doc! { "_id": { "$in": &bad }, "state": "dead" })
            .await?,
        6
    );
    Ok(())
}
