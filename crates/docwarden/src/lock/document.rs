//! Document locks (seed 003's shape): the lock lives in the entity document itself, as a
//! random `lock_id` and the server time `lock_time` it was taken.
//!
//! **Guarantee:** a document is locked by at most one [`DocumentGuard`] whose lock is still
//! valid, and [`DocumentLocks::release_with`] writes the holder's change and clears the lock
//! in one update fenced by the lock id: if the lock was taken over (after it expired) or
//! cleared, nothing is written and the holder gets [`FenceOutcome::Lost`]. A document
//! lock fences writes to the locked document only. An expired lock
//! can be taken over: the filter is `lock_id == null OR lock_time < cutoff` (the seed ANDs
//! the two, so an expired lock could never be taken over and a released document could
//! never be locked again). A lock id whose `lock_time` is missing or not a date (a hand
//! edit; docwarden never writes one) counts as expired.
//!
//! **Limits:** expiry is a promise about time (see the module docs of [`crate::lock`]); the
//! lock id fences only writes that go through [`DocumentLocks::release_with`]. Writes made
//! elsewhere while holding the lock are not fenced.

use std::time::{Duration, Instant};

use mongodb::Collection;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::options::ReturnDocument;
use tracing::instrument;

use super::collection::{describe, listing};
use super::deadline::{Deadline, Unanswered};
use super::fence::FenceOutcome;
use super::landing;
use super::wake::Wake;
use crate::backoff::Backoff;
use crate::clock::TimeSource;
use crate::error::{self, Error, Result};
use crate::validate;

/// Options of [`DocumentLocks`], validated by [`DocumentLocks::new`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct DocumentLockOptions {
    /// How long a lock is valid after `lock_time` before it may be taken over. Default 30 s.
    pub max_duration: Duration,
    /// The field holding the lock id. Default `lock_id`.
    pub lock_id_field: String,
    /// The field holding the lock time. Default `lock_time`.
    pub lock_time_field: String,
    /// First delay of a blocking [`DocumentLocks::lock`] retry. Default 5 ms.
    pub backoff_base: Duration,
    /// Largest delay between blocking lock retries, and the polling interval for a lock
    /// that expires without a release while a change stream wakes the waiter. Default
    /// 250 ms.
    pub backoff_max: Duration,
    /// Test controls only: `true` uses seed 003's AND filter.
    seed_and_filter: bool,
    /// Test controls only: every lock counts as expired (the takeover check is off).
    ignore_lock: bool,
    /// Whether a blocking lock listens for the release (`lock/wake.rs`); `false` only in
    /// tests that measure the backoff alone.
    wake: bool,
}

impl Default for DocumentLockOptions {
    fn default() -> Self {
        Self {
            max_duration: Duration::from_secs(30),
            lock_id_field: crate::format::lock::document::LOCK_ID.to_owned(),
            lock_time_field: crate::format::lock::document::LOCK_TIME.to_owned(),
            backoff_base: Duration::from_millis(5),
            backoff_max: Duration::from_millis(250),
            seed_and_filter: false,
            ignore_lock: false,
            wake: true,
        }
    }
}

impl DocumentLockOptions {
    /// Sets [`DocumentLockOptions::max_duration`].
    pub fn max_duration(mut self, max_duration: Duration) -> Self {
        self.max_duration = max_duration;
        self
    }

    /// Sets the lock id and lock time field names.
    pub fn fields(mut self, lock_id: impl Into<String>, lock_time: impl Into<String>) -> Self {
        self.lock_id_field = lock_id.into();
        self.lock_time_field = lock_time.into();
        self
    }

    /// Sets [`DocumentLockOptions::backoff_base`] and [`DocumentLockOptions::backoff_max`].
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_max = max;
        self
    }

    /// Test controls only, **unsafe**: every lock counts as expired, so a lock attempt
    /// takes over a held lock. Shows what the takeover check prevents.
    #[doc(hidden)]
    pub fn unsafe_ignore_lock(mut self) -> Self {
        self.ignore_lock = true;
        self
    }

    /// Test-only: a blocking lock only backs off (no change-stream wake-up), to compare
    /// hand-off latencies.
    #[doc(hidden)]
    pub fn poll_only(mut self) -> Self {
        self.wake = false;
        self
    }

    /// Test controls only, **unsafe**: locks with seed 003's filter, `lock_id == null AND
    /// lock_time < cutoff`, which can neither take over an expired lock nor relock a
    /// released document. Shows what docwarden's OR fixes.
    #[doc(hidden)]
    pub fn unsafe_seed_and_filter(mut self) -> Self {
        self.seed_and_filter = true;
        self
    }
}

/// A held document lock: the locked document as it was after locking, and the lock id that
/// fences the release.
#[derive(Clone, Debug, PartialEq)]
#[must_use = "a document lock is held until released or expired"]
pub struct DocumentGuard {
    /// The document's `_id`.
    pub id: Bson,
    /// The random 128-bit lock id written into the document.
    pub lock_id: String,
    /// Server time (estimated) written as the lock time.
    pub locked_at: DateTime,
    /// The document after locking.
    pub document: Document,
    /// The lock id field of the collection, for [`super::Fenced`].
    lock_id_field: String,
}

impl DocumentGuard {
    /// `{_id: id, <lock id field>: lock_id}`: the document still carries this lock.
    pub(crate) fn fence_filter(&self) -> Document {
        doc! { "_id": self.id.clone(), self.lock_id_field.as_str(): &self.lock_id }
    }
}

/// A locked document as stored, for listing ([`DocumentLocks::list_locked`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DocumentLockRecord {
    /// The document's `_id` (a string as is, any other type as extended JSON).
    pub id: String,
    /// The lock id (a string as is, any other type as extended JSON).
    pub lock_id: String,
    /// The lock time (server time); `None` if the stored value is not a date.
    #[serde(serialize_with = "super::collection::as_rfc3339")]
    pub locked_at: Option<DateTime>,
    /// Whether the lock has certainly expired (the next `lock` takes it over). A lock whose
    /// lock time is not a date counts as expired.
    pub expired: bool,
    /// What is wrong with a lock docwarden did not write, for example
    /// `"lock_time is missing"`; `None` for a well-formed lock.
    pub malformed: Option<String>,
}

/// Document locks on one collection.
///
/// ```no_run
/// # async fn example(db: mongodb::Database, time: docwarden::clock::TimeSource) -> docwarden::Result<()> {
/// use docwarden::lock::{DocumentLockOptions, DocumentLocks};
/// use mongodb::bson::doc;
/// let dummies = DocumentLocks::new(db.collection("dummies"), time, DocumentLockOptions::default())?;
/// if let Some(guard) = dummies.lock_or_create("id-1", doc! { "value": "initial" }).await? {
///     let outcome = dummies.release_with(guard, doc! { "$set": { "value": "changed" } }).await?;
///     assert!(outcome.is_applied(), "the lock expired and was taken over");
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct DocumentLocks {
    coll: Collection<Document>,
    time: TimeSource,
    options: DocumentLockOptions,
    max_ms: i64,
}

impl DocumentLocks {
    /// Document locks on collection `name` of `db` ([`DocumentLocks::new`]), after the
    /// preflight checks ([`crate::preflight::check`]). No index is created: only the `_id`
    /// index is needed.
    ///
    /// # Errors
    /// As [`DocumentLocks::new`]; [`Error::Incompatible`] for a server older than MongoDB
    /// 6.0 or a collection with a non-simple default collation; a database error.
    pub async fn open(
        db: &mongodb::Database,
        name: &str,
        time: TimeSource,
        options: DocumentLockOptions,
    ) -> Result<Self> {
        validate::collection_name("document lock collection", name)?;
        let this = Self::new(db.collection(name), time, options)?;
        crate::preflight::check(&this.coll).await?;
        Ok(this)
    }

    /// Document locks on `coll`, without touching the server: it only validates (only the
    /// `_id` index is needed; [`DocumentLocks::open`] also runs the preflight checks).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a zero `max_duration`, bad field names or a bad backoff.
    pub fn new(
        coll: Collection<Document>,
        time: TimeSource,
        options: DocumentLockOptions,
    ) -> Result<Self> {
        let max_ms = validate::duration_ms("max_duration", options.max_duration)?;
        Backoff::new(options.backoff_base, options.backoff_max)?;
        for (what, f) in [
            ("lock id field", &options.lock_id_field),
            ("lock time field", &options.lock_time_field),
        ] {
            validate::name(what, f)?;
            if f.starts_with('$') || f.contains('.') || f == "_id" {
                return Err(Error::invalid(what, "must be a plain top-level field name"));
            }
        }
        if options.lock_id_field == options.lock_time_field {
            return Err(Error::invalid(
                "lock time field",
                "must differ from the lock id field",
            ));
        }
        Ok(Self {
            coll,
            time,
            options,
            max_ms,
        })
    }

    /// Locks the existing document `id`. Contention is not an error: `Ok(None)` if the
    /// document is locked by another holder and the lock has not certainly expired, or if
    /// there is no such document ([`DocumentLocks::lock_or_create`] creates it).
    /// [`DocumentLocks::lock`] waits for the lock.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an id that is not a plain value
    /// ([`crate::validate::document_id`]: null, empty, an array, a regex, a document with a
    /// `$` key); a database error.
    ///
    /// An attempt that ends without an answer (an error after its write was sent, or its
    /// future dropped) unlocks what it locked once its landing deadline (2 s after it was
    /// sent) has passed; a write reaching the server later locks nothing
    /// (`lock/landing.rs`).
    #[instrument(skip(self, id), fields(collection = %self.coll.name(), id = %id))]
    pub async fn try_lock(
        &self,
        id: impl Into<Bson> + std::fmt::Display,
    ) -> Result<Option<DocumentGuard>> {
        let id = id.into();
        check_id(&id)?;
        let ops = self.lock_ops().await?;
        self.attempt(id, ops, &[]).await
    }

    /// Locks the existing document `id`, waiting until it is locked or `wait` has passed
    /// (`Ok(None)`, as for a document that does not exist); a zero `wait` tries once, as
    /// [`DocumentLocks::try_lock`]. The waiter retries the moment the lock is released (a
    /// change stream on the document, shared by the waiters of this process: `lock/wake.rs`)
    /// and polls every [`DocumentLockOptions::backoff_max`] for a lock that expires
    /// without a release; where change streams are refused it retries with jittered
    /// exponential backoff. Transient errors ([`Error::is_retryable`]) are retried within
    /// the wait like contention (`lock/deadline.rs`). An attempt whose reply was lost may
    /// have locked the document all the same: the next attempts take over a lock that
    /// carries the lock id of one of this call's failed attempts (never handed out to
    /// anyone), instead of waiting behind it until `max_duration`.
    ///
    /// # Errors
    /// As [`DocumentLocks::try_lock`]; a transient error only if the wait passed with the
    /// last attempt failing.
    #[instrument(skip(self, id), fields(collection = %self.coll.name(), id = %id))]
    pub async fn lock(
        &self,
        id: impl Into<Bson> + std::fmt::Display,
        wait: Duration,
    ) -> Result<Option<DocumentGuard>> {
        let id = id.into();
        check_id(&id)?;
        let called = Instant::now();
        let mut deadline = Deadline::after(wait);
        let mut backoff = Backoff::new(self.options.backoff_base, self.options.backoff_max)?;
        let mut wake = Wake::new(
            &self.coll,
            id.clone(),
            Wake::freed_document(&self.options.lock_id_field),
        );
        // The lock ids of this call's attempts that failed with a transient error: any of
        // them may have locked the document without the reply saying so.
        let mut unanswered = Unanswered::default();
        loop {
            let tried = match self.lock_ops().await {
                Ok(ops) => {
                    let lock_id = ops.lock_id.clone();
                    let r = self.attempt(id.clone(), ops, unanswered.nonces()).await;
                    unanswered.note(lock_id, &r);
                    r
                }
                Err(e) => Err(e),
            };
            if let Some(guard) = deadline.attempt(tried)? {
                crate::observe::lock_handoff(self.coll.name(), called, None);
                return Ok(Some(guard));
            }
            let listen = self.options.wake;
            if !wake
                .before_next_attempt(&deadline, &mut backoff, listen, self.options.backoff_max)
                .await
            {
                return deadline.passed();
            }
        }
    }

    /// One lock attempt on `id` (already checked) with `ops`: [`DocumentLocks::try_lock`].
    /// `mine`: lock ids of the blocking call's earlier attempts whose replies were lost; a
    /// lock carrying one of them is taken over as free.
    async fn attempt(
        &self,
        id: Bson,
        ops: LockOps,
        mine: &[String],
    ) -> Result<Option<DocumentGuard>> {
        let after = if self.options.seed_and_filter {
            let (filter, update) = self.operator_form(&id, &ops);
            self.coll
                .find_one_and_update(filter, update)
                .return_document(ReturnDocument::After)
                .await?
        } else {
            self.take_over(&id, &ops, mine)
                .await?
                .filter(|d| self.locked_by(d, &ops))
        };
        self.observe(after.is_some());
        Ok(after.map(|document| self.guard(id, ops, document)))
    }

    /// The write of one lock attempt: the condition in the pipeline, the filter `{_id}`
    /// alone, a point write on both servers (see [`takeover_pipeline`]). Returns the
    /// post-image (`None`: no such document), which shows `ops`' lock id only if this
    /// write took the lock. It takes the lock only before its landing deadline, and until
    /// the attempt answers, what an unanswered write took is unlocked once that deadline
    /// has passed (`lock/landing.rs`).
    async fn take_over(
        &self,
        id: &Bson,
        ops: &LockOps,
        mine: &[String],
    ) -> Result<Option<Document>> {
        let (id_f, time_f) = (&self.options.lock_id_field, &self.options.lock_time_field);
        let cleanup = self.cleanup(id, ops);
        let after = self
            .coll
            .find_one_and_update(
                doc! { "_id": id.clone() },
                takeover_pipeline(id_f, time_f, ops, mine),
            )
            .return_document(ReturnDocument::After)
            .await?;
        cleanup.settled();
        Ok(after)
    }

    /// The clean-up of attempt `ops` on `id` (`lock/landing.rs`): unlocks the document if
    /// it still carries this attempt's lock id once the landing deadline has passed,
    /// unless [`landing::CleanUp::settled`] first.
    fn cleanup(&self, id: &Bson, ops: &LockOps) -> landing::CleanUp {
        let (id_f, time_f) = (&self.options.lock_id_field, &self.options.lock_time_field);
        landing::CleanUp::new(
            &self.coll,
            &self.time,
            doc! { "_id": id.clone(), id_f.as_str(): &ops.lock_id },
            doc! { "$set": { id_f.as_str(): Bson::Null, time_f.as_str(): Bson::Null } },
            ops.land_by,
            "document lock",
        )
    }

    /// Whether stored document `d` is locked by attempt `ops`.
    fn locked_by(&self, d: &Document, ops: &LockOps) -> bool {
        d.get_str(&self.options.lock_id_field).ok() == Some(ops.lock_id.as_str())
    }

    /// The guard of attempt `ops`, which locked `document`.
    fn guard(&self, id: Bson, ops: LockOps, document: Document) -> DocumentGuard {
        DocumentGuard {
            id,
            lock_id: ops.lock_id,
            locked_at: ops.locked_at,
            document,
            lock_id_field: self.options.lock_id_field.clone(),
        }
    }

    /// Locks document `id`, creating it from `initial` if it does not exist. Contention is
    /// not an error: `Ok(None)` if the document is locked by another holder, including the
    /// race of concurrent creators of the same new document (exactly one wins, the others
    /// get `Ok(None)`).
    ///
    /// An existing document is locked by the one write of [`DocumentLocks::try_lock`]
    /// (with its landing deadline and clean-up); a missing one by an insert of `initial`
    /// with the lock fields (two round trips, once per document). A lost reply or a
    /// dropped call is unlocked once the attempt's landing deadline has passed; an insert
    /// that reaches the server more than that deadline late (after its clean-up) leaves
    /// the new document locked until `max_duration` (`docs/locks.md`). (Before session 25
    /// this was one upsert, which neither deadline nor clean-up covered.)
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an id that is not a plain value (as
    /// [`DocumentLocks::try_lock`]), or if `initial` has `$` fields, the lock fields, or an
    /// `_id` other than `id`; a database error.
    #[instrument(skip(self, id, initial), fields(collection = %self.coll.name(), id = %id))]
    pub async fn lock_or_create(
        &self,
        id: impl Into<Bson> + std::fmt::Display,
        mut initial: Document,
    ) -> Result<Option<DocumentGuard>> {
        let id = id.into();
        check_id(&id)?;
        if let Some(given) = initial.remove("_id")
            && given != id
        {
            return Err(Error::invalid(
                "initial document",
                "has an `_id` other than `id`",
            ));
        }
        for key in initial.keys() {
            if key.starts_with('$')
                || *key == self.options.lock_id_field
                || *key == self.options.lock_time_field
            {
                return Err(Error::invalid(
                    "initial document",
                    format!("must not contain `{key}`"),
                ));
            }
        }
        if self.options.seed_and_filter {
            return self.lock_or_create_by_upsert(id, initial).await;
        }
        // The lock ids of this call's inserts that met an existing document: our own
        // insert run twice (a retry some servers run again, `docs/surrogate.md`) may have
        // created it locked, and the next attempt takes such a lock over.
        let mut mine: Vec<String> = Vec::new();
        for _ in 0..CREATE_ROUNDS {
            let ops = self.lock_ops().await?;
            // An existing document: the takeover, with its landing deadline and clean-up.
            if let Some(stored) = self.take_over(&id, &ops, &mine).await? {
                let taken = self.locked_by(&stored, &ops);
                self.observe(taken);
                return Ok(taken.then(|| self.guard(id, ops, stored)));
            }
            // None yet: create it locked. An insert cannot carry a landing deadline, so an
            // insert that reaches the server after its clean-up ran leaves the new document
            // locked until `max_duration` (`docs/locks.md`); a lost reply or a dropped call
            // is unlocked by the clean-up.
            let (id_f, time_f) = (&self.options.lock_id_field, &self.options.lock_time_field);
            let mut created = doc! { "_id": id.clone() };
            created.extend(initial.clone());
            created.insert(id_f.as_str(), ops.lock_id.as_str());
            created.insert(time_f.as_str(), ops.locked_at);
            let cleanup = self.cleanup(&id, &ops);
            match self.coll.insert_one(created.clone()).await {
                Ok(_) => {
                    cleanup.settled();
                    self.observe(true);
                    return Ok(Some(self.guard(id, ops, created)));
                }
                // Created meanwhile (another creator, or our own insert run twice): take
                // it over as an existing document.
                Err(e) if error::is_duplicate_key(&e) => mine.push(ops.lock_id),
                Err(e) => return Err(e.into()),
            }
        }
        self.observe(false);
        Ok(None)
    }

    /// `lock_or_create` under the seed's-filter control: one upsert of the operator form
    /// (the filter is the seed's `AND`), without landing deadline or clean-up.
    async fn lock_or_create_by_upsert(
        &self,
        id: Bson,
        initial: Document,
    ) -> Result<Option<DocumentGuard>> {
        let ops = self.lock_ops().await?;
        let (filter, mut update) = self.operator_form(&id, &ops);
        if !initial.is_empty() {
            update.insert("$setOnInsert", initial);
        }
        match self
            .coll
            .find_one_and_update(filter, update)
            .upsert(true)
            .return_document(ReturnDocument::After)
            .await
        {
            Ok(Some(document)) => {
                self.observe(true);
                Ok(Some(self.guard(id, ops, document)))
            }
            Ok(None) => Err(Error::Malformed {
                id: id.to_string(),
                reason: "upsert returned no document".into(),
            }),
            Err(e) if error::is_duplicate_key(&e) => {
                self.observe(false);
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Writes the operator update `update` and clears the lock, in one update fenced by
    /// the guard's lock id.
    ///
    /// Returns the fencing shape every holder shares: [`FenceOutcome::Applied`], or
    /// [`FenceOutcome::Lost`] if the lock was taken over or cleared (nothing was written).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] if `update` is not an operator document or touches `_id` or
    /// the lock fields; a database error.
    #[instrument(skip(self, guard, update), fields(collection = %self.coll.name(), id = %guard.id))]
    pub async fn release_with(
        &self,
        guard: DocumentGuard,
        update: Document,
    ) -> Result<FenceOutcome> {
        let (id_f, time_f) = (&self.options.lock_id_field, &self.options.lock_time_field);
        // Checked (and the lock fields added) whichever form is sent.
        let fenced = release_update(id_f, time_f, update)?;
        let result = match release_pipeline(id_f, time_f, &guard.lock_id, &fenced) {
            // A plain `$set`/`$unset`: the fence in a pipeline, the filter `{_id}` alone.
            // The document changes only if it still carries our lock id (clearing it is a
            // change), so `modifiedCount` 0 is a lost lock.
            Some(pipeline) => {
                let r = self
                    .coll
                    .update_one(doc! { "_id": guard.id.clone() }, pipeline)
                    .await?;
                r.modified_count
            }
            // Any other operator: the fence in the filter.
            None => {
                self.coll
                    .update_one(guard.fence_filter(), fenced)
                    .await?
                    .matched_count
            }
        };
        if result == 0 {
            return Ok(FenceOutcome::Lost);
        }
        Ok(FenceOutcome::Applied)
    }

    /// Clears the lock without other changes ([`DocumentLocks::release_with`] with an
    /// empty update).
    ///
    /// # Errors
    /// As [`DocumentLocks::release_with`].
    pub async fn release(&self, guard: DocumentGuard) -> Result<FenceOutcome> {
        self.release_with(guard, Document::new()).await
    }

    /// Every locked document of the collection (lock id not null), by `_id`: an operator's
    /// view, which scans the collection (there is no index on the lock id). Locks docwarden
    /// did not write (a lock id next to a lock time that is missing or not a date) are
    /// listed with [`DocumentLockRecord::malformed`] set; they count as expired.
    ///
    /// # Errors
    /// A database error.
    pub async fn list_locked(&self) -> Result<Vec<DocumentLockRecord>> {
        self.list_locked_first(None).await
    }

    /// [`DocumentLocks::list_locked`], at most `limit` documents (`None`: all of them),
    /// the first by `_id`. A view should set a limit: every entity can be locked at once.
    ///
    /// # Errors
    /// A database error.
    pub async fn list_locked_first(&self, limit: Option<u64>) -> Result<Vec<DocumentLockRecord>> {
        let (id_f, time_f) = (
            self.options.lock_id_field.as_str(),
            self.options.lock_time_field.as_str(),
        );
        let cutoff = self.cutoff().await?;
        let docs = listing(
            &self.coll,
            doc! { id_f: { "$ne": Bson::Null } },
            Some(doc! { id_f: 1, time_f: 1 }),
            limit,
        )
        .await?;
        Ok(docs
            .iter()
            .map(|d| {
                let mut problems = Vec::new();
                let id = match d.get("_id") {
                    Some(Bson::String(s)) => s.clone(),
                    other => other.map(ToString::to_string).unwrap_or_default(),
                };
                let lock_id = match d.get(id_f) {
                    Some(Bson::String(s)) => s.clone(),
                    other => {
                        problems.push(format!("{id_f} is {}", describe(other)));
                        other.map(ToString::to_string).unwrap_or_default()
                    }
                };
                let locked_at = match d.get(time_f) {
                    Some(Bson::DateTime(t)) => Some(*t),
                    other => {
                        problems.push(format!("{time_f} is {}", describe(other)));
                        None
                    }
                };
                DocumentLockRecord {
                    id,
                    lock_id,
                    locked_at,
                    expired: locked_at.is_none_or(|t| t < cutoff),
                    malformed: (!problems.is_empty()).then(|| problems.join(", ")),
                }
            })
            .collect())
    }

    /// Locks whose lock time is before this instant have certainly expired.
    /// Counts a lock taken or found held (`docs/observability.md`).
    fn observe(&self, taken: bool) {
        if taken {
            crate::observe::lock_acquired(self.coll.name(), None);
        } else {
            crate::observe::lock_busy(self.coll.name());
        }
    }

    async fn cutoff(&self) -> Result<DateTime> {
        let now = self.time.now().await?;
        Ok(DateTime::from_millis(
            now.expired_before(self.time.skew_margin_ms())
                .timestamp_millis()
                .saturating_sub(self.max_ms),
        ))
    }

    /// A lock attempt's values: a fresh lock id, the lock time and the expiry cutoff.
    async fn lock_ops(&self) -> Result<LockOps> {
        let now = self.time.now().await?;
        let cutoff = if self.options.ignore_lock {
            DateTime::MAX
        } else {
            DateTime::from_millis(
                now.expired_before(self.time.skew_margin_ms())
                    .timestamp_millis()
                    .saturating_sub(self.max_ms),
            )
        };
        Ok(LockOps {
            cutoff,
            lock_id: validate::random_id(),
            locked_at: now.estimate(),
            land_by: landing::deadline(&now),
        })
    }

    /// The operator form of lock attempt `ops` on `id`: the takeover filter (the seed's
    /// AND filter under that control) and the `$set` of the lock fields, for the upsert of
    /// `lock_or_create` and for `lock` under the seed's-filter control. (`lock` itself
    /// sends [`takeover_pipeline`] with the filter `{_id}`.)
    fn operator_form(&self, id: &Bson, ops: &LockOps) -> (Document, Document) {
        let (id_f, time_f) = (
            self.options.lock_id_field.as_str(),
            self.options.lock_time_field.as_str(),
        );
        let filter = if self.options.seed_and_filter {
            doc! {
                "_id": id.clone(),
                id_f: Bson::Null,
                time_f: { "$lt": ops.cutoff },
            }
        } else {
            takeover_filter(id, id_f, time_f, ops.cutoff)
        };
        let update = doc! { "$set": { id_f: &ops.lock_id, time_f: ops.locked_at } };
        (filter, update)
    }
}

/// What [`DocumentLocks::lock_ops`] returns: the expiry cutoff, a fresh lock id, the lock
/// time, and the attempt's landing deadline (`lock/landing.rs`).
pub(crate) struct LockOps {
    pub(crate) cutoff: DateTime,
    pub(crate) lock_id: String,
    pub(crate) locked_at: DateTime,
    pub(crate) land_by: DateTime,
}

/// The caller's operator update with the lock fields cleared.
pub(crate) fn release_update(id_f: &str, time_f: &str, mut update: Document) -> Result<Document> {
    for (op, value) in &update {
        let Bson::Document(fields) = value else {
            return Err(Error::invalid(
                "release update",
                format!("`{op}` must take a document"),
            ));
        };
        if !op.starts_with('$') {
            return Err(Error::invalid(
                "release update",
                format!("`{op}` is not an update operator"),
            ));
        }
        // `$rename` writes its values (the new names) as well as its keys.
        let renamed = (op == "$rename").then(|| fields.values().filter_map(Bson::as_str));
        for k in fields
            .keys()
            .map(String::as_str)
            .chain(renamed.into_iter().flatten())
        {
            let root = k.split('.').next().unwrap_or(k);
            if root == "_id" || root == id_f || root == time_f {
                return Err(Error::invalid(
                    "release update",
                    format!("must not touch `{k}`"),
                ));
            }
        }
    }
    match update.get_mut("$set") {
        Some(Bson::Document(set)) => {
            set.insert(id_f, Bson::Null);
            set.insert(time_f, Bson::Null);
        }
        _ => {
            update.insert("$set", doc! { id_f: Bson::Null, time_f: Bson::Null });
        }
    }
    Ok(update)
}

/// [`release_update`]'s result as a one-stage pipeline for the filter `{_id}` alone, when
/// it is a plain `$set` and `$unset` of top-level fields; `None` for anything else, which
/// is sent as the operator update with the fence in the filter.
///
/// With only values set it is `{$replaceWith: {$cond: [held, {$mergeObjects: ["$$ROOT",
/// the fields]}, "$$ROOT"]}}`; with a field to remove, each field becomes `{$cond: [held,
/// new value, its stored value]}` in a `$set` stage. `held` is "the document carries
/// `lock_id`": the server decides on the document it writes, atomically, as it decides a
/// filter. Held, the document is the one the operator form leaves: a
/// value is set as given (`$literal`), an unset field is removed (`$$REMOVE`), the lock
/// fields become null, and fields are processed in the lexicographic order of their names,
/// as MongoDB 5.0+ processes an operator update's fields (so new fields are appended in
/// the same order). Not held, every field keeps its stored value (a missing one stays
/// missing) and the document is unchanged.
///
/// Why: a filter with a second field costs the embedded server a planned read before the
/// write (its `{_id}`-only fast path is skipped), about 10 % of a lock + `release_with`
/// (`docs/benchmarks.md`, session 18). MongoDB runs both as an `_id` point write.
///
/// Left to the fenced filter: other operators (`$inc`, `$push`, … behave differently on
/// null, missing or array values in the two forms), dotted or `$`-prefixed names, names
/// that are numbers (MongoDB orders those numerically), an empty name, a value with an
/// embedded `$`-prefixed or dotted name ([`plain_value`]), and a field both set and unset
/// (the server refuses that update; the filter form keeps its error).
pub(crate) fn release_pipeline(
    id_f: &str,
    time_f: &str,
    lock_id: &str,
    fenced: &Document,
) -> Option<Vec<Document>> {
    let mut fields: Vec<(&str, Bson)> = Vec::new();
    for (op, value) in fenced {
        let Bson::Document(operand) = value else {
            return None;
        };
        let remove = match op.as_str() {
            "$set" => false,
            "$unset" => true,
            _ => return None,
        };
        for (name, v) in operand {
            let plain = !name.is_empty()
                && !name.contains('.')
                && !name.starts_with('$')
                && !name.bytes().all(|b| b.is_ascii_digit());
            if !plain
                || fields.iter().any(|(n, _)| *n == name.as_str())
                || !(remove || plain_value(v))
            {
                return None;
            }
            let new = if remove {
                Bson::from("$$REMOVE")
            } else if name == id_f || name == time_f {
                Bson::Null
            } else {
                Bson::Document(doc! { "$literal": v.clone() })
            };
            fields.push((name.as_str(), new));
        }
    }
    fields.sort_unstable_by(|a, b| a.0.cmp(b.0));
    let held = doc! { "$eq": [format!("${id_f}"), { "$literal": lock_id }] };
    if fields.iter().all(|(_, new)| new != &Bson::from("$$REMOVE")) {
        // Only values set: one `$replaceWith` of a `$cond`, the condition evaluated once
        // (about 4 % of a lock + `release_with` on the embedded server, session 23).
        // `$mergeObjects` keeps a stored field where it is and appends a new one in the
        // order given, as the `$set` below does.
        let set: Document = fields
            .into_iter()
            .map(|(name, new)| (name.to_owned(), new))
            .collect();
        return Some(vec![doc! { "$replaceWith": { "$cond": [
            held,
            { "$mergeObjects": ["$$ROOT", set] },
            "$$ROOT",
        ] } }]);
    }
    // A field to remove: `$$REMOVE` works in a `$set` stage, not inside `$mergeObjects`.
    let mut set = Document::new();
    for (name, new) in fields {
        set.insert(
            name,
            doc! { "$cond": [held.clone(), new, format!("${name}")] },
        );
    }
    Some(vec![doc! { "$set": set }])
}

/// Whether `value` holds no embedded field name that starts with `$` or contains a dot,
/// at any depth: operator and pipeline updates do not treat such names alike on every
/// MongoDB version, so a value with one keeps the operator form.
fn plain_value(value: &Bson) -> bool {
    match value {
        Bson::Document(d) => d
            .iter()
            .all(|(k, v)| !k.starts_with('$') && !k.contains('.') && plain_value(v)),
        Bson::Array(items) => items.iter().all(plain_value),
        _ => true,
    }
}

/// `{$and: [{_id: id}, {$or: [lock_id == null, lock_time < cutoff, lock_time is not a
/// date]}]}` — the seed's filter with its AND bug fixed, shaped as a point write by `_id`
/// (the `$or` inside `$and`: a top-level `$or` next to `_id` costs the embedded server
/// about three times a point write; an upsert still inserts `{_id: id}`).
///
/// docwarden writes `lock_id` and `lock_time` together and clears them together; a lock id
/// next to a `lock_time` that is missing, null or not a date was edited by hand, and `$lt`
/// against a date never matches it, so without the third branch the document would stay
/// locked forever. It is treated as expired.
pub(crate) fn takeover_filter(
    id: &Bson,
    lock_id: &str,
    lock_time: &str,
    cutoff: DateTime,
) -> Document {
    doc! { "$and": [
        { "_id": id.clone() },
        { "$or": [
            { lock_id: Bson::Null },
            { lock_time: { "$lt": cutoff } },
            { lock_time: { "$not": { "$type": "date" } } },
        ] },
    ] }
}

/// [`takeover_filter`]'s condition moved into a one-stage pipeline for the filter `{_id}`
/// alone: the lock fields are set to this attempt's `lock_id` and `locked_at` when the
/// lock is free, expired or not a date, and kept as they are otherwise (the document is
/// unchanged, and the post-image shows the holder's lock id). The server evaluates the
/// condition on the document it writes, atomically, as it evaluates a filter; the
/// filter `{_id}` alone is MongoDB's `IDHACK` plan and lets the embedded server skip
/// planning the `$or` (about 45 µs of its CPU per lock, `docs/locks.md`).
///
/// `mine`: lock ids of the caller's own earlier attempts whose replies were lost
/// ([`DocumentLocks::lock`]); a lock carrying one of them is taken over too. Nothing is
/// taken once the server's clock has reached the attempt's landing deadline
/// (`ops.land_by`, `lock/landing.rs`).
pub(crate) fn takeover_pipeline(
    lock_id_f: &str,
    lock_time_f: &str,
    ops: &LockOps,
    mine: &[String],
) -> Vec<Document> {
    let LockOps {
        cutoff,
        lock_id,
        locked_at,
        land_by,
    } = ops;
    let id_path = format!("${lock_id_f}");
    let time_path = format!("${lock_time_f}");
    let mut free = vec![
        Bson::Document(doc! { "$eq": [{ "$ifNull": [&id_path, Bson::Null] }, Bson::Null] }),
        Bson::Document(doc! { "$ne": [{ "$type": &time_path }, "date"] }),
        Bson::Document(doc! { "$lt": [&time_path, { "$literal": cutoff }] }),
    ];
    if !mine.is_empty() {
        free.push(Bson::Document(
            doc! { "$in": [&id_path, { "$literal": mine }] },
        ));
    }
    // One `$replaceWith` of a `$cond`: the condition is evaluated once (a `$cond` per
    // field cost the embedded server about 2 % more per lock + release, session 23).
    vec![doc! { "$replaceWith": { "$cond": [
        { "$and": [landing::before(*land_by), { "$or": free }] },
        { "$mergeObjects": ["$$ROOT", {
            lock_id_f: { "$literal": lock_id },
            lock_time_f: { "$literal": locked_at },
        }] },
        "$$ROOT",
    ] } }]
}

/// Most takeover + insert rounds of one `lock_or_create`: an insert that meets a
/// document created meanwhile goes back to the takeover, which then answers.
const CREATE_ROUNDS: usize = 3;

fn check_id(id: &Bson) -> Result<()> {
    validate::document_id("document id", id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{ClockOptions, LocalClock};

    /// Session 24: the takeover sent after its landing deadline takes nothing, before it
    /// takes the free lock (fails without `landing::before` in the condition: the late
    /// write locks the document).
    #[tokio::test]
    async fn a_takeover_after_its_landing_deadline_takes_nothing() -> anyhow::Result<()> {
        let t = docwarden_testkit::TestDb::new("doclock_landing_deadline").await?;
        let coll = t.db.collection::<Document>("entities");
        coll.insert_one(doc! { "_id": 1, "lock_id": null, "lock_time": null })
            .await?;
        let now = DateTime::now().timestamp_millis();
        for (land_by, should_take) in [(now - 1_000, false), (now + 60_000, true)] {
            let ops = LockOps {
                cutoff: DateTime::from_millis(now),
                lock_id: format!("late-{land_by}"),
                locked_at: DateTime::from_millis(now),
                land_by: DateTime::from_millis(land_by),
            };
            let after = coll
                .find_one_and_update(
                    doc! { "_id": 1 },
                    takeover_pipeline("lock_id", "lock_time", &ops, &[]),
                )
                .return_document(ReturnDocument::After)
                .await?
                .unwrap_or_default();
            let took = after.get_str("lock_id").ok() == Some(ops.lock_id.as_str());
            anyhow::ensure!(
                took == should_take,
                "land_by {land_by} (now {now}): took {took}: {after}"
            );
        }
        Ok(())
    }

    #[test]
    fn release_clears_the_lock_and_refuses_to_touch_it() -> Result<()> {
        assert_eq!(
            release_update("l", "t", doc! { "$set": { "v": 1 } })?,
            doc! { "$set": { "v": 1, "l": null, "t": null } }
        );
        assert_eq!(
            release_update("l", "t", doc! { "$inc": { "n": 1 } })?,
            doc! { "$inc": { "n": 1 }, "$set": { "l": null, "t": null } }
        );
        assert!(release_update("l", "t", doc! { "$set": { "l": 1 } }).is_err());
        // Session 15: a `$rename` onto a lock field or `_id` passed (the server then
        // refused the update with a bare conflict error).
        assert!(release_update("l", "t", doc! { "$rename": { "x": "l" } }).is_err());
        assert!(release_update("l", "t", doc! { "$rename": { "x": "_id" } }).is_err());
        assert!(release_update("l", "t", doc! { "$rename": { "x": "y" } }).is_ok());
        assert!(release_update("l", "t", doc! { "$unset": { "t.x": "" } }).is_err());
        assert!(release_update("l", "t", doc! { "$set": { "_id": 2 } }).is_err());
        assert!(release_update("l", "t", doc! { "v": 1 }).is_err());
        Ok(())
    }

    #[test]
    fn only_a_plain_set_and_unset_become_a_pipeline() -> Result<()> {
        let plan = |u: Document| -> Result<Option<Vec<Document>>> {
            Ok(release_pipeline(
                "l",
                "t",
                "me",
                &release_update("l", "t", u)?,
            ))
        };
        let held = doc! { "$eq": ["$l", { "$literal": "me" }] };
        // Fields in lexicographic (byte) order, as MongoDB 5.0+ applies operator fields.
        assert_eq!(
            plan(doc! { "$set": { "v": { "$x": 1_i32 } } })?,
            None,
            "a `$` name inside a value"
        );
        assert_eq!(
            plan(doc! { "$set": { "b": 1_i32, "B": [1_i32] }, "$unset": { "a": "" } })?,
            Some(vec![doc! { "$set": {
                "B": { "$cond": [held.clone(), { "$literal": [1_i32] }, "$B"] },
                "a": { "$cond": [held.clone(), "$$REMOVE", "$a"] },
                "b": { "$cond": [held.clone(), { "$literal": 1_i32 }, "$b"] },
                "l": { "$cond": [held.clone(), Bson::Null, "$l"] },
                "t": { "$cond": [held, Bson::Null, "$t"] },
            } }])
        );
        // Only values set: one `$replaceWith`, the fields in the same order.
        assert_eq!(
            plan(doc! { "$set": { "b": 1_i32, "B": [1_i32] } })?,
            Some(vec![doc! { "$replaceWith": { "$cond": [
                { "$eq": ["$l", { "$literal": "me" }] },
                { "$mergeObjects": ["$$ROOT", {
                    "B": { "$literal": [1_i32] },
                    "b": { "$literal": 1_i32 },
                    "l": Bson::Null,
                    "t": Bson::Null,
                }] },
                "$$ROOT",
            ] } }])
        );
        for u in [
            doc! { "$inc": { "n": 1_i32 } },
            doc! { "$set": { "a.b": 1_i32 } },
            doc! { "$set": { "10": 1_i32 } },
            doc! { "$set": { "v": { "a.b": 1_i32 } } },
            doc! { "$set": { "v": [{ "$y": 1_i32 }] } },
            doc! { "$set": { "v": 1_i32 }, "$unset": { "v": "" } },
        ] {
            assert_eq!(plan(u.clone())?, None, "{u}");
        }
        Ok(())
    }

    #[test]
    fn options_and_ids_are_validated() {
        let time = TimeSource::local_unchecked(LocalClock::system(), ClockOptions::default());
        assert!(time.is_ok());
        assert!(check_id(&Bson::Null).is_err());
        assert!(check_id(&Bson::from("")).is_err());
        assert!(check_id(&Bson::from(3_i64)).is_ok());
    }

    #[test]
    fn the_takeover_filter_is_an_or() {
        let f = takeover_filter(
            &Bson::from("a"),
            "lock_id",
            "lock_time",
            DateTime::from_millis(5),
        );
        assert_eq!(
            f,
            doc! { "$and": [{ "_id": "a" }, { "$or": [
                { "lock_id": null },
                { "lock_time": { "$lt": DateTime::from_millis(5) } },
                { "lock_time": { "$not": { "$type": "date" } } },
            ] }] }
        );
    }
}
