//! Wake-ups for blocking acquires: a waiter is told the moment the one document it waits
//! for is freed and retries then, instead of backing off.
//!
//! **Guarantee:** a waiter that has armed its [`Wake`] and then found the resource held
//! learns of every later change of its document that matches its condition within the
//! change stream's delivery time (a few milliseconds on the embedded server), and retries
//! then. A release that happened *before* the waiter armed is not delivered; that is why
//! [`Wake::arm`] reports when it has just armed and the caller must try once more before
//! it waits.
//!
//! **One stream per collection, not per waiter.** All waiters of one process on one
//! collection (and one condition) share one change-stream listener
//! ([`crate::listener`]): one cursor and one pooled connection for its `getMore`s, which
//! forwards the key of each matching change to the waiters, who pick their own document.
//! (A stream per waiter held a pooled connection per waiter: 16 waiters starved the
//! acquirers of connections.) The listener stops when its last waiter leaves and is
//! opened again by the next one.
//!
//! **Limits:** a wake-up is a hint, never a grant: the waiter's next acquire decides.
//! Expiry is not an event (no write happens when a crashed holder's lease lapses), so a
//! waiter still polls, at the caller's interval, for leases that expire without a
//! release. Where the server refuses change streams (a standalone server, or a user
//! without the `changeStream` privilege) the refusal is detected at run time, remembered
//! for the collection, and waiters poll with the caller's backoff. Listeners are shared by
//! namespace within a process (see [`crate::listener`] for what that means with two
//! deployments).

use std::time::Duration;

use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};

use super::deadline::Deadline;
use crate::backoff::Backoff;
use crate::listener::{Received, Subscribed, Subscription, subscribe};

/// The state of one waiter.
enum State {
    /// Not armed yet (or disarmed after the listener was lost: re-armed by the next `arm`).
    Closed,
    /// Subscribed to a live listener.
    Open(Subscription),
    /// The server refused change streams: poll only.
    Refused,
}

/// What a [`Wake::wait`] ended with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Woken {
    /// A matching change to the document arrived (or may have: the listener lagged or
    /// was lost).
    Changed,
    /// The wait's time was up (or no listener: the caller's poll interval passed).
    TimedOut,
}

/// One waiter's wake-up on one document; see the module docs.
pub(crate) struct Wake {
    coll: Collection<Document>,
    id: Bson,
    matching: Document,
    state: State,
}

impl std::fmt::Debug for Wake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            State::Closed => "closed",
            State::Open(_) => "open",
            State::Refused => "refused",
        };
        f.debug_struct("Wake")
            .field("collection", &self.coll.name())
            .field("id", &self.id)
            .field("state", &state)
            .finish()
    }
}

impl Wake {
    /// A wake-up on changes of document `id` in `coll` that also match `matching` (a
    /// `$match` condition on the change event, for example [`Wake::freed_lock`]); nothing
    /// is subscribed until [`Wake::arm`].
    pub(crate) fn new(
        coll: &Collection<Document>,
        id: impl Into<Bson>,
        matching: Document,
    ) -> Self {
        Self {
            coll: coll.clone(),
            id: id.into(),
            matching,
            state: State::Closed,
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

    /// The change-event condition "the document lock was freed or may have been" for a
    /// document lock whose id is in `lock_id_field` ([`super::DocumentLocks`]): deleted or
    /// replaced, updated with the lock id set to `null` (a release), or the lock id
    /// removed (a hand edit). A lock taken by another waiter does not wake anyone.
    pub(crate) fn freed_document(lock_id_field: &str) -> Document {
        doc! { "$or": [
            { "operationType": { "$in": ["delete", "replace", "invalidate"] } },
            { format!("updateDescription.updatedFields.{lock_id_field}"): Bson::Null },
            { "updateDescription.removedFields": lock_id_field },
        ] }
    }

    /// Subscribes to the collection's listener (opening it if none is alive). Returns
    /// `true` when it has *just* subscribed: a change before that instant was not seen,
    /// so the caller must try once more before it waits. `false` when it was subscribed
    /// already, or cannot be (then [`Wake::wait`] only sleeps).
    pub(crate) async fn arm(&mut self) -> bool {
        if !matches!(self.state, State::Closed) {
            return false;
        }
        match subscribe(&self.coll, pipeline(self.matching.clone())).await {
            Subscribed::Yes(sub) => {
                self.state = State::Open(sub);
                true
            }
            Subscribed::Refused => {
                self.state = State::Refused;
                false
            }
            Subscribed::Unavailable(e) => {
                tracing::debug!(error = %e, "cannot open the change stream; polling this round");
                false
            }
        }
    }

    /// Between two attempts of a blocking acquire that did not get the lock (held, or a
    /// transient error): waits for the next attempt. After a transient error, the
    /// `backoff`; otherwise the release itself (this waiter's change stream, armed here
    /// when `listen`; an arm that just opened returns at once, since a release before it
    /// was not seen), polling every `poll` for an expiry without a release, or the
    /// `backoff` where change streams are refused. Never past the `deadline`; `false`
    /// when the wait has passed (the caller returns [`Deadline::passed`]).
    pub(crate) async fn before_next_attempt(
        &mut self,
        deadline: &Deadline,
        backoff: &mut Backoff,
        listen: bool,
        poll: Duration,
    ) -> bool {
        let Some(remaining) = deadline.left() else {
            return false;
        };
        if deadline.failing() {
            tokio::time::sleep(backoff.next_delay().min(remaining)).await;
            return true;
        }
        if listen && self.arm().await {
            return true;
        }
        let delay = if self.is_listening() {
            poll
        } else {
            backoff.next_delay()
        };
        self.wait(delay.min(remaining)).await;
        true
    }

    /// Whether it is subscribed to a listener (then the caller may wait longer between
    /// polls).
    pub(crate) fn is_listening(&self) -> bool {
        matches!(self.state, State::Open(_))
    }

    /// Waits for a matching change of its document, at most `max`. Without a listener it
    /// sleeps `max`. A lost listener disarms the waiter (the next [`Wake::arm`]
    /// subscribes again) and counts as a change, so the caller retries at once; so does a
    /// lag (changes dropped for this waiter).
    pub(crate) async fn wait(&mut self, max: Duration) -> Woken {
        let State::Open(sub) = &mut self.state else {
            tokio::time::sleep(max).await;
            return Woken::TimedOut;
        };
        let deadline = tokio::time::Instant::now() + max;
        loop {
            match tokio::time::timeout_at(deadline, sub.recv()).await {
                Err(_) => return Woken::TimedOut,
                Ok(Received::Change(c)) if c.id.as_ref() == Some(&self.id) => {
                    return Woken::Changed;
                }
                Ok(Received::Change(_)) => {}
                Ok(Received::Lagged) => return Woken::Changed,
                Ok(Received::Lost) => {
                    self.state = State::Closed;
                    return Woken::Changed;
                }
            }
        }
    }
}

/// The listener's pipeline: the caller's condition, and only the fields a wake-up needs
/// (the event's `_id` is its resume token and stays).
fn pipeline(matching: Document) -> Vec<Document> {
    vec![
        doc! { "$match": matching },
        doc! { "$project": { "operationType": 1, "documentKey": 1 } },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listener_matches_the_condition_and_keeps_the_key() {
        let p = pipeline(Wake::freed_lock());
        assert_eq!(p[0], doc! { "$match": Wake::freed_lock() });
        assert_eq!(
            p[1],
            doc! { "$project": { "operationType": 1, "documentKey": 1 } }
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
