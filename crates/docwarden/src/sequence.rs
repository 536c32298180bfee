//! Sequenced updates: operations stamped with a sequence number converge to the same
//! document whatever order they arrive in and however often each one is delivered.
//!
//! Guarantee: every operation is **one** atomic pipeline update (`findOneAndUpdate`) on
//! the single document that holds the key, and it compares its sequence number with the
//! state stored next to the data. (A set sends an operation it expects to apply to a
//! member that already has a state entry as plain query and update operators instead —
//! [`set::SetOptions::operator_form`], on by default: still one atomic write deciding the
//! same rule, the same stored document, see `docs/sequence.md`; registers do the same for a
//! write that wins by its number, [`register::FieldsOptions::operator_form`].) The final document equals the one you get by applying
//! the operations one by one in sequence order, for any permutation and any number of
//! duplicates. A unique index on the key means racing consumers can never create a second
//! document for it (the first message for a key creates the document empty, idempotently,
//! then updates it; see `apply` below for why that is not an upsert). The outcome
//! ([`ApplyOutcome::Applied`], [`ApplyOutcome::Stale`], [`ApplyOutcome::Duplicate`]) comes back in the
//! same round trip (a re-delivered operation costs a second one), read from the document
//! the write left, so nothing per-call is stored.
//!
//! Equal sequence numbers are resolved by a total order (a remove beats an add of the same
//! member; register values by MongoDB's comparison order, then by their BSON encoding, type
//! included), arrays and bookkeeping
//! sub-documents are kept in sorted order, and each set's bookkeeping lives under its own
//! name in `_seq_sets`: the stored document is identical, byte for byte, for every delivery
//! order and duplication (see [`set`] and [`register`] for the exact rules and limits).
//!
//! Limits: sequence numbers must be totally ordered *per key and member/field* by the
//! producer (a non-negative `i64`, see [`set`] for the rule at equal numbers); the state
//! lives in the document, so a set costs one small entry per member ever seen until
//! [`set::SequencedSet::compact`] removes tombstones below a watermark; an applied set
//! update rewrites the plain members array (O(members) work, fine for hundreds or a few
//! thousand members per document, not for hundreds of thousands).
//!
//! - [`set::SequencedSet`]: a last-writer-wins element set (`add` / `remove`; a batch of
//!   them in one round trip with [`set::SequencedSet::apply_many`], see [`batch`]).
//! - [`register::SequencedFields`]: last-writer-wins registers (`set` a field).
//! - [`compact`]: tombstone compaction below a watermark.
//! - Names: members may be any non-empty string (stored as given in the members array,
//!   reversibly encoded as state keys); field names become document keys and are refused
//!   unless they are plain (see [`encode`]).
//!
//! The stored format is documented in `docs/sequence.md` so workers in other languages can
//! join.
//!
//! ```no_run
//! # async fn example(db: mongodb::Database) -> docwarden::Result<()> {
//! use docwarden::sequence::{ApplyOutcome, SequencedSet, SetOptions};
//!
//! let classes = SequencedSet::open(
//!     &db,
//!     "students",
//!     SetOptions::default().key_field("student_id").field("classes"),
//! )
//! .await?;
//! // Messages 1 (enroll), 3 (enroll) and 2 (unenroll) arrive as 1, 3, 2:
//! assert_eq!(classes.add(7, "CS 101", 1).await?, ApplyOutcome::Applied);
//! assert_eq!(classes.add(7, "CS 101", 3).await?, ApplyOutcome::Applied);
//! assert_eq!(classes.remove(7, "CS 101", 2).await?, ApplyOutcome::Stale);
//! assert_eq!(classes.members(7).await?, Some(vec!["CS 101".to_owned()]));
//! # Ok(()) }
//! ```

pub mod batch;
pub mod compact;
pub mod encode;
mod hints;
pub mod register;
pub mod set;

pub use batch::SetOp;
pub use compact::CompactionReport;
pub use register::{FieldsOptions, MAX_VALUE_BYTES, SequencedFields};
pub use set::{MemberState, SequencedSet, SetOptions};

use mongodb::bson::{Bson, Document};

use crate::error::{Error, Result};

/// A temporary field the update pipelines use to carry the decision from their first stage
/// to the later ones; the last stage removes it, so it is never stored. (Earlier versions
/// stored the outcome of the last write here, which made the document depend on the
/// delivery order; a write to such a document removes it.)
pub const OUTCOME_FIELD: &str = "_seq_last";

/// The field of a reply's projection (never stored) holding the `$type`s of a document's
/// bookkeeping paths, by which a reply tells a document whose bookkeeping was hand-edited
/// out of shape (a set's apply, a register's losing read).
pub(crate) const SHAPE_FIELD: &str = "_dw_shape";

/// The marker of an applied write that also creates a new state key (a member seen for the
/// first time, a register field written for the first time): the pipeline then restores
/// the canonical (sorted) key order.
pub(crate) const CREATED: &str = "created";

/// How many times an operation tries to create a missing document before giving up.
const CREATE_ATTEMPTS: u32 = 8;

/// What a sequenced operation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ApplyOutcome {
    /// The operation won: the document now reflects it.
    Applied,
    /// A newer operation (higher sequence number, or the same number with an operation
    /// that wins the tie) had already been applied, or the sequence number is below the
    /// document's compaction watermark. Nothing changed.
    Stale,
    /// The very same operation (same sequence number, same effect) had already been
    /// applied. Nothing changed.
    Duplicate,
}

impl ApplyOutcome {
    /// The marker the pipeline's first stage writes to [`OUTCOME_FIELD`].
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ApplyOutcome::Applied => "applied",
            ApplyOutcome::Stale => "stale",
            ApplyOutcome::Duplicate => "duplicate",
        }
    }
}

/// The expression "the first stage decided to apply" for the later stages.
pub(crate) fn applied_expr() -> Document {
    mongodb::bson::doc! { "$in": [
        format!("${OUTCOME_FIELD}"),
        [ApplyOutcome::Applied.as_str(), CREATED],
    ] }
}

/// The value at the dotted `path` of `doc`, if every step is a sub-document.
pub(crate) fn get_path<'a>(doc: &'a Document, path: &str) -> Option<&'a Bson> {
    let mut parts = path.split('.');
    let first = parts.next()?;
    let mut cur = doc.get(first)?;
    for part in parts {
        cur = cur.as_document()?.get(part)?;
    }
    Some(cur)
}

/// A stored sequence number (or watermark) read back as the `i64` both servers take it to
/// equal: docwarden writes `int64`; an `int32`, a double holding an integer (JavaScript's
/// number type, a shell edit) or a decimal written as a plain integer by another client is
/// accepted. The servers compare numbers by value (`1001.0 == 1001`), so reading such a
/// value as "not a number" made a re-delivered message look like a document that changed
/// between two reads (until [`Error::Unavailable`]). `None` for anything else (a fraction,
/// a decimal in another form, a non-number).
pub(crate) fn stored_seq(value: &Bson) -> Option<i64> {
    match value {
        Bson::Int64(n) => Some(*n),
        Bson::Int32(n) => Some(i64::from(*n)),
        Bson::Double(f) => integral_double(*f),
        Bson::Decimal128(d) => d.to_string().parse().ok(),
        _ => None,
    }
}

/// `f` as an `i64` when it is an integer in the `i64` range (then exactly that integer).
#[allow(clippy::cast_possible_truncation)] // checked: integral and within [-2^63, 2^63)
fn integral_double(f: f64) -> Option<i64> {
    const TWO_63: f64 = 9_223_372_036_854_775_808.0;
    (f.fract() == 0.0 && (-TWO_63..TWO_63).contains(&f)).then_some(f as i64)
}

/// [`Error::Malformed`] if a stored sequence number (or watermark) at `path` is there but
/// not a number (a hand edit: a string, a document). The pipelines compare it in BSON
/// order, where a string is above every number, so every later operation would be
/// reported [`ApplyOutcome::Stale`] and dropped, for good.
pub(crate) fn check_stored_number(doc: &Document, path: &str, key: &Bson) -> Result<()> {
    match get_path(doc, path) {
        None | Some(Bson::Int32(_) | Bson::Int64(_) | Bson::Double(_) | Bson::Decimal128(_)) => {
            Ok(())
        }
        Some(other) => Err(Error::Malformed {
            id: key.to_string(),
            reason: format!(
                "`{path}` must be a sequence number, found {:?}",
                other.element_type()
            ),
        }),
    }
}

/// [`check_stored_number`] for a number the client compares for equality with an
/// operation's (a state entry's or a register's `seq`): a decimal that [`stored_seq`]
/// cannot read exactly (`1001.0`, `1.001E+3`) is refused too, since the server may take it
/// to equal the operation's number where the client cannot tell (the apply would go
/// round until [`Error::Unavailable`]).
pub(crate) fn check_stored_seq(doc: &Document, path: &str, key: &Bson) -> Result<()> {
    check_stored_number(doc, path, key)?;
    match get_path(doc, path) {
        Some(v @ Bson::Decimal128(d)) if stored_seq(v).is_none() => Err(Error::Malformed {
            id: key.to_string(),
            reason: format!(
                "`{path}` holds the decimal {d}, which is not a plain integer: store sequence numbers as int64"
            ),
        }),
        _ => Ok(()),
    }
}

/// The collection with `write_concern` set (its read concern and selection criteria
/// kept), or the collection as given when `write_concern` is `None`.
pub(crate) fn with_write_concern(
    collection: mongodb::Collection<Document>,
    write_concern: Option<&mongodb::options::WriteConcern>,
) -> mongodb::Collection<Document> {
    let Some(wc) = write_concern else {
        return collection;
    };
    let options = mongodb::options::CollectionOptions::builder()
        .write_concern(wc.clone())
        .read_concern(collection.read_concern().cloned())
        .selection_criteria(collection.selection_criteria().cloned())
        .build();
    let ns = collection.namespace();
    collection
        .client()
        .database(&ns.db)
        .collection_with_options(&ns.coll, options)
}

/// Checks a sequence number: a non-negative `i64`.
///
/// # Errors
/// [`Error::InvalidInput`] for a negative number.
pub fn validate_seq(seq: i64) -> Result<i64> {
    if seq < 0 {
        Err(Error::invalid(
            "sequence number",
            format!("{seq} is negative; sequence numbers are non-negative 64-bit integers"),
        ))
    } else {
        Ok(seq)
    }
}

/// Runs one `findOneAndUpdate` pipeline on the document `key_filter` selects, unless that
/// document already holds this very operation, and reads the caller's outcome back without
/// storing anything per call.
///
/// `conditions` are the clauses, after the key, of the filter `{$and: [{<key_field>: key},
/// …conditions]}`: the condition "the document does not hold this operation yet" (an
/// `$or`); `holds` tests it on a returned document (and may answer an error instead: a
/// set's pipeline leaves bookkeeping out of shape as it is, and `holds` reads that from the
/// types its projection carries). So when the write runs, the operation was not in effect before it (the server
/// checks the filter atomically with the write); the post-image (`ReturnDocument::After`,
/// projected to `projection`) then holds it exactly when this write applied it:
/// [`ApplyOutcome::Applied`], else [`ApplyOutcome::Stale`].
///
/// When nothing matched, a read of the document tells the rest: it holds the operation
/// ([`ApplyOutcome::Duplicate`], a second round trip, only for re-deliveries), it changed in
/// between (try again) unless `malformed` finds it out of shape (that error, nothing
/// written), or there is no document yet: it is created empty
/// (`insert_one` of `{<key_field>: key}`); the unique key index makes that idempotent, so a
/// duplicate-key error from a racing creator is absorbed and the update runs again.
///
/// Why not an upserting `findOneAndUpdate`: MongoDB would do the same in one round trip,
/// but the embedded secantusd-rs answers some *racing* upserts with `value: null` although
/// it applied the write, which would leave the outcome unknown. Creating the document
/// first costs extra round trips once per key and is correct on both servers; every later
/// first delivery of a message is exactly one round trip.
///
/// Why not the pre-image (`ReturnDocument::Before`), which would tell a duplicate in one
/// round trip: secantusd-rs returns a pre-image read *before* it takes the document for the
/// write, so a concurrent write in between makes it stale (MongoDB's is atomic). The
/// filter-and-post-image shape is atomic on both.
async fn apply<M>(
    collection: &mongodb::Collection<Document>,
    key_filter: Document,
    conditions: Vec<Document>,
    pipeline: impl Fn() -> Vec<Document>,
    projection: Document,
    holds: impl Fn(&Document) -> Result<bool>,
    malformed: impl Fn() -> M,
) -> Result<ApplyOutcome>
where
    M: std::future::Future<Output = Option<Error>>,
{
    // `$and` with the key first: the shape both servers route as a point lookup by the key
    // (secantusd-rs scans the collection for a top-level `$or` next to the key).
    let mut clauses = vec![key_filter.clone()];
    clauses.extend(conditions);
    let filter = mongodb::bson::doc! { "$and": clauses };
    let key = &key_filter;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let after = collection
            .find_one_and_update(filter.clone(), pipeline())
            .return_document(mongodb::options::ReturnDocument::After)
            .projection(projection.clone())
            .await?;
        if let Some(after) = after {
            return Ok(if holds(&after)? {
                ApplyOutcome::Applied
            } else {
                ApplyOutcome::Stale
            });
        }
        if attempt >= CREATE_ATTEMPTS {
            return Err(Error::Unavailable {
                what: "the sequenced document (deleted or changed as fast as it was read)",
            });
        }
        let current = collection
            .find_one(key_filter.clone())
            .projection(projection.clone())
            .await?;
        match current {
            Some(doc) if holds(&doc)? => return Ok(ApplyOutcome::Duplicate),
            Some(_) => match malformed().await {
                Some(e) => return Err(e),
                None => tracing::debug!(%key, "the document changed between two reads"),
            },
            None => match collection.insert_one(key_filter.clone()).await {
                Ok(_) => tracing::debug!(%key, "created the sequenced document"),
                Err(e) if crate::error::is_duplicate_key(&e) => {
                    tracing::debug!(%key, "a racing consumer created the document first");
                }
                Err(e) => return Err(e.into()),
            },
        }
    }
}

/// Creates the unique index on `key_field` (nothing to do for `_id`) and, when asked, a
/// multikey index on the plain members array.
async fn ensure_key_index(
    collection: &mongodb::Collection<Document>,
    key_field: &str,
) -> Result<()> {
    if key_field == "_id" {
        return Ok(());
    }
    let index = mongodb::IndexModel::builder()
        .keys(mongodb::bson::doc! { key_field: 1 })
        .options(
            mongodb::options::IndexOptions::builder()
                .unique(true)
                .name(format!("docwarden_seq_key_{key_field}"))
                .build(),
        )
        .build();
    collection.create_index(index).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_numbers_are_non_negative() {
        assert_eq!(validate_seq(0).ok(), Some(0));
        assert_eq!(validate_seq(i64::MAX).ok(), Some(i64::MAX));
        assert!(matches!(
            validate_seq(-1),
            Err(Error::InvalidInput {
                what: "sequence number",
                ..
            })
        ));
    }

    #[test]
    fn paths_and_stored_numbers() {
        let d = mongodb::bson::doc! { "a": { "b": { "c": 3_i64 } }, "n": 2_i32, "s": "x" };
        assert_eq!(get_path(&d, "a.b.c"), Some(&Bson::Int64(3)));
        assert_eq!(get_path(&d, "a.x.c"), None);
        assert_eq!(get_path(&d, "s.x"), None);
        assert_eq!(get_path(&d, "n").and_then(stored_seq), Some(2));
        assert_eq!(get_path(&d, "s").and_then(stored_seq), None);
        assert_eq!(stored_seq(&Bson::Double(1001.0)), Some(1001));
        assert_eq!(stored_seq(&Bson::Double(-3.0)), Some(-3));
        assert_eq!(stored_seq(&Bson::Double(1001.5)), None);
        assert_eq!(stored_seq(&Bson::Double(f64::NAN)), None);
        assert_eq!(stored_seq(&Bson::Double(9.3e18)), None);
        assert_eq!(
            stored_seq(&Bson::Double(-9_223_372_036_854_775_808.0)),
            Some(i64::MIN)
        );
        let dec = |s: &str| Bson::Decimal128(s.parse().unwrap_or_else(|_| panic!("{s}")));
        assert_eq!(stored_seq(&dec("1001")), Some(1001));
        assert_eq!(stored_seq(&dec("1001.0")), None);
    }
}
