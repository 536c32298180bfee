//! The semaphore workload (issue 16): racers take permits of one resource of a
//! [`Semaphore`] with N permits, hold them for a while, and release them; some "crash"
//! (never release: the permit must expire by server time) and some pause past their ttl.
//!
//! The checker ([`check`]) takes [`Holding`]s in any trusted order. `docwarden verify`
//! records them in the **server's order** ([`docwarden::check::order`], [`holdings`]): a
//! marker write before the acquire is sent, one right after it returned, and one right
//! before the holder confirms its permit still certainly valid; a holding it cannot
//! confirm (paused past its ttl) claims no stretch. No holder's clock takes part, so the
//! clock faults can neither hide an overlap nor invent one. The in-process [`run`] (the
//! integration test, whose racers share one unfaulted server clock and have no database
//! to mark) records **inner intervals in server time** instead: from the latest the
//! server's clock can read after the acquire returned to the earliest it can read before
//! the release was sent, or the permit's expiry if that is earlier.
//!
//! Either way more than N stretches overlapping at one instant is a real violation, and
//! token order is checked the same way: a permit whose acquire was sent after another's
//! returned must carry a higher token.
//!
//! `Mode::Control` opens the semaphore with its expiry check off (every holder counts as
//! expired), so acquires admit over valid holders: the checker must count violations.

use std::time::Duration;

use docwarden::check::order::{Crowding, Span, Stamp, crowding};
use docwarden::clock::TimeSource;
use docwarden::lock::{Owner, Semaphore, SemaphoreOptions};
use mongodb::Database;

use crate::run::{Mode, RunConfig, RunReport, run_tasks};

/// One holding of a permit, inner bounds in a trusted order: [`Stamp`]s of the server's
/// order (verify), or server milliseconds (the in-process [`run`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holding<T = i64> {
    /// The permit's fencing token.
    pub token: i64,
    /// Certainly before the acquire was sent.
    pub sent: T,
    /// Certainly after the acquire returned (the stretch's start).
    pub start: T,
    /// Certainly before the holder stopped holding a valid permit (the stretch's end);
    /// `None`: it claims no stretch (it could not confirm its permit).
    pub end: Option<T>,
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
pub fn check<T: Ord + Copy>(holdings: &[Holding<T>], permits: usize) -> SemaphoreCheck {
    let Crowding { most, beyond } = crowding(
        holdings.iter().filter_map(|h| Some((h.start, h.end?))),
        permits,
    );
    let mut out = SemaphoreCheck {
        max_holders: most,
        overlaps: beyond,
        token_regressions: 0,
    };
    let mut by_return: Vec<&Holding<T>> = holdings.iter().collect();
    by_return.sort_by_key(|h| h.start);
    let mut by_sent: Vec<&Holding<T>> = holdings.iter().collect();
    by_sent.sort_by_key(|h| h.sent);
    let mut i = 0;
    let mut highest = i64::MIN;
    // Every permit takes a new token: one granted twice did not increase, whatever the
    // overlap of the two acquires.
    let mut granted = std::collections::HashSet::new();
    for b in by_sent {
        while i < by_return.len() && by_return[i].start < b.sent {
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
                sent,
                start,
                end: Some(expiry),
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
            sent,
            start,
            end: Some(end.min(expiry)),
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

/// The history operations of the verify workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A permit granted: token, span = from the marker before the acquire was sent to the
    /// marker after it returned.
    Permit,
    /// A permit held and confirmed still certainly valid: token, span = from the marker
    /// after the acquire returned to the marker before the confirmation.
    Held,
}

impl Op {
    /// The name in histories and reports.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Op::Permit => "permit",
            Op::Held => "permit-held",
        }
    }
}

/// The history event of a granted permit (see [`Op::Permit`]): its acquire was sent after
/// `sent` and returned before `entered`.
pub fn permit_event(
    process: u32,
    at_us: u64,
    token: i64,
    sent: Stamp,
    entered: Stamp,
) -> Option<docwarden::check::Event> {
    Some(
        docwarden::check::Event::new(process, Op::Permit.as_str(), RESOURCE, at_us, at_us)
            .token(token)
            .span(Span::new(sent, entered)?),
    )
}

/// The history event of a permit held from `entered` to `confirmed` (see [`Op::Held`]),
/// recorded only once the holder confirmed the permit still certainly valid after
/// `confirmed`.
pub fn held_event(
    process: u32,
    at_us: u64,
    token: i64,
    entered: Stamp,
    confirmed: Stamp,
) -> Option<docwarden::check::Event> {
    Some(
        docwarden::check::Event::new(process, Op::Held.as_str(), RESOURCE, at_us, at_us)
            .token(token)
            .span(Span::new(entered, confirmed)?),
    )
}

/// The holdings of a history, in the server's order: each permit event, with the stretch
/// of its held event if the holder confirmed one (none for a holder paused or stopped
/// past its ttl, or killed).
pub fn holdings(events: &[docwarden::check::Event]) -> Vec<Holding<Stamp>> {
    let ends: std::collections::HashMap<i64, Stamp> = events
        .iter()
        .filter(|e| e.op == Op::Held.as_str())
        .filter_map(|e| Some((e.token?, e.span?.to)))
        .collect();
    events
        .iter()
        .filter(|e| e.op == Op::Permit.as_str())
        .filter_map(|e| {
            let token = e.token?;
            let span = e.span?;
            Some(Holding {
                token,
                sent: span.from,
                start: span.to,
                end: ends.get(&token).copied(),
            })
        })
        .collect()
}

/// The verify checker: more than `permits` holders at one instant of the server's order
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
                "{} holders at one instant of the server's order (permits {permits})",
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

#[cfg(test)]
mod tests {
    use super::*;

    fn h(token: i64, sent: i64, start: i64, end: i64) -> Holding {
        Holding {
            token,
            sent,
            start,
            end: Some(end),
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

    fn stamp(inc: u32) -> Stamp {
        Stamp::new(1_800_000_000, inc)
    }

    /// One verify holding: the acquire sent after marker `sent`, returned before
    /// `entered`, held and confirmed up to `confirmed` (server order), and what the
    /// holder's own clock said (`clock_ms`: start, end), as the old recorder kept it.
    struct Recorded {
        events: Vec<docwarden::check::Event>,
        by_clock: Vec<Holding>,
    }

    /// token, sent, entered, confirmed (server order), and the holder's clock's interval.
    type Planned = (i64, u32, u32, Option<u32>, (i64, i64));

    fn record(holdings: &[Planned]) -> Recorded {
        let mut events = Vec::new();
        let mut by_clock = Vec::new();
        for &(token, sent, entered, confirmed, (start_ms, end_ms)) in holdings {
            events.extend(permit_event(1, 0, token, stamp(sent), stamp(entered)));
            if let Some(c) = confirmed {
                events.extend(held_event(1, 0, token, stamp(entered), stamp(c)));
            }
            by_clock.push(h(token, start_ms - 1, start_ms, end_ms));
        }
        Recorded { events, by_clock }
    }

    /// Three holders of two permits held at once by the server's order, the third with a
    /// clock stepped 20 s ahead: by the holders' own clocks (the old judgement) the third
    /// came long after the other two, and the overlap is hidden. The server's order
    /// shows it.
    #[test]
    fn a_clock_stepped_ahead_hides_an_overlap_from_the_clocks_not_from_the_servers_order() {
        let r = record(&[
            (1, 1, 2, Some(20), (1_000, 1_030)),
            (2, 3, 4, Some(21), (1_002, 1_031)),
            (3, 5, 6, Some(22), (21_004, 21_030)),
        ]);
        assert_eq!(
            check(&r.by_clock, 2).overlaps,
            0,
            "the old judgement is fooled"
        );
        let c = check(&holdings(&r.events), 2);
        assert_eq!(c.overlaps, 1);
        assert_eq!(c.max_holders, 3);
    }

    /// Two holders of one permit, one after the other by the server's order, the second
    /// with a clock skewed 30 ms behind: by the clocks (the old judgement) they overlap.
    /// The server's order does not.
    #[test]
    fn a_clock_skewed_behind_invents_an_overlap_for_the_clocks_not_for_the_servers_order() {
        let r = record(&[
            (1, 1, 2, Some(5), (1_000, 1_030)),
            (2, 6, 7, Some(9), (1_010, 1_040)),
        ]);
        let fooled = check(&r.by_clock, 1);
        assert_eq!(fooled.overlaps, 1, "the old judgement is fooled");
        assert_eq!(
            check(&holdings(&r.events), 1),
            SemaphoreCheck {
                max_holders: 1,
                overlaps: 0,
                token_regressions: 0,
            }
        );
    }

    /// A holder that could not confirm its permit (paused past its ttl) claims no
    /// stretch; its token still counts for the order of tokens.
    #[test]
    fn an_unconfirmed_holding_claims_no_stretch_but_its_token_counts() {
        let r = record(&[
            (5, 1, 2, None, (0, 0)),
            (6, 3, 4, Some(9), (0, 0)),
            (4, 5, 6, Some(9), (0, 0)),
        ]);
        let c = check(&holdings(&r.events), 1);
        assert_eq!(c.overlaps, 1, "4 and 6 held at once; 5 claims nothing");
        assert_eq!(c.token_regressions, 1, "4 was sent after 5 and 6 returned");
    }
}
