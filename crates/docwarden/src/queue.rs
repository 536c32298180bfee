//! A job queue in a MongoDB collection: skip-locked claims, leases, fenced completion.
//!
//! **Guarantee:** a job is held by at most one claim at a time. A claim is one atomic
//! single-document update (or a bulk of them, re-checked per document) that writes a
//! lease `{owner, token, until}` with a fresh 128-bit token and an expiry computed from
//! the server's clock ([`TimeSource`]). Every later transition — heartbeat, complete,
//! fail, release, cancel — matches `{_id, state: "running", "lease.token": token}`, so a
//! worker that paused past its lease, or was cut off, cannot overwrite the job after
//! someone else took it: it gets [`Error::LeaseLost`] and nothing is written.
//!
//! **Limits:** delivery is at least once. A handler whose lease expired may still have
//! performed external side effects before its fenced completion is refused; make them
//! idempotent, or fence them with [`crate::lock::Fence::apply`] (a [`ClaimedJob`] is a
//! [`crate::lock::Fenced`] holder: it fences the job document, "still running under my
//! claim token", and gets [`crate::lock::FenceOutcome::Lost`] once the claim is lost). Expired leases are re-claimable after `lease_ttl` plus the clock bound and
//! skew margin. A job an operator edited into a shape the filters cannot match (a
//! `lease.until` or `run_at` that is not a date) is recovered or moved to `dead` by the
//! sweep and counted by [`JobQueue::stats`]. Writes use [`QueueOptions::write_concern`]
//! (majority on replica sets, or a failover can roll back a claim or a completion).
//! The job document format, and the options document `open` stores in
//! `<collection>.meta` for workers in other languages, are in `docs/queue.md`.
//!
//! ```no_run
//! # async fn example(db: mongodb::Database) -> docwarden::Result<()> {
//! use docwarden::clock::{ClockOptions, TimeSource};
//! use docwarden::queue::{EnqueueOptions, JobQueue, QueueOptions};
//! let time = TimeSource::server(db.client().clone(), ClockOptions::default())?;
//! let queue = JobQueue::open(&db, "jobs", time, QueueOptions::default()).await?;
//! queue.enqueue(mongodb::bson::doc! { "ip": "8.8.8.8" }, &EnqueueOptions::default()).await?;
//! if let Some(job) = queue.claim("worker-1").await? {
//!     queue.complete(&job, mongodb::bson::Bson::Null).await?;
//! }
//! # Ok(()) }
//! ```

use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use mongodb::bson::{Document, doc};
use mongodb::options::{CollectionOptions, IndexOptions};
use mongodb::{Collection, Database, IndexModel};

use crate::clock::TimeSource;
use crate::error::{Error, Result};
use crate::validate;

mod claim;
mod enqueue;
pub(crate) mod job;
mod limit;
mod ops;
mod options;
mod rate;
mod transition;
mod worker;

pub use crate::token::JobToken;
pub use enqueue::Enqueued;
pub use job::{ClaimedJob, Job, JobLease, JobState};
pub use limit::{JobLimits, LimitOptions, fairness_partition};
pub use ops::{CancelOutcome, JobListFilter, QueueStats};
#[doc(hidden)]
pub use options::Safeguard;
pub use options::{
    ClaimStrategy, EnqueueOptions, MAX_PARTITIONS, QueueOptions, RunAt, WorkerOptions,
};
pub use rate::RateRecord;
pub use transition::FailOutcome;
pub use worker::{HandlerResult, Worker, WorkerReport};

use job::{claimable_states, field, unfinished_states};

/// The stored job format, typed, for tools and workers in other languages (see
/// `docs/queue.md`): every field name ([`format::field`]), the states
/// ([`format::JobState`], [`JobState::as_str`] / [`JobState::parse`]), the index names and
/// the options document. No literal of a stored field name or state lives outside this
/// module: code outside the library (the CLI, `check`) goes through these constants.
pub mod format {
    pub use super::{index, meta};
    pub use crate::format::job::*;
}

/// Index names, so `explain` output and `docs/queue.md` can refer to them.
pub mod index {
    /// Due jobs in claim order: `{priority: -1, run_at: 1}`, partial on
    /// `state ∈ {ready, retrying}`.
    pub const CLAIM: &str = "docwarden_claim";
    /// Due jobs by partition in claim order: `{state: 1, partition: 1, priority: -1,
    /// run_at: 1}` (equality fields, then the sort, then the range), partial on `state`
    /// in the string range `[ready, retrying]` (the claimable states, see
    /// [`crate::format::job::CLAIMABLE_LOW`]). A batch claim asks `{$or: [{state:
    /// "ready", partition: {$in: ps}}, {state: "retrying", partition: {$in: ps}}],
    /// run_at: {$lte: now}}`, which every server answers from this index's prefixes.
    pub const CLAIM_PARTITION: &str = "docwarden_claim_partition";
    /// Running jobs by lease expiry: `{"lease.until": 1}`, partial on `state: running`.
    pub const LEASE_EXPIRY: &str = "docwarden_lease_expiry";
    /// Running jobs by token (fetch after a claim): `{"lease.token": 1}`, partial on
    /// `state: running`.
    pub const LEASE_TOKEN: &str = "docwarden_lease_token";
    /// At most one unfinished job per dedupe key: unique `{dedupe_key: 1}`, partial on
    /// an existing key and an unfinished state.
    pub const DEDUPE: &str = "docwarden_dedupe";
    /// Purge of finished jobs: `{state: 1, finished_at: 1}`, partial on the finished
    /// states (so it never competes with the claim index).
    pub const STATE: &str = "docwarden_state";
}

/// The options document other workers read (`docs/queue.md`, "The options document").
pub mod meta {
    /// Suffix of the collection holding the queue's options document: the options of
    /// queue `jobs` are in `jobs.meta`.
    pub const COLLECTION_SUFFIX: &str = ".meta";
    /// `_id` of the options document.
    pub const OPTIONS_ID: &str = "options";
    /// Version of the job and options document formats described in `docs/queue.md`
    /// (2: jobs carry a `partition`; jobs of format 1, without one, stay claimable).
    pub const FORMAT: i64 = 2;
}

#[derive(Debug)]
struct Inner {
    coll: Collection<Document>,
    meta: Collection<Document>,
    time: TimeSource,
    options: QueueOptions,
    ttl_ms: i64,
    last_reap: Mutex<Option<Instant>>,
    /// When `maybe_reap` last ran the sweep of undatable jobs (a collection scan on
    /// servers that cannot bound `$not: {$type}`), run every `claim::UNDATABLE_SWEEP_EVERY`
    /// sweeps.
    last_undatable_sweep: Mutex<Option<Instant>>,
    /// The next partition a batch claim of this handle reads (rotating).
    next_partition: AtomicU32,
    /// How many partitions one batch claim reads (adapts to the backlog).
    span: AtomicU32,
    /// Concurrency and rate limits: semaphores, rate documents, permits held (`queue/limit.rs`).
    limits: limit::Limits,
}

/// A handle on one queue (one collection). Cheap to clone.
#[derive(Clone, Debug)]
pub struct JobQueue {
    inner: Arc<Inner>,
}

impl JobQueue {
    /// A handle on `collection`, without touching the server. Call
    /// [`JobQueue::ensure_indexes`] and [`JobQueue::store_options`] once (or use
    /// [`JobQueue::open`], which does both). With [`QueueOptions::write_concern`] set,
    /// every write goes through `collection` with that write concern (its read concern
    /// and read preference are kept).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] if the options are invalid.
    pub fn new(
        collection: Collection<Document>,
        time: TimeSource,
        options: QueueOptions,
    ) -> Result<Self> {
        validate::collection_name("queue collection", collection.name())?;
        options.validate()?;
        let ttl_ms = validate::duration_ms("lease ttl", options.lease_ttl)?;
        let db = collection.client().database(&collection.namespace().db);
        let coll_options = CollectionOptions::builder()
            .write_concern(
                options
                    .write_concern
                    .clone()
                    .or_else(|| collection.write_concern().cloned()),
            )
            .read_concern(collection.read_concern().cloned())
            .selection_criteria(collection.selection_criteria().cloned())
            .build();
        let meta = db.collection_with_options(
            &format!("{}{}", collection.name(), meta::COLLECTION_SUFFIX),
            coll_options.clone(),
        );
        let collection = if options.write_concern.is_some() {
            db.collection_with_options(collection.name(), coll_options)
        } else {
            collection
        };
        let limits = limit::Limits::new(&collection, &time, &options)?;
        Ok(Self {
            inner: Arc::new(Inner {
                limits,
                coll: collection,
                meta,
                time,
                ttl_ms,
                last_reap: Mutex::new(None),
                last_undatable_sweep: Mutex::new(None),
                next_partition: AtomicU32::new(rand::random_range(0..options.partitions)),
                span: AtomicU32::new(1),
                options,
            }),
        })
    }

    /// A handle on collection `name` of `db`, with its indexes created and its options
    /// stored for other workers ([`JobQueue::store_options`]).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad name or options; [`Error::Incompatible`] for a
    /// server older than MongoDB 6.0 or a collection with a non-simple default collation
    /// (see [`crate::preflight`]); a database error if the indexes cannot be created or
    /// the options document cannot be written.
    pub async fn open(
        db: &Database,
        name: &str,
        time: TimeSource,
        options: QueueOptions,
    ) -> Result<Self> {
        validate::collection_name("queue collection", name)?;
        let queue = Self::new(db.collection(name), time, options)?;
        crate::preflight::check(queue.collection()).await?;
        queue.ensure_indexes().await?;
        queue.store_options().await?;
        Ok(queue)
    }

    /// The options document: what a worker in another language needs to behave like
    /// this handle (lease TTL, retry delays, sweep cut-off margin, default attempts).
    pub fn options_document(&self) -> Document {
        let o = &self.inner.options;
        let ms = |d: std::time::Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        doc! {
            field::ID: meta::OPTIONS_ID,
            "format": meta::FORMAT,
            "lease_ttl_ms": self.inner.ttl_ms,
            "max_attempts": i64::from(o.max_attempts),
            "retry_base_ms": ms(o.retry_base),
            "retry_max_ms": ms(o.retry_max),
            "retry_jitter": "equal",
            "reap_interval_ms": ms(o.reap_interval),
            "skew_margin_ms": self.inner.time.skew_margin_ms(),
            "partitions": i64::from(o.partitions),
        }
    }

    /// Writes [`JobQueue::options_document`] (plus `updated_at`, server time) to
    /// `<collection>.meta` under `_id: "options"`, replacing what an earlier handle
    /// stored: the last handle opened wins, so open every handle of one queue with the
    /// same options.
    ///
    /// # Errors
    /// A database error.
    pub async fn store_options(&self) -> Result<()> {
        let mut d = self.options_document();
        d.insert(field::UPDATED_AT, self.inner.time.now().await?.estimate());
        self.inner
            .meta
            .replace_one(doc! { field::ID: meta::OPTIONS_ID }, d)
            .upsert(true)
            .await?;
        Ok(())
    }

    /// The options document stored for queue `name` of `db`, if any (see
    /// [`JobQueue::store_options`]).
    ///
    /// # Errors
    /// A database error.
    pub async fn stored_options(db: &Database, name: &str) -> Result<Option<Document>> {
        Ok(db
            .collection::<Document>(&format!("{name}{}", meta::COLLECTION_SUFFIX))
            .find_one(doc! { field::ID: meta::OPTIONS_ID })
            .await?)
    }

    /// Creates the queue's indexes (idempotent).
    ///
    /// # Errors
    /// A database error.
    pub async fn ensure_indexes(&self) -> Result<()> {
        let running = doc! { field::STATE: job::JobState::Running.as_str() };
        let models = vec![
            IndexModel::builder()
                .keys(doc! { field::PRIORITY: -1, field::RUN_AT: 1 })
                .options(
                    IndexOptions::builder()
                        .name(index::CLAIM.to_owned())
                        .partial_filter_expression(
                            doc! { field::STATE: { "$in": claimable_states() } },
                        )
                        .build(),
                )
                .build(),
            IndexModel::builder()
                .keys(doc! { field::STATE: 1, field::PARTITION: 1, field::PRIORITY: -1, field::RUN_AT: 1 })
                .options(
                    IndexOptions::builder()
                        .name(index::CLAIM_PARTITION.to_owned())
                        .partial_filter_expression(doc! { field::STATE: {
                            "$gte": crate::format::job::CLAIMABLE_LOW,
                            "$lte": crate::format::job::CLAIMABLE_HIGH,
                        } })
                        .build(),
                )
                .build(),
            IndexModel::builder()
                .keys(doc! { field::LEASE_UNTIL: 1 })
                .options(
                    IndexOptions::builder()
                        .name(index::LEASE_EXPIRY.to_owned())
                        .partial_filter_expression(running.clone())
                        .build(),
                )
                .build(),
            IndexModel::builder()
                .keys(doc! { field::LEASE_TOKEN: 1 })
                .options(
                    IndexOptions::builder()
                        .name(index::LEASE_TOKEN.to_owned())
                        .partial_filter_expression(running)
                        .build(),
                )
                .build(),
            IndexModel::builder()
                .keys(doc! { field::DEDUPE_KEY: 1 })
                .options(
                    IndexOptions::builder()
                        .name(index::DEDUPE.to_owned())
                        .unique(true)
                        .partial_filter_expression(doc! {
                            field::DEDUPE_KEY: { "$exists": true },
                            field::STATE: { "$in": unfinished_states() },
                        })
                        .build(),
                )
                .build(),
            IndexModel::builder()
                .keys(doc! { field::STATE: 1, field::FINISHED_AT: 1 })
                .options(
                    IndexOptions::builder()
                        .name(index::STATE.to_owned())
                        .partial_filter_expression(
                            doc! { field::STATE: { "$in": job::finished_states() } },
                        )
                        .build(),
                )
                .build(),
        ];
        self.inner.coll.create_indexes(models).await?;
        Ok(())
    }

    /// The collection holding the jobs.
    pub fn collection(&self) -> &Collection<Document> {
        &self.inner.coll
    }

    /// The time source leases are computed with.
    pub fn time(&self) -> &TimeSource {
        &self.inner.time
    }

    /// The options this handle was built with.
    pub fn options(&self) -> &QueueOptions {
        &self.inner.options
    }

    /// The job with this id, parsed.
    ///
    /// # Errors
    /// [`Error::Malformed`] if the stored document does not parse; a database error.
    pub async fn get(&self, id: mongodb::bson::oid::ObjectId) -> Result<Option<Job>> {
        match self.inner.coll.find_one(doc! { field::ID: id }).await? {
            Some(d) => Job::from_document(&d).map(Some),
            None => Ok(None),
        }
    }
}

fn lease_lost(id: &mongodb::bson::Bson, token: &JobToken) -> Error {
    Error::LeaseLost {
        resource: job::render_id(id),
        token: token.clone().into(),
    }
}
