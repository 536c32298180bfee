//! Enqueue-to-start latency: how long a job waits between `enqueue` and its handler
//! starting, for an idle worker woken by a change stream versus one that only polls
//! (backing off from 50 ms to 1 s when idle).
//!
//! Jobs are enqueued one at a time with random idle gaps (200–600 ms), so the polling
//! worker has backed off between jobs, as it would in a quiet production queue. A row runs
//! for `--duration`, and a change-stream row for at least 40 jobs.
//!
//! Each mode gives two rows: the latency from the call to `enqueue`, and the part of it
//! after `enqueue` returned (the time the enqueue's own round trip does not explain: the
//! event's way to the worker, its claim by `_id` and the handler's start).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{EnqueueOptions, JobQueue, QueueOptions, Worker, WorkerOptions};
use hdrhistogram::Histogram;
use mongodb::Database;
use mongodb::bson::{Bson, doc, oid::ObjectId};
use tokio::sync::mpsc;

use super::{BenchRow, Load};

/// Samples the change-stream rows take at least, whatever `--duration` (a p50 of the ten
/// samples four seconds give is mostly noise).
const MIN_SAMPLES: u64 = 40;

pub(crate) async fn run(db: &Database, load: &Load) -> anyhow::Result<Vec<BenchRow>> {
    let mut rows = Vec::new();
    for (name, change_stream) in [
        ("enqueue→start latency (change stream)", true),
        ("enqueue→start latency (polling only)", false),
    ] {
        load.progress.set_message(name);
        rows.extend(one(db, load, name, change_stream).await?);
    }
    Ok(rows)
}

async fn one(
    db: &Database,
    load: &Load,
    name: &str,
    change_stream: bool,
) -> anyhow::Result<[BenchRow; 2]> {
    let time = TimeSource::server(db.client().clone(), ClockOptions::default())?;
    let coll = format!(
        "bench_wakeup_{}",
        if change_stream { "stream" } else { "poll" }
    );
    let queue = JobQueue::open(db, &coll, time, QueueOptions::default()).await?;
    let (tx, mut rx) = mpsc::unbounded_channel::<(ObjectId, Instant)>();
    let worker = Worker::spawn(
        queue.clone(),
        WorkerOptions::default()
            .concurrency(1)
            .change_stream(change_stream),
        move |job| {
            let tx = tx.clone();
            async move {
                let _ = tx.send((job.id(), Instant::now()));
                Ok(Bson::Null)
            }
        },
    )?;
    // Let the worker settle into its idle state (stream open, or polling backed off).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sent: Arc<Mutex<HashMap<ObjectId, (Instant, Instant)>>> = Arc::default();
    let mut hist = Histogram::<u64>::new(3)?;
    let mut after_reply = Histogram::<u64>::new(3)?;
    let commands_before = load.commands_sent().await?;
    let started = Instant::now();
    let mut samples = 0_u64;
    let min_samples = if change_stream { MIN_SAMPLES } else { 0 };
    while started.elapsed() < load.duration || samples < min_samples {
        let at = Instant::now();
        let id = queue
            .enqueue(doc! { "t": 1 }, &EnqueueOptions::default())
            .await?
            .created()
            .ok_or_else(|| anyhow::anyhow!("the job was not created"))?;
        let replied = Instant::now();
        sent.lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, (at, replied));
        // Wait for this job to start (at most 5 s), then idle before the next one.
        let deadline = Instant::now() + Duration::from_secs(5);
        while let Ok(Some((started_id, at_start))) = tokio::time::timeout(
            deadline.saturating_duration_since(Instant::now()),
            rx.recv(),
        )
        .await
        {
            let enqueued = sent
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&started_id);
            if let Some((enqueued, replied)) = enqueued {
                let us = |from: Instant| {
                    u64::try_from(at_start.saturating_duration_since(from).as_micros())
                        .unwrap_or(u64::MAX)
                        .max(1)
                };
                hist.record(us(enqueued))?;
                after_reply.record(us(replied))?;
                samples += 1;
            }
            if started_id == id {
                break;
            }
        }
        load.progress.tick();
        tokio::time::sleep(Duration::from_millis(rand::random_range(200..600))).await;
    }
    worker.shutdown().await;
    let elapsed = started.elapsed().as_secs_f64();
    let commands = load.commands_sent().await?.saturating_sub(commands_before);
    #[allow(clippy::cast_precision_loss)]
    let ops_per_sec = samples as f64 / elapsed;
    let row = |name: String, hist: &Histogram<u64>| BenchRow {
        name,
        workers: 1,
        ops: samples,
        ops_per_sec,
        p50_us: hist.value_at_quantile(0.5),
        p99_us: hist.value_at_quantile(0.99),
        ratio: f64::NAN,
        reference_ops_per_sec: f64::NAN,
        round_trips_per_op: super::per_op(commands, samples),
        server_cpu_us_per_op: None,
        client_cpu_us_per_op: None,
        rounds: 1,
        ratios: Vec::new(),
        ratio_min: f64::NAN,
        ratio_max: f64::NAN,
    };
    Ok([
        row(name.to_owned(), &hist),
        row(format!("{name}: after enqueue returned"), &after_reply),
    ])
}
