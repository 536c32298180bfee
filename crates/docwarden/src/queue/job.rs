//! The job document: its fields, its states, and typed parsing of what is stored.
//!
//! Parsing never panics: a document that a person or another program edited into the
//! wrong shape comes back as [`Error::Malformed`] with a reason, which the claim path
//! stores as the job's `last_error` when it moves the job to [`JobState::Dead`].

use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};

use crate::error::{Error, Result};

/// Field names of the job document (see `docs/queue.md`).
pub(crate) mod field {
    pub(crate) const ID: &str = "_id";
    pub(crate) const STATE: &str = "state";
    pub(crate) const PAYLOAD: &str = "payload";
    pub(crate) const PRIORITY: &str = "priority";
    pub(crate) const RUN_AT: &str = "run_at";
    pub(crate) const ATTEMPTS: &str = "attempts";
    pub(crate) const MAX_ATTEMPTS: &str = "max_attempts";
    pub(crate) const LEASE: &str = "lease";
    pub(crate) const LEASE_TOKEN: &str = "lease.token";
    pub(crate) const LEASE_UNTIL: &str = "lease.until";
    pub(crate) const LAST_ERROR: &str = "last_error";
    pub(crate) const RESULT: &str = "result";
    pub(crate) const DEDUPE_KEY: &str = "dedupe_key";
    pub(crate) const CREATED_AT: &str = "created_at";
    pub(crate) const UPDATED_AT: &str = "updated_at";
    pub(crate) const FINISHED_AT: &str = "finished_at";
}

/// Where a job is in its life.
///
/// ```text
/// ready ──claim──▶ running ──complete──▶ succeeded
///   ▲                │ │ └──fail (attempts < max)──▶ retrying ──claim──▶ running
///   │                │ └────fail (attempts = max)──▶ dead
///   └──release───────┘      lease expired ──▶ retrying (or dead at max attempts)
/// any unfinished ──cancel──▶ cancelled;   dead ──retry──▶ ready
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum JobState {
    /// Waiting to be claimed once `run_at` has passed.
    Ready,
    /// Claimed: a worker holds the lease.
    Running,
    /// Completed; `result` holds what the handler returned.
    Succeeded,
    /// Failed (or its lease expired) and waits for `run_at` to be tried again.
    Retrying,
    /// Failed `max_attempts` times, or malformed; `last_error` says why.
    Dead,
    /// Cancelled by an operator or its worker.
    Cancelled,
}

impl JobState {
    /// Every state, in display order.
    pub const ALL: [JobState; 6] = [
        JobState::Ready,
        JobState::Running,
        JobState::Succeeded,
        JobState::Retrying,
        JobState::Dead,
        JobState::Cancelled,
    ];

    /// The stored string.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Ready => "ready",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Retrying => "retrying",
            JobState::Dead => "dead",
            JobState::Cancelled => "cancelled",
        }
    }

    /// Parses a stored string.
    pub fn parse(s: &str) -> Option<JobState> {
        JobState::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Whether the job will never run again on its own (succeeded, dead, cancelled).
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Dead | JobState::Cancelled
        )
    }
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

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
pub struct Lease {
    /// The worker that holds (or last held) the job.
    pub owner: String,
    /// 128-bit random token, 32 hex digits; every transition matches it.
    pub token: String,
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
    pub lease: Option<Lease>,
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

fn type_name(b: &Bson) -> String {
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
        let lease = match d.get(field::LEASE) {
            None | Some(Bson::Null) => None,
            Some(Bson::Document(l)) => {
                let owner = get_opt_string(l, &raw_id, "owner")?
                    .ok_or_else(|| malformed(&raw_id, "`lease.owner` is missing"))?;
                let token = get_opt_string(l, &raw_id, "token")?
                    .ok_or_else(|| malformed(&raw_id, "`lease.token` is missing"))?;
                let until = get_date(l, &raw_id, "until")?;
                Some(Lease {
                    owner,
                    token,
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
        })
    }
}

/// A job this worker holds: the job and the lease its transitions are fenced by.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ClaimedJob {
    /// The job as it was right after the claim.
    pub job: Job,
    /// The lease taken by the claim.
    pub lease: Lease,
}

impl ClaimedJob {
    /// The job's id.
    pub fn id(&self) -> ObjectId {
        self.job.id
    }

    /// The job's payload.
    pub fn payload(&self) -> &Bson {
        &self.job.payload
    }

    /// The fencing filter `{_id, state: "running", "lease.token": token}`: a write to the
    /// job document with this filter applies only while this claim still holds the job.
    /// Handlers can use it for their own fenced writes (progress, side effects).
    pub fn fence(&self) -> Document {
        fence_filter(&Bson::ObjectId(self.job.id), &self.lease.token)
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
        assert_eq!(job.lease.map(|l| l.token), Some("t".to_owned()));
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
