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
//! token, and it writes even when the watchdog does not vouch for the lease (a holder
//! stopped or cut off by a partition past its lease, whose touch or read came back late,
//! writes all the same).
//!
//! Every other worker is a service instance with two tasks under one owner id (a common
//! shape: one id per instance, several tasks): besides the holder, a keep-alive task that
//! was never told the work finished keeps renewing (and now and then releasing) stale
//! copies of the leases the holder already released, through `LockCollection::renew` and
//! `release`. Each must be refused, including when it reaches the server while the same
//! owner's newer acquisition of the resource has not committed its token yet.
//!
//! Under `slow-reply`, worker 0 reaches the server through its own proxy, which delays
//! only the server-to-client bytes by 2.4 s while its clock takes its first sample
//! (`hello`, best of 3) comes back late in one direction, so its server-time estimate is
//! about 1.2 s behind — inside the sample's bound (half the round trip), which every
//! deadline must subtract. That worker holds 3 s leases and works 1.5 s under each (its
//! watchdog renews in between) before it checks validity; under `pause` it always stops
//! there past its lease. A watchdog that forgot the bound after a renewal claims
//! validity after a newer holder has acquired (`overlapping-leases`).
//!
//! After a transient error (no primary during a `stepdown`, a reset, a restart) the holder
//! and the keep-alive task back off (`outage_backoff`) rather than send into the outage:
//! each such request ends indeterminate, and none can be judged.
//!
//! Checked: tokens strictly increase per resource, no stale write accepted, no validity
//! claim overlapped a newer holder, no released or superseded lease was renewed or
//! released again (`stale-lease-accepted`), and every counter equals its acknowledged
//! increments (give or take uncertain ones), all from the history and the final read.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use docwarden::check::{Event, OpOutcome};
use docwarden::lock::{FenceOutcome, Lease, LockCollection, LockOptions, Owner, WatchdogOptions};
use docwarden_workloads::counters::{self, Counters, Op};
use docwarden_workloads::{Mode, Process};
use rand::Rng;

use super::args::Fault;
use super::context::{Ctx, Findings};

const RESOURCES: usize = 4;
pub(super) const TTL: Duration = Duration::from_secs(1);
/// Under `slow-reply`: the lease of the slowed worker, the work it does under each, and
/// how late its replies are while its clock takes its first sample.
const SLOW_TTL: Duration = Duration::from_secs(3);
const SLOW_WORK: Duration = Duration::from_millis(1_500);
const SLOW_REPLY: Duration = Duration::from_millis(2_400);
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

/// One holder's counter write, and what the control does when its outcome is unknown.
struct Write<'a> {
    ctx: &'a Ctx,
    process: Process,
    counters: &'a Counters,
    fence: &'a docwarden::lock::Fence,
    lease: &'a Lease,
    key: &'a str,
}

impl Write<'_> {
    /// Writes `value`, fenced. Safe: the reply decides; a retryable error (no reply, or
    /// `NotWritablePrimary`…) leaves the outcome unknown: indeterminate, the final read
    /// decides, nothing is re-sent. Control, with that settlement off: a client that
    /// cannot read back guesses ([`Ctx::guess_resend`]) — it re-sends the increment
    /// blindly as a fenced `$inc` (a duplicate if the first ran) and takes the re-send's
    /// reply, or it takes the write as applied (lost if it did not run). An outcome still
    /// unknown after the re-send is taken as applied. The second value says
    /// why a write was taken as applied without an acknowledgement. The control's client
    /// has `retryWrites=false`, so the driver's own retry hides nothing.
    async fn run(&self, value: i64) -> (docwarden::Result<FenceOutcome>, Option<String>) {
        let first = self
            .counters
            .write(self.fence, self.lease, self.key, value)
            .await;
        let err = match &first {
            Err(err) if self.ctx.mode == Mode::Control && err.is_retryable() => err.to_string(),
            _ => return (first, None),
        };
        if !first.as_ref().err().is_some_and(Ctx::guess_resend) {
            return (first, Some(format!("{err} (guessed applied)")));
        }
        let token = self.lease.token.get();
        let again = self
            .ctx
            .history
            .record(
                self.process.id(),
                Op::Resend.as_str(),
                self.key,
                self.counters.increment(self.fence, self.lease, self.key),
                |r, e| classify(r, e.token(token)),
            )
            .await;
        match again {
            Err(e) if e.is_retryable() => (
                Err(e),
                Some(format!(
                    "{err}, re-sent blindly, again unknown (guessed applied)"
                )),
            ),
            again => (again, None),
        }
    }
}

/// The stale copies of released leases a worker's keep-alive task renews, by resource.
type StaleCopies = Arc<Mutex<BTreeMap<String, Lease>>>;

/// One worker process: acquire, watch, touch, read, check validity, (pause), write,
/// release, until the run's deadline; every other worker also runs a keep-alive task under
/// the same owner id that renews stale copies of the released leases ([`keep_alive`]).
pub(super) async fn worker(ctx: &Ctx, process: Process) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    if ctx.has(Fault::SlowReply) && process.id() == 0 {
        return slowed(ctx, process, deadline).await;
    }
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
    let owner = Owner::random();
    let shape = Shape {
        ttl: TTL,
        work: Duration::ZERO,
        pause: 0.05,
    };
    if process.id() % 2 == 1 {
        return holder(ctx, &db, process, &locks, &owner, deadline, shape, None).await;
    }
    let stale = StaleCopies::default();
    let (held, ()) = tokio::join!(
        holder(
            ctx,
            &db,
            process,
            &locks,
            &owner,
            deadline,
            shape,
            Some(&stale)
        ),
        keep_alive(ctx, process, &locks, &stale, deadline),
    );
    held
}

/// How a holder works: its lease, how long it works under the lease before it checks
/// validity, and how often (under `pause`) it stops there past its lease.
#[derive(Clone, Copy)]
struct Shape {
    ttl: Duration,
    work: Duration,
    pause: f64,
}

/// Worker 0 under `slow-reply`: its own client through its own proxy, whose replies are
/// [`SLOW_REPLY`] late while its clock takes its first sample, then long leases with work
/// under them.
async fn slowed(ctx: &Ctx, process: Process, deadline: Instant) -> anyhow::Result<()> {
    let upstream = super::orchestrate::upstream_addr(&ctx.server_uri)?;
    let proxy = super::proxy::Proxy::start(upstream).await?;
    let client = docwarden_server::connect(&proxy.uri(), Duration::from_secs(30)).await?;
    // A patient clock: its three `hello`s (2.4 s each) may take 10 s.
    let clock = docwarden::clock::TimeSource::server(
        client.clone(),
        docwarden::clock::ClockOptions::default().hello_timeout(Duration::from_secs(10)),
    )?;
    // The spike lasts while the clock takes its first sample (recorded when it starts:
    // a killed worker's proxy stops with it).
    proxy.set_reply_latency(SLOW_REPLY);
    let start = ctx.history.now_us();
    ctx.injected(Fault::SlowReply, process, start, start);
    let sampled = clock.now().await;
    proxy.set_reply_latency(Duration::ZERO);
    tracing::debug!(?sampled, "slow-reply: the clock sampled under the spike");
    let db = client.database(ctx.db.name());
    let locks = LockCollection::new(db.collection(LOCKS), clock, LockOptions::default())?;
    let shape = Shape {
        ttl: SLOW_TTL,
        work: SLOW_WORK,
        pause: 1.0,
    };
    holder(
        ctx,
        &db,
        process,
        &locks,
        &Owner::random(),
        deadline,
        shape,
        None,
    )
    .await
}

/// The second task of a service instance: it still has copies of leases its sibling
/// released and keeps renewing them (now and then releasing one), every 1-4 ms until the
/// deadline. The library must refuse each: a released lease stays dead.
async fn keep_alive(
    ctx: &Ctx,
    process: Process,
    locks: &LockCollection,
    stale: &StaleCopies,
    deadline: Instant,
) {
    let mut rng = ctx.rng(process);
    let (h, p) = (&ctx.history, process.id());
    let Ok(mut outage) = outage_backoff() else {
        return;
    };
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(rng.random_range(1..=4))).await;
        let copy = {
            let copies = stale.lock().unwrap_or_else(|e| e.into_inner());
            let n = copies.len();
            (n > 0)
                .then(|| copies.values().nth(rng.random_range(0..n)).cloned())
                .flatten()
        };
        let Some(mut lease) = copy else { continue };
        let (key, token) = (lease.resource.clone(), lease.token.get());
        let outcome = |r: &docwarden::Result<()>, e: Event| match r {
            Ok(()) => e.token(token).detail("a stale copy, accepted"),
            Err(docwarden::Error::LeaseLost { .. }) => {
                e.token(token).outcome(OpOutcome::Failed).detail("lost")
            }
            Err(err) => e
                .token(token)
                .outcome(Ctx::outcome_of(r))
                .detail(err.to_string()),
        };
        // With the token in the invoke: a release of this stale copy cut short by a kill
        // must not pass for one of the holder's current lease (same process, same key).
        let answered = if rng.random_bool(0.1) {
            h.record_with_token(
                p,
                Op::Release.as_str(),
                &key,
                token,
                locks.release(&lease),
                outcome,
            )
            .await
        } else {
            h.record_with_token(
                p,
                Op::Renew.as_str(),
                &key,
                token,
                locks.renew(&mut lease, TTL),
                outcome,
            )
            .await
        };
        // Through an outage (no primary, a restart) a request that the server answers
        // with a transient error, or not at all, is one whose outcome stays unknown: back
        // off instead of piling them up every few milliseconds.
        if answered.as_ref().is_err_and(docwarden::Error::is_retryable) {
            tokio::time::sleep(outage.next_delay()).await;
        } else {
            outage.reset();
        }
    }
}

/// How a worker waits after a transient error (no primary during a `stepdown`, a reset, a
/// restart): 50 ms doubling to 800 ms, full jitter, at least 10 ms. Every request sent
/// into an outage ends indeterminate — the server's refusal (`NotWritablePrimary`) does
/// not prove that a write did not run (MongoDB may answer it to a write in flight when
/// the node stepped down) — so a worker that kept sending every few milliseconds only
/// piled up operations no checker can judge.
fn outage_backoff() -> docwarden::Result<docwarden::backoff::Backoff> {
    Ok(
        docwarden::backoff::Backoff::new(Duration::from_millis(50), Duration::from_millis(800))?
            .with_floor(Duration::from_millis(10)),
    )
}

/// The holder task: acquire, watch, touch, read, check validity, (pause), write, release,
/// until the deadline; hands each released lease to `stale` (its sibling keep-alive task).
#[allow(clippy::too_many_arguments)]
async fn holder(
    ctx: &Ctx,
    db: &mongodb::Database,
    process: Process,
    locks: &LockCollection,
    owner: &Owner,
    deadline: Instant,
    shape: Shape,
    stale: Option<&StaleCopies>,
) -> anyhow::Result<()> {
    let mut rng = ctx.rng(process);
    let counters = Counters::new(db.collection(COUNTERS));
    let fence = counters.fence(ctx.mode)?;
    let (h, p) = (&ctx.history, process.id());
    let mut outage = outage_backoff()?;
    while Instant::now() < deadline {
        let key = counters::resource(rng.random_range(0..RESOURCES));
        let acquired = h
            .record(
                p,
                Op::Acquire.as_str(),
                &key,
                locks.try_acquire(owner, &key, shape.ttl),
                |r, e| match r {
                    Ok(Some(l)) => e.token(l.token.get()),
                    Ok(None) => e.outcome(OpOutcome::Failed).detail("held"),
                    Err(err) => e.outcome(Ctx::outcome_of(r)).detail(err.to_string()),
                },
            )
            .await;
        let lease = match acquired {
            Ok(Some(lease)) => {
                outage.reset();
                lease
            }
            Ok(None) => {
                outage.reset();
                tokio::time::sleep(Duration::from_millis(rng.random_range(1..10))).await;
                continue;
            }
            Err(e) if e.is_retryable() => {
                tokio::time::sleep(outage.next_delay()).await;
                continue;
            }
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let token = lease.token.get();
        let watchdog = locks.watch(lease.clone(), shape.ttl, WatchdogOptions::default())?;
        // The fenced touch registers our token before we read.
        let touched = h
            .record(
                p,
                Op::Touch.as_str(),
                &key,
                counters.touch(&fence, &lease, &key, owner),
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
            tokio::time::sleep(shape.work).await;
            // Write only while the watchdog says the lease is certainly valid.
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
            }
            if (left.is_some() || ctx.mode == Mode::Control)
                && ctx.has(Fault::Pause)
                && rng.random_bool(shape.pause)
            {
                // The holder stops between its check and its write, and its watchdog
                // with it (as in a stopped process): the lease lapses.
                watchdog.stop();
                let start = h.now_us();
                tokio::time::sleep(shape.ttl + Duration::from_millis(700)).await;
                ctx.injected(Fault::Pause, process, start, h.now_us());
            }
            // The control writes whether or not the watchdog vouches for the lease (no
            // claim recorded then): a holder stopped or cut off past its lease, its touch
            // or read delivered late, still writes — the second safeguard it turns off,
            // besides fencing.
            if left.is_some() || ctx.mode == Mode::Control {
                let write = Write {
                    ctx,
                    process,
                    counters: &counters,
                    fence: &fence,
                    lease: &lease,
                    key: &key,
                };
                h.record(
                    p,
                    Op::Write.as_str(),
                    &key,
                    write.run(value + 1),
                    |(r, assumed), e| {
                        let e = e.token(token).value(value + 1);
                        match assumed {
                            Some(note) => e.detail(format!("assumed applied: {note}")),
                            None => classify(r, e),
                        }
                    },
                )
                .await
                .0
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
        let released = h
            .record_with_token(
                p,
                Op::Release.as_str(),
                &key,
                token,
                watchdog.release(),
                |r, e| e.token(token).outcome(Ctx::outcome_of(r)),
            )
            .await;
        if let (Some(stale), Ok(())) = (stale, released) {
            stale
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key, lease);
        }
    }
    Ok(())
}
