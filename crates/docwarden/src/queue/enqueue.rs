//! Enqueue: single and batch, delayed, prioritised, deduplicated.
//!
//! A dedupe key is enforced by the unique partial index [`index::DEDUPE`](super::index::DEDUPE)
//! over unfinished jobs, never by a read-then-write: two racing enqueues of one key
//! store one job. Sizes are checked before anything is sent, so a batch with one
//! oversized payload enqueues nothing.

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};

use super::JobQueue;
use super::job::{JobState, field, unfinished_states};
use super::options::{EnqueueOptions, RunAt};
use crate::error::{Error, Result, is_duplicate_key};
use crate::validate::MAX_DOCUMENT_BYTES;

/// What an enqueue did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Enqueued {
    /// A new job was stored.
    Created(ObjectId),
    /// An unfinished job with the same dedupe key exists; nothing was stored.
    Duplicate {
        /// The key.
        key: String,
        /// The existing job, if it could be read back.
        existing: Option<ObjectId>,
    },
}

impl Enqueued {
    /// The new job's id, if one was created.
    pub fn created(&self) -> Option<ObjectId> {
        match self {
            Enqueued::Created(id) => Some(*id),
            Enqueued::Duplicate { .. } => None,
        }
    }
}

impl JobQueue {
    /// Builds the document of a new job (validated, size-checked).
    async fn new_job(&self, payload: Bson, opts: &EnqueueOptions) -> Result<Document> {
        opts.validate()?;
        let now = self.inner.time.now().await?;
        let run_at = match opts.run_at {
            RunAt::Now => now.estimate(),
            RunAt::After(d) => now.plus_ms(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
            RunAt::At(at) => at,
        };
        let max_attempts = opts.max_attempts.unwrap_or(self.inner.options.max_attempts);
        let mut d = doc! {
            field::ID: ObjectId::new(),
            field::STATE: JobState::Ready.as_str(),
            field::PAYLOAD: payload,
            field::PRIORITY: opts.priority,
            field::RUN_AT: run_at,
            field::ATTEMPTS: 0_i64,
            field::MAX_ATTEMPTS: i64::from(max_attempts),
            field::LEASE: Bson::Null,
            field::LAST_ERROR: Bson::Null,
            field::CREATED_AT: now.estimate(),
            field::UPDATED_AT: now.estimate(),
            field::PARTITION: i64::from(rand::random_range(0..self.inner.options.partitions)),
        };
        if let Some(key) = &opts.dedupe_key {
            d.insert(field::DEDUPE_KEY, key.clone());
        }
        self.apply_limits(&mut d, opts)?;
        let mut bytes = Vec::new();
        d.to_writer(&mut bytes)
            .map_err(|e| Error::invalid("payload", format!("cannot be encoded as BSON: {e}")))?;
        // Leave room for the lease, result and error a job gains later.
        let limit = MAX_DOCUMENT_BYTES - 16 * 1024;
        if bytes.len() > limit {
            return Err(Error::invalid(
                "payload",
                format!(
                    "the job document would be {} bytes; the limit is {limit} (16 MiB less room for the lease and result)",
                    bytes.len()
                ),
            ));
        }
        Ok(d)
    }

    /// Enqueues one job.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for bad options or a payload too large for one document
    /// (nothing is sent); a database error.
    pub async fn enqueue(
        &self,
        payload: impl Into<Bson>,
        opts: &EnqueueOptions,
    ) -> Result<Enqueued> {
        let d = self.new_job(payload.into(), opts).await?;
        let id = d
            .get_object_id(field::ID)
            .map_err(|e| Error::invalid("job", e.to_string()))?;
        match self.inner.coll.insert_one(d).await {
            Ok(_) => {
                tracing::debug!(job = %id, "enqueued");
                Ok(Enqueued::Created(id))
            }
            Err(e) if is_duplicate_key(&e) => match &opts.dedupe_key {
                Some(key) => Ok(self.duplicate(key).await),
                None => Err(e.into()),
            },
            Err(e) => Err(e.into()),
        }
    }

    /// Enqueues many jobs in one unordered insert. Outcomes are in input order. Every
    /// job is validated first: if one is invalid, nothing is enqueued.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] naming the bad job (nothing sent); a database error other
    /// than a dedupe conflict.
    pub async fn enqueue_many<I, P>(&self, jobs: I) -> Result<Vec<Enqueued>>
    where
        I: IntoIterator<Item = (P, EnqueueOptions)>,
        P: Into<Bson>,
    {
        let mut docs = Vec::new();
        let mut keys = Vec::new();
        for (payload, opts) in jobs {
            docs.push(self.new_job(payload.into(), &opts).await?);
            keys.push(opts.dedupe_key);
        }
        if docs.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<ObjectId> = docs
            .iter()
            .map(|d| d.get_object_id(field::ID))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::invalid("job", e.to_string()))?;
        match self
            .inner
            .coll
            .insert_many(docs.clone())
            .ordered(false)
            .await
        {
            Ok(_) => Ok(ids.into_iter().map(Enqueued::Created).collect()),
            // Some dedupe keys are taken. Which documents were stored is read back by
            // id (servers differ in how they report per-document errors of a bulk
            // insert), and the rest are retried one by one.
            Err(e) if is_duplicate_key(&e) => {
                let stored: Vec<ObjectId> = self
                    .inner
                    .coll
                    .find(doc! { field::ID: { "$in": ids.clone() } })
                    .projection(doc! { field::ID: 1 })
                    .await?
                    .try_collect::<Vec<Document>>()
                    .await?
                    .iter()
                    .filter_map(|d| d.get_object_id(field::ID).ok())
                    .collect();
                let mut out = Vec::with_capacity(ids.len());
                for ((id, d), key) in ids.into_iter().zip(docs).zip(keys) {
                    if stored.contains(&id) {
                        out.push(Enqueued::Created(id));
                        continue;
                    }
                    match self.inner.coll.insert_one(d).await {
                        Ok(_) => out.push(Enqueued::Created(id)),
                        Err(e) if is_duplicate_key(&e) => match &key {
                            Some(key) => out.push(self.duplicate(key).await),
                            None => return Err(e.into()),
                        },
                        Err(e) => return Err(e.into()),
                    }
                }
                Ok(out)
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn duplicate(&self, key: &str) -> Enqueued {
        let existing = self
            .inner
            .coll
            .find_one(doc! { field::DEDUPE_KEY: key, field::STATE: { "$in": unfinished_states() } })
            .projection(doc! { field::ID: 1 })
            .await
            .ok()
            .flatten()
            .and_then(|d| d.get_object_id(field::ID).ok());
        Enqueued::Duplicate {
            key: key.to_owned(),
            existing,
        }
    }
}
