//! The semaphore workload (issue 16): racers take permits of one resource of a
//! [`Semaphore`] with N permits, hold them for a while, and release them; some "crash"
//! (never release: the permit must expire by server time) and some pause past their ttl.
//!
//! Each holding is recorded as an **inner interval** in server time, one that certainly
//! lies inside the real holding: it starts at the latest the server's clock can read
//! after the acquire returned, and ends at the earliest it can read before the release was
//! sent, or at the permit's expiry if that is earlier. More than N inner intervals
//! overlapping at one instant is therefore a real violation, whatever the clock error.
//! Token order is checked the same way: a permit granted certainly after another returned
//! must carry a higher token.
//!
//! `Mode::Control` opens the semaphore with its expiry check off (every holder counts as
//! expired), so acquires admit over valid holders: the checker must count violations.

use std::time::Duration;

use docwarden::clock::TimeSource;
use docwarden::lock::{Owner, Semaphore, SemaphoreOptions};
use mongodb::Database;

use crate::run::{Mode, RunConfig, RunReport, run_tasks};

/// One holding of a permit, in server time (milliseconds), inner bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holding {
    /// The permit's fencing token.
    pub token: i64,
    /// Earliest server time before the acquire was sent.
    pub sent_ms: i64,
    /// Latest server time after the acquire returned (the interval's start).
    pub start_ms: i64,
    /// Earliest server time before the release was sent, or the expiry if earlier.
    pub end_ms: i64,
}

/// What [`check`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SemaphoreCheck {
    /// Most holdings overlapping at one instant.
    pub max_holders: usize,
    /// Holdings that started while N others held (each one counted once).
    pub overlaps: u64,
    /// Holdings whose token is not above that of a holding that returned before it was sent.
    pub token_regressions: u64,
}

impl SemaphoreCheck {
    /// Every violation counted.
    pub fn violations(&self) -> u64 {
        self.overlaps + self.token_regressions
    }
}

/// Checks recorded holdings against `permits`: never more than `permits` at one instant,
/// tokens increasing in real-time order, and no token granted twice.
pub fn check(holdings: &[Holding], permits: usize) -> SemaphoreCheck {
    let mut events: Vec<(i64, i32)> = Vec::with_capacity(holdings.len() * 2);
    for h in holdings.iter().filter(|h| h.start_ms < h.end_ms) {
        events.push((h.start_ms, 1));
        events.push((h.end_ms, -1));
    }
    // Ends before starts at one instant: the intervals are half-open.
    events.sort_unstable();
    let mut out = SemaphoreCheck::default();
    let mut holding = 0_usize;
    for (_, delta) in events {
        if delta > 0 {
            holding += 1;
            if holding > permits {
                out.overlaps += 1;
            }
            out.max_holders = out.max_holders.max(holding);
        } else {
            holding = holding.saturating_sub(1);
        }
    }
    let mut by_return: Vec<&Holding> = holdings.iter().collect();
    by_return.sort_unstable_by_key(|h| h.start_ms);
    let mut by_sent: Vec<&Holding> = holdings.iter().collect();
    by_sent.sort_unstable_by_key(|h| h.sent_ms);
    let mut i = 0;
    let mut highest = i64::MIN;
    // Every permit takes a new token: one granted twice did not increase, whatever the
    // overlap of the two acquires.
    let mut granted = std::collections::HashSet::new();
    for b in by_sent {
        while i < by_return.len() && by_return[i].start_ms < b.sent_ms {
            highest = highest.max(by_return[i].token);
            i += 1;
        }
        let fresh = granted.insert(b.token);
        if highest >= b.token || !fresh {
            out.token_regressions += 1;
        }
    }
    out
}

/// Opens the semaphore `name` with `permits` permits for `mode`.
///
/// # Errors
/// A database error.
pub async fn open(
    db: &Database,
    name: &str,
    time: TimeSource,
    permits: u32,
    mode: Mode,
) -> docwarden::Result<Semaphore> {
    let mut options = SemaphoreOptions::default()
        .default_permits(permits)
        .backoff(Duration::from_millis(2), Duration::from_millis(20));
    if mode == Mode::Control {
        options = options.unsafe_ignore_expiry();
    }
    Semaphore::open(db, name, time, options).await
}

/// The resource every racer takes permits of.
pub const RESOURCE: &str = "partner-api";

/// How one racer behaves, by operation number.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// The permit's ttl.
    pub ttl: Duration,
    /// How long a holder holds before releasing.
    pub hold: Duration,
    /// Every this many operations a racer crashes (never releases).
    pub crash_every: u64,
    /// Every this many operations a racer pauses past its ttl, then releases.
    pub pause_every: u64,
}

impl Default for Shape {
    fn default() -> Self {
        Self {
            ttl: Duration::from_millis(300),
            hold: Duration::from_millis(15),
            crash_every: 11,
            pause_every: 13,
        }
    }
}

/// One racer's operations: acquire (waiting), hold, release (or crash, or pause first).
/// Returns its holdings.
///
/// # Errors
/// A database error other than a lost permit.
pub async fn racer(
    sem: &Semaphore,
    worker: usize,
    ops: u64,
    shape: Shape,
) -> anyhow::Result<Vec<Holding>> {
    let time = sem.time().clone();
    let mut out = Vec::new();
    for op in 0..ops {
        let owner = Owner::random();
        let sent = time.now().await?.earliest().timestamp_millis();
        let Some(permit) = sem
            .acquire(&owner, RESOURCE, shape.ttl, Duration::from_secs(10))
            .await?
        else {
            continue;
        };
        let start = time.now().await?.latest().timestamp_millis();
        let expiry = permit.expires_at.timestamp_millis();
        let nth = op + u64::try_from(worker).unwrap_or(0);
        if shape.crash_every > 0 && nth % shape.crash_every == shape.crash_every - 1 {
            out.push(Holding {
                token: permit.token.get(),
                sent_ms: sent,
                start_ms: start,
                end_ms: expiry,
            });
            continue;
        }
        let hold = if shape.pause_every > 0 && nth % shape.pause_every == shape.pause_every - 1 {
            shape.ttl + shape.hold
        } else {
            shape.hold
        };
        tokio::time::sleep(hold).await;
        let end = time.now().await?.earliest().timestamp_millis();
        out.push(Holding {
            token: permit.token.get(),
            sent_ms: sent,
            start_ms: start,
            end_ms: end.min(expiry),
        });
        match sem.release(&permit).await {
            Ok(()) | Err(docwarden::Error::LeaseLost { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(out)
}

/// Runs `config.workers` racers in this process and checks their holdings.
///
/// # Errors
/// A racer's database error.
pub async fn run(
    sem: &Semaphore,
    permits: u32,
    config: RunConfig,
    shape: Shape,
) -> anyhow::Result<(RunReport, SemaphoreCheck)> {
    let per = run_tasks(config.workers, |w| {
        let sem = sem.clone();
        async move { racer(&sem, w, config.ops_per_worker, shape).await }
    })
    .await?;
    let holdings: Vec<Holding> = per.into_iter().flatten().collect();
    let c = check(&holdings, usize::try_from(permits)?);
    Ok((
        RunReport {
            operations: u64::try_from(holdings.len())?,
            violations: c.violations(),
        },
        c,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(token: i64, sent_ms: i64, start_ms: i64, end_ms: i64) -> Holding {
        Holding {
            token,
            sent_ms,
            start_ms,
            end_ms,
        }
    }

    #[test]
    fn overlaps_beyond_n_are_counted() {
        let ok = [h(1, 0, 1, 10), h(2, 0, 2, 10), h(3, 9, 10, 20)];
        assert_eq!(check(&ok, 2).violations(), 0);
        assert_eq!(check(&ok, 1).overlaps, 1);
        let bad = [h(1, 0, 1, 10), h(2, 0, 2, 10), h(3, 0, 3, 10)];
        assert_eq!(check(&bad, 2).overlaps, 1);
        assert_eq!(check(&bad, 2).max_holders, 3);
    }

    /// Two permits granted the same token, their acquires overlapping: each permit takes
    /// a new token (`token + 1`), so one of them did not increase.
    #[test]
    fn one_token_granted_to_two_overlapping_permits_is_a_regression() {
        let twice = [h(2, 0, 3, 4), h(2, 1, 2, 3)];
        assert_eq!(check(&twice, 2).token_regressions, 1);
        // Ordered in real time: counted once.
        let ordered = [h(2, 0, 1, 2), h(2, 5, 6, 7)];
        assert_eq!(check(&ordered, 2).token_regressions, 1);
    }

    #[test]
    fn tokens_must_follow_real_time() {
        let ok = [h(1, 0, 1, 2), h(2, 5, 6, 7)];
        assert_eq!(check(&ok, 1).token_regressions, 0);
        let bad = [h(2, 0, 1, 2), h(1, 5, 6, 7)];
        assert_eq!(check(&bad, 1).token_regressions, 1);
        // Concurrent acquires may be granted in either order.
        let concurrent = [h(2, 0, 3, 4), h(1, 1, 2, 3)];
        assert_eq!(check(&concurrent, 2).token_regressions, 0);
    }
}

/// The history operations of the verify workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A permit granted: token, `value` = start (server ms), detail `sent_ms expiry_ms`.
    Permit,
    /// A permit given back: token, `value` = end (server ms).
    Release,
}

impl Op {
    /// The name in histories and reports.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Op::Permit => "permit",
            Op::Release => "release-permit",
        }
    }
}

/// The history event of a granted permit (see [`Op::Permit`]).
pub fn permit_event(
    process: u32,
    at_us: u64,
    token: i64,
    sent_ms: i64,
    start_ms: i64,
    expiry_ms: i64,
) -> docwarden::check::Event {
    docwarden::check::Event::new(process, Op::Permit.as_str(), RESOURCE, at_us, at_us)
        .token(token)
        .value(start_ms)
        .detail(format!("{sent_ms} {expiry_ms}"))
}

/// The history event of a released permit (see [`Op::Release`]).
pub fn release_event(process: u32, at_us: u64, token: i64, end_ms: i64) -> docwarden::check::Event {
    docwarden::check::Event::new(process, Op::Release.as_str(), RESOURCE, at_us, at_us)
        .token(token)
        .value(end_ms)
}

/// The holdings of a history: each permit event, ended by its release event or, without
/// one (a killed or paused holder), by its expiry.
pub fn holdings(events: &[docwarden::check::Event]) -> Vec<Holding> {
    let ends: std::collections::HashMap<i64, i64> = events
        .iter()
        .filter(|e| e.op == Op::Release.as_str())
        .filter_map(|e| Some((e.token?, e.value?)))
        .collect();
    events
        .iter()
        .filter(|e| e.op == Op::Permit.as_str())
        .filter_map(|e| {
            let token = e.token?;
            let start_ms = e.value?;
            let mut parts = e.detail.split(' ').map(str::parse::<i64>);
            let sent_ms = parts.next()?.ok()?;
            let expiry_ms = parts.next()?.ok()?;
            let end_ms = ends.get(&token).map_or(expiry_ms, |e| (*e).min(expiry_ms));
            Some(Holding {
                token,
                sent_ms,
                start_ms,
                end_ms,
            })
        })
        .collect()
}

/// The verify checker: more than `permits` holders at one instant
/// (`semaphore-over-capacity`, one per holding that started beyond), tokens out of
/// real-time order (`token-not-increasing`).
pub fn violations(
    events: &[docwarden::check::Event],
    permits: usize,
) -> Vec<docwarden::check::Violation> {
    let c = check(&holdings(events), permits);
    let mut out = Vec::new();
    for _ in 0..c.overlaps {
        out.push(docwarden::check::Violation::new(
            "semaphore-over-capacity",
            RESOURCE,
            format!(
                "{} holders at one server instant (permits {permits})",
                c.max_holders
            ),
        ));
    }
    for _ in 0..c.token_regressions {
        out.push(docwarden::check::Violation::new(
            "token-not-increasing",
            RESOURCE,
            "a permit granted after another returned carries a lower token",
        ));
    }
    out
}
