//! A waiting job whose `limits` field was hand-edited into something that is neither a
//! document nor null (a string, a number, an array) against the real server. Every plain
//! claim requires `limits: null` and every limited claim `limits: {$type: "object"}`, so
//! no claim can ever take such a job: until session 19 it stayed `ready` forever,
//! unreported (not in `QueueStats`, never swept), while the rest of the job document's
//! fields that a claim reads are buried with a reason (`docs/queue.md`, "The job
//! document"). Now `QueueStats::malformed_limits` counts it and the sweep moves it to
//! `dead` with `last_error: "malformed job document: `limits` …"`; a well-formed job next
//! to it runs. Without the fix the jobs stay `ready` and the test fails (checked by
//! reverting the sweep, see the commit message).

use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{
    EnqueueOptions, Enqueued, JobQueue, JobState, LimitOptions, QueueOptions, Worker, WorkerOptions,
};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};

async fn created(q: &JobQueue, n: i32) -> anyhow::Result<ObjectId> {
    match q
        .enqueue(doc! { "n": n }, &EnqueueOptions::default())
        .await?
    {
        Enqueued::Created(id) => Ok(id),
        other => anyhow::bail!("not created: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_job_with_unreadable_limits_is_buried_not_stuck() -> anyhow::Result<()> {
    let t = TestDb::new("queue_s19b_malformed_limits").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    // A handle that claims limited jobs too: neither kind of claim may take them. The
    // claims' sweep reads one partition at a time (`queue/malformed.rs`): with 4
    // partitions a pass is 5 slices.
    let opts = QueueOptions::default()
        .reap_interval(Duration::from_millis(100))
        .partitions(4)
        .limits(LimitOptions::default().key_concurrency(2));
    let q = JobQueue::open(&t.db, "jobs", time, opts).await?;
    let coll = q.collection().clone();
    let edits: [Bson; 3] = [
        Bson::String("api".into()),
        Bson::Int64(5),
        Bson::Array(vec![Bson::String("api".into())]),
    ];
    let mut bad = Vec::new();
    for (i, value) in (0..).zip(edits.iter()) {
        let id = created(&q, i).await?;
        coll.update_one(
            doc! { "_id": id },
            doc! { "$set": { "limits": value.clone() } },
        )
        .await?;
        bad.push(id);
    }
    let good = created(&q, 99).await?;

    let stats = q.stats().await?;
    println!("stats before the sweep: {stats:?}");
    assert_eq!(stats.malformed_limits, 3, "{stats:?}");

    let worker = Worker::spawn(q.clone(), WorkerOptions::default(), |_job| async {
        Ok(Bson::Null)
    })?;
    let started = Instant::now();
    let states = loop {
        let mut states = Vec::new();
        for id in &bad {
            let d: Document = coll
                .find_one(doc! { "_id": id })
                .await?
                .ok_or_else(|| anyhow::anyhow!("job {id} gone"))?;
            states.push(d);
        }
        let good_done = q.get(good).await?.map(|j| j.state) == Some(JobState::Succeeded);
        if good_done && states.iter().all(|d| d.get_str("state") == Ok("dead")) {
            break states;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(10),
            "after 10 s: good job done {good_done}; jobs with unreadable limits: {:?}",
            states
                .iter()
                .map(|d| (
                    d.get("limits").cloned(),
                    d.get_str("state").ok().map(str::to_owned)
                ))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    worker.shutdown().await;
    for d in &states {
        let why = d.get_str("last_error").unwrap_or_default();
        println!("{:?}: {why}", d.get("limits"));
        assert!(
            why.starts_with("malformed job document: `limits` must be a document, found "),
            "{why}"
        );
        assert!(d.get_datetime("finished_at").is_ok(), "{d:?}");
        assert_eq!(d.get_i64("attempts")?, 0, "never claimed: {d:?}");
    }
    let stats = q.stats().await?;
    assert_eq!(stats.malformed_limits, 0, "{stats:?}");
    Ok(())
}
