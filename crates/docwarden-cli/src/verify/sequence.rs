//! The sequence workload: enroll/unenroll messages for 20 students, stamped with sequence
//! numbers, delivered shuffled and partly duplicated to the workers.
//!
//! A message whose apply failed or whose worker was killed is delivered again (queues
//! deliver at least once); duplicates are harmless by design. The control run applies
//! messages without sequence numbers (`$addToSet` / `$pull`), as a naive consumer would.
//! Checked: each student's final classes equal the sequential model, one document each.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use docwarden::check::state::{check_against_model, check_one_document_per_key};
use docwarden::sequence::{SequencedSet, SetOptions};
use futures::TryStreamExt;
use mongodb::bson::{Document, doc};
use rand::Rng;
use rand::seq::SliceRandom;

use super::{Ctx, Findings};

const STUDENTS: usize = 20;
const CLASSES: [&str; 5] = ["CS101", "CS102", "MA201", "PH110", "EN150"];

#[derive(Clone, Debug)]
struct Msg {
    id: usize,
    student: String,
    class: &'static str,
    seq: i64,
    enroll: bool,
}

struct Mailbox {
    pending: Vec<Msg>,
    acked: BTreeSet<usize>,
}

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    let coll = ctx.db.collection::<Document>("students");
    let set =
        SequencedSet::open(&ctx.db, coll.name(), SetOptions::default().field("classes")).await?;
    // The producer: 60 messages per student with increasing sequence numbers.
    let mut rng = ctx.rng(u32::MAX - 3);
    let mut messages = Vec::new();
    let mut seq = 0_i64;
    for _ in 0..60 {
        for s in 0..STUDENTS {
            seq += 1;
            messages.push(Msg {
                id: messages.len(),
                student: format!("student{s}"),
                class: CLASSES[rng.random_range(0..CLASSES.len())],
                seq,
                enroll: rng.random_bool(0.6),
            });
        }
    }
    // Delivery: shuffled, 20 % delivered twice.
    let mut delivery: Vec<Msg> = messages.clone();
    delivery.extend(messages.iter().filter(|_| rng.random_bool(0.2)).cloned());
    delivery.shuffle(&mut rng);
    let mailbox = Arc::new(Mutex::new(Mailbox {
        pending: delivery,
        acked: BTreeSet::new(),
    }));
    let (c, s, m) = (Arc::clone(&ctx), set.clone(), Arc::clone(&mailbox));
    ctx.supervise("sequence", move |process| {
        let (ctx, set, mailbox) = (Arc::clone(&c), s.clone(), Arc::clone(&m));
        async move {
            consume(&ctx, &set, &mailbox, process).await;
            Ok(())
        }
    })
    .await;
    // Redeliver every message never acknowledged (failed, timed out, killed mid-apply).
    let unacked: Vec<Msg> = {
        let m = mailbox.lock().unwrap_or_else(|p| p.into_inner());
        messages
            .iter()
            .filter(|msg| !m.acked.contains(&msg.id))
            .cloned()
            .collect()
    };
    {
        let mut m = mailbox.lock().unwrap_or_else(|p| p.into_inner());
        m.pending = unacked;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline
        && !mailbox
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pending
            .is_empty()
    {
        consume_until(&ctx, &set, &mailbox, u32::MAX - 1, deadline).await;
    }

    // The model: every message applied in sequence order.
    let mut model_state: BTreeMap<String, BTreeMap<&str, (i64, bool)>> = BTreeMap::new();
    for m in &messages {
        let entry = model_state.entry(m.student.clone()).or_default();
        let current = entry.get(m.class).copied();
        if docwarden::sequence::set::resolve(current, m.seq, m.enroll)
            == docwarden::sequence::ApplyOutcome::Applied
        {
            entry.insert(m.class, (m.seq, m.enroll));
        }
    }
    let model: BTreeMap<String, Vec<String>> = model_state
        .into_iter()
        .map(|(k, v)| {
            let present: Vec<String> = v
                .into_iter()
                .filter(|(_, (_, p))| *p)
                .map(|(c, _)| c.to_owned())
                .collect();
            (k, present)
        })
        .collect();
    let mut found: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut per_key: BTreeMap<String, u64> = BTreeMap::new();
    let mut cursor = coll.find(doc! {}).await?;
    while let Some(d) = cursor.try_next().await? {
        let key = d
            .get("_id")
            .map(|b| b.as_str().map_or_else(|| b.to_string(), str::to_owned))
            .unwrap_or_default();
        *per_key.entry(key.clone()).or_default() += 1;
        let mut classes: Vec<String> = d
            .get_array("classes")
            .map(|a| {
                a.iter()
                    .filter_map(|b| b.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        classes.sort();
        found.insert(key, classes);
    }
    let mut violations = check_against_model(&model, &found);
    violations.extend(check_one_document_per_key(&per_key));
    Ok(Findings {
        operations: u64::try_from(ctx.history.len()).unwrap_or(u64::MAX),
        violations,
    })
}

async fn consume(ctx: &Ctx, set: &SequencedSet, mailbox: &Mutex<Mailbox>, process: u32) {
    let deadline = Instant::now() + ctx.duration;
    consume_until(ctx, set, mailbox, process, deadline).await;
}

async fn consume_until(
    ctx: &Ctx,
    set: &SequencedSet,
    mailbox: &Mutex<Mailbox>,
    process: u32,
    deadline: Instant,
) {
    let mut rng = ctx.rng(process);
    let raw = set.collection().clone();
    while Instant::now() < deadline {
        let Some(msg) = mailbox
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pending
            .pop()
        else {
            return;
        };
        ctx.maybe_pause(&mut rng, process, 0.01, Duration::from_millis(300))
            .await;
        let op = if msg.enroll { "add" } else { "remove" };
        let result: docwarden::Result<()> = if ctx.control {
            let update = if msg.enroll {
                doc! { "$addToSet": { "classes": msg.class } }
            } else {
                doc! { "$pull": { "classes": msg.class } }
            };
            raw.update_one(doc! { "_id": &msg.student }, update)
                .upsert(true)
                .await
                .map(drop)
                .map_err(docwarden::Error::from)
        } else if msg.enroll {
            set.add(msg.student.as_str(), msg.class, msg.seq)
                .await
                .map(drop)
        } else {
            set.remove(msg.student.as_str(), msg.class, msg.seq)
                .await
                .map(drop)
        };
        let start = ctx.history.now_us();
        ctx.history.push(
            docwarden::check::Event::new(process, op, &msg.student, start, start)
                .value(msg.seq)
                .outcome(Ctx::outcome_of(&result))
                .detail(msg.class),
        );
        let failed = {
            let mut m = mailbox.lock().unwrap_or_else(|p| p.into_inner());
            match result {
                Ok(()) => {
                    m.acked.insert(msg.id);
                    false
                }
                Err(_) => {
                    // Redelivered later, like an unacknowledged queue message.
                    m.pending.insert(0, msg);
                    true
                }
            }
        };
        if failed {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
