//! Wake-ups for blocking acquires: a waiter listens to a change stream on the one document
//! it waits for and retries the moment that document is freed, instead of backing off.
//!
//! **Guarantee:** a waiter that has armed its [`Wake`] (the stream is open) and then found
//! the resource held learns of every later change that matches its filter within the
//! change stream's delivery time (a few milliseconds on the embedded server), and retries
//! then. A release that happened *before* the stream opened is not delivered; that is why
//! [`Wake::arm`] reports when it has just opened the stream and the caller must try once
//! more before it waits.
//!
//! **Limits:** expiry is not an event (no write happens when a crashed holder's lease
//! lapses), so a waiter still polls, at the caller's interval, for leases that expire
//! without a release. Where the server refuses change streams (a standalone server, or a
//! user without the `changeStream` privilege) the refusal is detected at run time and the
//! waiter polls with the caller's backoff. Each armed waiter holds one change-stream
//! cursor for as long as it waits.

use std::time::Duration;

use futures::StreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};
use mongodb::change_stream::ChangeStream;
use mongodb::change_stream::event::ChangeStreamEvent;
use mongodb::error::ErrorKind;

/// How long the server holds one `getMore` of a waiter's change stream without events.
const MAX_AWAIT: Duration = Duration::from_millis(50);

/// The state of a waiter's change stream.
enum Stream {
    /// Not opened yet (or closed after an error: it is opened again by the next `arm`).
    Closed,
    /// Open and listening.
    Open(Box<ChangeStream<ChangeStreamEvent<Document>>>),
    /// The server refused change streams: poll only.
    Refused,
}

/// What a [`Wake::wait`] ended with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Woken {
    /// A matching change to the document arrived.
    Changed,
    /// The wait's time was up (or no stream is open: the caller's poll interval passed).
    TimedOut,
}

/// One waiter's wake-up on one document; see the module docs.
pub(crate) struct Wake {
    coll: Collection<Document>,
    pipeline: Vec<Document>,
    stream: Stream,
}

impl std::fmt::Debug for Wake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.stream {
            Stream::Closed => "closed",
            Stream::Open(_) => "open",
            Stream::Refused => "refused",
        };
        f.debug_struct("Wake")
            .field("collection", &self.coll.name())
            .field("stream", &state)
            .finish()
    }
}

impl Wake {
    /// A wake-up on changes of document `id` in `coll` that also match `matching` (a
    /// `$match` condition on the change event, for example
    /// [`Wake::freed_lock`]); nothing is opened until [`Wake::arm`].
    pub(crate) fn new(coll: &Collection<Document>, id: &str, matching: Document) -> Self {
        Self {
            coll: coll.clone(),
            pipeline: pipeline(id, matching),
            stream: Stream::Closed,
        }
    }

    /// The change-event condition "the lock document was freed or may have been": deleted
    /// or replaced, or updated with `owner` set to `null` (a release). An acquire by
    /// another waiter does not wake anyone.
    pub(crate) fn freed_lock() -> Document {
        let owner = format!(
            "updateDescription.updatedFields.{}",
            crate::format::lock::collection::OWNER
        );
        doc! { "$or": [
            { "operationType": { "$in": ["delete", "replace", "invalidate"] } },
            { owner: Bson::Null },
        ] }
    }

    /// Opens the change stream if it is not open. Returns `true` when it has *just* been
    /// opened: a release before that instant was not seen, so the caller must try once
    /// more before it waits. `false` when it was open already, or cannot be opened (then
    /// [`Wake::wait`] only sleeps).
    pub(crate) async fn arm(&mut self) -> bool {
        if !matches!(self.stream, Stream::Closed) {
            return false;
        }
        // A short server-side wait per getMore: a waiter that stops waiting (it acquired,
        // or gave up) drops its stream while a getMore may be in flight, and that
        // getMore holds a pooled connection until it returns; with the server's default
        // of 1 s, many short waits exhaust the pool. Events still arrive at once.
        match self
            .coll
            .watch()
            .pipeline(self.pipeline.clone())
            .max_await_time(MAX_AWAIT)
            .await
        {
            Ok(stream) => {
                self.stream = Stream::Open(Box::new(stream));
                true
            }
            Err(e) if matches!(*e.kind, ErrorKind::Command(_)) => {
                tracing::info!(error = %e, collection = %self.coll.name(), "change streams refused; waiters poll");
                self.stream = Stream::Refused;
                false
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot open the change stream; polling this round");
                false
            }
        }
    }

    /// Whether a change stream is open (then the caller may wait longer between polls).
    pub(crate) fn is_listening(&self) -> bool {
        matches!(self.stream, Stream::Open(_))
    }

    /// Waits for a matching change, at most `max`. Without an open stream it sleeps `max`.
    /// An interrupted stream is closed (the next [`Wake::arm`] opens it again) and counts
    /// as a change, so the caller retries at once.
    pub(crate) async fn wait(&mut self, max: Duration) -> Woken {
        let Stream::Open(stream) = &mut self.stream else {
            tokio::time::sleep(max).await;
            return Woken::TimedOut;
        };
        match tokio::time::timeout(max, stream.next()).await {
            Ok(Some(Ok(_))) => Woken::Changed,
            Ok(Some(Err(e))) => {
                tracing::debug!(error = %e, "change stream interrupted");
                self.stream = Stream::Closed;
                Woken::Changed
            }
            Ok(None) => {
                self.stream = Stream::Closed;
                Woken::Changed
            }
            Err(_) => Woken::TimedOut,
        }
    }
}

/// The change stream's pipeline: the one document first (so the server filters by key),
/// then the caller's condition; only the fields a wake-up needs.
fn pipeline(id: &str, matching: Document) -> Vec<Document> {
    vec![
        doc! { "$match": { "$and": [{ "documentKey._id": id }, matching] } },
        doc! { "$project": { "operationType": 1, "documentKey": 1 } },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_matches_the_document_first() {
        let p = pipeline("r", Wake::freed_lock());
        assert_eq!(
            p[0],
            doc! { "$match": { "$and": [{ "documentKey._id": "r" }, Wake::freed_lock()] } }
        );
        assert_eq!(
            Wake::freed_lock(),
            doc! { "$or": [
                { "operationType": { "$in": ["delete", "replace", "invalidate"] } },
                { "updateDescription.updatedFields.owner": null },
            ] }
        );
    }
}
