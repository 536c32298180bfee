//! The workers of one process that run schedules on one queue share one scheduler pass
//! task (`queue/schedulers.rs`), the way they share one change stream.
//!
//! Until session 21 every `Worker` with `run_schedules(true)` ran its own pass every
//! `schedule_every` (200 ms), each reading `<collection>.schedules`: 8 workers read it
//! about 80 times in 2 s where one pass task reads it about 10 times. Ticks are
//! deduplicated by their `_id` either way; this is about load. The reads are counted by
//! driver command monitoring (`find` on `jobs.schedules`). Without the fix the first test
//! fails (checked by reverting it, see the commit message).

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::format::field;
use docwarden::queue::{JobQueue, QueueOptions, Schedule, ScheduleSpec, Worker, WorkerOptions};
use docwarden_testkit::TestDb;
use futures::TryStreamExt;
use mongodb::Client;
use mongodb::bson::{Bson, Document, doc};
use mongodb::event::EventHandler;
use mongodb::event::command::CommandEvent;
use mongodb::options::ClientOptions;

/// The schedules collection of queue `jobs`.
const SCHEDULES: &str = "jobs.schedules";

/// The default period of a worker's scheduler passes.
const EVERY: Duration = Duration::from_millis(200);

/// A client that counts the `find` commands it sends to [`SCHEDULES`].
async fn counting_client(uri: &str) -> anyhow::Result<(Client, Arc<AtomicU64>)> {
    let reads = Arc::new(AtomicU64::new(0));
    let mut options = ClientOptions::parse(uri).await?;
    let r = Arc::clone(&reads);
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        if let CommandEvent::Started(e) = event
            && e.command_name == "find"
            && e.command.get_str("find") == Ok(SCHEDULES)
        {
            r.fetch_add(1, Ordering::Relaxed);
        }
    }));
    Ok((Client::with_options(options)?, reads))
}

/// Queue `jobs` of the test's database through `client`, with one schedule ticking every
/// second.
async fn queue_on(client: &Client, t: &TestDb) -> anyhow::Result<JobQueue> {
    let db = client.database(t.db.name());
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&db, "jobs", time, QueueOptions::default()).await?;
    q.schedule(&Schedule::new(
        "heartbeat",
        ScheduleSpec::every(Duration::from_secs(1))?,
        doc! {},
    ))
    .await?;
    Ok(q)
}

/// A worker on `q` that runs schedules (every [`EVERY`]) and completes every job.
fn scheduling_worker(q: &JobQueue, name: &str) -> anyhow::Result<Worker> {
    Ok(Worker::spawn(
        q.clone(),
        WorkerOptions::default()
            .name(name)
            .run_schedules(true)
            .schedule_every(EVERY),
        |_job| async { Ok(Bson::Null) },
    )?)
}

/// How many schedule reads `reads` counts over `window`, after `settle`.
async fn reads_over(reads: &AtomicU64, settle: Duration, window: Duration) -> u64 {
    tokio::time::sleep(settle).await;
    let before = reads.load(Ordering::Relaxed);
    tokio::time::sleep(window).await;
    reads.load(Ordering::Relaxed) - before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_workers_share_one_scheduler_pass() -> anyhow::Result<()> {
    const WORKERS: usize = 8;
    const WINDOW: Duration = Duration::from_secs(2);
    let t = TestDb::new("queue_s21_shared_scheduler").await?;
    let (client, reads) = counting_client(t.uri()).await?;
    let q = queue_on(&client, &t).await?;
    let workers = (0..WORKERS)
        .map(|w| scheduling_worker(&q, &format!("w{w}")))
        .collect::<anyhow::Result<Vec<_>>>()?;

    // One pass task reads the schedules about WINDOW / EVERY = 10 times in the window (a
    // pass that found a tick due reads no more: its compare-and-set succeeds); eight
    // read them about 80 times.
    let seen = reads_over(&reads, Duration::from_millis(500), WINDOW).await;
    let one = u64::try_from(WINDOW.as_millis() / EVERY.as_millis())?;
    println!("{WORKERS} workers with run_schedules: {seen} schedule reads in {WINDOW:?}");
    assert!(seen >= 3, "the shared pass runs: {seen} reads");
    assert!(
        seen <= 2 * one,
        "{seen} schedule reads in {WINDOW:?}: more than one scheduler's {one} (with margin)"
    );
    // It enqueues the ticks: each once.
    let ticks: Vec<Document> = q
        .collection()
        .find(doc! { field::SCHEDULE: "heartbeat" })
        .await?
        .try_collect()
        .await?;
    assert!(!ticks.is_empty(), "no tick enqueued");
    let distinct: HashSet<_> = ticks
        .iter()
        .filter_map(|d| d.get_datetime(field::TICK).ok())
        .collect();
    assert_eq!(distinct.len(), ticks.len(), "a tick enqueued twice");

    // The last worker gone, the pass task stops; the next worker starts it again.
    drop(workers);
    let after = reads_over(
        &reads,
        Duration::from_millis(300),
        Duration::from_millis(800),
    )
    .await;
    assert!(after <= 1, "{after} schedule reads without any worker");
    let again = scheduling_worker(&q, "again")?;
    let restarted = reads_over(&reads, Duration::ZERO, Duration::from_millis(1000)).await;
    assert!(restarted >= 2, "{restarted} reads after a new worker came");
    let _ = again.shutdown().await;
    Ok(())
}

/// The pass task ends while workers still hold it (here: the runtime that started it
/// shuts down, with its worker's handle still alive): the remaining subscriber learns it
/// and starts the task again on its own runtime, instead of holding a dead one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_task_that_ended_is_started_again_by_its_subscribers() -> anyhow::Result<()> {
    let t = TestDb::new("queue_s21_shared_scheduler_lost").await?;
    let (client, reads) = counting_client(t.uri()).await?;
    let q = queue_on(&client, &t).await?;

    // Worker `a` on a runtime of its own starts the pass task there.
    let (up_tx, up_rx) = tokio::sync::oneshot::channel::<()>();
    let (end_tx, end_rx) = tokio::sync::oneshot::channel::<()>();
    let qa = q.clone();
    let other = std::thread::spawn(move || -> anyhow::Result<()> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let a = rt.block_on(async move {
            let a = scheduling_worker(&qa, "a")?;
            tokio::time::sleep(Duration::from_millis(300)).await;
            let _ = up_tx.send(());
            let _ = end_rx.await;
            anyhow::Ok(a)
        })?;
        // Its tasks, the pass task among them, end with the runtime; `a` outlives it.
        drop(rt);
        drop(a);
        Ok(())
    });
    up_rx.await?;
    // Worker `b` subscribes to that task.
    let b = scheduling_worker(&q, "b")?;
    let shared = reads_over(
        &reads,
        Duration::from_millis(300),
        Duration::from_millis(1000),
    )
    .await;
    assert!(shared >= 2, "{shared} reads while shared");
    let _ = end_tx.send(());
    tokio::task::spawn_blocking(move || other.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the other runtime's thread panicked"))??;

    // `b` starts it again within one period.
    let after = reads_over(&reads, EVERY * 2, Duration::from_millis(1000)).await;
    println!("after the pass task's runtime shut down: {after} schedule reads in 1 s");
    assert!(
        after >= 2,
        "the pass task was not started again: {after} reads"
    );
    let _ = b.shutdown().await;
    Ok(())
}
