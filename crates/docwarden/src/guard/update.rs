//! Guarded updates: one atomic `updateOne` that writes a change only if the document after
//! the change satisfies every invariant.
//!
//! The change is an aggregation expression `NEW` for the one top-level field `F` it
//! touches. The update is the two-stage pipeline `[{$set: {F: {$mergeObjects: [{new: NEW,
//! old: $F}]}}}, {$set: {F: {$cond: [inv₁′ ∧ inv₂′ …, $F.new, $F.old]}}}]`, where `invᵢ′`
//! reads the changed field from `$F.new` (when an invariant reads `$$ROOT`, the whole new
//! document is bound with `$let` instead), with the filter `{_id}` alone: a member change's `$map` matches the member
//! by key per element (`$elemMatch` semantics) and leaves the array as it is when no
//! element has the key. The server evaluates the pipeline on the document it writes,
//! atomically, so two racing writers cannot both pass a check that only one of them may
//! pass (no write skew). `modifiedCount == 1` means
//! applied; otherwise one aggregation on the same `_id` tells the other outcomes apart,
//! and if that read finds the change would now pass (the document changed in between),
//! the update is tried again.

use std::time::Duration;

use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};
use tracing::{debug, instrument};

use super::invariant::{Invariant, NEW_VAR, field_name, rebase_field, refused_operator};

/// The key of the field's new value inside the field, between the update's two stages.
const WRAP_NEW: &str = "new";
/// The key of the field's stored value inside the field, between the update's two stages.
const WRAP_OLD: &str = "old";
use crate::error::{Error, Result};

/// What one guarded update did, read from its reply alone (the single update and each
/// update of a bulk).
#[derive(Clone, Copy)]
pub(super) enum Ran {
    /// It changed the document: [`GuardOutcome::Applied`].
    Written,
    /// Nothing matched its filter, which is `{_id}` alone: [`GuardOutcome::NotFound`],
    /// with no read (before session 26 a diagnosing read, a second round trip, said so).
    NoDocument,
    /// It matched and kept the stored value (already so, no such member, or refused):
    /// one read tells which.
    Kept,
}

impl Ran {
    pub(super) fn of(reply: &mongodb::results::UpdateResult) -> Self {
        if reply.modified_count > 0 {
            Self::Written
        } else if reply.matched_count == 0 {
            Self::NoDocument
        } else {
            Self::Kept
        }
    }
}

/// What a guarded update did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GuardOutcome {
    /// The change was written; the document now satisfies every invariant.
    Applied,
    /// The document was already in the requested state: the new value is the stored one,
    /// byte for byte (a value equal to it but of another type, `5.0` for a stored
    /// `NumberLong(5)`, is a change, as with `$set`); nothing was written, and the
    /// invariants were not consulted.
    NoChange,
    /// No document has this `_id`.
    NotFound,
    /// The array element to change (or remove) is not in the document.
    NoSuchMember,
    /// The change would break this invariant (the first failing one, in the order given);
    /// nothing was written.
    Rejected {
        /// The invariant's name.
        invariant: String,
    },
}

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    SetMember {
        key_field: String,
        key: Bson,
        fields: Document,
    },
    PullMember {
        key_field: String,
        key: Bson,
    },
    Push {
        element: Bson,
    },
    Inc {
        by: Bson,
    },
    Set {
        value: Bson,
    },
}

/// A change to one top-level field of a document, checked when built.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    field: String,
    kind: Kind,
}

impl Change {
    /// Set `fields` on the element(s) of `array` whose `key_field` equals `key` (a doctor by
    /// name). Key and fields are tested on the same element (`$elemMatch` semantics); if no
    /// element has the key the outcome is [`GuardOutcome::NoSuchMember`].
    ///
    /// # Errors
    /// [`Error::InvalidInput`]: `array` or `key_field` is not a top-level field name
    /// (`array` is `_id`), or `fields` is empty, has a key with a dot or a leading `$`, or
    /// is larger than a document can be (16 MiB as BSON).
    pub fn set_member(
        array: &str,
        key_field: &str,
        key: impl Into<Bson>,
        fields: Document,
    ) -> Result<Self> {
        change_field("array", array)?;
        field_name("key field", key_field)?;
        if fields.is_empty() {
            return Err(Error::invalid("fields", "must set at least one field"));
        }
        for k in fields.keys() {
            field_name("fields", k)?;
        }
        fits_a_document("fields", &Bson::Document(fields.clone()))?;
        Ok(Self {
            field: array.to_owned(),
            kind: Kind::SetMember {
                key_field: key_field.to_owned(),
                key: key.into(),
                fields,
            },
        })
    }

    /// Remove the element(s) of `array` whose `key_field` equals `key` (cancel a booking).
    /// [`GuardOutcome::NoSuchMember`] if there is none.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad field name or `_id`.
    pub fn pull_member(array: &str, key_field: &str, key: impl Into<Bson>) -> Result<Self> {
        change_field("array", array)?;
        field_name("key field", key_field)?;
        Ok(Self {
            field: array.to_owned(),
            kind: Kind::PullMember {
                key_field: key_field.to_owned(),
                key: key.into(),
            },
        })
    }

    /// Append `element` to `array` (a missing array is created). As MongoDB's `$push`, the
    /// update refuses a field that holds anything but an array (null included:
    /// [`Error::InvalidInput`] `{ what: "field" }`, nothing written).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad field name or `_id`, or an element larger than a
    /// document can be (16 MiB as BSON).
    pub fn push(array: &str, element: impl Into<Bson>) -> Result<Self> {
        change_field("array", array)?;
        let element = element.into();
        fits_a_document("element", &element)?;
        Ok(Self {
            field: array.to_owned(),
            kind: Kind::Push { element },
        })
    }

    /// Add `by` to a numeric top-level `field` (a missing field counts as 0). As MongoDB's
    /// `$inc`, the update refuses a field that holds anything but a number (null, a
    /// string, a date, …: [`Error::InvalidInput`] `{ what: "field" }`) and an integer sum
    /// that would leave the 64-bit range (`{ what: "by" }`, never rounded to a double);
    /// nothing is written.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad field name, `_id`, or a non-numeric `by`.
    pub fn inc(field: &str, by: impl Into<Bson>) -> Result<Self> {
        change_field("field", field)?;
        let by = by.into();
        if !matches!(
            by,
            Bson::Int32(_) | Bson::Int64(_) | Bson::Double(_) | Bson::Decimal128(_)
        ) {
            return Err(Error::invalid("by", "must be a number"));
        }
        Ok(Self {
            field: field.to_owned(),
            kind: Kind::Inc { by },
        })
    }

    /// Set a top-level `field` to `value` (taken literally).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad field name or `_id`, or a value larger than a
    /// document can be (16 MiB as BSON).
    pub fn set(field: &str, value: impl Into<Bson>) -> Result<Self> {
        change_field("field", field)?;
        let value = value.into();
        fits_a_document("value", &value)?;
        Ok(Self {
            field: field.to_owned(),
            kind: Kind::Set { value },
        })
    }

    /// The top-level field this change writes.
    pub fn field(&self) -> &str {
        &self.field
    }

    fn path(&self) -> String {
        format!("${}", self.field)
    }

    /// The new value of the field, as an expression over the current document.
    pub(crate) fn new_value(&self) -> Bson {
        let path = self.path();
        let e = match &self.kind {
            Kind::SetMember {
                key_field,
                key,
                fields,
            } => doc! { "$cond": [
                { "$isArray": &path },
                { "$map": {
                    "input": &path,
                    "as": "m",
                    "in": { "$cond": [
                        { "$eq": [format!("$$m.{key_field}"), { "$literal": key.clone() }] },
                        { "$mergeObjects": ["$$m", { "$literal": fields.clone() }] },
                        "$$m",
                    ]},
                }},
                &path,
            ]},
            Kind::PullMember { key_field, key } => doc! { "$cond": [
                { "$isArray": &path },
                { "$filter": {
                    "input": &path,
                    "as": "m",
                    "cond": { "$ne": [format!("$$m.{key_field}"), { "$literal": key.clone() }] },
                }},
                &path,
            ]},
            Kind::Push { element } => doc! { "$cond": [
                refuses_stored(&path, &ARRAY_OR_MISSING),
                &path,
                { "$concatArrays": [{ "$ifNull": [&path, []] }, [{ "$literal": element.clone() }]] },
            ]},
            Kind::Inc { by } => {
                let sum =
                    doc! { "$add": [{ "$ifNull": [&path, 0_i32] }, { "$literal": by.clone() }] };
                // Keep the stored value; the diagnosis reports the refusal.
                let not_a_number = refuses_stored(&path, &NUMERIC_OR_MISSING);
                let refuse = match inc_overflows(by, &path) {
                    Some(overflows) => doc! { "$or": [not_a_number, overflows] },
                    None => not_a_number,
                };
                doc! { "$cond": [refuse, &path, sum] }
            }
            Kind::Set { value } => doc! { "$literal": value.clone() },
        };
        Bson::Document(e)
    }

    /// Whether adding this change's integer `by` to the value at `path` would leave the
    /// 64-bit range (`false` for other changes): see [`inc_overflows`].
    fn overflows(&self, path: &str) -> Bson {
        match &self.kind {
            Kind::Inc { by } => {
                inc_overflows(by, path).map_or(Bson::Boolean(false), Bson::Document)
            }
            _ => Bson::Boolean(false),
        }
    }

    /// Whether the member this change needs is in the array at `path` (`true` for changes
    /// without one).
    fn member_present(&self, path: &str) -> Bson {
        match &self.kind {
            Kind::SetMember { key_field, key, .. } | Kind::PullMember { key_field, key } => {
                Bson::Document(doc! { "$cond": [
                    { "$isArray": path },
                    { "$anyElementTrue": [{ "$map": {
                        "input": path,
                        "as": "m",
                        "in": { "$eq": [format!("$$m.{key_field}"), { "$literal": key.clone() }] },
                    }}]},
                    false,
                ]})
            }
            _ => Bson::Boolean(true),
        }
    }

    /// `{$let: {vars: {dw_new: ROOT with the field replaced}, in}}`.
    fn over_new(&self, inner: Bson) -> Bson {
        Bson::Document(doc! { "$let": {
            "vars": { NEW_VAR: { "$mergeObjects": ["$$ROOT", { &self.field: self.new_value() }] } },
            "in": inner,
        }})
    }

    /// The filter of the guarded update of the document `_id == target`: `{_id: target}`
    /// and nothing else. Every condition (the member's presence, the invariants) is in
    /// the pipeline, which keeps the stored value when one fails, so the write is a point
    /// write by `_id` on both servers: MongoDB runs `{_id: v}` alone as its `IDHACK` plan,
    /// and the embedded server skips planning the filter and reading the match a second
    /// time (~60 µs of server CPU per update, `docs/guard.md`). A member that is not
    /// there leaves the document unchanged, and the diagnosing read reports it.
    pub fn filter(&self, target: &Bson) -> Document {
        doc! { "_id": target.clone() }
    }

    /// The pipeline update (for inspection). The first stage keeps the field's new and old
    /// values side by side in the field itself (`{new, old}`), the second keeps the new one
    /// if every invariant holds on it and the old one otherwise. No variable holds the
    /// value: the embedded server copies a `$let`'s variables for every element an
    /// iteration inside it visits, which made a check over a bound 1,000-element array
    /// cost 70 ms there (`docs/surrogate.md`); reading a field path is linear on both
    /// servers, and MongoDB computes the new value once either way. Only an invariant that
    /// reads `$$ROOT`, `$$CURRENT` or `$getField` without `input` binds the whole new
    /// document.
    pub fn pipeline(&self, invariants: &[Invariant]) -> Vec<Document> {
        match self.checks_at_new(invariants) {
            Some(checks) => vec![
                self.side_by_side(),
                doc! { "$set": { &self.field: { "$cond": [
                    { "$and": checks },
                    self.wrapped(WRAP_NEW),
                    self.wrapped(WRAP_OLD),
                ]}}},
            ],
            // An invariant reads `$$ROOT`: bind the whole new document.
            None => {
                let checks: Vec<Bson> = invariants.iter().map(|i| i.expr_over(NEW_VAR)).collect();
                vec![
                    doc! { "$set": { &self.field: self.over_new(Bson::Document(doc! { "$cond": [
                        { "$and": checks },
                        format!("$${NEW_VAR}.{}", self.field),
                        self.path(),
                    ]}))}},
                ]
            }
        }
    }

    /// `{$set: {F: {new: NEW, old: $F}}}`: the first stage of [`Change::pipeline`] and of
    /// the diagnosis. `$mergeObjects` makes the object an expression that replaces the
    /// field (a plain object in `$set` would merge into an embedded document, or into
    /// every element of an array).
    fn side_by_side(&self) -> Document {
        doc! { "$set": { &self.field: { "$mergeObjects": [{
            WRAP_NEW: self.new_value(),
            WRAP_OLD: self.path(),
        }]}}}
    }

    /// `$F.new` or `$F.old` after [`Change::side_by_side`].
    fn wrapped(&self, which: &str) -> String {
        format!("${}.{which}", self.field)
    }

    /// The invariants with every path into the changed field reading its new value
    /// (`$F.new`) after [`Change::side_by_side`]; `None` if one reads `$$ROOT`.
    fn checks_at_new(&self, invariants: &[Invariant]) -> Option<Vec<Bson>> {
        let new = self.wrapped(WRAP_NEW);
        invariants
            .iter()
            .map(|i| rebase_field(i.expr(), &self.field, &new))
            .collect()
    }

    /// The aggregation that explains why the filter did not match: whether the member is
    /// there, whether the change would leave the field as it is, and each invariant on
    /// the new value (the same stages as [`Change::pipeline`]).
    pub(crate) fn diagnose(&self, target: &Bson, invariants: &[Invariant]) -> Vec<Document> {
        let by_id = doc! { "$match": { "_id": target.clone() } };
        let ok_each = |checks: Vec<Bson>| {
            Bson::Array(
                checks
                    .into_iter()
                    .map(|c| Bson::Document(doc! { "$and": [c] }))
                    .collect(),
            )
        };
        match self.checks_at_new(invariants) {
            Some(checks) => vec![
                by_id,
                self.side_by_side(),
                doc! { "$project": {
                    "_id": 0,
                    "member": { "$and": [self.member_present(&self.wrapped(WRAP_OLD))] },
                    "stored": { "$type": [self.wrapped(WRAP_OLD)] },
                    "overflow": { "$and": [self.overflows(&self.wrapped(WRAP_OLD))] },
                    "same": same_pair(self.wrapped(WRAP_NEW), self.wrapped(WRAP_OLD)),
                    "ok": ok_each(checks),
                }},
            ],
            None => {
                let checks = invariants.iter().map(|i| i.expr_over(NEW_VAR)).collect();
                vec![
                    by_id,
                    doc! { "$project": {
                        "_id": 0,
                        "member": { "$and": [self.member_present(&self.path())] },
                        "stored": { "$type": [self.path()] },
                        "overflow": { "$and": [self.overflows(&self.path())] },
                        "same": same_pair(self.new_value(), self.path()),
                        "ok": self.over_new(ok_each(checks)),
                    }},
                ]
            }
        }
    }
}

/// `[new, old]` when the two are `$eq` (a candidate for "nothing to write", decided byte
/// for byte by [`same_bytes`]), `false` otherwise: values travel only in that case.
fn same_pair(new: impl Into<Bson>, old: impl Into<Bson>) -> Document {
    let (new, old) = (new.into(), old.into());
    doc! { "$cond": [{ "$eq": [new.clone(), old.clone()] }, [new, old], false] }
}

/// For an integer `by` (int or long): whether adding it to the integer at `path` would
/// leave the 64-bit range, as `{$and: [{$in: [{$type: [path]}, ["int", "long"]]}, {$gt:
/// [path, i64::MAX - by]}]}` (`$lt` and `i64::MIN - by` for a negative `by`); `None` for 0
/// or a non-integer `by`. Aggregation's `$add` answers such a sum as a double, which would
/// silently round the counter (`i64::MAX + 1` stored as `9.223372036854776e18`, and
/// every later `+1` lost); MongoDB's own `$inc` refuses it. An int that overflows 32 bits
/// becomes a long, as with `$inc`.
fn inc_overflows(by: &Bson, path: &str) -> Option<Document> {
    let by = match by {
        Bson::Int32(v) => i64::from(*v),
        Bson::Int64(v) => *v,
        _ => return None,
    };
    let (op, limit) = match by.cmp(&0) {
        std::cmp::Ordering::Greater => ("$gt", i64::MAX - by),
        std::cmp::Ordering::Less => ("$lt", i64::MIN - by),
        std::cmp::Ordering::Equal => return None,
    };
    Some(doc! { "$and": [
        { "$in": [{ "$type": [path] }, ["int", "long"]] },
        { op: [path, limit] },
    ]})
}

/// Whether the `$type` of the value at `path` is none of `accepted`: a stored value the
/// change refuses, as MongoDB's update operator does. `$inc` refuses anything but a
/// number (null, a string, a date, …; code 14), where aggregation's `$add` would count null
/// as 0 (`$ifNull`), add a number to a date as milliseconds, and fail on a string with a
/// bare error; `$push` refuses anything but an array (code 2), where `$concatArrays`
/// would take null for `[]` and fail on the rest. A missing field is accepted by both.
fn refuses_stored(path: &str, accepted: &[&str]) -> Document {
    doc! { "$not": [{ "$in": [{ "$type": [path] }, accepted.to_vec()] }] }
}

/// The `$type` aliases an `inc` adds to: the numbers, and a missing field (0).
const NUMERIC_OR_MISSING: [&str; 5] = ["missing", "int", "long", "double", "decimal"];

/// The `$type` aliases a `push` appends to: an array, and a missing field (`[]`).
const ARRAY_OR_MISSING: [&str; 2] = ["missing", "array"];

/// Whether two values are the same BSON, byte for byte (types and field order included):
/// what both servers compare to decide that a pipeline update modified nothing. `$eq`
/// alone says `5.0 == NumberLong(5)`, yet `$set` writes the double.
fn same_bytes(a: &Bson, b: &Bson) -> bool {
    let bytes = |v: &Bson| {
        let mut out = Vec::new();
        doc! { "v": v.clone() }
            .to_writer(&mut out)
            .map(|()| out)
            .ok()
    };
    matches!((bytes(a), bytes(b)), (Some(x), Some(y)) if x == y)
}

/// Checks that `value` can be written into a document at all: `{v: value}` is at most
/// [`crate::validate::MAX_DOCUMENT_BYTES`] (16 MiB) as BSON. A larger value could never be
/// stored (the server refuses the update, code 10334 "object to insert too large"), so it
/// is [`Error::InvalidInput`] when the change is built, before anything is sent.
fn fits_a_document(what: &'static str, value: &Bson) -> Result<()> {
    let mut encoded = Vec::new();
    doc! { "v": value.clone() }
        .to_writer(&mut encoded)
        .map_err(|e| Error::invalid(what, format!("cannot be encoded as BSON: {e}")))?;
    if encoded.len() > crate::validate::MAX_DOCUMENT_BYTES {
        return Err(Error::invalid(
            what,
            format!(
                "is {} bytes as BSON; a document holds at most {} (nothing sent)",
                encoded.len(),
                crate::validate::MAX_DOCUMENT_BYTES
            ),
        ));
    }
    Ok(())
}

/// Checks the top-level field a change writes: a [`field_name`], and not `_id`, which no
/// update may change (the server would refuse the write with a bare database error).
fn change_field(what: &'static str, name: &str) -> Result<()> {
    field_name(what, name)?;
    if name == "_id" {
        return Err(Error::invalid(what, "`_id` cannot be changed"));
    }
    Ok(())
}

/// Options of a [`Guarded`] handle.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct GuardOptions {
    /// How many times the update is tried when the document keeps changing between the
    /// update and the read that explains a miss (default 16).
    pub max_attempts: usize,
}

impl Default for GuardOptions {
    fn default() -> Self {
        Self { max_attempts: 16 }
    }
}

impl GuardOptions {
    /// Sets [`GuardOptions::max_attempts`].
    #[must_use]
    pub fn max_attempts(mut self, n: usize) -> Self {
        self.max_attempts = n;
        self
    }
}

/// A collection whose documents are changed only through guarded updates.
///
/// ```no_run
/// # async fn example(coll: mongodb::Collection<mongodb::bson::Document>) -> docwarden::Result<()> {
/// use docwarden::guard::{Change, Condition, GuardOptions, GuardOutcome, Guarded, Invariant};
/// use mongodb::bson::doc;
/// let guarded = Guarded::new(coll, GuardOptions::default())?;
/// let on_call = Invariant::at_least("someone on call", "doctors", 1, Condition::eq("on_call", true))?;
/// let off = Change::set_member("doctors", "name", "Bob", doc! { "on_call": false })?;
/// match guarded.update(1, &off, &[on_call]).await? {
///     GuardOutcome::Applied => println!("Bob is off call"),
///     GuardOutcome::Rejected { invariant } => println!("refused: {invariant}"),
///     other => println!("{other:?}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Guarded {
    coll: Collection<Document>,
    opts: GuardOptions,
    /// Set when the server refused the `bulkWrite` command ([`Guarded::update_many`] then
    /// sends one update at a time).
    pub(super) no_bulk: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Guarded {
    /// A handle on `coll` with `opts`, without touching the server: it only validates.
    /// Use [`Guarded::open`] to also run the preflight checks.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] if `max_attempts` is 0.
    pub fn new(coll: Collection<Document>, opts: GuardOptions) -> Result<Self> {
        crate::validate::positive("max_attempts", opts.max_attempts)?;
        Ok(Self {
            coll,
            opts,
            no_bulk: std::sync::Arc::default(),
        })
    }

    /// A handle on collection `name` of `db` ([`Guarded::new`]), after the preflight checks
    /// ([`crate::preflight::check`]). No index is created: the guard writes by `_id`
    /// (see [`super::ensure_array_index`] for the index a member lookup may want).
    ///
    /// # Errors
    /// As [`Guarded::new`]; [`Error::Incompatible`] for a server older than MongoDB 6.0 or
    /// a collection with a non-simple default collation; a database error.
    pub async fn open(db: &mongodb::Database, name: &str, opts: GuardOptions) -> Result<Self> {
        crate::validate::collection_name("guarded collection", name)?;
        let this = Self::new(db.collection(name), opts)?;
        crate::preflight::check(&this.coll).await?;
        Ok(this)
    }

    /// The wrapped collection.
    pub fn collection(&self) -> &Collection<Document> {
        &self.coll
    }

    /// Applies `change` to the document with `_id == target` only if the document after
    /// the change satisfies every invariant, in one atomic update. A missing document is
    /// answered by the update's reply ([`GuardOutcome::NotFound`]); a change the document
    /// kept is explained by one read ([`GuardOutcome`]). Nothing is written unless the
    /// outcome is [`GuardOutcome::Applied`].
    ///
    /// # Errors
    /// [`Error::InvalidInput`] if `target` is not a plain document id
    /// ([`crate::validate::document_id`]: a document with a `$` key would be read as a
    /// query operator and match another document; null, an array, a regex); nothing is
    /// sent; [`Error::InvalidInput`] `{ what: "by" }` if an integer [`Change::inc`] would
    /// leave the 64-bit range, `{ what: "field" }` if a [`Change::inc`] meets a stored value
    /// that is not a number or a [`Change::push`] one that is not an array (null included), `{ what: "invariant" }` if the server does not
    /// know an operator an invariant uses (the reason names the rule): nothing written in
    /// each case. [`Error::Database`] if the server fails the update (a validator refusal is code
    /// 121); [`Error::Unavailable`] if the document changed between every one of
    /// `max_attempts` updates and the reads explaining them (retry later).
    #[instrument(skip(self, target, change, invariants), fields(coll = %self.coll.name(), field = %change.field))]
    pub async fn update(
        &self,
        target: impl Into<Bson>,
        change: &Change,
        invariants: &[Invariant],
    ) -> Result<GuardOutcome> {
        let target = target.into();
        crate::validate::document_id("target", &target)?;
        // Built once for the first attempt and handed to the driver as they are; a retry
        // (rare: the document changed between a miss and its diagnosis) builds them again.
        let mut first = Some((change.filter(&target), change.pipeline(invariants)));
        for attempt in 0..self.opts.max_attempts {
            let (filter, pipeline) = first
                .take()
                .unwrap_or_else(|| (change.filter(&target), change.pipeline(invariants)));
            let res = self
                .coll
                .update_one(filter, pipeline)
                .await
                .map_err(|e| refused_operator(e, invariants))?;
            match Ran::of(&res) {
                Ran::Written => return Ok(GuardOutcome::Applied),
                Ran::NoDocument => return Ok(GuardOutcome::NotFound),
                Ran::Kept => {}
            }
            // Not written: no such member, or the value was kept because it was already so
            // or an invariant failed. One read tells which.
            if let Some(outcome) = self.diagnose(&target, change, invariants).await? {
                return Ok(outcome);
            }
            debug!(
                attempt,
                "document changed between update and read; retrying"
            );
            if attempt > 2 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        Err(Error::Unavailable {
            what: "guarded update (the document kept changing)",
        })
    }

    /// Why the filter did not match, or `None` if it would match now.
    pub(super) async fn diagnose(
        &self,
        target: &Bson,
        change: &Change,
        invariants: &[Invariant],
    ) -> Result<Option<GuardOutcome>> {
        let mut cursor = self
            .coll
            .aggregate(change.diagnose(target, invariants))
            .await
            .map_err(|e| refused_operator(e, invariants))?;
        let Some(d) = cursor
            .try_next()
            .await
            .map_err(|e| refused_operator(e, invariants))?
        else {
            return Ok(Some(GuardOutcome::NotFound));
        };
        let malformed = |reason: &str| Error::Malformed {
            id: target.to_string(),
            reason: format!("diagnosis: {reason}"),
        };
        if !d.get_bool("member").map_err(|_| malformed("member"))? {
            return Ok(Some(GuardOutcome::NoSuchMember));
        }
        let accepted: Option<(&[&str], &str)> = match change.kind {
            Kind::Inc { .. } => Some((
                &NUMERIC_OR_MISSING,
                "a number: an increment (like MongoDB's $inc)",
            )),
            Kind::Push { .. } => {
                Some((&ARRAY_OR_MISSING, "an array: a push (like MongoDB's $push)"))
            }
            _ => None,
        };
        if let Some((accepted, needs)) = accepted {
            let stored = d.get_str("stored").map_err(|_| malformed("stored"))?;
            if !accepted.contains(&stored) {
                return Err(Error::invalid(
                    "field",
                    format!(
                        "`{}` of {target} holds a {stored}, not {needs} refuses it (nothing written)",
                        change.field
                    ),
                ));
            }
        }
        if d.get_bool("overflow").map_err(|_| malformed("overflow"))? {
            return Err(Error::invalid(
                "by",
                format!(
                    "adding it to `{}` of {target} would leave the 64-bit integer range (nothing written)",
                    change.field
                ),
            ));
        }
        let same = match d.get("same") {
            Some(Bson::Boolean(false)) => false,
            Some(Bson::Array(pair)) if pair.len() == 2 => same_bytes(&pair[0], &pair[1]),
            _ => return Err(malformed("same")),
        };
        if same {
            return Ok(Some(GuardOutcome::NoChange));
        }
        let ok = d.get_array("ok").map_err(|_| malformed("ok"))?;
        for (inv, passed) in invariants.iter().zip(ok) {
            if passed != &Bson::Boolean(true) {
                return Ok(Some(GuardOutcome::Rejected {
                    invariant: inv.name().to_owned(),
                }));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::guard::Condition;

    #[test]
    fn changes_check_their_names() {
        assert!(Change::set_member("doctors", "name", "a", doc! {}).is_err());
        assert!(Change::set_member("doctors", "name", "a", doc! { "a.b": 1 }).is_err());
        assert!(Change::set_member("doctors", "name", "a", doc! { "$a": 1 }).is_err());
        assert!(Change::set_member("doc.tors", "name", "a", doc! { "a": 1 }).is_err());
        assert!(Change::inc("balance", "x").is_err());
        assert!(Change::inc("balance", 5_i64).is_ok());
        assert!(Change::set("_id", 5_i64).is_err());
        // Session 15: only `set` refused `_id`; the others built a change the server
        // then refused with a bare database error (or NoSuchMember).
        for c in [
            Change::inc("_id", 1_i64),
            Change::push("_id", 1_i64),
            Change::pull_member("_id", "k", 1_i64),
            Change::set_member("_id", "k", 1_i64, doc! { "a": 1 }),
        ] {
            assert!(
                matches!(c, Err(Error::InvalidInput { .. })),
                "a change of `_id` was built: {c:?}"
            );
        }
        assert!(Change::push("", 5_i64).is_err());
    }

    /// Session 19: a value no document can hold was built into a change and sent; the
    /// server refused the update with a bare database error (code 10334).
    #[test]
    fn a_value_larger_than_a_document_is_refused_when_the_change_is_built() {
        let huge = "x".repeat(crate::validate::MAX_DOCUMENT_BYTES);
        let too_big = |c: Result<Change>, what: &str| {
            assert!(
                matches!(&c, Err(Error::InvalidInput { what: w, .. }) if *w == what),
                "{what}: {:?}",
                c.as_ref().map(Change::field)
            );
        };
        too_big(Change::set("v", huge.as_str()), "value");
        too_big(Change::push("a", huge.as_str()), "element");
        too_big(
            Change::set_member("a", "k", 1, doc! { "v": huge.as_str() }),
            "fields",
        );
        let fits = "x".repeat(crate::validate::MAX_DOCUMENT_BYTES - 100);
        assert!(Change::set("v", fits).is_ok());
    }

    #[test]
    fn set_member_filter_is_the_id_alone_and_the_pipeline_reads_the_new_value() {
        let inv = Invariant::at_least("on", "doctors", 1, Condition::eq("on_call", true)).unwrap();
        let c = Change::set_member("doctors", "name", "Bob", doc! { "on_call": false }).unwrap();
        assert_eq!(c.filter(&Bson::Int32(1)), doc! { "_id": 1 });
        let p = c.pipeline(&[inv]);
        assert_eq!(p.len(), 2);
        let text = format!("{}", p[1]);
        assert!(text.contains("\"$doctors.new\""), "{text}");
        assert!(!text.contains("\"$doctors.on_call\""), "{text}");
    }
}
