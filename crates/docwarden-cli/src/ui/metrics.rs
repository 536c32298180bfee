//! `GET /metrics`: Prometheus text from the `metrics` facade and its Prometheus exporter.
//!
//! At each scrape the gauges are read from the database (jobs by queue and state, the
//! oldest due job's wait, expired leases, held locks and their holders), then everything
//! the process's recorder holds is rendered: those gauges, the dashboard's own counters,
//! and any series the library records in the same process ([`docwarden::observe::SERIES`],
//! for example when `docwarden demo --ui` runs workers next to the dashboard). Histograms whose name ends in
//! `_seconds` are rendered as Prometheus histograms with [`BUCKETS`].
//!
//! **Limits:** a series is never removed: a queue that disappears keeps its last gauges
//! until the process restarts. The recorder is process-global: the first caller installs
//! it; a process that installed another recorder gets no `/metrics` (an error says so).

use std::sync::OnceLock;

use docwarden::clock::TimeSource;
use docwarden::queue::format::field;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use mongodb::Database;

/// Histogram buckets (seconds) for every `*_seconds` histogram: the library's (claim-to-start
/// waits and run durations of jobs, lock hand-off waits), also used for scrape times.
pub(crate) const BUCKETS: [f64; 14] = docwarden::observe::BUCKETS;

static HANDLE: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();

/// The process's Prometheus recorder, installed on first use.
///
/// # Errors
/// Another `metrics` recorder was installed first.
pub(crate) fn handle() -> anyhow::Result<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".to_owned()), &BUCKETS)
                .and_then(PrometheusBuilder::install_recorder)
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| anyhow::anyhow!("cannot install the metrics recorder: {e}"))
}

/// Describes every series `/metrics` can show, so each gets its `# HELP` line.
///
/// The worker-side series (claims, completions, failures, lease losses, claim-to-start
/// and run durations, lock acquisitions and hand-off waits) are the library's
/// [`docwarden::observe::SERIES`], described by [`docwarden::observe::describe`]; they
/// show whenever they are recorded in this process (for example by `docwarden demo
/// --ui`'s workers).
pub(crate) fn describe() {
    docwarden::observe::describe();
    metrics::describe_gauge!(
        "docwarden_jobs",
        "Jobs by queue and state, read at scrape time."
    );
    metrics::describe_gauge!(
        "docwarden_queue_oldest_due_seconds",
        "How long the oldest due job (ready or retrying) has waited, read at scrape time."
    );
    metrics::describe_gauge!(
        "docwarden_queue_expired_leases",
        "Running jobs whose lease certainly expired (the next claim sweeps them)."
    );
    metrics::describe_gauge!(
        "docwarden_ui_counts_age_seconds",
        "Age of the queue counts a scrape reports: they are read again once older than --counts-every (1 s) and 20 times what reading them took."
    );
    metrics::describe_gauge!(
        "docwarden_locks",
        "Leases in a lock collection by status (held, expired), read at scrape time."
    );
    metrics::describe_gauge!(
        "docwarden_lock_holders",
        "Distinct owners holding an unexpired lease in a lock collection."
    );
    metrics::describe_counter!(
        "docwarden_ui_requests_total",
        "Pages and endpoints served by the dashboard."
    );
    metrics::describe_counter!(
        "docwarden_ui_actions_total",
        "Actions posted to the dashboard, by action and outcome (done, refused_*)."
    );
    metrics::describe_counter!(
        "docwarden_ui_live_fallbacks_total",
        "Times the live updates fell back from a change stream to polling."
    );
    metrics::describe_gauge!(
        "docwarden_ui_live_listeners",
        "Open live-update connections."
    );
    metrics::describe_histogram!(
        "docwarden_ui_scrape_seconds",
        metrics::Unit::Seconds,
        "Time to read the gauges from the database for one scrape."
    );
}

/// Reads the gauges from the database and renders the recorder.
pub(crate) async fn scrape(
    db: &Database,
    time: &TimeSource,
    catalog: &super::data::Catalog,
    kinds: &super::KindNames,
    snapshots: &super::snapshot::Snapshots,
    listeners: usize,
) -> anyhow::Result<String> {
    let handle = handle()?;
    let started = std::time::Instant::now();
    for c in &catalog.queues {
        // Every named queue of the collection, labelled as the workers label theirs
        // (`JobQueue::metrics_label`); the counts are the collection's paced snapshot
        // (`ui/snapshot.rs`).
        let snapshot = snapshots
            .get(db, time, c, super::snapshot::Stale::Wait)
            .await?;
        metrics::gauge!("docwarden_ui_counts_age_seconds", "collection" => c.clone())
            .set(snapshot.at.elapsed().as_secs_f64());
        for counts in &snapshot.queues {
            let q = counts.handle.metrics_label().to_owned();
            let stats = &counts.stats;
            for s in super::data::state_counts(stats) {
                metrics::gauge!("docwarden_jobs", "queue" => q.clone(), field::STATE => s.state)
                    .set(count(s.count));
            }
            metrics::gauge!("docwarden_queue_oldest_due_seconds", "queue" => q.clone())
                .set(stats.oldest_due_ms.map_or(0.0, ms_to_secs));
            metrics::gauge!("docwarden_queue_expired_leases", "queue" => q.clone())
                .set(count(stats.expired_running));
        }
    }
    for l in catalog.locks.iter().filter(|l| !kinds.contains(l)) {
        // The collection's paced snapshot: one aggregation, not a listing.
        let snapshot = snapshots
            .leases(db, time, l, super::snapshot::Stale::Wait)
            .await?;
        metrics::gauge!("docwarden_ui_counts_age_seconds", "collection" => l.clone())
            .set(snapshot.at.elapsed().as_secs_f64());
        let counts = snapshot.counts;
        metrics::gauge!("docwarden_locks", "collection" => l.clone(), "status" => "held")
            .set(count(counts.held));
        metrics::gauge!("docwarden_locks", "collection" => l.clone(), "status" => "expired")
            .set(count(counts.expired));
        metrics::gauge!("docwarden_lock_holders", "collection" => l.clone())
            .set(count(counts.holders));
    }
    metrics::gauge!("docwarden_ui_live_listeners").set(count_usize(listeners));
    metrics::histogram!("docwarden_ui_scrape_seconds").record(started.elapsed().as_secs_f64());
    handle.run_upkeep();
    Ok(handle.render())
}

#[allow(clippy::cast_precision_loss)]
fn count(n: u64) -> f64 {
    // Exact below 2^53 jobs.
    n as f64
}

fn count_usize(n: usize) -> f64 {
    count(u64::try_from(n).unwrap_or(u64::MAX))
}

#[allow(clippy::cast_precision_loss)]
fn ms_to_secs(ms: i64) -> f64 {
    ms as f64 / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker-side series recorded in the dashboard's process shows on `/metrics`, a
    /// `*_seconds` one as a histogram with buckets, with the dashboard's help text.
    #[test]
    fn worker_series_recorded_in_process_are_rendered() -> anyhow::Result<()> {
        let handle = handle()?;
        describe();
        metrics::histogram!("docwarden_queue_run_seconds", "queue" => "jobs", "outcome" => "succeeded") // not a stored field
            .record(0.02);
        metrics::counter!("docwarden_queue_claims_total", "queue" => "jobs").increment(3);
        handle.run_upkeep();
        let text = handle.render();
        assert!(
            text.contains("# TYPE docwarden_queue_run_seconds histogram"),
            "{text}"
        );
        assert!(
            text.contains(
                "docwarden_queue_run_seconds_bucket{queue=\"jobs\",outcome=\"succeeded\",le=\"0.025\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("docwarden_queue_claims_total{queue=\"jobs\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("# HELP docwarden_queue_claims_total Jobs claimed"),
            "{text}"
        );
        Ok(())
    }
}
