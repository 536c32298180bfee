//! One round trip for many single-document updates: an ordered `bulkWrite` command
//! (MongoDB 8.0) with per-operation results, shared by the batch APIs
//! ([`crate::sequence::SequencedSet::apply_many`], [`crate::guard::Guarded::update_many`]).
//!
//! Each update keeps its own filter, so the server decides each one on its document as
//! a single `update_one` would; the results say, per update, whether it matched and
//! whether it changed the document. A write error stops the bulk there (ordered); the
//! updates it did not run have no result, and the caller applies them one by one (which
//! reports the error). A server without the command is remembered in the caller's flag,
//! and nothing is sent to it again.

use std::sync::atomic::{AtomicBool, Ordering};

use mongodb::Collection;
use mongodb::bson::Document;
use mongodb::error::{ErrorKind, PartialBulkWriteResult};
use mongodb::options::{UpdateModifications, UpdateOneModel, WriteModel};
use mongodb::results::UpdateResult;

use crate::error::{Result, error_code};

/// Sends `updates` (filter, update) on `coll` as one ordered `bulkWrite` with the
/// collection's write concern; returns `(position, result)` of each update the server
/// ran, in batch order. With `refused` set nothing is sent (an empty answer); a server without the
/// command sets it.
///
/// # Errors
/// A database error other than a write error (network, write concern).
pub(crate) async fn updates(
    coll: &Collection<Document>,
    updates: Vec<(Document, UpdateModifications)>,
    refused: &AtomicBool,
) -> Result<Vec<(usize, UpdateResult)>> {
    if refused.load(Ordering::Relaxed) || updates.is_empty() {
        return Ok(Vec::new());
    }
    let namespace = coll.namespace();
    let models: Vec<WriteModel> = updates
        .into_iter()
        .map(|(filter, update)| {
            WriteModel::UpdateOne(
                UpdateOneModel::builder()
                    .namespace(namespace.clone())
                    .filter(filter)
                    .update(update)
                    .build(),
            )
        })
        .collect();
    let mut bulk = coll
        .client()
        .bulk_write(models)
        .ordered(true)
        .verbose_results();
    if let Some(wc) = coll.write_concern() {
        bulk = bulk.write_concern(wc.clone());
    }
    let mut ran: Vec<(usize, UpdateResult)> = match bulk.await {
        Ok(result) => result.update_results.into_iter().collect(),
        Err(e) => match *e.kind {
            ErrorKind::BulkWrite(ref failed) => match &failed.partial_result {
                Some(PartialBulkWriteResult::Verbose(v)) => {
                    v.update_results.clone().into_iter().collect()
                }
                _ => Vec::new(),
            },
            ErrorKind::IncompatibleServer { .. } => refuse(refused, &e),
            _ if error_code(&e) == Some(59) => refuse(refused, &e),
            _ => return Err(e.into()),
        },
    };
    // In the order the server ran them (the driver answers with a map).
    ran.sort_unstable_by_key(|(position, _)| *position);
    Ok(ran)
}

/// Remembers that the server has no `bulkWrite` command (MongoDB before 8.0).
fn refuse(refused: &AtomicBool, e: &mongodb::error::Error) -> Vec<(usize, UpdateResult)> {
    tracing::info!(error = %e, "no bulkWrite command: batches apply one operation at a time");
    refused.store(true, Ordering::Relaxed);
    Vec::new()
}
