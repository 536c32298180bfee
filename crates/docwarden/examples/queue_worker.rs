//! Enqueue jobs and drain them with a worker: leased claims, heartbeats, fenced completion.
//!
//! `cargo run -p docwarden --example queue_worker` (against `MONGODB_URI`, or an embedded
//! server).

use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{EnqueueOptions, JobQueue, JobState, QueueOptions, Worker, WorkerOptions};
use docwarden_server::{Target, connect};
use mongodb::bson::{Bson, doc};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let target = Target::resolve(None, None).await?; // MONGODB_URI, or an embedded server
    let client = connect(&target.uri(), Duration::from_secs(10)).await?;
    let db = client.database("docwarden_example_queue");

    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let queue = JobQueue::open(&db, "jobs", time, QueueOptions::default()).await?;
    for ip in ["8.8.8.8", "1.1.1.1", "9.9.9.9"] {
        queue
            .enqueue(doc! { "ip": ip }, &EnqueueOptions::default())
            .await?;
    }
    // A duplicate is refused while the first one is unfinished.
    let once = EnqueueOptions::default().dedupe_key("report-2026-11");
    println!(
        "first:  {:?}",
        queue.enqueue(doc! { "report": 1 }, &once).await?
    );
    println!(
        "second: {:?}",
        queue.enqueue(doc! { "report": 1 }, &once).await?
    );

    let worker = Worker::spawn(
        queue.clone(),
        WorkerOptions::default().concurrency(2),
        |job| async move {
            println!("handling {} (attempt {})", job.payload(), job.job.attempts);
            Ok(Bson::String("done".into()))
        },
    )?;
    let succeeded = JobState::Succeeded.as_str();
    while queue
        .stats()
        .await?
        .by_state
        .get(succeeded)
        .copied()
        .unwrap_or(0)
        < 4
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let report = worker.shutdown().await;
    println!("worker report: {report:?}");
    db.drop().await?;
    Ok(())
}
