//! A worker process that serves its own Prometheus `/metrics`: the library records its
//! series (claims, completions, failures, lease losses, claim-to-start and run
//! durations, lock acquisitions and hand-off waits; `docwarden::observe`), and
//! `observe::serve_prometheus` installs the recorder and the listener.
//!
//! `cargo run -p docwarden --features prometheus --example worker_metrics` (against
//! `MONGODB_URI`, or an embedded server), then `curl 127.0.0.1:9464/metrics` while it
//! runs (`METRICS_ADDR` to listen elsewhere; `METRICS_HOLD_SECS` keeps serving that long
//! after the jobs are done).

use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{LockCollection, LockOptions, Owner};
use docwarden::queue::{EnqueueOptions, JobQueue, JobState, QueueOptions, Worker, WorkerOptions};
use docwarden_server::{Target, connect};
use mongodb::bson::{Bson, doc};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let addr = std::env::var("METRICS_ADDR").unwrap_or_else(|_| "127.0.0.1:9464".to_owned());
    let metrics = docwarden::observe::serve_prometheus(addr.parse()?)?;
    println!("metrics on http://{addr}/metrics");

    let target = Target::resolve(None, None).await?; // MONGODB_URI, or an embedded server
    let client = connect(&target.uri(), Duration::from_secs(10)).await?;
    let db = client.database("docwarden_example_metrics");
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let queue = JobQueue::open(&db, "jobs", time.clone(), QueueOptions::default()).await?;
    let locks = LockCollection::open(&db, "locks", time, LockOptions::default()).await?;
    for n in 0..100 {
        queue
            .enqueue(doc! { "n": n }, &EnqueueOptions::default())
            .await?;
    }
    let worker = Worker::spawn(
        queue.clone(),
        WorkerOptions::default().concurrency(8),
        move |job| {
            let locks = locks.clone();
            async move {
                // Every tenth job takes a lock around its work.
                let n = job
                    .payload()
                    .as_document()
                    .and_then(|d| d.get_i32("n").ok());
                if n.is_some_and(|n| n % 10 == 0) {
                    let me = Owner::random();
                    let ttl = Duration::from_secs(5);
                    if let Some(lease) = locks.acquire(&me, "report", ttl, ttl).await? {
                        locks.release(&lease).await?;
                    }
                }
                Ok(Bson::Null)
            }
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
        < 100
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let report = worker.shutdown().await;
    println!("worker report: {report:?}");
    println!("{}", metrics.render());
    let hold = std::env::var("METRICS_HOLD_SECS")
        .ok()
        .and_then(|s| s.parse().ok());
    tokio::time::sleep(Duration::from_secs(hold.unwrap_or(0))).await;
    db.drop().await?;
    Ok(())
}
