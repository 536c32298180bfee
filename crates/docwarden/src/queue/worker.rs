//! The worker runtime: `N` concurrent handlers, heartbeats, wake-ups, graceful shutdown.
//!
//! **Guarantee:** while a handler runs, its lease is extended every `heartbeat_every`;
//! if a heartbeat finds the lease lost, the handler is dropped and nothing is written
//! for it. Idle workers wake on a change-stream event for new or released jobs, and
//! otherwise poll with a jittered backoff between `poll_min` and `poll_max`. Database
//! errors (a restarting server) make the worker back off and resume; they never end it.
//! Shutdown stops claiming, waits for running handlers up to `shutdown_deadline`, then
//! releases the jobs still running so other workers can claim them at once.
//!
//! Shutdown, [`Worker::kill`] and dropping the handle all stop every task of the
//! worker (supervisor, handlers, change-stream listener). A transition whose reply was
//! lost counts as applied only if the job shows that transition's own result.
//!
//! **Limits:** a worker that is killed (its task aborted, its process gone) releases
//! nothing; its jobs are re-claimable after the lease expires.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use mongodb::bson::{Bson, doc};
use mongodb::error::ErrorKind;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::JobQueue;
use super::claim::LEASE_EXPIRED_REASON;
use super::job::{ClaimedJob, JobState, field};
use super::ops::CANCELLED_REASON;
use super::options::WorkerOptions;
use super::transition::{FailOutcome, clip};
use crate::backoff::Backoff;
use crate::error::{Error, Result};

/// What a handler returns: a result to store with the job, or an error that fails
/// the attempt (its text becomes `last_error`).
pub type HandlerResult = std::result::Result<Bson, Box<dyn std::error::Error + Send + Sync>>;

/// Counts of what a worker did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct WorkerReport {
    /// Jobs claimed.
    pub claimed: u64,
    /// Jobs completed (fenced completion applied).
    pub succeeded: u64,
    /// Attempts that failed and were scheduled for a retry.
    pub retried: u64,
    /// Jobs that failed their last attempt.
    pub dead: u64,
    /// Jobs whose lease was lost before their transition could be written.
    pub lease_lost: u64,
    /// Jobs released at shutdown.
    pub released: u64,
    /// Claims that failed with a database error (the worker backed off).
    pub claim_errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    claimed: AtomicU64,
    succeeded: AtomicU64,
    retried: AtomicU64,
    dead: AtomicU64,
    lease_lost: AtomicU64,
    released: AtomicU64,
    claim_errors: AtomicU64,
}

impl Counters {
    fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
    fn report(&self) -> WorkerReport {
        WorkerReport {
            claimed: self.claimed.load(Ordering::Relaxed),
            succeeded: self.succeeded.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead: self.dead.load(Ordering::Relaxed),
            lease_lost: self.lease_lost.load(Ordering::Relaxed),
            released: self.released.load(Ordering::Relaxed),
            claim_errors: self.claim_errors.load(Ordering::Relaxed),
        }
    }
}

type BoxHandler = Arc<
    dyn Fn(ClaimedJob) -> std::pin::Pin<Box<dyn Future<Output = HandlerResult> + Send>>
        + Send
        + Sync,
>;

struct Ctx {
    queue: JobQueue,
    options: WorkerOptions,
    owner: String,
    heartbeat_every: Duration,
    handler: BoxHandler,
    counters: Arc<Counters>,
    /// Held by the change-stream listener task while it lives (see
    /// [`Worker::listener_probe`]).
    listener_alive: Arc<()>,
}

/// A running worker, started by [`Worker::spawn`]. Dropping it aborts the worker like
/// [`Worker::kill`]: the supervisor, every running handler and the change-stream listener
/// stop.
#[derive(Debug)]
pub struct Worker {
    owner: String,
    shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
    counters: Arc<Counters>,
    listener_probe: std::sync::Weak<()>,
}

impl Worker {
    /// Starts a worker on the current tokio runtime that runs `handler` for every job it
    /// claims from `queue`, up to `options.concurrency` at once, and returns the running
    /// worker. A worker is not a handle on a collection, so it has no `new`/`open` pair:
    /// `spawn` validates the options (before anything runs) and starts it; the returned
    /// [`Worker`] stops it ([`Worker::shutdown`], [`Worker::kill`], or drop).
    ///
    /// ```no_run
    /// # async fn example(queue: docwarden::queue::JobQueue) -> docwarden::Result<()> {
    /// use docwarden::queue::{Worker, WorkerOptions};
    /// let worker = Worker::spawn(queue, WorkerOptions::default(), |job| async move {
    ///     println!("payload {}", job.payload());
    ///     Ok(mongodb::bson::Bson::Null)
    /// })?;
    /// let report = worker.shutdown().await;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for invalid options.
    pub fn spawn<F, Fut>(queue: JobQueue, options: WorkerOptions, handler: F) -> Result<Worker>
    where
        F: Fn(ClaimedJob) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = HandlerResult> + Send + 'static,
    {
        let ttl = queue.options().lease_ttl;
        options.validate(ttl)?;
        let heartbeat_every = options
            .heartbeat_every
            .unwrap_or(ttl / 3)
            .max(Duration::from_millis(1));
        let owner = format!("{}-{:08x}", options.name, rand::random::<u32>());
        let counters = Arc::new(Counters::default());
        let listener_alive = Arc::new(());
        let listener_probe = Arc::downgrade(&listener_alive);
        let handler: BoxHandler = Arc::new(move |job| Box::pin(handler(job)));
        let ctx = Arc::new(Ctx {
            queue,
            options,
            owner: owner.clone(),
            heartbeat_every,
            handler,
            counters: Arc::clone(&counters),
            listener_alive,
        });
        let shutdown = CancellationToken::new();
        let span = tracing::info_span!("worker", owner = %owner);
        let task = tokio::spawn(supervise(ctx, shutdown.clone()).instrument(span));
        Ok(Worker {
            owner,
            shutdown,
            task: Some(task),
            counters,
            listener_probe,
        })
    }
}

impl Worker {
    /// The owner name written into this worker's leases.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// What the worker has done so far.
    pub fn report(&self) -> WorkerReport {
        self.counters.report()
    }

    /// A weak handle that stays upgradable while the worker's background tasks (the
    /// supervisor, which owns the handlers, and the change-stream listener) are alive:
    /// tests use it to see that shutdown, kill and drop end all of them.
    #[doc(hidden)]
    pub fn listener_probe(&self) -> std::sync::Weak<()> {
        self.listener_probe.clone()
    }

    /// Graceful shutdown: stop claiming, wait for running handlers up to the deadline,
    /// release the jobs still running, and return the final counts.
    pub async fn shutdown(mut self) -> WorkerReport {
        self.shutdown.cancel();
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
        {
            tracing::warn!(error = %e, "worker task ended abnormally");
        }
        self.counters.report()
    }

    /// Kills the worker as a crash would: every task (supervisor, handlers, change-stream
    /// listener) is stopped at once, nothing is released. Its jobs become claimable when
    /// their leases expire.
    pub async fn kill(mut self) -> WorkerReport {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
        // After the abort, so the supervisor never sees it as a graceful shutdown.
        self.shutdown.cancel();
        self.counters.report()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            // Aborting the supervisor drops its `JoinSet`s, which abort the handlers and
            // the listener; cancelling the token also stops a listener between polls.
            task.abort();
            self.shutdown.cancel();
        }
    }
}

async fn supervise(ctx: Arc<Ctx>, shutdown: CancellationToken) {
    let notify = Arc::new(Notify::new());
    let stop_listening = shutdown.child_token();
    // Background tasks live in a `JoinSet` owned by this future: when the supervisor is
    // aborted (kill, drop), the set is dropped and aborts them too.
    let mut background: JoinSet<()> = JoinSet::new();
    if ctx.options.change_stream {
        let alive = Arc::clone(&ctx.listener_alive);
        background.spawn(
            listen(
                ctx.queue.clone(),
                Arc::clone(&notify),
                stop_listening.clone(),
                alive,
            )
            .in_current_span(),
        );
    }
    let hard = CancellationToken::new();
    let sem = Arc::new(Semaphore::new(ctx.options.concurrency));
    let mut jobs: JoinSet<()> = JoinSet::new();
    let o = &ctx.options;
    let mut idle = match Backoff::new(o.poll_min, o.poll_max) {
        Ok(b) => b.with_floor(o.poll_min),
        Err(e) => {
            tracing::error!(error = %e, "invalid poll options");
            return;
        }
    };
    let mut errors = match Backoff::new(Duration::from_millis(100), Duration::from_secs(5)) {
        Ok(b) => b.with_floor(Duration::from_millis(50)),
        Err(e) => {
            tracing::error!(error = %e, "invalid backoff");
            return;
        }
    };
    loop {
        while jobs.try_join_next().is_some() {}
        let first = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            p = Arc::clone(&sem).acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let mut permits = vec![first];
        while permits.len() < o.batch_size {
            match Arc::clone(&sem).try_acquire_owned() {
                Ok(p) => permits.push(p),
                Err(_) => break,
            }
        }
        let claimed = if permits.len() == 1 {
            ctx.queue
                .claim(&ctx.owner)
                .await
                .map(|j| j.into_iter().collect::<Vec<_>>())
        } else {
            ctx.queue.claim_batch(&ctx.owner, permits.len()).await
        };
        match claimed {
            Ok(claimed) if !claimed.is_empty() => {
                idle.reset();
                errors.reset();
                for (job, permit) in claimed.into_iter().zip(permits) {
                    Counters::bump(&ctx.counters.claimed);
                    jobs.spawn(
                        run_job(Arc::clone(&ctx), job, permit, hard.clone()).in_current_span(),
                    );
                }
            }
            Ok(_) => {
                errors.reset();
                drop(permits);
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = notify.notified() => {}
                    () = tokio::time::sleep(idle.next_delay()) => {}
                }
            }
            Err(e) => {
                Counters::bump(&ctx.counters.claim_errors);
                drop(permits);
                let delay = errors.next_delay();
                tracing::warn!(error = %e, ?delay, "claim failed; backing off");
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
    stop_listening.cancel();
    let in_flight = jobs.len();
    if in_flight > 0 {
        tracing::info!(in_flight, "shutting down: waiting for running jobs");
    }
    let drained = tokio::time::timeout(ctx.options.shutdown_deadline, async {
        while jobs.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::info!(
            remaining = jobs.len(),
            "shutdown deadline passed: releasing jobs"
        );
        hard.cancel();
        while jobs.join_next().await.is_some() {}
    }
    while background.join_next().await.is_some() {}
}

async fn run_job(
    ctx: Arc<Ctx>,
    job: ClaimedJob,
    _permit: OwnedSemaphorePermit,
    hard: CancellationToken,
) {
    let span = tracing::info_span!("job", id = %job.id(), attempt = job.job.attempts);
    async move {
        let handler = (ctx.handler)(job.clone());
        let heartbeats = async {
            loop {
                tokio::time::sleep(ctx.heartbeat_every).await;
                match ctx.queue.heartbeat(&job).await {
                    Ok(_) => {}
                    Err(Error::LeaseLost { .. }) => return,
                    Err(e) => tracing::warn!(error = %e, "heartbeat failed; will retry"),
                }
            }
        };
        let outcome = tokio::select! {
            r = handler => Some(r),
            () = heartbeats => None,
            () = hard.cancelled() => {
                match settle(&ctx, &job, &Transition::Release).await {
                    Ok(_) => {
                        Counters::bump(&ctx.counters.released);
                        tracing::info!("released at shutdown");
                    }
                    Err(e) => tracing::warn!(error = %e, "could not release"),
                }
                return;
            }
        };
        let Some(outcome) = outcome else {
            Counters::bump(&ctx.counters.lease_lost);
            tracing::warn!("lease lost while the handler ran; handler dropped");
            return;
        };
        match outcome {
            Ok(result) => match settle(&ctx, &job, &Transition::Complete(result)).await {
                Ok(_) => {
                    Counters::bump(&ctx.counters.succeeded);
                    tracing::debug!("completed");
                }
                Err(Error::LeaseLost { .. }) => {
                    Counters::bump(&ctx.counters.lease_lost);
                    tracing::warn!("completion refused: the lease was lost");
                }
                Err(e) => tracing::warn!(error = %e, "could not complete"),
            },
            Err(err) => {
                let text = err.to_string();
                match settle(&ctx, &job, &Transition::Fail(text.clone())).await {
                    Ok(Some(FailOutcome::Dead)) => {
                        Counters::bump(&ctx.counters.dead);
                        tracing::warn!(error = %text, "job failed its last attempt: dead");
                    }
                    Ok(_) => {
                        Counters::bump(&ctx.counters.retried);
                        tracing::info!(error = %text, "job failed; will retry");
                    }
                    Err(Error::LeaseLost { .. }) => {
                        Counters::bump(&ctx.counters.lease_lost);
                    }
                    Err(e) => tracing::warn!(error = %e, "could not record the failure"),
                }
            }
        }
    }
    .instrument(span)
    .await;
}

/// The final transition of a job run by the worker.
enum Transition {
    Complete(Bson),
    Fail(String),
    Release,
}

/// Runs a fenced transition, retrying transient database errors (a restarting server)
/// with backoff for up to the lease TTL plus 30 s. If a retry reports the lease lost
/// after an earlier attempt failed in transit, the job is read back and the earlier
/// attempt counts as applied only if the document shows *this* transition's result (see
/// [`applied_earlier`]).
async fn settle(ctx: &Ctx, job: &ClaimedJob, t: &Transition) -> Result<Option<FailOutcome>> {
    settle_on(&ctx.queue, job, t, false).await
}

/// [`settle`] on `queue`; `in_doubt` says an earlier attempt already failed in transit.
async fn settle_on(
    queue: &JobQueue,
    job: &ClaimedJob,
    t: &Transition,
    mut in_doubt: bool,
) -> Result<Option<FailOutcome>> {
    let limit = queue.options().lease_ttl + Duration::from_secs(30);
    let started = tokio::time::Instant::now();
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(3))?
        .with_floor(Duration::from_millis(50));
    loop {
        let applied = match t {
            Transition::Complete(result) => {
                queue.complete(job, result.clone()).await.map(|()| None)
            }
            Transition::Fail(text) => queue.fail(job, text).await.map(Some),
            Transition::Release => queue.release(job).await.map(|()| None),
        };
        match applied {
            Ok(v) => return Ok(v),
            Err(e @ Error::LeaseLost { .. }) => {
                if in_doubt {
                    match applied_earlier(queue, job, t).await {
                        Ok(Some(v)) => return Ok(v),
                        Ok(None) => {}
                        Err(read) => {
                            tracing::warn!(error = %read, "could not read the job back");
                        }
                    }
                }
                return Err(e);
            }
            Err(e) if e.is_retryable() && started.elapsed() < limit => {
                in_doubt = true;
                let delay = backoff.next_delay();
                tracing::warn!(error = %e, ?delay, "transition failed; retrying");
                tokio::time::sleep(delay).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Whether an earlier attempt of `t`, whose reply was lost, did apply: `Some(outcome)`
/// only when the stored job shows that transition's own result under our token.
///
/// "Our token, no longer running" is not enough: the sweep (lease expired) and an
/// operator's `cancel` keep the token. So each transition checks its target:
/// - complete: `succeeded` (only a fenced completion writes it);
/// - fail: `retrying` or `dead` as the attempt count decides, with our `last_error`
///   (the sweep's and the operator's reasons are fixed strings; a handler error equal to
///   one of them is never taken as proof);
/// - release: `ready` or `retrying` with the attempt given back (`attempts` one below
///   the claim's; the sweep and cancel keep `attempts`).
async fn applied_earlier(
    queue: &JobQueue,
    job: &ClaimedJob,
    t: &Transition,
) -> Result<Option<Option<FailOutcome>>> {
    let Some(d) = queue
        .collection()
        .find_one(doc! { field::ID: job.id(), field::LEASE_TOKEN: &job.lease.token })
        .await?
    else {
        return Ok(None);
    };
    let state = d.get_str(field::STATE).ok().and_then(JobState::parse);
    let last_error = d.get_str(field::LAST_ERROR).ok();
    let attempts = match d.get(field::ATTEMPTS) {
        Some(Bson::Int64(n)) => Some(*n),
        Some(Bson::Int32(n)) => Some(i64::from(*n)),
        _ => None,
    };
    Ok(match t {
        Transition::Complete(_) => (state == Some(JobState::Succeeded)).then_some(None),
        Transition::Fail(text) => {
            let ours = clip(text);
            if ours == LEASE_EXPIRED_REASON
                || ours == CANCELLED_REASON
                || last_error != Some(ours.as_str())
            {
                None
            } else if job.job.attempts >= job.job.max_attempts {
                (state == Some(JobState::Dead)).then_some(Some(FailOutcome::Dead))
            } else if state == Some(JobState::Retrying) {
                let run_at = d
                    .get_datetime(field::RUN_AT)
                    .ok()
                    .copied()
                    .unwrap_or(job.job.run_at);
                let since = d
                    .get_datetime(field::UPDATED_AT)
                    .map(|u| u.timestamp_millis())
                    .unwrap_or(run_at.timestamp_millis());
                let delay = u64::try_from(run_at.timestamp_millis().saturating_sub(since))
                    .map(Duration::from_millis)
                    .unwrap_or_default();
                Some(Some(FailOutcome::Retrying { run_at, delay }))
            } else {
                None
            }
        }
        Transition::Release => (matches!(state, Some(JobState::Ready | JobState::Retrying))
            && attempts == Some(job.job.attempts - 1))
        .then_some(None),
    })
}

/// Wakes the supervisor on inserts and on jobs put back to ready/retrying. Ends (the
/// worker keeps polling) if the server refuses change streams.
async fn listen(queue: JobQueue, notify: Arc<Notify>, stop: CancellationToken, _alive: Arc<()>) {
    let Ok(mut backoff) = Backoff::new(Duration::from_millis(200), Duration::from_secs(10)) else {
        return;
    };
    let pipeline = vec![doc! { "$match": { "$or": [
        { "operationType": "insert" },
        { "updateDescription.updatedFields.state": {
            "$in": [JobState::Ready.as_str(), JobState::Retrying.as_str()]
        } },
    ] } }];
    loop {
        let opened = tokio::select! {
            () = stop.cancelled() => return,
            s = queue.collection().watch().pipeline(pipeline.clone()) => s,
        };
        match opened {
            Ok(mut stream) => {
                tracing::debug!("listening to the change stream");
                backoff.reset();
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        ev = stream.next() => match ev {
                            Some(Ok(_)) => notify.notify_one(),
                            Some(Err(e)) => {
                                tracing::debug!(error = %e, "change stream interrupted");
                                break;
                            }
                            None => break,
                        },
                    }
                }
            }
            Err(e) if matches!(*e.kind, ErrorKind::Command(_)) => {
                tracing::info!(error = %e, "change streams refused; polling only");
                return;
            }
            Err(e) => tracing::debug!(error = %e, "cannot open the change stream yet"),
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use docwarden_testkit::TestDb;
    use mongodb::bson::{Bson, doc};

    use super::{Transition, settle_on};
    use crate::clock::{ClockOptions, TimeSource};
    use crate::error::Error;
    use crate::queue::{EnqueueOptions, FailOutcome, JobQueue, JobState, QueueOptions};

    async fn open(t: &TestDb) -> anyhow::Result<JobQueue> {
        let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
        let opts = QueueOptions::default()
            .lease_ttl(Duration::from_millis(500))
            .reap_interval(Duration::from_secs(3600));
        Ok(JobQueue::open(&t.db, "jobs", time, opts).await?)
    }

    /// Finding 6: after a transition whose reply was lost, "our token, no longer running"
    /// was taken as proof that it applied, but the sweep and an operator's cancel keep the
    /// token: a swept or cancelled job was counted as succeeded (or retried).
    #[tokio::test]
    async fn a_lost_reply_is_not_taken_for_our_transition_after_a_sweep_or_a_cancel()
    -> anyhow::Result<()> {
        let t = TestDb::new("queue_settle_in_doubt").await?;
        let q = open(&t).await?;
        let transitions = [
            ("complete", Transition::Complete(Bson::Null)),
            ("fail", Transition::Fail("boom".into())),
            ("release", Transition::Release),
        ];
        for max_attempts in [1, 5] {
            for (name, tr) in &transitions {
                // The lease expires and the sweep moves the job (token kept).
                let opts = EnqueueOptions::default().max_attempts(max_attempts);
                q.enqueue(doc! { "t": *name }, &opts).await?;
                let swept = q
                    .claim("w")
                    .await?
                    .ok_or_else(|| anyhow::anyhow!("no job"))?;
                tokio::time::sleep(Duration::from_millis(1_000)).await;
                assert_eq!(q.reap_expired().await?, 1);
                let r = settle_on(&q, &swept, tr, true).await;
                assert!(
                    matches!(r, Err(Error::LeaseLost { .. })),
                    "{name} (max attempts {max_attempts}): a swept job was taken for our \
                     transition: {r:?}"
                );
                // An operator cancels a running job (token kept).
                q.enqueue(doc! { "t": *name }, &opts).await?;
                let cancelled = q
                    .claim("w")
                    .await?
                    .ok_or_else(|| anyhow::anyhow!("no job"))?;
                q.cancel(cancelled.id()).await?;
                let r = settle_on(&q, &cancelled, tr, true).await;
                assert!(
                    matches!(r, Err(Error::LeaseLost { .. })),
                    "{name} (max attempts {max_attempts}): a cancelled job was taken for our \
                     transition: {r:?}"
                );
                // Clean up so the next claim takes the next job.
                q.retry_dead(None).await?;
                t.db.collection::<mongodb::bson::Document>("jobs")
                    .delete_many(doc! {})
                    .await?;
            }
        }
        Ok(())
    }

    /// The other side of finding 6: when the earlier attempt did apply, the read-back
    /// recognises it (with the right fail outcome).
    #[tokio::test]
    async fn a_lost_reply_of_an_applied_transition_is_recognised() -> anyhow::Result<()> {
        let t = TestDb::new("queue_settle_applied").await?;
        let q = open(&t).await?;
        let opts = EnqueueOptions::default().max_attempts(2);
        q.enqueue_many((0..4).map(|i| (doc! { "i": i }, opts.clone())))
            .await?;
        let job = q
            .claim("w")
            .await?
            .ok_or_else(|| anyhow::anyhow!("no job"))?;
        q.complete(&job, Bson::Null).await?;
        let r = settle_on(&q, &job, &Transition::Complete(Bson::Null), true).await?;
        assert_eq!(r, None);

        let job = q
            .claim("w")
            .await?
            .ok_or_else(|| anyhow::anyhow!("no job"))?;
        let applied = q.fail(&job, "boom").await?;
        let r = settle_on(&q, &job, &Transition::Fail("boom".into()), true).await?;
        assert!(
            matches!(
                (&applied, &r),
                (FailOutcome::Retrying { run_at: a, .. }, Some(FailOutcome::Retrying { run_at: b, .. })) if a == b
            ),
            "{applied:?} vs {r:?}"
        );

        let job = q
            .claim("w")
            .await?
            .ok_or_else(|| anyhow::anyhow!("no job"))?;
        q.release(&job).await?;
        let r = settle_on(&q, &job, &Transition::Release, true).await?;
        assert_eq!(r, None);
        let again = q.get(job.id()).await?.map(|j| j.state);
        assert!(matches!(again, Some(JobState::Ready | JobState::Retrying)));

        // Not in doubt: a lost lease stays lost.
        let job = q
            .claim("w")
            .await?
            .ok_or_else(|| anyhow::anyhow!("no job"))?;
        q.cancel(job.id()).await?;
        let r = settle_on(&q, &job, &Transition::Complete(Bson::Null), false).await;
        assert!(matches!(r, Err(Error::LeaseLost { .. })), "{r:?}");
        Ok(())
    }
}
