//! Sequenced set applies of seed 001's set (`docwarden_workloads::enrollment`) over random
//! students, classes and sequence numbers.
//!
//! A second row applies the same messages to a set keyed by `_id` without a members index
//! (`SetOptions::default()`): the point write by `_id`, next to the seed's shape (a unique
//! `student_id` key and a multikey members index).
//!
//! Issue 14's operator form (`SetOptions::operator_form`, the default, as in the rows
//! above) next to the pipeline alone (`operator_form(false)`, the form before issue 14), on
//! sets where every member already has a state entry: an in-order stream (every apply
//! applies), and with `--stages` random numbers (many stale applies).
//!
//! The in-order stream again in batches of 64 messages per `SequencedSet::apply_many`
//! (one `bulkWrite` command per batch on MongoDB 8.0+): ops/s counts messages.
//!
//! Registers (`SequencedFields::set`): writes to fields already written once, by the
//! operator form (the default since session 31) and by the pipeline alone, as an in-order
//! stream and with random numbers from 0 to 63 (mostly stale or duplicates once a field has
//! been written a few times).
//!
//! With `--stages`, rows that time the parts of one apply on the same documents: the key
//! lookup with a trivial update, the full filter with a trivial pipeline, the full pipeline
//! without its post-image (`update_one`), and the pipeline without the canonical (sorted)
//! insertion (the test-only control; it runs last, as it leaves unsorted documents). Those
//! run on the seed's set; the in-order row's own floor, a bare `update_one` by `_id` on
//! documents of its shape, runs just before it.

use docwarden::sequence::{FieldsOptions, SequencedFields, SequencedSet, SetOptions};
use docwarden_workloads::Mode;
use docwarden_workloads::enrollment::{self, CLASSES, FIELD, KEY_FIELD, Message};
use mongodb::bson::{Document, doc};
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};

/// In-order applies, one `apply` per call (an issue 14 target row).
pub(crate) const IN_ORDER: &str = "sequence: in-order stream, every member seen";
/// In-order writes of registers, one `SequencedFields::set` per call.
pub(crate) const REGISTERS: &str = "sequence: register writes in order";
/// The register fields of the register rows.
const REGISTER_FIELDS: [&str; 3] = ["email", "name", "score"];
/// The bare write of one apply on the seed's set (`--stages`): by its `student_id` key.
pub(crate) const BARE: &str = "sequence stage: update_one by key, $inc";
/// The bare write of one in-order apply on the in-order row's documents: `update_one` by
/// `_id` with `$inc`, on a set of the same shape (keyed by `_id`, no members index, every
/// member seen). The in-order target row's floor (`--stages`).
pub(crate) const IN_ORDER_BARE: &str =
    "sequence stage: update_one by _id, $inc (in-order documents)";

use super::{BenchRow, Load, measure};

const KEYS: i64 = 1_000;

/// Messages per `apply_many` call in the batched row.
const BATCH: usize = 64;

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
    // Issue 14's operator form (`SetOptions::operator_form`, the default) against the
    // pipeline alone (`operator_form(false)`, the form before issue 14), on
    // fresh collections keyed by `_id` where every member of every key already has a
    // state entry (seq 0): first an in-order stream (every message newer than the last, so
    // every apply applies: the case the operator form is for), then random numbers (about
    // half the applies stale or duplicate: its worst case after first touches).
    if load.stages {
        // The in-order row's floor, on documents of its shape (the stage rows above run on
        // the seed's set, keyed by `student_id` with a members index).
        let coll = seen_set(db, "bench_sequence_in_order_floor", true)
            .await?
            .collection()
            .clone();
        rows.push(
            measure(IN_ORDER_BARE, load, move |_| {
                let c = coll.clone();
                async move {
                    c.update_one(
                        doc! { "_id": rand::random_range(0..KEYS) },
                        doc! { "$inc": { "bench_n": 1 } },
                    )
                    .await?;
                    Ok(1)
                }
            })
            .await?,
        );
    }
    for operator_form in [false, true] {
        let set = seen_set(db, "bench_sequence_in_order", operator_form).await?;
        let next = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(1));
        rows.push(
            measure(
                if operator_form {
                    IN_ORDER
                } else {
                    "sequence: in-order stream, every member seen, pipeline only"
                },
                load,
                move |_| {
                    let (set, next) = (set.clone(), next.clone());
                    async move {
                        let msg = Message {
                            seq: next.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                            ..random_message()
                        };
                        enrollment::apply(&set, &msg, Mode::Safe).await?;
                        Ok(1)
                    }
                },
            )
            .await?,
        );
    }
    // The same in-order stream read in batches (`SequencedSet::apply_many`: one
    // `bulkWrite` for the batch): a consumer that takes its messages 64 at a time.
    {
        let set = seen_set(db, "bench_sequence_in_order_batches", true).await?;
        let next = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(1));
        rows.push(
            measure(
                "sequence: in-order stream, every member seen, batches of 64 (apply_many)",
                load,
                move |_| {
                    let (set, next) = (set.clone(), next.clone());
                    async move {
                        let msgs: Vec<Message> = (0..BATCH)
                            .map(|_| Message {
                                seq: next.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                                ..random_message()
                            })
                            .collect();
                        enrollment::apply_batch(&set, &msgs).await?;
                        Ok(BATCH as u64)
                    }
                },
            )
            .await?,
        );
    }
    // Registers (`SequencedFields`): writes to fields written once before by the same
    // handle, by the operator form (since session 31) and by the pipeline alone — an
    // in-order stream, and random numbers below the stream's (stale or duplicate once
    // the field has a larger one, re-deliveries among them).
    for (in_order, operator_form, name) in [
        (true, true, REGISTERS),
        (
            true,
            false,
            "sequence: register writes in order, pipeline only",
        ),
        (false, true, "sequence: register writes, random numbers"),
        (
            false,
            false,
            "sequence: register writes, random numbers, pipeline only",
        ),
    ] {
        let fields = written_fields(db, operator_form).await?;
        let next = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(1));
        rows.push(
            measure(name, load, move |_| {
                let (fields, next) = (fields.clone(), next.clone());
                async move {
                    let seq = if in_order {
                        next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                    } else {
                        rand::random_range(0..64_i64)
                    };
                    let key = rand::random_range(0..KEYS);
                    let field = REGISTER_FIELDS[rand::random_range(0..REGISTER_FIELDS.len())];
                    fields.set(key, field, seq, seq).await?;
                    Ok(1)
                }
            })
            .await?,
        );
    }
    if load.stages {
        for operator_form in [false, true] {
            let set = seen_set(db, "bench_sequence_seen", operator_form).await?;
            rows.push(
                apply_row(
                    if operator_form {
                        "sequence stage: random seq, every member seen"
                    } else {
                        "sequence stage: random seq, every member seen, pipeline only"
                    },
                    load,
                    set,
                )
                .await?,
            );
        }
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

/// A set keyed by `_id` without a members index on a fresh collection `name` (dropped
/// first), with a state entry (seq 0, present) for every class of every key.
async fn seen_set(db: &Database, name: &str, operator_form: bool) -> anyhow::Result<SequencedSet> {
    let coll = db.collection::<Document>(name);
    coll.drop().await?;
    let set = SequencedSet::new(
        coll,
        SetOptions::default()
            .field(FIELD)
            .operator_form(operator_form),
    )?;
    set.ensure_indexes().await?;
    for student in 0..KEYS {
        for class in CLASSES {
            set.add(student, class, 0).await?;
        }
    }
    Ok(set)
}

/// A fresh collection of register documents keyed by `_id`, each of [`REGISTER_FIELDS`]
/// of every key written once (number 0) by the returned handle, so its hints know them.
async fn written_fields(db: &Database, operator_form: bool) -> anyhow::Result<SequencedFields> {
    let coll = db.collection::<Document>(if operator_form {
        "bench_registers"
    } else {
        "bench_registers_pipeline"
    });
    coll.drop().await?;
    let fields = SequencedFields::new(coll, FieldsOptions::default().operator_form(operator_form))?;
    for key in 0..KEYS {
        for field in REGISTER_FIELDS {
            fields.set(key, field, 0_i64, 0).await?;
        }
    }
    Ok(fields)
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
        measure(BARE, load, move |_| {
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
