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
//! change explained after the bulk is decided after every change of the batch (two
//! changes to one document: the second sees the first). An error fails the whole call with
//! the changes before it written; each change is a state ("Bob off call"), so sending the
//! batch again is safe (a repeat is [`GuardOutcome::NoChange`]).

use mongodb::bson::{Bson, Document};
use mongodb::options::UpdateModifications;

use super::{Change, GuardOutcome, Guarded, Invariant};
use crate::error::Result;

impl Guarded {
    /// Applies each `(target, change)` to the document with `_id == target` only if that
    /// document after the change satisfies every invariant; one round trip for the batch
    /// (see [`crate::guard`]'s batch module), outcomes in the same order.
    ///
    /// # Errors
    /// [`Error::InvalidInput`](crate::Error::InvalidInput) if any target is not a plain
    /// document id (as [`Guarded::update`]; nothing is sent); as [`Guarded::update`] for
    /// the changes that need their own round trip; a database error of the bulk (network,
    /// write concern).
    pub async fn update_many(
        &self,
        changes: &[(Bson, Change)],
        invariants: &[Invariant],
    ) -> Result<Vec<GuardOutcome>> {
        for (target, _) in changes {
            crate::validate::document_id("target", target)?;
        }
        // Per change: `None` not run by a bulk; `Some(true)` written; `Some(false)` run
        // and not written.
        let mut ran: Vec<Option<bool>> = vec![None; changes.len()];
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
                    *slot = Some(result.modified_count > 0);
                }
            }
        }
        let mut out = Vec::with_capacity(changes.len());
        for ((target, change), ran) in changes.iter().zip(ran) {
            out.push(match ran {
                Some(true) => GuardOutcome::Applied,
                // Not written: why, by the read the single update uses; if the document
                // would match now (it changed in between), the single update.
                Some(false) => match self.diagnose(target, change, invariants).await? {
                    Some(o) => o,
                    None => self.update(target.clone(), change, invariants).await?,
                },
                None => self.update(target.clone(), change, invariants).await?,
            });
        }
        Ok(out)
    }
}
