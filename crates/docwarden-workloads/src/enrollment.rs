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
use docwarden::check::state::{check_against_model, check_one_document_per_key};
use docwarden::sequence::{ApplyOutcome as Outcome, SequencedSet, SetOptions};
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
pub fn deliver(rng: &mut impl Rng, messages: &[Message]) -> Vec<Message> {
    let mut out = messages.to_vec();
    out.extend(
        messages
            .iter()
            .filter(|_| rng.random_bool(DUPLICATED))
            .copied(),
    );
    out.shuffle(rng);
    out
}

/// An at-least-once mailbox shared by consumers: a message is taken, then acknowledged,
/// or put back to be delivered again.
#[derive(Clone, Debug, Default)]
pub struct Mailbox {
    inner: Arc<Mutex<(Vec<Message>, BTreeSet<usize>)>>,
}

impl Mailbox {
    /// A mailbox holding `deliveries` (taken from the end).
    #[must_use]
    pub fn new(deliveries: Vec<Message>) -> Self {
        Self {
            inner: Arc::new(Mutex::new((deliveries, BTreeSet::new()))),
        }
    }

    /// The next delivery, if any.
    #[must_use]
    pub fn take(&self) -> Option<Message> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).0.pop()
    }

    /// Acknowledges a message: it was applied.
    pub fn ack(&self, msg: &Message) {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .insert(msg.id);
    }

    /// Puts a message back, to be delivered again last.
    pub fn put_back(&self, msg: Message) {
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
    pub fn redeliver_unacked(&self, messages: &[Message]) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let pending = messages
            .iter()
            .filter(|m| !inner.1.contains(&m.id))
            .copied()
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
