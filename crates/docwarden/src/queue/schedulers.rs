//! Scheduler passes shared within a process: one pass task per queue, however many of
//! its workers run schedules.
//!
//! **Why shared.** Each [`Worker`](super::Worker) with
//! [`WorkerOptions::run_schedules`](super::WorkerOptions::run_schedules) ran its own
//! scheduler pass every `schedule_every` (200 ms): a `find` on `<collection>.schedules`
//! at least, and 16 such workers in one process read the schedules 80 times a second to
//! enqueue what one pass enqueues (`tests/queue_s21_shared_scheduler.rs` counted 8
//! workers' reads). Ticks are deduplicated by their `_id` whatever the number of
//! schedulers (`queue/schedule.rs`), so sharing is about load, not correctness.
//!
//! **Guarantee:** while at least one worker of the process subscribes to a pass, one task
//! runs it ([`super::schedule::run_scheduler`]). Subscribers find it by the queue's
//! namespace, the queue's name, the period, and the handle's settings a pass depends on:
//! its time source (by identity: clones of one source), its options and its collection's
//! read and write concerns. Handles that differ in any of them run passes of their own
//! (as separate processes would: the verify harness's simulated processes, each with its
//! own clock, keep racing), so a pass never runs with another handle's clock, client or
//! options.
//!
//! **Lifetime:** mirrors [`crate::listener`]: the first subscriber starts the task, later
//! ones share it, and it stops when the last one drops its [`Subscription`] (at once, as a
//! killed scheduler stops: a tick inserted but not yet recorded in `last_tick` is
//! re-inserted as a no-op by the next pass). If the task ends for any other reason (a
//! pass panicked, its runtime shut down), a drop guard marks it lost; every subscriber
//! learns it ([`Subscription::lost`]) and subscribes again, the first of them starting a
//! new task ([`keep_running`]).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::JobQueue;
use crate::clock::TimeSource;

/// A shared pass task: one per (queue, handle settings, period) in this process.
#[derive(Debug)]
struct Hub {
    /// Cancelled once the task ended, however it ended: the next subscriber starts a new
    /// one.
    lost: CancellationToken,
    /// Stops the task when the last subscriber drops the hub.
    stop: CancellationToken,
    /// The time source whose address is part of the hub's key: kept alive with the hub, so
    /// no other source can take that address while the hub can be found.
    _time: TimeSource,
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Marks a pass task lost when it ends, however it ends, and so tells its subscribers.
struct Lost(CancellationToken);

impl Drop for Lost {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// The pass tasks of this process, by key ([`key`]).
static HUBS: LazyLock<Mutex<HashMap<String, Weak<Hub>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// One subscriber's hold on a shared pass task. Dropping it unsubscribes; the task stops
/// when its last subscriber is gone.
#[derive(Debug)]
pub(crate) struct Subscription {
    hub: Arc<Hub>,
}

impl Subscription {
    /// Returns once the task has ended (a panic, its runtime shutting down): subscribe
    /// again to start a new one. Never while the task runs.
    pub(crate) async fn lost(&self) {
        self.hub.lost.cancelled().await;
    }
}

/// What tells two handles' passes apart: everything a pass reads from its handle.
fn key(queue: &JobQueue, every: Duration) -> String {
    let coll = queue.collection();
    format!(
        "{}|{every:?}|{:p}|{:?}|{:?}|{:?}|{:?}",
        coll.namespace(),
        queue.time().identity(),
        queue.options(),
        coll.write_concern(),
        coll.read_concern(),
        coll.selection_criteria(),
    )
}

/// Subscribes to the pass task of `queue` every `every`, starting it (on the current
/// tokio runtime) if none is running in this process.
pub(crate) fn subscribe(queue: &JobQueue, every: Duration) -> Subscription {
    let key = key(queue, every);
    let mut hubs = HUBS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(hub) = hubs.get(&key).and_then(Weak::upgrade)
        && !hub.lost.is_cancelled()
    {
        return Subscription { hub };
    }
    // None alive: start one (the registry stays locked, so one starts at a time), and
    // forget the tasks nobody holds any more.
    hubs.retain(|_, hub| hub.strong_count() > 0);
    let lost = CancellationToken::new();
    let stop = CancellationToken::new();
    let hub = Arc::new(Hub {
        lost: lost.clone(),
        stop: stop.clone(),
        _time: queue.time().clone(),
    });
    hubs.insert(key, Arc::downgrade(&hub));
    let span = tracing::info_span!("scheduler", queue = %queue.metrics_label());
    let queue = queue.clone();
    tokio::spawn(
        async move {
            // However the task ends (stopped, a pass panicking, the runtime shutting
            // down), its subscribers learn it.
            let _lost = Lost(lost);
            tokio::select! {
                () = stop.cancelled() => {}
                () = super::schedule::run_scheduler(queue, every, Arc::default(), stop.clone()) => {}
            }
        }
        .instrument(span),
    );
    Subscription { hub }
}

/// A worker's part in its queue's shared passes: holds a subscription until `stop`, and
/// subscribes again (so restarts the task) whenever the task was lost, after one period
/// (a pass that panics at once is not restarted in a loop).
pub(crate) async fn keep_running(queue: JobQueue, every: Duration, stop: CancellationToken) {
    loop {
        let subscription = subscribe(&queue, every);
        tokio::select! {
            () = stop.cancelled() => return,
            () = subscription.lost() => {}
        }
        drop(subscription);
        tracing::info!("the shared scheduler task ended; starting it again");
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}
