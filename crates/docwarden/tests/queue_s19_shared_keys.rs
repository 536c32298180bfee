//! Concurrency keys are shared by every queue of a collection (documented in
//! `LimitOptions` and `docs/queue.md`, "Limits and fairness"): the permits of key `k`
//! live in `<collection>.limits` as `key:k`, whatever the job's queue. Two named queues,
//! two workers each (their own handles), one key with concurrency 1: never more than one
//! job of the key runs across both queues (violations counted at each handler start). The
//! control (permits switched off) shows the count can fail; if the key were per queue,
//! one job per queue would run at once and the safe run would count violations too.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{
    EnqueueOptions, JobQueue, JobState, LimitOptions, QueueOptions, Safeguard, Worker,
    WorkerOptions,
};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, Document, doc};

const JOBS_PER_QUEUE: usize = 12;
const QUEUES: [&str; 2] = ["alpha", "beta"];

#[derive(Debug, Default)]
struct Overlap {
    running: AtomicUsize,
    max_seen: AtomicUsize,
    violations: AtomicU64,
    /// Handler runs per queue (index in `QUEUES`) that saw a job of the other queue.
    wrong_queue: AtomicU64,
}

#[derive(Debug)]
struct Run {
    max_seen: usize,
    violations: u64,
    succeeded: u64,
}

async fn run(test: &str, safe: bool) -> anyhow::Result<Run> {
    let t = TestDb::new(test).await?;
    let mut opts = QueueOptions::default()
        .lease_ttl(Duration::from_secs(5))
        .limits(LimitOptions::default().key_concurrency(1));
    if !safe {
        opts = opts.unsafe_without(Safeguard::ConcurrencyLimit);
    }
    let seen = Arc::new(Overlap::default());
    let mut workers = Vec::new();
    for (i, name) in QUEUES.iter().enumerate() {
        // Every worker its own handle (as separate processes would have).
        for _ in 0..2 {
            let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
            let q = JobQueue::open(&t.db, "jobs", time, opts.clone().queue(*name)).await?;
            if workers.len() % 2 == 0 {
                for n in 0..JOBS_PER_QUEUE {
                    q.enqueue(
                        doc! { "queue_index": i64::try_from(i)?, "n": i64::try_from(n)? },
                        &EnqueueOptions::default().concurrency_key("api"),
                    )
                    .await?;
                }
            }
            let seen = Arc::clone(&seen);
            workers.push(Worker::spawn(
                q,
                WorkerOptions::default()
                    .concurrency(2)
                    .poll(Duration::from_millis(5), Duration::from_millis(50)),
                move |job| {
                    let seen = Arc::clone(&seen);
                    async move {
                        let now = seen.running.fetch_add(1, Ordering::SeqCst) + 1;
                        if now > 1 {
                            seen.violations.fetch_add(1, Ordering::SeqCst);
                        }
                        seen.max_seen.fetch_max(now, Ordering::SeqCst);
                        let from = job
                            .payload()
                            .as_document()
                            .and_then(|d| d.get_i64("queue_index").ok());
                        if from != i64::try_from(i).ok() {
                            seen.wrong_queue.fetch_add(1, Ordering::SeqCst);
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        seen.running.fetch_sub(1, Ordering::SeqCst);
                        Ok(Bson::Null)
                    }
                },
            )?);
        }
    }
    let jobs = t.db.collection::<Document>("jobs");
    let total = u64::try_from(JOBS_PER_QUEUE * QUEUES.len())?;
    let started = Instant::now();
    loop {
        let done = jobs
            .count_documents(doc! { "state": JobState::Succeeded.as_str() })
            .await?;
        if done == total {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(60),
            "{done} of {total} jobs done after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut succeeded = 0;
    for w in workers {
        succeeded += w.shutdown().await.succeeded;
    }
    assert_eq!(
        seen.wrong_queue.load(Ordering::SeqCst),
        0,
        "a worker ran a job of another queue"
    );
    let r = Run {
        max_seen: seen.max_seen.load(Ordering::SeqCst),
        violations: seen.violations.load(Ordering::SeqCst),
        succeeded,
    };
    eprintln!(
        "{test} (safe: {safe}): {total} jobs in {} ms over 2 queues, at most {} of key `api` running, {} violations",
        started.elapsed().as_millis(),
        r.max_seen,
        r.violations
    );
    Ok(r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_concurrency_key_is_shared_by_every_queue_of_the_collection() -> anyhow::Result<()> {
    let r = run("queue_s19_shared_key", true).await?;
    assert_eq!(r.succeeded, u64::try_from(JOBS_PER_QUEUE * QUEUES.len())?);
    assert_eq!(
        r.violations, 0,
        "more than one job of the key ran across the two queues: {r:?}"
    );
    assert_eq!(r.max_seen, 1, "{r:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_without_permits_runs_the_key_in_both_queues_at_once() -> anyhow::Result<()> {
    let r = run("queue_s19_shared_key_control", false).await?;
    assert!(r.violations > 0, "the control must bite: {r:?}");
    Ok(())
}
