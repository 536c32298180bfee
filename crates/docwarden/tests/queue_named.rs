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

/// Session 18: `get` and `cancel` went by `_id` alone, so a handle of queue `a` read and
/// cancelled a job of queue `b` (and the default queue's handle any job at all), and a
/// replacing, debouncing or follow-up enqueue rewrote the key's job of another queue
/// (dedupe keys are unique per collection). A handle is bound to its queue, as a BullMQ
/// `Queue` is (`queue.getJob(id)` reads that queue's job only): every by-id and by-key
/// operation now acts on its own queue's jobs and reports a job of another queue as not
/// found (or the key as taken). The test lists every crossing it sees; without the queue
/// in those filters it lists 9 (three reads, three cancels, three enqueues that merged
/// into `b`'s job).
#[tokio::test]
async fn by_id_and_by_key_operations_act_only_on_the_handles_own_queue() -> anyhow::Result<()> {
    use docwarden::queue::{CancelOutcome, Enqueued, OnDuplicate};
    let t = TestDb::new("queue_named_by_id_scope").await?;
    let default = open(&t, QueueOptions::default()).await?;
    let a = open(&t, QueueOptions::default().queue("a")).await?;
    let b = open(&t, QueueOptions::default().queue("b")).await?;
    let coll = default.collection().clone();
    let created = |e: Enqueued| {
        e.created()
            .ok_or_else(|| anyhow::anyhow!("not created: {e:?}"))
    };
    let of_a = created(
        a.enqueue(doc! { "q": "a" }, &EnqueueOptions::default())
            .await?,
    )?;
    let of_b = created(
        b.enqueue(doc! { "q": "b" }, &EnqueueOptions::default())
            .await?,
    )?;
    let of_default = created(
        default
            .enqueue(doc! { "q": "default" }, &EnqueueOptions::default())
            .await?,
    )?;
    let mut crossings: Vec<String> = Vec::new();

    // Reads: each handle sees its own job only.
    for (who, q, id, own) in [
        ("a", &a, of_a, true),
        ("a", &a, of_b, false),
        ("a", &a, of_default, false),
        ("default", &default, of_b, false),
        ("default", &default, of_default, true),
        ("b", &b, of_b, true),
    ] {
        let found = q.get(id).await?.is_some();
        if found != own {
            crossings.push(format!("{who}.get({id}) found: {found}"));
        }
    }

    // Cancel: another queue's job, waiting or running, is not found and left alone.
    let running = b
        .claim("w")
        .await?
        .ok_or_else(|| anyhow::anyhow!("b has no job"))?;
    assert_eq!(running.id(), of_b);
    for (who, q, id) in [
        ("a", &a, of_b),
        ("default", &default, of_b),
        ("b", &b, of_a),
    ] {
        let r = q.cancel(id).await?;
        if r != CancelOutcome::NotFound {
            crossings.push(format!("{who}.cancel({id}) of another queue's job: {r:?}"));
        }
    }
    let state = |id: ObjectId| {
        let coll = coll.clone();
        async move {
            anyhow::Ok(
                coll.find_one(doc! { field::ID: id })
                    .await?
                    .and_then(|d| d.get_str(field::STATE).ok().map(str::to_owned))
                    .unwrap_or_default(),
            )
        }
    };
    if state(of_b).await? == JobState::Running.as_str() {
        b.complete(&running, Bson::Null).await?;
    }
    if state(of_a).await? == JobState::Ready.as_str() {
        assert_eq!(
            a.cancel(of_a).await?,
            CancelOutcome::Cancelled {
                was: JobState::Ready
            }
        );
    }

    // By key: `b` holds key `k` (waiting, then running); `a`'s enqueues must not merge
    // into it.
    let keyed = |policy: OnDuplicate| {
        EnqueueOptions::default()
            .dedupe_key("k")
            .on_duplicate(policy)
    };
    let b_keyed = created(
        b.enqueue(doc! { "v": 1 }, &keyed(OnDuplicate::Keep))
            .await?,
    )?;
    for policy in [OnDuplicate::Replace, OnDuplicate::Debounce] {
        let r = a.enqueue(doc! { "v": 2 }, &keyed(policy)).await?;
        if !matches!(r, Enqueued::Duplicate { .. }) {
            crossings.push(format!("{policy:?} from a on b's waiting job: {r:?}"));
        }
    }
    // Put `b`'s job back as it was (payload, due now) if a replace reached it.
    coll.update_one(
        doc! { field::ID: b_keyed },
        doc! { "$set": { field::PAYLOAD: { "v": 1 }, field::RUN_AT: mongodb::bson::DateTime::now() } },
    )
    .await?;
    let held = b
        .claim("w")
        .await?
        .ok_or_else(|| anyhow::anyhow!("b's keyed job not claimable"))?;
    assert_eq!(held.id(), b_keyed);
    let r = a
        .enqueue(doc! { "v": 3 }, &keyed(OnDuplicate::FollowUp))
        .await?;
    if !matches!(r, Enqueued::Duplicate { .. }) {
        crossings.push(format!("a follow-up from a on b's running job: {r:?}"));
    }
    let stored = coll
        .find_one(doc! { field::ID: b_keyed })
        .await?
        .ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert!(
        crossings.iter().any(|c| c.contains("follow-up"))
            || matches!(stored.get(field::FOLLOW_UP), None | Some(Bson::Null)),
        "a follow-up of a was attached to b's job: {stored}"
    );
    assert_eq!(
        crossings,
        Vec::<String>::new(),
        "operations of one queue's handle reached another queue's jobs"
    );
    // Its own queue's handle still merges into it.
    let r = b
        .enqueue(doc! { "v": 4 }, &keyed(OnDuplicate::FollowUp))
        .await?;
    assert_eq!(r, Enqueued::FollowUp(b_keyed));
    Ok(())
}
