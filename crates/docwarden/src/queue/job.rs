//! The job document: its fields, its states, and typed parsing of what is stored.
//!
//! Parsing never panics: a document that a person or another program edited into the
//! wrong shape comes back as [`Error::Malformed`] with a reason, which the claim path
//! stores as the job's `last_error` when it moves the job to [`JobState::Dead`].

use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};

use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::token::JobToken;

pub use crate::format::job::JobState;
pub(crate) use crate::format::job::field;

/// The states a job can be claimed from once due, as stored strings.
pub(crate) fn claimable_states() -> Bson {
    Bson::Array(vec![
        Bson::String(JobState::Ready.as_str().into()),
        Bson::String(JobState::Retrying.as_str().into()),
    ])
}

/// The unfinished states (ready, retrying, running), as stored strings.
pub(crate) fn unfinished_states() -> Bson {
    Bson::Array(vec![
        Bson::String(JobState::Ready.as_str().into()),
        Bson::String(JobState::Retrying.as_str().into()),
        Bson::String(JobState::Running.as_str().into()),
    ])
}

/// The finished states (succeeded, dead, cancelled), as stored strings.
pub(crate) fn finished_states() -> Bson {
    Bson::Array(
        [JobState::Succeeded, JobState::Dead, JobState::Cancelled]
            .iter()
            .map(|s| Bson::String(s.as_str().into()))
            .collect(),
    )
}

/// A claim on a job: who holds it, the fencing token, and when it expires (server time).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct JobLease {
    /// The worker that holds (or last held) the job.
    pub owner: String,
    /// 128-bit random token, 32 hex digits; every transition matches it.
    pub token: JobToken,
    /// Expiry by the server's clock.
    pub until: DateTime,
}

/// A job as stored.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Job {
    /// The job's id.
    pub id: ObjectId,
    /// Its state.
    pub state: JobState,
    /// What the handler receives (any BSON value).
    pub payload: Bson,
    /// Higher runs first.
    pub priority: i64,
    /// Not claimed before this server time.
    pub run_at: DateTime,
    /// Claims so far (incremented by every claim).
    pub attempts: i64,
    /// After this many failed attempts the job is dead.
    pub max_attempts: i64,
    /// The current (or last) lease.
    pub lease: Option<JobLease>,
    /// The last failure's reason.
    pub last_error: Option<String>,
    /// What a successful handler returned.
    pub result: Option<Bson>,
    /// The dedupe key, if any.
    pub dedupe_key: Option<String>,
    /// When it was enqueued (server time estimate).
    pub created_at: DateTime,
    /// Last state change (server time estimate).
    pub updated_at: DateTime,
    /// When it reached a finished state.
    pub finished_at: Option<DateTime>,
    /// Times a handler snoozed it (the attempt given back each time).
    pub snoozes: i64,
    /// Times its lease expired and the sweep took it over.
    pub stalls: i64,
    /// Stalls after which the sweep moves it to `dead` (`None`: no limit).
    pub max_stalls: Option<i64>,
    /// What its handler last reported with [`JobQueue::progress`](super::JobQueue::progress).
    pub progress: Option<Bson>,
    /// The payload of a follow-up run requested while it was running.
    pub follow_up: Option<Bson>,
    /// Follow-up runs it has started.
    pub follow_ups: i64,
}

fn malformed(id: &Bson, reason: impl Into<String>) -> Error {
    Error::Malformed {
        id: render_id(id),
        reason: reason.into(),
    }
}

/// A document id rendered for messages.
pub(crate) fn render_id(id: &Bson) -> String {
    match id {
        Bson::ObjectId(oid) => oid.to_hex(),
        Bson::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A stored value's BSON type as named in [`Error::Malformed`] reasons (`string`,
/// `double`, `null` …).
pub(crate) fn type_name(b: &Bson) -> String {
    format!("{:?}", b.element_type()).to_lowercase()
}

fn get_int(d: &Document, id: &Bson, key: &str) -> Result<i64> {
    match d.get(key) {
        Some(Bson::Int64(v)) => Ok(*v),
        Some(Bson::Int32(v)) => Ok(i64::from(*v)),
        Some(other) => Err(malformed(
            id,
            format!("`{key}` must be an integer, found {}", type_name(other)),
        )),
        None => Err(malformed(id, format!("`{key}` is missing"))),
    }
}

fn get_opt_int(d: &Document, id: &Bson, key: &str) -> Result<Option<i64>> {
    match d.get(key) {
        None | Some(Bson::Null) => Ok(None),
        Some(_) => get_int(d, id, key).map(Some),
    }
}

fn get_date(d: &Document, id: &Bson, key: &str) -> Result<DateTime> {
    match d.get(key) {
        Some(Bson::DateTime(v)) => Ok(*v),
        Some(other) => Err(malformed(
            id,
            format!("`{key}` must be a date, found {}", type_name(other)),
        )),
        None => Err(malformed(id, format!("`{key}` is missing"))),
    }
}

fn get_opt_date(d: &Document, id: &Bson, key: &str) -> Result<Option<DateTime>> {
    match d.get(key) {
        None | Some(Bson::Null) => Ok(None),
        Some(_) => get_date(d, id, key).map(Some),
    }
}

fn get_opt_string(d: &Document, id: &Bson, key: &str) -> Result<Option<String>> {
    match d.get(key) {
        None | Some(Bson::Null) => Ok(None),
        Some(Bson::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(malformed(
            id,
            format!("`{key}` must be a string, found {}", type_name(other)),
        )),
    }
}

impl Job {
    /// Parses a stored job document.
    ///
    /// # Errors
    /// [`Error::Malformed`] naming the first field that is missing or has the wrong type.
    pub fn from_document(d: &Document) -> Result<Job> {
        let raw_id = d.get(field::ID).cloned().unwrap_or(Bson::Null);
        let id = match &raw_id {
            Bson::ObjectId(oid) => *oid,
            other => {
                return Err(malformed(
                    other,
                    format!("`_id` must be an ObjectId, found {}", type_name(other)),
                ));
            }
        };
        let state = match d.get(field::STATE) {
            Some(Bson::String(s)) => JobState::parse(s)
                .ok_or_else(|| malformed(&raw_id, format!("unknown state `{s}`")))?,
            Some(other) => {
                return Err(malformed(
                    &raw_id,
                    format!("`state` must be a string, found {}", type_name(other)),
                ));
            }
            None => return Err(malformed(&raw_id, "`state` is missing")),
        };
        let payload = d
            .get(field::PAYLOAD)
            .cloned()
            .ok_or_else(|| malformed(&raw_id, "`payload` is missing"))?;
        let priority = get_int(d, &raw_id, field::PRIORITY)?;
        let run_at = get_date(d, &raw_id, field::RUN_AT)?;
        let attempts = get_int(d, &raw_id, field::ATTEMPTS)?;
        let max_attempts = get_int(d, &raw_id, field::MAX_ATTEMPTS)?;
        if max_attempts < 1 {
            return Err(malformed(
                &raw_id,
                format!("`max_attempts` must be at least 1, found {max_attempts}"),
            ));
        }
        if attempts < 0 {
            return Err(malformed(&raw_id, "`attempts` must not be negative"));
        }
        if attempts == i64::MAX {
            // No claim can count it up (the server refuses the `$inc`): parsed as valid, it
            // would fail every claim of the queue it heads.
            return Err(malformed(
                &raw_id,
                "`attempts` is the largest int64 and cannot be counted up",
            ));
        }
        let lease = match d.get(field::LEASE) {
            None | Some(Bson::Null) => None,
            Some(Bson::Document(l)) => {
                let owner = get_opt_string(l, &raw_id, field::lease::OWNER)?
                    .ok_or_else(|| malformed(&raw_id, "`lease.owner` is missing"))?;
                let token = get_opt_string(l, &raw_id, field::lease::TOKEN)?
                    .ok_or_else(|| malformed(&raw_id, "`lease.token` is missing"))?;
                let until = get_date(l, &raw_id, field::lease::UNTIL)?;
                Some(JobLease {
                    owner,
                    token: JobToken::new(token),
                    until,
                })
            }
            Some(other) => {
                return Err(malformed(
                    &raw_id,
                    format!("`lease` must be a document, found {}", type_name(other)),
                ));
            }
        };
        if state == JobState::Running && lease.is_none() {
            return Err(malformed(&raw_id, "a running job has no `lease`"));
        }
        Ok(Job {
            id,
            state,
            payload,
            priority,
            run_at,
            attempts,
            max_attempts,
            lease,
            last_error: get_opt_string(d, &raw_id, field::LAST_ERROR)?,
            result: d.get(field::RESULT).cloned().filter(|b| *b != Bson::Null),
            dedupe_key: get_opt_string(d, &raw_id, field::DEDUPE_KEY)?,
            created_at: get_date(d, &raw_id, field::CREATED_AT)?,
            updated_at: get_date(d, &raw_id, field::UPDATED_AT)?,
            finished_at: get_opt_date(d, &raw_id, field::FINISHED_AT)?,
            snoozes: get_opt_int(d, &raw_id, field::SNOOZES)?.unwrap_or(0),
            stalls: get_opt_int(d, &raw_id, field::STALLS)?.unwrap_or(0),
            max_stalls: get_opt_int(d, &raw_id, field::MAX_STALLS)?,
            progress: d.get(field::PROGRESS).cloned().filter(|b| *b != Bson::Null),
            follow_up: match d.get(field::FOLLOW_UP) {
                None | Some(Bson::Null) => None,
                Some(Bson::Document(f)) => Some(
                    f.get(field::follow_up::PAYLOAD)
                        .cloned()
                        .ok_or_else(|| malformed(&raw_id, "`follow_up.payload` is missing"))?,
                ),
                Some(other) => {
                    return Err(malformed(
                        &raw_id,
                        format!("`follow_up` must be a document, found {}", type_name(other)),
                    ));
                }
            },
            follow_ups: get_opt_int(d, &raw_id, field::FOLLOW_UPS)?.unwrap_or(0),
        })
    }
}

/// A job this worker holds: the job, the lease its transitions are fenced by, and the
/// cancellation signal of this claim.
///
/// Clones share the signal: a [`Worker`](super::Worker) cancels it when the job is
/// cancelled (an operator's [`JobQueue::cancel`](super::JobQueue::cancel), seen by the
/// next heartbeat or change-stream event) or its lease is lost.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClaimedJob {
    /// The job as it was right after the claim.
    pub job: Job,
    /// The lease taken by the claim.
    pub lease: JobLease,
    /// Cancelled when this claim should stop (see [`ClaimedJob::cancellation`]).
    cancel: CancellationToken,
    /// When the claim's reply came back (the claim-to-start histogram, `observe`).
    claimed_at: std::time::Instant,
}

impl PartialEq for ClaimedJob {
    /// Equal when the job and the lease are (the signal is not compared).
    fn eq(&self, other: &Self) -> bool {
        self.job == other.job && self.lease == other.lease
    }
}

impl ClaimedJob {
    /// A claimed job with a fresh, uncancelled signal.
    pub(crate) fn new(job: Job, lease: JobLease) -> Self {
        Self {
            job,
            lease,
            cancel: CancellationToken::new(),
            claimed_at: std::time::Instant::now(),
        }
    }

    /// When the claim's reply came back (this process's monotonic clock).
    pub(crate) fn claimed_at(&self) -> std::time::Instant {
        self.claimed_at
    }

    /// The claim's cancellation signal. A worker cancels it when the job was cancelled
    /// while running (its handler should stop: whatever it returns afterwards is refused
    /// by the fence) or its lease was lost. A handler that ignores it is dropped
    /// [`WorkerOptions::cancel_grace`](super::WorkerOptions::cancel_grace) after the
    /// signal. The worker also cancels it when it abandons the handler — at
    /// [`WorkerOptions::job_timeout`](super::WorkerOptions::job_timeout), after a panic,
    /// or at the end of the shutdown deadline — so that tasks the handler spawned (which
    /// the worker cannot abort) can stop: the attempt is over and the job may run again.
    ///
    /// ```no_run
    /// # async fn handler(job: docwarden::queue::ClaimedJob) -> docwarden::queue::HandlerResult {
    /// tokio::select! {
    ///     () = job.cancellation().cancelled() => Err("cancelled".into()),
    ///     () = tokio::time::sleep(std::time::Duration::from_secs(60)) => Ok(mongodb::bson::Bson::Null),
    /// }
    /// # }
    /// ```
    pub fn cancellation(&self) -> &CancellationToken {
        &self.cancel
    }

    /// The job's id.
    pub fn id(&self) -> ObjectId {
        self.job.id
    }

    /// The job's payload.
    pub fn payload(&self) -> &Bson {
        &self.job.payload
    }
}

/// `{_id, state: "running", "lease.token": token}`.
pub(crate) fn fence_filter(id: &Bson, token: &str) -> Document {
    doc! {
        field::ID: id.clone(),
        field::STATE: JobState::Running.as_str(),
        field::LEASE_TOKEN: token,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Document {
        let now = DateTime::from_millis(1_700_000_000_000);
        doc! {
            "_id": ObjectId::new(), "state": "running", "payload": { "ip": "1.2.3.4" },
            "priority": 0_i64, "run_at": now, "attempts": 1_i64, "max_attempts": 5_i32,
            "lease": { "owner": "w", "token": "t", "until": now },
            "created_at": now, "updated_at": now,
        }
    }

    #[test]
    fn a_well_formed_document_parses() -> Result<()> {
        let job = Job::from_document(&sample())?;
        assert_eq!(job.state, JobState::Running);
        assert_eq!(job.max_attempts, 5);
        assert_eq!(job.lease.map(|l| l.token), Some(JobToken::new("t")));
        Ok(())
    }

    #[test]
    fn wrong_types_are_reasons_not_panics() {
        for (key, value, expect) in [
            ("max_attempts", Bson::String("three".into()), "max_attempts"),
            ("attempts", Bson::Double(1.5), "attempts"),
            ("state", Bson::String("paused".into()), "unknown state"),
            ("run_at", Bson::String("tomorrow".into()), "run_at"),
            ("lease", Bson::Int32(3), "lease"),
        ] {
            let mut d = sample();
            d.insert(key, value);
            match Job::from_document(&d) {
                Err(Error::Malformed { reason, .. }) => {
                    assert!(reason.contains(expect), "{reason}")
                }
                other => panic!("{key}: expected Malformed, got {other:?}"),
            }
        }
        let mut d = sample();
        d.remove("payload");
        assert!(Job::from_document(&d).is_err());
    }

    #[test]
    fn states_round_trip() {
        for s in JobState::ALL {
            assert_eq!(JobState::parse(s.as_str()), Some(s));
        }
        assert!(JobState::Dead.is_finished());
        assert!(!JobState::Retrying.is_finished());
    }
}
