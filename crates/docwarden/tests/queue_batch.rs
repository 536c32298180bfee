//! Batch claims over partitions, bulk completions and heartbeats with per-job outcomes,
//! and jobs stored before partitions existed, against the real server.

use std::time::Duration;

use docwarden::Error;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{EnqueueOptions, JobQueue, JobState, MAX_RESULT_BYTES, QueueOptions};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, Document, doc};

async fn open(t: &TestDb, name: &str, opts: QueueOptions) -> anyhow::Result<JobQueue> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    Ok(JobQueue::open(&t.db, name, time, opts).await?)
}

/// One bulk completes a batch; a job whose lease was lost in between (an operator
/// cancelled it) gets `LeaseLost` and stays cancelled, the others succeed. Control: the
/// same completion by `_id` alone (no fence) overwrites the cancelled job.
#[tokio::test]
async fn a_bulk_of_completions_reports_each_jobs_own_outcome() -> anyhow::Result<()> {
    let t = TestDb::new("queue_bulk_outcomes").await?;
    let q = open(&t, "jobs", QueueOptions::default().partitions(1)).await?;
    q.enqueue_many((0..5).map(|i| (doc! { "i": i }, EnqueueOptions::default())))
        .await?;
    let batch = q.claim_batch("w", 5).await?;
    assert_eq!(batch.len(), 5);
    let lost = batch[2].id();
    q.cancel(lost).await?;
    let beats = q.heartbeat_many(&batch).await?;
    assert_eq!(beats, vec![true, true, false, true, true]);
    let outcomes = q
        .complete_many(
            &batch
                .iter()
                .map(|j| (j.clone(), Bson::String("done".into())))
                .collect::<Vec<_>>(),
        )
        .await?;
    for (j, o) in batch.iter().zip(&outcomes) {
        if j.id() == lost {
            assert!(matches!(o, Err(Error::LeaseLost { .. })), "{o:?}");
        } else {
            assert!(o.is_ok(), "{o:?}");
        }
    }
    let coll = t.db.collection::<Document>("jobs");
    assert_eq!(
        coll.count_documents(doc! { "state": "succeeded" }).await?,
        4
    );
    let cancelled = q.get(lost).await?.ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(cancelled.state, JobState::Cancelled);
    assert_eq!(cancelled.result, None, "nothing written for the lost job");
    // Retried (the first reply "lost"): the read-back recognises what applied.
    let again = q
        .complete_many(
            &batch
                .iter()
                .map(|j| (j.clone(), Bson::String("done".into())))
                .collect::<Vec<_>>(),
        )
        .await?;
    assert_eq!(
        again.iter().filter(|o| o.is_ok()).count(),
        4,
        "a retried bulk reports the completions that applied: {again:?}"
    );
    // Control: without the fence, the late completion lands on the cancelled job.
    let r = coll
        .update_many(
            doc! { "_id": { "$in": batch.iter().map(|j| j.id()).collect::<Vec<_>>() } },
            doc! { "$set": { "state": "succeeded" } },
        )
        .await?;
    assert_eq!(r.modified_count, 1, "control: the unfenced bulk overwrites");
    Ok(())
}

/// Session 25: the jobs of one claim that get the same update share one statement, and
/// "the same" is byte for byte. Results that compare equal in Rust or as text but differ
/// in type or field order (`1` and `1.0`, `{a, b}` and `{b, a}`) are each stored as given,
/// and equal results share their statement.
#[tokio::test]
async fn a_bulk_stores_each_result_byte_for_byte() -> anyhow::Result<()> {
    let t = TestDb::new("queue_bulk_results_exact").await?;
    let q = open(&t, "jobs", QueueOptions::default().partitions(1)).await?;
    q.enqueue_many((0..6).map(|i| (doc! { "i": i }, EnqueueOptions::default())))
        .await?;
    let batch = q.claim_batch("w", 6).await?;
    assert_eq!(batch.len(), 6);
    let results = [
        Bson::Int32(1),
        Bson::Double(1.0),
        Bson::Document(doc! { "a": 1, "b": 2 }),
        Bson::Document(doc! { "b": 2, "a": 1 }),
        Bson::Int32(1),
        Bson::Null,
    ];
    let items: Vec<_> = batch.iter().cloned().zip(results.iter().cloned()).collect();
    let outcomes = q.complete_many(&items).await?;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    let coll = t.db.collection::<Document>("jobs");
    for (job, want) in batch.iter().zip(&results) {
        let d = coll
            .find_one(doc! { "_id": job.id() })
            .await?
            .ok_or_else(|| anyhow::anyhow!("gone"))?;
        let got = d.get("result").cloned().unwrap_or(Bson::Null);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        doc! { "v": got.clone() }.to_writer(&mut a)?;
        doc! { "v": want.clone() }.to_writer(&mut b)?;
        assert_eq!(a, b, "stored {got:?}, completed with {want:?}");
    }
    Ok(())
}

/// Session 25: a queue served by batch claims has no single-claim index (each index costs
/// every write of a job), and the first single claim of a handle creates it, so the
/// single claim still reads the head of the queue in claim order from its own index.
#[tokio::test]
async fn the_single_claim_index_is_created_by_the_first_single_claim() -> anyhow::Result<()> {
    use docwarden::queue::index;
    let t = TestDb::new("queue_single_claim_index").await?;
    let q = open(&t, "jobs", QueueOptions::default().partitions(1)).await?;
    q.enqueue_many((0..6).map(|i| (doc! { "i": i }, EnqueueOptions::default().priority(i))))
        .await?;
    let names = || async { t.db.collection::<Document>("jobs").list_index_names().await };
    let batch = q.claim_batch("w", 2).await?;
    assert_eq!(batch.len(), 2);
    assert!(
        !names().await?.iter().any(|n| n == index::CLAIM),
        "opened and batch-claimed: no single-claim index"
    );
    assert!(names().await?.iter().any(|n| n == index::CLAIM_PARTITION));
    // Another handle on the same collection: its first single claim creates the index and
    // takes the highest priority job left.
    let other = open(&t, "jobs", QueueOptions::default().partitions(1)).await?;
    let head = other
        .claim("w")
        .await?
        .ok_or_else(|| anyhow::anyhow!("nothing claimed"))?;
    let taken: Vec<i64> = batch.iter().map(|j| j.job.priority).collect();
    let best_left = (0..6).rev().find(|p| !taken.contains(p));
    assert_eq!(Some(head.job.priority), best_left);
    assert!(names().await?.iter().any(|n| n == index::CLAIM));
    // The first handle's single claim finds it in place (creating it again is a no-op).
    assert!(q.claim("w").await?.is_some());
    Ok(())
}

/// Session 25: a batch claim answers "nothing due" only after reading every partition. Its
/// reads that found nothing used to count as rounds: eight of them read 255 of the
/// partitions from a cold handle, so a due job in the others was not claimed (1 in 256 runs
/// of `queue_s19_default_field` at the default 256 partitions). Here, at 1,024
/// partitions, each fresh handle missed its job with probability 3/4 without the fix (2
/// of the 5 in the run that checked it).
#[tokio::test]
async fn a_batch_claim_reads_every_partition_before_it_answers_nothing() -> anyhow::Result<()> {
    let t = TestDb::new("queue_batch_every_partition").await?;
    let opts = QueueOptions::default().partitions(1024);
    let mut missed = 0;
    for round in 0..5 {
        let q = open(&t, "jobs", opts.clone()).await?;
        q.enqueue(doc! { "round": round }, &EnqueueOptions::default())
            .await?;
        // A fresh handle: its span starts at one partition.
        let fresh = open(&t, "jobs", opts.clone()).await?;
        let got = fresh.claim_batch("w", 10).await?;
        if got.len() != 1 {
            missed += 1;
        }
        fresh
            .complete_many(&got.into_iter().map(|j| (j, Bson::Null)).collect::<Vec<_>>())
            .await?;
    }
    assert_eq!(
        missed, 0,
        "fresh handles that did not claim the one due job"
    );
    Ok(())
}

/// A job stored before partitions existed (format 1, no `partition` field) is still
/// claimed by batch claims and by the worker's claims.
/// Session 15: `complete` refuses a result over `MAX_RESULT_BYTES`, but `complete_many`
/// sent any result: 2 MiB was stored (over the documented limit), and one result over
/// 16 MiB failed the whole bulk, so the other jobs' completions were not written either.
/// Each oversized result is now that job's own `InvalidInput`, nothing written for it,
/// and the others complete.
#[tokio::test]
async fn an_oversized_result_in_a_bulk_is_that_jobs_own_error() -> anyhow::Result<()> {
    let t = TestDb::new("queue_bulk_oversized_result").await?;
    let q = open(&t, "jobs", QueueOptions::default().partitions(1)).await?;
    let blob = |n: usize| {
        Bson::Binary(mongodb::bson::Binary {
            subtype: mongodb::bson::spec::BinarySubtype::Generic,
            bytes: vec![7; n],
        })
    };
    for oversized in [MAX_RESULT_BYTES + 1, 17 * 1024 * 1024] {
        q.enqueue_many((0..3).map(|i| (doc! { "i": i }, EnqueueOptions::default())))
            .await?;
        let batch = q.claim_batch("w", 3).await?;
        assert_eq!(batch.len(), 3);
        let outcomes = q
            .complete_many(&[
                (batch[0].clone(), Bson::Null),
                (batch[1].clone(), blob(oversized)),
                (batch[2].clone(), Bson::Null),
            ])
            .await;
        let outcomes = match outcomes {
            Ok(o) => o,
            Err(e) => anyhow::bail!("{oversized} bytes failed the whole bulk: {e}"),
        };
        assert!(
            matches!(outcomes[1], Err(Error::InvalidInput { what: "result", .. })),
            "{oversized} bytes: {:?}",
            outcomes[1]
        );
        assert!(outcomes[0].is_ok() && outcomes[2].is_ok(), "{outcomes:?}");
        let states: Vec<JobState> = {
            let mut v = Vec::new();
            for j in &batch {
                v.push(
                    q.get(j.id())
                        .await?
                        .ok_or_else(|| anyhow::anyhow!("gone"))?
                        .state,
                );
            }
            v
        };
        assert_eq!(
            states,
            vec![JobState::Succeeded, JobState::Running, JobState::Succeeded],
            "{oversized} bytes"
        );
        q.fail(&batch[1], "done").await?;
    }
    Ok(())
}

#[tokio::test]
async fn jobs_without_a_partition_are_still_claimed() -> anyhow::Result<()> {
    let t = TestDb::new("queue_format1").await?;
    let q = open(&t, "jobs", QueueOptions::default()).await?;
    let id = q
        .enqueue(doc! { "old": true }, &EnqueueOptions::default())
        .await?
        .created()
        .ok_or_else(|| anyhow::anyhow!("not created"))?;
    let coll = t.db.collection::<Document>("jobs");
    coll.update_one(doc! { "_id": id }, doc! { "$unset": { "partition": "" } })
        .await?;
    let batch = q.claim_batch("w", 8).await?;
    assert_eq!(batch.iter().map(|j| j.id()).collect::<Vec<_>>(), vec![id]);
    Ok(())
}

/// Batch claims read a few partitions at a time and rotate, widening the partitions
/// they read while those hold fewer due jobs than asked: with 64 partitions of about 20
/// jobs, 8 concurrent claimers asking for 32 jobs each still get most of a batch per
/// claim. With one partition (everyone reads the head of the queue) the racing claimers
/// lose their candidates to one another and claim again (more round trips, see
/// `docs/benchmarks.md`). No job is ever claimed twice either way (the per-document
/// re-check).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitions_keep_concurrent_claimers_off_one_another() -> anyhow::Result<()> {
    let t = TestDb::new("queue_partitions").await?;
    let mut per_claim = Vec::new();
    for (name, partitions) in [("spread", 64), ("head", 1)] {
        let q = open(&t, name, QueueOptions::default().partitions(partitions)).await?;
        q.enqueue_many((0..1280).map(|i| (doc! { "i": i }, EnqueueOptions::default())))
            .await?;
        let mut tasks = Vec::new();
        for w in 0..8 {
            // One handle per claimer, as separate worker processes have.
            let q = open(&t, name, QueueOptions::default().partitions(partitions)).await?;
            tasks.push(tokio::spawn(async move {
                let mut got = Vec::new();
                for _ in 0..3 {
                    let batch = q.claim_batch(&format!("w{w}"), 32).await?;
                    got.push(batch.iter().map(|j| j.id()).collect::<Vec<_>>());
                }
                anyhow::Ok(got)
            }));
        }
        let mut all = Vec::new();
        let mut claims = 0_usize;
        for task in tasks {
            for batch in task.await?? {
                claims += 1;
                all.extend(batch);
            }
        }
        let total = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), total, "{name}: a job was claimed twice");
        #[allow(clippy::cast_precision_loss)]
        let mean = total as f64 / claims as f64;
        eprintln!(
            "{name} ({partitions} partitions): {total} jobs in {claims} claims, {mean:.1} per claim"
        );
        per_claim.push(mean);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        per_claim[0] >= 16.0,
        "spread claimers should get most of a batch per claim: {per_claim:?}"
    );
    Ok(())
}

/// Format 3: `open` creates no `docwarden_lease_token` index, and a batch claim reads its
/// jobs back by `_id` and token: two batches claimed one after the other each get only
/// their own jobs, every job once, all running under the batch's token.
#[tokio::test]
async fn format_3_claims_read_back_by_id_without_a_token_index() -> anyhow::Result<()> {
    let t = TestDb::new("queue_format_3").await?;
    let q = open(&t, "jobs", QueueOptions::default().partitions(1)).await?;
    let indexes = q.collection().list_index_names().await?;
    assert!(
        !indexes
            .iter()
            .any(|n| n == docwarden::queue::index::LEASE_TOKEN),
        "{indexes:?}"
    );
    assert!(
        indexes
            .iter()
            .any(|n| n == docwarden::queue::index::LEASE_EXPIRY)
    );
    assert_eq!(docwarden::queue::meta::FORMAT, 3);
    q.enqueue_many((0..10).map(|i| (doc! { "i": i }, EnqueueOptions::default())))
        .await?;
    let first = q.claim_batch("w1", 4).await?;
    let second = q.claim_batch("w2", 10).await?;
    assert_eq!((first.len(), second.len()), (4, 6));
    let mut ids: Vec<_> = first.iter().chain(&second).map(|j| j.id()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 10, "every job claimed once");
    for batch in [&first, &second] {
        let token = &batch[0].lease.token;
        assert!(
            batch
                .iter()
                .all(|j| &j.lease.token == token && j.job.state == JobState::Running)
        );
    }
    assert_ne!(first[0].lease.token, second[0].lease.token);
    Ok(())
}

/// The reads that decide an outcome — the read-back of a short heartbeat or settle bulk,
/// and the read of a batch claim's own jobs — followed the collection's read preference
/// and read concern. With `secondaryPreferred` (a common client-wide setting) or
/// `majority` reads, a read-back can return a snapshot from before the write that took
/// the lease away: the heartbeat then reports a job re-claimed by another worker as still
/// held (two handlers run it), and a batch claim can miss the jobs it just claimed (they
/// stay `running` unheld until their lease expires, an attempt burned). They must read
/// the primary's latest data, like the fenced write they follow. On a one-member replica
/// set there is no secondary to lag, so the test routes the collection to `secondary`
/// read preference: a read that follows it cannot be served at all. Counts: outcome
/// reads that failed (0).
#[tokio::test]
async fn outcome_reads_go_to_the_primary_whatever_the_read_preference() -> anyhow::Result<()> {
    use mongodb::options::{CollectionOptions, ReadConcern, ReadPreference, SelectionCriteria};
    let t = TestDb::new("queue_outcome_reads_primary").await?;
    let q = open(&t, "jobs", QueueOptions::default().partitions(1)).await?;
    q.enqueue_many((0..4).map(|i| (doc! { "i": i }, EnqueueOptions::default())))
        .await?;
    // The same queue through a collection that reads from secondaries, majority-committed.
    // As a replica-set client (the test server is a one-member set), so that the driver
    // routes by read preference at all (a direct connection ignores it).
    let hello = t
        .client
        .database("admin")
        .run_command(doc! { "hello": 1 })
        .await?;
    let Ok(set_name) = hello.get_str("setName") else {
        docwarden_testkit::skip(
            "outcome_reads_go_to_the_primary_whatever_the_read_preference",
            "the server is not a replica set member",
        );
        return Ok(());
    };
    let mut client_options = mongodb::options::ClientOptions::parse(t.uri()).await?;
    client_options.direct_connection = Some(false);
    client_options.repl_set_name = Some(set_name.to_owned());
    client_options.server_selection_timeout = Some(Duration::from_millis(500));
    let client = mongodb::Client::with_options(client_options)?;
    let coll: mongodb::Collection<Document> = client.database(t.db.name()).collection_with_options(
        "jobs",
        CollectionOptions::builder()
            .selection_criteria(SelectionCriteria::ReadPreference(
                ReadPreference::Secondary {
                    options: Default::default(),
                },
            ))
            .read_concern(ReadConcern::majority())
            .build(),
    );
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let secondary = JobQueue::new(coll.clone(), time, QueueOptions::default().partitions(1))?;
    let mut failed = Vec::new();
    let batch = q.claim_batch("w", 3).await?;
    anyhow::ensure!(batch.len() == 3, "claimed {}", batch.len());
    q.cancel(batch[1].id()).await?;
    match secondary.heartbeat_many(&batch).await {
        Ok(held) if held == [true, false, true] => {}
        other => failed.push(format!("heartbeat read-back: {other:?}")),
    }
    let items: Vec<_> = batch.iter().map(|j| (j.clone(), Bson::Null)).collect();
    match secondary.complete_many(&items).await {
        Ok(o) if o[0].is_ok() && o[1].is_err() && o[2].is_ok() => {}
        other => failed.push(format!("settle read-back: {other:?}")),
    }
    // An operator's cancel of a finished job reads it to say so (a stale read: `NotFound`).
    match secondary.cancel(batch[0].id()).await {
        Ok(docwarden::queue::CancelOutcome::AlreadyFinished(JobState::Succeeded)) => {}
        other => failed.push(format!("cancel outcome read: {other:?}")),
    }
    // A claim reads its own job back after the write that claimed it (the update-then-
    // fetch claim; a batch claim's read of its jobs is the same kind of read).
    let fetching = JobQueue::new(
        coll.clone(),
        secondary.time().clone(),
        QueueOptions::default()
            .partitions(1)
            .claim_strategy(docwarden::queue::ClaimStrategy::UpdateThenFetch),
    )?;
    match fetching.claim("w2").await {
        Ok(Some(_)) => {}
        other => failed.push(format!("claimed job read: {other:?}")),
    }
    assert!(
        failed.is_empty(),
        "{} outcome reads failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
    Ok(())
}

/// A bulk of completions is one `update` command, and a command is one BSON document
/// (16 MiB). Each result may be up to `MAX_RESULT_BYTES` (1 MiB), and the worker sends up
/// to 1024 transitions in one bulk: jobs with large results finishing together made a
/// command the server refuses as a whole, so none of them was completed (the worker gave
/// the bulk up; the jobs ran again after their leases expired, and again). MongoDB
/// refuses a command body over 16 MiB (18 such results); the embedded server takes more,
/// so the test goes past the 48 MB message limit every server and driver has. Counts:
/// jobs of the bulk completed (all 60, each with a 900 KB result).
#[tokio::test]
async fn a_bulk_of_large_results_is_completed_whole() -> anyhow::Result<()> {
    let t = TestDb::new("queue_bulk_large_results").await?;
    let q = open(&t, "jobs", QueueOptions::default().partitions(1)).await?;
    let n = 60;
    q.enqueue_many((0..60_i64).map(|i| (doc! { "i": i }, EnqueueOptions::default())))
        .await?;
    let batch = q.claim_batch("w", n).await?;
    anyhow::ensure!(batch.len() == n, "claimed {}", batch.len());
    let items: Vec<_> = batch
        .iter()
        .enumerate()
        .map(|(i, j)| {
            (
                j.clone(),
                Bson::String(format!("{i}{}", "x".repeat(900_000))),
            )
        })
        .collect();
    let outcomes = q.complete_many(&items).await;
    let done = q
        .collection()
        .count_documents(doc! { "state": JobState::Succeeded.as_str() })
        .await?;
    assert!(
        outcomes.as_ref().is_ok_and(|o| o.iter().all(Result::is_ok)),
        "{:?}",
        outcomes.map(|o| o.iter().filter(|r| r.is_err()).count())
    );
    assert_eq!(done, u64::try_from(n)?, "jobs completed");
    Ok(())
}

/// A batch claim is a write (the leases) then a read of the claimed jobs. When the read
/// failed, the claim returned the error and the jobs it had just leased stayed `running`
/// under a token nobody held: unclaimable until their lease expired (30 s by default),
/// each charged an attempt it never ran — a job with `max_attempts(1)` went to `dead`
/// without ever running. The claim now gives them back (attempt returned) before it
/// reports the error. Counts: jobs left running unheld (0), dead (0).
#[tokio::test]
async fn a_claim_whose_read_back_fails_gives_its_jobs_back() -> anyhow::Result<()> {
    let test = "queue_claim_read_back_fails";
    let t = TestDb::new(test).await?;
    if let Err(e) = docwarden_testkit::fail_commands_off(&t.client).await {
        docwarden_testkit::skip(test, &format!("no failCommand fail point: {e}"));
        return Ok(());
    }
    let mut options = mongodb::options::ClientOptions::parse(t.uri()).await?;
    options.app_name = Some("claim-read-fails".into());
    let client = mongodb::Client::with_options(options)?;
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let opts = QueueOptions::default()
        .partitions(1)
        .lease_ttl(Duration::from_secs(1))
        .reap_interval(Duration::from_secs(3600));
    let q = open(&t, "jobs", opts.clone()).await?;
    let cut = JobQueue::new(client.database(t.db.name()).collection("jobs"), time, opts)?;
    q.enqueue_many(
        (0..3_i64).map(|i| (doc! { "i": i }, EnqueueOptions::default().max_attempts(1))),
    )
    .await?;
    // The claim's own sweep runs first (updates); then the candidates' find passes, the
    // leases are written, and the read of the claimed jobs fails (and its retry).
    docwarden_testkit::fail_commands_of(
        &t.client,
        "claim-read-fails",
        &["find"],
        2,
        Bson::Document(doc! { "skip": 1, "times": 2 }),
    )
    .await?;
    let claimed = cut.claim_batch("w", 3).await;
    docwarden_testkit::fail_commands_off(&t.client).await?;
    anyhow::ensure!(claimed.is_err(), "the read did not fail: {claimed:?}");
    let running = q
        .collection()
        .count_documents(doc! { "state": JobState::Running.as_str() })
        .await?;
    // Past the lease and the sweep's margin: a job left running would now be swept, and
    // with one attempt it would be dead without having run.
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    q.reap_expired().await?;
    let dead = q
        .collection()
        .count_documents(doc! { "state": JobState::Dead.as_str() })
        .await?;
    let again = q.claim_batch("w2", 3).await?;
    assert_eq!(
        (running, dead, again.len()),
        (0, 0, 3),
        "(left running unheld, dead without running, claimable again)"
    );
    assert!(
        again.iter().all(|j| j.job.attempts == 1),
        "attempts charged twice"
    );
    Ok(())
}

/// Session 17: `complete_many` given the same claim twice reported both occurrences
/// applied (`Ok` twice) although the job completed once, with one of the two results:
/// a caller counting completions counted it twice. The first occurrence is sent, each
/// later one of the same claim is that item's own `InvalidInput` (nothing sent for it),
/// and the stored result is the first occurrence's. Fails without the check: every
/// occurrence is `Ok`.
#[tokio::test]
async fn a_claim_given_twice_to_complete_many_is_completed_and_reported_once() -> anyhow::Result<()>
{
    let t = TestDb::new("queue_bulk_duplicate_claim").await?;
    let q = open(&t, "jobs", QueueOptions::default().partitions(1)).await?;
    q.enqueue_many((0..2).map(|i| (doc! { "i": i }, EnqueueOptions::default())))
        .await?;
    let batch = q.claim_batch("w", 2).await?;
    assert_eq!(batch.len(), 2);
    let (a, b) = (&batch[0], &batch[1]);
    let outcomes = q
        .complete_many(&[
            (a.clone(), Bson::String("first".into())),
            (a.clone(), Bson::String("second".into())),
            (b.clone(), Bson::String("b".into())),
            (a.clone(), Bson::String("first".into())),
        ])
        .await?;
    assert_eq!(outcomes.len(), 4);
    assert!(outcomes[0].is_ok(), "{:?}", outcomes[0]);
    assert!(outcomes[2].is_ok(), "{:?}", outcomes[2]);
    for o in [&outcomes[1], &outcomes[3]] {
        assert!(
            matches!(o, Err(Error::InvalidInput { what: "jobs", .. })),
            "a repeated claim was reported as {o:?}"
        );
    }
    let stored = q
        .get(a.id())
        .await?
        .ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(stored.state, JobState::Succeeded);
    assert_eq!(stored.result, Some(Bson::String("first".into())));
    Ok(())
}
