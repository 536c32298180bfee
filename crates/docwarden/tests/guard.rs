//! Guarded updates against the real server: exact outcomes, invariants that hold under
//! racing writers (with read-then-write controls that break them), the validator as a
//! second safeguard, the checker, and the embedded-array index.

#![allow(clippy::unwrap_used)] // a test may panic on a missing document

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use docwarden::guard::{
    self, Change, CmpOp, Condition, GuardOptions, GuardOutcome, Guarded, IndexUse, Invariant,
    Operand, ValidatorInstall, ValidatorOptions,
};
use docwarden_testkit::TestDb;
use docwarden_workloads::{Mode as WorkloadMode, RunConfig, on_call};
use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, DateTime, Document, doc};

const WORKERS: usize = 8;

/// Held by the tests that configure the server's `failCommand` fail point: it is one
/// configuration per server, each replacing the last, and this binary's tests share one
/// server (an `appName` in the configuration only keeps it off other clients).
static FAIL_POINT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const OPS_PER_WORKER: usize = 1_000;
const SHIFTS: i64 = 10;

fn on_call() -> Invariant {
    on_call::rule().unwrap()
}

fn within_capacity() -> Invariant {
    Invariant::sum_at_most(
        "booked seats within capacity",
        "bookings",
        "seats",
        Operand::field("capacity"),
    )
    .unwrap()
}

fn shift(id: i64, doctors: usize) -> Document {
    let doctors: Vec<Document> = (0..doctors)
        .map(|d| doc! { "name": format!("doctor{d}"), "on_call": true, "updated": DateTime::now() })
        .collect();
    doc! { "_id": id, "doctors": doctors }
}

fn doctor_on_call(d: &Document, name: &str) -> Option<bool> {
    d.get_array("doctors")
        .ok()?
        .iter()
        .filter_map(Bson::as_document)
        .find(|m| m.get_str("name").ok() == Some(name))
        .and_then(|m| m.get_bool("on_call").ok())
}

#[tokio::test]
async fn every_outcome_is_produced_exactly() -> anyhow::Result<()> {
    let t = TestDb::new("guard_outcomes").await?;
    let coll = t.db.collection::<Document>("shifts");
    coll.insert_one(doc! { "_id": 1, "doctors": [
        { "name": "Alice", "on_call": true },
        { "name": "Bob", "on_call": true },
    ]})
    .await?;
    let g = Guarded::new(coll.clone(), GuardOptions::default())?;
    let inv = [on_call()];
    let off = |n: &str| Change::set_member("doctors", "name", n, doc! { "on_call": false });

    assert_eq!(
        g.update(99, &off("Alice")?, &inv).await?,
        GuardOutcome::NotFound
    );
    assert_eq!(
        g.update(1, &off("Zoe")?, &inv).await?,
        GuardOutcome::NoSuchMember
    );
    assert_eq!(
        g.update(1, &off("Alice")?, &inv).await?,
        GuardOutcome::Applied
    );
    assert_eq!(
        g.update(1, &off("Alice")?, &inv).await?,
        GuardOutcome::NoChange
    );
    assert_eq!(
        g.update(1, &off("Bob")?, &inv).await?,
        GuardOutcome::Rejected {
            invariant: "at least one doctor on call".into()
        }
    );
    let d = coll.find_one(doc! { "_id": 1 }).await?.unwrap();
    assert_eq!(doctor_on_call(&d, "Alice"), Some(false));
    assert_eq!(doctor_on_call(&d, "Bob"), Some(true));

    // A top-level counter: balance >= 0.
    let accounts = t.db.collection::<Document>("accounts");
    accounts
        .insert_one(doc! { "_id": "acc", "balance": 10_i64 })
        .await?;
    let ga = Guarded::new(accounts.clone(), GuardOptions::default())?;
    let nonneg = [Invariant::field_cmp(
        "balance never negative",
        "balance",
        CmpOp::Gte,
        0_i64,
    )?];
    assert_eq!(
        ga.update("acc", &Change::inc("balance", -7_i64)?, &nonneg)
            .await?,
        GuardOutcome::Applied
    );
    assert_eq!(
        ga.update("acc", &Change::inc("balance", -7_i64)?, &nonneg)
            .await?,
        GuardOutcome::Rejected {
            invariant: "balance never negative".into()
        }
    );
    assert_eq!(
        ga.update("acc", &Change::inc("balance", 0_i64)?, &nonneg)
            .await?,
        GuardOutcome::NoChange
    );
    assert_eq!(
        ga.update("acc", &Change::set("balance", 3_i64)?, &nonneg)
            .await?,
        GuardOutcome::NoChange
    );
    assert_eq!(
        ga.update("nope", &Change::inc("balance", 1_i64)?, &nonneg)
            .await?,
        GuardOutcome::NotFound
    );
    // A raw invariant over `$$ROOT` (the whole new document is bound instead of one field).
    let via_root = [Invariant::raw(
        "root balance below 100",
        doc! { "$lt": ["$$ROOT.balance", 100] },
    )?];
    assert_eq!(
        ga.update("acc", &Change::inc("balance", 200_i64)?, &via_root)
            .await?,
        GuardOutcome::Rejected {
            invariant: "root balance below 100".into()
        }
    );
    let a = accounts.find_one(doc! { "_id": "acc" }).await?.unwrap();
    assert_eq!(a.get_i64("balance")?, 3);

    // Push / pull with a capacity stored in the document; `$`-strings are literals.
    let flights = t.db.collection::<Document>("flights");
    flights
        .insert_one(doc! { "_id": 7, "capacity": 3, "bookings": [] })
        .await?;
    let gf = Guarded::new(flights.clone(), GuardOptions::default())?;
    let cap = [within_capacity()];
    let book = |id: &str, seats: i32| Change::push("bookings", doc! { "id": id, "seats": seats });
    assert_eq!(
        gf.update(7, &book("$a", 2)?, &cap).await?,
        GuardOutcome::Applied
    );
    assert_eq!(
        gf.update(7, &book("b", 2)?, &cap).await?,
        GuardOutcome::Rejected {
            invariant: "booked seats within capacity".into()
        }
    );
    assert_eq!(
        gf.update(7, &Change::pull_member("bookings", "id", "zz")?, &cap)
            .await?,
        GuardOutcome::NoSuchMember
    );
    assert_eq!(
        gf.update(7, &Change::pull_member("bookings", "id", "$a")?, &cap)
            .await?,
        GuardOutcome::Applied
    );
    assert_eq!(
        gf.update(7, &book("b", 2)?, &cap).await?,
        GuardOutcome::Applied
    );
    let f = flights.find_one(doc! { "_id": 7 }).await?.unwrap();
    assert_eq!(f.get_array("bookings")?.len(), 1);
    Ok(())
}

#[tokio::test]
async fn the_seed_go_on_call_filter_picks_the_wrong_doctor_and_elem_match_does_not()
-> anyhow::Result<()> {
    let t = TestDb::new("guard_positional").await?;
    let coll = t.db.collection::<Document>("shifts");
    let start = doc! { "_id": 1, "doctors": [
        { "name": "Alice", "on_call": false },
        { "name": "Bob", "on_call": true },
    ]};
    coll.insert_one(start.clone()).await?;
    // Seed: goOnCall(1, "Bob"). Bob is already on call, yet the filter matches: its two
    // conditions are met by two different elements (Bob's name, Alice's on_call: false).
    let seed_filter = doc! { "_id": 1, "doctors.name": "Bob", "doctors.on_call": false };
    assert_eq!(coll.count_documents(seed_filter.clone()).await?, 1);
    let elem_match =
        doc! { "_id": 1, "doctors": { "$elemMatch": { "name": "Bob", "on_call": false } } };
    assert_eq!(coll.count_documents(elem_match).await?, 0);
    let res = coll
        .update_one(seed_filter, doc! { "$set": { "doctors.$.on_call": true } })
        .await?;
    let after = coll.find_one(doc! { "_id": 1 }).await?.unwrap();
    // The seed reports ON_OK (modifiedCount 1) and the changed doctor is Alice, not Bob.
    assert_eq!(res.modified_count, 1, "the seed's update reported ON_OK");
    assert_eq!(
        doctor_on_call(&after, "Alice"),
        Some(true),
        "the seed set the wrong doctor"
    );

    // docwarden: Bob on call is already the state -> NoChange, Alice untouched.
    coll.replace_one(doc! { "_id": 1 }, start).await?;
    let g = Guarded::new(coll.clone(), GuardOptions::default())?;
    let on = Change::set_member("doctors", "name", "Bob", doc! { "on_call": true })?;
    assert_eq!(
        g.update(1, &on, &[on_call()]).await?,
        GuardOutcome::NoChange
    );
    let after = coll.find_one(doc! { "_id": 1 }).await?.unwrap();
    assert_eq!(doctor_on_call(&after, "Alice"), Some(false));
    assert_eq!(doctor_on_call(&after, "Bob"), Some(true));
    Ok(())
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Guarded,
    /// Read, decide in the client, write unconditionally.
    ReadThenWrite,
}

/// Seed 000's workload (`docwarden_workloads::on_call`): 8 workers × 1,000 random on/off
/// toggles on 10 shifts; the shift is checked after every operation. Returns (violations
/// seen after operations, violating shifts at the end).
async fn on_call_workload(
    coll: Collection<Document>,
    mode: WorkloadMode,
) -> anyhow::Result<(u64, u64)> {
    let report = on_call_batches(coll, mode, 1).await?;
    Ok((report.seen, report.at_end))
}

/// [`on_call_workload`] with each worker sending its toggles `batch` at a time
/// (`Guarded::update_many`; 1: one update each). Returns the report.
async fn on_call_batches(
    coll: Collection<Document>,
    mode: WorkloadMode,
    batch: usize,
) -> anyhow::Result<on_call::OnCallReport> {
    on_call::setup(&coll, SHIFTS).await?;
    on_call::run_in_batches(
        &on_call::OnCall::new(coll)?,
        SHIFTS,
        RunConfig {
            workers: WORKERS,
            ops_per_worker: u64::try_from(OPS_PER_WORKER)?,
            mode,
        },
        batch,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_call_holds_under_8_workers_x_1000_toggles() -> anyhow::Result<()> {
    let t = TestDb::new("guard_on_call").await?;
    let (seen, end) = on_call_workload(t.db.collection("shifts"), WorkloadMode::Safe).await?;
    assert_eq!(seen, 0, "violations observed after operations");
    assert_eq!(end, 0, "violating shifts at the end");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_call_control_read_then_write_breaks_the_rule() -> anyhow::Result<()> {
    let t = TestDb::new("guard_on_call_control").await?;
    let (seen, end) = on_call_workload(t.db.collection("shifts"), WorkloadMode::Control).await?;
    eprintln!("control: {seen} violations observed, {end} violating shifts at the end");
    assert!(
        seen > 0,
        "the read-then-write control should break the rule"
    );
    Ok(())
}

// Batches: the same rule holds when 8 workers send their toggles 8 at a time in one
// `bulkWrite` each; every toggle has an outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_call_holds_under_8_workers_sending_batches_of_8() -> anyhow::Result<()> {
    let t = TestDb::new("guard_on_call_batches").await?;
    let r = on_call_batches(t.db.collection("shifts"), WorkloadMode::Safe, 8).await?;
    assert_eq!(r.seen, 0, "violations observed after batches");
    assert_eq!(r.at_end, 0, "violating shifts at the end");
    assert_eq!(
        r.applied + r.rejected + r.unchanged,
        u64::try_from(WORKERS * OPS_PER_WORKER)?
    );
    assert!(
        r.applied > 0 && r.rejected > 0,
        "both outcomes occur: {r:?}"
    );
    Ok(())
}

// Control: the same batches without the rule (the guard's safeguard off) take the last
// doctor off call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_call_control_batches_without_the_rule_break_it() -> anyhow::Result<()> {
    let t = TestDb::new("guard_on_call_batches_control").await?;
    let r = on_call_batches(t.db.collection("shifts"), WorkloadMode::Control, 8).await?;
    eprintln!(
        "control: {} violations observed, {} violating shifts at the end",
        r.seen, r.at_end
    );
    assert!(r.seen > 0, "batches without the rule should break it");
    Ok(())
}

/// 8 workers × 1,000 random book/cancel operations on 10 flights of 10 seats.
async fn capacity_workload(
    coll: Collection<Document>,
    mode: Mode,
) -> anyhow::Result<(u64, usize, u64)> {
    coll.insert_many((0..SHIFTS).map(|f| doc! { "_id": f, "capacity": 10, "bookings": [] }))
        .await?;
    let violations = Arc::new(AtomicU64::new(0));
    let applied = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        let coll = coll.clone();
        let violations = Arc::clone(&violations);
        let applied = Arc::clone(&applied);
        tasks.push(tokio::spawn(async move {
            let g = Guarded::new(coll.clone(), GuardOptions::default())?;
            let inv = [within_capacity()];
            let mut mine: Vec<(i64, String)> = Vec::new();
            for _ in 0..OPS_PER_WORKER {
                let cancel = !mine.is_empty() && rand::random_bool(0.4);
                let f = if cancel {
                    let (f, id) = mine.swap_remove(rand::random_range(0..mine.len()));
                    match mode {
                        Mode::Guarded => {
                            let o = g
                                .update(
                                    f,
                                    &Change::pull_member("bookings", "id", id.as_str())?,
                                    &inv,
                                )
                                .await?;
                            assert_eq!(o, GuardOutcome::Applied, "cancelling my own booking");
                        }
                        Mode::ReadThenWrite => {
                            coll.update_one(
                                doc! { "_id": f },
                                doc! { "$pull": { "bookings": { "id": id.as_str() } } },
                            )
                            .await?;
                        }
                    }
                    f
                } else {
                    let f = rand::random_range(0..SHIFTS);
                    let id = docwarden::validate::random_id();
                    let seats = rand::random_range(1..=3_i32);
                    let booking = doc! { "id": id.as_str(), "seats": seats };
                    let booked = match mode {
                        Mode::Guarded => {
                            g.update(f, &Change::push("bookings", booking)?, &inv)
                                .await?
                                == GuardOutcome::Applied
                        }
                        Mode::ReadThenWrite => {
                            let d = coll.find_one(doc! { "_id": f }).await?.unwrap();
                            let sum: i32 = d
                                .get_array("bookings")?
                                .iter()
                                .filter_map(Bson::as_document)
                                .filter_map(|b| b.get_i32("seats").ok())
                                .sum();
                            let fits = sum + seats <= d.get_i32("capacity")?;
                            if fits {
                                tokio::time::sleep(Duration::from_micros(300)).await;
                                coll.update_one(
                                    doc! { "_id": f },
                                    doc! { "$push": { "bookings": booking } },
                                )
                                .await?;
                            }
                            fits
                        }
                    };
                    if booked {
                        applied.fetch_add(1, Ordering::Relaxed);
                        mine.push((f, id));
                    }
                    f
                };
                if !guard::violations_of(&coll, f, &inv).await?.is_empty() {
                    violations.fetch_add(1, Ordering::Relaxed);
                }
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    let end = guard::violations(&coll, &[within_capacity()], None)
        .await?
        .len();
    Ok((
        violations.load(Ordering::Relaxed),
        end,
        applied.load(Ordering::Relaxed),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn capacity_holds_under_8_workers_x_1000_bookings() -> anyhow::Result<()> {
    let t = TestDb::new("guard_capacity").await?;
    let (seen, end, booked) = capacity_workload(t.db.collection("flights"), Mode::Guarded).await?;
    assert!(booked > 100, "the workload booked seats ({booked})");
    assert_eq!(seen, 0, "overbookings observed after operations");
    assert_eq!(end, 0, "overbooked flights at the end");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn capacity_control_read_then_write_overbooks() -> anyhow::Result<()> {
    let t = TestDb::new("guard_capacity_control").await?;
    let (seen, end, _) = capacity_workload(t.db.collection("flights"), Mode::ReadThenWrite).await?;
    eprintln!("control: {seen} overbookings observed, {end} overbooked flights at the end");
    assert!(seen > 0, "the read-then-write control should overbook");
    Ok(())
}

#[tokio::test]
async fn the_validator_refuses_the_seed_bypass_update_with_121() -> anyhow::Result<()> {
    let t = TestDb::new("guard_validator_bypass").await?;
    let coll = t.db.collection::<Document>("shifts");
    coll.insert_many([shift(1, 2), shift(2, 2)]).await?;
    let installed =
        guard::install_validator(&coll, &[on_call()], &ValidatorOptions::default()).await?;
    assert_eq!(
        installed,
        ValidatorInstall::Installed {
            existing_violations: vec![]
        }
    );
    let err = docwarden::Error::from(on_call::seed_bypass(&coll, 1).await.unwrap_err());
    assert!(err.is_validation_failure(), "expected code 121, got {err}");
    let d = coll.find_one(doc! { "_id": 1 }).await?.unwrap();
    assert_eq!(
        doctor_on_call(&d, "doctor0"),
        Some(true),
        "nothing was written"
    );
    // Guarded updates still work under the validator.
    let g = Guarded::new(coll.clone(), GuardOptions::default())?;
    let off = Change::set_member("doctors", "name", "doctor0", doc! { "on_call": false })?;
    assert_eq!(
        g.update(1, &off, &[on_call()]).await?,
        GuardOutcome::Applied
    );
    Ok(())
}

#[tokio::test]
async fn validator_install_lists_existing_violators_and_refuses() -> anyhow::Result<()> {
    let t = TestDb::new("guard_validator_refuse").await?;
    let coll = t.db.collection::<Document>("shifts");
    let mut bad = shift(2, 2);
    bad.insert("doctors", vec![doc! { "name": "x", "on_call": false }]);
    coll.insert_many([shift(1, 2), bad.clone(), doc! { "_id": 3_i64 }])
        .await?;
    let inv = [on_call()];
    let listed = guard::violations(&coll, &inv, None).await?;
    assert_eq!(
        listed.iter().map(|v| v.id.clone()).collect::<Vec<_>>(),
        vec![Bson::Int64(2), Bson::Int64(3)]
    );
    assert_eq!(
        listed[0].invariants,
        vec!["at least one doctor on call".to_owned()]
    );

    let refused = guard::install_validator(&coll, &inv, &ValidatorOptions::default()).await?;
    let ValidatorInstall::Refused { violations } = refused else {
        panic!("expected a refusal, got {refused:?}");
    };
    assert_eq!(violations, listed);
    // Not installed: another violating document is still accepted.
    bad.insert("_id", 4_i64);
    coll.insert_one(bad.clone()).await?;

    let forced = guard::install_validator(
        &coll,
        &inv,
        &ValidatorOptions::default().proceed_despite_violations(true),
    )
    .await?;
    let ValidatorInstall::Installed {
        existing_violations,
    } = forced
    else {
        panic!("expected an install, got {forced:?}");
    };
    assert_eq!(existing_violations.len(), 3);
    bad.insert("_id", 5_i64);
    let err = docwarden::Error::from(coll.insert_one(bad).await.unwrap_err());
    assert!(err.is_validation_failure(), "expected code 121, got {err}");
    Ok(())
}

#[tokio::test]
async fn an_embedded_array_index_is_used_by_the_seed_query() -> anyhow::Result<()> {
    let t = TestDb::new("guard_index").await?;
    let coll = t.db.collection::<Document>("shifts");
    coll.insert_many((0..50).map(|s| shift(s, 3))).await?;
    let name = guard::ensure_array_index(&coll, "doctors.updated").await?;
    assert_eq!(
        guard::ensure_array_index(&coll, "doctors.updated").await?,
        name,
        "idempotent"
    );
    let one_hour_ago = DateTime::from_millis(DateTime::now().timestamp_millis() - 3_600_000);
    let used =
        guard::index_use(&coll, doc! { "doctors.updated": { "$gte": one_hour_ago } }).await?;
    assert_eq!(used, IndexUse::IndexScan { index: name });
    // The check can fail: an unindexed embedded field is a collection scan.
    let unindexed = guard::index_use(&coll, doc! { "doctors.name": "doctor1" }).await?;
    assert_eq!(unindexed, IndexUse::CollectionScan);
    Ok(())
}

// A guarded update of a document that does not exist answers `NotFound` from the update's
// own reply (its filter is `{_id}` alone): one round trip, no explaining read (driver
// command monitoring). Before session 26 it took a diagnosing `aggregate` as well.
#[tokio::test]
async fn a_missing_document_is_answered_by_the_update_alone() -> anyhow::Result<()> {
    let t = TestDb::new("guard_missing_one_round_trip").await?;
    let (client, sent) = docwarden_testkit::counting_client(t.uri()).await?;
    let coll = client
        .database(t.db.name())
        .collection::<Document>("shifts");
    coll.insert_one(shift(1, 2)).await?;
    let g = Guarded::new(coll, GuardOptions::default())?;
    let off = Change::set_member("doctors", "name", "doctor0", doc! { "on_call": false })?;
    sent.take();
    assert_eq!(
        g.update(99, &off, &[on_call()]).await?,
        GuardOutcome::NotFound
    );
    assert_eq!(sent.take(), vec!["update".to_owned()]);
    // A refused change still reads why (the one remaining on call).
    assert_eq!(
        g.update(1, &off, &[on_call()]).await?,
        GuardOutcome::Applied
    );
    sent.take();
    let last = Change::set_member("doctors", "name", "doctor1", doc! { "on_call": false })?;
    assert!(matches!(
        g.update(1, &last, &[on_call()]).await?,
        GuardOutcome::Rejected { .. }
    ));
    assert_eq!(
        sent.take(),
        vec!["update".to_owned(), "aggregate".to_owned()]
    );
    Ok(())
}

// `update_many` gives every outcome `update` gives, in batch order, with one `bulkWrite`
// for the batch (driver command monitoring) and one explaining read per change it kept
// in a document that exists; the documents end as one-by-one updates leave them.
#[tokio::test]
async fn a_batch_gives_each_change_the_outcome_of_its_own_update() -> anyhow::Result<()> {
    let t = TestDb::new("guard_batch_outcomes").await?;
    let hello = t.db.run_command(doc! { "hello": 1 }).await?;
    let bulk = hello.get_i32("maxWireVersion").unwrap_or(0) >= 25;
    let (client, sent) = docwarden_testkit::counting_client(t.uri()).await?;
    let db = client.database(t.db.name());
    let shifts = |on: [bool; 2]| {
        doc! { "doctors": [
            { "name": "Alice", "on_call": on[0] },
            { "name": "Bob", "on_call": on[1] },
        ] }
    };
    let mut outcomes = Vec::new();
    for name in ["batch", "one_by_one"] {
        let coll = db.collection::<Document>(name);
        for (id, on) in [
            (1, [true, true]),
            (2, [true, true]),
            (3, [true, false]),
            (4, [true, true]),
        ] {
            let mut d = shifts(on);
            d.insert("_id", id);
            coll.insert_one(d).await?;
        }
        let off = |who: &str| Change::set_member("doctors", "name", who, doc! { "on_call": false });
        let on = |who: &str| Change::set_member("doctors", "name", who, doc! { "on_call": true });
        let changes = vec![
            (Bson::Int32(1), off("Bob")?),   // applied
            (Bson::Int32(2), on("Bob")?),    // already so
            (Bson::Int32(99), off("Bob")?),  // no such shift
            (Bson::Int32(4), off("Zed")?),   // no such doctor
            (Bson::Int32(3), off("Alice")?), // the last one on call
            (Bson::Int32(1), off("Alice")?), // Bob went off above: now the last one
            (Bson::Int32(4), off("Alice")?), // applied
        ];
        let guarded = Guarded::new(coll.clone(), GuardOptions::default())?;
        sent.take();
        let got = if name == "batch" {
            guarded.update_many(&changes, &[on_call()]).await?
        } else {
            let mut got = Vec::new();
            for (target, change) in &changes {
                got.push(guarded.update(target.clone(), change, &[on_call()]).await?);
            }
            got
        };
        let commands = sent.take();
        if name == "batch" && bulk {
            assert_eq!(
                commands.iter().filter(|c| *c == "bulkWrite").count(),
                1,
                "{commands:?}"
            );
            assert!(!commands.iter().any(|c| c == "update"), "{commands:?}");
            assert_eq!(
                commands.iter().filter(|c| *c == "aggregate").count(),
                4,
                "one explaining read per change not written, none for a missing document: {commands:?}"
            );
        }
        let docs: Vec<Document> = coll
            .find(doc! {})
            .sort(doc! { "_id": 1 })
            .await?
            .try_collect()
            .await?;
        outcomes.push((got, docs));
    }
    if !bulk {
        docwarden_testkit::skip(
            "a_batch_gives_each_change_the_outcome_of_its_own_update (command count)",
            "the server has no bulkWrite command (MongoDB 8.0+)",
        );
    }
    let rejected = GuardOutcome::Rejected {
        invariant: on_call::RULE.to_owned(),
    };
    assert_eq!(
        outcomes[0].0,
        vec![
            GuardOutcome::Applied,
            GuardOutcome::NoChange,
            GuardOutcome::NotFound,
            GuardOutcome::NoSuchMember,
            rejected.clone(),
            rejected,
            GuardOutcome::Applied,
        ]
    );
    assert_eq!(
        outcomes[0].0, outcomes[1].0,
        "the batch's outcomes are the one-by-one outcomes"
    );
    assert_eq!(outcomes[0].1, outcomes[1].1, "and so are the documents");
    Ok(())
}

/// Session 15: the target went into the filter `{_id: target}` as given, so a target that
/// is a query operator document (`{$gt: 0}`, `{$in: [..]}`, say an id taken from a JSON
/// request) applied the change to whichever document matched, and the outcome said
/// `Applied`. Now it is `InvalidInput { what: "target" }` and nothing is written, for
/// `update` and `update_many` alike.
#[tokio::test]
async fn an_operator_document_as_target_changes_nothing() -> anyhow::Result<()> {
    let t = TestDb::new("guard_operator_target").await?;
    let coll = t.db.collection::<Document>("accounts");
    coll.insert_many(vec![
        doc! { "_id": 1, "balance": 10 },
        doc! { "_id": 2, "balance": 10 },
    ])
    .await?;
    let g = Guarded::open(&t.db, "accounts", GuardOptions::default()).await?;
    let nonneg = Invariant::field_cmp("non-negative", "balance", CmpOp::Gte, 0)?;
    let debit = Change::inc("balance", -5)?;
    let invalid = |e: Option<&docwarden::Error>| {
        matches!(
            e,
            Some(docwarden::Error::InvalidInput { what: "target", .. })
        )
    };
    for target in [
        Bson::Document(doc! { "$gt": 0 }),
        Bson::Document(doc! { "$in": [1, 2] }),
        Bson::RegularExpression(mongodb::bson::Regex {
            pattern: "^".into(),
            options: String::new(),
        }),
    ] {
        let one = g
            .update(target.clone(), &debit, std::slice::from_ref(&nonneg))
            .await;
        assert!(invalid(one.as_ref().err()), "update({target}): {one:?}");
        let many = g
            .update_many(
                &[
                    (Bson::Int32(2), debit.clone()),
                    (target.clone(), debit.clone()),
                ],
                std::slice::from_ref(&nonneg),
            )
            .await;
        assert!(
            invalid(many.as_ref().err()),
            "update_many(.., {target}): {many:?}"
        );
    }
    let balances: Vec<i32> = coll
        .find(doc! {})
        .sort(doc! { "_id": 1 })
        .await?
        .try_collect::<Vec<Document>>()
        .await?
        .iter()
        .map(|d| d.get_i32("balance").unwrap())
        .collect();
    assert_eq!(balances, vec![10, 10], "a document was changed");
    Ok(())
}

/// Whether `value` (a pipeline, an expression) contains a `$let` anywhere.
fn binds_a_variable(value: &Bson) -> bool {
    match value {
        Bson::Document(d) => d.iter().any(|(k, v)| k == "$let" || binds_a_variable(v)),
        Bson::Array(a) => a.iter().any(binds_a_variable),
        _ => false,
    }
}

/// Session 16: the update bound the field's new value to a `$let` variable
/// (`dw_value`) and the invariants iterated it. The embedded server copies a `$let`'s
/// variables for every element an iteration inside it visits, so a guarded update of a
/// 1,000-element array cost 70 ms there, against 2.7 ms now (`docs/surrogate.md`). The
/// pipeline now keeps the new and old values side by side in the field between two
/// stages, which is linear on both servers. Only an invariant that reads `$$ROOT` still
/// binds the new document. (Speed is for benchmarks; this checks the shape that caused it.)
#[test]
fn a_guard_pipeline_binds_no_variable_unless_an_invariant_reads_the_root() -> anyhow::Result<()> {
    let invariants = [
        on_call(),
        within_capacity(),
        Invariant::at_most("few", "bookings", 3, Condition::eq("vip", true))?,
        Invariant::field_cmp("non-negative", "balance", CmpOp::Gte, 0)?,
        Invariant::raw(
            "sub-path",
            doc! { "$lte": [{ "$sum": "$bookings.seats" }, 9] },
        )?,
    ];
    let changes = [
        Change::set_member("doctors", "name", "Bob", doc! { "on_call": false })?,
        Change::pull_member("bookings", "id", "a")?,
        Change::push("bookings", doc! { "id": "b", "seats": 2 })?,
        Change::inc("balance", -5)?,
        Change::set("balance", 7)?,
    ];
    for change in &changes {
        let pipeline = Bson::Array(
            change
                .pipeline(&invariants)
                .into_iter()
                .map(Bson::Document)
                .collect(),
        );
        assert!(
            !binds_a_variable(&pipeline),
            "{change:?} binds a variable: {pipeline}"
        );
    }
    let via_root = Invariant::raw("root", doc! { "$lt": ["$$ROOT.balance", 100] })?;
    let bound = changes[3].pipeline(&[via_root]);
    assert!(binds_a_variable(&Bson::Array(
        bound.into_iter().map(Bson::Document).collect()
    )));
    Ok(())
}

/// The two-stage update writes exactly the new value, whatever the stored field holds: an
/// embedded document is replaced, not merged into (a plain object in `$set` would merge);
/// a missing field is created by `push` and `inc`; a field that is not an array has no
/// member to change; and a refused change leaves the field as it was, bytes and all.
#[tokio::test]
async fn a_guarded_update_writes_exactly_the_new_value_whatever_the_field_holds()
-> anyhow::Result<()> {
    let t = TestDb::new("guard_exact_new_value").await?;
    let coll = t.db.collection::<Document>("docs");
    coll.insert_many(vec![
        doc! { "_id": 1, "profile": { "b": 2, "c": [1, 2] }, "z": 1 },
        doc! { "_id": 2, "z": 1 },
        doc! { "_id": 3, "doctors": { "name": "Bob", "on_call": true }, "z": 1 },
        doc! { "_id": 4, "doctors": [{ "name": "Bob", "on_call": true }, 5, [1]], "z": 1 },
    ])
    .await?;
    let g = Guarded::new(coll.clone(), GuardOptions::default())?;
    let any = Invariant::raw("anything", doc! { "$literal": true })?;
    let never = Invariant::raw("never", doc! { "$eq": ["$profile.a", 99] })?;
    let get = |id: i32| {
        let coll = coll.clone();
        async move { coll.find_one(doc! { "_id": id }).await.map(Option::unwrap) }
    };

    let set = Change::set("profile", doc! { "a": 1 })?;
    assert_eq!(
        g.update(1, &set, std::slice::from_ref(&never)).await?,
        GuardOutcome::Rejected {
            invariant: "never".into()
        }
    );
    assert_eq!(
        get(1).await?,
        doc! { "_id": 1, "profile": { "b": 2, "c": [1, 2] }, "z": 1 }
    );
    assert_eq!(
        g.update(1, &set, std::slice::from_ref(&any)).await?,
        GuardOutcome::Applied
    );
    assert_eq!(
        get(1).await?,
        doc! { "_id": 1, "profile": { "a": 1 }, "z": 1 }
    );

    assert_eq!(
        g.update(2, &Change::push("list", 5)?, std::slice::from_ref(&any))
            .await?,
        GuardOutcome::Applied
    );
    assert_eq!(
        g.update(2, &Change::inc("n", 2)?, std::slice::from_ref(&any))
            .await?,
        GuardOutcome::Applied
    );
    assert_eq!(
        get(2).await?,
        doc! { "_id": 2, "z": 1, "list": [5], "n": 2 }
    );

    let off = Change::set_member("doctors", "name", "Bob", doc! { "on_call": false })?;
    assert_eq!(
        g.update(3, &off, std::slice::from_ref(&any)).await?,
        GuardOutcome::NoSuchMember
    );
    assert_eq!(
        get(3).await?,
        doc! { "_id": 3, "doctors": { "name": "Bob", "on_call": true }, "z": 1 }
    );
    assert_eq!(
        g.update(4, &off, &[on_call()]).await?,
        GuardOutcome::Rejected {
            invariant: on_call::RULE.into()
        }
    );
    assert_eq!(
        g.update(4, &off, std::slice::from_ref(&any)).await?,
        GuardOutcome::Applied
    );
    assert_eq!(
        get(4).await?,
        doc! { "_id": 4, "doctors": [{ "name": "Bob", "on_call": false }, 5, [1]], "z": 1 }
    );
    Ok(())
}

/// Session 17: `Invariant::raw` (and `Condition::raw`) took any document, and a rule
/// written in query syntax (`{status: "active"}`, the shape a filter or a validator takes)
/// is an object literal to the aggregation the guard runs: always true. The guard then
/// applied every change (`status: "gone"` was `Applied` under "stays active"), and the
/// validator and the checker built from it accepted every document. Now such a rule is
/// `InvalidInput` when it is built; the expression form guards as it should.
#[tokio::test]
async fn an_invariant_in_query_syntax_is_refused_instead_of_always_holding() -> anyhow::Result<()> {
    let t = TestDb::new("guard_query_syntax").await?;
    let coll = t.db.collection::<Document>("accounts");
    coll.insert_one(doc! { "_id": 1, "status": "active", "balance": 10 })
        .await?;
    let g = Guarded::new(coll.clone(), GuardOptions::default())?;
    let gone = Change::set("status", "gone")?;
    let query_shaped = [
        doc! { "status": "active" },
        doc! { "$and": [{ "status": "active" }, { "balance": { "$gte": 0 } }] },
        doc! { "$eq": ["$status", "active"], "status": "active" },
    ];
    for rule in query_shaped {
        match Invariant::raw("stays active", rule.clone()) {
            Err(docwarden::Error::InvalidInput { what: "expr", .. }) => {}
            Ok(inv) => {
                let outcome = g.update(1, &gone, &[inv]).await;
                panic!(
                    "`{rule}` was accepted as an invariant; setting status to gone: {outcome:?}"
                );
            }
            Err(e) => panic!("`{rule}`: {e}"),
        }
    }
    match Invariant::at_least(
        "someone active",
        "members",
        1,
        Condition::raw(doc! { "active": true }),
    ) {
        Err(docwarden::Error::InvalidInput {
            what: "condition", ..
        }) => {}
        other => panic!("a query-shaped condition was accepted: {other:?}"),
    }
    // The expression form guards.
    let stays = Invariant::raw("stays active", doc! { "$eq": ["$status", "active"] })?;
    assert_eq!(
        g.update(1, &gone, &[stays]).await?,
        GuardOutcome::Rejected {
            invariant: "stays active".into()
        }
    );
    assert_eq!(
        coll.find_one(doc! { "_id": 1 })
            .await?
            .unwrap()
            .get_str("status")?,
        "active"
    );
    Ok(())
}

/// Session 17: an ordering rule against a constant rendered as aggregation's `$gte`
/// alone, which follows the BSON type order: every string, array, document, boolean and
/// date is above every number. So `balance >= 0` let the guard write `balance: "-5"`,
/// `[-5]` or `true` (`Applied`), the validator accepted them, and the checker did not
/// list a hand-edited `balance: "-5"`; `capacity: "10"` (a string) let any booking
/// through `sum_at_most`. MongoDB's query language (`{balance: {$gte: 0}}`) compares
/// within one type bracket; the invariants now do too, in all three places alike.
#[tokio::test]
async fn an_ordering_rule_holds_only_between_values_of_one_type() -> anyhow::Result<()> {
    let t = TestDb::new("guard_type_bracket").await?;
    let coll = t.db.collection::<Document>("accounts");
    coll.insert_many(vec![
        doc! { "_id": 1, "balance": 10 },
        doc! { "_id": 2, "owner": "x" },
    ])
    .await?;
    let g = Guarded::new(coll.clone(), GuardOptions::default())?;
    let nonneg = Invariant::field_cmp("balance never negative", "balance", CmpOp::Gte, 0)?;
    let rejected = GuardOutcome::Rejected {
        invariant: "balance never negative".into(),
    };
    let mut written = Vec::new();
    for value in [
        Bson::String("-5".into()),
        Bson::Array(vec![Bson::Int32(-5)]),
        Bson::Boolean(true),
        Bson::Document(doc! { "amount": -5 }),
        Bson::DateTime(DateTime::from_millis(0)),
        Bson::Null,
    ] {
        let outcome = g
            .update(
                1,
                &Change::set("balance", value.clone())?,
                std::slice::from_ref(&nonneg),
            )
            .await?;
        if outcome != rejected {
            written.push(format!("{value}: {outcome:?}"));
            coll.update_one(doc! { "_id": 1 }, doc! { "$set": { "balance": 10 } })
                .await?;
        }
    }
    assert!(
        written.is_empty(),
        "balance >= 0 let these through: {written:?}"
    );
    // Numbers of every type compare together.
    for value in [Bson::Int64(3), Bson::Double(0.5), Bson::Int32(0)] {
        assert_eq!(
            g.update(
                1,
                &Change::set("balance", value)?,
                std::slice::from_ref(&nonneg)
            )
            .await?,
            GuardOutcome::Applied
        );
    }
    // As in `{balance: {$lte: 100}}`, a missing balance is not at most 100.
    let at_most = Invariant::field_cmp("at most 100", "balance", CmpOp::Lte, 100)?;
    assert_eq!(
        g.update(2, &Change::set("owner", "y")?, &[at_most]).await?,
        GuardOutcome::Rejected {
            invariant: "at most 100".into()
        }
    );

    // The checker finds a hand-edited string balance.
    coll.update_one(doc! { "_id": 1 }, doc! { "$set": { "balance": "-5" } })
        .await?;
    let found = guard::violations(&coll, std::slice::from_ref(&nonneg), None).await?;
    let ids: Vec<&Bson> = found.iter().map(|v| &v.id).collect();
    assert_eq!(ids, [&Bson::Int32(1), &Bson::Int32(2)], "{found:?}");

    // The validator refuses it.
    let ledger = t.db.collection::<Document>("ledger");
    guard::install_validator(&ledger, std::slice::from_ref(&nonneg), &Default::default()).await?;
    let insert = ledger.insert_one(doc! { "_id": 1, "balance": "-5" }).await;
    assert!(
        insert
            .as_ref()
            .is_err_and(|e| docwarden::error::error_code(e) == Some(121)),
        "the validator accepted a string balance: {insert:?}"
    );
    ledger.insert_one(doc! { "_id": 2, "balance": 5.5 }).await?;

    // A capacity stored as a string caps nothing unless it is compared as a number.
    let flights = t.db.collection::<Document>("flights");
    flights
        .insert_one(doc! { "_id": 1, "capacity": "10", "bookings": [] })
        .await?;
    let gf = Guarded::new(flights.clone(), GuardOptions::default())?;
    assert_eq!(
        gf.update(
            1,
            &Change::push("bookings", doc! { "id": "a", "seats": 100 })?,
            &[within_capacity()]
        )
        .await?,
        GuardOutcome::Rejected {
            invariant: "booked seats within capacity".into()
        }
    );
    assert!(matches!(
        Invariant::sum_at_most("cap", "bookings", "seats", "10"),
        Err(docwarden::Error::InvalidInput { what: "cap", .. })
    ));
    Ok(())
}

/// Session 17: `install_validator` ran `collMod` over whatever validator the collection
/// had, so a user's `$jsonSchema` (here: every account needs an owner) was silently
/// dropped and documents it refused were accepted from then on. Now a different validator
/// is reported (`OtherValidator`) and kept unless the caller asks to replace it; the same
/// invariants can be installed again.
#[tokio::test]
async fn installing_the_validator_keeps_a_users_other_validator() -> anyhow::Result<()> {
    let t = TestDb::new("guard_other_validator").await?;
    let users = doc! { "$jsonSchema": { "required": ["owner"] } };
    t.db.run_command(doc! { "create": "shifts", "validator": users.clone() })
        .await?;
    let coll = t.db.collection::<Document>("shifts");
    let rule = [on_call()];
    let outcome = guard::install_validator(&coll, &rule, &ValidatorOptions::default()).await?;
    assert_eq!(
        outcome,
        ValidatorInstall::OtherValidator {
            validator: users.clone()
        }
    );
    let ownerless = coll.insert_one(shift(1, 1)).await;
    assert!(
        ownerless
            .as_ref()
            .is_err_and(|e| docwarden::error::error_code(e) == Some(121)),
        "the user's validator is gone: {ownerless:?}"
    );
    // Asked to, it replaces it; installing the same invariants again is fine.
    let replace = ValidatorOptions::default().replace_other_validator(true);
    for opts in [&replace, &ValidatorOptions::default()] {
        assert!(matches!(
            guard::install_validator(&coll, &rule, opts).await?,
            ValidatorInstall::Installed { .. }
        ));
    }
    coll.insert_one(shift(1, 1)).await?;
    Ok(())
}

/// Session 17: `Change::inc` renders as aggregation's `$add`, which answers a sum that
/// leaves the 64-bit range as a double: a guarded `+1` on `i64::MAX` was `Applied` and
/// stored `9.223372036854776e18`, silently rounding the counter (and every later `+1` a
/// no-op), where MongoDB's `$inc` refuses the write. Now such an increment is
/// `InvalidInput { what: "by" }` and the counter keeps its long; an int that overflows 32
/// bits still becomes a long, and doubles add as doubles.
#[tokio::test]
async fn an_integer_inc_that_leaves_the_64_bit_range_is_refused_not_rounded() -> anyhow::Result<()>
{
    let t = TestDb::new("guard_inc_overflow").await?;
    let coll = t.db.collection::<Document>("counters");
    coll.insert_many(vec![
        doc! { "_id": 1, "n": i64::MAX },
        doc! { "_id": 2, "n": i64::MIN },
        doc! { "_id": 3, "n": i32::MAX },
        doc! { "_id": 4, "n": 1.5 },
        doc! { "_id": 5, "n": 1_i32 },
    ])
    .await?;
    let g = Guarded::new(coll.clone(), GuardOptions::default())?;
    let any = [Invariant::raw("anything", doc! { "$literal": true })?];
    let refused = |r: &docwarden::Result<GuardOutcome>| {
        matches!(r, Err(docwarden::Error::InvalidInput { what: "by", .. }))
    };
    let up = g.update(1, &Change::inc("n", 1_i64)?, &any).await;
    assert!(refused(&up), "i64::MAX + 1: {up:?}");
    let up = g.update(1, &Change::inc("n", 1_i32)?, &any).await;
    assert!(refused(&up), "i64::MAX + 1 (int): {up:?}");
    let down = g.update(2, &Change::inc("n", -1_i64)?, &any).await;
    assert!(refused(&down), "i64::MIN - 1: {down:?}");
    let big = g.update(5, &Change::inc("n", i64::MAX)?, &any).await;
    assert!(refused(&big), "1 + i64::MAX: {big:?}");
    for (id, by) in [
        (3, Bson::Int32(1)),
        (4, Bson::Int32(1)),
        (1, Bson::Int64(-1)),
    ] {
        assert_eq!(
            g.update(id, &Change::inc("n", by)?, &any).await?,
            GuardOutcome::Applied
        );
    }
    let n: Vec<Bson> = coll
        .find(doc! {})
        .sort(doc! { "_id": 1 })
        .await?
        .try_collect::<Vec<Document>>()
        .await?
        .iter()
        .map(|d| d.get("n").cloned().unwrap())
        .collect();
    assert_eq!(
        n,
        [
            Bson::Int64(i64::MAX - 1),
            Bson::Int64(i64::MIN),
            Bson::Int64(i64::from(i32::MAX) + 1),
            Bson::Double(2.5),
            Bson::Int32(1),
        ]
    );
    Ok(())
}

/// Session 17: `update_many` fails the whole call on the first change that fails, and the
/// outcomes of the changes the bulk wrote with it are lost: here the `+5` on account 2
/// is written, yet the caller only sees the error of account 1's overflowing `inc` and
/// cannot tell (sending the batch again adds 5 twice). `update_each` answers each
/// change's own result, and sends every change. Also pinned: a change the bulk refused
/// is explained after the whole batch, so one that a later change of the batch made
/// acceptable is applied after it (Bob off call once Alice is on).
#[tokio::test]
async fn a_batch_reports_each_changes_own_result_when_one_fails() -> anyhow::Result<()> {
    let t = TestDb::new("guard_batch_each").await?;
    let coll = t.db.collection::<Document>("accounts");
    coll.insert_many(vec![
        doc! { "_id": 1, "n": i64::MAX },
        doc! { "_id": 2, "n": 0_i64 },
        doc! { "_id": 3, "n": 0_i64 },
    ])
    .await?;
    let g = Guarded::new(coll.clone(), GuardOptions::default())?;
    let any = [Invariant::raw("anything", doc! { "$literal": true })?];
    let batch = vec![
        (Bson::Int32(2), Change::inc("n", 5_i64)?),
        (Bson::Int32(1), Change::inc("n", 1_i64)?),
        (Bson::Int32(3), Change::inc("n", 5_i64)?),
    ];
    let n = |id: i32| {
        let coll = coll.clone();
        async move {
            anyhow::Ok(
                coll.find_one(doc! { "_id": id })
                    .await?
                    .unwrap()
                    .get_i64("n")?,
            )
        }
    };
    let many = g.update_many(&batch, &any).await;
    assert!(
        matches!(many, Err(docwarden::Error::InvalidInput { what: "by", .. })),
        "{many:?}"
    );
    assert_eq!(n(2).await?, 5, "written, though the call failed");

    let each = g.update_each(&batch, &any).await?;
    assert_eq!(each.len(), 3);
    assert!(matches!(each[0], Ok(GuardOutcome::Applied)), "{each:?}");
    assert!(
        matches!(
            each[1],
            Err(docwarden::Error::InvalidInput { what: "by", .. })
        ),
        "{each:?}"
    );
    assert!(matches!(each[2], Ok(GuardOutcome::Applied)), "{each:?}");
    assert_eq!((n(1).await?, n(2).await?), (i64::MAX, 10));

    // Decided after the batch: Bob's refusal is explained once Alice is on call.
    let shifts = t.db.collection::<Document>("shifts");
    shifts
        .insert_one(doc! { "_id": 1, "doctors": [
            { "name": "Alice", "on_call": false },
            { "name": "Bob", "on_call": true },
        ]})
        .await?;
    let gs = Guarded::new(shifts.clone(), GuardOptions::default())?;
    let set =
        |who: &str, on: bool| Change::set_member("doctors", "name", who, doc! { "on_call": on });
    let got = gs
        .update_each(
            &[
                (Bson::Int32(1), set("Bob", false)?),
                (Bson::Int32(1), set("Alice", true)?),
            ],
            &[on_call()],
        )
        .await?;
    let hello = t.db.run_command(doc! { "hello": 1 }).await?;
    if hello.get_i32("maxWireVersion").unwrap_or(0) >= 25 {
        assert!(
            matches!(
                got[..],
                [Ok(GuardOutcome::Applied), Ok(GuardOutcome::Applied)]
            ),
            "{got:?}"
        );
    } else {
        // One update at a time (no bulkWrite): decided in batch order.
        assert!(
            matches!(
                got[..],
                [Ok(GuardOutcome::Rejected { .. }), Ok(GuardOutcome::Applied)]
            ),
            "{got:?}"
        );
    }
    assert!(
        guard::violations(&shifts, &[on_call()], None)
            .await?
            .is_empty()
    );
    Ok(())
}

/// Session 17: a raw invariant that reads a field with `$getField` (MongoDB's way to read
/// a field whose name holds a dot or starts with `$`) without an `input` reads the current
/// document, which the update's rewrite of `$field` paths did not see: between the two
/// stages it read the `{new, old}` pair (an object, above every number, so `balance >=
/// 0` held and a debit to -10 was `Applied`), and bound to `$$ROOT` it read the stored
/// value. Such an invariant now binds the new document and `$getField` reads it.
#[tokio::test]
async fn a_get_field_invariant_checks_the_new_value() -> anyhow::Result<()> {
    let t = TestDb::new("guard_get_field").await?;
    let coll = t.db.collection::<Document>("accounts");
    coll.insert_one(doc! { "_id": 1, "balance": 10, "limit.eur": 5 })
        .await?;
    let g = Guarded::new(coll.clone(), GuardOptions::default())?;
    let debit = Change::inc("balance", -20)?;
    let short = Invariant::raw(
        "short form",
        doc! { "$gte": [{ "$getField": "balance" }, 0] },
    )?;
    let long = Invariant::raw(
        "long form",
        doc! { "$gte": [{ "$getField": { "field": "balance" } }, 0] },
    )?;
    let dotted = Invariant::raw(
        "dotted name",
        doc! { "$gte": ["$balance", { "$multiply": [-1, { "$getField": { "$literal": "limit.eur" } }] }] },
    )?;
    for inv in [short, long] {
        assert_eq!(
            g.update(1, &debit, std::slice::from_ref(&inv)).await?,
            GuardOutcome::Rejected {
                invariant: inv.name().to_owned()
            }
        );
    }
    // Reading another field by a dotted name: -5 is within the limit, -15 is not.
    assert_eq!(
        g.update(
            1,
            &Change::inc("balance", -15)?,
            std::slice::from_ref(&dotted)
        )
        .await?,
        GuardOutcome::Applied
    );
    assert_eq!(
        g.update(
            1,
            &Change::inc("balance", -10)?,
            std::slice::from_ref(&dotted)
        )
        .await?,
        GuardOutcome::Rejected {
            invariant: "dotted name".into()
        }
    );
    assert_eq!(
        coll.find_one(doc! { "_id": 1 })
            .await?
            .unwrap()
            .get_i32("balance")?,
        -5
    );
    Ok(())
}

/// Session 18: `Change::inc` counted a stored null as 0 (`$ifNull`) and wrote a number,
/// added a number to a date as milliseconds, and failed on a string or a boolean with a
/// bare database error (`$add`'s code 16554), where MongoDB's `$inc` refuses every
/// non-numeric field, null included (code 14; asserted here against the server). Now the
/// guard refuses them alike with `InvalidInput { what: "field" }`, nothing written; a
/// missing field still counts as 0.
#[tokio::test]
async fn an_inc_of_a_field_that_is_not_a_number_is_refused_as_mongodb_inc_refuses_it()
-> anyhow::Result<()> {
    let t = TestDb::new("guard_inc_not_a_number").await?;
    let coll = t.db.collection::<Document>("counters");
    let stored = vec![
        doc! { "_id": 1, "n": Bson::Null },
        doc! { "_id": 2, "n": "5" },
        doc! { "_id": 3, "n": DateTime::from_millis(0) },
        doc! { "_id": 4, "n": true },
        doc! { "_id": 5, "n": [1] },
    ];
    coll.insert_many(stored.clone()).await?;
    coll.insert_one(doc! { "_id": 6 }).await?;
    let g = Guarded::new(coll.clone(), GuardOptions::default())?;
    let any = [Invariant::raw("anything", doc! { "$literal": true })?];
    let mut wrong = Vec::new();
    for d in &stored {
        let id = d.get("_id").cloned().unwrap();
        // MongoDB's own $inc refuses the field.
        let raw = coll
            .update_one(doc! { "_id": id.clone() }, doc! { "$inc": { "n": 2 } })
            .await;
        assert_eq!(
            raw.as_ref().err().and_then(docwarden::error::error_code),
            Some(14),
            "{d}: {raw:?}"
        );
        for by in [Bson::Int32(2), Bson::Int64(0), Bson::Double(0.5)] {
            let got = g
                .update(id.clone(), &Change::inc("n", by.clone())?, &any)
                .await;
            if !matches!(
                got,
                Err(docwarden::Error::InvalidInput { what: "field", .. })
            ) {
                wrong.push(format!("{d} + {by}: {got:?}"));
            }
        }
        let each = g
            .update_each(
                &[
                    (id.clone(), Change::inc("n", 1)?),
                    (Bson::Int32(6), Change::inc("m", 1)?),
                ],
                &any,
            )
            .await?;
        if !matches!(
            each[..],
            [
                Err(docwarden::Error::InvalidInput { what: "field", .. }),
                Ok(GuardOutcome::Applied)
            ]
        ) {
            wrong.push(format!("{d} in a batch: {each:?}"));
        }
    }
    assert!(wrong.is_empty(), "not refused as $inc refuses: {wrong:#?}");
    let now: Vec<Document> = coll
        .find(doc! { "_id": { "$lte": 5 } })
        .sort(doc! { "_id": 1 })
        .await?
        .try_collect()
        .await?;
    assert_eq!(now, stored, "nothing written");
    // A missing field counts as 0, as with $inc.
    assert_eq!(
        g.update(6, &Change::inc("n", 2)?, &any).await?,
        GuardOutcome::Applied
    );
    assert_eq!(
        coll.find_one(doc! { "_id": 6 }).await?.unwrap(),
        doc! { "_id": 6, "m": 5, "n": 2 }
    );
    Ok(())
}

/// Session 18: a raw rule with an operator that is not an aggregation expression (a typo
/// such as `$frobnicate`, a query operator such as `$exists`, anywhere inside it) was
/// accepted when built, and every update using it failed with a bare database error
/// (code 168); on the embedded server the validator built from it was even installed.
/// Now it is `InvalidInput` when built, naming the rule and the key. An operator MongoDB
/// documents but the server does not know (`$toUUID` before 8.0, and on the embedded
/// server) passes the build and the server's refusal is `InvalidInput { what:
/// "invariant" }` naming the rule, from the update, a batch and the checker.
#[tokio::test]
async fn an_unknown_operator_in_a_raw_rule_is_invalid_input_naming_the_rule() -> anyhow::Result<()>
{
    let t = TestDb::new("guard_unknown_operator").await?;
    let coll = t.db.collection::<Document>("accounts");
    coll.insert_one(doc! { "_id": 1, "balance": 10, "name": "a" })
        .await?;
    let g = Guarded::new(coll.clone(), GuardOptions::default())?;
    let bad = [
        doc! { "$frobnicate": ["$balance", 0] },
        doc! { "$gte": [{ "$frobnicate": "$balance" }, 0] },
        doc! { "$and": [{ "$exists": ["$balance", true] }] },
        doc! { "$gt": [{ "$size": { "$filter": {
            "input": "$items", "as": "i", "cond": { "$elemMatch": { "x": 1 } },
        }}}, 0] },
        doc! { "$gte": [{ "$abs": "$balance", "extra": 1 }, 0] },
        doc! { "$eq": [{ "$regex": "^a" }, "$name"] },
    ];
    let mut accepted = Vec::new();
    for expr in bad {
        match Invariant::raw("my rule", expr.clone()) {
            Err(docwarden::Error::InvalidInput {
                what: "expr",
                reason,
            }) if reason.contains("my rule") => {}
            Ok(inv) => {
                let got = g
                    .update(1, &Change::inc("balance", -1)?, std::slice::from_ref(&inv))
                    .await;
                accepted.push(format!("{expr}: built, update {got:?}"));
            }
            Err(e) => accepted.push(format!("{expr}: {e}")),
        }
    }
    let cond = Condition::raw(doc! { "$eq": [{ "$frobnicate": "$$elem.x" }, 1] });
    match Invariant::at_least("elem rule", "items", 1, cond) {
        Err(docwarden::Error::InvalidInput {
            what: "condition",
            reason,
        }) if reason.contains("elem rule") => {}
        other => accepted.push(format!("condition: {other:?}")),
    }
    assert!(accepted.is_empty(), "{accepted:#?}");
    // `$literal` contents are data, and `$$`-variables and plain keys are not operators.
    Invariant::raw(
        "literal",
        doc! { "$ne": ["$name", { "$literal": { "$frobnicate": 1 } }] },
    )?;

    // Documented, but perhaps not known to this server: typed either way.
    let newer = Invariant::raw(
        "uuid rule",
        doc! { "$ne": [
            { "$toUUID": { "$literal": "0e3b9063-8abd-4eb3-9f9f-f4c59fd30a60" } },
            { "$concat": ["$name", "-"] },
        ] },
    )?;
    let names_rule = |r: &docwarden::Error| matches!(r, docwarden::Error::InvalidInput { what: "invariant", reason } if reason.contains("uuid rule") && reason.contains("$toUUID"));
    let nonneg = Invariant::field_cmp("non-negative", "balance", CmpOp::Gte, 0)?;
    let rules = [nonneg, newer];
    let one = g.update(1, &Change::set("name", "b")?, &rules).await;
    let each = g
        .update_each(
            &[
                (Bson::Int32(1), Change::set("name", "c")?),
                (Bson::Int32(1), Change::set("name", "d")?),
            ],
            &rules,
        )
        .await?;
    let checked = guard::violations(&coll, &rules, None).await;
    if std::env::var_os("MONGODB_URI").is_none() {
        // The embedded server does not know `$toUUID`: the refusal is what is tested.
        assert!(one.is_err(), "the embedded server ran $toUUID: {one:?}");
    }
    match &one {
        // The server knows `$toUUID` (MongoDB 8.0+): the rule holds.
        Ok(_) => {}
        Err(e) => {
            assert!(names_rule(e), "update: {e}");
            for r in &each {
                assert!(r.as_ref().is_err_and(names_rule), "batch: {r:?}");
            }
            assert!(
                checked.as_ref().is_err_and(names_rule),
                "checker: {checked:?}"
            );
        }
    }
    Ok(())
}

/// Session 18: the diagnosing read compared the new value with the stored one by `$eq`,
/// for which `5.0 == NumberLong(5)`. A change to an equal value of another type is
/// written when the rules hold (`$set` writes the double: `Applied`), but on a document
/// that already broke a rule the pipeline kept the long and the outcome was `NoChange`,
/// though the stored type had not become the one asked for. Now "same" is byte for byte:
/// that change is `Rejected` by the broken rule; only an identical value is `NoChange`.
#[tokio::test]
async fn a_set_of_an_equal_value_of_another_type_is_a_change_not_no_change() -> anyhow::Result<()> {
    let t = TestDb::new("guard_same_typed").await?;
    let coll = t.db.collection::<Document>("accounts");
    let broken = doc! {
        "_id": 1, "n": 5_i64, "balance": -1, "profile": { "a": 5_i64 },
        "doctors": [{ "name": "Bob", "shifts": 5_i64 }],
    };
    coll.insert_many(vec![
        broken.clone(),
        doc! { "_id": 2, "n": 5_i64, "balance": 1 },
    ])
    .await?;
    let g = Guarded::new(coll.clone(), GuardOptions::default())?;
    let nonneg = [Invariant::field_cmp(
        "non-negative",
        "balance",
        CmpOp::Gte,
        0,
    )?];
    let rejected = GuardOutcome::Rejected {
        invariant: "non-negative".into(),
    };
    for change in [
        Change::set("n", 5.0)?,
        Change::set("n", 5_i32)?,
        Change::set("profile", doc! { "a": 5.0 })?,
        Change::set_member("doctors", "name", "Bob", doc! { "shifts": 5.0 })?,
    ] {
        assert_eq!(g.update(1, &change, &nonneg).await?, rejected, "{change:?}");
    }
    assert_eq!(
        coll.find_one(doc! { "_id": 1 }).await?.unwrap(),
        broken,
        "nothing written"
    );
    // The identical value is no change, whatever the rules say.
    assert_eq!(
        g.update(1, &Change::set("n", 5_i64)?, &nonneg).await?,
        GuardOutcome::NoChange
    );
    // Where the rules hold, the new type is written; then it is the same.
    assert_eq!(
        g.update(2, &Change::set("n", 5.0)?, &nonneg).await?,
        GuardOutcome::Applied
    );
    assert_eq!(
        coll.find_one(doc! { "_id": 2 }).await?.unwrap().get("n"),
        Some(&Bson::Double(5.0))
    );
    assert_eq!(
        g.update(2, &Change::set("n", 5.0)?, &nonneg).await?,
        GuardOutcome::NoChange
    );
    Ok(())
}

/// Session 18: `install_validator` listed the violators, then ran `collMod`; a violating
/// document written in between was in the collection, unreported, with the validator
/// answering `Installed { existing_violations: [] }`. Here `collMod` is held for 3 s
/// (a `failCommand` `blockConnection` on the installer's connection alone) while another
/// client writes a violator. Now the violators are listed again once the validator is in
/// place: without proceeding the answer is `Refused` with it and the collection has no
/// validator again; proceeding, `Installed` lists it.
#[tokio::test]
async fn a_violator_written_while_the_validator_installs_is_reported() -> anyhow::Result<()> {
    let _fail_point = FAIL_POINT.lock().await;
    let t = TestDb::new("guard_validator_gap").await?;
    let Some(_) = docwarden_testkit::fail_point_client(
        &t,
        "a_violator_written_while_the_validator_installs_is_reported",
    )
    .await?
    else {
        return Ok(());
    };
    let installer = docwarden_testkit::app_client(&t, "guard-slow-collmod").await?;
    let inv = [on_call()];
    let mut bad = shift(0, 1);
    bad.insert("doctors", vec![doc! { "name": "x", "on_call": false }]);
    // Round 3: the collection had a user's validator, level and action of its own, which
    // the caller asked to replace; refused, they are put back as they were.
    let users = doc! { "$jsonSchema": { "required": ["doctors"] } };
    for (round, proceed) in [(1_i64, false), (2, true), (3, false)] {
        let name = format!("shifts{round}");
        let coll = t.db.collection::<Document>(&name);
        if round == 3 {
            t.db.run_command(doc! {
                "create": &name,
                "validator": users.clone(),
                "validationLevel": "moderate",
                "validationAction": "warn",
            })
            .await?;
        }
        coll.insert_one(shift(1, 2)).await?;
        t.client
            .database("admin")
            .run_command(doc! {
                "configureFailPoint": "failCommand",
                "mode": { "times": 1 },
                "data": {
                    "failCommands": ["collMod"],
                    "blockConnection": true,
                    "blockTimeMS": 3_000,
                    "appName": "guard-slow-collmod",
                },
            })
            .await?;
        let theirs = installer
            .database(t.db.name())
            .collection::<Document>(&name);
        let opts = ValidatorOptions::default()
            .proceed_despite_violations(proceed)
            .replace_other_validator(round == 3);
        let rules = inv.clone();
        let install =
            tokio::spawn(async move { guard::install_validator(&theirs, &rules, &opts).await });
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        bad.insert("_id", 2_i64);
        coll.insert_one(bad.clone()).await?;
        let got = install.await??;
        let violators = match &got {
            ValidatorInstall::Refused { violations } if !proceed => violations,
            ValidatorInstall::Installed {
                existing_violations,
            } if proceed => existing_violations,
            other => panic!("round {round}: {other:?}"),
        };
        assert_eq!(
            violators.iter().map(|v| v.id.clone()).collect::<Vec<_>>(),
            vec![Bson::Int64(2)],
            "round {round}: {got:?}"
        );
        bad.insert("_id", 3_i64);
        let third = coll.insert_one(bad.clone()).await;
        if proceed {
            assert!(
                third
                    .as_ref()
                    .is_err_and(|e| docwarden::error::error_code(e) == Some(121)),
                "installed: {third:?}"
            );
        } else {
            assert!(third.is_ok(), "the previous validator is back: {third:?}");
        }
        let spec =
            t.db.run_command(doc! { "listCollections": 1, "filter": { "name": &name } })
                .await?;
        let options = spec
            .get_document("cursor")?
            .get_array("firstBatch")?
            .first()
            .and_then(Bson::as_document)
            .map(|c| c.get_document("options").cloned().unwrap_or_default())
            .unwrap_or_default();
        let validator = options
            .get_document("validator")
            .ok()
            .filter(|v| !v.is_empty());
        match round {
            1 => assert_eq!(validator, None, "{options}"),
            2 => assert_eq!(
                validator,
                Some(&guard::validator_document(&inv)),
                "{options}"
            ),
            _ => {
                assert_eq!(validator, Some(&users), "{options}");
                assert_eq!(options.get_str("validationLevel")?, "moderate", "{options}");
                assert_eq!(options.get_str("validationAction")?, "warn", "{options}");
            }
        }
    }
    Ok(())
}

/// Session 18 (review): `Change::push` appended to `{$ifNull: ["$F", []]}`, so a stored
/// null was taken for an empty array and replaced by `[element]` (`Applied`), and a
/// string or a document failed the update with a bare database error (`$concatArrays`);
/// MongoDB's `$push` refuses every field that is not an array (code 2, asserted here
/// against the server). Now the guard refuses them alike with `InvalidInput { what:
/// "field" }`, nothing written; a missing field still becomes `[element]`.
#[tokio::test]
async fn a_push_onto_a_field_that_is_not_an_array_is_refused_as_mongodb_push_refuses_it()
-> anyhow::Result<()> {
    let t = TestDb::new("guard_push_not_an_array").await?;
    let coll = t.db.collection::<Document>("flights");
    let stored = vec![
        doc! { "_id": 1, "capacity": 10, "bookings": Bson::Null },
        doc! { "_id": 2, "capacity": 10, "bookings": "none" },
        doc! { "_id": 3, "capacity": 10, "bookings": { "id": "a", "seats": 1 } },
        doc! { "_id": 4, "capacity": 10, "bookings": 0 },
    ];
    coll.insert_many(stored.clone()).await?;
    coll.insert_one(doc! { "_id": 5, "capacity": 10 }).await?;
    let g = Guarded::new(coll.clone(), GuardOptions::default())?;
    let booking = doc! { "id": "b", "seats": 1 };
    let mut wrong = Vec::new();
    for d in &stored {
        let id = d.get("_id").cloned().unwrap();
        let raw = coll
            .update_one(
                doc! { "_id": id.clone() },
                doc! { "$push": { "bookings": booking.clone() } },
            )
            .await;
        assert!(raw.is_err(), "MongoDB's $push accepted {d}: {raw:?}");
        let got = g
            .update(
                id.clone(),
                &Change::push("bookings", booking.clone())?,
                &[within_capacity()],
            )
            .await;
        if !matches!(
            got,
            Err(docwarden::Error::InvalidInput { what: "field", .. })
        ) {
            wrong.push(format!("{d}: {got:?}"));
        }
    }
    assert!(wrong.is_empty(), "not refused as $push refuses: {wrong:#?}");
    let now: Vec<Document> = coll
        .find(doc! { "_id": { "$lte": 4 } })
        .sort(doc! { "_id": 1 })
        .await?
        .try_collect()
        .await?;
    assert_eq!(now, stored, "nothing written");
    assert_eq!(
        g.update(
            5,
            &Change::push("bookings", booking.clone())?,
            &[within_capacity()]
        )
        .await?,
        GuardOutcome::Applied
    );
    assert_eq!(
        coll.find_one(doc! { "_id": 5 }).await?.unwrap(),
        doc! { "_id": 5, "capacity": 10, "bookings": [booking] }
    );
    Ok(())
}

/// Session 18 (review): `violations_of(coll, id, …)` put `id` into `{_id: id}` as given,
/// so an operator document (`{$gt: 0}`, say an id taken from a JSON request) or a regex
/// answered with the broken rules of some *other* document, as if they were this one's.
/// `Guarded::update` refuses such targets since session 15; the per-document check now
/// does too, with `InvalidInput { what: "id" }`.
#[tokio::test]
async fn the_check_of_one_document_refuses_an_operator_document_as_its_id() -> anyhow::Result<()> {
    let t = TestDb::new("guard_check_operator_id").await?;
    let coll = t.db.collection::<Document>("accounts");
    coll.insert_many(vec![
        doc! { "_id": 1, "balance": 10 },
        doc! { "_id": 2, "balance": -5 },
    ])
    .await?;
    let nonneg = [Invariant::field_cmp(
        "non-negative",
        "balance",
        CmpOp::Gte,
        0,
    )?];
    assert_eq!(
        guard::violations_of(&coll, 2, &nonneg).await?,
        vec!["non-negative".to_owned()]
    );
    assert!(guard::violations_of(&coll, 1, &nonneg).await?.is_empty());
    for id in [
        Bson::Document(doc! { "$gt": 0 }),
        Bson::Document(doc! { "$ne": 1 }),
        Bson::RegularExpression(mongodb::bson::Regex {
            pattern: "^".into(),
            options: String::new(),
        }),
    ] {
        let got = guard::violations_of(&coll, id.clone(), &nonneg).await;
        assert!(
            matches!(got, Err(docwarden::Error::InvalidInput { what: "id", .. })),
            "violations_of({id}): {got:?}"
        );
    }
    Ok(())
}

/// Session 18 (review): `ensure_array_index` asked for the index under its default name
/// (`doctors.updated_1`), and the server refuses a second index of the same keys under
/// another name (code 85, `IndexOptionsConflict`, on MongoDB and the embedded server
/// alike): on a collection where a DBA had created the index as `by_update`, the
/// "idempotent" ensure failed with a bare database error. Now the existing plain index is
/// the index; a partial one on the same keys still fails (it does not serve every query).
#[tokio::test]
async fn ensuring_an_array_index_accepts_the_same_index_under_another_name() -> anyhow::Result<()> {
    let t = TestDb::new("guard_index_other_name").await?;
    let coll = t.db.collection::<Document>("shifts");
    coll.insert_many((0..5).map(|s| shift(s, 3))).await?;
    coll.create_index(
        mongodb::IndexModel::builder()
            .keys(doc! { "doctors.updated": 1 })
            .options(
                mongodb::options::IndexOptions::builder()
                    .name("by_update".to_owned())
                    .build(),
            )
            .build(),
    )
    .await?;
    let got = guard::ensure_array_index(&coll, "doctors.updated").await;
    assert!(
        matches!(got.as_deref(), Ok("by_update")),
        "ensure_array_index: {got:?}"
    );
    let one_hour_ago = DateTime::from_millis(DateTime::now().timestamp_millis() - 3_600_000);
    assert_eq!(
        guard::index_use(&coll, doc! { "doctors.updated": { "$gte": one_hour_ago } }).await?,
        IndexUse::IndexScan {
            index: "by_update".into()
        }
    );
    // Keys written as a double (the legacy shell's `1.0`) are the same keys.
    coll.create_index(
        mongodb::IndexModel::builder()
            .keys(doc! { "doctors.on_call": 1.0 })
            .options(
                mongodb::options::IndexOptions::builder()
                    .name("on_call_dbl".to_owned())
                    .build(),
            )
            .build(),
    )
    .await?;
    let dbl = guard::ensure_array_index(&coll, "doctors.on_call").await;
    assert!(matches!(dbl.as_deref(), Ok("on_call_dbl")), "{dbl:?}");
    // A partial index on the same keys is not the index.
    coll.create_index(
        mongodb::IndexModel::builder()
            .keys(doc! { "doctors.name": 1 })
            .options(
                mongodb::options::IndexOptions::builder()
                    .name("some_names".to_owned())
                    .partial_filter_expression(doc! { "doctors.name": "doctor1" })
                    .build(),
            )
            .build(),
    )
    .await?;
    let partial = guard::ensure_array_index(&coll, "doctors.name").await;
    assert!(
        !matches!(partial.as_deref(), Ok("some_names")),
        "a partial index was taken for the index: {partial:?}"
    );
    Ok(())
}

/// Session 18 (review): `install_validator` on a collection that does not exist yet sends
/// `create`; when another process creates the collection first (two services installing
/// their validator at start-up, or one inserting its first document), `create` fails with
/// code 48 (`NamespaceExists`) and the install failed with a bare database error. Here the
/// installer's `create` is held (a `failCommand` `blockConnection` on its `appName`) while
/// another client creates the collection. Now the install reads the collection's options
/// again and installs with `collMod`.
#[tokio::test]
async fn installing_a_validator_while_someone_creates_the_collection_installs_it()
-> anyhow::Result<()> {
    let _fail_point = FAIL_POINT.lock().await;
    let t = TestDb::new("guard_validator_create_race").await?;
    let Some(_) = docwarden_testkit::fail_point_client(
        &t,
        "installing_a_validator_while_someone_creates_the_collection_installs_it",
    )
    .await?
    else {
        return Ok(());
    };
    let installer = docwarden_testkit::app_client(&t, "guard-slow-create").await?;
    t.client
        .database("admin")
        .run_command(doc! {
            "configureFailPoint": "failCommand",
            "mode": { "times": 1 },
            "data": {
                "failCommands": ["create"],
                "blockConnection": true,
                "blockTimeMS": 2_500,
                "appName": "guard-slow-create",
            },
        })
        .await?;
    let theirs = installer
        .database(t.db.name())
        .collection::<Document>("shifts");
    let install = tokio::spawn(async move {
        guard::install_validator(&theirs, &[on_call()], &ValidatorOptions::default()).await
    });
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    t.db.create_collection("shifts").await?;
    let got = install.await?;
    assert!(
        matches!(
            got,
            Ok(ValidatorInstall::Installed { ref existing_violations }) if existing_violations.is_empty()
        ),
        "{got:?}"
    );
    let coll = t.db.collection::<Document>("shifts");
    let bypass = coll
        .insert_one(doc! { "_id": 1, "doctors": [{ "name": "a", "on_call": false }] })
        .await;
    assert!(
        bypass
            .as_ref()
            .is_err_and(|e| docwarden::error::error_code(e) == Some(121)),
        "the validator is in place: {bypass:?}"
    );
    Ok(())
}
