//! Records the semaphore workload (`docwarden_workloads::semaphore`): every worker takes
//! permits of one resource with 3 permits, holds each for 5–30 ms and releases it; now and
//! then it crashes (never releases: the permit must expire by server time) and, under
//! `pause`, it stops past the permit's ttl before releasing. Checked from the history:
//! never more than 3 holders at any server instant (inner intervals, see the workload) and
//! tokens in real-time order. The control counts every holder as expired.

use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden::lock::Owner;
use docwarden_workloads::Process;
use docwarden_workloads::semaphore::{self, RESOURCE};
use rand::Rng;

use super::context::{Ctx, Findings};

/// The permits of the resource.
const PERMITS: u32 = 3;
/// A permit's ttl (what a `sigstop` must outlive).
pub(super) const TTL: Duration = Duration::from_millis(500);
const SEM: &str = "verify_semaphore";

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    semaphore::open(
        &ctx.db,
        SEM,
        docwarden::clock::TimeSource::server(ctx.client.clone(), Default::default())?,
        PERMITS,
        ctx.mode,
    )
    .await?;
    let c = Arc::clone(&ctx);
    ctx.supervise("semaphore", move |process| {
        let ctx = Arc::clone(&c);
        async move { worker(&ctx, process).await }
    })
    .await;
    let events = ctx.history.events();
    Ok(Findings {
        operations: u64::try_from(events.len()).unwrap_or(u64::MAX),
        violations: semaphore::violations(&events, usize::try_from(PERMITS)?),
    })
}

/// Acquire, hold, release (or crash, or pause past the ttl) until the deadline.
pub(super) async fn worker(ctx: &Ctx, process: Process) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let time = ctx.clock(process)?;
    let Some(sem) = ctx
        .setup(process, deadline, || {
            semaphore::open(&ctx.db, SEM, time.clone(), PERMITS, ctx.mode)
        })
        .await?
    else {
        return Ok(());
    };
    let mut rng = ctx.rng(process);
    while Instant::now() < deadline {
        let owner = Owner::random();
        let Ok(sent) = time.now().await else { continue };
        let permit = match sem
            .acquire(&owner, RESOURCE, TTL, Duration::from_secs(2))
            .await
        {
            Ok(Some(p)) => p,
            Ok(None) | Err(_) => continue,
        };
        let Ok(after) = time.now().await else {
            continue;
        };
        ctx.history.push(semaphore::permit_event(
            process.id(),
            ctx.history.now_us(),
            permit.token.get(),
            sent.earliest().timestamp_millis(),
            after.latest().timestamp_millis(),
            permit.expires_at.timestamp_millis(),
        ));
        if rng.random_bool(0.05) {
            continue; // crashed: the permit expires by server time
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(5..30))).await;
        ctx.maybe_pause(&mut rng, process, 0.05, TTL + Duration::from_millis(100))
            .await;
        let Ok(before) = time.now().await else {
            continue;
        };
        ctx.history.push(semaphore::release_event(
            process.id(),
            ctx.history.now_us(),
            permit.token.get(),
            before.earliest().timestamp_millis(),
        ));
        let _ = sem.release(&permit).await;
    }
    Ok(())
}
