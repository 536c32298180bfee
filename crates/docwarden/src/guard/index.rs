//! Indexes on fields inside embedded arrays (multikey), and a check from `explain` that a
//! query uses one.
//!
//! An index on `doctors.updated` holds one key per array element, so equality, sort and
//! range queries on the embedded field are index scans. [`index_use`] reads the winning
//! plan of `explain`; it reports what the planner chose for that query now, not for
//! every future data distribution.

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc};
use mongodb::{Collection, IndexModel};

use super::invariant::field_path;
use crate::error::{Error, Result};

/// How the winning plan of a query reads the collection.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum IndexUse {
    /// An index scan (`IXSCAN`) of the named index.
    IndexScan {
        /// The index's name.
        index: String,
    },
    /// A full collection scan (`COLLSCAN`).
    CollectionScan,
    /// Another plan (for example `IDHACK` or `EOF`): the stage names, outermost first.
    Other {
        /// Stage names of the winning plan.
        stages: Vec<String>,
    },
}

/// Creates (idempotently) an ascending index on `path`, a field inside an embedded array
/// such as `doctors.updated`, and returns its name. An index the collection already has
/// on exactly `{path: 1}`, plain (not partial, not sparse, no collation), under another
/// name (one a DBA created, say) is the index: its name is returned and nothing is
/// created (the server refuses a second index of the same keys, code 85).
///
/// # Errors
/// [`Error::InvalidInput`] for a bad path; [`Error::Database`] if the index cannot be
/// created (for example an index of that name with other options exists, or the index on
/// these keys is partial, sparse or has a collation).
pub async fn ensure_array_index(coll: &Collection<Document>, path: &str) -> Result<String> {
    field_path("path", path)?;
    let keys = doc! { path: 1 };
    match coll
        .create_index(IndexModel::builder().keys(keys.clone()).build())
        .await
    {
        Ok(res) => Ok(res.index_name),
        Err(e) if crate::error::error_code(&e) == Some(85) => {
            let existing: Vec<IndexModel> = coll.list_indexes().await?.try_collect().await?;
            existing
                .into_iter()
                .find(|ix| ascending_on(&ix.keys, path) && is_plain(ix))
                .and_then(|ix| ix.options.and_then(|o| o.name))
                .ok_or_else(|| e.into())
        }
        Err(e) => Err(e.into()),
    }
}

/// Whether index keys are `{path: 1}` alone, the 1 of any numeric type (the legacy
/// shell sends `1.0`).
fn ascending_on(keys: &Document, path: &str) -> bool {
    keys.len() == 1
        && match keys.get(path) {
            Some(Bson::Int32(v)) => *v == 1,
            Some(Bson::Int64(v)) => *v == 1,
            Some(Bson::Double(v)) => *v == 1.0,
            _ => false,
        }
}

/// Whether an index serves every query on its keys: not partial, not sparse, no
/// collation (the collection's simple one).
fn is_plain(ix: &IndexModel) -> bool {
    ix.options.as_ref().is_none_or(|o| {
        o.partial_filter_expression.is_none() && o.sparse != Some(true) && o.collation.is_none()
    })
}

/// Explains `filter` on `coll` and reports how its winning plan reads the collection.
///
/// # Errors
/// [`Error::Database`] if `explain` fails; [`Error::Malformed`] if its answer has no
/// winning plan.
pub async fn index_use(coll: &Collection<Document>, filter: Document) -> Result<IndexUse> {
    let db = coll.client().database(&coll.namespace().db);
    let explained = db
        .run_command(doc! {
            "explain": { "find": coll.name(), "filter": filter },
            "verbosity": "queryPlanner",
        })
        .await?;
    let plan = explained
        .get_document("queryPlanner")
        .and_then(|q| q.get_document("winningPlan"))
        .map_err(|_| Error::Malformed {
            id: "explain".into(),
            reason: "no queryPlanner.winningPlan".into(),
        })?;
    Ok(classify(plan))
}

/// Walks a winning plan: the first `IXSCAN` or `COLLSCAN` found decides.
pub(crate) fn classify(plan: &Document) -> IndexUse {
    let mut stages = Vec::new();
    let mut todo = vec![plan];
    while let Some(stage) = todo.pop() {
        // Newer servers wrap the classic plan in `queryPlan`.
        if let Ok(inner) = stage.get_document("queryPlan") {
            todo.push(inner);
        }
        if let Ok(name) = stage.get_str("stage") {
            match name {
                "IXSCAN" => {
                    return IndexUse::IndexScan {
                        index: stage.get_str("indexName").unwrap_or_default().to_owned(),
                    };
                }
                "COLLSCAN" => return IndexUse::CollectionScan,
                other => stages.push(other.to_owned()),
            }
        }
        if let Ok(input) = stage.get_document("inputStage") {
            todo.push(input);
        }
        if let Ok(inputs) = stage.get_array("inputStages") {
            todo.extend(inputs.iter().filter_map(Bson::as_document));
        }
    }
    IndexUse::Other { stages }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn plans_are_classified() {
        let ix = doc! { "stage": "FETCH", "inputStage": { "stage": "IXSCAN", "indexName": "doctors.updated_1" } };
        assert_eq!(
            classify(&ix),
            IndexUse::IndexScan {
                index: "doctors.updated_1".into()
            }
        );
        assert_eq!(
            classify(&doc! { "stage": "COLLSCAN" }),
            IndexUse::CollectionScan
        );
        assert_eq!(
            classify(&doc! { "queryPlan": { "stage": "IDHACK" } }),
            IndexUse::Other {
                stages: vec!["IDHACK".into()]
            }
        );
    }
}
