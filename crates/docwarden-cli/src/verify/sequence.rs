//! Records seed 001 (`docwarden_workloads::enrollment`): enroll/unenroll messages stamped
//! with sequence numbers, delivered shuffled and partly duplicated to the workers.
//!
//! A message whose apply failed or whose worker was killed is delivered again (queues
//! deliver at least once); duplicates are harmless by design. The control run applies
//! messages without sequence numbers, as a naive consumer would. Checked: each student's
//! final classes equal the sequential model, one document each.

use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden::check::Event;
use docwarden::sequence::SequencedSet;
use docwarden_workloads::Process;
use docwarden_workloads::enrollment::{self, Mailbox};
use mongodb::bson::Document;

use super::context::{Ctx, Findings};

const STUDENTS: i64 = 40;
const MESSAGES: usize = 1_200;

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    let coll = ctx.db.collection::<Document>("students");
    let set = enrollment::open_set(coll.clone()).await?;
    let mut rng = ctx.rng(Process::Producer);
    let plan = enrollment::produce(&mut rng, STUDENTS, MESSAGES);
    let mailbox = Mailbox::new(enrollment::deliver(&mut rng, &plan.messages));
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
    // Redeliver every message never acknowledged (failed, timed out, killed mid-apply).
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
