//! The cost of queue limits (issue 15): claim + complete of a backlog through a
//! concurrency-limited and a rate-limited queue, each as a ratio to the unlimited queue
//! measured in the same run (in the row's name; the `ratio` column stays the ratio to
//! `update_one`). The limits are set high (64 running per key, 1,000,000 starts per second
//! per key) so that the rows measure what the limit costs (a permit taken and released, a
//! rate admission per job), not the limit itself.

use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{EnqueueOptions, JobQueue, LimitOptions, QueueOptions};
use mongodb::Database;
use mongodb::bson::{Bson, doc};

use super::{BenchRow, Load, measure};

/// The module name for `--only`.
pub(crate) const NAME: &str = "limits"; // not a stored field: the module name

/// Jobs claimed per call.
const BATCH: usize = 8;
/// Tenants (keys) the backlog is spread over.
const KEYS: usize = 16;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Limit {
    None,
    Concurrency,
    Rate,
}

pub(crate) async fn run(db: &Database, load: &Load) -> anyhow::Result<Vec<BenchRow>> {
    let mut rows = Vec::new();
    let mut unlimited = f64::NAN;
    for (name, limit) in [
        (
            "queue claim+complete ×8 (unlimited, limits baseline)",
            Limit::None,
        ),
        (
            "queue claim+complete ×8, concurrency-limited (64/key)",
            Limit::Concurrency,
        ),
        (
            "queue claim+complete ×8, rate-limited (1M/s/key)",
            Limit::Rate,
        ),
    ] {
        let mut row = one(db, load, name, limit).await?;
        if limit == Limit::None {
            unlimited = row.ops_per_sec;
        } else {
            row.name = format!(
                "{} = {:.2}× unlimited",
                row.name,
                row.ops_per_sec / unlimited
            );
        }
        rows.push(row);
    }
    Ok(rows)
}

async fn one(db: &Database, load: &Load, name: &str, limit: Limit) -> anyhow::Result<BenchRow> {
    let time = TimeSource::server(db.client().clone(), ClockOptions::default())?;
    let limits = match limit {
        Limit::None => LimitOptions::default(),
        Limit::Concurrency => LimitOptions::default().key_concurrency(64),
        Limit::Rate => LimitOptions::default().rate(1_000_000, Duration::from_secs(1)),
    };
    let coll = format!("bench_limits_{}", limit as u8);
    let queue = JobQueue::open(db, &coll, time, QueueOptions::default().limits(limits)).await?;
    // A backlog larger than the run can drain.
    let jobs = 4_000 * load.duration.as_secs().max(1);
    load.progress
        .set_message(format!("{name}: enqueueing {jobs} jobs"));
    let mut left = usize::try_from(jobs)?;
    let mut n = 0_usize;
    while left > 0 {
        let batch: Vec<_> = (0..left.min(1_000))
            .map(|_| {
                n += 1;
                let key = format!("tenant-{}", n % KEYS);
                let opts = match limit {
                    Limit::None => EnqueueOptions::default(),
                    Limit::Concurrency => EnqueueOptions::default().concurrency_key(key),
                    Limit::Rate => EnqueueOptions::default().rate_key(key),
                };
                (Bson::Document(doc! { "n": 1 }), opts)
            })
            .collect();
        left -= batch.len();
        queue.enqueue_many(batch).await?;
    }
    measure(name, load, move |worker| {
        let queue = queue.clone();
        async move {
            let owner = format!("bench-limits-{worker}");
            let claimed = match limit {
                Limit::None => queue.claim_batch(&owner, BATCH).await?,
                Limit::Concurrency | Limit::Rate => queue.claim_limited(&owner, BATCH).await?,
            };
            let done: Vec<_> = claimed.iter().map(|j| (j.clone(), Bson::Null)).collect();
            queue.complete_many(&done).await?;
            for job in &claimed {
                queue.release_permits(job).await;
            }
            Ok(u64::try_from(claimed.len())?)
        }
    })
    .await
}
