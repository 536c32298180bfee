//! Pause and resume a named queue (issue 15, item 2): 8 workers; after the pause no
//! claim starts later than one wake-up (`poll_max`), counted from the leases the server
//! stored (claim time = `lease.until` − lease TTL) against the stored `paused_at`; after
//! the resume every job finishes. Control: with the pause check switched off
//! (`Safeguard::PauseCheck`) claims go on after the pause.

use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::format::field;
use docwarden::queue::{
    EnqueueOptions, JobQueue, JobState, PauseOutcome, QueueOptions, Safeguard, Worker,
    WorkerOptions,
};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, doc};

const TTL: Duration = Duration::from_secs(30);
const WAKE_UP: Duration = Duration::from_millis(500);

struct Run {
    /// Claims that started later than `paused_at` + one wake-up (+ 100 ms of clock slack).
    late_claims: u64,
    /// Jobs claimed before the pause.
    before: u64,
    /// Jobs succeeded at the end.
    succeeded: u64,
    total: u64,
}

async fn run(name: &str, opts: QueueOptions) -> anyhow::Result<Run> {
    let t = TestDb::new(name).await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time, opts.queue("p").lease_ttl(TTL)).await?;
    let coll = q.collection().clone();
    let total: u64 = 1_500;
    q.enqueue_many((0..total).map(|i| {
        (
            doc! { "i": i64::try_from(i).unwrap_or(0) },
            EnqueueOptions::default(),
        )
    }))
    .await?;
    let mut workers = Vec::new();
    for w in 0..8 {
        let opts = WorkerOptions::default()
            .name(format!("w{w}"))
            .concurrency(4)
            .batch_size(4)
            .prefetch(0)
            // No heartbeat inside the measurement window: `lease.until` stays the claim's.
            .heartbeat_every(Duration::from_secs(25))
            .poll(Duration::from_millis(50), WAKE_UP);
        workers.push(Worker::spawn(q.clone(), opts, |_job| async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok(Bson::Null)
        })?);
    }
    // Let the workers get going, then pause.
    let started = Instant::now();
    while coll
        .count_documents(doc! { field::STATE: JobState::Succeeded.as_str() })
        .await?
        < 100
    {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(30),
            "workers never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(q.pause("test").await?, PauseOutcome::Paused);
    assert_eq!(q.pause("test").await?, PauseOutcome::AlreadyPaused);
    let paused_at = q
        .control()
        .await?
        .paused_at
        .ok_or_else(|| anyhow::anyhow!("no paused_at"))?;
    // Three wake-ups of quiet.
    tokio::time::sleep(WAKE_UP * 3 + Duration::from_millis(500)).await;
    let ttl_ms = i64::try_from(TTL.as_millis())?;
    let bound = paused_at.timestamp_millis() + i64::try_from(WAKE_UP.as_millis())? + 100;
    let late = mongodb::bson::DateTime::from_millis(bound + ttl_ms);
    let start_bound = mongodb::bson::DateTime::from_millis(paused_at.timestamp_millis() + ttl_ms);
    let late_claims = coll
        .count_documents(doc! { field::LEASE_UNTIL: { "$gt": late } })
        .await?;
    let before = coll
        .count_documents(doc! { field::LEASE_UNTIL: { "$lte": start_bound } })
        .await?;
    assert_eq!(q.resume("test").await?, PauseOutcome::Resumed);
    assert_eq!(q.resume("test").await?, PauseOutcome::NotPaused);
    let started = Instant::now();
    let mut succeeded = 0;
    while started.elapsed() < Duration::from_secs(60) {
        succeeded = coll
            .count_documents(doc! { field::STATE: JobState::Succeeded.as_str() })
            .await?;
        if succeeded == total {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for w in workers {
        w.shutdown().await;
    }
    println!(
        "{name}: claims before the pause {before}, claims started after pause + one wake-up {late_claims}, succeeded {succeeded}/{total}"
    );
    Ok(Run {
        late_claims,
        before,
        succeeded,
        total,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_claim_starts_after_a_pause_plus_one_wake_up_and_resume_finishes_every_job()
-> anyhow::Result<()> {
    let r = run("queue_pause", QueueOptions::default()).await?;
    assert!(r.before > 0, "claims happened before the pause");
    assert_eq!(
        r.late_claims, 0,
        "no claim starts after pause + one wake-up"
    );
    assert_eq!(r.succeeded, r.total, "every job finishes after the resume");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_without_the_pause_check_workers_claim_from_a_paused_queue() -> anyhow::Result<()> {
    let r = run(
        "queue_pause_control",
        QueueOptions::default().unsafe_without(Safeguard::PauseCheck),
    )
    .await?;
    assert!(
        r.late_claims > 0,
        "the control must show claims after the pause, got {}",
        r.late_claims
    );
    Ok(())
}

/// The pause is persisted: a worker started while the queue is paused claims nothing
/// until the resume.
#[tokio::test]
async fn a_worker_started_on_a_paused_queue_waits_for_the_resume() -> anyhow::Result<()> {
    let t = TestDb::new("queue_pause_restart").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time, QueueOptions::default().queue("p")).await?;
    q.enqueue(doc! {}, &EnqueueOptions::default()).await?;
    q.pause("test").await?;
    let opts = WorkerOptions::default().poll(Duration::from_millis(50), WAKE_UP);
    let w = Worker::spawn(q.clone(), opts, |_job| async move { Ok(Bson::Null) })?;
    tokio::time::sleep(WAKE_UP * 2).await;
    assert_eq!(w.report().claimed, 0, "nothing claimed while paused");
    q.resume("test").await?;
    tokio::time::sleep(WAKE_UP * 2).await;
    assert_eq!(w.report().claimed, 1, "claimed after the resume");
    w.shutdown().await;
    Ok(())
}

/// Session 15: a worker waits for its first read of the queue's control document before
/// it claims. When that read failed (the server unreachable: a wrong port, a short
/// timeout) the failure was logged at debug level only and the worker's report stayed
/// all zeros, `claim_errors` included: a worker that could not work looked idle and
/// healthy. Failed control reads now count in `claim_errors` (and the first ones are
/// logged as warnings). No server is needed: the client points at a closed port.
#[tokio::test]
async fn a_worker_that_cannot_read_the_control_document_reports_errors() -> anyhow::Result<()> {
    let client = mongodb::Client::with_uri_str(
        "mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=100&connectTimeoutMS=100",
    )
    .await?;
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let queue = JobQueue::new(
        client.database("unreachable").collection("jobs"),
        time,
        QueueOptions::default(),
    )?;
    let worker = Worker::spawn(
        queue,
        WorkerOptions::default()
            .change_stream(false)
            .poll(Duration::from_millis(50), Duration::from_millis(200)),
        |_job| async move { Ok(Bson::Null) },
    )?;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let report = worker.shutdown().await;
    assert!(
        report.claim_errors >= 2,
        "an unreachable server left no trace in the report: {report:?}"
    );
    Ok(())
}

/// Session 17: pause and resume counted `version` with `$inc`, so a control document
/// whose `version` was hand-edited into a string made every pause (and resume) of the
/// queue fail with an untyped database error: the operator could not stop the queue.
/// The version now counts a non-number as 0. Fails without it: `pause` returns
/// `Error::Database` and the queue stays running.
#[tokio::test]
async fn a_hand_edited_control_version_does_not_block_pause_and_resume() -> anyhow::Result<()> {
    let t = TestDb::new("queue_pause_edited_version").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time, QueueOptions::default().queue("p")).await?;
    assert_eq!(q.pause("ops").await?, PauseOutcome::Paused);
    assert_eq!(q.resume("ops").await?, PauseOutcome::Resumed);
    let meta = t.db.collection::<mongodb::bson::Document>("jobs.meta");
    meta.update_one(
        doc! { "_id": "control:p" },
        doc! { "$set": { "version": "two" } },
    )
    .await?;
    let paused = q.pause("ops").await;
    assert!(
        matches!(paused, Ok(PauseOutcome::Paused)),
        "pause: {paused:?}"
    );
    assert!(q.is_paused().await?);
    let control = q.control().await?;
    assert_eq!((control.version, control.by.as_deref()), (1, Some("ops")));
    assert_eq!(q.resume("$ops").await?, PauseOutcome::Resumed);
    let control = q.control().await?;
    assert_eq!((control.paused, control.version), (false, 2));
    assert_eq!(
        control.by.as_deref(),
        Some("$ops"),
        "`by` taken for a field path"
    );
    Ok(())
}
