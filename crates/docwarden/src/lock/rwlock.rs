//! Read/write locks: many readers or one writer per resource, with writer preference and
//! a fenced writer, in one lock document per resource of a lock collection.
//!
//! **Format:** the lock document of a [`LockCollection`] (the writer is its holder:
//! `owner`, `token`, `expires_at`) plus an array `readers` of `{owner, id, acquired_at,
//! expires_at}` entries, one per read lease (field names in
//! [`crate::format::lock::rwlock`]).
//!
//! **Guarantee:** by the server's clock (with the clock's bound and a skew margin), no
//! read lease is valid while a write lease is, and no two write leases are valid at once.
//! A reader enters in one atomic write only while no writer is set or the writer's lease
//! has certainly expired (then the reader clears it); a writer first registers its intent
//! (it takes the lock document's lease, which makes new readers wait: **writer
//! preference**, readers cannot starve a waiting writer), then waits until every reader's
//! entry has certainly expired or been released, and only then returns its [`Lease`]. The
//! writer's lease carries a fencing token from the lock collection's counter (strictly
//! increasing per resource, across deletion of the document); fence its writes with
//! [`super::Fence::apply`]. A crashed reader's or writer's lease expires by server time.
//!
//! **Limits:** like every lease, a read or write lease is a promise about time: a holder
//! paused past its expiry still believes it holds it. Writes must be fenced (the writer's
//! token); readers' reads cannot be fenced, so a reader that must not act on data a
//! writer changed must check [`ReadLease::is_certainly_valid`] after reading. Readers
//! already inside may renew while a writer waits; a writer waits for them at most its
//! `wait`. Writers among themselves have no order (whoever takes the lease first). Garbage
//! collection never deletes a document with a live lease inside: every write (the
//! writer's, every reader's entry and renewal) keeps the lock document's `gc_at`, the TTL
//! index's field, at or after every lease expiry in it (`docs/locks.md`).

use std::time::{Duration, Instant};

use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::options::IndexOptions;
use mongodb::{Collection, Database, IndexModel};
use tracing::instrument;

use super::collection::{
    LockCollection, LockListFilter, LockOptions, acquire_filter, as_rfc3339, keep_gc_at, listing,
};
use super::deadline::{Deadline, Unanswered};
use super::landing;
use super::lease::{Lease, Owner};
use super::wake::Wake;
use crate::clock::{ServerTime, TimeSource};
use crate::error::{self, Error, Result};
use crate::format::lock::{collection as f, rwlock as rf};
use crate::token::{FencingToken, JobToken, Token};
use crate::validate;

/// Options of [`RwLocks`], validated once by [`RwLocks::new`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RwLockOptions {
    /// How often a waiting reader or writer re-reads the lock when no change arrives (a
    /// lease that lapses without a release is not a change event; without change streams
    /// this is the only way). Default 250 ms.
    pub poll_interval: Duration,
    /// The options of the lock collection [`RwLocks::open`] opens (backoff of the waits,
    /// `gc_after`, write concern, …). Default [`LockOptions::default`]. [`RwLocks::new`]
    /// takes a [`LockCollection`] that already has its own, and ignores this field.
    pub locks: LockOptions,
    control: RwControl,
}

/// Which single safeguard a control run switches off. Never set outside tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum RwControl {
    #[default]
    None,
    /// The writer does not wait for readers to leave.
    WriterIgnoresReaders,
    /// Readers enter whatever the writer (no writer preference, no exclusion).
    ReadersIgnoreWriter,
}

impl Default for RwLockOptions {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_millis(250),
            locks: LockOptions::default(),
            control: RwControl::None,
        }
    }
}

impl RwLockOptions {
    /// Sets [`RwLockOptions::poll_interval`].
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Sets [`RwLockOptions::locks`], the options of the lock collection
    /// [`RwLocks::open`] opens.
    pub fn locks(mut self, locks: LockOptions) -> Self {
        self.locks = locks;
        self
    }

    /// Test controls only, **unsafe**: a writer returns its lease without waiting for the
    /// readers inside to leave. Shows what the drain prevents.
    #[doc(hidden)]
    pub fn unsafe_writer_ignores_readers(mut self) -> Self {
        self.control = RwControl::WriterIgnoresReaders;
        self
    }

    /// Test controls only, **unsafe**: readers enter even while a writer holds or waits
    /// (no exclusion of the writer, no writer preference). Shows what the check prevents.
    #[doc(hidden)]
    pub fn unsafe_readers_ignore_writer(mut self) -> Self {
        self.control = RwControl::ReadersIgnoreWriter;
        self
    }
}

/// A read lease: one entry in the lock document's `readers`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadLease {
    /// The locked resource.
    pub resource: String,
    /// The reader's owner id.
    pub owner: String,
    /// The random id of this read acquisition.
    pub id: String,
    /// Server time (estimated) when it was acquired.
    pub acquired_at: DateTime,
    /// Server time (estimated) when it expires unless renewed.
    pub expires_at: DateTime,
}

impl ReadLease {
    /// Whether the read lease is still certainly valid at `now`, `margin_ms` included.
    pub fn is_certainly_valid(&self, now: &ServerTime, margin_ms: i64) -> bool {
        now.certainly_before(self.expires_at, margin_ms)
    }

    fn lost(&self) -> Error {
        Error::LeaseLost {
            resource: self.resource.clone(),
            token: Token::Job(JobToken::new(self.id.clone())),
        }
    }
}

/// A read/write lock as stored, for listing ([`RwLocks::list`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RwLockRecord {
    /// The resource.
    pub resource: String,
    /// The writer (holding, or waiting for readers to leave), if any.
    pub writer: Option<RwWriterRecord>,
    /// The read holders, expired ones included until the next write removes them.
    pub readers: Vec<RwReaderRecord>,
}

/// The writer of a [`RwLockRecord`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RwWriterRecord {
    /// The writer's owner id.
    pub owner: String,
    /// Its fencing token (`None` while its acquire is between steps).
    pub token: Option<FencingToken>,
    /// When its lease expires unless renewed (server time).
    #[serde(serialize_with = "as_rfc3339")]
    pub expires_at: Option<DateTime>,
    /// Whether it has certainly expired.
    pub expired: bool,
    /// Whether it is still waiting for readers to leave (it holds only its intent).
    pub waiting: bool,
}

/// A reader of a [`RwLockRecord`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RwReaderRecord {
    /// The reader's owner id.
    pub owner: String,
    /// When its read lease expires unless renewed (server time).
    #[serde(serialize_with = "as_rfc3339")]
    pub expires_at: Option<DateTime>,
    /// Whether it has certainly expired.
    pub expired: bool,
}

/// Read/write locks in one lock collection; see the module docs.
#[derive(Clone, Debug)]
pub struct RwLocks {
    locks: LockCollection,
    options: RwLockOptions,
}

impl RwLocks {
    /// Read/write locks in `locks` (the writers' tokens come from its counter). Only
    /// validates.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a zero poll interval.
    pub fn new(locks: LockCollection, options: RwLockOptions) -> Result<Self> {
        validate::duration_ms("poll interval", options.poll_interval)?;
        Ok(Self { locks, options })
    }

    /// Read/write locks in collection `name` of `db`: [`LockCollection::open`] with
    /// [`RwLockOptions::locks`] and an index on the readers' owner ids (for
    /// [`RwLocks::release_all`]).
    ///
    /// # Errors
    /// As [`RwLocks::new`] and [`LockCollection::open`].
    pub async fn open(
        db: &Database,
        name: &str,
        time: TimeSource,
        options: RwLockOptions,
    ) -> Result<Self> {
        validate::duration_ms("poll interval", options.poll_interval)?;
        let locks = LockCollection::open(db, name, time, options.locks.clone()).await?;
        let this = Self::new(locks, options)?;
        this.coll()
            .create_index(
                IndexModel::builder()
                    .keys(doc! { format!("{}.{}", rf::READERS, rf::READER_OWNER): 1 })
                    .options(
                        IndexOptions::builder()
                            .name("readers_owner".to_owned())
                            .build(),
                    )
                    .build(),
            )
            .await?;
        Ok(this)
    }

    /// The lock collection underneath (renew or watch a write lease with it:
    /// [`LockCollection::renew`], [`super::Watchdog::start`]).
    pub fn locks(&self) -> &LockCollection {
        &self.locks
    }

    fn coll(&self) -> &Collection<Document> {
        self.locks.collection()
    }

    fn margin(&self) -> i64 {
        self.locks.time().skew_margin_ms()
    }

    /// Tries once to take a read lease on `resource` for `ttl`. `Ok(None)` while a writer
    /// holds or waits (writer preference) and its lease has not certainly expired.
    ///
    /// An attempt that ends without an answer (an error after its write was sent, or its
    /// future dropped) has its entry pulled once its landing deadline (2 s after it was
    /// sent) has passed, instead of holding writers up for its ttl; a write reaching the
    /// server later enters nothing (`lock/landing.rs`).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an invalid resource or owner or a ttl not longer than the skew margin; a database
    /// error.
    pub async fn try_read(
        &self,
        owner: &Owner,
        resource: &str,
        ttl: Duration,
    ) -> Result<Option<ReadLease>> {
        self.read_attempt(owner, resource, ttl, &validate::random_id(), &[])
            .await
    }

    /// One read attempt with entry id `id`. `unknown`: the entry ids of this blocking
    /// read's earlier attempts that failed with a transient error, so may have entered
    /// without the reply saying so (`lock/deadline.rs`, [`Unanswered`]); empty for
    /// [`RwLocks::try_read`]. With `unknown` non-empty the attempt also enters while a
    /// writer holds or waits if one of those entries is in the document and still certainly
    /// valid (the lost reply's read lease, which that writer is waiting for anyway): the
    /// attempt then renews it under its own id, as [`RwLocks::renew_read`] would. Either
    /// way the attempt removes those entries, so they do not hold writers up until their
    /// ttl. Every attempt carries a landing deadline and a clean-up
    /// (`lock/landing.rs`, see [`RwLocks::read`]).
    #[instrument(name = "try_read", skip(self, owner, id, unknown), fields(collection = %self.coll().name()))]
    async fn read_attempt(
        &self,
        owner: &Owner,
        resource: &str,
        ttl: Duration,
        id: &str,
        unknown: &[String],
    ) -> Result<Option<ReadLease>> {
        validate::name("resource", resource)?;
        validate::name("owner", owner.id())?;
        let ttl_ms = super::lease::ttl_ms("ttl", ttl, self.margin())?;
        let now = self.locks.time().now().await?;
        let cutoff = now.expired_before(self.margin());
        let lease = ReadLease {
            resource: resource.to_owned(),
            owner: owner.id().to_owned(),
            id: id.to_owned(),
            acquired_at: now.estimate(),
            expires_at: now.plus_ms(ttl_ms),
        };
        let ignore_writer = self.options.control == RwControl::ReadersIgnoreWriter;
        let filter = if ignore_writer {
            doc! { "_id": resource }
        } else if unknown.is_empty() {
            acquire_filter(resource, cutoff)
        } else {
            let mut filter = acquire_filter(resource, cutoff);
            let mine = doc! { rf::READERS: { "$elemMatch": {
                rf::READER_ID: { "$in": unknown },
                rf::READER_EXPIRES_AT: { "$gt": certainly_valid_after(&now, self.margin()) },
            } } };
            if let Ok(and) = filter.get_array_mut("$and")
                && let Some(Bson::Document(free)) = and.get_mut(1)
                && let Ok(or) = free.get_array_mut("$or")
            {
                or.push(Bson::Document(mine));
            }
            filter
        };
        // The attempt appends its entry only while the server's clock is before
        // `land_by`: a write the client gave up on that reaches the server later adds
        // nothing, and until the attempt answers, the entry an unanswered write added is
        // pulled once `land_by` has passed (`lock/landing.rs`; armed below, before the
        // write is sent). A slow attempt may match and not enter (`entered`).
        let land_by = landing::deadline(&now);
        let writer = if ignore_writer {
            Writer::Keep
        } else if unknown.is_empty() {
            Writer::Clear
        } else {
            Writer::ClearIfFree
        };
        let update = read_pipeline(&lease, cutoff, writer, unknown, Some(land_by));
        let cleanup = landing::CleanUp::new(
            self.coll(),
            self.locks.time(),
            doc! { "_id": resource, format!("{}.{}", rf::READERS, rf::READER_ID): &lease.id },
            doc! { "$pull": { rf::READERS: { rf::READER_ID: &lease.id } } },
            land_by,
            "read lock",
        );
        let outcome = self.enter(resource, filter, update, lease, land_by).await;
        if outcome.is_ok() {
            cleanup.settled();
        }
        outcome
    }

    /// The write of one read attempt: `update` on `filter`, upserted. A held lock makes
    /// the upsert collide with the document on `_id`; so does a racing first insert of the
    /// document: one more try tells them apart.
    async fn enter(
        &self,
        resource: &str,
        filter: Document,
        update: Vec<Document>,
        lease: ReadLease,
        land_by: DateTime,
    ) -> Result<Option<ReadLease>> {
        for attempt in 0..2 {
            match self
                .coll()
                .update_one(filter.clone(), update.clone())
                .upsert(true)
                .await
            {
                Ok(r) if r.matched_count == 1 || r.upserted_id.is_some() => {
                    if !self.entered(resource, &lease.id, land_by).await? {
                        tracing::debug!(
                            resource,
                            "read attempt applied after its landing deadline"
                        );
                        break;
                    }
                    crate::observe::lock_acquired(self.coll().name(), None);
                    tracing::debug!(resource, "read lease taken");
                    return Ok(Some(lease));
                }
                Ok(_) => break,
                Err(e) if error::is_duplicate_key(&e) && attempt == 0 => {}
                Err(e) if error::is_duplicate_key(&e) => break,
                Err(e) => return Err(e.into()),
            }
        }
        crate::observe::lock_busy(self.coll().name());
        Ok(None)
    }

    /// Whether an attempt with landing deadline `land_by` whose write matched (or
    /// inserted) appended its entry: certainly, if its reply came while the server's
    /// clock was certainly before `land_by`; otherwise the document is read back.
    async fn entered(&self, resource: &str, id: &str, land_by: DateTime) -> Result<bool> {
        if self.locks.time().now().await?.latest() < land_by {
            return Ok(true);
        }
        let d = self.coll().find_one(doc! { "_id": resource }).await?;
        Ok(d.is_some_and(|d| {
            d.get_array(rf::READERS).is_ok_and(|rs| {
                rs.iter().any(|r| {
                    r.as_document()
                        .is_some_and(|r| r.get_str(rf::READER_ID).ok() == Some(id))
                })
            })
        }))
    }

    /// Takes a read lease, waiting until the writer leaves (woken by its release, see
    /// `lock/wake.rs`) or `wait` has passed (`Ok(None)`). Transient errors
    /// ([`Error::is_retryable`]) are retried with backoff within the wait
    /// (`lock/deadline.rs`). An attempt that failed may still reach the server later (its
    /// reply was lost, or the request was held): each attempt appends its entry only while
    /// the server's clock is before its landing deadline (sent + 2 s, `$$NOW` in the
    /// pipeline), and once an unanswered attempt's deadline has certainly passed one
    /// `$pull` removes its entry, in the background, whether the read entered or not
    /// (`lock/landing.rs`; the same for a [`RwLocks::try_read`] since session 24).
    ///
    /// # Errors
    /// As [`RwLocks::try_read`]; a transient error only if the wait passed with the last
    /// attempt failing.
    pub async fn read(
        &self,
        owner: &Owner,
        resource: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Option<ReadLease>> {
        let called = Instant::now();
        let mut deadline = Deadline::after(wait);
        let mut backoff = self.locks.backoff()?;
        let mut wake = Wake::new(self.coll(), resource, Wake::freed_lock());
        // Attempts that failed with a transient error may have entered all the same (a
        // lost reply): the next attempts take their entries back (`read_attempt`).
        let mut unanswered = Unanswered::default();
        loop {
            let id = validate::random_id();
            let result = self
                .read_attempt(owner, resource, ttl, &id, unanswered.nonces())
                .await;
            unanswered.note(id, &result);
            match deadline.attempt(result) {
                Ok(Some(lease)) => {
                    crate::observe::lock_handoff(self.coll().name(), called, None);
                    return Ok(Some(lease));
                }
                Ok(None) => {}
                Err(e) => return Err(e),
            }
            let Some(left) = deadline.left() else {
                return deadline.passed();
            };
            if deadline.failing() {
                tokio::time::sleep(backoff.next_delay().min(left)).await;
                continue;
            }
            if wake.arm().await {
                continue;
            }
            wake.wait(self.options.poll_interval.min(left)).await;
        }
    }

    /// Extends a read lease to `ttl` from now, only while it is certainly valid.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if it expired, was released or its entry removed;
    /// [`Error::InvalidInput`] for a ttl not longer than the time source's skew margin (zero included); a database error.
    pub async fn renew_read(&self, lease: &mut ReadLease, ttl: Duration) -> Result<()> {
        let ttl_ms = super::lease::ttl_ms("ttl", ttl, self.margin())?;
        let now = self.locks.time().now().await?;
        let valid_after = certainly_valid_after(&now, self.margin());
        let expires_at = now.plus_ms(ttl_ms);
        let filter = doc! {
            "_id": &lease.resource,
            rf::READERS: { "$elemMatch": {
                rf::READER_ID: &lease.id,
                rf::READER_EXPIRES_AT: { "$gt": valid_after },
            } },
        };
        let this = format!("$$r.{}", rf::READER_ID);
        let update = vec![doc! { "$set": {
            rf::READERS: { "$map": {
                "input": format!("${}", rf::READERS),
                "as": "r",
                "in": { "$cond": [
                    { "$eq": [this, { "$literal": &lease.id }] },
                    // Never earlier than stored: a renewal that lands after a later one
                    // (its holder stopped waiting for it) does not move the lease back.
                    { "$mergeObjects": ["$$r", { rf::READER_EXPIRES_AT: {
                        "$max": [format!("$$r.{}", rf::READER_EXPIRES_AT), { "$literal": expires_at }],
                    } }] },
                    "$$r",
                ] },
            } },
            f::GC_AT: keep_gc_at(expires_at),
        } }];
        let r = self.coll().update_one(filter, update).await?;
        if r.matched_count == 0 {
            return Err(lease.lost());
        }
        lease.expires_at = expires_at;
        Ok(())
    }

    /// Releases a read lease (removes its entry): a writer waiting for it proceeds at once.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if its entry is gone (expired and removed by a later reader,
    /// or released already); a database error.
    pub async fn release_read(&self, lease: &ReadLease) -> Result<()> {
        let r = self
            .coll()
            .update_one(
                doc! { "_id": &lease.resource, format!("{}.{}", rf::READERS, rf::READER_ID): &lease.id },
                doc! { "$pull": { rf::READERS: { rf::READER_ID: &lease.id } } },
            )
            .await?;
        if r.matched_count == 0 {
            return Err(lease.lost());
        }
        Ok(())
    }

    /// Tries once to take the write lease: `Ok(None)` if another writer holds it or
    /// readers are inside (then the intent is withdrawn at once).
    ///
    /// # Errors
    /// As [`RwLocks::write`].
    pub async fn try_write(
        &self,
        owner: &Owner,
        resource: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>> {
        self.write(owner, resource, ttl, Duration::ZERO).await
    }

    /// Takes the write lease on `resource` for `ttl`, waiting at most `wait`: first the
    /// lock document's lease (the intent, which keeps new readers out), then until every
    /// reader inside has released or certainly expired, renewing the intent meanwhile. The
    /// returned [`Lease`] is fenced by its token; renew and release it with
    /// [`RwLocks::locks`] (or [`RwLocks::release_write`]). An intent that lapses while
    /// waiting (its renewals failed longer than its ttl, the process paused) or is taken
    /// over by another writer is withdrawn and registered again (a new token) while the
    /// wait lasts. `Ok(None)` if `wait` passed (the intent is withdrawn).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a ttl not longer than the time source's skew margin (such
    /// a lease is never certainly valid); otherwise as [`LockCollection::acquire`].
    #[instrument(skip(self, owner), fields(collection = %self.coll().name()))]
    pub async fn write(
        &self,
        owner: &Owner,
        resource: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Option<Lease>> {
        let mut deadline = Deadline::after(wait);
        // Only a certainly valid intent becomes the write lease, and an intent is certainly
        // valid only while more than the skew margin (plus the clock's bound) is left: a
        // shorter ttl could never be handed out, and would register one intent after
        // another until the wait passed.
        let ttl_ms = super::lease::ttl_ms("ttl", ttl, self.margin())?;
        let mut backoff = self.locks.backoff()?;
        let Some(mut lease) = self.locks.acquire(owner, resource, ttl, wait).await? else {
            return Ok(None);
        };
        if self.options.control == RwControl::WriterIgnoresReaders {
            return Ok(Some(lease));
        }
        let mut wake = Wake::new(
            self.coll(),
            resource,
            doc! { "operationType": { "$in": ["update", "replace", "delete", "invalidate"] } },
        );
        loop {
            let delay = match self.readers_inside(&mut lease, ttl, ttl_ms).await {
                Ok(Readers::Gone) => {
                    tracing::debug!(resource, token = lease.token.get(), "write lease taken");
                    return Ok(Some(lease));
                }
                Ok(Readers::TakenOver) => {
                    tracing::debug!(resource, "write intent lost while readers were inside");
                    // Lapsed by this copy of the lease only (renewals that applied but
                    // lost their replies extended it on the server): withdraw it, or it
                    // keeps readers out until then. A no-op when it was taken over.
                    self.withdraw(&lease).await;
                    // The caller's wait is not over: register the intent again (a new
                    // acquisition, a new token) and wait on. The lapsed intent is never
                    // handed out: only an intent that finds the readers gone while it
                    // is certainly valid is (`readers_inside`).
                    // With backoff: an intent that keeps lapsing (a clock bound that
                    // eats the ttl) must not turn the wait into a busy loop.
                    let Some(left) = deadline.left() else {
                        return deadline.passed();
                    };
                    tokio::time::sleep(backoff.next_delay().min(left)).await;
                    let Some(left) = deadline.left() else {
                        return deadline.passed();
                    };
                    let Some(again) = self.locks.acquire(owner, resource, ttl, left).await? else {
                        return Ok(None);
                    };
                    tracing::debug!(
                        resource,
                        token = again.token.get(),
                        "write intent registered again"
                    );
                    lease = again;
                    deadline.attempted();
                    continue;
                }
                Ok(Readers::Inside { until_expiry }) => {
                    deadline.attempted();
                    until_expiry
                }
                Err(e) => {
                    if let Err(e) = deadline.absorb(e) {
                        self.withdraw(&lease).await;
                        return Err(e);
                    }
                    backoff.next_delay()
                }
            };
            let Some(left) = deadline.left() else {
                self.withdraw(&lease).await;
                return deadline.passed();
            };
            if deadline.failing() {
                tokio::time::sleep(delay.min(left)).await;
                continue;
            }
            if wake.arm().await {
                continue;
            }
            let delay = self
                .options
                .poll_interval
                .min(left)
                .min(delay)
                .min(ttl / 3)
                .max(Duration::from_millis(1));
            wake.wait(delay).await;
        }
    }

    /// One look at the readers inside while `lease` (the write intent) waits for them:
    /// gone (the write lease is taken), the intent taken over or lapsed, or readers still
    /// inside (the first of them certainly expires after `until_expiry`). Renews the
    /// intent a third of the ttl before it stops being certainly valid.
    async fn readers_inside(
        &self,
        lease: &mut Lease,
        ttl: Duration,
        ttl_ms: i64,
    ) -> Result<Readers> {
        let now = self.locks.time().now().await?;
        let cutoff = now.expired_before(self.margin());
        let mine = doc! {
            "_id": &lease.resource,
            f::OWNER: &lease.owner,
            f::TOKEN: lease.token,
            f::PENDING: { "$exists": false },
        };
        let Some(d) = self.coll().find_one(mine).await? else {
            return Ok(Readers::TakenOver);
        };
        // A renewal that failed (a transient error) may have let the intent lapse: then
        // it is no lease to hand out, whatever the readers did.
        if lease.remaining_ms(&now) <= 0 {
            return Ok(Readers::TakenOver);
        }
        // Renew while the intent is still certainly valid (the renewal requires it):
        // a third of the ttl before it stops being so. Also when the readers have gone:
        // the lease handed out must be certainly valid, and an intent whose renewals
        // failed (transient errors) may no longer be (session 17: it was handed out with
        // less than the clock's bound and margin left).
        let renew_below = ttl_ms
            .saturating_div(3)
            .saturating_add(now.bound_ms)
            .saturating_add(self.margin());
        if lease.remaining_ms(&now) < renew_below {
            match self.locks.renew(lease, ttl).await {
                Ok(()) => {}
                Err(Error::LeaseLost { .. }) => return Ok(Readers::TakenOver),
                Err(e) => return Err(e),
            }
        }
        let live = live_readers(&d, cutoff);
        let Some(first_expiry) = live.iter().min().copied() else {
            return Ok(Readers::Gone);
        };
        // The first live reader certainly expires this long from now.
        let until_expiry = first_expiry
            .timestamp_millis()
            .saturating_sub(cutoff.timestamp_millis())
            .saturating_add(1);
        Ok(Readers::Inside {
            until_expiry: Duration::from_millis(u64::try_from(until_expiry).unwrap_or(1)),
        })
    }

    /// Withdraws a write intent that will not become a write lease. A withdrawal that
    /// fails with a transient error is finished in the background
    /// ([`LockCollection::release_in_background`]): before session 35 it was dropped, and
    /// the intent kept readers out until its ttl. Only when that also fails for a minute
    /// does the intent expire with its ttl.
    async fn withdraw(&self, lease: &Lease) {
        self.locks
            .release_in_background(lease, "write intent withdrawal")
            .await;
    }

    /// Releases a write lease ([`LockCollection::release`]).
    ///
    /// # Errors
    /// As [`LockCollection::release`].
    pub async fn release_write(&self, lease: &Lease) -> Result<()> {
        self.locks.release(lease).await
    }

    /// Releases every read and write lease of `owner`; returns how many lock documents
    /// were changed.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an invalid owner id; a database error.
    pub async fn release_all(&self, owner: &Owner) -> Result<u64> {
        let writers = self.locks.release_all(owner).await?;
        let readers = self
            .coll()
            .update_many(
                doc! { format!("{}.{}", rf::READERS, rf::READER_OWNER): owner.id() },
                doc! { "$pull": { rf::READERS: { rf::READER_OWNER: owner.id() } } },
            )
            .await?;
        Ok(writers + readers.modified_count)
    }

    /// Every read/write lock with a writer or readers, by resource.
    ///
    /// # Errors
    /// A database error.
    pub async fn list(&self) -> Result<Vec<RwLockRecord>> {
        self.list_matching(&LockListFilter::default()).await
    }

    /// The read/write locks with a writer or readers that match `filter`, by resource:
    /// with an owner id, those it holds as writer (or waiting writer) or reader; with a
    /// resource, that one; at most `limit` resources. A view should set a limit: a
    /// read/write lock per entity makes one document per entity.
    ///
    /// # Errors
    /// A database error.
    pub async fn list_matching(&self, filter: &LockListFilter) -> Result<Vec<RwLockRecord>> {
        let mut clauses = vec![doc! { "$or": [
            { f::OWNER: { "$ne": Bson::Null } },
            { format!("{}.0", rf::READERS): { "$exists": true } },
        ] }];
        if let Some(owner) = &filter.owner {
            clauses.push(doc! { "$or": [
                { f::OWNER: owner.as_str() },
                { format!("{}.{}", rf::READERS, rf::READER_OWNER): owner.as_str() },
            ] });
        }
        if let Some(resource) = &filter.resource {
            clauses.push(doc! { "_id": resource.as_str() });
        }
        let now = self.locks.time().now().await?;
        let cutoff = now.expired_before(self.margin());
        let docs = listing(self.coll(), doc! { "$and": clauses }, None, filter.limit).await?;
        Ok(docs.iter().map(|d| rw_record(d, cutoff)).collect())
    }
}

/// What a writer waiting for the readers inside found ([`RwLocks::readers_inside`]).
enum Readers {
    /// No live reader: the write lease is taken.
    Gone,
    /// The intent was taken over, deleted, or lapsed.
    TakenOver,
    /// Readers are inside; the first certainly expires after `until_expiry`.
    Inside { until_expiry: Duration },
}

/// The expiries of the reader entries that have not certainly expired at `cutoff`
/// (entries whose expiry is not a date count as expired, like lock documents).
fn live_readers(d: &Document, cutoff: DateTime) -> Vec<DateTime> {
    d.get_array(rf::READERS)
        .map(|readers| {
            readers
                .iter()
                .filter_map(|r| match r {
                    Bson::Document(r) => r.get_datetime(rf::READER_EXPIRES_AT).ok().copied(),
                    _ => None,
                })
                .filter(|e| *e >= cutoff)
                .collect()
        })
        .unwrap_or_default()
}

/// What a reader's write does to the writer ([`read_pipeline`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Writer {
    /// Clear it: the filter admitted the document because its writer is absent or
    /// certainly expired.
    Clear,
    /// Clear it only if it is absent or certainly expired: the filter may also have
    /// admitted the document for an entry of this read's own lost attempts, with a live
    /// writer waiting.
    ClearIfFree,
    /// Leave it (the control that ignores the writer).
    Keep,
}

/// Server time after which a lease that expires later is still certainly valid now (the
/// clock's bound and `margin_ms` included): what a renewal requires.
fn certainly_valid_after(now: &ServerTime, margin_ms: i64) -> DateTime {
    DateTime::from_millis(
        now.estimate_ms
            .saturating_add(now.bound_ms)
            .saturating_add(margin_ms),
    )
}

/// A reader's entry: drop the reader entries that certainly expired and those of
/// `unknown` (this read's own earlier attempts whose replies were lost), add this one,
/// and clear the writer and any acquisition pending as `writer` says, so an expired
/// writer cannot renew. One stage: every expression reads the document before it.
fn read_pipeline(
    lease: &ReadLease,
    cutoff: DateTime,
    writer: Writer,
    unknown: &[String],
    land_by: Option<DateTime>,
) -> Vec<Document> {
    let readers = format!("${}", rf::READERS);
    let expiry = format!("$$r.{}", rf::READER_EXPIRES_AT);
    let live = doc! { "$gte": [expiry, { "$literal": cutoff }] };
    let keep = if unknown.is_empty() {
        live
    } else {
        let id = format!("$$r.{}", rf::READER_ID);
        doc! { "$and": [live, { "$not": [{ "$in": [id, { "$literal": unknown }] }] }] }
    };
    let entry = vec![Bson::Document(doc! {
        rf::READER_OWNER: { "$literal": &lease.owner },
        rf::READER_ID: { "$literal": &lease.id },
        rf::READER_ACQUIRED_AT: { "$literal": lease.acquired_at },
        rf::READER_EXPIRES_AT: { "$literal": lease.expires_at },
    })];
    let entry = match land_by {
        None => Bson::Array(entry),
        Some(land_by) => Bson::Document(doc! { "$cond": [
            landing::before(land_by),
            entry,
            [],
        ] }),
    };
    let mut set = doc! {
        rf::READERS: { "$concatArrays": [
            { "$filter": {
                "input": { "$cond": [{ "$isArray": &readers }, &readers, []] },
                "as": "r",
                "cond": keep,
            } },
            entry,
        ] },
        f::GC_AT: keep_gc_at(lease.expires_at),
    };
    match writer {
        Writer::Clear => {
            set.insert(f::OWNER, Bson::Null);
            set.insert(f::PENDING, "$$REMOVE");
        }
        Writer::ClearIfFree => {
            // The acquire filter's condition (`acquire_filter`), on the stored document.
            let expires_at = format!("${}", f::EXPIRES_AT);
            let owner = format!("${}", f::OWNER);
            let free = doc! { "$or": [
                { "$eq": [{ "$ifNull": [&owner, Bson::Null] }, Bson::Null] },
                { "$ne": [{ "$type": &expires_at }, "date"] },
                { "$lt": [&expires_at, { "$literal": cutoff }] },
            ] };
            set.insert(
                f::OWNER,
                doc! { "$cond": [free.clone(), Bson::Null, &owner] },
            );
            set.insert(
                f::PENDING,
                doc! { "$cond": [free, "$$REMOVE", format!("${}", f::PENDING)] },
            );
        }
        Writer::Keep => {}
    }
    vec![doc! { "$set": set }]
}

fn rw_record(d: &Document, cutoff: DateTime) -> RwLockRecord {
    let text = |v: Option<&Bson>| match v {
        Some(Bson::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => String::new(),
    };
    let live = live_readers(d, cutoff);
    let writer = match d.get(f::OWNER) {
        None | Some(Bson::Null) => None,
        owner => {
            let expires_at = d.get_datetime(f::EXPIRES_AT).ok().copied();
            let expired = expires_at.is_none_or(|e| e < cutoff);
            Some(RwWriterRecord {
                owner: text(owner),
                token: match (d.get(f::PENDING), d.get(f::TOKEN)) {
                    (None, Some(Bson::Int64(t))) => Some(FencingToken::new(*t)),
                    _ => None,
                },
                expires_at,
                expired,
                waiting: !expired && !live.is_empty(),
            })
        }
    };
    let readers = d
        .get_array(rf::READERS)
        .map(|rs| {
            rs.iter()
                .filter_map(|r| r.as_document())
                .map(|r| {
                    let expires_at = r.get_datetime(rf::READER_EXPIRES_AT).ok().copied();
                    RwReaderRecord {
                        owner: text(r.get(rf::READER_OWNER)),
                        expires_at,
                        expired: expires_at.is_none_or(|e| e < cutoff),
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    RwLockRecord {
        resource: text(d.get("_id")),
        writer,
        readers,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_readers_are_those_not_certainly_expired() {
        let d = doc! { rf::READERS: [
            { rf::READER_ID: "a", rf::READER_EXPIRES_AT: DateTime::from_millis(100) },
            { rf::READER_ID: "b", rf::READER_EXPIRES_AT: DateTime::from_millis(300) },
            { rf::READER_ID: "c", rf::READER_EXPIRES_AT: "soon" },
        ] };
        assert_eq!(
            live_readers(&d, DateTime::from_millis(200)),
            vec![DateTime::from_millis(300)]
        );
    }

    #[test]
    fn a_reader_clears_an_expired_writer_only_in_the_safe_pipeline() {
        let lease = ReadLease {
            resource: "r".into(),
            owner: "o".into(),
            id: "i".into(),
            acquired_at: DateTime::from_millis(0),
            expires_at: DateTime::from_millis(10),
        };
        let safe = read_pipeline(&lease, DateTime::from_millis(0), Writer::Clear, &[], None);
        let set = safe[0].get_document("$set").ok();
        assert_eq!(set.and_then(|s| s.get(f::OWNER)), Some(&Bson::Null));
        let control = read_pipeline(&lease, DateTime::from_millis(0), Writer::Keep, &[], None);
        let set = control[0].get_document("$set").ok();
        assert_eq!(set.and_then(|s| s.get(f::OWNER)), None);
    }

    #[test]
    fn records_show_a_waiting_writer() {
        let d = doc! {
            "_id": "r", f::OWNER: "w", f::TOKEN: 3_i64,
            f::EXPIRES_AT: DateTime::from_millis(1_000),
            rf::READERS: [{ rf::READER_OWNER: "o", rf::READER_ID: "i", rf::READER_EXPIRES_AT: DateTime::from_millis(500) }],
        };
        let r = rw_record(&d, DateTime::from_millis(100));
        assert_eq!(r.writer.as_ref().map(|w| w.waiting), Some(true));
        assert_eq!(r.readers.len(), 1);
        let r = rw_record(&d, DateTime::from_millis(600));
        assert_eq!(r.writer.as_ref().map(|w| w.waiting), Some(false));
        assert!(r.readers[0].expired);
    }
}
