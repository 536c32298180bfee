//! Options of the queue handle, of one enqueue, and of a worker; each validated once.

use std::time::Duration;

use mongodb::bson::DateTime;
use mongodb::options::WriteConcern;

use super::limit::{JobLimits, LimitOptions};
use crate::error::{Error, Result};
use crate::validate;

/// Most claim partitions a queue may have ([`QueueOptions::partitions`]).
pub const MAX_PARTITIONS: u32 = 1024;

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
    /// A limited claim takes the permits its job's concurrency key and queue limit name.
    /// Off: it claims limited jobs without permits.
    ConcurrencyLimit,
    /// A limited claim is admitted by the rate document of its job's rate key. Off: every
    /// start is admitted (and recorded).
    RateLimit,
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

    pub(crate) fn validate(&self) -> Result<()> {
        validate::duration_ms("lease ttl", self.lease_ttl)?;
        if self.max_attempts == 0 {
            return Err(Error::invalid("max attempts", "must be at least 1"));
        }
        crate::backoff::Backoff::new(self.retry_base, self.retry_max)?;
        validate::duration_ms("reap interval", self.reap_interval)?;
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
    /// Concurrency key, rate key and fairness key (`queue/limit.rs`).
    pub limits: JobLimits,
}

impl Default for EnqueueOptions {
    fn default() -> Self {
        Self {
            priority: 0,
            run_at: RunAt::Now,
            max_attempts: None,
            dedupe_key: None,
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

    /// At most N jobs of `key` run at once (N: [`LimitOptions::key_concurrency`] or
    /// [`JobQueue::set_concurrency_limit`](super::JobQueue::set_concurrency_limit)).
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

/// Options of a [`Worker`](super::Worker).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct WorkerOptions {
    /// Worker name stored in `lease.owner`; a random suffix is added. Default "worker".
    pub name: String,
    /// Handlers running at once. Default 4.
    pub concurrency: usize,
    /// Most jobs taken by one claim. The worker claims for all its free handler slots
    /// at once (plus its prefetch), up to this many jobs per claim. Default 64; `1`
    /// claims one job at a time, in strict queue order.
    pub batch_size: usize,
    /// Most jobs held beyond the handler slots: claimed, leased, and waiting in the
    /// worker for a free handler. The worker starts at 0 and doubles its prefetch while
    /// handlers finish faster than a claim comes back (they ran dry with jobs still
    /// due), up to this; it halves it when a claim comes back short. Default 256; `0`
    /// never claims more jobs than free handlers.
    pub prefetch: usize,
    /// Heartbeat period while a handler runs. Default: a third of the lease TTL.
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
}

impl Default for WorkerOptions {
    fn default() -> Self {
        Self {
            name: "worker".into(),
            concurrency: 4,
            batch_size: 64,
            prefetch: 256,
            heartbeat_every: None,
            poll_min: Duration::from_millis(50),
            poll_max: Duration::from_secs(1),
            shutdown_deadline: Duration::from_secs(10),
            change_stream: true,
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

    pub(crate) fn validate(&self, lease_ttl: Duration) -> Result<()> {
        validate::name("worker name", &self.name)?;
        validate::positive("concurrency", self.concurrency)?;
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
}
