//! Rate limits: at most N job starts per interval per key, across every worker.
//!
//! **One document per key** in `<queue>.rates`: `{_id: key, limit: N, interval_ms,
//! starts: [{at, id}]}` (field names in [`crate::format::job::rate`]). A start is admitted
//! by one atomic `findOneAndUpdate` upsert by `_id` whose pipeline drops the starts older
//! than the interval **by the server's clock** (`$$NOW`, so every worker and every clock
//! agree) and appends `{at: $$NOW, id}` only while fewer than `limit` starts remain. A
//! claim that fails after its start was admitted takes the start back (`$pull` by `id`),
//! so only jobs that really started count.
//!
//! **Guarantee:** no window of `interval` server time holds more than `limit` admitted
//! starts of one key. **Limits:** a start is counted when it is admitted, just before the
//! job's claim; a start taken back after a failed claim makes room again. The limit and the
//! interval of a key are stored on its first admission and changed with
//! [`JobQueue::set_rate_limit`](super::JobQueue::set_rate_limit).

use std::time::Duration;

use mongodb::bson::{Bson, Document, doc};
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};

use crate::clock::TimeSource;
use crate::error::{self, Error, Result};
use crate::format::job::rate as field;
use crate::validate;

/// The rate documents of one queue (`<queue>.rates`).
#[derive(Clone, Debug)]
pub(crate) struct RateLimiter {
    coll: Collection<Document>,
    default_limit: i64,
    default_interval_ms: i64,
}

/// A start admitted by [`RateLimiter::admit`]: its key and its id in `starts`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Start {
    pub(crate) key: String,
    pub(crate) id: String,
    /// The server's `$$NOW` of the admission.
    pub(crate) at: Option<mongodb::bson::DateTime>,
}

/// A rate key as stored (see [`JobQueue::rate_status`](super::JobQueue::rate_status)).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct RateRecord {
    /// The key.
    pub key: String,
    /// Starts allowed per interval.
    pub limit: Option<i64>,
    /// The interval, milliseconds.
    pub interval_ms: Option<i64>,
    /// Starts stored (the next admission drops those older than the interval).
    pub starts: usize,
}

impl RateLimiter {
    pub(crate) fn new(
        db: &Database,
        queue: &Collection<Document>,
        limit: u32,
        interval: Duration,
    ) -> Result<Self> {
        if limit == 0 {
            return Err(Error::invalid("rate limit", "must be at least 1"));
        }
        let default_interval_ms = validate::duration_ms("rate interval", interval)?;
        Ok(Self {
            coll: db.collection_with_options(
                &format!("{}{}", queue.name(), field::COLLECTION_SUFFIX),
                mongodb::options::CollectionOptions::builder()
                    .write_concern(queue.write_concern().cloned())
                    .build(),
            ),
            default_limit: i64::from(limit),
            default_interval_ms,
        })
    }

    /// Admits one start of `key` now (server time), or `None` if `limit` starts of the
    /// last interval are stored. `ignore_limit` is the test control (admit always).
    pub(crate) async fn admit(&self, key: &str, ignore_limit: bool) -> Result<Option<Start>> {
        let id = validate::random_id();
        for attempt in 1..=3 {
            let answer = self
                .coll
                .find_one_and_update(
                    doc! { field::ID: key },
                    admit_pipeline(
                        &id,
                        self.default_limit,
                        self.default_interval_ms,
                        ignore_limit,
                    ),
                )
                .upsert(true)
                .return_document(ReturnDocument::After)
                .await;
            let after = match answer {
                Ok(Some(d)) => d,
                // Two first admissions raced to insert the document: again, as an update.
                Ok(None) if attempt < 3 => continue,
                Err(e) if attempt < 3 && error::is_duplicate_key(&e) => continue,
                Ok(None) => return Ok(None),
                Err(e) => return Err(e.into()),
            };
            let mine = after.get_array(field::STARTS).ok().and_then(|s| {
                s.iter()
                    .filter_map(Bson::as_document)
                    .find(|s| s.get_str(field::start::ID).ok() == Some(id.as_str()))
            });
            return Ok(mine.map(|s| Start {
                key: key.to_owned(),
                at: s.get_datetime(field::start::AT).ok().copied(),
                id,
            }));
        }
        Ok(None)
    }

    /// Takes back a start whose claim failed. One that fails with a transient error is
    /// retried in the background (`lock/landing.rs`, "Releases that failed": until
    /// session 35 it was dropped, and the start counted until it left its interval); the
    /// `$pull` names the start's own id, so a retry after a first try that did apply
    /// finds nothing. `time` is the queue's time source.
    pub(crate) async fn take_back(&self, start: &Start, time: &TimeSource) {
        let (filter, update) = take_back_update(start);
        if let Err(e) = self.coll.update_one(filter.clone(), update.clone()).await {
            crate::lock::landing::release_later(
                &self.coll,
                time,
                filter,
                update,
                &Error::from(e),
                "rate start taken back",
            );
        }
    }

    pub(crate) async fn set(&self, key: &str, limit: u32, interval: Duration) -> Result<()> {
        validate::name("rate key", key)?;
        if limit == 0 {
            return Err(Error::invalid("rate limit", "must be at least 1"));
        }
        let ms = validate::duration_ms("rate interval", interval)?;
        for attempt in 1..=3 {
            match self
                .coll
                .update_one(
                    doc! { field::ID: key },
                    doc! { "$set": { field::LIMIT: i64::from(limit), field::INTERVAL_MS: ms } },
                )
                .upsert(true)
                .await
            {
                Ok(_) => return Ok(()),
                Err(e) if attempt < 3 && error::is_duplicate_key(&e) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    pub(crate) async fn status(&self, key: &str) -> Result<Option<RateRecord>> {
        let d = self.coll.find_one(doc! { field::ID: key }).await?;
        Ok(d.map(|d| RateRecord {
            key: key.to_owned(),
            limit: number(d.get(field::LIMIT)),
            interval_ms: number(d.get(field::INTERVAL_MS)),
            starts: d.get_array(field::STARTS).map_or(0, Vec::len),
        }))
    }
}

fn number(v: Option<&Bson>) -> Option<i64> {
    match v {
        Some(Bson::Int64(n)) => Some(*n),
        Some(Bson::Int32(n)) => Some(i64::from(*n)),
        _ => None,
    }
}

/// Stage 1: the stored limit and interval (the defaults on first use); stage 2: drop the
/// starts with `at + interval_ms ≤ $$NOW`; stage 3: append `{at: $$NOW, id}` while fewer
/// than `limit` remain. One atomic update of one document.
fn admit_pipeline(id: &str, limit: i64, interval_ms: i64, ignore_limit: bool) -> Vec<Document> {
    let starts = format!("${}", field::STARTS);
    let lim = format!("${}", field::LIMIT);
    let ivl = format!("${}", field::INTERVAL_MS);
    let at = format!("$$s.{}", field::start::AT);
    let admit: Bson = if ignore_limit {
        Bson::Boolean(true)
    } else {
        Bson::Document(doc! { "$lt": [{ "$size": &starts }, &lim] })
    };
    vec![
        doc! { "$set": {
            field::LIMIT: { "$cond": [{ "$isNumber": &lim }, &lim, limit] },
            field::INTERVAL_MS: { "$cond": [{ "$isNumber": &ivl }, &ivl, interval_ms] },
        } },
        doc! { "$set": { field::STARTS: { "$filter": {
            "input": { "$cond": [{ "$isArray": &starts }, &starts, []] },
            "as": "s",
            // `at + interval_ms > $$NOW`: still inside the interval. `$dateAdd` (MongoDB
            // 5.0+), not `$add` of a date and a number: the embedded server refuses the latter.
            "cond": { "$gt": [
                { "$dateAdd": { "startDate": &at, "unit": "millisecond", "amount": &ivl } },
                "$$NOW",
            ] },
        } } } },
        doc! { "$set": { field::STARTS: { "$cond": [
            admit,
            { "$concatArrays": [&starts, [{ field::start::AT: "$$NOW", field::start::ID: { "$literal": id } }]] },
            &starts,
        ] } } },
    ]
}

/// The filter and update that take `start` back: the `$pull` of its entry, by id, from
/// its key's document.
fn take_back_update(start: &Start) -> (Document, Document) {
    (
        doc! { field::ID: &start.key },
        doc! { "$pull": { field::STARTS: { field::start::ID: &start.id } } },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_admission_drops_old_starts_by_server_time_first() {
        let p = admit_pipeline("n", 5, 1_000, false);
        assert_eq!(p.len(), 3);
        let text = format!("{p:?}");
        assert!(text.contains("$$NOW"), "server time, not a client clock");
        let control = admit_pipeline("n", 5, 1_000, true);
        assert_eq!(
            control[2]
                .get_document("$set")
                .ok()
                .and_then(|s| s.get_document("starts").ok())
                .and_then(|c| c.get_array("$cond").ok())
                .and_then(|a| a.first())
                .cloned(),
            Some(Bson::Boolean(true))
        );
    }
}
