//! The lease-mutex checker.
//!
//! Leases can overlap in real time — a holder that pauses past its ttl still believes it
//! holds the lock — so "never two holders" is not the property. The property is:
//!
//! 1. **Tokens increase**: of two successful acquires of one resource where one ended
//!    before the other began, the later has the higher token; and no token is granted
//!    twice, whatever the overlap (two grants are in some order all the same).
//! 2. **Stale writes are refused**: once the storage has accepted a fenced operation with
//!    token `u`, no operation with a lower token that begins afterwards may be accepted
//!    (a `write`, or a `touch`: the touch is a fenced write too).
//!    (Storage-side fencing cannot refuse a stale holder before the new holder's token has
//!    reached the storage; that is why holders register their token — a fenced `touch` —
//!    before they read.)
//! 3. **No lost updates**: the final value of each counter equals the number of
//!    acknowledged increments (every read-modify-write under the lock counted once), and in
//!    the set workload every acknowledged add is in the final read.
//!
//! 4. **Validity claims hold** ([`check_validity`]): when a holder confirms that its lease
//!    is certainly valid until some instant (the [`crate::lock::Watchdog`]'s
//!    `valid_until`), no newer holder acquires the resource before that instant (or before
//!    the holder releases: a release the server refused released nothing). This is the
//!    property of the clock and of the watchdog, which fencing cannot show: a wrong claim
//!    is caught even when every write was fenced.
//!
//! 5. **A dead lease stays dead** ([`check_dead_leases`]): once a lease's release was
//!    accepted, or a newer lease of the resource (a higher token) was acquired, no `renew`
//!    or `release` of it that begins afterwards may be accepted — not even by a task of the
//!    same owner id while that owner's newer acquisition has not committed its token yet.
//!
//! Events used: `acquire` (Ok, token), `touch` and `write` (Ok = accepted, Failed =
//! refused; token), `hold` (token; `value` = milliseconds of certain validity left at the
//! instant of the event), `renew` and `release` (Ok = accepted; token).

use std::collections::{BTreeMap, BTreeSet};

use super::{Event, OpOutcome, Violation};

/// Checks properties 1 and 2 on the events of one run.
pub fn check_tokens(events: &[Event]) -> Vec<Violation> {
    let mut violations = Vec::new();
    let mut acquires: BTreeMap<&str, Vec<&Event>> = BTreeMap::new();
    for e in events {
        if e.op == "acquire" && e.outcome == OpOutcome::Ok && e.token.is_some() {
            acquires.entry(&e.key).or_default().push(e);
        }
    }
    for list in acquires.values_mut() {
        list.sort_by_key(|e| e.end_us);
        // Property 1: compare each acquire with every earlier one that ended before it began.
        let mut max_before: Vec<(u64, i64)> = Vec::new(); // (end_us, token), sorted by end
        // Each token granted so far: two grants of one token are in some order whatever
        // their overlap, and the later one's token did not increase.
        let mut granted: BTreeMap<i64, &Event> = BTreeMap::new();
        for e in list.iter() {
            let token = e.token.unwrap_or(i64::MIN);
            if let Some((_, prev)) = max_before
                .iter()
                .filter(|(end, _)| *end < e.start_us)
                .max_by_key(|(_, t)| *t)
                && *prev >= token
            {
                violations.push(Violation::new(
                    "token-not-increasing",
                    e.key.clone(),
                    format!(
                        "process {} acquired with token {token} after token {prev} had been granted",
                        e.process
                    ),
                ));
            } else if let Some(other) = granted.get(&token) {
                violations.push(Violation::new(
                    "token-not-increasing",
                    e.key.clone(),
                    format!(
                        "process {} acquired with token {token}, which process {} was granted too (acquires from {} and {} µs)",
                        e.process, other.process, other.start_us, e.start_us
                    ),
                ));
            }
            granted.entry(token).or_insert(e);
            max_before.push((e.end_us, token));
        }
    }
    // Property 2.
    let accepted: Vec<&Event> = events
        .iter()
        .filter(|e| {
            (e.op == "write" || e.op == "touch") && e.outcome == OpOutcome::Ok && e.token.is_some()
        })
        .collect();
    // The touch is a fenced write too: a stale one accepted is as much a violation.
    for w in &accepted {
        let token = w.token.unwrap_or_default();
        let newer = accepted
            .iter()
            .filter(|o| {
                o.key == w.key && o.end_us < w.start_us && o.token.is_some_and(|t| t > token)
            })
            .min_by_key(|o| o.end_us);
        if let Some(o) = newer {
            violations.push(Violation::new(
                "stale-write-accepted",
                w.key.clone(),
                format!(
                    "process {}'s {} with token {token} was accepted after the storage had accepted token {} from process {}",
                    w.process,
                    w.op,
                    o.token.unwrap_or_default(),
                    o.process
                ),
            ));
        }
    }
    violations
}

/// The history's name of a validity claim: at this instant the holder of lease `token`
/// on `key` held it, by its own account, for `value` more milliseconds at least.
pub const HOLD_OP: &str = "hold";

/// The history's name of a release.
pub const RELEASE_OP: &str = "release";

/// The history's name of a direct renewal (`LockCollection::renew`).
pub const RENEW_OP: &str = "renew";

/// Checks property 5: a [`RENEW_OP`] or [`RELEASE_OP`] of token `t` on a resource that
/// was accepted but began after an accepted release of `t` had ended, or after an acquire
/// of the resource with a higher token had completed, is a `stale-lease-accepted`
/// violation. Sound whatever the timing: a release leaves `owner: null`, and every later
/// acquisition commits a higher token, so no later document matches `t` again.
pub fn check_dead_leases(events: &[Event]) -> Vec<Violation> {
    let accepted = || {
        events
            .iter()
            .filter(|e| e.outcome == OpOutcome::Ok)
            .filter_map(|e| e.token.map(|t| (e, t)))
    };
    // The first accepted release of each (resource, token), by its end.
    let mut released: BTreeMap<(&str, i64), &Event> = BTreeMap::new();
    // Each resource's acquires by end, with the highest token acquired so far.
    let mut acquired: BTreeMap<&str, Vec<(u64, i64, &Event)>> = BTreeMap::new();
    for (e, t) in accepted() {
        if e.op == RELEASE_OP {
            let first = released.entry((e.key.as_str(), t)).or_insert(e);
            if e.end_us < first.end_us {
                *first = e;
            }
        } else if e.op == "acquire" {
            acquired.entry(&e.key).or_default().push((e.end_us, t, e));
        }
    }
    for list in acquired.values_mut() {
        list.sort_by_key(|(end, _, _)| *end);
        let mut best: Option<(i64, &Event)> = None;
        for entry in list.iter_mut() {
            match best {
                Some((t, e)) if t >= entry.1 => {
                    entry.1 = t;
                    entry.2 = e;
                }
                _ => best = Some((entry.1, entry.2)),
            }
        }
    }
    let mut violations = Vec::new();
    for (e, token) in accepted().filter(|(e, _)| e.op == RENEW_OP || e.op == RELEASE_OP) {
        let why = if let Some(r) = released
            .get(&(e.key.as_str(), token))
            .filter(|r| r.end_us < e.start_us)
        {
            format!(
                "process {} released token {token} by {} µs",
                r.process, r.end_us
            )
        } else if let Some((_, newer, a)) = acquired.get(e.key.as_str()).and_then(|list| {
            let before = list.partition_point(|(end, _, _)| *end < e.start_us);
            before.checked_sub(1).map(|i| list[i])
        }) && newer > token
        {
            format!(
                "process {} acquired token {newer} by {} µs",
                a.process, a.end_us
            )
        } else {
            continue;
        };
        violations.push(Violation::new(
            "stale-lease-accepted",
            e.key.clone(),
            format!(
                "process {}'s {} of token {token} from {} µs was accepted, but {why}",
                e.process, e.op, e.start_us
            ),
        ));
    }
    violations
}

/// Checks property 4: every validity claim ([`HOLD_OP`]) of a lease with token `t` ends
/// at the claimed instant or at the holder's release, whichever is first; no acquire of
/// the same resource with a higher token may have completed before that end
/// (`overlapping-leases`).
pub fn check_validity(events: &[Event]) -> Vec<Violation> {
    let mut violations = Vec::new();
    for hold in events.iter().filter(|e| e.op == HOLD_OP) {
        let (Some(token), Some(left_ms)) = (hold.token, hold.value) else {
            continue;
        };
        let claimed = hold
            .start_us
            .saturating_add(u64::try_from(left_ms).unwrap_or(0).saturating_mul(1000));
        // A release by this lease ends the claim, unless it was refused (the lease was no
        // longer its holder's: the claim stands); so may one whose outcome is unknown and
        // whose token was never recorded (its process was killed while it was in flight:
        // it may have landed, and a checker must accept either outcome).
        let released = events
            .iter()
            .filter(|e| {
                e.op == "release"
                    && e.key == hold.key
                    && e.start_us >= hold.start_us
                    && ((e.token == Some(token) && e.outcome != OpOutcome::Failed)
                        || (e.token.is_none()
                            && e.process == hold.process
                            && e.outcome == OpOutcome::Indeterminate))
            })
            .map(|e| e.start_us)
            .min()
            .unwrap_or(u64::MAX);
        let end = claimed.min(released);
        if let Some(newer) = events
            .iter()
            .filter(|e| {
                e.op == "acquire"
                    && e.outcome == OpOutcome::Ok
                    && e.key == hold.key
                    && e.token.is_some_and(|u| u > token)
                    && e.end_us < end
            })
            .min_by_key(|e| e.end_us)
        {
            violations.push(Violation::new(
                "overlapping-leases",
                hold.key.clone(),
                format!(
                    "process {} held token {token} certainly valid from {} µs until {end} µs, but process {} acquired token {} by {} µs",
                    hold.process,
                    hold.start_us,
                    newer.process,
                    newer.token.unwrap_or_default(),
                    newer.end_us
                ),
            ));
        }
    }
    violations
}

/// Property 3 for counters: `acknowledged[key]` increments were acknowledged,
/// `uncertain[key]` more may or may not have landed (timeouts, killed workers), and the
/// final read found `final_values[key]`, which must lie in `acked ..= acked + uncertain`.
pub fn check_counters(
    acknowledged: &BTreeMap<String, i64>,
    uncertain: &BTreeMap<String, i64>,
    final_values: &BTreeMap<String, i64>,
) -> Vec<Violation> {
    let keys: BTreeSet<&String> = acknowledged.keys().chain(final_values.keys()).collect();
    let mut violations = Vec::new();
    for key in keys {
        let acked = acknowledged.get(key).copied().unwrap_or(0);
        let maybe = uncertain.get(key).copied().unwrap_or(0);
        let found = final_values.get(key).copied().unwrap_or(0);
        if found < acked {
            violations.push(Violation::new(
                "lost-update",
                key.clone(),
                format!(
                    "{acked} increments acknowledged, counter reads {found}: {} lost",
                    acked - found
                ),
            ));
        } else if found > acked + maybe {
            violations.push(Violation::new(
                "unacknowledged-update",
                key.clone(),
                format!("counter reads {found} but only {acked} increments were acknowledged ({maybe} uncertain)"),
            ));
        }
    }
    violations
}

/// Property 3 for sets: every acknowledged element is in the final read.
pub fn check_set(acknowledged: &BTreeSet<String>, final_read: &BTreeSet<String>) -> Vec<Violation> {
    acknowledged
        .difference(final_read)
        .map(|e| {
            Violation::new(
                "lost-add",
                e.clone(),
                "acknowledged add missing from the final read",
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acquire(p: u32, key: &str, s: u64, e: u64, token: i64) -> Event {
        Event::new(p, "acquire", key, s, e).token(token)
    }
    #[test]
    fn a_renewal_or_release_of_a_released_or_superseded_lease_is_flagged() {
        let op = |op: &str, s: u64, e: u64, token: i64, ok: bool| {
            Event::new(2, op, "r", s, e).token(token).outcome(if ok {
                OpOutcome::Ok
            } else {
                OpOutcome::Failed
            })
        };
        let base = [
            acquire(1, "r", 0, 10, 5),
            op(RELEASE_OP, 20, 30, 5, true),
            acquire(1, "r", 40, 50, 6),
        ];
        let refused = [
            op(RENEW_OP, 35, 38, 5, false),
            op(RELEASE_OP, 60, 70, 5, false),
        ];
        let ok: Vec<Event> = base.iter().cloned().chain(refused).collect();
        assert!(check_dead_leases(&ok).is_empty());
        // Accepted while the release was in flight: not provably stale.
        let racing = [op(RENEW_OP, 25, 28, 5, true)];
        let ok: Vec<Event> = base.iter().cloned().chain(racing).collect();
        assert!(check_dead_leases(&ok).is_empty());
        for bad in [
            op(RENEW_OP, 35, 38, 5, true),
            op(RELEASE_OP, 60, 70, 5, true),
        ] {
            let events: Vec<Event> = base.iter().cloned().chain([bad]).collect();
            let v = check_dead_leases(&events);
            assert_eq!(v.len(), 1, "{v:?}");
            assert_eq!(v[0].kind, "stale-lease-accepted");
        }
        // Superseded without a release: a newer token acquired before the renewal began.
        let events = vec![
            acquire(1, "r", 0, 10, 5),
            acquire(3, "r", 2000, 2010, 6),
            op(RENEW_OP, 2020, 2030, 5, true),
        ];
        assert_eq!(check_dead_leases(&events).len(), 1);
    }

    fn write(p: u32, key: &str, s: u64, e: u64, token: i64, ok: bool) -> Event {
        Event::new(p, "write", key, s, e)
            .token(token)
            .outcome(if ok { OpOutcome::Ok } else { OpOutcome::Failed })
    }

    #[test]
    fn a_clean_history_has_no_violations() {
        let h = vec![
            acquire(1, "r", 0, 10, 1),
            write(1, "r", 11, 20, 1, true),
            acquire(2, "r", 30, 40, 2),
            write(2, "r", 45, 48, 2, true),
            // The paused holder writes late and is refused: fine.
            write(1, "r", 50, 60, 1, false),
            // A concurrent acquire (overlapping in time) may carry any token.
            acquire(3, "s", 0, 100, 5),
            acquire(4, "s", 50, 60, 4),
        ];
        assert!(check_tokens(&h).is_empty());
    }

    #[test]
    fn planted_token_regression_is_found() {
        let h = vec![acquire(1, "r", 0, 10, 5), acquire(2, "r", 20, 30, 5)];
        let v = check_tokens(&h);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].kind, "token-not-increasing");
    }

    #[test]
    fn planted_stale_write_is_found() {
        let h = vec![
            acquire(1, "r", 0, 10, 1),
            acquire(2, "r", 30, 40, 2),
            write(2, "r", 41, 45, 2, true),
            write(1, "r", 50, 60, 1, true),
        ];
        let v = check_tokens(&h);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].kind, "stale-write-accepted");
        // Before the newer token reached the storage, the old holder's write is not stale.
        let h = vec![
            acquire(1, "r", 0, 10, 1),
            acquire(2, "r", 30, 40, 2),
            write(1, "r", 42, 48, 1, true),
            write(2, "r", 50, 60, 2, true),
        ];
        assert!(check_tokens(&h).is_empty());
        // A write concurrent with the newer one is not ordered after it: allowed.
        let h = vec![
            write(2, "r", 30, 40, 2, true),
            write(1, "r", 35, 60, 1, true),
        ];
        assert!(check_tokens(&h).is_empty());
    }

    #[test]
    fn counters_and_sets() {
        let acked: BTreeMap<String, i64> = [("a".to_owned(), 3), ("b".to_owned(), 2)].into();
        let ok: BTreeMap<String, i64> = [("a".to_owned(), 3), ("b".to_owned(), 2)].into();
        let none = BTreeMap::new();
        assert!(check_counters(&acked, &none, &ok).is_empty());
        let lost: BTreeMap<String, i64> = [("a".to_owned(), 2), ("b".to_owned(), 2)].into();
        let v = check_counters(&acked, &none, &lost);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].kind, "lost-update");
        // One more than acknowledged is fine only if one increment was uncertain.
        let more: BTreeMap<String, i64> = [("a".to_owned(), 4), ("b".to_owned(), 2)].into();
        assert_eq!(
            check_counters(&acked, &none, &more)[0].kind,
            "unacknowledged-update"
        );
        let maybe: BTreeMap<String, i64> = [("a".to_owned(), 1)].into();
        assert!(check_counters(&acked, &maybe, &more).is_empty());

        let acked: BTreeSet<String> = ["x", "y"].iter().map(|s| s.to_string()).collect();
        let read: BTreeSet<String> = ["x"].iter().map(|s| s.to_string()).collect();
        assert!(check_set(&acked, &acked).is_empty());
        assert_eq!(check_set(&acked, &read).len(), 1);
    }

    #[test]
    fn planted_overlapping_claim_is_found() {
        let hold = |p: u32, at: u64, token: i64, left_ms: i64| {
            Event::new(p, HOLD_OP, "r", at, at)
                .token(token)
                .value(left_ms)
        };
        let release =
            |p: u32, at: u64, token: i64| Event::new(p, "release", "r", at, at + 5).token(token);
        // A claims 1 ms from 100 µs; B acquires after 1,100 µs: fine. A releases at 300 µs,
        // C acquires by 400 µs although A had claimed 5 ms: fine, A released first.
        let h = vec![
            acquire(1, "r", 0, 50, 1),
            hold(1, 100, 1, 1),
            acquire(2, "r", 1_000, 1_200, 2),
            hold(2, 1_300, 2, 5),
            release(2, 1_400, 2),
            acquire(3, "r", 1_410, 1_500, 3),
        ];
        assert!(check_validity(&h).is_empty());
        // A claims 5 ms from 100 µs; B's acquire completed at 1,200 µs with A unreleased.
        let h = vec![
            acquire(1, "r", 0, 50, 1),
            hold(1, 100, 1, 5),
            acquire(2, "r", 1_000, 1_200, 2),
        ];
        let v = check_validity(&h);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].kind, "overlapping-leases");
    }

    /// A release the server refused (`LeaseLost`: the lease had already been taken over)
    /// released nothing, so it does not end the holder's claim: a newer holder that
    /// acquired before the claimed instant overlapped it.
    #[test]
    fn a_refused_release_does_not_end_a_validity_claim() {
        let h = vec![
            acquire(1, "r", 0, 50, 1),
            Event::new(1, HOLD_OP, "r", 100, 100).token(1).value(5),
            Event::new(1, RELEASE_OP, "r", 300, 400)
                .token(1)
                .outcome(OpOutcome::Failed),
            acquire(2, "r", 250, 1_200, 2),
        ];
        let v = check_validity(&h);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].kind, "overlapping-leases");
    }

    /// A fenced touch with an older token accepted after the storage had accepted a newer
    /// token is a stale write, as much as the counter's write.
    #[test]
    fn a_stale_touch_accepted_is_found() {
        let touch =
            |p: u32, s: u64, e: u64, token: i64| Event::new(p, "touch", "r", s, e).token(token);
        let h = vec![
            acquire(1, "r", 0, 10, 1),
            acquire(2, "r", 30, 40, 2),
            touch(2, 41, 45, 2),
            touch(1, 50, 60, 1),
        ];
        let v = check_tokens(&h);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].kind, "stale-write-accepted");
    }

    /// Two acquires of one resource that overlap in time were still granted in some
    /// order: the same token granted twice did not increase, whatever the overlap.
    #[test]
    fn one_token_granted_to_two_overlapping_acquires_is_found() {
        let h = vec![acquire(1, "r", 0, 100, 5), acquire(2, "r", 50, 150, 5)];
        let v = check_tokens(&h);
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].kind, "token-not-increasing");
        // Different tokens of overlapping acquires: either order is possible.
        let h = vec![acquire(1, "r", 0, 100, 6), acquire(2, "r", 50, 150, 5)];
        assert!(check_tokens(&h).is_empty());
    }

    #[test]
    fn a_release_cut_short_by_a_kill_may_have_ended_the_claim() {
        // A claims 5 ms from 100 µs, starts its release at 300 µs and is killed before the
        // reply: the release is recorded without its token, indeterminate. It landed, and
        // B acquired by 500 µs — no violation. Another process's unknown release does not
        // end A's claim.
        let hold = Event::new(1, HOLD_OP, "r", 100, 100).token(1).value(5);
        let killed_release =
            |p: u32| Event::new(p, "release", "r", 300, 400).outcome(OpOutcome::Indeterminate);
        let h = vec![
            acquire(1, "r", 0, 50, 1),
            hold.clone(),
            killed_release(1),
            acquire(2, "r", 410, 500, 2),
        ];
        assert!(check_validity(&h).is_empty(), "{:?}", check_validity(&h));
        let h = vec![
            acquire(1, "r", 0, 50, 1),
            hold,
            killed_release(3),
            acquire(2, "r", 410, 500, 2),
        ];
        assert_eq!(check_validity(&h).len(), 1);
    }
}
