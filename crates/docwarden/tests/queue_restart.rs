//! The worker runtime across a server restart: workers back off, resume, lose no job.

use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{EnqueueOptions, JobQueue, QueueOptions, Worker, WorkerOptions};
use docwarden_testkit::TestDb;
use docwarden_workloads::jobs;
use mongodb::bson::doc;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_survive_a_server_restart_and_lose_no_job() -> anyhow::Result<()> {
    let Some(mut t) = TestDb::dedicated("queue_restart").await? else {
        return Ok(()); // TestDb::dedicated reported the skip
    };
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time, QueueOptions::default()).await?;
    let coll = q.collection().clone();
    q.enqueue_many((0..600).map(|i| (doc! { "n": i }, EnqueueOptions::default())))
        .await?;
    let mut workers = Vec::new();
    for w in 0..4 {
        let c = coll.clone();
        workers.push(Worker::spawn(
            q.clone(),
            WorkerOptions::default()
                .name(format!("w{w}"))
                .concurrency(4)
                .batch_size(4),
            move |job| {
                let c = c.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    // The seed workload's effect, fenced by the claim; a refused one is
                    // not counted and fails the attempt (the job is retried).
                    jobs::fenced_effect(c, job).await
                }
            },
        )?);
    }
    let started = Instant::now();
    while coll.count_documents(doc! { "state": "succeeded" }).await? < 100 {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(30),
            "no progress before the restart"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let server = t
        .server_mut()
        .ok_or_else(|| anyhow::anyhow!("no dedicated server"))?;
    server.restart().await?;
    eprintln!("server restarted after {:?}", started.elapsed());
    loop {
        let done = coll.count_documents(doc! { "state": "succeeded" }).await?;
        if done == 600 {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(50),
            "only {done} of 600 after the restart"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut claim_errors = 0;
    for w in workers {
        let r = w.shutdown().await;
        claim_errors += r.claim_errors;
    }
    let lost = coll
        .count_documents(doc! { "state": { "$ne": "succeeded" } })
        .await?;
    let no_effect = coll
        .count_documents(doc! { "effects": { "$exists": false } })
        .await?;
    eprintln!(
        "after restart: lost {lost}, without effect {no_effect}, claim errors backed off {claim_errors}"
    );
    assert_eq!((lost, no_effect), (0, 0));
    Ok(())
}
