//! The watchdog: a background task that renews a lease at a fraction of its ttl and tells
//! the holder at once when the lease is lost.
//!
//! **Guarantee:** while the watchdog runs, the lease is renewed every `ttl · fraction`;
//! the moment a renewal is refused ([`LostReason::TakenOver`]), or the lease has certainly
//! lapsed by the local monotonic clock because renewals kept failing
//! ([`LostReason::Expired`]), [`Watchdog::lost`] resolves and [`Watchdog::lease`] returns
//! `None`. "Certainly lapsed" is counted from the server time each renewal used: the lease
//! is taken as valid for `expires_at − estimate − bound − skew margin` after the renewal
//! was sent, the bound of that renewal's estimate included every time. Dropping the watchdog stops the renewals (the lease then expires on its own).
//!
//! **Limits:** the holder learns of a loss at the next renewal attempt at the latest, not
//! before: work that must never overlap another holder's has to be fenced (see
//! [`super::Fence`]). A holder that is paused is paused together with its watchdog;
//! [`Watchdog::lease`] and [`Watchdog::is_lost`] compare [`Watchdog::valid_until`] with the
//! monotonic clock at the call, so a holder that resumes past it is told at once, before
//! the task runs again. The monotonic clock (`Instant`) does not advance while the whole
//! machine is suspended (Linux `CLOCK_MONOTONIC`), so they also compare the same deadline
//! on the wall clock (the time source's [`crate::clock::LocalClock`]), which does: a
//! suspended VM or laptop that resumes past it is told too. The price: a forward step of
//! the wall clock (NTP) reports the lease lost until the next renewal; a backward step is
//! caught by the monotonic deadline. Fence the writes anyway.

use std::time::{Duration, Instant};

use mongodb::bson::DateTime;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::collection::LockCollection;
use super::lease::Lease;
use crate::clock::{LocalClock, ServerTime};
use crate::error::{Error, Result};
use crate::validate;

/// Options of a [`Watchdog`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct WatchdogOptions {
    /// Renew every `ttl · renew_fraction`, strictly between 0 and 1. Default 1/3.
    pub renew_fraction: f64,
}

impl Default for WatchdogOptions {
    fn default() -> Self {
        Self {
            renew_fraction: 1.0 / 3.0,
        }
    }
}

impl WatchdogOptions {
    /// Sets [`WatchdogOptions::renew_fraction`].
    pub fn renew_fraction(mut self, fraction: f64) -> Self {
        self.renew_fraction = fraction;
        self
    }
}

/// Why a watched lease is no longer held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostReason {
    /// A renewal was refused: the lease was taken over, released by someone else (for
    /// example `release_all`), its document deleted, or it had already lapsed.
    TakenOver,
    /// Renewals failed (server unreachable) until the lease had certainly lapsed.
    Expired,
    /// The watchdog was stopped or released; the lease is no longer renewed.
    Stopped,
}

#[derive(Clone, Debug)]
enum State {
    /// The lease as acquired, before the task has read the server time (the instant is
    /// the start: not yet known to be valid beyond it).
    Starting(Lease, Instant),
    /// The lease as last renewed, and until when it is certainly valid: by the monotonic
    /// clock, and the same deadline on the wall clock (milliseconds), which also counts a
    /// suspend of the whole machine. Past either it is reported lost even if the task has
    /// not run since (a paused or starved process): the task's own `Lost` may come late.
    Held(Lease, Instant, i64),
    Lost(LostReason, Lease),
}

impl State {
    /// The lease while it counts as held at `now` (wall clock: `wall_ms`).
    fn held_at(&self, now: Instant, wall_ms: i64) -> Option<&Lease> {
        match self {
            State::Starting(l, _) => Some(l),
            State::Held(l, until, wall_until) if now < *until && wall_ms < *wall_until => Some(l),
            State::Held(..) | State::Lost(..) => None,
        }
    }

    /// `Held` until `valid_until`, with the wall-clock deadline read from `local` now.
    fn held(lease: Lease, valid_until: Instant, local: &LocalClock) -> Self {
        let left = valid_until.saturating_duration_since(Instant::now());
        let wall_until = local
            .now_ms()
            .saturating_add(i64::try_from(left.as_millis()).unwrap_or(i64::MAX));
        State::Held(lease, valid_until, wall_until)
    }
}

/// Keeps a lease alive; see the module docs.
#[derive(Debug)]
pub struct Watchdog {
    rx: watch::Receiver<State>,
    cancel: CancellationToken,
    locks: LockCollection,
    /// The time source's wall clock, for the accessors' second deadline.
    local: LocalClock,
    task: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts renewing `lease` for `ttl` at a time. Must be called inside a Tokio runtime.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a ttl not longer than the time source's skew margin or a fraction outside (0, 1).
    pub fn start(
        locks: LockCollection,
        lease: Lease,
        ttl: Duration,
        options: WatchdogOptions,
    ) -> Result<Self> {
        super::lease::ttl_ms("ttl", ttl, locks.time().skew_margin_ms())?;
        let fraction = validate::fraction("renew fraction", options.renew_fraction)?;
        let interval = ttl.mul_f64(fraction).max(Duration::from_millis(1));
        // Valid until the deadline the time source's fresh sample gives, as after a
        // renewal (no I/O: the acquire just read it), so that a holder blocked before the
        // task first runs is not told "held" past it; without a fresh sample, not known
        // to be valid until the task has read the server time.
        let started = Instant::now();
        let initial = match locks.time().now_if_fresh() {
            Some(now) => State::held(
                lease.clone(),
                initial_valid_until(started, &lease, &now, margin_of(&locks)),
                &locks.time().local(),
            ),
            None => State::Starting(lease.clone(), started),
        };
        let (tx, rx) = watch::channel(initial);
        let cancel = CancellationToken::new();
        let span =
            tracing::info_span!("watchdog", resource = %lease.resource, token = lease.token.get());
        let task = tokio::spawn(
            run(locks.clone(), lease, ttl, interval, tx, cancel.clone()).instrument(span),
        );
        Ok(Self {
            rx,
            cancel,
            local: locks.time().local(),
            locks,
            task: Some(task),
        })
    }

    /// The lease as last renewed, or `None` once it is lost or past
    /// [`Watchdog::valid_until`] by the monotonic clock or the same deadline by the wall
    /// clock (checked at the call: a holder that resumes after a pause or a suspend longer
    /// than the lease is told at once, before the watchdog task has run again).
    /// Only if the time source had no fresh sample at [`Watchdog::start`] is it, until the
    /// task's first read of the server time, the lease as acquired.
    pub fn lease(&self) -> Option<Lease> {
        if self.cancel.is_cancelled() {
            return None;
        }
        self.rx
            .borrow()
            .held_at(Instant::now(), self.local.now_ms())
            .cloned()
    }

    /// Until when the lease is certainly valid by the local monotonic clock, or `None` once
    /// it is lost: `expires_at − estimate − bound − skew margin` of the server time the last
    /// renewal (or the start) read, counted from the instant just before that read. Act
    /// under the lease only before this instant (and fence the writes anyway).
    pub fn valid_until(&self) -> Option<Instant> {
        if self.cancel.is_cancelled() {
            return None;
        }
        match &*self.rx.borrow() {
            State::Starting(_, until) | State::Held(_, until, _) => Some(*until),
            State::Lost(..) => None,
        }
    }

    /// Whether the lease is lost, or no longer certainly valid by the local monotonic or
    /// wall clock ([`Watchdog::valid_until`] has passed, even if the watchdog task has not
    /// run since), as [`Watchdog::lease`] tells it.
    pub fn is_lost(&self) -> bool {
        self.rx
            .borrow()
            .held_at(Instant::now(), self.local.now_ms())
            .is_none()
    }

    /// Resolves as soon as the lease is lost (use it in a `select!` next to the work).
    pub async fn lost(&self) -> LostReason {
        let mut rx = self.rx.clone();
        match rx.wait_for(|s| matches!(s, State::Lost(..))).await {
            Ok(state) => match &*state {
                State::Lost(reason, _) => *reason,
                State::Starting(..) | State::Held(..) => LostReason::Stopped,
            },
            Err(_) => LostReason::Stopped,
        }
    }

    /// Stops renewing; the lease expires on its own.
    pub fn stop(&self) {
        self.cancel.cancel();
    }

    /// Stops renewing and releases the lease.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if it was already lost; a database error.
    pub async fn release(mut self) -> Result<()> {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        let state = self.rx.borrow().clone();
        match state {
            State::Starting(lease, _) | State::Held(lease, ..) => self.locks.release(&lease).await,
            State::Lost(_, lease) => Err(Error::LeaseLost {
                resource: lease.resource,
                token: lease.token.into(),
            }),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn run(
    locks: LockCollection,
    mut lease: Lease,
    ttl: Duration,
    interval: Duration,
    tx: watch::Sender<State>,
    cancel: CancellationToken,
) {
    let margin = margin_of(&locks);
    // Until when the lease is certainly valid, by the local monotonic clock.
    let started = Instant::now();
    let mut valid_until = match locks.time().now().await {
        Ok(now) => initial_valid_until(started, &lease, &now, margin),
        Err(_) => started,
    };
    let local = locks.time().local();
    let _ = tx.send(State::held(lease.clone(), valid_until, &local));
    let mut next = next_renewal(Instant::now(), interval, valid_until);
    loop {
        let wake = next.min(valid_until);
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep_until(wake.into()) => {}
        }
        if Instant::now() >= valid_until && Instant::now() < next {
            tracing::warn!("lease lapsed before it could be renewed");
            let _ = tx.send(State::Lost(LostReason::Expired, lease.clone()));
            return;
        }
        let attempt_started = Instant::now();
        let mut renewed = lease.clone();
        let outcome = tokio::select! {
            () = cancel.cancelled() => return,
            r = tokio::time::timeout(interval.max(Duration::from_millis(50)), locks.renew_at(&mut renewed, ttl)) => r,
            () = tokio::time::sleep_until(valid_until.into()) => {
                // The renewal is still in flight but the lease has certainly lapsed: say so
                // now rather than when the server answers.
                tracing::warn!("lease lapsed while a renewal was in flight");
                let _ = tx.send(State::Lost(LostReason::Expired, lease.clone()));
                return;
            }
        };
        match outcome {
            Ok(Ok(now)) => {
                lease = renewed;
                valid_until = renewed_valid_until(attempt_started, ttl, &now, margin);
                next = next_renewal(attempt_started, interval, valid_until);
                tracing::trace!("renewed");
                let _ = tx.send(State::held(lease.clone(), valid_until, &local));
            }
            Ok(Err(Error::LeaseLost { .. })) => {
                tracing::warn!("lease lost: renewal refused");
                let _ = tx.send(State::Lost(LostReason::TakenOver, lease.clone()));
                return;
            }
            Ok(Err(err)) => {
                tracing::warn!(%err, "renewal failed; retrying");
                next = later(Instant::now(), interval / 4);
                if Instant::now() >= valid_until {
                    let _ = tx.send(State::Lost(LostReason::Expired, lease.clone()));
                    return;
                }
            }
            Err(_) => {
                tracing::warn!("renewal timed out; retrying");
                next = Instant::now();
                if Instant::now() >= valid_until {
                    let _ = tx.send(State::Lost(LostReason::Expired, lease.clone()));
                    return;
                }
            }
        }
    }
}

/// The time source's skew margin as a duration.
fn margin_of(locks: &LockCollection) -> Duration {
    Duration::from_millis(u64::try_from(locks.time().skew_margin_ms()).unwrap_or(0))
}

/// Until when a lease expiring at `expires_at` is certainly valid by the local monotonic
/// clock, given the server time `now` read no earlier than the local instant `at`:
/// `at + (expires_at − estimate − bound − margin)`, and `at` itself once that is negative.
///
/// The server's true time at `at` is at most `estimate + bound` (the estimate was read at
/// or after `at`), so until the returned instant it is below `expires_at − margin`.
fn certainly_valid_until(
    at: Instant,
    expires_at: DateTime,
    now: &ServerTime,
    margin: Duration,
) -> Instant {
    let margin_ms = i64::try_from(margin.as_millis()).unwrap_or(i64::MAX);
    let left = expires_at
        .timestamp_millis()
        .saturating_sub(now.estimate_ms)
        .saturating_sub(now.bound_ms)
        .saturating_sub(margin_ms);
    later(at, Duration::from_millis(u64::try_from(left).unwrap_or(0)))
}

/// Until when `lease` is certainly valid by the local monotonic clock, when the watchdog
/// starts: `now` was read at or after `at`.
fn initial_valid_until(at: Instant, lease: &Lease, now: &ServerTime, margin: Duration) -> Instant {
    certainly_valid_until(at, lease.expires_at, now, margin)
}

/// Until when a lease renewed for `ttl` is certainly valid by the local monotonic clock:
/// the renewal was sent at `attempt_started` and stored `now + ttl` as the expiry. The
/// bound of `now` counts after every renewal, not only for the first deadline.
pub(crate) fn renewed_valid_until(
    attempt_started: Instant,
    ttl: Duration,
    now: &ServerTime,
    margin: Duration,
) -> Instant {
    let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
    certainly_valid_until(attempt_started, now.plus_ms(ttl_ms), now, margin)
}

/// The next renewal: after `interval`, but at the latest halfway to `valid_until`.
fn next_renewal(from: Instant, interval: Duration, valid_until: Instant) -> Instant {
    let half = valid_until.saturating_duration_since(from) / 2;
    later(from, interval.min(half))
}

/// `from + d`, capped a year ahead (a ttl may be far longer than an `Instant` can add).
fn later(from: Instant, d: Duration) -> Instant {
    const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);
    from.checked_add(d.min(YEAR)).unwrap_or(from)
}

impl LockCollection {
    /// Starts a [`Watchdog`] that keeps `lease` alive, renewing it for `ttl` at a time.
    ///
    /// # Errors
    /// As [`Watchdog::start`].
    pub fn watch(&self, lease: Lease, ttl: Duration, options: WatchdogOptions) -> Result<Watchdog> {
        Watchdog::start(self.clone(), lease, ttl, options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(expires_at: DateTime) -> Lease {
        Lease {
            resource: "r".into(),
            owner: "o".into(),
            token: crate::token::FencingToken::new(1),
            acquired_at: DateTime::from_millis(0),
            expires_at,
        }
    }

    fn claimed_ms(from: Instant, until: Instant) -> i128 {
        i128::try_from(until.saturating_duration_since(from).as_millis()).unwrap_or(i128::MAX)
    }

    /// Every deadline the watchdog reports, the first and every one after a renewal, is at
    /// most `expires_at − bound − margin` after the moment the server time was read.
    #[test]
    fn every_deadline_subtracts_the_bound_and_the_margin() {
        let at = Instant::now();
        let ttl = Duration::from_secs(10);
        for (bound_ms, margin_ms) in [(2_000, 0), (2_000, 250), (5, 250), (600, 250), (12_000, 0)] {
            let now = ServerTime {
                estimate_ms: 1_000_000,
                bound_ms,
            };
            let margin = Duration::from_millis(margin_ms);
            let expires_at = now.plus_ms(10_000);
            let allowed = i128::from(
                (expires_at.timestamp_millis()
                    - now.estimate_ms
                    - bound_ms
                    - i64::try_from(margin_ms).unwrap_or(0))
                .max(0),
            );
            let first = claimed_ms(
                at,
                initial_valid_until(at, &lease(expires_at), &now, margin),
            );
            let renewed = claimed_ms(at, renewed_valid_until(at, ttl, &now, margin));
            assert!(
                first <= allowed,
                "bound {bound_ms} ms, margin {margin_ms} ms: the first deadline claims {first} ms, at most expires_at − bound − margin = {allowed} ms"
            );
            assert!(
                renewed <= allowed,
                "bound {bound_ms} ms, margin {margin_ms} ms: after a renewal the watchdog claims {renewed} ms of validity, at most expires_at − bound − margin = {allowed} ms"
            );
        }
    }
}
