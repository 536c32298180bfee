//! Records seed 001 (`docwarden_workloads::enrollment`): enroll/unenroll messages stamped
//! with sequence numbers, delivered shuffled and partly duplicated to the workers.
//!
//! A message whose apply failed or whose worker was killed is delivered again (queues
//! deliver at least once); duplicates are harmless by design. Worker tasks share one
//! mailbox; a worker process takes every `workers`-th delivery (its slot's share), and its
//! replacement takes the same share again from the start (a redelivery). The control run applies
//! messages without sequence numbers, as a naive consumer would. Checked: each student's
//! final classes equal the sequential model, one document each.

use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden::check::{Event, OpOutcome};
use docwarden::sequence::SequencedSet;
use docwarden_workloads::Process;
use docwarden_workloads::enrollment::{self, Mailbox, Message, Op, Plan};
use mongodb::bson::Document;

use super::context::{Ctx, Findings};

const STUDENTS: i64 = 40;
const MESSAGES: usize = 1_200;

const STUDENTS_COLLECTION: &str = "students";

/// The producer's plan and the shuffled deliveries, the same in every process of a run.
fn plan(ctx: &Ctx) -> (Plan, Vec<Message>) {
    let mut rng = ctx.rng(Process::Producer);
    let plan = enrollment::produce(&mut rng, STUDENTS, MESSAGES);
    let deliveries = enrollment::deliver(&mut rng, &plan.messages);
    (plan, deliveries)
}

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    let coll = ctx.db.collection::<Document>(STUDENTS_COLLECTION);
    let set = enrollment::open_set(coll.clone()).await?;
    let (plan, deliveries) = plan(&ctx);
    let mailbox = Mailbox::new(deliveries);
    let (c, s, m) = (Arc::clone(&ctx), set.clone(), mailbox.clone());
    ctx.supervise("sequence", move |process| {
        let (ctx, set, mailbox) = (Arc::clone(&c), s.clone(), m.clone());
        async move {
            let deadline = Instant::now() + ctx.duration;
            consume(&ctx, &set, &mailbox, process, deadline).await;
            Ok(())
        }
    })
    .await;
    // Acknowledge every message applied (by a task or a process), then redeliver every
    // message never acknowledged (failed, timed out, killed mid-apply).
    for e in ctx.history.events() {
        let applied = e.outcome == OpOutcome::Ok
            && (e.op == Op::Enroll.as_str() || e.op == Op::Unenroll.as_str());
        if let Some(msg) = e
            .value
            .and_then(|seq| usize::try_from(seq).ok())
            .and_then(|seq| plan.messages.get(seq))
            .filter(|_| applied)
        {
            mailbox.ack(msg);
        }
    }
    mailbox.redeliver_unacked(&plan.messages);
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline && !mailbox.is_empty() {
        consume(&ctx, &set, &mailbox, Process::Drain, deadline).await;
    }
    let read = enrollment::final_read(&coll).await?;
    Ok(Findings {
        operations: u64::try_from(ctx.history.len()).unwrap_or(u64::MAX),
        violations: enrollment::check(&plan, &read),
    })
}

/// A worker process: applies its slot's share of the deliveries until the deadline.
pub(super) async fn worker(ctx: &Ctx, process: Process) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let set = enrollment::open_set(ctx.db.collection::<Document>(STUDENTS_COLLECTION)).await?;
    let slot = ctx.slot.map_or(0, |s| s.index);
    let (_, deliveries) = plan(ctx);
    let share = deliveries
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % ctx.workers.max(1) == slot)
        .map(|(_, m)| m)
        .collect();
    consume(ctx, &set, &Mailbox::new(share), process, deadline).await;
    Ok(())
}

async fn consume(
    ctx: &Ctx,
    set: &SequencedSet,
    mailbox: &Mailbox,
    process: Process,
    deadline: Instant,
) {
    let mut rng = ctx.rng(process);
    while Instant::now() < deadline {
        let Some(msg) = mailbox.take() else {
            return;
        };
        ctx.maybe_pause(&mut rng, process, 0.01, Duration::from_millis(300))
            .await;
        let result = enrollment::apply(set, &msg, ctx.mode).await;
        let at = ctx.history.now_us();
        ctx.history.push(
            Event::new(
                process.id(),
                msg.op().as_str(),
                &format!("student {}", msg.student),
                at,
                at,
            )
            .value(msg.seq)
            .outcome(Ctx::outcome_of(&result))
            .detail(msg.class),
        );
        if result.is_ok() {
            mailbox.ack(&msg);
        } else {
            // Redelivered later, like an unacknowledged queue message.
            mailbox.put_back(msg);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
