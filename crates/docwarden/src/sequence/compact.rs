//! Tombstone compaction below a watermark.
//!
//! **Watermark semantics:** by passing `watermark` the caller asserts that every operation
//! with a sequence number *below* it has been applied and will never be delivered again
//! (for example: the queue's acknowledged offset). Compaction then removes the tombstones
//! (`present: false` entries) whose `seq < watermark` and records the watermark in the
//! document (`_seq_sets.<field>.floor`, only ever raised). That is safe: any later operation on
//! such a member has `seq >= watermark`, which beats the removed tombstone anyway. As a
//! safety net, an operation that still arrives with `seq` below the recorded floor is
//! refused as [`super::ApplyOutcome::Stale`] instead of resurrecting a compacted member.
//! Present entries keep their state: a later remove must still compare against them.
//!
//! Each document is compacted by one atomic pipeline update; [`SequencedSet::compact_all`]
//! runs it over every document whose floor is below the watermark (each document
//! atomically, the collection not as one transaction — concurrent operations interleave
//! safely per document).

use mongodb::bson::{Bson, Document, doc};

use super::{SequencedSet, encode, validate_seq};
use crate::error::Result;

/// What a compaction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct CompactionReport {
    /// Documents the compaction looked at.
    pub matched: u64,
    /// Documents it changed (tombstones removed or the floor raised).
    pub modified: u64,
}

impl SequencedSet {
    /// Removes the tombstones of `key`'s set with `seq < watermark` and raises the
    /// document's floor to `watermark`, atomically.
    ///
    /// # Errors
    /// [`crate::Error::InvalidInput`] for a bad key or a negative watermark;
    /// [`crate::Error::Database`] otherwise.
    pub async fn compact(&self, key: impl Into<Bson>, watermark: i64) -> Result<CompactionReport> {
        let key = encode::key(key.into())?;
        validate_seq(watermark)?;
        let r = self
            .collection
            .update_one(
                doc! { self.key_field.as_str(): key.clone() },
                self.compaction_pipeline(watermark),
            )
            .await?;
        tracing::debug!(%key, watermark, modified = r.modified_count, "compacted");
        Ok(CompactionReport {
            matched: r.matched_count,
            modified: r.modified_count,
        })
    }

    /// Compacts every document of the collection whose floor is below `watermark` (see
    /// [`SequencedSet::compact`]): removes its tombstones with `seq < watermark` and raises
    /// its floor. Each document is updated atomically.
    ///
    /// # Errors
    /// [`crate::Error::InvalidInput`] for a negative watermark;
    /// [`crate::Error::Database`] otherwise.
    pub async fn compact_all(&self, watermark: i64) -> Result<CompactionReport> {
        validate_seq(watermark)?;
        let r = self
            .collection
            .update_many(
                // Documents whose floor is already at or above the watermark cannot hold a
                // tombstone below it: operations below the floor are refused.
                doc! {
                    self.state_field.as_str(): { "$exists": true },
                    "$or": [
                        { self.floor_field.as_str(): { "$exists": false } },
                        { self.floor_field.as_str(): { "$lt": watermark } },
                    ],
                },
                self.compaction_pipeline(watermark),
            )
            .await?;
        tracing::debug!(
            watermark,
            modified = r.modified_count,
            "compacted collection"
        );
        Ok(CompactionReport {
            matched: r.matched_count,
            modified: r.modified_count,
        })
    }

    /// The compaction pipeline (public for inspection and other-language ports).
    pub fn compaction_pipeline(&self, watermark: i64) -> Vec<Document> {
        let state = format!("${}", self.state_field);
        let floor = format!("${}", self.floor_field);
        vec![doc! { "$set": {
            self.state_field.as_str(): { "$arrayToObject": { "$filter": {
                "input": { "$objectToArray": { "$ifNull": [state.as_str(), {}] } },
                "as": "e",
                "cond": { "$not": [{ "$and": [
                    { "$eq": ["$$e.v.present", false] },
                    { "$lt": ["$$e.v.seq", watermark] },
                ] }] },
            } } },
            self.floor_field.as_str(): { "$max": [{ "$ifNull": [floor.as_str(), 0_i64] }, watermark] },
        } }]
    }
}
