//! Guarded updates: business invariants over one document that racing writers cannot
//! break.
//!
//! **Guarantee.** [`Guarded::update`] writes a change in one atomic `updateOne` whose
//! pipeline keeps the new value only if every [`Invariant`] holds on the document *after*
//! the change; the server evaluates the pipeline and writes the document atomically, so no interleaving of guarded
//! updates can leave a document violating an invariant that held before (no write skew),
//! and the array element to change is matched by its key with `$elemMatch` semantics.
//! [`Guarded::update_many`] sends many such updates, each to its own document, in one
//! `bulkWrite` round trip (MongoDB 8.0; one update at a time before), with the same
//! outcomes; [`Guarded::update_each`] reports each change's own result when some fail.
//!
//! **Limits.** Invariants are over one document; rules spanning documents need another
//! design. Writes that bypass the handle are not checked unless the same invariants are
//! installed as the collection's validator ([`install_validator`]), and a validator alone
//! does not prevent write skew in read-then-write code — it only refuses the final
//! invalid document. A change touches one top-level field.

mod batch;
mod check;
mod index;
mod invariant;
mod update;
mod validator;

pub use check::{InvariantViolation, violations, violations_of};
pub use index::{IndexUse, ensure_array_index, index_use};
pub use invariant::{CmpOp, Condition, ELEMENT_VAR, EXPRESSION_OPERATORS, Invariant, Operand};
pub use update::{Change, GuardOptions, GuardOutcome, Guarded};
pub use validator::{ValidatorInstall, ValidatorOptions, install_validator, validator_document};
