//! Queue limits against the real server, 8 workers with handles of their own: never more
//! than N running jobs per concurrency key, never more than N starts per interval per rate
//! key (each with a control that bites), the queue's own limit, and fairness: a tenant's
//! single job is not starved by another tenant's backlog (the wait is measured).

use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{EnqueueOptions, JobQueue, LimitOptions, QueueOptions};
use docwarden_testkit::TestDb;
use docwarden_workloads::Mode;
use docwarden_workloads::queue_limits::{self, LimitRun};
use mongodb::bson::doc;

fn time(t: &TestDb) -> anyhow::Result<TimeSource> {
    Ok(TimeSource::server(
        t.client.clone(),
        ClockOptions::default(),
    )?)
}

async fn concurrency(test: &str, mode: Mode) -> anyhow::Result<queue_limits::LimitReport> {
    let t = TestDb::new(test).await?;
    let run = LimitRun {
        mode,
        ..LimitRun::default()
    };
    let r = queue_limits::run_concurrency(&t.db, "jobs", time(&t)?, run).await?;
    eprintln!(
        "concurrency {mode:?}: {} jobs in {} ms, at most {} running per key (limit {}), {} violations",
        r.completed, r.elapsed_ms, r.max_seen, run.limit, r.violations
    );
    Ok(r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn never_more_than_n_running_per_key() -> anyhow::Result<()> {
    let r = concurrency("limits_concurrency", Mode::Safe).await?;
    assert_eq!(r.completed, 90);
    assert_eq!(r.violations, 0, "more than N jobs of one key ran at once");
    assert_eq!(r.max_seen, 2, "the workers fill the limit");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_without_permits_runs_too_many() -> anyhow::Result<()> {
    let r = concurrency("limits_concurrency_control", Mode::Control).await?;
    assert!(r.violations > 0, "the control must bite: {r:?}");
    Ok(())
}

async fn rate(test: &str, mode: Mode) -> anyhow::Result<queue_limits::LimitReport> {
    let t = TestDb::new(test).await?;
    let run = LimitRun {
        keys: 2,
        jobs_per_key: 12,
        limit: 3,
        interval: Duration::from_millis(400),
        mode,
        ..LimitRun::default()
    };
    let r = queue_limits::run_rate(&t.db, "jobs", time(&t)?, run).await?;
    eprintln!(
        "rate {mode:?}: {} jobs in {} ms, at most {} starts per {} ms window of one key (limit {}), {} violations",
        r.completed,
        r.elapsed_ms,
        r.max_seen,
        400 - queue_limits::RATE_SLACK_MS,
        run.limit,
        r.violations
    );
    Ok(r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn never_more_than_n_starts_per_interval() -> anyhow::Result<()> {
    let r = rate("limits_rate", Mode::Safe).await?;
    assert_eq!(r.completed, 24);
    assert_eq!(r.violations, 0);
    // 12 jobs at 3 per 400 ms take at least three intervals per key.
    assert!(r.elapsed_ms >= 1_200, "{r:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_without_the_rate_check_starts_too_many() -> anyhow::Result<()> {
    let r = rate("limits_rate_control", Mode::Control).await?;
    assert!(r.violations > 0, "the control must bite: {r:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_queue_limit_and_run_time_changes_are_stored() -> anyhow::Result<()> {
    let t = TestDb::new("limits_queue_level").await?;
    let q = JobQueue::open(
        &t.db,
        "jobs",
        time(&t)?,
        QueueOptions::default().limits(LimitOptions::default().queue_concurrency(2)),
    )
    .await?;
    let plain = JobQueue::open(&t.db, "jobs", time(&t)?, QueueOptions::default()).await?;
    for i in 0..5 {
        q.enqueue(
            doc! { "i": i },
            &EnqueueOptions::default().concurrency_key("a"),
        )
        .await?;
    }
    assert!(
        plain.claim_batch("plain", 10).await?.is_empty(),
        "a handle without limits never claims a limited job"
    );
    // Key limit 1 (the default), queue limit 2: one job of key a.
    let first = q.claim_limited("w1", 10).await?;
    assert_eq!(first.len(), 1);
    q.set_concurrency_limit("a", 5).await?;
    let second = q.claim_limited("w2", 10).await?;
    assert_eq!(second.len(), 1, "the queue limit (2) holds");
    let sems = q.concurrency_limits().await?;
    assert_eq!(sems.iter().map(|s| s.live()).sum::<usize>(), 4, "{sems:?}");
    q.complete(&first[0], mongodb::bson::Bson::Null).await?;
    q.release_permits(&first[0]).await;
    assert_eq!(q.claim_limited("w3", 10).await?.len(), 1);
    Ok(())
}

async fn fairness(
    test: &str,
    backlog: usize,
    fair: bool,
) -> anyhow::Result<queue_limits::FairnessReport> {
    let t = TestDb::new(test).await?;
    let r = queue_limits::run_fairness(&t.db, "jobs", time(&t)?, backlog, 8, fair).await?;
    eprintln!(
        "fairness (fair = {fair}): backlog {}, the small tenant's job waited {} ms, {} big jobs ran before it",
        r.backlog, r.small_wait_ms, r.big_before
    );
    Ok(r)
}

/// The size: one tenant's 100,000-job backlog, another tenant's single job. With
/// fairness keys it runs within about one partition rotation. The comparison without them
/// (random partitions; measured once at 100,000: 101 s, behind 99,893 jobs) runs with a
/// 10,000-job backlog to keep the test short.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backlog_does_not_starve_another_tenant() -> anyhow::Result<()> {
    let fair = fairness("limits_fairness", 100_000, true).await?;
    let random = fairness("limits_fairness_random", 10_000, false).await?;
    assert!(
        fair.big_before < 2_000,
        "the small tenant waited behind {} of 100,000 jobs",
        fair.big_before
    );
    assert!(
        fair.big_before < random.big_before,
        "fair {fair:?}, random {random:?}"
    );
    Ok(())
}

/// Session 15: the semaphore resource of a concurrency key is `key:<key>`, and of a named
/// queue's own limit `queue:<name>`; both were validated as names of up to
/// `MAX_NAME_LEN` bytes *before* the prefix. A job with a 509–512-byte concurrency key was
/// enqueued, and then every limited claim failed on it (the permit's resource was too
/// long): the job headed the queue, so nothing behind it ran either. The key (and a
/// limited named queue's name) now leave room for the prefix, and are refused with
/// `InvalidInput` when they do not.
#[tokio::test]
async fn a_concurrency_key_leaves_room_for_its_semaphore_prefix() -> anyhow::Result<()> {
    let t = TestDb::new("limits_long_key").await?;
    let q = JobQueue::open(
        &t.db,
        "jobs",
        time(&t)?,
        QueueOptions::default().limits(LimitOptions::default().key_concurrency(1)),
    )
    .await?;
    let max = docwarden::validate::MAX_NAME_LEN;
    let longest = "k".repeat(max - "key:".len());
    q.enqueue(
        doc! { "n": 1 },
        &EnqueueOptions::default().concurrency_key(longest.as_str()),
    )
    .await?;
    let claimed = q.claim_limited("w", 4).await?;
    assert_eq!(claimed.len(), 1, "the longest key accepted can be claimed");
    let too_long = "k".repeat(max);
    let enqueued = q
        .enqueue(
            doc! { "n": 2 },
            &EnqueueOptions::default().concurrency_key(too_long.as_str()),
        )
        .await;
    assert!(
        matches!(
            enqueued,
            Err(docwarden::Error::InvalidInput {
                what: "concurrency key",
                ..
            })
        ),
        "{enqueued:?}"
    );
    let set = q.set_concurrency_limit(&too_long, 2).await;
    assert!(
        matches!(set, Err(docwarden::Error::InvalidInput { .. })),
        "{set:?}"
    );
    q.enqueue(
        doc! { "n": 3 },
        &EnqueueOptions::default().concurrency_key("ok"),
    )
    .await?;
    let next = q.claim_limited("w", 4).await;
    assert!(
        matches!(&next, Ok(v) if v.len() == 1),
        "a job behind a refused one is claimed: {next:?}"
    );
    // A limited named queue's own resource is `queue:<name>`.
    let named = JobQueue::open(
        &t.db,
        "jobs",
        time(&t)?,
        QueueOptions::default()
            .queue("q".repeat(max))
            .limits(LimitOptions::default().queue_concurrency(1)),
    )
    .await;
    assert!(
        matches!(named, Err(docwarden::Error::InvalidInput { .. })),
        "{:?}",
        named.map(|_| ())
    );
    Ok(())
}

/// A caller that drives limited jobs itself ([`JobQueue::claim_limited`], then
/// [`JobQueue::heartbeat`] while the job runs) kept the job's lease but not its permit:
/// nothing renewed the permit (ttl 1.5 × the lease's), so once it expired a second job of
/// the key was claimed while the first one still held a valid lease — two running with
/// N = 1. The heartbeats renew the job's permits first (`docs/queue.md`, the protocol's
/// step 3). Counts: claims of the key's second job while the first is held (0).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_heartbeated_limited_job_keeps_its_permit() -> anyhow::Result<()> {
    let t = TestDb::new("limits_heartbeat_keeps_permit").await?;
    let opts = QueueOptions::default()
        .lease_ttl(Duration::from_millis(600))
        .limits(LimitOptions::default().key_concurrency(1));
    let q = JobQueue::open(&t.db, "jobs", time(&t)?, opts).await?;
    let one = EnqueueOptions::default().concurrency_key("k");
    q.enqueue(doc! { "n": 1 }, &one).await?;
    q.enqueue(doc! { "n": 2 }, &one).await?;
    let first = q.claim_limited("a", 1).await?;
    anyhow::ensure!(first.len() == 1, "claimed {} jobs", first.len());
    let mut violations = 0;
    let mut beats = 0;
    // Five lease TTLs (three permit TTLs), a heartbeat every third of the lease.
    for _ in 0..15 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        q.heartbeat(&first[0]).await?;
        beats += 1;
        let second = q.claim_limited("b", 1).await?;
        violations += second.len();
        for j in &second {
            q.release(j).await?;
            q.release_permits(j).await;
        }
        let many = q.heartbeat_many(&first).await?;
        anyhow::ensure!(many == [true], "heartbeat_many: {many:?}");
    }
    assert_eq!(
        violations, 0,
        "the key's second job was claimed {violations} times while the first held its lease ({beats} heartbeats)"
    );
    q.complete(&first[0], mongodb::bson::Bson::Null).await?;
    q.release_permits(&first[0]).await;
    let second = q.claim_limited("b", 1).await?;
    assert_eq!(second.len(), 1, "the permit came back after the completion");
    Ok(())
}

/// The permits a handle holds were filed by job id alone. When the handle claimed a job
/// again (released, retried or snoozed, then claimed by its other claim loop) before the
/// first claim's permits were released, the second claim's permits replaced the first's;
/// the release for the first claim then gave back the *second* claim's permits while it
/// ran, and the first claim's permit expired later: once it did, the key had one job more
/// running than N. Counts: jobs of the key running at once with N = 2 (at most 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_claimed_again_by_the_same_handle_keeps_its_new_permits() -> anyhow::Result<()> {
    let t = TestDb::new("limits_reclaimed_same_handle").await?;
    let opts = QueueOptions::default()
        .lease_ttl(Duration::from_millis(600))
        .limits(LimitOptions::default().key_concurrency(2));
    let q = JobQueue::open(&t.db, "jobs", time(&t)?, opts).await?;
    let key = EnqueueOptions::default().concurrency_key("k");
    q.enqueue(doc! { "n": 1 }, &key).await?;
    let first = q.claim_limited("w", 1).await?;
    anyhow::ensure!(first.len() == 1, "claimed {}", first.len());
    // Given back, and claimed again by the same handle before the first claim's permits
    // are released (the worker releases them after the transition's bulk came back).
    q.release(&first[0]).await?;
    let again = q.claim_limited("w", 1).await?;
    anyhow::ensure!(again.len() == 1, "claimed again {}", again.len());
    q.release_permits(&first[0]).await;
    // Two more jobs of the key; the job claimed again runs on, heartbeated.
    q.enqueue(doc! { "n": 2 }, &key).await?;
    q.enqueue(doc! { "n": 3 }, &key).await?;
    let mut running = vec![again[0].clone()];
    let mut most = 0;
    for _ in 0..12 {
        for j in &running {
            q.heartbeat(j).await?;
        }
        running.extend(q.claim_limited("w", 1).await?);
        most = most.max(running.len());
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert!(most <= 2, "{most} jobs of a key limited to 2 ran at once");
    Ok(())
}
