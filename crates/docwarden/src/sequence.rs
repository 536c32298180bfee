//! Sequenced updates: operations stamped with a sequence number converge to the same
//! document whatever order they arrive in and however often each one is delivered.
//!
//! Guarantee: every operation is **one** atomic pipeline update (`findOneAndUpdate`) on
//! the single document that holds the key, and it compares its sequence number with the
//! state stored next to the data. The final document equals the one you get by applying
//! the operations one by one in sequence order, for any permutation and any number of
//! duplicates. A unique index on the key means racing consumers can never create a second
//! document for it (the first message for a key creates the document empty, idempotently,
//! then updates it; see `apply` below for why that is not an upsert). The outcome
//! ([`Outcome::Applied`], [`Outcome::Stale`], [`Outcome::Duplicate`]) comes back in the
//! same round trip.
//!
//! Limits: sequence numbers must be totally ordered *per key and member/field* by the
//! producer (a non-negative `i64`, see [`set`] for the rule at equal numbers); the state
//! lives in the document, so a set costs one small entry per member ever seen until
//! [`set::SequencedSet::compact`] removes tombstones below a watermark; an applied set
//! update rewrites the plain members array (O(members) work, fine for hundreds or a few
//! thousand members per document, not for hundreds of thousands).
//!
//! - [`set::SequencedSet`]: a last-writer-wins element set (`add` / `remove`).
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
//! use docwarden::sequence::{Outcome, SequencedSet, SetOptions};
//!
//! let classes = SequencedSet::new(
//!     db.collection("students"),
//!     SetOptions::default().key_field("student_id").field("classes"),
//! )
//! .await?;
//! // Messages 1 (enroll), 3 (enroll) and 2 (unenroll) arrive as 1, 3, 2:
//! assert_eq!(classes.add(7, "CS 101", 1).await?, Outcome::Applied);
//! assert_eq!(classes.add(7, "CS 101", 3).await?, Outcome::Applied);
//! assert_eq!(classes.remove(7, "CS 101", 2).await?, Outcome::Stale);
//! assert_eq!(classes.members(7).await?, Some(vec!["CS 101".to_owned()]));
//! # Ok(()) }
//! ```

pub mod compact;
pub mod encode;
pub mod register;
pub mod set;

pub use compact::CompactionReport;
pub use register::{FieldsOptions, SequencedFields};
pub use set::{MemberState, SequencedSet, SetOptions};

use mongodb::bson::{Bson, Document};

use crate::error::{Error, Result};

/// The field in which every sequenced write records its own outcome. The write returns the
/// document as it left *that* write (`ReturnDocument::After`), so the marker read back is
/// always the caller's own, even under concurrency.
pub const OUTCOME_FIELD: &str = "_seq_last";

/// How many times an operation tries to create a missing document before giving up.
const CREATE_ATTEMPTS: u32 = 8;

/// What a sequenced operation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
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

impl Outcome {
    /// The marker stored in [`OUTCOME_FIELD`].
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Applied => "applied",
            Outcome::Stale => "stale",
            Outcome::Duplicate => "duplicate",
        }
    }

    fn from_marker(doc: Option<&Document>, key: &Bson) -> Result<Self> {
        let Some(doc) = doc else {
            return Err(Error::Malformed {
                id: key.to_string(),
                reason: "the update returned no document".to_owned(),
            });
        };
        match doc.get_str(OUTCOME_FIELD).ok() {
            Some("applied") => Ok(Outcome::Applied),
            Some("stale") => Ok(Outcome::Stale),
            Some("duplicate") => Ok(Outcome::Duplicate),
            _ => Err(Error::Malformed {
                id: key.to_string(),
                reason: format!("no outcome marker `{OUTCOME_FIELD}` in {doc}"),
            }),
        }
    }
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

/// Runs one `findOneAndUpdate` pipeline on the document `filter` selects and reads its
/// outcome marker. When there is no document yet, it is created empty (`insert_one` of the
/// filter itself, `{<key_field>: key}`); the unique key index makes that idempotent, so a
/// duplicate-key error from a racing creator is absorbed and the update runs again.
///
/// Why not an upserting `findOneAndUpdate`: MongoDB would do the same in one round trip,
/// but the embedded secantusd-rs answers some *racing* upserts with `value: null` although
/// it applied the write, which would leave the outcome unknown. Creating the document
/// first costs two extra round trips once per key and is correct on both servers; every
/// later message is exactly one round trip.
async fn apply(
    collection: &mongodb::Collection<Document>,
    filter: Document,
    pipeline: impl Fn() -> Vec<Document>,
    key: &Bson,
) -> Result<Outcome> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let doc = collection
            .find_one_and_update(filter.clone(), pipeline())
            .return_document(mongodb::options::ReturnDocument::After)
            .projection(mongodb::bson::doc! { OUTCOME_FIELD: 1 })
            .await?;
        if doc.is_some() {
            return Outcome::from_marker(doc.as_ref(), key);
        }
        if attempt >= CREATE_ATTEMPTS {
            return Err(Error::Unavailable {
                what: "the sequenced document (deleted as fast as it was created)",
            });
        }
        match collection.insert_one(filter.clone()).await {
            Ok(_) => tracing::debug!(%key, "created the sequenced document"),
            Err(e) if crate::error::is_duplicate_key(&e) => {
                tracing::debug!(%key, "a racing consumer created the document first");
            }
            Err(e) => return Err(e.into()),
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
    fn markers_round_trip() -> Result<()> {
        for o in [Outcome::Applied, Outcome::Stale, Outcome::Duplicate] {
            let d = mongodb::bson::doc! { OUTCOME_FIELD: o.as_str() };
            assert_eq!(Outcome::from_marker(Some(&d), &Bson::Int32(1))?, o);
        }
        assert!(Outcome::from_marker(None, &Bson::Int32(1)).is_err());
        Ok(())
    }
}
