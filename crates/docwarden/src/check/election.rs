//! The leader-election checker.
//!
//! A leader paused past its term still believes it leads, so "never two processes acting
//! as leader" is not the property. The properties are:
//!
//! 1. **One leader per term** (`duplicate-term`): no term was handed to two elections.
//! 2. **Terms increase** (`term-not-increasing`): of two elections where one ended before
//!    the other began, the later has the higher term.
//! 3. **Validity claims hold** (`two-leaders`): when a leader confirms that its term is
//!    certainly valid for `value` more milliseconds (a [`HOLD_OP`] event, from the
//!    watchdog's `valid_until`), no election of a higher term completes within that time,
//!    unless the leader resigned first.
//! 4. **A stale leader's writes are refused** (`stale-write-accepted`): the fenced log
//!    (the terms of the accepted writes, in the order the storage applied them) never goes
//!    down: a write of term `t` after one of a higher term means a leader wrote after a
//!    newer term had.
//!
//! 5. **Acknowledged writes are in the log** (`lost-update`): the log holds each term at
//!    least as many times as writes of that term were acknowledged (a missing log holds
//!    none).
//!
//! Events used: [`ELECT_OP`] (Ok, token = term), [`WRITE_OP`] (Ok, token = term), [`HOLD_OP`] (token, value = ms of
//! certain validity left), [`RESIGN_OP`] (token; Ok or indeterminate: it may have ended
//! the term; an indeterminate one without a token, cut short before its term was recorded,
//! may have ended its process's current term).
//!
//! **Limits:** real-time order comes from the history's monotonic clock, so operations
//! that overlap are never counted against each other.

use std::collections::BTreeMap;

use super::{Event, OpOutcome, Violation};

/// The history's name of a won election (token = the term).
pub const ELECT_OP: &str = "elect";
/// The history's name of a validity claim of a leader (token = term, value = ms left).
pub const HOLD_OP: &str = "hold";
/// The history's name of a fenced write as leader (Ok = accepted, Failed = refused).
pub const WRITE_OP: &str = "write";
/// The history's name of a resignation.
pub const RESIGN_OP: &str = "resign";

/// Checks properties 1 to 3 on the events of a run, and 4 and 5 on `log`: the terms of
/// the accepted fenced writes, in the order they were applied (the final read).
pub fn check(events: &[Event], log: &[i64]) -> Vec<Violation> {
    let mut violations = Vec::new();
    let elects: Vec<&Event> = events
        .iter()
        .filter(|e| e.op == ELECT_OP && e.outcome == OpOutcome::Ok && e.token.is_some())
        .collect();
    // 1.
    let mut by_term: BTreeMap<(&str, i64), Vec<&Event>> = BTreeMap::new();
    for e in &elects {
        by_term
            .entry((e.key.as_str(), e.token.unwrap_or_default()))
            .or_default()
            .push(e);
    }
    for ((key, term), list) in &by_term {
        if list.len() > 1 {
            let who: Vec<String> = list.iter().map(|e| e.process.to_string()).collect();
            violations.push(Violation::new(
                "duplicate-term",
                *key,
                format!("term {term} was won by processes {}", who.join(", ")),
            ));
        }
    }
    // 2.
    for a in &elects {
        for b in &elects {
            if a.key == b.key && a.end_us < b.start_us && a.token >= b.token {
                violations.push(Violation::new(
                    "term-not-increasing",
                    b.key.clone(),
                    format!(
                        "process {} won term {} after process {} had won term {}",
                        b.process,
                        b.token.unwrap_or_default(),
                        a.process,
                        a.token.unwrap_or_default()
                    ),
                ));
            }
        }
    }
    // 3.
    // A resignation ends the claim unless it was refused; one whose reply was lost may
    // have landed, and the checker accepts either outcome. So may one cut short whose
    // term was never recorded (its process killed or its task aborted while it was in
    // flight, recorded without a token): a process resigns only the term it holds, so
    // such a resignation by the claim's process after the claim may have ended it.
    let mut resigned: BTreeMap<(&str, i64), u64> = BTreeMap::new();
    for e in events
        .iter()
        .filter(|e| e.op == RESIGN_OP && e.outcome != OpOutcome::Failed)
    {
        if let Some(t) = e.token {
            let at = resigned.entry((e.key.as_str(), t)).or_insert(e.start_us);
            *at = (*at).min(e.start_us);
        }
    }
    for h in events.iter().filter(|e| e.op == HOLD_OP) {
        let (Some(term), Some(ms)) = (h.token, h.value) else {
            continue;
        };
        if ms <= 0 {
            continue;
        }
        let until = h
            .start_us
            .saturating_add(u64::try_from(ms).unwrap_or(0).saturating_mul(1_000));
        let untagged = events
            .iter()
            .filter(|e| {
                e.op == RESIGN_OP
                    && e.key == h.key
                    && e.token.is_none()
                    && e.process == h.process
                    && e.outcome == OpOutcome::Indeterminate
                    && e.start_us >= h.start_us
            })
            .map(|e| e.start_us)
            .min();
        let resign = match (resigned.get(&(h.key.as_str(), term)).copied(), untagged) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if let Some(e) = elects.iter().find(|e| {
            e.key == h.key
                && e.token.is_some_and(|t| t > term)
                && e.end_us < until
                && resign.is_none_or(|r| r > e.end_us)
        }) {
            violations.push(Violation::new(
                "two-leaders",
                h.key.clone(),
                format!(
                    "process {} won term {} while process {} claimed term {term} valid for {ms} ms more",
                    e.process,
                    e.token.unwrap_or_default(),
                    h.process
                ),
            ));
        }
    }
    // 4.
    let mut highest = i64::MIN;
    for (i, term) in log.iter().enumerate() {
        if *term < highest {
            violations.push(Violation::new(
                "stale-write-accepted",
                format!("log[{i}]"),
                format!("a write of term {term} was accepted after one of term {highest}"),
            ));
        }
        highest = highest.max(*term);
    }
    // 5.
    let mut acknowledged: BTreeMap<i64, usize> = BTreeMap::new();
    for e in events
        .iter()
        .filter(|e| e.op == WRITE_OP && e.outcome == OpOutcome::Ok)
    {
        if let Some(term) = e.token {
            *acknowledged.entry(term).or_default() += 1;
        }
    }
    for (term, n) in acknowledged {
        let found = log.iter().filter(|t| **t == term).count();
        if found < n {
            violations.push(Violation::new(
                "lost-update",
                format!("term {term}"),
                format!("{n} write(s) of term {term} were acknowledged, the log holds {found}"),
            ));
        }
    }
    violations
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(p: u32, op: &str, start: u64, end: u64, token: i64) -> Event {
        Event::new(p, op, "e", start, end).token(token)
    }

    #[test]
    fn a_clean_history_passes() {
        let events = vec![
            ev(1, ELECT_OP, 0, 10, 1),
            ev(1, HOLD_OP, 20, 20, 1).value(50),
            ev(1, RESIGN_OP, 80, 90, 1),
            ev(2, ELECT_OP, 85, 100, 2),
        ];
        assert!(check(&events, &[1, 1, 2]).is_empty());
    }

    /// A resignation whose reply was lost may have landed: a newer term won after it
    /// began is then no overlap (the checker accepts either outcome). A refused one
    /// ended nothing.
    #[test]
    fn an_indeterminate_resignation_may_have_ended_the_claim() {
        let resign = |outcome| ev(1, RESIGN_OP, 30, 40, 1).outcome(outcome);
        let history = |outcome| {
            vec![
                ev(1, ELECT_OP, 0, 10, 1),
                ev(1, HOLD_OP, 20, 20, 1).value(100),
                resign(outcome),
                ev(2, ELECT_OP, 35, 60, 2),
            ]
        };
        assert!(check(&history(OpOutcome::Indeterminate), &[]).is_empty());
        assert_eq!(check(&history(OpOutcome::Failed), &[]).len(), 1);
    }

    /// A resignation cut short before its term was recorded (its process killed while it
    /// was in flight) may have landed: by the claim's own process after the claim, it may
    /// end the claim; by another process, or refused, it does not.
    #[test]
    fn an_untagged_abandoned_resignation_of_the_claims_process_may_have_ended_it() {
        let history = |process: u32, outcome| {
            vec![
                ev(1, ELECT_OP, 0, 10, 1),
                ev(1, HOLD_OP, 20, 20, 1).value(100),
                Event::new(process, RESIGN_OP, "e", 30, 40).outcome(outcome),
                ev(2, ELECT_OP, 35, 60, 2),
            ]
        };
        assert!(check(&history(1, OpOutcome::Indeterminate), &[]).is_empty());
        assert_eq!(check(&history(3, OpOutcome::Indeterminate), &[]).len(), 1);
        assert_eq!(check(&history(1, OpOutcome::Failed), &[]).len(), 1);
    }

    /// The log is the final read of the fenced writes: an acknowledged write missing from
    /// it (or the whole log missing) was lost, and the order check alone cannot see it.
    #[test]
    fn an_acknowledged_write_missing_from_the_log_is_lost() {
        let events = vec![
            ev(1, ELECT_OP, 0, 10, 1),
            ev(1, WRITE_OP, 20, 30, 1),
            ev(1, WRITE_OP, 40, 50, 1),
            ev(1, WRITE_OP, 60, 70, 1).outcome(OpOutcome::Indeterminate),
        ];
        assert!(check(&events, &[1, 1]).is_empty());
        for log in [&[1][..], &[]] {
            let v = check(&events, log);
            assert_eq!(v.len(), 1, "{log:?}: {v:?}");
            assert_eq!(v[0].kind, "lost-update");
        }
    }

    #[test]
    fn planted_violations_are_found() {
        let kinds = |events: &[Event], log: &[i64]| -> Vec<&'static str> {
            check(events, log).iter().map(|v| v.kind).collect()
        };
        assert_eq!(
            kinds(
                &[ev(1, ELECT_OP, 0, 10, 5), ev(2, ELECT_OP, 20, 30, 5)],
                &[]
            ),
            vec!["duplicate-term", "term-not-increasing"]
        );
        assert_eq!(
            kinds(
                &[ev(1, ELECT_OP, 0, 10, 5), ev(2, ELECT_OP, 20, 30, 4)],
                &[]
            ),
            vec!["term-not-increasing"]
        );
        assert_eq!(
            kinds(
                &[
                    ev(1, ELECT_OP, 0, 10, 1),
                    ev(1, HOLD_OP, 20, 20, 1).value(100),
                    ev(2, ELECT_OP, 30, 40, 2)
                ],
                &[]
            ),
            vec!["two-leaders"]
        );
        assert_eq!(kinds(&[], &[1, 3, 2]), vec!["stale-write-accepted"]);
    }
}
