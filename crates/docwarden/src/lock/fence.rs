//! Fenced writes, one shape for every holder ([`Fenced`]): a lock-collection [`Lease`], a
//! document lock ([`super::DocumentGuard`]) and a job claim ([`crate::queue::ClaimedJob`])
//! all write through [`Fence::apply`] and get a [`FenceOutcome`].
//!
//! Which documents a holder can fence:
//! - a **lease** fences any document, by token order (Kleppmann's storage-side check): a
//!   write is applied only if the token stored in the target document is lower than or
//!   equal to the lease's token, and the write stores the lease's token;
//! - a **document lock** fences the locked document: the write applies only while the
//!   document still carries the guard's lock id;
//! - a **job claim** fences the job document: the write applies only while the job is
//!   still running under the claim's token.
//!
//! **Guarantee (lease):** once a write with token `t` was applied to a document, no write with a
//! token below `t` is ever applied to it: a holder that was paused past its lease and
//! wakes up after a newer holder wrote gets [`FenceOutcome::Stale`].
//!
//! **Limits:** the check is per document. If the newer holder has not written to that
//! document yet, the old holder's write still goes through (its token is still the highest
//! the storage has seen); register the new token first ([`Fence::apply`] with an empty
//! update) when that matters. One document must be fenced by the tokens of one resource
//! only: tokens of different resources are not comparable. A fenced write is not
//! idempotent: sent again after an error whose write had applied, an `$inc` applies twice
//! (the same token passes again); retry only idempotent updates.

use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};
use tracing::instrument;

use super::document::DocumentGuard;
use super::lease::Lease;
use crate::error::{Error, Result};
use crate::queue::ClaimedJob;
use crate::token::FencingToken;
use crate::validate;

/// Options of a [`Fence`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct FenceOptions {
    /// The field of the target documents that stores the highest token applied. Default
    /// `fence_token`.
    pub token_field: String,
    /// Test controls only: `false` switches the token check off.
    check_token: bool,
}

impl Default for FenceOptions {
    fn default() -> Self {
        Self {
            token_field: crate::format::lock::FENCE_TOKEN.to_owned(),
            check_token: true,
        }
    }
}

impl FenceOptions {
    /// Sets [`FenceOptions::token_field`].
    pub fn token_field(mut self, field: impl Into<String>) -> Self {
        self.token_field = field.into();
        self
    }

    /// Test controls only, **unsafe**: applies the update whatever token the document
    /// stores (the token check is off; the lease's token is still written). Shows what
    /// fencing prevents.
    #[doc(hidden)]
    pub fn unsafe_without_token_check(mut self) -> Self {
        self.check_token = false;
        self
    }
}

/// What a fenced write did, for every kind of holder ([`Fenced`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "a fenced write may have been refused: check the outcome"]
#[non_exhaustive]
pub enum FenceOutcome {
    /// The update was applied and the document now carries the lease's token.
    Applied,
    /// The document carries a higher token: a newer holder wrote. Nothing was written.
    Stale {
        /// The token stored in the document.
        seen: FencingToken,
    },
    /// The holder no longer holds the document: the document lock was taken over or
    /// cleared, or the job is no longer running under this claim. Nothing was written.
    Lost,
    /// No document matched the filter. Nothing was written.
    NotFound,
    /// Contention: a lease's write was refused on every one of its rounds, and each time
    /// the read that followed found a document matching the filter whose token would have
    /// let it through (the document kept changing under the filter between the write and
    /// the read). Nothing was written; the lease may still be current: try again.
    Contended,
}

/// A holder whose writes can be fenced by [`Fence::apply`]: a lock-collection [`Lease`]
/// (any document, by token order), a [`DocumentGuard`] (the locked document) or a
/// [`ClaimedJob`] (the job document). Sealed: docwarden implements it for its holders.
pub trait Fenced: sealed::Sealed {
    /// The condition a target document must meet for a write under this holder.
    #[doc(hidden)]
    fn fence_condition(&self) -> FenceCondition;
}

/// What [`Fenced::fence_condition`] yields. Not part of the stable API.
#[doc(hidden)]
#[derive(Clone, Debug, PartialEq)]
pub enum FenceCondition {
    /// Compare-and-raise this token in the fence's token field.
    Token(i64),
    /// The document must match this filter (ANDed with the caller's).
    Matches(Document),
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Lease {}
    impl Sealed for super::DocumentGuard {}
    impl Sealed for super::ClaimedJob {}
    impl Sealed for super::super::semaphore::Permit {}
    impl Sealed for crate::lock::Leadership {}
}

impl Fenced for Lease {
    fn fence_condition(&self) -> FenceCondition {
        FenceCondition::Token(self.token.get())
    }
}

impl Fenced for super::semaphore::Permit {
    fn fence_condition(&self) -> FenceCondition {
        FenceCondition::Token(self.token.get())
    }
}

impl Fenced for DocumentGuard {
    fn fence_condition(&self) -> FenceCondition {
        FenceCondition::Matches(self.fence_filter())
    }
}

impl Fenced for ClaimedJob {
    fn fence_condition(&self) -> FenceCondition {
        FenceCondition::Matches(crate::queue::job::fence_filter(
            &Bson::ObjectId(self.id()),
            self.lease.token.as_str(),
        ))
    }
}

impl FenceOutcome {
    /// Whether the update was applied.
    pub fn is_applied(&self) -> bool {
        matches!(self, FenceOutcome::Applied)
    }

    /// `Ok(true)` if applied, `Ok(false)` if no document matched, and
    /// [`Error::Stale`] if a newer token was seen.
    ///
    /// # Errors
    /// [`Error::Stale`] for [`FenceOutcome::Stale`]; [`Error::LeaseLost`] for
    /// [`FenceOutcome::Lost`]; [`Error::Unavailable`] (retryable: [`Error::is_retryable`])
    /// for [`FenceOutcome::Contended`].
    pub fn into_result(self, lease: &Lease) -> Result<bool> {
        match self {
            FenceOutcome::Applied => Ok(true),
            FenceOutcome::NotFound => Ok(false),
            FenceOutcome::Contended => Err(Error::Unavailable {
                what: "the fenced document (it kept changing under the filter)",
            }),
            FenceOutcome::Lost => Err(Error::LeaseLost {
                resource: lease.resource.clone(),
                token: lease.token.into(),
            }),
            FenceOutcome::Stale { seen } => Err(Error::Stale {
                resource: lease.resource.clone(),
                token: lease.token,
                seen,
            }),
        }
    }
}

/// Test-only: pauses a lease's [`Fence::apply`] made through [`Fence::with_round_pause`]
/// at two points of each round — after its fenced update matched nothing, before the read
/// that explains why; and before the next round's update — so a test can change the
/// document between them.
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct FencePause {
    reached: tokio::sync::Notify,
    resume: tokio::sync::Notify,
}

impl FencePause {
    /// Resolves once an apply has reached a pause point and is waiting.
    pub async fn reached(&self) {
        self.reached.notified().await;
    }

    /// Lets the waiting (or the next) apply go on.
    pub fn resume(&self) {
        self.resume.notify_one();
    }

    async fn pause(pause: Option<&Self>) {
        if let Some(pause) = pause {
            pause.reached.notify_one();
            pause.resume.notified().await;
        }
    }
}

/// Fenced writes to one collection.
///
/// ```no_run
/// # async fn example(db: mongodb::Database, lease: docwarden::lock::Lease) -> docwarden::Result<()> {
/// use docwarden::lock::{Fence, FenceOptions};
/// use mongodb::bson::doc;
/// let accounts = Fence::new(db.collection("accounts"), FenceOptions::default())?;
/// let outcome = accounts
///     .apply(&lease, doc! { "_id": 42 }, doc! { "$inc": { "balance": -10 } })
///     .await?;
/// outcome.into_result(&lease)?; // Error::Stale if a newer holder wrote first
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Fence {
    coll: Collection<Document>,
    field: String,
    check_token: bool,
    pause: Option<std::sync::Arc<FencePause>>,
}

impl Fence {
    /// The collection this fence writes to.
    pub fn collection(&self) -> &Collection<Document> {
        &self.coll
    }

    /// Fenced writes to collection `name` of `db` ([`Fence::new`]), after the preflight
    /// checks ([`crate::preflight::check`]). No index is created: fenced writes go by the
    /// caller's filter.
    ///
    /// # Errors
    /// As [`Fence::new`]; [`Error::Incompatible`] for a server older than MongoDB 6.0 or a
    /// collection with a non-simple default collation; a database error.
    pub async fn open(db: &mongodb::Database, name: &str, options: FenceOptions) -> Result<Self> {
        validate::collection_name("fenced collection", name)?;
        let this = Self::new(db.collection(name), options)?;
        crate::preflight::check(&this.coll).await?;
        Ok(this)
    }

    /// Fenced writes to `coll`, without touching the server: it only validates.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a token field that is not a plain field path: empty, a
    /// `$`-prefixed or empty segment (`a..b`, `a.`), or `_id` or a path inside it.
    pub fn new(coll: Collection<Document>, options: FenceOptions) -> Result<Self> {
        validate::name("token field", &options.token_field)?;
        let mut segments = options.token_field.split('.');
        if segments.clone().any(|s| s.is_empty() || s.starts_with('$'))
            || segments.next() == Some("_id")
        {
            // Else every apply fails on the server (an empty field name, an immutable
            // `_id`) with a bare database error.
            return Err(Error::invalid("token field", "must be a plain field name"));
        }
        Ok(Self {
            coll,
            field: options.token_field,
            check_token: options.check_token,
            pause: None,
        })
    }

    /// Test-only: a handle on the same collection whose lease applies stop at the pause
    /// points of [`FencePause`] until `pause` lets them go on.
    #[doc(hidden)]
    pub fn with_round_pause(&self, pause: std::sync::Arc<FencePause>) -> Self {
        Self {
            pause: Some(pause),
            ..self.clone()
        }
    }

    /// Applies the operator update `update` to the one document matching `filter`, only
    /// while `holder` still holds it:
    /// - a [`Lease`]: only if the document's stored token is absent or not above the
    ///   lease's token; the document then stores the token ([`FenceOutcome::Stale`]
    ///   otherwise). An empty `update` only records the token.
    /// - a [`DocumentGuard`] or a [`ClaimedJob`]: only if the document is the locked
    ///   document still carrying the guard's lock id, or the job still running under the
    ///   claim's token ([`FenceOutcome::Lost`] otherwise).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] if `update` is not an operator document or touches the
    /// fence's own fields — the token field; a guard's lock id; a job's `state` and
    /// `lease.token` — by a path it writes, a path containing one, or a `$rename` onto one
    /// (nothing is written); a database error.
    #[instrument(skip_all)]
    pub async fn apply<H: Fenced + ?Sized>(
        &self,
        holder: &H,
        filter: Document,
        update: Document,
    ) -> Result<FenceOutcome> {
        let token = match holder.fence_condition() {
            FenceCondition::Token(token) => token,
            FenceCondition::Matches(condition) => {
                return self.apply_matching(condition, filter, update).await;
            }
        };
        let update = fenced_update(&self.field, token, update)?;
        let guarded = if self.check_token {
            fenced_filter(&self.field, token, filter.clone())
        } else {
            filter.clone()
        };
        for round in 0..3 {
            if round > 0 {
                FencePause::pause(self.pause.as_deref()).await;
            }
            let result = self
                .coll
                .update_one(guarded.clone(), update.clone())
                .await?;
            if result.matched_count == 1 {
                return Ok(FenceOutcome::Applied);
            }
            FencePause::pause(self.pause.as_deref()).await;
            let Some(current) = self
                .coll
                .find_one(filter.clone())
                .projection(doc! { self.field.as_str(): 1 })
                .await?
            else {
                return Ok(FenceOutcome::NotFound);
            };
            match current.get(&self.field) {
                Some(Bson::Int64(seen)) if *seen > token => {
                    return Ok(FenceOutcome::Stale {
                        seen: FencingToken::new(*seen),
                    });
                }
                Some(Bson::Int64(_)) | Some(Bson::Null) | None => {
                    // The document changed between the write and the read; try again.
                    tracing::debug!(round, "fenced document changed under the filter");
                }
                Some(other) => {
                    return Err(Error::Malformed {
                        id: current
                            .get("_id")
                            .map(ToString::to_string)
                            .unwrap_or_default(),
                        reason: format!("fence token field holds {other}"),
                    });
                }
            }
        }
        // The document exists and matched the filter at every read: not `NotFound`.
        tracing::debug!(collection = %self.coll.name(), "fenced write contended: three rounds");
        Ok(FenceOutcome::Contended)
    }

    /// [`Fence::apply`] for a holder whose fence is a match condition on the document.
    async fn apply_matching(
        &self,
        condition: Document,
        filter: Document,
        update: Document,
    ) -> Result<FenceOutcome> {
        // The fields the condition reads (the lock id; the job's state and token): an
        // update that changed them would move the fence itself.
        let fence_fields: Vec<&str> = condition
            .keys()
            .map(String::as_str)
            .filter(|k| *k != "_id")
            .collect();
        check_operator_update(&update, &fence_fields)?;
        if update.is_empty() {
            return Err(Error::invalid(
                "fenced update",
                "must change something (a lease records its token; other holders have none)",
            ));
        }
        let guarded = if self.check_token {
            doc! { "$and": [ filter.clone(), condition ] }
        } else {
            filter.clone()
        };
        let result = self.coll.update_one(guarded, update).await?;
        if result.matched_count == 1 {
            return Ok(FenceOutcome::Applied);
        }
        let exists = self
            .coll
            .find_one(filter)
            .projection(doc! { "_id": 1 })
            .await?
            .is_some();
        Ok(if exists {
            FenceOutcome::Lost
        } else {
            FenceOutcome::NotFound
        })
    }
}

/// `filter AND (field == null OR field <= token)`.
pub(crate) fn fenced_filter(field: &str, token: i64, filter: Document) -> Document {
    doc! { "$and": [
        filter,
        { "$or": [ { field: Bson::Null }, { field: { "$lte": token } } ] },
    ] }
}

/// The caller's operator update with `$set: {field: token}` added.
pub(crate) fn fenced_update(field: &str, token: i64, mut update: Document) -> Result<Document> {
    check_operator_update(&update, &[field])?;
    match update.get_mut("$set") {
        Some(Bson::Document(set)) => {
            set.insert(field, token);
        }
        _ => {
            update.insert("$set", doc! { field: token });
        }
    }
    Ok(update)
}

/// Whether writing path `path` changes `field`: the same path, one inside it, or one
/// that contains it (`lease` contains `lease.token`).
fn touches(path: &str, field: &str) -> bool {
    let nested = |inner: &str, outer: &str| {
        inner
            .strip_prefix(outer)
            .is_some_and(|rest| rest.starts_with('.'))
    };
    path == field || nested(path, field) || nested(field, path)
}

/// Refuses anything but an operator update, and one touching a `protected` field: by a
/// path it writes, a path containing it, or as the target of a `$rename`.
fn check_operator_update(update: &Document, protected: &[&str]) -> Result<()> {
    for (op, value) in update {
        if !op.starts_with('$') {
            return Err(Error::invalid(
                "fenced update",
                format!("`{op}` is not an update operator"),
            ));
        }
        let Bson::Document(fields) = value else {
            return Err(Error::invalid(
                "fenced update",
                format!("`{op}` must take a document"),
            ));
        };
        // `$rename` writes its values (the new names) as well as its keys.
        let renamed = (op == "$rename").then(|| fields.values().filter_map(Bson::as_str));
        let written = fields
            .keys()
            .map(String::as_str)
            .chain(renamed.into_iter().flatten());
        for path in written {
            if let Some(field) = protected.iter().find(|f| touches(path, f)) {
                return Err(Error::invalid(
                    "fenced update",
                    format!("must not touch the fence field `{field}` (it writes `{path}`)"),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn update_gets_the_token_and_refuses_to_touch_it() -> Result<()> {
        assert_eq!(
            fenced_update("f", 3, doc! { "$inc": { "n": 1 } })?,
            doc! { "$inc": { "n": 1 }, "$set": { "f": 3_i64 } }
        );
        assert_eq!(
            fenced_update("f", 3, doc! { "$set": { "a": 1 } })?,
            doc! { "$set": { "a": 1, "f": 3_i64 } }
        );
        assert_eq!(
            fenced_update("f", 3, doc! {})?,
            doc! { "$set": { "f": 3_i64 } }
        );
        assert!(fenced_update("f", 3, doc! { "$set": { "f": 9 } }).is_err());
        assert!(fenced_update("f", 3, doc! { "$unset": { "f.x": "" } }).is_err());
        assert!(fenced_update("f", 3, doc! { "n": 1 }).is_err());
        // Session 15: a `$rename` onto the token field, and a write of a path that
        // contains a dotted token field, passed the check (the server then refused the
        // update with a bare conflict error, or it replaced the stored token).
        assert!(fenced_update("f", 3, doc! { "$rename": { "x": "f" } }).is_err());
        assert!(fenced_update("meta.f", 3, doc! { "$set": { "meta": {} } }).is_err());
        assert!(fenced_update("meta.f", 3, doc! { "$set": { "meta.g": 1 } }).is_ok());
        assert!(fenced_update("f", 3, doc! { "$set": { "ff": 1, "g.f": 1 } }).is_ok());
        Ok(())
    }

    /// Session 15: for a document lock or a job claim the update was not checked at all,
    /// so a fenced write could change the fence itself (the lock id, the job's state or
    /// token) and report `Applied`: the guard's release, the job's completion then
    /// failed as lost. The condition's fields are protected like a lease's token field.
    #[test]
    fn a_matching_fence_refuses_updates_of_its_own_fields() {
        let job = crate::queue::job::fence_filter(&Bson::Int32(1), "t");
        let fields: Vec<&str> = job
            .keys()
            .map(String::as_str)
            .filter(|k| *k != "_id")
            .collect();
        for bad in [
            doc! { "$set": { "state": "succeeded" } },
            doc! { "$set": { "lease": {} } },
            doc! { "$unset": { "lease.token": "" } },
            doc! { "$rename": { "x": "state" } },
        ] {
            assert!(check_operator_update(&bad, &fields).is_err(), "{bad}");
        }
        assert!(check_operator_update(&doc! { "$set": { "progress": 1 } }, &fields).is_ok());
    }

    /// Session 15: `a..b`, `a.`, `a.$b` and `_id.t` passed as token fields; every apply
    /// then failed on the server with a bare database error.
    #[tokio::test]
    async fn token_fields_are_plain_paths() -> anyhow::Result<()> {
        let client = mongodb::Client::with_uri_str("mongodb://127.0.0.1:1").await?;
        let coll = client.database("none").collection::<Document>("c");
        for ok in ["fence_token", "meta.token"] {
            assert!(Fence::new(coll.clone(), FenceOptions::default().token_field(ok)).is_ok());
        }
        for bad in ["", "$t", "a..b", "a.", ".a", "a.$b", "_id", "_id.t"] {
            assert!(
                matches!(
                    Fence::new(coll.clone(), FenceOptions::default().token_field(bad)),
                    Err(Error::InvalidInput {
                        what: "token field",
                        ..
                    })
                ),
                "{bad:?} was accepted"
            );
        }
        Ok(())
    }

    #[test]
    fn filter_admits_missing_or_lower_tokens() {
        assert_eq!(
            fenced_filter("f", 5, doc! { "_id": 1 }),
            doc! { "$and": [ { "_id": 1 }, { "$or": [ { "f": null }, { "f": { "$lte": 5_i64 } } ] } ] }
        );
    }
}
