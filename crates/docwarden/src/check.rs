//! Checkers that decide, from a recorded history, whether a guarantee held.
//!
//! A run of `docwarden verify` records every operation it makes ([`history`]): which
//! process, when it started and ended on a monotonic clock, on what key, with which
//! fencing token, and whether it succeeded, failed, or is indeterminate (a timeout: it
//! may or may not have taken effect). Each checker turns such a history — plus a final
//! read of the database — into a list of [`Violation`]s. The checkers are pure functions
//! and are unit-tested on synthetic histories with and without planted violations.
//!
//! **Limits:** a checker can only see what the history recorded. Real-time order is taken
//! from the client's monotonic clock, so two operations are ordered only when one ended
//! before the other started; concurrent operations are never counted against each other.
//! The checkers of holders' stretches (semaphore, limits, rwlock) judge them in the
//! server's order instead ([`order`]), which no client clock can bend.

pub mod election;
pub mod history;
pub mod lease;
pub mod order;
pub mod queue;
pub mod rwlock;
pub mod state;

pub use history::{Entry, Event, History, OpOutcome};

/// One broken guarantee found by a checker.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Violation {
    /// The kind, stable for scripts: `token-not-increasing`, `stale-write-accepted`,
    /// `overlapping-leases`, `lost-update`, `unacknowledged-update`, `duplicated-update`,
    /// `lost-add`, `lost-job`, `duplicate-effect`, `retry-executed-twice` (the server ran a
    /// driver retry twice),
    /// `stale-effect`, `effect-after-finish`, `phantom-completion`, `stuck-job`,
    /// `duplicate-term`, `term-not-increasing`, `two-leaders`, `rw-overlap`,
    /// `state-mismatch`, `duplicate-document`, `invariant-broken`; and from `verify`,
    /// `nothing-verified` (no operation of a module took effect).
    pub kind: &'static str,
    /// The resource, job or document concerned.
    pub key: String,
    /// A sentence a person can act on.
    pub detail: String,
}

impl Violation {
    /// A violation of `kind` on `key`.
    pub fn new(kind: &'static str, key: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            kind,
            key: key.into(),
            detail: detail.into(),
        }
    }
}

/// Counts of violations by kind, in first-seen order.
pub fn count_by_kind(violations: &[Violation]) -> Vec<(&'static str, usize)> {
    let mut counts: Vec<(&'static str, usize)> = Vec::new();
    for v in violations {
        match counts.iter_mut().find(|(k, _)| *k == v.kind) {
            Some((_, n)) => *n += 1,
            None => counts.push((v.kind, 1)),
        }
    }
    counts
}
