//! Periodic jobs (issue 15, item 1): 8 schedulers, killed and restarted at random over
//! a few seconds of 1 s interval ticks, enqueue every tick exactly once. Control: with a
//! random `_id` instead of the tick's deterministic one (`Safeguard::ScheduleTickId`),
//! racing schedulers enqueue ticks twice.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::format::{field, schedule_field as sf};
use docwarden::queue::{
    JobQueue, MissedTicks, QueueOptions, Safeguard, Schedule, ScheduleSpec, Scheduler,
};
use docwarden_testkit::TestDb;
use futures::TryStreamExt;
use mongodb::bson::{Document, doc};

struct Ticks {
    /// Ticks from the first after creation to `last_tick`.
    expected: u64,
    /// Ticks with no job.
    lost: u64,
    /// Extra jobs of ticks that have more than one.
    duplicated: u64,
    /// Jobs whose tick is not a tick of the schedule.
    stray: u64,
}

async fn run(name: &str, opts: QueueOptions, seconds: u64) -> anyhow::Result<Ticks> {
    let t = TestDb::new(name).await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time, opts.queue("cron")).await?;
    let every = Duration::from_secs(1);
    q.schedule(
        &Schedule::new(
            "tick",
            ScheduleSpec::every(every)?,
            doc! { "report": "hourly" },
        )
        .missed(MissedTicks::CatchUp(100)),
    )
    .await?;
    let mut schedulers: Vec<Option<Scheduler>> = (0..8)
        .map(|_| Scheduler::spawn(q.clone(), Duration::from_millis(5)).map(Some))
        .collect::<Result<_, _>>()?;
    let started = Instant::now();
    let mut kills = 0;
    while started.elapsed() < Duration::from_secs(seconds) {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let i = rand::random_range(0..schedulers.len());
        if let Some(s) = schedulers[i].take() {
            s.kill().await;
            kills += 1;
        }
        let j = rand::random_range(0..schedulers.len());
        if schedulers[j].is_none() {
            schedulers[j] = Some(Scheduler::spawn(q.clone(), Duration::from_millis(5))?);
        }
    }
    for s in schedulers.into_iter().flatten() {
        s.shutdown().await;
    }
    // One clean pass: ticks left behind by a kill between insert and compare-and-set.
    q.run_due_ticks().await?;
    let stored =
        t.db.collection::<Document>("jobs.schedules")
            .find_one(doc! { sf::ID: "tick" })
            .await?
            .ok_or_else(|| anyhow::anyhow!("no schedule"))?;
    let anchor = stored.get_datetime(sf::ANCHOR)?.timestamp_millis();
    let last = stored.get_datetime(sf::LAST_TICK)?.timestamp_millis();
    let every_ms = i64::try_from(every.as_millis())?;
    let expected = u64::try_from((last - anchor) / every_ms)?;
    let jobs: Vec<Document> = q
        .collection()
        .find(doc! { field::SCHEDULE: "tick" })
        .await?
        .try_collect()
        .await?;
    let mut per_tick: BTreeMap<i64, u64> = BTreeMap::new();
    for j in &jobs {
        *per_tick
            .entry(j.get_datetime(field::TICK)?.timestamp_millis())
            .or_default() += 1;
    }
    let mut lost = 0;
    for k in 1..=i64::try_from(expected)? {
        if !per_tick.contains_key(&(anchor + k * every_ms)) {
            lost += 1;
        }
    }
    let duplicated = per_tick.values().map(|n| n - 1).sum();
    let stray = u64::try_from(
        per_tick
            .keys()
            .filter(|t| (*t - anchor) % every_ms != 0 || **t <= anchor || **t > last)
            .count(),
    )?;
    let listed = q.schedules().await?;
    assert_eq!(listed.len(), 1);
    println!(
        "{name}: {expected} ticks, {} jobs, lost {lost}, duplicated {duplicated}, stray {stray}, scheduler kills {kills}",
        jobs.len()
    );
    Ok(Ticks {
        expected,
        lost,
        duplicated,
        stray,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_schedulers_with_kills_enqueue_every_tick_exactly_once() -> anyhow::Result<()> {
    let r = run("queue_schedule", QueueOptions::default(), 6).await?;
    assert!(r.expected >= 5, "only {} ticks elapsed", r.expected);
    assert_eq!(r.lost, 0, "no tick lost");
    assert_eq!(r.duplicated, 0, "no tick enqueued twice");
    assert_eq!(r.stray, 0, "every job is a tick of the schedule");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_random_tick_ids_enqueue_ticks_twice() -> anyhow::Result<()> {
    let r = run(
        "queue_schedule_control",
        QueueOptions::default().unsafe_without(Safeguard::ScheduleTickId),
        6,
    )
    .await?;
    assert!(
        r.duplicated > 0,
        "the control must enqueue some tick twice, got {}",
        r.duplicated
    );
    Ok(())
}

/// Skip and catch-up: after an outage of 5 ticks, `Skip` enqueues only the latest one and
/// `CatchUp(3)` the latest three; a replaced schedule keeps its `last_tick`.
#[tokio::test]
async fn missed_ticks_follow_the_policy() -> anyhow::Result<()> {
    let t = TestDb::new("queue_schedule_missed").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time, QueueOptions::default()).await?;
    let every = ScheduleSpec::every(Duration::from_millis(200))?;
    q.schedule(&Schedule::new("skip", every.clone(), doc! {}))
        .await?;
    q.schedule(&Schedule::new("catch", every.clone(), doc! {}).missed(MissedTicks::CatchUp(3)))
        .await?;
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let r = q.run_due_ticks().await?;
    assert_eq!(r.enqueued, 1 + 3, "{r:?}");
    assert!(r.skipped >= 4 + 2, "{r:?}");
    // Replacing the schedule keeps last_tick: nothing due again at once.
    q.schedule(&Schedule::new("skip", every, doc! { "v": 2 }))
        .await?;
    let again = q.run_due_ticks().await?;
    assert!(again.enqueued <= 2, "{again:?}");
    assert_eq!(again.duplicates, 0);
    assert!(q.unschedule("skip").await?);
    assert_eq!(q.schedules().await?.len(), 1);
    Ok(())
}

/// Session 15: `schedule` stored a payload too large for a job (its ticks could never be
/// enqueued), and `run_due_ticks` stopped at the first schedule whose tick failed for a
/// reason of its own (that payload; a hand-edited `last_tick` before 1970, whose tick
/// has no job id): the pass returned the error, so the queue's other schedules never
/// ticked again. Now `schedule` refuses the payload, and a pass skips such a schedule
/// (counted in `errors`, logged) and runs the others.
#[tokio::test]
async fn one_schedule_that_cannot_tick_does_not_stop_the_others() -> anyhow::Result<()> {
    let t = TestDb::new("queue_schedule_unfireable").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time, QueueOptions::default()).await?;
    let every = ScheduleSpec::every(Duration::from_millis(100))?;
    let big = mongodb::bson::Bson::Binary(mongodb::bson::Binary {
        subtype: mongodb::bson::spec::BinarySubtype::Generic,
        bytes: vec![7; 15 * 1024 * 1024 + 512 * 1024],
    });
    let refused = q
        .schedule(&Schedule::new("too-big", every.clone(), big.clone()))
        .await;
    assert!(
        matches!(
            refused,
            Err(docwarden::Error::InvalidInput {
                what: "payload",
                ..
            })
        ),
        "{refused:?}"
    );
    assert!(q.schedules().await?.is_empty(), "nothing stored");
    // The same schedules as a hand edit (or an older version) would leave them.
    q.schedule(&Schedule::new("too-big", every.clone(), doc! {}))
        .await?;
    q.schedule(&Schedule::new("before-1970", every.clone(), doc! {}))
        .await?;
    q.schedule(&Schedule::new("healthy", every, doc! {}))
        .await?;
    let schedules = t.db.collection::<Document>("jobs.schedules");
    schedules
        .update_one(
            doc! { "_id": "too-big" },
            doc! { "$set": { "payload": big } },
        )
        .await?;
    schedules
        .update_one(
            doc! { "_id": "before-1970" },
            doc! { "$set": {
                // Its next tick comes out 8 ms before 1970: no tick job id exists.
                "last_tick": mongodb::bson::DateTime::from_millis(-10_000),
                "anchor": mongodb::bson::DateTime::from_millis(i64::MIN),
            } },
        )
        .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pass = q.run_due_ticks().await;
    let report = match pass {
        Ok(r) => r,
        Err(e) => anyhow::bail!("one schedule failed the whole pass: {e}"),
    };
    assert_eq!(report.errors, 2, "{report:?}");
    let healthy =
        t.db.collection::<Document>("jobs")
            .count_documents(doc! { field::SCHEDULE: "healthy" })
            .await?;
    assert_eq!(healthy, 1, "the healthy schedule ticked: {report:?}");
    Ok(())
}

/// Session 18: `schedule` upserted by `{_id: name}` alone and `$set` the handle's queue,
/// so scheduling a name that another queue's schedule held silently moved that schedule
/// (with its `last_tick` and anchor) to the calling handle's queue: queue `b` stopped
/// getting its ticks, and nothing said so. Schedule names are unique per collection; a
/// name of another queue is now `InvalidInput` naming that queue, and its schedule is
/// left as it was. Without the queue in the upsert's filter the test lists both attempts
/// (from `a` and from the default queue) as takeovers.
#[tokio::test]
async fn a_schedule_name_of_another_queue_is_refused_not_taken_over() -> anyhow::Result<()> {
    let t = TestDb::new("queue_schedule_name_of_another_queue").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let default = JobQueue::open(&t.db, "jobs", time, QueueOptions::default()).await?;
    let a = default.named("a", QueueOptions::default())?;
    let b = default.named("b", QueueOptions::default())?;
    let hourly = ScheduleSpec::every(Duration::from_secs(3600))?;
    b.schedule(&Schedule::new("nightly", hourly.clone(), doc! { "q": "b" }))
        .await?;
    let mut takeovers = Vec::new();
    for (who, q) in [("a", &a), ("default", &default)] {
        let r = q
            .schedule(&Schedule::new("nightly", hourly.clone(), doc! { "q": who }))
            .await;
        match r {
            Err(docwarden::Error::InvalidInput { what, reason }) => {
                assert_eq!(what, "schedule name");
                assert!(reason.contains("queue `b`"), "{reason}");
            }
            other => takeovers.push(format!("{who}: {other:?}")),
        }
    }
    let of_b: Vec<String> = b.schedules().await?.into_iter().map(|s| s.name).collect();
    assert_eq!(
        (takeovers, of_b),
        (Vec::<String>::new(), vec!["nightly".to_owned()]),
        "another queue's handle took b's schedule over"
    );
    let stored =
        t.db.collection::<Document>("jobs.schedules")
            .find_one(doc! { "_id": "nightly" })
            .await?
            .ok_or_else(|| anyhow::anyhow!("gone"))?;
    assert_eq!(
        stored.get_document(sf::PAYLOAD)?.get_str("q")?,
        "b",
        "{stored}"
    );
    // A handle still creates and replaces its own schedules.
    a.schedule(&Schedule::new("own", hourly.clone(), doc! { "v": 1 }))
        .await?;
    a.schedule(&Schedule::new("own", hourly, doc! { "v": 2 }))
        .await?;
    assert_eq!(a.schedules().await?.len(), 1);
    Ok(())
}
