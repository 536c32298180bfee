//! Seed 002, jobs (`docwarden::queue`): producers enqueue numbered jobs `{ n }` while
//! workers claim them under leases and commit their effect.
//!
//! Two shapes of the effect:
//! - the **runtime** shape, run by [`docwarden::queue::Worker`] (`verify queue`): the
//!   handler appends an effect record `{token, attempt}` of its claim to the job document
//!   ([`effect`]), fenced by the claim in [`Mode::Safe`] and by `_id` alone in
//!   [`Mode::Control`] (a paused holder then writes under a lost lease); the worker
//!   completes the job with the claim's token as its result. Some jobs are poison
//!   ([`Producer::enqueue_mixed`]): their handler fails without an effect until they are
//!   dead. The final read is [`observe`], judged by [`check`]
//!   ([`docwarden::check::queue::check_runtime`]);
//! - the **completion** shape (`bench`): the effect of a job is its completion, fenced by
//!   the claim ([`complete`]). [`fenced_effect`] is the tests' counting handler.
use std::collections::BTreeMap;
use std::time::Duration;

use docwarden::check::queue::{
    EFFECT_OP, ENQUEUE_OP, EffectRecord, HANDLE_OP, JobRecord, REPORT_OP,
};
use docwarden::check::{Event, Violation};
use docwarden::lock::{Fence, FenceOptions, FenceOutcome};
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
    /// A handler started on a claimed job.
    Handle,
    /// A handler's effect write.
    Effect,
    /// A worker's counts at its graceful shutdown.
    Report,
}

impl Op {
    /// The name in histories and reports.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Op::Enqueue => ENQUEUE_OP,
            Op::Handle => HANDLE_OP,
            Op::Effect => EFFECT_OP,
            Op::Report => REPORT_OP,
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

/// Attempts of a regular job in the runtime run: enough that no job dies of lost leases.
pub const RUNTIME_ATTEMPTS: u32 = 50;
/// Attempts of a poison job: it fails every one and is dead after these.
pub const POISON_ATTEMPTS: u32 = 2;

/// The queue options of the runtime run: [`short_lease_options`] with
/// [`RUNTIME_ATTEMPTS`] and retries after 20–200 ms (so poison jobs die within the run).
#[must_use]
pub fn runtime_options() -> QueueOptions {
    short_lease_options()
        .max_attempts(RUNTIME_ATTEMPTS)
        .retry_delays(Duration::from_millis(20), Duration::from_millis(200))
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

    /// Enqueues `count` jobs `{ n, poison }` where every `poison_every`-th `n` is poison
    /// (its handler fails on purpose; [`POISON_ATTEMPTS`] attempts).
    ///
    /// # Errors
    /// The enqueue's error (`n` then does not advance).
    pub async fn enqueue_mixed(
        &mut self,
        queue: &JobQueue,
        count: usize,
        poison_every: i64,
    ) -> docwarden::Result<()> {
        let first = self.next;
        let last = first + i64::try_from(count).unwrap_or(i64::MAX);
        queue
            .enqueue_many((first + 1..=last).map(|n| {
                let poison = poison_every > 0 && n % poison_every == 0;
                let options = if poison {
                    EnqueueOptions::default().max_attempts(POISON_ATTEMPTS)
                } else {
                    EnqueueOptions::default()
                };
                (doc! { "n": n, "poison": poison }, options)
            }))
            .await?;
        self.next = last;
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

/// Whether `job` is poison ([`Producer::enqueue_mixed`]): its handler must fail.
#[must_use]
pub fn is_poison(job: &ClaimedJob) -> bool {
    matches!(job.payload(), Bson::Document(d) if d.get_bool("poison").unwrap_or(false))
}

/// The runtime handler's effect: appends `{token, attempt}` of `job`'s claim to the job
/// document's `effects`. Safe: fenced by the claim (applies only while the job runs under
/// this claim; [`FenceOutcome::Lost`] otherwise). Control: by `_id` alone, whoever holds
/// the job now.
///
/// # Errors
/// A database error (the outcome is then unknown if it is retryable).
pub async fn effect(
    coll: &Collection<Document>,
    job: &ClaimedJob,
    mode: Mode,
) -> docwarden::Result<FenceOutcome> {
    let record = doc! {
        "$push": { "effects": { EFFECT_CLAIM: job.lease.token.as_str(), EFFECT_ATTEMPT: job.job.attempts } },
    };
    match mode {
        Mode::Safe => {
            Fence::new(coll.clone(), FenceOptions::default())?
                .apply(job, doc! { "_id": job.id() }, record)
                .await
        }
        Mode::Control => {
            let r = coll.update_one(doc! { "_id": job.id() }, record).await?;
            Ok(if r.matched_count == 1 {
                FenceOutcome::Applied
            } else {
                FenceOutcome::NotFound
            })
        }
    }
}

/// What the runtime handler returns once its effect applied: the claim's token and
/// attempt, stored with the completion (the checker reads who completed the job).
#[must_use]
pub fn completion_result(job: &ClaimedJob) -> Bson {
    Bson::Document(
        doc! { EFFECT_CLAIM: job.lease.token.as_str(), EFFECT_ATTEMPT: job.job.attempts },
    )
}

/// A history event naming the claim of `job` by `process`: op `handle`, the claim's
/// token in `detail`, its attempt in `token`.
#[must_use]
pub fn handle_event(process: u32, job: &ClaimedJob, at_us: u64) -> Event {
    Event::new(
        process,
        Op::Handle.as_str(),
        &job.id().to_hex(),
        at_us,
        at_us,
    )
    .token(job.job.attempts)
    .detail(job.lease.token.as_str())
}

/// The workload's own effect record (`effects: [{claim, attempt}]` on the job document,
/// and the handler's result): the claim's lease token and the attempt that applied it.
/// Not docwarden's format: named apart from the job's `lease.token`.
const EFFECT_CLAIM: &str = "claim";
/// See [`EFFECT_CLAIM`].
const EFFECT_ATTEMPT: &str = "attempt";

/// The final read of the runtime run: every job's state, its effect records in the
/// order they were applied, and the claim that completed it.
///
/// # Errors
/// A database error.
pub async fn observe(queue: &JobQueue) -> anyhow::Result<BTreeMap<String, JobRecord>> {
    let mut jobs = BTreeMap::new();
    let mut cursor = queue.collection().find(doc! {}).await?;
    while let Some(d) = cursor.try_next().await? {
        let id = d
            .get_object_id("_id")
            .map(|o| o.to_hex())
            .unwrap_or_default();
        let effects = d
            .get_array("effects")
            .map(|a| {
                a.iter()
                    .filter_map(Bson::as_document)
                    .map(|e| EffectRecord {
                        token: e.get_str(EFFECT_CLAIM).unwrap_or_default().to_owned(),
                        attempt: e.get_i64(EFFECT_ATTEMPT).unwrap_or_default(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        let completed_by = d
            .get_document(field::RESULT)
            .ok()
            .and_then(|r| r.get_str(EFFECT_CLAIM).ok())
            .map(str::to_owned);
        jobs.insert(
            id,
            JobRecord {
                state: d.get_str(field::STATE).ok().map(str::to_owned),
                effects,
                completed_by,
            },
        );
    }
    Ok(jobs)
}

/// The checker of the runtime run: every job finished once, its effects in claim order
/// and never written under a lost lease, dead jobs without effect, no phantom completion.
#[must_use]
pub fn check(jobs: &BTreeMap<String, JobRecord>, events: &[Event]) -> Vec<Violation> {
    docwarden::check::queue::check_runtime(jobs, events)
}
