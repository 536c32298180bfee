//! The handler timeout (`WorkerOptions::job_timeout`) against the real server: a handler
//! that runs past it is dropped and its attempt failed through the fenced failure (with
//! `timed out after …`), so the job is retried, and goes dead at its last attempt; a
//! handler that finishes in time is not touched. Without the timeout wired in, the hung
//! handlers are never failed and the test times out waiting for them (checked by hand,
//! see the commit message).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{
    EnqueueOptions, Enqueued, Job, JobQueue, JobState, QueueOptions, Worker, WorkerOptions,
};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, doc, oid::ObjectId};

async fn open(t: &TestDb) -> anyhow::Result<JobQueue> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let opts = QueueOptions::default()
        .retry_delays(Duration::from_millis(10), Duration::from_millis(50))
        .lease_ttl(Duration::from_secs(3));
    Ok(JobQueue::open(&t.db, "jobs", time, opts).await?)
}

async fn enqueue(q: &JobQueue, kind: &str, max_attempts: u32) -> anyhow::Result<ObjectId> {
    match q
        .enqueue(
            doc! { "kind": kind },
            &EnqueueOptions::default().max_attempts(max_attempts),
        )
        .await?
    {
        Enqueued::Created(id) => Ok(id),
        other => anyhow::bail!("not created: {other:?}"),
    }
}

/// Waits until job `id` is in `state`, or fails after `limit`.
async fn wait_state(
    q: &JobQueue,
    id: ObjectId,
    state: JobState,
    limit: Duration,
) -> anyhow::Result<Job> {
    let started = Instant::now();
    loop {
        let job = q
            .get(id)
            .await?
            .ok_or_else(|| anyhow::anyhow!("job {id} is gone"))?;
        if job.state == state {
            return Ok(job);
        }
        anyhow::ensure!(
            started.elapsed() < limit,
            "job {id} is {:?} (attempts {}, last error {:?}), not {state:?}, after {limit:?}",
            job.state,
            job.attempts,
            job.last_error
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Three jobs, one worker with a 300 ms timeout: `hangs` never finishes (2 attempts:
/// retried, then dead), `once` hangs at its first attempt only (retried, then
/// succeeds), `fast` takes 20 ms (succeeds at once, never timed out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_past_its_timeout_fails_its_attempt() -> anyhow::Result<()> {
    let t = TestDb::new("queue_s19_timeout").await?;
    let q = open(&t).await?;
    let hangs = enqueue(&q, "hangs", 2).await?;
    let once = enqueue(&q, "once", 2).await?;
    let fast = enqueue(&q, "fast", 2).await?;
    let runs = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&runs);
    let worker = Worker::spawn(
        q.clone(),
        WorkerOptions::default()
            .concurrency(3)
            .poll(Duration::from_millis(10), Duration::from_millis(100))
            .job_timeout(Duration::from_millis(300)),
        move |job| {
            let counted = Arc::clone(&counted);
            async move {
                counted.fetch_add(1, Ordering::Relaxed);
                let kind = job
                    .payload()
                    .as_document()
                    .and_then(|d| d.get_str("kind").ok())
                    .unwrap_or_default()
                    .to_owned();
                let hang = kind == "hangs" || (kind == "once" && job.job.attempts == 1);
                let took = if hang {
                    Duration::from_secs(60)
                } else {
                    Duration::from_millis(20)
                };
                tokio::time::sleep(took).await;
                Ok(Bson::String(kind))
            }
        },
    )?;
    let limit = Duration::from_secs(15);
    let dead = wait_state(&q, hangs, JobState::Dead, limit).await?;
    let retried = wait_state(&q, once, JobState::Succeeded, limit).await?;
    let quick = wait_state(&q, fast, JobState::Succeeded, limit).await?;
    let report = worker.shutdown().await;
    eprintln!("{report:?}");

    assert_eq!(dead.attempts, 2, "{dead:?}");
    assert_eq!(
        dead.last_error.as_deref(),
        Some("timed out after 300ms"),
        "{dead:?}"
    );
    assert_eq!(retried.attempts, 2, "{retried:?}");
    assert_eq!(
        retried.last_error.as_deref(),
        Some("timed out after 300ms"),
        "the first attempt's error is kept: {retried:?}"
    );
    assert_eq!(quick.attempts, 1, "{quick:?}");
    assert_eq!(quick.last_error, None, "{quick:?}");
    assert_eq!(report.timed_out, 3, "{report:?}");
    assert_eq!(report.retried, 2, "{report:?}");
    assert_eq!(report.dead, 1, "{report:?}");
    assert_eq!(report.succeeded, 2, "{report:?}");
    assert_eq!(report.lease_lost, 0, "{report:?}");
    assert_eq!(runs.load(Ordering::Relaxed), 5, "handler runs");
    Ok(())
}

/// Without a timeout (the default) a handler longer than the lease TTL is left to run:
/// heartbeats keep its lease, nothing fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_timeout_a_long_handler_runs_to_its_end() -> anyhow::Result<()> {
    let t = TestDb::new("queue_s19_no_timeout").await?;
    let q = open(&t).await?;
    let id = enqueue(&q, "long", 1).await?;
    let worker = Worker::spawn(
        q.clone(),
        WorkerOptions::default()
            .concurrency(1)
            .poll(Duration::from_millis(10), Duration::from_millis(100)),
        |_job| async move {
            // Longer than the 3 s lease: the heartbeats (every second) renew it.
            tokio::time::sleep(Duration::from_millis(3_500)).await;
            Ok(Bson::Null)
        },
    )?;
    let done = wait_state(&q, id, JobState::Succeeded, Duration::from_secs(15)).await?;
    let report = worker.shutdown().await;
    assert_eq!(done.attempts, 1, "{done:?}");
    assert_eq!(report.timed_out, 0, "{report:?}");
    assert_eq!(report.succeeded, 1, "{report:?}");
    Ok(())
}
