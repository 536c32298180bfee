//! Fenced transitions of a claimed job: heartbeat, complete, fail, release, cancel.
//!
//! Every one is a single `updateOne` whose filter is the claim's fence
//! `{_id, state: "running", "lease.token": token}`. If it matches nothing, the lease was
//! lost (expired and swept or re-claimed, or cancelled by an operator) and the call
//! returns [`Error::LeaseLost`](crate::Error::LeaseLost) having written nothing.

use std::time::Duration;

use mongodb::bson::{Bson, DateTime, Document, doc};

use super::job::{ClaimedJob, JobState, field};
use super::{JobQueue, lease_lost};
use crate::backoff::Backoff;
use crate::error::Result;

/// Longest `last_error` stored, in bytes.
const MAX_ERROR_LEN: usize = 4096;

/// What [`JobQueue::fail`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailOutcome {
    /// The job will be tried again at `run_at` (server time).
    Retrying {
        /// When it becomes due again.
        run_at: DateTime,
        /// The delay chosen.
        delay: Duration,
    },
    /// The job used all its attempts and is dead; `last_error` is kept.
    Dead,
}

/// `error` cut to [`MAX_ERROR_LEN`] bytes (at a character boundary), as stored.
pub(super) fn clip(error: &str) -> String {
    if error.len() <= MAX_ERROR_LEN {
        error.to_owned()
    } else {
        format!("{}…", &error[..error.floor_char_boundary(MAX_ERROR_LEN)])
    }
}

impl JobQueue {
    async fn fenced(&self, job: &ClaimedJob, update: Document) -> Result<()> {
        let r = self
            .inner
            .coll
            .update_one(
                super::job::fence_filter(&Bson::ObjectId(job.id()), job.lease.token.as_str()),
                update,
            )
            .await?;
        if r.matched_count == 1 {
            Ok(())
        } else {
            Err(lease_lost(&Bson::ObjectId(job.job.id), &job.lease.token))
        }
    }

    /// Extends the lease to `lease_ttl` from now (server time) and returns the new
    /// expiry.
    ///
    /// # Errors
    /// [`Error::LeaseLost`](crate::Error::LeaseLost) if the claim no longer holds the
    /// job; a database error.
    pub async fn heartbeat(&self, job: &ClaimedJob) -> Result<DateTime> {
        let now = self.inner.time.now().await?;
        let until = now.plus_ms(self.inner.ttl_ms);
        self.fenced(
            job,
            doc! { "$set": { field::LEASE_UNTIL: until, field::UPDATED_AT: now.estimate() } },
        )
        .await?;
        Ok(until)
    }

    /// Marks the job succeeded and stores `result`.
    ///
    /// # Errors
    /// [`Error::LeaseLost`](crate::Error::LeaseLost) if the claim no longer holds the
    /// job (nothing written); a database error.
    #[tracing::instrument(skip(self, job, result), fields(job = %job.job.id), level = "debug")]
    pub async fn complete(&self, job: &ClaimedJob, result: impl Into<Bson>) -> Result<()> {
        let now = self.inner.time.now().await?.estimate();
        self.fenced(
            job,
            doc! { "$set": {
                field::STATE: JobState::Succeeded.as_str(),
                field::RESULT: result.into(),
                field::FINISHED_AT: now,
                field::UPDATED_AT: now,
            } },
        )
        .await
    }

    /// The retry delay after the `attempt`-th attempt failed (1-based): exponential from
    /// `retry_base` up to `retry_max`, with "equal jitter" (uniform in the upper half of
    /// the cap), so delays grow with every attempt yet retries of many jobs spread out.
    pub fn retry_delay(&self, attempt: i64) -> Duration {
        let o = &self.inner.options;
        let cap = Backoff::new(o.retry_base, o.retry_max)
            .map(|b| b.cap(u32::try_from(attempt.saturating_sub(1).max(0)).unwrap_or(u32::MAX)))
            .unwrap_or(o.retry_max);
        let half = cap / 2;
        half + half.mul_f64(rand::random::<f64>())
    }

    /// Records a failure: the job goes to `retrying` with a backoff delay, or to `dead`
    /// once it has used `max_attempts`; `error` is kept as `last_error` either way.
    ///
    /// # Errors
    /// [`Error::LeaseLost`](crate::Error::LeaseLost) if the claim no longer holds the
    /// job (nothing written); a database error.
    #[tracing::instrument(skip(self, job), fields(job = %job.job.id), level = "debug")]
    pub async fn fail(&self, job: &ClaimedJob, error: &str) -> Result<FailOutcome> {
        let now = self.inner.time.now().await?;
        let error = clip(error);
        if job.job.attempts >= job.job.max_attempts {
            self.fenced(
                job,
                doc! { "$set": {
                    field::STATE: JobState::Dead.as_str(),
                    field::LAST_ERROR: error,
                    field::FINISHED_AT: now.estimate(),
                    field::UPDATED_AT: now.estimate(),
                } },
            )
            .await?;
            return Ok(FailOutcome::Dead);
        }
        let delay = self.retry_delay(job.job.attempts);
        let run_at = now.plus_ms(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
        self.fenced(
            job,
            doc! { "$set": {
                field::STATE: JobState::Retrying.as_str(),
                field::LAST_ERROR: error,
                field::RUN_AT: run_at,
                field::UPDATED_AT: now.estimate(),
            } },
        )
        .await?;
        Ok(FailOutcome::Retrying { run_at, delay })
    }

    /// Gives the job back without counting the attempt: it is claimable again at once
    /// (graceful shutdown uses this).
    ///
    /// # Errors
    /// [`Error::LeaseLost`](crate::Error::LeaseLost) if the claim no longer holds the
    /// job; a database error.
    pub async fn release(&self, job: &ClaimedJob) -> Result<()> {
        let now = self.inner.time.now().await?.estimate();
        let state = if job.job.attempts <= 1 {
            JobState::Ready
        } else {
            JobState::Retrying
        };
        self.fenced(
            job,
            doc! {
                "$set": { field::STATE: state.as_str(), field::UPDATED_AT: now },
                "$inc": { field::ATTEMPTS: -1_i64 },
            },
        )
        .await
    }

    /// Cancels the job this claim holds, keeping `reason` as `last_error`.
    ///
    /// # Errors
    /// [`Error::LeaseLost`](crate::Error::LeaseLost) if the claim no longer holds the
    /// job; a database error.
    pub async fn cancel_claimed(&self, job: &ClaimedJob, reason: &str) -> Result<()> {
        let now = self.inner.time.now().await?.estimate();
        self.fenced(
            job,
            doc! { "$set": {
                field::STATE: JobState::Cancelled.as_str(),
                field::LAST_ERROR: clip(reason),
                field::FINISHED_AT: now,
                field::UPDATED_AT: now,
            } },
        )
        .await
    }
}
