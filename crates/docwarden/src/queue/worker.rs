//! The worker runtime: `N` concurrent handlers fed by batch claims, with batched
//! completions and heartbeats, wake-ups, graceful shutdown.
//!
//! **How it runs.** The worker claims for all its free handler slots at once, plus a
//! prefetch that grows while handlers finish faster than a claim comes back
//! ([`WorkerOptions::prefetch`]), in batches of up to [`WorkerOptions::batch_size`]
//! ([`JobQueue::claim_batch`]: three round trips per batch, partitions keep workers off
//! each other's jobs; one claim loop). Claimed jobs wait
//! in the worker for a free handler. Final transitions (complete, fail, release) are
//! queued to one writer that sends everything queued as one unordered bulk of per-job
//! fenced updates ([`JobQueue::complete_many`] is the public form) while the previous
//! bulk is in flight, and every
//! `heartbeat_every` one bulk extends every lease the worker holds
//! ([`JobQueue::heartbeat_many`]). Leases stay per job, and every write stays fenced
//! per job: each job gets its own outcome (counted in [`WorkerReport`]).
//!
//! **Guarantee:** while a job is held (waiting or running), its lease is extended every
//! `heartbeat_every`; if a heartbeat finds the lease lost, or no heartbeat renewed the
//! lease before it expires by the worker's own monotonic clock (heartbeats failing: a
//! worker cut off from the server), the handler is dropped (or never started) and
//! nothing is written for it, before the sweep can hand the job to another worker. Idle workers wake on a change-stream
//! event for new or released jobs (a new job is claimed by `_id` straight from the
//! event: one round trip), and otherwise poll with a jittered backoff between
//! `poll_min` and `poll_max`. The change stream, which the server pays for on every
//! write, is opened when a claim finds nothing (a worker started on a backlog opens
//! none until it has drained it), closed by a busy worker (claims kept finding jobs for
//! a second), and reopened as soon as a claim finds nothing, then the worker claims
//! once more for the jobs inserted in between; while it is closed, a job cancelled as it runs is signalled by the next
//! heartbeat instead of at once. Database errors (a restarting server) make the worker back
//! off and resume; they never end it. A handler that panics fails its attempt, and so does one that runs past
//! [`WorkerOptions::job_timeout`] (its future is dropped). Shutdown stops claiming, releases the jobs still
//! waiting, waits for running handlers up to `shutdown_deadline`, then releases the
//! jobs still running so other workers can claim them at once.
//!
//! Shutdown, [`Worker::kill`] and dropping the handle all stop every task of the
//! worker (supervisor, handlers, writer, heartbeats, change-stream listener). A
//! transition whose reply was lost counts as applied only if the job shows that
//! transition's own result.
//!
//! **Limits:** a worker that is killed (its task aborted, its process gone) releases
//! nothing; its jobs are re-claimable after the lease expires, including jobs whose
//! handler had finished but whose completion was still queued (delivery is at least
//! once). Jobs waiting in the worker hold their leases: a slow handler delays them by
//! at most the prefetch (which stays 0 while handlers are slower than claims). The claim
//! counts the attempt and a handler's start writes nothing, so a killed worker's jobs
//! that never started (at most `concurrency` + the prefetch) are swept with an attempt
//! used, and to `dead` if it was their last (`docs/queue.md`, "A crash charges an attempt
//! to jobs that never started"); a graceful shutdown gives them their attempt back.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use mongodb::bson::{Bson, doc, oid::ObjectId};
use tokio::sync::{Notify, mpsc};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::JobQueue;
use super::job::{ClaimedJob, JobState, field};
use super::options::WorkerOptions;
use super::transition::{FailOutcome, Held, MAX_RESULT_BYTES, Settled, Snooze, Transition};
use crate::backoff::Backoff;
use crate::error::{Error, Result};
use crate::listener::{self, Received, Subscribed};

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
    /// Claims that failed with a database error (the worker backed off), and failed reads
    /// of the queue's control document (pause and resume): a worker claims nothing until
    /// it has read it once, so a worker that cannot reach the server counts here.
    pub claim_errors: u64,
    /// Jobs cancelled while running here whose handler was signalled
    /// ([`ClaimedJob::cancellation`]); their later transitions are refused by the fence.
    pub cancelled: u64,
    /// Jobs snoozed by their handler ([`super::snooze`]).
    pub snoozed: u64,
    /// Handlers dropped at [`WorkerOptions::job_timeout`]; each one's failure is then
    /// written like any failed attempt and counted again in `retried` or `dead` (or
    /// `lease_lost` if the fence refuses it).
    pub timed_out: u64,
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
    cancelled: AtomicU64,
    snoozed: AtomicU64,
    timed_out: AtomicU64,
}

impl Counters {
    fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
    fn add(c: &AtomicU64, n: usize) {
        c.fetch_add(u64::try_from(n).unwrap_or(u64::MAX), Ordering::Relaxed);
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
            cancelled: self.cancelled.load(Ordering::Relaxed),
            snoozed: self.snoozed.load(Ordering::Relaxed),
            timed_out: self.timed_out.load(Ordering::Relaxed),
        }
    }
}

type BoxHandler = Arc<
    dyn Fn(ClaimedJob) -> std::pin::Pin<Box<dyn Future<Output = HandlerResult> + Send>>
        + Send
        + Sync,
>;

/// Most claim loops of one worker (see `supervise`).
const MAX_CLAIMERS: usize = 2;

/// The claim loops of a worker with `concurrency` handlers: one for a single handler, two
/// from two handlers on. One loop waits for each claim's three round trips, and the
/// server idles meanwhile: a second loop drained 1.3–1.5× as many jobs per second at two
/// and four handlers (`docs/benchmarks.md`, session 10). The worker's writes take turns
/// with as many write commands in flight as it has claim loops (`Ctx::io`).
fn claimers(concurrency: usize) -> usize {
    concurrency.clamp(1, MAX_CLAIMERS)
}

/// Most final transitions written by one bulk.
const MAX_BULK: usize = 1024;

/// How long claims must keep finding jobs before the worker closes its change stream.
/// A busy worker claims again as soon as a slot frees, so the stream's wake-ups are
/// useless then, and the server pays for every stream on every write to the
/// collection (about 40 µs per job on the embedded server, a fifth of a job's cost:
/// `docs/benchmarks.md`). The stream is reopened the moment a claim finds nothing.
const BUSY_STREAM_OFF: Duration = Duration::from_secs(1);

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
    /// Every lease the worker holds (waiting, running, or transition queued), with the
    /// token that drops its handler when a heartbeat finds the lease lost, and when the
    /// lease certainly holds until by this process's monotonic clock (see [`HeldJob`]).
    held: Mutex<HashMap<ClaimKey, HeldJob>>,
    /// Jobs claimed whose handler has not finished (waiting + running).
    outstanding: AtomicUsize,
    /// Handler slots waiting for a job.
    idle_handlers: AtomicUsize,
    /// Jobs held beyond the handler slots at most, now (adapts up to
    /// [`WorkerOptions::prefetch`]).
    prefetch: AtomicUsize,
    /// Handlers finished so far (the prefetch grows only once some have finished).
    finished: AtomicU64,
    /// How long a handler runs, microseconds: a moving average (weight 1/8) over the
    /// finished ones. The prefetch grows only while it is shorter than a claim.
    handler_micros: AtomicU64,
    /// Signalled when a handler finishes (a slot is free).
    slot_freed: Notify,
    /// Signalled by the change-stream listener when a job was cancelled: the heartbeat
    /// runs at once, so a held job's handler gets its signal within one event.
    check_now: Arc<Notify>,
    /// Whether the queue is paused (its control document, watched by
    /// `control::watch_pause`); `None` when the pause check is switched off (control).
    paused: Option<tokio::sync::watch::Receiver<bool>>,
    /// Whether the change stream is wanted: set by the claim loop, `true` once a claim
    /// found nothing due, `false` after claims kept finding jobs for [`BUSY_STREAM_OFF`]
    /// (see [`listen`]).
    stream_wanted: tokio::sync::watch::Sender<bool>,
    /// Whether the listener holds an open change stream now (see
    /// [`Worker::change_stream_open`]).
    stream_open: Arc<std::sync::atomic::AtomicBool>,
    /// Set by the listener when it took a job event for this worker (`queue/wakes.rs`),
    /// cleared when the claim loop wakes for it: a worker takes one event at a time.
    wake_pending: Arc<std::sync::atomic::AtomicBool>,
    /// Taken by each claim's write and each bulk of final transitions: as many write
    /// commands of the worker in flight as it has claim loops ([`claimers`]), so
    /// transitions that finish during a claim go out in one bigger bulk (`docs/queue.md`,
    /// "Worker runtime"). A batch claim's two reads take no turn: holding one through
    /// them kept a one-handler worker's completions waiting on its reads (session 26:
    /// 3–61 % more jobs per second with them outside, the same at eight handlers).
    io: tokio::sync::Semaphore,
}

impl Ctx {
    /// Folds one handler's run time into [`Ctx::handler_micros`].
    fn ran_for(&self, took: Duration) {
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let first = self.finished.load(Ordering::Relaxed) == 0;
        let _ = self
            .handler_micros
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |avg| {
                Some(if first {
                    micros
                } else {
                    avg - avg / 8 + micros / 8
                })
            });
    }

    /// Holds `jobs`, claimed by a claim sent at `sent` (their leases run from then).
    fn hold(&self, jobs: &[ClaimedJob], sent: tokio::time::Instant) -> Vec<CancellationToken> {
        let valid_until = sent + self.queue.options().lease_ttl;
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        jobs.iter()
            .map(|j| {
                let lost = CancellationToken::new();
                held.insert(
                    claim_key(j),
                    HeldJob {
                        job: j.clone(),
                        lost: lost.clone(),
                        valid_until,
                        settling: false,
                    },
                );
                lost
            })
            .collect()
    }

    /// Marks held claim `job` as having its final transition queued for the writer: from
    /// now on the writer's reply, not a heartbeat, tells its outcome. Returns whether the
    /// worker still held it: `false` once a heartbeat took it away (lease lost, or
    /// cancelled by an operator), which that heartbeat has counted already.
    fn settling(&self, job: &ClaimedJob) -> bool {
        match self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&claim_key(job))
        {
            Some(h) => {
                h.settling = true;
                true
            }
            None => false,
        }
    }

    /// When the lease of held claim `job` certainly still holds until (monotonic clock);
    /// `None` once the job is no longer held, or when the control switched this
    /// safeguard off ([`super::Safeguard::LeaseDeadline`]: the handler then runs past its
    /// lease until a heartbeat finds it lost).
    fn valid_until(&self, job: &ClaimedJob) -> Option<tokio::time::Instant> {
        if self.queue.options().unsafe_without == Some(super::Safeguard::LeaseDeadline) {
            return None;
        }
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&claim_key(job))
            .map(|h| h.valid_until)
    }
    /// Stops holding claim `job`; whether it was still held (a heartbeat that found its
    /// lease lost took it away already, and counted it).
    fn forget(&self, job: &ClaimedJob) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&claim_key(job))
            .is_some()
    }
    /// The jobs held, each with whether its final transition is queued (settling).
    fn held_jobs(&self) -> Vec<(ClaimedJob, bool)> {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|h| (h.job.clone(), h.settling))
            .collect()
    }
}

/// A claim the worker holds: the job's id and the claim's lease token. The worker may
/// hold a job under a new claim (its other claim loop took it again once it was given
/// back) before the writer has forgotten the old one: each is its own entry.
type ClaimKey = (ObjectId, String);

fn claim_key(job: &ClaimedJob) -> ClaimKey {
    (job.id(), job.lease.token.as_str().to_owned())
}

/// A job the worker holds.
struct HeldJob {
    job: ClaimedJob,
    /// Cancelled when the lease is lost: drops the handler (or never starts it).
    lost: CancellationToken,
    /// The lease certainly holds until then, by this process's monotonic clock: the
    /// instant the claim (or the last heartbeat that renewed the lease) was sent, plus the
    /// lease TTL. The server computed the lease's expiry from a clock reading taken after
    /// that instant, so this is never later than the lease's expiry; the sweep takes the
    /// job over only after the expiry plus the clock bound and the skew margin. A handler
    /// still running then is dropped ([`lease_expiry`]): a worker cut off from the server,
    /// whose heartbeats fail, never runs a job another worker may have taken over.
    valid_until: tokio::time::Instant,
    /// Its final transition is queued for (or in flight in) the writer. A heartbeat that
    /// finds such a job no longer running under its token leaves it to the writer: the
    /// transition may just have landed (our own completion, not a lost lease), and if the
    /// lease was lost the fenced transition says so.
    settling: bool,
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
    stream_open: Arc<std::sync::atomic::AtomicBool>,
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
        // `-` and eight hex digits: `WORKER_SUFFIX_LEN` bytes, room left by the validation.
        let owner = format!("{}-{:08x}", options.name, rand::random::<u32>());
        let counters = Arc::new(Counters::default());
        let listener_alive = Arc::new(());
        let listener_probe = Arc::downgrade(&listener_alive);
        let stream_open = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let handler: BoxHandler = Arc::new(move |job| Box::pin(handler(job)));
        // "Paused" until the control document was read once: never claim before.
        let (paused_tx, paused_rx) = tokio::sync::watch::channel(true);
        let pause_check = queue.options().unsafe_without != Some(super::Safeguard::PauseCheck);
        let write_turns = claimers(options.concurrency);
        let ctx = Arc::new(Ctx {
            queue,
            options,
            owner: owner.clone(),
            heartbeat_every,
            handler,
            counters: Arc::clone(&counters),
            listener_alive,
            held: Mutex::new(HashMap::new()),
            outstanding: AtomicUsize::new(0),
            idle_handlers: AtomicUsize::new(0),
            prefetch: AtomicUsize::new(0),
            finished: AtomicU64::new(0),
            handler_micros: AtomicU64::new(0),
            slot_freed: Notify::new(),
            check_now: Arc::new(Notify::new()),
            wake_pending: Arc::default(),
            paused: pause_check.then_some(paused_rx),
            // Opened by the first claim that finds nothing: a worker started on a
            // backlog has no use for it until the backlog is drained.
            stream_wanted: tokio::sync::watch::Sender::new(false),
            stream_open: Arc::clone(&stream_open),
            io: tokio::sync::Semaphore::new(write_turns),
        });
        let shutdown = CancellationToken::new();
        let span = tracing::info_span!("worker", owner = %owner);
        let task = tokio::spawn(supervise(ctx, shutdown.clone(), paused_tx).instrument(span));
        Ok(Worker {
            owner,
            shutdown,
            task: Some(task),
            counters,
            listener_probe,
            stream_open,
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

    /// Whether the worker's change stream is open now: it is while the worker is idle
    /// (a claim found nothing), and closed while claims keep finding jobs. For tests.
    #[doc(hidden)]
    pub fn change_stream_open(&self) -> bool {
        self.stream_open.load(Ordering::Relaxed)
    }

    /// Graceful shutdown: stop claiming, release the jobs waiting for a handler, wait
    /// for running handlers up to the deadline, release the jobs still running, and
    /// return the final counts.
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

/// A job handed to a handler slot, with the token a heartbeat cancels if it finds the
/// lease lost.
type Handoff = (ClaimedJob, CancellationToken);
/// A final transition queued for the writer.
type Final = (ClaimedJob, Transition);

async fn supervise(
    ctx: Arc<Ctx>,
    shutdown: CancellationToken,
    paused: tokio::sync::watch::Sender<bool>,
) {
    let notify = Arc::new(Notify::new());
    let (woke_tx, mut woke_rx) = mpsc::channel::<Bson>(64);
    let stop_listening = shutdown.child_token();
    // Background tasks live in `JoinSet`s owned by this future: when the supervisor is
    // aborted (kill, drop), the sets are dropped and abort them too.
    let mut background: JoinSet<()> = JoinSet::new();
    if ctx.options.change_stream {
        let alive = Arc::clone(&ctx.listener_alive);
        background.spawn(
            listen(
                ctx.queue.clone(),
                Arc::clone(&notify),
                woke_tx,
                stop_listening.clone(),
                alive,
                Arc::clone(&ctx.check_now),
                StreamSwitch {
                    wanted: ctx.stream_wanted.subscribe(),
                    is_open: Arc::clone(&ctx.stream_open),
                    wake_pending: Arc::clone(&ctx.wake_pending),
                },
            )
            .in_current_span(),
        );
    }
    if ctx.paused.is_some() {
        background.spawn(
            super::control::watch_pause(
                ctx.queue.clone(),
                paused,
                ctx.options.poll_max,
                ctx.options.change_stream && ctx.options.watch_control,
                stop_listening.clone(),
                {
                    let counters = Arc::clone(&ctx.counters);
                    move || Counters::bump(&counters.claim_errors)
                },
            )
            .in_current_span(),
        );
    }
    if ctx.options.run_schedules {
        // The process's one pass task for this queue, shared with its other workers
        // (`queue/schedulers.rs`).
        background.spawn(
            super::schedulers::keep_running(
                ctx.queue.clone(),
                ctx.options.schedule_every,
                stop_listening.clone(),
            )
            .in_current_span(),
        );
    }
    let hard = CancellationToken::new();
    let (final_tx, final_rx) = mpsc::unbounded_channel::<Final>();
    let mut writer: JoinSet<()> = JoinSet::new();
    writer.spawn(write_finals(Arc::clone(&ctx), final_rx).in_current_span());
    let stop_heartbeats = CancellationToken::new();
    background.spawn(heartbeats(Arc::clone(&ctx), stop_heartbeats.clone()).in_current_span());
    let (job_tx, job_rx) = mpsc::unbounded_channel::<Handoff>();
    let job_rx = Arc::new(tokio::sync::Mutex::new(job_rx));
    let mut handlers: JoinSet<()> = JoinSet::new();
    for _ in 0..ctx.options.concurrency {
        handlers.spawn(
            run_slot(
                Arc::clone(&ctx),
                Arc::clone(&job_rx),
                final_tx.clone(),
                shutdown.clone(),
                hard.clone(),
            )
            .in_current_span(),
        );
    }
    // Claim loops: two for eight handlers or more, with two write commands in flight
    // (one loop and one command measured 0.54x update_one at 8 handlers, two of each
    // 0.70-0.73x; four of each were slower again: `docs/benchmarks.md`).
    let claimers = claimers(ctx.options.concurrency);
    let mut loops =
        vec![claim_loop(&ctx, &shutdown, Some((&*notify, &mut woke_rx)), &job_tx).boxed()];
    for _ in 1..claimers {
        loops.push(claim_loop(&ctx, &shutdown, None, &job_tx).boxed());
    }
    futures::future::join_all(loops).await;
    stop_listening.cancel();
    // Release the jobs still waiting for a handler (the slots stop taking jobs on
    // shutdown).
    drop(job_tx);
    let waiting: Vec<Handoff> = {
        let mut rx = job_rx.lock().await;
        std::iter::from_fn(|| rx.try_recv().ok()).collect()
    };
    if !waiting.is_empty() {
        tracing::info!(
            waiting = waiting.len(),
            "shutting down: releasing waiting jobs"
        );
    }
    for (job, _) in waiting {
        ctx.outstanding.fetch_sub(1, Ordering::Relaxed);
        if !ctx.settling(&job) {
            // A heartbeat found its lease lost (or the job cancelled) and counted it:
            // there is nothing to release, and a refused release would count it again.
            ctx.queue.release_permits(&job).await;
            continue;
        }
        let _ = final_tx.send((job, Transition::Release));
    }
    let running = ctx.outstanding.load(Ordering::Relaxed);
    if running > 0 {
        tracing::info!(running, "shutting down: waiting for running jobs");
    }
    let drained = tokio::time::timeout(ctx.options.shutdown_deadline, async {
        while handlers.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::info!(
            remaining = handlers.len(),
            "shutdown deadline passed: releasing jobs"
        );
        hard.cancel();
        while handlers.join_next().await.is_some() {}
    }
    drop(final_tx);
    while writer.join_next().await.is_some() {}
    stop_heartbeats.cancel();
    while background.join_next().await.is_some() {}
}

/// Claims while there are free slots, until shutdown. The first loop also wakes on
/// change-stream events (`wake`); the others poll when the queue is empty.
async fn claim_loop(
    ctx: &Arc<Ctx>,
    shutdown: &CancellationToken,
    mut wake: Option<(&Notify, &mut mpsc::Receiver<Bson>)>,
    job_tx: &mpsc::UnboundedSender<Handoff>,
) {
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
    let mut woken: Option<Bson> = None;
    // Since when claims keep finding jobs (the first loop manages the change stream).
    let mut busy_since: Option<tokio::time::Instant> = None;
    let manages_stream = wake.is_some();
    loop {
        if shutdown.is_cancelled() {
            return;
        }
        // A paused queue: no claim starts until it is resumed (`control.rs`).
        let paused_now = ctx.paused.as_ref().is_some_and(|p| *p.borrow());
        if paused_now && let Some(paused) = &ctx.paused {
            let mut rx = paused.clone();
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                ok = async { rx.wait_for(|p| !*p).await.is_ok() } => {
                    if !ok {
                        tokio::time::sleep(o.poll_max).await;
                    }
                }
            }
            continue;
        }
        // Reserve the slots this claim fills, so that concurrent claim loops never hold
        // more than the handlers plus the prefetch.
        let prefetch = ctx.prefetch.load(Ordering::Relaxed);
        let target = o.concurrency + prefetch;
        let threshold = (o.batch_size.min(target) / 2).max(1);
        let reserved =
            ctx.outstanding
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |outstanding| {
                    let free = target.saturating_sub(outstanding);
                    if free == 0 || (free < threshold && outstanding >= o.concurrency) {
                        None
                    } else {
                        Some(outstanding + free.min(o.batch_size))
                    }
                });
        let want = match reserved {
            Ok(before) => (target - before).min(o.batch_size),
            Err(_) => {
                tokio::select! {
                    biased;
                    () = shutdown.cancelled() => return,
                    () = ctx.slot_freed.notified() => {}
                }
                continue;
            }
        };
        let claim_started = tokio::time::Instant::now();
        let claimed = match woken.take() {
            Some(id) => {
                let turn = ctx.io.acquire().await;
                match ctx.queue.claim_id(&ctx.owner, &id).await {
                    Ok(Some(job)) => Ok(vec![job]),
                    Ok(None) => {
                        drop(turn);
                        claim(ctx, want).await
                    }
                    Err(e) => Err(e),
                }
            }
            None => claim(ctx, want).await,
        };
        let got = claimed.as_ref().map_or(0, Vec::len);
        if got < want {
            ctx.outstanding.fetch_sub(want - got, Ordering::AcqRel);
            ctx.slot_freed.notify_waiters();
        }
        match claimed {
            Ok(jobs) if !jobs.is_empty() => {
                idle.reset();
                errors.reset();
                if manages_stream {
                    let since = *busy_since.get_or_insert_with(tokio::time::Instant::now);
                    if since.elapsed() >= BUSY_STREAM_OFF {
                        ctx.stream_wanted
                            .send_if_modified(|w| std::mem::replace(w, false));
                    }
                }
                // Handlers that have run jobs wait for one while the queue still gave
                // a full batch, and a job takes them less time than this claim took:
                // they are faster than claims, so hold more. (A handler is always idle
                // when the claim made for its free slot returns; slower handlers, and
                // handlers that never finished a job, say stuck ones, never grow it.)
                let claim_micros =
                    u64::try_from(claim_started.elapsed().as_micros()).unwrap_or(u64::MAX);
                let starved = ctx.finished.load(Ordering::Relaxed) > 0
                    && ctx.handler_micros.load(Ordering::Relaxed) < claim_micros
                    && ctx.idle_handlers.load(Ordering::Relaxed) > 0;
                if jobs.len() < want {
                    ctx.prefetch.store(prefetch / 2, Ordering::Relaxed);
                } else if starved {
                    let grown = (prefetch * 2).max(o.concurrency).min(o.prefetch);
                    ctx.prefetch.store(grown, Ordering::Relaxed);
                }
                Counters::add(&ctx.counters.claimed, jobs.len());
                let tokens = ctx.hold(&jobs, claim_started);
                for handoff in jobs.into_iter().zip(tokens) {
                    if job_tx.send(handoff).is_err() {
                        return;
                    }
                }
            }
            Ok(_) => {
                errors.reset();
                if manages_stream {
                    busy_since = None;
                    // Reopened: the listener signals `notify` once the stream is open,
                    // so a job inserted before that is claimed by the next claim.
                    ctx.stream_wanted
                        .send_if_modified(|w| !std::mem::replace(w, true));
                }
                ctx.prefetch.store(prefetch / 2, Ordering::Relaxed);
                let delay = idle.next_delay();
                match wake.as_mut() {
                    Some((notify, woke)) => {
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = notify.notified() => {
                                // A single new job: claim it by `_id` (one round trip);
                                // several at once: a batch claim takes them in order.
                                ctx.wake_pending.store(false, Ordering::Release);
                                woken = woke.try_recv().ok();
                                if woke.try_recv().is_ok() {
                                    woken = None;
                                    while woke.try_recv().is_ok() {}
                                }
                            }
                            () = tokio::time::sleep(delay) => {
                                ctx.wake_pending.store(false, Ordering::Release);
                                while woke.try_recv().is_ok() {}
                            }
                        }
                    }
                    None => {
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep(delay) => {}
                        }
                    }
                }
            }
            Err(e) => {
                Counters::bump(&ctx.counters.claim_errors);
                let delay = errors.next_delay();
                tracing::warn!(error = %e, ?delay, "claim failed; backing off");
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// One claim of up to `want` jobs: a batch claim, or the strict single claim when the
/// worker's batch size is 1.
///
/// A batch claim takes a write turn for its `updateMany` alone (its reads need none);
/// the limited and the single claims hold one throughout.
async fn claim(ctx: &Ctx, want: usize) -> Result<Vec<ClaimedJob>> {
    if ctx.queue.claims_limited() {
        // Limited jobs after their permits, then plain ones (`queue/limit.rs`).
        let _turn = ctx.io.acquire().await;
        return ctx.queue.claim_with_limits(&ctx.owner, want).await;
    }
    if ctx.options.batch_size == 1 {
        let _turn = ctx.io.acquire().await;
        Ok(ctx.queue.claim(&ctx.owner).await?.into_iter().collect())
    } else {
        ctx.queue
            .claim_batch_taking(&ctx.owner, want, Some(&ctx.io))
            .await
    }
}

/// One handler slot: takes the next waiting job, runs the handler, queues its final
/// transition. Stops taking jobs at shutdown.
async fn run_slot(
    ctx: Arc<Ctx>,
    jobs: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Handoff>>>,
    finals: mpsc::UnboundedSender<Final>,
    shutdown: CancellationToken,
    hard: CancellationToken,
) {
    loop {
        ctx.idle_handlers.fetch_add(1, Ordering::Relaxed);
        let next = tokio::select! {
            biased;
            () = shutdown.cancelled() => None,
            next = async { jobs.lock().await.recv().await } => next,
        };
        ctx.idle_handlers.fetch_sub(1, Ordering::Relaxed);
        let Some((job, lost)) = next else {
            return;
        };
        let started = crate::observe::started(ctx.queue.metrics_label(), &job);
        let ran_from = tokio::time::Instant::now();
        let Ran {
            transition: final_transition,
            timed_out,
        } = run_job(&ctx, &job, &lost, &hard).await;
        ctx.ran_for(ran_from.elapsed());
        crate::observe::ran(
            ctx.queue.metrics_label(),
            started,
            final_transition.as_ref(),
            timed_out,
        );
        ctx.outstanding.fetch_sub(1, Ordering::Relaxed);
        ctx.finished.fetch_add(1, Ordering::Relaxed);
        ctx.slot_freed.notify_one();
        match final_transition {
            // Unless a heartbeat found the lease lost meanwhile (it took the job away and
            // counted it, under the same lock): the fence would refuse the transition and
            // the writer count the loss a second time. A job cancelled by an operator
            // still sends its transition, which the fence refuses (counted as a loss).
            Some(t) if ctx.settling(&job) || !lost.is_cancelled() => {
                if finals.send((job, t)).is_err() {
                    return;
                }
            }
            _ => {
                ctx.forget(&job);
                ctx.queue.release_permits(&job).await;
            }
        }
    }
}

/// How one handler run ended.
struct Ran {
    /// The transition to write; `None` when the lease was lost (nothing is written).
    transition: Option<Transition>,
    /// Dropped at [`WorkerOptions::job_timeout`] (the transition is its failure).
    timed_out: bool,
}

/// Runs the handler of one job; returns the transition to write, or `None` when the
/// lease was lost (nothing is written), and whether it timed out.
async fn run_job(
    ctx: &Ctx,
    job: &ClaimedJob,
    lost: &CancellationToken,
    hard: &CancellationToken,
) -> Ran {
    let span = tracing::info_span!("job", id = %job.id(), queue = %ctx.queue.collection().name(), name = ctx.queue.queue_name(), attempt = job.job.attempts, token = job.lease.token.as_str());
    async move {
        if lost.is_cancelled()
            || job.cancellation().is_cancelled()
            || ctx
                .valid_until(job)
                .is_some_and(|t| t <= tokio::time::Instant::now())
        {
            // Lost, cancelled by an operator, or not renewed in time while it waited for
            // a slot (the sweep takes it back): never started.
            return Ran { transition: None, timed_out: false };
        }
        // A panic in the handler (or in the call that makes its future) fails the attempt:
        // unwinding through the slot would end the slot and leave the job held, its lease
        // renewed by the heartbeat for as long as the worker lives.
        let handler = std::panic::AssertUnwindSafe(async { (ctx.handler)(job.clone()).await })
            .catch_unwind();
        // A job cancelled while it runs: its handler is signalled (the claim's
        // cancellation token) and may run on for `cancel_grace`; what it returns is
        // refused by the fence.
        let grace = async {
            job.cancellation().cancelled().await;
            tokio::time::sleep(ctx.options.cancel_grace).await;
        };
        // `WorkerOptions::job_timeout`, from the handler's start.
        let timeout = async {
            match ctx.options.job_timeout {
                Some(after) => {
                    tokio::time::sleep(after).await;
                    after
                }
                None => std::future::pending().await,
            }
        };
        let transition = tokio::select! {
            r = handler => Some(match r {
                Ok(Ok(result)) => match too_large(&result) {
                    None => Transition::Complete(result),
                    Some(reason) => Transition::Fail(reason),
                },
                Ok(Err(err)) => match err.downcast::<Snooze>() {
                    Ok(s) => Transition::Snooze(i64::try_from(s.after.as_millis()).unwrap_or(i64::MAX)),
                    Err(err) => Transition::Fail(err.to_string()),
                },
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    tracing::warn!(panic = %what, "handler panicked; attempt failed");
                    // Tasks it spawned may outlive it: tell them the attempt is over.
                    job.cancellation().cancel();
                    Transition::Fail(format!("the handler panicked: {what}"))
                }
            }),
            () = lost.cancelled() => {
                tracing::warn!("lease lost while the handler ran; handler dropped");
                None
            }
            () = lease_expiry(ctx, job) => {
                tracing::warn!("lease not renewed before it expired (heartbeats failing); handler dropped");
                // Counted once: unless a heartbeat found the lease lost (and counted it)
                // at the same moment.
                if ctx.forget(job) {
                    Counters::bump(&ctx.counters.lease_lost);
                }
                job.cancellation().cancel();
                None
            }
            () = grace => {
                tracing::warn!("job cancelled and its handler ran past the cancel grace; handler dropped");
                None
            }
            after = timeout => {
                tracing::warn!(?after, "handler ran past the job timeout; handler dropped, attempt failed");
                Counters::bump(&ctx.counters.timed_out);
                // The handler is dropped; tasks it spawned are told by the claim's token.
                job.cancellation().cancel();
                return Ran {
                    transition: Some(Transition::Fail(super::options::timed_out_error(after))),
                    timed_out: true,
                };
            }
            () = hard.cancelled() => {
                // Dropped at the shutdown deadline, the job released: as at a timeout.
                job.cancellation().cancel();
                Some(Transition::Release)
            }
        };
        Ran { transition, timed_out: false }
    }
    .instrument(span)
    .await
}

/// Resolves once the lease of held claim `job` is past its [`HeldJob::valid_until`] without a
/// renewal; never while it is renewed in time, or once the job is no longer held (a
/// heartbeat that removed it has signalled the handler already).
async fn lease_expiry(ctx: &Ctx, job: &ClaimedJob) {
    loop {
        let Some(until) = ctx.valid_until(job) else {
            return std::future::pending().await;
        };
        if until <= tokio::time::Instant::now() {
            return;
        }
        tokio::time::sleep_until(until).await;
    }
}

/// Why a handler's result cannot be stored (over [`MAX_RESULT_BYTES`]), if it cannot.
fn too_large(result: &Bson) -> Option<String> {
    // A value of fixed size (at most 16 bytes) always fits: not encoded to find out.
    if matches!(
        result,
        Bson::Null
            | Bson::Boolean(_)
            | Bson::Int32(_)
            | Bson::Int64(_)
            | Bson::Double(_)
            | Bson::DateTime(_)
            | Bson::ObjectId(_)
            | Bson::Timestamp(_)
            | Bson::Decimal128(_)
            | Bson::MinKey
            | Bson::MaxKey
            | Bson::Undefined
    ) {
        return None;
    }
    let mut bytes = Vec::new();
    match doc! { "v": result.clone() }.to_writer(&mut bytes) {
        Err(e) => Some(format!(
            "the handler's result cannot be encoded as BSON: {e}"
        )),
        Ok(()) if bytes.len() > MAX_RESULT_BYTES => Some(format!(
            "the handler's result is {} bytes as BSON; the limit is {MAX_RESULT_BYTES}",
            bytes.len()
        )),
        Ok(()) => None,
    }
}

/// The writer: sends every final transition queued as one bulk while the previous bulk
/// is in flight, and counts each job's own outcome. Ends when every sender is gone and
/// the queue is written.
async fn write_finals(ctx: Arc<Ctx>, mut rx: mpsc::UnboundedReceiver<Final>) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < MAX_BULK {
            match rx.try_recv() {
                Ok(f) => batch.push(f),
                Err(_) => break,
            }
        }
        let outcomes = {
            let _turn = ctx.io.acquire().await;
            settle_batch(&ctx.queue, &batch).await
        };
        for ((job, t), outcome) in batch.iter().zip(outcomes) {
            ctx.forget(job);
            ctx.queue.release_permits(job).await;
            count(&ctx.counters, t, outcome);
        }
    }
}

fn count(counters: &Counters, t: &Transition, outcome: Settled) {
    match (t, outcome) {
        (Transition::Complete(_), Ok(_)) => {
            Counters::bump(&counters.succeeded);
            tracing::debug!("completed");
        }
        (Transition::Fail(text), Ok(Some(FailOutcome::Dead))) => {
            Counters::bump(&counters.dead);
            tracing::warn!(error = %text, "job failed its last attempt: dead");
        }
        (Transition::Fail(text), Ok(_)) => {
            Counters::bump(&counters.retried);
            tracing::info!(error = %text, "job failed; will retry");
        }
        (Transition::Release, Ok(_)) => {
            Counters::bump(&counters.released);
            tracing::info!("released at shutdown");
        }
        (Transition::Snooze(ms), Ok(_)) => {
            Counters::bump(&counters.snoozed);
            tracing::debug!(ms, "snoozed");
        }
        (_, Err(Error::LeaseLost { .. })) => {
            Counters::bump(&counters.lease_lost);
            tracing::warn!("transition refused: the lease was lost");
        }
        (_, Err(e)) => tracing::warn!(error = %e, "could not write the transition"),
    }
}

/// [`JobQueue::settle_many`], retrying a bulk that failed as a whole (a restarting
/// server) with backoff for up to the lease TTL plus 30 s; a retried bulk reports what
/// the lost attempt applied (read back by `_id`). Gives every job the error if it never
/// gets through.
async fn settle_batch(queue: &JobQueue, batch: &[Final]) -> Vec<Settled> {
    let limit = queue.options().lease_ttl + Duration::from_secs(30);
    let started = tokio::time::Instant::now();
    let mut backoff = match Backoff::new(Duration::from_millis(100), Duration::from_secs(3)) {
        Ok(b) => b.with_floor(Duration::from_millis(50)),
        Err(e) => return given_up(batch, &e),
    };
    loop {
        match queue.settle_many(batch).await {
            Ok(outcomes) => return outcomes,
            Err(e) if e.is_retryable() && started.elapsed() < limit => {
                let delay = backoff.next_delay();
                tracing::warn!(error = %e, ?delay, jobs = batch.len(), "bulk of transitions failed; retrying");
                tokio::time::sleep(delay).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, jobs = batch.len(), "bulk of transitions failed");
                return given_up(batch, &e);
            }
        }
    }
}

/// Every job of a bulk that never got through gets the bulk's error (as text: the
/// driver's error is not `Clone`).
fn given_up(batch: &[Final], e: &Error) -> Vec<Settled> {
    batch
        .iter()
        .map(|(job, _)| {
            Err(Error::Malformed {
                id: job.id().to_hex(),
                reason: format!("the bulk of transitions failed: {e}"),
            })
        })
        .collect()
}

/// Every `heartbeat_every`, extends every lease the worker holds in one bulk; a job
/// whose lease was lost is forgotten and its handler dropped (or never started).
async fn heartbeats(ctx: Arc<Ctx>, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(ctx.heartbeat_every) => {}
            () = ctx.check_now.notified() => {}
        }
        let (jobs, settling): (Vec<ClaimedJob>, Vec<bool>) = ctx.held_jobs().into_iter().unzip();
        if jobs.is_empty() {
            continue;
        }
        // Permits first, so that a permit always outlives its job's lease (`queue/limit.rs`).
        let permits = ctx.queue.renew_permits(&jobs).await;
        // The leases this heartbeat renews run from now at the latest.
        let sent = tokio::time::Instant::now();
        match ctx.queue.heartbeat_detail(&jobs, &settling).await {
            Ok(held) => {
                for ((job, still), permit) in jobs.iter().zip(held).zip(permits) {
                    if still == Held::Yes && permit {
                        if let Some(h) = ctx
                            .held
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_mut(&claim_key(job))
                        {
                            h.valid_until = h.valid_until.max(sent + ctx.queue.options().lease_ttl);
                        }
                        continue;
                    }
                    let gone = {
                        let mut held = ctx.held.lock().unwrap_or_else(|p| p.into_inner());
                        match held.get(&claim_key(job)) {
                            // The writer tells this job's outcome (see `HeldJob::settling`).
                            Some(h) if h.settling => None,
                            Some(_) => {
                                let h = held.remove(&claim_key(job));
                                // Under the lock: a slot that finds the job no longer
                                // held also finds `lost` cancelled, and never sends its
                                // transition (`run_slot`), which would count it twice.
                                if still != Held::Cancelled
                                    && let Some(h) = &h
                                {
                                    h.lost.cancel();
                                }
                                h
                            }
                            None => None,
                        }
                    };
                    if gone.is_none() {
                        continue;
                    }
                    job.cancellation().cancel();
                    if still == Held::Cancelled {
                        // Cancelled by an operator: the handler is signalled and may
                        // finish within `cancel_grace`; its transition is refused.
                        Counters::bump(&ctx.counters.cancelled);
                        tracing::info!(job = %job.id(), "job cancelled while running; handler signalled");
                    } else {
                        // The lease, or the permit that must outlive it, is lost.
                        Counters::bump(&ctx.counters.lease_lost);
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "heartbeat failed; will retry"),
        }
    }
}

/// Runs a fenced transition of one job, retrying transient database errors (a
/// restarting server) with backoff for up to the lease TTL plus 30 s. If a retry
/// reports the lease lost after an earlier attempt failed in transit, the job is read
/// back and the earlier attempt counts as applied only if the document shows *this*
/// transition's result (see `transition::shows`). `in_doubt` says an earlier attempt already
/// failed in transit.
#[cfg(test)]
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
            Transition::Snooze(ms) => queue
                .snooze(job, Duration::from_millis(u64::try_from(*ms).unwrap_or(0)))
                .await
                .map(|_| None),
        };
        match applied {
            Ok(v) => return Ok(v),
            Err(e @ Error::LeaseLost { .. }) => {
                if in_doubt {
                    match queue
                        .collection()
                        .find_one(
                            doc! { field::ID: job.id(), field::LEASE_TOKEN: &job.lease.token },
                        )
                        .await
                    {
                        Ok(Some(d)) => {
                            if let Some(v) = super::transition::shows(&d, job, t) {
                                return Ok(v);
                            }
                        }
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

/// Wakes the supervisor on inserts and on jobs put back to ready/retrying, and passes
/// the `_id` of an inserted job so an idle worker can claim it by `_id`. Ends (the
/// worker keeps polling) if the server refuses change streams.
/// When the listener keeps its stream open ([`BUSY_STREAM_OFF`]), and where it says
/// whether it is open.
struct StreamSwitch {
    /// `true` while the worker wants the stream (set by the claim loop).
    wanted: tokio::sync::watch::Receiver<bool>,
    /// Set while the stream is open.
    is_open: Arc<std::sync::atomic::AtomicBool>,
    /// [`Ctx::wake_pending`].
    wake_pending: Arc<std::sync::atomic::AtomicBool>,
}

async fn listen(
    queue: JobQueue,
    notify: Arc<Notify>,
    woke: mpsc::Sender<Bson>,
    stop: CancellationToken,
    _alive: Arc<()>,
    check_now: Arc<Notify>,
    switch: StreamSwitch,
) {
    let StreamSwitch {
        mut wanted,
        is_open,
        wake_pending,
    } = switch;
    /// Clears `is_open` however the stream ends (closed, failed, task aborted).
    struct Open(Arc<std::sync::atomic::AtomicBool>);
    impl Drop for Open {
        fn drop(&mut self) {
            self.0.store(false, Ordering::Relaxed);
        }
    }
    let Ok(mut backoff) = Backoff::new(Duration::from_millis(200), Duration::from_secs(10)) else {
        return;
    };
    let pipeline = vec![
        doc! { "$match": { "$or": [
            { "operationType": "insert", "fullDocument.queue": queue.queue_value() },
            { "updateDescription.updatedFields.state": {
                "$in": [JobState::Ready.as_str(), JobState::Retrying.as_str(), JobState::Cancelled.as_str()]
            } },
        ] } },
        doc! { "$project": {
            "operationType": 1, "documentKey": 1, "updateDescription.updatedFields.state": 1,
        } },
    ];
    'open: loop {
        // A busy worker keeps no stream open (`BUSY_STREAM_OFF`).
        tokio::select! {
            () = stop.cancelled() => return,
            r = wanted.wait_for(|w| *w) => if r.is_err() { return },
        }
        // The handle's workers in this process share one stream (`crate::listener`).
        let subscribed = tokio::select! {
            () = stop.cancelled() => return,
            s = listener::subscribe(queue.collection(), pipeline.clone()) => s,
        };
        match subscribed {
            Subscribed::Yes(mut sub) => {
                tracing::debug!("listening to the change stream");
                backoff.reset();
                is_open.store(true, Ordering::Relaxed);
                let _open = Open(Arc::clone(&is_open));
                // Jobs inserted while this worker was not subscribed: one claim finds them.
                notify.notify_one();
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        r = wanted.wait_for(|w| !*w) => {
                            if r.is_err() {
                                return;
                            }
                            tracing::debug!("busy: change stream closed until a claim finds nothing");
                            continue 'open;
                        }
                        ev = sub.recv() => match ev {
                            Received::Change(change) => {
                                let cancelled = change.updated_fields.as_ref().is_some_and(|u| {
                                    u.get_str(field::STATE).ok()
                                        == Some(JobState::Cancelled.as_str())
                                });
                                if cancelled {
                                    // A job was cancelled: if this worker runs it, the
                                    // heartbeat signals its handler now.
                                    check_now.notify_one();
                                    continue;
                                }
                                // A job inserted, or put back to ready/retrying: one idle
                                // worker of the handle takes it (`queue/wakes.rs`), and
                                // takes one at a time.
                                let Some(key) = change.id.as_ref() else {
                                    notify.notify_one();
                                    continue;
                                };
                                if wake_pending.load(Ordering::Acquire) || !queue.take_wake(key) {
                                    continue;
                                }
                                wake_pending.store(true, Ordering::Release);
                                if change.inserted {
                                    let _ = woke.try_send(key.clone());
                                }
                                notify.notify_one();
                            }
                            Received::Lagged => {
                                // Events were dropped: a cancellation among them, or
                                // new jobs.
                                check_now.notify_one();
                                notify.notify_one();
                            }
                            Received::Lost => {
                                tracing::debug!("change stream interrupted");
                                break;
                            }
                        },
                    }
                }
            }
            Subscribed::Refused => {
                tracing::info!("change streams refused; polling only");
                return;
            }
            Subscribed::Unavailable(e) => {
                tracing::debug!(error = %e, "cannot open the change stream yet");
            }
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
