//! The queue checker: every enqueued job's effect exactly once, none lost, none stuck.
//!
//! Input is what a final read found: for each enqueued job, how many times its effect was
//! committed (the workload's handler writes one effect document per execution, fenced by
//! the claim) and the job's final state.

use std::collections::BTreeMap;

use super::Violation;
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
}
