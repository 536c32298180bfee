//! Sequenced updates against the real server: any order, any duplication, one document.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use docwarden::Error;
use docwarden::sequence::{
    ApplyOutcome, FieldsOptions, SequencedFields, SequencedSet, SetOp, SetOptions,
};
use docwarden_testkit::TestDb;
use docwarden_workloads::enrollment;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};
use proptest::prelude::*;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

const CONSUMERS: usize = 8;
const MEMBERS: [&str; 4] = ["CS 101", "MATH 2", "$cash", "a.b@c.d"];

/// One enroll (`present`) or unenroll message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Op {
    member: usize,
    seq: i64,
    present: bool,
}

/// The model: apply the history one by one in sequence order (at equal seq the add first,
/// so the remove wins) and keep, per member, the last state.
fn model(ops: &[Op]) -> BTreeMap<String, (i64, bool)> {
    let mut sorted = ops.to_vec();
    sorted.sort_by_key(|o| (o.seq, !o.present));
    let mut state = BTreeMap::new();
    for o in sorted {
        state.insert(MEMBERS[o.member].to_owned(), (o.seq, o.present));
    }
    state
}

fn present(model: &BTreeMap<String, (i64, bool)>) -> BTreeSet<String> {
    model
        .iter()
        .filter(|(_, (_, p))| *p)
        .map(|(m, _)| m.clone())
        .collect()
}

/// Every op delivered 1–3 times, shuffled.
fn deliveries(ops: &[Op], rng: &mut StdRng) -> Vec<Op> {
    let mut out = Vec::new();
    for o in ops {
        for _ in 0..rand::Rng::random_range(rng, 1..=3) {
            out.push(*o);
        }
    }
    out.shuffle(rng);
    out
}

/// `CONSUMERS` tasks take messages from a shared queue and apply them with `apply`;
/// returns the outcome of every delivery.
async fn consume<F, Fut>(messages: Vec<Op>, apply: F) -> anyhow::Result<Vec<(Op, ApplyOutcome)>>
where
    F: Fn(Op) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<ApplyOutcome>> + Send,
{
    let queue = Arc::new(Mutex::new(messages));
    let apply = Arc::new(apply);
    let mut tasks = Vec::new();
    for _ in 0..CONSUMERS {
        let queue = Arc::clone(&queue);
        let apply = Arc::clone(&apply);
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            loop {
                let next = queue.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.pop();
                let Some(op) = next else { break };
                seen.push((op, apply(op).await?));
            }
            anyhow::Ok(seen)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok(all)
}

async fn student_set(t: &TestDb) -> anyhow::Result<SequencedSet> {
    Ok(enrollment::open_set(t.db.collection("students")).await?)
}

/// Runs one history through `CONSUMERS` racing consumers on `key` and returns the number
/// of violations: wrong final state, wrong present list, more than one document, or a
/// message applied twice.
async fn run_history(set: &SequencedSet, key: i64, ops: &[Op], seed: u64) -> anyhow::Result<u64> {
    let mut rng = StdRng::seed_from_u64(seed);
    let msgs = deliveries(ops, &mut rng);
    let s = set.clone();
    let outcomes = consume(msgs, move |o| {
        let s = s.clone();
        async move {
            let m = MEMBERS[o.member];
            Ok(if o.present {
                s.add(key, m, o.seq).await?
            } else {
                s.remove(key, m, o.seq).await?
            })
        }
    })
    .await?;
    violations_of(set, key, ops, outcomes).await
}

/// Small sequence numbers (gaps, ties and re-deliveries are frequent), and now and then one
/// next to `i64::MAX` (session 16: the pipelines compare, never add; a number there must
/// order as any other, above every small one).
fn op_strategy() -> impl Strategy<Value = Op> {
    let seq = prop_oneof![4 => 0_i64..12, 1 => (i64::MAX - 3)..=i64::MAX];
    (0..MEMBERS.len(), seq, any::<bool>()).prop_map(|(member, seq, present)| Op {
        member,
        seq,
        present,
    })
}

#[test]
fn any_order_and_duplication_by_8_consumers_equals_the_sequential_model() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()?;
    let t = rt.block_on(TestDb::new("sequence_proptest"))?;
    let set = rt.block_on(student_set(&t))?;
    let next_key = std::sync::atomic::AtomicI64::new(0);
    let config = ProptestConfig {
        cases: 28,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(config, |(ops in prop::collection::vec(op_strategy(), 1..16), seed in any::<u64>())| {
        let key = next_key.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let violations = rt.block_on(run_history(&set, key, &ops, seed))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(violations, 0);
    });
    drop(set);
    rt.block_on(async move { drop(t) });
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seed_insert_delete_insert_applied_as_1_3_2_keeps_the_last_insert() -> anyhow::Result<()> {
    let t = TestDb::new("sequence_seed_132").await?;
    let set = student_set(&t).await?;
    assert_eq!(set.add(1, "CS 101", 1).await?, ApplyOutcome::Applied);
    assert_eq!(set.add(1, "CS 101", 3).await?, ApplyOutcome::Applied);
    assert_eq!(set.remove(1, "CS 101", 2).await?, ApplyOutcome::Stale);
    assert_eq!(set.members(1).await?, Some(vec!["CS 101".to_owned()]));
    // Every permutation of the three, each delivered twice, ends the same way.
    let ops = [(1_i64, true), (2, false), (3, true)];
    let perms = [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ];
    for (i, p) in perms.iter().enumerate() {
        let key = 100 + i64::try_from(i)?;
        for round in 0..2 {
            for &j in p {
                let (seq, add) = ops[j];
                let o = if add {
                    set.add(key, "CS 101", seq).await?
                } else {
                    set.remove(key, "CS 101", seq).await?
                };
                if round == 1 {
                    assert_ne!(o, ApplyOutcome::Applied, "a duplicate must not apply");
                }
            }
        }
        assert_eq!(
            set.members(key).await?,
            Some(vec!["CS 101".to_owned()]),
            "{p:?}"
        );
    }
    // Control: the seed's two updates in the same order lose the insert or split the
    // student into two documents.
    let coll: Collection<Document> = t.db.collection("seed_students");
    enrollment::seed_apply(&coll, 1, "CS 101", 1, true).await?;
    enrollment::seed_apply(&coll, 1, "CS 101", 3, true).await?;
    enrollment::seed_apply(&coll, 1, "CS 101", 2, false).await?;
    let (docs, diverged) = seed_check(&coll, 1, &BTreeSet::from(["CS 101".to_owned()])).await?;
    assert!(
        docs > 1 || diverged,
        "the seed's approach should fail 1,3,2"
    );
    Ok(())
}

/// (documents for the student, whether their classes differ from `expected`), from the
/// workload's final read.
async fn seed_check(
    coll: &Collection<Document>,
    student: i64,
    expected: &BTreeSet<String>,
) -> anyhow::Result<(u64, bool)> {
    let read = enrollment::final_read(coll).await?;
    let classes = read.classes.get(&student).cloned().unwrap_or_default();
    Ok((
        read.documents.get(&student).copied().unwrap_or(0),
        &classes != expected,
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_the_seed_two_update_upsert_diverges_or_duplicates() -> anyhow::Result<()> {
    // The same harness as the property test, with the seed's updates instead.
    let t = TestDb::new("sequence_seed_control").await?;
    let coll: Collection<Document> = t.db.collection("seed_students");
    let set = student_set(&t).await?; // the same histories through docwarden, as a check
    let mut seed_duplicates = 0;
    let mut seed_diverged = 0;
    let mut ours = 0;
    let mut rng = StdRng::seed_from_u64(1);
    for key in 0..16_i64 {
        let ops: Vec<Op> = (0..10)
            .map(|_| Op {
                member: rand::Rng::random_range(&mut rng, 0..2),
                seq: rand::Rng::random_range(&mut rng, 0..1000),
                present: rand::Rng::random_bool(&mut rng, 0.5),
            })
            .collect();
        let msgs = deliveries(&ops, &mut rng);
        let c = coll.clone();
        consume(msgs, move |o| {
            let c = c.clone();
            async move { enrollment::seed_apply(&c, key, MEMBERS[o.member], o.seq, o.present).await }
        })
        .await?;
        let (docs, diverged) = seed_check(&coll, key, &present(&model(&ops))).await?;
        seed_duplicates += docs.saturating_sub(1);
        seed_diverged += u64::from(diverged);
        ours += run_history(&set, key, &ops, rand::Rng::random(&mut rng)).await?;
    }
    eprintln!("seed: {seed_duplicates} duplicate documents, {seed_diverged} diverged students");
    assert!(
        seed_duplicates + seed_diverged > 0,
        "the control must show the seed's flaw"
    );
    assert_eq!(ours, 0, "docwarden must converge on the same histories");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_one_document_per_key_when_8_consumers_race_to_create_it() -> anyhow::Result<()> {
    let t = TestDb::new("sequence_create_race").await?;
    let set = student_set(&t).await?;
    let by_id = SequencedSet::open(&t.db, "by_id", SetOptions::default()).await?;
    let seed_coll: Collection<Document> = t.db.collection("seed");
    let keys = 20_i64;
    let mut seed_docs = 0;
    for key in 0..keys {
        let barrier = Arc::new(tokio::sync::Barrier::new(CONSUMERS));
        let mut tasks = Vec::new();
        for c in 0..CONSUMERS {
            let (set, by_id, seed_coll, barrier) = (
                set.clone(),
                by_id.clone(),
                seed_coll.clone(),
                Arc::clone(&barrier),
            );
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let member = format!("class {}", c % 4); // pairs deliver the same message
                let seq = i64::try_from(c % 4)?;
                let a = set.add(key, &member, seq).await?;
                let b = by_id.add(key, &member, seq).await?;
                enrollment::seed_apply(&seed_coll, key, &member, seq, true).await?;
                anyhow::Ok([a, b])
            }));
        }
        let mut applied = 0;
        for task in tasks {
            applied += task
                .await??
                .iter()
                .filter(|o| **o == ApplyOutcome::Applied)
                .count();
        }
        assert_eq!(
            applied, 8,
            "each of the 4 messages applied once per collection"
        );
        assert_eq!(
            set.collection()
                .count_documents(doc! { "student_id": key })
                .await?,
            1
        );
        assert_eq!(
            by_id
                .collection()
                .count_documents(doc! { "_id": key })
                .await?,
            1
        );
        assert_eq!(set.members(key).await?.map(|m| m.len()), Some(4));
        seed_docs += seed_coll
            .count_documents(doc! { "student_id": key })
            .await?;
    }
    assert_eq!(set.collection().count_documents(doc! {}).await?, 20);
    // Control: the seed's upsert, racing the same duplicated messages, makes extra students.
    eprintln!("seed: {seed_docs} documents for {keys} students");
    assert!(seed_docs > u64::try_from(keys)?);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sequence_numbers_names_and_keys_are_validated() -> anyhow::Result<()> {
    let t = TestDb::new("sequence_validation").await?;
    let set = SequencedSet::open(&t.db, "s", SetOptions::default()).await?;
    let fields = SequencedFields::open(&t.db, "f", FieldsOptions::default()).await?;
    let invalid = |r: docwarden::Result<ApplyOutcome>| matches!(r, Err(Error::InvalidInput { .. }));
    assert!(invalid(set.add(1, "a", -1).await));
    assert!(invalid(set.remove(1, "a", i64::MIN).await));
    assert!(invalid(set.add(1, "", 1).await));
    assert!(invalid(set.add(1, "a\0", 1).await));
    assert!(invalid(set.add("", "a", 1).await));
    assert!(invalid(set.add(Bson::Null, "a", 1).await));
    assert!(invalid(set.add(doc! { "$gt": 1 }, "a", 1).await));
    assert!(invalid(fields.set(1, "a", 1, -5).await));
    for bad in ["", "$set", "a.b", "_id", "_seq", "_seq_x"] {
        assert!(invalid(fields.set(1, bad, 1, 1).await), "{bad:?}");
    }
    assert!(matches!(
        set.compact(1, -1).await,
        Err(Error::InvalidInput { .. })
    ));
    for bad in ["", "$x", "a.b", "_seq"] {
        assert!(
            SequencedSet::new(t.db.collection("s2"), SetOptions::default().field(bad)).is_err()
        );
    }
    assert!(
        SequencedSet::open(&t.db, "s3", SetOptions::default().key_field("k").field("k"))
            .await
            .is_err()
    );
    // Nothing was written by refused calls.
    assert_eq!(set.collection().count_documents(doc! {}).await?, 0);
    assert_eq!(fields.collection().count_documents(doc! {}).await?, 0);
    // Members are values: `$` and `.` are stored exactly as given, never interpreted.
    assert_eq!(set.add(1, "$cash", 0).await?, ApplyOutcome::Applied);
    assert_eq!(set.add(1, "a.b@c.d", 0).await?, ApplyOutcome::Applied);
    assert_eq!(set.add(1, "$classes", 1).await?, ApplyOutcome::Applied);
    for odd in ["0", "100%", "%2E", "_seq", "_id"] {
        assert_eq!(set.add(1, odd, 1).await?, ApplyOutcome::Applied, "{odd}");
        assert_eq!(set.add(1, odd, 1).await?, ApplyOutcome::Duplicate, "{odd}");
        assert_eq!(set.remove(1, odd, 1).await?, ApplyOutcome::Applied, "{odd}");
    }
    let mut m = set.members(1).await?.unwrap_or_default();
    m.sort();
    assert_eq!(m, ["$cash", "$classes", "a.b@c.d"]);
    let mut states: Vec<(String, i64, bool)> = set
        .states(1)
        .await?
        .unwrap_or_default()
        .into_iter()
        .map(|s| (s.member, s.seq, s.present))
        .collect();
    states.sort();
    let want: Vec<(String, i64, bool)> = [
        ("$cash", 0, true),
        ("$classes", 1, true),
        ("%2E", 1, false),
        ("0", 1, false),
        ("100%", 1, false),
        ("_id", 1, false),
        ("_seq", 1, false),
        ("a.b@c.d", 0, true),
    ]
    .into_iter()
    .map(|(m, s, p)| (m.to_owned(), s, p))
    .collect();
    assert_eq!(states, want);
    assert_eq!(set.remove(1, "$cash", 2).await?, ApplyOutcome::Applied);
    assert_eq!(set.add(1, "$cash", 0).await?, ApplyOutcome::Stale);
    // Values too: a `$`-string is a value, not a field path.
    assert_eq!(
        fields.set("k", "name", "$name", 1).await?,
        ApplyOutcome::Applied
    );
    assert_eq!(
        fields.get("k", "name").await?,
        Some((Bson::from("$name"), 1))
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outcomes_and_the_equal_seq_rules() -> anyhow::Result<()> {
    let t = TestDb::new("sequence_outcomes").await?;
    let set = student_set(&t).await?;
    assert_eq!(set.remove(7, "X", 5).await?, ApplyOutcome::Applied); // remove before add
    assert_eq!(set.add(7, "X", 4).await?, ApplyOutcome::Stale);
    assert_eq!(set.remove(7, "X", 5).await?, ApplyOutcome::Duplicate);
    assert_eq!(set.add(7, "X", 5).await?, ApplyOutcome::Stale); // remove wins at equal seq
    assert_eq!(set.add(7, "X", 6).await?, ApplyOutcome::Applied);
    assert_eq!(set.add(7, "X", 6).await?, ApplyOutcome::Duplicate);
    assert_eq!(set.remove(7, "X", 6).await?, ApplyOutcome::Applied); // …in either order
    assert_eq!(set.members(7).await?, Some(vec![]));

    let f = SequencedFields::open(
        &t.db,
        "profiles",
        FieldsOptions::default().key_field("student_id"),
    )
    .await?;
    assert_eq!(f.set(1, "name", "Jane", 3).await?, ApplyOutcome::Applied);
    assert_eq!(f.set(1, "name", "John", 2).await?, ApplyOutcome::Stale);
    assert_eq!(f.set(1, "name", "Jane", 3).await?, ApplyOutcome::Duplicate);
    let address = doc! { "city": "Oslo", "zip": "0150", "$weird": "no" };
    let address = {
        let mut a = address;
        a.remove("$weird");
        a
    };
    assert_eq!(
        f.set(1, "address", address.clone(), 1).await?,
        ApplyOutcome::Applied
    );
    assert_eq!(
        f.get(1, "address").await?,
        Some((Bson::Document(address), 1))
    );
    // Equal seq, different values: the greater value wins whatever the order.
    for (key, order) in [(10, [5, 7]), (11, [7, 5])] {
        for v in order {
            f.set(key, "score", v, 9).await?;
        }
        assert_eq!(f.get(key, "score").await?, Some((Bson::Int32(7), 9)));
    }
    // 7 (int64) equals 7 (int32) in MongoDB's order; the tie key (the encoding, type
    // included) decides: the int64 is longer, so it wins whatever the order.
    assert_eq!(f.set(10, "score", 7_i64, 9).await?, ApplyOutcome::Applied);
    assert_eq!(f.set(11, "score", 7_i64, 9).await?, ApplyOutcome::Applied);
    assert_eq!(f.set(11, "score", 7_i32, 9).await?, ApplyOutcome::Stale);
    assert_eq!(f.set(10, "score", 7_i64, 9).await?, ApplyOutcome::Duplicate);
    assert_eq!(f.get(10, "score").await?, Some((Bson::Int64(7), 9)));
    assert_eq!(f.get(99, "score").await?, None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registers_converge_under_8_consumers() -> anyhow::Result<()> {
    let t = TestDb::new("sequence_registers").await?;
    let f = SequencedFields::open(&t.db, "profiles", FieldsOptions::default()).await?;
    let mut rng = StdRng::seed_from_u64(5);
    for key in 0..8_i64 {
        // Distinct seqs per field; values are sub-documents and strings derived from seq.
        let ops: Vec<Op> = (0..12_i64)
            .map(|seq| Op {
                member: rand::Rng::random_range(&mut rng, 0..2),
                seq: seq * 3 + rand::Rng::random_range(&mut rng, 0..3),
                present: rand::Rng::random_bool(&mut rng, 0.5),
            })
            .collect();
        let value = |o: Op| -> Bson {
            if o.present {
                Bson::Document(doc! { "seq": o.seq, "note": format!("${}", o.seq) })
            } else {
                Bson::String(format!("v{}", o.seq))
            }
        };
        let msgs = deliveries(&ops, &mut rng);
        let f2 = f.clone();
        let outcomes = consume(msgs, move |o| {
            let f = f2.clone();
            async move { Ok(f.set(key, ["a", "b"][o.member], value(o), o.seq).await?) }
        })
        .await?;
        for member in 0..2 {
            let last = ops
                .iter()
                .filter(|o| o.member == member)
                .max_by_key(|o| o.seq);
            let got = f.get(key, ["a", "b"][member]).await?;
            assert_eq!(
                got,
                last.map(|o| (value(*o), o.seq)),
                "key {key} field {member}"
            );
        }
        let mut applied: HashMap<Op, u32> = HashMap::new();
        for (op, o) in outcomes {
            if o == ApplyOutcome::Applied {
                *applied.entry(op).or_default() += 1;
            }
        }
        assert!(applied.values().all(|n| *n == 1));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn compaction_removes_only_tombstones_below_the_watermark() -> anyhow::Result<()> {
    let t = TestDb::new("sequence_compaction").await?;
    let set = student_set(&t).await?;
    set.add(1, "a", 1).await?;
    set.remove(1, "a", 2).await?;
    set.add(1, "b", 3).await?;
    set.remove(1, "b", 5).await?;
    set.add(1, "c", 4).await?;
    set.remove(1, "d", 3).await?;
    let r = set.compact(1, 4).await?;
    assert_eq!((r.matched, r.modified), (1, 1));
    let mut states: Vec<(String, i64, bool)> = set
        .states(1)
        .await?
        .unwrap_or_default()
        .into_iter()
        .map(|s| (s.member, s.seq, s.present))
        .collect();
    states.sort();
    assert_eq!(
        states,
        [("b".into(), 5, false), ("c".into(), 4, true)],
        "tombstones a@2 and d@3 go, b@5 (not below 4) and the present c@4 stay"
    );
    // Later operations (seq >= watermark) still converge.
    assert_eq!(set.add(1, "a", 6).await?, ApplyOutcome::Applied);
    assert_eq!(set.add(1, "b", 4).await?, ApplyOutcome::Stale); // the b@5 tombstone still wins
    assert_eq!(set.remove(1, "c", 4).await?, ApplyOutcome::Applied); // remove wins the tie
    // A message below the watermark breaks the caller's promise; it is refused, so a
    // compacted member is not resurrected.
    assert_eq!(set.add(1, "d", 1).await?, ApplyOutcome::Stale);
    let mut m = set.members(1).await?.unwrap_or_default();
    m.sort();
    assert_eq!(m, ["a"]);
    // A lower watermark never lowers the floor.
    set.compact(1, 2).await?;
    assert_eq!(set.add(1, "d", 3).await?, ApplyOutcome::Stale);

    // Over the collection, interleaved with racing consumers delivering everything at or
    // above the watermark: every student ends at the model.
    let watermark = 6;
    let mut rng = StdRng::seed_from_u64(9);
    let mut histories = Vec::new();
    for key in 100..112_i64 {
        let ops: Vec<Op> = (0..12)
            .map(|_| Op {
                member: rand::Rng::random_range(&mut rng, 0..3),
                seq: rand::Rng::random_range(&mut rng, 0..12),
                present: rand::Rng::random_bool(&mut rng, 0.4),
            })
            .collect();
        for o in ops.iter().filter(|o| o.seq < watermark) {
            if o.present {
                set.add(key, MEMBERS[o.member], o.seq).await?;
            } else {
                set.remove(key, MEMBERS[o.member], o.seq).await?;
            }
        }
        histories.push((key, ops));
    }
    let later: Vec<(i64, Op)> = histories
        .iter()
        .flat_map(|(k, ops)| ops.iter().filter(|o| o.seq >= watermark).map(|o| (*k, *o)))
        .collect();
    let s = set.clone();
    let compactor = tokio::spawn(async move { s.compact_all(watermark).await });
    let s = set.clone();
    let keyed: Vec<Op> = later
        .iter()
        .map(|(k, o)| Op {
            member: o.member + 4 * usize::try_from(*k).unwrap_or(0),
            ..*o
        })
        .collect();
    let mut keyed = deliveries(&keyed, &mut rng);
    keyed.shuffle(&mut rng);
    consume(keyed, move |o| {
        let s = s.clone();
        async move {
            let key = i64::try_from(o.member / 4)?;
            let m = MEMBERS[o.member % 4];
            Ok(if o.present {
                s.add(key, m, o.seq).await?
            } else {
                s.remove(key, m, o.seq).await?
            })
        }
    })
    .await?;
    compactor.await??;
    for (key, ops) in &histories {
        let expected: BTreeMap<String, (i64, bool)> = model(ops)
            .into_iter()
            .filter(|(_, (seq, p))| *p || *seq >= watermark)
            .collect();
        let got: BTreeMap<String, (i64, bool)> = set
            .states(*key)
            .await?
            .unwrap_or_default()
            .into_iter()
            .map(|s| (s.member, (s.seq, s.present)))
            .collect();
        // A tombstone below the watermark may survive if compaction ran before it was
        // superseded... it cannot: all ops below the watermark were applied first.
        assert_eq!(got, expected, "key {key}");
        let members: BTreeSet<String> = set
            .members(*key)
            .await?
            .unwrap_or_default()
            .into_iter()
            .collect();
        assert_eq!(members, present(&model(ops)), "key {key}");
    }
    Ok(())
}

/// The stored document of `filter` without the fields in `strip` (the key, which differs
/// between runs), as the exact bytes the server returned: key order and BSON types count.
async fn stored_bytes(
    coll: &Collection<Document>,
    filter: Document,
    strip: &[&str],
) -> anyhow::Result<Vec<u8>> {
    let mut d = coll
        .find_one(filter.clone())
        .await?
        .ok_or_else(|| anyhow::anyhow!("no document for {filter}"))?;
    for s in strip {
        d.remove(*s);
    }
    let mut bytes = Vec::new();
    d.to_writer(&mut bytes)?;
    Ok(bytes)
}

/// The document as text for failure messages (types shown by extended JSON).
async fn shown(coll: &Collection<Document>, filter: Document) -> anyhow::Result<String> {
    let d = coll.find_one(filter).await?.unwrap_or_default();
    Ok(Bson::Document(d).into_canonical_extjson().to_string())
}

// Finding 4 of issue 11: set `X`'s floor field was `_seq_X_floor`, which is set
// `X_floor`'s state field; set `last`'s state was the outcome marker `_seq_last`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sets_whose_names_extend_each_other_never_share_a_field() -> anyhow::Result<()> {
    let t = TestDb::new("sequence_set_names").await?;
    let coll: Collection<Document> = t.db.collection("c");
    let x = SequencedSet::open(&t.db, "c", SetOptions::default().field("X")).await?;
    let x_floor = SequencedSet::open(&t.db, "c", SetOptions::default().field("X_floor")).await?;
    let last = SequencedSet::open(&t.db, "c", SetOptions::default().field("last")).await?;
    assert_eq!(x_floor.add(1, "a", 1).await?, ApplyOutcome::Applied);
    assert_eq!(
        x.add(1, "b", 1).await?,
        ApplyOutcome::Applied,
        "set X after set X_floor: {}",
        shown(&coll, doc! { "_id": 1 }).await?
    );
    assert_eq!(x.compact(1, 2).await?.matched, 1);
    assert_eq!(
        x_floor.add(1, "c", 2).await?,
        ApplyOutcome::Applied,
        "set X_floor after compacting X"
    );
    assert_eq!(
        x.add(1, "d", 2).await?,
        ApplyOutcome::Applied,
        "set X after compacting X"
    );
    assert_eq!(x_floor.compact(1, 2).await?.matched, 1);
    assert_eq!(
        x.add(1, "e", 2).await?,
        ApplyOutcome::Applied,
        "X after compacting X_floor"
    );
    assert_eq!(
        x.add(1, "z", 1).await?,
        ApplyOutcome::Stale,
        "below X's own floor"
    );
    assert_eq!(
        x_floor.add(1, "y", 1).await?,
        ApplyOutcome::Stale,
        "below X_floor's floor"
    );
    // Already in effect (present entries survive compaction): a duplicate, floor or not.
    assert_eq!(
        x.add(1, "b", 1).await?,
        ApplyOutcome::Duplicate,
        "b@1 again"
    );
    let sorted = |m: Option<Vec<String>>| {
        let mut m = m.unwrap_or_default();
        m.sort();
        m
    };
    assert_eq!(sorted(x.members(1).await?), ["b", "d", "e"]);
    assert_eq!(sorted(x_floor.members(1).await?), ["a", "c"]);
    // A set named `last` next to the others.
    let r = last.add(1, "m", 1).await;
    assert!(
        matches!(r, Ok(ApplyOutcome::Applied)),
        "set `last`: {r:?}: {}",
        shown(&coll, doc! { "_id": 1 }).await?
    );
    assert_eq!(last.add(1, "m", 1).await?, ApplyOutcome::Duplicate);
    assert_eq!(
        x.add(1, "f", 3).await?,
        ApplyOutcome::Applied,
        "X after set `last`"
    );
    assert_eq!(sorted(last.members(1).await?), ["m"]);
    assert_eq!(sorted(x.members(1).await?), ["b", "d", "e", "f"]);
    Ok(())
}

// Finding 7 of issue 11: at equal sequence numbers the stored type was whichever value came
// first, and the set's members array order and `_seq_last` followed the delivery order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn equal_seq_values_of_different_types_store_one_document_for_every_order()
-> anyhow::Result<()> {
    let t = TestDb::new("sequence_tie_types").await?;
    let f = SequencedFields::open(&t.db, "profiles", FieldsOptions::default()).await?;
    let writes: Vec<(&str, Bson, i64)> = vec![
        ("score", Bson::Int32(7), 9),
        ("score", Bson::Int64(7), 9),
        ("score", Bson::Double(7.0), 9),
        ("shape", Bson::Document(doc! { "a": 1_i32 }), 4),
        ("shape", Bson::Document(doc! { "a": 1.0_f64 }), 4),
        ("shape", Bson::Document(doc! { "a": 1_i64 }), 4),
        ("name", Bson::String("Jane".to_owned()), 2),
    ];
    let orders: Vec<Vec<usize>> = vec![
        vec![0, 1, 2, 3, 4, 5, 6],
        vec![6, 5, 4, 3, 2, 1, 0],
        vec![2, 0, 4, 6, 1, 3, 5],
        vec![1, 1, 5, 3, 6, 0, 2, 4, 2, 6],
    ];
    let mut docs = Vec::new();
    for (key, order) in orders.iter().enumerate() {
        let key = i64::try_from(key)?;
        for &i in order {
            let (field, value, seq) = &writes[i];
            f.set(key, field, value.clone(), *seq).await?;
        }
        docs.push((
            order,
            stored_bytes(f.collection(), doc! { "_id": key }, &["_id"]).await?,
            shown(f.collection(), doc! { "_id": key }).await?,
        ));
    }
    for (order, bytes, text) in &docs[1..] {
        assert!(
            *bytes == docs[0].1,
            "registers: order {order:?} stored {text}, order {:?} stored {}",
            docs[0].0,
            docs[0].2
        );
    }

    // The registers' document: top-level fields sorted by name after `_id`.
    let stored = f
        .collection()
        .find_one(doc! { "_id": 0 })
        .await?
        .unwrap_or_default();
    let keys: Vec<&String> = stored.keys().collect();
    let mut sorted_keys = keys.clone();
    sorted_keys[1..].sort();
    assert_eq!(keys[0], "_id");
    assert_eq!(keys, sorted_keys, "{stored}");
    assert_eq!(stored.get("score"), Some(&Bson::Int64(7)), "{stored}");
    assert_eq!(
        stored.get("shape"),
        Some(&Bson::Document(doc! { "a": 1_i64 })),
        "{stored}"
    );

    // A set: the same members through different orders, duplicates and equal numbers.
    let set = SequencedSet::open(&t.db, "students", SetOptions::default()).await?;
    let ops = [
        ("CS 101", 1, true),
        ("MATH 2", 2, true),
        ("$cash", 2, true),
        ("MATH 2", 2, false),
        ("a.b@c.d", 3, true),
        ("CS 101", 3, true),
    ];
    let orders: Vec<Vec<usize>> = vec![
        vec![0, 1, 2, 3, 4, 5],
        vec![5, 4, 3, 2, 1, 0],
        vec![4, 2, 0, 5, 3, 1, 1],
        vec![3, 3, 5, 0, 1, 2, 4],
    ];
    let mut docs = Vec::new();
    for (key, order) in orders.iter().enumerate() {
        let key = i64::try_from(key)?;
        for &i in order {
            let (member, seq, add) = ops[i];
            if add {
                set.add(key, member, seq).await?;
            } else {
                set.remove(key, member, seq).await?;
            }
        }
        docs.push((
            order,
            stored_bytes(set.collection(), doc! { "_id": key }, &["_id"]).await?,
            shown(set.collection(), doc! { "_id": key }).await?,
        ));
    }
    // The canonical order is the binary order of the strings (Rust's `str` order).
    let members = set.members(0).await?.unwrap_or_default();
    let mut sorted = members.clone();
    sorted.sort();
    assert_eq!(members, sorted, "members sorted");
    let stored = set
        .collection()
        .find_one(doc! { "_id": 0 })
        .await?
        .unwrap_or_default();
    let keys: Vec<String> = stored
        .get_document("_seq_sets")?
        .get_document("members")?
        .get_document("state")?
        .keys()
        .cloned()
        .collect();
    let mut sorted_keys = keys.clone();
    sorted_keys.sort();
    assert_eq!(keys.len(), 4, "{stored}");
    assert_eq!(keys, sorted_keys, "state entries sorted by member key");
    for (order, bytes, text) in &docs[1..] {
        assert!(
            *bytes == docs[0].1,
            "set: order {order:?} stored {text}, order {:?} stored {}",
            docs[0].0,
            docs[0].2
        );
    }
    Ok(())
}

/// A register write in the race proptest: field 0 or 1, one of the equal-but-differently
/// typed values, a sequence number from a small range (so numbers repeat).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Write {
    field: usize,
    value: usize,
    seq: i64,
}

/// The tie key as docs/sequence.md defines it, written independently of the library.
fn tie_bytes(value: &Bson) -> Vec<u8> {
    let mut encoded = Vec::new();
    if doc! { "v": value.clone() }.to_writer(&mut encoded).is_err() {
        return Vec::new();
    }
    let mut key = u32::try_from(encoded.len())
        .unwrap_or(u32::MAX)
        .to_be_bytes()
        .to_vec();
    key.extend(encoded);
    key
}

/// The rank of `tie_value(i)`'s type class in MongoDB's comparison order.
fn bson_class(i: usize) -> u8 {
    match i {
        0..=2 => 0,
        3..=5 => 2,
        _ => 1,
    }
}

fn tie_value(i: usize) -> Bson {
    match i {
        0 => Bson::Int32(7),
        1 => Bson::Int64(7),
        2 => Bson::Double(7.0),
        3 => Bson::Document(doc! { "a": 1_i32 }),
        4 => Bson::Document(doc! { "a": 1.0_f64 }),
        5 => Bson::Document(doc! { "a": 1_i64 }),
        _ => Bson::String("7".to_owned()),
    }
}

/// Runs `ops` (sets) and `writes` (registers) `RUNS` times, each delivery shuffled,
/// duplicated and raced by `CONSUMERS` consumers on its own key, and returns how many runs
/// stored a document different (in bytes, `_id` aside) from the first run's.
async fn race_equal_numbers(
    set: &SequencedSet,
    fields: &SequencedFields,
    case: i64,
    ops: &[Op],
    writes: &[Write],
    seed: u64,
    check_models: bool,
) -> anyhow::Result<u64> {
    const RUNS: i64 = 3;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut set_docs = Vec::new();
    let mut field_docs = Vec::new();
    for run in 0..RUNS {
        let key = case * RUNS + run;
        let history_seed = rand::Rng::random(&mut rng);
        if !ops.is_empty() {
            let violations = run_history(set, key, ops, history_seed).await?;
            anyhow::ensure!(
                !check_models || violations == 0,
                "set run {run}: {violations} violations"
            );
            set_docs.push((
                stored_bytes(
                    set.collection(),
                    doc! { "student_id": key },
                    &["_id", "student_id"],
                )
                .await?,
                shown(set.collection(), doc! { "student_id": key }).await?,
            ));
        }
        let mut msgs = Vec::new();
        for w in writes {
            for _ in 0..rand::Rng::random_range(&mut rng, 1..=3) {
                msgs.push(Op {
                    member: w.field * 16 + w.value,
                    seq: w.seq,
                    present: true,
                });
            }
        }
        msgs.shuffle(&mut rng);
        let f = fields.clone();
        consume(msgs, move |o| {
            let f = f.clone();
            async move {
                let field = ["a", "b"][o.member / 16];
                Ok(f.set(key, field, tie_value(o.member % 16), o.seq).await?)
            }
        })
        .await?;
        for (field, name) in ["a", "b"].into_iter().enumerate().filter(|_| check_models) {
            // The model: the greatest (seq, value in BSON order, tie key) wins; the tie key
            // is the value's BSON encoding `{v: value}` with a big-endian length prefix
            // (docs/sequence.md). The values here are all equal within their BSON type
            // class: numbers < strings < documents.
            let winner = writes
                .iter()
                .filter(|w| w.field == field)
                .max_by_key(|w| (w.seq, bson_class(w.value), tie_bytes(&tie_value(w.value))))
                .map(|w| (tie_value(w.value), w.seq));
            let got = fields.get(key, name).await?;
            anyhow::ensure!(
                got == winner,
                "register {name} of run {run}: {got:?}, the model says {winner:?}"
            );
        }
        if !writes.is_empty() {
            field_docs.push((
                stored_bytes(fields.collection(), doc! { "_id": key }, &["_id"]).await?,
                shown(fields.collection(), doc! { "_id": key }).await?,
            ));
        }
    }
    let mut differing = 0;
    for (what, docs) in [("set", &set_docs), ("registers", &field_docs)] {
        for (bytes, text) in docs.iter().skip(1) {
            if *bytes != docs[0].0 {
                eprintln!("{what}: {text} != {}", docs[0].1);
                differing += 1;
            }
        }
    }
    Ok(differing)
}

#[test]
fn equal_numbers_raced_by_8_consumers_store_identical_documents() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()?;
    let t = rt.block_on(TestDb::new("sequence_equal_numbers"))?;
    let set = rt.block_on(student_set(&t))?;
    let fields = rt.block_on(SequencedFields::open(
        &t.db,
        "profiles",
        FieldsOptions::default(),
    ))?;
    let next_case = std::sync::atomic::AtomicI64::new(0);
    let config = ProptestConfig {
        cases: 16,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let ops = prop::collection::vec(
        (0..MEMBERS.len(), 0_i64..4, any::<bool>()).prop_map(|(member, seq, present)| Op {
            member,
            seq,
            present,
        }),
        1..14,
    );
    let writes = prop::collection::vec(
        (0_usize..2, 0_usize..7, 0_i64..3).prop_map(|(field, value, seq)| Write {
            field,
            value,
            seq,
        }),
        1..10,
    );
    proptest!(config, |(ops in ops, writes in writes, seed in any::<u64>())| {
        let case = next_case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let differing = rt.block_on(race_equal_numbers(&set, &fields, case, &ops, &writes, seed, true))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(differing, 0, "stored documents differ between deliveries");
    });
    drop((set, fields));
    rt.block_on(async move { drop(t) });
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_without_canonical_order_or_tie_keys_documents_differ() -> anyhow::Result<()> {
    // The race above with docwarden's own code and one safeguard switched off each time:
    // the members array unsorted, then no tie keys.
    let t = TestDb::new("sequence_equal_numbers_control").await?;
    let set = student_set(&t).await?;
    let fields = SequencedFields::open(&t.db, "profiles", FieldsOptions::default()).await?;
    let unsorted = SequencedSet::open(
        &t.db,
        "students_unsorted",
        SetOptions::default()
            .key_field("student_id")
            .field("classes")
            .control_without_canonical_order(),
    )
    .await?;
    let no_ties = SequencedFields::open(
        &t.db,
        "profiles_no_ties",
        FieldsOptions::default().control_without_tie_keys(),
    )
    .await?;
    let ops: Vec<Op> = (0..MEMBERS.len())
        .map(|member| Op {
            member,
            seq: 1,
            present: true,
        })
        .collect();
    let writes: Vec<Write> = (0..3)
        .map(|value| Write {
            field: 0,
            value,
            seq: 1,
        })
        .collect();
    let (mut set_differ, mut tie_differ, mut ours) = (0, 0, 0);
    for case in 0..6 {
        let seed = 1000 + u64::try_from(case)?;
        set_differ += race_equal_numbers(&unsorted, &fields, case, &ops, &[], seed, false).await?;
        tie_differ += race_equal_numbers(&set, &no_ties, case, &[], &writes, seed, false).await?;
        ours += race_equal_numbers(&set, &fields, case + 100, &ops, &writes, seed, true).await?;
    }
    eprintln!("control: {set_differ} set runs and {tie_differ} register runs differ");
    assert!(
        set_differ > 0,
        "an unsorted members array must depend on the order"
    );
    assert!(
        tie_differ > 0,
        "without tie keys the stored type must depend on the order"
    );
    assert_eq!(
        ours, 0,
        "docwarden's documents are identical on the same histories"
    );
    Ok(())
}

/// Members whose binary order differs from other orders (case, punctuation, `$`, `.`,
/// multi-byte UTF-8, digits), for the operator form's sorted `$push`.
const ODD_MEMBERS: [&str; 8] = ["CS 101", "$cash", "a.b@c.d", "B", "a", "é", "0", "z%2E"];

// Issue 14: the operator form (`update_one` with `$set`/`$push $sort`/`$pull`, tried first
// for a member that has a state entry) must leave the document the pipeline leaves, byte
// for byte, and report the same outcome for every call.
#[test]
fn operator_form_stores_the_pipelines_document_and_outcomes() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let t = rt.block_on(TestDb::new("sequence_operator_form"))?;
    let coll: Collection<Document> = t.db.collection("students");
    let by_operators = SequencedSet::new(
        coll.clone(),
        SetOptions::default()
            .key_field("student_id")
            .field("classes")
            .operator_form(true),
    )?;
    let by_pipeline = SequencedSet::new(
        coll.clone(),
        SetOptions::default()
            .key_field("student_id")
            .field("classes"),
    )?;
    rt.block_on(by_operators.ensure_indexes())?;
    let next_case = std::sync::atomic::AtomicI64::new(0);
    let config = ProptestConfig {
        cases: 24,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let ops = prop::collection::vec((0..ODD_MEMBERS.len(), 0_i64..6, any::<bool>()), 1..30);
    proptest!(config, |(ops in ops, compact_at in prop::option::of((0_usize..30, 0_i64..6)))| {
        let case = next_case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        rt.block_on(async {
            let (a, b) = (2 * case, 2 * case + 1);
            for (i, &(member, seq, present)) in ops.iter().enumerate() {
                if let Some((at, watermark)) = compact_at
                    && at == i
                {
                    by_operators.compact(a, watermark).await?;
                    by_pipeline.compact(b, watermark).await?;
                }
                let m = ODD_MEMBERS[member];
                let (x, y) = if present {
                    (by_operators.add(a, m, seq).await?, by_pipeline.add(b, m, seq).await?)
                } else {
                    (by_operators.remove(a, m, seq).await?, by_pipeline.remove(b, m, seq).await?)
                };
                anyhow::ensure!(x == y, "op {i} ({m}, {seq}, {present}): operators {x:?}, pipeline {y:?}");
            }
            let x = stored_bytes(&coll, doc! { "student_id": a }, &["_id", "student_id"]).await?;
            let y = stored_bytes(&coll, doc! { "student_id": b }, &["_id", "student_id"]).await?;
            anyhow::ensure!(
                x == y,
                "documents differ:\n operators {}\n pipeline  {}",
                shown(&coll, doc! { "student_id": a }).await?,
                shown(&coll, doc! { "student_id": b }).await?,
            );
            Ok(())
        })
        .map_err(|e: anyhow::Error| TestCaseError::fail(e.to_string()))?;
    });
    drop((by_operators, by_pipeline));
    rt.block_on(async move { drop(t) });
    Ok(())
}

// Issue 14: the operator form under 8 racing consumers, every delivery shuffled and
// duplicated: the sequential model's state, one document, no message applied twice, and
// the same bytes for three deliveries of each history (equal numbers included, so the
// remove-wins tie goes through the operator filter).
#[test]
fn operator_form_raced_by_8_consumers_equals_the_model_and_stores_one_document()
-> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()?;
    let t = rt.block_on(TestDb::new("sequence_operator_form_race"))?;
    let set = SequencedSet::new(
        t.db.collection("students"),
        SetOptions::default()
            .key_field("student_id")
            .field("classes")
            .operator_form(true),
    )?;
    rt.block_on(set.ensure_indexes())?;
    let fields = rt.block_on(SequencedFields::open(
        &t.db,
        "profiles",
        FieldsOptions::default(),
    ))?;
    let next_case = std::sync::atomic::AtomicI64::new(0);
    let config = ProptestConfig {
        cases: 16,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let ops = prop::collection::vec(
        (0..MEMBERS.len(), 0_i64..5, any::<bool>()).prop_map(|(member, seq, present)| Op {
            member,
            seq,
            present,
        }),
        1..16,
    );
    proptest!(config, |(ops in ops, seed in any::<u64>())| {
        let case = next_case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let differing = rt.block_on(race_equal_numbers(&set, &fields, case, &ops, &[], seed, true))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(differing, 0, "stored documents differ between deliveries");
    });
    drop((set, fields));
    rt.block_on(async move { drop(t) });
    Ok(())
}

/// Like [`consume`], but each consumer takes a batch of 1–5 messages at a time and
/// applies it with [`SequencedSet::apply_many`].
async fn consume_batches(
    set: &SequencedSet,
    key: i64,
    messages: Vec<Op>,
    seed: u64,
) -> anyhow::Result<Vec<(Op, ApplyOutcome)>> {
    let queue = Arc::new(Mutex::new((messages, StdRng::seed_from_u64(seed))));
    let mut tasks = Vec::new();
    for _ in 0..CONSUMERS {
        let queue = Arc::clone(&queue);
        let set = set.clone();
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            loop {
                let batch: Vec<Op> = {
                    let mut q = queue.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
                    let n = rand::Rng::random_range(&mut q.1, 1..=5).min(q.0.len());
                    let at = q.0.len() - n;
                    q.0.split_off(at)
                };
                if batch.is_empty() {
                    break;
                }
                let ops: Vec<SetOp> = batch
                    .iter()
                    .map(|o| {
                        let m = MEMBERS[o.member];
                        if o.present {
                            SetOp::add(key, m, o.seq)
                        } else {
                            SetOp::remove(key, m, o.seq)
                        }
                    })
                    .collect();
                let outcomes = set.apply_many(&ops).await?;
                anyhow::ensure!(outcomes.len() == ops.len(), "one outcome per operation");
                seen.extend(batch.into_iter().zip(outcomes));
            }
            anyhow::Ok(seen)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok(all)
}

/// The violations of one key after a run: its states and members against the model, one
/// document, and no message applied twice.
async fn violations_of(
    set: &SequencedSet,
    key: i64,
    ops: &[Op],
    outcomes: Vec<(Op, ApplyOutcome)>,
) -> anyhow::Result<u64> {
    let mut violations = 0;
    let expected = model(ops);
    let got: BTreeMap<String, (i64, bool)> = set
        .states(key)
        .await?
        .unwrap_or_default()
        .into_iter()
        .map(|s| (s.member, (s.seq, s.present)))
        .collect();
    if got != expected {
        eprintln!("key {key}: state {got:?} != model {expected:?} for {ops:?}");
        violations += 1;
    }
    let members: BTreeSet<String> = set
        .members(key)
        .await?
        .unwrap_or_default()
        .into_iter()
        .collect();
    if members != present(&expected) {
        eprintln!("key {key}: members {members:?} != model {expected:?}");
        violations += 1;
    }
    if set
        .collection()
        .count_documents(doc! { "student_id": key })
        .await?
        != 1
    {
        violations += 1;
    }
    let mut applied: HashMap<Op, u32> = HashMap::new();
    for (op, outcome) in outcomes {
        if outcome == ApplyOutcome::Applied {
            *applied.entry(op).or_default() += 1;
        }
    }
    violations += applied.values().filter(|n| **n > 1).count() as u64;
    Ok(violations)
}

// `apply_many`: 8 consumers apply duplicated deliveries in batches of 1–5; the document
// must be the sequential model's, with no message applied twice. Half of each history
// goes one by one first, shuffled, so the batches find predicted members (the
// `bulkWrite` path) as well as new ones; the other half comes mostly in order.
#[test]
fn batches_by_8_consumers_equal_the_sequential_model() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()?;
    let t = rt.block_on(TestDb::new("sequence_batches"))?;
    let set = rt.block_on(student_set(&t))?;
    let next_key = std::sync::atomic::AtomicI64::new(0);
    let config = ProptestConfig {
        cases: 24,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let ops = prop::collection::vec(
        (0..MEMBERS.len(), 0_i64..60, any::<bool>()).prop_map(|(member, seq, present)| Op {
            member,
            seq,
            present,
        }),
        4..40,
    );
    proptest!(config, |(ops in ops, seed in any::<u64>())| {
        let key = next_key.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let violations = rt.block_on(async {
            let mut rng = StdRng::seed_from_u64(seed);
            // The lower half of the sequence numbers one by one, shuffled; the upper half
            // in batches, mostly in order (consumers take from the end), as a stream read
            // in batches arrives (the racing consumers still interleave it).
            let mut later = deliveries(&ops, &mut rng);
            later.sort_by_key(|o| std::cmp::Reverse(o.seq));
            let mut msgs = later.split_off(later.len() / 2);
            msgs.shuffle(&mut rng);
            let s = set.clone();
            let mut outcomes = consume(msgs, move |o| {
                let s = s.clone();
                async move {
                    let m = MEMBERS[o.member];
                    Ok(if o.present { s.add(key, m, o.seq).await? } else { s.remove(key, m, o.seq).await? })
                }
            })
            .await?;
            outcomes.extend(consume_batches(&set, key, later, seed).await?);
            violations_of(&set, key, &ops, outcomes).await
        })
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(violations, 0);
    });
    drop(set);
    rt.block_on(async move { drop(t) });
    Ok(())
}

// The batch's point: operations whose members the handle has seen go to the server as one
// `bulkWrite` command, and their outcomes come back from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_of_predicted_operations_is_one_command() -> anyhow::Result<()> {
    let t = TestDb::new("sequence_batch_command").await?;
    let hello = t.db.run_command(doc! { "hello": 1 }).await?;
    if hello.get_i32("maxWireVersion").unwrap_or(0) < 25 {
        docwarden_testkit::skip(
            "a_batch_of_predicted_operations_is_one_command",
            "the server has no bulkWrite command (MongoDB 8.0+)",
        );
        return Ok(());
    }
    let (client, log) = docwarden_testkit::counting_client(t.uri()).await?;
    let set = enrollment::open_set(client.database(t.db.name()).collection("students")).await?;
    for key in 0..4_i64 {
        for m in ["CS 101", "MATH 2"] {
            assert_eq!(set.add(key, m, 1).await?, ApplyOutcome::Applied);
        }
    }
    log.take();
    let batch = vec![
        SetOp::remove(0, "CS 101", 2),
        SetOp::add(0, "CS 101", 3),
        SetOp::remove(1, "MATH 2", 2),
        SetOp::add(2, "CS 101", 5),
        SetOp::remove(3, "CS 101", 4),
        SetOp::remove(3, "CS 101", 4),
    ];
    let outcomes = set.apply_many(&batch).await?;
    let sent = log.take_counts();
    // The last operation repeats the one before it: not predicted to apply, so it is
    // applied on its own after the batch and reads as the duplicate it is.
    assert_eq!(
        outcomes,
        vec![
            ApplyOutcome::Applied,
            ApplyOutcome::Applied,
            ApplyOutcome::Applied,
            ApplyOutcome::Applied,
            ApplyOutcome::Applied,
            ApplyOutcome::Duplicate,
        ]
    );
    assert_eq!(sent.get("bulkWrite"), Some(&1), "commands sent: {sent:?}");
    assert_eq!(
        sent.get("update"),
        None,
        "no operation went on its own: {sent:?}"
    );
    assert_eq!(
        set.members(0).await?,
        Some(vec!["CS 101".to_owned(), "MATH 2".to_owned()])
    );
    assert_eq!(set.members(1).await?, Some(vec!["CS 101".to_owned()]));
    assert_eq!(set.members(3).await?, Some(vec!["MATH 2".to_owned()]));
    // A stale operation in a batch changes nothing and says so.
    assert_eq!(
        set.apply_many(&[SetOp::add(1, "MATH 2", 1), SetOp::add(2, "MATH 2", 9)])
            .await?,
        vec![ApplyOutcome::Stale, ApplyOutcome::Applied]
    );
    assert_eq!(set.members(1).await?, Some(vec!["CS 101".to_owned()]));
    // Invalid input anywhere: nothing is sent.
    assert!(matches!(
        set.apply_many(&[SetOp::add(1, "MATH 2", 10), SetOp::add(1, "MATH 2", -1)])
            .await,
        Err(Error::InvalidInput { .. })
    ));
    let math = set
        .states(1)
        .await?
        .unwrap_or_default()
        .into_iter()
        .find(|s| s.member == "MATH 2")
        .map(|s| (s.seq, s.present));
    assert_eq!(
        math,
        Some((2, false)),
        "the valid operation of a refused batch was not sent"
    );
    drop(client);
    Ok(())
}

// Control for the batch: the operator form's update sent in a bulk *without* its "wins"
// condition (the filter reduced to the key) lets a stale add bring back a member a newer
// remove took out — the condition is what keeps a batch's order-independence.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_a_batch_without_its_condition_lets_a_stale_add_back() -> anyhow::Result<()> {
    let t = TestDb::new("sequence_batch_control").await?;
    let set = student_set(&t).await?;
    set.add(1_i64, "CS 101", 1).await?;
    set.remove(1_i64, "CS 101", 5).await?;
    let (_, update) = set.operator_update_for(1_i64, "CS 101", 3, true, false)?;
    // Safe: the batch refuses the stale add.
    assert_eq!(
        set.apply_many(&[SetOp::add(1_i64, "CS 101", 3)]).await?,
        vec![ApplyOutcome::Stale]
    );
    assert_eq!(set.members(1_i64).await?, Some(Vec::new()));
    // Control: the same update with the key alone as its filter.
    set.collection()
        .update_one(doc! { "student_id": 1_i64 }, update)
        .await?;
    let violations = u64::from(set.members(1_i64).await? != Some(Vec::new()));
    assert_eq!(
        violations, 1,
        "the unconditioned update must bring the member back"
    );
    Ok(())
}

// The registrar's batches (`enrollment::apply_records`, what `verify sequence`'s batching
// consumers send: one `apply_many` per set, credits one by one) store what one consumer
// applying every message once in sequence order stores, byte for byte, whatever the
// delivery order and duplicates. Control: the same batches without sequence numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registrar_batches_store_what_the_sequential_consumer_stores() -> anyhow::Result<()> {
    use docwarden_workloads::Mode;
    let t = TestDb::new("sequence_registrar_batches").await?;
    let mut rng = StdRng::seed_from_u64(7);
    let plan = enrollment::produce_records(&mut rng, 6, 300);
    let mut deliveries = enrollment::deliver(&mut rng, &plan.records);
    deliveries.extend(plan.records.iter().step_by(5).copied());
    let replay_coll = t.db.collection::<Document>("replay");
    let replay = enrollment::open_registrar(replay_coll.clone()).await?;
    for rec in plan.in_sequence_order() {
        enrollment::apply_record(&replay, &rec, Mode::Safe).await?;
    }
    let replayed = enrollment::read_records(&replay_coll).await?;
    let mut violations = Vec::new();
    for mode in [Mode::Safe, Mode::Control] {
        let coll = t.db.collection::<Document>(&format!("batches_{mode:?}"));
        let registrar = enrollment::open_registrar(coll.clone()).await?;
        for batch in deliveries.chunks(4) {
            let outcomes = enrollment::apply_records(&registrar, batch, mode).await?;
            assert_eq!(outcomes.len(), batch.len());
            assert_eq!(outcomes.iter().all(Option::is_some), mode == Mode::Safe);
        }
        let live = enrollment::read_records(&coll).await?;
        violations.push(enrollment::check_records(&plan, &live, &replayed).len());
    }
    assert_eq!(violations[0], 0, "batched consumer");
    assert!(violations[1] > 0, "control: {violations:?}");
    Ok(())
}

/// Session 15: a stored sequence number or watermark hand-edited into a string (above
/// every number in BSON order) made every later operation on that key come back
/// `Stale`, so the messages were dropped for good with an outcome that says a newer one
/// had won. It is `Malformed` now, naming the path; a genuinely stale message stays
/// `Stale`.
#[tokio::test]
async fn a_sequence_number_edited_into_a_string_is_malformed_not_stale() -> anyhow::Result<()> {
    let t = TestDb::new("seq_edited_number").await?;
    let set = SequencedSet::open(&t.db, "s", SetOptions::default()).await?;
    let fields = SequencedFields::open(&t.db, "f", FieldsOptions::default()).await?;
    let malformed = |r: &docwarden::Result<ApplyOutcome>| matches!(r, Err(Error::Malformed { .. }));
    // Registers: `_seq.<field>`.
    assert_eq!(fields.set("a", "v", 1, 5).await?, ApplyOutcome::Applied);
    assert_eq!(fields.set("a", "v", 0, 4).await?, ApplyOutcome::Stale);
    t.db.collection::<Document>("f")
        .update_one(doc! { "_id": "a" }, doc! { "$set": { "_seq.v": "5" } })
        .await?;
    let r = fields.set("a", "v", 2, 6).await;
    assert!(malformed(&r), "register: {r:?}");
    // Sets: the member's entry seq, and the compaction watermark.
    assert_eq!(set.add("k", "m", 5).await?, ApplyOutcome::Applied);
    assert_eq!(set.add("k", "m", 4).await?, ApplyOutcome::Stale);
    let sets = t.db.collection::<Document>("s");
    let entry = set
        .collection()
        .find_one(doc! { "_id": "k" })
        .await?
        .ok_or_else(|| anyhow::anyhow!("no document"))?;
    let state = entry
        .get_document("_seq_sets")?
        .get_document("members")?
        .get_document("state")?
        .keys()
        .next()
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no entry"))?;
    sets.update_one(
        doc! { "_id": "k" },
        doc! { "$set": { format!("{}.{state}.seq", "_seq_sets.members.state"): "5" } },
    )
    .await?;
    let r = set.remove("k", "m", 6).await;
    assert!(malformed(&r), "set entry: {r:?}");
    assert_eq!(set.add("k2", "m", 1).await?, ApplyOutcome::Applied);
    sets.update_one(
        doc! { "_id": "k2" },
        doc! { "$set": { set.floor_field(): "0" } },
    )
    .await?;
    let r = set.add("k2", "n", 2).await;
    assert!(malformed(&r), "set floor: {r:?}");
    Ok(())
}

/// Session 15: a register value is carried about seven times by its update (compared,
/// written, and its tie key in the filter and the pipeline): a 9 MiB value made a 66 MB
/// command that the driver refused with a bare database error ("Message length … over
/// maximum"), a 17 MiB one "malformed value". A value over `MAX_VALUE_BYTES` is now
/// `InvalidInput { what: "value" }`, nothing sent; one at the limit is stored.
#[tokio::test]
async fn a_register_value_over_the_limit_is_refused_and_one_at_the_limit_is_stored()
-> anyhow::Result<()> {
    let t = TestDb::new("seq_value_limit").await?;
    let fields = SequencedFields::open(&t.db, "f", FieldsOptions::default()).await?;
    // `{"v": "<n bytes>"}` is 4 + 1 + 2 + 4 + n + 1 + 1 bytes.
    let at_limit = "x".repeat(docwarden::sequence::MAX_VALUE_BYTES - 13);
    assert_eq!(
        fields.set("a", "v", at_limit.as_str(), 1).await?,
        ApplyOutcome::Applied
    );
    for n in [docwarden::sequence::MAX_VALUE_BYTES, 9 * 1024 * 1024] {
        let r = fields.set("b", "v", "x".repeat(n).as_str(), 1).await;
        assert!(
            matches!(r, Err(Error::InvalidInput { what: "value", .. })),
            "{n} bytes: {:?}",
            r.map_err(|e| e.to_string().chars().take(200).collect::<String>())
        );
    }
    assert_eq!(fields.get("b", "v").await?, None, "nothing stored");
    Ok(())
}

/// The `input` of every `$filter` / `$map` in `value` that is a `$let` variable (`"$$…"`).
fn iterated_variables(value: &Bson, found: &mut Vec<String>) {
    match value {
        Bson::Document(d) => {
            for (k, v) in d {
                if k == "input"
                    && let Bson::String(s) = v
                    && s.starts_with("$$")
                {
                    found.push(s.clone());
                }
                iterated_variables(v, found);
            }
        }
        Bson::Array(a) => a.iter().for_each(|v| iterated_variables(v, found)),
        _ => {}
    }
}

/// Session 15: a first-seen member's add iterated a `$let` variable holding every state
/// entry (`$filter` over `$$es`), which the embedded server copies for each element it
/// visits: O(entries²), 1 s per add at 2,000 members (`docs/surrogate.md`). The
/// pipeline now reads the entries by expression, linear on both servers. (Speed is for
/// benchmarks; this checks the shape that caused it.)
#[tokio::test]
async fn a_set_pipeline_never_iterates_a_variable() -> anyhow::Result<()> {
    let t = TestDb::new("a_set_pipeline_never_iterates_a_variable").await?;
    let set = student_set(&t).await?;
    let mut found = Vec::new();
    for present in [true, false] {
        for stage in set.pipeline("CS 101", 7, present) {
            iterated_variables(&Bson::Document(stage), &mut found);
        }
    }
    assert!(
        found.is_empty(),
        "the set's pipeline iterates variables: {found:?}"
    );
    Ok(())
}

/// Register values for the operator form's tests: plain ones it carries, and ones it must
/// leave to the pipeline (NaN, −0.0, a decimal, a timestamp, a `$`-key, a dotted key),
/// several equal in MongoDB's comparison order (`7`, `7.0`, `7` as int64).
fn register_value(i: usize) -> Bson {
    match i % 14 {
        0 => Bson::Int32(7),
        1 => Bson::Double(7.0),
        2 => Bson::Int64(7),
        3 => Bson::String("seven".to_owned()),
        4 => Bson::Document(doc! { "a": 1_i32, "b": [1_i32, "x"] }),
        5 => Bson::Array(vec![Bson::Int32(1), Bson::Document(doc! { "k": "v" })]),
        6 => Bson::Double(f64::NAN),
        7 => Bson::Double(-0.0),
        8 => Bson::Decimal128(
            "7.00"
                .parse()
                .unwrap_or(mongodb::bson::Decimal128::from_bytes([0; 16])),
        ),
        9 => Bson::Timestamp(mongodb::bson::Timestamp {
            time: 0,
            increment: 0,
        }),
        10 => Bson::Document(doc! { "$x": 1_i32 }),
        11 => Bson::Document(doc! { "a.b": 1_i32 }),
        12 => Bson::Null,
        _ => Bson::Boolean(true),
    }
}

// Issue 14, session 31: the registers' operator form (`update_one` with `$set`, tried
// first for a number above the one the handle last saw stored) must leave the document
// the pipeline leaves, byte for byte, and report the same outcome for every call — over
// in-order runs (the form's case), stale and equal numbers, first writes of a field, and
// values it must leave to the pipeline.
#[test]
fn register_operator_form_stores_the_pipelines_document_and_outcomes() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let t = rt.block_on(TestDb::new("register_operator_form"))?;
    let (client, log) = rt.block_on(docwarden_testkit::counting_client(t.uri()))?;
    let coll: Collection<Document> = client.database(t.db.name()).collection("profiles");
    let by_operators = SequencedFields::new(coll.clone(), FieldsOptions::default())?;
    let by_pipeline =
        SequencedFields::new(coll.clone(), FieldsOptions::default().operator_form(false))?;
    let next_case = std::sync::atomic::AtomicI64::new(0);
    let updates = std::sync::atomic::AtomicU64::new(0);
    let config = ProptestConfig {
        cases: 24,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    // (field, in order?, seq if not, value): about half the writes continue an in-order
    // run of their field.
    let ops = prop::collection::vec((0_usize..3, any::<bool>(), 0_i64..8, 0_usize..14), 1..30);
    proptest!(config, |(ops in ops)| {
        let case = next_case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        rt.block_on(async {
            let (a, b) = (2 * case, 2 * case + 1);
            let mut next = [10_i64; 3];
            for (i, &(field, in_order, seq, value)) in ops.iter().enumerate() {
                let name = ["name", "age", "zip"][field];
                let seq = if in_order {
                    next[field] += 1;
                    next[field]
                } else {
                    seq
                };
                let v = register_value(value);
                let x = by_operators.set(a, name, v.clone(), seq).await?;
                let y = by_pipeline.set(b, name, v.clone(), seq).await?;
                anyhow::ensure!(x == y, "write {i} ({name}, {seq}, {v}): operators {x:?}, pipeline {y:?}");
            }
            updates.fetch_add(
                u64::from(log.take_counts().get("update").copied().unwrap_or(0)),
                std::sync::atomic::Ordering::Relaxed,
            );
            let x = stored_bytes(&coll, doc! { "_id": a }, &["_id"]).await?;
            let y = stored_bytes(&coll, doc! { "_id": b }, &["_id"]).await?;
            anyhow::ensure!(
                x == y,
                "documents differ:\n operators {}\n pipeline  {}",
                shown(&coll, doc! { "_id": a }).await?,
                shown(&coll, doc! { "_id": b }).await?,
            );
            Ok(())
        })
        .map_err(|e: anyhow::Error| TestCaseError::fail(e.to_string()))?;
    });
    // The operator form ran (an `update` command per write it applied): the comparison
    // above is not the pipeline against itself.
    let updates = updates.into_inner();
    assert!(updates > 20, "the operator form sent {updates} updates");
    drop((by_operators, by_pipeline));
    rt.block_on(async move { drop(t) });
    Ok(())
}

// Session 31: an in-order stream of register writes costs one `update` per write after
// the field's first write (the pipeline's `findAndModify` creates it), a write the hint
// says loses one read, and values the operator form leaves alone, hand edits and lost
// races still reach the pipeline and its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registers_in_order_are_one_update_each_and_misses_go_to_the_pipeline() -> anyhow::Result<()>
{
    let t = TestDb::new("register_operator_commands").await?;
    let (client, log) = docwarden_testkit::counting_client(t.uri()).await?;
    let coll: Collection<Document> = client.database(t.db.name()).collection("profiles");
    let fields = SequencedFields::new(coll.clone(), FieldsOptions::default())?;
    assert_eq!(fields.set("k", "v", 1_i64, 1).await?, ApplyOutcome::Applied);
    log.take();
    for seq in 2..=11 {
        assert_eq!(fields.set("k", "v", seq, seq).await?, ApplyOutcome::Applied);
    }
    let sent = log.take_counts();
    assert_eq!(sent.get("update"), Some(&10), "{sent:?}");
    assert_eq!(sent.get("findAndModify"), None, "{sent:?}");
    assert_eq!(fields.get("k", "v").await?, Some((Bson::Int64(11), 11)));

    // A value the form leaves alone: the pipeline, and the same answer.
    log.take();
    assert_eq!(
        fields.set("k", "v", Bson::Double(f64::NAN), 12).await?,
        ApplyOutcome::Applied
    );
    assert_eq!(log.take_counts().get("update"), None);

    // Another handle (another process) got further: this handle's hint says 12, the
    // stored number is 20, so its write of 13 misses the operators and is stale.
    let other = SequencedFields::new(coll.clone(), FieldsOptions::default())?;
    assert_eq!(
        other.set("k", "v", 20_i64, 20).await?,
        ApplyOutcome::Applied
    );
    log.take();
    assert_eq!(fields.set("k", "v", 13_i64, 13).await?, ApplyOutcome::Stale);
    let sent = log.take_counts();
    assert_eq!(sent.get("update"), Some(&1), "{sent:?}");
    assert_eq!(sent.get("findAndModify"), Some(&1), "{sent:?}");
    // The post-image taught the handle 20: the next in-order write is one update again.
    log.take();
    assert_eq!(
        fields.set("k", "v", 21_i64, 21).await?,
        ApplyOutcome::Applied
    );
    assert_eq!(log.take_counts().get("update"), Some(&1));

    // A re-delivery and a stale write the hint knows lose are decided by one read (no
    // write); the same number with another value goes to the pipeline, which compares.
    log.take();
    assert_eq!(
        fields.set("k", "v", 21_i64, 21).await?,
        ApplyOutcome::Duplicate
    );
    assert_eq!(fields.set("k", "v", 3_i64, 3).await?, ApplyOutcome::Stale);
    let sent = log.take_counts();
    assert_eq!(sent.get("find"), Some(&2), "{sent:?}");
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(
        fields.set("k", "v", 22_i32, 21).await?,
        ApplyOutcome::Applied
    );
    assert_eq!(log.take_counts().get("findAndModify"), Some(&1));
    assert_eq!(fields.get("k", "v").await?, Some((Bson::Int32(22), 21)));
    // A tie key edited into a string: the read leaves it to the pipeline, `Malformed`.
    coll.update_one(doc! { "_id": "k" }, doc! { "$set": { "_seq_tie.v": "x" } })
        .await?;
    let r = fields.set("k", "v", 3_i64, 3).await;
    assert!(matches!(r, Err(Error::Malformed { .. })), "{r:?}");
    coll.update_one(
        doc! { "_id": "k" },
        doc! { "$set": { "_seq_tie.v": Bson::Binary(mongodb::bson::Binary {
            subtype: mongodb::bson::spec::BinarySubtype::Generic,
            bytes: docwarden::sequence::register::tie_key(&Bson::Int32(22))?,
        }) } },
    )
    .await?;

    // Hand edits the operators must not write over: the number as an array, `_seq` as an
    // array. The pipeline decides (stale or malformed), and nothing is written over them.
    coll.update_one(doc! { "_id": "k" }, doc! { "$set": { "_seq.v": [1_i64] } })
        .await?;
    let r = fields.set("k", "v", 22_i64, 22).await;
    assert!(
        matches!(r, Err(Error::Malformed { .. }) | Ok(ApplyOutcome::Stale)),
        "{r:?}"
    );
    let stored = coll
        .find_one(doc! { "_id": "k" })
        .await?
        .ok_or_else(|| anyhow::anyhow!("no document"))?;
    assert_eq!(
        stored.get_document("_seq")?.get("v"),
        Some(&Bson::Array(vec![Bson::Int64(1)]))
    );
    assert_eq!(stored.get("v"), Some(&Bson::Int32(22)));
    let seq_array = Bson::Array(vec![Bson::Document(doc! { "v": 1_i64 })]);
    coll.update_one(
        doc! { "_id": "k" },
        doc! { "$set": { "_seq": seq_array.clone() } },
    )
    .await?;
    // Before session 31 this was a bare database error from the pipeline
    // (`$objectToArray` of an array); it is `Malformed`, naming the field.
    let r = fields.set("k", "v", 23_i64, 23).await;
    assert!(
        matches!(&r, Err(Error::Malformed { reason, .. }) if reason.contains("`_seq`")),
        "{r:?}"
    );
    let stored = coll
        .find_one(doc! { "_id": "k" })
        .await?
        .ok_or_else(|| anyhow::anyhow!("no document"))?;
    assert_eq!(stored.get("_seq"), Some(&seq_array));
    assert_eq!(stored.get("v"), Some(&Bson::Int32(22)));
    Ok(())
}

/// Register writes raced through `handles` (8 handles on one collection, as 8 processes,
/// each with its own hints): per key, 24 writes of two fields with rising numbers, each
/// delivered 1–3 times, shuffled, each delivery to a random handle. Violations: a field
/// whose stored value and number are not the highest-numbered write's, and a write
/// answered `Applied` more than once.
async fn race_registers(handles: &[SequencedFields], key: i64, seed: u64) -> anyhow::Result<u64> {
    let mut rng = StdRng::seed_from_u64(seed);
    let ops: Vec<Op> = (0..24_i64)
        .map(|i| Op {
            member: rand::Rng::random_range(&mut rng, 0..2),
            seq: i * 2 + rand::Rng::random_range(&mut rng, 0..2),
            present: true,
        })
        .collect();
    let msgs = deliveries(&ops, &mut rng);
    let all = handles.to_vec();
    let outcomes = consume(msgs, move |o| {
        let f = all[rand::random_range(0..all.len())].clone();
        async move {
            Ok(
                f.set(key, ["a", "b"][o.member], Bson::Int64(o.seq * 10), o.seq)
                    .await?,
            )
        }
    })
    .await?;
    let mut violations = 0;
    for member in 0..2 {
        let last = ops
            .iter()
            .filter(|o| o.member == member)
            .map(|o| o.seq)
            .max();
        let got = handles[0].get(key, ["a", "b"][member]).await?;
        if got != last.map(|s| (Bson::Int64(s * 10), s)) {
            violations += 1;
        }
    }
    let mut applied: HashMap<Op, u32> = HashMap::new();
    for (op, o) in outcomes {
        if o == ApplyOutcome::Applied {
            *applied.entry(op).or_default() += 1;
        }
    }
    Ok(violations + applied.values().filter(|n| **n > 1).count() as u64)
}

// Session 31: register writes raced by 8 processes (8 handles, each with its own hints, so
// the operator form meets numbers other processes stored): 0 violations. The control — the
// operator form without "the stored number is below the write's" in its filter — lets a
// stale write overwrite a newer one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registers_raced_by_8_processes_keep_the_newest_and_the_control_does_not()
-> anyhow::Result<()> {
    let t = TestDb::new("register_operator_race").await?;
    let coll: Collection<Document> = t.db.collection("profiles");
    let handles = |options: FieldsOptions| -> anyhow::Result<Vec<SequencedFields>> {
        (0..CONSUMERS)
            .map(|_| Ok(SequencedFields::new(coll.clone(), options.clone())?))
            .collect()
    };
    let safe = handles(FieldsOptions::default())?;
    let control = handles(FieldsOptions::default().control_operator_without_number_check())?;
    let (mut safe_violations, mut control_violations) = (0, 0);
    for round in 0..8_u64 {
        let key = i64::try_from(round)?;
        safe_violations += race_registers(&safe, key, round).await?;
        control_violations += race_registers(&control, 100 + key, round).await?;
    }
    eprintln!("register race: {safe_violations} violations, control {control_violations}");
    assert_eq!(safe_violations, 0, "violations with the operator form");
    assert!(
        control_violations > 0,
        "the control (no number check) showed no violation"
    );
    Ok(())
}

// Session 31: a register document whose `_seq` or `_seq_tie` was edited into something
// other than a sub-document is `Malformed` for every write, and nothing is written over it,
// with either form. Before, the pipeline wrote a fresh `_seq` over a string (the edit and
// every other field's number lost) and, over an empty-array `_seq_tie`, wrote the value
// and answered `Stale`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn register_bookkeeping_out_of_shape_is_malformed_and_left_as_it_is() -> anyhow::Result<()> {
    let t = TestDb::new("register_out_of_shape").await?;
    let coll: Collection<Document> = t.db.collection("profiles");
    let edits = [
        ("_seq", Bson::String("x".to_owned())),
        ("_seq", Bson::Array(vec![Bson::Int32(1)])),
        ("_seq_tie", Bson::String("x".to_owned())),
        ("_seq_tie", Bson::Array(vec![])),
    ];
    let mut key = 0_i64;
    for (path, value) in edits {
        for operator_form in [true, false] {
            key += 1;
            let fields = SequencedFields::new(
                coll.clone(),
                FieldsOptions::default().operator_form(operator_form),
            )?;
            assert_eq!(fields.set(key, "v", 1_i64, 1).await?, ApplyOutcome::Applied);
            coll.update_one(
                doc! { "_id": key },
                doc! { "$set": { path: value.clone() } },
            )
            .await?;
            let before = stored_bytes(&coll, doc! { "_id": key }, &[]).await?;
            for (field, seq) in [("v", 2), ("v", 0), ("v", 1), ("w", 5)] {
                let r = fields.set(key, field, seq, seq).await;
                assert!(
                    matches!(&r, Err(Error::Malformed { reason, .. }) if reason.contains(&format!("`{path}`"))),
                    "{path} = {value}, operator form {operator_form}, {field} @ {seq}: {r:?}"
                );
            }
            assert_eq!(
                stored_bytes(&coll, doc! { "_id": key }, &[]).await?,
                before,
                "{path} = {value}: the document was written"
            );
        }
    }
    Ok(())
}
