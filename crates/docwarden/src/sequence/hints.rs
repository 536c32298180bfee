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
