//! The worker-side metrics (`docwarden::observe`) against the real server: after a run
//! with successes, retries, dead jobs and lost leases, every counter equals what the
//! database shows. The `metrics` recorder is process-global, so this binary holds one
//! recorder and one test.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{
    DocumentLockOptions, DocumentLocks, LockCollection, LockOptions, Owner, RwLockOptions, RwLocks,
    Semaphore, SemaphoreOptions,
};
use docwarden::queue::{
    ClaimedJob, EnqueueOptions, HandlerResult, JobQueue, JobState, QueueOptions, Worker,
    WorkerOptions,
};
use docwarden_testkit::TestDb;
use metrics_exporter_prometheus::PrometheusBuilder;
use mongodb::bson::{Bson, Document, doc};
use mongodb::{Collection, Database};

const OK: i32 = 40;
const FLAKY: i32 = 8;
const DEAD: i32 = 6;
const LOSE: i32 = 5;
const SLOW: i32 = 4;
/// The worker's `job_timeout`: `slow` jobs run past it on their first attempt.
const JOB_TIMEOUT: Duration = Duration::from_secs(1);

/// One handler for every kind of job: `ok` succeeds, `flaky` fails its first attempt,
/// `dead` always fails (two attempts), `lose` loses its lease on its first attempt (its
/// lease expires and the sweep takes it back while the handler runs) and then returns
/// success, which the fence refuses; `slow` runs past the worker's job timeout on its
/// first attempt (dropped, the attempt failed as `timed_out`) and succeeds on its second.
async fn run(queue: JobQueue, job: ClaimedJob) -> HandlerResult {
    let kind = job
        .payload()
        .as_document()
        .and_then(|d| d.get_str("kind").ok())
        .unwrap_or("ok")
        .to_owned();
    match kind.as_str() {
        "flaky" if job.job.attempts == 1 => Err("flaky: first attempt fails".into()),
        "dead" => Err("always fails".into()),
        "slow" if job.job.attempts == 1 => {
            tokio::time::sleep(JOB_TIMEOUT * 30).await;
            Ok(Bson::String("never: dropped at the timeout".into()))
        }
        "lose" if job.job.attempts == 1 => {
            let past = mongodb::bson::DateTime::from_millis(0);
            queue
                .collection()
                .update_one(
                    doc! { "_id": job.id(), "lease.token": job.lease.token.as_str() },
                    doc! { "$set": { "lease.until": past } },
                )
                .await?;
            // (Another `lose` handler's sweep may have taken it back already.)
            queue.reap_expired().await?;
            Ok(Bson::String("too late".into()))
        }
        _ => Ok(Bson::Null),
    }
}

/// One sample of Prometheus text: name, labels, value.
type Sample = (String, BTreeMap<String, String>, f64);

/// Sums the samples of `name` whose labels include every `labels` pair.
fn sum(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, _, v)| v)
        .sum()
}

/// Parses Prometheus text samples: `name{k="v",…} value`.
fn parse(text: &str) -> anyhow::Result<Vec<Sample>> {
    let mut out = Vec::new();
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (series, value) = line
            .rsplit_once(' ')
            .ok_or_else(|| anyhow::anyhow!("no value in {line:?}"))?;
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let mut map = BTreeMap::new();
        for pair in labels.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("bad label in {line:?}"))?;
            map.insert(k.to_owned(), v.trim_matches('"').to_owned());
        }
        out.push((name.to_owned(), map, value.parse()?));
    }
    Ok(out)
}

async fn sum_field(c: &Collection<Document>, field: &str) -> anyhow::Result<f64> {
    let mut cursor = c
        .aggregate(vec![
            doc! { "$group": { "_id": Bson::Null, "n": { "$sum": format!("${field}") } } },
        ])
        .await?;
    let mut total = 0.0;
    while cursor.advance().await? {
        let d = cursor.deserialize_current()?;
        total += match d.get("n") {
            Some(Bson::Int32(n)) => f64::from(*n),
            #[allow(clippy::cast_precision_loss)]
            Some(Bson::Int64(n)) => *n as f64,
            Some(Bson::Double(n)) => *n,
            _ => 0.0,
        };
    }
    Ok(total)
}

async fn count_state(c: &Collection<Document>, state: JobState) -> anyhow::Result<f64> {
    #[allow(clippy::cast_precision_loss)]
    Ok(c.count_documents(doc! { "state": state.as_str() }).await? as f64)
}

async fn open(
    db: &Database,
    client: &mongodb::Client,
) -> anyhow::Result<(JobQueue, LockCollection)> {
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let opts = QueueOptions::default()
        .lease_ttl(Duration::from_secs(30))
        .retry_delays(Duration::from_millis(10), Duration::from_millis(50));
    let queue = JobQueue::open(db, "jobs", time.clone(), opts).await?;
    let locks = LockCollection::open(db, "locks", time, LockOptions::default()).await?;
    Ok((queue, locks))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_and_lock_counters_match_the_database_after_a_run() -> anyhow::Result<()> {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder)?;
    docwarden::observe::describe();

    let t = TestDb::new("metrics_counts").await?;
    let (queue, locks) = open(&t.db, &t.client).await?;
    let coll = queue.collection().clone();
    for (kind, n, attempts) in [
        ("ok", OK, 3),
        ("flaky", FLAKY, 3),
        ("dead", DEAD, 2),
        ("lose", LOSE, 3),
        ("slow", SLOW, 3),
    ] {
        for i in 0..n {
            queue
                .enqueue(
                    doc! { "kind": kind, "i": i },
                    &EnqueueOptions::default().max_attempts(attempts),
                )
                .await?;
        }
    }
    let total = OK + FLAKY + DEAD + LOSE + SLOW;
    let q = queue.clone();
    // Heartbeats far apart: a lost lease is seen by the refused completion (a heartbeat
    // seeing it first would drop the handler instead; either counts one loss).
    let worker = Worker::spawn(
        queue.clone(),
        WorkerOptions::default()
            .concurrency(8)
            .batch_size(16)
            .heartbeat_every(Duration::from_secs(10))
            .job_timeout(JOB_TIMEOUT),
        move |job| run(q.clone(), job),
    )?;
    let started = Instant::now();
    loop {
        let finished = coll
            .count_documents(doc! { "state": { "$in": ["succeeded", "dead"] } })
            .await?;
        if finished == u64::try_from(total)? {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(60),
            "only {finished} of {total} jobs finished"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let report = worker.shutdown().await;

    // Locks: three acquire/release rounds, one refused try while held.
    let (a, b) = (Owner::random(), Owner::random());
    let ttl = Duration::from_secs(10);
    for _ in 0..3 {
        let lease = locks
            .acquire(&a, "r", ttl, ttl)
            .await?
            .ok_or_else(|| anyhow::anyhow!("acquire timed out"))?;
        anyhow::ensure!(locks.try_acquire(&b, "r", ttl).await?.is_none());
        locks.release(&lease).await?;
    }

    // The other lock kinds count in the same series, labelled by their collections: a
    // semaphore of one permit (taken, refused, taken again after a wait), a read lease
    // (taken, refused under a writer), a document lock (taken, refused while held).
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let sem = Semaphore::open(&t.db, "sems", time.clone(), SemaphoreOptions::default()).await?;
    let permit = sem
        .try_acquire(&a, "s", ttl)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no permit"))?;
    anyhow::ensure!(sem.try_acquire(&b, "s", ttl).await?.is_none());
    sem.release(&permit).await?;
    let permit = sem
        .acquire(&b, "s", ttl, ttl)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no permit after the wait"))?;
    sem.release(&permit).await?;
    let rw = RwLocks::open(&t.db, "rw", time.clone(), RwLockOptions::default()).await?;
    let read = rw
        .read(&a, "x", ttl, ttl)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no read lease"))?;
    rw.release_read(&read).await?;
    let write = rw
        .try_write(&a, "x", ttl)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no write lease"))?;
    anyhow::ensure!(rw.try_read(&b, "x", ttl).await?.is_none());
    rw.locks().release(&write).await?;
    let docs = t.db.collection::<Document>("accounts");
    docs.insert_one(doc! { "_id": 1, "n": 0 }).await?;
    let doc_locks = DocumentLocks::new(docs, time, DocumentLockOptions::default())?;
    let guard = doc_locks
        .try_lock(1)
        .await?
        .ok_or_else(|| anyhow::anyhow!("document not locked"))?;
    anyhow::ensure!(doc_locks.try_lock(1).await?.is_none());
    anyhow::ensure!(doc_locks.release(guard).await?.is_applied());

    handle.run_upkeep();
    let text = handle.render();
    let s = parse(&text)?;
    let q = [("queue", "jobs")];
    let claims = sum(&s, "docwarden_queue_claims_total", &q);
    let completions = sum(&s, "docwarden_queue_completions_total", &q);
    let retrying = sum(
        &s,
        "docwarden_queue_failures_total",
        &[("queue", "jobs"), ("outcome", "retrying")],
    );
    let dead = sum(
        &s,
        "docwarden_queue_failures_total",
        &[("queue", "jobs"), ("outcome", "dead")],
    );
    let lost = sum(&s, "docwarden_queue_lease_losses_total", &q);

    // The database's view.
    let db_attempts = sum_field(&coll, "attempts").await?;
    let db_succeeded = count_state(&coll, JobState::Succeeded).await?;
    let db_dead = count_state(&coll, JobState::Dead).await?;
    let db_stalls = sum_field(&coll, "stalls").await?;
    println!(
        "metrics: claims {claims} completions {completions} retrying {retrying} dead {dead} lost {lost}; \
         database: attempts {db_attempts} succeeded {db_succeeded} dead {db_dead} stalls {db_stalls}; report {report:?}"
    );
    assert_eq!(claims, db_attempts, "claims = sum of attempts\n{text}");
    assert_eq!(
        completions, db_succeeded,
        "completions = succeeded jobs\n{text}"
    );
    assert_eq!(dead, db_dead, "dead failures = dead jobs\n{text}");
    assert_eq!(
        lost, db_stalls,
        "lease losses = stalls (sweeps of lost leases)\n{text}"
    );
    // Every attempt ended one way: completed, failed (retrying or dead), or lost.
    assert_eq!(claims, completions + retrying + dead + lost, "{text}");
    // And the designed numbers.
    assert_eq!(db_succeeded, f64::from(OK + FLAKY + LOSE + SLOW));
    assert_eq!(db_dead, f64::from(DEAD));
    assert_eq!(lost, f64::from(LOSE));
    assert_eq!(retrying, f64::from(FLAKY + DEAD + SLOW));
    assert_eq!(claims, f64::from(OK + 2 * (FLAKY + DEAD + LOSE + SLOW)));
    // Each handler run and each start is one histogram sample.
    assert_eq!(
        sum(&s, "docwarden_queue_run_seconds_count", &q),
        claims,
        "{text}"
    );
    assert_eq!(
        sum(&s, "docwarden_queue_claim_to_start_seconds_count", &q),
        claims,
        "{text}"
    );
    assert_eq!(
        sum(
            &s,
            "docwarden_queue_run_seconds_count",
            &[("queue", "jobs"), ("outcome", "failed")]
        ),
        retrying + dead - f64::from(SLOW),
        "handler errors only: a timed-out run has its own label\n{text}"
    );
    // A run dropped at `job_timeout` is labelled `timed_out`, not `failed`.
    assert_eq!(
        sum(
            &s,
            "docwarden_queue_run_seconds_count",
            &[("queue", "jobs"), ("outcome", "timed_out")]
        ),
        f64::from(SLOW),
        "{text}"
    );
    assert_eq!(report.timed_out, u64::try_from(SLOW)?);
    // The worker's own report agrees.
    assert_eq!(f64::from(u32::try_from(report.claimed)?), claims);
    assert_eq!(f64::from(u32::try_from(report.lease_lost)?), lost);

    let l = [("collection", "locks"), ("outcome", "acquired")];
    assert_eq!(
        sum(&s, "docwarden_lock_acquisitions_total", &l),
        3.0,
        "{text}"
    );
    let busy = [("collection", "locks"), ("outcome", "busy")];
    assert_eq!(
        sum(&s, "docwarden_lock_acquisitions_total", &busy),
        3.0,
        "{text}"
    );
    assert_eq!(
        sum(
            &s,
            "docwarden_lock_handoff_wait_seconds_count",
            &[("collection", "locks")]
        ),
        3.0,
        "{text}"
    );
    for (collection, acquired, busy, handoffs) in [
        ("sems", 2.0, 1.0, 1.0),
        ("rw", 2.0, 1.0, 2.0),
        ("accounts", 1.0, 1.0, 0.0),
    ] {
        let outcome = |o| [("collection", collection), ("outcome", o)];
        assert_eq!(
            sum(
                &s,
                "docwarden_lock_acquisitions_total",
                &outcome("acquired")
            ),
            acquired,
            "{collection} acquired\n{text}"
        );
        assert_eq!(
            sum(&s, "docwarden_lock_acquisitions_total", &outcome("busy")),
            busy,
            "{collection} busy\n{text}"
        );
        assert_eq!(
            sum(
                &s,
                "docwarden_lock_handoff_wait_seconds_count",
                &[("collection", collection)]
            ),
            handoffs,
            "{collection} hand-offs\n{text}"
        );
    }
    assert!(
        text.contains("# HELP docwarden_queue_claims_total"),
        "{text}"
    );
    Ok(())
}
