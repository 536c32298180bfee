//! Records the registrar workload of seed 001 (`docwarden_workloads::enrollment`): each
//! student's document holds two sequenced sets whose names extend each other (`classes`,
//! `classes_floor`) and a sequenced credits register; messages are stamped with sequence
//! numbers, and a second producer republishes half the credits updates with the same number
//! and the same value encoded as another numeric type (`int32`, `int64`, `double`). The
//! messages reach the workers shuffled and partly duplicated.
//!
//! A message whose apply failed or whose worker was killed is delivered again (queues
//! deliver at least once); duplicates are harmless by design. The control run applies
//! messages without sequence numbers, as a naive consumer would. Checked: each student's
//! two sets and credits equal the sequential model, one document each, and the stored
//! document equals byte for byte (BSON types and the order of members and state entries
//! included) the one a single consumer stores applying the same messages once each in
//! sequence order, on a second collection (`docs/sequence.md`, "The stored document does
//! not depend on delivery order").

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use docwarden::check::Event;
use docwarden_workloads::Process;
use docwarden_workloads::enrollment::{self, Mailbox, Record, Registrar};
use mongodb::bson::Document;

use super::context::{Ctx, Findings};

const STUDENTS: i64 = 40;
const MESSAGES: usize = 1_200;

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    let coll = ctx.db.collection::<Document>("students");
    let registrar = enrollment::open_registrar(coll.clone()).await?;
    let mut rng = ctx.rng(Process::Producer);
    let plan = enrollment::produce_records(&mut rng, STUDENTS, MESSAGES);
    let mailbox = Mailbox::new(enrollment::deliver(&mut rng, &plan.records));
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
    // Redeliver every message never acknowledged (failed, timed out, killed mid-apply).
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

async fn consume(
    ctx: &Ctx,
    registrar: &Registrar,
    mailbox: &Mailbox<Record>,
    process: Process,
    deadline: Instant,
) {
    let mut rng = ctx.rng(process);
    while Instant::now() < deadline {
        let Some(rec) = mailbox.take() else {
            return;
        };
        ctx.maybe_pause(&mut rng, process, 0.01, Duration::from_millis(300))
            .await;
        let result = enrollment::apply_record(registrar, &rec, ctx.mode).await;
        let at = ctx.history.now_us();
        ctx.history.push(
            Event::new(
                process.id(),
                rec.op(),
                &format!("student {}", rec.student),
                at,
                at,
            )
            .value(rec.seq)
            .outcome(Ctx::outcome_of(&result))
            .detail(rec.detail()),
        );
        if result.is_ok() {
            mailbox.ack(&rec);
        } else {
            // Redelivered later, like an unacknowledged queue message.
            mailbox.put_back(rec);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
