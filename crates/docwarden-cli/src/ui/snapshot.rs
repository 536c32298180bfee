//! The counts of a queue collection (its named queues and each one's `JobQueue::stats`),
//! read at a rate that does not grow with the collection.
//!
//! `stats` reads the whole collection: a `$group` by state over every job, and counts of
//! the hand-edit conditions over every waiting job. At 1,000,000 jobs that took 6.5–6.9 s
//! on the embedded server (`docs/benchmarks.md`, session 36), and the dashboard used to
//! call it for every queue on every page view, live fingerprint and `GET /metrics`
//! scrape. So the dashboard shares one snapshot per collection: a view or scrape reuses
//! it while it is younger than `--counts-every` ([`MIN_FRESH`]) or [`SHARE`] times what
//! reading it took,
//! whichever is longer, so the counts cost the server at most about 1/[`SHARE`] of one
//! connection's time however many pages and scrapers ask. Concurrent requests for a stale
//! snapshot wait for the one read. An action on a collection (retry, purge, pause, cancel)
//! drops its snapshot, so the page after it shows fresh counts.
//!
//! **Limit:** on a large collection the counts a page shows can be that old; the page
//! says how old they are.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use docwarden::clock::TimeSource;
use docwarden::queue::{JobQueue, QueueStats};
use mongodb::Database;

/// A snapshot is always reused for at least this long.
pub(crate) const MIN_FRESH: Duration = Duration::from_secs(1);
/// A snapshot that took `t` to read is reused for `SHARE × t`.
pub(crate) const SHARE: u32 = 20;

/// One named queue of a collection, with its counts.
#[derive(Debug, Clone)]
pub(crate) struct QueueCounts {
    /// The named queue (`default`: jobs without a queue name).
    pub(crate) name: String,
    /// A read-only handle on it.
    pub(crate) handle: JobQueue,
    /// Its counts when the snapshot was read.
    pub(crate) stats: QueueStats,
}

/// The named queues of one collection and their counts, as read at one time.
#[derive(Debug)]
pub(crate) struct Snapshot {
    /// Every named queue, the default one first.
    pub(crate) queues: Vec<QueueCounts>,
    /// When the read finished.
    pub(crate) at: Instant,
    /// How long the read took.
    pub(crate) took: Duration,
}

impl Snapshot {
    /// Whether the snapshot may still be served (see the module docs).
    fn fresh(&self, min_fresh: Duration) -> bool {
        self.at.elapsed() < reuse_for(self.took, min_fresh)
    }
}

/// How long a snapshot that took `took` to read is reused.
fn reuse_for(took: Duration, min_fresh: Duration) -> Duration {
    took.saturating_mul(SHARE).max(min_fresh)
}

type Slot = Arc<tokio::sync::Mutex<Option<Arc<Snapshot>>>>;

/// The dashboard's snapshots, one per queue collection.
#[derive(Debug)]
pub(crate) struct Snapshots {
    slots: Mutex<HashMap<String, Slot>>,
    min_fresh: Duration,
}

impl Snapshots {
    /// Snapshots reused for at least `min_fresh` (`docwarden ui --counts-every`,
    /// [`MIN_FRESH`] by default).
    pub(crate) fn new(min_fresh: Duration) -> Self {
        Self {
            slots: Mutex::new(HashMap::new()),
            min_fresh,
        }
    }

    fn slot(&self, collection: &str) -> Slot {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(slots.entry(collection.to_owned()).or_default())
    }

    /// The snapshot of queue collection `collection`: the one held if it is still fresh,
    /// else a new read (one at a time per collection).
    ///
    /// # Errors
    /// A database error of the read.
    pub(crate) async fn get(
        &self,
        db: &Database,
        time: &TimeSource,
        collection: &str,
    ) -> anyhow::Result<Arc<Snapshot>> {
        let slot = self.slot(collection);
        let mut held = slot.lock().await;
        if let Some(s) = held.as_ref().filter(|s| s.fresh(self.min_fresh)) {
            return Ok(Arc::clone(s));
        }
        let started = Instant::now();
        let mut queues = Vec::new();
        for (name, handle) in super::data::named_queues(db, time, collection).await? {
            let stats = handle.stats().await?;
            queues.push(QueueCounts {
                name,
                handle,
                stats,
            });
        }
        let snapshot = Arc::new(Snapshot {
            queues,
            at: Instant::now(),
            took: started.elapsed(),
        });
        *held = Some(Arc::clone(&snapshot));
        Ok(snapshot)
    }

    /// The shortest time a snapshot is reused.
    pub(crate) fn min_fresh(&self) -> Duration {
        self.min_fresh
    }

    /// Drops the snapshot of `collection` (after an action on it).
    pub(crate) async fn forget(&self, collection: &str) {
        *self.slot(collection).lock().await = None;
    }
}

/// How old the counts of `snapshot` are, as text, once that is worth saying (2 s or
/// more); `min_fresh` as in [`Snapshots::new`].
pub(crate) fn age_note(snapshot: &Snapshot, min_fresh: Duration) -> Option<String> {
    let age = snapshot.at.elapsed();
    (age >= Duration::from_secs(2)).then(|| {
        format!(
            "counts read {} s ago (reading them took {:.1} s; read again at most every {} s)",
            age.as_secs(),
            snapshot.took.as_secs_f64(),
            reuse_for(snapshot.took, min_fresh).as_secs()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_read_is_reused_for_its_share() {
        let second = Duration::from_secs(1);
        assert_eq!(reuse_for(Duration::from_millis(10), second), second);
        assert_eq!(
            reuse_for(Duration::from_secs(7), second),
            Duration::from_secs(140)
        );
    }
}
