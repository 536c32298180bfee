//! Counting semaphores: at most N holders ("permits") per resource, each permit a fenced
//! lease with its own fencing token.
//!
//! **One document per resource** in `<name>`: `{_id: resource, permits: N, holders:
//! [{owner, token, acquisition, acquired_at, until}], token, ceiling}` (field names in
//! [`crate::format::lock::semaphore`]). An acquire is one atomic `findOneAndUpdate` by
//! `_id` whose pipeline first drops the holders whose `until` is before the cut-off (server
//! time minus the clock bound and the skew margin, from the [`TimeSource`]), then appends
//! the new holder with `token + 1` only while fewer than `permits` holders remain, the
//! document's token block has a token left (`token < ceiling`) and the server's clock is
//! before the attempt's landing deadline (sent + 2 s; what an attempt that ended without
//! an answer appended is pulled after it, `lock/landing.rs`). A renewal is one
//! `findOneAndUpdate` by `_id` per resource document, whatever the number of permits of
//! that resource renewed at once ([`Semaphore::renew_many`]): it extends the holder
//! elements that match a permit's owner and token with a still certainly valid `until`;
//! release is one `$pull` of `(owner, token)`.
//!
//! **Tokens strictly increase per resource**, across release, expiry, crashes and deletion
//! of the document, the way [`super::LockCollection`] keeps them: tokens are handed out from
//! a block `(ceiling − block, ceiling]` reserved in the counter collection `<name>.tokens`,
//! which nothing deletes. When the document is missing or its block is used up, a refill
//! (1) marks the document with a random `refill` nonce (upsert), (2) raises the counter by a
//! block above the document's token, (3) commits the new ceiling compare-and-set on the
//! nonce. Between (1) and (3) no other refill can commit and the document cannot be
//! replaced without losing the nonce, so the new block starts above every token handed out.
//!
//! **N changes at run time** ([`Semaphore::set_permits`]): growing admits at once;
//! shrinking drops nobody, and no new permit is granted until fewer than N hold.
//!
//! **Limits:** a permit is a promise about time: a holder paused past `until` still believes
//! it holds; its writes must be fenced ([`super::Fence::apply`] with the [`Permit`], by token
//! order per target document). Tokens of one semaphore resource are comparable with each
//! other only. The counter collection must never be deleted or rolled back (majority write
//! concern on a replica set), as for the lock collection.

use std::time::{Duration, Instant};

use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::options::{IndexOptions, ReturnDocument, WriteConcern};
use mongodb::{Collection, Database, IndexModel};
use tracing::instrument;

use super::collection::{LockListFilter, listing};
use super::deadline::{Deadline, Unanswered};
use super::landing;
use super::lease::{Lease, Owner};
use crate::backoff::Backoff;
use crate::clock::{ServerTime, TimeSource};
use crate::error::{self, Error, Result};
use crate::format::lock::semaphore as field;
use crate::token::FencingToken;
use crate::validate;

/// Tokens reserved per counter write.
const TOKEN_BLOCK: i64 = 1_000_000;

/// How many times one `try_acquire` refills a block before it gives up (each refill that
/// loses to a racing refill leaves a fresh block behind, so the next attempt is fast).
const MAX_ROUNDS: usize = 8;

/// Options of a [`Semaphore`], validated once by [`Semaphore::new`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SemaphoreOptions {
    /// Permits of a resource whose document stores none yet (set a resource's own number
    /// with [`Semaphore::set_permits`]). Default 1.
    pub default_permits: u32,
    /// First delay of a blocking [`Semaphore::acquire`] retry. Default 5 ms.
    pub backoff_base: Duration,
    /// Largest delay between blocking acquire retries. Default 250 ms.
    pub backoff_max: Duration,
    /// Write concern for the semaphore and token collections; `None` inherits.
    pub write_concern: Option<WriteConcern>,
    token_block: i64,
    /// Test controls only: the acquire counts every holder as expired.
    unsafe_ignore_expiry: bool,
}

impl Default for SemaphoreOptions {
    fn default() -> Self {
        Self {
            default_permits: 1,
            backoff_base: Duration::from_millis(5),
            backoff_max: Duration::from_millis(250),
            write_concern: None,
            token_block: TOKEN_BLOCK,
            unsafe_ignore_expiry: false,
        }
    }
}

impl SemaphoreOptions {
    /// Sets [`SemaphoreOptions::default_permits`].
    pub fn default_permits(mut self, n: u32) -> Self {
        self.default_permits = n;
        self
    }

    /// Sets [`SemaphoreOptions::backoff_base`] and [`SemaphoreOptions::backoff_max`].
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_max = max;
        self
    }

    /// Sets [`SemaphoreOptions::write_concern`].
    pub fn write_concern(mut self, write_concern: WriteConcern) -> Self {
        self.write_concern = Some(write_concern);
        self
    }

    /// Tokens reserved per refill (default 1,000,000); `1` makes every acquire refill.
    #[doc(hidden)]
    pub fn token_block(mut self, block: i64) -> Self {
        self.token_block = block;
        self
    }

    /// Test controls only, **unsafe**: the acquire counts every holder as expired, so it
    /// admits whatever the number of valid holders. Shows what the expiry check prevents.
    #[doc(hidden)]
    pub fn unsafe_ignore_expiry(mut self) -> Self {
        self.unsafe_ignore_expiry = true;
        self
    }

    fn validate(&self) -> Result<()> {
        validate_permits(self.default_permits)?;
        Backoff::new(self.backoff_base, self.backoff_max)?;
        if self.token_block < 1 {
            return Err(Error::invalid("token_block", "must be at least 1"));
        }
        Ok(())
    }
}

fn validate_permits(n: u32) -> Result<i64> {
    if n == 0 {
        return Err(Error::invalid("permits", "must be at least 1"));
    }
    Ok(i64::from(n))
}

/// One permit of a [`Semaphore`]: the value a holder keeps to renew, release and fence
/// writes ([`super::Fence::apply`]; it fences by token order like a [`Lease`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Permit {
    /// The semaphore resource (the document's `_id`).
    pub resource: String,
    /// The holder's owner id.
    pub owner: String,
    /// The fencing token of this permit: strictly increasing per resource.
    pub token: FencingToken,
    /// Server time (estimated) when the permit was granted.
    pub acquired_at: DateTime,
    /// Server time (estimated) when the permit expires unless renewed.
    pub expires_at: DateTime,
}

impl Permit {
    /// Whether the permit is still certainly valid at `now`, `margin_ms` included.
    pub fn is_certainly_valid(&self, now: &ServerTime, margin_ms: i64) -> bool {
        now.certainly_before(self.expires_at, margin_ms)
    }

    /// The permit as a [`Lease`] on its resource (same token and times), for code written
    /// against leases.
    pub fn as_lease(&self) -> Lease {
        Lease {
            resource: self.resource.clone(),
            owner: self.owner.clone(),
            token: self.token,
            acquired_at: self.acquired_at,
            expires_at: self.expires_at,
        }
    }
}

/// One holder of a semaphore, as stored, for listing.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct HolderRecord {
    /// The holder's owner id (`""` if not a string).
    pub owner: String,
    /// Its fencing token (`None` if not an int64).
    pub token: Option<FencingToken>,
    /// When it was granted (server time).
    #[serde(serialize_with = "super::collection::as_rfc3339")]
    pub acquired_at: Option<DateTime>,
    /// When it expires unless renewed (server time); not a date counts as expired.
    #[serde(serialize_with = "super::collection::as_rfc3339")]
    pub expires_at: Option<DateTime>,
    /// Whether it has certainly expired (the next acquire drops it).
    pub expired: bool,
}

/// A semaphore resource as stored, for listing (`docwarden locks list`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SemaphoreRecord {
    /// The resource (the document's `_id`; extended JSON if not a string).
    pub resource: String,
    /// Permits of the resource (`None` if the document stores none: the handle's default
    /// applies).
    pub permits: Option<i64>,
    /// The holders stored, expired ones included until the next acquire drops them.
    pub holders: Vec<HolderRecord>,
    /// The last token handed out, if any.
    pub token: Option<FencingToken>,
}

impl SemaphoreRecord {
    /// How many holders are not certainly expired.
    pub fn live(&self) -> usize {
        self.holders.iter().filter(|h| !h.expired).count()
    }
}

/// Counting semaphores with fencing tokens, one document per resource.
///
/// ```no_run
/// # async fn example(db: mongodb::Database, client: mongodb::Client) -> docwarden::Result<()> {
/// use std::time::Duration;
/// use docwarden::clock::{ClockOptions, TimeSource};
/// use docwarden::lock::{Owner, Semaphore, SemaphoreOptions};
///
/// let time = TimeSource::server(client, ClockOptions::default())?;
/// let sem = Semaphore::open(&db, "api.sem", time, SemaphoreOptions::default().default_permits(4)).await?;
/// let me = Owner::random();
/// if let Some(permit) = sem.try_acquire(&me, "partner-api", Duration::from_secs(10)).await? {
///     // … call the API, fence writes with `permit` …
///     sem.release(&permit).await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Semaphore {
    docs: Collection<Document>,
    tokens: Collection<Document>,
    time: TimeSource,
    options: SemaphoreOptions,
    default_permits: i64,
}

impl Semaphore {
    /// A handle on the semaphore collection `collection` and its counter collection
    /// `<name>.tokens`, without touching the server: it only validates.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad collection name or options.
    pub fn new(
        collection: Collection<Document>,
        time: TimeSource,
        options: SemaphoreOptions,
    ) -> Result<Self> {
        validate::collection_name("semaphore collection", collection.name())?;
        options.validate()?;
        let db = collection.client().database(&collection.namespace().db);
        let coll_options =
            crate::lock::collection::inherited_options(&collection, options.write_concern.clone());
        let name = collection.name();
        Ok(Self {
            docs: db.collection_with_options(name, coll_options.clone()),
            tokens: db.collection_with_options(
                &format!("{name}{}", crate::format::lock::TOKENS_SUFFIX),
                coll_options,
            ),
            time,
            default_permits: i64::from(options.default_permits),
            options,
        })
    }

    /// Opens the semaphore collection `name` of `db` ([`Semaphore::new`]), runs the
    /// preflight checks and creates the index `{holders.owner: 1}` (listing and releasing
    /// by owner).
    ///
    /// # Errors
    /// As [`Semaphore::new`]; [`Error::Incompatible`] from [`crate::preflight::check`]; a
    /// database error.
    pub async fn open(
        db: &Database,
        name: &str,
        time: TimeSource,
        options: SemaphoreOptions,
    ) -> Result<Self> {
        validate::collection_name("semaphore collection", name)?;
        let this = Self::new(db.collection(name), time, options)?;
        crate::preflight::check(&this.docs).await?;
        crate::preflight::check(&this.tokens).await?;
        this.ensure_indexes().await?;
        Ok(this)
    }

    /// Creates the index (idempotent).
    ///
    /// # Errors
    /// A database error.
    pub async fn ensure_indexes(&self) -> Result<()> {
        let key = format!("{}.{}", field::HOLDERS, field::holder::OWNER);
        self.docs
            .create_index(
                IndexModel::builder()
                    .keys(doc! { key: 1 })
                    .options(
                        IndexOptions::builder()
                            .name("holders_owner".to_owned())
                            .build(),
                    )
                    .build(),
            )
            .await?;
        Ok(())
    }

    /// The semaphore collection's name.
    pub fn name(&self) -> &str {
        self.docs.name()
    }

    /// The time source every expiry decision uses.
    pub fn time(&self) -> &TimeSource {
        &self.time
    }

    /// Tries once to take a permit of `resource` for `ttl`. `Ok(None)` when `permits`
    /// holders that are not certainly expired hold it (contention is not an error).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad resource or owner or a ttl not longer than the skew margin; a database error.
    ///
    /// **An attempt without an answer.** The write appends the new holder only while the
    /// server's clock is before its landing deadline, 2 s after it was sent. If the call
    /// returns an error after sending it (a lost reply, a network error) or its future
    /// is dropped before it returns (a timeout around it), the holder entry that write
    /// may have appended is pulled in the background once the deadline has
    /// certainly passed (`lock/landing.rs`): other contenders wait about 2 s for it, not
    /// its ttl. A write that takes longer than 2 s to reach the server admits nothing
    /// (`Ok(None)`, as contention).
    #[instrument(skip(self, owner), fields(collection = %self.docs.name(), owner = owner.id()))]
    pub async fn try_acquire(
        &self,
        owner: &Owner,
        resource: &str,
        ttl: Duration,
    ) -> Result<Option<Permit>> {
        self.attempt(owner, resource, ttl, &validate::random_id(), &[])
            .await
    }

    /// One acquire attempt with acquisition nonce `nonce` (every round of it: a round
    /// that answered was not admitted). `unknown`: the nonces of this blocking acquire's
    /// earlier attempts that failed with a transient error, whose holder entries (lost
    /// replies) the attempt gives back in the same write before it is admitted afresh, so
    /// the acquire never holds two permits and never hands out an old entry with part of
    /// its ttl gone; empty for [`Semaphore::try_acquire`].
    ///
    /// Each round's write carries its own landing deadline and is covered by a
    /// [`landing::CleanUp`] armed before it is sent (see [`Semaphore::try_acquire`]).
    async fn attempt(
        &self,
        owner: &Owner,
        resource: &str,
        ttl: Duration,
        nonce: &str,
        unknown: &[String],
    ) -> Result<Option<Permit>> {
        validate::name("resource", resource)?;
        validate::name("owner", owner.id())?;
        let ttl_ms = super::lease::ttl_ms("ttl", ttl, self.time.skew_margin_ms())?;
        // The clean-up of the round in flight (`lock/landing.rs`): armed before each
        // round's write, so an error or a dropped future after it was sent frees the entry
        // it may have appended once its landing deadline has passed. A round's clean-up is
        // replaced (settled) when the next round arms its own: that round's write was
        // answered as not admitted, so it left no entry, and every round writes the same
        // nonce. Settled when the attempt returns `Ok`; on an error (a refill's included)
        // the last one fires, and finds nothing if that round was answered.
        let mut cleanup: Option<landing::CleanUp> = None;
        let outcome = self
            .rounds(owner, resource, ttl_ms, nonce, unknown, &mut cleanup)
            .await;
        if outcome.is_ok()
            && let Some(cleanup) = cleanup.take()
        {
            cleanup.settled();
        }
        outcome
    }

    /// The rounds of one acquire attempt (see [`Semaphore::attempt`]): a write, and a
    /// refill when the block is used up, up to [`MAX_ROUNDS`] times. `cleanup` holds the
    /// clean-up of the last round's write.
    async fn rounds(
        &self,
        owner: &Owner,
        resource: &str,
        ttl_ms: i64,
        nonce: &str,
        unknown: &[String],
        cleanup: &mut Option<landing::CleanUp>,
    ) -> Result<Option<Permit>> {
        for _ in 0..MAX_ROUNDS {
            let now = self.time.now().await?;
            let cutoff = now.expired_before(self.time.skew_margin_ms());
            let acquired_at = now.estimate();
            let expires_at = now.plus_ms(ttl_ms);
            let land_by = landing::deadline(&now);
            let update = acquire_pipeline(
                &AcquireArgs {
                    owner: owner.id(),
                    nonce,
                    unknown,
                    acquired_at,
                    expires_at,
                    cutoff,
                    land_by,
                    default_permits: self.default_permits,
                },
                self.options.unsafe_ignore_expiry,
            );
            let armed = landing::CleanUp::new(
                &self.docs,
                &self.time,
                doc! {
                    field::ID: resource,
                    field::HOLDERS: { "$elemMatch": { field::holder::ACQUISITION: nonce } },
                },
                doc! { "$pull": { field::HOLDERS: { field::holder::ACQUISITION: nonce } } },
                land_by,
                "semaphore acquire",
            );
            if let Some(answered) = cleanup.replace(armed) {
                answered.settled();
            }
            let after = self
                .docs
                .find_one_and_update(doc! { field::ID: resource }, update)
                .return_document(ReturnDocument::After)
                .await?;
            let Some(after) = after else {
                // No document yet (or deleted): create it with a fresh block.
                self.refill(resource).await?;
                continue;
            };
            match admitted(&after, nonce, self.default_permits) {
                Admission::Granted(token) => {
                    crate::observe::lock_acquired(self.docs.name(), Some(token));
                    tracing::debug!(resource, token, "permit acquired");
                    return Ok(Some(Permit {
                        resource: resource.to_owned(),
                        owner: owner.id().to_owned(),
                        token: FencingToken::new(token),
                        acquired_at,
                        expires_at,
                    }));
                }
                Admission::Full => {
                    crate::observe::lock_busy(self.docs.name());
                    return Ok(None);
                }
                Admission::Late => {
                    crate::observe::lock_busy(self.docs.name());
                    tracing::debug!(
                        resource,
                        "the acquire reached the server after its landing deadline"
                    );
                    return Ok(None);
                }
                Admission::Exhausted => self.refill(resource).await?,
            }
        }
        crate::observe::lock_busy(self.docs.name());
        tracing::debug!(resource, "no permit after racing refills");
        Ok(None)
    }

    /// Takes a permit of `resource` for `ttl`, retrying with jittered backoff until one is
    /// granted or `wait` has passed (`Ok(None)`). Transient errors
    /// ([`Error::is_retryable`]) are retried within the wait like contention
    /// (`lock/deadline.rs`).
    ///
    /// # Errors
    /// As [`Semaphore::try_acquire`]; a transient error only if the wait passed with the
    /// last attempt failing.
    pub async fn acquire(
        &self,
        owner: &Owner,
        resource: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Option<Permit>> {
        let called = Instant::now();
        let mut deadline = Deadline::after(wait);
        let mut backoff = Backoff::new(self.options.backoff_base, self.options.backoff_max)?;
        // Attempts that failed with a transient error may have been admitted all the same
        // (a lost reply): later attempts give that permit back in the write that admits
        // them, instead of holding a second one or handing out the old one.
        let mut unanswered = Unanswered::default();
        loop {
            let nonce = validate::random_id();
            let result = self
                .attempt(owner, resource, ttl, &nonce, unanswered.nonces())
                .await;
            unanswered.note(nonce, &result);
            if let Some(p) = deadline.attempt(result)? {
                crate::observe::lock_handoff(self.docs.name(), called, Some(p.token.get()));
                return Ok(Some(p));
            }
            let Some(left) = deadline.left() else {
                return deadline.passed();
            };
            tokio::time::sleep(backoff.next_delay().min(left)).await;
        }
    }

    /// A new token block for `resource` (the three steps in the module docs). Racing
    /// refills: the last marker wins, the others commit nothing.
    async fn refill(&self, resource: &str) -> Result<()> {
        let nonce = validate::random_id();
        let marked = match self
            .docs
            .find_one_and_update(
                doc! { field::ID: resource },
                doc! {
                    "$set": { field::REFILL: &nonce },
                    "$setOnInsert": { field::PERMITS: self.default_permits, field::HOLDERS: [] },
                },
            )
            .upsert(true)
            .return_document(ReturnDocument::After)
            .await
        {
            Ok(Some(d)) => d,
            // A racing first upsert: the document exists now; the caller tries again.
            Ok(None) => return Ok(()),
            Err(e) if error::is_duplicate_key(&e) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        // A hand-written token (a double from mongosh) still counts: the block goes above.
        let previous = super::collection::stored_number(marked.get(field::TOKEN)).unwrap_or(0);
        let block = self.options.token_block;
        let overflow = || Error::Malformed {
            id: resource.to_owned(),
            reason: "fencing token overflow".into(),
        };
        previous.checked_add(block).ok_or_else(overflow)?;
        let ceiling = self.reserve(resource, previous, block).await?;
        let base = ceiling.checked_sub(block).ok_or_else(overflow)?;
        let committed = self
            .docs
            .update_one(
                doc! { field::ID: resource, field::REFILL: &nonce },
                commit_pipeline(base, ceiling),
            )
            .await?;
        tracing::debug!(
            resource,
            ceiling,
            committed = committed.matched_count,
            "token block"
        );
        Ok(())
    }

    /// Raises the counter `<name>.tokens` by one block above `previous`; the new value.
    async fn reserve(&self, resource: &str, previous: i64, block: i64) -> Result<i64> {
        for attempt in 1..=3 {
            let answer = self
                .tokens
                .find_one_and_update(
                    doc! { field::ID: resource },
                    vec![doc! { "$set": { field::TOKEN: { "$add": [
                        { "$max": [ { "$ifNull": [ format!("${}", field::TOKEN), 0_i64 ] }, previous ] },
                        block,
                    ] } } }],
                )
                .upsert(true)
                .return_document(ReturnDocument::After)
                .await;
            match answer {
                Ok(Some(c)) => {
                    return super::collection::stored_number(c.get(field::TOKEN)).ok_or_else(
                        || Error::Malformed {
                            id: resource.to_owned(),
                            reason: format!(
                                "semaphore token counter is {}",
                                super::collection::describe(c.get(field::TOKEN))
                            ),
                        },
                    );
                }
                Ok(None) if attempt < 3 => {}
                Err(e) if attempt < 3 && error::is_duplicate_key(&e) => {}
                Ok(None) => break,
                Err(e) => return Err(e.into()),
            }
        }
        Err(Error::Malformed {
            id: resource.to_owned(),
            reason: "semaphore token counter upsert returned nothing".into(),
        })
    }

    /// Extends `permit` to `ttl` from now (server time), only while it is still certainly
    /// valid and still stored ([`Semaphore::renew_many`] of one permit).
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the permit expired, was released or dropped;
    /// [`Error::InvalidInput`] for a ttl not longer than the time source's skew margin (zero included); a database error.
    #[instrument(skip(self, permit), fields(collection = %self.docs.name(), resource = %permit.resource, owner = %permit.owner, token = permit.token.get()))]
    pub async fn renew(&self, permit: &mut Permit, ttl: Duration) -> Result<()> {
        self.renew_many(std::slice::from_mut(permit), ttl)
            .await?
            .pop()
            .unwrap_or(Ok(()))
    }

    /// Extends every permit of `permits` to `ttl` from now (one server time for all),
    /// each only while it is still certainly valid and still stored, as
    /// [`Semaphore::renew`] would: **one write per resource document** (the permits of a
    /// resource are elements of its `holders`), the writes of different resources sent
    /// concurrently. For one permit of a resource, an `updateOne` by `_id` and
    /// `$elemMatch` on its `(owner, token)` with a certainly valid `until` (renewed if it
    /// matched); for several, a `findOneAndUpdate` by `_id` whose pipeline extends
    /// exactly the elements that match one of them with a certainly valid `until` (a
    /// permit is renewed when the document returned shows its element with the new
    /// expiry). Returns one result per permit, in order; a renewed permit's
    /// `expires_at` is updated.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a ttl not longer than the skew margin and the clock's error, for the whole call.
    /// Per permit: [`Error::LeaseLost`] if it expired, was released or dropped; a
    /// database error of its resource's write (the other resources' writes are not
    /// affected).
    #[instrument(skip_all, fields(collection = %self.docs.name(), permits = permits.len()))]
    pub async fn renew_many(
        &self,
        permits: &mut [Permit],
        ttl: Duration,
    ) -> Result<Vec<Result<()>>> {
        let ttl_ms = super::lease::ttl_ms("ttl", ttl, self.time.skew_margin_ms())?;
        if permits.is_empty() {
            return Ok(Vec::new());
        }
        let now = self.time.now().await?;
        let valid_after = DateTime::from_millis(
            now.estimate_ms
                .saturating_add(now.bound_ms)
                .saturating_add(self.time.skew_margin_ms()),
        );
        let expires_at = now.plus_ms(ttl_ms);
        // The permits of each resource, in order of first appearance.
        let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
        for (i, p) in permits.iter().enumerate() {
            match groups.iter_mut().find(|(r, _)| *r == p.resource) {
                Some((_, members)) => members.push(i),
                None => groups.push((p.resource.as_str(), vec![i])),
            }
        }
        let projection = doc! {
            format!("{}.{}", field::HOLDERS, field::holder::OWNER): 1,
            format!("{}.{}", field::HOLDERS, field::holder::TOKEN): 1,
            format!("{}.{}", field::HOLDERS, field::holder::UNTIL): 1,
        };
        let until = format!("{}.$.{}", field::HOLDERS, field::holder::UNTIL);
        let writes = groups.iter().map(|(resource, members)| {
            let held: Vec<&Permit> = members.iter().filter_map(|&i| permits.get(i)).collect();
            let (projection, until) = (&projection, &until);
            async move {
                if let [one] = held.as_slice() {
                    // One permit of this resource: the positional update of its element
                    // (same condition; no document to send back).
                    let mut element = holder_match(one);
                    element.insert(field::holder::UNTIL, doc! { "$gt": valid_after });
                    let r = self
                        .docs
                        .update_one(
                            doc! { field::ID: *resource, field::HOLDERS: { "$elemMatch": element } },
                            // `$max`: a renewal that lands after a later one (its
                            // holder stopped waiting for it) does not move it back.
                            doc! { "$max": { until: expires_at } },
                        )
                        .await?;
                    return Ok(vec![r.matched_count == 1]);
                }
                let after = self
                    .docs
                    .find_one_and_update(
                        doc! { field::ID: *resource },
                        renew_pipeline(&held, valid_after, expires_at),
                    )
                    .projection(projection.clone())
                    .return_document(ReturnDocument::After)
                    .await?;
                Ok::<_, mongodb::error::Error>(
                    held.iter()
                        .map(|p| {
                            after
                                .as_ref()
                                .is_some_and(|a| renewed(a, p, valid_after, expires_at))
                        })
                        .collect(),
                )
            }
        });
        let answers = futures::future::join_all(writes).await;
        let mut out: Vec<Option<Result<()>>> = (0..permits.len()).map(|_| None).collect();
        for ((_, members), answer) in groups.iter().zip(answers) {
            for (k, &i) in members.iter().enumerate() {
                let Some(permit) = permits.get(i) else {
                    continue;
                };
                let result = match &answer {
                    Ok(renewed) if renewed.get(k) == Some(&true) => Ok(()),
                    Ok(_) => Err(lost(permit)),
                    Err(e) => Err(Error::from(e.clone())),
                };
                if let Some(slot) = out.get_mut(i) {
                    *slot = Some(result);
                }
            }
        }
        let mut results = Vec::with_capacity(permits.len());
        for (permit, result) in permits.iter_mut().zip(out) {
            let result = result.unwrap_or_else(|| Err(lost(permit)));
            if result.is_ok() {
                permit.expires_at = expires_at;
            }
            results.push(result);
        }
        Ok(results)
    }

    /// Gives `permit` back (one `$pull`). Releasing a permit that expired but was not
    /// dropped yet still frees it.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the permit is no longer stored (dropped as expired,
    /// released); a database error.
    #[instrument(skip(self, permit), fields(collection = %self.docs.name(), resource = %permit.resource, owner = %permit.owner, token = permit.token.get()))]
    pub async fn release(&self, permit: &Permit) -> Result<()> {
        let (filter, update) = release_update(permit);
        let r = self.docs.update_one(filter, update).await?;
        if r.modified_count == 0 {
            return Err(lost(permit));
        }
        Ok(())
    }

    /// Releases `permit` for a caller that will not wait for the answer (a claim giving
    /// back the permits of a job it did not start, a `Worker` after a job's last
    /// transition): a release that fails with a transient error is retried in the
    /// background (`lock/landing.rs`, `release_later`), so the permit does not keep a
    /// holder out until its ttl; a permit already lost is nothing to release.
    pub(crate) async fn release_in_background(&self, permit: &Permit, what: &'static str) {
        match self.release(permit).await {
            Ok(()) | Err(Error::LeaseLost { .. }) => {}
            Err(e) => {
                let (filter, update) = release_update(permit);
                landing::release_later(&self.docs, &self.time, filter, update, &e, what);
            }
        }
    }

    /// Releases every permit `owner` holds in any resource; how many documents changed.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad owner id; a database error.
    pub async fn release_all(&self, owner: &Owner) -> Result<u64> {
        validate::name("owner", owner.id())?;
        let key = format!("{}.{}", field::HOLDERS, field::holder::OWNER);
        let r = self
            .docs
            .update_many(
                doc! { key: owner.id() },
                doc! { "$pull": { field::HOLDERS: { field::holder::OWNER: owner.id() } } },
            )
            .await?;
        Ok(r.modified_count)
    }

    /// Sets the number of permits of `resource` (creating its document if needed). Growing
    /// admits new holders at once; shrinking drops nobody: no new permit is granted until
    /// fewer than `permits` hold.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad resource or `permits = 0`; a database error.
    pub async fn set_permits(&self, resource: &str, permits: u32) -> Result<()> {
        validate::name("resource", resource)?;
        let n = validate_permits(permits)?;
        for attempt in 1..=3 {
            match self
                .docs
                .update_one(
                    doc! { field::ID: resource },
                    doc! { "$set": { field::PERMITS: n } },
                )
                .upsert(true)
                .await
            {
                Ok(_) => return Ok(()),
                Err(e) if attempt < 3 && error::is_duplicate_key(&e) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// The semaphore of `resource` as stored, `None` if it has no document.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad resource; a database error.
    pub async fn status(&self, resource: &str) -> Result<Option<SemaphoreRecord>> {
        validate::name("resource", resource)?;
        let now = self.time.now().await?;
        let cutoff = now.expired_before(self.time.skew_margin_ms());
        Ok(self
            .docs
            .find_one(doc! { field::ID: resource })
            .await?
            .map(|d| record(&d, cutoff)))
    }

    /// Every semaphore document (with at least one holder stored if `held_only`), by
    /// resource; with `owner`, only those `owner` holds a permit of.
    ///
    /// # Errors
    /// A database error.
    pub async fn list(&self, owner: Option<&str>, held_only: bool) -> Result<Vec<SemaphoreRecord>> {
        let filter = LockListFilter {
            owner: owner.map(str::to_owned),
            ..LockListFilter::default()
        };
        self.list_matching(&filter, held_only).await
    }

    /// The semaphore documents that match `filter` (with an owner id, those it holds a
    /// permit of; with a resource, that one; at most `limit` of them), by resource; with
    /// `held_only`, only those with at least one holder stored. A view should set a limit:
    /// a semaphore per entity makes one document per entity.
    ///
    /// # Errors
    /// A database error.
    pub async fn list_matching(
        &self,
        filter: &LockListFilter,
        held_only: bool,
    ) -> Result<Vec<SemaphoreRecord>> {
        let mut query = Document::new();
        if let Some(owner) = &filter.owner {
            query.insert(
                format!("{}.{}", field::HOLDERS, field::holder::OWNER),
                owner.as_str(),
            );
        } else if held_only {
            query.insert(format!("{}.0", field::HOLDERS), doc! { "$exists": true });
        }
        if let Some(resource) = &filter.resource {
            query.insert(field::ID, resource.as_str());
        }
        let now = self.time.now().await?;
        let cutoff = now.expired_before(self.time.skew_margin_ms());
        let docs = listing(&self.docs, query, None, filter.limit).await?;
        Ok(docs.iter().map(|d| record(d, cutoff)).collect())
    }
}

fn lost(permit: &Permit) -> Error {
    Error::LeaseLost {
        resource: permit.resource.clone(),
        token: permit.token.into(),
    }
}

/// The filter and update of [`Semaphore::release`]: the resource's document holding
/// `permit`, and the `$pull` of its holder element.
fn release_update(permit: &Permit) -> (Document, Document) {
    (
        doc! { field::ID: &permit.resource, field::HOLDERS: { "$elemMatch": holder_match(permit) } },
        doc! { "$pull": { field::HOLDERS: holder_match(permit) } },
    )
}

/// The holder element of `permit`: `{owner, token}` (tokens are unique per resource).
fn holder_match(permit: &Permit) -> Document {
    doc! { field::holder::OWNER: &permit.owner, field::holder::TOKEN: permit.token }
}

/// The renewal of `held` (permits of one resource): every holder element that matches one
/// of them by `(owner, token)` and whose `until` is a date after `valid_after` (still
/// certainly valid) gets `until = max(until, expires_at)` (a renewal that lands after a
/// later one does not move it back); every other element stays as it is. One stage, so
/// each element is decided on the document as stored.
fn renew_pipeline(held: &[&Permit], valid_after: DateTime, expires_at: DateTime) -> Vec<Document> {
    let holders = format!("${}", field::HOLDERS);
    let owner = format!("$$h.{}", field::holder::OWNER);
    let token = format!("$$h.{}", field::holder::TOKEN);
    let until = format!("$$h.{}", field::holder::UNTIL);
    let ours: Vec<Document> = held
        .iter()
        .map(|p| {
            doc! { "$and": [
                { "$eq": [&owner, { "$literal": &p.owner }] },
                { "$eq": [&token, { "$literal": p.token.get() }] },
            ] }
        })
        .collect();
    vec![doc! { "$set": { field::HOLDERS: { "$map": {
        "input": { "$cond": [{ "$isArray": &holders }, &holders, []] },
        "as": "h",
        "in": { "$cond": [
            { "$and": [
                { "$or": ours },
                { "$eq": [{ "$type": &until }, "date"] },
                { "$gt": [&until, { "$literal": valid_after }] },
            ] },
            { "$mergeObjects": ["$$h", { field::holder::UNTIL: { "$max": [&until, { "$literal": expires_at }] } }] },
            "$$h",
        ] },
    } } } }]
}

/// Whether `after` (the document a renewal returned) shows `permit`'s holder element
/// renewed: its `until` at least the renewal's new expiry and after `valid_after` (the
/// renewal keeps a later `until`, so equality would miss a permit a later renewal
/// extended further; an element the renewal skipped was not after `valid_after`).
fn renewed(after: &Document, permit: &Permit, valid_after: DateTime, expires_at: DateTime) -> bool {
    after
        .get_array(field::HOLDERS)
        .map(|hs| {
            hs.iter().filter_map(Bson::as_document).any(|h| {
                h.get_str(field::holder::OWNER).ok() == Some(permit.owner.as_str())
                    && h.get_i64(field::holder::TOKEN).ok() == Some(permit.token.get())
                    && h.get_datetime(field::holder::UNTIL)
                        .is_ok_and(|u| *u >= expires_at && *u > valid_after)
            })
        })
        .unwrap_or(false)
}

struct AcquireArgs<'a> {
    owner: &'a str,
    nonce: &'a str,
    /// Earlier attempts' nonces (see [`Semaphore::acquire`]): their holder entries are
    /// dropped before the admission.
    unknown: &'a [String],
    acquired_at: DateTime,
    expires_at: DateTime,
    cutoff: DateTime,
    /// The attempt's landing deadline (`lock/landing.rs`): the new holder is appended
    /// only while the server's clock is before it.
    land_by: DateTime,
    default_permits: i64,
}

/// The acquire: stage 1 drops the holders whose `until` is before `cutoff` (or not a
/// date) and those of `unknown` (this acquire's lost attempts); stage 2 appends the new
/// holder with `token + 1` (and stores that token) only while fewer than `permits` holders
/// remain, `token < ceiling` and the server's clock is before `land_by` (the landing
/// deadline, [`landing::before`]). Both stages are one atomic update of one document.
///
/// Only stage 2 depends on the deadline: a write that lands after it still drops what
/// stage 1 drops, and appends nothing. That is the simplest correct option — stage 1 is
/// safe whenever it lands (a holder whose `until` is before the fixed `cutoff` stays
/// certainly expired; an `unknown` entry is this acquire's own, never announced to
/// anyone), and it is what an acquire that found the semaphore full leaves too. The
/// returned document then has room and a token left without the nonce:
/// [`Admission::Late`]. The `ignore_expiry` control changes stage 1 only.
fn acquire_pipeline(a: &AcquireArgs<'_>, ignore_expiry: bool) -> Vec<Document> {
    let holders = format!("${}", field::HOLDERS);
    let token = format!("${}", field::TOKEN);
    let ceiling = format!("${}", field::CEILING);
    let permits = format!("${}", field::PERMITS);
    let until = format!("$$h.{}", field::holder::UNTIL);
    let live = if ignore_expiry {
        Bson::Array(Vec::new())
    } else {
        let mut keep = vec![
            Bson::Document(doc! { "$eq": [{ "$type": &until }, "date"] }),
            Bson::Document(doc! { "$gte": [&until, a.cutoff] }),
        ];
        if !a.unknown.is_empty() {
            // The entries of this acquire's earlier attempts whose replies were lost:
            // nobody was told they hold them, so they are given back here and the
            // attempt is admitted afresh (a new token, `until` from now).
            let acquisition = format!("$$h.{}", field::holder::ACQUISITION);
            keep.push(Bson::Document(doc! { "$not": [{ "$in": [
                { "$ifNull": [acquisition, Bson::Null] },
                { "$literal": a.unknown },
            ] }] }));
        }
        Bson::Document(doc! { "$filter": {
            "input": { "$cond": [{ "$isArray": &holders }, &holders, []] },
            "as": "h",
            "cond": { "$and": keep },
        } })
    };
    let admit = doc! { "$and": [
        landing::before(a.land_by),
        { "$eq": [{ "$type": &token }, "long"] },
        { "$eq": [{ "$type": &ceiling }, "long"] },
        { "$lt": [&token, &ceiling] },
        { "$lt": [{ "$size": &holders }, { "$cond": [{ "$isNumber": &permits }, &permits, a.default_permits] }] },
    ] };
    let next = doc! { "$add": [&token, 1_i64] };
    let holder = doc! {
        field::holder::OWNER: { "$literal": a.owner },
        field::holder::TOKEN: next.clone(),
        field::holder::ACQUISITION: { "$literal": a.nonce },
        field::holder::ACQUIRED_AT: { "$literal": a.acquired_at },
        field::holder::UNTIL: { "$literal": a.expires_at },
    };
    vec![
        doc! { "$set": { field::HOLDERS: live } },
        doc! { "$set": {
            field::HOLDERS: { "$cond": [admit.clone(), { "$concatArrays": [&holders, [holder]] }, &holders] },
            field::TOKEN: { "$cond": [admit, next, &token] },
        } },
    ]
}

/// Commits a refilled block `(base, ceiling]`: the next token is `base + 1` (never below
/// the stored token), and the refill marker goes.
fn commit_pipeline(base: i64, ceiling: i64) -> Vec<Document> {
    let token = format!("${}", field::TOKEN);
    vec![doc! { "$set": {
        field::CEILING: ceiling,
        field::TOKEN: { "$cond": [
            { "$eq": [{ "$type": &token }, "long"] },
            { "$max": [&token, base] },
            base,
        ] },
        field::REFILL: "$$REMOVE",
    } }]
}

#[derive(Debug)]
enum Admission {
    Granted(i64),
    Full,
    Exhausted,
    /// Room and a token left, yet not admitted: the write reached the server after its
    /// landing deadline.
    Late,
}

/// What an acquire's returned document says: our holder (by nonce) is in it, or the
/// semaphore is full, or the block is used up (or the document has none yet), or neither
/// (the write landed after its deadline, [`acquire_pipeline`]). The returned document is
/// what the admission was decided on: it is left as stage 1 left it unless admitted.
/// Permits are read as the acquire pipeline reads them: a stored number, else
/// `default_permits`.
fn admitted(after: &Document, nonce: &str, default_permits: i64) -> Admission {
    let holders = after
        .get_array(field::HOLDERS)
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    for h in holders {
        if let Bson::Document(h) = h
            && h.get_str(field::holder::ACQUISITION).ok() == Some(nonce)
            && let Ok(t) = h.get_i64(field::holder::TOKEN)
        {
            return Admission::Granted(t);
        }
    }
    let room = match after.get(field::PERMITS) {
        Some(Bson::Int64(n)) => i64::try_from(holders.len()).unwrap_or(i64::MAX) < *n,
        Some(Bson::Int32(n)) => i64::try_from(holders.len()).unwrap_or(i64::MAX) < i64::from(*n),
        // A double is what mongosh writes for `permits: 3`; the pipeline honours any number
        // (`$isNumber`), so this must too, or a full semaphore reads as "block used up"
        // and every contended acquire refills token blocks until its rounds run out.
        Some(Bson::Double(n)) => u32::try_from(holders.len()).map_or(f64::MAX, f64::from) < *n,
        // A decimal (`NumberDecimal("3")`) is a number to the pipeline too. Its text
        // ("3", "2.5", "3E+2", "NaN", "Infinity") read as a double decides as the
        // pipeline's comparison does for any value a permit count can take.
        Some(Bson::Decimal128(d)) => d
            .to_string()
            .parse::<f64>()
            .is_ok_and(|n| u32::try_from(holders.len()).map_or(f64::MAX, f64::from) < n),
        // Missing, or not a number (a hand edit): the pipeline used the default.
        _ => i64::try_from(holders.len()).unwrap_or(i64::MAX) < default_permits,
    };
    let token_left = matches!(
        (after.get(field::TOKEN), after.get(field::CEILING)),
        (Some(Bson::Int64(token)), Some(Bson::Int64(ceiling))) if token < ceiling
    );
    match (room, token_left) {
        (false, _) => Admission::Full,
        (true, false) => Admission::Exhausted,
        (true, true) => Admission::Late,
    }
}

/// The stored `permits` as the acquire enforces them (it admits while the holders are
/// fewer than any number, `$isNumber`): an int64 or int32 as is, a double — what mongosh
/// writes for `permits: 3` — rounded up (`3.0` is 3; `2.5` admits a third holder).
/// `None` when missing or not a number the listing can show (the handle's default applies
/// to a missing or non-numeric value).
fn stored_permits(value: Option<&Bson>) -> Option<i64> {
    super::collection::stored_number(value)
}

fn record(d: &Document, cutoff: DateTime) -> SemaphoreRecord {
    let resource = match d.get(field::ID) {
        Some(Bson::String(s)) => s.clone(),
        other => other.map(ToString::to_string).unwrap_or_default(),
    };
    let permits = stored_permits(d.get(field::PERMITS));
    let holders = d
        .get_array(field::HOLDERS)
        .map(|hs| {
            hs.iter()
                .filter_map(Bson::as_document)
                .map(|h| {
                    let expires_at = h.get_datetime(field::holder::UNTIL).ok().copied();
                    HolderRecord {
                        owner: h
                            .get_str(field::holder::OWNER)
                            .unwrap_or_default()
                            .to_owned(),
                        token: h.get_i64(field::holder::TOKEN).ok().map(FencingToken::new),
                        acquired_at: h.get_datetime(field::holder::ACQUIRED_AT).ok().copied(),
                        expires_at,
                        expired: expires_at.is_none_or(|e| e < cutoff),
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    SemaphoreRecord {
        resource,
        permits,
        holders,
        token: d.get_i64(field::TOKEN).ok().map(FencingToken::new),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_validated() {
        assert!(SemaphoreOptions::default().validate().is_ok());
        assert!(
            SemaphoreOptions::default()
                .default_permits(0)
                .validate()
                .is_err()
        );
        assert!(
            SemaphoreOptions::default()
                .backoff(Duration::ZERO, Duration::from_secs(1))
                .validate()
                .is_err()
        );
    }

    #[test]
    fn admission_is_read_from_the_document() -> anyhow::Result<()> {
        let d = doc! { "_id": "r", "permits": 1_i64, "token": 5_i64, "ceiling": 9_i64,
        "holders": [{ "owner": "o", "token": 5_i64, "acquisition": "n", "until": DateTime::from_millis(1) }] };
        assert!(matches!(admitted(&d, "n", 3), Admission::Granted(5)));
        assert!(matches!(admitted(&d, "m", 3), Admission::Full));
        let e = doc! { "_id": "r", "permits": 2_i64, "holders": [] };
        assert!(matches!(admitted(&e, "m", 3), Admission::Exhausted));
        // Session 15: `permits` as a double (mongosh's `permits: 1`) read as "no limit
        // stored", so a full semaphore looked exhausted: every contended acquire refilled
        // MAX_ROUNDS token blocks (8 million tokens, ~6 ms) before answering `None`.
        let d = doc! { "_id": "r", "permits": 1.0, "token": 5_i64, "ceiling": 9_i64,
        "holders": [{ "owner": "o", "token": 5_i64, "acquisition": "n", "until": DateTime::from_millis(1) }] };
        assert!(matches!(admitted(&d, "m", 3), Admission::Full));
        // Permits missing or not a number: the pipeline admits by the handle's default,
        // and so does this reading (a string read as "no limit" made a full semaphore
        // refill its token block for every round of a contended acquire).
        let s = doc! { "_id": "r", "permits": "1", "token": 5_i64, "ceiling": 9_i64,
        "holders": [{ "owner": "o", "token": 5_i64, "acquisition": "n", "until": DateTime::from_millis(1) }] };
        assert!(matches!(admitted(&s, "m", 1), Admission::Full));
        // Room and a token left without the nonce: the pipeline would have admitted but
        // for its landing deadline (session 24): contention, not a refill.
        assert!(matches!(admitted(&s, "m", 2), Admission::Late));
        let used_up = doc! { "_id": "r", "permits": 2_i64, "token": 9_i64, "ceiling": 9_i64,
        "holders": [{ "owner": "o", "token": 5_i64, "acquisition": "n", "until": DateTime::from_millis(1) }] };
        assert!(matches!(admitted(&used_up, "m", 3), Admission::Exhausted));
        // Session 25: `permits` as a decimal is a number to the pipeline (`$isNumber`); it
        // was read as missing here, so the handle's default decided instead (3 below).
        let holder = |i: i64| doc! { "owner": "o", "token": i, "acquisition": format!("n{i}"), "until": DateTime::from_millis(1) };
        let decimal = |text: &str, holders: i64| -> anyhow::Result<Document> {
            Ok(
                doc! { "_id": "r", "permits": text.parse::<mongodb::bson::Decimal128>()?,
                "token": 5_i64, "ceiling": 9_i64, "holders": (0..holders).map(holder).collect::<Vec<_>>() },
            )
        };
        for (permits, holders, default, full) in [
            ("1", 1, 3, true),
            ("5", 3, 3, false),
            ("2.5", 2, 1, false),
            ("NaN", 0, 3, true),
        ] {
            let got = admitted(&decimal(permits, holders)?, "m", default);
            let want_full = matches!(got, Admission::Full);
            assert_eq!(
                want_full, full,
                "permits {permits}, {holders} holders: {got:?}"
            );
            assert!(full || matches!(got, Admission::Late), "{got:?}");
        }
        Ok(())
    }

    /// Session 24: the acquire's write appends the new holder only before its landing
    /// deadline; later, it still drops what stage 1 drops (an expired holder) and leaves
    /// the token as it was. Run against the database: the condition is `$$NOW`'s.
    #[tokio::test]
    async fn a_write_after_its_landing_deadline_admits_nothing() -> anyhow::Result<()> {
        let t = docwarden_testkit::TestDb::new("semaphore_write_after_landing_deadline").await?;
        let coll = t.db.collection::<Document>("sem");
        let now = DateTime::now().timestamp_millis();
        let mut violations = Vec::new();
        for (land_by, should_admit) in [(now - 1_000, false), (now + 60_000, true)] {
            let resource = format!("r{should_admit}");
            coll.insert_one(doc! { "_id": &resource, "permits": 1_i64, "token": 5_i64,
            "ceiling": 9_i64, "holders": [{ "owner": "gone", "token": 5_i64,
            "acquisition": "old", "until": DateTime::from_millis(now - 600_000) }] })
                .await?;
            let update = acquire_pipeline(
                &AcquireArgs {
                    owner: "o",
                    nonce: "n",
                    unknown: &[],
                    acquired_at: DateTime::from_millis(now),
                    expires_at: DateTime::from_millis(now + 60_000),
                    cutoff: DateTime::from_millis(now - 1_000),
                    land_by: DateTime::from_millis(land_by),
                    default_permits: 1,
                },
                false,
            );
            let after = coll
                .find_one_and_update(doc! { "_id": &resource }, update)
                .return_document(ReturnDocument::After)
                .await?
                .unwrap_or_default();
            let holders = after.get_array(field::HOLDERS).map(Vec::len).ok();
            let expected = if should_admit {
                (Some(1), Ok(6))
            } else {
                (Some(0), Ok(5))
            };
            if (holders, after.get_i64(field::TOKEN)) != expected {
                violations.push(format!("land_by {land_by} (now {now}): {after}"));
            }
            let admission = admitted(&after, "n", 1);
            let right = if should_admit {
                matches!(admission, Admission::Granted(6))
            } else {
                matches!(admission, Admission::Late)
            };
            if !right {
                let expected = if should_admit { "granted" } else { "late" };
                violations.push(format!("land_by {land_by}: not read as {expected}"));
            }
        }
        assert!(violations.is_empty(), "{violations:#?}");
        Ok(())
    }

    #[test]
    fn an_earlier_attempts_holder_is_given_back_not_doubled() {
        let p = acquire_pipeline(
            &AcquireArgs {
                owner: "o",
                nonce: "now",
                unknown: &["lost".to_owned()],
                acquired_at: DateTime::from_millis(1),
                expires_at: DateTime::from_millis(2),
                cutoff: DateTime::from_millis(0),
                land_by: DateTime::from_millis(3),
                default_permits: 3,
            },
            false,
        );
        let keep = p[0]
            .get_document("$set")
            .and_then(|s| s.get_document("holders"))
            .and_then(|h| h.get_document("$filter"))
            .and_then(|f| f.get_document("cond"))
            .and_then(|c| c.get_array("$and"))
            .map(Vec::len);
        assert_eq!(
            keep,
            Ok(3),
            "a date, not certainly expired, not a lost attempt's"
        );
    }

    #[test]
    fn the_acquire_drops_expired_holders_before_counting() {
        let p = acquire_pipeline(
            &AcquireArgs {
                owner: "o",
                nonce: "n",
                unknown: &[],
                acquired_at: DateTime::from_millis(1),
                expires_at: DateTime::from_millis(2),
                cutoff: DateTime::from_millis(0),
                land_by: DateTime::from_millis(3),
                default_permits: 3,
            },
            false,
        );
        assert_eq!(p.len(), 2, "drop, then admit");
        let control = acquire_pipeline(
            &AcquireArgs {
                owner: "o",
                nonce: "n",
                unknown: &[],
                acquired_at: DateTime::from_millis(1),
                expires_at: DateTime::from_millis(2),
                cutoff: DateTime::from_millis(0),
                land_by: DateTime::from_millis(3),
                default_permits: 3,
            },
            true,
        );
        assert_eq!(
            control[0],
            doc! { "$set": { "holders": [] } },
            "the control drops every holder"
        );
    }
}
