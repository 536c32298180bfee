//! Which idle worker a change-stream event wakes: one per job, not every one.
//!
//! The idle workers of a handle share one change stream (`crate::listener`), so every one
//! of them sees each inserted job. Before, each tried to claim it by `_id`, and all but
//! one then ran a batch claim that found nothing: 16 idle workers sent 17 writes and 16
//! reads per job enqueued one at a time (`tests/queue_shared_listener.rs`). Now the first
//! idle worker without a wake-up pending takes the event ([`WakeLedger::take`]); the
//! others leave it.
//!
//! **Guarantee:** a hint, never a grant. The claim decides; a job whose taker died, or
//! which no idle worker took (all had a wake-up pending: they are claiming and go on
//! claiming while claims find jobs), is claimed by the next claim or poll of any worker.

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;

use mongodb::bson::Bson;

/// How many recent events the ledger remembers (older ones may be taken twice: harmless).
const REMEMBERED: usize = 4096;

/// The job events a handle's workers have taken, most recent last.
#[derive(Debug, Default)]
pub(crate) struct WakeLedger {
    taken: Mutex<(HashSet<String>, VecDeque<String>)>,
}

impl WakeLedger {
    /// Takes the event of job `id` for the calling worker: `true` for the first caller,
    /// `false` once another worker of the handle took it.
    pub(crate) fn take(&self, id: &Bson) -> bool {
        let key = id.to_string();
        let mut guard = self.taken.lock().unwrap_or_else(|p| p.into_inner());
        let (set, order) = &mut *guard;
        if !set.insert(key.clone()) {
            return false;
        }
        order.push_back(key);
        if order.len() > REMEMBERED
            && let Some(old) = order.pop_front()
        {
            set.remove(&old);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::oid::ObjectId;

    #[test]
    fn each_event_is_taken_once_and_old_ones_are_forgotten() {
        let ledger = WakeLedger::default();
        let a = Bson::ObjectId(ObjectId::new());
        assert!(ledger.take(&a));
        assert!(!ledger.take(&a));
        for _ in 0..REMEMBERED {
            assert!(ledger.take(&Bson::ObjectId(ObjectId::new())));
        }
        assert!(ledger.take(&a), "forgotten after {REMEMBERED} newer events");
    }
}
