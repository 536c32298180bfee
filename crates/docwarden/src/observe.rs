//! Observability: the metrics a worker process records, and the spans it opens.
//!
//! **Metrics.** docwarden records its worker-side series through the [`metrics`] facade:
//! every counter and histogram in [`SERIES`] (names, kinds, labels and help text live
//! here and nowhere else; `docwarden ui` renders the same list). The library installs no
//! recorder: a process that installs one (for example `metrics-exporter-prometheus`, or
//! `serve_prometheus` with the `prometheus` feature) gets the series; a process that
//! does not pays a call into the facade's no-op recorder per event (one small label
//! allocation), nothing else. Call [`describe`] once after installing a recorder so the
//! series carry their help text.
//!
//! What each counter counts, exactly once per event:
//! - `docwarden_queue_claims_total`: each job a claim took (a batch claim of 64 counts
//!   64), counted when the claimed document came back under the claim's token.
//! - `docwarden_queue_completions_total` / `docwarden_queue_failures_total{outcome}`: a
//!   fenced completion / failure the server acknowledged as applied (a bulk retried after
//!   a lost reply counts what the read-back shows applied, once).
//! - `docwarden_queue_lease_losses_total`: a fenced transition or heartbeat of a job the
//!   server refused because the claim no longer held it.
//! - `docwarden_lock_acquisitions_total{outcome}`: each try to take a lock that acquired
//!   (`acquired`) or found it held (`busy`), for every lock kind: a lease
//!   ([`LockCollection::try_acquire`]; a blocking `acquire` counts each of its tries), a
//!   semaphore permit, a read or write lock, and a document lock.
//!
//! Labels: `queue` is [`JobQueue::metrics_label`] (the collection's name for its default
//! queue, `<collection>/<queue>` for a named queue), `collection` the lock collection's.
//!
//! **Limits.** Counters are per process and start at zero with it. A job whose
//! heartbeat is refused while its finished handler's transition is still queued counts
//! two lease losses (both writes were refused). Durations are measured by the process's
//! monotonic clock, not the server's.
//!
//! **Spans** (by [`tracing`]): `job` (info) around each handler run, with `id`, `queue`,
//! `attempt` and `token`; `claim`/`claim_batch` (debug) with the queue and owner;
//! `settle` and `heartbeat` (debug) on each bulk of fenced transitions, with the number
//! of jobs and the numbers completed, failed and lost; `try_acquire`, `acquire`, `renew`
//! and `release` (info) on lock operations with `collection`, `resource`, `owner` and
//! `token` (on an acquire, recorded once known). Disabled spans cost a callsite check.
//!
//! [`LockCollection::try_acquire`]: crate::lock::LockCollection::try_acquire
//! [`JobQueue::metrics_label`]: crate::queue::JobQueue::metrics_label

use std::time::{Duration, Instant};

use crate::error::Error;
use crate::queue::ClaimedJob;
use crate::queue::FailOutcome;
use crate::queue::transition::{Held, Settled, Transition};

/// A series docwarden records: name, kind, help text (which names its labels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Series {
    /// The Prometheus name.
    pub name: &'static str,
    /// Counter or histogram.
    pub kind: SeriesKind,
    /// The `# HELP` text.
    pub help: &'static str,
}

/// A series' kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeriesKind {
    /// Only goes up.
    Counter,
    /// A distribution, in seconds.
    Histogram,
}

/// Jobs claimed. Label `queue`.
pub const CLAIMS: &str = "docwarden_queue_claims_total";
/// Jobs completed. Label `queue`.
pub const COMPLETIONS: &str = "docwarden_queue_completions_total";
/// Failed attempts. Labels `queue`, `outcome` (`retrying`, `dead`).
pub const FAILURES: &str = "docwarden_queue_failures_total";
/// Fenced writes refused because the claim was lost. Label `queue`.
pub const LEASE_LOSSES: &str = "docwarden_queue_lease_losses_total";
/// Claim reply to handler start, seconds. Label `queue`.
pub const CLAIM_TO_START: &str = "docwarden_queue_claim_to_start_seconds";
/// Handler run time, seconds. Labels `queue`, `outcome`.
pub const RUN: &str = "docwarden_queue_run_seconds";
/// Lock acquire tries. Labels `collection`, `outcome` (`acquired`, `busy`).
pub const LOCK_ACQUISITIONS: &str = "docwarden_lock_acquisitions_total";
/// From an `acquire` call to holding the lease, seconds. Label `collection`.
pub const LOCK_HANDOFF_WAIT: &str = "docwarden_lock_handoff_wait_seconds";

/// Every series docwarden records in a worker process.
pub const SERIES: [Series; 8] = [
    Series {
        name: CLAIMS,
        kind: SeriesKind::Counter,
        help: "Jobs claimed (a batch claim counts each job).",
    },
    Series {
        name: COMPLETIONS,
        kind: SeriesKind::Counter,
        help: "Jobs completed by their claim (succeeded), counted when the fenced write applied.",
    },
    Series {
        name: FAILURES,
        kind: SeriesKind::Counter,
        help: "Failed attempts, by outcome (retrying, dead), counted when the fenced write applied.",
    },
    Series {
        name: LEASE_LOSSES,
        kind: SeriesKind::Counter,
        help: "Fenced job transitions or heartbeats refused because the claim was lost.",
    },
    Series {
        name: CLAIM_TO_START,
        kind: SeriesKind::Histogram,
        help: "From a claim's reply to its handler starting.",
    },
    Series {
        name: RUN,
        kind: SeriesKind::Histogram,
        help: "Handler run time, by outcome (succeeded, failed, timed_out, snoozed, released, lease_lost).",
    },
    Series {
        name: LOCK_ACQUISITIONS,
        kind: SeriesKind::Counter,
        help: "Lock acquire tries, by outcome (acquired, busy).",
    },
    Series {
        name: LOCK_HANDOFF_WAIT,
        kind: SeriesKind::Histogram,
        help: "From an acquire call to holding the lease (the wait for the previous holder).",
    },
];

/// Histogram buckets (seconds) suited to every `*_seconds` series: claim-to-start waits,
/// run durations, lock hand-off waits.
pub const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Registers the help text (and the unit of histograms) of every series in [`SERIES`]
/// with the installed recorder. Call it once after installing one; harmless otherwise.
pub fn describe() {
    for s in SERIES {
        match s.kind {
            SeriesKind::Counter => metrics::describe_counter!(s.name, s.help),
            SeriesKind::Histogram => {
                metrics::describe_histogram!(s.name, metrics::Unit::Seconds, s.help);
            }
        }
    }
}

/// Installs a Prometheus recorder for the process, with [`BUCKETS`] for the
/// `*_seconds` series and [`describe`] done, that serves `GET /metrics` (any path) on
/// `addr` from a background task of the current tokio runtime. Returns the handle,
/// which also renders the text on demand.
///
/// ```no_run
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// let handle = docwarden::observe::serve_prometheus("127.0.0.1:9464".parse()?)?;
/// // … run workers and locks; `curl 127.0.0.1:9464/metrics` shows their series.
/// # drop(handle); Ok(()) }
/// ```
///
/// # Errors
/// Another recorder is installed already; there is no tokio runtime; `addr` cannot be
/// bound.
#[cfg(feature = "prometheus")]
pub fn serve_prometheus(
    addr: std::net::SocketAddr,
) -> Result<metrics_exporter_prometheus::PrometheusHandle, metrics_exporter_prometheus::BuildError>
{
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let builder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".to_owned()), &BUCKETS)?
        .with_http_listener(addr);
    let (recorder, exporter) = builder.build()?;
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder)
        .map_err(metrics_exporter_prometheus::BuildError::FailedToSetGlobalRecorder)?;
    tokio::spawn(async move {
        if let Err(e) = exporter.await {
            tracing::warn!(error = ?e, "the Prometheus listener stopped");
        }
    });
    describe();
    Ok(handle)
}

fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// `n` jobs of `queue` claimed.
pub(crate) fn claimed(queue: &str, n: usize) {
    metrics::counter!(CLAIMS, "queue" => queue.to_owned()).increment(count(n));
}

/// A fenced write of one job of `queue` refused: the claim was lost.
pub(crate) fn lease_lost(queue: &str) {
    metrics::counter!(LEASE_LOSSES, "queue" => queue.to_owned()).increment(1);
}

/// One job of `queue` completed (the write applied).
pub(crate) fn completed(queue: &str) {
    metrics::counter!(COMPLETIONS, "queue" => queue.to_owned()).increment(1);
}

/// One failure of a job of `queue` applied, with its outcome.
pub(crate) fn failed(queue: &str, outcome: &FailOutcome) {
    let outcome = match outcome {
        FailOutcome::Dead => "dead",
        FailOutcome::Retrying { .. } => "retrying",
    };
    metrics::counter!(FAILURES, "queue" => queue.to_owned(), "outcome" => outcome).increment(1);
}

/// A bulk of final transitions of `queue` settled: counts each job's applied outcome
/// (and refusals) once, and records the totals on the current (`settle`) span.
pub(crate) fn settled(queue: &str, items: &[(ClaimedJob, Transition)], outcomes: &[Settled]) {
    let (mut done, mut failed_n, mut lost) = (0_usize, 0_usize, 0_usize);
    for ((_, t), outcome) in items.iter().zip(outcomes) {
        match (t, outcome) {
            (Transition::Complete(_), Ok(_)) => done += 1,
            (Transition::Fail(_), Ok(Some(o))) => {
                failed_n += 1;
                failed(queue, o);
            }
            (_, Err(Error::LeaseLost { .. })) => lost += 1,
            _ => {}
        }
    }
    if done > 0 {
        metrics::counter!(COMPLETIONS, "queue" => queue.to_owned()).increment(count(done));
    }
    if lost > 0 {
        metrics::counter!(LEASE_LOSSES, "queue" => queue.to_owned()).increment(count(lost));
    }
    let span = tracing::Span::current();
    span.record("completed", done);
    span.record("failed", failed_n);
    span.record("lost", lost);
}

/// A heartbeat bulk of `queue` answered: counts the jobs whose claim was lost (not those
/// cancelled under their claim) and records it on the current (`heartbeat`) span.
pub(crate) fn heartbeats(queue: &str, held: &[Held]) {
    let lost = held.iter().filter(|h| **h == Held::Lost).count();
    if lost > 0 {
        metrics::counter!(LEASE_LOSSES, "queue" => queue.to_owned()).increment(count(lost));
    }
    tracing::Span::current().record("lost", lost);
}

/// A worker's handler slot takes `job` of `queue`: records the claim-to-start wait and
/// returns the start instant for [`ran`].
pub(crate) fn started(queue: &str, job: &ClaimedJob) -> Instant {
    let now = Instant::now();
    metrics::histogram!(CLAIM_TO_START, "queue" => queue.to_owned())
        .record(now.saturating_duration_since(job.claimed_at()));
    now
}

/// A handler of `queue` started at `started` ended with `transition` (`None`: dropped,
/// its lease lost or its cancel grace over); `timed_out`: it was dropped at
/// `WorkerOptions::job_timeout` (its transition is then the failure), labelled
/// `timed_out` rather than `failed`.
pub(crate) fn ran(queue: &str, started: Instant, transition: Option<&Transition>, timed_out: bool) {
    let outcome = match transition {
        Some(Transition::Fail(_)) if timed_out => "timed_out",
        Some(Transition::Complete(_)) => "succeeded",
        Some(Transition::Fail(_)) => "failed",
        Some(Transition::Snooze(_)) => "snoozed",
        Some(Transition::Release) => "released",
        None => "lease_lost",
    };
    metrics::histogram!(RUN, "queue" => queue.to_owned(), "outcome" => outcome)
        .record(started.elapsed());
}

/// A lock of `collection` acquired — a lease, a semaphore permit, a read lease or a
/// document lock — with fencing token `token` where it has one (recorded on the current
/// span too).
pub(crate) fn lock_acquired(collection: &str, token: Option<i64>) {
    metrics::counter!(LOCK_ACQUISITIONS, "collection" => collection.to_owned(), "outcome" => "acquired")
        .increment(1);
    if let Some(token) = token {
        tracing::Span::current().record("token", token);
    }
}

/// A lock of `collection` found held by someone else (a full semaphore, a writer in the
/// way of a reader, a locked document).
pub(crate) fn lock_busy(collection: &str) {
    metrics::counter!(LOCK_ACQUISITIONS, "collection" => collection.to_owned(), "outcome" => "busy")
        .increment(1);
}

/// A waiting acquire of a lock of `collection` (`acquire`, a semaphore's `acquire`, a
/// read lease's `read`) called at `called` now holds it, with fencing token `token`
/// where it has one (recorded on the current span).
pub(crate) fn lock_handoff(collection: &str, called: Instant, token: Option<i64>) {
    let waited: Duration = called.elapsed();
    metrics::histogram!(LOCK_HANDOFF_WAIT, "collection" => collection.to_owned()).record(waited);
    if let Some(token) = token {
        tracing::Span::current().record("token", token);
    }
}
