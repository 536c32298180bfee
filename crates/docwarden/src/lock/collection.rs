//! The lock collection (seed 004's shape): one document per resource in `<name>`, and a
//! fencing-token counter per resource in `<name>.tokens` that no TTL index touches.
//!
//! **One write per acquire, one per release.** The lock document carries the current
//! `token` and a `ceiling`: the top of a block of tokens reserved for this resource in the
//! counter collection. An acquire is one atomic `findOneAndUpdate` upsert by `{_id:
//! resource}` whose one-stage pipeline, when the lock is free (`owner` null, `expires_at <
//! cutoff`, or `expires_at` not a date: `acquire_condition`), takes it and, while `token
//! < ceiling`, sets `token + 1` in the same write (the fast path); a held lock is left as
//! it is, and its post-image (another acquisition's nonce) answers `Ok(None)`. Release is
//! one `updateOne`.
//!
//! **The slow path** (a new or deleted lock document, an exhausted block, a `pending` nonce
//! an acquire left uncommitted, a hand-edited token) is the three steps of issue 11: the
//! same write stores a random `pending` nonce instead of a token; then one `$inc` on the
//! counter reserves the next block (`counter = max(counter, previous token) + block`),
//! raised above the lock document's previous token; then the block's first token and its
//! ceiling are committed into the lock document, compare-and-set on `(owner, pending
//! nonce)`. If the lease was taken over in between, the acquire reports `Ok(None)` and its
//! block is never used.
//!
//! **Why tokens still strictly increase** (across release, expiry, crashes and deletion of
//! the lock document): every token handed out is at most its document's `ceiling`, and a
//! ceiling is only ever written after the counter was raised to it, so every token handed out
//! is ≤ the counter at that moment; the counter never decreases. While the lock document
//! exists, its token is the last one handed out and the fast path hands out `token + 1`.
//! Once it is deleted, the next acquire takes the slow path and starts above the counter,
//! hence above every token handed out before. The assumption is the counter's: the
//! `<name>.tokens` collection is never deleted, edited down or rolled back (majority write
//! concern on a replica set). If it is lost *and* the lock document is deleted, tokens
//! restart from the block size and a fence may refuse a new holder's writes or accept an
//! old one's. No clock is involved in token order: a server clock that steps back changes
//! expiry decisions (see `docs/locks.md`), never tokens.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::options::{CollectionOptions, IndexOptions, ReturnDocument, WriteConcern};
use mongodb::{Collection, Database, IndexModel};
use tracing::instrument;

use super::deadline::{Deadline, Unanswered};
use super::landing;
use super::lease::{Lease, Owner};
use super::wake::Wake;
use crate::backoff::Backoff;
use crate::clock::{ServerTime, TimeSource};
use crate::error::{self, Error, Result};
use crate::format::lock::{collection as f, rwlock as rf};
use crate::token::FencingToken;
use crate::validate;

/// Name of the TTL index on `gc_at` that garbage-collects long-dead lock documents.
const GC_INDEX: &str = "gc_at_gc";

/// Name of the TTL index on `expires_at` of versions before session 17: it could delete a
/// read/write lock document whose readers were still inside (`docs/locks.md`), so
/// [`LockCollection::ensure_indexes`] drops it.
const OLD_GC_INDEX: &str = "expires_at_gc";

/// Tokens reserved per counter write (see the module docs): the first token of a resource
/// is 1, the first after a deletion of its lock document is above the previous block.
const TOKEN_BLOCK: i64 = 1_000_000;

/// The longest [`LockOptions::gc_after`]: MongoDB refuses a TTL index whose
/// `expireAfterSeconds` does not fit in a 32-bit integer (about 68 years).
pub const MAX_GC_AFTER: Duration = Duration::from_secs(i32::MAX as u64);

/// Options of a [`LockCollection`], validated once by [`LockCollection::new`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LockOptions {
    /// How long after `gc_at` (the latest lease expiry the document has carried) the TTL
    /// index may delete a lock document (garbage collection only; expiry itself is decided
    /// in the acquire's atomic write). Default 1 hour;
    /// at least one second and at most [`MAX_GC_AFTER`] (a TTL index's
    /// `expireAfterSeconds` is a 32-bit integer).
    pub gc_after: Duration,
    /// First delay of a blocking [`LockCollection::acquire`] retry. Default 5 ms.
    pub backoff_base: Duration,
    /// Largest delay between blocking acquire retries. Default 250 ms.
    pub backoff_max: Duration,
    /// Write concern for the lock and token collections; `None` (the default) inherits the
    /// database's. Use majority where a failover must not roll back an acquire or a token.
    pub write_concern: Option<WriteConcern>,
    /// Tokens reserved per counter write ([`TOKEN_BLOCK`]; test-only setter).
    token_block: i64,
    /// Test controls only: one safeguard switched off (see the `unsafe_*` setters).
    unsafe_control: UnsafeControl,
    /// Whether a blocking acquire listens for the release (`lock/wake.rs`); `false` only
    /// in tests that measure the backoff alone.
    wake: bool,
}

/// Which single safeguard a control run switches off. Never set outside tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum UnsafeControl {
    #[default]
    None,
    /// Every lock counts as expired: the acquire takes over held leases.
    IgnoreExpiry,
    /// The slow path takes the lock document's previous token + 1 (and reserves a block
    /// above it) without the counter collection.
    TokenInLockDocument,
    /// The TTL index garbage-collects by the holder's `expires_at` (the index before
    /// session 17) instead of `gc_at`.
    GcByHolderExpiry,
}

impl Default for LockOptions {
    fn default() -> Self {
        Self {
            gc_after: Duration::from_secs(3600),
            backoff_base: Duration::from_millis(5),
            backoff_max: Duration::from_millis(250),
            write_concern: None,
            token_block: TOKEN_BLOCK,
            unsafe_control: UnsafeControl::None,
            wake: true,
        }
    }
}

impl LockOptions {
    /// Sets [`LockOptions::gc_after`].
    pub fn gc_after(mut self, gc_after: Duration) -> Self {
        self.gc_after = gc_after;
        self
    }

    /// Sets [`LockOptions::backoff_base`] and [`LockOptions::backoff_max`].
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_max = max;
        self
    }

    /// Sets [`LockOptions::write_concern`] (for example [`WriteConcern::majority()`]).
    pub fn write_concern(mut self, write_concern: WriteConcern) -> Self {
        self.write_concern = Some(write_concern);
        self
    }

    /// Test controls only, **unsafe**: the acquire treats every lock as expired (its expiry
    /// check is off), so held leases are taken over. Shows what the check prevents.
    #[doc(hidden)]
    pub fn unsafe_ignore_expiry(mut self) -> Self {
        self.unsafe_control = UnsafeControl::IgnoreExpiry;
        self
    }

    /// Tokens reserved in the counter per slow-path acquire (default 1,000,000). With `1`
    /// every acquire takes the three-step slow path; tests use it to pause an acquire
    /// between its steps. Tokens stay strictly increasing with any block size ≥ 1.
    #[doc(hidden)]
    pub fn token_block(mut self, block: i64) -> Self {
        self.token_block = block;
        self
    }

    /// Test controls only, **unsafe**: the slow path takes the lock document's previous
    /// token + 1 instead of reserving a block from the counter collection, so deleting the
    /// lock document (what the TTL index does) resets the tokens. Shows what the counter
    /// prevents.
    #[doc(hidden)]
    pub fn unsafe_token_in_lock_document(mut self) -> Self {
        self.unsafe_control = UnsafeControl::TokenInLockDocument;
        self
    }

    /// Test controls only, **unsafe**: the TTL index collects lock documents `gc_after`
    /// after the holder's `expires_at` (the index of versions before session 17) instead
    /// of after `gc_at`, so a read/write lock document can be deleted with live readers
    /// inside. Shows what `gc_at` prevents.
    #[doc(hidden)]
    pub fn unsafe_gc_by_holder_expiry(mut self) -> Self {
        self.unsafe_control = UnsafeControl::GcByHolderExpiry;
        self
    }

    /// Test-only: a blocking acquire only backs off (no change-stream wake-up), to
    /// compare hand-off latencies.
    #[doc(hidden)]
    pub fn poll_only(mut self) -> Self {
        self.wake = false;
        self
    }

    fn validate(&self) -> Result<()> {
        let gc = validate::duration_ms("gc_after", self.gc_after)?;
        if gc < 1_000 {
            return Err(Error::invalid("gc_after", "must be at least one second"));
        }
        if self.gc_after > MAX_GC_AFTER {
            // Else `open` fails creating the TTL index (a bare database error).
            return Err(Error::invalid(
                "gc_after",
                format!(
                    "must be at most {} s (a TTL index's expireAfterSeconds is 32-bit)",
                    MAX_GC_AFTER.as_secs()
                ),
            ));
        }
        Backoff::new(self.backoff_base, self.backoff_max)?;
        if self.token_block < 1 {
            return Err(Error::invalid("token_block", "must be at least 1"));
        }
        Ok(())
    }
}

/// Which locks a listing returns: [`LockCollection::list`], and the same filter for
/// [`crate::lock::Election::list_matching`], [`crate::lock::RwLocks::list_matching`] and
/// [`crate::lock::Semaphore::list_matching`]. Empty: every held lock.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct LockListFilter {
    /// Only locks held by this owner id.
    pub owner: Option<String>,
    /// Only the lock on this resource.
    pub resource: Option<String>,
    /// At most this many locks, the first by resource (`None`: all of them).
    pub limit: Option<u64>,
}

impl LockListFilter {
    /// Only locks held by `owner`.
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = Some(owner.into());
        self
    }

    /// Only the lock on `resource`.
    pub fn resource(mut self, resource: impl Into<String>) -> Self {
        self.resource = Some(resource.into());
        self
    }

    /// At most `limit` locks, the first by resource. A listing for display should set
    /// one: with a lock per entity, a collection can hold many thousands of leases, and
    /// [`LockCollection::counts`] says how many there are in one small reply.
    pub fn limit(mut self, limit: u64) -> Self {
        self.limit = Some(limit);
        self
    }
}

/// The documents of `coll` matching `query`, by `_id`, at most `limit` (`None`: all of
/// them; `Some(0)`: none, and nothing is read, since the server's limit 0 means "no
/// limit"). Every lock kind's listing reads through this: leases
/// ([`LockCollection::list`]), elections, read/write locks, semaphores and document locks.
pub(crate) async fn listing(
    coll: &Collection<Document>,
    query: Document,
    projection: Option<Document>,
    limit: Option<u64>,
) -> Result<Vec<Document>> {
    let mut find = coll.find(query).sort(doc! { "_id": 1 });
    if let Some(projection) = projection {
        find = find.projection(projection);
    }
    match limit {
        Some(0) => return Ok(Vec::new()),
        // The server's limit 0 is none: so is one over i64::MAX.
        Some(limit) => find = find.limit(i64::try_from(limit).unwrap_or(0)),
        None => {}
    }
    Ok(find.await?.try_collect().await?)
}

/// How many locks a lock collection holds, from [`LockCollection::counts`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct LockCounts {
    /// Held locks that have not certainly expired (as [`LockRecord::expired`] says).
    pub held: u64,
    /// Lock documents that still name an owner but have certainly expired, or whose
    /// `expires_at` is not a date: the next acquire takes them over.
    pub expired: u64,
    /// Distinct owners among the held (not expired) locks.
    pub holders: u64,
}

/// A held lock as stored, for listing.
///
/// A lock document docwarden did not write (edited by hand) is listed too, with what is
/// wrong in [`LockRecord::malformed`]; fields that could not be read are `None`. A lock
/// whose `expires_at` is not a date counts as expired: any acquire takes it over.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LockRecord {
    /// The resource (the document's `_id`, shown as extended JSON if it is not a string).
    pub resource: String,
    /// The holder's owner id (shown as extended JSON if it is not a string).
    pub owner: String,
    /// The fencing token; `None` while an acquire is between its steps, or when the stored
    /// token is not an int64.
    pub token: Option<FencingToken>,
    /// When it was acquired (server time); `None` if the stored value is not a date.
    #[serde(serialize_with = "as_rfc3339")]
    pub acquired_at: Option<DateTime>,
    /// When it expires unless renewed (server time); `None` if the stored value is not a
    /// date (then the lock counts as expired).
    #[serde(serialize_with = "as_rfc3339")]
    pub expires_at: Option<DateTime>,
    /// Whether it has certainly expired (any acquirer may take it over now).
    pub expired: bool,
    /// What is wrong with a lock document docwarden did not write, for example
    /// `"expires_at is a string"`; `None` for a well-formed lock.
    pub malformed: Option<String>,
}

/// Serializes an optional date as RFC 3339 (milliseconds if it has no such form), for the
/// JSON listings of lock documents and document locks.
pub(super) fn as_rfc3339<S: serde::Serializer>(
    d: &Option<DateTime>,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_str(
            &d.try_to_rfc3339_string()
                .unwrap_or_else(|_| d.timestamp_millis().to_string()),
        ),
        None => s.serialize_none(),
    }
}

/// Test-only: pauses every slow-path acquire of a [`LockCollection`] made with
/// [`LockCollection::with_acquire_pause`] right after its step 1 (the acquire upsert that
/// wrote the `pending` nonce), before it reserves its token block, so tests can interleave
/// other operations in that window. A fast-path acquire (one write) has no such window
/// and does not pause; `LockOptions::token_block(1)` makes every acquire a slow one.
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct AcquirePause {
    reached: tokio::sync::Notify,
    resume: tokio::sync::Notify,
}

impl AcquirePause {
    /// Resolves once an acquire has completed its step 1 and is waiting.
    pub async fn reached(&self) {
        self.reached.notified().await;
    }

    /// Lets one waiting (or the next) acquire continue with steps 2 and 3.
    pub fn resume(&self) {
        self.resume.notify_one();
    }
}

/// A lock collection: leases on named resources with fencing tokens.
///
/// Cloning is cheap (collections and the time source are shared handles).
///
/// ```no_run
/// # async fn example(db: mongodb::Database, client: mongodb::Client) -> docwarden::Result<()> {
/// use std::time::Duration;
/// use docwarden::clock::{ClockOptions, TimeSource};
/// use docwarden::lock::{LockCollection, LockOptions, Owner};
///
/// let time = TimeSource::server(client, ClockOptions::default())?;
/// let locks = LockCollection::open(&db, "workitem.lock", time, LockOptions::default()).await?;
/// let me = Owner::random();
/// if let Some(lease) = locks.acquire(&me, "workitem-42", Duration::from_secs(10), Duration::from_secs(2)).await? {
///     // … work, fencing every write with lease.token …
///     locks.release(&lease).await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct LockCollection {
    locks: Collection<Document>,
    tokens: Collection<Document>,
    time: TimeSource,
    options: LockOptions,
    pause: Option<Arc<AcquirePause>>,
}

/// The options of the collections a handle opens next to `collection` (its own, and
/// companions such as `<name>.tokens`): `write_concern` if given, else the collection's;
/// the collection's read concern and selection criteria. One definition for the lock
/// collection, the semaphore and the queue.
pub(crate) fn inherited_options(
    collection: &Collection<Document>,
    write_concern: Option<WriteConcern>,
) -> CollectionOptions {
    CollectionOptions::builder()
        .write_concern(write_concern.or_else(|| collection.write_concern().cloned()))
        .read_concern(collection.read_concern().cloned())
        .selection_criteria(collection.selection_criteria().cloned())
        .build()
}

impl LockCollection {
    /// A handle on the lock collection `collection` (and its counter collection
    /// `<name>.tokens` in the same database), without touching the server: it only
    /// validates. Use [`LockCollection::open`] to also run the preflight checks and create
    /// the indexes, or call [`LockCollection::ensure_indexes`] once. With
    /// [`LockOptions::write_concern`] set, both collections use it; otherwise they inherit
    /// `collection`'s write concern (its read concern and read preference are kept).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad collection name or options.
    pub fn new(
        collection: Collection<Document>,
        time: TimeSource,
        options: LockOptions,
    ) -> Result<Self> {
        validate::collection_name("lock collection", collection.name())?;
        options.validate()?;
        let db = collection.client().database(&collection.namespace().db);
        let coll_options =
            crate::lock::collection::inherited_options(&collection, options.write_concern.clone());
        let name = collection.name();
        Ok(Self {
            locks: db.collection_with_options(name, coll_options.clone()),
            tokens: db.collection_with_options(
                &format!("{name}{}", crate::format::lock::TOKENS_SUFFIX),
                coll_options,
            ),
            time,
            options,
            pause: None,
        })
    }

    /// Opens the lock collection `name` (and its counter collection `<name>.tokens`) in
    /// `db` ([`LockCollection::new`]), runs the preflight checks on both
    /// ([`crate::preflight::check`]) and creates the indexes if they are missing:
    /// `{owner: 1, _id: 1}` for listing and releasing by owner, and a TTL index on
    /// `gc_at` with `gc_after` ([`LockCollection::ensure_indexes`], which also migrates a
    /// collection of an earlier version).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad name or options; [`Error::Incompatible`] for a
    /// server older than MongoDB 6.0 or a collection with a non-simple default collation
    /// (see [`crate::preflight`]); a database error if the indexes cannot be created.
    pub async fn open(
        db: &Database,
        name: &str,
        time: TimeSource,
        options: LockOptions,
    ) -> Result<Self> {
        validate::collection_name("lock collection", name)?;
        let this = Self::new(db.collection(name), time, options)?;
        crate::preflight::check(&this.locks).await?;
        crate::preflight::check(&this.tokens).await?;
        this.ensure_indexes().await?;
        Ok(this)
    }

    /// Creates the indexes (idempotent). A TTL index created earlier with another
    /// `gc_after` is changed with `collMod`.
    ///
    /// **Migration** from versions before session 17, whose TTL index `expires_at_gc` was on
    /// the holder's `expires_at` (it could delete a read/write lock document with live
    /// readers inside): that index is dropped, and every lock document without a `gc_at`
    /// gets one, the latest lease expiry it carries (the holder's, every reader's; the
    /// server's now if it carries none), in one `updateMany` evaluated per document on the
    /// server. Idempotent; a document written without `gc_at` later (by an earlier version
    /// still running) is never deleted early, only late: from the next call on.
    ///
    /// # Errors
    /// A database error.
    pub async fn ensure_indexes(&self) -> Result<()> {
        self.locks
            .create_index(
                IndexModel::builder()
                    .keys(doc! { f::OWNER: 1, "_id": 1 })
                    .options(IndexOptions::builder().name("owner_id".to_owned()).build())
                    .build(),
            )
            .await?;
        let (field, name, obsolete) =
            if self.options.unsafe_control == UnsafeControl::GcByHolderExpiry {
                (f::EXPIRES_AT, OLD_GC_INDEX, GC_INDEX)
            } else {
                (f::GC_AT, GC_INDEX, OLD_GC_INDEX)
            };
        let names = self.locks.list_index_names().await?;
        if names.iter().any(|n| n == obsolete) {
            match self.locks.drop_index(obsolete).await {
                Ok(()) => {
                    tracing::info!(collection = %self.locks.name(), index = obsolete, "dropped the obsolete TTL index")
                }
                // Another process dropped it first.
                Err(e) if error::error_code(&e) == Some(27) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let gc = IndexModel::builder()
            .keys(doc! { field: 1 })
            .options(
                IndexOptions::builder()
                    .name(name.to_owned())
                    .expire_after(self.options.gc_after)
                    .build(),
            )
            .build();
        match self.locks.create_index(gc).await {
            Ok(_) => {}
            Err(e) if matches!(error::error_code(&e), Some(85 | 86)) => {
                let secs = i64::try_from(self.options.gc_after.as_secs()).unwrap_or(i64::MAX);
                self.locks
                    .client()
                    .database(&self.locks.namespace().db)
                    .run_command(doc! {
                        "collMod": self.locks.name(),
                        "index": { "name": name, "expireAfterSeconds": secs },
                    })
                    .await?;
            }
            Err(e) => return Err(e.into()),
        }
        let migrated = self
            .locks
            .update_many(
                doc! { f::GC_AT: { "$exists": false } },
                vec![
                    doc! { "$set": { f::GC_AT: { "$ifNull": [latest_lease_expiry(), "$$NOW"] } } },
                ],
            )
            .await?;
        if migrated.modified_count > 0 {
            tracing::info!(collection = %self.locks.name(), documents = migrated.modified_count, "lock documents given a gc_at");
        }
        Ok(())
    }

    /// Test-only: a handle on the same collections whose acquires stop after step 1 until
    /// `pause` lets them go on (see [`AcquirePause`]).
    #[doc(hidden)]
    pub fn with_acquire_pause(&self, pause: Arc<AcquirePause>) -> Self {
        Self {
            pause: Some(pause),
            ..self.clone()
        }
    }

    /// The lock collection's name.
    pub fn name(&self) -> &str {
        self.locks.name()
    }

    /// The lock documents' collection (for the election's and rw lock's own reads).
    pub(crate) fn collection(&self) -> &Collection<Document> {
        &self.locks
    }

    /// The time source every expiry decision uses.
    pub fn time(&self) -> &TimeSource {
        &self.time
    }

    /// The filter and the update pipeline of an acquire's first write (a
    /// `findOneAndUpdate` with upsert, answering the post-image), for inspection and
    /// other-language ports (`docs/locks.md`, "How an acquire works"): it takes `resource`
    /// for `owner` when the lock is free or its expiry is before `cutoff` (the server time
    /// before which an expiry is certainly past), writing the acquisition `nonce`,
    /// `acquired_at` and `expires_at`, and the next token of the document's block (or the
    /// `pending` nonce of the slow path). It takes nothing once the server's clock has
    /// reached `land_by`, the attempt's landing deadline (sent + 2 s: see
    /// [`LockCollection::try_acquire`]).
    pub fn acquire_update(
        resource: &str,
        owner: &str,
        nonce: &str,
        cutoff: DateTime,
        land_by: DateTime,
        acquired_at: DateTime,
        expires_at: DateTime,
    ) -> (Document, Vec<Document>) {
        let take = Bson::Document(take_condition(cutoff, &[], land_by));
        (
            doc! { "_id": resource },
            acquire_pipeline(take, owner, nonce, acquired_at, expires_at),
        )
    }

    /// The filter and the update pipeline of [`LockCollection::release`] for `lease` (an
    /// `updateOne`), for inspection and other-language ports, as
    /// [`LockCollection::acquire_update`]: the filter is `{_id: resource}` alone, and the
    /// one-stage pipeline frees the lock (`owner: null`, `expires_at: $$NOW`) only while the
    /// document still shows `lease` — its owner and token, no acquisition pending — and
    /// leaves it as it is otherwise (`modifiedCount` 0: the lease was lost).
    pub fn release_update_for(lease: &Lease) -> (Document, Vec<Document>) {
        (doc! { "_id": &lease.resource }, release_pipeline(lease))
    }

    /// Tries once to acquire `resource` for `ttl`. `Ok(None)` when it is held by someone
    /// else and not certainly expired (contention is not an error).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an empty or too long resource or a ttl not longer than the time source's skew margin (nothing is
    /// written); a database error.
    ///
    /// **An attempt without an answer.** The write takes the lock only while the server's
    /// clock is before its landing deadline, 2 s after it was sent. If the call returns an
    /// error after sending it (a lost reply, a network error) or its future is dropped
    /// before it returns (a timeout around it), whatever that write took is freed in the
    /// background once the deadline has certainly passed (`lock/landing.rs`): other
    /// contenders wait about 2 s for it, not its ttl. A write that takes longer than 2 s
    /// to reach the server takes nothing (`Ok(None)`, as contention).
    pub async fn try_acquire(
        &self,
        owner: &Owner,
        resource: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>> {
        self.attempt(owner, resource, ttl, &validate::random_id(), &[])
            .await
    }

    /// One acquire attempt with acquisition nonce `nonce`. `unknown`: the nonces of this
    /// blocking acquire's earlier attempts that failed with a transient error, so may have
    /// taken the lock without the reply saying so (see [`acquire_condition`]); empty for
    /// [`LockCollection::try_acquire`]. Its span is `try_acquire`, for a
    /// [`LockCollection::try_acquire`] and for each try of a blocking acquire alike
    /// (`docs/observability.md`).
    #[instrument(name = "try_acquire", skip(self, owner, nonce, unknown), fields(collection = %self.locks.name(), owner = owner.id(), token = tracing::field::Empty))]
    async fn attempt(
        &self,
        owner: &Owner,
        resource: &str,
        ttl: Duration,
        nonce: &str,
        unknown: &[String],
    ) -> Result<Option<Lease>> {
        validate::name("resource", resource)?;
        validate::name("owner", owner.id())?;
        let ttl_ms = super::lease::ttl_ms("ttl", ttl, self.time.skew_margin_ms())?;
        let now = self.time.now().await?;
        let cutoff = now.expired_before(self.time.skew_margin_ms());
        let nonce = nonce.to_owned();
        let acquired_at = now.estimate();
        let expires_at = now.plus_ms(ttl_ms);

        // The acquire, one atomic upsert by `{_id}` alone: when the lock is free (or this
        // acquire's own, `unknown`) its pipeline takes it, with a token left in the
        // document's block as the whole acquire (the fast path), otherwise writing a
        // `pending` nonce; when it is held, the document stays as it is and comes back.
        // It takes the lock only before its landing deadline (`lock/landing.rs`): until
        // the attempt ends with an answer, what a late or unanswered write took is freed
        // once that deadline has passed (the clean-up is armed before the write is sent,
        // so a caller that drops this future is covered too).
        let land_by = landing::deadline(&now);
        let take = match self.options.unsafe_control {
            // The control switches off the held-lock check only: the landing deadline
            // stays, so its violations are the check's alone.
            UnsafeControl::IgnoreExpiry => landing::before(land_by),
            _ => take_condition(cutoff, unknown, land_by),
        };
        let take = Bson::Document(take);
        let update = acquire_pipeline(take, owner.id(), &nonce, acquired_at, expires_at);
        let cleanup = landing::CleanUp::new(
            &self.locks,
            &self.time,
            doc! { "_id": resource, "owner": owner.id(), "acquisition": &nonce },
            release_update(),
            land_by,
            "lock acquire",
        );
        let outcome = self
            .attempt_write(owner, resource, &nonce, update, acquired_at, expires_at)
            .await;
        if outcome.is_ok() {
            cleanup.settled();
        }
        outcome
    }

    /// The write of one acquire attempt and, on the slow path, its token commit.
    async fn attempt_write(
        &self,
        owner: &Owner,
        resource: &str,
        nonce: &str,
        update: Vec<Document>,
        acquired_at: DateTime,
        expires_at: DateTime,
    ) -> Result<Option<Lease>> {
        let nonce = nonce.to_owned();
        let after = match self
            .locks
            .find_one_and_update(doc! { "_id": resource }, update)
            .upsert(true)
            .return_document(ReturnDocument::After)
            .await
        {
            Ok(Some(after)) => after,
            // An upsert that raced another one may be answered without a document although
            // it applied (the embedded server does so when the document appeared between its
            // match and its write): read it back; this acquisition is recognised below by
            // its nonce, which every acquire writes.
            Ok(None) => match self.locks.find_one(doc! { "_id": resource }).await? {
                Some(d) => d,
                None => {
                    crate::observe::lock_busy(self.locks.name());
                    tracing::debug!(resource, "acquire answered no document and lost the race");
                    return Ok(None);
                }
            },
            // Two first acquires of a resource racing to insert its document: MongoDB
            // retries the loser's upsert as an update (its filter is `_id` equality), the
            // embedded server may answer a duplicate key. The winner holds the lock.
            Err(e) if error::is_duplicate_key(&e) => {
                crate::observe::lock_busy(self.locks.name());
                tracing::trace!(resource, "held (lost the insert race)");
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        };
        if after.get_str("acquisition").ok() != Some(nonce.as_str())
            || after.get_str("owner").ok() != Some(owner.id())
        {
            crate::observe::lock_busy(self.locks.name());
            tracing::trace!(resource, "held");
            return Ok(None);
        }
        let lease = |token: i64| Lease {
            resource: resource.to_owned(),
            owner: owner.id().to_owned(),
            token: FencingToken::new(token),
            acquired_at,
            expires_at,
        };
        if after.get_str("pending").ok() != Some(nonce.as_str()) {
            // The fast path: the token was taken from the block in the same write.
            let token = after.get_i64("token").map_err(|e| Error::Malformed {
                id: resource.to_owned(),
                reason: format!("lock document after the acquire: {e}"),
            })?;
            crate::observe::lock_acquired(self.locks.name(), Some(token));
            tracing::debug!(resource, token, "acquired");
            return Ok(Some(lease(token)));
        }
        // The slow path. `previous` is the token the document kept (0 for a new document or
        // a hand-edited token): the new block starts above it.
        let previous = match after.get("token") {
            None => 0,
            Some(value) => stored_number(Some(value)).unwrap_or_else(|| {
                tracing::warn!(resource, token = %describe(Some(value)), "took over a lock whose token is not a number (edited by hand?)");
                0
            }),
        };
        if !matches!(after.get("expires_at"), Some(Bson::DateTime(_))) {
            // Unreachable: the pipeline just wrote a date.
            tracing::warn!(
                resource,
                "lock document without a date expiry after the acquire"
            );
        }
        if let Some(pause) = &self.pause {
            pause.reached.notify_one();
            pause.resume.notified().await;
        }

        match self.commit_block(owner, resource, &nonce, previous).await {
            Ok(Some(token)) => {
                crate::observe::lock_acquired(self.locks.name(), Some(token));
                tracing::debug!(resource, token, "acquired (new token block)");
                Ok(Some(lease(token)))
            }
            Ok(None) => {
                crate::observe::lock_busy(self.locks.name());
                tracing::warn!(
                    resource,
                    "lease taken over between acquire and token commit"
                );
                Ok(None)
            }
            Err(err) => {
                // Best effort: free the half-acquired lock instead of letting it expire.
                let _ = self
                    .locks
                    .update_one(
                        doc! { "_id": resource, "owner": owner.id(), "pending": &nonce },
                        release_update(),
                    )
                    .await;
                Err(err)
            }
        }
    }

    /// Slow path, step 2: raises the counter by one block (above `previous`) and returns
    /// its new value, the block's ceiling.
    ///
    /// Two first reservations of a resource race to insert its counter document: MongoDB
    /// may answer one of them with a duplicate key error, and the embedded server with no
    /// document. Either way the counter document exists afterwards, and the reservation is
    /// made again as an update (a reservation that did apply before its answer was lost
    /// only skips a block, which keeps tokens increasing).
    async fn reserve(&self, resource: &str, previous: i64, block: i64) -> Result<i64> {
        let mut attempts = 0;
        loop {
            attempts += 1;
            let answer = self
                .tokens
                .find_one_and_update(doc! { "_id": resource }, reserve_pipeline(previous, block))
                .upsert(true)
                .return_document(ReturnDocument::After)
                .await;
            match answer {
                Ok(Some(counter)) => {
                    return stored_number(counter.get("token")).ok_or_else(|| Error::Malformed {
                        id: resource.to_owned(),
                        reason: format!("token counter is {}", describe(counter.get("token"))),
                    });
                }
                Ok(None) if attempts < 3 => {}
                Err(e) if attempts < 3 && error::is_duplicate_key(&e) => {}
                Ok(None) => {
                    return Err(Error::Malformed {
                        id: resource.to_owned(),
                        reason: "token counter upsert returned nothing".into(),
                    });
                }
                Err(e) => return Err(e.into()),
            }
            tracing::debug!(resource, attempts, "token counter upsert raced; again");
        }
    }

    /// Slow path, steps 2 and 3: reserves the next block of tokens in the counter (above
    /// `previous`), then commits its first token and its ceiling into the lock document,
    /// compare-and-set on the pending nonce. `Ok(None)` if the acquisition was taken over
    /// in between.
    async fn commit_block(
        &self,
        owner: &Owner,
        resource: &str,
        nonce: &str,
        previous: i64,
    ) -> Result<Option<i64>> {
        let overflow = || Error::Malformed {
            id: resource.to_owned(),
            reason: "fencing token overflow".into(),
        };
        let block = self.options.token_block;
        let ceiling = if self.options.unsafe_control == UnsafeControl::TokenInLockDocument {
            previous.checked_add(block).ok_or_else(overflow)?
        } else {
            previous.checked_add(block).ok_or_else(overflow)?;
            self.reserve(resource, previous, block).await?
        };
        // The block is (ceiling − block, ceiling]; its first token goes to this lease.
        let token = ceiling
            .checked_sub(block)
            .and_then(|t| t.checked_add(1))
            .ok_or_else(overflow)?;
        let committed = self
            .locks
            .update_one(
                doc! { "_id": resource, "owner": owner.id(), "pending": nonce },
                doc! {
                    "$set": { "token": token, "ceiling": ceiling },
                    "$unset": { "pending": "" },
                },
            )
            .await?;
        Ok((committed.matched_count == 1).then_some(token))
    }

    /// A fresh backoff with this handle's [`LockOptions::backoff`], for the waits of the
    /// locks built on it (read/write locks).
    pub(crate) fn backoff(&self) -> Result<Backoff> {
        Backoff::new(self.options.backoff_base, self.options.backoff_max)
    }

    /// Acquires `resource` for `ttl`, waiting until it is acquired or `wait` has passed
    /// (`Ok(None)`). A zero `wait` tries once. The waiter retries the moment the lock is
    /// released (a change stream on the lock document, `lock/wake.rs`), and polls every
    /// `backoff_max` for a holder whose lease lapses without a release; where change
    /// streams are refused it retries with jittered exponential backoff.
    ///
    /// Transient errors (a failover, a restart, a network blip: [`Error::is_retryable`])
    /// are retried with backoff within the wait, like contention (`lock/deadline.rs`).
    ///
    /// # Errors
    /// As [`LockCollection::try_acquire`]; a transient error only if the wait passed with
    /// the last attempt failing.
    #[instrument(skip(self, owner), fields(collection = %self.locks.name(), owner = owner.id(), token = tracing::field::Empty))]
    pub async fn acquire(
        &self,
        owner: &Owner,
        resource: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Option<Lease>> {
        let called = Instant::now();
        let mut deadline = Deadline::after(wait);
        let mut backoff = self.backoff()?;
        // Woken by the release itself (a change stream on this lock document), polling
        // only for expiries, or with the backoff where change streams are refused.
        let mut wake = Wake::new(&self.locks, resource, Wake::freed_lock());
        // Attempts that failed with a transient error may have taken the lock all the same
        // (a lost reply): the next attempts take it back from them rather than waiting
        // behind them until their ttl.
        let mut unanswered = Unanswered::default();
        loop {
            let nonce = validate::random_id();
            let result = self
                .attempt(owner, resource, ttl, &nonce, unanswered.nonces())
                .await;
            unanswered.note(nonce, &result);
            if let Some(lease) = deadline.attempt(result)? {
                crate::observe::lock_handoff(self.locks.name(), called, Some(lease.token.get()));
                return Ok(Some(lease));
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

    /// Extends `lease` to `ttl` from now (server time). Allowed only while the lease is
    /// still *certainly* valid (its expiry is after the server time estimate plus bound
    /// and skew margin) and still holds `(resource, owner, token)` with no acquisition
    /// pending; a lease that has lapsed cannot be revived, even if nobody took it over yet,
    /// and a stale lease of the same owner id cannot extend a newer acquisition.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the lease expired, was released, taken over or deleted;
    /// [`Error::InvalidInput`] for a ttl not longer than the time source's skew margin (zero included); a database error.
    #[instrument(skip(self, lease), fields(collection = %self.locks.name(), resource = %lease.resource, owner = %lease.owner, token = lease.token.get()))]
    pub async fn renew(&self, lease: &mut Lease, ttl: Duration) -> Result<()> {
        self.renew_at(lease, ttl).await.map(|_| ())
    }

    /// [`LockCollection::renew`], returning the server time the new expiry was computed
    /// from (the watchdog needs its bound).
    pub(crate) async fn renew_at(&self, lease: &mut Lease, ttl: Duration) -> Result<ServerTime> {
        let ttl_ms = super::lease::ttl_ms("ttl", ttl, self.time.skew_margin_ms())?;
        let now = self.time.now().await?;
        let expires_at = now.plus_ms(ttl_ms);
        let result = self
            .locks
            .update_one(
                renew_filter(lease, &now, self.time.skew_margin_ms()),
                renew_pipeline(expires_at),
            )
            .await?;
        if result.matched_count == 0 {
            return Err(lost(lease));
        }
        lease.expires_at = expires_at;
        Ok(now)
    }

    /// Releases `lease`: compare-and-set on `(resource, owner, token)` with no acquisition
    /// pending (so a stale lease of the same owner id cannot free a newer acquisition that
    /// has not committed its token yet). The document stays
    /// (with `owner: null` and its token) until the TTL index collects it. Releasing a
    /// lease that expired but was not taken over still frees the resource.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the lease was taken over, released or deleted already (so a
    /// non-holder can never release); a database error.
    #[instrument(skip(self, lease), fields(collection = %self.locks.name(), resource = %lease.resource, owner = %lease.owner, token = lease.token.get()))]
    pub async fn release(&self, lease: &Lease) -> Result<()> {
        let (filter, update) = Self::release_update_for(lease);
        let result = self.locks.update_one(filter, update).await?;
        if result.modified_count == 0 {
            return Err(lost(lease));
        }
        Ok(())
    }

    /// Releases `lease` for a caller that will not wait for the answer (a writer
    /// withdrawing the intent it gives up on): a release that fails with a transient
    /// error is retried in the background ([`landing::release_later`]), so the lease does
    /// not keep the others out until its ttl; a lease already lost is nothing to release.
    pub(crate) async fn release_in_background(&self, lease: &Lease, what: &'static str) {
        match self.release(lease).await {
            Ok(()) | Err(Error::LeaseLost { .. }) => {}
            Err(e) => landing::release_later(
                &self.locks,
                &self.time,
                cas_filter(lease),
                release_update(),
                &e,
                what,
            ),
        }
    }

    /// Releases every lease held by `owner` (for example when a process shuts down or an
    /// operator cleans up after it) and returns how many were released.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an invalid owner id; a database error.
    #[instrument(skip(self, owner), fields(collection = %self.locks.name(), owner = owner.id()))]
    pub async fn release_all(&self, owner: &Owner) -> Result<u64> {
        validate::name("owner", owner.id())?;
        let result = self
            .locks
            .update_many(doc! { "owner": owner.id() }, release_update())
            .await?;
        Ok(result.modified_count)
    }

    /// The held locks matching `filter`, by resource. Lock documents docwarden did not
    /// write are listed with [`LockRecord::malformed`] set, never skipped.
    ///
    /// # Errors
    /// A database error.
    pub async fn list(&self, filter: &LockListFilter) -> Result<Vec<LockRecord>> {
        let mut query = doc! { "owner": { "$ne": Bson::Null } };
        if let Some(owner) = &filter.owner {
            query.insert("owner", owner.as_str());
        }
        if let Some(resource) = &filter.resource {
            query.insert("_id", resource.as_str());
        }
        let now = self.time.now().await?;
        let cutoff = now.expired_before(self.time.skew_margin_ms());
        let docs = listing(&self.locks, query, None, filter.limit).await?;
        Ok(docs.iter().map(|d| record(d, cutoff)).collect())
    }

    /// How many locks are held and expired, and by how many owners, in one aggregation
    /// whose reply is one small document, however many locks there are.
    ///
    /// The server still reads every lock document that names an owner (on MongoDB through
    /// the `{owner: 1, _id: 1}` index's keys and the documents' `expires_at`), so this
    /// costs the server in proportion to the held locks: a dashboard or exporter should
    /// pace it (`docwarden ui` reads it at most once per `--counts-every`). A lock counts
    /// as expired exactly when [`LockRecord::expired`] would say so.
    ///
    /// # Errors
    /// A database error.
    pub async fn counts(&self) -> Result<LockCounts> {
        let now = self.time.now().await?;
        let cutoff = now.expired_before(self.time.skew_margin_ms());
        let expires = format!("${}", f::EXPIRES_AT);
        let live = doc! { "$and": [
            { "$eq": [{ "$type": &expires }, "date"] },
            { "$gte": [&expires, cutoff] },
        ] };
        let pipeline = vec![
            doc! { "$match": { f::OWNER: { "$ne": Bson::Null } } },
            // One row per owner: its live locks and all its locks.
            doc! { "$group": {
                "_id": format!("${}", f::OWNER),
                "live": { "$sum": { "$cond": [live, 1, 0] } },
                "all": { "$sum": 1 },
            } },
            doc! { "$group": {
                "_id": Bson::Null,
                "held": { "$sum": "$live" },
                "all": { "$sum": "$all" },
                "holders": { "$sum": { "$cond": [{ "$gt": ["$live", 0] }, 1, 0] } },
            } },
        ];
        let mut cursor = self.locks.aggregate(pipeline).await?;
        let Some(row) = cursor.try_next().await? else {
            return Ok(LockCounts::default());
        };
        let n = |k: &str| -> u64 {
            match row.get(k) {
                Some(Bson::Int32(v)) => u64::try_from(*v).unwrap_or(0),
                Some(Bson::Int64(v)) => u64::try_from(*v).unwrap_or(0),
                _ => 0,
            }
        };
        let held = n("held");
        Ok(LockCounts {
            held,
            expired: n("all").saturating_sub(held),
            holders: n("holders"),
        })
    }

    /// The fencing token of the last committed acquisition of `resource`, as stored in its
    /// lock document; `None` if there is none (never acquired, or the lock document was
    /// deleted: the next acquire then starts above the counter in `<name>.tokens`, which
    /// holds the top of the last reserved block, not a token handed out).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an invalid resource; [`Error::Malformed`] for a lock
    /// document whose committed token is not an int64; a database error.
    pub async fn last_token(&self, resource: &str) -> Result<Option<FencingToken>> {
        validate::name("resource", resource)?;
        let Some(d) = self.locks.find_one(doc! { "_id": resource }).await? else {
            return Ok(None);
        };
        match d.get("token") {
            None => Ok(None),
            Some(Bson::Int64(t)) => Ok(Some(FencingToken::new(*t))),
            Some(other) => Err(Error::Malformed {
                id: resource.to_owned(),
                reason: format!("token is {}", describe(Some(other))),
            }),
        }
    }
}

fn lost(lease: &Lease) -> Error {
    Error::LeaseLost {
        resource: lease.resource.clone(),
        token: lease.token.into(),
    }
}

/// `{$and: [{_id: resource}, {$or: [owner == null, expires_at < cutoff, expires_at is not
/// a date]}]}`: the lock is free or certainly expired, as a query filter (the read/write
/// locks' readers enter with it; the acquire evaluates the same condition in its pipeline,
/// [`acquire_condition`]). Routed by `_id` (a top-level `$or` next to `_id` costs the
/// embedded server a scan of the alternatives, about three times a point write; inside
/// `$and` it is a point write on both servers, and an upsert still inserts `{_id:
/// resource}`).
///
/// docwarden always writes `expires_at` as a date; a lock whose `expires_at` is anything
/// else (a string, null, a number, missing) was edited by hand, and `$lt` against a date
/// never matches it (comparisons stay within one BSON type), so without the third branch
/// it would be locked forever. It is treated as expired. Tokens still increase: the token
/// is drawn from the counter collection, raised above the document's previous token.
pub(crate) fn acquire_filter(resource: &str, cutoff: DateTime) -> Document {
    doc! { "$and": [{ "_id": resource }, { "$or": [
        { "owner": Bson::Null },
        { "expires_at": { "$lt": cutoff } },
        { "expires_at": { "$not": { "$type": "date" } } },
    ] }] }
}

/// When the acquire takes the lock, as an aggregation expression over the stored document
/// (or over `{_id}` for a document the upsert inserts): [`acquire_filter`]'s condition —
/// `owner` null or missing, `expires_at` not a date, or a date before `cutoff` — or the
/// lock as left by one of `unknown`: acquisitions of the same blocking acquire whose
/// attempt failed with a transient error (a lost reply: the write may have applied).
/// Taking such a lock again is taking it from oneself: nobody else was told they hold it,
/// and the pipeline hands out a fresh token (or a new block). Only *earlier* attempts'
/// nonces are listed, never the current one's, so a delayed execution of an earlier
/// attempt cannot take the lock back from the attempt that reported it. With `unknown`
/// empty (every first attempt, every `try_acquire`) the condition has three branches.
///
/// In the pipeline, not in the filter: on the embedded server a filter of anything but
/// `{_id: value}` first reads the matching document in the order mongod's plan would, and
/// evaluating the `$or` as a query costs more than as an expression; the acquire by
/// `{_id}` alone costs it 6–9 % fewer instructions per acquire + release
/// (`docs/benchmarks.md`, session 23). On MongoDB both are a point write by `_id`.
/// `tests/lock_s23_acquire_by_id.rs` checks that the expression takes exactly the
/// documents the filter matches, over stored documents of every shape.
pub(crate) fn acquire_condition(cutoff: DateTime, unknown: &[String]) -> Document {
    let mut free = vec![
        Bson::Document(doc! { "$eq": [{ "$ifNull": ["$owner", Bson::Null] }, Bson::Null] }),
        Bson::Document(doc! { "$ne": [{ "$type": "$expires_at" }, "date"] }),
        Bson::Document(doc! { "$lt": ["$expires_at", { "$literal": cutoff }] }),
    ];
    if !unknown.is_empty() {
        free.push(Bson::Document(
            doc! { "$in": ["$acquisition", { "$literal": unknown }] },
        ));
    }
    doc! { "$or": free }
}

/// The acquire's whole condition: [`acquire_condition`], and the server's clock before the
/// attempt's landing deadline `land_by` (`lock/landing.rs`).
pub(crate) fn take_condition(cutoff: DateTime, unknown: &[String], land_by: DateTime) -> Document {
    doc! { "$and": [landing::before(land_by), acquire_condition(cutoff, unknown)] }
}

/// The acquire's update, for the filter `{_id: resource}` and an upsert: when `take` (the
/// [`acquire_condition`]) holds, the lock is taken — `owner`, the acquisition's random
/// nonce in `acquisition` (by which a lost answer, and whether this acquire took the lock,
/// are recognised), `acquired_at`, `expires_at`, `gc_at` ([`keep_gc_at`]) — and, while the
/// document's block has a token left (`token` and `ceiling` are int64, `token < ceiling`)
/// and no `pending` nonce is stored, `token + 1` is set in the same write (the fast path);
/// otherwise the token is kept and the `pending` nonce stored (the slow path commits a
/// token from a new block; a `pending` left by an acquire that never committed is
/// overwritten). When `take` does not hold, the document is left as it is. One stage,
/// `$replaceWith` of a `$cond`: the condition is evaluated once, and every expression
/// reads the document as it was.
pub(crate) fn acquire_pipeline(
    take: Bson,
    owner: &str,
    nonce: &str,
    acquired_at: DateTime,
    expires_at: DateTime,
) -> Vec<Document> {
    let fast = doc! { "$and": [
        { "$eq": [{ "$type": "$token" }, "long"] },
        { "$eq": [{ "$type": "$ceiling" }, "long"] },
        { "$lt": ["$token", "$ceiling"] },
        { "$eq": [{ "$type": "$pending" }, "missing"] },
    ] };
    let taken = doc! {
        "owner": { "$literal": owner },
        "acquisition": { "$literal": nonce },
        "acquired_at": { "$literal": acquired_at },
        "expires_at": { "$literal": expires_at },
        f::GC_AT: keep_gc_at(expires_at),
    };
    let token = doc! { "$cond": [
        fast,
        { "token": { "$add": ["$token", 1_i64] } },
        { "pending": { "$literal": nonce } },
    ] };
    vec![doc! { "$replaceWith": { "$cond": [
        take,
        { "$mergeObjects": ["$$ROOT", taken, token] },
        "$$ROOT",
    ] } }]
}

/// The `gc_at` a write that gives a lease the expiry `expires_at` leaves (a pipeline
/// expression over the stored document): the later of `expires_at` and the stored
/// `gc_at`, so `gc_at` never goes down and stays at or after every lease expiry the
/// document carries. A stored `gc_at` that is not a date (a document of an earlier version,
/// or edited by hand) is replaced by [`latest_lease_expiry`]. One definition for the
/// writer's acquire and renewal and the readers' entries and renewals.
pub(crate) fn keep_gc_at(expires_at: DateTime) -> Document {
    let stored = format!("${}", f::GC_AT);
    doc! { "$max": [
        { "$literal": expires_at },
        { "$cond": [
            { "$eq": [{ "$type": &stored }, "date"] },
            &stored,
            latest_lease_expiry(),
        ] },
    ] }
}

/// The latest lease expiry a stored lock document carries (a pipeline expression): the
/// later of the holder's `expires_at` and every reader entry's `expires_at`, dates only
/// (`null` if there is none). Gives a document without `gc_at` its first one.
pub(crate) fn latest_lease_expiry() -> Document {
    let date_or_null = |path: &str| {
        doc! { "$cond": [{ "$eq": [{ "$type": path }, "date"] }, path, Bson::Null] }
    };
    let readers = format!("${}", rf::READERS);
    let reader_expiry = format!("$$r.{}", rf::READER_EXPIRES_AT);
    doc! { "$max": [
        date_or_null(&format!("${}", f::EXPIRES_AT)),
        { "$max": { "$map": {
            "input": { "$cond": [{ "$isArray": &readers }, &readers, []] },
            "as": "r",
            "in": date_or_null(&reader_expiry),
        } } },
    ] }
}

/// The holder's identity: `(resource, owner, token)` of a *committed* acquisition.
///
/// While a newer acquisition is between its step 1 and its token commit, the document
/// carries that acquisition's owner and `pending` nonce but still the previous token; a
/// stale lease of the same owner id would match `(resource, owner, token)` and renew or
/// release the newer acquisition. Requiring that no `pending` nonce is present closes that
/// window: each acquisition's token is committed exactly once, with `pending` removed, so
/// the filter matches only the acquisition that handed out this lease.
pub(crate) fn cas_filter(lease: &Lease) -> Document {
    doc! {
        "_id": &lease.resource,
        "owner": &lease.owner,
        "token": lease.token,
        "pending": { "$exists": false },
    }
}

/// The holder's identity and an expiry that is still certainly in the future.
pub(crate) fn renew_filter(lease: &Lease, now: &ServerTime, margin_ms: i64) -> Document {
    let valid_after = DateTime::from_millis(
        now.estimate_ms
            .saturating_add(now.bound_ms)
            .saturating_add(margin_ms),
    );
    let mut f = cas_filter(lease);
    f.insert("expires_at", doc! { "$gt": valid_after });
    f
}

/// The renewal to `expires_at`, never earlier than the stored expiry: a renewal the
/// holder stopped waiting for (the watchdog's timeout, a lost connection) may still land
/// after a later one, and must not move the lease back (`tests/lock_late_renewal.rs`).
/// The filter ([`renew_filter`]) has matched a date expiry.
fn renew_pipeline(expires_at: DateTime) -> Vec<Document> {
    vec![doc! { "$set": {
        f::EXPIRES_AT: { "$max": [format!("${}", f::EXPIRES_AT), { "$literal": expires_at }] },
        f::GC_AT: keep_gc_at(expires_at),
    } }]
}

/// The release as a pipeline for the filter `{_id}` alone: `owner: null` and `expires_at:
/// $$NOW` when the document still shows `lease` ([`holds`]), the document unchanged
/// otherwise (`modifiedCount` 0: the lease was lost). One `$replaceWith` of a `$cond`, as
/// the acquire: the condition is evaluated once (a `$cond` per field cost the embedded
/// server about 25,000 more instructions per release, session 23).
fn release_pipeline(lease: &Lease) -> Vec<Document> {
    vec![doc! { "$replaceWith": { "$cond": [
        holds(lease),
        { "$mergeObjects": ["$$ROOT", { "owner": Bson::Null, "expires_at": "$$NOW" }] },
        "$$ROOT",
    ] } }]
}

/// [`cas_filter`] as an aggregation expression over the stored document.
fn holds(lease: &Lease) -> Document {
    doc! { "$and": [
        { "$eq": ["$owner", { "$literal": &lease.owner }] },
        { "$eq": ["$token", lease.token] },
        { "$eq": [{ "$type": "$pending" }, "missing"] },
    ] }
}

/// Frees the lock, keeps its token, and starts the garbage-collection clock at the
/// server's now: the operator form, for [`LockCollection::release_all`] and for freeing a
/// half-acquired lock, whose filters say what they free.
fn release_update() -> Document {
    doc! {
        "$set": { "owner": Bson::Null },
        "$unset": { "pending": "" },
        "$currentDate": { "expires_at": true },
    }
}

/// `token = max(token, previous) + block` on the counter document (0 if new): reserves
/// the block `(token − block, token]`, above every token reserved before and above the
/// lock document's `previous` token (so a counter lost by an operator is re-seeded from
/// the lock document while that exists).
fn reserve_pipeline(previous: i64, block: i64) -> Vec<Document> {
    vec![doc! { "$set": { "token": { "$add": [
        { "$max": [ { "$ifNull": [ "$token", 0_i64 ] }, previous ] },
        block,
    ] } } }]
}

/// A stored integer as docwarden and other writers leave it: an int64 or int32 as is, a
/// double — what mongosh writes for `token: 100` — rounded up (a bound "tokens handed out
/// are at most this" stays one). `None` for anything else, or a double outside the
/// int64 range.
pub(crate) fn stored_number(value: Option<&Bson>) -> Option<i64> {
    // 2^63 as a double: every double below it in magnitude converts exactly after `ceil`.
    const LIMIT: f64 = 9_223_372_036_854_775_808.0;
    match value {
        Some(Bson::Int64(n)) => Some(*n),
        Some(Bson::Int32(n)) => Some(i64::from(*n)),
        Some(Bson::Double(n)) if n.is_finite() && n.ceil() < LIMIT && n.ceil() >= -LIMIT =>
        {
            #[allow(clippy::cast_possible_truncation)]
            Some(n.ceil() as i64)
        }
        _ => None,
    }
}

/// The BSON type of a stored value in words, for reports: `"a string"`, `"missing"`.
pub(crate) fn describe(value: Option<&Bson>) -> &'static str {
    match value {
        None => "missing",
        Some(Bson::Null) => "null",
        Some(Bson::String(_)) => "a string",
        Some(Bson::Int32(_) | Bson::Int64(_) | Bson::Double(_) | Bson::Decimal128(_)) => "a number",
        Some(Bson::DateTime(_)) => "a date",
        Some(Bson::Boolean(_)) => "a boolean",
        Some(Bson::Document(_)) => "a document",
        Some(Bson::Array(_)) => "an array",
        Some(Bson::Timestamp(_)) => "a timestamp",
        Some(_) => "of another type",
    }
}

/// A listing record; never fails: what docwarden did not write is reported in `malformed`.
fn record(d: &Document, cutoff: DateTime) -> LockRecord {
    let mut problems: Vec<String> = Vec::new();
    let mut text = |field: &str| match d.get(field) {
        Some(Bson::String(s)) => s.clone(),
        other => {
            problems.push(format!("{field} is {}", describe(other)));
            other.map(ToString::to_string).unwrap_or_default()
        }
    };
    let resource = text("_id");
    let owner = text("owner");
    let mut date = |field: &str| match d.get(field) {
        Some(Bson::DateTime(t)) => Some(*t),
        other => {
            problems.push(format!("{field} is {}", describe(other)));
            None
        }
    };
    let acquired_at = date("acquired_at");
    let expires_at = date("expires_at");
    let token = if d.contains_key("pending") {
        None
    } else {
        match d.get("token") {
            Some(Bson::Int64(t)) => Some(FencingToken::new(*t)),
            other => {
                problems.push(format!("token is {}", describe(other)));
                None
            }
        }
    };
    LockRecord {
        resource,
        owner,
        token,
        acquired_at,
        expires_at,
        // Not a date: treated as expired, the acquire takes it over.
        expired: expires_at.is_none_or(|e| e < cutoff),
        malformed: (!problems.is_empty()).then(|| problems.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Session 15: a `gc_after` over `i32::MAX` seconds passed validation, and `open` then
    /// failed creating the TTL index (`CannotCreateIndex`, a bare database error).
    #[test]
    fn gc_after_fits_a_ttl_index() {
        assert!(
            LockOptions::default()
                .gc_after(MAX_GC_AFTER)
                .validate()
                .is_ok()
        );
        for too_long in [
            MAX_GC_AFTER + Duration::from_secs(1),
            Duration::from_millis(u64::try_from(i64::MAX).unwrap_or(u64::MAX)),
        ] {
            assert!(
                matches!(
                    LockOptions::default().gc_after(too_long).validate(),
                    Err(Error::InvalidInput {
                        what: "gc_after",
                        ..
                    })
                ),
                "{too_long:?} was accepted"
            );
        }
    }

    fn lease() -> Lease {
        Lease {
            resource: "r".into(),
            owner: "o".into(),
            token: FencingToken::new(7),
            acquired_at: DateTime::from_millis(0),
            expires_at: DateTime::from_millis(5_000),
        }
    }

    #[test]
    fn acquire_filter_is_free_or_expired() {
        let f = acquire_filter("r", DateTime::from_millis(1_000));
        // `_id` first, the alternatives inside `$and`: a point write.
        assert_eq!(
            f,
            doc! { "$and": [{ "_id": "r" }, { "$or": [
                { "owner": null },
                { "expires_at": { "$lt": DateTime::from_millis(1_000) } },
                { "expires_at": { "$not": { "$type": "date" } } },
            ] }] }
        );
    }

    #[test]
    fn stored_numbers_of_every_numeric_type_are_read() {
        assert_eq!(stored_number(Some(&Bson::Int64(7))), Some(7));
        assert_eq!(stored_number(Some(&Bson::Int32(7))), Some(7));
        assert_eq!(stored_number(Some(&Bson::Double(7.0))), Some(7));
        assert_eq!(
            stored_number(Some(&Bson::Double(6.5))),
            Some(7),
            "rounded up"
        );
        assert_eq!(stored_number(Some(&Bson::Double(1e300))), None);
        assert_eq!(stored_number(Some(&Bson::Double(f64::NAN))), None);
        assert_eq!(stored_number(Some(&Bson::String("7".into()))), None);
        assert_eq!(stored_number(None), None);
    }

    #[test]
    fn a_retrying_acquire_also_takes_its_earlier_attempts_acquisitions() {
        let cutoff = DateTime::from_millis(1_000);
        let free = vec![
            Bson::Document(doc! { "$eq": [{ "$ifNull": ["$owner", Bson::Null] }, Bson::Null] }),
            Bson::Document(doc! { "$ne": [{ "$type": "$expires_at" }, "date"] }),
            Bson::Document(doc! { "$lt": ["$expires_at", { "$literal": cutoff }] }),
        ];
        assert_eq!(acquire_condition(cutoff, &[]), doc! { "$or": free.clone() });
        let mut mine = free;
        mine.push(Bson::Document(
            doc! { "$in": ["$acquisition", { "$literal": ["n1", "n2"] }] },
        ));
        assert_eq!(
            acquire_condition(cutoff, &["n1".to_owned(), "n2".to_owned()]),
            doc! { "$or": mine }
        );
    }

    #[test]
    fn renew_requires_identity_and_certain_validity() {
        let now = ServerTime {
            estimate_ms: 1_000,
            bound_ms: 5,
        };
        let f = renew_filter(&lease(), &now, 250);
        assert_eq!(
            f,
            doc! { "_id": "r", "owner": "o", "token": 7_i64, "pending": { "$exists": false }, "expires_at": { "$gt": DateTime::from_millis(1_255) } }
        );
    }

    #[test]
    fn renew_and_release_never_match_a_pending_acquisition() {
        let f = cas_filter(&lease());
        assert_eq!(
            f,
            doc! { "_id": "r", "owner": "o", "token": 7_i64, "pending": { "$exists": false } }
        );
    }

    #[test]
    fn a_block_is_reserved_above_the_counter_and_the_previous_token() {
        assert_eq!(
            reserve_pipeline(42, 1_000),
            vec![doc! { "$set": { "token": { "$add": [
                { "$max": [{ "$ifNull": ["$token", 0_i64] }, 42_i64] },
                1_000_i64,
            ] } } }]
        );
    }

    #[test]
    fn the_acquire_takes_a_token_from_the_block_or_writes_a_nonce() {
        let take = Bson::Document(acquire_condition(DateTime::from_millis(1), &[]));
        let p = acquire_pipeline(
            take.clone(),
            "o",
            "n",
            DateTime::from_millis(1),
            DateTime::from_millis(2),
        );
        assert_eq!(
            p.len(),
            1,
            "one stage: every expression reads the old document"
        );
        let cond = p[0]
            .get_document("$replaceWith")
            .and_then(|r| r.get_array("$cond"))
            .cloned()
            .unwrap_or_default();
        assert_eq!(cond.first(), Some(&take), "taken when the condition holds");
        assert_eq!(cond.get(2), Some(&Bson::from("$$ROOT")), "else left as is");
        let merged = cond
            .get(1)
            .and_then(Bson::as_document)
            .and_then(|m| m.get_array("$mergeObjects").ok())
            .cloned()
            .unwrap_or_default();
        assert_eq!(merged.first(), Some(&Bson::from("$$ROOT")));
        let token = merged
            .get(2)
            .and_then(Bson::as_document)
            .and_then(|c| c.get_array("$cond").ok())
            .cloned()
            .unwrap_or_default();
        assert_eq!(
            token.get(1),
            Some(&Bson::Document(
                doc! { "token": { "$add": ["$token", 1_i64] } }
            ))
        );
        assert_eq!(
            token.get(2),
            Some(&Bson::Document(doc! { "pending": { "$literal": "n" } }))
        );
    }

    #[test]
    fn options_are_validated() {
        assert!(LockOptions::default().validate().is_ok());
        assert!(
            LockOptions::default()
                .gc_after(Duration::from_millis(10))
                .validate()
                .is_err()
        );
        assert!(
            LockOptions::default()
                .backoff(Duration::ZERO, Duration::from_secs(1))
                .validate()
                .is_err()
        );
    }

    #[test]
    fn records_decode_pending_and_committed() {
        let d = doc! { "_id": "r", "owner": "o", "token": 3_i64, "acquired_at": DateTime::from_millis(0), "expires_at": DateTime::from_millis(10) };
        let r = record(&d, DateTime::from_millis(20));
        assert_eq!(r.token, Some(FencingToken::new(3)));
        assert!(r.expired);
        assert_eq!(r.malformed, None);
        let mut p = d.clone();
        p.insert("pending", "n");
        assert_eq!(record(&p, DateTime::from_millis(0)).token, None);
    }

    #[test]
    fn malformed_records_are_reported_not_fatal() {
        let r = record(
            &doc! { "_id": "r", "owner": "o", "token": 3_i64, "acquired_at": DateTime::from_millis(0), "expires_at": "tomorrow" },
            DateTime::from_millis(0),
        );
        assert_eq!(r.malformed.as_deref(), Some("expires_at is a string"));
        assert_eq!(r.expires_at, None);
        assert!(r.expired, "an expiry that is not a date counts as expired");
        let r = record(&doc! { "_id": "r" }, DateTime::from_millis(0));
        assert_eq!(
            r.malformed.as_deref(),
            Some(
                "owner is missing, acquired_at is missing, expires_at is missing, token is missing"
            )
        );
    }

    /// The acquire as a model, under arbitrary interleavings of four acquirers (two owner
    /// ids), expiries, deletions of the lock document, release-all, and replays of any
    /// lease ever handed out (renew evaluated with the real [`cas_filter`], release with
    /// the real [`holds`] expression of its pipeline, checked to agree).
    /// The fast path (a token from the document's block, one write) and the slow path
    /// (nonce, block reserved in the counter, commit) follow [`acquire_pipeline`] and
    /// [`reserve_pipeline`]; the block size is small so blocks run out. Two properties:
    /// every committed token is above every token committed before on the resource
    /// (across release, expiry, crashes — an acquirer that never takes its next step —
    /// and deletion), and a replayed lease matches only the committed acquisition that
    /// handed it out (issue 11, finding 2: not a newer one of the same owner id, not one
    /// whose token is pending).
    ///
    /// Session 16: any step's reply may be lost (the write applies, the attempt fails):
    /// the step-2 failure frees the half-acquired lock as `try_acquire` does, and the
    /// actor's next attempt in the same blocking acquire also matches the acquisitions of
    /// its failed attempts ([`acquire_condition`]). A third property: an attempt that
    /// takes a lock only by that match takes it from an acquisition no lease was ever
    /// handed out for.
    mod acquire_model {
        use mongodb::bson::{Bson, DateTime, Document, doc};
        use proptest::prelude::*;

        use super::super::{cas_filter, holds};
        use crate::lock::lease::Lease;
        use crate::token::FencingToken;

        #[derive(Clone, Debug)]
        struct LockDoc {
            owner: Option<String>,
            pending: Option<String>,
            token: Option<i64>,
            ceiling: Option<i64>,
            expired: bool,
            /// The nonce of the acquisition that last wrote `owner`.
            acquisition: u64,
        }

        #[derive(Clone, Debug)]
        enum Phase {
            Idle,
            Pending { nonce: u64, previous: i64 },
            Reserved { nonce: u64, ceiling: i64 },
        }

        #[derive(Clone, Debug)]
        enum Op {
            /// The actor's next step; `true`: its write applies but its reply is lost.
            Step(usize, bool),
            Expire,
            Delete,
            ReleaseAll(usize),
            Replay {
                lease: usize,
                release: bool,
            },
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                8 => (0..4_usize, prop::bool::weighted(0.15)).prop_map(|(a, lost)| Op::Step(a, lost)),
                2 => Just(Op::Expire),
                1 => Just(Op::Delete),
                1 => (0..2_usize).prop_map(Op::ReleaseAll),
                4 => (0..64_usize, any::<bool>()).prop_map(|(lease, release)| Op::Replay { lease, release }),
            ]
        }

        fn owner_of(actor: usize) -> String {
            format!("owner-{}", actor % 2)
        }

        fn stored(d: &LockDoc) -> Document {
            let mut b =
                doc! { "_id": "r", "owner": d.owner.clone().map_or(Bson::Null, Bson::String) };
            if let Some(t) = d.token {
                b.insert("token", t);
            }
            if let Some(c) = d.ceiling {
                b.insert("ceiling", c);
            }
            if let Some(p) = &d.pending {
                b.insert("pending", p.as_str());
            }
            b
        }

        /// Evaluates the filter shapes `cas_filter` uses: equality and `{$exists: false}`.
        fn matches(filter: &Document, d: &Document) -> bool {
            filter.iter().all(|(k, cond)| match cond {
                Bson::Document(c) if c == &doc! { "$exists": false } => !d.contains_key(k),
                Bson::Document(c) if c.keys().any(|op| op.starts_with('$')) => {
                    panic!("operator not modelled: {c}")
                }
                v => d.get(k) == Some(v),
            })
        }

        /// Evaluates the expressions [`holds`] uses: `$and`, `$eq`, `$type` (of a field
        /// that is missing or not), `$literal`, field paths and constants.
        fn eval(e: &Bson, d: &Document) -> Bson {
            match e {
                Bson::String(p) if p.starts_with('$') => {
                    d.get(&p[1..]).cloned().unwrap_or(Bson::Undefined)
                }
                Bson::Document(op) => match op.iter().next() {
                    Some((k, Bson::Array(args))) if k == "$and" => {
                        Bson::Boolean(args.iter().all(|a| eval(a, d) == Bson::Boolean(true)))
                    }
                    Some((k, Bson::Array(args))) if k == "$eq" => {
                        Bson::Boolean(eval(&args[0], d) == eval(&args[1], d))
                    }
                    Some((k, arg)) if k == "$type" => match eval(arg, d) {
                        Bson::Undefined => Bson::String("missing".into()),
                        _ => Bson::String("present".into()),
                    },
                    Some((k, v)) if k == "$literal" => v.clone(),
                    _ => panic!("expression not modelled: {op}"),
                },
                v => v.clone(),
            }
        }

        fn lease(owner: String, token: i64) -> Lease {
            Lease {
                resource: "r".into(),
                owner,
                token: FencingToken::new(token),
                acquired_at: DateTime::from_millis(0),
                expires_at: DateTime::from_millis(0),
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]
            #[test]
            fn tokens_strictly_increase_and_a_lease_matches_only_its_own_acquisition(
                block in 1..4_i64,
                ops in proptest::collection::vec(op(), 1..300),
            ) {
                let mut doc: Option<LockDoc> = None;
                let mut counter = 0_i64;
                let mut phases = vec![Phase::Idle; 4];
                // Every lease handed out, with the nonce of its acquisition.
                let mut leases: Vec<(Lease, u64)> = Vec::new();
                let mut highest = 0_i64;
                let mut nonces = 0_u64;
                // Per actor: the nonces of its blocking acquire's failed attempts.
                let mut unknown: Vec<Vec<u64>> = vec![Vec::new(); 4];
                for op in ops {
                    match op {
                        Op::Step(a, lost) => match phases[a].clone() {
                            Phase::Idle => {
                                let free = doc.as_ref().is_none_or(|d| d.owner.is_none() || d.expired);
                                let mine = doc.as_ref().is_some_and(|d| unknown[a].contains(&d.acquisition));
                                if !free && !mine {
                                    continue;
                                }
                                if !free
                                    && let Some(d) = &doc
                                {
                                    prop_assert!(
                                        leases.iter().all(|(_, n)| *n != d.acquisition),
                                        "took back acquisition {} that handed out a lease", d.acquisition
                                    );
                                }
                                nonces += 1;
                                let (token, ceiling, pending) = doc.as_ref().map_or((None, None, None), |d| (d.token, d.ceiling, d.pending.clone()));
                                // acquire_pipeline: a token left in the block and no
                                // pending nonce → token + 1.
                                let next = match (token, ceiling, pending) {
                                    (Some(t), Some(c), None) if t < c => Some(t + 1),
                                    _ => None,
                                };
                                doc = Some(LockDoc {
                                    owner: Some(owner_of(a)),
                                    pending: next.is_none().then(|| format!("n{nonces}")),
                                    token: next.or(token),
                                    ceiling,
                                    expired: false,
                                    acquisition: nonces,
                                });
                                if let Some(t) = next {
                                    prop_assert!(t > highest, "fast token {t} after {highest}");
                                    highest = t;
                                    if lost {
                                        unknown[a].push(nonces);
                                    } else {
                                        leases.push((lease(owner_of(a), t), nonces));
                                        unknown[a].clear();
                                    }
                                } else if lost {
                                    unknown[a].push(nonces);
                                } else {
                                    phases[a] = Phase::Pending { nonce: nonces, previous: token.unwrap_or(0) };
                                }
                            }
                            Phase::Pending { nonce, previous } => {
                                // reserve_pipeline.
                                counter = counter.max(previous) + block;
                                phases[a] = Phase::Reserved { nonce, ceiling: counter };
                                if lost {
                                    // The attempt fails: it frees the half-acquired lock
                                    // (owner and pending nonce) and the block is never used.
                                    phases[a] = Phase::Idle;
                                    unknown[a].push(nonce);
                                    if let Some(d) = doc.as_mut()
                                        && d.owner.as_deref() == Some(owner_of(a).as_str())
                                        && d.pending.as_deref() == Some(format!("n{nonce}").as_str())
                                    {
                                        d.owner = None;
                                        d.pending = None;
                                    }
                                }
                            }
                            Phase::Reserved { nonce, ceiling } => {
                                phases[a] = Phase::Idle;
                                if lost {
                                    unknown[a].push(nonce);
                                }
                                let Some(d) = doc.as_mut() else { continue };
                                if d.owner.as_deref() == Some(owner_of(a).as_str())
                                    && d.pending.as_deref() == Some(format!("n{nonce}").as_str())
                                {
                                    let t = ceiling - block + 1;
                                    d.token = Some(t);
                                    d.ceiling = Some(ceiling);
                                    d.pending = None;
                                    prop_assert!(t > highest, "slow token {t} after {highest}");
                                    highest = t;
                                    if !lost {
                                        leases.push((lease(owner_of(a), t), nonce));
                                        unknown[a].clear();
                                    }
                                }
                            }
                        },
                        Op::Expire => {
                            if let Some(d) = doc.as_mut() {
                                d.expired = true;
                            }
                        }
                        Op::Delete => doc = None,
                        Op::ReleaseAll(o) => {
                            if let Some(d) = doc.as_mut()
                                && d.owner.as_deref() == Some(owner_of(o).as_str())
                            {
                                d.owner = None;
                                d.pending = None;
                            }
                        }
                        Op::Replay { lease, release } => {
                            if leases.is_empty() {
                                continue;
                            }
                            let (lease, nonce) = &leases[lease % leases.len()];
                            let Some(d) = doc.as_mut() else { continue };
                            // Release writes by `_id` with `holds` in its pipeline, renew
                            // filters by `cas_filter`: both must pick the same documents.
                            let by_filter = matches(&cas_filter(lease), &stored(d));
                            prop_assert_eq!(
                                eval(&Bson::Document(holds(lease)), &stored(d)),
                                Bson::Boolean(by_filter),
                                "release and renew disagree on {:?} for {:?}", d, lease
                            );
                            // Renew also needs a certainly valid expiry.
                            if (release || !d.expired) && by_filter {
                                prop_assert!(
                                    d.pending.is_none() && d.acquisition == *nonce,
                                    "lease {lease:?} of acquisition {nonce} matched {d:?}"
                                );
                                if release {
                                    d.owner = None;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
