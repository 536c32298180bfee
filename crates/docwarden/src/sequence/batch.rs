//! Batches of sequenced set operations: many `add`s and `remove`s in one round trip, for
//! a consumer that receives its messages in batches.
//!
//! **Guarantee.** [`SequencedSet::apply_many`] gives every operation the outcome rule and
//! the stored document of [`SequencedSet::add`] / [`SequencedSet::remove`]: the server
//! decides each one on the document as it is, so the documents converge to the same bytes
//! for any batching, order and duplication of the operations. The operations this handle
//! can predict (it has seen the member's state entry, and the operation wins against it)
//! travel together in one `bulkWrite` command, each as the operator form's conditional
//! update (`docs/sequence.md`), in the batch's order; the server answers for each one
//! whether it matched. The others — members seen for the first time, a document that does
//! not exist yet, a prediction the document no longer bears out — are then applied one by
//! one, as [`SequencedSet::add`] would.
//!
//! **Limits.** The one round trip needs MongoDB 8.0's `bulkWrite` command; an older server
//! refuses it once and the handle applies every later batch one operation at a time (same
//! outcomes, one round trip each). An operation applied one by one after the batch is
//! decided after every batched operation: when a batch holds two operations on the same
//! member, its outcome may be [`ApplyOutcome::Stale`] where a one-by-one run in batch
//! order said [`ApplyOutcome::Applied`] (the document is the same either way). An error
//! fails the whole call; the operations applied before it stay applied, and applying the
//! batch again is safe (each operation is idempotent: a repeat is a
//! [`ApplyOutcome::Duplicate`]).
//!
//! ```no_run
//! # async fn example(classes: docwarden::sequence::SequencedSet) -> docwarden::Result<()> {
//! use docwarden::sequence::{ApplyOutcome, SetOp};
//!
//! let outcomes = classes
//!     .apply_many(&[
//!         SetOp::add(7, "CS 101", 1),
//!         SetOp::add(8, "CS 101", 1),
//!         SetOp::remove(7, "CS 101", 2),
//!     ])
//!     .await?;
//! assert_eq!(outcomes.len(), 3);
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use mongodb::bson::{Bson, Document};
use mongodb::options::UpdateModifications;

use super::set::{SequencedSet, resolve};
use super::{ApplyOutcome, encode, validate_seq};
use crate::error::Result;

/// One operation of [`SequencedSet::apply_many`]: add or remove `member` in the set of
/// `key` as of `seq`.
#[derive(Debug, Clone, PartialEq)]
pub struct SetOp {
    /// The document's key (the set's key field).
    pub key: Bson,
    /// The member added or removed.
    pub member: String,
    /// The operation's sequence number (non-negative).
    pub seq: i64,
    /// `true`: an add; `false`: a remove.
    pub present: bool,
}

impl SetOp {
    /// An add of `member` to the set of `key` as of `seq`.
    pub fn add(key: impl Into<Bson>, member: impl Into<String>, seq: i64) -> Self {
        Self {
            key: key.into(),
            member: member.into(),
            seq,
            present: true,
        }
    }

    /// A remove of `member` from the set of `key` as of `seq`.
    pub fn remove(key: impl Into<Bson>, member: impl Into<String>, seq: i64) -> Self {
        Self {
            key: key.into(),
            member: member.into(),
            seq,
            present: false,
        }
    }
}

/// An operation sent in the bulk: its place in the batch, its hint key, and the state
/// entry it leaves when it applies.
struct Planned {
    index: usize,
    at: (String, String),
    state: (i64, bool),
}

impl SequencedSet {
    /// Applies `ops` in one round trip where it can (see [`crate::sequence::batch`]) and
    /// returns their outcomes in the same order. Every operation is validated first:
    /// if one is invalid, nothing is sent.
    ///
    /// # Errors
    /// [`crate::Error::InvalidInput`] naming the first bad key, member or `seq`;
    /// otherwise as [`SequencedSet::add`] (the operations before the failing one may be
    /// applied).
    pub async fn apply_many(&self, ops: &[SetOp]) -> Result<Vec<ApplyOutcome>> {
        let mut keys = Vec::with_capacity(ops.len());
        for op in ops {
            keys.push(encode::key(op.key.clone())?);
            encode::member(&op.member)?;
            validate_seq(op.seq)?;
        }
        let mut outcomes: Vec<Option<ApplyOutcome>> = vec![None; ops.len()];
        if self.canonical_order && self.operator_form && !self.no_bulk.load(Ordering::Relaxed) {
            let (planned, models) = self.plan(ops, &keys);
            if planned.len() > 1 {
                for (j, result) in
                    crate::bulk::updates(self.collection(), models, &self.no_bulk).await?
                {
                    if result.matched_count == 1
                        && let Some(p) = planned.get(j)
                    {
                        outcomes[p.index] = Some(ApplyOutcome::Applied);
                        self.remember(p.at.clone(), p.state);
                    }
                }
            }
        }
        let mut out = Vec::with_capacity(ops.len());
        for ((op, key), outcome) in ops.iter().zip(keys).zip(outcomes) {
            out.push(match outcome {
                Some(o) => o,
                None => self.apply(key, &op.member, op.seq, op.present).await?,
            });
        }
        tracing::debug!(ops = ops.len(), "sequenced set batch applied");
        Ok(out)
    }

    /// The operations whose outcome this handle predicts as applied, as operator-form
    /// updates in batch order. A member's prediction within the batch follows the
    /// batch's earlier operations on it.
    fn plan(
        &self,
        ops: &[SetOp],
        keys: &[Bson],
    ) -> (Vec<Planned>, Vec<(Document, UpdateModifications)>) {
        let mut predicted: HashMap<(String, String), (i64, bool)> = HashMap::new();
        let mut planned = Vec::new();
        let mut models = Vec::new();
        for (index, (op, key)) in ops.iter().zip(keys).enumerate() {
            let at = (key.to_string(), op.member.clone());
            let Some(state) = predicted.get(&at).copied().or_else(|| self.hint(&at)) else {
                continue;
            };
            if resolve(Some(state), op.seq, op.present) != ApplyOutcome::Applied {
                continue;
            }
            let (filter, update) =
                self.operator_update(key, &op.member, op.seq, op.present, state.1);
            models.push((filter, UpdateModifications::Document(update)));
            let state = (op.seq, op.present);
            predicted.insert(at.clone(), state);
            planned.push(Planned { index, at, state });
        }
        (planned, models)
    }
}
