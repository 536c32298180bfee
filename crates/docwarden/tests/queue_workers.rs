//! The worker runtime against the real server: exactly-once effects with 8 workers,
//! killed workers, retries, graceful shutdown and malformed job documents.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use docwarden::Error;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{Fence, FenceOptions, FenceOutcome};
use docwarden::queue::{
    ClaimedJob, EnqueueOptions, HandlerResult, JobQueue, JobState, QueueOptions, Safeguard, Worker,
    WorkerOptions,
};
use docwarden_testkit::TestDb;
use docwarden_workloads::jobs::{self, Producer};
use futures::TryStreamExt;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Bson, Document, doc};
use mongodb::{Collection, Database};

/// Fast jobs first (so the worker's prefetch grows), then a slow one (`{slow: true}`),
/// then one that waits in the worker behind it (`{waits: true}`): its id.
async fn enqueue_one_waiting_behind_a_slow_job(q: &JobQueue) -> anyhow::Result<ObjectId> {
    q.enqueue_many((0..300_i64).map(|i| (doc! { "n": i }, EnqueueOptions::default().priority(10))))
        .await?;
    q.enqueue(
        doc! { "slow": true },
        &EnqueueOptions::default().priority(5),
    )
    .await?;
    q.enqueue(
        doc! { "waits": true },
        &EnqueueOptions::default().priority(0),
    )
    .await?
    .created()
    .ok_or_else(|| anyhow::anyhow!("not created"))
}

async fn open(
    db: &Database,
    client: &mongodb::Client,
    opts: QueueOptions,
) -> anyhow::Result<JobQueue> {
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    Ok(JobQueue::open(db, "jobs", time, opts).await?)
}

async fn count(c: &Collection<Document>, filter: Document) -> anyhow::Result<u64> {
    Ok(c.count_documents(filter).await?)
}

/// Waits until `filter` matches `n` jobs, or fails after `limit`.
async fn wait_for(
    c: &Collection<Document>,
    filter: Document,
    n: u64,
    limit: Duration,
) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let got = count(c, filter.clone()).await?;
        if got >= n {
            return Ok(());
        }
        anyhow::ensure!(
            started.elapsed() < limit,
            "only {got} of {n} jobs match {filter} after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Seed 002's effect (`docwarden_workloads::jobs::fenced_effect`): `$inc effects` on the
/// job document, fenced by the claim.
async fn fenced_effect(coll: Collection<Document>, job: ClaimedJob) -> HandlerResult {
    jobs::fenced_effect(coll, job).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_thousand_jobs_eight_workers_every_effect_exactly_once() -> anyhow::Result<()> {
    let t = TestDb::new("queue_5000").await?;
    let q = open(&t.db, &t.client, QueueOptions::default()).await?;
    let coll = q.collection().clone();
    let started = Instant::now();
    Producer::new().enqueue(&q, 5000).await?;
    let mut workers = Vec::new();
    for w in 0..8 {
        let c = coll.clone();
        // Two workers claim one job at a time; six claim batches of up to 32 (sorted
        // finds are slow on the embedded surrogate, batches amortise them).
        let (concurrency, batch) = if w < 2 { (2, 1) } else { (32, 32) };
        let opts = WorkerOptions::default()
            .name(format!("w{w}"))
            .concurrency(concurrency)
            .batch_size(batch);
        workers.push(Worker::spawn(q.clone(), opts, move |job| {
            fenced_effect(c.clone(), job)
        })?);
    }
    wait_for(
        &coll,
        doc! { "state": "succeeded" },
        5000,
        Duration::from_secs(90),
    )
    .await?;
    let mut succeeded = 0;
    for w in workers {
        succeeded += w.shutdown().await.succeeded;
    }
    let lost = count(&coll, doc! { "state": { "$ne": "succeeded" } }).await?;
    let running = count(&coll, doc! { "state": "running" }).await?;
    let once = count(&coll, doc! { "state": "succeeded", "effects": 1 }).await?;
    let duplicated = count(&coll, doc! { "effects": { "$gt": 1 } }).await?;
    let missing = count(&coll, doc! { "effects": { "$exists": false } }).await?;
    eprintln!(
        "5000 jobs in {:?}: lost {lost}, running {running}, duplicated {duplicated}",
        started.elapsed()
    );
    assert_eq!((lost, running, duplicated, missing), (0, 0, 0, 0));
    assert_eq!(once, 5000);
    assert_eq!(succeeded, 5000, "completions applied");

    // Control: the same workers, docwarden's own claim with its one safeguard off (the
    // claim reads the head job, then writes the lease by `_id` without re-checking that
    // the job is still claimable — the seed's read-then-write): effects are duplicated.
    let control = t.db.collection::<Document>("control");
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let cq = JobQueue::open(
        &t.db,
        "control",
        time,
        // One partition, so the eight workers read the same jobs (partitions make the
        // race rarer; the re-check is what makes it harmless).
        QueueOptions::default()
            .unsafe_without(Safeguard::ClaimRecheck)
            .partitions(1),
    )
    .await?;
    Producer::new().enqueue(&cq, 100).await?;
    let mut workers = Vec::new();
    for w in 0..8 {
        let c = control.clone();
        let opts = WorkerOptions::default()
            .name(format!("c{w}"))
            .concurrency(2)
            .poll(Duration::from_millis(10), Duration::from_millis(50));
        workers.push(Worker::spawn(cq.clone(), opts, move |job| {
            fenced_effect(c.clone(), job)
        })?);
    }
    let started = Instant::now();
    while count(&control, doc! { "effects": { "$exists": true } }).await? < 100
        && started.elapsed() < Duration::from_secs(30)
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for w in workers {
        w.kill().await;
    }
    let control_dupes = count(&control, doc! { "effects": { "$gt": 1 } }).await?;
    eprintln!("control: {control_dupes} of 100 jobs had their effect applied more than once");
    assert!(control_dupes > 0, "the control should duplicate effects");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_workers_jobs_are_reclaimed_and_their_late_completions_refused() -> anyhow::Result<()>
{
    let t = TestDb::new("queue_killed").await?;
    let opts = QueueOptions::default()
        .lease_ttl(Duration::from_secs(2))
        .reap_interval(Duration::from_millis(200));
    let q = open(&t.db, &t.client, opts).await?;
    let coll = q.collection().clone();
    Producer::new().enqueue(&q, 40).await?;
    // A worker that hangs in every handler, then is killed (tasks aborted).
    let hang = Worker::spawn(
        q.clone(),
        WorkerOptions::default().name("hang").concurrency(4),
        |_job| async {
            std::future::pending::<()>().await;
            Ok(Bson::Null)
        },
    )?;
    // And a "process" that claimed a job by hand and will wake up late.
    let zombie = q
        .claim("zombie")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no job"))?;
    wait_for(
        &coll,
        doc! { "state": "running" },
        5,
        Duration::from_secs(10),
    )
    .await?;
    // The worker counts its claims once they are read back, a moment after the jobs
    // show `running` (killed in between, it reported 3).
    let counted = Instant::now();
    while hang.report().claimed < 4 && counted.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let hung = hang.kill().await;
    assert_eq!(hung.claimed, 4);
    let c = coll.clone();
    let healthy = Worker::spawn(
        q.clone(),
        WorkerOptions::default()
            .name("healthy")
            .concurrency(4)
            .poll(Duration::from_millis(20), Duration::from_millis(200)),
        move |job| fenced_effect(c.clone(), job),
    )?;
    wait_for(
        &coll,
        doc! { "state": "succeeded" },
        40,
        Duration::from_secs(30),
    )
    .await?;
    let report = healthy.shutdown().await;
    assert_eq!(report.succeeded, 40);
    // The jobs of the killed worker and of the zombie were claimed twice.
    assert_eq!(count(&coll, doc! { "attempts": 2 }).await?, 5);
    assert_eq!(count(&coll, doc! { "effects": 1 }).await?, 40);
    // The zombie wakes up: every write it tries is refused.
    assert!(matches!(
        q.complete(&zombie, "late").await,
        Err(Error::LeaseLost { .. })
    ));
    let outcome = Fence::new(coll.clone(), FenceOptions::default())?
        .apply(
            &zombie,
            doc! { "_id": zombie.id() },
            doc! { "$inc": { "effects": 1 } },
        )
        .await?;
    assert_eq!(
        outcome,
        FenceOutcome::Lost,
        "the zombie's fenced effect is refused"
    );
    assert_eq!(count(&coll, doc! { "effects": { "$gt": 1 } }).await?, 0);
    // Control: the same late completion without the fence lands on a finished job.
    let r = coll
        .update_one(
            doc! { "_id": zombie.id() },
            doc! { "$inc": { "effects": 1 } },
        )
        .await?;
    assert_eq!(r.modified_count, 1, "control: unfenced late write applies");
    assert_eq!(count(&coll, doc! { "effects": { "$gt": 1 } }).await?, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_handler_is_retried_with_growing_delays_then_dead() -> anyhow::Result<()> {
    let t = TestDb::new("queue_retries").await?;
    let opts =
        QueueOptions::default().retry_delays(Duration::from_millis(300), Duration::from_secs(30));
    let q = open(&t.db, &t.client, opts).await?;
    let id = q
        .enqueue(
            doc! { "ip": "10.0.0.1" },
            &EnqueueOptions::default().max_attempts(4),
        )
        .await?
        .created()
        .ok_or_else(|| anyhow::anyhow!("not created"))?;
    let calls = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let seen = Arc::clone(&calls);
    let w = Worker::spawn(
        q.clone(),
        WorkerOptions::default().poll(Duration::from_millis(10), Duration::from_millis(50)),
        move |job| {
            let seen = Arc::clone(&seen);
            async move {
                seen.lock().map_err(|e| e.to_string())?.push(Instant::now());
                Err(format!("geo service said no (attempt {})", job.job.attempts).into())
            }
        },
    )?;
    wait_for(
        q.collection(),
        doc! { "state": "dead" },
        1,
        Duration::from_secs(20),
    )
    .await?;
    let report = w.shutdown().await;
    assert_eq!((report.retried, report.dead), (3, 1));
    let job = q.get(id).await?.ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(job.state, JobState::Dead);
    assert_eq!(job.attempts, 4);
    assert_eq!(
        job.last_error.as_deref(),
        Some("geo service said no (attempt 4)")
    );
    let calls = calls.lock().map_err(|e| anyhow::anyhow!("{e}"))?.clone();
    assert_eq!(calls.len(), 4);
    let gaps: Vec<Duration> = calls.windows(2).map(|w| w[1] - w[0]).collect();
    eprintln!("retry gaps {gaps:?}");
    // Delay n is in [cap/2, cap] with cap = 300 ms · 2^(n-1).
    for (n, gap) in gaps.iter().enumerate() {
        let half_cap = Duration::from_millis(150) * 2_u32.pow(u32::try_from(n)?);
        assert!(*gap >= half_cap, "gap {n} = {gap:?} below {half_cap:?}");
    }
    assert!(
        gaps[2] > gaps[0] && gaps[2] > gaps[1],
        "delays grow: {gaps:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn graceful_shutdown_leaves_no_job_running() -> anyhow::Result<()> {
    let t = TestDb::new("queue_shutdown").await?;
    let q = open(&t.db, &t.client, QueueOptions::default()).await?;
    let coll = q.collection().clone();
    let spawn = |name: &str| -> anyhow::Result<Worker> {
        Ok(Worker::spawn(
            q.clone(),
            WorkerOptions::default()
                .name(name)
                .concurrency(4)
                .shutdown_deadline(Duration::from_millis(500)),
            |job| async move {
                // Every fifth job takes far longer than the shutdown deadline.
                let n = job
                    .payload()
                    .as_document()
                    .and_then(|d| d.get_i32("n").ok())
                    .unwrap_or(0);
                let ms = if n % 5 == 0 { 60_000 } else { 20 };
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(Bson::Null)
            },
        )?)
    };
    q.enqueue_many((0..20).map(|i| (doc! { "n": i }, EnqueueOptions::default())))
        .await?;
    let w = spawn("graceful")?;
    wait_for(
        &coll,
        doc! { "state": "running" },
        4,
        Duration::from_secs(10),
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = w.shutdown().await;
    let running = count(&coll, doc! { "state": "running" }).await?;
    assert_eq!(running, 0, "graceful shutdown left jobs running");
    assert!(report.released >= 1, "{report:?}");
    // Released jobs are claimable at once (the lease TTL is 30 s) and not charged an attempt.
    let again = q
        .claim("next")
        .await?
        .ok_or_else(|| anyhow::anyhow!("nothing claimable"))?;
    assert_eq!(again.job.attempts, 1);
    q.release(&again).await?;

    // Control: killing instead of shutting down leaves jobs running until their leases expire.
    let w = spawn("killed")?;
    wait_for(
        &coll,
        doc! { "state": "running" },
        4,
        Duration::from_secs(10),
    )
    .await?;
    w.kill().await;
    assert!(
        count(&coll, doc! { "state": "running" }).await? > 0,
        "control: a kill leaves jobs running"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hand_edited_job_goes_to_dead_with_the_reason_and_the_worker_keeps_running()
-> anyhow::Result<()> {
    let t = TestDb::new("queue_malformed").await?;
    let q = open(&t.db, &t.client, QueueOptions::default()).await?;
    let coll = q.collection().clone();
    let ids: Vec<_> = q
        .enqueue_many((0..10).map(|i| {
            (
                doc! { "n": i },
                EnqueueOptions::default().priority(if i < 2 { 10 } else { 0 }),
            )
        }))
        .await?
        .iter()
        .filter_map(|e| e.created())
        .collect();
    // An operator "fixes" two jobs by hand, with the wrong types.
    coll.update_one(
        doc! { "_id": ids[0] },
        doc! { "$set": { "max_attempts": "three" } },
    )
    .await?;
    coll.update_one(
        doc! { "_id": ids[1] },
        doc! { "$set": { "attempts": "none yet" } },
    )
    .await?;
    let c = coll.clone();
    let w = Worker::spawn(
        q.clone(),
        WorkerOptions::default().concurrency(2),
        move |job| fenced_effect(c.clone(), job),
    )?;
    wait_for(
        &coll,
        doc! { "state": "succeeded" },
        8,
        Duration::from_secs(20),
    )
    .await?;
    wait_for(&coll, doc! { "state": "dead" }, 2, Duration::from_secs(20)).await?;
    for (id, field) in [(ids[0], "max_attempts"), (ids[1], "attempts")] {
        let d = coll
            .find_one(doc! { "_id": id })
            .await?
            .ok_or_else(|| anyhow::anyhow!("gone"))?;
        assert_eq!(d.get_str("state")?, "dead");
        let reason = d.get_str("last_error")?;
        assert!(
            reason.contains(field) && reason.contains("malformed"),
            "{reason}"
        );
    }
    // The worker is still alive and takes new work.
    q.enqueue(doc! { "n": 99 }, &EnqueueOptions::default())
        .await?;
    wait_for(
        &coll,
        doc! { "state": "succeeded" },
        9,
        Duration::from_secs(20),
    )
    .await?;
    let report = w.shutdown().await;
    assert_eq!(report.succeeded, 9);
    Ok(())
}

/// Finding 5: killing or dropping a worker left its change-stream listener running
/// forever (only the supervisor was aborted), holding a server cursor.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_drop_and_shutdown_stop_the_change_stream_listener() -> anyhow::Result<()> {
    let t = TestDb::new("queue_listener").await?;
    let q = open(&t.db, &t.client, QueueOptions::default()).await?;
    for how in ["kill", "drop", "shutdown"] {
        let w = Worker::spawn(
            q.clone(),
            WorkerOptions::default().name(how),
            |_job| async { Ok(Bson::Null) },
        )?;
        // Let the listener open its stream.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let probe = w.listener_probe();
        assert!(
            probe.upgrade().is_some(),
            "{how}: the worker is not running"
        );
        match how {
            "kill" => {
                w.kill().await;
            }
            "drop" => drop(w),
            _ => {
                w.shutdown().await;
            }
        }
        let started = Instant::now();
        while probe.strong_count() > 0 && started.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            probe.strong_count(),
            0,
            "{how}: the change-stream listener is still running"
        );
    }
    Ok(())
}

/// A worker started on a backlog opens no change stream until a claim finds nothing:
/// the stream would only cost the server on every write while claims keep finding jobs.
/// Fails when the worker opens it at start (it then stays open for the first second of
/// claims).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_started_on_a_backlog_opens_its_change_stream_only_once_drained()
-> anyhow::Result<()> {
    let t = TestDb::new("queue_stream_backlog").await?;
    let q = open(&t.db, &t.client, QueueOptions::default()).await?;
    let coll = q.collection().clone();
    Producer::new().enqueue(&q, 2000).await?;
    let w = Worker::spawn(
        q.clone(),
        WorkerOptions::default().name("backlog").concurrency(4),
        |_job| async {
            tokio::time::sleep(Duration::from_millis(1)).await;
            Ok(Bson::Null)
        },
    )?;
    let (mut samples, mut open_with_jobs_ready) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let open = w.change_stream_open();
        let ready = count(&coll, doc! { "state": "ready" }).await?;
        samples += 1;
        if open && ready > 0 {
            open_with_jobs_ready += 1;
        }
        if ready == 0 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        open_with_jobs_ready, 0,
        "the stream was open in {open_with_jobs_ready} of {samples} samples taken while jobs were ready"
    );
    wait_for(
        &coll,
        doc! { "state": "succeeded" },
        2000,
        Duration::from_secs(30),
    )
    .await?;
    let opened = Instant::now();
    while !w.change_stream_open() && opened.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        w.change_stream_open(),
        "not opened once the backlog was drained"
    );
    let report = w.shutdown().await;
    assert_eq!(report.succeeded, 2000);
    println!("{samples} samples while draining, the stream opened after the backlog");
    Ok(())
}

/// A busy worker closes its change stream (the server pays for every open stream on
/// every write) and reopens it once a claim finds nothing: a job enqueued afterwards
/// starts at once, not after a poll. Fails without the reopen (the last step waits for
/// a 20 s poll) and without the close (the stream stays open while busy).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_busy_worker_closes_its_change_stream_and_reopens_it_when_idle() -> anyhow::Result<()> {
    let t = TestDb::new("queue_stream_busy").await?;
    let q = open(&t.db, &t.client, QueueOptions::default()).await?;
    let coll = q.collection().clone();
    let w = Worker::spawn(
        q.clone(),
        WorkerOptions::default()
            .name("busy")
            .concurrency(4)
            .poll(Duration::from_secs(20), Duration::from_secs(30)),
        |_job| async {
            tokio::time::sleep(Duration::from_millis(2)).await;
            Ok(Bson::Null)
        },
    )?;
    let until = |want: bool, limit: Duration| {
        let w = &w;
        async move {
            let started = Instant::now();
            while w.change_stream_open() != want {
                if started.elapsed() > limit {
                    return false;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            true
        }
    };
    assert!(
        until(true, Duration::from_secs(5)).await,
        "an idle worker opens its change stream"
    );
    Producer::new().enqueue(&q, 3000).await?;
    assert!(
        until(false, Duration::from_secs(10)).await,
        "the stream stayed open while claims kept finding jobs"
    );
    let left = count(&coll, doc! { "state": "ready" }).await?;
    assert!(left > 0, "closed only after the backlog was gone");
    wait_for(
        &coll,
        doc! { "state": "succeeded" },
        3000,
        Duration::from_secs(60),
    )
    .await?;
    assert!(
        until(true, Duration::from_secs(5)).await,
        "the stream was not reopened once claims found nothing"
    );
    let enqueued = Instant::now();
    Producer::new().enqueue(&q, 1).await?;
    wait_for(
        &coll,
        doc! { "state": "succeeded" },
        3001,
        Duration::from_secs(3),
    )
    .await?;
    println!(
        "closed while busy ({left} jobs still ready), reopened when idle, next job done in {:?}",
        enqueued.elapsed()
    );
    let report = w.shutdown().await;
    assert_eq!(report.succeeded, 3001);
    Ok(())
}

/// Slow handlers never grow the prefetch (`docs/queue.md`, "Prefetch and batch claims"):
/// a worker with one handler whose jobs take far longer than a claim holds one job at a
/// time, so the next due job stays claimable by any other worker. Before the fix the
/// prefetch grew on every full claim that came back to an idle handler — and the handler
/// whose free slot the claim was made for is always idle then — so the worker held all
/// three jobs at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_handlers_never_hold_a_job_they_cannot_start() -> anyhow::Result<()> {
    let t = TestDb::new("queue_slow_prefetch").await?;
    let q = open(&t.db, &t.client, QueueOptions::default()).await?;
    let coll = q.collection().clone();
    // Jobs whose handler has returned: the worker writes their completion in its next
    // write turn, which may land just after the claim of the next job. Such a job is
    // `running` in the database for a moment but not held: it is not counted.
    let finished: Arc<Mutex<std::collections::HashSet<ObjectId>>> = Arc::default();
    let done = Arc::clone(&finished);
    let w = Worker::spawn(
        q.clone(),
        WorkerOptions::default().name("slow").concurrency(1),
        move |job| {
            let done = Arc::clone(&done);
            async move {
                let ms = job
                    .payload()
                    .as_document()
                    .and_then(|d| d.get_i64("ms").ok())
                    .unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(u64::try_from(ms)?)).await;
                done.lock()
                    .map_err(|_| "the finished set is poisoned")?
                    .insert(job.id());
                Ok(Bson::Null)
            }
        },
    )?;
    // Warm: a job has run (only handlers that finished one can grow the prefetch).
    q.enqueue(doc! { "ms": 300_i64 }, &EnqueueOptions::default())
        .await?;
    wait_for(
        &coll,
        doc! { "state": "succeeded" },
        1,
        Duration::from_secs(10),
    )
    .await?;
    q.enqueue_many((0..3).map(|_| (doc! { "ms": 1_000_i64 }, EnqueueOptions::default())))
        .await?;
    let mut most = 0;
    let until = Instant::now() + Duration::from_millis(2_500);
    while Instant::now() < until {
        let running: Vec<Document> = coll
            .find(doc! { "state": "running" })
            .projection(doc! { "_id": 1 })
            .await?
            .try_collect()
            .await?;
        let finished = finished
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .clone();
        let held = running
            .iter()
            .filter(|d| {
                d.get_object_id("_id")
                    .map_or(true, |id| !finished.contains(&id))
            })
            .count();
        most = most.max(held);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    w.shutdown().await;
    assert_eq!(
        most, 1,
        "a worker with one handler slower than its claims held {most} unfinished jobs at once"
    );
    Ok(())
}

/// The `failCommand` fail point is one per server (each configuration replaces the last,
/// `off` ends any): the tests of this binary that use it take turns.
static FAIL_POINT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Decrements the count of running handlers when the handler ends or is dropped.
struct Running(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A worker cut off from the server (its heartbeats fail, the rest of the cluster is fine)
/// kept running its handler past the lease: once the lease expired, the sweep handed the
/// job to another worker and both handlers ran the job at once. A worker must drop a
/// handler whose lease it could not renew before the lease expires (by its own monotonic
/// clock, from when it sent the claim or the last heartbeat that renewed it), so the
/// sweep's takeover never overlaps it. Counts: handlers of the job running at once (at
/// most 1), and the second worker must get the job. Control: the cut-off worker without
/// that safeguard ([`Safeguard::LeaseDeadline`]): both handlers run at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_whose_heartbeats_fail_drops_its_handler_before_the_lease_expires()
-> anyhow::Result<()> {
    let _turn = FAIL_POINT.lock().await;
    let Some((took_over, overlap)) = cut_off_worker("queue_partitioned_worker", None).await? else {
        return Ok(());
    };
    assert_eq!(took_over, 2, "the second worker never got the job");
    assert_eq!(
        overlap, 1,
        "{overlap} handlers ran the job at once: the cut-off worker's handler outlived its lease"
    );
    let Some((took_over, overlap)) = cut_off_worker(
        "queue_partitioned_worker_control",
        Some(Safeguard::LeaseDeadline),
    )
    .await?
    else {
        return Ok(());
    };
    assert_eq!(took_over, 2, "control: the second worker never got the job");
    assert_eq!(overlap, 2, "the control's handlers must overlap");
    Ok(())
}

/// Worker A claims the one job, then every write of its client fails (a fail point by
/// app name); worker B takes the job over once the lease is swept. Returns how many
/// handlers started and the most that ran at once, or `None` where there are no fail
/// points (skipped). `without`: the safeguard worker A runs without.
async fn cut_off_worker(
    test: &str,
    without: Option<Safeguard>,
) -> anyhow::Result<Option<(usize, usize)>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let t = TestDb::new(test).await?;
    if let Err(e) = docwarden_testkit::fail_commands_off(&t.client).await {
        docwarden_testkit::skip(test, &format!("no failCommand fail point: {e}"));
        return Ok(None);
    }
    // Worker A's own client, named so that the fail point cuts off only its writes.
    let mut options = mongodb::options::ClientOptions::parse(t.uri()).await?;
    options.app_name = Some("partitioned-worker".into());
    let client_a = mongodb::Client::with_options(options)?;
    let opts = QueueOptions::default()
        .lease_ttl(Duration::from_secs(1))
        .reap_interval(Duration::from_millis(100));
    let opts_a = match without {
        Some(safeguard) => opts.clone().unsafe_without(safeguard),
        None => opts.clone(),
    };
    let qa = open(&client_a.database(t.db.name()), &client_a, opts_a).await?;
    let qb = open(&t.db, &t.client, opts).await?;
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let starts = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (running, most, starts) = (running.clone(), most.clone(), starts.clone());
        move |_job: ClaimedJob| {
            let (running, most, starts) = (running.clone(), most.clone(), starts.clone());
            async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                let _guard = Running(running);
                most.fetch_max(now, Ordering::SeqCst);
                starts.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(5)).await;
                HandlerResult::Ok(Bson::Null)
            }
        }
    };
    let worker_options = WorkerOptions::default()
        .concurrency(1)
        .batch_size(1)
        .change_stream(false)
        .poll(Duration::from_millis(20), Duration::from_millis(100));
    qa.enqueue(doc! { "n": 1 }, &EnqueueOptions::default().max_attempts(5))
        .await?;
    let a = Worker::spawn(qa, worker_options.clone().name("a"), handler.clone())?;
    let started = Instant::now();
    while starts.load(Ordering::SeqCst) == 0 {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(10),
            "A never started"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A's heartbeats (and every other write of its client) fail from now on.
    docwarden_testkit::fail_commands_of(
        &t.client,
        "partitioned-worker",
        &["update"],
        2,
        Bson::String("alwaysOn".into()),
    )
    .await?;
    let b = Worker::spawn(qb, worker_options.name("b"), handler)?;
    let waited = Instant::now();
    while starts.load(Ordering::SeqCst) < 2 && waited.elapsed() < Duration::from_secs(8) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    docwarden_testkit::fail_commands_off(&t.client).await?;
    let took_over = starts.load(Ordering::SeqCst);
    let overlap = most.load(Ordering::SeqCst);
    a.kill().await;
    b.kill().await;
    Ok(Some((took_over, overlap)))
}

/// A heartbeat that raced the worker's own completion counted it as a lost lease: the
/// heartbeat bulk came back short because the completion had just landed, the read-back
/// found the job `succeeded`, and the job — still held until the writer's reply — was
/// dropped and counted in `lease_lost` as well as in `succeeded`. No lease is lost here
/// (30 s TTL), so every job must count once, as succeeded. Counts: lease losses (0),
/// succeeded (every job).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_heartbeat_racing_the_workers_own_completion_is_not_a_lost_lease() -> anyhow::Result<()> {
    let t = TestDb::new("queue_heartbeat_races_completion").await?;
    let q = open(&t.db, &t.client, QueueOptions::default()).await?;
    let n = 1_000_u64;
    q.enqueue_many((0..1_000_i64).map(|i| (doc! { "n": i }, EnqueueOptions::default())))
        .await?;
    let w = Worker::spawn(
        q.clone(),
        WorkerOptions::default()
            .concurrency(8)
            .heartbeat_every(Duration::from_millis(1))
            .change_stream(false),
        |_job| async move {
            tokio::time::sleep(Duration::from_millis(2)).await;
            Ok(Bson::Null)
        },
    )?;
    wait_for(
        q.collection(),
        doc! { "state": "succeeded" },
        n,
        Duration::from_secs(60),
    )
    .await?;
    let report = w.shutdown().await;
    assert_eq!(report.succeeded, n, "{report:?}");
    assert_eq!(
        report.lease_lost, 0,
        "jobs completed by this worker were also counted as lost leases: {report:?}"
    );
    Ok(())
}

/// A job cancelled while it waited in the worker (claimed ahead, its handler slot still
/// busy) was started anyway: the heartbeat saw the cancel and signalled the claim, but
/// the slot only checked for a lost lease before it ran the handler, so the handler of a
/// job cancelled before it started ran for up to `cancel_grace`. Counts: handlers started
/// for the cancelled job (0).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_cancelled_while_it_waits_in_the_worker_never_starts() -> anyhow::Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let t = TestDb::new("queue_cancel_waiting").await?;
    let q = open(&t.db, &t.client, QueueOptions::default().partitions(1)).await?;
    let coll = q.collection().clone();
    // The job that waits behind the slow one is cancelled.
    let waiting = enqueue_one_waiting_behind_a_slow_job(&q).await?;
    let started = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&started);
    let w = Worker::spawn(
        q.clone(),
        WorkerOptions::default()
            .concurrency(1)
            .heartbeat_every(Duration::from_millis(50))
            .change_stream(false),
        move |job| {
            let seen = Arc::clone(&seen);
            async move {
                let d = job.payload().as_document().cloned().unwrap_or_default();
                if d.contains_key("waits") {
                    seen.fetch_add(1, Ordering::SeqCst);
                } else if d.contains_key("slow") {
                    tokio::time::sleep(Duration::from_millis(1_500)).await;
                }
                Ok(Bson::Null)
            }
        },
    )?;
    wait_for(
        &coll,
        doc! { "_id": waiting, "state": "running" },
        1,
        Duration::from_secs(20),
    )
    .await?;
    let outcome = q.cancel(waiting).await?;
    wait_for(
        &coll,
        doc! { "state": "succeeded" },
        301,
        Duration::from_secs(20),
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = w.shutdown().await;
    assert_eq!(
        outcome,
        docwarden::queue::CancelOutcome::Cancelled {
            was: JobState::Running
        },
        "the job was not held by the worker when it was cancelled"
    );
    assert_eq!(
        started.load(Ordering::SeqCst),
        0,
        "the handler of a job cancelled before it started ran: {report:?}"
    );
    Ok(())
}

/// The worker filed the jobs it holds by job id alone. A job given back (here: snoozed
/// with no delay) and claimed again by the worker's claim loop before the writer had
/// forgotten the first claim was filed under the same id: the writer's `forget` of the
/// first claim then removed the *second* one, whose lease was no longer heartbeated and
/// expired while its handler ran (another worker's sweep could then hand it to a second
/// handler). The writer forgets each job after releasing the permits of the jobs before
/// it in its bulk; the worker's writes are slowed (60 ms each, a loaded server) so the
/// claim loop wins that race every time. Counts: lost leases (0), handlers of one job
/// running at once (at most 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_claimed_again_by_the_same_worker_stays_heartbeated() -> anyhow::Result<()> {
    use std::collections::HashMap;
    let _turn = FAIL_POINT.lock().await;
    let test = "queue_reclaimed_same_worker";
    let t = TestDb::new(test).await?;
    if let Err(e) = docwarden_testkit::fail_commands_off(&t.client).await {
        docwarden_testkit::skip(test, &format!("no failCommand fail point: {e}"));
        return Ok(());
    }
    let mut options = mongodb::options::ClientOptions::parse(t.uri()).await?;
    options.app_name = Some("slow-writes".into());
    let client_w = mongodb::Client::with_options(options)?;
    let opts = QueueOptions::default()
        .lease_ttl(Duration::from_secs(2))
        .reap_interval(Duration::from_millis(100))
        .partitions(1)
        .limits(docwarden::queue::LimitOptions::default().key_concurrency(1_000));
    let q = open(&t.db, &t.client, opts.clone()).await?;
    let qw = open(&client_w.database(t.db.name()), &client_w, opts).await?;
    let n = 8_i64;
    q.enqueue_many((0..n).map(|i| {
        (
            doc! { "n": i },
            EnqueueOptions::default()
                .concurrency_key("shared")
                .max_attempts(10),
        )
    }))
    .await?;
    t.client
        .database("admin")
        .run_command(doc! {
            "configureFailPoint": "failCommand",
            "mode": "alwaysOn",
            "data": {
                "failCommands": ["update"],
                "blockConnection": true,
                "blockTimeMS": 60,
                "appName": "slow-writes",
            },
        })
        .await?;
    let runs: Arc<Mutex<HashMap<ObjectId, (usize, usize)>>> = Arc::default();
    let seen = Arc::clone(&runs);
    let w = Worker::spawn(
        qw,
        WorkerOptions::default()
            .concurrency(8)
            .poll(Duration::from_millis(1), Duration::from_millis(5))
            .change_stream(false),
        move |job| {
            let seen = Arc::clone(&seen);
            async move {
                if job.job.snoozes == 0 {
                    return docwarden::queue::snooze(Duration::ZERO);
                }
                {
                    let mut m = seen.lock().map_err(|_| "poisoned")?;
                    let e = m.entry(job.id()).or_insert((0, 0));
                    e.0 += 1;
                    e.1 = e.1.max(e.0);
                }
                struct Done(Arc<Mutex<HashMap<ObjectId, (usize, usize)>>>, ObjectId);
                impl Drop for Done {
                    fn drop(&mut self) {
                        if let Ok(mut m) = self.0.lock()
                            && let Some(e) = m.get_mut(&self.1)
                        {
                            e.0 -= 1;
                        }
                    }
                }
                let _done = Done(Arc::clone(&seen), job.id());
                tokio::time::sleep(Duration::from_millis(2_500)).await;
                Ok(Bson::Null)
            }
        },
    )?;
    let waited = wait_for(
        q.collection(),
        doc! { "state": "succeeded" },
        u64::try_from(n)?,
        Duration::from_secs(30),
    )
    .await;
    docwarden_testkit::fail_commands_off(&t.client).await?;
    let report = w.shutdown().await;
    waited?;
    let overlaps = runs
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .values()
        .filter(|(_, most)| *most > 1)
        .count();
    assert_eq!(
        (report.lease_lost, overlaps),
        (0, 0),
        "lost leases, jobs run twice at once: {report:?}"
    );
    Ok(())
}

/// A handler that panicked took its handler slot down with it, and the job with it: the
/// job stayed in the worker's held set, so the heartbeat renewed its lease for as long as
/// the worker lived — never finished, never claimable again — and the worker ran one
/// handler fewer from then on. A panic is a failed attempt. Counts: jobs stuck running
/// (0), jobs of the queue finished (all).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_handler_fails_its_attempt_and_keeps_its_slot() -> anyhow::Result<()> {
    let t = TestDb::new("queue_handler_panics").await?;
    let q = open(
        &t.db,
        &t.client,
        QueueOptions::default()
            .lease_ttl(Duration::from_secs(1))
            .retry_delays(Duration::from_millis(10), Duration::from_millis(20)),
    )
    .await?;
    let coll = q.collection().clone();
    q.enqueue(
        doc! { "panic": true },
        &EnqueueOptions::default().max_attempts(2),
    )
    .await?;
    let w = Worker::spawn(
        q.clone(),
        WorkerOptions::default().concurrency(1).change_stream(false),
        |job| async move {
            let panics = job
                .payload()
                .as_document()
                .is_some_and(|d| d.contains_key("panic"));
            assert!(!panics, "the handler panics");
            Ok(Bson::Null)
        },
    )?;
    let dead = wait_for(
        &coll,
        doc! { "state": "dead", "last_error": { "$regex": "panic" } },
        1,
        Duration::from_secs(6),
    )
    .await;
    // The worker still runs jobs with its one slot.
    q.enqueue_many((0..3_i64).map(|i| (doc! { "n": i }, EnqueueOptions::default())))
        .await?;
    let others = wait_for(
        &coll,
        doc! { "state": "succeeded" },
        3,
        Duration::from_secs(6),
    )
    .await;
    let running = count(&coll, doc! { "state": "running" }).await?;
    w.kill().await;
    assert_eq!(running, 0, "jobs stuck running");
    dead?;
    others?;
    Ok(())
}

/// Session 17: a job waiting in the worker (claimed ahead, its one handler slot busy)
/// whose lease a heartbeat found lost was counted in `lease_lost` twice: once by that
/// heartbeat, and again at shutdown, which still released it — a release the fence
/// refused, counted as a second loss (and a second `docwarden_lease_losses_total`).
/// Counts: lease losses (1), handlers started for the lost job (0), the lost job left as
/// its new holder wrote it. Fails without the fix: `lease_lost` is 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_job_found_lost_is_counted_once_at_shutdown() -> anyhow::Result<()> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let t = TestDb::new("queue_lost_waiting_shutdown").await?;
    let q = open(&t.db, &t.client, QueueOptions::default().partitions(1)).await?;
    let coll = q.collection().clone();
    // The job that waits behind the slow one loses its lease.
    let waiting = enqueue_one_waiting_behind_a_slow_job(&q).await?;
    let started = Arc::new(AtomicUsize::new(0));
    let slow_done = Arc::new(AtomicBool::new(false));
    let (seen, done) = (Arc::clone(&started), Arc::clone(&slow_done));
    let w = Worker::spawn(
        q.clone(),
        WorkerOptions::default()
            .concurrency(1)
            .heartbeat_every(Duration::from_millis(50))
            .change_stream(false),
        move |job| {
            let (seen, done) = (Arc::clone(&seen), Arc::clone(&done));
            async move {
                let d = job.payload().as_document().cloned().unwrap_or_default();
                if d.contains_key("waits") {
                    seen.fetch_add(1, Ordering::SeqCst);
                } else if d.contains_key("slow") {
                    tokio::time::sleep(Duration::from_secs(4)).await;
                    done.store(true, Ordering::SeqCst);
                }
                Ok(Bson::Null)
            }
        },
    )?;
    wait_for(
        &coll,
        doc! { "_id": waiting, "state": "running" },
        1,
        Duration::from_secs(20),
    )
    .await?;
    // Another claim takes the job over (its token replaces ours): the next heartbeat
    // finds the lease lost.
    coll.update_one(
        doc! { "_id": waiting },
        doc! { "$set": { "lease.token": "another-claim" } },
    )
    .await?;
    let noticed = Instant::now();
    while w.report().lease_lost == 0 && noticed.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    anyhow::ensure!(
        !slow_done.load(Ordering::SeqCst),
        "the slow handler finished before the shutdown: the lost job did not wait"
    );
    let report = w.shutdown().await;
    assert_eq!(
        report.lease_lost, 1,
        "one lost lease counted {} times: {report:?}",
        report.lease_lost
    );
    assert_eq!(
        started.load(Ordering::SeqCst),
        0,
        "the lost job's handler ran"
    );
    let stored = coll
        .find_one(doc! { "_id": waiting })
        .await?
        .ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(
        (
            stored.get_str("state")?,
            stored.get_document("lease")?.get_str("token")?
        ),
        ("running", "another-claim"),
        "not as its new holder left it: {stored}"
    );
    Ok(())
}

/// Session 17, the documented limit (`docs/queue.md`, "A crash charges an attempt to
/// jobs that never started"): the claim counts the attempt, and a handler's start writes
/// nothing, so the jobs a crashed worker held without starting them are swept with an
/// attempt used — on their last attempt, to `dead`. Counts: such jobs (at least one, at
/// most `WorkerOptions::prefetch` = 4 behind the one busy handler), handlers they ran
/// (0). A graceful shutdown of the same worker gives them back instead (0 charged).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crash_charges_at_most_the_prefetch_to_jobs_that_never_started() -> anyhow::Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    const PREFETCH: usize = 4;
    const TAIL: i64 = 8;
    for graceful in [false, true] {
        let t = TestDb::new(if graceful {
            "queue_crash_prefetch_shutdown"
        } else {
            "queue_crash_prefetch"
        })
        .await?;
        let q = open(&t.db, &t.client, QueueOptions::default().partitions(1)).await?;
        let coll = q.collection().clone();
        // Fast jobs (the prefetch grows), a slow one that holds the only handler, then
        // the tail: one attempt each, waiting behind it.
        q.enqueue_many(
            (0..300_i64).map(|i| (doc! { "n": i }, EnqueueOptions::default().priority(10))),
        )
        .await?;
        q.enqueue(
            doc! { "slow": true },
            &EnqueueOptions::default().priority(5),
        )
        .await?;
        q.enqueue_many((0..TAIL).map(|i| {
            (
                doc! { "tail": i },
                EnqueueOptions::default().priority(0).max_attempts(1),
            )
        }))
        .await?;
        let tail_ran = Arc::new(AtomicUsize::new(0));
        let ran = Arc::clone(&tail_ran);
        let w = Worker::spawn(
            q.clone(),
            WorkerOptions::default()
                .concurrency(1)
                .prefetch(PREFETCH)
                .shutdown_deadline(Duration::from_millis(200))
                .change_stream(false),
            move |job| {
                let ran = Arc::clone(&ran);
                async move {
                    let d = job.payload().as_document().cloned().unwrap_or_default();
                    if d.contains_key("tail") {
                        ran.fetch_add(1, Ordering::SeqCst);
                    } else if d.contains_key("slow") {
                        tokio::time::sleep(Duration::from_secs(60)).await;
                    }
                    Ok(Bson::Null)
                }
            },
        )?;
        wait_for(
            &coll,
            doc! { "payload.tail": { "$exists": true }, "state": "running" },
            1,
            Duration::from_secs(20),
        )
        .await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        if graceful {
            w.shutdown().await;
        } else {
            w.kill().await;
        }
        // The crashed worker's leases expire; the sweep takes its jobs over.
        coll.update_many(
            doc! { "state": "running" },
            doc! { "$set": { "lease.until": mongodb::bson::DateTime::from_millis(0) } },
        )
        .await?;
        q.reap_expired().await?;
        let charged = count(
            &coll,
            doc! { "payload.tail": { "$exists": true }, "attempts": { "$gte": 1 } },
        )
        .await?;
        let buried = count(
            &coll,
            doc! {
                "payload.tail": { "$exists": true },
                "state": "dead",
                "last_error": "lease expired before the job finished",
            },
        )
        .await?;
        eprintln!("graceful {graceful}: {charged} tail jobs charged, {buried} buried");
        assert_eq!(tail_ran.load(Ordering::SeqCst), 0, "a tail job ran");
        if graceful {
            assert_eq!(
                charged, 0,
                "a shutdown gives every waiting job its attempt back"
            );
        } else {
            assert!(
                (1..=PREFETCH as u64).contains(&charged),
                "{charged} jobs that never started were charged (prefetch {PREFETCH})"
            );
            assert_eq!(buried, charged, "each was on its only attempt");
        }
    }
    Ok(())
}
