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
//!
//! **Hand-edited bookkeeping is left as it is.** A document whose `_seq_sets`,
//! `_seq_sets.<field>` or `state` is neither missing nor a document is not compacted: the
//! pipeline writes it back as stored (before session 22 it wrote fresh bookkeeping over a
//! scalar, and one `state` that was not a document failed `compact_all` for the whole
//! collection). [`SequencedSet::compact`] answers [`crate::Error::Malformed`] naming the
//! field; [`SequencedSet::compact_all`] compacts the others and counts such documents in
//! [`CompactionReport::malformed`].

use mongodb::bson::{Bson, Document, doc};

use super::set::{SETS_FIELD, bookkeeping_malformed, in_shape};
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
    /// Documents it left alone because their bookkeeping was edited out of the shape
    /// docwarden writes (see the module documentation; [`SequencedSet::compact_all`] only).
    pub malformed: u64,
}

impl SequencedSet {
    /// Removes the tombstones of `key`'s set with `seq < watermark` and raises the
    /// document's floor to `watermark`, atomically.
    ///
    /// # Errors
    /// [`crate::Error::InvalidInput`] for a bad key or a negative watermark;
    /// [`crate::Error::Malformed`] naming the field when the set's bookkeeping was edited
    /// out of shape (nothing written); [`crate::Error::Database`] otherwise.
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
        if r.matched_count == 1
            && r.modified_count == 0
            && let Some((path, shape)) = self.broken_field(&key, false).await
        {
            return Err(bookkeeping_malformed(&key, &path, shape));
        }
        tracing::debug!(%key, watermark, modified = r.modified_count, "compacted");
        Ok(CompactionReport {
            matched: r.matched_count,
            modified: r.modified_count,
            malformed: 0,
        })
    }

    /// Compacts every document of the collection whose floor is below `watermark` (see
    /// [`SequencedSet::compact`]): removes its tombstones with `seq < watermark` and raises
    /// its floor. Each document is updated atomically. Documents whose bookkeeping was
    /// edited out of shape are left as they are and counted in
    /// [`CompactionReport::malformed`] (a warning is logged).
    ///
    /// # Errors
    /// [`crate::Error::InvalidInput`] for a negative watermark;
    /// [`crate::Error::Database`] otherwise.
    pub async fn compact_all(&self, watermark: i64) -> Result<CompactionReport> {
        validate_seq(watermark)?;
        // Documents whose floor is already at or above the watermark cannot hold a
        // tombstone below it: operations below the floor are refused.
        let below = doc! {
            self.state_field.as_str(): { "$exists": true },
            "$or": [
                { self.floor_field.as_str(): { "$exists": false } },
                { self.floor_field.as_str(): { "$lt": watermark } },
            ],
        };
        let r = self
            .collection
            .update_many(below.clone(), self.compaction_pipeline(watermark))
            .await?;
        // Only when some matched document was left unchanged: count those out of shape.
        let malformed = if r.matched_count > r.modified_count {
            self.collection
                .count_documents(doc! { "$and": [
                    below,
                    { "$expr": { "$not": [in_shape(&self.set_paths())] } },
                ] })
                .await?
        } else {
            0
        };
        if malformed > 0 {
            tracing::warn!(
                collection = %self.collection.name(),
                field = %self.field(),
                malformed,
                "compaction left documents whose set bookkeeping is not in the shape docwarden writes"
            );
        }
        tracing::debug!(
            watermark,
            modified = r.modified_count,
            "compacted collection"
        );
        Ok(CompactionReport {
            matched: r.matched_count,
            modified: r.modified_count,
            malformed,
        })
    }

    /// The compaction pipeline (public for inspection and other-language ports): the
    /// `state` without the tombstones below `watermark` and the `floor` raised to it,
    /// written into `_seq_sets` as a whole when `_seq_sets`, `_seq_sets.<field>` and
    /// `state` are each missing or a document; `_seq_sets` as stored otherwise.
    pub fn compaction_pipeline(&self, watermark: i64) -> Vec<Document> {
        let state = format!("${}", self.state_field);
        let floor = format!("${}", self.floor_field);
        let compacted = self.sets_with(doc! {
            "state": { "$arrayToObject": { "$filter": {
                "input": { "$objectToArray": { "$ifNull": [state.as_str(), {}] } },
                "as": "e",
                "cond": { "$not": [{ "$and": [
                    { "$eq": ["$$e.v.present", false] },
                    { "$lt": ["$$e.v.seq", watermark] },
                ] }] },
            } } },
            "floor": { "$max": [{ "$ifNull": [floor.as_str(), 0_i64] }, watermark] },
        });
        vec![doc! { "$set": {
            SETS_FIELD: { "$cond": [
                in_shape(&self.set_paths()),
                compacted,
                format!("${SETS_FIELD}"),
            ] },
        } }]
    }
}
