//! A schedule whose `every_ms` is a BSON int32, against the real server. `docs/queue.md`
//! says integers are int64 and int32 is accepted when reading, and a schedule's
//! `priority`, `max_attempts` and `catch_up` were read either way, but `every_ms` only
//! as int64: a schedule written or edited by a tool that stores small integers as int32
//! (the Node.js driver does for any whole number in range) was skipped by every
//! scheduler pass as "neither `cron` nor a positive `every_ms`" and left out of
//! `JobQueue::schedules`, so it silently stopped ticking. Without the fix the pass
//! reports an error and enqueues nothing, and the test fails (checked by reverting the
//! fix, see the commit message).

use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{JobQueue, QueueOptions, Schedule, ScheduleSpec};
use docwarden_testkit::TestDb;
use mongodb::bson::{Document, doc};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_int32_every_ms_is_read_like_an_int64() -> anyhow::Result<()> {
    let t = TestDb::new("queue_s19b_schedule_int32").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time, QueueOptions::default()).await?;
    q.schedule(&Schedule::new(
        "tick",
        ScheduleSpec::every(Duration::from_secs(3600))?,
        doc! { "k": 1 },
    ))
    .await?;
    // As another tool would store it: 100 ms as an int32.
    let schedules = t.db.collection::<Document>("jobs.schedules");
    let r = schedules
        .update_one(
            doc! { "_id": "tick" },
            doc! { "$set": { "every_ms": 100_i32 } },
        )
        .await?;
    anyhow::ensure!(r.matched_count == 1, "no schedule document `tick`");

    let listed = q.schedules().await?;
    println!("listed: {listed:?}");
    assert_eq!(listed.len(), 1, "the schedule is listed");
    assert_eq!(
        listed[0].spec.to_string(),
        ScheduleSpec::every(Duration::from_millis(100))?.to_string()
    );
    tokio::time::sleep(Duration::from_millis(250)).await;
    let report = q.run_due_ticks().await?;
    println!("pass: {report:?}");
    assert_eq!(report.errors, 0, "{report:?}");
    assert_eq!(
        report.enqueued, 1,
        "the latest due tick (missed: skip): {report:?}"
    );
    assert_eq!(
        q.collection()
            .count_documents(doc! { "schedule": "tick" })
            .await?,
        1
    );
    Ok(())
}
