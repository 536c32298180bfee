//! Records seeds 003/004's counters under leases (`docwarden_workloads::counters`), each
//! lease kept by the real [`docwarden::lock::Watchdog`]: read-modify-writes of counters,
//! every write fenced.
//!
//! Each worker repeatedly acquires one of four resources with a 1 s lease and starts a
//! watchdog on it, registers its token on the counter document (a fenced touch, so no
//! older holder can write after this point), reads the counter, and writes `n + 1` fenced
//! by its token only if the watchdog says the lease is still certainly valid
//! (`valid_until`, `is_lost`; it records that claim, or gives up). Under `pause` the
//! holder (and its watchdog) stops between that check and the write, past its lease: the
//! window only fencing closes. The control run trusts client clocks, its fence checks no
//! token, and it writes even when the watchdog does not vouch for the lease (a holder cut
//! off by a partition past its lease, whose touch or read came back late, writes all the
//! same).
//!
//! Checked: tokens strictly increase per resource, no stale write accepted, no validity
//! claim overlapped a newer holder, and every counter equals its acknowledged increments
//! (give or take uncertain ones), all from the history and the final read.

use std::sync::Arc;
use std::time::{Duration, Instant};

use docwarden::check::{Event, OpOutcome};
use docwarden::lock::{FenceOutcome, LockCollection, LockOptions, Owner, WatchdogOptions};
use docwarden_workloads::counters::{self, Counters, Op};
use docwarden_workloads::{Mode, Process};
use rand::Rng;

use super::args::Fault;
use super::context::{Ctx, Findings};

const RESOURCES: usize = 4;
pub(super) const TTL: Duration = Duration::from_secs(1);
const LOCKS: &str = "verify_locks";
const COUNTERS: &str = "counters";

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    let counters = Counters::new(ctx.db.collection(COUNTERS));
    counters.setup(RESOURCES).await?;
    // The preflight checks and the indexes, once; the workers open handles with `new`.
    LockCollection::open(
        &ctx.db,
        LOCKS,
        docwarden::clock::TimeSource::server(ctx.client.clone(), Default::default())?,
        LockOptions::default(),
    )
    .await?;
    let c = Arc::clone(&ctx);
    ctx.supervise("locks", move |process| {
        let ctx = Arc::clone(&c);
        async move { worker(&ctx, process).await }
    })
    .await;

    let finals = counters.finals().await?;
    let events = ctx.history.events();
    Ok(Findings {
        operations: u64::try_from(events.len()).unwrap_or(u64::MAX),
        violations: counters::check(&events, &finals),
    })
}

fn classify(r: &docwarden::Result<FenceOutcome>, e: Event) -> Event {
    match r {
        Ok(FenceOutcome::Applied) => e,
        Ok(other) => e.outcome(OpOutcome::Failed).detail(format!("{other:?}")),
        Err(err) => e.outcome(Ctx::outcome_of(r)).detail(err.to_string()),
    }
}

/// One worker process: acquire, watch, touch, read, check validity, (pause), write,
/// release, until the run's deadline.
pub(super) async fn worker(ctx: &Ctx, process: Process) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let mut rng = ctx.rng(process);
    // A worker task gets its own client, naming its host (as a worker process does), so
    // that a partition cuts it off whole, its watchdog's renewals included.
    let db = match ctx.slot {
        Some(_) => ctx.db.clone(),
        None => {
            let host = usize::try_from(process.id()).unwrap_or(0) % ctx.workers.max(1);
            super::process::connect_once(&ctx.uri, host)
                .await?
                .database(ctx.db.name())
        }
    };
    let locks = LockCollection::new(
        db.collection(LOCKS),
        ctx.clock(process)?,
        LockOptions::default(),
    )?;
    let counters = Counters::new(db.collection(COUNTERS));
    let fence = counters.fence(ctx.mode)?;
    let owner = Owner::random();
    let (h, p) = (&ctx.history, process.id());
    while Instant::now() < deadline {
        let key = counters::resource(rng.random_range(0..RESOURCES));
        let acquired = h
            .record(
                p,
                Op::Acquire.as_str(),
                &key,
                locks.try_acquire(&owner, &key, TTL),
                |r, e| match r {
                    Ok(Some(l)) => e.token(l.token.get()),
                    Ok(None) => e.outcome(OpOutcome::Failed).detail("held"),
                    Err(err) => e.outcome(Ctx::outcome_of(r)).detail(err.to_string()),
                },
            )
            .await;
        let lease = match acquired {
            Ok(Some(lease)) => lease,
            Ok(None) => {
                tokio::time::sleep(Duration::from_millis(rng.random_range(1..10))).await;
                continue;
            }
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let token = lease.token.get();
        let watchdog = locks.watch(lease.clone(), TTL, WatchdogOptions::default())?;
        // The fenced touch registers our token before we read.
        let touched = h
            .record(
                p,
                Op::Touch.as_str(),
                &key,
                counters.touch(&fence, &lease, &key, &owner),
                |r, e| classify(r, e.token(token)),
            )
            .await;
        let read = match touched {
            Ok(FenceOutcome::Applied) => Some(counters.read(&key).await),
            _ => None,
        };
        if let Some(Err(e)) = &read {
            let at = h.now_us();
            h.push(
                Event::new(p, Op::Abandon.as_str(), &key, at, at)
                    .token(token)
                    .outcome(OpOutcome::Failed)
                    .detail(format!("the read failed: {e}")),
            );
        }
        if let Some(Ok(value)) = read {
            // Write only while the watchdog says the lease is certainly valid (safe).
            let at = h.now_us();
            let left = watchdog
                .valid_until()
                .filter(|_| !watchdog.is_lost())
                .map(|until| until.saturating_duration_since(Instant::now()))
                .filter(|left| !left.is_zero());
            if let Some(left) = left {
                h.push(
                    Event::new(p, Op::Hold.as_str(), &key, at, at)
                        .token(token)
                        .value(i64::try_from(left.as_millis()).unwrap_or(i64::MAX)),
                );
                if ctx.has(Fault::Pause) && rng.random_bool(0.05) {
                    // The holder stops between its check and its write, and its watchdog
                    // with it (as in a stopped process): the lease lapses.
                    watchdog.stop();
                    let start = h.now_us();
                    tokio::time::sleep(TTL + Duration::from_millis(700)).await;
                    ctx.injected(Fault::Pause, process, start, h.now_us());
                }
            }
            // The control writes whether or not the watchdog vouches for the lease (no
            // claim recorded then): a holder cut off by a partition past its lease, its
            // touch or read delivered late, still writes.
            if left.is_some() || ctx.mode == Mode::Control {
                h.record(
                    p,
                    Op::Write.as_str(),
                    &key,
                    counters.write(&fence, &lease, &key, value + 1),
                    |r, e| classify(r, e.token(token).value(value + 1)),
                )
                .await
                .ok();
            } else {
                h.push(
                    Event::new(p, Op::Abandon.as_str(), &key, at, at)
                        .token(token)
                        .outcome(OpOutcome::Failed)
                        .detail("the lease was not certainly valid"),
                );
            }
        }
        h.record(p, Op::Release.as_str(), &key, watchdog.release(), |r, e| {
            e.token(token).outcome(Ctx::outcome_of(r))
        })
        .await
        .ok();
    }
    Ok(())
}
