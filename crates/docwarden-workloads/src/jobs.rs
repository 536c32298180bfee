//! Seed 002, jobs (`docwarden::queue`): producers enqueue numbered jobs `{ n }` while
//! workers claim them under leases and commit their effect.
//!
//! The effect of a job is its completion fenced by the claim ([`Mode::Safe`]); the control
//! completes by `_id` alone ([`Mode::Control`]), which double-commits a job whose lease was
//! taken over. A handler's side effect for [`docwarden::queue::Worker`] is
//! [`fenced_effect`]. The final read is [`observe`]; [`check`] is
//! [`docwarden::check::queue::check_jobs`].

use std::collections::BTreeMap;
use std::time::Duration;

use docwarden::check::Violation;
use docwarden::check::queue::{JobObservation, check_jobs};
use docwarden::lock::{Fence, FenceOptions};
use docwarden::queue::format::field;
use docwarden::queue::{
    ClaimedJob, EnqueueOptions, HandlerResult, JobQueue, JobState, QueueOptions,
};
use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};

use crate::Mode;

/// The lease of the fault-injection run: short, so that paused holders lose their jobs.
pub const LEASE: Duration = Duration::from_secs(2);

/// The operations of the workload, as the history names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A batch of jobs enqueued.
    Enqueue,
    /// A job claimed (or a failed claim).
    Claim,
    /// A job's effect committed: its completion.
    Complete,
}

impl Op {
    /// The name in histories and reports.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Op::Enqueue => "enqueue",
            Op::Claim => "claim",
            Op::Complete => "complete",
        }
    }
}

/// The queue options of the fault-injection run: [`LEASE`], reaped every 500 ms.
#[must_use]
pub fn short_lease_options() -> QueueOptions {
    QueueOptions::default()
        .lease_ttl(LEASE)
        .reap_interval(Duration::from_millis(500))
}

/// The producer: enqueues jobs `{ n }` with increasing `n`, in chunks of at most 1,000.
#[derive(Clone, Debug, Default)]
pub struct Producer {
    next: i64,
}

impl Producer {
    /// A producer starting at `n = 1`.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Enqueues `count` jobs. `n` advances only over chunks that were enqueued.
    ///
    /// # Errors
    /// The first chunk's error.
    pub async fn enqueue(&mut self, queue: &JobQueue, count: usize) -> docwarden::Result<()> {
        let mut left = count;
        while left > 0 {
            let chunk = left.min(1000);
            let first = self.next;
            queue
                .enqueue_many((0..chunk).map(|i| {
                    let n = first + 1 + i64::try_from(i).unwrap_or(i64::MAX);
                    (doc! { "n": n }, EnqueueOptions::default())
                }))
                .await?;
            self.next = first + i64::try_from(chunk).unwrap_or(i64::MAX);
            left -= chunk;
        }
        Ok(())
    }

    /// Tops the due backlog up to about `keep` jobs; returns how many it enqueued.
    ///
    /// # Errors
    /// A database error.
    pub async fn top_up(&mut self, queue: &JobQueue, keep: usize) -> docwarden::Result<usize> {
        let waiting = usize::try_from(backlog(queue).await?).unwrap_or(keep);
        let missing = keep.saturating_sub(waiting);
        self.enqueue(queue, missing).await?;
        Ok(missing)
    }
}

fn states(states: &[JobState]) -> Document {
    doc! { field::STATE: { "$in": states.iter().map(|s| s.as_str()).collect::<Vec<_>>() } }
}

/// Jobs due to be claimed (ready or retrying).
///
/// # Errors
/// A database error.
pub async fn backlog(queue: &JobQueue) -> docwarden::Result<u64> {
    Ok(queue
        .collection()
        .count_documents(states(&[JobState::Ready, JobState::Retrying]))
        .await?)
}

/// Jobs not finished yet (ready, running or retrying).
///
/// # Errors
/// A database error.
pub async fn unfinished(queue: &JobQueue) -> docwarden::Result<u64> {
    Ok(queue
        .collection()
        .count_documents(states(&[
            JobState::Ready,
            JobState::Running,
            JobState::Retrying,
        ]))
        .await?)
}

/// The effect of a claimed job, committed with `result`. Safe: the queue's completion,
/// fenced by the claim's lease (`Ok(false)` if the lease was lost). Control: the job set
/// `succeeded` by `_id` alone, whoever holds it now.
///
/// # Errors
/// A database error.
pub async fn complete(
    queue: &JobQueue,
    job: &ClaimedJob,
    result: impl Into<Bson>,
    mode: Mode,
) -> docwarden::Result<bool> {
    let result = result.into();
    match mode {
        Mode::Safe => match queue.complete(job, result).await {
            Ok(()) => Ok(true),
            Err(docwarden::Error::LeaseLost { .. }) => Ok(false),
            Err(e) => Err(e),
        },
        Mode::Control => {
            let r = queue
                .collection()
                .update_one(
                    doc! { "_id": job.id() },
                    doc! {
                        "$set": { field::STATE: JobState::Succeeded.as_str(), field::RESULT: result },
                        "$unset": { field::LEASE: "" },
                    },
                )
                .await?;
            Ok(r.matched_count == 1)
        }
    }
}

/// A worker handler's side effect, fenced by the claim: `$inc effects` on the job document
/// applies only while this claim holds the job.
///
/// # Errors
/// The handler fails if the effect was fenced off (lease lost) or on a database error.
pub async fn fenced_effect(coll: Collection<Document>, job: ClaimedJob) -> HandlerResult {
    let outcome = Fence::new(coll, FenceOptions::default())?
        .apply(
            &job,
            doc! { "_id": job.id() },
            doc! { "$inc": { "effects": 1 } },
        )
        .await?;
    if outcome.is_applied() {
        Ok(Bson::Int64(job.job.attempts))
    } else {
        Err("the effect was fenced off: lease lost".into())
    }
}

/// The final read: every job's stored state, with `effects` committed effects counted by
/// the caller (job id in hex → completions that applied).
///
/// # Errors
/// A database error.
pub async fn observe(
    queue: &JobQueue,
    effects: &BTreeMap<String, u64>,
) -> anyhow::Result<BTreeMap<String, JobObservation>> {
    let mut jobs: BTreeMap<String, JobObservation> = BTreeMap::new();
    let mut cursor = queue.collection().find(doc! {}).await?;
    while let Some(d) = cursor.try_next().await? {
        let id = d
            .get_object_id("_id")
            .map(|o| o.to_hex())
            .unwrap_or_default();
        jobs.insert(
            id,
            JobObservation {
                effects: 0,
                state: d.get_str(field::STATE).ok().map(str::to_owned),
            },
        );
    }
    for (id, n) in effects {
        jobs.entry(id.clone()).or_default().effects += n;
    }
    Ok(jobs)
}

/// The checker: every job's effect exactly once, none lost, none stuck.
#[must_use]
pub fn check(jobs: &BTreeMap<String, JobObservation>) -> Vec<Violation> {
    check_jobs(jobs)
}
