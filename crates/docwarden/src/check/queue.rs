//! The queue checkers: every enqueued job's effect exactly once, none lost, none stuck
//! ([`check_jobs`], for workloads whose effect is the completion itself), and the checker
//! of the real worker runtime ([`check_runtime`]), whose handler writes an effect record
//! fenced by its claim before the worker completes the job.
//!
//! Input is what a final read found for each enqueued job (its state, the effect records
//! in the order the database applied them, the claim that completed it) and, for
//! [`check_runtime`], the history: when each claim's handler began ([`HANDLE_OP`]) and
//! each effect write ([`EFFECT_OP`]), so that a write made under a lease that was already
//! taken over is seen even when it happened to land before the newer claim's own effect.
//!
//! **Limits:** a job run more than once (its lease lost after the effect, before the
//! completion) legitimately carries several effects: the queue is at-least-once, so only
//! their order, their claims and the finished state are judged, not their number. Claims
//! are ordered by the start of their handlers on the run's monotonic clock; a claim whose
//! handler never started (a worker killed between claim and handler) is not seen.
use std::collections::BTreeMap;

use super::{Event, OpOutcome, Violation};
use crate::format::job::JobState;

/// What the final read found about one job.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobObservation {
    /// Committed effects of this job.
    pub effects: u64,
    /// The job's final state as stored (`succeeded`, `dead`, `running`…), or `None` if the
    /// job document is gone.
    pub state: Option<String>,
}

/// Checks every enqueued job, as its doc promises:
/// - a job that is `dead` (it exhausted its attempts on purpose) or `cancelled` must have
///   no effect (`state-mismatch`);
/// - every other job must have exactly one effect (`lost-job` for none,
///   `duplicate-effect` for more) and be `succeeded` (`stuck-job` while `running`,
///   `state-mismatch` for an effect whose job is `ready`, `retrying` or gone).
pub fn check_jobs(jobs: &BTreeMap<String, JobObservation>) -> Vec<Violation> {
    let mut violations = Vec::new();
    for (id, job) in jobs {
        let state = job.state.as_deref().unwrap_or("missing");
        if job.effects > 1 {
            violations.push(Violation::new(
                "duplicate-effect",
                id.clone(),
                format!("effect committed {} times", job.effects),
            ));
        }
        match JobState::parse(state) {
            Some(JobState::Running) => violations.push(Violation::new(
                "stuck-job",
                id.clone(),
                "still running after the run drained",
            )),
            Some(JobState::Dead | JobState::Cancelled) if job.effects > 0 => {
                violations.push(Violation::new(
                    "state-mismatch",
                    id.clone(),
                    format!(
                        "{state} but its effect was committed {} time(s)",
                        job.effects
                    ),
                ));
            }
            Some(JobState::Dead | JobState::Cancelled) => {}
            Some(JobState::Succeeded) if job.effects == 0 => violations.push(Violation::new(
                "lost-job",
                id.clone(),
                "marked succeeded but no effect was committed",
            )),
            Some(JobState::Succeeded) => {}
            _ if job.effects == 0 => violations.push(Violation::new(
                "lost-job",
                id.clone(),
                format!("never completed (state {state})"),
            )),
            _ => violations.push(Violation::new(
                "state-mismatch",
                id.clone(),
                format!("its effect was committed but the job is {state}, not succeeded"),
            )),
        }
    }
    violations
}

/// The history's name of a handler starting on a claimed job: `key` is the job id (hex),
/// `detail` the claim's token, `token` the claim's attempt number.
pub const HANDLE_OP: &str = "handle";
/// The kind of a violation [`check_runtime`] attributes to the server: a claim's effect
/// applied more times than its handler sent it, so the server executed a retry of the
/// driver (same `lsid` and `txnNumber`) more than once, which MongoDB's retryable writes
/// forbid. Seen on `secantusd-rs` when the retry races the first attempt (a connection
/// reset) or follows a crash (`docs/surrogate.md`).
pub const RETRY_EXECUTED_TWICE: &str = "retry-executed-twice";

/// The history's name of a handler's effect write: `key` is the job id, `detail` starts
/// with the claim's token, `token` is the attempt. Ok: applied; Failed: refused (fenced
/// off); Indeterminate: unknown (the final read decides).
pub const EFFECT_OP: &str = "effect";
/// The history's name of an enqueue: `value` is the number of jobs it enqueued (Ok: all of
/// them were inserted).
pub const ENQUEUE_OP: &str = "enqueue";
/// The history's name of a worker's final counts at its graceful shutdown: `value` is
/// the number of completions the worker believes it wrote.
pub const REPORT_OP: &str = "worker-report";

/// One effect record stored on a job: the claim that wrote it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EffectRecord {
    /// The claim's token.
    pub token: String,
    /// The claim's attempt number (informative: a released claim gives its attempt back).
    pub attempt: i64,
}

/// What the final read found about one job run by the worker runtime.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobRecord {
    /// The job's final state as stored, or `None` if the job document is gone.
    pub state: Option<String>,
    /// The effect records, in the order the database applied them.
    pub effects: Vec<EffectRecord>,
    /// The token of the claim whose completion is stored (`succeeded` jobs).
    pub completed_by: Option<String>,
}

/// The claim token an [`EFFECT_OP`] or [`HANDLE_OP`] event carries (first word of its
/// detail).
fn event_token(e: &Event) -> &str {
    e.detail.split_whitespace().next().unwrap_or("")
}

/// Checks the jobs of a run of the worker runtime:
/// - **finished once**: after the drain every job is finished; a `succeeded` job carries
///   the effect of the claim that completed it, and that effect is its last one (an
///   effect applied after it is `effect-after-finish`); a `dead` or `cancelled` job has no
///   effect (`state-mismatch`); an unfinished job is `lost-job` (`stuck-job` if running);
/// - **fenced order**: the effects of a job were applied in the order of its claims,
///   each claim's at most once (`stale-effect`, `duplicate-effect`); and no effect that
///   landed was written after a newer claim had taken the job (`stale-effect`: a write
///   under a lost lease), which the final read alone cannot see when the stale write
///   happened to land first;
/// - **nothing vanished**: a job whose handler ran ([`HANDLE_OP`]) but whose document
///   the final read does not find is `lost-job`, and so are jobs missing from a final read
///   that holds fewer jobs than the acknowledged enqueues ([`ENQUEUE_OP`]) inserted;
/// - **no phantom completion**: the completions the workers reported ([`REPORT_OP`]) are
///   at most the `succeeded` jobs (`phantom-completion`: a worker took a completion that
///   did not land for its own).
///
/// An indeterminate effect (its reply lost) counts exactly when the final read shows it.
pub fn check_runtime(jobs: &BTreeMap<String, JobRecord>, events: &[Event]) -> Vec<Violation> {
    // Claims per job, ordered by the start of their handlers.
    let mut claims: BTreeMap<&str, Vec<(&str, u64)>> = BTreeMap::new();
    for e in events.iter().filter(|e| e.op == HANDLE_OP) {
        claims
            .entry(e.key.as_str())
            .or_default()
            .push((event_token(e), e.start_us));
    }
    for list in claims.values_mut() {
        list.sort_by_key(|(_, at)| *at);
    }
    let mut effect_starts: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for e in events
        .iter()
        .filter(|e| e.op == EFFECT_OP && e.outcome != OpOutcome::Failed)
    {
        let at = effect_starts
            .entry((e.key.as_str(), event_token(e)))
            .or_insert(e.start_us);
        *at = (*at).max(e.start_us);
    }
    // How many times each claim's handler sent its effect (a control's blind re-send is a
    // second send), whatever came of it.
    let mut sends: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for e in events.iter().filter(|e| e.op == EFFECT_OP) {
        *sends.entry((e.key.as_str(), event_token(e))).or_default() += 1;
    }
    let mut violations = Vec::new();
    let mut succeeded = 0_u64;
    for (id, job) in jobs {
        let order = claims.get(id.as_str());
        let index = |token: &str| order.and_then(|c| c.iter().position(|(t, _)| *t == token));
        let mut seen: Vec<&str> = Vec::new();
        let mut last: Option<(usize, &str)> = None;
        for effect in &job.effects {
            let token = effect.token.as_str();
            if seen.contains(&token) {
                // The k-th application of this claim's effect (k ≥ 2): the handler's own
                // sends explain the first `sent`; beyond them only the driver can have sent
                // it again — its retry after a lost reply, which the server must execute at
                // most once (MongoDB's retryable writes).
                let k = seen.iter().filter(|t| **t == token).count() + 1;
                let sent = sends.get(&(id.as_str(), token)).copied().unwrap_or(0);
                violations.push(if sent > 0 && k > sent {
                    Violation::new(
                        RETRY_EXECUTED_TWICE,
                        id.clone(),
                        format!(
                            "the effect of claim {token} was applied {k} times but its handler sent it {sent} time(s): the server executed the driver's retry of it again (its retryable-write deduplication failed: a server fault, not docwarden's; see docs/surrogate.md)"
                        ),
                    )
                } else {
                    Violation::new(
                        "duplicate-effect",
                        id.clone(),
                        format!("the effect of claim {token} was applied twice"),
                    )
                });
                seen.push(token);
                continue;
            }
            seen.push(token);
            let Some(i) = index(token) else { continue };
            if let Some((j, before)) = last
                && j > i
            {
                violations.push(Violation::new(
                    "stale-effect",
                    id.clone(),
                    format!(
                        "the effect of claim {token} (attempt {}) was applied after the effect of the later claim {before}",
                        effect.attempt
                    ),
                ));
            }
            last = Some((i, token));
            // A write that began after a newer claim took the job was made under a lost
            // lease: it must have been refused.
            if let (Some(list), Some(began)) = (order, effect_starts.get(&(id.as_str(), token)))
                && let Some((newer, taken)) = list[i + 1..].iter().find(|(_, at)| at < began)
            {
                violations.push(Violation::new(
                    "stale-effect",
                    id.clone(),
                    format!(
                        "claim {token} wrote its effect at {began} µs, after claim {newer} had taken the job at {taken} µs (a write under a lost lease)"
                    ),
                ));
            }
        }
        let state = job.state.as_deref().unwrap_or("missing");
        match JobState::parse(state) {
            Some(JobState::Running) => violations.push(Violation::new(
                "stuck-job",
                id.clone(),
                "still running after the run drained",
            )),
            Some(JobState::Dead | JobState::Cancelled) if !job.effects.is_empty() => {
                violations.push(Violation::new(
                    "state-mismatch",
                    id.clone(),
                    format!("{state} but {} effect(s) were applied", job.effects.len()),
                ));
            }
            Some(JobState::Dead | JobState::Cancelled) => {}
            Some(JobState::Succeeded) => {
                succeeded += 1;
                let by = job.completed_by.as_deref().unwrap_or("");
                match job.effects.last() {
                    None => violations.push(Violation::new(
                        "lost-job",
                        id.clone(),
                        "marked succeeded but no effect was applied",
                    )),
                    Some(_) if !job.effects.iter().any(|e| e.token == by) => {
                        violations.push(Violation::new(
                            "state-mismatch",
                            id.clone(),
                            format!("completed by claim {by}, which applied no effect"),
                        ));
                    }
                    Some(last) if last.token != by => violations.push(Violation::new(
                        "effect-after-finish",
                        id.clone(),
                        format!(
                            "completed by claim {by}, but claim {} applied an effect after it",
                            last.token
                        ),
                    )),
                    Some(_) => {}
                }
            }
            _ if job.effects.is_empty() => violations.push(Violation::new(
                "lost-job",
                id.clone(),
                format!("never finished (state {state})"),
            )),
            _ => violations.push(Violation::new(
                "state-mismatch",
                id.clone(),
                format!("its effect was applied but the job is {state}, not succeeded"),
            )),
        }
    }
    // A job a handler ran is a job that was enqueued: its document gone from the final
    // read is a job lost, not one to leave unjudged.
    for (id, list) in &claims {
        if !jobs.contains_key(*id) {
            violations.push(Violation::new(
                "lost-job",
                *id,
                format!(
                    "claimed {} time(s) (first claim {}), but its document is missing from the final read",
                    list.len(),
                    list.first().map_or("", |(t, _)| *t)
                ),
            ));
        }
    }
    let enqueued: u64 = events
        .iter()
        .filter(|e| e.op == ENQUEUE_OP && e.outcome == OpOutcome::Ok)
        .filter_map(|e| e.value)
        .map(|v| u64::try_from(v).unwrap_or(0))
        .sum();
    let found = u64::try_from(jobs.len()).unwrap_or(u64::MAX);
    if found < enqueued {
        violations.push(Violation::new(
            "lost-job",
            "queue",
            format!("acknowledged enqueues inserted {enqueued} jobs, the final read found {found}"),
        ));
    }
    let reported: u64 = events
        .iter()
        .filter(|e| e.op == REPORT_OP)
        .filter_map(|e| e.value)
        .map(|v| u64::try_from(v).unwrap_or(0))
        .sum();
    if reported > succeeded {
        violations.push(Violation::new(
            "phantom-completion",
            "workers",
            format!(
                "the workers reported {reported} completions, the database holds {succeeded} succeeded jobs"
            ),
        ));
    }
    violations
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(effects: u64, state: JobState) -> JobObservation {
        JobObservation {
            effects,
            state: Some(state.as_str().to_owned()),
        }
    }

    #[test]
    fn exactly_once_passes_and_planted_faults_are_found() {
        let mut jobs: BTreeMap<String, JobObservation> = (0..5)
            .map(|i| (format!("j{i}"), obs(1, JobState::Succeeded)))
            .collect();
        jobs.insert("dead-job".into(), obs(0, JobState::Dead));
        assert!(check_jobs(&jobs).is_empty());

        jobs.insert("dup".into(), obs(2, JobState::Succeeded));
        jobs.insert("lost".into(), obs(0, JobState::Ready));
        jobs.insert("stuck".into(), obs(0, JobState::Running));
        jobs.insert("gone".into(), JobObservation::default());
        let kinds: Vec<&str> = check_jobs(&jobs).iter().map(|v| v.kind).collect();
        assert_eq!(
            kinds,
            vec!["duplicate-effect", "lost-job", "lost-job", "stuck-job"]
        );
    }

    /// Finding 14: a dead job with an effect and a retrying job with an effect were both
    /// reported clean.
    #[test]
    fn a_dead_job_with_an_effect_and_an_unfinished_job_with_one_are_violations() {
        for (state, effects, kind) in [
            (JobState::Dead, 1, "state-mismatch"),
            (JobState::Cancelled, 1, "state-mismatch"),
            (JobState::Retrying, 1, "state-mismatch"),
            (JobState::Ready, 1, "state-mismatch"),
        ] {
            let jobs = BTreeMap::from([("j".to_owned(), obs(effects, state))]);
            let found = check_jobs(&jobs);
            assert_eq!(
                found.iter().map(|v| v.kind).collect::<Vec<_>>(),
                vec![kind],
                "a {state} job with {effects} effect(s) was reported as {found:?}"
            );
        }
        let gone = BTreeMap::from([(
            "gone".to_owned(),
            JobObservation {
                effects: 1,
                state: None,
            },
        )]);
        assert_eq!(
            check_jobs(&gone).iter().map(|v| v.kind).collect::<Vec<_>>(),
            vec!["state-mismatch"]
        );
    }

    fn handle(p: u32, job: &str, token: &str, at: u64) -> Event {
        Event::new(p, HANDLE_OP, job, at, at).detail(token)
    }
    fn effect(p: u32, job: &str, token: &str, s: u64, e: u64, outcome: OpOutcome) -> Event {
        Event::new(p, EFFECT_OP, job, s, e)
            .detail(token)
            .outcome(outcome)
    }
    fn record(state: JobState, effects: &[&str], by: Option<&str>) -> JobRecord {
        JobRecord {
            state: Some(state.as_str().to_owned()),
            effects: effects
                .iter()
                .zip(1..)
                .map(|(t, attempt)| EffectRecord {
                    token: (*t).to_owned(),
                    attempt,
                })
                .collect(),
            completed_by: by.map(str::to_owned),
        }
    }
    fn kinds(v: &[Violation]) -> Vec<&'static str> {
        v.iter().map(|v| v.kind).collect()
    }

    #[test]
    fn runtime_clean_runs_pass_including_re_executions_and_lost_replies() {
        let jobs = BTreeMap::from([
            (
                "a".to_owned(),
                record(JobState::Succeeded, &["t1"], Some("t1")),
            ),
            // Lease lost after the effect, run again: at-least-once, in claim order.
            (
                "b".to_owned(),
                record(JobState::Succeeded, &["t2", "t3"], Some("t3")),
            ),
            // The effect's reply was lost but it landed: the final read decides.
            (
                "c".to_owned(),
                record(JobState::Succeeded, &["t4"], Some("t4")),
            ),
            ("d".to_owned(), record(JobState::Dead, &[], None)),
        ]);
        let events = vec![
            handle(1, "a", "t1", 10),
            effect(1, "a", "t1", 11, 12, OpOutcome::Ok),
            handle(1, "b", "t2", 10),
            effect(1, "b", "t2", 11, 12, OpOutcome::Ok),
            handle(2, "b", "t3", 50),
            effect(2, "b", "t3", 51, 52, OpOutcome::Ok),
            // The paused first holder's late write was fenced off.
            effect(1, "b", "t2", 60, 61, OpOutcome::Failed),
            handle(1, "c", "t4", 10),
            effect(1, "c", "t4", 11, 90, OpOutcome::Indeterminate),
            Event::new(1, REPORT_OP, "-", 100, 100).value(3),
        ];
        assert_eq!(kinds(&check_runtime(&jobs, &events)), Vec::<&str>::new());
    }

    #[test]
    fn runtime_planted_violations_are_found() {
        // A stale write that landed after the newer claim's effect.
        let jobs = BTreeMap::from([(
            "b".to_owned(),
            record(JobState::Succeeded, &["t3", "t2"], Some("t3")),
        )]);
        let events = vec![
            handle(1, "b", "t2", 10),
            handle(2, "b", "t3", 50),
            effect(2, "b", "t3", 51, 52, OpOutcome::Ok),
            effect(1, "b", "t2", 60, 61, OpOutcome::Ok),
        ];
        assert_eq!(
            kinds(&check_runtime(&jobs, &events)),
            vec!["stale-effect", "stale-effect", "effect-after-finish"]
        );
        // A stale write that landed before the newer claim's effect: only the history
        // shows that it began after the newer claim.
        let jobs = BTreeMap::from([(
            "b".to_owned(),
            record(JobState::Succeeded, &["t2", "t3"], Some("t3")),
        )]);
        let events = vec![
            handle(1, "b", "t2", 10),
            handle(2, "b", "t3", 50),
            effect(1, "b", "t2", 55, 56, OpOutcome::Ok),
            effect(2, "b", "t3", 57, 58, OpOutcome::Ok),
        ];
        assert_eq!(kinds(&check_runtime(&jobs, &events)), vec!["stale-effect"]);
        // Dead with an effect, unfinished, completed without its effect, twice applied,
        // and more completions reported than the database holds.
        let jobs = BTreeMap::from([
            ("d".to_owned(), record(JobState::Dead, &["t1"], None)),
            ("r".to_owned(), record(JobState::Retrying, &[], None)),
            ("s".to_owned(), record(JobState::Running, &[], None)),
            (
                "w".to_owned(),
                record(JobState::Succeeded, &["t5"], Some("t6")),
            ),
            (
                "x".to_owned(),
                record(JobState::Succeeded, &["t7", "t7"], Some("t7")),
            ),
        ]);
        let events = vec![Event::new(1, REPORT_OP, "-", 1, 1).value(5)];
        assert_eq!(
            kinds(&check_runtime(&jobs, &events)),
            vec![
                "state-mismatch",
                "lost-job",
                "stuck-job",
                "state-mismatch",
                "duplicate-effect",
                "phantom-completion"
            ]
        );
    }

    /// The final read judges the jobs it finds; a job the history shows claimed and run,
    /// whose document is gone, was lost too.
    #[test]
    fn a_handled_job_missing_from_the_final_read_is_lost() {
        let jobs = BTreeMap::from([(
            "a".to_owned(),
            record(JobState::Succeeded, &["t1"], Some("t1")),
        )]);
        let events = vec![
            handle(1, "a", "t1", 10),
            effect(1, "a", "t1", 11, 12, OpOutcome::Ok),
            handle(2, "b", "t2", 20),
            effect(2, "b", "t2", 21, 22, OpOutcome::Ok),
        ];
        let found = check_runtime(&jobs, &events);
        assert_eq!(kinds(&found), vec!["lost-job"], "{found:?}");
        assert_eq!(found[0].key, "b");
    }

    /// A job never claimed whose document is gone is seen only by the count: the final
    /// read holds fewer jobs than the acknowledged enqueues inserted. An enqueue whose
    /// reply was lost may have inserted nothing.
    #[test]
    fn fewer_jobs_than_acknowledged_enqueues_inserted_are_lost() {
        let jobs = BTreeMap::from([(
            "a".to_owned(),
            record(JobState::Succeeded, &["t1"], Some("t1")),
        )]);
        let enqueue = |n: i64, outcome| {
            Event::new(0, ENQUEUE_OP, "batch", 0, 1)
                .value(n)
                .outcome(outcome)
        };
        assert!(check_runtime(&jobs, &[enqueue(1, OpOutcome::Ok)]).is_empty());
        let found = check_runtime(
            &jobs,
            &[
                enqueue(1, OpOutcome::Ok),
                enqueue(1, OpOutcome::Ok),
                enqueue(5, OpOutcome::Indeterminate),
            ],
        );
        assert_eq!(kinds(&found), vec!["lost-job"], "{found:?}");
        assert_eq!(found[0].key, "queue");
    }

    /// Issue 13: a safe queue run under `reset` or `crash` now and then found one effect
    /// applied twice by a claim whose handler sent it once, reported as `duplicate-effect`
    /// as if docwarden or the handler had re-sent it. Only the driver's retry can have, and
    /// the server executed it again: it is named as that.
    #[test]
    fn an_effect_applied_more_often_than_it_was_sent_is_the_servers_retry() {
        let jobs = BTreeMap::from([(
            "j".to_owned(),
            record(JobState::Succeeded, &["t1", "t1"], Some("t1")),
        )]);
        // Safe: one send, its reply lost and retried by the driver under the hood.
        let once = vec![
            handle(1, "j", "t1", 10),
            effect(1, "j", "t1", 11, 40, OpOutcome::Ok),
        ];
        let found = check_runtime(&jobs, &once);
        assert_eq!(kinds(&found), vec![RETRY_EXECUTED_TWICE], "{found:?}");
        assert!(found[0].detail.contains("sent it 1 time"), "{found:?}");
        // Control: the handler re-sent it blindly itself — the workload's duplicate.
        let twice = vec![
            handle(1, "j", "t1", 10),
            effect(1, "j", "t1", 11, 40, OpOutcome::Indeterminate),
            effect(1, "j", "t1", 41, 45, OpOutcome::Ok),
        ];
        assert_eq!(
            kinds(&check_runtime(&jobs, &twice)),
            vec!["duplicate-effect"]
        );
    }
}
