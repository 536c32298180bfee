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
