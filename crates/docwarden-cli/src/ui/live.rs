//! Live updates: one background task watches the database (a change stream; polling when
//! the deployment has none or the stream fails) and tells every open page, by
//! server-sent events, that something changed; the page then fetches itself again.
//!
//! **Guarantee:** a change made while a page is open reaches it within about a second
//! (change stream) or [`POLL_EVERY`] (polling). Notifications are coalesced: a burst of
//! writes is one event per [`COALESCE`]. The page then shows the queue counts of its
//! collection's snapshot (`ui/snapshot.rs`), which on a large collection may be older
//! than the change. **Limits:** polling compares counts per named
//! queue, pauses and lease holders, so an edit that changes none of them (a payload
//! rewritten in place, a semaphore permit taken) is not noticed until the next change
//! that does.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Duration;

use docwarden::clock::TimeSource;
use futures::TryStreamExt;
use mongodb::Database;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// How often a burst of changes is sent as one event.
pub(crate) const COALESCE: Duration = Duration::from_millis(700);
/// How often the polling fallback looks.
pub(crate) const POLL_EVERY: Duration = Duration::from_secs(2);

/// How the dashboard learns of changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Mode {
    /// Not started yet.
    Starting = 0,
    /// A change stream on the database.
    ChangeStream = 1,
    /// Polling counts and leases every [`POLL_EVERY`].
    Polling = 2,
}

impl Mode {
    /// Shown in the page footer.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Mode::Starting => "starting",
            Mode::ChangeStream => "change stream",
            Mode::Polling => "polling",
        }
    }

    fn from_u8(v: u8) -> Mode {
        match v {
            1 => Mode::ChangeStream,
            2 => Mode::Polling,
            _ => Mode::Starting,
        }
    }
}

/// The shared end of the watcher.
#[derive(Debug)]
pub(crate) struct Live {
    tx: broadcast::Sender<()>,
    dirty: AtomicBool,
    mode: AtomicU8,
}

impl Live {
    /// A watcher with no task yet; [`Live::spawn`] starts it.
    pub(crate) fn new() -> Arc<Live> {
        let (tx, _) = broadcast::channel(16);
        Arc::new(Live {
            tx,
            dirty: AtomicBool::new(false),
            mode: AtomicU8::new(Mode::Starting as u8),
        })
    }

    /// The current mode.
    pub(crate) fn mode(&self) -> Mode {
        Mode::from_u8(self.mode.load(Ordering::Relaxed))
    }

    /// A receiver of change notifications.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<()> {
        self.tx.subscribe()
    }

    /// How many pages listen.
    pub(crate) fn listeners(&self) -> usize {
        self.tx.receiver_count()
    }

    /// Something the pages show changed (a snapshot read in the background): the open
    /// pages are told on the next tick, with the database's own changes.
    pub(crate) fn changed(&self) {
        self.dirty.store(true, Ordering::Relaxed);
    }

    fn set_mode(&self, m: Mode) {
        self.mode.store(m as u8, Ordering::Relaxed);
    }

    /// Starts the watcher and the coalescing ticker; both stop with `cancel`.
    pub(crate) fn spawn(
        self: &Arc<Self>,
        db: Database,
        time: TimeSource,
        catalog: super::Catalogue,
        snapshots: Arc<super::snapshot::Snapshots>,
        poll_only: bool,
        cancel: CancellationToken,
    ) {
        let this = Arc::clone(self);
        let stop = cancel.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(COALESCE);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    _ = tick.tick() => {
                        if this.dirty.swap(false, Ordering::Relaxed) {
                            let _ = this.tx.send(());
                        }
                    }
                }
            }
        });
        let this = Arc::clone(self);
        tokio::spawn(async move {
            tokio::select! {
                () = cancel.cancelled() => {}
                () = this.watch(db, time, catalog, &snapshots, poll_only) => {}
            }
        });
    }

    #[tracing::instrument(skip_all)]
    async fn watch(
        &self,
        db: Database,
        time: TimeSource,
        catalog: super::Catalogue,
        snapshots: &super::snapshot::Snapshots,
        poll_only: bool,
    ) {
        let stream = if poll_only {
            None
        } else {
            Some(db.watch().await)
        };
        match stream {
            None => {}
            Some(Ok(mut stream)) => {
                self.set_mode(Mode::ChangeStream);
                loop {
                    match stream.try_next().await {
                        Ok(Some(_)) => self.dirty.store(true, Ordering::Relaxed),
                        Ok(None) => break,
                        Err(e) => {
                            tracing::warn!(error = %e, "change stream failed; polling instead");
                            break;
                        }
                    }
                }
            }
            Some(Err(e)) => {
                tracing::info!(error = %e, "no change stream on this deployment; polling");
            }
        }
        if !poll_only {
            metrics::counter!("docwarden_ui_live_fallbacks_total").increment(1);
        }
        self.set_mode(Mode::Polling);
        let mut last = String::new();
        loop {
            tokio::time::sleep(POLL_EVERY).await;
            match fingerprint(&db, &time, &catalog, snapshots).await {
                Ok(f) if f != last => {
                    if !last.is_empty() {
                        self.dirty.store(true, Ordering::Relaxed);
                    }
                    last = f;
                }
                Ok(_) => {}
                Err(e) => tracing::debug!(error = %e, "poll failed"),
            }
        }
    }
}

/// Counts by state and the pause of every named queue, and the leases of every lock
/// collection, as text.
async fn fingerprint(
    db: &Database,
    time: &TimeSource,
    catalog: &super::Catalogue,
    snapshots: &super::snapshot::Snapshots,
) -> anyhow::Result<String> {
    let c = catalog.get(db).await?;
    let mut out = String::new();
    for q in &c.queues {
        for counts in &snapshots
            .get(db, time, q, super::snapshot::Stale::Wait)
            .await?
            .queues
        {
            let paused = counts.handle.is_paused().await?;
            out.push_str(&format!(
                "{q}:{}:{paused}:{:?};",
                counts.name, counts.stats.by_state
            ));
        }
    }
    for l in &c.locks {
        // The counts and the first leases the page shows, from the paced snapshot.
        let leases = snapshots
            .leases(db, time, l, super::snapshot::Stale::Wait)
            .await?;
        out.push_str(&format!("{l}:{:?};", leases.counts));
        for r in &leases.first {
            out.push_str(&format!("{l}:{}:{}:{:?};", r.resource, r.owner, r.token));
        }
    }
    Ok(out)
}
