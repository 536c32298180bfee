//! Queue workloads: jobs/s with `workers` concurrent claimers, for a single claim by
//! `findOneAndUpdate`, a single claim by `updateOne` + fetch by token (the seed's
//! choice), and a batch claim of 16; every job is completed (fenced) before it counts.
//! Producers and the effect are seed 002's (`docwarden_workloads::jobs`).

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{ClaimStrategy, ClaimedJob, JobQueue, QueueOptions};
use docwarden_workloads::Mode;
use docwarden_workloads::jobs::{self, Producer};
use mongodb::Database;
use mongodb::bson::Bson;

use super::{BenchRow, Load, measure};

const BATCH: usize = 16;
/// The backlog the steady-state rows keep.
const STEADY: usize = 100;

/// Keeps about [`STEADY`] jobs due until `stop` is cancelled.
async fn top_up(q: JobQueue, stop: tokio_util::sync::CancellationToken) -> anyhow::Result<()> {
    let mut producer = Producer::new();
    while !stop.is_cancelled() {
        producer.top_up(&q, STEADY).await?;
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    Ok(())
}

async fn prepared(
    db: &Database,
    name: &str,
    strategy: ClaimStrategy,
    jobs: usize,
) -> anyhow::Result<JobQueue> {
    let time = TimeSource::server(db.client().clone(), ClockOptions::default())?;
    let q = JobQueue::open(
        db,
        name,
        time,
        QueueOptions::default().claim_strategy(strategy),
    )
    .await?;
    Producer::new().enqueue(&q, jobs).await?;
    Ok(q)
}

/// Completes a claimed job (seed 002's effect): 1 if the fenced completion applied, 0
/// (and a warning) if the lease was lost — which happens only if two claims took the
/// same job, so the count is printed: it must be 0 on MongoDB.
async fn completed(q: &JobQueue, job: &ClaimedJob) -> anyhow::Result<u64> {
    if jobs::complete(q, job, Bson::Null, Mode::Safe).await? {
        Ok(1)
    } else {
        eprintln!(
            "bench: a completion was refused (lease lost): job {} was claimed twice",
            job.id()
        );
        Ok(0)
    }
}

pub(crate) async fn run(db: &Database, load: &Load) -> anyhow::Result<Vec<BenchRow>> {
    let jobs = usize::try_from(
        load.duration
            .as_secs()
            .saturating_mul(2_000)
            .clamp(2_000, 20_000),
    )?;
    let mut rows = Vec::new();
    for (name, coll, strategy) in [
        (
            "queue claim+complete (findOneAndUpdate)",
            "bench_queue_fam",
            ClaimStrategy::FindOneAndUpdate,
        ),
        (
            "queue claim+complete (updateOne+fetch)",
            "bench_queue_uof",
            ClaimStrategy::UpdateThenFetch,
        ),
    ] {
        let q = prepared(db, coll, strategy, jobs).await?;
        rows.push(
            measure(name, load, move |worker| {
                let q = q.clone();
                async move {
                    match q.claim(&format!("bench-{worker}")).await? {
                        Some(job) => completed(&q, &job).await,
                        None => Ok(0),
                    }
                }
            })
            .await?,
        );
    }
    // Steady state: a producer keeps about STEADY jobs waiting, as in a queue whose
    // producers and consumers are balanced (the usual production shape).
    for (name, batch_size) in [
        (
            "queue claim+complete, steady backlog ~100 (findOneAndUpdate)",
            1,
        ),
        ("queue batch claim(16)+complete, steady backlog ~100", BATCH),
    ] {
        let coll = format!("bench_queue_steady{batch_size}");
        let q = prepared(db, &coll, ClaimStrategy::FindOneAndUpdate, STEADY).await?;
        let stop = tokio_util::sync::CancellationToken::new();
        let producer = tokio::spawn(top_up(q.clone(), stop.clone()));
        let row = measure(name, load, move |worker| {
            let q = q.clone();
            async move {
                let owner = format!("bench-{worker}");
                let mut n = 0;
                if batch_size == 1 {
                    if let Some(job) = q.claim(&owner).await? {
                        n += completed(&q, &job).await?;
                    }
                } else {
                    for job in &q.claim_batch(&owner, batch_size).await? {
                        n += completed(&q, job).await?;
                    }
                }
                Ok(n)
            }
        })
        .await;
        stop.cancel();
        producer.await??;
        rows.push(row?);
    }
    for batch_size in [BATCH, 4 * BATCH] {
        let coll = format!("bench_queue_batch{batch_size}");
        let q = prepared(db, &coll, ClaimStrategy::FindOneAndUpdate, jobs).await?;
        let name = format!("queue batch claim({batch_size})+complete");
        rows.push(
            measure(&name, load, move |worker| {
                let q = q.clone();
                async move {
                    let batch = q
                        .claim_batch(&format!("bench-{worker}"), batch_size)
                        .await?;
                    let mut n = 0;
                    for job in &batch {
                        n += completed(&q, job).await?;
                    }
                    Ok(n)
                }
            })
            .await?,
        );
    }
    Ok(rows)
}
