//! Landing deadlines: how long after it was sent a lock write may still apply, and the
//! clean-up of what a write its caller gave up on may have left.
//!
//! **The problem.** An acquire's write can apply without its caller learning so: the reply
//! was lost (a failover between the write and its acknowledgement, a network error), or
//! the caller stopped waiting (a `tokio::time::timeout` around the call, a `select!` that
//! took another branch, a dropped task). The lock is then held by an acquisition nobody was
//! told about, and without a clean-up every other contender waits until its ttl.
//!
//! **Guarantee.** An attempt that carries a landing deadline `land_by` (sent + [`WINDOW`]
//! by the server-time estimate, [`deadline`]) takes the lock only while the server's clock
//! (`$$NOW`, [`before`]) is before `land_by`; a write that reaches the server later leaves
//! the document as it is. An attempt that did not end with an answer (an error, or its
//! future dropped) arms a [`CleanUp`]: once `land_by` has certainly passed by the server
//! clock, one write frees whatever that attempt left — and nothing else, since its filter
//! names the attempt's own nonce. So an unanswered acquisition holds a lock for about
//! [`WINDOW`] plus the clock's bound, not for its ttl.
//!
//! **Retries.** The clean-up's write is idempotent (its filter names the attempt's nonce,
//! so a second run finds nothing of it), and a transient failure ([`Error::is_retryable`]:
//! a stepdown's not-primary answer, a network error) is retried with jittered backoff for
//! up to [`RETRY_FOR`]. Before session 33 one failed write gave up at once, and a lock an
//! unanswered attempt took during a failover stayed held until its ttl (`docwarden verify
//! all --faults all` logged it at stepdowns; `tests/lock_s33_cleanup_retry.rs`).
//!
//! **Releases that failed.** The same background retry finishes a release docwarden sends
//! itself and nobody waits for — a writer withdrawing the intent it gives up on
//! (`lock/rwlock.rs`), a queue giving back a job's permits (`queue/limit.rs`), a rate
//! start (`queue/rate.rs`) or the jobs a claim could not read back (`queue/claim.rs`) —
//! when that release fails with a transient error: [`release_later`],
//! [`release_many_later`]. The acquisition was answered, so there is no landing deadline
//! to wait for; its filter names the lease (its owner and token, its holder entry, its
//! start's id, or a claim's token), so a retry frees that lease and nothing else, and
//! finds nothing if the first try did apply. Before session 35 such a release was
//! dropped, and the lease kept the others out until its ttl
//! (`tests/lock_s35_release_later.rs`).
//!
//! **Limits.** The clean-up runs in a background task of the current tokio runtime and is
//! best effort: if it still fails after [`RETRY_FOR`], fails with an error that is not
//! transient, or no runtime is left (the process is exiting), the acquisition expires with
//! its ttl, as before. An attempt whose write takes longer than [`WINDOW`] to reach the
//! server does not take a free lock (it reports contention, and a blocking acquire tries
//! again).

use std::time::{Duration, Instant};

use mongodb::Collection;
use mongodb::bson::{DateTime, Document, doc};
use mongodb::options::UpdateModifications;

use crate::backoff::Backoff;
use crate::clock::{ServerTime, TimeSource};
use crate::error::{Error, Result};

/// How long after it was sent (by the server's clock) a lock attempt's write may still
/// apply.
pub(crate) const WINDOW: Duration = Duration::from_secs(2);

/// How long a clean-up keeps retrying a transient failure before it leaves the acquisition
/// to expire with its ttl: a MongoDB election (10 s by default) and the driver's server
/// selection after it fit well inside.
pub(crate) const RETRY_FOR: Duration = Duration::from_secs(60);

/// The first and the largest delay between a clean-up's tries (full jitter, at least
/// [`RETRY_FLOOR`]).
const RETRY_BASE: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(2);
const RETRY_FLOOR: Duration = Duration::from_millis(10);

/// The landing deadline of an attempt sent at server time `now`: `now` + [`WINDOW`].
pub(crate) fn deadline(now: &ServerTime) -> DateTime {
    now.plus_ms(i64::try_from(WINDOW.as_millis()).unwrap_or(i64::MAX))
}

/// `{$lt: ["$$NOW", land_by]}`: the server's clock is still before the landing deadline
/// when the write runs (one value for the whole statement on MongoDB and the embedded
/// server alike).
pub(crate) fn before(land_by: DateTime) -> Document {
    doc! { "$lt": ["$$NOW", { "$literal": land_by }] }
}

/// Waits until `land_by` has certainly passed by the server's clock (the estimate's
/// earliest reading is after it).
///
/// # Errors
/// The time source's error.
pub(crate) async fn passed(time: &TimeSource, land_by: DateTime) -> Result<()> {
    loop {
        let now = time.now().await?;
        let left = land_by
            .timestamp_millis()
            .saturating_sub(now.earliest().timestamp_millis());
        if left < 0 {
            return Ok(());
        }
        let ms = u64::try_from(left).unwrap_or(0).saturating_add(1);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// Finishes a release that failed with `error`: when the error is transient
/// ([`Error::is_retryable`]), `update` on the document `filter` matches is retried in the
/// background, with jittered backoff for up to [`RETRY_FOR`] (as a [`CleanUp`], without a
/// landing deadline to wait for); any other error is only logged. `filter` must name the
/// one lease the release frees (owner and token, or a holder entry), so that a retry
/// after a first try that did apply finds nothing. `what` names the release in logs.
pub(crate) fn release_later(
    coll: &Collection<Document>,
    time: &TimeSource,
    filter: Document,
    update: Document,
    error: &Error,
    what: &'static str,
) {
    retry_later(coll, time, filter, update.into(), false, error, what);
}

/// [`release_later`] for a release of every document `filter` matches (an `updateMany`,
/// operators or a pipeline): `filter` must name what the release frees (a claim's lease
/// token and the state it left the documents in), so that a retry finds nothing of what
/// a first try did free.
pub(crate) fn release_many_later(
    coll: &Collection<Document>,
    time: &TimeSource,
    filter: Document,
    update: UpdateModifications,
    error: &Error,
    what: &'static str,
) {
    retry_later(coll, time, filter, update, true, error, what);
}

fn retry_later(
    coll: &Collection<Document>,
    time: &TimeSource,
    filter: Document,
    update: UpdateModifications,
    many: bool,
    error: &Error,
    what: &'static str,
) {
    if !error.is_retryable() {
        tracing::debug!(%error, what, "release failed; the lease expires with its ttl");
        return;
    }
    tracing::debug!(%error, what, "release failed; retrying in the background");
    drop(CleanUp {
        armed: Some(Armed {
            coll: coll.clone(),
            time: time.clone(),
            filter,
            update,
            many,
            land_by: None,
            what,
        }),
    });
}

/// The clean-up of one attempt: `update` on the document `filter` matches, run in the
/// background once the attempt's landing deadline has passed, unless the attempt was
/// [`settled`](CleanUp::settled) (it ended with an answer). Armed from before the write is
/// sent, so an attempt whose future is dropped mid-flight is cleaned up too.
#[derive(Debug)]
pub(crate) struct CleanUp {
    armed: Option<Armed>,
}

#[derive(Debug)]
struct Armed {
    coll: Collection<Document>,
    time: TimeSource,
    filter: Document,
    update: UpdateModifications,
    /// An `updateMany` (a [`release_many_later`]), else an `updateOne`.
    many: bool,
    /// `None`: nothing to wait for (a [`release_later`]).
    land_by: Option<DateTime>,
    what: &'static str,
}

impl CleanUp {
    /// A clean-up of `filter` by `update` in `coll` after `land_by`; `what` names the
    /// attempt in logs.
    pub(crate) fn new(
        coll: &Collection<Document>,
        time: &TimeSource,
        filter: Document,
        update: Document,
        land_by: DateTime,
        what: &'static str,
    ) -> Self {
        Self {
            armed: Some(Armed {
                coll: coll.clone(),
                time: time.clone(),
                filter,
                update: update.into(),
                many: false,
                land_by: Some(land_by),
                what,
            }),
        }
    }

    /// The attempt ended with an answer its caller received: nothing to clean up.
    pub(crate) fn settled(mut self) {
        self.armed = None;
    }
}

impl Drop for CleanUp {
    fn drop(&mut self) {
        let Some(armed) = self.armed.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                what = armed.what,
                "no runtime left to clean up an unanswered attempt; it expires with its ttl"
            );
            return;
        };
        runtime.spawn(armed.run());
    }
}

impl Armed {
    /// Waits for the landing deadline, then frees what the attempt left, retrying a
    /// transient failure for up to [`RETRY_FOR`].
    async fn run(self) {
        let give_up = Instant::now() + RETRY_FOR;
        let mut backoff = Backoff::new(RETRY_BASE, RETRY_MAX)
            .ok()
            .map(|b| b.with_floor(RETRY_FLOOR));
        loop {
            let e = match self.once().await {
                Ok(()) => return,
                Err(e) => e,
            };
            match backoff.as_mut() {
                Some(b) if e.is_retryable() && Instant::now() < give_up => {
                    let delay = b.next_delay();
                    tracing::debug!(error = %e, what = self.what, tries = b.attempts(), ?delay, "clean-up failed; trying again");
                    tokio::time::sleep(delay).await;
                }
                _ if self.land_by.is_none() => {
                    tracing::warn!(error = %e, what = self.what, "cannot finish a failed release; the lease expires with its ttl");
                    return;
                }
                _ => {
                    tracing::warn!(error = %e, what = self.what, "cannot clean up an unanswered attempt; it expires with its ttl");
                    return;
                }
            }
        }
    }

    /// One try: the landing deadline (if any) has passed by the server's clock, then the
    /// write.
    async fn once(&self) -> Result<()> {
        if let Some(land_by) = self.land_by {
            passed(&self.time, land_by).await?;
        }
        let (filter, update) = (self.filter.clone(), self.update.clone());
        let r = if self.many {
            self.coll.update_many(filter, update).await
        } else {
            self.coll.update_one(filter, update).await
        }
        .map_err(Error::from)?;
        if r.modified_count > 0 && self.land_by.is_some() {
            tracing::info!(
                what = self.what,
                "freed what an unanswered attempt had taken"
            );
        } else if r.modified_count > 0 {
            tracing::info!(what = self.what, "finished a failed release");
        }
        Ok(())
    }
}
