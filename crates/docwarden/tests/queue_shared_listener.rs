//! Idle workers of one queue handle share one change stream for jobs and one for the
//! queue's control document (`crate::listener`), instead of two each.
//!
//! A change stream's `getMore` holds a pooled connection while the server waits for
//! events. Before, every idle `Worker` held one (two with `watch_control`), so 12 idle
//! workers on a
//! client with the driver's default pool of 10 made every other operation of the
//! application wait about a second for a connection (measured: 4 parallel `find_one`s
//! p50 0.99 s with 12 idle workers, 0.4 ms with none).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use docwarden::capabilities::probe_change_streams;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{EnqueueOptions, JobQueue, QueueOptions, Worker, WorkerOptions};
use docwarden_testkit::TestDb;
use mongodb::Client;
use mongodb::bson::{Bson, doc};
use mongodb::event::EventHandler;
use mongodb::event::cmap::CmapEvent;
use mongodb::event::command::CommandEvent;
use mongodb::options::ClientOptions;

/// What the test client saw: change streams opened, and since when each connection that
/// is checked out now has been.
#[derive(Default)]
struct Seen {
    streams_opened: AtomicU64,
    out_since: Mutex<HashMap<u32, Instant>>,
}

impl Seen {
    /// Connections checked out for at least `held` now.
    fn held_for(&self, held: Duration) -> usize {
        self.out_since
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|since| since.elapsed() >= held)
            .count()
    }
}

/// A client with the driver's default pool size (10, stated) that counts the change
/// streams it opens and the connections it has checked out.
async fn observed_client(uri: &str) -> anyhow::Result<(Client, Arc<Seen>)> {
    let seen = Arc::new(Seen::default());
    let mut options = ClientOptions::parse(uri).await?;
    options.max_pool_size = Some(10);
    let s = Arc::clone(&seen);
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        if let CommandEvent::Started(e) = event
            && e.command_name == "aggregate"
            && e.command
                .get_array("pipeline")
                .ok()
                .and_then(|p| p.first())
                .and_then(Bson::as_document)
                .is_some_and(|stage| stage.contains_key("$changeStream"))
        {
            s.streams_opened.fetch_add(1, Ordering::Relaxed);
        }
    }));
    let s = Arc::clone(&seen);
    options.cmap_event_handler = Some(EventHandler::callback(move |event| {
        let mut out = s.out_since.lock().unwrap_or_else(|p| p.into_inner());
        match event {
            CmapEvent::ConnectionCheckedOut(e) => {
                out.insert(e.connection_id, Instant::now());
            }
            CmapEvent::ConnectionCheckedIn(e) => {
                out.remove(&e.connection_id);
            }
            CmapEvent::ConnectionClosed(e) => {
                out.remove(&e.connection_id);
            }
            _ => {}
        }
    }));
    Ok((Client::with_options(options)?, seen))
}

/// The test's database through `client`, and the queue `jobs` opened on it.
async fn queue_on(client: &Client, t: &TestDb) -> anyhow::Result<(mongodb::Database, JobQueue)> {
    let db = client.database(t.db.name());
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&db, "jobs", time, QueueOptions::default()).await?;
    Ok((db, q))
}

/// `n` workers on `q` with `options` (named `w0`, `w1`, …) whose handler sends the instant
/// it starts a job, and the receiving end; then waits until every worker listens, or
/// `within` has passed. Returns the workers, the receiver and how many listen.
async fn idle_workers(
    q: &JobQueue,
    n: usize,
    options: &WorkerOptions,
    within: Duration,
) -> anyhow::Result<(
    Vec<Worker>,
    tokio::sync::mpsc::UnboundedReceiver<Instant>,
    usize,
)> {
    let (started_tx, started_rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let mut workers = Vec::new();
    for w in 0..n {
        let started_tx = started_tx.clone();
        workers.push(Worker::spawn(
            q.clone(),
            options.clone().name(format!("w{w}")),
            move |_job| {
                let started_tx = started_tx.clone();
                async move {
                    let _ = started_tx.send(Instant::now());
                    Ok(Bson::Null)
                }
            },
        )?);
    }
    let since = Instant::now();
    while !workers.iter().all(Worker::change_stream_open) && since.elapsed() < within {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let listening = workers.iter().filter(|w| w.change_stream_open()).count();
    Ok((workers, started_rx, listening))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_idle_workers_share_two_change_streams_and_leave_the_pool_free()
-> anyhow::Result<()> {
    const WORKERS: usize = 16;
    let t = TestDb::new("queue_shared_listener").await?;
    if !probe_change_streams(&t.client).await?.is_supported() {
        eprintln!("skipped: the server refuses change streams (workers poll; nothing is shared)");
        return Ok(());
    }
    let (client, seen) = observed_client(t.uri()).await?;
    let (db, q) = queue_on(&client, &t).await?;
    // Every worker idle and listening (a stream per worker cannot all open: the pool
    // has 10 connections; go on after 5 s and let the counts below tell).
    let (workers, mut started_rx, listening) = idle_workers(
        &q,
        WORKERS,
        &WorkerOptions::default().watch_control(true),
        Duration::from_secs(5),
    )
    .await?;
    eprintln!("{listening} of {WORKERS} workers listening");
    // Connections held for 300 ms or more: the change streams' `getMore`s (the server
    // holds each up to 500 ms; a claim or a read takes a millisecond).
    let mut most_held = 0;
    let window = Instant::now();
    while window.elapsed() < Duration::from_millis(2_000) {
        most_held = most_held.max(seen.held_for(Duration::from_millis(300)));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // What the application feels: its own reads while the workers idle.
    // (Before the listeners were shared, they never finished: the test hung.)
    let other = db.collection::<mongodb::bson::Document>("app");
    let reads = async {
        other.insert_one(doc! { "_id": 1 }).await?;
        let mut slowest = Duration::ZERO;
        for _ in 0..20 {
            let s = Instant::now();
            other.find_one(doc! { "_id": 1 }).await?;
            slowest = slowest.max(s.elapsed());
        }
        anyhow::Ok(slowest)
    };
    let slowest = tokio::time::timeout(Duration::from_secs(30), reads)
        .await
        .map_err(|_| anyhow::anyhow!("20 reads of the application did not finish in 30 s"))??;
    let streams = seen.streams_opened.load(Ordering::Relaxed);
    eprintln!(
        "{WORKERS} idle workers: {streams} change streams opened, at most {most_held} of 10 pooled connections held 300 ms or more, slowest of 20 reads {slowest:?}"
    );
    assert_eq!(listening, WORKERS, "every idle worker listens");
    assert_eq!(
        streams, 2,
        "one stream for the jobs and one for the control document, shared by every worker"
    );
    assert!(
        most_held <= 3,
        "{most_held} connections held by waits: the listeners are not shared"
    );

    // The shared stream still wakes the workers: a job enqueued now starts long before
    // the next poll would have found it.
    let enqueued = Instant::now();
    q.enqueue(doc! { "n": 1 }, &EnqueueOptions::default())
        .await?;
    let started = tokio::time::timeout(Duration::from_secs(10), started_rx.recv())
        .await?
        .ok_or_else(|| anyhow::anyhow!("no job started"))?;
    eprintln!("enqueue to start: {:?}", started - enqueued);
    for w in workers {
        w.shutdown().await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_insert_wakes_one_idle_worker_not_all() -> anyhow::Result<()> {
    const WORKERS: usize = 16;
    const JOBS: usize = 40;
    let t = TestDb::new("queue_shared_listener_herd").await?;
    if !probe_change_streams(&t.client).await?.is_supported() {
        eprintln!("skipped: the server refuses change streams (workers poll; nothing is woken)");
        return Ok(());
    }
    let (client, log) = docwarden_testkit::counting_client(t.uri()).await?;
    let (_, q) = queue_on(&client, &t).await?;
    // Rare polls: what the workers send below is what the inserts woke.
    let (workers, mut started_rx, listening) = idle_workers(
        &q,
        WORKERS,
        &WorkerOptions::default().poll(Duration::from_secs(5), Duration::from_secs(10)),
        Duration::from_secs(20),
    )
    .await?;
    anyhow::ensure!(
        listening == WORKERS,
        "only {listening} of {WORKERS} workers listen"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let producer = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let pq = JobQueue::open(&t.db, "jobs", producer, QueueOptions::default()).await?;
    log.take();
    let mut latencies = Vec::new();
    for n in 0..JOBS {
        let enqueued = Instant::now();
        pq.enqueue(doc! { "n": i64::try_from(n)? }, &EnqueueOptions::default())
            .await?;
        let started = tokio::time::timeout(Duration::from_secs(10), started_rx.recv())
            .await?
            .ok_or_else(|| anyhow::anyhow!("no job started"))?;
        latencies.push(started - enqueued);
        // Let the woken workers settle before the next insert.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let counts = log.take_counts();
    let writes: u32 = ["findAndModify", "update"]
        .iter()
        .filter_map(|c| counts.get(*c))
        .sum();
    let finds = counts.get("find").copied().unwrap_or(0);
    latencies.sort();
    eprintln!(
        "{JOBS} jobs, one at a time, {WORKERS} idle workers: {writes} claim and completion writes, {finds} finds ({:.1} writes per job); enqueue to start p50 {:?}; {counts:?}",
        f64::from(writes) / JOBS as f64,
        latencies[JOBS / 2]
    );
    // A job is one claim by `_id` and one completion (the completion may share a bulk);
    // before, every idle worker claimed by `_id` and then ran a batch claim: 17 writes
    // and 16 reads per job.
    assert!(
        writes <= 3 * u32::try_from(JOBS)?,
        "{writes} writes for {JOBS} jobs: the inserts woke more than one worker each"
    );
    assert!(
        finds <= 2 * u32::try_from(JOBS)?,
        "{finds} finds for {JOBS} jobs: woken workers ran batch claims that found nothing"
    );
    for w in workers {
        w.shutdown().await;
    }
    Ok(())
}
