//! Concurrency limits, rate limits and fairness keys of jobs.
//!
//! A job enqueued with a concurrency key, a rate key, or through a handle with a queue
//! concurrency limit carries a `limits` sub-document (`{key, queue, rate}`, see
//! [`crate::format::job::field::limits`]). **The plain claims never take such a job**
//! (their filters require `limits: null`); only [`JobQueue::claim_limited`] does, and only
//! after it holds what the job names:
//! 1. a permit of the semaphore `queue` (a named queue's: `queue:<name>`) in
//!    `<collection>.limits` if `limits.queue` (at most
//!    [`LimitOptions::queue_concurrency`] running jobs in the queue),
//! 2. a permit of the semaphore `key:<key>` in `<collection>.limits` if `limits.key` (at
//!    most N running jobs of the key, N stored in the semaphore document, set by
//!    [`JobQueue::set_concurrency_limit`], default [`LimitOptions::key_concurrency`]),
//!    shared by every queue of the collection (see [`LimitOptions`]),
//! 3. a rate start admitted in `<collection>.rates` if `limits.rate` (`queue/rate.rs`),
//!    shared likewise,
//!
//! then it claims the job by `_id` with the claim filter re-checked in the write; if that
//! fails it gives the permits and the start back. Each permit is a
//! [`crate::lock::Semaphore`] permit (one atomic write, expiry by server time) whose ttl is
//! the job lease's ttl and half again, renewed by every heartbeat of the job (the
//! worker's, [`JobQueue::heartbeat`], [`JobQueue::heartbeat_many`]) before the job's
//! lease and released after the job's final transition is written. So a job never runs
//! without its permits, and a crashed worker's permits expire after its job leases.
//!
//! **Guarantee:** at any server instant at most N jobs of a key, across every queue of
//! the collection (and at most the queue limit of the queue's limited jobs) hold a valid
//! lease. **Limits:** a handle without [`LimitOptions`] never
//! claims limited jobs (it cannot bypass a limit, it only leaves the jobs to others). The
//! candidates of a limited claim are read from a few rotating partitions, like the plain
//! batch claim's, so a claim's cost does not grow with the backlog.
//!
//! **Fairness:** an enqueue with a fairness key stores `partition = fnv1a64(key) mod
//! partitions` instead of a random partition, so all jobs of a tenant share one partition
//! and the rotating batch claim visits tenants in turn: a tenant's backlog delays another
//! tenant's job by about one rotation, not by the backlog. Tenants whose keys fall in one
//! partition share its turns.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};

use super::JobQueue;
use super::job::{ClaimedJob, claimable_states, field};
use super::options::{EnqueueOptions, QueueOptions, Safeguard};
use super::rate::{RateLimiter, RateRecord, Start};
use crate::clock::TimeSource;
use crate::error::{Error, Result};
use crate::format::job::field::limits as lfield;
use crate::format::job::limit as lcoll;
use crate::lock::{Owner, Permit, Semaphore, SemaphoreOptions, SemaphoreRecord};
use crate::validate;

/// Limits a queue handle honours ([`QueueOptions::limits`]). A handle with any of them
/// set claims limited jobs (after their permits); one without claims only plain jobs.
///
/// **Concurrency and rate keys are shared by every queue of the collection**: the permits
/// of key `k` are the semaphore resource `key:k` in `<collection>.limits`, and its starts
/// the document `k` in `<collection>.rates`, whatever the job's queue
/// ([`QueueOptions::queue`]). So jobs of one key in two named queues together run at most
/// N at once (and start at most `limit` times per interval). That is the point of a key:
/// it names something outside the queue (an external API, a tenant) whose budget does not
/// depend on which queue the work came from. Two queues that use one key string for
/// unrelated things throttle each other: prefix such keys with the queue, or use
/// [`LimitOptions::queue_concurrency`], which is per queue (resource `queue:<name>`). A
/// key's N is stored on its first permit, from the `key_concurrency` of the handle that
/// takes it, and then holds for every queue; set it with
/// [`JobQueue::set_concurrency_limit`] (a rate's with [`JobQueue::set_rate_limit`]) rather
/// than relying on handles' defaults agreeing (`docs/queue.md`, "Limits and fairness").
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct LimitOptions {
    /// Whether this handle claims limited jobs. Set by every setter.
    pub enabled: bool,
    /// Running jobs per concurrency key, for a key whose semaphore stores no number yet
    /// (the first permit of the key stores it, for every queue of the collection).
    /// Default 1.
    pub key_concurrency: Option<u32>,
    /// Running limited jobs in the queue; every job enqueued through this handle counts
    /// against it. `None`: no queue limit.
    pub queue_concurrency: Option<u32>,
    /// Starts per interval of a rate key whose document stores no limit yet. Default 10
    /// per second.
    pub rate: Option<(u32, Duration)>,
}

impl LimitOptions {
    /// Default running jobs per concurrency key (see [`LimitOptions::key_concurrency`]).
    pub fn key_concurrency(mut self, n: u32) -> Self {
        self.enabled = true;
        self.key_concurrency = Some(n);
        self
    }

    /// A concurrency limit on the whole queue.
    pub fn queue_concurrency(mut self, n: u32) -> Self {
        self.enabled = true;
        self.queue_concurrency = Some(n);
        self
    }

    /// Default starts per interval of a rate key.
    pub fn rate(mut self, n: u32, interval: Duration) -> Self {
        self.enabled = true;
        self.rate = Some((n, interval));
        self
    }

    /// Claims limited jobs with every default (for a worker that only honours limits set
    /// elsewhere).
    pub fn enable(mut self) -> Self {
        self.enabled = true;
        self
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.key_concurrency == Some(0) || self.queue_concurrency == Some(0) {
            return Err(Error::invalid("concurrency limit", "must be at least 1"));
        }
        if let Some((n, interval)) = self.rate {
            if n == 0 {
                return Err(Error::invalid("rate limit", "must be at least 1"));
            }
            validate::duration_ms("rate interval", interval)?;
        }
        Ok(())
    }
}

/// The limits of one job ([`EnqueueOptions::limits`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct JobLimits {
    /// At most N jobs of this key run at once (per tenant, per resource).
    pub concurrency_key: Option<String>,
    /// At most N starts of this key per interval.
    pub rate_key: Option<String>,
    /// Jobs of one fairness key share a claim partition, so tenants take turns.
    pub fairness_key: Option<String>,
}

impl JobLimits {
    pub(crate) fn validate(&self) -> Result<()> {
        if let Some(key) = &self.concurrency_key {
            concurrency_key(key)?;
        }
        for (what, v) in [
            ("rate key", &self.rate_key),
            ("fairness key", &self.fairness_key),
        ] {
            if let Some(v) = v {
                validate::name(what, v)?;
            }
        }
        Ok(())
    }
}

/// Checks a concurrency key: a [`validate::name`] that leaves room for the
/// [`KEY_PREFIX`](lcoll::KEY_PREFIX) of its semaphore resource, which must itself be a
/// valid name (a longer key was enqueued, and then failed every limited claim).
fn concurrency_key(key: &str) -> Result<()> {
    validate::name("concurrency key", key)?;
    let limit = validate::MAX_NAME_LEN - lcoll::KEY_PREFIX.len();
    if key.len() > limit {
        return Err(Error::invalid(
            "concurrency key",
            format!(
                "is {} bytes, the limit is {limit} (its semaphore resource adds `{}`)",
                key.len(),
                lcoll::KEY_PREFIX
            ),
        ));
    }
    Ok(())
}

/// FNV-1a, 64 bits: the fairness partition of a key is `fnv1a64(key) mod partitions`
/// (documented so that an enqueuer in another language computes the same partition).
pub fn fairness_partition(key: &str, partitions: u32) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    i64::from(u32::try_from(h % u64::from(partitions.max(1))).unwrap_or(0))
}

/// The limiter state of a queue handle: its semaphores, its rate documents, and the
/// permits of the jobs it holds.
#[derive(Debug)]
pub(crate) struct Limits {
    keys: Semaphore,
    queue: Semaphore,
    rates: RateLimiter,
    /// By claim: the job's id and the claim's lease token. A job this handle claims
    /// again before the earlier claim's permits are released has two entries, and each
    /// release gives back its own claim's permits.
    held: Mutex<HashMap<(ObjectId, String), Held>>,
}

#[derive(Debug, Default)]
struct Held {
    permits: Vec<Permit>,
}

impl Limits {
    pub(crate) fn new(
        coll: &Collection<Document>,
        time: &TimeSource,
        options: &QueueOptions,
    ) -> Result<Self> {
        let l = &options.limits;
        l.validate()?;
        let db: Database = coll.client().database(&coll.namespace().db);
        let sem = |permits: u32| {
            Semaphore::new(
                db.collection_with_options(
                    &format!("{}{}", coll.name(), lcoll::COLLECTION_SUFFIX),
                    mongodb::options::CollectionOptions::builder()
                        .write_concern(coll.write_concern().cloned())
                        .build(),
                ),
                time.clone(),
                SemaphoreOptions::default().default_permits(permits),
            )
        };
        let (n, interval) = l.rate.unwrap_or((10, Duration::from_secs(1)));
        Ok(Self {
            keys: sem(l.key_concurrency.unwrap_or(1))?,
            queue: sem(l.queue_concurrency.unwrap_or(1))?,
            rates: RateLimiter::new(&db, coll, n, interval)?,
            held: Mutex::new(HashMap::new()),
        })
    }
}

/// The key of a claim's permits in [`Limits::held`].
fn claim_key(job: &ClaimedJob) -> (ObjectId, String) {
    (job.id(), job.lease.token.as_str().to_owned())
}

/// What one limited claim of one candidate did.
enum Attempt {
    Claimed(Box<ClaimedJob>),
    KeyFull(String),
    RateFull(String),
    QueueFull,
    Gone,
}

/// How many candidate rounds one limited claim reads (each reads the next partitions and
/// excludes the keys found full).
const ROUNDS: usize = 10;

impl JobQueue {
    /// The semaphore resource of this queue's own concurrency limit: `queue` for the
    /// default queue, `queue:<name>` for a named queue (each named queue has its own).
    fn queue_resource(&self) -> String {
        match &self.inner.options.queue {
            None => lcoll::QUEUE_RESOURCE.to_string(),
            Some(name) => format!("{}:{name}", lcoll::QUEUE_RESOURCE),
        }
    }

    /// Whether this handle claims limited jobs ([`LimitOptions`]).
    pub(crate) fn claims_limited(&self) -> bool {
        self.inner.options.limits.enabled
    }

    /// The `limits` sub-document and the fairness partition of a new job (enqueue).
    pub(crate) fn apply_limits(&self, d: &mut Document, opts: &EnqueueOptions) -> Result<()> {
        let l = &opts.limits;
        l.validate()?;
        let mut limits = Document::new();
        if let Some(k) = &l.concurrency_key {
            limits.insert(lfield::KEY, k.as_str());
        }
        if self.inner.options.limits.queue_concurrency.is_some() {
            limits.insert(lfield::QUEUE, true);
        }
        if let Some(k) = &l.rate_key {
            limits.insert(lfield::RATE, k.as_str());
        }
        if !limits.is_empty() {
            d.insert(field::LIMITS, limits);
        }
        if let Some(k) = &l.fairness_key {
            d.insert(
                field::PARTITION,
                fairness_partition(k, self.inner.options.partitions),
            );
        }
        Ok(())
    }

    /// The permit ttl: the job lease's and half again, so a permit outlives the lease it
    /// was taken for (it is renewed first, by the same heartbeat).
    fn permit_ttl(&self) -> Duration {
        self.inner.options.lease_ttl + self.inner.options.lease_ttl / 2
    }

    /// The worker's claim: limited jobs first (after their permits), then plain ones.
    pub(crate) async fn claim_with_limits(&self, owner: &str, k: usize) -> Result<Vec<ClaimedJob>> {
        let mut out = self.claim_limited(owner, k).await?;
        if out.len() < k {
            out.extend(self.claim_batch(owner, k - out.len()).await?);
        }
        Ok(out)
    }

    /// Claims up to `k` due limited jobs, each only after the permits and the rate start
    /// its `limits` name (see the module docs), highest ranked first, skipping keys found
    /// full. Empty when the handle has no [`LimitOptions`].
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad owner or `k = 0`; a database error.
    pub async fn claim_limited(&self, owner: &str, k: usize) -> Result<Vec<ClaimedJob>> {
        validate::name("owner", owner)?;
        validate::positive("batch size", k)?;
        let mut out = Vec::new();
        if !self.claims_limited() {
            return Ok(out);
        }
        let me = Owner::from_existing(owner)?;
        let mut full_keys: Vec<String> = Vec::new();
        let mut full_rates: Vec<String> = Vec::new();
        let limit = i64::try_from(k.saturating_mul(4)).unwrap_or(i64::MAX);
        for _ in 0..ROUNDS {
            let now = self.inner.time.now().await?;
            // The due limited jobs of a few partitions (rotating, widening while they hold
            // fewer than asked), like the plain batch claim: the read's cost does not grow
            // with the whole backlog.
            let (partitions, everything) = self.next_partitions();
            let mut filter = self.partition_filter(&partitions, &now);
            filter.insert(field::LIMITS, doc! { "$type": "object" });
            if !full_keys.is_empty() {
                filter.insert(field::LIMITS_KEY, doc! { "$nin": full_keys.clone() });
            }
            if !full_rates.is_empty() {
                filter.insert(field::LIMITS_RATE, doc! { "$nin": full_rates.clone() });
            }
            let candidates: Vec<Document> = self
                .inner
                .coll
                .find(filter)
                .sort(Self::claim_sort())
                .projection(doc! { field::ID: 1, field::LIMITS: 1 })
                .limit(limit)
                .await?
                .try_collect()
                .await?;
            self.adapt_span(candidates.len(), k);
            if candidates.is_empty() {
                // Widen only while no key was found full: once one is, the rest of the
                // backlog may well be of full keys, and reading on would cost O(backlog).
                if everything || !full_keys.is_empty() || !full_rates.is_empty() {
                    break;
                }
                continue;
            }
            let mut progress = false;
            for c in candidates {
                if out.len() >= k {
                    return Ok(out);
                }
                let limits = c.get_document(field::LIMITS).cloned().unwrap_or_default();
                let key = limits.get_str(lfield::KEY).ok().map(str::to_owned);
                let rate = limits.get_str(lfield::RATE).ok().map(str::to_owned);
                if key.as_ref().is_some_and(|k| full_keys.contains(k))
                    || rate.as_ref().is_some_and(|r| full_rates.contains(r))
                {
                    continue;
                }
                let id = c.get(field::ID).cloned().unwrap_or(Bson::Null);
                match self.claim_one_limited(&me, &id, &limits).await? {
                    Attempt::Claimed(job) => {
                        progress = true;
                        out.push(*job);
                    }
                    Attempt::KeyFull(k) => {
                        progress = true;
                        full_keys.push(k);
                    }
                    Attempt::RateFull(r) => {
                        progress = true;
                        full_rates.push(r);
                    }
                    Attempt::QueueFull => return Ok(out),
                    Attempt::Gone => {}
                }
            }
            if (!progress && everything) || out.len() >= k {
                break;
            }
        }
        Ok(out)
    }

    async fn claim_one_limited(&self, me: &Owner, id: &Bson, limits: &Document) -> Result<Attempt> {
        let l = &self.inner.limits;
        let skip_permits = self.inner.options.unsafe_without == Some(Safeguard::ConcurrencyLimit);
        let skip_rate = self.inner.options.unsafe_without == Some(Safeguard::RateLimit);
        let ttl = self.permit_ttl();
        let mut permits: Vec<Permit> = Vec::new();
        if limits.get_bool(lfield::QUEUE).unwrap_or(false) && !skip_permits {
            match l.queue.try_acquire(me, &self.queue_resource(), ttl).await? {
                Some(p) => permits.push(p),
                None => return Ok(Attempt::QueueFull),
            }
        }
        if let Ok(key) = limits.get_str(lfield::KEY)
            && !skip_permits
        {
            let resource = format!("{}{key}", lcoll::KEY_PREFIX);
            match l.keys.try_acquire(me, &resource, ttl).await {
                Ok(Some(p)) => permits.push(p),
                Ok(None) => {
                    self.give_back(&permits, None).await;
                    return Ok(Attempt::KeyFull(key.to_owned()));
                }
                Err(e) => {
                    self.give_back(&permits, None).await;
                    return Err(e);
                }
            }
        }
        let mut start: Option<Start> = None;
        if let Ok(rate) = limits.get_str(lfield::RATE) {
            match l.rates.admit(rate, skip_rate).await {
                Ok(Some(s)) => start = Some(s),
                Ok(None) => {
                    self.give_back(&permits, None).await;
                    return Ok(Attempt::RateFull(rate.to_owned()));
                }
                Err(e) => {
                    self.give_back(&permits, None).await;
                    return Err(e);
                }
            }
        }
        // The claim by `_id`, the claim filter re-checked in the write, with the very
        // `limits` the permits were taken for: a replacing enqueue
        // (`OnDuplicate::Replace`/`Debounce`) may have given the waiting job other keys
        // since the read, and it must not start under another key's permit.
        let claimed = async {
            let now = self.inner.time.now().await?;
            let token = validate::random_id();
            let filter = doc! {
                field::ID: id.clone(),
                field::STATE: { "$in": claimable_states() },
                field::RUN_AT: { "$lte": now.latest() },
                field::LIMITS: limits.clone(),
            };
            let mut update = Self::claim_update(
                me.id(),
                &token,
                now.plus_ms(self.inner.ttl_ms),
                now.estimate(),
            );
            if let Some(at) = start.as_ref().and_then(|s| s.at)
                && let Ok(set) = update.get_document_mut("$set")
            {
                set.insert(field::LIMITS_ADMITTED_AT, at);
            }
            let d = self
                .inner
                .coll
                .find_one_and_update(filter, update)
                .return_document(ReturnDocument::After)
                .await?;
            match d {
                Some(d) => self.accept(d, &token).await,
                None => Ok(None),
            }
        }
        .await;
        match claimed {
            Ok(Some(job)) => {
                if !permits.is_empty() {
                    self.inner
                        .limits
                        .held
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(claim_key(&job), Held { permits });
                }
                Ok(Attempt::Claimed(Box::new(job)))
            }
            Ok(None) => {
                self.give_back(&permits, start.as_ref()).await;
                Ok(Attempt::Gone)
            }
            Err(e) => {
                self.give_back(&permits, start.as_ref()).await;
                Err(e)
            }
        }
    }

    /// Releases permits (and takes a rate start back after a failed claim). A release that
    /// fails with a transient error is finished in the background
    /// (`Semaphore::release_in_background`, `RateLimiter::take_back`): before session 35
    /// it was dropped, and the permit held a slot of the limit until its ttl, the start
    /// one of the rate until it left its interval.
    async fn give_back(&self, permits: &[Permit], start: Option<&Start>) {
        for p in permits {
            let sem = if !p.resource.starts_with(lcoll::KEY_PREFIX) {
                &self.inner.limits.queue
            } else {
                &self.inner.limits.keys
            };
            sem.release_in_background(p, "concurrency permit").await;
        }
        if let Some(s) = start {
            self.inner.limits.rates.take_back(s, &self.inner.time).await;
        }
    }

    /// Releases the permits this handle holds for `job`, a job it claimed with
    /// [`JobQueue::claim_limited`]: call it after the job's final transition was written
    /// (or its lease was lost); the [`super::Worker`] does. Nothing for a job without
    /// permits. A release that fails with a transient error is retried in the background for
    /// up to a minute; after that a permit not released expires by itself.
    pub async fn release_permits(&self, job: &ClaimedJob) {
        let held = self
            .inner
            .limits
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&claim_key(job));
        if let Some(h) = held {
            self.give_back(&h.permits, None).await;
        }
    }

    /// Renews the permits of `jobs` (the worker's heartbeat, before the jobs' leases):
    /// per job, whether it still holds every permit (`true` for a job without permits).
    pub(crate) async fn renew_permits(&self, jobs: &[ClaimedJob]) -> Vec<bool> {
        let ttl = self.permit_ttl();
        // Every permit of every job, by semaphore, with the job it belongs to: one
        // `renew_many` per semaphore (one write per permit document, the documents'
        // writes concurrent), not one round trip per permit.
        let (mut queue, mut keys) = (Vec::new(), Vec::new());
        let (mut queue_of, mut keys_of) = (Vec::new(), Vec::new());
        {
            let held = self
                .inner
                .limits
                .held
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            for (i, job) in jobs.iter().enumerate() {
                for p in held
                    .get(&claim_key(job))
                    .map(|h| h.permits.clone())
                    .unwrap_or_default()
                {
                    if p.resource.starts_with(lcoll::KEY_PREFIX) {
                        keys.push(p);
                        keys_of.push(i);
                    } else {
                        queue.push(p);
                        queue_of.push(i);
                    }
                }
            }
        }
        let (by_queue, by_keys) = futures::join!(
            self.inner.limits.queue.renew_many(&mut queue, ttl),
            self.inner.limits.keys.renew_many(&mut keys, ttl),
        );
        let mut out = vec![true; jobs.len()];
        for (results, owners) in [(by_queue, queue_of), (by_keys, keys_of)] {
            match results {
                Ok(results) => {
                    for (r, i) in results.into_iter().zip(owners) {
                        match r {
                            Ok(()) => {}
                            Err(Error::LeaseLost { .. }) => out[i] = false,
                            Err(e) => {
                                tracing::warn!(error = %e, "permit renewal failed; will retry");
                            }
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "permit renewals failed; will retry"),
            }
        }
        out
    }

    /// Sets the number of jobs of concurrency key `key` that may run at once (stored in
    /// its semaphore document, for every worker). Shrinking stops nothing that runs: no
    /// new job of the key starts until fewer than `n` run.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad key or `n = 0`; a database error.
    pub async fn set_concurrency_limit(&self, key: &str, n: u32) -> Result<()> {
        concurrency_key(key)?;
        self.inner
            .limits
            .keys
            .set_permits(&format!("{}{key}", lcoll::KEY_PREFIX), n)
            .await
    }

    /// Sets the queue's own concurrency limit (for every worker).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for `n = 0`; a database error.
    pub async fn set_queue_concurrency_limit(&self, n: u32) -> Result<()> {
        self.inner
            .limits
            .queue
            .set_permits(&self.queue_resource(), n)
            .await
    }

    /// Sets the rate limit of `key`: at most `n` starts per `interval`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad key, `n = 0` or a zero interval; a database error.
    pub async fn set_rate_limit(&self, key: &str, n: u32, interval: Duration) -> Result<()> {
        self.inner.limits.rates.set(key, n, interval).await
    }

    /// The concurrency semaphores of this queue (`queue` and `key:<key>`), with their
    /// holders: what `docwarden locks list` / `queue` commands show.
    ///
    /// # Errors
    /// A database error.
    pub async fn concurrency_limits(&self) -> Result<Vec<SemaphoreRecord>> {
        self.inner.limits.keys.list(None, false).await
    }

    /// The rate document of `key`, `None` if it was never used.
    ///
    /// # Errors
    /// A database error.
    pub async fn rate_status(&self, key: &str) -> Result<Option<RateRecord>> {
        self.inner.limits.rates.status(key).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Session 18: a replacing enqueue (`OnDuplicate::Replace`/`Debounce`) now gives the
    /// waiting job the new enqueue's limits. The limited claim took its permits for the
    /// keys it read, then claimed by `_id` re-checking only `limits: {$type: "object"}`,
    /// so a job whose key changed from `a` to `b` in between started under `a`'s permit:
    /// key `b` could run one job over its limit. The claim now re-checks `limits` equal
    /// to what it read: the job is `Gone` for that claim (its permit given back) and the
    /// next limited claim takes it under `b`. Fails without it: the stale claim succeeds.
    #[tokio::test]
    async fn a_job_whose_keys_a_replace_changed_is_not_claimed_under_the_old_permit()
    -> anyhow::Result<()> {
        use crate::clock::ClockOptions;
        use crate::queue::{Enqueued, OnDuplicate};
        let t = docwarden_testkit::TestDb::new("queue_limited_claim_replaced_keys").await?;
        let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
        let q = JobQueue::open(
            &t.db,
            "jobs",
            time,
            QueueOptions::default().limits(LimitOptions::default().key_concurrency(1)),
        )
        .await?;
        let keyed = |key: &str| {
            EnqueueOptions::default()
                .dedupe_key("r")
                .on_duplicate(OnDuplicate::Replace)
                .concurrency_key(key)
        };
        let id = q
            .enqueue(doc! { "v": 1 }, &keyed("a"))
            .await?
            .created()
            .ok_or_else(|| anyhow::anyhow!("not created"))?;
        // The limited claim read the job's limits (key `a`) ...
        let read = q
            .collection()
            .find_one(doc! { field::ID: id })
            .await?
            .ok_or_else(|| anyhow::anyhow!("gone"))?
            .get_document(field::LIMITS)?
            .clone();
        // ... then a replacing enqueue gave it key `b`, before the claim's write.
        assert_eq!(
            q.enqueue(doc! { "v": 2 }, &keyed("b")).await?,
            Enqueued::Replaced(id)
        );
        let me = Owner::from_existing("w")?;
        let stale = match q.claim_one_limited(&me, &Bson::ObjectId(id), &read).await? {
            Attempt::Claimed(job) => Some(job.id()),
            _ => None,
        };
        assert_eq!(
            stale, None,
            "claimed under key a's permit after it became key b's"
        );
        // The next limited claim reads key `b` and takes it.
        let jobs = q.claim_limited("w2", 1).await?;
        assert_eq!(
            jobs.iter().map(ClaimedJob::id).collect::<Vec<_>>(),
            vec![id]
        );
        assert_eq!(
            q.collection()
                .find_one(doc! { field::ID: id })
                .await?
                .ok_or_else(|| anyhow::anyhow!("gone"))?
                .get_document(field::LIMITS)?
                .get_str(lfield::KEY)?,
            "b"
        );
        Ok(())
    }

    #[test]
    fn fairness_partitions_are_fnv1a_and_stable() {
        // FNV-1a 64 of "a" is 0xaf63dc4c8601ec8c.
        assert_eq!(
            fairness_partition("a", 1024),
            i64::try_from(0xaf63_dc4c_8601_ec8c_u64 % 1024).unwrap_or(-1)
        );
        assert_eq!(fairness_partition("tenant", 1), 0);
        assert!((0..256).contains(&fairness_partition("tenant-b", 256)));
    }

    #[test]
    fn limits_are_validated() {
        assert!(
            LimitOptions::default()
                .key_concurrency(0)
                .validate()
                .is_err()
        );
        assert!(
            LimitOptions::default()
                .rate(1, Duration::ZERO)
                .validate()
                .is_err()
        );
        assert!(
            LimitOptions::default()
                .queue_concurrency(2)
                .validate()
                .is_ok()
        );
    }
}
