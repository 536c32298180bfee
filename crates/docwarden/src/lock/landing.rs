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
//! **Limits.** The clean-up runs in a background task of the current tokio runtime and is
//! best effort: if it fails (the server unreachable at that moment) or no runtime is left
//! (the process is exiting), the acquisition expires with its ttl, as before. An attempt
//! whose write takes longer than [`WINDOW`] to reach the server does not take a free lock
//! (it reports contention, and a blocking acquire tries again).

use std::time::Duration;

use mongodb::Collection;
use mongodb::bson::{DateTime, Document, doc};

use crate::clock::{ServerTime, TimeSource};

/// How long after it was sent (by the server's clock) a lock attempt's write may still
/// apply.
pub(crate) const WINDOW: Duration = Duration::from_secs(2);

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
pub(crate) async fn passed(time: &TimeSource, land_by: DateTime) -> crate::Result<()> {
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
    update: Document,
    land_by: DateTime,
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
                update,
                land_by,
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
    async fn run(self) {
        if let Err(e) = passed(&self.time, self.land_by).await {
            tracing::warn!(error = %e, what = self.what, "cannot read the server time to clean up an unanswered attempt; it expires with its ttl");
            return;
        }
        match self.coll.update_one(self.filter, self.update).await {
            Ok(r) if r.modified_count > 0 => {
                tracing::info!(
                    what = self.what,
                    "freed what an unanswered attempt had taken"
                );
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, what = self.what, "cannot clean up an unanswered attempt; it expires with its ttl");
            }
        }
    }
}
