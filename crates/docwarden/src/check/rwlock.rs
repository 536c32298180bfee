//! The read/write-lock checker.
//!
//! Each holder records the stretch it spent inside, **and confirmed afterwards** that its
//! lease was still certainly valid at the end of it (an [`READ_INSIDE_OP`] or
//! [`WRITE_INSIDE_OP`] event; a holder that could not confirm records nothing). The
//! stretch is a [`Span`] of the server's order ([`super::order`]): from a marker write
//! made right after the acquire returned to one made right before the confirmation. It
//! lies within the lease's validity, so the property is exact: **no write stretch
//! overlaps a read or another write stretch** (`rw-overlap`). A paused holder that lost
//! its lease does not confirm, so pauses cannot produce false alarms; a lock that let a
//! reader in next to a valid writer (or two writers) does. No client clock takes part in
//! the judgement, so a skewed, stepped or drifting clock can neither hide an overlap nor
//! invent one; a clock that let a holder confirm a lease it had lost shows as an overlap.
//!
//! **Limits:** a stretch without a span (a marker write failed) is not judged; the check
//! is per key (resource).

use super::order::Span;
use super::{Event, OpOutcome, Violation};

/// The history's name of a confirmed read stretch.
pub const READ_INSIDE_OP: &str = "read-inside";
/// The history's name of a confirmed write stretch (token = the writer's token).
pub const WRITE_INSIDE_OP: &str = "write-inside";

/// Checks that no confirmed write stretch overlaps another confirmed stretch, in the
/// server's order.
pub fn check(events: &[Event]) -> Vec<Violation> {
    let inside: Vec<(&Event, Span)> = events
        .iter()
        .filter(|e| {
            (e.op == READ_INSIDE_OP || e.op == WRITE_INSIDE_OP) && e.outcome == OpOutcome::Ok
        })
        .filter_map(|e| Some((e, e.span?)))
        .collect();
    let mut violations = Vec::new();
    for (i, (w, ws)) in inside.iter().enumerate() {
        if w.op != WRITE_INSIDE_OP {
            continue;
        }
        for (j, (x, xs)) in inside.iter().enumerate() {
            if i == j || x.key != w.key {
                continue;
            }
            // Each write/write pair once.
            if x.op == WRITE_INSIDE_OP && j < i {
                continue;
            }
            if ws.overlaps(xs) {
                violations.push(Violation::new(
                    "rw-overlap",
                    w.key.clone(),
                    format!(
                        "process {} wrote (token {}) over {ws} while process {} {} over {xs} (server order)",
                        w.process,
                        w.token.unwrap_or_default(),
                        x.process,
                        if x.op == WRITE_INSIDE_OP { "wrote" } else { "read" },
                    ),
                ));
            }
        }
    }
    violations
}

#[cfg(test)]
mod tests {
    use super::super::order::Stamp;
    use super::*;

    fn span(from: u32, to: u32) -> Span {
        Span::new(Stamp::new(100, from), Stamp::new(100, to)).expect("span")
    }
    /// A stretch recorded at `s..e` µs on the history's clock, spanning `from..to` of the
    /// server's order.
    fn r(p: u32, s: u64, e: u64, from: u32, to: u32) -> Event {
        Event::new(p, READ_INSIDE_OP, "k", s, e).span(span(from, to))
    }
    fn w(p: u32, s: u64, e: u64, from: u32, to: u32) -> Event {
        Event::new(p, WRITE_INSIDE_OP, "k", s, e)
            .token(1)
            .span(span(from, to))
    }

    #[test]
    fn readers_may_overlap_writers_may_not() {
        assert!(
            check(&[
                r(1, 0, 10, 1, 10),
                r(2, 5, 15, 5, 15),
                w(3, 20, 30, 20, 30),
                r(1, 31, 40, 31, 40)
            ])
            .is_empty()
        );
        assert_eq!(check(&[r(1, 0, 10, 1, 10), w(3, 9, 30, 9, 30)]).len(), 1);
        assert_eq!(check(&[w(1, 0, 10, 1, 10), w(3, 9, 30, 9, 30)]).len(), 1);
        let other_key = Event::new(2, READ_INSIDE_OP, "other", 0, 100).span(span(1, 100));
        assert!(check(&[w(1, 0, 10, 1, 10), other_key]).is_empty());
        // Touching in the server's order (the reader's last marker and the writer's first
        // read the same cluster time): no order, no overlap.
        assert!(check(&[r(1, 0, 10, 1, 10), w(3, 11, 30, 10, 30)]).is_empty());
    }

    /// The history's clock of one process stepped back (or a time base shifted) puts a
    /// writer's stretch next to a reader's where the server ordered them apart, and hides
    /// an overlap the server saw: the server's order decides, the history's clock does not.
    #[test]
    fn the_servers_order_decides_not_the_holders_clocks() {
        // By the recorded times they overlap; the server ordered them one after the other.
        assert!(check(&[r(1, 0, 10, 1, 5), w(3, 5, 30, 6, 30)]).is_empty());
        // By the recorded times the writer came after; the server saw both inside at once.
        assert_eq!(check(&[r(1, 0, 10, 1, 10), w(3, 50, 60, 5, 30)]).len(), 1);
        // A stretch without a span (its marker write failed) is not judged.
        let unstamped = Event::new(3, WRITE_INSIDE_OP, "k", 0, 10).token(2);
        assert!(check(&[r(1, 0, 10, 1, 10), unstamped]).is_empty());
    }
}
