//! The sweep of waiting jobs that no claim can take: hand-edited documents whose `run_at`
//! is not a date (never due) or whose `limits` is neither a document nor null (neither
//! kind of claim matches it). Both go to `dead` with the reason, so a hand edit is
//! reported instead of leaving a job waiting forever.
//!
//! **Its cost does not grow with the backlog.** Neither condition can be answered from an
//! index (MongoDB fetches every document to test `$not: {$type: "date"}`, and no index
//! holds `limits`), so a sweep of the whole queue reads every waiting job. Until session
//! 36 every handle did that at its first claim and then once a minute: at a backlog of
//! 1,000,000 jobs, two `updateMany`s of 3–4 s each on the embedded server, which holds
//! the collection's write lock while it scans, and on MongoDB a fetch of every waiting
//! job per worker per minute (`docs/benchmarks.md`, session 36). Now the automatic sweep
//! reads one *slice* at a time: the waiting jobs of one partition (`partition: {$in:
//! [k]}`, the batch claim's own index prefix), and a last slice for jobs of format 1
//! (`partition` missing or null) and out-of-range partitions. A slice is one read of
//! `_id`s; only the `_id`s it finds are then written, with the condition re-checked. A
//! job whose `partition` was hand-edited into something that is neither a number nor null
//! is in no slice: [`JobQueue::stats`] counts it and [`JobQueue::reap_expired`] sweeps it.
//!
//! **Pacing.** A handle sweeps its next slice at most once per `reap_interval` and, after
//! a slice that took `d`, not before [`SHARE`] × `d` has passed: the sweep takes at most
//! about 2 % of the time of the handle's claims, whatever the backlog. Handles start at a
//! random slice. So a hand-edited job is found within one pass, `partitions + 1` slices
//! of one handle (about 4 minutes at the defaults, one partition's read taking under
//! 5 ms; longer when a partition's read takes longer than `reap_interval / 50`), and
//! sooner with more handles.
//!
//! [`JobQueue::reap_expired`] still sweeps the whole queue in one call: an explicit
//! request, for tests and operators.

use std::time::{Duration, Instant};

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc};

use super::JobQueue;
use super::job::{JobState, claimable_states, field};
use crate::clock::ServerTime;
use crate::error::Result;

/// A slice's read takes at most one part in `SHARE` of the handle's time: after a slice
/// that took `d`, the next is not read before `SHARE × d` has passed.
pub(crate) const SHARE: u32 = 50;

/// Most `_id`s one slice's read returns; the rest of a slice holding more malformed jobs
/// is found at the next pass.
const SLICE_LIMIT: i64 = 1_000;

/// Where a handle's automatic sweep is: the next slice, and when it may be read.
#[derive(Debug)]
pub(crate) struct SweepCursor {
    /// The next slice: a partition in `0..partitions`, or `partitions` for the last one
    /// (format 1 and out-of-range partitions).
    next: u32,
    /// Not before this instant (`None`: at once).
    due: Option<Instant>,
}

impl SweepCursor {
    /// A cursor at a random slice of `partitions + 1`, due at once.
    pub(crate) fn new(partitions: u32) -> Self {
        Self {
            next: rand::random_range(0..=partitions),
            due: None,
        }
    }
}

/// The partition arms of slice `slice` of a queue with `partitions` partitions: the
/// partition itself, or for the last slice every job no partition's slice reads
/// (`partition` missing or null, below 0, or at or above `partitions`). Each arm is an
/// index range of the batch claim's `{state, queue, partition, …}` index on both servers.
fn slice_arms(slice: u32, partitions: u32) -> Vec<Bson> {
    if slice < partitions {
        vec![Bson::Document(doc! { "$in": [i64::from(slice)] })]
    } else {
        vec![
            Bson::Document(doc! { "$in": [Bson::Null] }),
            Bson::Document(doc! { "$lt": 0_i64 }),
            Bson::Document(doc! { "$gte": i64::from(partitions) }),
        ]
    }
}

impl JobQueue {
    /// Claimable jobs that can never be due: `run_at` is not a date.
    pub(crate) fn undatable_filter(&self) -> Document {
        Self::undatable_in(Some(self.queue_value()))
    }

    /// [`JobQueue::undatable_filter`] for the jobs whose `queue` is `queue`, or for every
    /// job of the collection (`None`).
    pub(crate) fn undatable_in(queue: Option<Bson>) -> Document {
        super::in_queue(
            doc! {
                field::STATE: { "$in": claimable_states() },
                field::RUN_AT: { "$not": { "$type": "date" } },
            },
            queue,
        )
    }

    /// Claimable jobs that no claim can take: `limits` is there but neither a document
    /// nor null (a hand edit). Every plain claim requires `limits: null` and every
    /// limited claim `limits: {$type: "object"}`; an array counts as malformed whatever
    /// it holds (`$type` matches an array by its elements).
    pub(crate) fn malformed_limits_filter(&self) -> Document {
        Self::malformed_limits_in(Some(self.queue_value()))
    }

    /// [`JobQueue::malformed_limits_filter`] for the jobs whose `queue` is `queue`, or for
    /// every job of the collection (`None`).
    pub(crate) fn malformed_limits_in(queue: Option<Bson>) -> Document {
        let waiting = super::in_queue(doc! { field::STATE: { "$in": claimable_states() } }, queue);
        doc! { "$and": [waiting, Self::malformed_limits()] }
    }

    /// The condition on `limits` of [`JobQueue::malformed_limits_filter`].
    fn malformed_limits() -> Document {
        doc! { "$or": [
            { field::LIMITS: { "$type": "array" } },
            { field::LIMITS: { "$exists": true, "$not": { "$type": ["object", "null"] } } },
        ] }
    }

    /// The read of one slice: the `_id`s of its waiting jobs that are undatable or have
    /// malformed limits.
    fn slice_filter(&self, slice: u32) -> Document {
        let mut arms = Vec::new();
        for part in slice_arms(slice, self.inner.options.partitions) {
            for state in [JobState::Ready, JobState::Retrying] {
                arms.push(doc! {
                    field::STATE: state.as_str(),
                    field::QUEUE: self.queue_value(),
                    field::PARTITION: part.clone(),
                });
            }
        }
        doc! { "$and": [
            { "$or": arms },
            { "$or": [
                { field::RUN_AT: { "$not": { "$type": "date" } } },
                Self::malformed_limits(),
            ] },
        ] }
    }

    /// Reads and sweeps the handle's next slice if it is due (see the module docs);
    /// called by claims after the sweep of expired leases. Returns how many jobs it
    /// moved to `dead`.
    pub(super) async fn sweep_malformed_slice(&self, now: &ServerTime) -> Result<u64> {
        let slice = {
            let mut cursor = self
                .inner
                .malformed_sweep
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if cursor.due.is_some_and(|due| Instant::now() < due) {
                return Ok(0);
            }
            // Claimed: another claim of the handle does not read the same slice meanwhile.
            cursor.due = Some(Instant::now() + self.inner.options.reap_interval);
            let slice = cursor.next;
            cursor.next = (slice + 1) % (self.inner.options.partitions + 1);
            slice
        };
        let started = Instant::now();
        let result = self.sweep_slice(slice, now).await;
        let took = started.elapsed();
        let mut cursor = self
            .inner
            .malformed_sweep
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        cursor.due =
            Some(Instant::now() + next_slice_after(took, self.inner.options.reap_interval));
        if result.is_err() {
            // Read it again at the next turn.
            cursor.next = slice;
        }
        result
    }

    async fn sweep_slice(&self, slice: u32, now: &ServerTime) -> Result<u64> {
        let found: Vec<Document> = self
            .inner
            .coll
            .find(self.slice_filter(slice))
            .projection(doc! { field::ID: 1 })
            .limit(SLICE_LIMIT)
            .await?
            .try_collect()
            .await?;
        if found.is_empty() {
            return Ok(0);
        }
        let ids: Vec<Bson> = found
            .into_iter()
            .filter_map(|d| d.get(field::ID).cloned())
            .collect();
        self.bury_unclaimable(Some(ids), now).await
    }

    /// Moves the waiting jobs that no claim can take to `dead` with the reason: all of the
    /// queue's (`ids` `None`, [`JobQueue::reap_expired`]), or those among `ids` (a slice),
    /// each condition re-checked by its write. Returns how many it moved.
    pub(super) async fn bury_unclaimable(
        &self,
        ids: Option<Vec<Bson>>,
        now: &ServerTime,
    ) -> Result<u64> {
        // Each condition: its filter, the field it names, what that field must be, and
        // the warning logged when it moved jobs.
        let conditions = [
            (
                self.undatable_filter(),
                field::RUN_AT,
                "a date",
                "jobs whose run_at is not a date moved to dead",
            ),
            (
                self.malformed_limits_filter(),
                field::LIMITS,
                "a document",
                "jobs whose limits is neither a document nor null moved to dead",
            ),
        ];
        let mut moved = 0;
        for (mut filter, name, must_be, warning) in conditions {
            if let Some(ids) = &ids {
                filter.insert(field::ID, doc! { "$in": ids.clone() });
            }
            let n = self
                .inner
                .coll
                .update_many(
                    filter,
                    vec![doc! { "$set": {
                        field::STATE: JobState::Dead.as_str(),
                        field::LAST_ERROR: { "$concat": [
                            format!("malformed job document: `{name}` must be {must_be}, found "),
                            { "$type": format!("${name}") },
                        ] },
                        field::FINISHED_AT: now.estimate(),
                        field::UPDATED_AT: now.estimate(),
                    } }],
                )
                .await?
                .modified_count;
            if n > 0 {
                tracing::warn!(jobs = n, "{warning}");
            }
            moved += n;
        }
        Ok(moved)
    }
}

/// How long after a slice that took `took` the next may be read: [`SHARE`] × `took`, and
/// at least `reap_interval`.
fn next_slice_after(took: Duration, reap_interval: Duration) -> Duration {
    took.saturating_mul(SHARE).max(reap_interval)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_slice_spaces_the_next_by_its_share() {
        let second = Duration::from_secs(1);
        assert_eq!(next_slice_after(Duration::from_millis(4), second), second);
        assert_eq!(
            next_slice_after(Duration::from_millis(200), second),
            Duration::from_secs(10)
        );
    }

    #[test]
    fn the_slices_cover_every_partition_then_the_rest() {
        assert_eq!(
            slice_arms(0, 4),
            vec![Bson::Document(doc! { "$in": [0_i64] })]
        );
        assert_eq!(
            slice_arms(3, 4),
            vec![Bson::Document(doc! { "$in": [3_i64] })]
        );
        let last = slice_arms(4, 4);
        assert_eq!(last.len(), 3);
        assert!(last.contains(&Bson::Document(doc! { "$gte": 4_i64 })));
        assert!(last.contains(&Bson::Document(doc! { "$in": [Bson::Null] })));
        assert!(last.contains(&Bson::Document(doc! { "$lt": 0_i64 })));
        for _ in 0..100 {
            assert!(SweepCursor::new(4).next <= 4);
        }
    }
}
