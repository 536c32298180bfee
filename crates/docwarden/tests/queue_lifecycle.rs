//! Job lifecycle features (issue 15) raced by eight workers or more against the real
//! server: cancelling a running job, snooze, uniqueness windows, replace, debounce and
//! follow-up runs, progress, transactional enqueue and stall accounting. Each asserts
//! counts; where a safeguard is what makes it right, a control switches it off and shows
//! the violations.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use docwarden::Error;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{
    EnqueueOptions, Enqueued, JobQueue, JobState, MAX_PROGRESS_BYTES, OnDuplicate, QueueOptions,
    Safeguard, Worker, WorkerOptions, WorkerReport, snooze,
};
use docwarden_testkit::TestDb;
use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use mongodb::{Client, Collection, Database};

async fn open(
    db: &Database,
    client: &Client,
    name: &str,
    opts: QueueOptions,
) -> anyhow::Result<JobQueue> {
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    Ok(JobQueue::open(db, name, time, opts).await?)
}

async fn count(c: &Collection<Document>, filter: Document) -> anyhow::Result<u64> {
    Ok(c.count_documents(filter).await?)
}

async fn all(c: &Collection<Document>, filter: Document) -> anyhow::Result<Vec<Document>> {
    Ok(c.find(filter).await?.try_collect().await?)
}

/// Waits until `filter` matches at least `n` jobs, or fails after `limit`.
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
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn stop(workers: Vec<Worker>) -> WorkerReport {
    let mut total = WorkerReport::default();
    for w in workers {
        let r = w.shutdown().await;
        total.succeeded += r.succeeded;
        total.lease_lost += r.lease_lost;
        total.cancelled += r.cancelled;
        total.snoozed += r.snoozed;
        total.retried += r.retried;
        total.dead += r.dead;
    }
    total
}

fn int(d: &Document, key: &str) -> i64 {
    match d.get(key) {
        Some(Bson::Int64(n)) => *n,
        Some(Bson::Int32(n)) => i64::from(*n),
        _ => 0,
    }
}

/// What the cancel race counted.
#[derive(Debug)]
struct CancelRun {
    jobs: u64,
    cancelled_by_operator: u64,
    /// Handlers started (a job cancelled between its claim and the worker's fetch of
    /// it never starts).
    started: u64,
    signalled: u64,
    /// Cancelled jobs whose handler's late completion was stored anyway.
    overwritten: u64,
    max_signal_ms: i64,
    report: WorkerReport,
}

/// 64 jobs, eight workers (half without a change stream: they learn of the cancel from
/// their heartbeat); an operator cancels every job as soon as it runs. Each handler
/// waits for its cancellation signal, then returns a late completion.
async fn cancel_race(t: &TestDb, name: &str, opts: QueueOptions) -> anyhow::Result<CancelRun> {
    const JOBS: u64 = 64;
    let q = open(
        &t.db,
        &t.client,
        name,
        opts.lease_ttl(Duration::from_secs(3)),
    )
    .await?;
    let coll = q.collection().clone();
    q.enqueue_many((0..JOBS).map(|i| (doc! { "i": i.cast_signed() }, EnqueueOptions::default())))
        .await?;
    let cancelled_at: Arc<Mutex<HashMap<ObjectId, Instant>>> = Arc::default();
    let signalled = Arc::new(AtomicU64::new(0));
    let started_handlers = Arc::new(AtomicU64::new(0));
    let max_signal_ms = Arc::new(AtomicI64::new(0));
    let mut workers = Vec::new();
    for w in 0..8 {
        let (at, sig, max, st) = (
            Arc::clone(&cancelled_at),
            Arc::clone(&signalled),
            Arc::clone(&max_signal_ms),
            Arc::clone(&started_handlers),
        );
        let wo = WorkerOptions::default()
            .name(format!("w{w}"))
            .concurrency(4)
            .heartbeat_every(Duration::from_millis(500))
            .change_stream(w % 2 == 0);
        workers.push(Worker::spawn(q.clone(), wo, move |job| {
            let (at, sig, max, st) = (
                Arc::clone(&at),
                Arc::clone(&sig),
                Arc::clone(&max),
                Arc::clone(&st),
            );
            async move {
                st.fetch_add(1, Ordering::Relaxed);
                tokio::select! {
                    () = job.cancellation().cancelled() => {
                        sig.fetch_add(1, Ordering::Relaxed);
                        let since = at.lock().unwrap_or_else(|p| p.into_inner()).get(&job.id()).copied();
                        if let Some(since) = since {
                            let ms = i64::try_from(since.elapsed().as_millis()).unwrap_or(i64::MAX);
                            max.fetch_max(ms, Ordering::Relaxed);
                        }
                        // The late completion: refused by the fence.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Ok(Bson::String("late".into()))
                    }
                    () = tokio::time::sleep(Duration::from_secs(20)) => Ok(Bson::String("never signalled".into())),
                }
            }
        })?);
    }
    // The operator: cancel every job once it runs.
    let started = Instant::now();
    let mut cancelled_by_operator = 0;
    while cancelled_by_operator < JOBS && started.elapsed() < Duration::from_secs(60) {
        for d in all(&coll, doc! { "state": "running" }).await? {
            let id = d.get_object_id("_id")?;
            cancelled_at
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id, Instant::now());
            if let docwarden::queue::CancelOutcome::Cancelled { was } = q.cancel(id).await? {
                assert_eq!(was, JobState::Running);
                cancelled_by_operator += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Every signal, then every late completion written (or refused).
    tokio::time::sleep(Duration::from_millis(200)).await;
    while signalled.load(Ordering::Relaxed) < started_handlers.load(Ordering::Relaxed)
        && started.elapsed() < Duration::from_secs(60)
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = stop(workers).await;
    Ok(CancelRun {
        jobs: JOBS,
        cancelled_by_operator,
        started: started_handlers.load(Ordering::Relaxed),
        signalled: signalled.load(Ordering::Relaxed),
        overwritten: count(&coll, doc! { "state": "succeeded" }).await?,
        max_signal_ms: max_signal_ms.load(Ordering::Relaxed),
        report,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelling_running_jobs_signals_their_handlers_and_refuses_late_completions()
-> anyhow::Result<()> {
    let t = TestDb::new("queue_lifecycle_cancel").await?;
    let run = cancel_race(&t, "jobs", QueueOptions::default()).await?;
    eprintln!("cancel: {run:?}");
    assert_eq!(
        run.cancelled_by_operator, run.jobs,
        "every job cancelled while running"
    );
    assert!(
        run.started >= run.jobs / 2,
        "{} handlers started",
        run.started
    );
    assert_eq!(
        run.signalled, run.started,
        "every started handler signalled"
    );
    assert_eq!(
        run.report.cancelled, run.started,
        "workers counted the signals"
    );
    assert_eq!(run.overwritten, 0, "late completions stored");
    assert_eq!(
        run.report.lease_lost, run.started,
        "late completions refused by the fence"
    );
    assert_eq!(
        count(
            &t.db.collection::<Document>("jobs"),
            doc! { "state": "cancelled" }
        )
        .await?,
        run.jobs
    );
    // Heartbeat every 500 ms (the change stream is faster): one heartbeat plus slack.
    assert!(
        run.max_signal_ms < 1_250,
        "a signal took {} ms (more than one heartbeat)",
        run.max_signal_ms
    );

    // Control: the final transitions without `state: "running"` in their fence: the
    // handlers' late completions overwrite the operator's cancel.
    let control = cancel_race(
        &t,
        "control",
        QueueOptions::default().unsafe_without(Safeguard::TransitionFence),
    )
    .await?;
    eprintln!("cancel control: {control:?}");
    assert!(
        control.overwritten > 0,
        "the control must store late completions over cancelled jobs"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn snoozed_jobs_run_again_later_without_using_an_attempt() -> anyhow::Result<()> {
    const JOBS: u64 = 200;
    const SNOOZES: i64 = 2;
    let t = TestDb::new("queue_lifecycle_snooze").await?;
    // One attempt each: a snooze that used one would leave `attempts` above 1.
    let q = open(
        &t.db,
        &t.client,
        "jobs",
        QueueOptions::default().max_attempts(1),
    )
    .await?;
    let coll = q.collection().clone();
    q.enqueue_many((0..JOBS).map(|i| (doc! { "i": i.cast_signed() }, EnqueueOptions::default())))
        .await?;
    let runs = Arc::new(AtomicU64::new(0));
    let early = Arc::new(AtomicU64::new(0));
    let last_run: Arc<Mutex<HashMap<ObjectId, Instant>>> = Arc::default();
    let mut workers = Vec::new();
    for w in 0..8 {
        let (runs, early, last) = (Arc::clone(&runs), Arc::clone(&early), Arc::clone(&last_run));
        let wo = WorkerOptions::default()
            .name(format!("w{w}"))
            .concurrency(4);
        workers.push(Worker::spawn(q.clone(), wo, move |job| {
            let (runs, early, last) = (Arc::clone(&runs), Arc::clone(&early), Arc::clone(&last));
            async move {
                runs.fetch_add(1, Ordering::Relaxed);
                let before = last
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(job.id(), Instant::now());
                if before.is_some_and(|b| b.elapsed() < Duration::from_millis(180)) {
                    early.fetch_add(1, Ordering::Relaxed);
                }
                if job.job.snoozes < SNOOZES {
                    snooze(Duration::from_millis(200))
                } else {
                    Ok(Bson::Int64(job.job.snoozes))
                }
            }
        })?);
    }
    wait_for(
        &coll,
        doc! { "state": "succeeded" },
        JOBS,
        Duration::from_secs(60),
    )
    .await?;
    let report = stop(workers).await;
    let one_attempt = count(
        &coll,
        doc! { "state": "succeeded", "attempts": 1, "snoozes": SNOOZES },
    )
    .await?;
    let runs = runs.load(Ordering::Relaxed);
    let early = early.load(Ordering::Relaxed);
    eprintln!("snooze: runs {runs}, early {early}, {report:?}");
    assert_eq!(
        one_attempt, JOBS,
        "succeeded with one attempt and two snoozes"
    );
    assert_eq!(runs, JOBS * 3);
    assert_eq!(report.snoozed, JOBS * 2);
    assert_eq!(report.succeeded, JOBS);
    assert_eq!(early, 0, "a snoozed job ran before its time");
    Ok(())
}

/// Eight enqueuers race `enqueue` of 50 keys with a uniqueness window of 10 minutes
/// while eight workers complete the jobs at once; returns (jobs stored, keys with more
/// than one job inside one window).
async fn window_race(t: &TestDb, name: &str, opts: QueueOptions) -> anyhow::Result<(u64, u64)> {
    const KEYS: i64 = 50;
    let window = Duration::from_secs(600);
    let q = open(&t.db, &t.client, name, opts).await?;
    let coll = q.collection().clone();
    let mut workers = Vec::new();
    for w in 0..8 {
        let wo = WorkerOptions::default()
            .name(format!("w{w}"))
            .concurrency(4)
            .poll(Duration::from_millis(5), Duration::from_millis(20));
        workers.push(Worker::spawn(q.clone(), wo, |_job| async {
            Ok(Bson::Null)
        })?);
    }
    let mut enqueuers = tokio::task::JoinSet::new();
    for e in 0..8_u64 {
        let q = q.clone();
        enqueuers.spawn(async move {
            for round in 0..4_u64 {
                for k in 0..KEYS {
                    // Stagger the racers a little, so reads and inserts interleave.
                    tokio::time::sleep(Duration::from_millis((e * 3 + round) % 7)).await;
                    let opts = EnqueueOptions::default()
                        .dedupe_key(format!("k{k}"))
                        .unique_window(window);
                    q.enqueue(doc! { "k": k }, &opts).await?;
                }
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = enqueuers.join_next().await {
        r??;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop(workers).await;
    let w = i64::try_from(window.as_millis())?;
    let docs = all(&coll, doc! {}).await?;
    let mut by_key_slot: HashMap<(i64, i64), u64> = HashMap::new();
    for d in &docs {
        let k = d.get_document("payload")?.get_i64("k")?;
        let created = d.get_datetime("created_at")?.timestamp_millis();
        *by_key_slot
            .entry((k, created - created.rem_euclid(w)))
            .or_default() += 1;
    }
    let violations = by_key_slot.values().filter(|n| **n > 1).count();
    Ok((docs.len() as u64, violations as u64))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_uniqueness_window_allows_one_job_per_key_per_window_finished_or_not()
-> anyhow::Result<()> {
    let t = TestDb::new("queue_lifecycle_window").await?;
    let (jobs, violations) = window_race(&t, "jobs", QueueOptions::default()).await?;
    eprintln!("window: {jobs} jobs, {violations} keys with two in a window");
    assert_eq!(violations, 0);
    assert!((50..=100).contains(&jobs), "{jobs} jobs for 50 keys");

    // Control: the window checked by a read before the insert (no unique slot): once
    // the first job finished, a racer that read before it existed inserts a second.
    let (jobs, violations) = window_race(
        &t,
        "control",
        QueueOptions::default().unsafe_without(Safeguard::UniqueSlot),
    )
    .await?;
    eprintln!("window control: {jobs} jobs, {violations} keys with two in a window");
    assert!(
        violations > 0,
        "the control must store two jobs of a key in a window"
    );
    Ok(())
}

/// Sixteen enqueuers replace the payloads of 8 keys, two per key, while eight workers run
/// them; each handler records the payload it got. Returns (jobs, created, replaced, jobs
/// whose stored payload differs from what their handler ran).
///
/// Key `k`'s job is due 200 + 120·`k` ms after its creation, so the keys fall due one
/// after another while their two replacers are at them: every claim lands among a
/// stream of replacements of its own key (a replacer cycling over all the keys came
/// back to a key about every 100 ms, so most claims fell between two of its writes, and
/// the control missed every claim in one CI run).
async fn replace_race(
    t: &TestDb,
    name: &str,
    opts: QueueOptions,
) -> anyhow::Result<(u64, u64, u64, u64)> {
    const KEYS: u64 = 8;
    let q = open(&t.db, &t.client, name, opts).await?;
    let coll = q.collection().clone();
    let seen: Arc<Mutex<HashMap<ObjectId, Bson>>> = Arc::default();
    let mut workers = Vec::new();
    for w in 0..8 {
        let seen = Arc::clone(&seen);
        // Fast polls: a job is claimed as soon as it is due (no change-stream event
        // announces that), while the replacers are still at it.
        let wo = WorkerOptions::default()
            .name(format!("w{w}"))
            .concurrency(2)
            .poll(Duration::from_millis(5), Duration::from_millis(20));
        workers.push(Worker::spawn(q.clone(), wo, move |job| {
            let seen = Arc::clone(&seen);
            async move {
                seen.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(job.id(), job.payload().clone());
                tokio::time::sleep(Duration::from_millis(30)).await;
                Ok(job.payload().clone())
            }
        })?);
    }
    let created = Arc::new(AtomicU64::new(0));
    let replaced = Arc::new(AtomicU64::new(0));
    let mut enqueuers = tokio::task::JoinSet::new();
    for e in 0..2 * KEYS {
        let (q, created, replaced) = (q.clone(), Arc::clone(&created), Arc::clone(&replaced));
        let k = e % KEYS;
        enqueuers.spawn(async move {
            // The replacers go on for 1.5 s, so they race the claims of due jobs.
            let started = Instant::now();
            let mut round = 0_i64;
            let opts = EnqueueOptions::default()
                .dedupe_key(format!("k{k}"))
                .on_duplicate(OnDuplicate::Replace)
                .delay(Duration::from_millis(200 + 120 * k));
            while started.elapsed() < Duration::from_millis(1_500) {
                round += 1;
                match q
                    .enqueue(
                        doc! { "k": i64::try_from(k)?, "by": i64::try_from(e)?, "round": round },
                        &opts,
                    )
                    .await?
                {
                    Enqueued::Created(_) => created.fetch_add(1, Ordering::Relaxed),
                    Enqueued::Replaced(_) => replaced.fetch_add(1, Ordering::Relaxed),
                    _ => 0,
                };
            }
            anyhow::Ok(())
        });
    }
    let t0 = Instant::now();
    while let Some(r) = enqueuers.join_next().await {
        r??;
    }
    eprintln!("enqueued in {:?}", t0.elapsed());
    let jobs = count(&coll, doc! {}).await?;
    wait_for(
        &coll,
        doc! { "state": "succeeded" },
        jobs,
        Duration::from_secs(60),
    )
    .await?;
    stop(workers).await;
    let seen = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut rewritten = 0;
    for d in all(&coll, doc! {}).await? {
        let id = d.get_object_id("_id")?;
        if seen.get(&id) != d.get("payload") {
            rewritten += 1;
        }
    }
    Ok((
        jobs,
        created.load(Ordering::Relaxed),
        replaced.load(Ordering::Relaxed),
        rewritten,
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replace_rewrites_only_jobs_that_have_not_started() -> anyhow::Result<()> {
    let t = TestDb::new("queue_lifecycle_replace").await?;
    let (jobs, created, replaced, rewritten) =
        replace_race(&t, "jobs", QueueOptions::default()).await?;
    eprintln!(
        "replace: {jobs} jobs, {created} created, {replaced} replaced, {rewritten} rewritten after start"
    );
    assert_eq!(jobs, created, "every stored job is a created one");
    assert!(replaced > 0, "some enqueues replaced a waiting job");
    assert_eq!(rewritten, 0, "a started job's payload was replaced");

    // Control: the waiting job read, then written by `_id` 20 ms later. It rewrites a
    // started job only when a claim falls inside that gap, so it is a race: up to three
    // runs, each on a fresh collection (one run missed every claim in CI once).
    let mut rewritten_by_control = 0;
    for attempt in 0..3 {
        let (jobs, created, replaced, rewritten) = replace_race(
            &t,
            &format!("control{attempt}"),
            QueueOptions::default().unsafe_without(Safeguard::ReplaceRecheck),
        )
        .await?;
        eprintln!(
            "replace control, run {attempt}: {jobs} jobs, {created} created, {replaced} replaced, {rewritten} rewritten after start"
        );
        rewritten_by_control += rewritten;
        if rewritten > 0 {
            break;
        }
    }
    assert!(
        rewritten_by_control > 0,
        "the control must rewrite started jobs"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn debounce_runs_a_burst_once_after_the_last_enqueue() -> anyhow::Result<()> {
    let t = TestDb::new("queue_lifecycle_debounce").await?;
    let q = open(&t.db, &t.client, "jobs", QueueOptions::default()).await?;
    let coll = q.collection().clone();
    let runs: Arc<Mutex<Vec<(Instant, Bson)>>> = Arc::default();
    let mut workers = Vec::new();
    for w in 0..8 {
        let runs = Arc::clone(&runs);
        let wo = WorkerOptions::default()
            .name(format!("w{w}"))
            .poll(Duration::from_millis(10), Duration::from_millis(50));
        workers.push(Worker::spawn(q.clone(), wo, move |job| {
            let runs = Arc::clone(&runs);
            async move {
                runs.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((Instant::now(), job.payload().clone()));
                Ok(Bson::Null)
            }
        })?);
    }
    let delay = Duration::from_millis(400);
    let last_enqueue = Arc::new(Mutex::new(Instant::now()));
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let mut enqueuers = tokio::task::JoinSet::new();
    for e in 0..8_i64 {
        let (q, last, outcomes) = (q.clone(), Arc::clone(&last_enqueue), Arc::clone(&outcomes));
        enqueuers.spawn(async move {
            for i in 0..40_i64 {
                let opts = EnqueueOptions::default()
                    .dedupe_key("burst")
                    .on_duplicate(OnDuplicate::Debounce)
                    .delay(delay);
                // Taken before the call: a run may start between the server applying
                // this enqueue and its reply arriving, and that run counts.
                let sent = Instant::now();
                let o = q.enqueue(doc! { "by": e, "i": i }, &opts).await?;
                {
                    let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
                    *last = (*last).max(sent);
                }
                outcomes.lock().unwrap_or_else(|p| p.into_inner()).push(o);
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = enqueuers.join_next().await {
        r??;
    }
    wait_for(
        &coll,
        doc! { "state": "succeeded" },
        1,
        Duration::from_secs(10),
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(800)).await;
    stop(workers).await;
    let runs = runs.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let outcomes = outcomes.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let created = outcomes.iter().filter(|o| o.created().is_some()).count();
    let replaced = outcomes
        .iter()
        .filter(|o| matches!(o, Enqueued::Replaced(_)))
        .count();
    let last = *last_enqueue.lock().unwrap_or_else(|p| p.into_inner());
    eprintln!(
        "debounce: {} enqueues, {created} created, {replaced} replaced, {} runs",
        outcomes.len(),
        runs.len()
    );
    assert_eq!(outcomes.len(), 320);
    assert_eq!(
        (created, replaced),
        (1, 319),
        "one job, every other enqueue debounced into it"
    );
    assert_eq!(runs.len(), 1, "the burst ran once");
    // Due `delay` after the last enqueue (less the few ms the clock bound allows).
    assert!(
        runs[0].0 + Duration::from_millis(50) >= last + delay,
        "ran {:?} before the last enqueue's delay ended",
        (last + delay).saturating_duration_since(runs[0].0)
    );
    assert_eq!(count(&coll, doc! {}).await?, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn follow_up_runs_once_more_after_the_current_run() -> anyhow::Result<()> {
    let t = TestDb::new("queue_lifecycle_follow_up").await?;
    let q = open(&t.db, &t.client, "jobs", QueueOptions::default()).await?;
    let coll = q.collection().clone();
    let running = Arc::new(AtomicUsize::new(0));
    let overlap = Arc::new(AtomicU64::new(0));
    let starts: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let mut workers = Vec::new();
    for w in 0..8 {
        let (running, overlap, starts) = (
            Arc::clone(&running),
            Arc::clone(&overlap),
            Arc::clone(&starts),
        );
        let wo = WorkerOptions::default()
            .name(format!("w{w}"))
            .poll(Duration::from_millis(10), Duration::from_millis(50));
        workers.push(Worker::spawn(q.clone(), wo, move |_job| {
            let (running, overlap, starts) = (
                Arc::clone(&running),
                Arc::clone(&overlap),
                Arc::clone(&starts),
            );
            async move {
                if running.fetch_add(1, Ordering::SeqCst) > 0 {
                    overlap.fetch_add(1, Ordering::Relaxed);
                }
                starts
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(Instant::now());
                tokio::time::sleep(Duration::from_millis(80)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                Ok(Bson::Null)
            }
        })?);
    }
    let last_enqueue = Arc::new(Mutex::new(Instant::now()));
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let mut enqueuers = tokio::task::JoinSet::new();
    for e in 0..8_i64 {
        let (q, last, outcomes) = (q.clone(), Arc::clone(&last_enqueue), Arc::clone(&outcomes));
        enqueuers.spawn(async move {
            for i in 0..60_i64 {
                let opts = EnqueueOptions::default()
                    .dedupe_key("refresh")
                    .on_duplicate(OnDuplicate::FollowUp);
                // When the enqueue was sent: a run it asks for (a waiting job, or a
                // follow-up of the running one) starts after this, though possibly before
                // the reply arrives (the job is claimable once written).
                let sent = Instant::now();
                let o = q.enqueue(doc! { "by": e, "i": i }, &opts).await?;
                {
                    let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
                    *last = (*last).max(sent);
                }
                outcomes.lock().unwrap_or_else(|p| p.into_inner()).push(o);
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = enqueuers.join_next().await {
        r??;
    }
    let last = *last_enqueue.lock().unwrap_or_else(|p| p.into_inner());
    // Settled: every job succeeded, twice in a row 300 ms apart (a follow-up turns a
    // finished run back into a ready job; a fixed sleep was too short on a loaded machine).
    let settle_by = Instant::now() + Duration::from_secs(20);
    let mut quiet = 0;
    while quiet < 2 {
        anyhow::ensure!(
            Instant::now() < settle_by,
            "jobs still unfinished after 20 s"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        let open = count(&coll, doc! { "state": { "$ne": "succeeded" } }).await?;
        quiet = if open == 0 { quiet + 1 } else { 0 };
    }
    stop(workers).await;
    let starts = starts.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let outcomes = outcomes.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let created = i64::try_from(outcomes.iter().filter(|o| o.created().is_some()).count())?;
    let follow_ups_asked = outcomes
        .iter()
        .filter(|o| matches!(o, Enqueued::FollowUp(_)))
        .count();
    let docs = all(&coll, doc! {}).await?;
    let follow_ups_run: i64 = docs.iter().map(|d| int(d, "follow_ups")).sum();
    let unfinished = count(&coll, doc! { "state": { "$ne": "succeeded" } }).await?;
    eprintln!(
        "follow-up: {} enqueues, {created} created, {follow_ups_asked} follow-ups asked, {} runs, {follow_ups_run} follow-up runs",
        outcomes.len(),
        starts.len()
    );
    assert_eq!(
        overlap.load(Ordering::Relaxed),
        0,
        "two runs of the key at once"
    );
    assert_eq!(unfinished, 0);
    assert_eq!(
        i64::try_from(starts.len())?,
        created + follow_ups_run,
        "every run is a created job or one follow-up"
    );
    assert!(follow_ups_run >= 2, "follow-ups ran");
    assert!(
        starts.iter().any(|s| *s >= last),
        "no run started after the last enqueue was sent"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn progress_and_results_are_fenced_and_size_limited() -> anyhow::Result<()> {
    const JOBS: u64 = 160;
    let t = TestDb::new("queue_lifecycle_progress").await?;
    let q = open(
        &t.db,
        &t.client,
        "jobs",
        QueueOptions::default()
            .lease_ttl(Duration::from_millis(600))
            .reap_interval(Duration::from_millis(50)),
    )
    .await?;
    let coll = q.collection().clone();
    q.enqueue_many((0..JOBS).map(|i| (doc! { "i": i.cast_signed() }, EnqueueOptions::default())))
        .await?;
    let mut workers = Vec::new();
    for w in 0..8 {
        let qq = q.clone();
        let wo = WorkerOptions::default()
            .name(format!("w{w}"))
            .concurrency(4)
            .heartbeat_every(Duration::from_millis(150));
        workers.push(Worker::spawn(q.clone(), wo, move |job| {
            let q = qq.clone();
            async move {
                for step in 1..=3_i64 {
                    q.progress(&job, doc! { "step": step, "of": 3_i64 }).await?;
                }
                Ok(
                    doc! { "i": job.payload().as_document().and_then(|d| d.get_i64("i").ok()) }
                        .into(),
                )
            }
        })?);
    }
    wait_for(
        &coll,
        doc! { "state": "succeeded" },
        JOBS,
        Duration::from_secs(60),
    )
    .await?;
    stop(workers).await;
    let done = count(
        &coll,
        doc! { "state": "succeeded", "progress.step": 3_i64, "result.i": { "$exists": true } },
    )
    .await?;
    let consistent = all(&coll, doc! {})
        .await?
        .iter()
        .filter(|d| {
            d.get_document("result")
                .ok()
                .and_then(|r| r.get_i64("i").ok())
                == d.get_document("payload")
                    .ok()
                    .and_then(|p| p.get_i64("i").ok())
        })
        .count() as u64;
    assert_eq!((done, consistent), (JOBS, JOBS));

    // Size limits: typed errors, nothing written.
    q.enqueue(doc! { "big": true }, &EnqueueOptions::default())
        .await?;
    let job = q
        .claim("solo")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no job"))?;
    let big = Bson::String("x".repeat(MAX_PROGRESS_BYTES));
    let r = q.progress(&job, big).await;
    assert!(
        matches!(
            r,
            Err(Error::InvalidInput {
                what: "progress",
                ..
            })
        ),
        "{r:?}"
    );
    let huge = Bson::String("x".repeat(docwarden::queue::MAX_RESULT_BYTES));
    let r = q.complete(&job, huge).await;
    assert!(
        matches!(r, Err(Error::InvalidInput { what: "result", .. })),
        "{r:?}"
    );
    // Fenced: once the lease expired and was swept, progress is refused.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    q.reap_expired().await?;
    let r = q.progress(&job, 1_i64).await;
    assert!(matches!(r, Err(Error::LeaseLost { .. })), "{r:?}");
    let stored = q
        .get(job.id())
        .await?
        .ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(stored.progress, None);
    Ok(())
}

/// Whether the server runs multi-document transactions (a replica set does; a
/// standalone refuses them).
async fn transactions_supported(client: &Client, db: &Database) -> anyhow::Result<bool> {
    let probe = db.collection::<Document>("txn_probe");
    let mut s = client.start_session().await?;
    s.start_transaction().await?;
    match probe.insert_one(doc! { "p": 1 }).session(&mut s).await {
        Ok(_) => {
            s.commit_transaction().await?;
            Ok(true)
        }
        Err(e) => {
            eprintln!("transactions refused: {e}");
            Ok(false)
        }
    }
}

/// Eight tasks each run 25 transactions that insert an order and enqueue its job
/// (inside the transaction with `enqueue_in`, or outside it for the control), and commit
/// the even ones, abort the odd ones, while eight workers run the jobs. Returns (orders
/// committed, jobs stored, jobs whose order was aborted, jobs run).
async fn transactional_race(
    t: &TestDb,
    name: &str,
    inside: bool,
) -> anyhow::Result<(u64, u64, u64, u64)> {
    let q = open(&t.db, &t.client, name, QueueOptions::default()).await?;
    let coll = q.collection().clone();
    let orders_name = format!("{name}_orders");
    // Created before the transactions: creating a collection inside concurrent
    // transactions conflicts.
    t.db.create_collection(&orders_name).await?;
    let orders = t.db.collection::<Document>(&orders_name);
    let ran = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for w in 0..8 {
        let ran = Arc::clone(&ran);
        let wo = WorkerOptions::default().name(format!("w{w}"));
        workers.push(Worker::spawn(q.clone(), wo, move |_job| {
            let ran = Arc::clone(&ran);
            async move {
                ran.fetch_add(1, Ordering::Relaxed);
                Ok(Bson::Null)
            }
        })?);
    }
    let mut tasks = tokio::task::JoinSet::new();
    for e in 0..8_i64 {
        let (q, orders, client) = (q.clone(), orders.clone(), t.client.clone());
        tasks.spawn(async move {
            for i in 0..25_i64 {
                let n = e * 100 + i;
                let mut s = client.start_session().await?;
                s.start_transaction().await?;
                orders.insert_one(doc! { "_id": n }).session(&mut s).await?;
                if inside {
                    q.enqueue_in(&mut s, doc! { "order": n }, &EnqueueOptions::default())
                        .await?;
                } else {
                    q.enqueue(doc! { "order": n }, &EnqueueOptions::default())
                        .await?;
                }
                if n % 2 == 0 {
                    s.commit_transaction().await?;
                } else {
                    s.abort_transaction().await?;
                }
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    let committed = count(&orders, doc! {}).await?;
    let jobs = count(&coll, doc! {}).await?;
    wait_for(
        &coll,
        doc! { "state": "succeeded" },
        jobs,
        Duration::from_secs(60),
    )
    .await?;
    stop(workers).await;
    let mut orphans = 0;
    for d in all(&coll, doc! {}).await? {
        let n = d.get_document("payload")?.get_i64("order")?;
        if count(&orders, doc! { "_id": n }).await? == 0 {
            orphans += 1;
        }
    }
    Ok((committed, jobs, orphans, ran.load(Ordering::Relaxed)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_enqueued_in_a_transaction_exists_iff_the_transaction_commits() -> anyhow::Result<()>
{
    let t = TestDb::new("queue_lifecycle_txn").await?;
    if !transactions_supported(&t.client, &t.db).await? {
        docwarden_testkit::skip(
            "a_job_enqueued_in_a_transaction_exists_iff_the_transaction_commits",
            "the server refuses multi-document transactions",
        );
        return Ok(());
    }
    let (committed, jobs, orphans, ran) = transactional_race(&t, "jobs", true).await?;
    eprintln!("enqueue_in: {committed} committed, {jobs} jobs, {orphans} orphans, {ran} runs");
    // n = 100·e + i, i in 0..25: 13 even (committed) and 12 odd (aborted) per task.
    assert_eq!(committed, 104);
    assert_eq!((jobs, orphans, ran), (104, 0, 104));

    // Control: the same transactions with the job enqueued outside them: the aborted
    // orders' jobs exist (and run).
    let (committed, jobs, orphans, ran) = transactional_race(&t, "control", false).await?;
    eprintln!("enqueue outside: {committed} committed, {jobs} jobs, {orphans} orphans, {ran} runs");
    assert_eq!((committed, jobs), (104, 200));
    assert_eq!(orphans, 96, "the control must leave jobs of aborted orders");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stalls_are_counted_once_per_takeover_and_max_stalls_buries_the_job() -> anyhow::Result<()>
{
    const JOBS: u64 = 40;
    const MAX_STALLS: u32 = 2;
    let t = TestDb::new("queue_lifecycle_stalls").await?;
    let opts = QueueOptions::default()
        .lease_ttl(Duration::from_millis(300))
        .reap_interval(Duration::from_millis(20))
        .max_attempts(10)
        .max_stalls(MAX_STALLS);
    let q = open(&t.db, &t.client, "jobs", opts.clone()).await?;
    let coll = q.collection().clone();
    q.enqueue_many((0..JOBS).map(|i| (doc! { "i": i.cast_signed() }, EnqueueOptions::default())))
        .await?;
    // Eight claimers, each with its own handle (so their sweeps race), claim jobs and
    // abandon them: every lease expires and is taken over by some sweep.
    let claims = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..8 {
        let h = open(&t.db, &t.client, "jobs", opts.clone()).await?;
        let (claims, coll) = (Arc::clone(&claims), coll.clone());
        tasks.spawn(async move {
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(60) {
                if count(&coll, doc! { "state": "dead" }).await? == JOBS {
                    break;
                }
                match h.claim_batch(&format!("w{w}"), 4).await? {
                    batch if batch.is_empty() => {
                        tokio::time::sleep(Duration::from_millis(30)).await;
                    }
                    batch => {
                        claims.fetch_add(batch.len() as u64, Ordering::Relaxed);
                    }
                }
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    let docs = all(&coll, doc! {}).await?;
    let buried = docs
        .iter()
        .filter(|d| {
            d.get_str("state") == Ok("dead")
                && int(d, "stalls") == i64::from(MAX_STALLS) + 1
                && int(d, "attempts") == i64::from(MAX_STALLS) + 1
                && d.get_str("last_error")
                    .is_ok_and(|e| e.starts_with("stalled"))
        })
        .count() as u64;
    let miscounted = docs
        .iter()
        .filter(|d| int(d, "stalls") != int(d, "attempts"))
        .count();
    let claims = claims.load(Ordering::Relaxed);
    eprintln!(
        "stalls: {claims} claims, {buried} buried after {} stalls, {miscounted} miscounted",
        MAX_STALLS + 1
    );
    assert_eq!(miscounted, 0, "stalls != abandoned claims");
    assert_eq!(buried, JOBS);
    assert_eq!(claims, JOBS * u64::from(MAX_STALLS + 1));
    Ok(())
}

#[tokio::test]
async fn uniqueness_policies_one_enqueue_at_a_time() -> anyhow::Result<()> {
    let t = TestDb::new("queue_lifecycle_policies").await?;
    let q = open(&t.db, &t.client, "jobs", QueueOptions::default()).await?;
    let replace = EnqueueOptions::default()
        .dedupe_key("r")
        .on_duplicate(OnDuplicate::Replace);
    let first = q.enqueue(doc! { "v": 1 }, &replace).await?;
    let id = first
        .created()
        .ok_or_else(|| anyhow::anyhow!("{first:?}"))?;
    assert_eq!(
        q.enqueue(doc! { "v": 2 }, &replace).await?,
        Enqueued::Replaced(id)
    );
    let job = q.get(id).await?.ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(job.payload, Bson::Document(doc! { "v": 2 }));
    // Running: kept.
    let claimed = q
        .claim("w")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no job"))?;
    let again = q.enqueue(doc! { "v": 3 }, &replace).await?;
    assert!(
        matches!(again, Enqueued::Duplicate { existing: Some(e), .. } if e == id),
        "{again:?}"
    );
    // Follow-up on the running job: completes into one more run.
    let follow = replace.clone().on_duplicate(OnDuplicate::FollowUp);
    assert_eq!(
        q.enqueue(doc! { "v": 4 }, &follow).await?,
        Enqueued::FollowUp(id)
    );
    assert_eq!(
        q.enqueue(doc! { "v": 5 }, &follow).await?,
        Enqueued::FollowUp(id)
    );
    q.complete(&claimed, "first run").await?;
    let job = q.get(id).await?.ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(
        (
            job.state,
            job.payload.clone(),
            job.attempts,
            job.follow_ups,
            job.follow_up.clone()
        ),
        (JobState::Ready, Bson::Document(doc! { "v": 5 }), 0, 1, None)
    );
    let claimed = q
        .claim("w")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no job"))?;
    q.complete(&claimed, "second run").await?;
    let job = q.get(id).await?.ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!((job.state, job.follow_ups), (JobState::Succeeded, 1));
    // Finished: a new enqueue creates a new job (MongoDB frees the key of a finished
    // job; the embedded surrogate keeps it, see docs/queue.md).
    if docwarden::capabilities::probe_partial_index_updates(&t.client)
        .await?
        .is_supported()
    {
        let next = q.enqueue(doc! { "v": 6 }, &replace).await?;
        assert!(next.created().is_some(), "{next:?}");
    } else {
        eprintln!("surrogate: a finished job's dedupe key stays taken; not asserted");
    }
    // Window: finished or not, one per key per window.
    let windowed = EnqueueOptions::default()
        .dedupe_key("w")
        .unique_window(Duration::from_secs(600));
    let claimed_id = q.enqueue(1_i64, &windowed).await?.created();
    assert!(claimed_id.is_some());
    let claimed = q
        .claim("w")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no job"))?;
    q.complete(&claimed, Bson::Null).await?;
    let again = q.enqueue(2_i64, &windowed).await?;
    assert!(
        matches!(again, Enqueued::Duplicate { existing: Some(e), .. } if Some(e) == claimed_id),
        "{again:?}"
    );
    Ok(())
}

/// Session 15: a follow-up payload is stored in the key's running job next to its own
/// payload; when the two did not fit in one document the server refused the write and
/// the enqueue returned a bare database error (BSONObjectTooLarge). It is
/// `InvalidInput { what: "payload" }` now, and the running job is unchanged.
#[tokio::test]
async fn a_follow_up_too_large_for_the_running_job_is_invalid_input() -> anyhow::Result<()> {
    let t = TestDb::new("queue_lifecycle_follow_up_size").await?;
    let q = open(&t.db, &t.client, "jobs", QueueOptions::default()).await?;
    let blob = || {
        Bson::Binary(mongodb::bson::Binary {
            subtype: mongodb::bson::spec::BinarySubtype::Generic,
            bytes: vec![7; 9 * 1024 * 1024],
        })
    };
    let follow_up = EnqueueOptions::default()
        .dedupe_key("k")
        .on_duplicate(OnDuplicate::FollowUp);
    q.enqueue(doc! { "b": blob() }, &follow_up).await?;
    let job = q
        .claim("w")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no job"))?;
    let second = q.enqueue(doc! { "b": blob() }, &follow_up).await;
    assert!(
        matches!(
            second,
            Err(Error::InvalidInput {
                what: "payload",
                ..
            })
        ),
        "{:?}",
        second.map_err(|e| e.to_string().chars().take(200).collect::<String>())
    );
    let stored = q
        .get(job.id())
        .await?
        .ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(stored.follow_up, None, "nothing was written");
    q.complete(&job, Bson::Null).await?;
    Ok(())
}

/// Session 17: `retry_dead` reset `attempts` but kept the per-run counters of the run
/// that died: a job buried for its stalls (`max_stalls: 1`) came back with `stalls: 2`,
/// so the first stall of its new run buried it again at once (and `snoozes`, `progress`,
/// `result`, the old `lease` were carried over too). A retried job starts as a fresh one,
/// its history (`last_error`, `created_at`) kept. Fails without the reset: the job is
/// `dead` again after one stall of its new run, and the fields are not reset.
#[tokio::test]
async fn a_retried_dead_job_starts_as_a_fresh_run() -> anyhow::Result<()> {
    let t = TestDb::new("queue_lifecycle_retry_fresh").await?;
    let opts = QueueOptions::default()
        .reap_interval(Duration::from_secs(3600))
        .max_stalls(1);
    let q = open(&t.db, &t.client, "jobs", opts).await?;
    let coll = q.collection().clone();
    let id = q
        .enqueue(doc! { "n": 1 }, &EnqueueOptions::default().max_attempts(5))
        .await?
        .created()
        .ok_or_else(|| anyhow::anyhow!("not created"))?;
    // The lease of the claim `job` expires and the sweep takes the job over.
    let stall = |job: docwarden::queue::ClaimedJob| {
        let (q, coll) = (q.clone(), coll.clone());
        async move {
            coll.update_one(
                doc! { "_id": job.id() },
                doc! { "$set": { "lease.until": mongodb::bson::DateTime::from_millis(0) } },
            )
            .await?;
            anyhow::ensure!(q.reap_expired().await? == 1, "not swept");
            anyhow::Ok(())
        }
    };
    let claim = || async {
        q.claim("w")
            .await?
            .ok_or_else(|| anyhow::anyhow!("nothing to claim"))
    };
    // One run: a snooze, progress, then two stalls bury it (`max_stalls: 1`).
    let job = claim().await?;
    q.snooze(&job, Duration::ZERO).await?;
    let job = claim().await?;
    q.progress(&job, "half way").await?;
    stall(job).await?;
    let job = claim().await?;
    stall(job).await?;
    let dead = q.get(id).await?.ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(
        (dead.state, dead.stalls, dead.snoozes),
        (JobState::Dead, 2, 1)
    );

    assert_eq!(q.retry_dead(Some(&[id])).await?, 1);
    let fresh = q.get(id).await?.ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(fresh.state, JobState::Ready);
    assert_eq!(
        (fresh.attempts, fresh.stalls, fresh.snoozes),
        (0, 0, 0),
        "per-run counters kept: {fresh:?}"
    );
    assert_eq!(
        (
            &fresh.progress,
            &fresh.result,
            &fresh.lease,
            fresh.finished_at
        ),
        (&None, &None, &None, None),
        "per-run fields kept: {fresh:?}"
    );
    assert_eq!(fresh.last_error, dead.last_error, "history lost");
    assert_eq!(fresh.created_at, dead.created_at, "history lost");

    // Its new run's first stall is within `max_stalls`: retried, not buried.
    let job = claim().await?;
    assert_eq!(job.job.attempts, 1);
    stall(job).await?;
    let after = q.get(id).await?.ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(
        (after.state, after.stalls),
        (JobState::Retrying, 1),
        "the new run's first stall buried the job: {after:?}"
    );
    Ok(())
}

/// Hand edits of a running job's `attempts` (a string, a double, null, missing): shared by
/// the give-back and the sweep tests of malformed attempt counts.
fn attempts_hand_edits() -> Vec<(&'static str, Document)> {
    vec![
        ("attempts string", doc! { "$set": { "attempts": "2" } }),
        ("attempts double", doc! { "$set": { "attempts": 1.5 } }),
        ("attempts null", doc! { "$set": { "attempts": Bson::Null } }),
        ("attempts missing", doc! { "$unset": { "attempts": "" } }),
    ]
}

/// Session 17: `release` and `snooze` count `attempts` down and `snoozes` up with `$inc`.
/// On a job hand-edited while it ran they returned a bare database error (a string or a
/// null: the server's TypeMismatch), or wrote what no claim parses again (a double
/// counted down to 0.5; a missing `attempts` created as −1). Each is now
/// `Error::Malformed` naming the field, and nothing is written: the job is exactly as
/// the edit left it. The worker's bulk path (a handler that snoozes) reports the same,
/// counted neither as a snooze nor as a lost lease. Fails without the guard: bare
/// `Database` errors, and the double/missing edits are written through.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_give_back_of_a_hand_edited_job_is_malformed_and_writes_nothing() -> anyhow::Result<()> {
    let t = TestDb::new("queue_lifecycle_give_back_malformed").await?;
    let q = open(&t.db, &t.client, "jobs", QueueOptions::default()).await?;
    let coll = q.collection().clone();
    let mut edits: Vec<(&str, Document, &str)> = attempts_hand_edits()
        .into_iter()
        .map(|(name, edit)| (name, edit, "attempts"))
        .collect();
    edits.extend([
        (
            "snoozes string",
            doc! { "$set": { "snoozes": "many" } },
            "snoozes",
        ),
        (
            "snoozes double",
            doc! { "$set": { "snoozes": 2.5 } },
            "snoozes",
        ),
    ]);
    for (name, edit, field) in &edits {
        for op in ["release", "snooze"] {
            if *field == "snoozes" && op == "release" {
                continue; // a release does not count snoozes
            }
            q.enqueue(doc! { "case": *name, "op": op }, &EnqueueOptions::default())
                .await?;
            let job = q
                .claim("w")
                .await?
                .ok_or_else(|| anyhow::anyhow!("no job"))?;
            coll.update_one(doc! { "_id": job.id() }, edit.clone())
                .await?;
            let before = coll
                .find_one(doc! { "_id": job.id() })
                .await?
                .ok_or_else(|| anyhow::anyhow!("gone"))?;
            let r = match op {
                "release" => q.release(&job).await,
                _ => q.snooze(&job, Duration::from_secs(1)).await.map(|_| ()),
            };
            match &r {
                Err(Error::Malformed { reason, .. }) => assert!(
                    reason.contains(field),
                    "{op} of a job with {name}: the reason does not name `{field}`: {reason}"
                ),
                other => panic!("{op} of a job with {name}: expected Malformed, got {other:?}"),
            }
            let after = coll
                .find_one(doc! { "_id": job.id() })
                .await?
                .ok_or_else(|| anyhow::anyhow!("gone"))?;
            assert_eq!(before, after, "{op} of a job with {name} wrote to it");
            // The claim still holds it: the handler can still finish it.
            q.fail(&job, "given up").await?;
        }
    }

    // The worker's bulk path: the handler edits its own job, then snoozes.
    let bulk = open(&t.db, &t.client, "bulk", QueueOptions::default()).await?;
    let bulk_coll = bulk.collection().clone();
    let id = bulk
        .enqueue(doc! { "n": 1 }, &EnqueueOptions::default())
        .await?
        .created()
        .ok_or_else(|| anyhow::anyhow!("not created"))?;
    let c = bulk_coll.clone();
    let w = Worker::spawn(
        bulk.clone(),
        WorkerOptions::default().concurrency(1).change_stream(false),
        move |job| {
            let c = c.clone();
            async move {
                c.update_one(
                    doc! { "_id": job.id() },
                    doc! { "$set": { "attempts": 1.5 } },
                )
                .await?;
                snooze(Duration::from_secs(1))
            }
        },
    )?;
    wait_for(
        &bulk_coll,
        doc! { "_id": id, "attempts": 1.5 },
        1,
        Duration::from_secs(10),
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = w.shutdown().await;
    let stored = bulk_coll
        .find_one(doc! { "_id": id })
        .await?
        .ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(
        (
            stored.get_str("state")?,
            stored.get_f64("attempts")?,
            stored.contains_key("snoozes")
        ),
        ("running", 1.5, false),
        "the worker's snooze wrote to the hand-edited job: {stored}"
    );
    assert_eq!(
        (report.snoozed, report.lease_lost),
        (0, 0),
        "counted as a snooze or a lost lease: {report:?}"
    );
    Ok(())
}

/// Session 17: a completion that consumes a follow-up counts `follow_ups + 1` with
/// `$add`; a `follow_ups` hand-edited into a string while the job ran failed the whole
/// completion with an untyped database error (the job stayed running until its lease
/// expired, its result lost). It counts as 0 now, like the sweep's `stalls`: the follow-up
/// run is queued and the result kept. Fails without it: `complete` returns
/// `Error::Database`.
#[tokio::test]
async fn a_completion_with_a_hand_edited_follow_up_count_still_applies() -> anyhow::Result<()> {
    let t = TestDb::new("queue_lifecycle_follow_ups_edited").await?;
    let q = open(&t.db, &t.client, "jobs", QueueOptions::default()).await?;
    let coll = q.collection().clone();
    let follow_up = EnqueueOptions::default()
        .dedupe_key("k")
        .on_duplicate(OnDuplicate::FollowUp);
    q.enqueue(doc! { "run": 1 }, &follow_up).await?;
    let job = q
        .claim("w")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no job"))?;
    let second = q.enqueue(doc! { "run": 2 }, &follow_up).await?;
    assert_eq!(second, Enqueued::FollowUp(job.id()));
    coll.update_one(
        doc! { "_id": job.id() },
        doc! { "$set": { "follow_ups": "several" } },
    )
    .await?;
    let r = q.complete(&job, "first").await;
    assert!(r.is_ok(), "the completion failed: {r:?}");
    let stored = coll
        .find_one(doc! { "_id": job.id() })
        .await?
        .ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(stored.get_str("state")?, "ready", "{stored}");
    assert_eq!(
        stored.get_document("payload")?.get_i32("run")?,
        2,
        "{stored}"
    );
    assert_eq!(stored.get_i64("follow_ups")?, 1, "{stored}");
    assert_eq!(stored.get_str("result")?, "first", "{stored}");
    Ok(())
}

/// Session 18: `Replace` and `Debounce` rewrote only the waiting job's payload and
/// priority (and `run_at`), so the job kept the first enqueue's `max_attempts` and
/// limits: an enqueue asking for one attempt, or for another concurrency key, ran with
/// the old job's five attempts under the old key. BullMQ's debounce `replace` stores the
/// new job with its own options (Oban's `replace:` names the fields, `max_attempts` and
/// `priority` among them); here the waiting job now takes everything the enqueue decides
/// and keeps what it has lived (`attempts`, `created_at`). Fails without it: the replaced
/// job keeps `max_attempts: 5` and `limits.key: "a"`.
#[tokio::test]
async fn replace_and_debounce_take_the_new_enqueues_options() -> anyhow::Result<()> {
    let t = TestDb::new("queue_lifecycle_replace_options").await?;
    let q = open(&t.db, &t.client, "jobs", QueueOptions::default()).await?;
    let coll = q.collection().clone();
    let stored = |id: ObjectId| {
        let coll = coll.clone();
        async move {
            coll.find_one(doc! { "_id": id })
                .await?
                .ok_or_else(|| anyhow::anyhow!("gone"))
        }
    };
    let first = EnqueueOptions::default()
        .dedupe_key("r")
        .max_attempts(5)
        .priority(1)
        .concurrency_key("a");
    let id = q
        .enqueue(doc! { "v": 1 }, &first)
        .await?
        .created()
        .ok_or_else(|| anyhow::anyhow!("not created"))?;
    let before = stored(id).await?;

    // A replace without limits: one attempt, no `limits` left (plain claims take it).
    let plain = EnqueueOptions::default()
        .dedupe_key("r")
        .on_duplicate(OnDuplicate::Replace)
        .max_attempts(1)
        .priority(3);
    assert_eq!(
        q.enqueue(doc! { "v": 2 }, &plain).await?,
        Enqueued::Replaced(id)
    );
    let after = stored(id).await?;
    assert_eq!(after.get_i64("max_attempts")?, 1, "{after}");
    assert_eq!(after.get_i64("priority")?, 3, "{after}");
    assert!(
        !after.contains_key("limits"),
        "the old limits stayed: {after}"
    );
    assert_eq!(after.get_document("payload")?.get_i32("v")?, 2);
    assert_eq!(after.get("created_at"), before.get("created_at"));
    assert_eq!(
        after.get("run_at"),
        before.get("run_at"),
        "replace keeps run_at"
    );

    // A replace with other keys: the job carries those.
    let keyed = plain.clone().concurrency_key("b").rate_key("rb");
    assert_eq!(
        q.enqueue(doc! { "v": 3 }, &keyed).await?,
        Enqueued::Replaced(id)
    );
    let after = stored(id).await?;
    let limits = after.get_document("limits")?;
    assert_eq!(
        (limits.get_str("key")?, limits.get_str("rate")?),
        ("b", "rb"),
        "{after}"
    );

    // Debounce: the new options and the new run_at.
    let debounce = |n: u32, delay: Duration| {
        EnqueueOptions::default()
            .dedupe_key("d")
            .on_duplicate(OnDuplicate::Debounce)
            .max_attempts(n)
            .delay(delay)
    };
    let d = q
        .enqueue(doc! { "v": 1 }, &debounce(5, Duration::from_secs(1)))
        .await?
        .created()
        .ok_or_else(|| anyhow::anyhow!("not created"))?;
    let early = stored(d).await?.get_datetime("run_at")?.timestamp_millis();
    assert_eq!(
        q.enqueue(doc! { "v": 2 }, &debounce(2, Duration::from_secs(3600)))
            .await?,
        Enqueued::Replaced(d)
    );
    let after = stored(d).await?;
    assert_eq!(after.get_i64("max_attempts")?, 2, "{after}");
    assert!(
        after.get_datetime("run_at")?.timestamp_millis() - early > 3_000_000,
        "{after}"
    );

    // A retrying job keeps the attempts it made: they count against the new maximum.
    let r = q
        .enqueue(
            doc! { "v": 1 },
            &EnqueueOptions::default().dedupe_key("f").max_attempts(5),
        )
        .await?
        .created()
        .ok_or_else(|| anyhow::anyhow!("not created"))?;
    let job = q
        .claim("w")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no job"))?;
    assert_eq!(job.id(), r);
    q.fail(&job, "boom").await?;
    let replace_f = EnqueueOptions::default()
        .dedupe_key("f")
        .on_duplicate(OnDuplicate::Replace)
        .max_attempts(3);
    assert_eq!(
        q.enqueue(doc! { "v": 2 }, &replace_f).await?,
        Enqueued::Replaced(r)
    );
    let after = stored(r).await?;
    assert_eq!(
        (
            after.get_i64("attempts")?,
            after.get_i64("max_attempts")?,
            after.get_str("state")?
        ),
        (1, 3, "retrying"),
        "{after}"
    );
    Ok(())
}

/// Session 18: a release or snooze of a job whose `attempts` was hand-edited while it ran
/// is refused as `Malformed` and writes nothing, so the job stays running until its lease
/// expires. The sweep then buried it with "lease expired before the job finished" (a
/// string `attempts` compares above every number, so `attempts ≥ max_attempts` held), or,
/// for a double or null, put it back to `retrying` for the next claim to bury: the real
/// cause was hidden or deferred. The sweep now moves a job whose `attempts` or
/// `max_attempts` is not an integer to `dead` naming the field (one pipeline update, as
/// before; nothing changes on the claim, completion or heartbeat paths). Fails without
/// it: the string case is buried as "lease expired before the job finished", the double
/// and null cases are `retrying`.
#[tokio::test]
async fn an_expired_job_with_a_malformed_attempt_count_is_buried_naming_the_field()
-> anyhow::Result<()> {
    let t = TestDb::new("queue_lifecycle_sweep_malformed").await?;
    let q = open(
        &t.db,
        &t.client,
        "jobs",
        QueueOptions::default().reap_interval(Duration::from_secs(3600)),
    )
    .await?;
    let coll = q.collection().clone();
    let mut edits: Vec<(&str, Document, &str)> = attempts_hand_edits()
        .into_iter()
        .map(|(name, edit)| (name, edit, "`attempts`"))
        .collect();
    edits.extend([
        (
            "max_attempts missing",
            doc! { "$unset": { "max_attempts": "" } },
            "`max_attempts`",
        ),
        (
            "max_attempts zero",
            doc! { "$set": { "max_attempts": 0_i64 } },
            "`max_attempts` must be at least 1, found 0",
        ),
    ]);
    let mut ids = Vec::new();
    for (name, edit, _) in &edits {
        q.enqueue(doc! { "case": *name }, &EnqueueOptions::default())
            .await?;
        let job = q
            .claim("w")
            .await?
            .ok_or_else(|| anyhow::anyhow!("no job"))?;
        coll.update_one(doc! { "_id": job.id() }, edit.clone())
            .await?;
        if name.starts_with("attempts") {
            let r = q.release(&job).await;
            assert!(
                matches!(r, Err(Error::Malformed { .. })),
                "release of a job with {name}: {r:?}"
            );
        }
        // Its worker is gone: the lease expires.
        coll.update_one(
            doc! { "_id": job.id() },
            doc! { "$set": { "lease.until": mongodb::bson::DateTime::from_millis(0) } },
        )
        .await?;
        ids.push(job.id());
    }
    // A well-formed expired job still gets the plain reason and is retried.
    q.enqueue(doc! { "case": "plain" }, &EnqueueOptions::default())
        .await?;
    let plain = q
        .claim("w")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no job"))?;
    coll.update_one(
        doc! { "_id": plain.id() },
        doc! { "$set": { "lease.until": mongodb::bson::DateTime::from_millis(0) } },
    )
    .await?;
    assert_eq!(q.reap_expired().await?, 7);
    let mut hidden = Vec::new();
    for ((name, _, field), id) in edits.iter().zip(&ids) {
        let d = coll
            .find_one(doc! { "_id": *id })
            .await?
            .ok_or_else(|| anyhow::anyhow!("gone"))?;
        let reason = d.get_str("last_error").unwrap_or_default();
        if d.get_str("state")? != "dead"
            || !reason.starts_with("malformed job document: ")
            || !reason.contains(field)
            || d.get_datetime("finished_at").is_err()
        {
            hidden.push(format!(
                "{name}: {} with {reason:?}",
                d.get_str("state").unwrap_or_default()
            ));
        }
    }
    assert_eq!(
        hidden,
        Vec::<String>::new(),
        "swept jobs whose last_error hides the malformed field"
    );
    let d = coll
        .find_one(doc! { "_id": plain.id() })
        .await?
        .ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(
        (d.get_str("state")?, d.get_str("last_error")?),
        ("retrying", "lease expired before the job finished")
    );
    Ok(())
}
