//! Seed 002's own claim loop, as the article writes it: the anchor the queue's bench
//! rows are compared with (`docwarden bench`, "seed 002 claim loop").
//!
//! A message `{originatingIp, location: null}` is claimed by one `update_one` that sets
//! `lock: {by, until, token}` where `location` is null and the lock is missing or
//! expired (with a 1 s grace), then fetched by `find_one({lock.by, lock.until,
//! lock.token})`; the final write sets `location` and unsets `lock`, filtered by `_id`,
//! `lock.by`, `lock.token` and `lock.until >= now`. Everything the article does is kept
//! on purpose, flaws included (`DESIGN.md`, "What the seeds get wrong"): the client's
//! clock, a 4-digit random token, one worker id shared by every thread of the process,
//! and a partial index on `lock.until` that the claim filter cannot use. Only the idle
//! sleep differs: the article sleeps 5 s when nothing was claimed; [`IDLE`] is 5 ms, so
//! a spurious empty claim does not stall a short measurement.
//!
//! This is an anchor, not a safe queue: never use it outside a benchmark.

use std::time::Duration;

use mongodb::bson::{DateTime, Document, doc};
use mongodb::options::IndexOptions;
use mongodb::{Collection, Database, IndexModel};

/// How long a claim holds a message (`LOCK_DURATION`).
pub const LOCK_DURATION: Duration = Duration::from_secs(60);
/// The grace on an expired lock (`MAX_CLOCK_SKEW`).
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(1);
/// The pause after a claim that found nothing (the article's is 5 s).
pub const IDLE: Duration = Duration::from_millis(5);

/// The seed's message collection and the process's worker id.
#[derive(Clone, Debug)]
pub struct SeedQueue {
    messages: Collection<Document>,
    worker_id: String,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// `utcnow()` shifted by `delta_ms`.
fn utc_plus(delta_ms: i64) -> DateTime {
    DateTime::from_millis(DateTime::now().timestamp_millis().saturating_add(delta_ms))
}

impl SeedQueue {
    /// Drops collection `name` of `db` and creates it as `insert_test_docs` does (the
    /// partial index `{lock.until: 1}` over `{location: null}`), without documents.
    ///
    /// # Errors
    /// A database error.
    pub async fn setup(db: &Database, name: &str) -> anyhow::Result<Self> {
        let messages = db.collection::<Document>(name);
        messages.drop().await?;
        messages
            .create_index(
                IndexModel::builder()
                    .keys(doc! { "lock.until": 1 })
                    .options(
                        IndexOptions::builder()
                            .partial_filter_expression(doc! { "location": null })
                            .build(),
                    )
                    .build(),
            )
            .await?;
        Ok(Self {
            messages,
            worker_id: format!("bench-{}", std::process::id()),
        })
    }

    /// Inserts `count` messages with random IPs and `location: null`, in chunks of 1,000.
    ///
    /// # Errors
    /// A database error.
    pub async fn insert(&self, count: usize) -> anyhow::Result<()> {
        let mut left = count;
        while left > 0 {
            let chunk = left.min(1000);
            let docs: Vec<Document> = (0..chunk)
                .map(|_| {
                    let ip: Vec<String> = (0..4)
                        .map(|_| rand::random_range(1..=255_u8).to_string())
                        .collect();
                    doc! { "originatingIp": ip.join("."), "location": null }
                })
                .collect();
            self.messages.insert_many(docs).await?;
            left -= chunk;
        }
        Ok(())
    }

    /// `claim_document()`: the lock by `update_one`, then the message by `find_one`.
    /// `None` when the update modified nothing (or the fetch found nothing); the token
    /// comes back with the message (the seed reads it from `lock`).
    ///
    /// # Errors
    /// A database error.
    pub async fn claim(&self) -> anyhow::Result<Option<(Document, i32)>> {
        let now = DateTime::now();
        let lock_expiry = utc_plus(ms(LOCK_DURATION));
        let token = rand::random_range(1000..=9999_i32);
        let result = self
            .messages
            .update_one(
                doc! { "$and": [
                    { "location": null },
                    { "$or": [
                        { "lock": { "$exists": false } },
                        { "lock.until": { "$lt": DateTime::from_millis(now.timestamp_millis() - ms(MAX_CLOCK_SKEW)) } },
                    ] },
                ] },
                // The seed sets `lock: {by, until, token}`; its three dotted fields are the
                // same write (the lock holds nothing else).
                doc! { "$set": { "lock.by": &self.worker_id, "lock.until": lock_expiry, "lock.token": token } },
            )
            .await?;
        if result.modified_count == 0 {
            return Ok(None);
        }
        Ok(self
            .messages
            .find_one(doc! {
                "lock.by": &self.worker_id,
                "lock.until": lock_expiry,
                "lock.token": token,
            })
            .await?
            .map(|message| (message, token)))
    }

    /// The final update of `process_document()`: `location` set and `lock` unset if the
    /// lock is still this claim's and unexpired. Returns whether it applied.
    ///
    /// # Errors
    /// A database error.
    pub async fn finish(
        &self,
        message: &Document,
        token: i32,
        location: Document,
    ) -> anyhow::Result<bool> {
        let r = self
            .messages
            .update_one(
                doc! {
                    "_id": message.get("_id").cloned().unwrap_or_default(),
                    "lock.by": &self.worker_id,
                    "lock.until": { "$gte": DateTime::now() },
                    "lock.token": token,
                },
                doc! { "$set": { "location": location }, "$unset": { "lock": "" } },
            )
            .await?;
        Ok(r.modified_count == 1)
    }

    /// One iteration of a thread's loop: claim, "fetch the location" (a constant, no
    /// API call), final update. Returns 1 if a message was processed; sleeps [`IDLE`]
    /// and returns 0 if nothing was claimed.
    ///
    /// # Errors
    /// A database error.
    pub async fn step(&self) -> anyhow::Result<u64> {
        match self.claim().await? {
            Some((message, token)) => {
                let done = self
                    .finish(
                        &message,
                        token,
                        doc! { "status": "success", "country": "Bench" },
                    )
                    .await?;
                Ok(u64::from(done))
            }
            None => {
                tokio::time::sleep(IDLE).await;
                Ok(0)
            }
        }
    }
}
