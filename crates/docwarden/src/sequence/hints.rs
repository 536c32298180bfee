//! What a handle last saw of each `(key, name)` entry: the hint that picks which form of a
//! sequenced write to try first (issue 14's operator forms, [`super::set`] and
//! [`super::register`]).
//!
//! **Guarantee:** none about the data. A hint only chooses the form a write is sent in;
//! the server decides every outcome in one atomic write, so a stale or missing hint costs
//! a round trip, never a wrong document. **Limits:** one map per handle and its clones,
//! cleared when it reaches [`HINTS_MAX`] entries (so memory stays bounded and a consumer
//! of many keys starts over).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The most `(key, name)` hints a handle keeps before starting over.
pub(super) const HINTS_MAX: usize = 100_000;

/// The last state a handle (and its clones) saw per `(key, name)` entry.
#[derive(Debug)]
pub(super) struct Hints<V>(Arc<Mutex<HashMap<(String, String), V>>>);

impl<V> Clone for Hints<V> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<V> Default for Hints<V> {
    fn default() -> Self {
        Self(Arc::default())
    }
}

impl<V: Copy> Hints<V> {
    /// The last state of `at` this handle saw, if any.
    pub(super) fn get(&self, at: &(String, String)) -> Option<V> {
        self.0.lock().ok()?.get(at).copied()
    }

    /// Records the state of `at` as seen in a reply, clearing the map first when it holds
    /// [`HINTS_MAX`] entries.
    pub(super) fn remember(&self, at: (String, String), state: V) {
        if let Ok(mut hints) = self.0.lock() {
            if hints.len() >= HINTS_MAX {
                hints.clear();
            }
            hints.insert(at, state);
        }
    }
}

/// `ReadConcernMajorityNotEnabled`: the server answers majority reads with this error.
const READ_CONCERN_MAJORITY_NOT_ENABLED: i32 = 148;

/// The read that decides a write its hint says loses (stale or a duplicate): one
/// `find_one` with read concern `majority`, so that a no-op decided on what it returns is
/// one against a state a majority holds, which no rollback takes back. A deployment
/// without majority reads (error 148) is remembered, and its writes go to their update.
#[derive(Debug, Clone, Default)]
pub(super) struct LosingRead {
    no_majority: Arc<std::sync::atomic::AtomicBool>,
}

impl LosingRead {
    /// The document `filter` matches, projected; `None` when there is none, when the
    /// deployment has no majority reads, or when the read fails (the update then decides,
    /// and reports what is wrong).
    pub(super) async fn read(
        &self,
        collection: &mongodb::Collection<mongodb::bson::Document>,
        filter: mongodb::bson::Document,
        projection: mongodb::bson::Document,
    ) -> Option<mongodb::bson::Document> {
        use std::sync::atomic::Ordering;
        if self.no_majority.load(Ordering::Relaxed) {
            return None;
        }
        let read = collection
            .find_one(filter)
            .projection(projection)
            .read_concern(mongodb::options::ReadConcern::majority())
            .await;
        match read {
            Ok(found) => found,
            Err(e) => {
                if crate::error::error_code(&e) == Some(READ_CONCERN_MAJORITY_NOT_ENABLED) {
                    self.no_majority.store(true, Ordering::Relaxed);
                }
                tracing::debug!(error = %e, "the losing write's read failed; the update decides");
                None
            }
        }
    }
}
