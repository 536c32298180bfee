//! Named queues in one collection (issue 15, item 12): each handle claims only its own
//! queue's jobs, under 8 racing workers; jobs stored without a `queue` field (formats 1
//! and 2) belong to the default queue; each named queue stores its own options document.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::format::field;
use docwarden::queue::{EnqueueOptions, JobQueue, JobState, QueueOptions, Worker, WorkerOptions};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};

async fn open(t: &TestDb, opts: QueueOptions) -> anyhow::Result<JobQueue> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    Ok(JobQueue::open(&t.db, "jobs", time, opts).await?)
}

/// (queue the worker serves, queue stored on the job) per handled job id.
type Seen = HashMap<ObjectId, Vec<(String, String)>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_workers_on_three_queues_claim_only_their_own_jobs() -> anyhow::Result<()> {
    let t = TestDb::new("queue_named_isolation").await?;
    let default = open(&t, QueueOptions::default()).await?;
    let a = open(&t, QueueOptions::default().queue("a").max_attempts(2)).await?;
    let b = open(&t, QueueOptions::default().queue("b").max_attempts(7)).await?;
    let coll = default.collection().clone();
    let per_queue: u64 = 300;
    for q in [&default, &a, &b] {
        q.enqueue_many((0..per_queue).map(|i| {
            (
                doc! { "i": i64::try_from(i).unwrap_or(0) },
                EnqueueOptions::default(),
            )
        }))
        .await?;
    }
    // A job of format 2 (no `queue` field): the default queue's.
    let legacy = ObjectId::new();
    let mut d = coll
        .find_one(doc! { field::QUEUE: Bson::Null })
        .await?
        .ok_or_else(|| anyhow::anyhow!("no default job"))?;
    d.insert(field::ID, legacy);
    d.remove(field::QUEUE);
    coll.insert_one(d).await?;

    // (queue the worker serves, queue stored on the job) per handled job id.
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let mut workers = Vec::new();
    for w in 0..8 {
        let q = match w % 3 {
            0 => default.clone(),
            1 => a.clone(),
            _ => b.clone(),
        };
        let served = q.queue_name().to_owned();
        let seen = Arc::clone(&seen);
        let c = coll.clone();
        let opts = WorkerOptions::default()
            .name(format!("w{w}"))
            .concurrency(8)
            .batch_size(if w < 3 { 1 } else { 16 });
        workers.push(Worker::spawn(q, opts, move |job| {
            let seen = Arc::clone(&seen);
            let served = served.clone();
            let c = c.clone();
            async move {
                let stored = c
                    .find_one(doc! { field::ID: job.id() })
                    .await?
                    .and_then(|d| d.get_str(field::QUEUE).ok().map(str::to_owned))
                    .unwrap_or_else(|| "default".to_owned());
                seen.lock()
                    .map_err(|_| "poisoned")?
                    .entry(job.id())
                    .or_default()
                    .push((served, stored));
                Ok(Bson::Null)
            }
        })?);
    }
    let total = 3 * per_queue + 1;
    let started = Instant::now();
    loop {
        let done = coll
            .count_documents(doc! { field::STATE: JobState::Succeeded.as_str() })
            .await?;
        if done >= total {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            for q in [&default, &a, &b] {
                println!("{}: {:?}", q.queue_name(), q.stats().await?);
            }
            anyhow::bail!("only {done} of {total} jobs done");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for w in workers {
        w.shutdown().await;
    }
    let seen: Seen = seen
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    let handled = u64::try_from(seen.len())?;
    let twice = seen.values().filter(|v| v.len() > 1).count();
    let foreign = seen
        .values()
        .flatten()
        .filter(|(served, stored)| served != stored)
        .count();
    println!("handled {handled}, twice {twice}, by another queue's worker {foreign}");
    assert_eq!(handled, total, "every job handled");
    assert_eq!(twice, 0, "no job handled twice");
    assert_eq!(foreign, 0, "no job handled by a worker of another queue");
    assert_eq!(
        seen.get(&legacy).map(|v| v[0].0.as_str()),
        Some("default"),
        "a job without a queue field belongs to the default queue"
    );
    // Per-queue stats and options.
    assert_eq!(a.stats().await?.total, per_queue);
    assert_eq!(default.stats().await?.total, per_queue + 1);
    let opts_a = JobQueue::stored_options_of(&t.db, "jobs", "a")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no options for a"))?;
    let opts_b = JobQueue::stored_options_of(&t.db, "jobs", "b")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no options for b"))?;
    assert_eq!(opts_a.get_i64("max_attempts")?, 2);
    assert_eq!(opts_b.get_i64("max_attempts")?, 7);
    assert_eq!(opts_a.get_str(field::QUEUE)?, "a");
    let default_opts = JobQueue::stored_options(&t.db, "jobs")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no default options"))?;
    assert_eq!(default_opts.get_i64("max_attempts")?, 5);
    Ok(())
}

/// The claim filters start with the queue equality and the claim indexes begin with the
/// queue (format 3), so each queue is claimed from its own index range.
#[tokio::test]
async fn claims_of_one_queue_leave_the_others_untouched() -> anyhow::Result<()> {
    let t = TestDb::new("queue_named_claims").await?;
    let a = open(&t, QueueOptions::default().queue("a")).await?;
    let b = a.named("b", QueueOptions::default())?;
    b.store_options().await?;
    for i in 0..5 {
        a.enqueue(doc! { "i": i }, &EnqueueOptions::default().priority(1))
            .await?;
    }
    b.enqueue(doc! { "i": 99 }, &EnqueueOptions::default())
        .await?;
    let got = b.claim_batch("w", 10).await?;
    assert_eq!(got.len(), 1, "b claims only its own job");
    let one = b.claim("w").await?;
    assert!(one.is_none(), "b has nothing left though a has 5 due jobs");
    let mut claimed = 0;
    loop {
        let n = a.claim_batch("w", 10).await?.len();
        if n == 0 {
            break;
        }
        claimed += n;
    }
    assert_eq!(claimed, 5);
    let stored: Vec<Document> = {
        use futures::TryStreamExt;
        a.collection()
            .list_indexes()
            .await?
            .try_collect::<Vec<_>>()
            .await?
            .into_iter()
            .map(|m| m.keys)
            .collect()
    };
    assert!(
        stored
            .iter()
            .any(|k| k.keys().next().map(String::as_str) == Some(field::QUEUE)),
        "an index starts with the queue: {stored:?}"
    );
    Ok(())
}
