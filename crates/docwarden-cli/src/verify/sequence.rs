//! Records the registrar workload of seed 001 (`docwarden_workloads::enrollment`): each
//! student's document holds two sequenced sets whose names extend each other (`classes`,
//! `classes_floor`) and a sequenced credits register; messages are stamped with sequence
//! numbers, and a second producer republishes half the credits updates with the same number
//! and the same value encoded as another numeric type (`int32`, `int64`, `double`). The
//! messages reach the workers shuffled and partly duplicated.
//!
//! A message whose apply failed or whose worker was killed is delivered again (queues
//! deliver at least once); duplicates are harmless by design. Worker tasks share one
//! mailbox; a worker process takes every `workers`-th delivery (its slot's share), and its
//! replacement takes the same share again from the start (a redelivery). Consumers with an
//! odd id take four messages at a time and apply them as one batch
//! (`SequencedSet::apply_many` per set). The control run applies messages without
//! sequence numbers, as a naive consumer would. Checked: each student's
//! two sets and credits equal the sequential model, one document each, and the stored
//! document equals byte for byte (BSON types and the order of members and state entries
//! included) the one a single consumer stores applying the same messages once each in
//! sequence order, on a second collection (`docs/sequence.md`, "The stored document does
//! not depend on delivery order").

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use docwarden::check::{Event, OpOutcome};
use docwarden_workloads::Process;
use docwarden_workloads::enrollment::{self, Mailbox, Record, RecordPlan, Registrar};
use mongodb::bson::Document;

use super::context::{Ctx, Findings};

const STUDENTS: i64 = 40;
const MESSAGES: usize = 1_200;

const STUDENTS_COLLECTION: &str = "students";
/// Messages per batch of the batching consumers (processes with an odd id).
const BATCH: usize = 4;

/// The producers' plan and the shuffled deliveries, the same in every process of a run.
fn plan(ctx: &Ctx) -> (RecordPlan, Vec<Record>) {
    let mut rng = ctx.rng(Process::Producer);
    let plan = enrollment::produce_records(&mut rng, STUDENTS, MESSAGES);
    let deliveries = enrollment::deliver(&mut rng, &plan.records);
    (plan, deliveries)
}

/// The history's key of a message about `student`.
fn key(student: i64) -> String {
    format!("student {student}")
}

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    let coll = ctx.db.collection::<Document>(STUDENTS_COLLECTION);
    let registrar = enrollment::open_registrar(coll.clone()).await?;
    let (plan, deliveries) = plan(&ctx);
    let mailbox = Mailbox::new(deliveries);
    let (c, r, m) = (Arc::clone(&ctx), registrar.clone(), mailbox.clone());
    ctx.supervise("sequence", move |process| {
        let (ctx, registrar, mailbox) = (Arc::clone(&c), r.clone(), m.clone());
        async move {
            let deadline = Instant::now() + ctx.duration;
            consume(&ctx, &registrar, &mailbox, process, deadline).await;
            Ok(())
        }
    })
    .await;
    // Acknowledge every message applied (by a task or a process: the history names it by
    // student, operation, sequence number and value), then redeliver every message never
    // acknowledged (failed, timed out, killed mid-apply).
    let applied: std::collections::BTreeSet<(String, String, i64, String)> = ctx
        .history
        .events()
        .into_iter()
        .filter(|e| e.outcome == OpOutcome::Ok)
        .filter_map(|e| Some((e.key, e.op, e.value?, e.detail)))
        .collect();
    for rec in &plan.records {
        if applied.contains(&(key(rec.student), rec.op().to_owned(), rec.seq, rec.detail())) {
            mailbox.ack(rec);
        }
    }
    mailbox.redeliver_unacked(&plan.records);
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline && !mailbox.is_empty() {
        consume(&ctx, &registrar, &mailbox, Process::Drain, deadline).await;
    }
    let live = enrollment::read_records(&coll).await?;
    let replay = replay(&ctx, &plan.in_sequence_order()).await?;
    Ok(Findings {
        operations: u64::try_from(ctx.history.len()).unwrap_or(u64::MAX),
        violations: enrollment::check_records(&plan, &live, &replay),
    })
}

/// A worker process: applies its slot's share of the deliveries until the deadline.
pub(super) async fn worker(ctx: &Ctx, process: Process) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let Some(registrar) = ctx
        .setup(process, deadline, || {
            enrollment::open_registrar(ctx.db.collection::<Document>(STUDENTS_COLLECTION))
        })
        .await?
    else {
        return Ok(());
    };
    let slot = ctx.slot.map_or(0, |s| s.index);
    let (_, deliveries) = plan(ctx);
    let share = deliveries
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % ctx.workers.max(1) == slot)
        .map(|(_, m)| m)
        .collect();
    consume(ctx, &registrar, &Mailbox::new(share), process, deadline).await;
    Ok(())
}

/// The reference: one consumer applies every message once, in sequence order, to
/// `students_replay` (same code and mode; not recorded in the history). A failed apply is
/// retried (fail points may still match this client).
async fn replay(ctx: &Ctx, records: &[Record]) -> anyhow::Result<enrollment::RecordRead> {
    let coll = ctx.db.collection::<Document>("students_replay");
    let registrar = enrollment::open_registrar(coll.clone()).await?;
    for rec in records {
        let mut attempts = 0;
        loop {
            match enrollment::apply_record(&registrar, rec, ctx.mode).await {
                Ok(_) => break,
                Err(e) if attempts < 50 => {
                    attempts += 1;
                    tracing::debug!(error = %e, "replay apply failed, retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e).context("the sequential replay could not apply"),
            }
        }
    }
    enrollment::read_records(&coll).await
}

/// Applies messages from `mailbox` until it is empty or the deadline passes: one at a
/// time, or [`BATCH`] at a time (`enrollment::apply_records`, one `apply_many` per set)
/// for processes with an odd id. Every message gets its own event.
async fn consume(
    ctx: &Ctx,
    registrar: &Registrar,
    mailbox: &Mailbox<Record>,
    process: Process,
    deadline: Instant,
) {
    let mut rng = ctx.rng(process);
    let batch = if process.id() % 2 == 1 { BATCH } else { 1 };
    while Instant::now() < deadline {
        let recs: Vec<Record> = std::iter::from_fn(|| mailbox.take()).take(batch).collect();
        if recs.is_empty() {
            return;
        }
        ctx.maybe_pause(&mut rng, process, 0.01, Duration::from_millis(300))
            .await;
        let result = if let [rec] = recs.as_slice() {
            enrollment::apply_record(registrar, rec, ctx.mode)
                .await
                .map(|o| vec![o])
        } else {
            enrollment::apply_records(registrar, &recs, ctx.mode).await
        };
        let at = ctx.history.now_us();
        // A batch that failed may have applied some of its messages.
        let outcome = match Ctx::outcome_of(&result) {
            OpOutcome::Failed if recs.len() > 1 => OpOutcome::Indeterminate,
            outcome => outcome,
        };
        for rec in &recs {
            ctx.history.push(
                Event::new(process.id(), rec.op(), &key(rec.student), at, at)
                    .value(rec.seq)
                    .outcome(outcome)
                    .detail(rec.detail()),
            );
        }
        if result.is_ok() {
            for rec in &recs {
                mailbox.ack(rec);
            }
        } else {
            // Redelivered later, like unacknowledged queue messages.
            for rec in recs {
                mailbox.put_back(rec);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
