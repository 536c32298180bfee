//! Seed 001, enrollment (`docwarden::sequence`): students enroll in and unenroll from
//! classes through a queue that delivers the messages shuffled and partly duplicated, yet
//! every student must end with the classes the sequential history gives, in one document.
//!
//! The data set: [`CLASSES`] (six), [`DUPLICATED`] (a quarter of the messages delivered
//! twice). [`Mode::Safe`] applies each message with [`SequencedSet::add`] /
//! [`SequencedSet::remove`] and its sequence number; [`Mode::Control`] applies it without
//! the sequence number (`$addToSet` / `$pull` with upsert), as a naive consumer would.
//! [`seed_apply`] is the seed's own two-update upsert, shown for contrast. The final read
//! is [`final_read`]; [`check`] compares it with the model through
//! [`docwarden::check::state`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use docwarden::check::Violation;
use docwarden::check::state::{
    check_against_model, check_identical_documents, check_one_document_per_key,
};
use docwarden::sequence::{
    ApplyOutcome as Outcome, FieldsOptions, SequencedFields, SequencedSet, SetOp, SetOptions,
};
use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};
use rand::Rng;
use rand::seq::SliceRandom;

use crate::Mode;

/// The classes of the seed.
pub const CLASSES: [&str; 6] = ["CS 101", "CS 201", "MATH 2", "PHYS 1", "HIST 3", "ART 4"];

/// Share of messages the queue delivers twice.
pub const DUPLICATED: f64 = 0.25;

/// The field identifying a student's document.
pub const KEY_FIELD: &str = "student_id";

/// The field holding a student's classes.
pub const FIELD: &str = "classes";

/// The operations of the workload, as the history names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A student enrolls in a class.
    Enroll,
    /// A student unenrolls from a class.
    Unenroll,
}

impl Op {
    /// The name in histories and reports.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Op::Enroll => "enroll",
            Op::Unenroll => "unenroll",
        }
    }
}

/// One queued message, stamped by the producer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Message {
    /// Position in the producer's order (identifies the message for acknowledgements).
    pub id: usize,
    /// The student.
    pub student: i64,
    /// The class.
    pub class: &'static str,
    /// Enroll (`true`) or unenroll.
    pub enroll: bool,
    /// The producer's sequence number.
    pub seq: i64,
}

impl Message {
    /// The history's name of this message.
    #[must_use]
    pub fn op(&self) -> Op {
        if self.enroll {
            Op::Enroll
        } else {
            Op::Unenroll
        }
    }
}

/// What the producer sent, and the result of applying it in order.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// The messages, in sequence order.
    pub messages: Vec<Message>,
    /// Each touched student's classes after the sequential history.
    pub expected: BTreeMap<i64, BTreeSet<String>>,
}

/// The producer: `messages` messages over students `0..students`, each toggling one
/// student's enrollment in one class, stamped with an increasing sequence number.
pub fn produce(rng: &mut impl Rng, students: i64, messages: usize) -> Plan {
    let mut plan = Plan::default();
    for id in 0..messages {
        let student = rng.random_range(0..students);
        let class = CLASSES[rng.random_range(0..CLASSES.len())];
        let classes = plan.expected.entry(student).or_default();
        let enroll = !classes.contains(class);
        if enroll {
            classes.insert(class.to_owned());
        } else {
            classes.remove(class);
        }
        plan.messages.push(Message {
            id,
            student,
            class,
            enroll,
            seq: i64::try_from(id).unwrap_or(i64::MAX),
        });
    }
    plan
}

/// The queue: every message once, [`DUPLICATED`] of them twice, in random order.
pub fn deliver<M: Clone>(rng: &mut impl Rng, messages: &[M]) -> Vec<M> {
    let mut out = messages.to_vec();
    out.extend(
        messages
            .iter()
            .filter(|_| rng.random_bool(DUPLICATED))
            .cloned(),
    );
    out.shuffle(rng);
    out
}

/// A message a [`Mailbox`] can acknowledge: it names itself by its position in the
/// producer's order.
pub trait Delivered: Clone {
    /// The message's position in the producer's order.
    fn id(&self) -> usize;
}

impl Delivered for Message {
    fn id(&self) -> usize {
        self.id
    }
}

/// An at-least-once mailbox shared by consumers: a message is taken, then acknowledged,
/// or put back to be delivered again.
#[derive(Clone, Debug)]
pub struct Mailbox<M = Message> {
    inner: Arc<Mutex<(Vec<M>, BTreeSet<usize>)>>,
}

impl<M> Default for Mailbox<M> {
    fn default() -> Self {
        Self {
            inner: Arc::new(Mutex::new((Vec::new(), BTreeSet::new()))),
        }
    }
}

impl<M: Delivered> Mailbox<M> {
    /// A mailbox holding `deliveries` (taken from the end).
    #[must_use]
    pub fn new(deliveries: Vec<M>) -> Self {
        Self {
            inner: Arc::new(Mutex::new((deliveries, BTreeSet::new()))),
        }
    }

    /// The next delivery, if any.
    #[must_use]
    pub fn take(&self) -> Option<M> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).0.pop()
    }

    /// Acknowledges a message: it was applied.
    pub fn ack(&self, msg: &M) {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .insert(msg.id());
    }

    /// Puts a message back, to be delivered again last.
    pub fn put_back(&self, msg: M) {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .insert(0, msg);
    }

    /// Whether nothing is left to deliver.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .is_empty()
    }

    /// Replaces what is left with every message of `messages` never acknowledged (failed,
    /// timed out, or taken by a killed consumer).
    pub fn redeliver_unacked(&self, messages: &[M]) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let pending = messages
            .iter()
            .filter(|m| !inner.1.contains(&m.id()))
            .cloned()
            .collect();
        inner.0 = pending;
    }
}

/// Setup: the students' sequenced set on `coll`.
///
/// # Errors
/// The set's validation or index creation.
pub async fn open_set(coll: Collection<Document>) -> docwarden::Result<SequencedSet> {
    let set = SequencedSet::new(
        coll,
        SetOptions::default()
            .key_field(KEY_FIELD)
            .field(FIELD)
            .index_members(true),
    )?;
    docwarden::preflight::check(set.collection()).await?;
    set.ensure_indexes().await?;
    Ok(set)
}

/// The operation. Safe: the sequenced add or remove, whose outcome is returned. Control:
/// `$addToSet` / `$pull` with upsert, ignoring the sequence number (`None`).
///
/// # Errors
/// A database error.
pub async fn apply(
    set: &SequencedSet,
    msg: &Message,
    mode: Mode,
) -> docwarden::Result<Option<Outcome>> {
    match mode {
        Mode::Safe if msg.enroll => Ok(Some(set.add(msg.student, msg.class, msg.seq).await?)),
        Mode::Safe => Ok(Some(set.remove(msg.student, msg.class, msg.seq).await?)),
        Mode::Control => {
            let update = if msg.enroll {
                doc! { "$addToSet": { FIELD: msg.class } }
            } else {
                doc! { "$pull": { FIELD: msg.class } }
            };
            set.collection()
                .update_one(doc! { KEY_FIELD: msg.student }, update)
                .upsert(true)
                .await?;
            Ok(None)
        }
    }
}

/// The safe operation of [`apply`] for a batch of messages: one
/// [`SequencedSet::apply_many`] (one round trip for the members the handle has seen, on
/// MongoDB 8.0+), outcomes in message order.
///
/// # Errors
/// A database error.
pub async fn apply_batch(set: &SequencedSet, msgs: &[Message]) -> docwarden::Result<Vec<Outcome>> {
    let ops: Vec<SetOp> = msgs
        .iter()
        .map(|m| set_op(m.student, m.class, m.seq, m.enroll))
        .collect();
    set.apply_many(&ops).await
}

/// The batch operation of one class message: an add (`enroll`) or a remove.
fn set_op(student: i64, class: &str, seq: i64, enroll: bool) -> SetOp {
    if enroll {
        SetOp::add(student, class, seq)
    } else {
        SetOp::remove(student, class, seq)
    }
}

/// What the final read found.
#[derive(Clone, Debug, Default)]
pub struct FinalRead {
    /// Each student's classes (the union over its documents).
    pub classes: BTreeMap<i64, BTreeSet<String>>,
    /// Documents per student.
    pub documents: BTreeMap<i64, u64>,
}

impl FinalRead {
    /// All documents read.
    #[must_use]
    pub fn total_documents(&self) -> u64 {
        self.documents.values().sum()
    }
}

/// The final read of `coll`: every document's student and classes (a class is a string,
/// or, in the seed's format, a document with a `name`).
///
/// # Errors
/// A database error.
pub async fn final_read(coll: &Collection<Document>) -> anyhow::Result<FinalRead> {
    let mut read = FinalRead::default();
    let mut cursor = coll.find(doc! {}).await?;
    while let Some(d) = cursor.try_next().await? {
        let Ok(student) = d.get_i64(KEY_FIELD) else {
            continue;
        };
        *read.documents.entry(student).or_default() += 1;
        let classes = read.classes.entry(student).or_default();
        for c in d.get_array(FIELD).map(Vec::as_slice).unwrap_or_default() {
            let name = match c {
                Bson::String(s) => Some(s.as_str()),
                Bson::Document(c) => c.get_str("name").ok(),
                _ => None,
            };
            if let Some(name) = name {
                classes.insert(name.to_owned());
            }
        }
    }
    Ok(read)
}

/// The checker: each touched student's classes equal the sequential model
/// (`state-mismatch`), in exactly one document (`duplicate-document`).
#[must_use]
pub fn check(plan: &Plan, read: &FinalRead) -> Vec<Violation> {
    let render = |m: &BTreeMap<i64, BTreeSet<String>>| -> BTreeMap<String, Vec<String>> {
        m.iter()
            .map(|(k, v)| (format!("student {k}"), v.iter().cloned().collect()))
            .collect()
    };
    let mut violations = check_against_model(&render(&plan.expected), &render(&read.classes));
    violations.extend(check_one_document_per_key(
        &read
            .documents
            .iter()
            .map(|(k, n)| (format!("student {k}"), *n))
            .collect(),
    ));
    violations
}

/// The seed's own update, translated exactly (its `$or` written as the array MongoDB
/// needs), with upsert: classes and deleted classes as `{ name, seq }` entries. Returns
/// `Applied` if it wrote, `Stale` if its filter matched nothing.
///
/// # Errors
/// A database error.
pub async fn seed_apply(
    coll: &Collection<Document>,
    student: i64,
    class: &str,
    seq: i64,
    enroll: bool,
) -> anyhow::Result<Outcome> {
    let (mine, other) = if enroll {
        (FIELD, "deleted_classes")
    } else {
        ("deleted_classes", FIELD)
    };
    let r = coll
        .update_one(
            doc! {
                KEY_FIELD: student,
                mine: { "$not": { "$elemMatch": { "name": class } } },
                "$or": [
                    { other: { "$not": { "$elemMatch": { "name": class } } } },
                    { other: { "$elemMatch": { "name": class, "seq": { "$lt": seq } } } },
                ],
            },
            doc! {
                "$push": { mine: { "name": class, "seq": seq } },
                "$pull": { other: { "name": class } },
            },
        )
        .upsert(true)
        .await?;
    Ok(if r.modified_count > 0 || r.upserted_id.is_some() {
        Outcome::Applied
    } else {
        Outcome::Stale
    })
}

// ---------------------------------------------------------------------------------------
// The registrar: the student document as a registrar's consumers build it.

/// The second set of a student's document, the classes a student follows from the floor
/// seats of the lecture halls. Its name extends [`FIELD`], as user schemas' names do; under
/// the layout before issue 11 (`_seq_<field>` and `_seq_<field>_floor`) set `classes`'s
/// compaction floor was set `classes_floor`'s state.
pub const FLOOR_FIELD: &str = "classes_floor";

/// The register (`SequencedFields`) holding a student's credits.
pub const CREDITS_FIELD: &str = "credits";

/// Share of credits updates that the second producer publishes again, with the same
/// sequence number and the same value encoded as another numeric type.
pub const REPUBLISHED: f64 = 0.5;

/// A credits value as a producer encoded it: equal numbers, different BSON types (the
/// registrar's old system sends `int32`, the new one `int64`, a spreadsheet import
/// `double`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Credits {
    /// `int32`.
    Int32(i32),
    /// `int64`.
    Int64(i32),
    /// `double`.
    Double(i32),
}

impl Credits {
    /// The value as stored.
    #[must_use]
    pub fn to_bson(self) -> Bson {
        match self {
            Credits::Int32(v) => Bson::Int32(v),
            Credits::Int64(v) => Bson::Int64(i64::from(v)),
            Credits::Double(v) => Bson::Double(f64::from(v)),
        }
    }

    /// The number, whatever its encoding.
    #[must_use]
    pub fn value(self) -> i32 {
        match self {
            Credits::Int32(v) | Credits::Int64(v) | Credits::Double(v) => v,
        }
    }

    /// The same number in the next encoding.
    #[must_use]
    pub fn encoded_differently(self) -> Self {
        match self {
            Credits::Int32(v) => Credits::Int64(v),
            Credits::Int64(v) => Credits::Double(v),
            Credits::Double(v) => Credits::Int32(v),
        }
    }
}

/// What a registrar message changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// Adds (`enroll`) or removes a class in set `field` ([`FIELD`] or [`FLOOR_FIELD`]).
    Class {
        /// The set.
        field: &'static str,
        /// The class.
        class: &'static str,
        /// Add or remove.
        enroll: bool,
    },
    /// Sets the student's credits.
    Credits(Credits),
}

/// One registrar message, stamped by its producer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    /// Position in the producers' order (identifies the message for acknowledgements).
    pub id: usize,
    /// The student.
    pub student: i64,
    /// The sequence number; a republished credits update repeats its original's.
    pub seq: i64,
    /// The change.
    pub change: Change,
}

impl Delivered for Record {
    fn id(&self) -> usize {
        self.id
    }
}

impl Record {
    /// The history's name of this message.
    #[must_use]
    pub fn op(&self) -> &'static str {
        match self.change {
            Change::Class { enroll: true, .. } => Op::Enroll.as_str(),
            Change::Class { enroll: false, .. } => Op::Unenroll.as_str(),
            Change::Credits(_) => "credits",
        }
    }

    /// The history's detail: the set and class, or the credits as encoded.
    #[must_use]
    pub fn detail(&self) -> String {
        match self.change {
            Change::Class { field, class, .. } => format!("{field}: {class}"),
            Change::Credits(c) => format!("{c:?}"),
        }
    }
}

/// A student's state in the model and in the final read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StudentState {
    /// The members of [`FIELD`], sorted.
    pub classes: Vec<String>,
    /// The members of [`FLOOR_FIELD`], sorted.
    pub classes_floor: Vec<String>,
    /// The credits, as a number.
    pub credits: Option<f64>,
}

/// What the registrar's producers sent and the result of applying it in sequence order.
#[derive(Clone, Debug, Default)]
pub struct RecordPlan {
    /// The messages, in the producers' order.
    pub records: Vec<Record>,
    /// Each touched student's state after the sequential history.
    pub expected: BTreeMap<i64, StudentState>,
}

impl RecordPlan {
    /// The messages in sequence order (ties in the producers' order): the replay whose
    /// stored documents every delivery order must reproduce byte for byte.
    #[must_use]
    pub fn in_sequence_order(&self) -> Vec<Record> {
        let mut out = self.records.clone();
        out.sort_by_key(|r| (r.seq, r.id));
        out
    }
}

/// The registrar's producers: `messages` messages over students `0..students`. Most toggle
/// a class in one of the two sets; a fifth set the credits, and [`REPUBLISHED`] of those
/// are published again by the second producer: the same sequence number, the same value,
/// another numeric type.
pub fn produce_records(rng: &mut impl Rng, students: i64, messages: usize) -> RecordPlan {
    let mut plan = RecordPlan::default();
    let mut sets: BTreeMap<(i64, &'static str), BTreeSet<&'static str>> = BTreeMap::new();
    let mut last_credits: BTreeMap<i64, (i64, Credits)> = BTreeMap::new();
    for id in 0..messages {
        let student = rng.random_range(0..students);
        let mut seq = i64::try_from(id).unwrap_or(i64::MAX);
        let roll: f64 = rng.random();
        let change = if roll < 0.2 {
            let credits = match last_credits.get(&student) {
                Some(&(seq0, c0)) if rng.random_bool(REPUBLISHED) => {
                    seq = seq0;
                    c0.encoded_differently()
                }
                _ => {
                    let v = rng.random_range(1..4);
                    match rng.random_range(0..3) {
                        0 => Credits::Int32(v),
                        1 => Credits::Int64(v),
                        _ => Credits::Double(v),
                    }
                }
            };
            last_credits.insert(student, (seq, credits));
            Change::Credits(credits)
        } else {
            let field = if roll < 0.5 { FLOOR_FIELD } else { FIELD };
            let class = CLASSES[rng.random_range(0..CLASSES.len())];
            let members = sets.entry((student, field)).or_default();
            let enroll = members.insert(class);
            if !enroll {
                members.remove(class);
            }
            Change::Class {
                field,
                class,
                enroll,
            }
        };
        plan.records.push(Record {
            id,
            student,
            seq,
            change,
        });
    }
    for ((student, field), members) in sets {
        let state = plan.expected.entry(student).or_default();
        let members = members.into_iter().map(str::to_owned).collect();
        if field == FIELD {
            state.classes = members;
        } else {
            state.classes_floor = members;
        }
    }
    for (student, (_, credits)) in last_credits {
        plan.expected.entry(student).or_default().credits = Some(f64::from(credits.value()));
    }
    plan
}

/// The registrar's handles on one collection: the two sets and the credits register, all
/// keyed by [`KEY_FIELD`].
#[derive(Clone, Debug)]
pub struct Registrar {
    /// Set [`FIELD`].
    pub classes: SequencedSet,
    /// Set [`FLOOR_FIELD`].
    pub classes_floor: SequencedSet,
    /// The register holding [`CREDITS_FIELD`].
    pub fields: SequencedFields,
}

/// Setup: the registrar's sets and register on `coll`.
///
/// # Errors
/// Validation, preflight or index creation.
pub async fn open_registrar(coll: Collection<Document>) -> docwarden::Result<Registrar> {
    let classes = open_set(coll.clone()).await?;
    let classes_floor = SequencedSet::new(
        coll.clone(),
        SetOptions::default()
            .key_field(KEY_FIELD)
            .field(FLOOR_FIELD),
    )?;
    classes_floor.ensure_indexes().await?;
    let fields = SequencedFields::new(coll, FieldsOptions::default().key_field(KEY_FIELD))?;
    fields.ensure_indexes().await?;
    Ok(Registrar {
        classes,
        classes_floor,
        fields,
    })
}

/// The operation. Safe: the sequenced add, remove or register write. Control: `$addToSet`,
/// `$pull` or `$set` with upsert, ignoring the sequence number (`None`).
///
/// # Errors
/// A database error.
pub async fn apply_record(
    registrar: &Registrar,
    rec: &Record,
    mode: Mode,
) -> docwarden::Result<Option<Outcome>> {
    let set = |field: &str| {
        if field == FIELD {
            &registrar.classes
        } else {
            &registrar.classes_floor
        }
    };
    match (mode, rec.change) {
        (
            Mode::Safe,
            Change::Class {
                field,
                class,
                enroll,
            },
        ) => {
            let set = set(field);
            Ok(Some(if enroll {
                set.add(rec.student, class, rec.seq).await?
            } else {
                set.remove(rec.student, class, rec.seq).await?
            }))
        }
        (Mode::Safe, Change::Credits(c)) => Ok(Some(
            registrar
                .fields
                .set(rec.student, CREDITS_FIELD, c.to_bson(), rec.seq)
                .await?,
        )),
        (Mode::Control, change) => {
            let update = match change {
                Change::Class {
                    field,
                    class,
                    enroll: true,
                } => doc! { "$addToSet": { field: class } },
                Change::Class { field, class, .. } => doc! { "$pull": { field: class } },
                Change::Credits(c) => doc! { "$set": { CREDITS_FIELD: c.to_bson() } },
            };
            registrar
                .fields
                .collection()
                .update_one(doc! { KEY_FIELD: rec.student }, update)
                .upsert(true)
                .await?;
            Ok(None)
        }
    }
}

/// The operation of [`apply_record`] for several messages at once. Safe: each set's class
/// messages go through one [`SequencedSet::apply_many`] (the operations the handle can
/// predict in one `bulkWrite` on MongoDB 8.0+), the credits one by one after them.
/// Control: each message as [`apply_record`] applies it. Outcomes in message order.
///
/// # Errors
/// A database error (some messages of the batch may have been applied: a redelivery is
/// harmless by design).
pub async fn apply_records(
    registrar: &Registrar,
    recs: &[Record],
    mode: Mode,
) -> docwarden::Result<Vec<Option<Outcome>>> {
    let mut outcomes = vec![None; recs.len()];
    if mode == Mode::Safe {
        for (name, set) in [
            (FIELD, &registrar.classes),
            (FLOOR_FIELD, &registrar.classes_floor),
        ] {
            let (positions, ops): (Vec<usize>, Vec<SetOp>) = recs
                .iter()
                .enumerate()
                .filter_map(|(i, r)| match r.change {
                    Change::Class {
                        field,
                        class,
                        enroll,
                    } if field == name => Some((i, set_op(r.student, class, r.seq, enroll))),
                    _ => None,
                })
                .unzip();
            if ops.is_empty() {
                continue;
            }
            for (i, outcome) in positions.into_iter().zip(set.apply_many(&ops).await?) {
                outcomes[i] = Some(outcome);
            }
        }
    }
    for (i, rec) in recs.iter().enumerate() {
        if mode == Mode::Control || matches!(rec.change, Change::Credits(_)) {
            outcomes[i] = apply_record(registrar, rec, mode).await?;
        }
    }
    Ok(outcomes)
}

/// What the final read of the registrar's collection found.
#[derive(Clone, Debug, Default)]
pub struct RecordRead {
    /// Each student's state (of its last document, if several).
    pub states: BTreeMap<i64, StudentState>,
    /// Documents per student.
    pub documents: BTreeMap<i64, u64>,
    /// Each student's document as compared byte for byte (see [`comparable`]).
    pub stored: BTreeMap<i64, Document>,
}

/// A stored document as `docs/sequence.md` promises it independent of delivery order:
/// without `_id`, with its top-level fields and the sets' `_seq_sets` entries in name
/// order (with several sets in one document their order follows first use, a documented
/// limit); everything else as stored (members' order, state entries' order, BSON types).
#[must_use]
pub fn comparable(stored: &Document) -> Document {
    let mut fields: Vec<(String, Bson)> = stored
        .iter()
        .filter(|(k, _)| k.as_str() != "_id")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    fields.sort_by(|a, b| a.0.cmp(&b.0));
    fields
        .into_iter()
        .map(|(k, v)| match v {
            Bson::Document(sets) if k == "_seq_sets" => {
                let mut entries: Vec<(String, Bson)> = sets.into_iter().collect();
                entries.sort_by(|a, b| a.0.cmp(&b.0));
                (k, Bson::Document(entries.into_iter().collect()))
            }
            v => (k, v),
        })
        .collect()
}

/// The final read of the registrar's collection `coll`.
///
/// # Errors
/// A database error.
pub async fn read_records(coll: &Collection<Document>) -> anyhow::Result<RecordRead> {
    let mut read = RecordRead::default();
    let mut cursor = coll.find(doc! {}).await?;
    let members = |d: &Document, field: &str| -> Vec<String> {
        let mut out: Vec<String> = d
            .get_array(field)
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .filter_map(|m| m.as_str().map(str::to_owned))
            .collect();
        out.sort();
        out
    };
    while let Some(d) = cursor.try_next().await? {
        let Ok(student) = d.get_i64(KEY_FIELD) else {
            continue;
        };
        *read.documents.entry(student).or_default() += 1;
        let credits = match d.get(CREDITS_FIELD) {
            Some(Bson::Int32(v)) => Some(f64::from(*v)),
            #[allow(clippy::cast_precision_loss)]
            Some(Bson::Int64(v)) => Some(*v as f64),
            Some(Bson::Double(v)) => Some(*v),
            _ => None,
        };
        read.states.insert(
            student,
            StudentState {
                classes: members(&d, FIELD),
                classes_floor: members(&d, FLOOR_FIELD),
                credits,
            },
        );
        read.stored.insert(student, comparable(&d));
    }
    Ok(read)
}

/// The registrar's checker: each touched student's two sets and credits equal the
/// sequential model (`state-mismatch`), in one document (`duplicate-document`), and the
/// stored document equals, byte for byte, the one of `replay` (the same messages applied
/// once each in sequence order) (`order-dependent-document`).
#[must_use]
pub fn check_records(plan: &RecordPlan, live: &RecordRead, replay: &RecordRead) -> Vec<Violation> {
    let key = |k: &i64| format!("student {k}");
    let render = |m: &BTreeMap<i64, StudentState>| -> BTreeMap<String, StudentState> {
        m.iter().map(|(k, v)| (key(k), v.clone())).collect()
    };
    let mut violations = check_against_model(&render(&plan.expected), &render(&live.states));
    violations.extend(check_one_document_per_key(
        &live.documents.iter().map(|(k, n)| (key(k), *n)).collect(),
    ));
    let stored = |m: &BTreeMap<i64, Document>| -> BTreeMap<String, Document> {
        m.iter().map(|(k, v)| (key(k), v.clone())).collect()
    };
    violations.extend(check_identical_documents(
        &stored(&replay.stored),
        &stored(&live.stored),
    ));
    violations
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    #[test]
    fn the_plan_is_the_sequential_history_and_delivery_keeps_every_message() {
        let mut rng = StdRng::seed_from_u64(1);
        let plan = produce(&mut rng, 5, 200);
        let mut replay: BTreeMap<i64, BTreeSet<String>> = BTreeMap::new();
        for m in &plan.messages {
            let classes = replay.entry(m.student).or_default();
            assert_eq!(m.enroll, !classes.contains(m.class), "messages toggle");
            if m.enroll {
                classes.insert(m.class.to_owned());
            } else {
                classes.remove(m.class);
            }
        }
        assert_eq!(replay, plan.expected);
        let delivered = deliver(&mut rng, &plan.messages);
        let ids: BTreeSet<usize> = delivered.iter().map(|m| m.id).collect();
        assert_eq!(
            ids.len(),
            plan.messages.len(),
            "every message at least once"
        );
        assert!(delivered.len() > plan.messages.len(), "some twice");
    }

    #[test]
    fn the_checker_counts_wrong_classes_and_duplicate_documents() {
        let plan = produce(&mut StdRng::seed_from_u64(2), 3, 30);
        let mut read = FinalRead {
            classes: plan.expected.clone(),
            documents: plan.expected.keys().map(|k| (*k, 1)).collect(),
        };
        assert!(check(&plan, &read).is_empty());
        let (first, _) = plan
            .expected
            .iter()
            .next()
            .map(|(k, v)| (*k, v))
            .unwrap_or((0, &BTreeSet::new()));
        read.documents.insert(first, 2);
        read.classes
            .entry(first)
            .or_default()
            .insert("NOT A CLASS".to_owned());
        let kinds: Vec<&str> = check(&plan, &read).iter().map(|v| v.kind).collect();
        assert_eq!(kinds.len(), 2, "{kinds:?}");
        assert!(kinds.contains(&"duplicate-document"));
    }

    #[test]
    fn the_mailbox_redelivers_what_was_not_acknowledged() {
        let plan = produce(&mut StdRng::seed_from_u64(3), 2, 4);
        let mailbox = Mailbox::new(plan.messages.clone());
        let first = mailbox.take();
        assert!(first.is_some());
        if let Some(m) = first {
            mailbox.ack(&m);
        }
        let second = mailbox.take();
        mailbox.redeliver_unacked(&plan.messages);
        let mut left = 0;
        while mailbox.take().is_some() {
            left += 1;
        }
        assert_eq!(left, 3, "all but the acknowledged one, {second:?} included");
    }
}
