//! Last-writer-wins registers: `set(key, field, value, seq)` for scalar or sub-document
//! values.
//!
//! Each call is one atomic pipeline update on the document `{<key_field>: key}`. The
//! value is stored under its plain field name (readable as-is), and its sequence number in
//! `_seq.<field>`.
//!
//! **Rule:** a write `(seq, value)` replaces the stored `(seq₀, value₀)` when `seq > seq₀`,
//! or when `seq == seq₀` and `value` is greater than `value₀` in MongoDB's BSON comparison
//! order (`$gt`) — **the greater value wins at equal sequence numbers**, which does not
//! depend on arrival order. An equal value at an equal seq (`$eq`, so `1` and `1.0` are
//! equal) is [`Outcome::Duplicate`]; a losing write is [`Outcome::Stale`].

use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};

use super::{Outcome, encode, validate_seq};
use crate::error::{Error, Result};

/// The sub-document holding each register's sequence number.
pub const SEQ_FIELD: &str = "_seq";

/// Options of [`SequencedFields`], validated by [`SequencedFields::new`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct FieldsOptions {
    /// The field that identifies the document (`_id` by default). Any other field gets a
    /// unique index.
    pub key_field: String,
}

impl Default for FieldsOptions {
    fn default() -> Self {
        Self {
            key_field: "_id".to_owned(),
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
}

/// A handle on a collection of documents whose fields are last-writer-wins registers.
#[derive(Debug, Clone)]
pub struct SequencedFields {
    collection: Collection<Document>,
    key_field: String,
}

impl SequencedFields {
    /// A handle on `collection`; validates the options and creates the unique key index
    /// (idempotently) unless the key is `_id`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a key field that is not a plain name;
    /// [`Error::Database`] if the index cannot be created.
    pub async fn new(collection: Collection<Document>, options: FieldsOptions) -> Result<Self> {
        if options.key_field != "_id" {
            encode::field("key field", &options.key_field)?;
        }
        super::ensure_key_index(&collection, &options.key_field).await?;
        Ok(Self {
            collection,
            key_field: options.key_field,
        })
    }

    /// The collection this handle writes to.
    pub fn collection(&self) -> &Collection<Document> {
        &self.collection
    }

    /// Sets `field` of `key` to `value` as of `seq`. One round trip.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad key, a field name that is not plain (see
    /// [`encode::field`]; it must also differ from the key field) or a negative `seq`;
    /// [`Error::Malformed`] if the stored document is not in the expected shape;
    /// [`Error::Database`] otherwise (a duplicate-key error from a consumer
    /// racing to create the document is absorbed, not returned).
    pub async fn set(
        &self,
        key: impl Into<Bson>,
        field: &str,
        value: impl Into<Bson>,
        seq: i64,
    ) -> Result<Outcome> {
        let key = encode::key(key.into())?;
        self.check_field(field)?;
        validate_seq(seq)?;
        let value = value.into();
        let outcome = super::apply(
            &self.collection,
            doc! { self.key_field.as_str(): key.clone() },
            || Self::pipeline(field, value.clone(), seq),
            &key,
        )
        .await?;
        tracing::debug!(%key, field, seq, ?outcome, "sequenced field write");
        Ok(outcome)
    }

    fn check_field(&self, field: &str) -> Result<()> {
        encode::field("field", field)?;
        if field == self.key_field {
            return Err(Error::invalid("field", "must differ from the key field"));
        }
        Ok(())
    }

    /// The update pipeline for one write (public for inspection and other-language ports).
    /// `field` must already be checked.
    pub fn pipeline(field: &str, value: Bson, seq: i64) -> Vec<Document> {
        let v = encode::literal(value);
        let current_value = format!("${field}");
        let seq_path = format!("${SEQ_FIELD}.{field}");
        let outcome = doc! { "$let": {
            "vars": { "cur": { "$ifNull": [seq_path.as_str(), -1_i64] } },
            "in": { "$switch": {
                "branches": [
                    { "case": { "$gt": [seq, "$$cur"] }, "then": Outcome::Applied.as_str() },
                    { "case": { "$lt": [seq, "$$cur"] }, "then": Outcome::Stale.as_str() },
                    { "case": { "$eq": [current_value.as_str(), v.clone()] },
                      "then": Outcome::Duplicate.as_str() },
                    { "case": { "$gt": [v.clone(), current_value.as_str()] },
                      "then": Outcome::Applied.as_str() },
                ],
                "default": Outcome::Stale.as_str(),
            } },
        } };
        let applied =
            doc! { "$eq": [format!("${}", super::OUTCOME_FIELD), Outcome::Applied.as_str()] };
        let seqs = doc! { "$ifNull": [format!("${SEQ_FIELD}"), {}] };
        vec![
            doc! { "$set": { super::OUTCOME_FIELD: outcome } },
            doc! { "$set": {
                field: { "$cond": [applied.clone(), v, current_value.as_str()] },
                SEQ_FIELD: { "$cond": [
                    applied,
                    { "$mergeObjects": [seqs.clone(), { field: seq }] },
                    seqs,
                ] },
            } },
        ]
    }

    /// The value of `field` of `key` and its sequence number, or `None` when the document
    /// or the register does not exist.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad key or field; [`Error::Malformed`] if the stored
    /// sequence number is not an `i64`; [`Error::Database`] otherwise.
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
        let seq = seq.as_i64().ok_or_else(|| Error::Malformed {
            id: key.to_string(),
            reason: format!("`{SEQ_FIELD}.{field}` is not an i64"),
        })?;
        Ok(Some((doc.get(field).cloned().unwrap_or(Bson::Null), seq)))
    }
}
