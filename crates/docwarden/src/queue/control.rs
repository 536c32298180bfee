//! Pause and resume a named queue: a control document in `<collection>.meta`.
//!
//! **Guarantee:** [`JobQueue::pause`] is one single-document upsert of the queue's
//! control document (`_id: "control:<queue>"`, `paused: true`, `paused_at` server
//! time). Every [`Worker`](super::Worker) of the queue re-reads that document every
//! `poll_max` (and, with [`WorkerOptions::watch_control`](super::WorkerOptions::watch_control),
//! also on a change-stream event on it) and starts no claim while it reads
//! `paused: true`, so no claim starts later than one wake-up (`poll_max`, or the
//! change-stream event) after the pause was written.
//! Jobs already claimed (running or waiting in a worker) finish; [`JobQueue::resume`]
//! lets the workers claim again the same way. The state survives restarts: it is in
//! the database, and a worker reads it before its first claim.
//!
//! **Limits:** a claim already sent when the pause lands may still take jobs (it
//! started before the pause). The pause is honoured by the workers, not by the
//! server: a direct [`JobQueue::claim`] or [`JobQueue::claim_batch`] call, or a worker
//! of format 2, still claims from a paused queue (check [`JobQueue::is_paused`]).
//! `docs/queue.md` ("Pause and resume") describes the document for other languages.

use std::time::Duration;

use mongodb::bson::{Bson, DateTime, Document, doc};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::JobQueue;
use crate::error::{Result, is_duplicate_key};
use crate::format::schedule::{control, control_id};
use crate::listener::{self, Received, Subscribed};

/// What [`JobQueue::pause`] or [`JobQueue::resume`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PauseOutcome {
    /// The queue was running and is now paused.
    Paused,
    /// The queue was already paused; nothing changed.
    AlreadyPaused,
    /// The queue was paused and now runs again.
    Resumed,
    /// The queue was not paused; nothing changed.
    NotPaused,
}

/// The stored control state of a queue (the default when no document exists: running).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct QueueControl {
    /// The queue's name.
    pub queue: String,
    /// Whether workers may start claims.
    pub paused: bool,
    /// Server time of the last pause.
    pub paused_at: Option<DateTime>,
    /// Server time of the last resume.
    pub resumed_at: Option<DateTime>,
    /// Who paused or resumed last.
    pub by: Option<String>,
    /// Pauses plus resumes so far.
    pub version: i64,
}

impl QueueControl {
    fn from_document(queue: &str, d: Option<&Document>) -> Self {
        let Some(d) = d else {
            return QueueControl {
                queue: queue.to_owned(),
                ..QueueControl::default()
            };
        };
        let date = |k: &str| d.get_datetime(k).ok().copied();
        QueueControl {
            queue: queue.to_owned(),
            // Anything but `true` is "not paused": a hand-edited document cannot stop
            // a queue by accident.
            paused: matches!(d.get(control::PAUSED), Some(Bson::Boolean(true))),
            paused_at: date(control::PAUSED_AT),
            resumed_at: date(control::RESUMED_AT),
            by: d.get_str(control::BY).ok().map(str::to_owned),
            version: match d.get(control::VERSION) {
                Some(Bson::Int64(v)) => *v,
                Some(Bson::Int32(v)) => i64::from(*v),
                _ => 0,
            },
        }
    }
}

/// `version + 1` as a pipeline expression, a stored `version` that is not a number
/// (absent, or a hand edit) counting as 0: an `$inc` on a string failed every pause and
/// resume of the queue with an untyped database error.
fn version_plus_one() -> Document {
    let version = format!("${}", control::VERSION);
    doc! { "$add": [
        { "$cond": [{ "$isNumber": version.as_str() }, version.as_str(), 0_i64] },
        1_i64,
    ] }
}

impl JobQueue {
    fn control_filter(&self) -> Document {
        doc! { "_id": control_id(self.queue_name()) }
    }

    /// Pauses this handle's queue: workers start no new claim from it within one
    /// wake-up; running jobs finish. `by` is stored for operators (a user, a host).
    ///
    /// # Errors
    /// [`crate::Error::InvalidInput`] for an empty `by`; a database error.
    pub async fn pause(&self, by: &str) -> Result<PauseOutcome> {
        crate::validate::name("paused by", by)?;
        let now = self.time().now().await?.estimate();
        let mut filter = self.control_filter();
        filter.insert(control::PAUSED, doc! { "$ne": true });
        // The seed-003 shape: the upsert inserts the document if none exists, and hits a
        // duplicate key if it exists already paused (the filter did not match it).
        let r = self
            .meta()
            .update_one(
                filter,
                vec![doc! { "$set": {
                    control::QUEUE: { "$literal": self.queue_name() },
                    control::PAUSED: true,
                    control::PAUSED_AT: now,
                    control::BY: { "$literal": by },
                    control::UPDATED_AT: now,
                    control::VERSION: version_plus_one(),
                } }],
            )
            .upsert(true)
            .await;
        match r {
            Ok(_) => {
                tracing::info!(queue = self.queue_name(), by, "queue paused");
                Ok(PauseOutcome::Paused)
            }
            Err(e) if is_duplicate_key(&e) => Ok(PauseOutcome::AlreadyPaused),
            Err(e) => Err(e.into()),
        }
    }

    /// Resumes this handle's queue: workers claim from it again within one wake-up.
    ///
    /// # Errors
    /// [`crate::Error::InvalidInput`] for an empty `by`; a database error.
    pub async fn resume(&self, by: &str) -> Result<PauseOutcome> {
        crate::validate::name("resumed by", by)?;
        let now = self.time().now().await?.estimate();
        let mut filter = self.control_filter();
        filter.insert(control::PAUSED, true);
        let r = self
            .meta()
            .update_one(
                filter,
                vec![doc! { "$set": {
                    control::PAUSED: false,
                    control::RESUMED_AT: now,
                    control::BY: { "$literal": by },
                    control::UPDATED_AT: now,
                    control::VERSION: version_plus_one(),
                } }],
            )
            .await?;
        if r.matched_count == 0 {
            return Ok(PauseOutcome::NotPaused);
        }
        tracing::info!(queue = self.queue_name(), by, "queue resumed");
        Ok(PauseOutcome::Resumed)
    }

    /// The queue's stored control state (running when no document exists).
    ///
    /// # Errors
    /// A database error.
    pub async fn control(&self) -> Result<QueueControl> {
        let d = self.meta().find_one(self.control_filter()).await?;
        Ok(QueueControl::from_document(self.queue_name(), d.as_ref()))
    }

    /// Whether the queue is paused (one read of the control document).
    ///
    /// # Errors
    /// A database error.
    pub async fn is_paused(&self) -> Result<bool> {
        Ok(self.control().await?.paused)
    }
}

/// Keeps `tx` equal to the queue's `paused` flag until `stop`: re-reads the control
/// document at once, on every change-stream event on it, and every `poll` (the
/// fallback when change streams are refused or an event is missed). The first value
/// sent is the first successful read; until then the receiver's initial value holds
/// (workers start with "paused" so that they never claim before they know). Every failed
/// read calls `failed` (a worker counts it: until the first read succeeds it claims
/// nothing, and must not look idle and healthy).
pub(crate) async fn watch_pause(
    queue: JobQueue,
    tx: watch::Sender<bool>,
    poll: Duration,
    change_stream: bool,
    stop: CancellationToken,
    failed: impl Fn() + Send,
) {
    let mut read_once = false;
    // The handle's workers in this process share one stream (`crate::listener`).
    let pipeline = vec![
        doc! { "$match": { "documentKey._id": control_id(queue.queue_name()) } },
        doc! { "$project": { "operationType": 1, "documentKey": 1 } },
    ];
    let mut stream = None;
    loop {
        if stream.is_none() && change_stream {
            stream = tokio::select! {
                () = stop.cancelled() => return,
                s = listener::subscribe(queue.meta(), pipeline.clone()) => match s {
                    Subscribed::Yes(s) => Some(s),
                    Subscribed::Refused => None,
                    Subscribed::Unavailable(e) => {
                        tracing::debug!(error = %e, "cannot watch the control document; polling");
                        None
                    }
                },
            };
        }
        // Read after the stream is open: a change between the read and the open would
        // otherwise be missed until the next poll.
        match queue.is_paused().await {
            Ok(p) => {
                read_once = true;
                tx.send_if_modified(|cur| {
                    let changed = *cur != p;
                    *cur = p;
                    changed
                });
            }
            Err(e) => {
                failed();
                if read_once {
                    tracing::debug!(error = %e, "cannot read the control document");
                } else {
                    tracing::warn!(error = %e, "cannot read the control document; not claiming until it is read");
                }
            }
        }
        let sleep = tokio::time::sleep(poll);
        match stream.as_mut() {
            Some(s) => tokio::select! {
                () = stop.cancelled() => return,
                () = sleep => {}
                ev = s.recv() => {
                    if matches!(ev, Received::Lost) {
                        stream = None;
                    }
                }
            },
            None => tokio::select! {
                () = stop.cancelled() => return,
                () = sleep => {}
            },
        }
    }
}
