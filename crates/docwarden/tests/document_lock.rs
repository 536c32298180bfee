//! Document locks (seed 003) against the real server: lock, lock_or_create, the upsert
//! race, expired-lock takeover (the seed's AND bug fixed), fenced release, mutual
//! exclusion; each concurrency test with a control.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use docwarden::Error;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{DocumentLockOptions, DocumentLocks, FenceOutcome};
use docwarden_testkit::TestDb;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};

fn locks(t: &TestDb, coll: &Collection<Document>, max: Duration) -> anyhow::Result<DocumentLocks> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    Ok(DocumentLocks::new(
        coll.clone(),
        time,
        DocumentLockOptions::default().max_duration(max),
    )?)
}

/// The controls: the same document locks with seed 003's AND filter (one safeguard off).
fn seed_locks(
    t: &TestDb,
    coll: &Collection<Document>,
    max: Duration,
) -> anyhow::Result<DocumentLocks> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    Ok(DocumentLocks::new(
        coll.clone(),
        time,
        DocumentLockOptions::default()
            .max_duration(max)
            .unsafe_seed_and_filter(),
    )?)
}

#[tokio::test]
async fn lock_release_with_and_lock_again() -> anyhow::Result<()> {
    let t = TestDb::new("doclock_basic").await?;
    let coll = t.db.collection::<Document>("dummies");
    coll.insert_one(
        doc! { "_id": "d1", "value": "a", "lock_id": Bson::Null, "lock_time": Bson::Null },
    )
    .await?;
    let locks = locks(&t, &coll, Duration::from_secs(30))?;

    let guard = locks.try_lock("d1").await?.context("exists")?;
    assert_eq!(guard.document.get_str("lock_id")?, guard.lock_id);
    assert_eq!(guard.lock_id.len(), 32);
    // Contention is not an error: a held lock is `Ok(None)`, and the refused attempt
    // leaves the holder's lock fields exactly as they were.
    let held = coll.find_one(doc! { "_id": "d1" }).await?.context("d1")?;
    assert!(matches!(locks.try_lock("d1").await, Ok(None)));
    assert_eq!(
        coll.find_one(doc! { "_id": "d1" }).await?.context("d1")?,
        held
    );
    assert!(matches!(
        locks.lock_or_create("d1", doc! {}).await,
        Ok(None)
    ));
    assert_eq!(
        locks
            .release_with(guard, doc! { "$set": { "value": "b" } })
            .await?,
        FenceOutcome::Applied
    );
    let d = coll.find_one(doc! { "_id": "d1" }).await?.context("d1")?;
    assert_eq!(d.get_str("value")?, "b");
    assert_eq!(d.get("lock_id"), Some(&Bson::Null));
    assert_eq!(d.get("lock_time"), Some(&Bson::Null));

    // A released document can be locked again (with the seed's AND filter it cannot:
    // `lock_time < cutoff` never matches null).
    let again = locks.try_lock("d1").await?.context("relock")?;
    assert_eq!(locks.release(again).await?, FenceOutcome::Applied);
    // Control: docwarden's document locks with one safeguard off (seed 003's AND filter)
    // cannot relock the released document.
    let seed = seed_locks(&t, &coll, Duration::from_secs(30))?;
    let seed_and = seed.try_lock("d1").await;
    assert!(
        matches!(seed_and, Ok(None)),
        "control: the seed's AND filter cannot relock a released document: {seed_and:?}"
    );

    // A missing document is not created by lock().
    assert!(locks.try_lock("missing").await?.is_none());
    assert_eq!(coll.count_documents(doc! { "_id": "missing" }).await?, 0);
    Ok(())
}

#[tokio::test]
async fn lock_or_create_upserts_with_the_initial_document() -> anyhow::Result<()> {
    let t = TestDb::new("doclock_upsert").await?;
    let coll = t.db.collection::<Document>("dummies");
    let locks = locks(&t, &coll, Duration::from_secs(30))?;
    let guard = locks
        .lock_or_create("new", doc! { "value": "initial", "n": 1_i64 })
        .await?
        .context("new")?;
    assert_eq!(guard.document.get_str("value")?, "initial");
    assert!(matches!(
        locks.lock_or_create("new", doc! { "value": "other" }).await,
        Ok(None)
    ));
    assert_eq!(
        locks
            .release_with(guard, doc! { "$inc": { "n": 1_i64 } })
            .await?,
        FenceOutcome::Applied
    );
    // Existing document: the initial fields are not applied.
    let guard = locks
        .lock_or_create("new", doc! { "value": "ignored" })
        .await?
        .context("released")?;
    assert_eq!(guard.document.get_str("value")?, "initial");
    assert_eq!(guard.document.get_i64("n")?, 2);
    assert_eq!(locks.release(guard).await?, FenceOutcome::Applied);
    assert_eq!(coll.count_documents(doc! {}).await?, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_racing_creators_one_winner_seven_already_locked() -> anyhow::Result<()> {
    let t = TestDb::new("doclock_upsert_race").await?;
    let coll = t.db.collection::<Document>("dummies");
    let locks = locks(&t, &coll, Duration::from_secs(30))?;
    for round in 0..5 {
        let id = format!("race-{round}");
        let barrier = Arc::new(tokio::sync::Barrier::new(8));
        let mut tasks = Vec::new();
        for i in 0..8 {
            let (locks, barrier, id) = (locks.clone(), Arc::clone(&barrier), id.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                locks
                    .lock_or_create(id.as_str(), doc! { "creator": i })
                    .await
            }));
        }
        let (mut winners, mut already) = (0, 0);
        for task in tasks {
            match task.await? {
                Ok(Some(_)) => winners += 1,
                Ok(None) => already += 1,
                Err(e) => return Err(e.into()),
            }
        }
        assert_eq!((winners, already), (1, 7), "round {round}");
        assert_eq!(coll.count_documents(doc! { "_id": &id }).await?, 1);
    }

    // Control: a non-atomic read-then-lock on a free document lets several tasks "win".
    let mut extra_winners = 0;
    for round in 0..20 {
        let id = format!("naive-{round}");
        coll.insert_one(doc! { "_id": &id, "lock_id": Bson::Null })
            .await?;
        let barrier = Arc::new(tokio::sync::Barrier::new(8));
        let mut tasks = Vec::new();
        for i in 0..8 {
            let (coll, barrier, id) = (coll.clone(), Arc::clone(&barrier), id.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let d = coll.find_one(doc! { "_id": &id }).await?.context("naive")?;
                if d.get("lock_id") == Some(&Bson::Null) {
                    coll.update_one(doc! { "_id": &id }, doc! { "$set": { "lock_id": i } })
                        .await?;
                    return anyhow::Ok(1);
                }
                Ok(0)
            }));
        }
        let mut winners = 0;
        for task in tasks {
            winners += task.await??;
        }
        extra_winners += winners - 1;
    }
    assert!(
        extra_winners > 0,
        "the control must let more than one task lock"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expired_lock_is_taken_over_and_the_old_release_is_lost() -> anyhow::Result<()> {
    let t = TestDb::new("doclock_takeover").await?;
    let coll = t.db.collection::<Document>("dummies");
    let locks = locks(&t, &coll, Duration::from_secs(1))?;
    let a = locks
        .lock_or_create("d", doc! { "value": "start" })
        .await?
        .context("d is new")?;
    assert!(matches!(locks.try_lock("d").await, Ok(None)));
    tokio::time::sleep(Duration::from_millis(1_800)).await; // a pauses past max_duration

    // Control first: docwarden's document locks with one safeguard off (seed 003's AND
    // filter) cannot take over the expired lock, with `lock` or with the upsert.
    let seed = seed_locks(&t, &coll, Duration::from_secs(1))?;
    let mut seed_takeovers = 0;
    for attempt in [
        seed.try_lock("d").await.map(|g| g.is_some()),
        seed.lock_or_create("d", doc! {}).await.map(|g| g.is_some()),
    ] {
        if attempt? {
            seed_takeovers += 1;
        }
    }
    assert_eq!(
        seed_takeovers, 0,
        "control: the seed's AND filter says 'already locked' forever"
    );

    let b = locks.try_lock("d").await?.context("b takes over")?;
    assert_ne!(b.lock_id, a.lock_id);
    let lost = locks
        .release_with(a, doc! { "$set": { "value": "from a" } })
        .await?;
    assert_eq!(lost, FenceOutcome::Lost);
    assert_eq!(
        locks
            .release_with(b, doc! { "$set": { "value": "from b" } })
            .await?,
        FenceOutcome::Applied
    );
    let d = coll.find_one(doc! { "_id": "d" }).await?.context("d")?;
    assert_eq!(d.get_str("value")?, "from b");

    // A lock that was cleared (released by hand) is lost as well.
    let c = locks.try_lock("d").await?.context("c")?;
    coll.update_one(
        doc! { "_id": "d" },
        doc! { "$set": { "lock_id": Bson::Null } },
    )
    .await?;
    assert_eq!(locks.release(c).await?, FenceOutcome::Lost);
    Ok(())
}

async fn counter_rounds(
    locks: Option<DocumentLocks>,
    coll: &Collection<Document>,
) -> anyhow::Result<i64> {
    const TASKS: usize = 8;
    const ROUNDS: i64 = 50;
    coll.insert_one(doc! { "_id": "counter", "n": 0_i64 })
        .await?;
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let (locks, coll) = (locks.clone(), coll.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                match &locks {
                    Some(locks) => loop {
                        match locks.try_lock("counter").await {
                            Ok(Some(guard)) => {
                                let n = guard.document.get_i64("n")?;
                                tokio::task::yield_now().await;
                                let released = locks
                                    .release_with(guard, doc! { "$set": { "n": n + 1 } })
                                    .await?;
                                anyhow::ensure!(released.is_applied(), "{released:?}");
                                break;
                            }
                            Ok(None) => {
                                tokio::time::sleep(Duration::from_millis(rand_ms())).await;
                            }
                            Err(e) => return Err(e.into()),
                        }
                    },
                    None => {
                        let d = coll
                            .find_one(doc! { "_id": "counter" })
                            .await?
                            .context("counter")?;
                        let n = d.get_i64("n")?;
                        tokio::task::yield_now().await;
                        coll.update_one(doc! { "_id": "counter" }, doc! { "$set": { "n": n + 1 } })
                            .await?;
                    }
                }
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    let n = coll
        .find_one(doc! { "_id": "counter" })
        .await?
        .context("counter")?
        .get_i64("n")?;
    Ok(i64::try_from(TASKS)? * ROUNDS - n)
}

/// A random backoff of 1 to 3 ms, drawn anew on every call (it used to be derived from the
/// process id, so every task of a run slept the same time and the retries stayed in step).
fn rand_ms() -> u64 {
    rand::random_range(1..=3)
}

#[test]
fn the_backoff_is_random_per_call() {
    let draws: std::collections::BTreeSet<u64> = (0..200).map(|_| rand_ms()).collect();
    assert!(
        draws.len() > 1 && draws.iter().all(|d| (1..=3).contains(d)),
        "rand_ms() drew only {draws:?} in 200 calls"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn document_locks_lose_no_update_and_the_control_does() -> anyhow::Result<()> {
    let t = TestDb::new("doclock_mutual_exclusion").await?;
    let coll = t.db.collection::<Document>("locked");
    let started = Instant::now();
    let lost = counter_rounds(Some(locks(&t, &coll, Duration::from_secs(30))?), &coll).await?;
    eprintln!(
        "document locks: lost {lost} in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(lost, 0);
    let control = t.db.collection::<Document>("unlocked");
    let lost = counter_rounds(None, &control).await?;
    eprintln!("control: lost {lost}");
    assert!(lost > 0, "the control must lose updates");
    Ok(())
}

#[tokio::test]
async fn bad_input_is_refused_and_nothing_is_written() -> anyhow::Result<()> {
    let t = TestDb::new("doclock_bad_input").await?;
    let coll = t.db.collection::<Document>("dummies");
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let invalid = |e: &Error| matches!(e, Error::InvalidInput { .. });
    let zero = DocumentLocks::new(
        coll.clone(),
        time.clone(),
        DocumentLockOptions::default().max_duration(Duration::ZERO),
    );
    assert!(zero.as_ref().is_err_and(invalid));
    let same = DocumentLocks::new(
        coll.clone(),
        time.clone(),
        DocumentLockOptions::default().fields("l", "l"),
    );
    assert!(same.as_ref().is_err_and(invalid));
    let locks = locks(&t, &coll, Duration::from_secs(30))?;
    assert!(
        locks
            .lock_or_create("a", doc! { "lock_id": "mine" })
            .await
            .as_ref()
            .is_err_and(invalid)
    );
    assert!(
        locks
            .lock_or_create("a", doc! { "$set": { "x": 1 } })
            .await
            .as_ref()
            .is_err_and(invalid)
    );
    assert!(
        locks
            .lock_or_create("a", doc! { "_id": "b" })
            .await
            .as_ref()
            .is_err_and(invalid)
    );
    assert!(
        locks
            .lock_or_create("", doc! {})
            .await
            .as_ref()
            .is_err_and(invalid)
    );
    let long = "x".repeat(docwarden::validate::MAX_NAME_LEN + 1);
    assert!(
        locks
            .try_lock(long.as_str())
            .await
            .as_ref()
            .is_err_and(invalid)
    );
    assert_eq!(coll.count_documents(doc! {}).await?, 0);
    let guard = locks
        .lock_or_create("ok", doc! {})
        .await?
        .context("ok is new")?;
    let bad = locks
        .release_with(guard.clone(), doc! { "$set": { "lock_id": "x" } })
        .await;
    assert!(bad.as_ref().is_err_and(invalid));
    let still_locked = coll.find_one(doc! { "_id": "ok" }).await?.context("ok")?;
    assert_eq!(still_locked.get_str("lock_id")?, guard.lock_id);
    assert_eq!(locks.release(guard).await?, FenceOutcome::Applied);
    Ok(())
}

/// Session 15: an id that is a query operator document went into the filter `{_id: id}`
/// as given: `lock({$gt: 0})` locked whichever document came first, and
/// `lock_or_create({$gt: 5}, …)` inserted a new document under a random ObjectId. Both
/// are `InvalidInput` now, and nothing is locked or created.
#[tokio::test]
async fn an_operator_document_as_id_locks_nothing() -> anyhow::Result<()> {
    let t = TestDb::new("doclock_operator_id").await?;
    let coll = t.db.collection::<Document>("dummies");
    coll.insert_many(vec![doc! { "_id": 1, "n": 0 }, doc! { "_id": 2, "n": 0 }])
        .await?;
    let locks = locks(&t, &coll, Duration::from_secs(30))?;
    let invalid = |e: &Error| {
        matches!(
            e,
            Error::InvalidInput {
                what: "document id",
                ..
            }
        )
    };
    for id in [
        Bson::Document(doc! { "$gt": 0 }),
        Bson::Document(doc! { "$in": [1, 2] }),
        Bson::RegularExpression(mongodb::bson::Regex {
            pattern: "^".into(),
            options: String::new(),
        }),
    ] {
        let locked = locks.try_lock(id.clone()).await;
        assert!(
            locked.as_ref().is_err_and(invalid),
            "lock({id}): {locked:?}"
        );
        let created = locks.lock_or_create(id.clone(), doc! {}).await;
        assert!(
            created.as_ref().is_err_and(invalid),
            "lock_or_create({id}): {created:?}"
        );
    }
    assert_eq!(
        coll.count_documents(doc! { "lock_id": { "$exists": true } })
            .await?,
        0,
        "a document was locked"
    );
    assert_eq!(
        coll.count_documents(doc! {}).await?,
        2,
        "a document was created"
    );
    Ok(())
}

/// A stored value of one of several BSON types, or the field missing.
fn value_strategy() -> impl proptest::strategy::Strategy<Value = Option<Bson>> {
    use proptest::prelude::*;
    prop_oneof![
        Just(None),
        Just(Some(Bson::Null)),
        any::<i32>().prop_map(|v| Some(Bson::Int32(v))),
        any::<i64>().prop_map(|v| Some(Bson::Int64(v))),
        Just(Some(Bson::Double(0.5))),
        "[a-z$.]{0,4}".prop_map(|s| Some(Bson::String(s))),
        Just(Some(Bson::Array(vec![Bson::Int32(1), Bson::Null]))),
        Just(Some(Bson::Document(doc! { "$x": 1, "a.b": [] }))),
    ]
}

/// Session 18: `release_with` of a plain `$set`/`$unset` is sent as a pipeline for the
/// filter `{_id}` alone (the fence inside). For random stored documents and random plain
/// updates, held or taken over, it must leave the document — values, types and field
/// order — and report the outcome exactly as the operator update fenced in the filter
/// does (sent here raw on a twin document).
#[test]
fn a_plain_release_as_a_pipeline_leaves_what_the_fenced_operator_form_leaves() -> anyhow::Result<()>
{
    use proptest::prelude::*;
    const NAMES: [&str; 5] = ["a", "b", "B", "x y", "é"];
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let t = rt.block_on(TestDb::new("doclock_release_forms"))?;
    let coll = t.db.collection::<Document>("docs");
    let locks = locks(&t, &coll, Duration::from_secs(30))?;
    let next = std::sync::atomic::AtomicI64::new(0);
    let config = ProptestConfig {
        cases: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    // Half the fields missing, so that updates often append new fields (whose order the
    // two forms must agree on).
    let stored = prop::collection::vec(
        prop_oneof![1 => Just(None), 1 => value_strategy()],
        NAMES.len(),
    );
    // Per name: untouched, `$set` to a value, or `$unset`.
    let change = prop_oneof![
        2 => Just(None),
        3 => value_strategy().prop_map(|v| Some(Some(v.unwrap_or(Bson::Null)))),
        1 => Just(Some(None)),
    ];
    let changes = prop::collection::vec(change, NAMES.len());
    proptest!(config, |(stored in stored, changes in changes, taken_over in any::<bool>())| {
        let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let outcome: anyhow::Result<()> = rt.block_on(async {
            let (mine, twin) = (2 * n, 2 * n + 1);
            let mut base = doc! {};
            for (name, v) in NAMES.iter().zip(&stored) {
                if let Some(v) = v {
                    base.insert(*name, v.clone());
                }
            }
            let mut d = base.clone();
            d.insert("_id", mine);
            coll.insert_one(d).await?;
            let guard = locks.try_lock(mine).await?.context("free document")?;
            // The twin: the same fields in the same order, the same lock fields.
            let mut d = doc! { "_id": twin };
            for (k, v) in coll.find_one(doc! { "_id": mine }).await?.context("mine")? {
                if k != "_id" {
                    d.insert(k, v);
                }
            }
            coll.insert_one(d).await?;
            if taken_over {
                for id in [mine, twin] {
                    coll.update_one(doc! { "_id": id }, doc! { "$set": { "lock_id": "someone else" } })
                        .await?;
                }
            }
            let (mut set, mut unset) = (doc! {}, doc! {});
            for (name, c) in NAMES.iter().zip(&changes) {
                match c {
                    Some(Some(v)) => { set.insert(*name, v.clone()); }
                    Some(None) => { unset.insert(*name, ""); }
                    None => {}
                }
            }
            let mut update = doc! {};
            if !set.is_empty() {
                update.insert("$set", set.clone());
            }
            if !unset.is_empty() {
                update.insert("$unset", unset.clone());
            }
            let lock_id = guard.lock_id.clone();
            let applied = locks.release_with(guard, update).await? == FenceOutcome::Applied;
            // The operator form fenced in the filter, as `release_with` sent it before.
            set.insert("lock_id", Bson::Null);
            set.insert("lock_time", Bson::Null);
            let mut fenced = doc! { "$set": set };
            if !unset.is_empty() {
                fenced.insert("$unset", unset);
            }
            let r = coll
                .update_one(doc! { "_id": twin, "lock_id": &lock_id }, fenced)
                .await?;
            anyhow::ensure!(applied == (r.matched_count == 1), "outcomes differ: pipeline applied {applied}, filter matched {}", r.matched_count);
            anyhow::ensure!(applied != taken_over, "applied {applied} although taken over {taken_over}");
            let strip = |mut d: Document| { d.remove("_id"); d };
            let a = strip(coll.find_one(doc! { "_id": mine }).await?.context("mine")?);
            let b = strip(coll.find_one(doc! { "_id": twin }).await?.context("twin")?);
            // Compared as raw bytes: the same values, types and field order.
            anyhow::ensure!(
                mongodb::bson::to_vec(&a)? == mongodb::bson::to_vec(&b)?,
                "pipeline left {a:?}, the filter form {b:?}"
            );
            Ok(())
        });
        outcome.map_err(|e| TestCaseError::fail(format!("{e:#}")))?;
    });
    rt.block_on(async move { drop(t) });
    Ok(())
}
