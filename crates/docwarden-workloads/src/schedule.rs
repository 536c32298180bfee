//! Periodic jobs (issue 15, item 1): one interval schedule ticking every [`EVERY`], run
//! by the scheduler of every worker at once ([`WorkerOptions::run_schedules`]), under
//! worker kills and pauses. Checked: every tick from the schedule's creation to its
//! `last_tick` has exactly one job (none lost, none twice), no job belongs to a time
//! that is not a tick, and `last_tick` kept up with the run.
//!
//! Safe mode: each tick's job has the deterministic `_id` of (schedule, tick). Control
//! ([`Mode::Control`]): a random `_id` (`Safeguard::ScheduleTickId`), so schedulers that
//! race for one tick both enqueue it.

use std::collections::BTreeMap;
use std::time::Duration;

use docwarden::check::Violation;
use docwarden::queue::format::{field, schedule_field as sf};
use docwarden::queue::{
    JobQueue, MissedTicks, QueueOptions, Safeguard, Schedule, ScheduleSpec, WorkerOptions,
};
use futures::TryStreamExt;
use mongodb::bson::{Document, doc};

use crate::Mode;

/// The queue collection of the workload.
pub const COLLECTION: &str = "verify_schedule";
/// The named queue the schedule enqueues into.
pub const QUEUE: &str = "periodic";
/// The schedule's name.
pub const SCHEDULE: &str = "verify-tick";
/// The schedule's interval.
pub const EVERY: Duration = Duration::from_secs(1);
/// Ticks the schedulers may catch up after everyone was stopped (all of a run's).
const CATCH_UP: u32 = 10_000;

/// The names of the workload's operations in histories.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A worker's scheduler counts at its graceful shutdown.
    Report,
    /// The final clean scheduler pass.
    Pass,
}

impl Op {
    /// The name in histories and reports.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Op::Report => "report",
            Op::Pass => "pass",
        }
    }
}

/// The queue options of `mode`: the control switches the deterministic tick `_id` off.
#[must_use]
pub fn queue_options(mode: Mode) -> QueueOptions {
    let o = QueueOptions::default().queue(QUEUE);
    match mode {
        Mode::Safe => o,
        Mode::Control => o.unsafe_without(Safeguard::ScheduleTickId),
    }
}

/// The worker options: the scheduler on, a pass every 10 ms (so that schedulers race
/// for each tick), quick polls.
#[must_use]
pub fn worker_options(name: String) -> WorkerOptions {
    WorkerOptions::default()
        .name(name)
        .concurrency(2)
        .run_schedules(true)
        .schedule_every(Duration::from_millis(10))
        .poll(Duration::from_millis(10), Duration::from_millis(200))
}

/// Creates (or replaces) the workload's schedule: every [`EVERY`], catching up every
/// missed tick, so a tick is never skipped on purpose.
///
/// # Errors
/// A database error.
pub async fn setup(queue: &JobQueue) -> docwarden::Result<()> {
    queue
        .schedule(
            &Schedule::new(
                SCHEDULE,
                ScheduleSpec::every(EVERY)?,
                doc! { "periodic": true },
            )
            .missed(MissedTicks::CatchUp(CATCH_UP)),
        )
        .await
}

/// What the final read saw.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    /// The schedule's anchor (creation), ms.
    pub anchor_ms: i64,
    /// Its `last_tick`, ms.
    pub last_tick_ms: i64,
    /// Jobs per tick (ms).
    pub per_tick: BTreeMap<i64, u64>,
}

/// Reads the schedule and its jobs.
///
/// # Errors
/// A database error, or a missing schedule.
pub async fn observe(queue: &JobQueue) -> anyhow::Result<Observed> {
    let db = queue
        .collection()
        .client()
        .database(&queue.collection().namespace().db);
    let stored = db
        .collection::<Document>(&format!(
            "{COLLECTION}{}",
            docwarden::queue::format::SCHEDULES_SUFFIX
        ))
        .find_one(doc! { sf::ID: SCHEDULE })
        .await?
        .ok_or_else(|| anyhow::anyhow!("the schedule is gone"))?;
    let jobs: Vec<Document> = queue
        .collection()
        .find(doc! { field::SCHEDULE: SCHEDULE })
        .await?
        .try_collect()
        .await?;
    let mut per_tick = BTreeMap::new();
    for j in &jobs {
        *per_tick
            .entry(j.get_datetime(field::TICK)?.timestamp_millis())
            .or_default() += 1;
    }
    Ok(Observed {
        anchor_ms: stored.get_datetime(sf::ANCHOR)?.timestamp_millis(),
        last_tick_ms: stored.get_datetime(sf::LAST_TICK)?.timestamp_millis(),
        per_tick,
    })
}

/// The checker: `lost-tick` (a tick in `(anchor, last_tick]` without a job),
/// `duplicate-tick` (a tick with more than one job), `stray-tick` (a job whose tick is
/// not a tick in that range), `lagging-schedule` (`last_tick` more than two intervals
/// behind `read_at_ms`, the server time of the final read after a clean pass).
#[must_use]
pub fn check(o: &Observed, read_at_ms: i64) -> Vec<Violation> {
    let every = i64::try_from(EVERY.as_millis()).unwrap_or(1000);
    let mut v = Vec::new();
    let mut t = o.anchor_ms + every;
    while t <= o.last_tick_ms {
        if !o.per_tick.contains_key(&t) {
            v.push(Violation::new(
                "lost-tick",
                t.to_string(),
                "no job was enqueued for this tick",
            ));
        }
        t += every;
    }
    for (tick, n) in &o.per_tick {
        if *n > 1 {
            v.push(Violation::new(
                "duplicate-tick",
                tick.to_string(),
                format!("{n} jobs for one tick"),
            ));
        }
        if (tick - o.anchor_ms) % every != 0 || *tick <= o.anchor_ms || *tick > o.last_tick_ms {
            v.push(Violation::new(
                "stray-tick",
                tick.to_string(),
                "a job for a time that is not a tick up to last_tick",
            ));
        }
    }
    if read_at_ms - o.last_tick_ms > 2 * every {
        v.push(Violation::new(
            "lagging-schedule",
            SCHEDULE,
            format!(
                "last_tick is {} ms behind the final read",
                read_at_ms - o.last_tick_ms
            ),
        ));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checker_finds_lost_duplicate_and_stray_ticks() {
        let mut o = Observed {
            anchor_ms: 0,
            last_tick_ms: 3_000,
            per_tick: BTreeMap::new(),
        };
        o.per_tick.insert(1_000, 1);
        o.per_tick.insert(2_000, 2);
        o.per_tick.insert(2_500, 1);
        let kinds: Vec<&str> = check(&o, 3_100).iter().map(|v| v.kind).collect();
        assert_eq!(kinds, vec!["lost-tick", "duplicate-tick", "stray-tick"]);
        o.per_tick = [(1_000, 1), (2_000, 1), (3_000, 1)].into_iter().collect();
        assert!(check(&o, 3_100).is_empty());
        assert_eq!(check(&o, 9_000).len(), 1);
    }
}
