//! One unordered `update` command of many statements: what the worker's bulks of fenced
//! transitions and heartbeats ([`super::transition`]) and `retry_dead`'s per-job revivals
//! ([`super::ops`]) send, with the collection's write concern.
//!
//! **Guarantee:** each statement is applied or refused on its own (`ordered: false`); the
//! reply's counts and per-statement errors are returned as sent. A reply with a
//! `writeConcernError` (applied on the primary, not acknowledged as asked) is
//! [`Error::Unavailable`]: in doubt, like a lost reply, so the caller reads back.
//! **Limits:** the command must fit one message (16 MB): callers split by size.

use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};

use crate::error::{Error, Result};

/// One statement the server refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Refusal {
    /// The statement's index in the command.
    pub(crate) index: usize,
    /// The server's error code.
    pub(crate) code: i32,
    /// The server's message.
    pub(crate) message: String,
}

/// What an unordered `update` command answered.
#[derive(Clone, Debug, Default)]
pub(crate) struct UpdateReply {
    /// Documents the statements matched (`n`).
    pub(crate) matched: u64,
    /// Documents the statements changed (`nModified`).
    pub(crate) modified: u64,
    /// The statements refused.
    pub(crate) refused: Vec<Refusal>,
}

/// Sends `statements` (`{q, u, …}` documents) to `coll` as one unordered `update` command
/// with the collection's write concern.
///
/// # Errors
/// A database error for the command as a whole; [`Error::Unavailable`] for a write
/// concern error; [`Error::InvalidInput`] for a write concern that does not serialise.
pub(crate) async fn unordered_update(
    coll: &Collection<Document>,
    statements: Vec<Document>,
) -> Result<UpdateReply> {
    let mut command = doc! {
        "update": coll.name(),
        "updates": statements,
        "ordered": false,
    };
    if let Some(wc) = coll.write_concern() {
        let wc = mongodb::bson::to_document(wc)
            .map_err(|e| Error::invalid("write concern", e.to_string()))?;
        if !wc.is_empty() {
            command.insert("writeConcern", wc);
        }
    }
    let reply = coll
        .client()
        .database(&coll.namespace().db)
        .run_command(command)
        .await?;
    if reply.contains_key("writeConcernError") {
        return Err(Error::Unavailable {
            what: "write concern",
        });
    }
    let count = |v: Option<&Bson>| match v {
        Some(Bson::Int32(n)) => u64::try_from(*n).unwrap_or(0),
        Some(Bson::Int64(n)) => u64::try_from(*n).unwrap_or(0),
        _ => 0,
    };
    let refused = reply
        .get_array("writeErrors")
        .map(|errors| {
            errors
                .iter()
                .filter_map(Bson::as_document)
                .filter_map(|e| {
                    let index = match e.get("index") {
                        Some(Bson::Int32(i)) => usize::try_from(*i).ok(),
                        Some(Bson::Int64(i)) => usize::try_from(*i).ok(),
                        _ => None,
                    }?;
                    Some(Refusal {
                        index,
                        code: e.get_i32("code").unwrap_or_default(),
                        message: e.get_str("errmsg").unwrap_or_default().to_owned(),
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(UpdateReply {
        matched: count(reply.get("n")),
        modified: count(reply.get("nModified")),
        refused,
    })
}
