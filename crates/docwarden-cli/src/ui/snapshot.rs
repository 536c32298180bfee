//! The counts of a queue collection (its named queues, each one's `JobQueue::stats` and
//! its chart of finished jobs per minute) and of a lock collection (`LockCollection::counts` and the first leases by resource),
//! read at a rate that does not grow with the collection.
//!
//! `stats` reads the whole collection: a `$group` by state over every job, and counts of
//! the hand-edit conditions over every waiting job. At 1,000,000 jobs that took 6.5–6.9 s
//! on the embedded server (`docs/benchmarks.md`, session 36), and the dashboard used to
//! call it for every queue on every page view, live fingerprint and `GET /metrics`
//! scrape. A lock collection's counts read every held lock document (with a lock per
//! entity, many thousands), and the dashboard used to list every one of them on each view,
//! fingerprint and scrape. So the dashboard shares one snapshot per collection: a view or
//! scrape reuses it while it is younger than `--counts-every` ([`MIN_FRESH`]) or [`SHARE`]
//! times what reading it took, whichever is longer, so the counts cost the server at most
//! about 1/[`SHARE`] of one connection's time however many pages and scrapers ask.
//! A page view that finds a snapshot stale is served it at once and it is read again in
//! the background ([`Stale::Serve`]); the live poller and `/metrics` wait for the new read
//! ([`Stale::Wait`]), as does everyone when nothing is held yet (one read at a time). An
//! action on a queue collection (retry, purge, pause, cancel) drops its snapshot, so the
//! page after it shows fresh counts; a background read started before the action is not
//! stored.
//!
//! The jobs page's listings are paced the same way, one per filter (session 38): a
//! listing sorts by `updated_at`, which no index serves (an index on it would cost every
//! job write), so on a large collection each one reads every job it filters (about 1.3 s
//! per 1,000,000 jobs here), and an open page fetches itself again after every burst of
//! writes (`ui/live.rs`, at most every 0.7 s). At most [`LISTINGS_KEPT`] filters are kept;
//! an action drops them all.
//!
//! **Limits:** on a large collection the counts a page shows can be that old; the page
//! says how old they are. The locks page shows the first [`LEASES_SHOWN`] leases of a
//! collection by resource, with the counts of all of them.

use std::collections::HashMap;
use std::future::Future;
use std::ops::Deref;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use docwarden::clock::TimeSource;
use docwarden::lock::{LockCounts, LockListFilter, LockRecord};
use docwarden::queue::{JobQueue, QueueOptions, QueueStats};
use mongodb::Database;

/// A snapshot is always reused for at least this long.
pub(crate) const MIN_FRESH: Duration = Duration::from_secs(1);
/// A snapshot that took `t` to read is reused for `SHARE × t`.
pub(crate) const SHARE: u32 = 20;
/// How many leases of a lock collection the locks page lists (the first by resource).
pub(crate) const LEASES_SHOWN: u64 = 200;
/// How many job listings (distinct filters) are kept; past that, those nobody is reading
/// are dropped.
pub(crate) const LISTINGS_KEPT: usize = 64;

/// One named queue of a collection, with its counts.
#[derive(Debug, Clone)]
pub(crate) struct QueueCounts {
    /// The named queue (`default`: jobs without a queue name).
    pub(crate) name: String,
    /// A read-only handle on it.
    pub(crate) handle: JobQueue,
    /// Its counts when the snapshot was read.
    pub(crate) stats: QueueStats,
    /// Its finished jobs per minute over the last minutes, as of the read (the chart).
    pub(crate) history: Vec<super::data::Minute>,
}

/// The named queues of one queue collection and their counts.
#[derive(Debug)]
pub(crate) struct Queues {
    /// Every named queue, the default one first.
    pub(crate) queues: Vec<QueueCounts>,
}

/// The counts of one lock collection and its first leases.
#[derive(Debug)]
pub(crate) struct Leases {
    /// Held and expired locks, and holders, of the whole collection.
    pub(crate) counts: LockCounts,
    /// The first [`LEASES_SHOWN`] leases by resource.
    pub(crate) first: Vec<LockRecord>,
}

impl Leases {
    /// Whether [`Leases::first`] lists fewer leases than the collection holds.
    pub(crate) fn truncated(&self) -> bool {
        let listed = u64::try_from(self.first.len()).unwrap_or(u64::MAX);
        listed < self.counts.held.saturating_add(self.counts.expired)
    }
}

/// What was read, when, and how long reading it took.
#[derive(Debug)]
pub(crate) struct Snapshot<T> {
    value: T,
    /// When the read finished.
    pub(crate) at: Instant,
    /// How long the read took.
    pub(crate) took: Duration,
}

impl<T> Deref for Snapshot<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> Snapshot<T> {
    /// Whether the snapshot may still be served (see the module docs).
    fn fresh(&self, min_fresh: Duration) -> bool {
        self.at.elapsed() < reuse_for(self.took, min_fresh)
    }

    /// When its read started.
    fn started(&self) -> Instant {
        self.at.checked_sub(self.took).unwrap_or(self.at)
    }
}

/// How long a snapshot that took `took` to read is reused.
fn reuse_for(took: Duration, min_fresh: Duration) -> Duration {
    took.saturating_mul(SHARE).max(min_fresh)
}

/// What a slot holds: the last snapshot, whether a background read is under way, and a
/// generation that [`Paced::forget`] moves on, so that a background read started before
/// an action does not store what it read over the action's effect.
#[derive(Debug)]
struct Held<T> {
    snapshot: Option<Arc<Snapshot<T>>>,
    refreshing: bool,
    generation: u64,
}

impl<T> Default for Held<T> {
    fn default() -> Self {
        Self {
            snapshot: None,
            refreshing: false,
            generation: 0,
        }
    }
}

type Slot<T> = Arc<tokio::sync::Mutex<Held<T>>>;

/// Called when a background read has stored a new snapshot: the open pages were served
/// the old one, and fetch themselves again on the live updates' next tick.
pub(crate) type Refreshed = Arc<dyn Fn() + Send + Sync>;

/// How a caller takes a snapshot that is no longer fresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stale {
    /// Wait for it to be read again (the live poller, which compares what it reads, and
    /// `GET /metrics`, whose samples should be as fresh as the pacing allows).
    Wait,
    /// Take it at once and read it again in the background (page views: at 1,000,000
    /// jobs a read of the counts takes seconds, and the page says how old they are).
    Serve,
}

/// Runs `read` and stamps what it read.
async fn timed<T, Fut>(read: impl FnOnce() -> Fut) -> anyhow::Result<Snapshot<T>>
where
    Fut: Future<Output = anyhow::Result<T>>,
{
    let started = Instant::now();
    let value = read().await?;
    Ok(Snapshot {
        value,
        at: Instant::now(),
        took: started.elapsed(),
    })
}

/// Snapshots of one kind, one per collection (or filter), each reused for at least
/// `min_fresh`; `refreshed` is called after each background read that stored one.
struct Paced<T> {
    slots: Mutex<HashMap<String, Slot<T>>>,
    min_fresh: Duration,
    refreshed: Refreshed,
}

impl<T> std::fmt::Debug for Paced<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Paced")
            .field("min_fresh", &self.min_fresh)
            .finish_non_exhaustive()
    }
}

impl<T: Send + Sync + 'static> Paced<T> {
    fn new(min_fresh: Duration, refreshed: &Refreshed) -> Self {
        Self {
            slots: Mutex::new(HashMap::new()),
            min_fresh,
            refreshed: Arc::clone(refreshed),
        }
    }

    fn slot(&self, collection: &str) -> Slot<T> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(slots.entry(collection.to_owned()).or_default())
    }

    /// Drops the slots nobody holds once there are more than `kept` (a slot held is being
    /// read or served).
    fn prune(&self, kept: usize) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if slots.len() > kept {
            slots.retain(|_, slot| Arc::strong_count(slot) > 1);
        }
    }

    /// The held snapshot of `collection` if it is still fresh, else `read`'s (one read at
    /// a time per collection). With [`Stale::Serve`] a snapshot that is no longer fresh
    /// is returned at once and read again in the background (one read at a time); with
    /// nothing held, every caller waits for the one read.
    async fn get<F, Fut>(
        &self,
        collection: &str,
        stale: Stale,
        read: F,
    ) -> anyhow::Result<Arc<Snapshot<T>>>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = anyhow::Result<T>> + Send + 'static,
    {
        let slot = self.slot(collection);
        let mut held = slot.lock().await;
        if let Some(s) = held.snapshot.as_ref() {
            if s.fresh(self.min_fresh) {
                return Ok(Arc::clone(s));
            }
            if stale == Stale::Serve {
                let served = Arc::clone(s);
                if !held.refreshing {
                    held.refreshing = true;
                    let generation = held.generation;
                    let slot = Arc::clone(&slot);
                    let name = collection.to_owned();
                    let refreshed = Arc::clone(&self.refreshed);
                    tokio::spawn(async move {
                        let read = timed(read).await;
                        let mut held = slot.lock().await;
                        held.refreshing = false;
                        match read {
                            // Not over a newer read (a waiting caller's, made meanwhile),
                            // nor after an action dropped the snapshot: what was read may
                            // predate it.
                            Ok(s)
                                if held.generation == generation
                                    && held
                                        .snapshot
                                        .as_ref()
                                        .is_none_or(|h| h.started() <= s.started()) =>
                            {
                                held.snapshot = Some(Arc::new(s));
                                refreshed();
                            }
                            Ok(_) => {}
                            // The page keeps the old one and says how old it is; the next
                            // view tries again.
                            Err(e) => {
                                tracing::warn!(key = %name, "reading a dashboard snapshot again failed: {e:#}");
                            }
                        }
                    });
                }
                return Ok(served);
            }
        }
        let snapshot = Arc::new(timed(read).await?);
        held.snapshot = Some(Arc::clone(&snapshot));
        Ok(snapshot)
    }

    async fn forget(&self, collection: &str) {
        let slot = self.slot(collection);
        let mut held = slot.lock().await;
        held.snapshot = None;
        held.generation = held.generation.wrapping_add(1);
    }

    fn forget_all(&self) {
        self.slots.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// The dashboard's snapshots, one per queue collection and one per lock collection.
#[derive(Debug)]
pub(crate) struct Snapshots {
    queues: Paced<Queues>,
    leases: Paced<Leases>,
    listings: Paced<Vec<super::data::JobRow>>,
    min_fresh: Duration,
}

impl Snapshots {
    /// Snapshots reused for at least `min_fresh` (`docwarden ui --counts-every`,
    /// [`MIN_FRESH`] by default); `refreshed` is called after each background read that
    /// stored a new snapshot.
    pub(crate) fn new(min_fresh: Duration, refreshed: Refreshed) -> Self {
        Self {
            queues: Paced::new(min_fresh, &refreshed),
            leases: Paced::new(min_fresh, &refreshed),
            listings: Paced::new(min_fresh, &refreshed),
            min_fresh,
        }
    }

    /// The snapshot of queue collection `collection`: the one held if it is still fresh,
    /// else a new read (one at a time per collection), or with [`Stale::Serve`] the one
    /// held while it is read again in the background.
    ///
    /// # Errors
    /// A database error of the read.
    pub(crate) async fn get(
        &self,
        db: &Database,
        time: &TimeSource,
        collection: &str,
        stale: Stale,
    ) -> anyhow::Result<Arc<Snapshot<Queues>>> {
        let (db, time, name) = (db.clone(), time.clone(), collection.to_owned());
        self.queues
            .get(collection, stale, move || async move {
                let mut queues = Vec::new();
                // Every named queue's counts from one pass over the collection per count.
                let base = super::data::queue(&db, &time, &name)?;
                let every = base.stats_of_every_queue().await?;
                let now_ms = time.now().await?.estimate_ms;
                for (name, stats) in every {
                    let handle = base.named(&name, QueueOptions::default())?;
                    let history = super::data::history(&handle, &name, now_ms).await?;
                    queues.push(QueueCounts {
                        name,
                        handle,
                        stats,
                        history,
                    });
                }
                Ok(Queues { queues })
            })
            .await
    }

    /// The snapshot of lock collection `collection`: its counts (one aggregation) and its
    /// first [`LEASES_SHOWN`] leases, reused as [`Snapshots::get`]'s.
    ///
    /// # Errors
    /// A database error of the read.
    pub(crate) async fn leases(
        &self,
        db: &Database,
        time: &TimeSource,
        collection: &str,
        stale: Stale,
    ) -> anyhow::Result<Arc<Snapshot<Leases>>> {
        let (db, time, name) = (db.clone(), time.clone(), collection.to_owned());
        self.leases
            .get(collection, stale, move || async move {
                let locks = super::data::locks(&db, &time, &name)?;
                let counts = locks.counts().await?;
                let first = locks
                    .list(&LockListFilter::default().limit(LEASES_SHOWN))
                    .await?;
                Ok(Leases { counts, first })
            })
            .await
    }

    /// The job listing named `key` (its filter): the one held if it is still fresh, else
    /// `read`'s, reused as [`Snapshots::get`]'s; a page view takes a stale one at once
    /// ([`Stale::Serve`]).
    ///
    /// # Errors
    /// `read`'s error.
    pub(crate) async fn listing<F, Fut>(
        &self,
        key: &str,
        read: F,
    ) -> anyhow::Result<Arc<Snapshot<Vec<super::data::JobRow>>>>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = anyhow::Result<Vec<super::data::JobRow>>> + Send + 'static,
    {
        self.listings.prune(LISTINGS_KEPT);
        self.listings.get(key, Stale::Serve, read).await
    }

    /// The shortest time a snapshot is reused.
    pub(crate) fn min_fresh(&self) -> Duration {
        self.min_fresh
    }

    /// Drops the snapshot of queue collection `collection` and every job listing (after
    /// an action on it).
    pub(crate) async fn forget(&self, collection: &str) {
        self.queues.forget(collection).await;
        self.listings.forget_all();
    }
}

/// How old the counts of `snapshot` are, as text, once that is worth saying (2 s or
/// more); `min_fresh` as in [`Snapshots::new`].
pub(crate) fn age_note<T>(snapshot: &Snapshot<T>, min_fresh: Duration) -> Option<String> {
    read_note("counts", snapshot, min_fresh)
}

/// [`age_note`] of what `snapshot` holds (`what`: "counts", "this list").
pub(crate) fn read_note<T>(
    what: &str,
    snapshot: &Snapshot<T>,
    min_fresh: Duration,
) -> Option<String> {
    let age = snapshot.at.elapsed();
    (age >= Duration::from_secs(2)).then(|| {
        format!(
            "{what} read {} s ago (reading took {:.1} s; read again at most every {} s)",
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
