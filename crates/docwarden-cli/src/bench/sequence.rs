//! Sequenced set applies of seed 001's set (`docwarden_workloads::enrollment`) over random
//! students, classes and sequence numbers.
//!
//! A second row applies the same messages to a set keyed by `_id` without a members index
//! (`SetOptions::default()`): the point write by `_id`, next to the seed's shape (a unique
//! `student_id` key and a multikey members index).
//!
//! With `--stages`, rows that time the parts of one apply on the same documents: the key
//! lookup with a trivial update, the full filter with a trivial pipeline, the full pipeline
//! without its post-image (`update_one`), and the pipeline without the canonical (sorted)
//! insertion (the test-only control; it runs last, as it leaves unsorted documents).

use docwarden::sequence::{SequencedSet, SetOptions};
use docwarden_workloads::Mode;
use docwarden_workloads::enrollment::{self, CLASSES, FIELD, KEY_FIELD, Message};
use mongodb::bson::{Document, doc};
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};

use super::{BenchRow, Load, measure};

const KEYS: i64 = 1_000;

fn random_message() -> Message {
    Message {
        id: 0,
        student: rand::random_range(0..KEYS),
        class: CLASSES[rand::random_range(0..CLASSES.len())],
        enroll: rand::random_bool(0.5),
        seq: rand::random_range(0..1_000_000_i64),
    }
}

pub(crate) async fn run(db: &Database, load: &Load) -> anyhow::Result<Vec<BenchRow>> {
    let set = enrollment::open_set(db.collection("bench_sequence")).await?;
    // Create the documents first, as the reference's are: the row measures steady-state
    // applies (one round trip each), not the one-off creation of a key.
    for student in 0..KEYS {
        set.add(student, CLASSES[0], 0).await?;
    }
    let mut rows = Vec::new();
    if load.stages {
        rows.extend(stages(&set, load).await?);
    }
    let applies = set.clone();
    rows.push(
        measure("sequence: add/remove (random seq)", load, move |_| {
            let set = applies.clone();
            async move {
                enrollment::apply(&set, &random_message(), Mode::Safe).await?;
                Ok(1)
            }
        })
        .await?,
    );
    // The same applies on a set keyed by `_id` with no members index: the point write by
    // `_id` the server routes directly, without a second unique index to maintain.
    let by_id = SequencedSet::new(
        db.collection("bench_sequence_by_id"),
        SetOptions::default().field(FIELD),
    )?;
    by_id.ensure_indexes().await?;
    for student in 0..KEYS {
        by_id.add(student, CLASSES[0], 0).await?;
    }
    rows.push(
        measure(
            "sequence: add/remove keyed by _id (random seq)",
            load,
            move |_| {
                let set = by_id.clone();
                async move {
                    enrollment::apply(&set, &random_message(), Mode::Safe).await?;
                    Ok(1)
                }
            },
        )
        .await?,
    );
    // Steady state: every member of every key already has a state entry (seq 0), so each
    // apply takes the operator form (issue 14) unless it is stale or a duplicate.
    let seen = by_id_set(db, "bench_sequence_seen", false).await?;
    for student in 0..KEYS {
        for class in CLASSES {
            seen.add(student, class, 0).await?;
        }
    }
    rows.push(apply_row("sequence: add/remove keyed by _id, every member seen", load, seen).await?);
    if load.stages {
        // The same two rows with every operation sent as the pipeline update (before issue
        // 14), on fresh collections prepared the same way: before/after in one run.
        let fresh = by_id_set(db, "bench_sequence_pipeline", true).await?;
        for student in 0..KEYS {
            fresh.add(student, CLASSES[0], 0).await?;
        }
        rows.push(
            apply_row(
                "sequence stage: keyed by _id, pipeline only (before issue 14)",
                load,
                fresh,
            )
            .await?,
        );
        let seen = by_id_set(db, "bench_sequence_seen_pipeline", true).await?;
        for student in 0..KEYS {
            for class in CLASSES {
                seen.add(student, class, 0).await?;
            }
        }
        rows.push(
            apply_row(
                "sequence stage: every member seen, pipeline only (before issue 14)",
                load,
                seen,
            )
            .await?,
        );
    }
    if load.stages {
        let control = SequencedSet::new(
            set.collection().clone(),
            SetOptions::default()
                .key_field(KEY_FIELD)
                .field(FIELD)
                .control_without_canonical_order(),
        )?;
        rows.push(
            measure(
                "sequence stage: without sorted insertion",
                load,
                move |_| {
                    let set = control.clone();
                    async move {
                        enrollment::apply(&set, &random_message(), Mode::Safe).await?;
                        Ok(1)
                    }
                },
            )
            .await?,
        );
    }
    Ok(rows)
}

/// A set keyed by `_id` without a members index on collection `name`; `pipeline_only`
/// sends every operation as the pipeline update (the form before issue 14).
async fn by_id_set(db: &Database, name: &str, pipeline_only: bool) -> anyhow::Result<SequencedSet> {
    let mut options = SetOptions::default().field(FIELD);
    if pipeline_only {
        options = options.pipeline_only();
    }
    let set = SequencedSet::new(db.collection(name), options)?;
    set.ensure_indexes().await?;
    Ok(set)
}

/// A row of random applies on `set`.
async fn apply_row(name: &'static str, load: &Load, set: SequencedSet) -> anyhow::Result<BenchRow> {
    measure(name, load, move |_| {
        let set = set.clone();
        async move {
            enrollment::apply(&set, &random_message(), Mode::Safe).await?;
            Ok(1)
        }
    })
    .await
}

/// The filter an apply sends (see `docwarden::sequence::apply`).
fn filter(set: &SequencedSet, msg: &Message) -> Document {
    let entry = format!(
        "{}.{}",
        set.state_field(),
        docwarden::sequence::encode::member_key(msg.class)
    );
    doc! { "$and": [
        { KEY_FIELD: msg.student },
        { "$or": [
            { format!("{entry}.seq"): { "$ne": msg.seq } },
            { format!("{entry}.present"): { "$ne": msg.enroll } },
        ] },
    ] }
}

async fn stages(set: &SequencedSet, load: &Load) -> anyhow::Result<Vec<BenchRow>> {
    let coll = set.collection().clone();
    let mut rows = Vec::new();
    let c = coll.clone();
    rows.push(
        measure("sequence stage: update_one by key, $inc", load, move |_| {
            let c = c.clone();
            async move {
                c.update_one(
                    doc! { KEY_FIELD: rand::random_range(0..KEYS) },
                    doc! { "$inc": { "bench_n": 1 } },
                )
                .await?;
                Ok(1)
            }
        })
        .await?,
    );
    let c = coll.clone();
    rows.push(
        measure(
            "sequence stage: findOneAndUpdate by key, trivial pipeline",
            load,
            move |_| {
                let c = c.clone();
                async move {
                    trivial_pipeline(&c, doc! { KEY_FIELD: rand::random_range(0..KEYS) }).await
                }
            },
        )
        .await?,
    );
    let (c, s) = (coll.clone(), set.clone());
    rows.push(
        measure(
            "sequence stage: full filter, trivial pipeline",
            load,
            move |_| {
                let (c, s) = (c.clone(), s.clone());
                async move { trivial_pipeline(&c, filter(&s, &random_message())).await }
            },
        )
        .await?,
    );
    let (c, s) = (coll.clone(), set.clone());
    rows.push(
        measure(
            "sequence stage: full pipeline by update_one",
            load,
            move |_| {
                let (c, s) = (c.clone(), s.clone());
                async move {
                    let msg = random_message();
                    c.update_one(filter(&s, &msg), s.pipeline(msg.class, msg.seq, msg.enroll))
                        .await?;
                    Ok(1)
                }
            },
        )
        .await?,
    );
    Ok(rows)
}

/// The stage rows' write: `findOneAndUpdate(filter)` with a one-field pipeline (what the
/// server charges for a pipeline update, apart from the sequenced apply's own stages).
async fn trivial_pipeline(c: &Collection<Document>, filter: Document) -> anyhow::Result<u64> {
    c.find_one_and_update(
        filter,
        vec![doc! { "$set": { "bench_n": { "$add": ["$bench_n", 1] } } }],
    )
    .return_document(ReturnDocument::After)
    .projection(doc! { "bench_n": 1 })
    .await?;
    Ok(1)
}
