//! Records seed 002 (`docwarden_workloads::jobs`) run by the real worker runtime: a
//! producer enqueues jobs (every tenth poison) while each worker process runs
//! [`docwarden::queue::Worker`] — batch claims, heartbeats, settle after lost replies,
//! graceful shutdown at the run's deadline — with a handler whose effect is an effect
//! record of its claim, fenced by the claim.
//!
//! Under `pause` a handler sometimes blocks its job's task (handler and heartbeats, as a
//! stopped process would) past the lease, between its work and its effect write. The
//! control run writes the effect by `_id` alone (fencing off), so the paused holder's late
//! write lands under a lost lease. Checked ([`docwarden::check::queue::check_runtime`]):
//! every job finished once, its effects in claim order and none written after a newer
//! claim took the job, dead jobs without effect, no completion reported that did not land;
//! and no worker that stopped (shut down or killed in its task) left its change-stream
//! listener running.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use docwarden::check::{History, OpOutcome, Violation};
use docwarden::lock::FenceOutcome;
use docwarden::queue::{
    ClaimedJob, HandlerResult, JobQueue, QueueOptions, Safeguard, Worker, WorkerOptions,
};
use docwarden_workloads::jobs::{self, Op, Producer};
use docwarden_workloads::{Mode, Process};
use mongodb::Collection;
use mongodb::bson::Document;
use rand::Rng;
use rand::rngs::StdRng;
use tokio::sync::mpsc;

use super::args::Fault;
use super::context::{Ctx, Findings};

const COLLECTION: &str = "verify_jobs";
/// Jobs per enqueued batch, and the backlog above which the producer waits.
const BATCH: usize = 20;
const MAX_BACKLOG: u64 = 16;
/// Every this many jobs, one is poison.
const POISON_EVERY: i64 = 10;
/// The chance that a handler is paused past the lease under `pause` (besides one of each
/// worker's first [`FIRST_PAUSE_WITHIN`] handlers, so that short runs pause too).
const PAUSE_P: f64 = 0.03;
const FIRST_PAUSE_WITHIN: u32 = 8;

/// The change-stream listeners of the workers run in this process
/// ([`Worker::listener_probe`]): once a worker has stopped — shut down, or killed with its
/// task — its listener must not run on (a killed worker leaks nothing).
static LISTENERS: Mutex<Vec<(Process, Weak<()>)>> = Mutex::new(Vec::new());

/// Listeners still running 2 s after their workers stopped, as violations.
async fn leaked_listeners() -> Vec<Violation> {
    let alive = || -> Vec<Process> {
        LISTENERS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, probe)| probe.upgrade().is_some())
            .map(|(p, _)| *p)
            .collect()
    };
    let until = Instant::now() + Duration::from_secs(2);
    while !alive().is_empty() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    alive()
        .into_iter()
        .map(|p| {
            Violation::new(
                "leaked-listener",
                p.label(),
                "the worker stopped, but its change-stream listener still runs",
            )
        })
        .collect()
}

pub(super) async fn run(ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    LISTENERS.lock().unwrap_or_else(|e| e.into_inner()).clear();
    let producer_clock =
        docwarden::clock::TimeSource::server(ctx.client.clone(), Default::default())?;
    let queue = JobQueue::open(&ctx.db, COLLECTION, producer_clock, options(&ctx)).await?;
    // Jobs are produced during the first 60 % of the run; workers go on until the
    // deadline, then the drain finishes what is left.
    let produce_until = Instant::now() + ctx.duration.mul_f64(0.6);
    let producer = {
        let (queue, ctx) = (queue.clone(), Arc::clone(&ctx));
        tokio::spawn(async move { produce(&ctx, &queue, produce_until).await })
    };
    let c = Arc::clone(&ctx);
    ctx.supervise("queue", move |process| {
        let ctx = Arc::clone(&c);
        async move { worker(&ctx, process).await }
    })
    .await;
    producer.await?;
    let leaked = leaked_listeners().await;
    drain(&ctx, &queue).await?;

    let events = ctx.history.events();
    let observed = jobs::observe(&queue).await?;
    let mut violations = jobs::check(&observed, &events);
    violations.extend(leaked);
    Ok(Findings {
        operations: u64::try_from(events.len()).unwrap_or(u64::MAX),
        violations,
    })
}

/// The queue's options: [`jobs::runtime_options`]. The control under `kill` switches
/// rescue off ([`Safeguard::Rescue`]): expired leases are never swept back, so the jobs a
/// killed worker held stay `running` (`stuck-job`), the drain's included. (Only under
/// `kill`: the other controls need rescue to hand a paused holder's job to another.)
fn options(ctx: &Ctx) -> QueueOptions {
    let options = jobs::runtime_options();
    match ctx.mode {
        Mode::Control if ctx.has(Fault::Kill) => options.unsafe_without(Safeguard::Rescue),
        // A paused holder's worker drops its handler once the lease is no longer
        // certainly valid by its own clock (session 16), before the unfenced effect: the
        // control switches that off too, so the paused holder's late write lands.
        Mode::Control => options.unsafe_without(Safeguard::LeaseDeadline),
        Mode::Safe => options,
    }
}

/// The producer: batches of [`BATCH`] jobs while the backlog is small, so that re-claims
/// of expired leases happen during the run, not after it.
async fn produce(ctx: &Ctx, queue: &JobQueue, until: Instant) {
    let mut producer = Producer::new();
    while Instant::now() < until {
        if jobs::backlog(queue).await.unwrap_or(0) > MAX_BACKLOG {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        ctx.history
            .record(
                Process::Producer.id(),
                Op::Enqueue.as_str(),
                "batch",
                producer.enqueue_mixed(queue, BATCH, POISON_EVERY),
                // The jobs it enqueues: all of them when acknowledged.
                |r, e| {
                    e.value(i64::try_from(BATCH).unwrap_or(i64::MAX))
                        .outcome(Ctx::outcome_of(r))
                },
            )
            .await
            .ok();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Under `pause`: the random stream deciding which handlers pause, and where to report
/// each pause window (start, end in µs).
struct PausePlan {
    /// The random stream, and how many handlers are left before the first pause.
    rng: Mutex<(StdRng, u32)>,
    windows: mpsc::UnboundedSender<(u64, u64)>,
}

/// What a handler needs: where to record, where to write, and the pause plan.
struct Handler {
    history: Arc<History>,
    coll: Collection<Document>,
    mode: Mode,
    process: Process,
    pause: Option<PausePlan>,
}

impl Handler {
    /// Runs one claimed job: records the claim, fails poison jobs, does the work, maybe
    /// pauses, writes the effect record, and returns the claim as the job's result.
    async fn run(&self, job: ClaimedJob) -> HandlerResult {
        let p = self.process.id();
        let id = job.id().to_hex();
        self.history
            .push(jobs::handle_event(p, &job, self.history.now_us()));
        if jobs::is_poison(&job) {
            return Err("poison job: fails on purpose".into());
        }
        let (work, pause) = match &self.pause {
            Some(plan) => {
                let mut guard = plan.rng.lock().unwrap_or_else(|e| e.into_inner());
                let (rng, first) = &mut *guard;
                let forced = *first == 1;
                *first = first.saturating_sub(1);
                (rng.random_range(2..15), forced || rng.random_bool(PAUSE_P))
            }
            None => (2, false),
        };
        tokio::time::sleep(Duration::from_millis(work)).await;
        if pause && let Some(plan) = &self.pause {
            let start = self.history.now_us();
            block_task(jobs::LEASE + Duration::from_millis(1500));
            let _ = plan.windows.send((start, self.history.now_us()));
        }
        let token = job.lease.token.to_string();
        let (outcome, assumed) = self
            .history
            .record(
                p,
                Op::Effect.as_str(),
                &id,
                self.effect(&job),
                |(r, assumed), e| classify_effect(r, assumed.as_deref(), &token, &job, e),
            )
            .await;
        if assumed.is_some() {
            return Ok(jobs::completion_result(&job));
        }
        let outcome = outcome?;
        if outcome.is_applied() {
            Ok(jobs::completion_result(&job))
        } else {
            Err(format!("the effect was refused: {outcome:?}").into())
        }
    }

    /// Writes the effect of `job`. Safe: the reply decides; a retryable error leaves the
    /// outcome unknown (the handler fails, the job runs again under a new claim, and the
    /// final read decides whether this claim's effect landed). Control, with that
    /// settlement off: a handler that cannot read back guesses ([`Ctx::guess_resend`]) —
    /// it re-sends the same claim's effect blindly (a `$push`, not
    /// idempotent: a duplicate if the first ran) and takes the re-send's reply, or it
    /// takes the effect as applied (lost if it did not run) and the job is completed. An
    /// outcome still unknown after the re-send is taken as applied. The second value says
    /// why an effect was taken as applied without an acknowledgement. The control's client
    /// has `retryWrites=false`.
    async fn effect(&self, job: &ClaimedJob) -> (docwarden::Result<FenceOutcome>, Option<String>) {
        let first = jobs::effect(&self.coll, job, self.mode).await;
        let err = match &first {
            Err(err) if self.mode == Mode::Control && err.is_retryable() => err.to_string(),
            _ => return (first, None),
        };
        if !first.as_ref().err().is_some_and(Ctx::guess_resend) {
            return (first, Some(format!("{err} (guessed applied)")));
        }
        let token = job.lease.token.to_string();
        let again = self
            .history
            .record(
                self.process.id(),
                Op::Effect.as_str(),
                &job.id().to_hex(),
                jobs::effect(&self.coll, job, self.mode),
                |r, e| {
                    let e = classify_effect(r, None, &token, job, e);
                    let detail = format!("{} (a blind re-send)", e.detail);
                    e.detail(detail)
                },
            )
            .await;
        match again {
            Err(e) if e.is_retryable() => (
                Err(e),
                Some(format!(
                    "{err}, re-sent blindly, again unknown (guessed applied)"
                )),
            ),
            again => (again, None),
        }
    }
}

/// The history's record of an effect write: the claim's token first in the detail, its
/// attempt as the token; assumed applied (`assumed`, the control's reason) is recorded
/// as applied.
fn classify_effect(
    r: &docwarden::Result<FenceOutcome>,
    assumed: Option<&str>,
    token: &str,
    job: &ClaimedJob,
    e: docwarden::check::Event,
) -> docwarden::check::Event {
    let e = e.token(job.job.attempts);
    match (r, assumed) {
        (_, Some(note)) => e.detail(format!("{token} assumed applied: {note}")),
        (Ok(FenceOutcome::Applied), None) => e.detail(token.to_owned()),
        (Ok(other), None) => e
            .outcome(OpOutcome::Failed)
            .detail(format!("{token} {other:?}")),
        (Err(err), None) => e
            .outcome(Ctx::outcome_of(r))
            .detail(format!("{token} {err}")),
    }
}

/// Blocks the calling task for `how_long` without yielding: the handler and the
/// heartbeats polled with it stop, as in a stopped process. On a multi-threaded runtime
/// the other tasks move to other threads; on a current-thread runtime the whole process
/// stops.
fn block_task(how_long: Duration) {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => {
            tokio::task::block_in_place(|| std::thread::sleep(how_long));
        }
        _ => std::thread::sleep(how_long),
    }
}

/// The options of every worker: 4 handlers, batch claims of up to 2, quick polls, and a
/// shutdown that waits out a paused handler.
fn worker_options(name: String) -> WorkerOptions {
    WorkerOptions::default()
        .name(name)
        .concurrency(4)
        .batch_size(2)
        .poll(Duration::from_millis(10), Duration::from_millis(200))
        .shutdown_deadline(jobs::LEASE * 3)
}

/// One worker process: runs a [`Worker`] until the run's deadline, then shuts it down
/// gracefully and records its counts.
pub(super) async fn worker(ctx: &Ctx, process: Process) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    let queue = JobQueue::new(
        ctx.db.collection(COLLECTION),
        ctx.clock(process)?,
        options(ctx),
    )?;
    let (windows, mut paused) = mpsc::unbounded_channel();
    let handler = Arc::new(Handler {
        history: Arc::clone(&ctx.history),
        coll: ctx.db.collection(COLLECTION),
        mode: ctx.mode,
        process,
        pause: ctx.has(Fault::Pause).then(|| {
            let mut rng = ctx.rng(process);
            let first = rng.random_range(1..=FIRST_PAUSE_WITHIN);
            PausePlan {
                rng: Mutex::new((rng, first)),
                windows,
            }
        }),
    });
    let worker = Worker::spawn(
        queue,
        worker_options(format!("verify-{}", process.id())),
        move |job| {
            let handler = Arc::clone(&handler);
            async move { handler.run(job).await }
        },
    )?;
    LISTENERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((process, worker.listener_probe()));
    let until = tokio::time::Instant::from_std(deadline);
    loop {
        tokio::select! {
            Some((start, end)) = paused.recv() => ctx.injected(Fault::Pause, process, start, end),
            () = tokio::time::sleep_until(until) => break,
        }
    }
    let report = worker.shutdown().await;
    while let Ok((start, end)) = paused.try_recv() {
        ctx.injected(Fault::Pause, process, start, end);
    }
    record_report(&ctx.history, process, report.succeeded);
    Ok(())
}

fn record_report(history: &History, process: Process, succeeded: u64) {
    let at = history.now_us();
    history.push(
        docwarden::check::Event::new(process.id(), Op::Report.as_str(), "-", at, at)
            .value(i64::try_from(succeeded).unwrap_or(i64::MAX))
            .detail(format!("{succeeded} completed")),
    );
}

/// Finishes every job still unfinished with a fault-free, fenced worker, until none is
/// left or a limit of 4 leases + 20 s (2 leases without rescue).
async fn drain(ctx: &Ctx, queue: &JobQueue) -> anyhow::Result<()> {
    // Without rescue (the `kill` control) a killed worker's jobs never finish: waiting
    // for them proves nothing, two leases let the live ones end.
    let patience = if options(ctx).unsafe_without == Some(Safeguard::Rescue) {
        jobs::LEASE * 2
    } else {
        jobs::LEASE * 4 + Duration::from_secs(20)
    };
    let limit = Instant::now() + patience;
    let handler = Arc::new(Handler {
        history: Arc::clone(&ctx.history),
        coll: queue.collection().clone(),
        mode: Mode::Safe,
        process: Process::Drain,
        pause: None,
    });
    let worker = Worker::spawn(
        queue.clone(),
        worker_options("verify-drain".to_owned()),
        move |job| {
            let handler = Arc::clone(&handler);
            async move { handler.run(job).await }
        },
    )?;
    while Instant::now() < limit && jobs::unfinished(queue).await? > 0 {
        // Leases of paused or killed workers expire within one lease.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let report = worker.shutdown().await;
    record_report(&ctx.history, Process::Drain, report.succeeded);
    Ok(())
}
