//! A schedule that cannot tick (a hand-edited `cron` that does not parse), against the
//! real server: every scheduler pass skips it and counts it in
//! `SchedulerReport::errors`, but logs it as a warning only once per handle until its
//! problem changes or it ticked again. A pass runs every 200 ms in every worker with
//! `run_schedules(true)`; until session 19 each pass logged a warning, five a second per
//! worker for as long as the document stayed broken. Without the fix the ten passes
//! below log ten warnings and the test fails (checked by reverting the fix, see the
//! commit message). The tracing subscriber is process-global: one test in this binary.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{JobQueue, QueueOptions, Schedule, ScheduleSpec};
use docwarden_testkit::TestDb;
use mongodb::bson::{Document, doc};
use tracing::{Event, Level};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

/// Counts the warnings docwarden's schedule code logs.
#[derive(Clone, Default)]
struct Warnings(Arc<AtomicU64>);

impl<S: tracing::Subscriber> Layer<S> for Warnings {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let m = event.metadata();
        if *m.level() == Level::WARN && m.target().starts_with("docwarden::queue::schedule") {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_schedule_is_warned_about_once_not_at_every_pass() -> anyhow::Result<()> {
    let warnings = Warnings::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(warnings.clone()))?;
    let t = TestDb::new("queue_s19b_schedule_log").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time, QueueOptions::default()).await?;
    q.schedule(&Schedule::new(
        "report",
        ScheduleSpec::every(Duration::from_secs(3600))?,
        doc! {},
    ))
    .await?;
    let schedules = t.db.collection::<Document>("jobs.schedules");
    schedules
        .update_one(
            doc! { "_id": "report" },
            doc! { "$set": { "cron": "every monday" } },
        )
        .await?;
    let mut errors = 0;
    for _ in 0..10 {
        errors += q.run_due_ticks().await?.errors;
    }
    let seen = warnings.0.load(Ordering::SeqCst);
    println!("10 passes over a broken schedule: {errors} errors, {seen} warnings");
    assert_eq!(errors, 10, "every pass skips it and says so in its report");
    assert_eq!(seen, 1, "one warning for one problem");

    // Fixed: it ticks (nothing due); broken again: warned again, once.
    schedules
        .update_one(doc! { "_id": "report" }, doc! { "$unset": { "cron": "" } })
        .await?;
    assert_eq!(q.run_due_ticks().await?.errors, 0);
    schedules
        .update_one(
            doc! { "_id": "report" },
            doc! { "$set": { "cron": "61 * * * *" } },
        )
        .await?;
    for _ in 0..5 {
        assert_eq!(q.run_due_ticks().await?.errors, 1);
    }
    assert_eq!(
        warnings.0.load(Ordering::SeqCst),
        2,
        "warned again after the fix broke"
    );
    Ok(())
}
