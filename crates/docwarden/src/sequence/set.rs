//! A last-writer-wins element set: `add(key, member, seq)` and `remove(key, member, seq)`.
//!
//! Each call is one atomic pipeline update on the document `{<key_field>: key}` (with
//! [`SetOptions::operator_form`], an operator update when the member already has a state
//! entry; the same rule and the same stored document). The
//! document keeps a plain array of the present members (`<field>`, stored as given and
//! kept sorted, for reads and multikey indexes) and, under `_seq_sets.<field>`, one state
//! entry per member ever seen (`state.<member key>: {seq, present}`, the key encoded by
//! [`encode::member_key`], entries sorted by key) and the highest compaction watermark
//! (`floor`). Every set's bookkeeping lives under its own field name inside
//! [`SETS_FIELD`], so two sets on one document never share a field.
//!
//! **Canonical document:** the members array and the state entries are kept in sorted
//! order and nothing per-call is stored, so the document left by a history of operations
//! is the same, byte for byte, for every delivery order and any duplication (for one set
//! per document; with several sets or other fields, the order of the top-level fields
//! follows their first use).
//!
//! **Why a sub-document keyed by member, not an array of `{member, seq, present}`:** the
//! update reads and writes the member's state by a direct path, so its cost does not grow
//! with the number of state entries, where an array needs a `$filter` over every entry to
//! find the member and another to replace it. On the embedded server that array version
//! ran at about 0.55× raw `update_one`, the keyed one at about 0.8×. The price is the
//! reversible key encoding (`%`, `.`, `$` percent-encoded); the plain members array still
//! costs O(members) per applied update (`$in`, `$concatArrays`, `$filter`), which suits
//! sets of up to a few thousand members per document.
//!
//! **Rule:** an operation `(seq, present)` replaces the member's state `(seq₀, present₀)`
//! when `seq > seq₀`, or when `seq == seq₀` and the operation is a remove while the state
//! is present — **remove wins at equal sequence numbers**. So the final state is the
//! maximum under the order `(seq, remove > add)`, which does not depend on arrival order.
//! The same operation again is [`ApplyOutcome::Duplicate`]; a losing one is [`ApplyOutcome::Stale`];
//! one with `seq` below the document's compaction watermark is [`ApplyOutcome::Stale`] too.

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc};
use mongodb::options::WriteConcern;
use mongodb::{Collection, Database, IndexModel};

use super::hints::{Hints, LosingRead};
use super::{ApplyOutcome, CREATED, OUTCOME_FIELD, SHAPE_FIELD, encode, validate_seq};
use crate::error::{Error, Result};

/// Options of a [`SequencedSet`], validated by [`SequencedSet::new`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SetOptions {
    /// The field that identifies the document (`_id` by default). Any other field gets a
    /// unique index.
    pub key_field: String,
    /// The field holding the plain array of present members (`members` by default).
    pub field: String,
    /// Create a multikey index on the present-members array (off by default).
    pub index_members: bool,
    /// Write concern for every write of the handle; `None` (the default) inherits the
    /// collection's. Use [`WriteConcern::majority()`] on a replica set, so that a
    /// failover cannot roll back an applied operation the caller already acknowledged to
    /// its queue.
    pub write_concern: Option<WriteConcern>,
    /// Test-only control: `false` appends new members unsorted and never re-sorts the
    /// state entries, as before issue 11, so the tests can show the document then depends
    /// on the delivery order. Always `true` outside those tests.
    #[doc(hidden)]
    pub canonical_order: bool,
    /// Use the **operator form** when it fits (on by default; issue 14): an operation
    /// that this handle expects to apply to a member that already has a state entry (it
    /// keeps the last state it saw of each entry as a hint) is sent as plain query and
    /// update operators (`update_one`) instead of the pipeline update, which costs the
    /// embedded server about a quarter less time per applied operation. An operation the
    /// hint says loses (stale or a duplicate) is first decided by one read of the stored
    /// entry (read concern `majority`), nothing written, when the stored state confirms it.
    /// Any other operation — a member's first, a key never seen, a losing one the read
    /// does not confirm — is the pipeline update, as is an operator update that did not
    /// match (a second round trip, only when another consumer changed the entry since this
    /// handle saw it). The stored
    /// document and the outcomes are the same either way (see `docs/sequence.md`, "The
    /// operator form"). `false`: always the pipeline.
    pub operator_form: bool,
}

impl Default for SetOptions {
    fn default() -> Self {
        Self {
            key_field: "_id".to_owned(),
            field: "members".to_owned(),
            index_members: false,
            write_concern: None,
            canonical_order: true,
            operator_form: true,
        }
    }
}

impl SetOptions {
    /// The field identifying the document, e.g. `student_id`.
    #[must_use]
    pub fn key_field(mut self, key_field: impl Into<String>) -> Self {
        self.key_field = key_field.into();
        self
    }

    /// The field holding the present members, e.g. `classes`.
    #[must_use]
    pub fn field(mut self, field: impl Into<String>) -> Self {
        self.field = field.into();
        self
    }

    /// Whether to index the present-members array.
    #[must_use]
    pub fn index_members(mut self, on: bool) -> Self {
        self.index_members = on;
        self
    }

    /// Sets [`SetOptions::write_concern`] (for example [`WriteConcern::majority()`]).
    #[must_use]
    pub fn write_concern(mut self, write_concern: WriteConcern) -> Self {
        self.write_concern = Some(write_concern);
        self
    }

    /// Test-only control (see the field): switches the canonical order off.
    #[doc(hidden)]
    #[must_use]
    pub fn control_without_canonical_order(mut self) -> Self {
        self.canonical_order = false;
        self
    }

    /// Sets [`SetOptions::operator_form`] (`false`: every operation as the pipeline
    /// update).
    #[must_use]
    pub fn operator_form(mut self, on: bool) -> Self {
        self.operator_form = on;
        self
    }
}

/// The stored state of one member.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemberState {
    /// The member.
    pub member: String,
    /// Sequence number of the operation that set this state.
    pub seq: i64,
    /// Whether the member is in the set (`false`: a tombstone).
    pub present: bool,
}

/// A handle on a collection of sequenced sets (one set per document, in one field).
#[derive(Debug, Clone)]
pub struct SequencedSet {
    pub(super) collection: Collection<Document>,
    pub(super) key_field: String,
    pub(super) field: String,
    /// `_seq_sets.<field>.state`.
    pub(super) state_field: String,
    /// `_seq_sets.<field>.floor`.
    pub(super) floor_field: String,
    pub(super) canonical_order: bool,
    pub(super) operator_form: bool,
    index_members: bool,
    /// With [`SetOptions::operator_form`]: the last state of each `(key, member)` entry
    /// this handle (and its clones) saw, which picks the form to try first.
    hints: Hints<(i64, bool)>,
    /// Set when the server refused the `bulkWrite` command ([`SequencedSet::apply_many`]
    /// then applies one operation at a time).
    pub(super) no_bulk: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The losing-operation read of hinted applies (left to the pipeline update when the
    /// server refuses read concern `majority`).
    losing_read: LosingRead,
}

/// The pipeline's decision for a document whose bookkeeping is out of shape (bound as
/// `$$dw_d` next to [`ApplyOutcome`]'s names and [`CREATED`]): nothing is changed.
pub(super) const MALFORMED: &str = "malformed";

/// The sub-document holding the bookkeeping of every set: `_seq_sets.<field>` for the set
/// stored in `<field>`. Field names contain no `.`, so distinct sets get distinct,
/// non-overlapping paths (the old flat `_seq_<field>` / `_seq_<field>_floor` names
/// collided: set `x`'s floor was set `x_floor`'s state).
pub const SETS_FIELD: &str = "_seq_sets";

impl SequencedSet {
    /// A handle on `collection`, without touching the server: it only validates the
    /// options. Use [`SequencedSet::open`] to also run the preflight checks and create the
    /// indexes, or call [`SequencedSet::ensure_indexes`] once.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a key field or set field that is not a plain name (see
    /// [`encode::field`]; the key field may be `_id`).
    pub fn new(collection: Collection<Document>, options: SetOptions) -> Result<Self> {
        if options.key_field != "_id" {
            encode::field("key field", &options.key_field)?;
        }
        encode::field("set field", &options.field)?;
        if options.field == options.key_field {
            return Err(Error::invalid(
                "set field",
                "must differ from the key field",
            ));
        }
        Ok(Self {
            state_field: format!("{SETS_FIELD}.{}.state", options.field),
            floor_field: format!("{SETS_FIELD}.{}.floor", options.field),
            collection: super::with_write_concern(collection, options.write_concern.as_ref()),
            key_field: options.key_field,
            field: options.field,
            canonical_order: options.canonical_order,
            operator_form: options.operator_form,
            hints: Hints::default(),
            no_bulk: std::sync::Arc::default(),
            losing_read: LosingRead::default(),
            index_members: options.index_members,
        })
    }

    /// A handle on collection `name` of `db` ([`SequencedSet::new`]), after the preflight
    /// checks ([`crate::preflight::check`]), with its indexes created
    /// ([`SequencedSet::ensure_indexes`]).
    ///
    /// # Errors
    /// As [`SequencedSet::new`]; [`Error::Incompatible`] for a server older than MongoDB
    /// 6.0 or a collection with a non-simple default collation (see
    /// [`crate::preflight`]); [`Error::Database`] if the indexes cannot be created.
    pub async fn open(db: &Database, name: &str, options: SetOptions) -> Result<Self> {
        crate::validate::collection_name("set collection", name)?;
        let this = Self::new(db.collection(name), options)?;
        crate::preflight::check(&this.collection).await?;
        this.ensure_indexes().await?;
        Ok(this)
    }

    /// Creates the indexes (idempotent): a unique index on the key field unless it is
    /// `_id`, and the members index if [`SetOptions::index_members`] asked for it.
    ///
    /// # Errors
    /// [`Error::Database`] if the indexes cannot be created.
    pub async fn ensure_indexes(&self) -> Result<()> {
        super::ensure_key_index(&self.collection, &self.key_field).await?;
        if self.index_members {
            self.collection
                .create_index(
                    IndexModel::builder()
                        .keys(doc! { self.field.as_str(): 1 })
                        .build(),
                )
                .await?;
        }
        Ok(())
    }

    /// The collection this handle writes to.
    pub fn collection(&self) -> &Collection<Document> {
        &self.collection
    }

    /// The field holding the present members.
    pub fn field(&self) -> &str {
        &self.field
    }

    /// The path of the sub-document holding the per-member state entries
    /// (`_seq_sets.<field>.state`).
    pub fn state_field(&self) -> &str {
        &self.state_field
    }

    /// The path of the compaction watermark (`_seq_sets.<field>.floor`).
    pub fn floor_field(&self) -> &str {
        &self.floor_field
    }

    /// Adds `member` to the set of `key` as of `seq`. One round trip.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad key, member or negative `seq`;
    /// [`Error::Malformed`] if the stored document is not in the expected shape;
    /// [`Error::Database`] otherwise (a duplicate-key error from a consumer
    /// racing to create the document is absorbed, not returned).
    pub async fn add(&self, key: impl Into<Bson>, member: &str, seq: i64) -> Result<ApplyOutcome> {
        self.apply(key.into(), member, seq, true).await
    }

    /// Removes `member` from the set of `key` as of `seq` (leaving a tombstone). One round
    /// trip.
    ///
    /// # Errors
    /// As [`SequencedSet::add`].
    pub async fn remove(
        &self,
        key: impl Into<Bson>,
        member: &str,
        seq: i64,
    ) -> Result<ApplyOutcome> {
        self.apply(key.into(), member, seq, false).await
    }

    pub(super) async fn apply(
        &self,
        key: Bson,
        member: &str,
        seq: i64,
        present: bool,
    ) -> Result<ApplyOutcome> {
        let key = encode::key(key)?;
        encode::member(member)?;
        validate_seq(seq)?;
        match self.apply_valid(&key, member, seq, present).await {
            Err(Error::Database { source }) => Err(self.malformed_or(&key, source).await),
            other => other,
        }
    }

    /// [`SequencedSet::apply`] after its input was checked.
    async fn apply_valid(
        &self,
        key: &Bson,
        member: &str,
        seq: i64,
        present: bool,
    ) -> Result<ApplyOutcome> {
        let key = key.clone();
        let entry = self.entry_path(member);
        // The control without canonical order keeps to the pipeline (the operator form's
        // sorted `$push` would re-sort the array).
        let hinted = self.canonical_order && self.operator_form;
        let hint_key = (key.to_string(), member.to_owned());
        if hinted && let Some(state) = self.hint(&hint_key) {
            if resolve(Some(state), seq, present) == ApplyOutcome::Applied {
                let (filter, update) = self.operator_update(&key, member, seq, present, state.1);
                if self
                    .collection
                    .update_one(filter, update)
                    .await?
                    .matched_count
                    == 1
                {
                    self.remember(hint_key, (seq, present));
                    tracing::debug!(%key, member, seq, present, "sequenced set operation applied by operators");
                    return Ok(ApplyOutcome::Applied);
                }
            } else if let Some(outcome) = self
                .decided_by_read(&key, &entry, seq, present, &hint_key)
                .await?
            {
                tracing::debug!(%key, member, seq, present, ?outcome, "sequenced set operation decided by a read");
                return Ok(outcome);
            }
        }
        let seq_path = format!("{entry}.seq");
        let present_path = format!("{entry}.present");
        // The entry as the pipeline's post-image (or the diagnosing read) showed it.
        let seen = std::sync::Mutex::new(None);
        let conditions = vec![doc! { "$or": [
            { seq_path.as_str(): { "$ne": seq } },
            { present_path.as_str(): { "$ne": present } },
        ] }];
        let paths = self.bookkeeping_paths(member);
        let shape = types_of(&paths);
        let outcome = super::apply(
            &self.collection,
            doc! { self.key_field.as_str(): key.clone() },
            conditions,
            || self.pipeline(member, seq, present),
            doc! { entry.as_str(): 1, self.floor_field.as_str(): 1, SHAPE_FIELD: shape },
            |d| {
                check_shape(d, &paths, &key)?;
                if hinted && let Ok(mut seen) = seen.lock() {
                    *seen = entry_state(d, &entry);
                }
                super::check_stored_number(d, &self.floor_field, &key)?;
                holds(d, &entry, seq, present, &key)
            },
            || self.bookkeeping_error(&key),
        )
        .await?;
        if let Some(state) = seen.into_inner().ok().flatten() {
            self.remember(hint_key, state);
        }
        tracing::debug!(%key, member, seq, present, ?outcome, "sequenced set operation");
        Ok(outcome)
    }

    /// The outcome of an operation this handle's hint says loses (stale or a duplicate),
    /// decided by one read of the stored entry and floor with read concern `majority`:
    /// when the stored state already equals the operation ([`ApplyOutcome::Duplicate`])
    /// or beats it, or the floor is above it ([`ApplyOutcome::Stale`]), that is the
    /// outcome and nothing is written — the operation is a no-op at the time of the read,
    /// against a state a majority holds, so no rollback can take it back. `None` when the
    /// read does not decide it (the operation would apply there — the bookkeeping was
    /// reset, or the majority has not caught up —, the document or the entry is missing or
    /// not in shape): the pipeline update decides then, as for any operation. The state
    /// read becomes the hint.
    async fn decided_by_read(
        &self,
        key: &Bson,
        entry: &str,
        seq: i64,
        present: bool,
        hint_key: &(String, String),
    ) -> Result<Option<ApplyOutcome>> {
        let Some(stored) = self
            .losing_read
            .read(
                &self.collection,
                doc! { self.key_field.as_str(): key.clone() },
                doc! { entry: 1, self.floor_field.as_str(): 1 },
            )
            .await
        else {
            return Ok(None);
        };
        let Some(state) = entry_state(&stored, entry) else {
            return Ok(None);
        };
        let floor = match super::get_path(&stored, &self.floor_field) {
            None => 0,
            Some(value) => match super::stored_seq(value) {
                Some(floor) => floor,
                None => return Ok(None),
            },
        };
        self.remember(hint_key.clone(), state);
        let outcome = if state == (seq, present) {
            ApplyOutcome::Duplicate
        } else if seq < floor {
            ApplyOutcome::Stale
        } else {
            resolve(Some(state), seq, present)
        };
        Ok((outcome != ApplyOutcome::Applied).then_some(outcome))
    }

    /// The error to report for `source`, a database error of an apply on `key`:
    /// [`Error::Malformed`] naming the field when the server refused the write (an error
    /// with a code, not a network error) and the document's members array or bookkeeping
    /// is not of the shape docwarden writes — a hand edit the pipeline and the operators
    /// cannot work on (`$pull`/`$in` on a non-array, `$objectToArray` of a non-document);
    /// `source` itself otherwise (also when the read fails). Costs a read only on such an
    /// error.
    async fn malformed_or(&self, key: &Bson, source: mongodb::error::Error) -> Error {
        if crate::error::error_code(&source).is_none() {
            return source.into();
        }
        match self.broken_field(key, true).await {
            Some((path, shape)) => Error::Malformed {
                id: key.to_string(),
                reason: format!(
                    "`{path}` is not {shape} (the server refused the update: {source})"
                ),
            },
            None => source.into(),
        }
    }

    /// The paths of the set's bookkeeping an apply of `member` reads and writes:
    /// `_seq_sets`, `_seq_sets.<field>`, its `state` and the member's entry. Each must be
    /// missing or a document; the pipeline ([`SequencedSet::pipeline`]) writes nothing
    /// otherwise, and the reply answers [`Error::Malformed`] naming the first that is not.
    fn bookkeeping_paths(&self, member: &str) -> [String; 4] {
        let [sets, set, state] = self.set_paths();
        [sets, set, state, self.entry_path(member)]
    }

    /// `_seq_sets`, `_seq_sets.<field>` and its `state`: the paths every write of this set
    /// reads as documents (an apply also reads the member's entry).
    pub(super) fn set_paths(&self) -> [String; 3] {
        [
            SETS_FIELD.to_owned(),
            format!("{SETS_FIELD}.{}", self.field),
            self.state_field.clone(),
        ]
    }

    /// `_seq_sets` with this set's part merged with `part` (fields of `_seq_sets.<field>`,
    /// such as `state`), as a pipeline expression over bookkeeping in shape: written as a
    /// whole, never through a dotted path, whose `$set` would replace a scalar parent on its
    /// way. `$mergeObjects` keeps the position of every existing field, as a dotted `$set`
    /// does, and appends new ones in `part`'s order.
    pub(super) fn sets_with(&self, part: Document) -> Document {
        doc! { "$mergeObjects": [format!("${SETS_FIELD}"), {
            self.field.as_str(): { "$mergeObjects": [
                format!("${SETS_FIELD}.{}", self.field),
                part,
            ] },
        }] }
    }

    /// [`Error::Malformed`] naming the first part of the set's bookkeeping in `key`'s
    /// document that is not a document (see [`SequencedSet::broken_field`]): why an apply's
    /// update matched nothing although the document is there and does not hold the
    /// operation (a race with a hand edit; the reply's shape check answers the usual case).
    async fn bookkeeping_error(&self, key: &Bson) -> Option<Error> {
        let (path, shape) = self.broken_field(key, false).await?;
        Some(bookkeeping_malformed(key, &path, shape))
    }

    /// The first field of `key`'s document that is not in the shape docwarden writes, with
    /// the shape it should have: with `members`, the members field when it is there and not
    /// an array; then `_seq_sets`, `_seq_sets.<field>` and its `state` when there and not
    /// documents (null included). One aggregation of the fields' `$type`s (a few bytes,
    /// whatever the size of the set); `None` when the document is in shape or gone, or the
    /// read fails.
    pub(super) async fn broken_field(
        &self,
        key: &Bson,
        members: bool,
    ) -> Option<(String, &'static str)> {
        let set = format!("{SETS_FIELD}.{}", self.field);
        let mut paths = Vec::with_capacity(4);
        if members {
            paths.push((self.field.clone(), "array", "an array"));
        }
        for path in [SETS_FIELD, set.as_str(), self.state_field.as_str()] {
            paths.push((path.to_owned(), "object", "a document"));
        }
        let types: Document = paths
            .iter()
            .enumerate()
            .map(|(i, (path, _, _))| {
                (
                    format!("t{i}"),
                    Bson::from(doc! { "$type": format!("${path}") }),
                )
            })
            .collect();
        let mut project = doc! { "_id": 0 };
        project.extend(types);
        let mut cursor = self
            .collection
            .aggregate(vec![
                doc! { "$match": { self.key_field.as_str(): key.clone() } },
                doc! { "$project": project },
            ])
            .await
            .ok()?;
        let found = cursor.try_next().await.ok()??;
        paths
            .into_iter()
            .enumerate()
            .find(|(i, (_, wanted, _))| {
                !matches!(found.get_str(format!("t{i}")), Ok(t) if t == *wanted || t == "missing")
            })
            .map(|(_, (path, _, shape))| (path, shape))
    }

    /// The last state of `(key, member)`'s entry this handle saw, if any.
    pub(super) fn hint(&self, at: &(String, String)) -> Option<(i64, bool)> {
        self.hints.get(at)
    }

    /// Records the state of `(key, member)`'s entry as seen in a reply (a hint only: it
    /// picks the form to try first, the server decides; see [`super::hints`]).
    pub(super) fn remember(&self, at: (String, String), state: (i64, bool)) {
        self.hints.remember(at, state);
    }

    /// The filter and the operator update of the operator form (public as
    /// [`SequencedSet::operator_update_for`] for ports): the key first, then the members
    /// field holding an array (`$type: "array"`), then "the operation wins" (see
    /// [`resolve`]) in plain operators — `floor` missing or `<= seq`, and `seq₀ < seq` (a
    /// remove: or `seq₀ == seq` on a present entry; an add: on an entry whose `present` is
    /// `on_present_entry`) —, so `n: 1` means this write applied the operation. A members
    /// field that is not an array (a hand edit) matches nothing and the apply goes on with
    /// the pipeline, which decides for every form alike: a null or missing field counts as
    /// empty, any other value is [`Error::Malformed`]. (Without the condition an add on a
    /// present entry, which leaves the array alone, applied over a string, and `$push` and
    /// `$pull` refused a null the pipeline takes for empty: the answer depended on the
    /// handle's hints.) The update replaces the entry in place (`$set` keeps an existing field's
    /// position) and changes the members array: an add on a tombstone `$push`es the member
    /// with `$sort: 1` (the binary order of the strings, as the pipeline keeps it), an add
    /// on a present entry leaves the array (the member is in it), a remove `$pull`s it. The
    /// document is the one the pipeline would leave, byte for byte. For an add, `on_present_entry`
    /// picks the form for a member whose entry is present (only the entry changes) instead
    /// of a tombstone (the member is `$push`ed into the sorted array).
    pub(super) fn operator_update(
        &self,
        key: &Bson,
        member: &str,
        seq: i64,
        present: bool,
        on_present_entry: bool,
    ) -> (Document, Document) {
        let entry = self.entry_path(member);
        let seq_path = format!("{entry}.seq");
        let present_path = format!("{entry}.present");
        let wins = if present {
            doc! { "$and": [
                { seq_path.as_str(): { "$lt": seq } },
                { present_path.as_str(): on_present_entry },
            ] }
        } else {
            doc! { "$or": [
                { seq_path.as_str(): { "$lt": seq } },
                { seq_path.as_str(): seq, present_path.as_str(): true },
            ] }
        };
        let filter = doc! { "$and": [
            { self.key_field.as_str(): key.clone() },
            { self.field.as_str(): { "$type": "array" } },
            { self.floor_field.as_str(): { "$not": { "$gt": seq } } },
            wins,
        ] };
        let mut update = doc! {
            "$set": { entry.as_str(): { "seq": seq, "present": present } },
            // Written by earlier versions; removed by any write, as the pipeline does.
            "$unset": { OUTCOME_FIELD: "" },
        };
        if present && !on_present_entry {
            update.insert(
                "$push",
                doc! { self.field.as_str(): { "$each": [member], "$sort": 1 } },
            );
        } else if !present {
            update.insert("$pull", doc! { self.field.as_str(): member });
        }
        (filter, update)
    }

    /// The filter and update of the operator form an apply tries first (see
    /// `docs/sequence.md`, "The operator form"), for inspection and other-language ports;
    /// for an add, `on_present_entry` picks the variant for a present entry (only the
    /// entry changes) instead of a tombstone (the member is `$push`ed in order).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad key, member or negative `seq`.
    pub fn operator_update_for(
        &self,
        key: impl Into<Bson>,
        member: &str,
        seq: i64,
        present: bool,
        on_present_entry: bool,
    ) -> Result<(Document, Document)> {
        let key = encode::key(key.into())?;
        encode::member(member)?;
        validate_seq(seq)?;
        Ok(self.operator_update(&key, member, seq, present, on_present_entry))
    }

    /// The path of `member`'s state entry.
    fn entry_path(&self, member: &str) -> String {
        format!("{}.{}", self.state_field, encode::member_key(member))
    }

    /// The update pipeline for one operation (public for inspection and other-language
    /// ports; [`SequencedSet::add`] and [`SequencedSet::remove`] run it). **One** `$set`
    /// stage (issue 14; two stages before), whose fields both bind the decision
    /// (`$$dw_d`: `applied`, `created` — applied, and the member had no state entry —,
    /// `duplicate` or `stale`, computed from the document as it was):
    ///
    /// - the state sub-document: when `created`, the new entry inserted in key order
    ///   (`$objectToArray`, the entries below, the new one, the entries above,
    ///   `$arrayToObject`), so the entries' order does not depend on which member came
    ///   first; when `applied`, the entry replaced in place (`$mergeObjects`); otherwise
    ///   unchanged;
    /// - the members array, kept sorted: when applied, an add of a new member inserts it in
    ///   order the same way, a remove filters;
    /// - the temporary [`OUTCOME_FIELD`] of earlier versions is removed (`$$REMOVE`).
    ///
    /// The update's filter is the key plus "not in effect yet"
    /// (`$or: [{<entry>.seq: {$ne: seq}}, {<entry>.present: {$ne: present}}]`), which is how
    /// the caller's outcome is read back from the post-image (see `docs/sequence.md`).
    ///
    /// The bookkeeping must be in shape: `_seq_sets`, `_seq_sets.<field>`, its `state` and
    /// the entry each missing or a document. The decision checks it first (`$type` of each
    /// path in `["object", "missing"]`); out of shape it is `malformed`, and every field is
    /// written back as stored (the state goes into `_seq_sets` as a whole through
    /// `$mergeObjects`, never through a dotted path, which would replace a scalar on its
    /// way). The apply projects the same four `$type`s into its post-image and answers
    /// [`Error::Malformed`] naming the first path out of shape. (Session 21 checked this in
    /// the filter with four `{<path>: {$not: {$type: [every other type]}}}` clauses; on the
    /// embedded server those cost +70 % instructions per apply, the check here +5–9 %:
    /// `docs/benchmarks.md`.)
    pub fn pipeline(&self, member: &str, seq: i64, present: bool) -> Vec<Document> {
        let m = encode::literal(member);
        let entry = self.entry_path(member);
        let cur = format!("${entry}");
        let cur_seq = doc! { "$ifNull": [format!("{cur}.seq"), -1_i64] };
        let cur_present = doc! { "$eq": [format!("{cur}.present"), true] };
        let same_seq = doc! { "$eq": [seq, cur_seq.clone()] };
        let members = format!("${}", self.field);
        let members_or_empty = doc! { "$ifNull": [members.as_str(), []] };
        let mut branches = vec![
            doc! {
                "case": { "$lt": [seq, { "$ifNull": [format!("${}", self.floor_field), 0_i64] }] },
                "then": ApplyOutcome::Stale.as_str(),
            },
            doc! {
                "case": { "$gt": [seq, cur_seq] },
                "then": { "$cond": [
                    { "$eq": [{ "$type": cur.as_str() }, "missing"] },
                    CREATED,
                    ApplyOutcome::Applied.as_str(),
                ] },
            },
        ];
        // Equal sequence numbers: remove wins, so an add ties only with itself (present),
        // and a remove beats a present state and ties with a tombstone.
        if present {
            branches.push(doc! {
                "case": { "$and": [same_seq, cur_present] },
                "then": ApplyOutcome::Duplicate.as_str(),
            });
        } else {
            branches.push(doc! {
                "case": same_seq,
                "then": { "$cond": [cur_present, ApplyOutcome::Applied.as_str(), ApplyOutcome::Duplicate.as_str()] },
            });
        }
        // The decision is bound once per field (`$$dw_d`); both fields read the document
        // as it was before the update, in one stage.
        let decided = "$$dw_d";
        let applied = doc! { "$in": [decided, [ApplyOutcome::Applied.as_str(), CREATED]] };
        let new_members = if present {
            let appended = doc! { "$concatArrays": [members_or_empty.clone(), [m.clone()]] };
            let inserted = if self.canonical_order {
                // Insert in order (the array is sorted): the members below, the new one,
                // the members above. Two linear passes, no sort.
                doc! { "$concatArrays": [
                    { "$filter": { "input": members_or_empty.clone(), "as": "x", "cond": { "$lt": ["$$x", m.clone()] } } },
                    [m.clone()],
                    { "$filter": { "input": members_or_empty.clone(), "as": "x", "cond": { "$gt": ["$$x", m.clone()] } } },
                ] }
            } else {
                appended
            };
            doc! { "$cond": [
                { "$in": [m, members_or_empty.clone()] },
                members_or_empty.clone(),
                inserted,
            ] }
        } else {
            doc! { "$filter": {
                "input": members_or_empty.clone(),
                "as": "x",
                "cond": { "$ne": ["$$x", m] },
            } }
        };
        // Bookkeeping out of shape (a hand edit) decides `malformed`: every field is
        // written back as stored, and the reply's shape check names the field.
        let in_shape = in_shape(&self.bookkeeping_paths(member));
        let decision = doc! { "$cond": [
            in_shape.clone(),
            { "$switch": { "branches": branches, "default": ApplyOutcome::Stale.as_str() } },
            MALFORMED,
        ] };
        let state = format!("${}", self.state_field);
        let state_or_empty = doc! { "$ifNull": [state.as_str(), {}] };
        let new_entry = doc! { "$literal": { "seq": seq, "present": present } };
        let member_key = encode::member_key(member);
        // An applied operation on a member with an entry replaces the entry where it is
        // (`$mergeObjects` keeps the position of an existing field).
        let replaced = doc! { "$mergeObjects": [state_or_empty.clone(), { member_key.as_str(): new_entry.clone() }] };
        let created = if self.canonical_order {
            // A new entry is inserted in key order: the entries below, the new one, the
            // entries above. Each `$filter` reads `$objectToArray` of the state itself
            // rather than one `$let` variable holding it: the embedded server copies the
            // variables in scope for every element a `$filter` visits, which made a
            // variable holding the entries cost O(entries²) (1 s per first-seen member at
            // 2,000 entries, 6 ms inline; `docs/surrogate.md`). Linear on both servers.
            let key = encode::literal(member_key.as_str());
            let entries = doc! { "$objectToArray": state_or_empty };
            doc! { "$arrayToObject": { "$concatArrays": [
                { "$filter": { "input": entries.clone(), "as": "e", "cond": { "$lt": ["$$e.k", key.clone()] } } },
                [{ "k": key.clone(), "v": new_entry }],
                { "$filter": { "input": entries, "as": "e", "cond": { "$gt": ["$$e.k", key] } } },
            ] } }
        } else {
            // Control: appended after the existing entries.
            replaced.clone()
        };
        // The new state goes into `_seq_sets` as a whole (see `sets_with`).
        let sets = format!("${SETS_FIELD}");
        let with_state = |new_state: Document| self.sets_with(doc! { "state": new_state });
        let members_stored = format!("${}", self.field);
        vec![doc! { "$set": {
            SETS_FIELD: { "$let": {
                "vars": { "dw_d": decision.clone() },
                "in": { "$switch": {
                    "branches": [
                        { "case": { "$eq": [decided, CREATED] }, "then": with_state(created) },
                        { "case": { "$eq": [decided, ApplyOutcome::Applied.as_str()] }, "then": with_state(replaced) },
                    ],
                    "default": sets.as_str(),
                } },
            } },
            self.field.as_str(): { "$let": {
                "vars": { "dw_d": decision.clone() },
                "in": { "$switch": {
                    "branches": [
                        { "case": applied, "then": new_members },
                        { "case": { "$eq": [decided, MALFORMED] }, "then": members_stored.as_str() },
                    ],
                    "default": members_or_empty,
                } },
            } },
            // Written by earlier versions; removed by any write over bookkeeping in shape.
            OUTCOME_FIELD: { "$cond": [in_shape, "$$REMOVE", format!("${OUTCOME_FIELD}")] },
        } }]
    }

    /// The present members of `key`'s set (in no particular order), or `None` when there
    /// is no document for `key`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad key; [`Error::Malformed`] if the field is not an
    /// array of strings; [`Error::Database`] otherwise.
    pub async fn members(&self, key: impl Into<Bson>) -> Result<Option<Vec<String>>> {
        let key = encode::key(key.into())?;
        let Some(doc) = self
            .collection
            .find_one(doc! { self.key_field.as_str(): key.clone() })
            .projection(doc! { self.field.as_str(): 1 })
            .await?
        else {
            return Ok(None);
        };
        let malformed = |reason: String| Error::Malformed {
            id: key.to_string(),
            reason,
        };
        let Some(values) = doc.get(&self.field) else {
            return Ok(Some(Vec::new()));
        };
        let Bson::Array(values) = values else {
            return Err(malformed(format!("`{}` is not an array", self.field)));
        };
        values
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| malformed(format!("`{}` holds a non-string", self.field)))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// The stored state entries of `key` (present members and tombstones), or `None` when
    /// there is no document for `key`.
    ///
    /// # Errors
    /// As [`SequencedSet::members`].
    pub async fn states(&self, key: impl Into<Bson>) -> Result<Option<Vec<MemberState>>> {
        let key = encode::key(key.into())?;
        let Some(doc) = self
            .collection
            .find_one(doc! { self.key_field.as_str(): key.clone() })
            .projection(doc! { self.state_field.as_str(): 1 })
            .await?
        else {
            return Ok(None);
        };
        let malformed = |reason: &str| Error::Malformed {
            id: key.to_string(),
            reason: format!("`{}`: {reason}", self.state_field),
        };
        let entries = match super::get_path(&doc, &self.state_field) {
            None => return Ok(Some(Vec::new())),
            Some(Bson::Document(d)) => d,
            Some(_) => return Err(malformed("not a document")),
        };
        entries
            .iter()
            .map(|(k, e)| {
                let e = e
                    .as_document()
                    .ok_or_else(|| malformed("entry is not a document"))?;
                Ok(MemberState {
                    member: encode::decode_member_key(k)
                        .ok_or_else(|| malformed("a key is not an encoded member"))?,
                    seq: e
                        .get("seq")
                        .and_then(super::stored_seq)
                        .ok_or_else(|| malformed("entry without a sequence number"))?,
                    present: e
                        .get_bool("present")
                        .map_err(|_| malformed("entry without present"))?,
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

/// The `$type` of each of `paths` (pipeline expressions), in order: what [`in_shape`]
/// tests and what an apply projects into [`SHAPE_FIELD`].
pub(super) fn types_of(paths: &[String]) -> Vec<Bson> {
    paths
        .iter()
        .map(|path| Bson::from(doc! { "$type": format!("${path}") }))
        .collect()
}

/// True (a pipeline expression) when each of `paths` is missing or a document.
pub(super) fn in_shape(paths: &[String]) -> Document {
    doc! { "$and": types_of(paths)
    .into_iter()
    .map(|t| Bson::from(doc! { "$in": [t, ["object", "missing"]] }))
    .collect::<Vec<_>>() }
}

/// The error for `key`'s document whose bookkeeping `path` is not `shape`.
pub(super) fn bookkeeping_malformed(key: &Bson, path: &str, shape: &str) -> Error {
    Error::Malformed {
        id: key.to_string(),
        reason: format!(
            "`{path}` is not {shape}: nothing written (an apply writes only over bookkeeping in the shape docwarden writes)"
        ),
    }
}

/// [`Error::Malformed`] naming the first of `paths` whose `$type` in the reply's
/// [`SHAPE_FIELD`] is neither `object` nor `missing`: the pipeline left such a document as
/// it was. Nothing to check when the reply carries no types.
pub(super) fn check_shape(doc: &Document, paths: &[String], key: &Bson) -> Result<()> {
    let Ok(types) = doc.get_array(SHAPE_FIELD) else {
        return Ok(());
    };
    match paths
        .iter()
        .zip(types)
        .find(|(_, t)| !matches!(t.as_str(), Some("object" | "missing")))
    {
        Some((path, _)) => Err(bookkeeping_malformed(key, path, "a document")),
        None => Ok(()),
    }
}

/// Whether `doc` holds the operation `(seq, present)` in the state entry at `entry`.
fn holds(doc: &Document, entry: &str, seq: i64, present: bool, key: &Bson) -> Result<bool> {
    let Some(e) = super::get_path(doc, entry) else {
        return Ok(false);
    };
    let e = e.as_document().ok_or_else(|| Error::Malformed {
        id: key.to_string(),
        reason: format!("`{entry}` is not a document"),
    })?;
    super::check_stored_seq(e, "seq", key)?;
    Ok(e.get("seq").and_then(super::stored_seq) == Some(seq)
        && e.get("present") == Some(&Bson::Boolean(present)))
}

/// The state `(seq, present)` of the entry at `entry` in `doc`, if it is well formed.
fn entry_state(doc: &Document, entry: &str) -> Option<(i64, bool)> {
    let e = super::get_path(doc, entry)?.as_document()?;
    Some((
        e.get("seq").and_then(super::stored_seq)?,
        e.get("present")?.as_bool()?,
    ))
}

/// The model the pipeline implements: `(seq, present)` replaces `current` when it is
/// greater under `(seq, remove > add)`. Used by tests and the demo as the reference.
pub fn resolve(current: Option<(i64, bool)>, seq: i64, present: bool) -> ApplyOutcome {
    match current {
        None => ApplyOutcome::Applied,
        Some((s, _)) if seq > s => ApplyOutcome::Applied,
        Some((s, p)) if seq == s => match (p, present) {
            (true, true) | (false, false) => ApplyOutcome::Duplicate,
            (true, false) => ApplyOutcome::Applied,
            (false, true) => ApplyOutcome::Stale,
        },
        Some(_) => ApplyOutcome::Stale,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn model(ops: &[(i64, bool)]) -> Option<(i64, bool)> {
        let mut sorted = ops.to_vec();
        // Sequential order; at equal seq the add is applied first, then the remove.
        sorted.sort_by_key(|&(s, p)| (s, !p));
        sorted.last().copied()
    }

    proptest! {
        #[test]
        fn resolve_converges_for_any_order(ops in prop::collection::vec((0_i64..6, any::<bool>()), 1..12),
                                           perm in any::<prop::sample::Index>()) {
            let mut shuffled = ops.clone();
            let n = shuffled.len();
            shuffled.rotate_left(perm.index(n));
            shuffled.reverse();
            let mut state: BTreeMap<(), (i64, bool)> = BTreeMap::new();
            for (s, p) in shuffled {
                if resolve(state.get(&()).copied(), s, p) == ApplyOutcome::Applied {
                    state.insert((), (s, p));
                }
            }
            prop_assert_eq!(state.get(&()).copied(), model(&ops));
        }
    }

    #[test]
    fn remove_wins_ties() {
        assert_eq!(resolve(Some((3, true)), 3, false), ApplyOutcome::Applied);
        assert_eq!(resolve(Some((3, false)), 3, true), ApplyOutcome::Stale);
        assert_eq!(resolve(Some((3, false)), 3, false), ApplyOutcome::Duplicate);
        assert_eq!(resolve(Some((3, true)), 3, true), ApplyOutcome::Duplicate);
        assert_eq!(resolve(Some((3, true)), 2, false), ApplyOutcome::Stale);
        assert_eq!(resolve(None, 0, false), ApplyOutcome::Applied);
    }
}
