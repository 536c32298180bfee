//! Guarded updates in batches: many changes, each to its own document, in one round trip.
//!
//! **Guarantee.** [`Guarded::update_many`] writes each change as the same `{_id}` filter
//! and pipeline [`Guarded::update`] sends, so the server checks every invariant on each
//! document atomically with its write, whatever else runs: no interleaving breaks an
//! invariant that held (no write skew), as for one update. The changes travel in one
//! ordered `bulkWrite` command (MongoDB 8.0) with per-change results: a change that
//! modified its document is [`GuardOutcome::Applied`]; every other one is explained by the
//! same read [`Guarded::update`] uses (rejected by which invariant, no change, no such
//! document or member), and tried again on its own if its document changed in between.
//!
//! **Limits.** One round trip needs the `bulkWrite` command: on an older server the handle
//! sends one update at a time (same outcomes). Changes are decided in batch order, and a
//! change explained after the bulk is decided after every change of the batch: a change
//! refused by the bulk whose document a later change of the batch made acceptable is then
//! applied (two changes to one document: the second sees the first, and the first may be
//! applied after it). [`Guarded::update_many`] fails the whole call on the first failed
//! change, and the outcomes of the changes written with it are lost: sending the batch
//! again is safe only for changes that are states (`set`, `set_member`, `pull_member`: a
//! repeat is [`GuardOutcome::NoChange`]), not for `inc` and `push`.
//! [`Guarded::update_each`] answers each change's own result instead.

use mongodb::bson::{Bson, Document};
use mongodb::options::UpdateModifications;

use super::update::Ran;
use super::{Change, GuardOutcome, Guarded, Invariant};
use crate::error::Result;

impl Guarded {
    /// Applies each `(target, change)` to the document with `_id == target` only if that
    /// document after the change satisfies every invariant; one round trip for the batch
    /// (see [`crate::guard`]'s batch module), outcomes in the same order.
    ///
    /// The first change that fails fails the call, and the outcomes of the changes the
    /// bulk wrote are lost with it: for `inc` and `push` changes, which are not states, use
    /// [`Guarded::update_each`], which reports each change's own result.
    ///
    /// # Errors
    /// [`Error::InvalidInput`](crate::Error::InvalidInput) if any target is not a plain
    /// document id (as [`Guarded::update`]; nothing is sent); the first error of a change
    /// (as [`Guarded::update`]; the changes after it that the bulk did not run are not
    /// sent); a database error of the bulk (network, write concern).
    pub async fn update_many(
        &self,
        changes: &[(Bson, Change)],
        invariants: &[Invariant],
    ) -> Result<Vec<GuardOutcome>> {
        self.batch(changes, invariants, true)
            .await?
            .into_iter()
            .collect()
    }

    /// As [`Guarded::update_many`], with each change's own result: a change that fails
    /// (a validator's refusal, an integer `inc` out of range, an `inc` or `push` on a stored
    /// value it refuses, an error of its explaining read) does not hide the outcomes of the others, which are all sent. The answer has
    /// one entry per change, in the same order.
    ///
    /// # Errors
    /// The outer error, before any per-change result: [`Error::InvalidInput`](crate::Error::InvalidInput)
    /// if any target is not a plain document id (nothing is sent), or a database error of
    /// the bulk itself (network, write concern: which changes were written is then unknown;
    /// read them back).
    pub async fn update_each(
        &self,
        changes: &[(Bson, Change)],
        invariants: &[Invariant],
    ) -> Result<Vec<Result<GuardOutcome>>> {
        self.batch(changes, invariants, false).await
    }

    /// The batch: one bulk, then each change not written explained (or sent alone). With
    /// `stop`, nothing more is sent after the first failed change.
    async fn batch(
        &self,
        changes: &[(Bson, Change)],
        invariants: &[Invariant],
        stop: bool,
    ) -> Result<Vec<Result<GuardOutcome>>> {
        for (target, _) in changes {
            crate::validate::document_id("target", target)?;
        }
        // Per change: `None` not run by a bulk, else what its update did.
        let mut ran: Vec<Option<Ran>> = vec![None; changes.len()];
        if changes.len() > 1 && !self.no_bulk.load(std::sync::atomic::Ordering::Relaxed) {
            let updates: Vec<(Document, UpdateModifications)> = changes
                .iter()
                .map(|(target, change)| {
                    (
                        change.filter(target),
                        UpdateModifications::Pipeline(change.pipeline(invariants)),
                    )
                })
                .collect();
            for (i, result) in
                crate::bulk::updates(self.collection(), updates, &self.no_bulk).await?
            {
                if let Some(slot) = ran.get_mut(i) {
                    *slot = Some(Ran::of(&result));
                }
            }
        }
        let mut out = Vec::with_capacity(changes.len());
        for ((target, change), ran) in changes.iter().zip(ran) {
            let outcome = match ran {
                Some(Ran::Written) => Ok(GuardOutcome::Applied),
                Some(Ran::NoDocument) => Ok(GuardOutcome::NotFound),
                // Not written: why, by the read the single update uses; if the document
                // would match now (it changed in between), the single update.
                Some(Ran::Kept) => match self.diagnose(target, change, invariants).await {
                    Ok(Some(o)) => Ok(o),
                    Ok(None) => self.update(target.clone(), change, invariants).await,
                    Err(e) => Err(e),
                },
                None => self.update(target.clone(), change, invariants).await,
            };
            let failed = outcome.is_err();
            out.push(outcome);
            if failed && stop {
                break;
            }
        }
        Ok(out)
    }
}
