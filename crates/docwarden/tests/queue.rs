//! The queue's claims, transitions, indexes and input checks against the real server.

use std::time::Duration;

use docwarden::Error;
use docwarden::clock::{ClockOptions, LocalClock, TimeSource};
use docwarden::queue::{
    CancelOutcome, ClaimStrategy, EnqueueOptions, Enqueued, FailOutcome, JobQueue, JobState,
    QueueOptions,
};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, Document, doc};

async fn open(t: &TestDb, opts: QueueOptions) -> anyhow::Result<JobQueue> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    Ok(JobQueue::open(&t.db, "jobs", time, opts).await?)
}

#[tokio::test]
async fn claims_follow_priority_then_run_at_and_skip_delayed_jobs() -> anyhow::Result<()> {
    let t = TestDb::new("queue_priority").await?;
    for strategy in [
        ClaimStrategy::FindOneAndUpdate,
        ClaimStrategy::UpdateThenFetch,
    ] {
        t.db.collection::<Document>("jobs").drop().await?;
        let q = open(&t, QueueOptions::default().claim_strategy(strategy)).await?;
        let e = EnqueueOptions::default();
        q.enqueue(doc! { "n": 0 }, &e).await?;
        q.enqueue(doc! { "n": 5 }, &e.clone().priority(5)).await?;
        q.enqueue(doc! { "n": 1 }, &e.clone().priority(1)).await?;
        q.enqueue(
            doc! { "n": 100 },
            &e.clone().priority(100).delay(Duration::from_secs(3600)),
        )
        .await?;
        let mut order = Vec::new();
        while let Some(job) = q.claim("w").await? {
            assert_eq!(job.job.state, JobState::Running);
            assert_eq!(job.job.attempts, 1);
            assert_eq!(job.lease.token.len(), 32, "128-bit token");
            order.push(
                job.payload()
                    .as_document()
                    .and_then(|d| d.get_i32("n").ok()),
            );
            q.complete(&job, Bson::Null).await?;
        }
        assert_eq!(order, vec![Some(5), Some(1), Some(0)], "{strategy:?}");
        let stats = q.stats().await?;
        assert_eq!(stats.by_state.get("succeeded"), Some(&3));
        assert_eq!(stats.by_state.get("ready"), Some(&1));
    }
    Ok(())
}

#[tokio::test]
async fn every_transition_is_fenced_by_the_claim_token() -> anyhow::Result<()> {
    let t = TestDb::new("queue_fenced").await?;
    let q = open(
        &t,
        QueueOptions::default()
            .lease_ttl(Duration::from_secs(1))
            .reap_interval(Duration::from_millis(10)),
    )
    .await?;
    let id = q
        .enqueue(doc! { "x": 1 }, &EnqueueOptions::default())
        .await?
        .created();
    let old = q
        .claim("slow")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no job"))?;
    assert_eq!(Some(old.id()), id);
    // The holder pauses past its lease; another worker sweeps and takes the job.
    tokio::time::sleep(Duration::from_millis(1_800)).await;
    let new = q
        .claim("fast")
        .await?
        .ok_or_else(|| anyhow::anyhow!("not re-claimable"))?;
    assert_eq!(new.id(), old.id());
    assert_eq!(new.job.attempts, 2);
    assert_eq!(new.job.state, JobState::Running);
    // Every write of the old holder is refused and changes nothing.
    assert!(matches!(
        q.heartbeat(&old).await,
        Err(Error::LeaseLost { .. })
    ));
    assert!(matches!(
        q.complete(&old, "late").await,
        Err(Error::LeaseLost { .. })
    ));
    assert!(matches!(
        q.fail(&old, "late").await,
        Err(Error::LeaseLost { .. })
    ));
    assert!(matches!(
        q.release(&old).await,
        Err(Error::LeaseLost { .. })
    ));
    assert!(matches!(
        q.cancel_claimed(&old, "late").await,
        Err(Error::LeaseLost { .. })
    ));
    q.heartbeat(&new).await?;
    q.complete(&new, "done").await?;
    let job = q
        .get(new.id())
        .await?
        .ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!(job.result, Some(Bson::String("done".into())));
    // Control: the same late write without the fence overwrites the finished job.
    let coll = t.db.collection::<Document>("jobs");
    let unfenced = coll
        .update_one(
            doc! { "_id": old.id() },
            doc! { "$set": { "result": "late" } },
        )
        .await?;
    assert_eq!(
        unfenced.modified_count, 1,
        "control: an unfenced late write applies"
    );
    Ok(())
}

#[tokio::test]
async fn fail_retries_with_growing_delays_then_dead_and_ops_work() -> anyhow::Result<()> {
    let t = TestDb::new("queue_fail_ops").await?;
    let q = open(
        &t,
        QueueOptions::default().retry_delays(Duration::from_millis(100), Duration::from_secs(60)),
    )
    .await?;
    let id = q
        .enqueue(doc! {}, &EnqueueOptions::default().max_attempts(3))
        .await?
        .created()
        .ok_or_else(|| anyhow::anyhow!("not created"))?;
    let mut delays = Vec::new();
    loop {
        let Some(job) = q.claim("w").await? else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        match q.fail(&job, &format!("boom {}", job.job.attempts)).await? {
            FailOutcome::Retrying { delay, .. } => delays.push(delay),
            FailOutcome::Dead => break,
            other => anyhow::bail!("unexpected {other:?}"),
        }
    }
    assert_eq!(delays.len(), 2);
    assert!(delays[0] >= Duration::from_millis(50) && delays[0] <= Duration::from_millis(100));
    assert!(delays[1] >= Duration::from_millis(100) && delays[1] <= Duration::from_millis(200));
    let job = q.get(id).await?.ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(job.state, JobState::Dead);
    assert_eq!(job.attempts, 3);
    assert_eq!(job.last_error.as_deref(), Some("boom 3"));
    // retry dead → ready with attempts reset; cancel; purge.
    assert_eq!(q.retry_dead(None).await?, 1);
    let job = q.get(id).await?.ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!((job.state, job.attempts), (JobState::Ready, 0));
    assert_eq!(
        q.cancel(id).await?,
        CancelOutcome::Cancelled {
            was: JobState::Ready
        }
    );
    assert_eq!(
        q.cancel(id).await?,
        CancelOutcome::AlreadyFinished(JobState::Cancelled)
    );
    assert_eq!(q.purge(Duration::from_secs(3600)).await?, 0);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(q.purge(Duration::from_millis(1)).await?, 1);
    assert!(q.list(&Default::default()).await?.is_empty());
    Ok(())
}

#[tokio::test]
async fn the_claim_query_uses_the_partial_index() -> anyhow::Result<()> {
    let t = TestDb::new("queue_explain").await?;
    let q = open(&t, QueueOptions::default()).await?;
    let jobs = (0..300).map(|i| (doc! { "i": i }, EnqueueOptions::default().priority(i % 7)));
    q.enqueue_many(jobs).await?;
    for _ in 0..100 {
        if let Some(j) = q.claim("w").await? {
            q.complete(&j, Bson::Null).await?;
        }
    }
    let (find, fam) = q.explain_claim().await?;
    for (what, plan) in [("find", &find), ("findAndModify", &fam)] {
        let winning = plan
            .get_document("queryPlanner")
            .and_then(|p| p.get_document("winningPlan"))
            .map(|w| format!("{w:?}"))
            .unwrap_or_else(|_| format!("{plan:?}"));
        assert!(winning.contains("IXSCAN"), "{what}: no IXSCAN in {winning}");
        assert!(
            winning.contains("docwarden_claim"),
            "{what}: not the claim index: {winning}"
        );
        assert!(
            !winning.contains("COLLSCAN"),
            "{what}: collection scan: {winning}"
        );
        assert!(
            !winning.contains("\"SORT\""),
            "{what}: blocking sort: {winning}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_dedupe_key_allows_one_unfinished_job_even_under_races() -> anyhow::Result<()> {
    let t = TestDb::new("queue_dedupe").await?;
    let q = open(&t, QueueOptions::default()).await?;
    let first = q
        .enqueue(doc! {}, &EnqueueOptions::default().dedupe_key("a"))
        .await?;
    let second = q
        .enqueue(doc! {}, &EnqueueOptions::default().dedupe_key("a"))
        .await?;
    assert_eq!(
        second,
        Enqueued::Duplicate {
            key: "a".into(),
            existing: first.created()
        }
    );
    // 16 racing enqueues of one key store one job.
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let q = q.clone();
        tasks.push(tokio::spawn(async move {
            q.enqueue(doc! {}, &EnqueueOptions::default().dedupe_key("b"))
                .await
        }));
    }
    let mut created = 0;
    for task in tasks {
        if task.await??.created().is_some() {
            created += 1;
        }
    }
    assert_eq!(created, 1);
    // The batch reports duplicates per item.
    let out = q
        .enqueue_many([
            (doc! {}, EnqueueOptions::default().dedupe_key("d")),
            (doc! {}, EnqueueOptions::default().dedupe_key("d")),
            (doc! {}, EnqueueOptions::default()),
        ])
        .await?;
    // One of the two "d" jobs is stored (an unordered insert may store either).
    assert_eq!(
        out[..2].iter().filter(|o| o.created().is_some()).count(),
        1,
        "{out:?}"
    );
    assert_eq!(
        out[..2]
            .iter()
            .filter(|o| matches!(o, Enqueued::Duplicate { .. }))
            .count(),
        1
    );
    assert!(out[2].created().is_some());
    // A finished job frees its key (MongoDB drops the entry of a document that leaves
    // a partial index's filter; secantusd-rs keeps it, see docs/queue.md).
    while let Some(j) = q.claim("w").await? {
        q.complete(&j, Bson::Null).await?;
    }
    if docwarden::capabilities::probe_partial_index_updates(&t.client)
        .await?
        .is_supported()
    {
        let again = q
            .enqueue(doc! {}, &EnqueueOptions::default().dedupe_key("a"))
            .await?;
        assert!(again.created().is_some(), "{again:?}");
    } else {
        eprintln!("surrogate: a unique partial index keeps entries of updated-out documents");
    }
    // Control: read-then-insert without the unique index lets racers duplicate a key.
    let plain = t.db.collection::<Document>("plain");
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let plain = plain.clone();
        tasks.push(tokio::spawn(async move {
            if plain.find_one(doc! { "key": "c" }).await?.is_none() {
                tokio::time::sleep(Duration::from_millis(5)).await;
                plain.insert_one(doc! { "key": "c" }).await?;
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    assert!(
        plain.count_documents(doc! { "key": "c" }).await? > 1,
        "control shows duplicates"
    );
    Ok(())
}

#[tokio::test]
async fn a_payload_over_16_mib_is_refused_and_nothing_is_enqueued() -> anyhow::Result<()> {
    let t = TestDb::new("queue_too_big").await?;
    let q = open(&t, QueueOptions::default()).await?;
    let big = Bson::Binary(mongodb::bson::Binary {
        subtype: mongodb::bson::spec::BinarySubtype::Generic,
        bytes: vec![0_u8; 17 * 1024 * 1024],
    });
    match q.enqueue(big.clone(), &EnqueueOptions::default()).await {
        Err(Error::InvalidInput {
            what: "payload",
            reason,
        }) => {
            assert!(
                reason.contains("bytes") || reason.contains("size"),
                "{reason}"
            )
        }
        other => anyhow::bail!("expected InvalidInput, got {other:?}"),
    }
    let batch = q
        .enqueue_many([
            (Bson::Int32(1), EnqueueOptions::default()),
            (big, EnqueueOptions::default()),
        ])
        .await;
    assert!(matches!(batch, Err(Error::InvalidInput { .. })));
    assert_eq!(
        t.db.collection::<Document>("jobs")
            .count_documents(doc! {})
            .await?,
        0
    );
    Ok(())
}

#[tokio::test]
async fn a_worker_whose_clock_is_30s_ahead_cannot_steal_a_live_lease() -> anyhow::Result<()> {
    let t = TestDb::new("queue_clock_ahead").await?;
    let opts = QueueOptions::default()
        .lease_ttl(Duration::from_secs(10))
        .reap_interval(Duration::from_millis(1));
    let holder = open(&t, opts.clone()).await?;
    holder.enqueue(doc! {}, &EnqueueOptions::default()).await?;
    let held = holder
        .claim("holder")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no job"))?;
    let coll = t.db.collection::<Document>("jobs");
    // Server-time estimate from a clock 30 s ahead: no steal.
    let ahead = TimeSource::server_with_local(
        t.client.clone(),
        LocalClock::with_offset_ms(30_000),
        ClockOptions::default(),
    )?;
    let skewed = JobQueue::new(coll.clone(), ahead, opts.clone())?;
    let mut stolen = 0;
    for _ in 0..5 {
        if skewed.claim("skewed").await?.is_some() {
            stolen += 1;
        }
    }
    assert_eq!(skewed.reap_expired().await?, 0);
    assert_eq!(stolen, 0, "a skewed worker stole a live lease");
    holder.heartbeat(&held).await?;
    // Control: trusting the same skewed client clock steals the live lease.
    let trusting =
        TimeSource::local_unchecked(LocalClock::with_offset_ms(30_000), ClockOptions::default())?;
    let control = JobQueue::new(coll, trusting, opts)?;
    let thief = control.claim("control").await?;
    assert!(thief.is_some(), "control: the unchecked clock should steal");
    // Fencing still refuses the robbed holder's completion.
    assert!(matches!(
        holder.complete(&held, Bson::Null).await,
        Err(Error::LeaseLost { .. })
    ));
    Ok(())
}

#[tokio::test]
async fn batch_claims_never_share_a_job() -> anyhow::Result<()> {
    let t = TestDb::new("queue_batch").await?;
    let q = open(&t, QueueOptions::default()).await?;
    q.enqueue_many((0..400).map(|i| (doc! { "i": i }, EnqueueOptions::default())))
        .await?;
    let mut tasks = Vec::new();
    for w in 0..8 {
        let q = q.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let batch = q.claim_batch(&format!("w{w}"), 10).await?;
                if batch.is_empty() {
                    break;
                }
                for j in batch {
                    q.complete(&j, Bson::Null).await?;
                    mine.push(j.id());
                }
            }
            anyhow::Ok(mine)
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await??);
    }
    let n = all.len();
    all.sort();
    all.dedup();
    assert_eq!(n, 400, "every job claimed");
    assert_eq!(all.len(), 400, "no job claimed twice");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_worker_wakes_on_a_new_job_through_the_change_stream() -> anyhow::Result<()> {
    use docwarden::queue::{Worker, WorkerOptions};
    let t = TestDb::new("queue_wakeup").await?;
    let q = open(&t, QueueOptions::default()).await?;
    let coll = t.db.collection::<Document>("jobs");
    // Polling alone would wait at least 5 s; only the change stream can be faster.
    for change_stream in [true, false] {
        let w = Worker::spawn(
            q.clone(),
            WorkerOptions::default()
                .change_stream(change_stream)
                .poll(Duration::from_secs(5), Duration::from_secs(30)),
            |_job| async { Ok(Bson::Null) },
        )?;
        tokio::time::sleep(Duration::from_millis(1_000)).await; // idle: first poll found nothing
        let id = q
            .enqueue(doc! {}, &EnqueueOptions::default())
            .await?
            .created();
        let started = std::time::Instant::now();
        let mut done = false;
        while started.elapsed() < Duration::from_secs(2) {
            if coll
                .count_documents(doc! { "_id": id, "state": "succeeded" })
                .await?
                == 1
            {
                done = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        w.shutdown().await;
        if change_stream {
            assert!(done, "the change stream did not wake the worker within 2 s");
        } else {
            // Control: without the change stream the job waits for the next poll.
            assert!(!done, "control: polling alone should not be this fast");
        }
    }
    Ok(())
}
