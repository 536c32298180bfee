//! Operations: stats, list, retry dead jobs, cancel, purge, and the claim's query plan.
//!
//! These are for operators and the CLI; each is one or two indexed commands, except
//! `retry_dead` and `purge`, which send one command per batch of jobs (1,000 and
//! [`PURGE_BATCH`]), and `stats`, whose counts read the queue's jobs. Cancelling a
//! running job takes its lease away: the worker's later transitions are refused.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use mongodb::options::ReturnDocument;

use super::job::{JobState, field, finished_states, unfinished_states};
use super::{JobQueue, index};
use crate::error::{Error, Result};
use crate::validate;

/// Jobs deleted per statement by [`JobQueue::purge`].
pub const PURGE_BATCH: i64 = 10_000;

/// Most jobs revived per command by [`JobQueue::retry_dead`] (one statement each).
const RETRY_BATCH: usize = 1_000;

/// The server's duplicate-key error code.
const DUPLICATE_KEY: i64 = 11_000;

/// The `last_error` an operator's [`JobQueue::cancel`] stores.
pub(crate) const CANCELLED_REASON: &str = "cancelled by an operator";

/// Counts and ages that tell whether a queue is healthy.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct QueueStats {
    /// Jobs per stored state (unknown states are counted under their own string).
    pub by_state: BTreeMap<String, u64>,
    /// How long the oldest due job (ready or retrying) has been waiting, in ms.
    pub oldest_due_ms: Option<i64>,
    /// Running jobs whose lease has certainly expired (their worker is gone or stuck;
    /// the next claim sweeps them).
    pub expired_running: u64,
    /// Running jobs whose `lease.until` is not a date (a hand edit): the sweep treats
    /// their lease as expired once they went a lease TTL without an update.
    pub unreadable_leases: u64,
    /// Ready or retrying jobs whose `run_at` is not a date (a hand edit): they can never
    /// be due; the next sweep moves them to `dead` with the reason.
    pub undatable: u64,
    /// Ready or retrying jobs whose `limits` is neither a document nor null (a hand
    /// edit): no claim can take them; the next sweep of undatable jobs moves them to
    /// `dead` with the reason.
    pub malformed_limits: u64,
    /// All jobs.
    pub total: u64,
    /// Jobs that store `queue: "default"` (any state), counted for the default queue
    /// only (always 0 for a named queue). The default queue's jobs carry *no* `queue`
    /// field ([`QueueOptions::queue`](super::QueueOptions::queue)), so no handle claims,
    /// lists, counts, sweeps, cancels or purges these: a foreign producer or a hand edit
    /// wrote them. They are not in [`QueueStats::total`]. The fix is one `updateMany` of
    /// [`JobQueue::misnamed_default_filter`] that `$unset`s `queue` (`docs/queue.md`,
    /// "Named queues"); `docwarden doctor` and `docwarden queue stats` print it.
    pub misnamed_default: u64,
}

/// The queue a stored job belongs to, from its `queue` field.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum QueueKey {
    /// No `queue` field, or null.
    Default,
    /// `queue: "default"`: in no queue ([`QueueStats::misnamed_default`]).
    MisnamedDefault,
    /// A named queue.
    Named(String),
    /// A `queue` that is neither a string nor null (a hand edit): in no queue.
    Foreign,
}

impl QueueKey {
    fn of(value: Option<&Bson>) -> Self {
        match value {
            None | Some(Bson::Null) => Self::Default,
            Some(Bson::String(s)) if s == crate::format::schedule::DEFAULT_QUEUE => {
                Self::MisnamedDefault
            }
            Some(Bson::String(s)) => Self::Named(s.clone()),
            Some(_) => Self::Foreign,
        }
    }
}

/// A `$sum`'s count.
fn count_of(n: Option<&Bson>) -> u64 {
    match n {
        Some(Bson::Int32(n)) => u64::try_from(*n).unwrap_or(0),
        Some(Bson::Int64(n)) => u64::try_from(*n).unwrap_or(0),
        _ => 0,
    }
}

/// Which jobs [`JobQueue::list`] returns. Every criterion set must hold (they are
/// combined with "and").
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct JobListFilter {
    /// Only this state; all states when `None`.
    pub state: Option<JobState>,
    /// Only jobs carrying this key: as their dedupe key (`dedupe_key`), as the key of
    /// their uniqueness window (`unique_slot` is `<key>@<window start>`), or as their
    /// concurrency or rate key (`limits.key`, `limits.rate`). A fairness key is not
    /// stored (only the partition it hashes to), so it cannot be listed by. Exact,
    /// case-sensitive match (`unique_slot` as exactly the key, `@` and digits).
    /// `None`: any.
    pub key: Option<String>,
    /// Only jobs whose `last_error` contains this text, case-insensitively (a literal:
    /// regular-expression characters in it are escaped). `None`: any.
    ///
    /// Neither criterion has an index of its own, and the listing sorts by `updated_at`,
    /// which no index serves: a listing reads the queue's jobs (what an operator's look
    /// needs, not a hot path).
    pub error_contains: Option<String>,
    /// At most this many (newest `updated_at` first). Default 50.
    pub limit: i64,
    /// The jobs of every named queue of the collection, not only the handle's own
    /// (each document's `queue` field says which; none: the default queue). One read for
    /// a view of the whole collection, instead of [`JobQueue::queue_names`] (which reads
    /// every job) and one listing per name. Default `false`.
    pub every_queue: bool,
}

impl Default for JobListFilter {
    fn default() -> Self {
        Self {
            state: None,
            key: None,
            error_contains: None,
            limit: 50,
            every_queue: false,
        }
    }
}

impl JobListFilter {
    /// Sets [`JobListFilter::state`].
    pub fn state(mut self, state: JobState) -> Self {
        self.state = Some(state);
        self
    }
    /// Sets [`JobListFilter::key`].
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }
    /// Sets [`JobListFilter::error_contains`].
    pub fn error_contains(mut self, text: impl Into<String>) -> Self {
        self.error_contains = Some(text.into());
        self
    }
    /// Sets [`JobListFilter::limit`].
    pub fn limit(mut self, limit: i64) -> Self {
        self.limit = limit;
        self
    }
    /// Sets [`JobListFilter::every_queue`]: list the jobs of every named queue of the
    /// collection.
    pub fn every_queue(mut self) -> Self {
        self.every_queue = true;
        self
    }

    /// The query of this filter (the queue's own criterion is added by
    /// [`JobQueue::list`]).
    fn query(&self) -> Document {
        let mut query = Document::new();
        if let Some(s) = self.state {
            query.insert(field::STATE, s.as_str());
        }
        if let Some(k) = &self.key {
            query.insert(
                "$or",
                vec![
                    doc! { field::DEDUPE_KEY: k.as_str() },
                    // The slot is `<key>@<window start in ms>`: the digits are anchored,
                    // so a key that contains `@` (`k@eu`) is not listed for `k`. The
                    // range `["<key>@0", "<key>@:")` (`:` follows `9`) holds every such
                    // slot: MongoDB bounds the index scan by it as by the anchored
                    // regex's prefix, and the embedded server, which bounds no `$regex`
                    // and evaluates one per document (60 s over 1,000,000 jobs), needs
                    // it to read the index at all (`docs/surrogate.md`).
                    doc! { field::UNIQUE_SLOT: {
                        "$gte": format!("{k}@0"),
                        "$lt": format!("{k}@:"),
                        "$regex": format!("^{}@[0-9]+$", regex_literal(k)),
                    } },
                    doc! { field::LIMITS_KEY: k.as_str() },
                    doc! { field::LIMITS_RATE: k.as_str() },
                ],
            );
        }
        if let Some(e) = &self.error_contains {
            query.insert(
                field::LAST_ERROR,
                doc! { "$regex": regex_literal(e), "$options": "i" },
            );
        }
        query
    }
}

/// `s` with every regular-expression metacharacter escaped, so that `$regex` matches it
/// literally.
fn regex_literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\^$.|?*+()[]{}/-#".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The update of [`JobQueue::retry_dead`]: a fresh run at `now` (see there for which
/// fields are reset and which are kept as the job's history).
fn retry_update(now: mongodb::bson::DateTime) -> Document {
    doc! {
        "$set": {
            field::STATE: JobState::Ready.as_str(),
            field::ATTEMPTS: 0_i64,
            field::LEASE: Bson::Null,
            field::RUN_AT: now,
            field::UPDATED_AT: now,
        },
        "$unset": {
            field::FINISHED_AT: "",
            field::STALLS: "",
            field::SNOOZES: "",
            field::PROGRESS: "",
            field::RESULT: "",
            field::FOLLOW_UP: "",
        },
    }
}

/// What [`JobQueue::cancel`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CancelOutcome {
    /// The job was cancelled; it was in `was`.
    Cancelled {
        /// The state before.
        was: JobState,
    },
    /// The job had already finished in this state; nothing changed.
    AlreadyFinished(JobState),
    /// No job with that id in the handle's queue (none at all, or one of another queue).
    NotFound,
}

impl JobQueue {
    /// Counts by state, the oldest due job's wait, and running jobs with expired leases.
    ///
    /// The counts by state and of hand-edited waiting jobs read the queue's jobs (no index
    /// serves them): a dashboard or exporter should pace this call (`docwarden ui` reads
    /// it at most once per `--counts-every`). For every named queue of the collection, use
    /// [`JobQueue::stats_of_every_queue`], which reads the collection once, not once per
    /// queue.
    ///
    /// # Errors
    /// A database error.
    pub async fn stats(&self) -> Result<QueueStats> {
        let own = self.queue_value();
        let mut by_queue = self.stats_in(Some(own.clone())).await?;
        let mut stats = by_queue
            .remove(&QueueKey::of(Some(&own)))
            .unwrap_or_default();
        if self.inner.options.queue.is_none() {
            // Not indexed (the claim indexes are partial on the claimable states): one
            // read of the collection, as the counts by state.
            stats.misnamed_default = self
                .inner
                .coll
                .count_documents(Self::misnamed_default_filter())
                .await?;
        }
        Ok(stats)
    }

    /// [`JobQueue::stats`] of every named queue of this handle's collection, as
    /// [`JobQueue::queue_names`] names them (the default queue first), from one pass of
    /// each count over the collection grouped by queue. `queue_names` and one `stats` per
    /// queue read every job once for the names and once or more per queue: at 1,000,000
    /// jobs on the embedded server, 12 s for one queue (`docs/ui.md`, "Counts at scale").
    ///
    /// # Errors
    /// A database error.
    pub async fn stats_of_every_queue(&self) -> Result<Vec<(String, QueueStats)>> {
        let mut by_queue = self.stats_in(None).await?;
        let misnamed = by_queue
            .remove(&QueueKey::MisnamedDefault)
            .map_or(0, |s| s.total);
        let mut names = self.meta_queue_names().await?;
        names.extend(by_queue.keys().filter_map(|k| match k {
            QueueKey::Named(n) => Some(n.clone()),
            _ => None,
        }));
        let default = crate::format::schedule::DEFAULT_QUEUE;
        names.remove(default);
        let mut stats = by_queue.remove(&QueueKey::Default).unwrap_or_default();
        stats.misnamed_default = misnamed;
        let mut out = vec![(default.to_owned(), stats)];
        for name in names {
            if validate::name("queue", &name).is_ok() {
                let stats = by_queue
                    .remove(&QueueKey::Named(name.clone()))
                    .unwrap_or_default();
                out.push((name, stats));
            }
        }
        Ok(out)
    }

    /// The counts of the jobs whose `queue` is `scope`, or of every job (`None`), by the
    /// queue each job belongs to. Each count is one aggregation grouped by `queue`.
    async fn stats_in(&self, scope: Option<Bson>) -> Result<BTreeMap<QueueKey, QueueStats>> {
        let coll = &self.inner.coll;
        let mut out: BTreeMap<QueueKey, QueueStats> = BTreeMap::new();
        let within = |filter: Document| super::in_queue(filter, scope.clone());
        let queue = format!("${}", field::QUEUE);
        let mut groups = coll
            .aggregate(vec![
                doc! { "$match": within(Document::new()) },
                doc! { "$group": {
                    "_id": { "q": &queue, "s": format!("${}", field::STATE) },
                    "n": { "$sum": 1 },
                } },
            ])
            .await?;
        while let Some(g) = groups.try_next().await? {
            let id = g.get_document("_id").ok();
            let state = match id.and_then(|i| i.get("s")) {
                Some(Bson::String(s)) => s.clone(),
                Some(other) => format!("<{other}>"),
                None => "<missing>".into(),
            };
            let n = count_of(g.get("n"));
            let stats = out
                .entry(QueueKey::of(id.and_then(|i| i.get("q"))))
                .or_default();
            stats.total += n;
            *stats.by_state.entry(state).or_default() += n;
        }
        let now = self.inner.time.now().await?;
        // The oldest due job per queue: `run_at: {$lte: date}` matches dates only.
        let due = within(doc! {
            field::STATE: { "$in": super::job::claimable_states() },
            field::RUN_AT: { "$lte": now.latest() },
        });
        let oldest = doc! { "$min": format!("${}", field::RUN_AT) };
        for (key, value) in self.grouped(due, oldest).await? {
            if let Bson::DateTime(t) = value {
                out.entry(key).or_default().oldest_due_ms =
                    Some(now.estimate_ms.saturating_sub(t.timestamp_millis()).max(0));
            }
        }
        let cutoff = now.expired_before(self.inner.time.skew_margin_ms());
        let one = doc! { "$sum": 1 };
        let expired = within(doc! {
            field::STATE: JobState::Running.as_str(),
            field::LEASE_UNTIL: { "$lt": cutoff },
        });
        for (key, n) in self.grouped(expired, one.clone()).await? {
            out.entry(key).or_default().expired_running = count_of(Some(&n));
        }
        for (key, n) in self
            .grouped(Self::unreadable_lease_in(scope.clone()), one.clone())
            .await?
        {
            out.entry(key).or_default().unreadable_leases = count_of(Some(&n));
        }
        for (key, n) in self
            .grouped(Self::undatable_in(scope.clone()), one.clone())
            .await?
        {
            out.entry(key).or_default().undatable = count_of(Some(&n));
        }
        for (key, n) in self
            .grouped(Self::malformed_limits_in(scope.clone()), one)
            .await?
        {
            out.entry(key).or_default().malformed_limits = count_of(Some(&n));
        }
        Ok(out)
    }

    /// `accumulator` over the jobs matching `filter`, per queue.
    async fn grouped(
        &self,
        filter: Document,
        accumulator: Document,
    ) -> Result<Vec<(QueueKey, Bson)>> {
        let mut cursor = self
            .inner
            .coll
            .aggregate(vec![
                doc! { "$match": filter },
                doc! { "$group": { "_id": format!("${}", field::QUEUE), "v": accumulator } },
            ])
            .await?;
        let mut out = Vec::new();
        while let Some(g) = cursor.try_next().await? {
            out.push((
                QueueKey::of(g.get("_id")),
                g.get("v").cloned().unwrap_or(Bson::Null),
            ));
        }
        Ok(out)
    }

    /// The jobs that store `queue: "default"` ([`QueueStats::misnamed_default`]): in no
    /// queue, since the default queue's jobs carry no `queue` field. The fix, in
    /// `mongosh`: `db.getCollection("<collection>").updateMany({queue: "default"},
    /// {$unset: {queue: ""}})`, safe in any state (no handle can have claimed them).
    /// The claim filters are not widened to take them: their `queue: null` equality is
    /// what the claim indexes serve (`docs/queue.md`, "Named queues").
    pub fn misnamed_default_filter() -> Document {
        doc! { field::QUEUE: crate::format::schedule::DEFAULT_QUEUE }
    }

    /// The stored job documents of this queue (of every queue of the collection with
    /// [`JobListFilter::every_queue`]) matching `filter`, newest change first (raw, so a
    /// malformed document is shown as it is; parse with
    /// [`Job::from_document`](super::Job::from_document)).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a limit below 1; a database error.
    pub async fn list(&self, filter: &JobListFilter) -> Result<Vec<Document>> {
        if filter.limit < 1 {
            return Err(Error::invalid("limit", "must be at least 1"));
        }
        if filter.key.as_deref() == Some("") {
            return Err(Error::invalid("key", "must not be empty"));
        }
        if filter.error_contains.as_deref() == Some("") {
            return Err(Error::invalid("error text", "must not be empty"));
        }
        let mut query = filter.query();
        if !filter.every_queue {
            query.insert(field::QUEUE, self.queue_value());
        }
        Ok(self
            .inner
            .coll
            .find(query)
            .sort(doc! { field::UPDATED_AT: -1 })
            .limit(filter.limit)
            .await?
            .try_collect()
            .await?)
    }

    /// The names of the queues in this handle's collection, sorted with `default`
    /// first: the default queue (always), every string `queue` value stored on a job
    /// (one `distinct` over the collection: the claim indexes that start with `queue` are
    /// partial, so finished jobs are read too), and every queue with an options or
    /// control document in
    /// the meta collection (a named queue that has no job yet, or was paused before its
    /// first job). Open one with [`JobQueue::named`].
    ///
    /// # Errors
    /// A database error.
    pub async fn queue_names(&self) -> Result<Vec<String>> {
        let mut names = self.meta_queue_names().await?;
        for v in self.inner.coll.distinct(field::QUEUE, doc! {}).await? {
            if let Bson::String(s) = v {
                names.insert(s);
            }
        }
        let default = crate::format::schedule::DEFAULT_QUEUE;
        names.remove(default);
        let mut out = vec![default.to_owned()];
        out.extend(
            names
                .into_iter()
                .filter(|n| validate::name("queue", n).is_ok()),
        );
        Ok(out)
    }

    /// The queues with an options or control document in the meta collection.
    async fn meta_queue_names(&self) -> Result<std::collections::BTreeSet<String>> {
        use crate::format::schedule::{OPTIONS_ID_PREFIX, control};
        let mut names = std::collections::BTreeSet::new();
        let pattern = format!(
            "^({}|{})",
            regex_literal(OPTIONS_ID_PREFIX),
            regex_literal(control::ID_PREFIX)
        );
        let mut meta = self
            .meta()
            .find(doc! { "_id": { "$regex": pattern } })
            .projection(doc! { "_id": 1 })
            .await?;
        while let Some(d) = meta.try_next().await? {
            if let Ok(id) = d.get_str("_id") {
                let name = id
                    .strip_prefix(OPTIONS_ID_PREFIX)
                    .or_else(|| id.strip_prefix(control::ID_PREFIX))
                    .unwrap_or(id);
                names.insert(name.to_owned());
            }
        }
        Ok(names)
    }

    /// Moves dead jobs (all, or those in `ids`) back to `ready`, due now, to run as a
    /// fresh job would: every per-run field is reset — `attempts: 0`, no `lease`, and
    /// no `stalls`, `snoozes`, `progress`, `result` or `finished_at` (so `max_stalls`
    /// and `max_attempts` count from zero again), and a follow-up dropped when the job
    /// died stays dropped (no `follow_up`). Its history is kept: `last_error` (why it
    /// died), `created_at`, `follow_ups`, and `settled` (the proof a worker's read-back
    /// may still need). A dead job whose dedupe key is taken by an unfinished job (a
    /// newer one, or another dead job of the key revived by this same call) stays dead.
    /// Returns how many were revived: exactly the jobs this call moved to `ready`.
    ///
    /// The jobs are revived one statement per job (`{_id, state: "dead", queue}`),
    /// sent as unordered `update` commands of up to 1,000 statements, after one
    /// read of the dead jobs' ids when `ids` is `None`. A statement refused with a
    /// duplicate key is skipped; the others apply and are counted by the server's
    /// `nModified`. (Until session 19 one `updateMany` did it, and on a duplicate key
    /// revived the jobs still dead one by one, counting only those: MongoDB's
    /// multi-update stops at the first failing document and keeps, without reporting
    /// them, the documents it updated before, so those were revived but not counted.)
    ///
    /// # Errors
    /// [`Error::Malformed`] naming a job whose revival the server refused for another
    /// reason than a duplicate key (a hand edit, a validator); a database error. The
    /// commands sent before either stay applied.
    pub async fn retry_dead(&self, ids: Option<&[ObjectId]>) -> Result<u64> {
        let now = self.inner.time.now().await?.estimate();
        let ids: Vec<ObjectId> = match ids {
            Some(ids) => ids.to_vec(),
            None => {
                self.ids_where(
                    doc! { field::STATE: JobState::Dead.as_str(), field::QUEUE: self.queue_value() },
                )
                .await?
            }
        };
        let update = retry_update(now);
        let mut revived = 0;
        for chunk in ids.chunks(RETRY_BATCH) {
            revived += self.revive_each(chunk, &update).await?;
        }
        Ok(revived)
    }

    /// The ids of the jobs matching `filter` (one `find` with an `_id` projection).
    pub(super) async fn ids_where(&self, filter: Document) -> Result<Vec<ObjectId>> {
        Ok(self
            .inner
            .coll
            .find(filter)
            .projection(doc! { field::ID: 1 })
            .await?
            .try_collect::<Vec<Document>>()
            .await?
            .iter()
            .filter_map(|d| d.get_object_id(field::ID).ok())
            .collect())
    }

    /// Sends one statement per job of `ids` (`{_id, state: "dead", queue}` → `update`)
    /// as one unordered `update` command with the collection's write concern; returns
    /// the server's `nModified`. A statement refused with a duplicate key is skipped (the
    /// job stays dead); any other refusal is an error naming its job.
    async fn revive_each(&self, ids: &[ObjectId], update: &Document) -> Result<u64> {
        let coll = &self.inner.coll;
        let statements: Vec<Document> = ids
            .iter()
            .map(|id| {
                doc! {
                    "q": {
                        field::ID: id,
                        field::STATE: JobState::Dead.as_str(),
                        field::QUEUE: self.queue_value(),
                    },
                    "u": update.clone(),
                }
            })
            .collect();
        let reply = super::bulk::unordered_update(coll, statements).await?;
        if let Some(r) = reply
            .refused
            .iter()
            .find(|r| i64::from(r.code) != DUPLICATE_KEY)
        {
            return Err(Error::Malformed {
                id: ids.get(r.index).map(|id| id.to_hex()).unwrap_or_default(),
                reason: format!(
                    "the retry of the dead job was refused (code {}): {}",
                    r.code, r.message
                ),
            });
        }
        Ok(reply.modified)
    }

    /// Cancels an unfinished job of this handle's queue: one conditional write, `{_id,
    /// state: unfinished, queue}` → `cancelled` (the lease, and so its token, is kept).
    /// A job of another queue of the collection is [`CancelOutcome::NotFound`] and is
    /// left alone, as for every other operation of the handle: open a handle on its
    /// queue ([`JobQueue::named`]) to cancel it. A running job loses its
    /// lease at once: its worker's later transitions (completion, failure, snooze,
    /// progress) match nothing and fail with [`Error::LeaseLost`]. A docwarden
    /// [`Worker`](super::Worker) running it notices at its next heartbeat, or at once on
    /// the change-stream event, and signals the handler through
    /// [`ClaimedJob::cancellation`](super::ClaimedJob::cancellation).
    ///
    /// # Errors
    /// [`Error::Malformed`] if the job's stored `state` is not a docwarden state (a hand
    /// edit; nothing is cancelled); a database error.
    pub async fn cancel(&self, id: ObjectId) -> Result<CancelOutcome> {
        let now = self.inner.time.now().await?.estimate();
        let before = self
            .inner
            .coll
            .find_one_and_update(
                doc! {
                    field::ID: id,
                    field::STATE: { "$in": unfinished_states() },
                    field::QUEUE: self.queue_value(),
                },
                doc! { "$set": {
                    field::STATE: JobState::Cancelled.as_str(),
                    field::LAST_ERROR: CANCELLED_REASON,
                    field::FINISHED_AT: now,
                    field::UPDATED_AT: now,
                } },
            )
            .return_document(ReturnDocument::Before)
            .projection(doc! { field::STATE: 1 })
            .await?;
        let state_of = |d: &Document| {
            d.get_str(field::STATE)
                .ok()
                .and_then(JobState::parse)
                .unwrap_or(JobState::Ready)
        };
        if let Some(d) = before {
            return Ok(CancelOutcome::Cancelled { was: state_of(&d) });
        }
        // Read as the write above saw the job: a stale read would say `NotFound` for a job
        // just enqueued, or name a state it has left.
        let (primary, local) = super::latest();
        match self
            .inner
            .coll
            .find_one(doc! { field::ID: id, field::QUEUE: self.queue_value() })
            .projection(doc! { field::STATE: 1 })
            .selection_criteria(primary)
            .read_concern(local)
            .await?
        {
            // A state docwarden never writes (a hand edit) is neither finished nor
            // cancellable: say so instead of naming a state the job is not in.
            Some(d) => match d.get_str(field::STATE).ok().and_then(JobState::parse) {
                Some(state) => Ok(CancelOutcome::AlreadyFinished(state)),
                None => Err(Error::Malformed {
                    id: id.to_hex(),
                    reason: format!(
                        "`{}` is {}, not a docwarden job state; nothing was cancelled",
                        field::STATE,
                        match d.get(field::STATE) {
                            Some(Bson::String(s)) => format!("{s:?}"),
                            other => crate::lock::collection::describe(other).to_owned(),
                        }
                    ),
                }),
            },
            None => Ok(CancelOutcome::NotFound),
        }
    }

    /// Deletes finished jobs (succeeded, dead, cancelled) that finished more than
    /// `older_than` ago. Returns how many were deleted.
    ///
    /// The deletion goes in batches of [`PURGE_BATCH`] jobs: a read of their ids on the
    /// `state, finished_at` index, then one `deleteMany` by those ids that checks the state
    /// and age again. No single statement deletes millions of documents, so workers keep
    /// writing between batches (the embedded server runs a collection's writes one at a
    /// time; MongoDB replicates each batch before the next). A job retried in between
    /// (`retry_dead`) is not deleted. A purge stopped half way has deleted whole batches.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a zero duration; a database error (the batches
    /// deleted before it stay deleted).
    pub async fn purge(&self, older_than: Duration) -> Result<u64> {
        let ms = validate::duration_ms("purge age", older_than)?;
        let now = self.inner.time.now().await?;
        let cutoff = mongodb::bson::DateTime::from_millis(now.estimate_ms.saturating_sub(ms));
        let finished = doc! {
            field::STATE: { "$in": finished_states() },
            field::FINISHED_AT: { "$lt": cutoff },
            field::QUEUE: self.queue_value(),
        };
        let mut deleted = 0;
        loop {
            let ids: Vec<Bson> = self
                .inner
                .coll
                .find(finished.clone())
                .projection(doc! { field::ID: 1 })
                .limit(PURGE_BATCH)
                .await?
                .try_collect::<Vec<Document>>()
                .await?
                .into_iter()
                .filter_map(|mut d| d.remove(field::ID))
                .collect();
            if ids.is_empty() {
                break;
            }
            let full = i64::try_from(ids.len()).unwrap_or(i64::MAX) >= PURGE_BATCH;
            let r = self
                .inner
                .coll
                .delete_many(doc! { "$and": [
                    { field::ID: { "$in": ids } },
                    finished.clone(),
                ] })
                .await?;
            deleted += r.deleted_count;
            // A batch that deleted nothing changed under us entirely (retried): stop
            // rather than read it again.
            if !full || r.deleted_count == 0 {
                break;
            }
        }
        Ok(deleted)
    }

    /// The server's `explain` (queryPlanner) of the claim as sent — the find equivalent
    /// of the claim's filter, sort and hint, and the `findAndModify` a single claim
    /// sends. Tests assert the winning plans use [`index::CLAIM`].
    ///
    /// # Errors
    /// A database error.
    pub async fn explain_claim(&self) -> Result<(Document, Document)> {
        self.explain_claim_with(true).await
    }

    /// Like [`JobQueue::explain_claim`] but without the hint: the plans the server's
    /// planner picks on its own for the claim's filter and sort (MongoDB picks
    /// [`index::CLAIM`], whose partial filter the claim filter implies; see
    /// `docs/queue.md` for what the embedded surrogate picks).
    ///
    /// # Errors
    /// A database error.
    pub async fn explain_claim_unhinted(&self) -> Result<(Document, Document)> {
        self.explain_claim_with(false).await
    }

    async fn explain_claim_with(&self, hinted: bool) -> Result<(Document, Document)> {
        self.ensure_single_claim_index().await?;
        let now = self.inner.time.now().await?;
        let db = self
            .inner
            .coll
            .client()
            .database(&self.inner.coll.namespace().db);
        let name = self.inner.coll.name();
        let mut find = doc! {
            "find": name,
            "filter": self.due_filter(&now),
            "sort": Self::claim_sort(),
            "limit": 1,
        };
        let mut fam = doc! {
            "findAndModify": name,
            "query": self.due_filter(&now),
            "sort": Self::claim_sort(),
            "update": { "$set": { "explain": true } },
        };
        if hinted {
            find.insert("hint", index::CLAIM);
            fam.insert("hint", index::CLAIM);
        }
        let find = db
            .run_command(doc! { "explain": find, "verbosity": "queryPlanner" })
            .await?;
        let fam = db
            .run_command(doc! { "explain": fam, "verbosity": "queryPlanner" })
            .await?;
        Ok((find, fam))
    }
}
