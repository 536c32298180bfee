//! Records the semaphore workload (`docwarden_workloads::semaphore`): every worker takes
//! permits of one resource with 3 permits, holds each for 5–30 ms and releases it; now and
//! then it crashes (holds for half the ttl, then never releases: the permit must expire by
//! server time) and, under `pause`, it stops past the permit's ttl before releasing.
//! Each holding is recorded in the server's order (marker writes, see the workload), never
//! by the worker's clock. Checked from the history: never more than 3 confirmed holders at
//! one instant of that order, and tokens in real-time order. The control counts every
//! holder as expired.

use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden::lock::Owner;
use docwarden_workloads::Process;
use docwarden_workloads::marker::Markers;
use docwarden_workloads::semaphore::{self, RESOURCE};
use rand::Rng;

use super::context::{Ctx, Findings};

/// The permits of the resource.
const PERMITS: u32 = 3;
/// A permit's ttl (what a `sigstop` must outlive).
pub(super) const TTL: Duration = Duration::from_millis(500);
const SEM: &str = "verify_semaphore";
/// The pause after a marker write failed (no primary, a reset): no spinning through it.
const MARKER_RETRY: Duration = Duration::from_millis(50);

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
    let markers = Markers::new(&ctx.db);
    let id = process.id();
    while Instant::now() < deadline {
        let owner = Owner::random();
        // The server's order, never this process's clock: a marker before the acquire is
        // sent, one after it returned, one before the holder confirms its permit.
        let Ok(sent) = markers.stamp(id).await else {
            tokio::time::sleep(MARKER_RETRY).await;
            continue;
        };
        let permit = match sem
            .acquire(&owner, RESOURCE, TTL, Duration::from_secs(2))
            .await
        {
            Ok(Some(p)) => p,
            Ok(None) | Err(_) => continue,
        };
        let entered = markers.stamp(id).await.ok();
        let token = permit.token.get();
        if let Some(event) =
            entered.and_then(|e| semaphore::permit_event(id, ctx.history.now_us(), token, sent, e))
        {
            ctx.history.push(event);
        }
        // A crashed holder works on for half its ttl, then vanishes without releasing:
        // its permit must keep others out until it expires by server time.
        let crashed = rng.random_bool(0.05);
        let work = if crashed {
            TTL / 2
        } else {
            Duration::from_millis(rng.random_range(5..30))
        };
        tokio::time::sleep(work).await;
        if !crashed {
            ctx.maybe_pause(&mut rng, process, 0.05, TTL + Duration::from_millis(100))
                .await;
        }
        let confirmed = markers.stamp(id).await.ok();
        let valid = match time.now().await {
            Ok(now) => permit.is_certainly_valid(&now, time.skew_margin_ms()),
            Err(_) => false,
        };
        if let (true, Some(entered), Some(confirmed)) = (valid, entered, confirmed)
            && let Some(event) =
                semaphore::held_event(id, ctx.history.now_us(), token, entered, confirmed)
        {
            ctx.history.push(event);
        }
        if crashed {
            continue;
        }
        let _ = sem.release(&permit).await;
    }
    Ok(())
}
