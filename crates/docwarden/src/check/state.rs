//! State checkers: a final state against a sequential model (sequence), and counts of
//! invariant violations observed by reads (guard).

use std::collections::{BTreeMap, BTreeSet};

use super::Violation;

/// Compares, key by key, the final state read from the database with the model's. Keys
/// are documents; values are any comparable rendering of their state.
pub fn check_against_model<V: PartialEq + std::fmt::Debug>(
    model: &BTreeMap<String, V>,
    found: &BTreeMap<String, V>,
) -> Vec<Violation> {
    let keys: BTreeSet<&String> = model.keys().chain(found.keys()).collect();
    keys.into_iter()
        .filter_map(|k| {
            let (m, f) = (model.get(k), found.get(k));
            (m != f).then(|| {
                Violation::new(
                    "state-mismatch",
                    k.clone(),
                    format!("model {m:?}, database {f:?}"),
                )
            })
        })
        .collect()
}

/// Documents per key: more than one is a `duplicate-document` violation.
pub fn check_one_document_per_key(counts: &BTreeMap<String, u64>) -> Vec<Violation> {
    counts
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(k, n)| Violation::new("duplicate-document", k.clone(), format!("{n} documents")))
        .collect()
}

/// Compares stored documents byte for byte (BSON encoding: field order and types
/// included) with a reference: a key whose document differs, or exists on one side only,
/// is an `order-dependent-document` violation, whose detail shows both documents. The
/// reference is typically the same messages applied once each in sequence order; the
/// caller removes what the property leaves free (`_id`, documented field-order limits).
pub fn check_identical_documents(
    reference: &BTreeMap<String, mongodb::bson::Document>,
    found: &BTreeMap<String, mongodb::bson::Document>,
) -> Vec<Violation> {
    let bytes = |d: &mongodb::bson::Document| {
        let mut out = Vec::new();
        d.to_writer(&mut out).map(|()| out).ok()
    };
    let keys: BTreeSet<&String> = reference.keys().chain(found.keys()).collect();
    keys.into_iter()
        .filter_map(|k| {
            let (r, f) = (reference.get(k), found.get(k));
            (r.and_then(bytes) != f.and_then(bytes) || r.is_some() != f.is_some()).then(|| {
                let show = |d: Option<&mongodb::bson::Document>| {
                    d.map_or_else(
                        || "none".to_owned(),
                        |d| {
                            mongodb::bson::Bson::Document(d.clone())
                                .into_canonical_extjson()
                                .to_string()
                        },
                    )
                };
                Violation::new(
                    "order-dependent-document",
                    k.clone(),
                    format!("replay in sequence order {}, database {}", show(r), show(f)),
                )
            })
        })
        .collect()
}

/// Turns observations `(document, invariant, holds)` into violations.
pub fn check_invariant_reads<'a>(
    reads: impl IntoIterator<Item = (&'a str, &'a str, bool)>,
) -> Vec<Violation> {
    reads
        .into_iter()
        .filter(|(_, _, holds)| !holds)
        .map(|(doc, invariant, _)| {
            Violation::new(
                "invariant-broken",
                doc,
                format!("`{invariant}` does not hold"),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_comparison() {
        let model: BTreeMap<String, Vec<&str>> = [("s1".to_owned(), vec!["a"])].into();
        assert!(check_against_model(&model, &model.clone()).is_empty());
        let found: BTreeMap<String, Vec<&str>> = [("s1".to_owned(), vec!["a", "b"])].into();
        assert_eq!(
            check_against_model(&model, &found)[0].kind,
            "state-mismatch"
        );
        let missing: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        assert_eq!(check_against_model(&model, &missing).len(), 1);
    }

    #[test]
    fn documents_differing_in_a_type_or_an_order_are_flagged() {
        use mongodb::bson::doc;
        let one =
            |d| -> BTreeMap<String, mongodb::bson::Document> { [("s1".to_owned(), d)].into() };
        let reference = one(doc! { "credits": 1_i32, "classes": ["a", "b"] });
        assert!(check_identical_documents(&reference, &reference.clone()).is_empty());
        let typed = one(doc! { "credits": 1_i64, "classes": ["a", "b"] });
        let order = one(doc! { "credits": 1_i32, "classes": ["b", "a"] });
        for found in [typed, order, BTreeMap::new()] {
            let v = check_identical_documents(&reference, &found);
            assert_eq!(v.len(), 1, "{found:?}");
            assert_eq!(v[0].kind, "order-dependent-document");
        }
    }

    #[test]
    fn duplicates_and_invariants() {
        let counts: BTreeMap<String, u64> = [("a".to_owned(), 1), ("b".to_owned(), 2)].into();
        assert_eq!(check_one_document_per_key(&counts).len(), 1);
        let reads = [("s1", "on-call", true), ("s2", "on-call", false)];
        let v = check_invariant_reads(reads);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].key, "s2");
        assert!(super::super::count_by_kind(&v) == vec![("invariant-broken", 1)]);
    }
}
