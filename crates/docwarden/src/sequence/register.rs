//! Last-writer-wins registers: `set(key, field, value, seq)` for scalar or sub-document
//! values.
//!
//! Each call is one atomic pipeline update on the document `{<key_field>: key}`. The
//! value is stored under its plain field name (readable as-is), its sequence number in
//! `_seq.<field>` and its tie key in `_seq_tie.<field>`.
//!
//! **The operator form** (issue 14, [`FieldsOptions::operator_form`], on by default): a
//! write whose number is above the last one this handle saw stored for the field (an
//! in-order stream, after the field's first write) is sent first as one `updateOne` with
//! `$set` of the value, its number and tie key, filtered on a stored number below it
//! ([`SequencedFields::operator_update_for`]). It leaves the document the pipeline would
//! leave, byte for byte; anything it does not match (a newer write got there first, a
//! hand-edited document, a field never written) goes on to the pipeline, which decides.
//! Values with types or keys the two forms could store differently always take the
//! pipeline ([`operator_value`]).
//!
//! **Rule:** a write `(seq, value)` replaces the stored `(seq₀, value₀)` when `seq > seq₀`,
//! or when `seq == seq₀` and `value` is greater than `value₀` in MongoDB's BSON comparison
//! order (`$gt`), or when the two are equal there (`7`, `7.0` and `7` as int64 are, and
//! `{a: 1}` and `{a: 1.0}`) and the value's **tie key** ([`tie_key`]: its BSON encoding,
//! length first) is greater. That is a total order over BSON values *with their types*,
//! so which value is stored, type included, does not depend on arrival order. The same
//! value (identical bytes) at an equal seq is [`ApplyOutcome::Duplicate`]; a losing write is
//! [`ApplyOutcome::Stale`].
//!
//! **Canonical document:** the first write of a field sorts the document's top-level
//! fields by name (`_id` first) and the entries of `_seq` and `_seq_tie`; later writes
//! change values in place. Nothing per-call is stored. So the document left by a history
//! of writes is the same, byte for byte, for every delivery order and any duplication.
//! Limits: the tie key stores the value's bytes a second time (registers are meant for
//! small values), and fields written by other means keep the position they are given
//! until the next first write of a register field sorts them.

use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};

use mongodb::options::WriteConcern;

use super::hints::{Hints, LosingRead};
use super::set::{self, MALFORMED};
use super::{ApplyOutcome, CREATED, OUTCOME_FIELD, SHAPE_FIELD, encode, validate_seq};
use crate::error::{Error, Result};

/// The sub-document holding each register's sequence number.
pub const SEQ_FIELD: &str = "_seq";

/// The sub-document holding each register's tie key ([`tie_key`]).
pub const TIE_FIELD: &str = "_seq_tie";

/// The largest register value, as the BSON size of `{"v": value}` (2 MiB). An update
/// carries the value about seven times (the pipeline compares and writes it, and the
/// filter and the pipeline carry its tie key), and a command may not exceed 16 MiB; the
/// stored document holds it twice (value and tie key). A larger value is refused before
/// anything is sent ([`tie_key`]).
pub const MAX_VALUE_BYTES: usize = 2 * 1024 * 1024;

/// The tie key of a register value: the BSON encoding of the one-field document
/// `{"v": value}`, preceded by its length as a 4-byte big-endian integer, stored as BSON
/// binary (subtype 0). It decides between values at equal sequence numbers that MongoDB's
/// comparison order finds equal: the greater key wins — a longer encoding beats a shorter
/// one, equal lengths compare byte by byte, which is the order MongoDB uses for binary
/// data of one subtype (length first) and plain byte order thanks to the prefix, so every
/// server and every port agree. The encoding includes each value's type:
/// `7` (int32, 12 bytes) < `7.0` (double, 16 bytes, type byte 0x01) < `7` (int64, 16
/// bytes, type byte 0x12).
///
/// # Errors
/// [`Error::InvalidInput`] if the value cannot be encoded (larger than BSON allows) or is
/// larger than [`MAX_VALUE_BYTES`].
pub fn tie_key(value: &Bson) -> Result<Vec<u8>> {
    let mut encoded = Vec::new();
    doc! { "v": value.clone() }
        .to_writer(&mut encoded)
        .map_err(|e| Error::invalid("value", format!("cannot be encoded as BSON: {e}")))?;
    if encoded.len() > MAX_VALUE_BYTES {
        return Err(Error::invalid(
            "value",
            format!(
                "is {} bytes as BSON; the limit of a register value is {MAX_VALUE_BYTES}",
                encoded.len()
            ),
        ));
    }
    let len = u32::try_from(encoded.len())
        .map_err(|_| Error::invalid("value", "larger than a BSON document can be"))?;
    let mut key = len.to_be_bytes().to_vec();
    key.extend_from_slice(&encoded);
    Ok(key)
}

fn binary(bytes: Vec<u8>) -> Bson {
    Bson::Binary(mongodb::bson::Binary {
        subtype: mongodb::bson::spec::BinarySubtype::Generic,
        bytes,
    })
}

/// Options of [`SequencedFields`], validated by [`SequencedFields::new`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct FieldsOptions {
    /// The field that identifies the document (`_id` by default). Any other field gets a
    /// unique index.
    pub key_field: String,
    /// Write concern for every write of the handle; `None` (the default) inherits the
    /// collection's. Use [`WriteConcern::majority()`] on a replica set, so that a
    /// failover cannot roll back an applied write the caller already acknowledged.
    pub write_concern: Option<WriteConcern>,
    /// Test-only control: `false` treats values that MongoDB's order finds equal as the
    /// same value at equal sequence numbers (the first one stays), as before issue 11, so
    /// the tests can show the stored type then depends on the delivery order. Always `true`
    /// outside those tests.
    #[doc(hidden)]
    pub tie_keys: bool,
    /// Send a write whose number is above the last one this handle saw stored for the
    /// field as an operator update first (one `updateOne`; see the module docs), and the
    /// pipeline only when that does not match. `false`: every write is the pipeline's
    /// `findAndModify`. The stored document and the outcome are the same either way.
    /// Default `true`.
    pub operator_form: bool,
    /// Test-only control: `false` sends the operator form with the key alone as its filter
    /// (no "the stored number is below the write's", no shape checks), so the tests can
    /// show that a stale write then overwrites a newer one. Always `true` outside those
    /// tests.
    #[doc(hidden)]
    pub operator_number_check: bool,
}

impl Default for FieldsOptions {
    fn default() -> Self {
        Self {
            key_field: "_id".to_owned(),
            write_concern: None,
            tie_keys: true,
            operator_form: true,
            operator_number_check: true,
        }
    }
}

impl FieldsOptions {
    /// The field identifying the document, e.g. `student_id`.
    #[must_use]
    pub fn key_field(mut self, key_field: impl Into<String>) -> Self {
        self.key_field = key_field.into();
        self
    }

    /// Sets [`FieldsOptions::write_concern`] (for example [`WriteConcern::majority()`]).
    #[must_use]
    pub fn write_concern(mut self, write_concern: WriteConcern) -> Self {
        self.write_concern = Some(write_concern);
        self
    }

    /// Test-only control (see the field): switches the tie keys off (and with them the
    /// operator form, which keeps to the rule with tie keys).
    #[doc(hidden)]
    #[must_use]
    pub fn control_without_tie_keys(mut self) -> Self {
        self.tie_keys = false;
        self
    }

    /// Test-only control (see the field): the operator form without its number check.
    #[doc(hidden)]
    #[must_use]
    pub fn control_operator_without_number_check(mut self) -> Self {
        self.operator_number_check = false;
        self
    }

    /// Sets [`FieldsOptions::operator_form`].
    #[must_use]
    pub fn operator_form(mut self, on: bool) -> Self {
        self.operator_form = on;
        self
    }
}

/// A handle on a collection of documents whose fields are last-writer-wins registers.
#[derive(Debug, Clone)]
pub struct SequencedFields {
    collection: Collection<Document>,
    key_field: String,
    tie_keys: bool,
    operator_form: bool,
    /// [`FieldsOptions::operator_number_check`] (the control switches it off).
    number_check: bool,
    /// With [`FieldsOptions::operator_form`]: the last sequence number of each `(key,
    /// field)` this handle (and its clones) saw stored, which picks the form to try first.
    hints: Hints<i64>,
    /// The read that decides a write whose number is at or below the hint.
    losing_read: LosingRead,
}

impl SequencedFields {
    /// A handle on `collection`, without touching the server: it only validates the
    /// options. Use [`SequencedFields::open`] to also run the preflight checks and create
    /// the key index, or call [`SequencedFields::ensure_indexes`] once.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a key field that is not a plain name.
    pub fn new(collection: Collection<Document>, options: FieldsOptions) -> Result<Self> {
        if options.key_field != "_id" {
            encode::field("key field", &options.key_field)?;
        }
        Ok(Self {
            collection: super::with_write_concern(collection, options.write_concern.as_ref()),
            key_field: options.key_field,
            tie_keys: options.tie_keys,
            operator_form: options.operator_form && options.tie_keys,
            number_check: options.operator_number_check,
            hints: Hints::default(),
            losing_read: LosingRead::default(),
        })
    }

    /// A handle on collection `name` of `db` ([`SequencedFields::new`]), after the
    /// preflight checks ([`crate::preflight::check`]), with the unique key index created
    /// ([`SequencedFields::ensure_indexes`]).
    ///
    /// # Errors
    /// As [`SequencedFields::new`]; [`Error::Incompatible`] for a server older than
    /// MongoDB 6.0 or a collection with a non-simple default collation (see
    /// [`crate::preflight`]); [`Error::Database`] if the index cannot be created.
    pub async fn open(db: &mongodb::Database, name: &str, options: FieldsOptions) -> Result<Self> {
        crate::validate::collection_name("fields collection", name)?;
        let this = Self::new(db.collection(name), options)?;
        crate::preflight::check(&this.collection).await?;
        this.ensure_indexes().await?;
        Ok(this)
    }

    /// Creates the unique key index (idempotent) unless the key is `_id`.
    ///
    /// # Errors
    /// [`Error::Database`] if the index cannot be created.
    pub async fn ensure_indexes(&self) -> Result<()> {
        super::ensure_key_index(&self.collection, &self.key_field).await
    }

    /// The collection this handle writes to.
    pub fn collection(&self) -> &Collection<Document> {
        &self.collection
    }

    /// Sets `field` of `key` to `value` as of `seq`. One round trip; two when the operator
    /// form was tried and did not match (another handle had written a newer number, or a
    /// hand edit: see the module docs), and when the document is created.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad key, a field name that is not plain (see
    /// [`encode::field`]; it must also differ from the key field), a negative `seq` or a
    /// value larger than [`MAX_VALUE_BYTES`] (nothing is sent);
    /// [`Error::Malformed`] if the stored document is not in the expected shape;
    /// [`Error::Database`] otherwise (a duplicate-key error from a consumer
    /// racing to create the document is absorbed, not returned).
    pub async fn set(
        &self,
        key: impl Into<Bson>,
        field: &str,
        value: impl Into<Bson>,
        seq: i64,
    ) -> Result<ApplyOutcome> {
        let key = encode::key(key.into())?;
        self.check_field(field)?;
        validate_seq(seq)?;
        let value = value.into();
        let tie = tie_key(&value)?;
        match self.set_valid(&key, field, value, tie, seq).await {
            Err(Error::Database { source }) => Err(self.malformed_or(&key, source).await),
            other => other,
        }
    }

    /// [`SequencedFields::set`] after its input was checked (`tie`: the value's
    /// [`tie_key`]).
    async fn set_valid(
        &self,
        key: &Bson,
        field: &str,
        value: Bson,
        tie: Vec<u8>,
        seq: i64,
    ) -> Result<ApplyOutcome> {
        let hint_key = (key.to_string(), field.to_owned());
        let hint = self.hints.get(&hint_key).filter(|_| self.operator_form);
        if hint.is_some_and(|seen| seq <= seen)
            && let Some(outcome) = self.decided_by_read(key, field, seq, &tie, &hint_key).await
        {
            tracing::debug!(%key, field, seq, ?outcome, "sequenced field write decided by a read");
            return Ok(outcome);
        }
        if hint.is_some_and(|seen| seq > seen) && operator_value(&value) {
            let (mut filter, update) =
                operator_update(&self.key_field, key, field, value.clone(), &tie, seq);
            if !self.number_check {
                filter = doc! { "$and": [{ self.key_field.as_str(): key.clone() }] };
            }
            if self
                .collection
                .update_one(filter, update)
                .await?
                .matched_count
                == 1
            {
                self.hints.remember(hint_key, seq);
                tracing::debug!(%key, field, seq, "sequenced field write applied by operators");
                return Ok(ApplyOutcome::Applied);
            }
        }
        let seq_path = format!("{SEQ_FIELD}.{field}");
        let tie_path = format!("{TIE_FIELD}.{field}");
        // The stored number as the pipeline's post-image (or the diagnosing read) showed it.
        let seen = std::sync::Mutex::new(None);
        let shape_paths = bookkeeping_paths();
        let outcome = super::apply(
            &self.collection,
            doc! { self.key_field.as_str(): key.clone() },
            vec![doc! { "$or": [
                { seq_path.as_str(): { "$ne": seq } },
                { tie_path.as_str(): { "$ne": binary(tie.clone()) } },
            ] }],
            || {
                Self::pipeline_with_tie(
                    field,
                    value.clone(),
                    binary(tie.clone()),
                    seq,
                    self.tie_keys,
                )
            },
            doc! {
                seq_path.as_str(): 1,
                tie_path.as_str(): 1,
                SHAPE_FIELD: set::types_of(&shape_paths),
            },
            |d| {
                // Bookkeeping out of shape (a hand edit): the pipeline decided `malformed`
                // and left the document as it was.
                set::check_shape(d, &shape_paths, key)?;
                let held = holds(d, &seq_path, &tie_path, seq, &tie, key)?;
                if let Ok(mut seen) = seen.lock() {
                    *seen = super::get_path(d, &seq_path).and_then(super::stored_seq);
                }
                Ok(held)
            },
            // A document out of shape is reported by the shape check of the read.
            || async { None },
        )
        .await?;
        if self.operator_form
            && let Some(stored) = seen.into_inner().ok().flatten()
        {
            self.hints.remember(hint_key, stored);
        }
        tracing::debug!(%key, field, seq, ?outcome, "sequenced field write");
        Ok(outcome)
    }

    /// The outcome of a write whose number is at or below the one this handle last saw
    /// stored (stale, or a re-delivery), decided by one read of the stored number and tie
    /// key with read concern `majority`: a stored number above `seq` is
    /// [`ApplyOutcome::Stale`], the same number with the same tie key (the same value, byte
    /// for byte) [`ApplyOutcome::Duplicate`] — the write is a no-op at the time of the read,
    /// against a state a majority holds, so no rollback takes it back; nothing is written.
    /// `None` when the read does not decide it (the same number with another value, a
    /// smaller stored number, a document or register that is missing or not in shape): the
    /// pipeline decides then, as for any write. The number read becomes the hint.
    async fn decided_by_read(
        &self,
        key: &Bson,
        field: &str,
        seq: i64,
        tie: &[u8],
        hint_key: &(String, String),
    ) -> Option<ApplyOutcome> {
        let seq_path = format!("{SEQ_FIELD}.{field}");
        let tie_path = format!("{TIE_FIELD}.{field}");
        let stored = self
            .losing_read
            .read(
                &self.collection,
                doc! { self.key_field.as_str(): key.clone() },
                doc! {
                    seq_path.as_str(): 1,
                    tie_path.as_str(): 1,
                    SHAPE_FIELD: set::types_of(&bookkeeping_paths()),
                },
            )
            .await?;
        // Bookkeeping out of shape (a hand edit), or a reply without the shape, is the
        // pipeline's to report.
        if stored.get_array(SHAPE_FIELD).is_err()
            || set::check_shape(&stored, &bookkeeping_paths(), key).is_err()
        {
            return None;
        }
        let stored_seq = super::get_path(&stored, &seq_path).and_then(super::stored_seq)?;
        // A tie key that is not binary data is a hand edit the pipeline reports.
        let stored_tie = match super::get_path(&stored, &tie_path) {
            None => None,
            Some(Bson::Binary(b)) => Some(b.bytes.as_slice()),
            Some(_) => return None,
        };
        self.hints.remember(hint_key.clone(), stored_seq);
        if stored_seq > seq {
            Some(ApplyOutcome::Stale)
        } else {
            (stored_seq == seq && stored_tie == Some(tie)).then_some(ApplyOutcome::Duplicate)
        }
    }

    /// The filter and the update of the operator form a write tries first (see the module
    /// docs), for inspection and other-language ports; `None` for a value that always
    /// takes the pipeline ([`operator_value`]).
    ///
    /// # Errors
    /// As [`SequencedFields::set`] for a bad key, field, `seq` or value.
    pub fn operator_update_for(
        &self,
        key: impl Into<Bson>,
        field: &str,
        value: impl Into<Bson>,
        seq: i64,
    ) -> Result<Option<(Document, Document)>> {
        let key = encode::key(key.into())?;
        self.check_field(field)?;
        validate_seq(seq)?;
        let value = value.into();
        let tie = tie_key(&value)?;
        Ok(operator_value(&value)
            .then(|| operator_update(&self.key_field, &key, field, value, &tie, seq)))
    }

    /// The error to report for `source`, a database error of a write on `key`:
    /// [`Error::Malformed`] naming the field when the server refused the write (an error
    /// with a code, not a network error) and the document's `_seq` or `_seq_tie` is not a
    /// sub-document — a hand edit the pipeline cannot work on (`$objectToArray` of an
    /// array); `source` itself otherwise (also when the read fails). Costs a read only on
    /// such an error.
    async fn malformed_or(&self, key: &Bson, source: mongodb::error::Error) -> Error {
        if crate::error::error_code(&source).is_none() {
            return source.into();
        }
        match self.out_of_shape(key).await {
            Some(path) => shape_error(
                key,
                path,
                &format!("the server refused the write: {source}"),
            ),
            None => source.into(),
        }
    }

    /// The first of `_seq` and `_seq_tie` that `key`'s document holds as anything but a
    /// sub-document (a hand edit); `None` if both are documents or missing, or when the
    /// read fails or finds no document.
    async fn out_of_shape(&self, key: &Bson) -> Option<&'static str> {
        let stored = self
            .collection
            .find_one(doc! { self.key_field.as_str(): key.clone() })
            .projection(doc! { SEQ_FIELD: 1, TIE_FIELD: 1 })
            .await
            .ok()??;
        [SEQ_FIELD, TIE_FIELD].into_iter().find(|f| {
            stored
                .get(*f)
                .is_some_and(|v| !matches!(v, Bson::Document(_)))
        })
    }

    fn check_field(&self, field: &str) -> Result<()> {
        encode::field("field", field)?;
        if field == self.key_field {
            return Err(Error::invalid("field", "must differ from the key field"));
        }
        Ok(())
    }

    /// The update pipeline for one write (public for inspection and other-language ports).
    /// `field` must already be checked. The update's filter is the key plus "not in effect
    /// yet" (`$or: [{_seq.<field>: {$ne: seq}}, {_seq_tie.<field>: {$ne: <tie key>}}]`),
    /// which is how the caller's outcome is read back from the post-image (see
    /// `docs/sequence.md`).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] if the value cannot be encoded or is too large (see
    /// [`tie_key`]).
    pub fn pipeline(field: &str, value: Bson, seq: i64) -> Result<Vec<Document>> {
        let tie = binary(tie_key(&value)?);
        Ok(Self::pipeline_with_tie(field, value, tie, seq, true))
    }

    /// Four stages: (1) decide, into the temporary [`OUTCOME_FIELD`] (`created` when the
    /// field had no sequence number yet; `malformed` when `_seq` or `_seq_tie` is neither
    /// missing nor a document, a hand edit); (2) when applied, write the value and merge
    /// the number and the tie key into `_seq` and `_seq_tie` (`$mergeObjects` on the
    /// top-level fields: a dotted path would replace a scalar on its way; it keeps an
    /// existing entry where it is and appends a new one, as `$set` by path does);
    /// (3) when `created`, sort the top-level fields and the entries of `_seq` and
    /// `_seq_tie` by name, `_id` first; (4) `$unset` the temporary field. A `malformed`
    /// decision leaves the document as it was; the apply reads the two `$type`s in the
    /// post-image and answers [`Error::Malformed`]. (Session 31 checked the shape in the
    /// filter, which this server plans and checks for every write; since session 32 the
    /// check is in the decision, as for sets.)
    fn pipeline_with_tie(
        field: &str,
        value: Bson,
        tie: Bson,
        seq: i64,
        tie_keys: bool,
    ) -> Vec<Document> {
        let v = encode::literal(value);
        let t = encode::literal(tie);
        let current_value = format!("${field}");
        let seq_path = format!("{SEQ_FIELD}.{field}");
        let tie_path = format!("{TIE_FIELD}.{field}");
        let cur_seq = format!("${seq_path}");
        let cur_tie = format!("${tie_path}");
        let mut branches = vec![
            doc! { "case": { "$gt": [seq, "$$cur"] }, "then": { "$cond": [
                { "$eq": [{ "$type": cur_seq.as_str() }, "missing"] },
                CREATED,
                ApplyOutcome::Applied.as_str(),
            ] } },
            doc! { "case": { "$lt": [seq, "$$cur"] }, "then": ApplyOutcome::Stale.as_str() },
            // Equal numbers: the greater value in MongoDB's comparison order wins…
            doc! { "case": { "$gt": [v.clone(), current_value.as_str()] },
            "then": ApplyOutcome::Applied.as_str() },
            doc! { "case": { "$lt": [v.clone(), current_value.as_str()] },
            "then": ApplyOutcome::Stale.as_str() },
        ];
        if tie_keys {
            // …and values equal there (7, 7.0, {a: 1}, {a: 1.0}) by tie key. A missing tie
            // key (a document written before tie keys existed) is below every key.
            branches.push(doc! { "case": { "$gt": [t.clone(), cur_tie.as_str()] },
            "then": ApplyOutcome::Applied.as_str() });
            branches.push(doc! { "case": { "$eq": [t.clone(), cur_tie.as_str()] },
            "then": ApplyOutcome::Duplicate.as_str() });
        } else {
            branches.push(
                doc! { "case": { "$eq": [v.clone(), current_value.as_str()] },
                "then": ApplyOutcome::Duplicate.as_str() },
            );
        }
        // Bookkeeping out of shape (a hand edit) decides `malformed`: every field is
        // written back as stored, and the reply's shape check names the field.
        let outcome = doc! { "$cond": [
            set::in_shape(&bookkeeping_paths()),
            { "$let": {
                "vars": { "cur": { "$ifNull": [cur_seq.as_str(), -1_i64] } },
                "in": { "$switch": {
                    "branches": branches,
                    "default": ApplyOutcome::Stale.as_str(),
                } },
            } },
            MALFORMED,
        ] };
        let applied = super::applied_expr();
        let sorted = |input: Bson| -> Document {
            doc! { "$arrayToObject": { "$sortArray": {
                "input": { "$objectToArray": input },
                "sortBy": { "k": 1 },
            } } }
        };
        let root = doc! { "$map": {
            "input": { "$objectToArray": "$$ROOT" },
            "as": "e",
            "in": { "$cond": [
                { "$in": ["$$e.k", [SEQ_FIELD, TIE_FIELD]] },
                { "k": "$$e.k", "v": sorted(Bson::String("$$e.v".to_owned())) },
                "$$e",
            ] },
        } };
        let sorted_root = doc! { "$mergeObjects": [
            { "_id": "$_id" },
            { "$arrayToObject": { "$sortArray": { "input": root, "sortBy": { "k": 1 } } } },
        ] };
        vec![
            doc! { "$set": { OUTCOME_FIELD: outcome } },
            // Top-level fields only: a dotted path would replace a scalar on its way.
            // `$mergeObjects` keeps an existing entry where it is and appends a new one,
            // as `$set` by path does.
            doc! { "$set": {
                field: { "$cond": [applied.clone(), v, current_value.as_str()] },
                SEQ_FIELD: { "$cond": [
                    applied.clone(),
                    { "$mergeObjects": [format!("${SEQ_FIELD}"), { field: { "$literal": seq } }] },
                    format!("${SEQ_FIELD}"),
                ] },
                TIE_FIELD: { "$cond": [
                    applied,
                    { "$mergeObjects": [format!("${TIE_FIELD}"), { field: t }] },
                    format!("${TIE_FIELD}"),
                ] },
            } },
            doc! { "$replaceWith": { "$cond": [
                { "$eq": [format!("${OUTCOME_FIELD}"), CREATED] },
                sorted_root,
                "$$ROOT",
            ] } },
            doc! { "$unset": OUTCOME_FIELD },
        ]
    }

    /// The value of `field` of `key` and its sequence number, or `None` when the document
    /// or the register does not exist.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad key or field; [`Error::Malformed`] if the stored
    /// sequence number is not one (an `int64`, or an `int32`, integral double or plain
    /// integer decimal another writer stored); [`Error::Database`] otherwise.
    pub async fn get(&self, key: impl Into<Bson>, field: &str) -> Result<Option<(Bson, i64)>> {
        let key = encode::key(key.into())?;
        self.check_field(field)?;
        let Some(doc) = self
            .collection
            .find_one(doc! { self.key_field.as_str(): key.clone() })
            .projection(doc! { field: 1, SEQ_FIELD: 1 })
            .await?
        else {
            return Ok(None);
        };
        let Some(seq) = doc.get_document(SEQ_FIELD).ok().and_then(|s| s.get(field)) else {
            return Ok(None);
        };
        let seq = super::stored_seq(seq).ok_or_else(|| Error::Malformed {
            id: key.to_string(),
            reason: format!("`{SEQ_FIELD}.{field}` is not a sequence number"),
        })?;
        Ok(Some((doc.get(field).cloned().unwrap_or(Bson::Null), seq)))
    }
}

/// The operator form of the write `(value, seq)` of `field` (see the module docs): the key
/// first, then `_seq` and `_seq_tie` plain sub-documents, a stored number of `field` that
/// is not an array and is below `seq` (the write wins by its number alone, the
/// pipeline's first case), and a stored tie key; the update `$set`s the value, the number
/// and the tie key by their paths — in place, as the pipeline does for a field written
/// before — and `$unset`s [`OUTCOME_FIELD`], as the pipeline's last stage does. `n: 1`
/// means this write applied. Array operands are excluded on purpose: a query compares an
/// array's elements where the pipeline compares the array.
fn operator_update(
    key_field: &str,
    key: &Bson,
    field: &str,
    value: Bson,
    tie: &[u8],
    seq: i64,
) -> (Document, Document) {
    let seq_path = format!("{SEQ_FIELD}.{field}");
    let tie_path = format!("{TIE_FIELD}.{field}");
    let filter = doc! { "$and": [
        { key_field: key.clone() },
        { SEQ_FIELD: plain_document() },
        { seq_path.as_str(): { "$lt": seq, "$not": { "$type": "array" } } },
        { TIE_FIELD: plain_document() },
        { tie_path.as_str(): { "$type": "binData" } },
    ] };
    let update = doc! {
        "$set": {
            field: value,
            seq_path.as_str(): seq,
            tie_path.as_str(): binary(tie.to_vec()),
        },
        "$unset": { OUTCOME_FIELD: "" },
    };
    (filter, update)
}

/// A query condition on a path: a sub-document, not an array (`$type: "object"` alone
/// would match an array holding one).
fn plain_document() -> Document {
    doc! { "$type": "object", "$not": { "$type": "array" } }
}

/// `_seq` and `_seq_tie`, the bookkeeping the pipeline writes only when each is missing
/// or a document ([`set::in_shape`]).
fn bookkeeping_paths() -> [String; 2] {
    [SEQ_FIELD.to_owned(), TIE_FIELD.to_owned()]
}

/// [`Error::Malformed`] for `key`'s document whose bookkeeping `path` is not a document.
fn shape_error(key: &Bson, path: &str, detail: &str) -> Error {
    Error::Malformed {
        id: key.to_string(),
        reason: format!("`{path}` is not a document ({detail})"),
    }
}

/// Whether the operator form may carry `value`: only types that an update operator and a
/// pipeline's `$literal` store alike, byte for byte, on every server — 32- and 64-bit
/// integers, doubles (not NaN nor −0.0), strings, booleans, null, dates, object ids,
/// binary data, and documents and arrays of them whose keys are non-empty, without a `.`
/// and not starting with `$` (an update operator refuses to store such a key, where
/// `$literal` stores it). Anything else (a decimal, a timestamp, a regular expression,
/// code, deprecated types) takes the pipeline.
pub fn operator_value(value: &Bson) -> bool {
    match value {
        Bson::Double(d) => !(d.is_nan() || (*d == 0.0 && d.is_sign_negative())),
        Bson::Int32(_)
        | Bson::Int64(_)
        | Bson::String(_)
        | Bson::Boolean(_)
        | Bson::Null
        | Bson::DateTime(_)
        | Bson::ObjectId(_)
        | Bson::Binary(_) => true,
        Bson::Array(items) => items.iter().all(operator_value),
        Bson::Document(d) => d.iter().all(|(k, v)| {
            !k.is_empty() && !k.contains('.') && !k.starts_with('$') && operator_value(v)
        }),
        _ => false,
    }
}

/// Whether `doc` holds the write `(seq, tie)`: its number and tie key are stored.
fn holds(
    doc: &Document,
    seq_path: &str,
    tie_path: &str,
    seq: i64,
    tie: &[u8],
    key: &Bson,
) -> Result<bool> {
    let stored_tie = match super::get_path(doc, tie_path) {
        None => return Ok(false),
        Some(Bson::Binary(b)) => &b.bytes,
        Some(_) => {
            return Err(Error::Malformed {
                id: key.to_string(),
                reason: format!("`{tie_path}` is not binary"),
            });
        }
    };
    super::check_stored_seq(doc, seq_path, key)?;
    Ok(
        super::get_path(doc, seq_path).and_then(super::stored_seq) == Some(seq)
            && stored_tie.as_slice() == tie,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(v: impl Into<Bson>) -> Vec<u8> {
        tie_key(&v.into()).unwrap_or_default()
    }

    #[test]
    fn tie_keys_order_values_with_their_types() {
        assert!(key(7_i32) < key(7.0_f64));
        assert!(key(7.0_f64) < key(7_i64));
        assert!(key(5_i32) < key(7_i32));
        assert!(key(doc! { "a": 1_i32 }) < key(doc! { "a": 1.0_f64 }));
        assert_ne!(key(doc! { "a": 1_i64 }), key(doc! { "a": 1.0_f64 }));
        assert_ne!(key(0.0_f64), key(-0.0_f64));
        assert_eq!(key("x"), key("x"));
    }

    #[test]
    fn holds_compares_number_and_tie_key() {
        let k = Bson::Int32(1);
        let t = key(7_i32);
        let holds = |d: &Document, seq, tie: &[u8]| holds(d, "_seq.f", "_seq_tie.f", seq, tie, &k);
        assert_eq!(holds(&doc! { "_id": 1 }, 3, &t).ok(), Some(false));
        let d = doc! { "_seq": { "f": 3_i64 }, "_seq_tie": { "f": binary(t.clone()) } };
        assert_eq!(holds(&d, 3, &t).ok(), Some(true));
        assert_eq!(holds(&d, 4, &t).ok(), Some(false));
        assert_eq!(holds(&d, 3, &key(7_i64)).ok(), Some(false));
        let old = doc! { "_seq": { "f": 3_i64 } };
        assert_eq!(holds(&old, 3, &t).ok(), Some(false));
        let bad = doc! { "_seq": { "f": 3_i64 }, "_seq_tie": { "f": "x" } };
        assert!(holds(&bad, 3, &t).is_err());
    }
}
