//! Tasks a handler spawned, when the worker abandons the handler: a handler that panics,
//! one dropped at `WorkerOptions::job_timeout`, and one still running at the end of
//! `shutdown_deadline` (released). The job is then retried or released, and may run
//! again elsewhere, while the tasks the first attempt spawned would run on with nothing
//! to tell them the attempt is over: the worker cannot abort tasks it does not own, and
//! until session 19 it did not cancel the claim's `cancellation()` token in these three
//! cases (it did for an operator's cancel and a lost lease). River cancels the job's
//! context at its timeout for the same reason. Each case here spawns a task that waits
//! for the token and counts; without the fix none of the three is signalled and the
//! test fails (checked by reverting the fix, see the commit message).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{EnqueueOptions, JobQueue, QueueOptions, Worker, WorkerOptions};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, doc};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_spawned_by_an_abandoned_handler_are_signalled() -> anyhow::Result<()> {
    let t = TestDb::new("queue_s19b_spawned_tasks").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let opts = QueueOptions::default()
        .lease_ttl(Duration::from_secs(5))
        .retry_delays(Duration::from_secs(60), Duration::from_secs(60));
    let q = JobQueue::open(&t.db, "jobs", time, opts).await?;
    for kind in ["panics", "hangs"] {
        q.enqueue(
            doc! { "kind": kind },
            &EnqueueOptions::default().max_attempts(3),
        )
        .await?;
    }
    let spawned = Arc::new(AtomicU64::new(0));
    let signalled = Arc::new(AtomicU64::new(0));
    let (s, c) = (Arc::clone(&spawned), Arc::clone(&signalled));
    let worker = Worker::spawn(
        q.clone(),
        WorkerOptions::default()
            .concurrency(2)
            .job_timeout(Duration::from_millis(500)),
        move |job| {
            let (s, c) = (Arc::clone(&s), Arc::clone(&c));
            async move {
                let token = job.cancellation().clone();
                s.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    token.cancelled().await;
                    c.fetch_add(1, Ordering::SeqCst);
                });
                let kind = job
                    .payload()
                    .as_document()
                    .and_then(|d| d.get_str("kind").ok())
                    .unwrap_or_default()
                    .to_owned();
                if kind == "panics" {
                    panic!("after spawning a task");
                }
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok(Bson::Null)
            }
        },
    )?;
    let started = Instant::now();
    while signalled.load(Ordering::SeqCst) < 2 && started.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (s_n, c_n) = (
        spawned.load(Ordering::SeqCst),
        signalled.load(Ordering::SeqCst),
    );
    println!("panic and timeout: {s_n} handlers spawned a task, {c_n} tasks signalled");
    assert_eq!(s_n, 2, "one attempt each (retries are a minute away)");
    assert_eq!(
        c_n, 2,
        "the panicked and the timed-out handler's tasks are signalled"
    );
    let report = worker.shutdown().await;
    assert_eq!(report.timed_out, 1, "{report:?}");

    // A handler still running when `shutdown_deadline` ends: released, its task told.
    q.enqueue(doc! { "kind": "slow" }, &EnqueueOptions::default())
        .await?;
    let spawned = Arc::new(AtomicU64::new(0));
    let signalled = Arc::new(AtomicU64::new(0));
    let (s, c) = (Arc::clone(&spawned), Arc::clone(&signalled));
    let worker = Worker::spawn(
        q.clone(),
        WorkerOptions::default().shutdown_deadline(Duration::from_millis(200)),
        move |job| {
            let (s, c) = (Arc::clone(&s), Arc::clone(&c));
            async move {
                let token = job.cancellation().clone();
                tokio::spawn(async move {
                    token.cancelled().await;
                    c.fetch_add(1, Ordering::SeqCst);
                });
                s.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok(Bson::Null)
            }
        },
    )?;
    let started = Instant::now();
    while spawned.load(Ordering::SeqCst) < 1 {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(10),
            "slow job never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let report = worker.shutdown().await;
    assert_eq!(report.released, 1, "{report:?}");
    let started = Instant::now();
    while signalled.load(Ordering::SeqCst) < 1 && started.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        signalled.load(Ordering::SeqCst),
        1,
        "the released handler's task is signalled"
    );
    Ok(())
}
