//! Session 34: a scheduler whose passes fail backs off (`queue/schedule.rs`,
//! `run_scheduler`).
//!
//! `docwarden verify schedule --faults all` logged 2,120 "scheduler pass failed;
//! retrying" warnings in two stepdowns: each scheduler tried again every period (there,
//! 10 ms), as long as the server refused. Now the wait after a failed pass doubles from
//! the period up to 5 s, and the first pass that succeeds returns to the period.
//!
//! Here every `find` of the scheduler's client fails (MongoDB's `failCommand` fail point,
//! matched by the client's application name, so the test's own client is not affected)
//! for [`FAILING`], with a pass every 10 ms. A scheduler that does not back off tries
//! about 130 passes in that time; one that does tries about ten. Then the fail point is
//! lifted and the scheduler must enqueue the tick that fell due meanwhile within
//! [`RECOVERY`]. Fail points are server-wide, so this file is its own test binary with one
//! test.

use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{JobQueue, QueueOptions, Schedule, ScheduleSpec, Scheduler};
use docwarden_testkit::fail_commands_off;
use mongodb::bson::{Bson, doc};

/// The application name of the scheduler's client.
const APP: &str = "scheduler-backoff";

/// How long the scheduler's reads fail.
const FAILING: Duration = Duration::from_millis(1_500);

/// The scheduler's period.
const EVERY: Duration = Duration::from_millis(10);

/// The most passes a backing-off scheduler may try while its reads fail: the delays
/// double from 10 ms (jittered, never below it), so about ten fit in 1.5 s; without a
/// backoff about 130 do.
const MOST_FAILED_PASSES: u64 = 30;

/// How soon after the fail point is lifted the due tick must be enqueued: the longest
/// wait the backoff has reached by then (about 2.6 s) and a pass, with room for a slow
/// machine.
const RECOVERY: Duration = Duration::from_secs(10);

/// `BadValue`: an error that is neither retried by the driver nor a server state change,
/// so that every failed pass is the scheduler's own.
const BAD_VALUE: i32 = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_whose_passes_fail_backs_off_then_recovers() -> anyhow::Result<()> {
    let test = "a_scheduler_whose_passes_fail_backs_off_then_recovers";
    let Some((t, admin, client)) = docwarden_testkit::app_faults(test, APP).await? else {
        return Ok(());
    };
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(
        &client.database(t.db.name()),
        "jobs",
        time,
        QueueOptions::default().queue("cron"),
    )
    .await?;
    q.schedule(&Schedule::new(
        "tick",
        ScheduleSpec::every(Duration::from_secs(1))?,
        doc! { "report": "hourly" },
    ))
    .await?;

    docwarden_testkit::fail_commands_of(
        &admin,
        APP,
        &["find"],
        BAD_VALUE,
        Bson::String("alwaysOn".into()),
    )
    .await?;
    let scheduler = Scheduler::spawn(q.clone(), EVERY)?;
    tokio::time::sleep(FAILING).await;
    let failed = scheduler.report().errors;
    fail_commands_off(&admin).await?;

    let lifted = Instant::now();
    let recovered = loop {
        let report = scheduler.report();
        if report.enqueued > 0 {
            break Some(lifted.elapsed());
        }
        if lifted.elapsed() > RECOVERY {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let report = scheduler.shutdown().await;

    println!(
        "{failed} failed passes in {FAILING:?}; the due tick enqueued {recovered:?} after the \
         fail point was lifted; {report:?}"
    );
    assert!(
        failed >= 2,
        "the fail point did not act: {failed} failed passes"
    );
    let mut violations = Vec::new();
    if failed > MOST_FAILED_PASSES {
        violations.push(format!(
            "{failed} passes failed in {FAILING:?} with a period of {EVERY:?}: no backoff \
             (at most {MOST_FAILED_PASSES})"
        ));
    }
    if recovered.is_none() {
        violations.push(format!(
            "no tick enqueued within {RECOVERY:?} after the server answered again"
        ));
    }
    assert!(
        violations.is_empty(),
        "{} violation(s): {violations:?}",
        violations.len()
    );
    Ok(())
}
