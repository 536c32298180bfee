//! The read/write-lock checker.
//!
//! Each holder records the stretch of time it spent inside, **and confirmed afterwards**
//! that its lease was still certainly valid at the end of it (an [`READ_INSIDE_OP`] or
//! [`WRITE_INSIDE_OP`] event from the instant its acquire returned to that check; a
//! holder that could not confirm records nothing). Such a stretch lies within the lease's
//! validity, so the property is exact: **no write stretch overlaps a read or another
//! write stretch** (`rw-overlap`). A paused holder that lost its lease does not confirm,
//! so pauses cannot produce false alarms; a lock that let a reader in next to a valid
//! writer (or two writers) does.
//!
//! **Limits:** stretches are compared on the history's monotonic clock; the check is per
//! key (resource).

use super::{Event, OpOutcome, Violation};

/// The history's name of a confirmed read stretch.
pub const READ_INSIDE_OP: &str = "read-inside";
/// The history's name of a confirmed write stretch (token = the writer's token).
pub const WRITE_INSIDE_OP: &str = "write-inside";

/// Checks that no confirmed write stretch overlaps another confirmed stretch.
pub fn check(events: &[Event]) -> Vec<Violation> {
    let inside: Vec<&Event> = events
        .iter()
        .filter(|e| {
            (e.op == READ_INSIDE_OP || e.op == WRITE_INSIDE_OP) && e.outcome == OpOutcome::Ok
        })
        .collect();
    let mut violations = Vec::new();
    for (i, w) in inside.iter().enumerate() {
        if w.op != WRITE_INSIDE_OP {
            continue;
        }
        for (j, x) in inside.iter().enumerate() {
            if i == j || x.key != w.key {
                continue;
            }
            // Each write/write pair once.
            if x.op == WRITE_INSIDE_OP && j < i {
                continue;
            }
            if w.start_us < x.end_us && x.start_us < w.end_us {
                violations.push(Violation::new(
                    "rw-overlap",
                    w.key.clone(),
                    format!(
                        "process {} wrote (token {}) from {} to {} µs while process {} {} from {} to {} µs",
                        w.process,
                        w.token.unwrap_or_default(),
                        w.start_us,
                        w.end_us,
                        x.process,
                        if x.op == WRITE_INSIDE_OP { "wrote" } else { "read" },
                        x.start_us,
                        x.end_us
                    ),
                ));
            }
        }
    }
    violations
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_may_overlap_writers_may_not() {
        let r = |p, s, e| Event::new(p, READ_INSIDE_OP, "k", s, e);
        let w = |p, s, e| Event::new(p, WRITE_INSIDE_OP, "k", s, e).token(1);
        assert!(check(&[r(1, 0, 10), r(2, 5, 15), w(3, 20, 30), r(1, 31, 40)]).is_empty());
        assert_eq!(check(&[r(1, 0, 10), w(3, 9, 30)]).len(), 1);
        assert_eq!(check(&[w(1, 0, 10), w(3, 9, 30)]).len(), 1);
        let other_key = Event::new(2, READ_INSIDE_OP, "other", 0, 100);
        assert!(check(&[w(1, 0, 10), other_key]).is_empty());
    }
}
