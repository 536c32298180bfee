//! Installs invariants as the collection's validator (`$expr`, strict level, error
//! action), after listing the documents that already violate them, and lists them again
//! once it is installed: a violating document written between the first list and
//! `collMod` is reported too (and, unless the caller proceeds despite violations, the
//! previous validator is put back).
//!
//! A validator refuses any insert or update whose result breaks an invariant (error
//! 121), including writes that bypass [`super::Guarded`]. It is a second safeguard, not a
//! concurrency control: it checks the one document written, so it cannot express rules
//! across documents. A collection holds one validator: a different one already there (a
//! user's `$jsonSchema`, other invariants) is reported and kept unless the caller asks to
//! replace it; one an earlier docwarden installed for the same invariants is upgraded; the
//! invariants combined by hand with other rules in a top-level `$and` are recognised, and
//! the other rules kept.

use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::{Document, doc};
use mongodb::results::CollectionSpecification;
use tracing::{info, instrument, warn};

use super::check::{InvariantViolation, violations};
use super::invariant::{Invariant, all_of, refused_operator};
use crate::error::{Error, Result};

/// Options of [`install_validator`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ValidatorOptions {
    /// Install even if existing documents violate the invariants (they stay as they are;
    /// with the strict level every later update of them must fix them). Default false.
    pub proceed_despite_violations: bool,
    /// How many violating documents to list (default 100).
    pub list_limit: i64,
    /// Replace a validator the collection already has that is not this one (`collMod`
    /// keeps one validator per collection). Default false: such a collection is left as it
    /// is and the answer is [`ValidatorInstall::OtherValidator`].
    pub replace_other_validator: bool,
}

impl Default for ValidatorOptions {
    fn default() -> Self {
        Self {
            proceed_despite_violations: false,
            list_limit: 100,
            replace_other_validator: false,
        }
    }
}

impl ValidatorOptions {
    /// Sets [`ValidatorOptions::proceed_despite_violations`].
    #[must_use]
    pub fn proceed_despite_violations(mut self, yes: bool) -> Self {
        self.proceed_despite_violations = yes;
        self
    }

    /// Sets [`ValidatorOptions::list_limit`].
    #[must_use]
    pub fn list_limit(mut self, n: i64) -> Self {
        self.list_limit = n;
        self
    }

    /// Sets [`ValidatorOptions::replace_other_validator`].
    #[must_use]
    pub fn replace_other_validator(mut self, yes: bool) -> Self {
        self.replace_other_validator = yes;
        self
    }
}

/// What [`install_validator`] did.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ValidatorInstall {
    /// The validator is installed. `existing_violations` lists documents that violate it
    /// once it is installed (read after `collMod`, so a document written while it was being
    /// installed is in; empty unless `proceed_despite_violations` was set).
    Installed {
        /// Documents that already violated the invariants.
        existing_violations: Vec<InvariantViolation>,
    },
    /// Nothing was installed because these documents already violate the invariants
    /// (found before `collMod`, or after it: then the collection's previous validator,
    /// level and action were put back).
    Refused {
        /// The violating documents (at most `list_limit`).
        violations: Vec<InvariantViolation>,
    },
    /// Nothing was installed because the collection already has a different validator
    /// (a user's `$jsonSchema`, or other invariants), which `collMod` would have replaced.
    /// Combine the rules into one validator (`{$and: [<the other rules>,
    /// validator_document(invariants)]}`, which an install then recognises), or set
    /// [`ValidatorOptions::replace_other_validator`].
    OtherValidator {
        /// The validator the collection has.
        validator: Document,
    },
    /// The collection had a validator an earlier docwarden installed for these invariants
    /// (see [`validator_document`] for how one is recognised), which differs from what this
    /// version installs (a rule's rendering was fixed since, or the marker is new); it was
    /// replaced as an install replaces a validator: after the violators were listed, and
    /// listed again. Violators not proceeded past are [`ValidatorInstall::Refused`] instead,
    /// and the earlier validator stays.
    Upgraded {
        /// The validator that was replaced.
        previous: Document,
        /// Documents that violate the invariants once the new validator is installed (as
        /// in [`ValidatorInstall::Installed`]).
        existing_violations: Vec<InvariantViolation>,
    },
}

/// The start of the `$comment` that marks a validator docwarden installed.
const MARK: &str = "docwarden guard invariants";

/// The `$comment` of the validator for `invariants`: [`MARK`], then each invariant's name
/// in quotes (`\` and `"` escaped), in the order given.
fn marker(invariants: &[Invariant]) -> String {
    let names: Vec<String> = invariants
        .iter()
        .map(|i| {
            format!(
                "\"{}\"",
                i.name().replace('\\', "\\\\").replace('"', "\\\"")
            )
        })
        .collect();
    format!("{MARK}: [{}]", names.join(", "))
}

/// What the collection's validator is to an install of `invariants`.
#[derive(Debug, PartialEq)]
enum Existing<'a> {
    /// None, or exactly the one this version installs.
    NoneOrSame,
    /// One an earlier docwarden installed for these invariants.
    Earlier(&'a Document),
    /// `{$and: [...]}` of which exactly one clause is this version's validator or an
    /// earlier docwarden's for these invariants, next to other rules (a user's
    /// `$jsonSchema`): the combination `docs/guard.md` recommends.
    Combined {
        /// The collection's validator.
        current: &'a Document,
        /// The same with that clause replaced by this version's validator.
        with_ours: Document,
    },
    /// Anyone else's.
    Other(&'a Document),
}

/// Classifies `existing` (the collection's validator, if any) against `validator`, the one
/// this version installs for `invariants`: marked with the same [`marker`], or unmarked
/// (before session 19) and `{$expr: {$and: [...]}}` with each invariant rendered as this or
/// an earlier version renders it, is ours from an earlier version; a top-level `$and` with
/// exactly one clause that is ours (this version's or an earlier one's) is ours combined
/// with other rules.
fn classify<'a>(
    existing: Option<&'a Document>,
    validator: &Document,
    invariants: &[Invariant],
) -> Existing<'a> {
    let Some(existing) = existing.filter(|v| !v.is_empty() && *v != validator) else {
        return Existing::NoneOrSame;
    };
    if is_ours(existing, validator, invariants) {
        return Existing::Earlier(existing);
    }
    combined(existing, validator, invariants).map_or(Existing::Other(existing), |with_ours| {
        Existing::Combined {
            current: existing,
            with_ours,
        }
    })
}

/// `existing` with its one clause that is ours replaced by `validator`, when `existing` is
/// `{$and: [...]}` alone (an `$and` holds only when every clause holds, so the invariants
/// are enforced next to the other rules; an `$or` or anything else would not enforce them)
/// and exactly one of its clauses is `validator` or an earlier docwarden's validator for
/// these invariants ([`is_ours`]); `None` otherwise.
fn combined(
    existing: &Document,
    validator: &Document,
    invariants: &[Invariant],
) -> Option<Document> {
    if existing.len() != 1 {
        return None;
    }
    let clauses = existing.get_array("$and").ok()?;
    let mut ours = clauses.iter().enumerate().filter(|(_, clause)| {
        clause
            .as_document()
            .is_some_and(|c| c == validator || is_ours(c, validator, invariants))
    });
    let (at, _) = ours.next()?;
    if ours.next().is_some() {
        return None;
    }
    let mut clauses = clauses.clone();
    clauses[at] = validator.clone().into();
    Some(doc! { "$and": clauses })
}

/// Whether `existing` (not `validator` itself) is a validator an earlier docwarden
/// installed for `invariants`: marked with the same [`marker`], or unmarked and exactly
/// `{$expr: {$and: [...]}}` of the invariants as this or an earlier version renders them.
fn is_ours(existing: &Document, validator: &Document, invariants: &[Invariant]) -> bool {
    if existing == validator {
        return false;
    }
    if existing.get_str("$comment") == Ok(marker(invariants).as_str()) {
        return true;
    }
    let unmarked = || {
        let mut keys = existing.keys();
        let expr = existing.get_document("$expr").ok()?;
        let mut expr_keys = expr.keys();
        let rules = expr.get_array("$and").ok()?;
        let alone = keys.next().is_some() && keys.next().is_none();
        let and_alone = expr_keys.next().is_some() && expr_keys.next().is_none();
        Some(
            alone
                && and_alone
                && rules.len() == invariants.len()
                && rules.iter().zip(invariants).all(|(rule, inv)| {
                    rule == inv.expr() || inv.earlier_renderings().any(|old| old == rule)
                }),
        )
    };
    unmarked() == Some(true)
}

/// The validator document for `invariants`: `{$expr: {$and: [...]}, $comment: "docwarden
/// guard invariants: [\"name\", …]"}`.
///
/// The `$comment` (a query operator that any query predicate, a validator included, may
/// carry; it matches every document) marks the validator as docwarden's, for these
/// invariants by name, since session 19. [`install_validator`] takes a validator as one an
/// earlier docwarden installed for the same invariants, and replaces it
/// ([`ValidatorInstall::Upgraded`]), when it carries this marker, or, unmarked, when it is
/// `{$expr: {$and: [...]}}` with each invariant rendered as this version or an earlier one
/// rendered it (until session 16 an ordering comparison had no type bracket). Combined
/// with other rules as `{$and: [...]}` (nothing else at the top level), exactly one clause
/// of which is this document or such an earlier one, it is recognised too: the install
/// keeps the other clauses and puts this document in that clause's place
/// ([`ValidatorInstall::Installed`] when it is already there, else
/// [`ValidatorInstall::Upgraded`]). Any other validator is someone else's
/// ([`ValidatorInstall::OtherValidator`]).
pub fn validator_document(invariants: &[Invariant]) -> Document {
    doc! { "$expr": all_of(invariants), "$comment": marker(invariants) }
}

/// Installs `invariants` as `coll`'s validator ([`validator_document`]) with
/// `validationLevel: "strict"` and `validationAction: "error"` (creating the collection if
/// it does not exist), unless the collection has a different validator and
/// `opts.replace_other_validator` is false ([`ValidatorInstall::OtherValidator`]), or
/// existing documents violate them and `opts.proceed_despite_violations` is false
/// ([`ValidatorInstall::Refused`]). Installing the same invariants again is allowed (it
/// resets the level and action). A validator an earlier docwarden installed for the same
/// invariants is not "different": it is replaced, after the same violator checks, and the
/// answer is [`ValidatorInstall::Upgraded`]. Neither is a validator that combines the
/// invariants with other rules in a top-level `$and` (see [`validator_document`]): it is
/// installed as it is, the other rules kept, with the invariants' clause brought up to
/// this version.
///
/// The violators are listed before `collMod` and again after it. Once the validator is in
/// place (strict, error) no write can add a violator, except with
/// `bypassDocumentValidation`, so the second list is complete: a document written between
/// the first list and `collMod` is reported. If the second list finds violators and the
/// caller did not proceed despite them, the previous validator, level and action are put
/// back (no validator for a collection that had none) and the answer is
/// [`ValidatorInstall::Refused`]; writes that would have broken the invariants in the
/// moment between may have been refused with code 121.
///
/// A collection whose default collation is not the simple one is refused before anything
/// is read or written: MongoDB evaluates a validator with the collection's default
/// collation (`CollectionImpl::parseValidator` gives the validator's expression context a
/// clone of the collection's collator), as it does every update and aggregation that names
/// none, so on such a collection an invariant comparing strings would not mean what it
/// means everywhere else in docwarden (byte for byte): `{locale: "en", strength: 2}` makes
/// `name == "Bob"` hold for `"bob"`, in the validator, the guarded update and the checker
/// alike. The same collections [`super::Guarded::open`] refuses.
///
/// # Errors
/// [`Error::Incompatible`] naming the collation if the collection has a non-simple default
/// collation (nothing installed);
/// [`Error::InvalidInput`] for no invariants or a `list_limit` below 1 (both checked before
/// anything is sent), or `{ what: "invariant" }` if the server does not know an operator
/// an invariant uses;
/// [`Error::Database`] if listing, `collMod`/`create` or putting the previous validator
/// back fails (then the new validator may be in place). A collection created by someone
/// else between reading its options and `create` is not an error: its options are read
/// again and the install goes on from them (once; [`Error::Unavailable`] if it happens
/// twice).
#[instrument(skip(coll, invariants, opts), fields(coll = %coll.name()))]
pub async fn install_validator(
    coll: &Collection<Document>,
    invariants: &[Invariant],
    opts: &ValidatorOptions,
) -> Result<ValidatorInstall> {
    if invariants.is_empty() {
        return Err(Error::invalid("invariants", "at least one is needed"));
    }
    if opts.list_limit < 1 {
        return Err(Error::invalid("list_limit", "must be at least 1"));
    }
    // A collection that did not exist may be created by someone else (another process
    // installing the same validator at start-up) before `create`: then start over once,
    // from its options.
    match install(coll, invariants, opts, true).await? {
        Some(done) => Ok(done),
        None => install(coll, invariants, opts, false)
            .await?
            .ok_or(Error::Unavailable {
                what: "validator install (the collection kept being created and dropped)",
            }),
    }
}

/// One attempt of [`install_validator`]; `None` if the collection appeared between reading
/// its options and `create` (code 48, `NamespaceExists`) and `retry_created` is set.
async fn install(
    coll: &Collection<Document>,
    invariants: &[Invariant],
    opts: &ValidatorOptions,
    retry_created: bool,
) -> Result<Option<ValidatorInstall>> {
    let db = coll.client().database(&coll.namespace().db);
    // Read again on the second attempt: the collection someone else created may have one.
    crate::preflight::require_simple_collation(&db, coll.name()).await?;
    let specs: Vec<CollectionSpecification> = db
        .list_collections()
        .filter(doc! { "name": coll.name() })
        .await?
        .try_collect()
        .await?;
    let mut validator = validator_document(invariants);
    let current = specs
        .first()
        .and_then(|spec| spec.options.validator.as_ref());
    let earlier = match classify(current, &validator, invariants) {
        Existing::NoneOrSame => None,
        Existing::Earlier(previous) => {
            info!(validator = %previous, "upgrading the validator an earlier docwarden installed");
            Some(previous.clone())
        }
        Existing::Combined { current, with_ours } => {
            info!(validator = %current, "the invariants are combined with other rules; keeping them");
            validator = with_ours;
            (validator != *current).then(|| current.clone())
        }
        Existing::Other(other) if !opts.replace_other_validator => {
            warn!(validator = %other, "the collection has another validator; not replaced");
            return Ok(Some(ValidatorInstall::OtherValidator {
                validator: other.clone(),
            }));
        }
        Existing::Other(other) => {
            info!(validator = %other, "replacing the collection's other validator");
            None
        }
    };
    let existing = violations(coll, invariants, Some(opts.list_limit)).await?;
    if !existing.is_empty() && !opts.proceed_despite_violations {
        return Ok(Some(ValidatorInstall::Refused {
            violations: existing,
        }));
    }
    let command = if specs.is_empty() {
        "create"
    } else {
        "collMod"
    };
    let installed = db
        .run_command(doc! {
            command: coll.name(),
            "validator": validator,
            "validationLevel": "strict",
            "validationAction": "error",
        })
        .await;
    match installed {
        Err(e) if specs.is_empty() && retry_created && crate::error::error_code(&e) == Some(48) => {
            info!("the collection was created meanwhile; reading its options again");
            return Ok(None);
        }
        other => other.map_err(|e| refused_operator(e, invariants))?,
    };
    // Complete now: with the validator in place no write adds a violator.
    let after = violations(coll, invariants, Some(opts.list_limit)).await?;
    if !after.is_empty() && !opts.proceed_despite_violations {
        warn!(
            violators = after.len(),
            "violating documents were written while the validator was installed; putting the previous one back"
        );
        let previous = specs.first().map(|spec| &spec.options);
        let level = previous
            .and_then(|o| o.validation_level.as_ref())
            .map(mongodb::bson::to_bson)
            .transpose()
            .map_err(|e| Error::invalid("validationLevel", e.to_string()))?;
        let action = previous
            .and_then(|o| o.validation_action.as_ref())
            .map(mongodb::bson::to_bson)
            .transpose()
            .map_err(|e| Error::invalid("validationAction", e.to_string()))?;
        db.run_command(doc! {
            "collMod": coll.name(),
            "validator": previous.and_then(|o| o.validator.clone()).unwrap_or_default(),
            "validationLevel": level.unwrap_or_else(|| "strict".into()),
            "validationAction": action.unwrap_or_else(|| "error".into()),
        })
        .await?;
        return Ok(Some(ValidatorInstall::Refused { violations: after }));
    }
    info!(invariants = invariants.len(), "validator installed");
    Ok(Some(match earlier {
        Some(previous) => ValidatorInstall::Upgraded {
            previous,
            existing_violations: after,
        },
        None => ValidatorInstall::Installed {
            existing_violations: after,
        },
    }))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::guard::{CmpOp, Condition};

    #[test]
    fn earlier_docwarden_validators_are_told_from_other_ones() {
        let nonneg = Invariant::field_cmp("nonneg", "balance", CmpOp::Gte, 0_i64).unwrap();
        let on = Invariant::at_least("on", "doctors", 1, Condition::eq("on_call", true)).unwrap();
        let invs = [nonneg, on.clone()];
        let now = validator_document(&invs);
        assert_eq!(classify(None, &now, &invs), Existing::NoneOrSame);
        assert_eq!(classify(Some(&now), &now, &invs), Existing::NoneOrSame);
        assert_eq!(classify(Some(&doc! {}), &now, &invs), Existing::NoneOrSame);
        // Sessions 17-18: the same expressions, unmarked.
        let unmarked = doc! { "$expr": all_of(&invs) };
        assert_eq!(
            classify(Some(&unmarked), &now, &invs),
            Existing::Earlier(&unmarked)
        );
        // Until session 16: `balance >= 0` without the type bracket.
        let old = doc! { "$expr": { "$and": [
            { "$gte": ["$balance", { "$literal": 0_i64 }] },
            on.expr().clone(),
        ]}};
        assert_eq!(classify(Some(&old), &now, &invs), Existing::Earlier(&old));
        // Marked with the same names: ours, whatever the expressions.
        let marked = doc! { "$expr": { "$and": [true] }, "$comment": marker(&invs) };
        assert_eq!(
            classify(Some(&marked), &now, &invs),
            Existing::Earlier(&marked)
        );
        // Anyone else's: hand-written, another rule set, fewer rules, extra keys.
        let others = [
            doc! { "$expr": { "$and": [{ "$gte": ["$balance", 0_i64] }, on.expr().clone()] } },
            doc! { "$expr": { "$and": [true] }, "$comment": marker(&invs[1..]) },
            doc! { "$expr": { "$and": [on.expr().clone()] } },
            doc! { "$expr": all_of(&invs), "owner": { "$exists": true } },
            doc! { "$jsonSchema": { "required": ["owner"] } },
            // Combined, but not so that the invariants must hold, or ours twice.
            doc! { "$or": [{ "$jsonSchema": {} }, now.clone()] },
            doc! { "$and": [{ "$jsonSchema": {} }], "$or": [now.clone()] },
            doc! { "$and": [now.clone(), { "$jsonSchema": {} }, unmarked.clone()] },
            doc! { "$and": [{ "$jsonSchema": {} }, { "$expr": true, "$comment": marker(&invs[1..]) }] },
        ];
        for other in &others {
            assert_eq!(
                classify(Some(other), &now, &invs),
                Existing::Other(other),
                "{other}"
            );
        }
        // Session 21: combined with a user's rules in a top-level `$and`, as docs/guard.md
        // recommends: ours (this version's clause kept, an earlier one's replaced in place).
        let schema = doc! { "$jsonSchema": { "required": ["owner"] } };
        let current = doc! { "$and": [schema.clone(), now.clone()] };
        assert_eq!(
            classify(Some(&current), &now, &invs),
            Existing::Combined {
                current: &current,
                with_ours: current.clone()
            }
        );
        let earlier = doc! { "$and": [old.clone(), schema.clone()] };
        assert_eq!(
            classify(Some(&earlier), &now, &invs),
            Existing::Combined {
                current: &earlier,
                with_ours: doc! { "$and": [now.clone(), schema] }
            }
        );
    }

    #[test]
    fn the_marker_quotes_each_name() {
        let a = Invariant::raw("say \"hi\" \\ bye", doc! { "$literal": true }).unwrap();
        let b = Invariant::raw("b", doc! { "$literal": true }).unwrap();
        assert_eq!(
            marker(&[a, b]),
            r#"docwarden guard invariants: ["say \"hi\" \\ bye", "b"]"#
        );
    }
}
