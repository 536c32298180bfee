//! Options of the queue handle, of one enqueue, and of a worker; each validated once.

use std::time::Duration;

use mongodb::bson::DateTime;
use mongodb::options::WriteConcern;

use super::limit::{JobLimits, LimitOptions};
use crate::error::{Error, Result};
use crate::validate;

/// Most claim partitions a queue may have ([`QueueOptions::partitions`]).
pub const MAX_PARTITIONS: u32 = 1024;

/// The longest named queue ([`QueueOptions::queue`]), in bytes: its concurrency
/// semaphore's resource `queue:<name>` must be a valid name of at most
/// [`validate::MAX_NAME_LEN`] bytes.
pub const MAX_QUEUE_NAME_LEN: usize =
    validate::MAX_NAME_LEN - crate::format::job::limit::QUEUE_RESOURCE.len() - 1;

/// How a single claim talks to the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimStrategy {
    /// One `findAndModify` with a sort: one round trip, returns the claimed document.
    FindOneAndUpdate,
    /// `updateOne` with a sort, then a find by the new token (the seed's choice): two
    /// round trips, no pre/post image kept for a retried write. Needs `updateOne` with
    /// `sort` (MongoDB 8.0; `docwarden doctor` probes it); older servers refuse it.
    /// On the embedded surrogate (secantusd-rs 0.5.3) concurrent sorted `updateOne`s
    /// can claim one job twice (see `docs/queue.md`); use it on MongoDB only.
    UpdateThenFetch,
}

/// Options of a [`JobQueue`](super::JobQueue).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct QueueOptions {
    /// How long a claim holds a job without a heartbeat. Default 30 s.
    pub lease_ttl: Duration,
    /// Maximum attempts of a job enqueued without its own. Default 5.
    pub max_attempts: u32,
    /// First retry delay; doubles per attempt (with jitter). Default 1 s.
    pub retry_base: Duration,
    /// Longest retry delay. Default 10 min.
    pub retry_max: Duration,
    /// How often a claim also sweeps expired leases back to `retrying` when due jobs
    /// exist (an empty queue always sweeps). Default 1 s.
    pub reap_interval: Duration,
    /// Single-claim strategy. Default [`ClaimStrategy::FindOneAndUpdate`] (measured
    /// faster, see `docs/queue.md`).
    pub claim_strategy: ClaimStrategy,
    /// How many claim partitions a job is spread over: enqueue stores a random
    /// `partition` in `0..partitions`, and a batch claim reads the due jobs of a few
    /// partitions (rotating), not the head of the whole queue, so concurrent claimers
    /// rarely race for the same jobs. `1` gives one strict claim order for batches too
    /// (see `docs/queue.md`, "Ordering"). Default 256; at most 1,024.
    pub partitions: u32,
    /// Write concern of every write the queue makes (enqueue, claim, transitions, sweep,
    /// operator commands, the options document); `None` (the default) inherits the
    /// collection's. On a replica set use [`WriteConcern::majority()`], so that a failover
    /// cannot roll back an acknowledged enqueue, claim or completion.
    pub write_concern: Option<WriteConcern>,
    /// Stalls (lease expired, job taken over by the sweep) after which a job goes to
    /// `dead` with the reason instead of `retrying`: the job is dead at the stall that
    /// makes `stalls > max_stalls` (so `Some(0)` buries it at its first stall). Stored
    /// per job at enqueue (`max_stalls`). Default `None`: no limit (attempts still
    /// bound it).
    pub max_stalls: Option<u32>,
    /// The named queue of this handle (format 3): enqueue stores it in the job's `queue`
    /// field, and every claim, sweep and operator command matches it, so several
    /// queues share one collection and its indexes, each with its own options
    /// document. `None` (the default, also what `"default"` means) is the default queue,
    /// whose jobs carry no `queue` field (jobs of formats 1 and 2 belong to it). At most
    /// [`MAX_QUEUE_NAME_LEN`] bytes.
    pub queue: Option<String>,
    /// A safeguard switched off, for the controls of the concurrency tests only.
    #[doc(hidden)]
    pub unsafe_without: Option<Safeguard>,
    /// Concurrency and rate limits this handle honours (`queue/limit.rs`). Default: none,
    /// and the handle never claims a limited job.
    pub limits: LimitOptions,
}

/// A safeguard of the queue that a test's control switches off to show that the test
/// can fail. Never use outside tests.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Safeguard {
    /// The claim re-checks the claim filter in its write. Off: the single claim reads the
    /// first due job, then writes the lease by `_id` alone (the seed's read-then-write);
    /// the batch claim writes its candidates by `_id` alone, 20 ms after reading them.
    ClaimRecheck,
    /// The batch claim's `updateMany` re-checks the claim filter per document. Off: it
    /// writes the lease to the candidate ids whatever their state.
    BatchRecheck,
    /// Final transitions match `state: "running"` besides `_id` and the token. Off: they
    /// match `{_id, lease.token}` only, so a late completion overwrites a job an
    /// operator cancelled.
    TransitionFence,
    /// Uniqueness windows are enforced by the unique `unique_slot` index. Off: enqueue
    /// reads whether a job of the key was created inside the window, then inserts
    /// (read-then-write, 20 ms apart).
    UniqueSlot,
    /// Replace and debounce write only jobs still waiting (`state` re-checked in the
    /// write). Off: they read the key's waiting job, then write it by `_id` alone
    /// (20 ms apart), and can rewrite a job a worker has claimed meanwhile.
    ReplaceRecheck,
    /// Claims sweep expired leases back to `retrying` (`reap_interval`), so that the jobs
    /// of a worker that died are run again. Off: no sweep; a dead worker's jobs stay
    /// `running` for ever.
    Rescue,
    /// A schedule's job for tick `T` gets the deterministic `_id` of (schedule, `T`), so a
    /// second enqueue of one tick is a duplicate-key no-op. Off: a random `_id`, so two
    /// schedulers that race for one tick both enqueue it.
    ScheduleTickId,
    /// A worker checks the queue's control document (pause) before every claim. Off: it
    /// claims from a paused queue.
    PauseCheck,
    /// A limited claim takes the permits its job's concurrency key and queue limit name.
    /// Off: it claims limited jobs without permits.
    ConcurrencyLimit,
    /// A limited claim is admitted by the rate document of its job's rate key. Off: every
    /// start is admitted (and recorded).
    RateLimit,
    /// A `Worker` drops a handler (or never starts it) once its lease is no longer
    /// certainly valid by the worker's monotonic clock, because no heartbeat renewed it in
    /// time. Off: the handler runs on past its lease until a heartbeat finds it lost (a
    /// paused or cut-off holder's late write reaches the server).
    LeaseDeadline,
}

impl Default for QueueOptions {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(30),
            max_attempts: 5,
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(600),
            reap_interval: Duration::from_secs(1),
            claim_strategy: ClaimStrategy::FindOneAndUpdate,
            partitions: 256,
            write_concern: None,
            max_stalls: None,
            queue: None,
            unsafe_without: None,
            limits: LimitOptions::default(),
        }
    }
}

impl QueueOptions {
    /// Sets [`QueueOptions::lease_ttl`].
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }
    /// Sets [`QueueOptions::max_attempts`].
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }
    /// Sets [`QueueOptions::retry_base`] and [`QueueOptions::retry_max`].
    pub fn retry_delays(mut self, base: Duration, max: Duration) -> Self {
        self.retry_base = base;
        self.retry_max = max;
        self
    }
    /// Sets [`QueueOptions::reap_interval`].
    pub fn reap_interval(mut self, every: Duration) -> Self {
        self.reap_interval = every;
        self
    }
    /// Sets [`QueueOptions::partitions`].
    pub fn partitions(mut self, n: u32) -> Self {
        self.partitions = n;
        self
    }
    /// Sets [`QueueOptions::claim_strategy`].
    pub fn claim_strategy(mut self, strategy: ClaimStrategy) -> Self {
        self.claim_strategy = strategy;
        self
    }
    /// Sets [`QueueOptions::write_concern`] (for example [`WriteConcern::majority()`]).
    pub fn write_concern(mut self, write_concern: WriteConcern) -> Self {
        self.write_concern = Some(write_concern);
        self
    }
    /// Sets [`QueueOptions::queue`] (`"default"` is the default queue).
    pub fn queue(mut self, name: impl Into<String>) -> Self {
        let name = name.into();
        self.queue = (name != crate::format::schedule::DEFAULT_QUEUE).then_some(name);
        self
    }
    /// Sets [`QueueOptions::limits`].
    pub fn limits(mut self, limits: LimitOptions) -> Self {
        self.limits = limits;
        self
    }
    /// Switches one safeguard off: for a test's control only.
    #[doc(hidden)]
    pub fn unsafe_without(mut self, safeguard: Safeguard) -> Self {
        self.unsafe_without = Some(safeguard);
        self
    }
    /// Sets [`QueueOptions::max_stalls`].
    pub fn max_stalls(mut self, n: u32) -> Self {
        self.max_stalls = Some(n);
        self
    }

    pub(crate) fn validate(&self) -> Result<()> {
        validate::duration_ms("lease ttl", self.lease_ttl)?;
        if self.max_attempts == 0 {
            return Err(Error::invalid("max attempts", "must be at least 1"));
        }
        crate::backoff::Backoff::new(self.retry_base, self.retry_max)?;
        validate::duration_ms("reap interval", self.reap_interval)?;
        if let Some(q) = &self.queue {
            validate::name("queue name", q)?;
            // The queue's own semaphore resource is `queue:<name>` (queue/limit.rs), which
            // must itself be a valid name.
            let limit = MAX_QUEUE_NAME_LEN;
            if q.len() > limit {
                return Err(Error::invalid(
                    "queue name",
                    format!("is {} bytes, the limit is {limit}", q.len()),
                ));
            }
        }
        if !(1..=MAX_PARTITIONS).contains(&self.partitions) {
            return Err(Error::invalid(
                "partitions",
                format!("must be between 1 and {MAX_PARTITIONS}"),
            ));
        }
        Ok(())
    }
}

/// When an enqueued job becomes due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RunAt {
    /// As soon as it is stored.
    Now,
    /// This long after it is stored (server time).
    After(Duration),
    /// At this server time.
    At(DateTime),
}

/// Options of one enqueue.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EnqueueOptions {
    /// Higher runs first. Default 0.
    pub priority: i64,
    /// When the job becomes due. Default now.
    pub run_at: RunAt,
    /// Overrides [`QueueOptions::max_attempts`].
    pub max_attempts: Option<u32>,
    /// At most one unfinished job per key (enforced by a unique partial index).
    pub dedupe_key: Option<String>,
    /// At most one job per dedupe key per window of this length, finished jobs
    /// included: windows are aligned to multiples of the length since the epoch (server
    /// time at enqueue), and the unique index on `unique_slot` enforces it. Needs a
    /// dedupe key and [`OnDuplicate::Keep`]; a windowed job is unique by its slot
    /// alone (it does not store `dedupe_key`). Default none.
    pub unique_window: Option<std::time::Duration>,
    /// What an enqueue does when the key already has an unfinished job. Default
    /// [`OnDuplicate::Keep`].
    pub on_duplicate: OnDuplicate,
    /// Concurrency key, rate key and fairness key (`queue/limit.rs`).
    pub limits: JobLimits,
}

/// What an enqueue with a dedupe key does when the key already has an unfinished job
/// (see `docs/queue.md`, "Uniqueness"). Each is one conditional single-document write.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnDuplicate {
    /// Keep the existing job; the enqueue reports it as a duplicate.
    #[default]
    Keep,
    /// If the existing job is waiting (`ready` or `retrying`), replace its payload and
    /// priority; a running job is kept.
    Replace,
    /// Like `Replace`, and also reset its `run_at` to this enqueue's (debounce: a burst
    /// of enqueues runs once, after the last one's delay).
    Debounce,
    /// If the key's job is waiting, keep it (it will run with the newest state anyway);
    /// if it is running, request exactly one follow-up run: the completion puts the job
    /// back to `ready` with this payload instead of `succeeded`. Any number of enqueues
    /// during one run request one follow-up (the last payload wins).
    FollowUp,
}

impl Default for EnqueueOptions {
    fn default() -> Self {
        Self {
            priority: 0,
            run_at: RunAt::Now,
            max_attempts: None,
            dedupe_key: None,
            unique_window: None,
            on_duplicate: OnDuplicate::Keep,
            limits: JobLimits::default(),
        }
    }
}

impl EnqueueOptions {
    /// Sets [`EnqueueOptions::priority`].
    pub fn priority(mut self, p: i64) -> Self {
        self.priority = p;
        self
    }
    /// Delays the job by `d`.
    pub fn delay(mut self, d: Duration) -> Self {
        self.run_at = RunAt::After(d);
        self
    }
    /// Runs the job at server time `at`.
    pub fn run_at(mut self, at: DateTime) -> Self {
        self.run_at = RunAt::At(at);
        self
    }
    /// Sets [`EnqueueOptions::max_attempts`].
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n);
        self
    }
    /// Sets [`EnqueueOptions::dedupe_key`].
    pub fn dedupe_key(mut self, key: impl Into<String>) -> Self {
        self.dedupe_key = Some(key.into());
        self
    }

    /// Sets [`EnqueueOptions::unique_window`].
    pub fn unique_window(mut self, window: std::time::Duration) -> Self {
        self.unique_window = Some(window);
        self
    }
    /// Sets [`EnqueueOptions::on_duplicate`].
    pub fn on_duplicate(mut self, policy: OnDuplicate) -> Self {
        self.on_duplicate = policy;
        self
    }
    /// At most N jobs of `key` run at once (N: [`LimitOptions::key_concurrency`] or
    /// [`JobQueue::set_concurrency_limit`](super::JobQueue::set_concurrency_limit)). The
    /// key is at most [`validate::MAX_NAME_LEN`] − 4 bytes: its semaphore resource is
    /// `key:<key>`.
    pub fn concurrency_key(mut self, key: impl Into<String>) -> Self {
        self.limits.concurrency_key = Some(key.into());
        self
    }
    /// At most N starts of `key` per interval ([`LimitOptions::rate`] or
    /// [`JobQueue::set_rate_limit`](super::JobQueue::set_rate_limit)).
    pub fn rate_key(mut self, key: impl Into<String>) -> Self {
        self.limits.rate_key = Some(key.into());
        self
    }
    /// Jobs of one fairness key (a tenant) share one claim partition, so tenants take
    /// turns ([`super::fairness_partition`]).
    pub fn fairness_key(mut self, key: impl Into<String>) -> Self {
        self.limits.fairness_key = Some(key.into());
        self
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if let Some(w) = self.unique_window {
            validate::duration_ms("unique window", w)?;
            if self.dedupe_key.is_none() {
                return Err(Error::invalid("unique window", "needs a dedupe key"));
            }
            if self.on_duplicate != OnDuplicate::Keep {
                return Err(Error::invalid(
                    "unique window",
                    "a windowed job is never replaced or followed up",
                ));
            }
        }
        if self.on_duplicate != OnDuplicate::Keep && self.dedupe_key.is_none() {
            return Err(Error::invalid("on duplicate", "needs a dedupe key"));
        }
        self.limits.validate()?;
        if self.max_attempts == Some(0) {
            return Err(Error::invalid("max attempts", "must be at least 1"));
        }
        if let Some(key) = &self.dedupe_key {
            validate::name("dedupe key", key)?;
        }
        if let RunAt::After(d) = self.run_at
            && i64::try_from(d.as_millis()).is_err()
        {
            return Err(Error::invalid("delay", "is too long"));
        }
        Ok(())
    }
}

/// Most handlers one [`Worker`](super::Worker) runs at once
/// ([`WorkerOptions::concurrency`]). The worker starts every handler slot at spawn: an
/// unbounded count (a typo, `usize::MAX`) made it spawn tasks until memory ran out.
pub const MAX_CONCURRENCY: usize = 4096;

/// The random suffix a worker adds to its name to make its owner id: `-` and eight hex
/// digits.
pub(crate) const WORKER_SUFFIX_LEN: usize = 9;

/// The longest [`WorkerOptions::name`], in bytes: the owner id (the name and a random
/// suffix) must itself be a valid name of at most [`validate::MAX_NAME_LEN`] bytes.
pub const MAX_WORKER_NAME_LEN: usize = validate::MAX_NAME_LEN - WORKER_SUFFIX_LEN;

/// Options of a [`Worker`](super::Worker).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct WorkerOptions {
    /// Worker name stored in `lease.owner`; a random suffix is added. At most
    /// [`MAX_WORKER_NAME_LEN`] bytes. Default "worker".
    pub name: String,
    /// Handlers running at once: at least 1, at most [`MAX_CONCURRENCY`]. Default 4.
    pub concurrency: usize,
    /// Most jobs taken by one claim. The worker claims for all its free handler slots
    /// at once (plus its prefetch), up to this many jobs per claim. Default 128; `1`
    /// claims one job at a time, in strict queue order.
    pub batch_size: usize,
    /// Most jobs held beyond the handler slots: claimed, leased, and waiting in the
    /// worker for a free handler. The worker starts at 0 and doubles its prefetch while
    /// handlers finish faster than a claim comes back (a full claim found a handler idle,
    /// and the handlers' average run time is shorter than that claim took), up to this;
    /// it halves it when a claim comes back short. Default 256; `0` never claims more
    /// jobs than free handlers.
    pub prefetch: usize,
    /// Heartbeat period while a handler runs. Default: a third of the lease TTL. A
    /// handler whose lease was not renewed within the lease TTL (by the worker's own
    /// clock) is dropped, so leave room for a missed heartbeat and its round trips: a
    /// period near the TTL drops handlers whenever one heartbeat is late.
    pub heartbeat_every: Option<Duration>,
    /// Shortest idle poll when no change stream event arrives. Default 50 ms.
    pub poll_min: Duration,
    /// Longest idle poll. Default 1 s.
    pub poll_max: Duration,
    /// How long shutdown waits for running handlers before releasing their jobs.
    /// Default 10 s.
    pub shutdown_deadline: Duration,
    /// Whether to listen to a change stream for new jobs (falls back to polling when the
    /// server refuses). Default true.
    pub change_stream: bool,
    /// How long a handler may run on after its job was cancelled (its
    /// [`ClaimedJob::cancellation`](super::ClaimedJob::cancellation) signalled) before
    /// the worker drops it. Whatever it returns is refused by the fence either way.
    /// Default 10 s.
    pub cancel_grace: Duration,
    /// Whether the worker also runs the queue's scheduler (periodic jobs, see
    /// [`JobQueue::schedule`](super::JobQueue::schedule)): one pass over the queue's
    /// schedules every [`WorkerOptions::schedule_every`]. The workers of one process that
    /// run it on the same queue (with clones of one handle, or handles alike sharing one
    /// time source) and period share one pass task; any number of processes may run it;
    /// each tick is enqueued once. Default false.
    pub run_schedules: bool,
    /// Period of the worker's scheduler passes. Default 200 ms. After a pass that fails,
    /// the next waits longer, doubling up to 5 s, until one succeeds
    /// ([`Scheduler::spawn`](super::Scheduler::spawn)).
    pub schedule_every: Duration,
    /// Whether the worker also opens a change stream on the queue's control document
    /// (pause and resume take effect at the event instead of the next `poll_max` re-read).
    /// The workers of a process share one such stream (`docs/queue.md`, "Worker
    /// runtime"). Default false: on the embedded server a second change stream per worker
    /// slowed eight workers on a 5,000-job backlog more than fivefold (the test timed out
    /// at 90 s instead of finishing in 19 s; measured before the streams were shared), and
    /// the re-read every `poll_max` (one point read) already bounds the delay.
    pub watch_control: bool,
    /// How long one handler run may take (River's `JobTimeout`, Oban's `timeout/1`). Once
    /// it passes, measured by the worker's monotonic clock from the handler's start (time
    /// spent waiting for a slot does not count), the worker stops waiting: it drops the
    /// handler's future (it never resumes from its pending `.await`) and fails the
    /// attempt through the normal fenced failure, with `last_error` `timed out after
    /// <duration>` (`timed out after 2s` for whole seconds, `timed out after 1500ms`
    /// otherwise): the job is
    /// retried per its `max_attempts`, or goes `dead` at its last attempt. Counted in
    /// [`WorkerReport::timed_out`](super::WorkerReport::timed_out) (and the failure in
    /// `retried` or `dead` once written).
    ///
    /// Default `None`: no timeout, as before this option existed (Oban's default,
    /// `:infinity`; River's is one minute). A default would fail a legitimately long job
    /// at every attempt and bury it; a dead or cut-off worker is already covered by the
    /// lease (heartbeats, the sweep), so the timeout is only for handlers that hang.
    ///
    /// - **Heartbeats** keep renewing the lease while the handler runs, so the timeout
    ///   may be longer than the lease TTL; a lease lost first drops the handler without
    ///   any write (the timeout then never fires).
    /// - **Cancel grace**: a job cancelled by an operator is dropped at the timeout or at
    ///   the end of [`WorkerOptions::cancel_grace`], whichever comes first; the fence
    ///   refuses the failure either way (counted in `lease_lost`).
    /// - **Shutdown**: the timeout still runs while shutdown waits up to
    ///   [`WorkerOptions::shutdown_deadline`]; a handler timed out before that deadline
    ///   fails its attempt, one still running at the deadline is released (its attempt
    ///   given back).
    /// - **Limits**: dropping a future cannot stop work the handler spawned
    ///   (`tokio::spawn`) or a handler that blocks its thread without awaiting; the
    ///   claim's [`cancellation`](super::ClaimedJob::cancellation) token is not signalled
    ///   by a timeout.
    pub job_timeout: Option<Duration>,
}

/// The `last_error` of an attempt that ran past [`WorkerOptions::job_timeout`] `after`:
/// `timed out after 2s` for whole seconds, `timed out after 1500ms` otherwise.
pub(crate) fn timed_out_error(after: Duration) -> String {
    let ms = after.as_millis();
    if ms.is_multiple_of(1000) {
        format!("timed out after {}s", ms / 1000)
    } else {
        format!("timed out after {ms}ms")
    }
}

impl Default for WorkerOptions {
    fn default() -> Self {
        Self {
            name: "worker".into(),
            concurrency: 4,
            batch_size: 128,
            prefetch: 256,
            heartbeat_every: None,
            poll_min: Duration::from_millis(50),
            poll_max: Duration::from_secs(1),
            shutdown_deadline: Duration::from_secs(10),
            change_stream: true,
            cancel_grace: Duration::from_secs(10),
            run_schedules: false,
            schedule_every: Duration::from_millis(200),
            watch_control: false,
            job_timeout: None,
        }
    }
}

impl WorkerOptions {
    /// Sets [`WorkerOptions::name`].
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
    /// Sets [`WorkerOptions::concurrency`].
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }
    /// Sets [`WorkerOptions::batch_size`].
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }
    /// Sets [`WorkerOptions::prefetch`].
    pub fn prefetch(mut self, n: usize) -> Self {
        self.prefetch = n;
        self
    }
    /// Sets [`WorkerOptions::heartbeat_every`].
    pub fn heartbeat_every(mut self, d: Duration) -> Self {
        self.heartbeat_every = Some(d);
        self
    }
    /// Sets [`WorkerOptions::poll_min`] and [`WorkerOptions::poll_max`].
    pub fn poll(mut self, min: Duration, max: Duration) -> Self {
        self.poll_min = min;
        self.poll_max = max;
        self
    }
    /// Sets [`WorkerOptions::shutdown_deadline`].
    pub fn shutdown_deadline(mut self, d: Duration) -> Self {
        self.shutdown_deadline = d;
        self
    }
    /// Sets [`WorkerOptions::change_stream`].
    pub fn change_stream(mut self, on: bool) -> Self {
        self.change_stream = on;
        self
    }
    /// Sets [`WorkerOptions::cancel_grace`].
    pub fn cancel_grace(mut self, d: Duration) -> Self {
        self.cancel_grace = d;
        self
    }

    /// Sets [`WorkerOptions::run_schedules`].
    pub fn run_schedules(mut self, on: bool) -> Self {
        self.run_schedules = on;
        self
    }
    /// Sets [`WorkerOptions::watch_control`].
    pub fn watch_control(mut self, on: bool) -> Self {
        self.watch_control = on;
        self
    }
    /// Sets [`WorkerOptions::schedule_every`].
    pub fn schedule_every(mut self, every: Duration) -> Self {
        self.schedule_every = every;
        self
    }
    /// Sets [`WorkerOptions::job_timeout`].
    pub fn job_timeout(mut self, timeout: Duration) -> Self {
        self.job_timeout = Some(timeout);
        self
    }

    pub(crate) fn validate(&self, lease_ttl: Duration) -> Result<()> {
        validate::name("worker name", &self.name)?;
        if self.name.len() > MAX_WORKER_NAME_LEN {
            // The owner id adds a suffix: a longer name makes every claim refuse it.
            return Err(Error::invalid(
                "worker name",
                format!(
                    "is {} bytes, the limit is {MAX_WORKER_NAME_LEN} (the owner id adds {WORKER_SUFFIX_LEN})",
                    self.name.len()
                ),
            ));
        }
        validate::duration_ms("scheduler period", self.schedule_every)?;
        if let Some(t) = self.job_timeout {
            validate::duration_ms("job timeout", t)?;
        }
        validate::positive("concurrency", self.concurrency)?;
        if self.concurrency > MAX_CONCURRENCY {
            return Err(Error::invalid(
                "concurrency",
                format!("{} is more than {MAX_CONCURRENCY}", self.concurrency),
            ));
        }
        validate::positive("batch size", self.batch_size)?;
        if let Some(hb) = self.heartbeat_every {
            validate::duration_ms("heartbeat period", hb)?;
            if hb >= lease_ttl {
                return Err(Error::invalid(
                    "heartbeat period",
                    "must be shorter than the lease TTL",
                ));
            }
        }
        crate::backoff::Backoff::new(self.poll_min, self.poll_max)?;
        if i64::try_from(self.shutdown_deadline.as_millis()).is_err() {
            return Err(Error::invalid("shutdown deadline", "is too long"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_validated() {
        assert!(QueueOptions::default().validate().is_ok());
        assert!(QueueOptions::default().max_attempts(0).validate().is_err());
        assert!(
            QueueOptions::default()
                .lease_ttl(Duration::ZERO)
                .validate()
                .is_err()
        );
        assert!(
            EnqueueOptions::default()
                .max_attempts(0)
                .validate()
                .is_err()
        );
        assert!(EnqueueOptions::default().dedupe_key("").validate().is_err());
        let ttl = Duration::from_secs(3);
        assert!(WorkerOptions::default().validate(ttl).is_ok());
        assert!(
            WorkerOptions::default()
                .concurrency(0)
                .validate(ttl)
                .is_err()
        );
        assert!(
            WorkerOptions::default()
                .heartbeat_every(Duration::from_secs(3))
                .validate(ttl)
                .is_err()
        );
    }

    /// A job timeout is at least a millisecond and fits in milliseconds; its error text.
    #[test]
    fn the_job_timeout_is_validated() {
        let ttl = Duration::from_secs(3);
        assert!(
            WorkerOptions::default()
                .job_timeout(Duration::from_secs(60))
                .validate(ttl)
                .is_ok()
        );
        for bad in [Duration::ZERO, Duration::from_micros(10), Duration::MAX] {
            assert!(
                matches!(
                    WorkerOptions::default().job_timeout(bad).validate(ttl),
                    Err(Error::InvalidInput {
                        what: "job timeout",
                        ..
                    })
                ),
                "{bad:?} was accepted"
            );
        }
        assert_eq!(
            timed_out_error(Duration::from_secs(2)),
            "timed out after 2s"
        );
        assert_eq!(
            timed_out_error(Duration::from_millis(1500)),
            "timed out after 1500ms"
        );
    }

    /// Session 15: `concurrency(usize::MAX)` passed validation, and the spawned worker
    /// then started handler slots until the process ran out of memory.
    #[test]
    fn concurrency_is_bounded() {
        let ttl = Duration::from_secs(3);
        assert!(
            WorkerOptions::default()
                .concurrency(MAX_CONCURRENCY)
                .validate(ttl)
                .is_ok()
        );
        for n in [MAX_CONCURRENCY + 1, usize::MAX] {
            assert!(
                matches!(
                    WorkerOptions::default().concurrency(n).validate(ttl),
                    Err(Error::InvalidInput {
                        what: "concurrency",
                        ..
                    })
                ),
                "{n} handlers were accepted"
            );
        }
    }

    /// Session 15: a worker name of 504 to 512 bytes passed validation, but the owner id
    /// (the name and its 9-byte random suffix) was over `MAX_NAME_LEN`, so `spawn`
    /// returned a worker whose every claim failed with `InvalidInput` (counted in
    /// `claim_errors`, nothing claimed, nothing reported to the caller).
    #[test]
    fn a_worker_name_leaves_room_for_the_owner_suffix() {
        let ttl = Duration::from_secs(3);
        let longest = "w".repeat(MAX_WORKER_NAME_LEN);
        assert!(
            WorkerOptions::default()
                .name(&longest)
                .validate(ttl)
                .is_ok()
        );
        let owner = format!("{longest}-{:08x}", u32::MAX);
        assert_eq!(owner.len(), MAX_WORKER_NAME_LEN + WORKER_SUFFIX_LEN);
        assert!(validate::name("owner", &owner).is_ok());
        for len in [MAX_WORKER_NAME_LEN + 1, validate::MAX_NAME_LEN] {
            assert!(
                matches!(
                    WorkerOptions::default().name("w".repeat(len)).validate(ttl),
                    Err(Error::InvalidInput {
                        what: "worker name",
                        ..
                    })
                ),
                "a {len}-byte worker name was accepted"
            );
        }
    }
}
