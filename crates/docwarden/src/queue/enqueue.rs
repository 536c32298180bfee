//! Enqueue: single and batch, delayed, prioritised, deduplicated, windowed, replacing,
//! debounced, follow-up, and inside the caller's transaction.
//!
//! A dedupe key is enforced by the unique partial index [`index::DEDUPE`](super::index::DEDUPE)
//! over unfinished jobs, never by a read-then-write: two racing enqueues of one key
//! store one job. A uniqueness window is enforced the same way, by the unique index
//! [`index::UNIQUE_SLOT`](super::index::UNIQUE_SLOT) over `unique_slot` (key and window
//! start) in every state. Replace, debounce and follow-up
//! ([`OnDuplicate`]) are each one conditional write to the key's one unfinished job,
//! re-checking its state in the write, so they never touch a job that started (replace,
//! debounce) or finished (follow-up) meanwhile. Sizes are checked before anything is
//! sent, so a batch with one oversized payload enqueues nothing.
//!
//! **Limits.** Windows are aligned to multiples of their length (server time), like
//! River's `ByPeriod`: "at most one per 10 minutes" is one per 10-minute bucket, so two
//! jobs can be a second apart across a bucket boundary. Purging a finished job frees its
//! window slot: purge only jobs older than the longest window.

use mongodb::bson::{Bson, Document, doc, oid::ObjectId};

use std::time::Duration;

use mongodb::options::ReturnDocument;
use mongodb::{ClientSession, IndexModel};

use super::job::{JobState, claimable_states, field, unfinished_states};
use super::options::{EnqueueOptions, OnDuplicate, RunAt, Safeguard};
use super::transition::{MAX_PROGRESS_BYTES, MAX_RESULT_BYTES};
use super::{JobQueue, index};
use crate::error::{Error, Result, is_duplicate_key};
use crate::validate::MAX_DOCUMENT_BYTES;

/// The largest new job document, in BSON bytes: 16 MiB less room for what the job
/// gains later — a result of up to [`MAX_RESULT_BYTES`], progress of up to
/// [`MAX_PROGRESS_BYTES`], and 16 KiB for the lease, `last_error`, `settled` and
/// counters — so that every transition a handler is allowed to ask for can be stored.
const MAX_NEW_JOB_BYTES: usize =
    MAX_DOCUMENT_BYTES - MAX_RESULT_BYTES - MAX_PROGRESS_BYTES - 16 * 1024;

/// What an enqueue did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Enqueued {
    /// A new job was stored.
    Created(ObjectId),
    /// An unfinished job with the same dedupe key exists (or, with a uniqueness
    /// window, a job of the key was created inside the window); nothing was stored.
    Duplicate {
        /// The key.
        key: String,
        /// The existing unfinished job, if it could be read back. Dedupe keys are unique
        /// per collection: it may be a job of another queue, which this enqueue never
        /// changes (not even with [`OnDuplicate::Replace`] or
        /// [`OnDuplicate::FollowUp`]).
        existing: Option<ObjectId>,
    },
    /// [`OnDuplicate::Replace`] / [`OnDuplicate::Debounce`]: the key's waiting job (of
    /// this handle's queue) got this enqueue's payload, priority, `max_attempts` and
    /// limits (and, debouncing, its `run_at`); see `docs/queue.md`, "Uniqueness".
    Replaced(ObjectId),
    /// [`OnDuplicate::FollowUp`]: the key's job is running; it will run once more, with
    /// this enqueue's payload, when it completes.
    FollowUp(ObjectId),
}

impl Enqueued {
    /// The new job's id, if one was created.
    pub fn created(&self) -> Option<ObjectId> {
        match self {
            Enqueued::Created(id) => Some(*id),
            Enqueued::Duplicate { .. } | Enqueued::Replaced(_) | Enqueued::FollowUp(_) => None,
        }
    }
}

impl JobQueue {
    /// Builds the document of a new job (validated, size-checked).
    pub(super) async fn new_job(&self, payload: Bson, opts: &EnqueueOptions) -> Result<Document> {
        opts.validate()?;
        let now = self.inner.time.now().await?;
        let run_at = match opts.run_at {
            RunAt::Now => now.estimate(),
            RunAt::After(d) => now.plus_ms(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
            RunAt::At(at) => at,
        };
        let max_attempts = opts.max_attempts.unwrap_or(self.inner.options.max_attempts);
        let mut d = doc! {
            field::ID: ObjectId::new(),
            field::STATE: JobState::Ready.as_str(),
            field::PAYLOAD: payload,
            field::PRIORITY: opts.priority,
            field::RUN_AT: run_at,
            field::ATTEMPTS: 0_i64,
            field::MAX_ATTEMPTS: i64::from(max_attempts),
            field::LEASE: Bson::Null,
            field::LAST_ERROR: Bson::Null,
            field::CREATED_AT: now.estimate(),
            field::UPDATED_AT: now.estimate(),
            field::PARTITION: i64::from(rand::random_range(0..self.inner.options.partitions)),
        };
        match (&opts.dedupe_key, opts.unique_window) {
            // A windowed job is unique by its slot (every state), not by the key among
            // unfinished jobs.
            (Some(key), Some(w)) => {
                if self.inner.options.unsafe_without == Some(Safeguard::UniqueSlot) {
                    d.insert(CONTROL_KEY, key.clone());
                } else {
                    d.insert(field::UNIQUE_SLOT, unique_slot(key, w, now.estimate_ms));
                }
            }
            (Some(key), None) => {
                d.insert(field::DEDUPE_KEY, key.clone());
            }
            (None, _) => {}
        }
        if let Some(n) = self.inner.options.max_stalls {
            d.insert(field::MAX_STALLS, i64::from(n));
        }
        if let Some(q) = &self.inner.options.queue {
            d.insert(field::QUEUE, q.clone());
        }
        self.apply_limits(&mut d, opts)?;
        let mut bytes = Vec::new();
        d.to_writer(&mut bytes)
            .map_err(|e| Error::invalid("payload", format!("cannot be encoded as BSON: {e}")))?;
        if bytes.len() > MAX_NEW_JOB_BYTES {
            return Err(Error::invalid(
                "payload",
                format!(
                    "the job document would be {} bytes; the limit is {MAX_NEW_JOB_BYTES} (16 MiB less room for the result, progress, lease and error it gains later)",
                    bytes.len()
                ),
            ));
        }
        Ok(d)
    }

    /// Enqueues one job.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for bad options or a payload too large for one document
    /// (nothing is sent); a database error.
    pub async fn enqueue(
        &self,
        payload: impl Into<Bson>,
        opts: &EnqueueOptions,
    ) -> Result<Enqueued> {
        let d = self.new_job(payload.into(), opts).await?;
        if let (Some(key), Some(w)) = (&opts.dedupe_key, opts.unique_window) {
            return self.enqueue_windowed(d, key, w).await;
        }
        if opts.on_duplicate != OnDuplicate::Keep
            && let Some(key) = &opts.dedupe_key
        {
            return self.enqueue_or_merge(d, key, opts.on_duplicate).await;
        }
        let id = d
            .get_object_id(field::ID)
            .map_err(|e| Error::invalid("job", e.to_string()))?;
        match self.inner.coll.insert_one(d).await {
            Ok(_) => {
                tracing::debug!(job = %id, "enqueued");
                Ok(Enqueued::Created(id))
            }
            Err(e) if is_duplicate_key(&e) => match &opts.dedupe_key {
                Some(key) => Ok(self.duplicate(key).await),
                None => Err(e.into()),
            },
            Err(e) => Err(e.into()),
        }
    }

    /// Enqueues many jobs in one unordered insert. Outcomes are in input order. Every
    /// job is validated first: if one is invalid, nothing is enqueued.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] naming the bad job (nothing sent); a database error other
    /// than a dedupe conflict.
    pub async fn enqueue_many<I, P>(&self, jobs: I) -> Result<Vec<Enqueued>>
    where
        I: IntoIterator<Item = (P, EnqueueOptions)>,
        P: Into<Bson>,
    {
        let mut docs = Vec::new();
        let mut keys = Vec::new();
        for (payload, opts) in jobs {
            if opts.on_duplicate != OnDuplicate::Keep {
                return Err(Error::invalid(
                    "on duplicate",
                    "enqueue_many keeps duplicates; replace, debounce and follow-up need enqueue",
                ));
            }
            docs.push(self.new_job(payload.into(), &opts).await?);
            keys.push(opts.dedupe_key);
        }
        if docs.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<ObjectId> = docs
            .iter()
            .map(|d| d.get_object_id(field::ID))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::invalid("job", e.to_string()))?;
        match self
            .inner
            .coll
            .insert_many(docs.clone())
            .ordered(false)
            .await
        {
            Ok(_) => Ok(ids.into_iter().map(Enqueued::Created).collect()),
            // Some dedupe keys are taken. Which documents were stored is read back by
            // id (servers differ in how they report per-document errors of a bulk
            // insert), and the rest are retried one by one.
            Err(e) if is_duplicate_key(&e) => {
                let stored = self
                    .ids_where(doc! { field::ID: { "$in": ids.clone() } })
                    .await?;
                let mut out = Vec::with_capacity(ids.len());
                for ((id, d), key) in ids.into_iter().zip(docs).zip(keys) {
                    if stored.contains(&id) {
                        out.push(Enqueued::Created(id));
                        continue;
                    }
                    match self.inner.coll.insert_one(d).await {
                        Ok(_) => out.push(Enqueued::Created(id)),
                        Err(e) if is_duplicate_key(&e) => match &key {
                            Some(key) => out.push(self.duplicate(key).await),
                            None => return Err(e.into()),
                        },
                        Err(e) => return Err(e.into()),
                    }
                }
                Ok(out)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Enqueues one job inside the caller's transaction: the insert goes through
    /// `session` (which must be in a transaction the caller started), so the job exists
    /// if and only if the transaction commits. Workers cannot see (or claim) it before
    /// the commit; a change-stream wake-up arrives at the commit.
    ///
    /// Only [`OnDuplicate::Keep`] is accepted here. A dedupe conflict is a write error,
    /// and MongoDB aborts a transaction on a write error: the outcome is
    /// [`Enqueued::Duplicate`] (without the existing id) and the caller's transaction is
    /// already aborted.
    ///
    /// ```no_run
    /// # async fn example(client: mongodb::Client, queue: docwarden::queue::JobQueue) -> docwarden::Result<()> {
    /// use docwarden::queue::EnqueueOptions;
    /// use mongodb::bson::{Document, doc};
    /// let orders = client.database("shop").collection::<Document>("orders");
    /// let mut session = client.start_session().await?;
    /// session.start_transaction().await?;
    /// orders.insert_one(doc! { "_id": 7, "total": 12 }).session(&mut session).await?;
    /// queue.enqueue_in(&mut session, doc! { "order": 7 }, &EnqueueOptions::default()).await?;
    /// session.commit_transaction().await?; // the order and its job, or neither
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for bad options, another [`OnDuplicate`] policy, or an
    /// oversized payload (nothing sent); a database error (for example a server without
    /// transactions: a standalone refuses them).
    pub async fn enqueue_in(
        &self,
        session: &mut ClientSession,
        payload: impl Into<Bson>,
        opts: &EnqueueOptions,
    ) -> Result<Enqueued> {
        if opts.on_duplicate != OnDuplicate::Keep {
            return Err(Error::invalid(
                "on duplicate",
                "only `Keep` can run inside a transaction",
            ));
        }
        let d = self.new_job(payload.into(), opts).await?;
        let id = d
            .get_object_id(field::ID)
            .map_err(|e| Error::invalid("job", e.to_string()))?;
        match self.inner.coll.insert_one(d).session(session).await {
            Ok(_) => Ok(Enqueued::Created(id)),
            Err(e) if is_duplicate_key(&e) => match &opts.dedupe_key {
                Some(key) => Ok(Enqueued::Duplicate {
                    key: key.clone(),
                    existing: None,
                }),
                None => Err(e.into()),
            },
            Err(e) => Err(e.into()),
        }
    }

    /// Inserts a windowed job: the unique index on `unique_slot` refuses a second job of
    /// the key in the window, whatever the first one's state.
    async fn enqueue_windowed(&self, d: Document, key: &str, window: Duration) -> Result<Enqueued> {
        let id = d
            .get_object_id(field::ID)
            .map_err(|e| Error::invalid("job", e.to_string()))?;
        if self.inner.options.unsafe_without == Some(Safeguard::UniqueSlot)
            && let Some(existing) = self.window_taken_by_read(key, window).await?
        {
            return Ok(Enqueued::Duplicate {
                key: key.to_owned(),
                existing: Some(existing),
            });
        }
        match self.inner.coll.insert_one(d.clone()).await {
            Ok(_) => Ok(Enqueued::Created(id)),
            Err(e) if is_duplicate_key(&e) => {
                let slot = d.get(field::UNIQUE_SLOT).cloned().unwrap_or(Bson::Null);
                let existing = self
                    .inner
                    .coll
                    .find_one(doc! { field::UNIQUE_SLOT: slot })
                    .projection(doc! { field::ID: 1 })
                    .await?
                    .and_then(|d| d.get_object_id(field::ID).ok());
                Ok(Enqueued::Duplicate {
                    key: key.to_owned(),
                    existing,
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Insert `d`, or merge it into the key's unfinished job by `policy` — each step one
    /// conditional single-document write; a few rounds when the key's job changes state
    /// between them (it started, finished, or was inserted by a racing enqueue).
    async fn enqueue_or_merge(
        &self,
        d: Document,
        key: &str,
        policy: OnDuplicate,
    ) -> Result<Enqueued> {
        let id = d
            .get_object_id(field::ID)
            .map_err(|e| Error::invalid("job", e.to_string()))?;
        let payload = d.get(field::PAYLOAD).cloned().unwrap_or(Bson::Null);
        let replace = replace_update(&d, policy);
        for _ in 0..MERGE_ROUNDS {
            if matches!(policy, OnDuplicate::Replace | OnDuplicate::Debounce)
                && let Some(existing) = self.replace_waiting(key, replace.clone()).await?
            {
                return Ok(Enqueued::Replaced(existing));
            }
            match self.inner.coll.insert_one(d.clone()).await {
                Ok(_) => return Ok(Enqueued::Created(id)),
                Err(e) if is_duplicate_key(&e) => {}
                Err(e) => return Err(e.into()),
            }
            // The key has an unfinished job (or its window is taken). Only a job of this
            // handle's queue is merged into: the key's job in another queue of the
            // collection is left alone (the outcome is `Duplicate`).
            let running = doc! {
                field::DEDUPE_KEY: key,
                field::STATE: JobState::Running.as_str(),
                field::QUEUE: self.queue_value(),
            };
            if policy == OnDuplicate::FollowUp {
                let set = doc! { "$set": {
                    field::FOLLOW_UP: { field::follow_up::PAYLOAD: payload.clone() },
                } };
                let stored = match self
                    .inner
                    .coll
                    .find_one_and_update(running.clone(), set)
                    .projection(doc! { field::ID: 1 })
                    .await
                {
                    Ok(stored) => stored,
                    // The running job and this follow-up payload do not fit in one
                    // document (BSONObjectTooLarge 10334, or MongoDB's 17419 for an
                    // update): nothing was written.
                    Err(e) if matches!(crate::error::error_code(&e), Some(10334 | 17419)) => {
                        return Err(Error::invalid(
                            "payload",
                            "too large to be stored as a follow-up of the key's running job (the job would be over 16 MiB); nothing was written",
                        ));
                    }
                    Err(e) => return Err(e.into()),
                };
                if let Some(job) = stored
                    && let Ok(existing) = job.get_object_id(field::ID)
                {
                    return Ok(Enqueued::FollowUp(existing));
                }
                if self.unfinished_of(key).await?.is_some() {
                    // Waiting: it runs after this enqueue anyway.
                    return Ok(self.duplicate(key).await);
                }
            } else if self.inner.coll.find_one(running).await?.is_some() {
                return Ok(self.duplicate(key).await);
            }
        }
        Ok(self.duplicate(key).await)
    }

    /// Applies `update` ([`replace_update`]) to the key's waiting (`ready`/`retrying`)
    /// job of this handle's queue, re-checking the state in the write; its id, or `None`
    /// if the key has no waiting job in this queue now.
    async fn replace_waiting(&self, key: &str, update: Document) -> Result<Option<ObjectId>> {
        let waiting = doc! {
            field::DEDUPE_KEY: key,
            field::STATE: { "$in": claimable_states() },
            field::QUEUE: self.queue_value(),
        };
        let filter = if self.inner.options.unsafe_without == Some(Safeguard::ReplaceRecheck) {
            // Control only: read the waiting job, then write it by `_id` alone, 20 ms
            // later (a worker may have claimed it meanwhile).
            let Some(found) = self
                .inner
                .coll
                .find_one(waiting)
                .projection(doc! { field::ID: 1 })
                .await?
            else {
                return Ok(None);
            };
            tokio::time::sleep(Duration::from_millis(20)).await;
            doc! { field::ID: found.get(field::ID).cloned().unwrap_or(Bson::Null) }
        } else {
            waiting
        };
        Ok(self
            .inner
            .coll
            .find_one_and_update(filter, update)
            .projection(doc! { field::ID: 1 })
            .return_document(ReturnDocument::After)
            .await?
            .and_then(|d| d.get_object_id(field::ID).ok()))
    }

    async fn unfinished_of(&self, key: &str) -> Result<Option<Document>> {
        Ok(self
            .inner
            .coll
            .find_one(doc! {
                field::DEDUPE_KEY: key,
                field::STATE: { "$in": unfinished_states() },
                field::QUEUE: self.queue_value(),
            })
            .projection(doc! { field::ID: 1, field::STATE: 1 })
            .await?)
    }

    /// Control only ([`Safeguard::UniqueSlot`] off, so the job has no slot): the job of
    /// `key` created in the current window, found by a read 20 ms before the insert.
    async fn window_taken_by_read(&self, key: &str, window: Duration) -> Result<Option<ObjectId>> {
        let now = self.inner.time.now().await?;
        let w = i64::try_from(window.as_millis()).unwrap_or(i64::MAX).max(1);
        let start =
            mongodb::bson::DateTime::from_millis(now.estimate_ms - now.estimate_ms.rem_euclid(w));
        let taken = self
            .inner
            .coll
            .find_one(doc! { CONTROL_KEY: key, field::CREATED_AT: { "$gte": start } })
            .projection(doc! { field::ID: 1 })
            .await?
            .and_then(|d| d.get_object_id(field::ID).ok());
        tokio::time::sleep(Duration::from_millis(20)).await;
        Ok(taken)
    }

    async fn duplicate(&self, key: &str) -> Enqueued {
        let existing = self
            .inner
            .coll
            .find_one(doc! { field::DEDUPE_KEY: key, field::STATE: { "$in": unfinished_states() } })
            .projection(doc! { field::ID: 1 })
            .await
            .ok()
            .flatten()
            .and_then(|d| d.get_object_id(field::ID).ok());
        Enqueued::Duplicate {
            key: key.to_owned(),
            existing,
        }
    }
}

/// The update [`OnDuplicate::Replace`] and [`OnDuplicate::Debounce`] apply to the key's
/// waiting job, from `d`, the job this enqueue would have created: the waiting job takes
/// everything the enqueue's options and the handle's options decide — `payload`,
/// `priority`, `max_attempts`, `limits` (removed when this enqueue has none), `partition`
/// (a fairness key's), `max_stalls` (removed when the handle has none) and, debouncing,
/// `run_at` — as BullMQ's debounce `replace` stores the new job with its own options.
/// It keeps what it has lived: `_id`, `created_at`, `attempts` (which count against the
/// new `max_attempts`), `last_error`, `stalls`, `snoozes`, `follow_ups`, and, for
/// `Replace`, its `run_at` (a retry's backoff included).
fn replace_update(d: &Document, policy: OnDuplicate) -> Document {
    let mut set = Document::new();
    let mut unset = Document::new();
    let mut taken = vec![
        field::PAYLOAD,
        field::PRIORITY,
        field::MAX_ATTEMPTS,
        field::PARTITION,
        field::UPDATED_AT,
        field::LIMITS,
        field::MAX_STALLS,
    ];
    if policy == OnDuplicate::Debounce {
        taken.push(field::RUN_AT);
    }
    for f in taken {
        match d.get(f) {
            Some(v) => {
                set.insert(f, v.clone());
            }
            None => {
                unset.insert(f, "");
            }
        }
    }
    let mut update = doc! { "$set": set };
    if !unset.is_empty() {
        update.insert("$unset", unset);
    }
    update
}

/// The key a windowed job stores in the control ([`Safeguard::UniqueSlot`] off).
const CONTROL_KEY: &str = field::CONTROL_UNIQUE_KEY;

/// Rounds of [`JobQueue::enqueue_or_merge`] before it reports a duplicate.
const MERGE_ROUNDS: usize = 4;

/// `<key>@<window start ms>` for server time `now_ms`: windows aligned to multiples of
/// `window` since the epoch.
pub(super) fn unique_slot(key: &str, window: Duration, now_ms: i64) -> String {
    let w = i64::try_from(window.as_millis()).unwrap_or(i64::MAX).max(1);
    format!("{key}@{}", now_ms - now_ms.rem_euclid(w))
}

/// The unique index on `unique_slot` (every state, documents that have one): at most
/// one job per key per window, finished jobs included.
pub(super) fn unique_slot_index() -> IndexModel {
    IndexModel::builder()
        .keys(doc! { field::UNIQUE_SLOT: 1 })
        .options(
            mongodb::options::IndexOptions::builder()
                .name(index::UNIQUE_SLOT.to_owned())
                .unique(true)
                .partial_filter_expression(doc! { field::UNIQUE_SLOT: { "$exists": true } })
                .build(),
        )
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_aligned_windows() {
        let w = Duration::from_secs(600);
        assert_eq!(unique_slot("k", w, 1_200_000), "k@1200000");
        assert_eq!(unique_slot("k", w, 1_799_999), "k@1200000");
        assert_eq!(unique_slot("k", w, 1_800_000), "k@1800000");
    }
}
