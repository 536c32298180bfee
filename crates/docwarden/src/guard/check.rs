//! The checker: which documents violate which invariants, by one aggregation.
//!
//! `$match: {$expr: {$not: [{$and: [...]}]}}` finds the violators and a `$project` names
//! the invariants each one breaks. It reads a snapshot per document, not of the whole
//! collection: run it after writers stop for an exact count.

use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};

use super::invariant::{Invariant, all_of, refused_operator};
use crate::error::{Error, Result};

/// A document that violates one or more invariants.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct InvariantViolation {
    /// The document's `_id`.
    pub id: Bson,
    /// Names of the invariants it violates, in the order given.
    pub invariants: Vec<String>,
}

/// The aggregation pipeline that lists violators (optionally of one document). For one
/// document the match is `{$and: [{_id}, {$expr}]}`: `_id` first and the `$expr` inside
/// `$and`, a point lookup (a top-level `$expr` next to `_id` makes some servers scan the
/// collection).
pub(crate) fn pipeline(
    invariants: &[Invariant],
    only: Option<&Bson>,
    limit: Option<i64>,
) -> Vec<Document> {
    let violated = doc! { "$expr": { "$not": [all_of(invariants)] } };
    let m = match only {
        Some(id) => doc! { "$and": [{ "_id": id.clone() }, violated] },
        None => violated,
    };
    let names: Vec<Bson> = invariants
        .iter()
        .map(|i| {
            Bson::Document(doc! { "$cond": [{ "$and": [i.expr().clone()] }, "$$REMOVE", { "$literal": i.name() }] })
        })
        .collect();
    let mut p = vec![doc! { "$match": m }, doc! { "$sort": { "_id": 1 } }];
    if let Some(n) = limit {
        p.push(doc! { "$limit": n });
    }
    p.push(doc! { "$project": { "_id": 1, "failed": names } });
    p
}

/// Lists the documents of `coll` that violate any of `invariants` (sorted by `_id`, at
/// most `limit` of them when given).
///
/// # Errors
/// [`Error::InvalidInput`] for a `limit` below 1, or `{ what: "invariant" }` if the
/// server does not know an operator an invariant uses; [`Error::Database`] if the
/// aggregation fails.
pub async fn violations(
    coll: &Collection<Document>,
    invariants: &[Invariant],
    limit: Option<i64>,
) -> Result<Vec<InvariantViolation>> {
    if limit.is_some_and(|n| n < 1) {
        return Err(Error::invalid("limit", "must be at least 1"));
    }
    collect(coll, pipeline(invariants, None, limit))
        .await
        .map_err(|e| refused_operator(e, invariants))
}

/// The invariants the document with `_id == id` violates (empty if none, or if there is
/// no such document): the per-operation check of a concurrency test.
///
/// # Errors
/// [`Error::InvalidInput`] `{ what: "id" }` if `id` is not a plain document id
/// ([`crate::validate::document_id`]: an operator document such as `{$gt: 0}` or a regex
/// would match, and report, other documents; nothing is sent), `{ what: "invariant" }` if
/// the server does not know an operator an invariant uses; [`Error::Database`] if the
/// aggregation fails.
pub async fn violations_of(
    coll: &Collection<Document>,
    id: impl Into<Bson>,
    invariants: &[Invariant],
) -> Result<Vec<String>> {
    let id = id.into();
    crate::validate::document_id("id", &id)?;
    let mut v = collect(coll, pipeline(invariants, Some(&id), Some(1)))
        .await
        .map_err(|e| refused_operator(e, invariants))?;
    Ok(v.pop().map(|v| v.invariants).unwrap_or_default())
}

async fn collect(
    coll: &Collection<Document>,
    pipeline: Vec<Document>,
) -> Result<Vec<InvariantViolation>> {
    let docs: Vec<Document> = coll.aggregate(pipeline).await?.try_collect().await?;
    docs.into_iter()
        .map(|d| {
            let id = d.get("_id").cloned().unwrap_or(Bson::Null);
            let failed = d.get_array("failed").map_err(|_| Error::Malformed {
                id: id.to_string(),
                reason: "checker returned no `failed` list".into(),
            })?;
            let invariants = failed
                .iter()
                .filter_map(|b| b.as_str().map(str::to_owned))
                .collect();
            Ok(InvariantViolation { id, invariants })
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::guard::Condition;

    #[test]
    fn the_check_of_one_document_is_a_point_lookup_by_id() {
        let inv = Invariant::at_least("on", "doctors", 1, Condition::eq("on_call", true)).unwrap();
        let p = pipeline(&[inv], Some(&Bson::Int32(7)), Some(1));
        let m = p[0].get_document("$match").unwrap();
        assert_eq!(m.keys().collect::<Vec<_>>(), ["$and"], "{m}");
        let and = m.get_array("$and").unwrap();
        assert_eq!(and[0], Bson::Document(doc! { "_id": 7 }), "{m}");
        assert!(and[1].as_document().unwrap().contains_key("$expr"), "{m}");
    }
}
