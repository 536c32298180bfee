//! Installs invariants as the collection's validator (`$expr`, strict level, error
//! action), after listing the documents that already violate them.
//!
//! A validator refuses any insert or update whose result breaks an invariant (error
//! 121), including writes that bypass [`super::Guarded`]. It is a second safeguard, not a
//! concurrency control: it checks the one document written, so it cannot express rules
//! across documents, and `collMod` replaces any validator the collection had.

use mongodb::Collection;
use mongodb::bson::{Document, doc};
use tracing::{info, instrument};

use super::check::{InvariantViolation, violations};
use super::invariant::{Invariant, all_of};
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
}

impl Default for ValidatorOptions {
    fn default() -> Self {
        Self {
            proceed_despite_violations: false,
            list_limit: 100,
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
}

/// What [`install_validator`] did.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ValidatorInstall {
    /// The validator is installed. `existing_violations` lists documents that violated it
    /// when it was installed (empty unless `proceed_despite_violations` was set).
    Installed {
        /// Documents that already violated the invariants.
        existing_violations: Vec<InvariantViolation>,
    },
    /// Nothing was installed because these documents already violate the invariants.
    Refused {
        /// The violating documents (at most `list_limit`).
        violations: Vec<InvariantViolation>,
    },
}

/// The validator document for `invariants`: `{$expr: {$and: [...]}}`.
pub fn validator_document(invariants: &[Invariant]) -> Document {
    doc! { "$expr": all_of(invariants) }
}

/// Installs `invariants` as `coll`'s validator with `validationLevel: "strict"` and
/// `validationAction: "error"` (creating the collection if it does not exist), unless
/// existing documents violate them and `opts.proceed_despite_violations` is false.
///
/// # Errors
/// [`Error::InvalidInput`] for no invariants or a `list_limit` below 1;
/// [`Error::Database`] if listing or `collMod`/`create` fails.
#[instrument(skip(coll, invariants, opts), fields(coll = %coll.name()))]
pub async fn install_validator(
    coll: &Collection<Document>,
    invariants: &[Invariant],
    opts: &ValidatorOptions,
) -> Result<ValidatorInstall> {
    if invariants.is_empty() {
        return Err(Error::invalid("invariants", "at least one is needed"));
    }
    let existing = violations(coll, invariants, Some(opts.list_limit)).await?;
    if !existing.is_empty() && !opts.proceed_despite_violations {
        return Ok(ValidatorInstall::Refused {
            violations: existing,
        });
    }
    let db = coll.client().database(&coll.namespace().db);
    let names = db
        .list_collection_names()
        .filter(doc! { "name": coll.name() })
        .await?;
    let validator = validator_document(invariants);
    if names.is_empty() {
        db.run_command(doc! {
            "create": coll.name(),
            "validator": validator,
            "validationLevel": "strict",
            "validationAction": "error",
        })
        .await?;
    } else {
        db.run_command(doc! {
            "collMod": coll.name(),
            "validator": validator,
            "validationLevel": "strict",
            "validationAction": "error",
        })
        .await?;
    }
    info!(invariants = invariants.len(), "validator installed");
    Ok(ValidatorInstall::Installed {
        existing_violations: existing,
    })
}
