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
use super::job::{ClaimedJob, JobState, field};
use super::options::WorkerOptions;
use super::transition::FailOutcome;
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
}

/// Starts workers. See [`Worker::spawn`].
#[derive(Debug)]
#[non_exhaustive]
pub struct Worker;

impl Worker {
    /// Starts a worker on the current tokio runtime that runs `handler` for every job it
    /// claims from `queue`, up to `options.concurrency` at once.
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
    pub fn spawn<F, Fut>(
        queue: JobQueue,
        options: WorkerOptions,
        handler: F,
    ) -> Result<WorkerHandle>
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
        let handler: BoxHandler = Arc::new(move |job| Box::pin(handler(job)));
        let ctx = Arc::new(Ctx {
            queue,
            options,
            owner: owner.clone(),
            heartbeat_every,
            handler,
            counters: Arc::clone(&counters),
        });
        let shutdown = CancellationToken::new();
        let span = tracing::info_span!("worker", owner = %owner);
        let task = tokio::spawn(supervise(ctx, shutdown.clone()).instrument(span));
        Ok(WorkerHandle {
            owner,
            shutdown,
            task: Some(task),
            counters,
        })
    }
}

/// A running worker. Dropping it aborts the worker like [`WorkerHandle::kill`].
#[derive(Debug)]
pub struct WorkerHandle {
    owner: String,
    shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
    counters: Arc<Counters>,
}

impl WorkerHandle {
    /// The owner name written into this worker's leases.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// What the worker has done so far.
    pub fn report(&self) -> WorkerReport {
        self.counters.report()
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

    /// Kills the worker as a crash would: every task is aborted at once, nothing is
    /// released. Its jobs become claimable when their leases expire.
    pub async fn kill(mut self) -> WorkerReport {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
        self.counters.report()
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

async fn supervise(ctx: Arc<Ctx>, shutdown: CancellationToken) {
    let notify = Arc::new(Notify::new());
    let stop_listening = shutdown.child_token();
    let listener = ctx.options.change_stream.then(|| {
        tokio::spawn(
            listen(
                ctx.queue.clone(),
                Arc::clone(&notify),
                stop_listening.clone(),
            )
            .in_current_span(),
        )
    });
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
    if let Some(l) = listener {
        let _ = l.await;
    }
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
/// after an earlier attempt failed in transit, the job is read back: when it carries
/// our token and has left `running`, the earlier attempt did apply (`Ok(None)`).
async fn settle(ctx: &Ctx, job: &ClaimedJob, t: &Transition) -> Result<Option<FailOutcome>> {
    let limit = ctx.queue.options().lease_ttl + Duration::from_secs(30);
    let started = tokio::time::Instant::now();
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(3))?
        .with_floor(Duration::from_millis(50));
    let mut in_doubt = false;
    loop {
        let applied = match t {
            Transition::Complete(result) => {
                ctx.queue.complete(job, result.clone()).await.map(|()| None)
            }
            Transition::Fail(text) => ctx.queue.fail(job, text).await.map(Some),
            Transition::Release => ctx.queue.release(job).await.map(|()| None),
        };
        match applied {
            Ok(v) => return Ok(v),
            Err(e @ Error::LeaseLost { .. }) => {
                if in_doubt && applied_earlier(ctx, job).await {
                    return Ok(None);
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

async fn applied_earlier(ctx: &Ctx, job: &ClaimedJob) -> bool {
    let found = ctx
        .queue
        .collection()
        .find_one(doc! { field::ID: job.id(), field::LEASE_TOKEN: &job.lease.token })
        .projection(doc! { field::STATE: 1 })
        .await;
    matches!(found, Ok(Some(d)) if d.get_str(field::STATE) != Ok(JobState::Running.as_str()))
}

/// Wakes the supervisor on inserts and on jobs put back to ready/retrying. Ends (the
/// worker keeps polling) if the server refuses change streams.
async fn listen(queue: JobQueue, notify: Arc<Notify>, stop: CancellationToken) {
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
