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
use mongodb::options::IndexOptions;
use mongodb::{Collection, Database, IndexModel};

use crate::clock::TimeSource;
use crate::error::{Error, Result};
use crate::validate;

mod bulk;
mod claim;
mod control;
mod enqueue;
pub(crate) mod job;
mod limit;
mod malformed;
mod ops;
mod options;
mod rate;
mod schedule;
mod schedulers;
pub(crate) mod transition;
mod wakes;
mod worker;

pub use crate::token::JobToken;
pub use control::{PauseOutcome, QueueControl};
pub use enqueue::Enqueued;
pub use job::{ClaimedJob, Job, JobLease, JobState};
pub use limit::{JobLimits, LimitOptions, fairness_partition};
pub use ops::{CancelOutcome, JobListFilter, PURGE_BATCH, QueueStats};
#[doc(hidden)]
pub use options::Safeguard;
pub use options::{
    ClaimStrategy, EnqueueOptions, MAX_CONCURRENCY, MAX_PARTITIONS, MAX_QUEUE_NAME_LEN,
    MAX_WORKER_NAME_LEN, QueueOptions, RunAt, WorkerOptions,
};
// Issue 15, job lifecycle: uniqueness policies, snooze, progress and result limits.
pub use options::OnDuplicate;
pub use rate::RateRecord;
pub use schedule::{
    MAX_CATCH_UP, MissedTicks, Schedule, ScheduleSpec, Scheduled, Scheduler, SchedulerReport,
    TickOutcome, tick_job_id,
};
pub use transition::FailOutcome;
pub use transition::{MAX_PROGRESS_BYTES, MAX_RESULT_BYTES, Snooze, snooze};
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
    pub use crate::format::schedule::*;
}

/// Index names, so `explain` output and `docs/queue.md` can refer to them.
pub mod index {
    /// Due jobs of one queue in claim order: `{queue: 1, priority: -1, run_at: 1}`
    /// (format 3: the queue name, an equality, first), partial on
    /// `state ∈ {ready, retrying}`, read by single claims only. Created by a handle's
    /// first single claim, not when the queue is opened (since session 25, see
    /// [`JobQueue::ensure_single_claim_index`](super::JobQueue::ensure_single_claim_index)).
    /// Format 2 named it `docwarden_claim` without `queue` (see [`LEGACY`]).
    pub const CLAIM: &str = "docwarden_claim_q";
    /// Due jobs by queue and partition in claim order: `{state: 1, queue: 1, partition:
    /// 1, priority: -1, run_at: 1}` (equality fields, then the sort, then the range),
    /// partial on `state` in the string range `[ready, retrying]` (the claimable states,
    /// see [`crate::format::job::CLAIMABLE_LOW`]). A batch claim asks `{$or: [{state:
    /// "ready", queue: q, partition: {$in: ps}}, {state: "retrying", queue: q,
    /// partition: {$in: ps}}], run_at: {$lte: now}}`, which every server answers from
    /// this index's prefixes (`q` is `null` for the default queue: its jobs carry no
    /// `queue` field). Format 2 named it `docwarden_claim_partition` without `queue`.
    pub const CLAIM_PARTITION: &str = "docwarden_claim_partition_q";
    /// The claim indexes of format 2 (without `queue`). `ensure_indexes` leaves them in
    /// place, since workers of format 2 still hint them; drop them once every worker
    /// runs format 3 (`docs/queue.md`, "Upgrading to format 3").
    pub const LEGACY: [&str; 2] = ["docwarden_claim", "docwarden_claim_partition"];
    /// Running jobs by lease expiry: `{"lease.until": 1}`, partial on `state: running`.
    pub const LEASE_EXPIRY: &str = "docwarden_lease_expiry";
    /// Running jobs by token: `{"lease.token": 1}`, partial on `state: running`. Created
    /// up to format 2 only: from format 3 the claimed jobs are read back by `_id` (and
    /// the single claim of [`ClaimStrategy::UpdateThenFetch`](super::ClaimStrategy) by
    /// its exact `lease.until`), so every job no longer pays two entries in it. An
    /// existing one may be dropped once no worker of format 2 runs (see `docs/queue.md`).
    pub const LEASE_TOKEN: &str = "docwarden_lease_token";
    /// At most one unfinished job per dedupe key: unique `{dedupe_key: 1}`, partial on
    /// an existing key and an unfinished state.
    pub const DEDUPE: &str = "docwarden_dedupe";
    /// Purge of finished jobs: `{state: 1, finished_at: 1}`, partial on the finished
    /// states (so it never competes with the claim index).
    pub const STATE: &str = "docwarden_state";
    /// At most one job per key per uniqueness window: unique `{unique_slot: 1}`, partial
    /// on an existing slot, every state (issue 15).
    pub const UNIQUE_SLOT: &str = "docwarden_unique_slot";
}

/// The options document other workers read (`docs/queue.md`, "The options document").
pub mod meta {
    /// Suffix of the collection holding the queue's options document: the options of
    /// queue `jobs` are in `jobs.meta`.
    pub const COLLECTION_SUFFIX: &str = ".meta";
    /// `_id` of the options document.
    pub const OPTIONS_ID: &str = "options";
    /// Version of the job and options document formats described in `docs/queue.md`
    /// (2: jobs carry a `partition`; jobs of format 1, without one, stay claimable;
    /// 3: no `docwarden_lease_token` index (claimed jobs are read back by `_id`); named
    /// queues — jobs carry a `queue` (absent for the default queue), the claim indexes
    /// start with it, each named queue has its own options document
    /// `options:<queue>` and control document `control:<queue>` (pause) in the meta
    /// collection, and schedules live in `<collection>.schedules`).
    pub const FORMAT: i64 = 3;
}

#[derive(Debug)]
struct Inner {
    /// The `queue` label of this handle's metrics ([`JobQueue::metrics_label`]).
    label: String,
    coll: Collection<Document>,
    meta: Collection<Document>,
    time: TimeSource,
    options: QueueOptions,
    ttl_ms: i64,
    last_reap: Mutex<Option<Instant>>,
    /// Where the claims' sweep of waiting jobs that no claim can take is: the next
    /// partition it reads, and when (`queue/malformed.rs`).
    malformed_sweep: Mutex<malformed::SweepCursor>,
    /// The problem last logged per schedule document (`_id` → reason) by this handle's
    /// scheduler passes: a schedule that cannot tick is logged once as a warning, and
    /// again only when its problem changes or after it ticked (`queue/schedule.rs`).
    schedule_problems: Mutex<std::collections::HashMap<String, String>>,
    /// The next partition a batch claim of this handle reads (rotating).
    next_partition: AtomicU32,
    /// How many partitions one batch claim reads (adapts to the backlog).
    span: AtomicU32,
    /// Batch claims in a row that found a full batch at the current span.
    span_full: AtomicU32,
    /// The span the last short batch claim says would hold a full batch (0: unknown).
    span_hint: AtomicU32,
    /// Concurrency and rate limits: semaphores, rate documents, permits held (`queue/limit.rs`).
    limits: limit::Limits,
    /// The job events this handle's idle workers have taken (`queue/wakes.rs`).
    wakes: wakes::WakeLedger,
    /// Set once this handle has created the single claim's index
    /// ([`JobQueue::ensure_single_claim_index`]).
    single_claim_index: tokio::sync::OnceCell<()>,
}

/// A handle on one queue (one collection). Cheap to clone.
#[derive(Clone, Debug)]
pub struct JobQueue {
    inner: Arc<Inner>,
}

/// `filter` restricted to the jobs whose `queue` is `queue` (`None`: every job of the
/// collection), for the filters that serve one queue and the counts of every queue.
pub(crate) fn in_queue(mut filter: Document, queue: Option<mongodb::bson::Bson>) -> Document {
    if let Some(q) = queue {
        filter.insert(field::QUEUE, q);
    }
    filter
}

impl JobQueue {
    /// A handle on `collection`, without touching the server. Call
    /// [`JobQueue::ensure_indexes`] and [`JobQueue::store_options`] once (or use
    /// [`JobQueue::open`], which does both). With [`QueueOptions::write_concern`] set,
    /// every write goes through `collection` with that write concern (its read concern
    /// and read preference are kept, except for the reads that decide an outcome — a
    /// claim reading its own jobs, the read-back of a short bulk — which always read the
    /// primary's latest data).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] if the options are invalid, or the collection's name is not
    /// a queue's ([`validate::queue_collection_name`]: it ends in the suffix of a queue's
    /// side collection, such as `.meta`).
    pub fn new(
        collection: Collection<Document>,
        time: TimeSource,
        options: QueueOptions,
    ) -> Result<Self> {
        validate::queue_collection_name("queue collection", collection.name())?;
        options.validate()?;
        let ttl_ms = validate::duration_ms("lease ttl", options.lease_ttl)?;
        let db = collection.client().database(&collection.namespace().db);
        let coll_options =
            crate::lock::collection::inherited_options(&collection, options.write_concern.clone());
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
                label: match &options.queue {
                    Some(q) => format!("{}/{q}", collection.name()),
                    None => collection.name().to_owned(),
                },
                limits,
                coll: collection,
                meta,
                time,
                ttl_ms,
                last_reap: Mutex::new(None),
                malformed_sweep: Mutex::new(malformed::SweepCursor::new(options.partitions)),
                schedule_problems: Mutex::new(std::collections::HashMap::new()),
                wakes: wakes::WakeLedger::default(),
                single_claim_index: tokio::sync::OnceCell::new(),
                next_partition: AtomicU32::new(rand::random_range(0..options.partitions)),
                span: AtomicU32::new(1),
                span_full: AtomicU32::new(0),
                span_hint: AtomicU32::new(0),
                options,
            }),
        })
    }

    /// A handle on collection `name` of `db`, with its indexes created and its options
    /// stored for other workers ([`JobQueue::store_options`]).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad name (one ending in the suffix of a queue's side
    /// collection — `.meta`, `.schedules`, `.rates`, `.limits`, `.limits.tokens` — among
    /// them, see [`validate::queue_collection_name`]; nothing is created) or options;
    /// [`Error::Incompatible`] for a server older than MongoDB 6.0 or a collection with a
    /// non-simple default collation (see [`crate::preflight`]); a database error if the
    /// indexes cannot be created or the options document cannot be written.
    pub async fn open(
        db: &Database,
        name: &str,
        time: TimeSource,
        options: QueueOptions,
    ) -> Result<Self> {
        validate::queue_collection_name("queue collection", name)?;
        let queue = Self::new(db.collection(name), time, options)?;
        crate::preflight::check(queue.collection()).await?;
        queue.ensure_indexes().await?;
        queue.store_options().await?;
        Ok(queue)
    }

    /// The `queue` label of this queue's metrics (`docs/observability.md`): the
    /// collection's name for its default queue, `<collection>/<queue>` for a named queue.
    pub fn metrics_label(&self) -> &str {
        &self.inner.label
    }

    /// Takes the change-stream event of job `id` for an idle worker of this handle:
    /// `true` for the first worker to ask (`queue/wakes.rs`).
    pub(crate) fn take_wake(&self, id: &mongodb::bson::Bson) -> bool {
        self.inner.wakes.take(id)
    }

    /// The name of this handle's queue (`"default"` for the default queue).
    pub fn queue_name(&self) -> &str {
        self.inner
            .options
            .queue
            .as_deref()
            .unwrap_or(crate::format::schedule::DEFAULT_QUEUE)
    }

    /// A handle on another named queue of the same collection, with the same time
    /// source and `options` (validated); `"default"` is the default queue. Call
    /// [`JobQueue::store_options`] on it to publish its options.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad name or options.
    pub fn named(&self, queue: &str, options: QueueOptions) -> Result<JobQueue> {
        JobQueue::new(
            self.inner.coll.clone(),
            self.inner.time.clone(),
            options.queue(queue),
        )
    }

    /// The value of the job's `queue` field for this handle's queue: `null` for the
    /// default queue (which matches the absent field too), the name otherwise.
    pub(crate) fn queue_value(&self) -> mongodb::bson::Bson {
        match &self.inner.options.queue {
            Some(q) => mongodb::bson::Bson::String(q.clone()),
            None => mongodb::bson::Bson::Null,
        }
    }

    /// The meta collection (`<collection>.meta`: options and control documents).
    pub(crate) fn meta(&self) -> &Collection<Document> {
        &self.inner.meta
    }

    /// `_id` of this queue's options document: `options` for the default queue,
    /// `options:<queue>` for a named one.
    fn options_id(queue: Option<&str>) -> String {
        match queue {
            None => meta::OPTIONS_ID.to_owned(),
            Some(q) => format!("{}{q}", crate::format::schedule::OPTIONS_ID_PREFIX),
        }
    }

    /// The options document: what a worker in another language needs to behave like
    /// this handle (lease TTL, retry delays, sweep cut-off margin, default attempts).
    pub fn options_document(&self) -> Document {
        let o = &self.inner.options;
        let ms = |d: std::time::Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        doc! {
            field::ID: Self::options_id(o.queue.as_deref()),
            field::QUEUE: self.queue_name(),
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
            .replace_one(
                doc! { field::ID: Self::options_id(self.inner.options.queue.as_deref()) },
                d,
            )
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
        Self::stored_options_of(db, name, crate::format::schedule::DEFAULT_QUEUE).await
    }

    /// The options document stored for the named queue `queue` of collection `name`
    /// (`"default"`: the default queue), if any.
    ///
    /// # Errors
    /// A database error.
    pub async fn stored_options_of(
        db: &Database,
        name: &str,
        queue: &str,
    ) -> Result<Option<Document>> {
        let queue = (queue != crate::format::schedule::DEFAULT_QUEUE).then_some(queue);
        Ok(db
            .collection::<Document>(&format!("{name}{}", meta::COLLECTION_SUFFIX))
            .find_one(doc! { field::ID: Self::options_id(queue) })
            .await?)
    }

    /// Creates the queue's indexes (idempotent), except the single claim's
    /// ([`index::CLAIM`]), which the first single claim of a handle creates
    /// ([`JobQueue::ensure_single_claim_index`]).
    ///
    /// # Errors
    /// A database error.
    pub async fn ensure_indexes(&self) -> Result<()> {
        let running = doc! { field::STATE: job::JobState::Running.as_str() };
        let models = vec![
            IndexModel::builder()
                .keys(doc! {
                    field::STATE: 1,
                    field::QUEUE: 1,
                    field::PARTITION: 1,
                    field::PRIORITY: -1,
                    field::RUN_AT: 1,
                })
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
            enqueue::unique_slot_index(),
        ];
        self.inner.coll.create_indexes(models).await?;
        Ok(())
    }

    /// Creates the single claim's index ([`index::CLAIM`]) if this handle has not yet
    /// (idempotent; one `createIndexes` per handle). [`JobQueue::claim`] (and a `Worker`
    /// with a batch size of 1) calls it before its first claim; call it at startup to
    /// build the index before the first single claim waits for it on a large backlog.
    ///
    /// Only single claims read that index: batch claims, and so the default `Worker`,
    /// read the partition index. Every index costs every write of a job that enters or
    /// leaves it, so a queue that never claims one job at a time does not keep it (on the
    /// embedded server it was 8 % of a job's two writes, `docs/benchmarks.md`, session
    /// 24). A queue created before session 25 keeps the index it has.
    ///
    /// # Errors
    /// A database error.
    pub async fn ensure_single_claim_index(&self) -> Result<()> {
        self.inner
            .single_claim_index
            .get_or_try_init(|| async {
                let model = IndexModel::builder()
                    .keys(doc! { field::QUEUE: 1, field::PRIORITY: -1, field::RUN_AT: 1 })
                    .options(
                        IndexOptions::builder()
                            .name(index::CLAIM.to_owned())
                            .partial_filter_expression(
                                doc! { field::STATE: { "$in": claimable_states() } },
                            )
                            .build(),
                    )
                    .build();
                self.inner.coll.create_index(model).await.map(|_| ())
            })
            .await?;
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

    /// The job with this id, parsed, if it is a job of this handle's queue: a job of
    /// another queue of the collection is `None`, as a missing one is (a handle only
    /// ever reads and changes its own queue's jobs, like BullMQ's `Queue.getJob`).
    ///
    /// # Errors
    /// [`Error::Malformed`] if the stored document does not parse; a database error.
    pub async fn get(&self, id: mongodb::bson::oid::ObjectId) -> Result<Option<Job>> {
        match self
            .inner
            .coll
            .find_one(doc! { field::ID: id, field::QUEUE: self.queue_value() })
            .await?
        {
            Some(d) => Job::from_document(&d).map(Some),
            None => Ok(None),
        }
    }
}

/// Where a read that decides an outcome goes: the primary, read concern `local` — the
/// latest data, as the fenced write it follows saw it — whatever the collection's read
/// preference and read concern. A secondary, or a `majority` snapshot, can predate the
/// write that took a lease away (a heartbeat's read-back would find the job still held
/// while another worker runs it), or the claim just written (a claim would miss its own
/// jobs, left `running` unheld until their lease expires).
fn latest() -> (
    mongodb::options::SelectionCriteria,
    mongodb::options::ReadConcern,
) {
    (
        mongodb::options::SelectionCriteria::ReadPreference(
            mongodb::options::ReadPreference::Primary,
        ),
        mongodb::options::ReadConcern::local(),
    )
}

fn lease_lost(id: &mongodb::bson::Bson, token: &JobToken) -> Error {
    Error::LeaseLost {
        resource: job::render_id(id),
        token: token.clone().into(),
    }
}
