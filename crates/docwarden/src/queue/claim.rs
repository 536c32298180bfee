//! Claims: one job or a batch, highest priority due job first, with a fresh lease.
//!
//! A batch claim ([`JobQueue::claim_batch`]) reads the due jobs of a few partitions
//! (rotating, widening while they hold fewer jobs than asked) through
//! [`index::CLAIM_PARTITION`](super::index::CLAIM_PARTITION), so concurrent claimers do
//! not race for the head of the queue and a claim's cost does not grow with the backlog;
//! its order is strict inside the partitions read, not across them (`docs/queue.md`,
//! "Ordering"). A single claim takes the head of the whole queue:
//! the claim filter `{state: {$in: [ready, retrying]}, run_at: {$lte: now}}` with sort
//! `{priority: -1, run_at: 1}` is served by the partial index
//! [`index::CLAIM`](super::index::CLAIM) (`{priority: -1, run_at: 1}` over claimable
//! jobs only), so a claim walks the index in claim order and never scans finished jobs.
//! Expired leases are swept back to `retrying` by one indexed `updateMany`
//! ([`index::LEASE_EXPIRY`](super::index::LEASE_EXPIRY)) at most every
//! `reap_interval`, with a cut-off of server time minus the clock bound and the skew
//! margin, so they become claimable like any other due job. The same sweep recovers
//! hand-edited jobs whose `lease.until` or `run_at` is not a date (see
//! [`JobQueue::reap_expired`]). The sweep is housekeeping: its failure is logged and never
//! fails the claim that ran it.

use std::sync::atomic::Ordering;
use std::time::Instant;

use futures::TryStreamExt;
use mongodb::bson::{Bson, DateTime, Document, RawDocumentBuf, doc};
use mongodb::options::{Hint, ReturnDocument};

use super::job::{ClaimedJob, Job, JobState, claimable_states, fence_filter, field};
use super::options::{ClaimStrategy, Safeguard};
use super::{JobQueue, index};
use crate::clock::ServerTime;
use crate::error::{Error, Result};
use crate::validate;

/// The claim index, named explicitly: the claim filter is exactly the index's partial
/// filter, so the hint is always valid, and the plan never depends on the planner's
/// trial (or on a server that does not match `$in` against partial filters).
/// Above this many partitions, a batch claim that found a full batch halves its span at
/// once ([`JobQueue::adapt_span`]).
const WIDE_SPAN: u32 = 8;
/// Full batch claims in a row before a narrow span tries one partition fewer.
const SHRINK_AFTER: u32 = 8;

pub(crate) fn claim_hint() -> Hint {
    Hint::Name(index::CLAIM.to_owned())
}

/// The `last_error` the sweep stores on a job whose lease expired.
pub(crate) const LEASE_EXPIRED_REASON: &str = "lease expired before the job finished";

/// The `last_error` the sweep stores on a job it moves to `dead` because its stalls
/// went past its `max_stalls` (stall accounting, issue 15).
pub(crate) const STALLED_REASON: &str = "stalled: the lease expired more than max_stalls times";

/// How many times one claim call retries after burying a malformed job.
const MAX_ROUNDS: usize = 8;

/// Most reads of one batch claim that found nothing and widened the span: the span
/// doubles on each, so 11 reach every one of [`MAX_PARTITIONS`](super::options::MAX_PARTITIONS)
/// partitions; the rest is room for another claim of the handle narrowing it meanwhile.
const MAX_WIDENINGS: usize = 32;

impl JobQueue {
    /// The claim filter for server time `now`: claimable state and due. A job is due
    /// when `run_at` may have passed by the server's clock (`now.latest()`): a job can
    /// start up to the clock bound (milliseconds) early, and a job enqueued "now" by one
    /// client is at once claimable by every other.
    pub(crate) fn due_filter(&self, now: &ServerTime) -> Document {
        doc! {
            field::QUEUE: self.queue_value(),
            field::STATE: { "$in": claimable_states() },
            field::RUN_AT: { "$lte": now.latest() },
        }
    }

    /// The plain claims' filter: due, and without `limits` (a limited job is claimed only
    /// by [`JobQueue::claim_limited`], after its permits: `queue/limit.rs`).
    pub(crate) fn plain_due_filter(&self, now: &ServerTime) -> Document {
        let mut f = self.due_filter(now);
        f.insert(field::LIMITS, Bson::Null);
        f
    }

    /// The claim order: highest priority first, then oldest `run_at`.
    pub(crate) fn claim_sort() -> Document {
        doc! { field::PRIORITY: -1, field::RUN_AT: 1 }
    }

    pub(super) fn claim_update(
        owner: &str,
        token: &str,
        until: DateTime,
        now: DateTime,
    ) -> Document {
        doc! {
            "$set": {
                field::STATE: JobState::Running.as_str(),
                field::LEASE: { field::lease::OWNER: owner, field::lease::TOKEN: token, field::lease::UNTIL: until },
                field::UPDATED_AT: now,
            },
            "$inc": { field::ATTEMPTS: 1_i64 },
        }
    }

    /// Claims the highest priority due job for `owner`, or `None` if none is due.
    ///
    /// A job whose stored document turns out malformed is moved to `dead` with the
    /// reason, and the claim goes on to the next job.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad owner name; a database error.
    #[tracing::instrument(skip(self), fields(queue = %self.collection().name()), level = "debug")]
    pub async fn claim(&self, owner: &str) -> Result<Option<ClaimedJob>> {
        validate::name("owner", owner)?;
        self.ensure_single_claim_index().await?;
        for _ in 0..MAX_ROUNDS {
            self.maybe_reap().await;
            let token = validate::random_id();
            let attempt = match self.inner.options.claim_strategy {
                ClaimStrategy::FindOneAndUpdate => self.claim_fam(owner, &token).await,
                ClaimStrategy::UpdateThenFetch => self.claim_update_fetch(owner, &token).await,
            };
            match attempt {
                Ok(Some(d)) => match self.accept(d, &token).await? {
                    Some(claimed) => return Ok(Some(claimed)),
                    None => continue,
                },
                Ok(None) => return Ok(None),
                Err(e) if !e.is_retryable() => {
                    if self.bury_malformed(None).await? == 0 {
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    async fn claim_fam(&self, owner: &str, token: &str) -> Result<Option<Document>> {
        let now = self.inner.time.now().await?;
        let update =
            Self::claim_update(owner, token, now.plus_ms(self.inner.ttl_ms), now.estimate());
        if self.inner.options.unsafe_without == Some(Safeguard::ClaimRecheck) {
            // Control only: read the head job, then write the lease by `_id` alone. The
            // gap between the read and the write is widened (20 ms) so that the race the
            // re-check closes shows up in a short test.
            let Some(head) = self
                .inner
                .coll
                .find_one(self.plain_due_filter(&now))
                .sort(Self::claim_sort())
                .projection(doc! { field::ID: 1 })
                .await?
            else {
                return Ok(None);
            };
            let id = head.get(field::ID).cloned().unwrap_or(Bson::Null);
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            return Ok(self
                .inner
                .coll
                .find_one_and_update(doc! { field::ID: id }, update)
                .return_document(ReturnDocument::After)
                .await?);
        }
        Ok(self
            .inner
            .coll
            .find_one_and_update(self.plain_due_filter(&now), update)
            .sort(Self::claim_sort())
            .hint(claim_hint())
            .return_document(ReturnDocument::After)
            .await?)
    }

    async fn claim_update_fetch(&self, owner: &str, token: &str) -> Result<Option<Document>> {
        let now = self.inner.time.now().await?;
        let update =
            Self::claim_update(owner, token, now.plus_ms(self.inner.ttl_ms), now.estimate());
        let r = self
            .inner
            .coll
            .update_one(self.plain_due_filter(&now), update)
            .sort(Self::claim_sort())
            .hint(claim_hint())
            .await?;
        if r.modified_count == 0 {
            return Ok(None);
        }
        // The claimed job's `lease.until` is known exactly: an equality on the lease-expiry
        // index (partial on `running`) finds it without an index on the token.
        let (primary, local) = super::latest();
        let claimed = doc! {
            field::LEASE_UNTIL: now.plus_ms(self.inner.ttl_ms),
            field::STATE: JobState::Running.as_str(),
            field::LEASE_TOKEN: token,
        };
        match self
            .inner
            .coll
            .find_one(claimed.clone())
            .selection_criteria(primary)
            .read_concern(local)
            .await
        {
            Ok(d) => Ok(d),
            Err(e) => {
                self.give_back_unread(claimed).await;
                Err(e.into())
            }
        }
    }

    /// Best effort, after a claim wrote its leases but could not read the claimed jobs
    /// back: gives the running jobs matching `claimed` (a filter naming the claim's
    /// token) back as a release does — `ready` (`retrying` after earlier attempts), the
    /// attempt returned — so they are claimable at once instead of after their lease,
    /// and not charged an attempt they never ran. If this write fails with a transient
    /// error it is retried in the background for up to a minute (`lock/landing.rs`,
    /// "Releases that failed"; before session 35 it was not, and the jobs waited for their
    /// lease to expire, charged the attempt); after that the leases expire and the sweep
    /// takes the jobs back.
    async fn give_back_unread(&self, mut claimed: Document) {
        claimed.insert(field::STATE, JobState::Running.as_str());
        let now = match self.inner.time.now().await {
            Ok(now) => now.estimate(),
            Err(e) => {
                tracing::warn!(error = %e, "claimed jobs not read back, nor given back");
                return;
            }
        };
        let give_back = vec![doc! { "$set": {
            field::STATE: { "$cond": [
                { "$lte": [format!("${}", field::ATTEMPTS), 1_i64] },
                JobState::Ready.as_str(),
                JobState::Retrying.as_str(),
            ] },
            field::ATTEMPTS: { "$subtract": [format!("${}", field::ATTEMPTS), 1_i64] },
            field::UPDATED_AT: now,
        } }];
        match self
            .inner
            .coll
            .update_many(claimed.clone(), give_back.clone())
            .await
        {
            Ok(r) => tracing::warn!(
                jobs = r.modified_count,
                "claimed jobs could not be read back: given back"
            ),
            Err(e) => {
                let e = Error::from(e);
                tracing::warn!(error = %e, "claimed jobs not read back, nor given back yet");
                // The filter names the claim's token and `running`: a retry finds nothing
                // of what a first try did give back.
                crate::lock::landing::release_many_later(
                    &self.inner.coll,
                    &self.inner.time,
                    claimed,
                    give_back.into(),
                    &e,
                    "claimed jobs given back",
                );
            }
        }
    }

    /// The partitions the next batch claim of this handle reads: `span` consecutive
    /// ones from a rotating cursor, so concurrent claimers of one handle start apart.
    pub(super) fn next_partitions(&self) -> (Vec<i64>, bool) {
        let total = self.inner.options.partitions;
        let span = self.inner.span.load(Ordering::Relaxed).clamp(1, total);
        let first = self.inner.next_partition.fetch_add(span, Ordering::Relaxed) % total;
        let parts = (0..span).map(|i| i64::from((first + i) % total)).collect();
        (parts, span == total)
    }

    /// Adapts the span of the next batch claims to the backlog's density. A short claim
    /// (`found < k` due jobs in `span` partitions) tells the density, and the span grows
    /// to the one that would have held `k` (at least one partition more; double when
    /// nothing was found), remembered as a hint. A full claim only says "at least `k`":
    /// a wide span more than twice the hint (or with no hint: a burst after an empty
    /// queue) halves at once; otherwise the span shrinks by one partition after
    /// [`SHRINK_AFTER`] full claims in a row. So a backlog settles on full claims with
    /// one short claim in about `SHRINK_AFTER + 1`, and a find reads about one batch's
    /// worth whatever the backlog.
    pub(super) fn adapt_span(&self, found: usize, k: usize) {
        let total = self.inner.options.partitions;
        let span = self.inner.span.load(Ordering::Relaxed).clamp(1, total);
        let hint = self.inner.span_hint.load(Ordering::Relaxed);
        let next = if found >= k {
            let full = self.inner.span_full.fetch_add(1, Ordering::Relaxed) + 1;
            if span > WIDE_SPAN && (hint == 0 || span > hint.saturating_mul(2)) {
                span / 2
            } else if full >= SHRINK_AFTER {
                self.inner.span_full.store(0, Ordering::Relaxed);
                span - 1
            } else {
                span
            }
        } else {
            self.inner.span_full.store(0, Ordering::Relaxed);
            if found == 0 {
                self.inner.span_hint.store(0, Ordering::Relaxed);
                span.saturating_mul(2)
            } else {
                let k = u64::try_from(k).unwrap_or(u64::MAX);
                let found = u64::try_from(found).unwrap_or(1);
                let dense = u32::try_from((u64::from(span) * k).div_ceil(found))
                    .unwrap_or(u32::MAX)
                    .min(total);
                self.inner.span_hint.store(dense, Ordering::Relaxed);
                dense.max(span + 1)
            }
        };
        self.inner
            .span
            .store(next.clamp(1, total), Ordering::Relaxed);
    }

    /// The batch claim's candidate filter: the due jobs of `partitions` (plus jobs
    /// stored without a partition, format 1, as `null`), as one `$or` of the two
    /// claimable states, each an equality on `state` and an `$in` on `partition` (the
    /// prefix of [`index::CLAIM_PARTITION`](super::index::CLAIM_PARTITION)), with the due
    /// condition beside it: never a top-level `$expr`, never a hint.
    ///
    /// When `partitions` is every partition (a small backlog widens the span to all of
    /// them), the `$in` is left out: the arms are `{state, queue}` alone, which match the
    /// same jobs (format 1 included) as two index ranges instead of two per partition.
    /// On the embedded server each range is a seek: with 256 partitions the `$in` form
    /// cost ~3 ms of server CPU per read whatever the backlog, the two ranges ~1 ms
    /// (`docs/benchmarks.md`, session 8). On MongoDB an `$in` of more than 200 index
    /// bounds is not merge-sorted anyway (`internalQueryMaxScansToExplode`), and each
    /// `{state, queue}` arm is an equality prefix the planner can serve from the claim
    /// indexes.
    pub(crate) fn partition_filter(&self, partitions: &[i64], now: &ServerTime) -> Document {
        let every = usize::try_from(self.inner.options.partitions)
            .is_ok_and(|total| partitions.len() >= total);
        let keys: Vec<Bson> = if every {
            Vec::new()
        } else {
            partitions
                .iter()
                .map(|p| Bson::Int64(*p))
                .chain(std::iter::once(Bson::Null))
                .collect()
        };
        let arms: Vec<Document> = [JobState::Ready, JobState::Retrying]
            .iter()
            .map(|s| {
                let mut arm = doc! {
                    field::STATE: s.as_str(),
                    field::QUEUE: self.queue_value(),
                };
                if !every {
                    arm.insert(field::PARTITION, doc! { "$in": keys.clone() });
                }
                arm
            })
            .collect();
        doc! { "$or": arms, field::RUN_AT: { "$lte": now.latest() }, field::LIMITS: Bson::Null }
    }

    /// Claims up to `k` due jobs with one lease token, in three round trips whatever
    /// `k`: a find of candidate ids, one `updateMany` by `_id` that re-checks the claim
    /// filter per document (so racing claimers never share a job), and a find of those
    /// `_id`s under the new token.
    ///
    /// Candidates are the `k` highest ranked due jobs (priority, then `run_at`) of a
    /// few partitions ([`QueueOptions::partitions`](super::QueueOptions::partitions)):
    /// the handle rotates through the partitions and widens the number it reads at once
    /// while they hold fewer than `k` due jobs, so a small backlog is still claimed in
    /// full batches and a large one costs the same per claim. The claimed jobs are
    /// returned in rank order. The ordering promise is in `docs/queue.md`
    /// ("Ordering"): strict inside the partitions read, not across partitions. If the
    /// read of the claimed jobs fails, they are given back (attempt returned) before the
    /// error is returned.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad owner or `k = 0`; a database error.
    pub async fn claim_batch(&self, owner: &str, k: usize) -> Result<Vec<ClaimedJob>> {
        self.claim_batch_taking(owner, k, None).await
    }

    /// [`JobQueue::claim_batch`], holding a permit of `turns` (a `Worker`'s write turns,
    /// `queue/worker.rs`) for its write alone: its two reads take no turn, so another
    /// claim's or the completions' writes go on meanwhile.
    #[tracing::instrument(name = "claim_batch", skip(self, turns), fields(queue = %self.collection().name()), level = "debug")]
    pub(crate) async fn claim_batch_taking(
        &self,
        owner: &str,
        k: usize,
        turns: Option<&tokio::sync::Semaphore>,
    ) -> Result<Vec<ClaimedJob>> {
        validate::name("owner", owner)?;
        validate::positive("batch size", k)?;
        let limit = i64::try_from(k).unwrap_or(i64::MAX);
        // Reads that found nothing in partitions short of all of them widen the span (it
        // doubles) and do not count as rounds: a claim answers "nothing due" only after
        // a read of every partition. (Counted as rounds, eight of them read 255 of 256
        // partitions from a cold handle, and due jobs all in the one left out were not
        // claimed.) `MAX_WIDENINGS` bounds them should another claim of the handle
        // narrow the span meanwhile.
        let (mut rounds, mut widenings) = (0, 0);
        while rounds < MAX_ROUNDS {
            self.maybe_reap().await;
            let now = self.inner.time.now().await?;
            let (partitions, everything) = self.next_partitions();
            let ids: Vec<Bson> = self
                .inner
                .coll
                .clone_with_type::<RawDocumentBuf>()
                .find(self.partition_filter(&partitions, &now))
                .sort(Self::claim_sort())
                .projection(doc! { field::ID: 1 })
                .limit(limit)
                .await?
                .try_collect::<Vec<RawDocumentBuf>>()
                .await?
                .iter()
                .filter_map(|d| d.get(field::ID).ok().flatten())
                .filter_map(|id| Bson::try_from(id).ok())
                .collect();
            self.adapt_span(ids.len(), k);
            if ids.is_empty() {
                widenings += 1;
                if everything || widenings > MAX_WIDENINGS {
                    return Ok(Vec::new());
                }
                continue;
            }
            rounds += 1;
            let token = validate::random_id();
            let mut filter = doc! { field::ID: { "$in": ids.clone() } };
            filter.extend(self.plain_due_filter(&now));
            match self.inner.options.unsafe_without {
                Some(Safeguard::BatchRecheck) => {
                    // Control only: the candidates are written whatever their state now.
                    filter = doc! { field::ID: { "$in": ids.clone() } };
                }
                Some(Safeguard::ClaimRecheck) => {
                    // Control only: the seed's read-then-write, with the gap widened
                    // (20 ms) so that the race the re-check closes shows in a short test.
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    filter = doc! { field::ID: { "$in": ids.clone() } };
                }
                _ => {}
            }
            let update = Self::claim_update(
                owner,
                &token,
                now.plus_ms(self.inner.ttl_ms),
                now.estimate(),
            );
            let written = {
                // A closed semaphore (never, in a `Worker`) only means no turn to wait for.
                let _turn = match turns {
                    Some(t) => t.acquire().await.ok(),
                    None => None,
                };
                self.inner.coll.update_many(filter, update).await
            };
            let failed = match written {
                Ok(r) if r.matched_count == 0 => continue,
                Ok(_) => None,
                Err(e) => Some(Error::from(e)),
            };
            let claimed = match self.fetch_claimed(&ids, &token).await {
                Ok(claimed) => claimed,
                Err(e) => {
                    self.give_back_unread(
                        doc! { field::ID: { "$in": ids.clone() }, field::LEASE_TOKEN: &token },
                    )
                    .await;
                    return Err(e);
                }
            };
            if let Some(e) = failed
                && (e.is_retryable() || self.bury_malformed(Some(ids)).await? == 0)
            {
                if claimed.is_empty() {
                    return Err(e);
                }
                tracing::warn!(error = %e, "batch claim partly failed");
            }
            if !claimed.is_empty() {
                return Ok(claimed);
            }
        }
        Ok(Vec::new())
    }

    /// The jobs among `ids` claimed under `token`, parsed (malformed ones moved to
    /// `dead`), in rank order. Point lookups by `_id` with the token re-checked, so no
    /// index on the token is needed (format 3).
    async fn fetch_claimed(&self, ids: &[Bson], token: &str) -> Result<Vec<ClaimedJob>> {
        let (primary, local) = super::latest();
        // Read raw and converted directly: the driver's own conversion of each document
        // (through serde) was a sixth of a `Worker`'s client CPU.
        let docs: Vec<RawDocumentBuf> = self
            .inner
            .coll
            .clone_with_type::<RawDocumentBuf>()
            .find(doc! { field::ID: { "$in": ids }, field::LEASE_TOKEN: token })
            .selection_criteria(primary)
            .read_concern(local)
            .await?
            .try_collect()
            .await?;
        let mut claimed = Vec::with_capacity(docs.len());
        for raw in docs {
            let d = Document::try_from(raw.as_ref()).map_err(|e| Error::Malformed {
                id: "a claimed job".into(),
                reason: format!("the server's reply is not valid BSON: {e}"),
            })?;
            if let Some(c) = self.accept(d, token).await? {
                claimed.push(c);
            }
        }
        claimed.sort_by(|a, b| {
            b.job
                .priority
                .cmp(&a.job.priority)
                .then(a.job.run_at.cmp(&b.job.run_at))
        });
        Ok(claimed)
    }

    /// Claims the job `id` if it is due: one `findOneAndUpdate` routed by `_id` (the
    /// claim filter re-checked in the write), which returns the claimed document. A
    /// worker woken by the insert of `id` uses it: one round trip from the event to a
    /// running handler. `None` if the job is not (or no longer) claimable.
    ///
    /// # Errors
    /// A database error.
    pub(crate) async fn claim_id(&self, owner: &str, id: &Bson) -> Result<Option<ClaimedJob>> {
        let now = self.inner.time.now().await?;
        let token = validate::random_id();
        let mut filter = doc! { field::ID: id.clone() };
        filter.extend(self.plain_due_filter(&now));
        let update = Self::claim_update(
            owner,
            &token,
            now.plus_ms(self.inner.ttl_ms),
            now.estimate(),
        );
        let claimed = self
            .inner
            .coll
            .find_one_and_update(filter, update)
            .return_document(ReturnDocument::After)
            .await?;
        match claimed {
            Some(d) => self.accept(d, &token).await,
            None => Ok(None),
        }
    }

    /// Parses a freshly claimed document; a malformed one is moved to `dead` (fenced by
    /// our token) with the reason, and `None` is returned.
    pub(super) async fn accept(&self, d: Document, token: &str) -> Result<Option<ClaimedJob>> {
        match Job::from_document(&d) {
            Ok(job) => match job.lease.clone() {
                Some(lease) if lease.token.as_str() == token => {
                    crate::observe::claimed(self.metrics_label(), 1);
                    Ok(Some(ClaimedJob::new(job, lease)))
                }
                _ => Ok(None),
            },
            Err(Error::Malformed { reason, id }) => {
                let raw_id = d.get(field::ID).cloned().unwrap_or(Bson::Null);
                tracing::warn!(job = %id, %reason, "malformed job moved to dead");
                self.bury(fence_filter(&raw_id, token), &reason).await?;
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    async fn bury(&self, filter: Document, reason: &str) -> Result<bool> {
        let now = self.inner.time.now().await?.estimate();
        let r = self
            .inner
            .coll
            .update_one(
                filter,
                doc! { "$set": {
                    field::STATE: JobState::Dead.as_str(),
                    field::LAST_ERROR: format!("malformed job document: {reason}"),
                    field::FINISHED_AT: now,
                    field::UPDATED_AT: now,
                } },
            )
            .await?;
        Ok(r.modified_count == 1)
    }

    /// After a claim failed on the server (for example `$inc` on a string `attempts`):
    /// parses the due candidates and moves the malformed ones to `dead`. Returns how
    /// many were moved.
    async fn bury_malformed(&self, ids: Option<Vec<Bson>>) -> Result<usize> {
        let now = self.inner.time.now().await?;
        let mut filter = self.due_filter(&now);
        if let Some(ids) = ids {
            filter.insert(field::ID, doc! { "$in": ids });
        }
        let docs: Vec<Document> = self
            .inner
            .coll
            .find(filter)
            .sort(Self::claim_sort())
            .limit(16)
            .await?
            .try_collect()
            .await?;
        let mut buried = 0;
        for d in docs {
            if let Err(Error::Malformed { reason, id }) = Job::from_document(&d) {
                let raw_id = d.get(field::ID).cloned().unwrap_or(Bson::Null);
                let state = d.get(field::STATE).cloned().unwrap_or(Bson::Null);
                tracing::warn!(job = %id, %reason, "malformed job moved to dead");
                if self
                    .bury(doc! { field::ID: raw_id, field::STATE: state }, &reason)
                    .await?
                {
                    buried += 1;
                }
            }
        }
        Ok(buried)
    }

    /// Sweeps expired leases if the last sweep is older than `reap_interval`, then reads
    /// the handle's next slice of waiting jobs that no claim can take if it is due
    /// (`queue/malformed.rs`: one partition's at a time, so its cost does not grow with
    /// the backlog).
    ///
    /// The sweep is housekeeping: if it fails (an `updateMany`, which drivers never
    /// retry, refused or cut off), the failure is logged and the claim goes on; the next
    /// sweep is due after `reap_interval` like after a successful one.
    async fn maybe_reap(&self) {
        if self.inner.options.unsafe_without == Some(Safeguard::Rescue) {
            return;
        }
        let every = self.inner.options.reap_interval;
        {
            let mut last = self
                .inner
                .last_reap
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if last.is_some_and(|t| t.elapsed() < every) {
                return;
            }
            *last = Some(Instant::now());
        }
        let swept = match self.reap_running().await {
            Ok((_, now)) => self.sweep_malformed_slice(&now).await,
            Err(e) => Err(e),
        };
        if let Err(e) = swept {
            tracing::warn!(error = %e, "housekeeping sweep failed; claiming anyway");
        }
    }

    /// Moves every running job whose lease has certainly expired (server time minus the
    /// clock bound and the skew margin) back to `retrying`, due at once — or to `dead`
    /// if it has used all its attempts. Returns how many jobs were moved. Their holders'
    /// later transitions fail with [`Error::LeaseLost`].
    ///
    /// Hand-edited documents that would otherwise stay stuck forever are recovered too:
    /// a running job whose `lease.until` is not a date (null, missing, a string) counts
    /// as expired once it has not been updated (claimed or heartbeated) for a lease TTL
    /// past the same cut-off, and goes to `retrying` (or `dead`) with the reason; a
    /// `ready`/`retrying` job whose `run_at` is not a date can never be due, and one
    /// whose `limits` is neither a document nor null can never be claimed: both go to
    /// `dead` with the reason. Unlike the claims' automatic sweep, which reads one
    /// partition's waiting jobs at a time (`queue/malformed.rs`), this reads every waiting
    /// job of the queue.
    ///
    /// # Errors
    /// A database error.
    pub async fn reap_expired(&self) -> Result<u64> {
        let (moved, now) = self.reap_running().await?;
        Ok(moved + self.bury_unclaimable(None, &now).await?)
    }

    /// The sweep of running jobs: expired leases, and leases that cannot be read. Returns
    /// how many jobs it moved, and the server time it used.
    async fn reap_running(&self) -> Result<(u64, ServerTime)> {
        let now = self.inner.time.now().await?;
        let cutoff = now.expired_before(self.inner.time.skew_margin_ms());
        let expired = self
            .sweep_running(
                doc! {
                    field::STATE: JobState::Running.as_str(),
                    field::LEASE_UNTIL: { "$lt": cutoff },
                    field::QUEUE: self.queue_value(),
                },
                Bson::String(LEASE_EXPIRED_REASON.into()),
                &now,
            )
            .await?;
        if expired > 0 {
            tracing::info!(jobs = expired, "expired leases swept");
        }
        let quiet_since =
            DateTime::from_millis(cutoff.timestamp_millis().saturating_sub(self.inner.ttl_ms));
        let unreadable = self
            .sweep_running(
                // `$and` of the routable part and the `$or`: servers that route a filter
                // by its first indexed field read `docwarden_lease_expiry` (running jobs
                // only) instead of scanning the collection.
                doc! { "$and": [
                    self.unreadable_lease_filter(),
                    { "$or": [
                        { field::UPDATED_AT: { "$lt": quiet_since } },
                        { field::UPDATED_AT: { "$not": { "$type": "date" } } },
                    ] },
                ] },
                Bson::Document(doc! { "$concat": [
                    "malformed job document: `lease.until` must be a date, found ",
                    { "$type": "$lease.until" },
                    "; the lease was treated as expired",
                ] }),
                &now,
            )
            .await?;
        if unreadable > 0 {
            tracing::warn!(
                jobs = unreadable,
                "running jobs without a date in lease.until swept as expired"
            );
        }
        Ok((expired + unreadable, now))
    }

    /// Running jobs whose `lease.until` is not a date.
    pub(crate) fn unreadable_lease_filter(&self) -> Document {
        Self::unreadable_lease_in(Some(self.queue_value()))
    }

    /// [`JobQueue::unreadable_lease_filter`] for the jobs whose `queue` is `queue`, or
    /// for every job of the collection (`None`).
    pub(crate) fn unreadable_lease_in(queue: Option<Bson>) -> Document {
        super::in_queue(
            doc! {
                field::STATE: JobState::Running.as_str(),
                field::LEASE_UNTIL: { "$not": { "$type": "date" } },
            },
            queue,
        )
    }

    /// The sweep's update of the running jobs matching `filter`: `retrying`, due now, or
    /// `dead` (with `finished_at`) at max attempts; `reason` (a string or an expression)
    /// becomes `last_error`.
    async fn sweep_running(&self, filter: Document, reason: Bson, now: &ServerTime) -> Result<u64> {
        let out_of_attempts = doc! { "$gte": ["$attempts", "$max_attempts"] };
        // Stall accounting: every takeover counts one stall; past `max_stalls` (when the
        // job has one) the job is dead with `STALLED_REASON`. A `stalls` that is not a
        // number (missing, or a hand edit) counts as 0: `$add` on a string would fail the
        // whole `updateMany`, and with it the sweep of every other expired lease.
        let stalls = doc! { "$add": [
            { "$cond": [{ "$isNumber": "$stalls" }, "$stalls", 0_i64] },
            1_i64,
        ] };
        let stalled = doc! { "$and": [
            { "$in": [{ "$type": "$max_stalls" }, ["int", "long"]] },
            { "$gt": [stalls.clone(), "$max_stalls"] },
        ] };
        // A job whose `attempts` or `max_attempts` is not an integer (a hand edit that a
        // release or snooze refused as `Malformed`, leaving the job to expire) cannot be
        // counted or claimed again: it goes to `dead` naming the field, rather than
        // under the plain expiry reason (a string `attempts` compares above every number)
        // or back to `retrying` for the next claim to bury. A `max_attempts` below 1 (which
        // every claim refuses to parse) is buried naming it too.
        let not_integer =
            |f: &str| doc! { "$not": [{ "$in": [{ "$type": format!("${f}") }, ["int", "long"]] }] };
        let malformed_reason = |f: &str| {
            Bson::Document(doc! { "$concat": [
                format!("malformed job document: `{f}` must be an integer, found "),
                { "$type": format!("${f}") },
                " (swept: ",
                reason.clone(),
                ")",
            ] })
        };
        let max_below_one = doc! { "$lt": [format!("${}", field::MAX_ATTEMPTS), 1_i64] };
        let max_reason = Bson::Document(doc! { "$concat": [
            format!("malformed job document: `{}` must be at least 1, found ", field::MAX_ATTEMPTS),
            { "$toString": format!("${}", field::MAX_ATTEMPTS) },
            " (swept: ",
            reason.clone(),
            ")",
        ] });
        let malformed = doc! { "$or": [
            not_integer(field::ATTEMPTS),
            not_integer(field::MAX_ATTEMPTS),
            max_below_one.clone(),
        ] };
        let dead = doc! { "$or": [malformed.clone(), out_of_attempts.clone(), stalled.clone()] };
        let r = self
            .inner
            .coll
            .update_many(
                filter,
                vec![doc! { "$set": {
                    field::STATE: { "$cond": [
                        dead.clone(), JobState::Dead.as_str(), JobState::Retrying.as_str()
                    ] },
                    field::LAST_ERROR: { "$switch": {
                        "branches": [
                            { "case": not_integer(field::ATTEMPTS), "then": malformed_reason(field::ATTEMPTS) },
                            { "case": not_integer(field::MAX_ATTEMPTS), "then": malformed_reason(field::MAX_ATTEMPTS) },
                            { "case": max_below_one, "then": max_reason },
                            { "case": { "$and": [stalled, { "$not": [out_of_attempts] }] }, "then": STALLED_REASON },
                        ],
                        "default": reason,
                    } },
                    field::STALLS: stalls,
                    field::FINISHED_AT: { "$cond": [dead, now.estimate(), Bson::Null] },
                    field::RUN_AT: now.estimate(),
                    field::UPDATED_AT: now.estimate(),
                } }],
            )
            .await?;
        Ok(r.modified_count)
    }
}

#[cfg(test)]
mod tests {
    use crate::clock::{ClockOptions, LocalClock, TimeSource};
    use crate::queue::{JobQueue, QueueOptions};

    /// A handle that never talks to a server (the span is client state).
    async fn handle() -> anyhow::Result<JobQueue> {
        let client = mongodb::Client::with_uri_str("mongodb://127.0.0.1:1").await?;
        let time = TimeSource::local_unchecked(LocalClock::system(), ClockOptions::default())?;
        Ok(JobQueue::new(
            client.database("none").collection("jobs"),
            time,
            QueueOptions::default(),
        )?)
    }

    /// Claims of `k` over a backlog of `density` due jobs per partition (fractional:
    /// the average), from `span`: the share of full batches, the mean span read.
    fn run(q: &JobQueue, density: f64, k: usize, claims: usize) -> (f64, f64) {
        let (mut full, mut spans) = (0, 0.0);
        for _ in 0..claims {
            let span = q.next_partitions().0.len();
            #[allow(
                clippy::cast_precision_loss,
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss
            )]
            let found = ((span as f64 * density) as usize).min(k);
            if found == k {
                full += 1;
            }
            #[allow(clippy::cast_precision_loss)]
            {
                spans += span as f64;
            }
            q.adapt_span(found, k);
        }
        #[allow(clippy::cast_precision_loss)]
        (f64::from(full) / claims as f64, spans / claims as f64)
    }

    /// Before: the span doubled on a short claim and halved on a full one, so at 39 jobs
    /// per partition (10,000 over 256) every other claim was short (39 of 64). Now the
    /// span follows the density: nearly every claim is full, and a find reads about one
    /// batch's worth at any backlog.
    #[tokio::test]
    async fn the_span_settles_on_full_batches_at_every_density() -> anyhow::Result<()> {
        for (density, max_span) in [(0.4, 200.0), (1.5, 48.0), (39.0, 2.2), (390.0, 1.0)] {
            let q = handle().await?;
            // Converge (from a span of 1, as a new handle starts), then measure.
            run(&q, density, 64, 200);
            let (full, span) = run(&q, density, 64, 900);
            assert!(
                full >= 0.85,
                "density {density}: only {:.0} % of the claims were full",
                full * 100.0
            );
            assert!(
                span <= max_span,
                "density {density}: the finds read {span:.1} partitions on average"
            );
        }
        // A burst after an empty queue: from the widest span back to a narrow one fast.
        let q = handle().await?;
        run(&q, 0.0, 64, 20);
        assert_eq!(q.next_partitions().0.len(), 256);
        let (_, span) = run(&q, 39.0, 64, 10);
        assert!(span < 80.0, "still reading {span:.0} partitions a claim");
        Ok(())
    }

    /// A read of some partitions names them; a read of every partition (a small backlog)
    /// names none, so the server reads two index ranges, not two per partition.
    #[tokio::test]
    async fn a_read_of_every_partition_names_none() -> anyhow::Result<()> {
        use super::field;
        let q = handle().await?;
        let now = crate::clock::ServerTime {
            estimate_ms: 0,
            bound_ms: 0,
        };
        let arms = |partitions: &[i64]| -> anyhow::Result<Vec<mongodb::bson::Document>> {
            Ok(q.partition_filter(partitions, &now)
                .get_array("$or")?
                .iter()
                .filter_map(|a| a.as_document().cloned())
                .collect())
        };
        let some = arms(&[3, 4])?;
        assert_eq!(some.len(), 2);
        assert!(some.iter().all(|a| a.contains_key(field::PARTITION)));
        let every: Vec<i64> = (0..256).collect();
        let all = arms(&every)?;
        assert_eq!(all.len(), 2);
        assert!(all.iter().all(|a| !a.contains_key(field::PARTITION)
            && a.contains_key(field::STATE)
            && a.contains_key(field::QUEUE)));
        Ok(())
    }
}
