//! Seed 001: students enroll and unenroll through a queue; consumers see the messages
//! shuffled and partly duplicated, yet every student ends with the classes the sequential
//! history gives.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use docwarden::sequence::{ApplyOutcome, SequencedSet, SetOptions};
use futures::TryStreamExt;
use mongodb::Database;
use mongodb::bson::{Document, doc};
use rand::seq::SliceRandom;

use super::ScenarioReport;

const STUDENTS: i64 = 40;
const CLASSES: [&str; 6] = ["CS 101", "CS 201", "MATH 2", "PHYS 1", "HIST 3", "ART 4"];
const MESSAGES: usize = 1_200;
const CONSUMERS: usize = 5;
/// Share of messages the queue delivers twice.
const DUPLICATED: f64 = 0.25;

/// One queued message, stamped by the producer.
#[derive(Debug, Clone, Copy)]
struct Message {
    student: i64,
    class: usize,
    enroll: bool,
    seq: i64,
}

/// The producer: each message toggles one student's enrollment in one class, stamped with
/// an ever-increasing sequence number. Returns the messages and the sequential result.
fn produce() -> (Vec<Message>, BTreeMap<i64, BTreeSet<String>>) {
    let mut expected: BTreeMap<i64, BTreeSet<String>> =
        (0..STUDENTS).map(|s| (s, BTreeSet::new())).collect();
    let mut messages = Vec::with_capacity(MESSAGES);
    for seq in 0..MESSAGES {
        let student = rand::random_range(0..STUDENTS);
        let class = rand::random_range(0..CLASSES.len());
        let classes = expected.entry(student).or_default();
        let enroll = !classes.contains(CLASSES[class]);
        if enroll {
            classes.insert(CLASSES[class].to_owned());
        } else {
            classes.remove(CLASSES[class]);
        }
        messages.push(Message {
            student,
            class,
            enroll,
            seq: i64::try_from(seq).unwrap_or(i64::MAX),
        });
    }
    (messages, expected)
}

/// The queue: every message once, some twice, in random order.
fn deliver(messages: &[Message]) -> Vec<Message> {
    let mut out: Vec<Message> = messages.to_vec();
    out.extend(
        messages
            .iter()
            .filter(|_| rand::random_bool(DUPLICATED))
            .copied(),
    );
    out.shuffle(&mut rand::rng());
    out
}

pub(crate) async fn run(db: &Database) -> anyhow::Result<Vec<ScenarioReport>> {
    let started = Instant::now();
    crate::demo::narrate!(
        "== enrollment: {MESSAGES} enroll/unenroll messages for {STUDENTS} students, \
         delivered shuffled ({:.0}% twice) to {CONSUMERS} consumers",
        DUPLICATED * 100.0
    );
    let (messages, expected) = produce();
    let deliveries = deliver(&messages);
    let set = SequencedSet::open(
        db,
        "enrollment",
        SetOptions::default()
            .key_field("student_id")
            .field("classes")
            .index_members(true),
    )
    .await?;

    let (tx, rx) = tokio::sync::mpsc::channel::<Message>(64);
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    let mut consumers = Vec::new();
    for _ in 0..CONSUMERS {
        let rx = Arc::clone(&rx);
        let set = set.clone();
        consumers.push(tokio::spawn(async move {
            let mut counts = [0_u64; 3];
            loop {
                let next = rx.lock().await.recv().await;
                let Some(m) = next else { break };
                let outcome = if m.enroll {
                    set.add(m.student, CLASSES[m.class], m.seq).await?
                } else {
                    set.remove(m.student, CLASSES[m.class], m.seq).await?
                };
                counts[match outcome {
                    ApplyOutcome::Applied => 0,
                    ApplyOutcome::Stale => 1,
                    _ => 2,
                }] += 1;
            }
            anyhow::Ok(counts)
        }));
    }
    let operations = u64::try_from(deliveries.len())?;
    for m in &deliveries {
        tx.send(*m).await?;
    }
    drop(tx);
    let mut counts = [0_u64; 3];
    for c in consumers {
        for (total, n) in counts.iter_mut().zip(c.await??) {
            *total += n;
        }
    }
    crate::demo::narrate!(
        "   {operations} deliveries: {} applied, {} stale (a newer message had won), {} duplicates",
        counts[0],
        counts[1],
        counts[2]
    );

    let mut wrong = 0_u64;
    let mut shown = 0;
    crate::demo::narrate!(
        "   {:<8} {:<48} sequential expectation",
        "student",
        "final classes"
    );
    for (student, want) in &expected {
        let got: BTreeSet<String> = set
            .members(*student)
            .await?
            .unwrap_or_default()
            .into_iter()
            .collect();
        let ok = &got == want;
        if !ok {
            wrong += 1;
        }
        if shown < 8 || !ok {
            shown += 1;
            crate::demo::narrate!(
                "   {:<8} {:<48} {} {}",
                student,
                join(&got),
                join(want),
                if ok { "ok" } else { "DIFFERENT" }
            );
        }
    }
    let documents = set.collection().count_documents(doc! {}).await?;
    let touched = u64::try_from(
        messages
            .iter()
            .map(|m| m.student)
            .collect::<BTreeSet<_>>()
            .len(),
    )?;
    let duplicates = documents.saturating_sub(touched);
    crate::demo::narrate!(
        "   {wrong} students differ from the sequential history; {documents} documents for \
         {touched} students ({duplicates} duplicates)"
    );

    // For contrast: the seed's two-update upsert on the same deliveries (not counted).
    let (seed_docs, seed_wrong) = seed_approach(db, &deliveries, &expected).await?;
    crate::demo::narrate!(
        "   the seed's upsert approach on the same deliveries: {seed_wrong} students wrong, \
         {} duplicate documents",
        seed_docs.saturating_sub(touched)
    );

    Ok(vec![ScenarioReport {
        scenario: "enrollment",
        operations,
        violations: wrong + duplicates,
        elapsed: started.elapsed(),
    }])
}

fn join(classes: &BTreeSet<String>) -> String {
    if classes.is_empty() {
        "-".to_owned()
    } else {
        classes.iter().cloned().collect::<Vec<_>>().join(", ")
    }
}

/// The seed's updates (its filters, with upsert), applied sequentially in delivery order.
/// Returns (documents, students whose classes differ).
async fn seed_approach(
    db: &Database,
    deliveries: &[Message],
    expected: &BTreeMap<i64, BTreeSet<String>>,
) -> anyhow::Result<(u64, u64)> {
    let coll = db.collection::<Document>("enrollment_seed");
    for m in deliveries {
        let class = CLASSES[m.class];
        let (mine, other) = if m.enroll {
            ("classes", "deleted_classes")
        } else {
            ("deleted_classes", "classes")
        };
        coll.update_one(
            doc! {
                "student_id": m.student,
                mine: { "$not": { "$elemMatch": { "name": class } } },
                "$or": [
                    { other: { "$not": { "$elemMatch": { "name": class } } } },
                    { other: { "$elemMatch": { "name": class, "seq": { "$lt": m.seq } } } },
                ],
            },
            doc! {
                "$push": { mine: { "name": class, "seq": m.seq } },
                "$pull": { other: { "name": class } },
            },
        )
        .upsert(true)
        .await?;
    }
    let mut got: BTreeMap<i64, BTreeSet<String>> = BTreeMap::new();
    let mut docs = 0;
    let mut cursor = coll.find(doc! {}).await?;
    while let Some(d) = cursor.try_next().await? {
        docs += 1;
        let student = d.get_i64("student_id")?;
        let entry = got.entry(student).or_default();
        for c in d.get_array("classes").cloned().unwrap_or_default() {
            if let Some(name) = c.as_document().and_then(|c| c.get_str("name").ok()) {
                entry.insert(name.to_owned());
            }
        }
    }
    let wrong = expected
        .iter()
        .filter(|(s, want)| got.get(s).cloned().unwrap_or_default() != **want)
        .count();
    Ok((docs, u64::try_from(wrong)?))
}
