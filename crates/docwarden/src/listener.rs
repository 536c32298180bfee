//! Change-stream listeners shared within a process: one change stream per (collection,
//! pipeline), however many tasks wait on it.
//!
//! **Why shared.** A change stream's `getMore` holds a pooled connection while the server
//! waits for events (up to [`MAX_AWAIT`] each time), so a stream per waiter holds a
//! connection per waiter: with the driver's default pool of 10, 16 blocked lock waiters
//! starved the acquirers, and 12 idle queue `Worker`s on one client (a stream for jobs and
//! one for the queue's control document each) made every other operation of the
//! application wait about a second for a connection (`tests/queue_shared_listener.rs`).
//! On MongoDB each stream is also its own cursor over the oplog (SERVER-32946: tens of
//! streams on one collection lag by seconds); the drivers' documentation warns that each
//! stream ties up a connection (NODE-1305). River and Oban likewise keep one notifier per
//! process.
//!
//! **Guarantee:** a [`Subscription`] receives every change its pipeline passes from the
//! moment [`subscribe`] returns it until it is dropped, or learns that it may have missed
//! some ([`Received::Lagged`], [`Received::Lost`]). A change before the subscription is
//! not delivered: callers read the state once *after* subscribing.
//!
//! **Lifetime:** the listener's task opens the stream when the first subscriber of its
//! (namespace, pipeline) arrives and stops when the last one leaves; the next subscriber
//! opens a new one. A lost stream (a restart, a network error) is told to every
//! subscriber, who subscribes again. Where the server refuses change streams (a
//! standalone server, a user without the `changeStream` privilege) the refusal is
//! remembered for the (namespace, pipeline) and [`subscribe`] answers
//! [`Subscribed::Refused`] at once: callers poll.
//!
//! **Limits:** listeners are found by namespace and pipeline, not by client: two clients
//! of two deployments that use the same database and collection names in one process
//! share the first one's listener (the other's subscribers then see the wrong
//! deployment's changes, and fall back on their polls — still correct, since every use
//! treats a change as a hint to re-read, never as a grant).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::Duration;

use futures::StreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, Document};
use mongodb::change_stream::event::OperationType;
use mongodb::error::ErrorKind;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// How long the server holds one `getMore` of a listener's change stream without events.
pub(crate) const MAX_AWAIT: Duration = Duration::from_millis(500);

/// Changes a listener buffers per subscriber before a slow subscriber lags.
const CAPACITY: usize = 1024;

/// One change, as a listener forwards it: what the pipeline kept of the event.
#[derive(Debug)]
pub(crate) struct Change {
    /// The changed document's `_id` (`documentKey._id`), if the pipeline kept it.
    pub(crate) id: Option<Bson>,
    /// Whether the change inserted the document.
    pub(crate) inserted: bool,
    /// The fields an update set (`updateDescription.updatedFields`), as far as the
    /// pipeline kept them; `None` for other operations.
    pub(crate) updated_fields: Option<Document>,
}

/// A shared listener: one per (namespace, pipeline) in this process.
#[derive(Debug)]
struct Hub {
    /// Each change; `None` when the stream was lost.
    tx: broadcast::Sender<Option<Arc<Change>>>,
    /// Set once the stream is lost: the next subscriber opens a new listener.
    dead: Arc<AtomicBool>,
    /// Stops the listener task when the last subscriber drops the hub.
    stop: CancellationToken,
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Marks a listener lost when its task ends, however it ends, and tells its subscribers.
struct Lost {
    dead: Arc<AtomicBool>,
    tx: broadcast::Sender<Option<Arc<Change>>>,
}

impl Drop for Lost {
    fn drop(&mut self) {
        self.dead.store(true, Ordering::SeqCst);
        let _ = self.tx.send(None);
    }
}

/// What the registry knows about one (namespace, pipeline).
enum Entry {
    /// A listener, alive while some subscriber holds it.
    Hub(Weak<Hub>),
    /// The server refused change streams: subscribers poll.
    Refused,
}

/// The listeners of this process, by (namespace, pipeline).
static HUBS: LazyLock<tokio::sync::Mutex<HashMap<String, Entry>>> =
    LazyLock::new(|| tokio::sync::Mutex::new(HashMap::new()));

/// What [`subscribe`] got.
pub(crate) enum Subscribed {
    /// Subscribed to a live listener (opened by this call, or shared).
    Yes(Subscription),
    /// The server refused change streams on this namespace (now or earlier in this
    /// process): poll.
    Refused,
    /// The stream could not be opened now (a network error, a server starting): try
    /// again later, polling meanwhile.
    Unavailable(mongodb::error::Error),
}

/// One subscriber's end of a shared listener. Dropping it unsubscribes; the listener
/// stops when its last subscriber is gone.
pub(crate) struct Subscription {
    _hub: Arc<Hub>,
    rx: broadcast::Receiver<Option<Arc<Change>>>,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription").finish_non_exhaustive()
    }
}

/// What [`Subscription::recv`] got.
#[derive(Debug)]
pub(crate) enum Received {
    /// A change the pipeline passed.
    Change(Arc<Change>),
    /// Changes were dropped for this subscriber (it was slow): it may have missed any.
    Lagged,
    /// The stream was lost: subscribe again (changes since may have been missed).
    Lost,
}

impl Subscription {
    /// The next change, or what stands instead of it.
    pub(crate) async fn recv(&mut self) -> Received {
        match self.rx.recv().await {
            Ok(Some(change)) => Received::Change(change),
            Err(broadcast::error::RecvError::Lagged(_)) => Received::Lagged,
            Ok(None) | Err(broadcast::error::RecvError::Closed) => Received::Lost,
        }
    }
}

/// Subscribes to the listener of `pipeline` on `coll`, opening it if none is alive in
/// this process. The pipeline should `$project` only what its subscribers read (the
/// event's `_id`, its resume token, stays).
pub(crate) async fn subscribe(coll: &Collection<Document>, pipeline: Vec<Document>) -> Subscribed {
    let key = format!("{}|{:?}", coll.namespace(), pipeline);
    let mut hubs = HUBS.lock().await;
    if let Some(entry) = hubs.get(&key) {
        match entry {
            Entry::Refused => return Subscribed::Refused,
            Entry::Hub(weak) => {
                if let Some(hub) = weak.upgrade()
                    && !hub.dead.load(Ordering::SeqCst)
                {
                    let rx = hub.tx.subscribe();
                    return Subscribed::Yes(Subscription { _hub: hub, rx });
                }
            }
        }
    }
    // No live listener: open one (the registry stays locked, so one opens at a time).
    match coll
        .watch()
        .pipeline(pipeline)
        .max_await_time(MAX_AWAIT)
        .await
    {
        Ok(mut stream) => {
            let (tx, rx) = broadcast::channel(CAPACITY);
            let dead = Arc::new(AtomicBool::new(false));
            let stop = CancellationToken::new();
            let hub = Arc::new(Hub {
                tx: tx.clone(),
                dead: Arc::clone(&dead),
                stop: stop.clone(),
            });
            hubs.insert(key, Entry::Hub(Arc::downgrade(&hub)));
            tokio::spawn(async move {
                // However the task ends (the stream lost, the last subscriber gone, or
                // the runtime shutting down), the subscribers learn it.
                let _lost = Lost {
                    dead,
                    tx: tx.clone(),
                };
                loop {
                    tokio::select! {
                        () = stop.cancelled() => break,
                        event = stream.next() => match event {
                            Some(Ok(e)) => {
                                let change = Change {
                                    id: e.document_key.and_then(|k| k.get("_id").cloned()),
                                    inserted: matches!(e.operation_type, OperationType::Insert),
                                    updated_fields: e.update_description.map(|u| u.updated_fields),
                                };
                                let _ = tx.send(Some(Arc::new(change)));
                            }
                            Some(Err(e)) => {
                                tracing::debug!(error = %e, "change-stream listener interrupted");
                                break;
                            }
                            None => break,
                        },
                    }
                }
            });
            Subscribed::Yes(Subscription { _hub: hub, rx })
        }
        Err(e) if matches!(*e.kind, ErrorKind::Command(_)) => {
            tracing::info!(error = %e, collection = %coll.name(), "change streams refused; polling");
            hubs.insert(key, Entry::Refused);
            Subscribed::Refused
        }
        Err(e) => Subscribed::Unavailable(e),
    }
}
