//! Fenced transitions of a claimed job: heartbeat, complete, fail, release, cancel.
//!
//! Every one is a single `updateOne` whose filter is the claim's fence
//! `{_id, state: "running", "lease.token": token}`. If it matches nothing, the lease was
//! lost (expired and swept or re-claimed, or cancelled by an operator) and the call
//! returns [`Error::LeaseLost`] having written nothing.
//!
//! The worker writes the same transitions in bulk ([`JobQueue::settle_many`],
//! [`JobQueue::heartbeat_many`]): one unordered `update` command whose statements are
//! the per-job fenced updates above, so each job is still fenced by its own token. When
//! the reply's match count falls short of the statements (a lease was lost, or a reply
//! was lost and the bulk retried), the jobs are read back by `_id` and each one counts
//! as applied only if its document shows that transition's own result under its token,
//! or records it in `settled: {token, by}` — every final transition writes that field
//! in its own fenced update and nothing else touches it, so the proof survives the job
//! being claimed again (by another worker or claim loop) before the read-back.
//!
//! Limit: a job that was settled, claimed again *and settled again* by another claim
//! between the bulk and its read-back shows neither, and is reported as
//! [`Error::LeaseLost`] although its transition applied. One worker cannot do that to
//! itself (its writer reads back before it sends the next bulk); two workers can, within
//! one round trip.

use std::time::Duration;

use std::collections::HashMap;

use futures::TryStreamExt;
use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};

use super::claim::{LEASE_EXPIRED_REASON, STALLED_REASON};
use super::job::{ClaimedJob, JobState, field};
use super::ops::CANCELLED_REASON;
use super::options::Safeguard;
use super::{JobQueue, lease_lost};
use crate::backoff::Backoff;
use crate::clock::ServerTime;
use crate::error::{Error, Result};

/// Longest `last_error` stored, in bytes.
const MAX_ERROR_LEN: usize = 4096;

/// Largest progress value [`JobQueue::progress`] stores, in BSON bytes (16 KiB).
pub const MAX_PROGRESS_BYTES: usize = 16 * 1024;

/// Largest result a completion stores, in BSON bytes (1 MiB). A worker whose handler
/// returns more fails the attempt with the reason.
pub const MAX_RESULT_BYTES: usize = 1024 * 1024;

/// `value`'s size as stored under a key, or [`Error::InvalidInput`] naming `what` if it
/// is larger than `limit`.
fn check_size(what: &'static str, value: &Bson, limit: usize) -> Result<()> {
    let mut bytes = Vec::new();
    doc! { "v": value.clone() }
        .to_writer(&mut bytes)
        .map_err(|e| Error::invalid(what, format!("cannot be encoded as BSON: {e}")))?;
    if bytes.len() > limit {
        return Err(Error::invalid(
            what,
            format!("is {} bytes as BSON; the limit is {limit}", bytes.len()),
        ));
    }
    Ok(())
}

/// A handler's request to run its job again later without using an attempt: return it
/// as the handler's error (see [`snooze`]); the worker moves the job back to `ready`
/// (or `retrying`), due `after` from now (server time), and gives the attempt back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Snooze {
    /// How long from now the job becomes due again.
    pub after: Duration,
}

impl std::fmt::Display for Snooze {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "snoozed for {:?}", self.after)
    }
}

impl std::error::Error for Snooze {}

/// The handler result that snoozes the job: run it again `after` from now without
/// counting this attempt (`snoozes` is incremented instead).
///
/// ```no_run
/// # async fn handler(job: docwarden::queue::ClaimedJob) -> docwarden::queue::HandlerResult {
/// // The upstream is rate-limited: try again in a minute, this attempt does not count.
/// docwarden::queue::snooze(std::time::Duration::from_secs(60))
/// # }
/// ```
pub fn snooze(after: Duration) -> super::HandlerResult {
    Err(Box::new(Snooze { after }))
}

/// What [`JobQueue::fail`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailOutcome {
    /// The job will be tried again at `run_at` (server time).
    Retrying {
        /// When it becomes due again.
        run_at: DateTime,
        /// The delay chosen.
        delay: Duration,
    },
    /// The job used all its attempts and is dead; `last_error` is kept.
    Dead,
}

/// `error` cut to [`MAX_ERROR_LEN`] bytes (at a character boundary), as stored.
pub(super) fn clip(error: &str) -> String {
    if error.len() <= MAX_ERROR_LEN {
        error.to_owned()
    } else {
        format!("{}…", &error[..error.floor_char_boundary(MAX_ERROR_LEN)])
    }
}

/// A final transition of a claimed job, as the worker writes it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Transition {
    /// Succeeded with this result.
    Complete(Bson),
    /// The attempt failed with this error.
    Fail(String),
    /// Given back without counting the attempt.
    Release,
    /// Given back without counting the attempt, due again this many ms from now.
    Snooze(i64),
}

impl Transition {
    /// The name stored as `settled.by` when the transition applies.
    fn name(&self) -> &'static str {
        match self {
            Transition::Complete(_) => "complete",
            Transition::Fail(_) => "fail",
            Transition::Release => "release",
            Transition::Snooze(_) => "snooze",
        }
    }
}

/// A transition's update: update operators, or a pipeline (the completion).
enum Update {
    Operators(Document),
    Pipeline(Vec<Document>),
}

impl Update {
    /// As the `u` of an `update` command's statement.
    fn into_bson(self) -> Bson {
        match self {
            Update::Operators(d) => Bson::Document(d),
            Update::Pipeline(stages) => {
                Bson::Array(stages.into_iter().map(Bson::Document).collect())
            }
        }
    }
}

impl From<Update> for mongodb::options::UpdateModifications {
    fn from(u: Update) -> Self {
        match u {
            Update::Operators(d) => Self::Document(d),
            Update::Pipeline(stages) => Self::Pipeline(stages),
        }
    }
}

/// Most bytes of results and errors one bulk of transitions carries: a command is one
/// BSON document (16 MiB on MongoDB), and a result may be up to [`MAX_RESULT_BYTES`], so
/// a bulk of jobs with large results is sent as several commands.
const MAX_BULK_BYTES: usize = 8 * 1024 * 1024;

/// About how many bytes transition `t` adds to a bulk's command.
fn transition_bytes(t: &Transition) -> usize {
    let payload = match t {
        Transition::Complete(result) => {
            let mut bytes = Vec::new();
            match (doc! { "v": result.clone() }).to_writer(&mut bytes) {
                Ok(()) => bytes.len(),
                Err(_) => MAX_RESULT_BYTES,
            }
        }
        Transition::Fail(error) => error.len().min(MAX_ERROR_LEN),
        Transition::Release | Transition::Snooze(_) => 0,
    };
    payload + 512
}

/// `items` in consecutive chunks of at most [`MAX_BULK_BYTES`] (one item at least).
fn by_size(items: &[(ClaimedJob, Transition)]) -> Vec<&[(ClaimedJob, Transition)]> {
    let mut chunks = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, (_, t)) in items.iter().enumerate() {
        let b = transition_bytes(t);
        if i > start && bytes + b > MAX_BULK_BYTES {
            chunks.push(&items[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += b;
    }
    if start < items.len() {
        chunks.push(&items[start..]);
    }
    chunks
}

/// `settled: {token, by}`: which claim's final transition applied (see
/// [`field::SETTLED`]), written in the transition's own fenced update.
fn settled(token: &str, by: &str) -> Document {
    doc! { field::settled::TOKEN: token, field::settled::BY: by }
}

/// Whether the stored job `d` records transition `t` of claim `job` as the one that
/// settled it ([`field::SETTLED`]): proof that survives the job being claimed again.
fn settled_by(d: &Document, job: &ClaimedJob, t: &Transition) -> bool {
    d.get_document(field::SETTLED).is_ok_and(|s| {
        s.get_str(field::settled::TOKEN).ok() == Some(job.lease.token.as_str())
            && s.get_str(field::settled::BY).ok() == Some(t.name())
    })
}

/// One job's outcome in a bulk of transitions: the fail outcome for a failure, `None`
/// for a completion or a release, [`Error::LeaseLost`] if the claim no longer held it.
pub(crate) type Settled = Result<Option<FailOutcome>>;

/// What, beside the claim token, decides a transition's update: a completion's result
/// (its update is built from the token and the result alone), or the whole update of any
/// other transition, as BSON bytes (exact: `1` and `1.0`, or fields in another order, are
/// different values and get different statements).
#[derive(PartialEq, Eq, Hash)]
enum GroupKey {
    Complete(Vec<u8>),
    Update(Vec<u8>),
}

/// `value` as BSON bytes (the document `{v: value}`): a key that tells values apart
/// byte for byte, cheaper to make than their text.
fn value_bytes(value: &Bson) -> Vec<u8> {
    let mut d = Document::new();
    d.insert("v", value.clone());
    let mut bytes = Vec::new();
    // Writing into a `Vec` fails only for a key the value itself holds that BSON cannot
    // encode (a NUL byte); the statement would fail on the server then. Its debug text,
    // which also tells types and field order apart, keys it meanwhile.
    if d.to_writer(&mut bytes).is_err() {
        bytes = format!("{value:?}").into_bytes();
    }
    bytes
}

/// Jobs of one claim token that get the same update: one `multi` statement.
struct Group {
    token: String,
    update: Bson,
    /// What the stored job must also match for the update to apply ([`guard`]).
    guard: Option<Document>,
    ids: Vec<Bson>,
}

/// The integer BSON types, as a `$type` operand.
fn integer_types() -> Bson {
    Bson::Array(vec!["int".into(), "long".into()])
}

/// What the stored job must match, beyond the fence, for transition `t`'s update to be
/// right. A give-back (release, snooze) counts `attempts` down and `snoozes` up with
/// `$inc`, which on a hand-edited job either fails the whole update (a string, a null:
/// an untyped database error) or quietly stores what no claim parses again (a double,
/// or a missing `attempts` created as −1). So a give-back also matches `attempts` as an
/// integer and, snoozing, `snoozes` as an integer or absent; a job edited otherwise
/// matches nothing, keeps everything it had, and the read-back reports it as
/// [`Error::Malformed`] ([`refused_by_guard`]).
fn guard(t: &Transition) -> Option<Document> {
    match t {
        Transition::Release => Some(doc! { field::ATTEMPTS: { "$type": integer_types() } }),
        Transition::Snooze(_) => Some(doc! {
            field::ATTEMPTS: { "$type": integer_types() },
            "$or": [
                { field::SNOOZES: { "$exists": false } },
                { field::SNOOZES: { "$type": integer_types() } },
            ],
        }),
        Transition::Complete(_) | Transition::Fail(_) => None,
    }
}

/// Why transition `t` of claim `job` did not apply to the stored job `d`, if it was
/// [`guard`]'s refusal: `d` still runs under the claim, but a field the transition
/// counts with is not an integer. Nothing was written; the job stays running under the
/// claim until its lease expires (or the claim completes, fails or cancels it).
pub(crate) fn refused_by_guard(d: &Document, job: &ClaimedJob, t: &Transition) -> Option<Error> {
    guard(t)?;
    let token = d
        .get_document(field::LEASE)
        .ok()
        .and_then(|l| l.get_str(field::lease::TOKEN).ok());
    if d.get_str(field::STATE).ok() != Some(JobState::Running.as_str())
        || token != Some(job.lease.token.as_str())
    {
        return None;
    }
    let integer = |v: Option<&Bson>| matches!(v, Some(Bson::Int32(_) | Bson::Int64(_)));
    let found = |v: Option<&Bson>| {
        v.map_or_else(
            || "it is missing".to_owned(),
            |b| format!("found {}", super::job::type_name(b)),
        )
    };
    let mut problems = Vec::new();
    if !integer(d.get(field::ATTEMPTS)) {
        problems.push(format!(
            "`{}` must be an integer, {}",
            field::ATTEMPTS,
            found(d.get(field::ATTEMPTS))
        ));
    }
    if matches!(t, Transition::Snooze(_))
        && d.get(field::SNOOZES).is_some()
        && !integer(d.get(field::SNOOZES))
    {
        problems.push(format!(
            "`{}` must be an integer or absent, {}",
            field::SNOOZES,
            found(d.get(field::SNOOZES))
        ));
    }
    if problems.is_empty() {
        return None;
    }
    Some(Error::Malformed {
        id: job.id().to_hex(),
        reason: format!(
            "{} (edited while the job ran); the {} was not written and the job is unchanged, still running under this claim",
            problems.join("; "),
            t.name()
        ),
    })
}

/// `{q: {_id: {$in: ids}, state: "running", "lease.token": token}, u, multi: true}` per
/// group: `_id` first, so the server routes each statement by `_id`. With `unfenced`
/// (a control only, [`Safeguard::TransitionFence`] off) the state is not matched.
fn groups_to_statements(groups: Vec<Group>, unfenced: bool) -> Vec<Document> {
    groups
        .into_iter()
        .map(|g| {
            let mut q = doc! {
                field::ID: { "$in": g.ids },
                field::STATE: JobState::Running.as_str(),
                field::LEASE_TOKEN: g.token,
            };
            if unfenced {
                q.remove(field::STATE);
            }
            if let Some(guard) = g.guard {
                q.extend(guard);
            }
            doc! { "q": q, "u": g.update, "multi": true }
        })
        .collect()
}

/// A heartbeat's update: the lease until `until`, never earlier than stored (`$max`): a
/// heartbeat the worker stopped waiting for may land after a later one and must not move
/// the lease back (`tests/lock_late_renewal.rs`). A hand-edited `lease.until` of a type
/// that sorts before dates (a string, a number, `null`) is replaced by the date.
fn heartbeat_update(until: DateTime, at: DateTime) -> Document {
    doc! {
        "$max": { field::LEASE_UNTIL: until },
        "$set": { field::UPDATED_AT: at },
    }
}

/// Whether a claim still holds a job, as a heartbeat found it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Held {
    /// Running under the claim's token: the lease was extended.
    Yes,
    /// Cancelled while this claim held it (the token kept): signal the handler.
    Cancelled,
    /// Expired and swept, re-claimed, or gone.
    Lost,
}

/// A bulk of transitions as sent: each job's planned outcome and statement, and the
/// server's reply.
struct Sent {
    /// The outcome each job's transition has once applied, in input order.
    planned: Vec<Option<FailOutcome>>,
    /// Each job's statement (group) index, in input order.
    group_of: Vec<usize>,
    reply: BulkReply,
}

/// What one unordered bulk of fenced updates answered.
struct BulkReply {
    /// Documents the statements matched (each document by its own `_id` and fence).
    matched: usize,
    /// Statements the server refused, by index, with its message.
    refused: HashMap<usize, String>,
}

/// Whether the stored job `d` shows transition `t` of claim `job` as applied:
/// `Some(outcome)` only when it shows that transition's own result under our token.
///
/// "Our token, no longer running" is not enough: the sweep (lease expired) and an
/// operator's `cancel` keep the token. So each transition checks its target:
/// - complete: `succeeded` (only a fenced completion writes it);
/// - fail: `retrying` or `dead` as the attempt count decides, with our `last_error`
///   (the sweep's and the operator's reasons are fixed strings; a handler error equal to
///   one of them is never taken as proof);
/// - release: `ready` or `retrying` with the attempt given back (`attempts` one below
///   the claim's; the sweep and cancel keep `attempts`).
pub(crate) fn shows(d: &Document, job: &ClaimedJob, t: &Transition) -> Option<Option<FailOutcome>> {
    let token = d
        .get_document(field::LEASE)
        .ok()
        .and_then(|l| l.get_str(field::lease::TOKEN).ok());
    if token != Some(job.lease.token.as_str()) {
        return None;
    }
    let state = d.get_str(field::STATE).ok().and_then(JobState::parse);
    let last_error = d.get_str(field::LAST_ERROR).ok();
    let int = |key: &str| match d.get(key) {
        Some(Bson::Int64(n)) => Some(*n),
        Some(Bson::Int32(n)) => Some(i64::from(*n)),
        _ => None,
    };
    let attempts = int(field::ATTEMPTS);
    let snoozes = int(field::SNOOZES).unwrap_or(0);
    let follow_ups = int(field::FOLLOW_UPS).unwrap_or(0);
    let given_back = matches!(state, Some(JobState::Ready | JobState::Retrying))
        && attempts == Some(job.job.attempts - 1)
        && follow_ups == job.job.follow_ups;
    match t {
        // Succeeded, or turned into its follow-up run (`follow_ups` counted up).
        Transition::Complete(_) => (state == Some(JobState::Succeeded)
            || (state == Some(JobState::Ready) && follow_ups == job.job.follow_ups + 1))
            .then_some(None),
        Transition::Fail(text) => {
            let ours = clip(text);
            if ours == LEASE_EXPIRED_REASON
                || ours == STALLED_REASON
                || ours == CANCELLED_REASON
                || last_error != Some(ours.as_str())
            {
                None
            } else if job.job.attempts >= job.job.max_attempts {
                (state == Some(JobState::Dead)).then_some(Some(FailOutcome::Dead))
            } else if state == Some(JobState::Retrying) {
                let run_at = d
                    .get_datetime(field::RUN_AT)
                    .ok()
                    .copied()
                    .unwrap_or(job.job.run_at);
                let since = d
                    .get_datetime(field::UPDATED_AT)
                    .map(|u| u.timestamp_millis())
                    .unwrap_or(run_at.timestamp_millis());
                let delay = u64::try_from(run_at.timestamp_millis().saturating_sub(since))
                    .map(Duration::from_millis)
                    .unwrap_or_default();
                Some(Some(FailOutcome::Retrying { run_at, delay }))
            } else {
                None
            }
        }
        Transition::Release => (given_back && snoozes == job.job.snoozes).then_some(None),
        Transition::Snooze(_) => (given_back && snoozes == job.job.snoozes + 1).then_some(None),
    }
}

impl JobQueue {
    /// The update of transition `t` of `job` at server time `now`, and the outcome it
    /// has once applied. Every one also records `settled: {token, by}`
    /// ([`field::SETTLED`]), the proof a read-back finds even after the job was claimed
    /// again.
    fn transition_update(
        &self,
        job: &ClaimedJob,
        t: &Transition,
        now: &ServerTime,
    ) -> (Update, Option<FailOutcome>) {
        let at = now.estimate();
        let settled = settled(job.lease.token.as_str(), t.name());
        let (mut update, outcome) = match t {
            Transition::Complete(result) => {
                return (
                    Update::Pipeline(Self::complete_update(result, at, settled)),
                    None,
                );
            }
            Transition::Fail(error) => {
                let error = clip(error);
                if job.job.attempts >= job.job.max_attempts {
                    (
                        doc! { "$set": {
                            field::STATE: JobState::Dead.as_str(),
                            field::LAST_ERROR: error,
                            field::FINISHED_AT: at,
                            field::UPDATED_AT: at,
                        } },
                        Some(FailOutcome::Dead),
                    )
                } else {
                    let delay = self.retry_delay(job.job.attempts);
                    let run_at = now.plus_ms(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
                    (
                        doc! { "$set": {
                            field::STATE: JobState::Retrying.as_str(),
                            field::LAST_ERROR: error,
                            field::RUN_AT: run_at,
                            field::UPDATED_AT: at,
                        } },
                        Some(FailOutcome::Retrying { run_at, delay }),
                    )
                }
            }
            Transition::Release => (Self::give_back_update(job, at, None), None),
            Transition::Snooze(ms) => (
                Self::give_back_update(job, at, Some(now.plus_ms(*ms))),
                None,
            ),
        };
        if let Ok(set) = update.get_document_mut("$set") {
            set.insert(field::SETTLED, settled);
        }
        (Update::Operators(update), outcome)
    }

    /// The completion: one pipeline update, so a follow-up requested while the job ran
    /// (`follow_up`, see [`OnDuplicate::FollowUp`](super::OnDuplicate::FollowUp)) is
    /// consumed in the same write. Without one: `succeeded`, `result`, `finished_at`.
    /// With one: back to `ready` with the follow-up's payload, due now, `attempts: 0`,
    /// `follow_ups + 1`, `follow_up: null` (`result` keeps this run's).
    fn complete_update(result: &Bson, at: DateTime, settled: Document) -> Vec<Document> {
        let has = doc! { "$eq": [{ "$type": format!("${}", field::FOLLOW_UP) }, "object"] };
        let pick = |then: Bson, otherwise: Bson| doc! { "$cond": [has.clone(), then, otherwise] };
        let keep = |f: &str| Bson::String(format!("${f}"));
        let follow_ups = doc! { "$cond": [{ "$isNumber": keep(field::FOLLOW_UPS) }, keep(field::FOLLOW_UPS), 0_i64] };
        vec![doc! { "$set": {
            field::STATE: pick(JobState::Ready.as_str().into(), JobState::Succeeded.as_str().into()),
            field::RESULT: { "$literal": result.clone() },
            field::PAYLOAD: pick(
                format!("${}.{}", field::FOLLOW_UP, field::follow_up::PAYLOAD).into(),
                keep(field::PAYLOAD),
            ),
            field::ATTEMPTS: pick(Bson::Int64(0), keep(field::ATTEMPTS)),
            field::RUN_AT: pick(at.into(), keep(field::RUN_AT)),
            field::FINISHED_AT: pick(Bson::Null, at.into()),
            // Counting a follow-up run, a `follow_ups` that is not a number (absent, or a
            // hand edit) counts as 0, as the sweep counts `stalls`: `$add` on a string
            // failed the whole completion with an untyped database error.
            field::FOLLOW_UPS: pick(
                doc! { "$add": [follow_ups, 1_i64] }.into(),
                doc! { "$ifNull": [keep(field::FOLLOW_UPS), 0_i64] }.into(),
            ),
            field::FOLLOW_UP: Bson::Null,
            field::UPDATED_AT: at,
            field::SETTLED: { "$literal": settled },
        } }]
    }

    /// Release (`run_at` `None`: unchanged) or snooze (due at `run_at`, `snoozes + 1`):
    /// back to `ready` (`retrying` after earlier attempts) with the attempt given back.
    fn give_back_update(job: &ClaimedJob, at: DateTime, run_at: Option<DateTime>) -> Document {
        let state = if job.job.attempts <= 1 {
            JobState::Ready
        } else {
            JobState::Retrying
        };
        let mut set = doc! { field::STATE: state.as_str(), field::UPDATED_AT: at };
        let mut inc = doc! { field::ATTEMPTS: -1_i64 };
        if let Some(run_at) = run_at {
            set.insert(field::RUN_AT, run_at);
            inc.insert(field::SNOOZES, 1_i64);
        }
        doc! { "$set": set, "$inc": inc }
    }

    /// Sends `statements` (`{q, u}` documents, each `q` a fence by `_id`) as one
    /// unordered `update` command with the queue's write concern.
    async fn bulk_fenced(&self, statements: Vec<Document>) -> Result<BulkReply> {
        let reply = super::bulk::unordered_update(&self.inner.coll, statements).await?;
        Ok(BulkReply {
            matched: usize::try_from(reply.matched).unwrap_or(usize::MAX),
            refused: reply
                .refused
                .into_iter()
                .map(|r| {
                    (
                        r.index,
                        format!("write refused (code {}): {}", r.code, r.message),
                    )
                })
                .collect(),
        })
    }

    /// The stored jobs `ids`, by id (for the read-back after a short bulk).
    async fn read_back(&self, ids: Vec<ObjectId>) -> Result<HashMap<ObjectId, Document>> {
        let (primary, local) = super::latest();
        let docs: Vec<Document> = self
            .inner
            .coll
            .find(doc! { field::ID: { "$in": ids } })
            .selection_criteria(primary)
            .read_concern(local)
            .projection(doc! {
                field::ID: 1, field::STATE: 1, field::LEASE: 1, field::LAST_ERROR: 1,
                field::ATTEMPTS: 1, field::RUN_AT: 1, field::UPDATED_AT: 1,
                field::SNOOZES: 1, field::FOLLOW_UPS: 1, field::SETTLED: 1,
            })
            .await?
            .try_collect()
            .await?;
        Ok(docs
            .into_iter()
            .filter_map(|d| d.get_object_id(field::ID).ok().map(|id| (id, d)))
            .collect())
    }

    /// Writes the final transitions of many claimed jobs in one unordered bulk of
    /// per-job fenced updates (several commands when their results add up to more than
    /// [`MAX_BULK_BYTES`]), and returns each job's own outcome, in input order:
    /// `Ok(None)` (completed or released), `Ok(Some(outcome))` (failed), or
    /// [`Error::LeaseLost`] (nothing written for that job).
    ///
    /// Jobs of one claim share its token; jobs with the same token and the same update
    /// (a batch completed with the same result, released at shutdown) go in one
    /// statement `{_id: {$in: ids}, state: "running", "lease.token": token}` with
    /// `multi`, which fences every document by its own `_id`, state and token exactly as
    /// one statement per job would, at a fraction of the server's per-statement cost.
    /// When the bulk matched fewer jobs than it holds, or the server refused a
    /// statement, the jobs are read back (one find by `_id`) and a job counts as applied
    /// only if it shows its transition's result under its own token, so a retried bulk
    /// whose first reply was lost reports what did apply.
    ///
    /// # Errors
    /// A database error for the bulk as a whole (nothing is known of any job; retry
    /// it); a job whose statement the server refused carries [`Error::Malformed`] with
    /// the reason.
    #[tracing::instrument(name = "settle", skip_all, fields(queue = %self.collection().name(), jobs = items.len(), completed = tracing::field::Empty, failed = tracing::field::Empty, lost = tracing::field::Empty), level = "debug")]
    pub(crate) async fn settle_many(
        &self,
        items: &[(ClaimedJob, Transition)],
    ) -> Result<Vec<Settled>> {
        let outcomes = self.settle_unobserved(items).await?;
        crate::observe::settled(self.metrics_label(), items, &outcomes);
        Ok(outcomes)
    }

    async fn settle_unobserved(&self, items: &[(ClaimedJob, Transition)]) -> Result<Vec<Settled>> {
        let mut outcomes = Vec::with_capacity(items.len());
        // One command per chunk: a command is one BSON document, and results may be large.
        for chunk in by_size(items) {
            let sent = self.send_transitions(chunk).await?;
            outcomes.extend(self.resolve(chunk, sent).await?);
        }
        Ok(outcomes)
    }

    /// Sends the transitions of `items` as one unordered bulk: one `multi` statement per
    /// claim token and update.
    async fn send_transitions(&self, items: &[(ClaimedJob, Transition)]) -> Result<Sent> {
        let now = self.inner.time.now().await?;
        let mut planned = Vec::with_capacity(items.len());
        let mut groups: Vec<Group> = Vec::new();
        let mut by_key: HashMap<(&str, GroupKey), usize> = HashMap::new();
        let mut group_of = Vec::with_capacity(items.len());
        for (job, t) in items {
            // A completion's update depends only on its claim token and its result: its
            // pipeline is built once per group, not once per job (building it and
            // comparing its text per job was a quarter of a `Worker`'s client CPU).
            let (key, built) = match t {
                Transition::Complete(result) => (GroupKey::Complete(value_bytes(result)), None),
                _ => {
                    let (update, outcome) = self.transition_update(job, t, &now);
                    let update = update.into_bson();
                    (
                        GroupKey::Update(value_bytes(&update)),
                        Some((update, outcome)),
                    )
                }
            };
            let (update, outcome) = built.unzip();
            planned.push(outcome.flatten());
            let g = *by_key
                .entry((job.lease.token.as_str(), key))
                .or_insert_with(|| {
                    let update = update
                        .unwrap_or_else(|| self.transition_update(job, t, &now).0.into_bson());
                    groups.push(Group {
                        token: job.lease.token.as_str().to_owned(),
                        update,
                        guard: guard(t),
                        ids: Vec::new(),
                    });
                    groups.len() - 1
                });
            groups[g].ids.push(Bson::ObjectId(job.id()));
            group_of.push(g);
        }
        let unfenced = self.inner.options.unsafe_without == Some(Safeguard::TransitionFence);
        let reply = self
            .bulk_fenced(groups_to_statements(groups, unfenced))
            .await?;
        Ok(Sent {
            planned,
            group_of,
            reply,
        })
    }

    /// Each job's outcome of a sent bulk. A bulk that matched every job applied every
    /// transition; a short one is read back by `_id`, and a job counts as applied only if
    /// its document shows the transition's own result under our token ([`shows`]) or
    /// records it as the one that settled it, even if the job was claimed again since
    /// ([`field::SETTLED`]). A job that shows neither was not written: its lease was lost
    /// (or the server refused its statement, which is reported as such).
    async fn resolve(
        &self,
        items: &[(ClaimedJob, Transition)],
        sent: Sent,
    ) -> Result<Vec<Settled>> {
        let Sent {
            planned,
            group_of,
            reply,
        } = sent;
        if reply.matched == items.len() && reply.refused.is_empty() {
            return Ok(planned.into_iter().map(Ok).collect());
        }
        let stored = self
            .read_back(items.iter().map(|(j, _)| j.id()).collect())
            .await?;
        Ok(items
            .iter()
            .zip(group_of)
            .zip(planned)
            .map(|(((job, t), g), planned)| {
                let applied = stored.get(&job.id()).and_then(|d| {
                    shows(d, job, t).or_else(|| settled_by(d, job, t).then_some(planned))
                });
                if let Some(outcome) = applied {
                    return Ok(outcome);
                }
                // A hand-edited job the guard kept the transition off (still ours).
                if let Some(e) = stored
                    .get(&job.id())
                    .and_then(|d| refused_by_guard(d, job, t))
                {
                    return Err(e);
                }
                match reply.refused.get(&g) {
                    Some(reason) => Err(Error::Malformed {
                        id: job.id().to_hex(),
                        reason: reason.clone(),
                    }),
                    None => Err(lease_lost(&Bson::ObjectId(job.id()), &job.lease.token)),
                }
            })
            .collect())
    }

    /// Completes many claimed jobs in one unordered bulk of per-job fenced updates (jobs
    /// of one claim completed with the same result share one `multi` statement that
    /// fences each document by its own `_id`, state and token): each job's own outcome, in input order — `Ok(())`,
    /// [`Error::LeaseLost`] with nothing written for that job, or
    /// [`Error::InvalidInput`] for a result larger than [`MAX_RESULT_BYTES`] (as
    /// [`JobQueue::complete`]; that job is not sent, the others are).
    ///
    /// A claim given more than once (the same job under the same claim token) is
    /// completed once, by its first occurrence and with its result; every later
    /// occurrence is not sent and gets [`Error::InvalidInput`] (`what: "jobs"`), so each
    /// completion that applied is reported exactly once. (The same job under two
    /// different claims is not a duplicate: at most one of them still holds it, the
    /// other gets [`Error::LeaseLost`].)
    ///
    /// # Errors
    /// A database error for the bulk as a whole (retry it: a retried bulk reports what
    /// the lost attempt applied).
    pub async fn complete_many(&self, jobs: &[(ClaimedJob, Bson)]) -> Result<Vec<Result<()>>> {
        // `None`: sent in the bulk; `Some(e)`: refused before anything was sent.
        let mut refused: Vec<Option<Error>> = Vec::with_capacity(jobs.len());
        let mut items: Vec<(ClaimedJob, Transition)> = Vec::with_capacity(jobs.len());
        let mut seen: std::collections::HashSet<(ObjectId, &str)> =
            std::collections::HashSet::with_capacity(jobs.len());
        for (j, r) in jobs {
            if !seen.insert((j.id(), j.lease.token.as_str())) {
                refused.push(Some(Error::invalid(
                    "jobs",
                    format!(
                        "job {} is given more than once under the same claim; only its first occurrence was sent",
                        j.id().to_hex()
                    ),
                )));
                continue;
            }
            match check_size("result", r, MAX_RESULT_BYTES) {
                Ok(()) => {
                    items.push((j.clone(), Transition::Complete(r.clone())));
                    refused.push(None);
                }
                Err(e) => refused.push(Some(e)),
            }
        }
        let mut settled = self.settle_many(&items).await?.into_iter();
        Ok(refused
            .into_iter()
            .zip(jobs)
            .map(|(refused, (job, _))| match refused {
                Some(e) => Err(e),
                // `settle_many` answers one outcome per item, in order; were one missing,
                // the job would be reported as not completed by this call.
                None => settled.next().map_or_else(
                    || Err(lease_lost(&Bson::ObjectId(job.id()), &job.lease.token)),
                    |r| r.map(|_| ()),
                ),
            })
            .collect())
    }

    /// Extends the leases of many claimed jobs to `lease_ttl` from now (server time) in
    /// one unordered bulk of per-job fenced updates (one `multi` statement per claim
    /// token, fencing each document by its own `_id`, state and token), and says for each job, in input order,
    /// whether its claim still holds it (a short bulk is read back by `_id`). The
    /// permits of a job claimed with [`JobQueue::claim_limited`] are renewed first (one
    /// write per permit; none for a job without permits), and a job whose permit was
    /// lost counts as not held: stop it as a lost lease.
    ///
    /// # Errors
    /// A database error for the bulk as a whole.
    pub async fn heartbeat_many(&self, jobs: &[ClaimedJob]) -> Result<Vec<bool>> {
        // Permits first, so that a permit always outlives its job's lease (`queue/limit.rs`).
        let permits = self.renew_permits(jobs).await;
        Ok(self
            .heartbeat_detail(jobs, &[])
            .await?
            .into_iter()
            .zip(permits)
            .map(|(h, permit)| h == Held::Yes && permit)
            .collect())
    }

    /// [`JobQueue::heartbeat_many`], telling a job cancelled under this claim (an
    /// operator's cancel keeps the token: the handler is signalled, not dropped) from a
    /// lost one.
    #[tracing::instrument(name = "heartbeat", skip_all, fields(queue = %self.collection().name(), jobs = jobs.len(), lost = tracing::field::Empty), level = "debug")]
    ///
    /// `settling[i]` says that job `i`'s final transition is already on its way (the
    /// worker's writer): its own write may be what moved it, so it is not counted as a
    /// lease loss here (the transition's fenced write reports a real one).
    pub(crate) async fn heartbeat_detail(
        &self,
        jobs: &[ClaimedJob],
        settling: &[bool],
    ) -> Result<Vec<Held>> {
        let held = self.heartbeat_unobserved(jobs).await?;
        let counted: Vec<Held> = held
            .iter()
            .enumerate()
            .map(|(i, h)| match h {
                Held::Lost if settling.get(i) == Some(&true) => Held::Yes,
                h => *h,
            })
            .collect();
        crate::observe::heartbeats(self.metrics_label(), &counted);
        Ok(held)
    }

    async fn heartbeat_unobserved(&self, jobs: &[ClaimedJob]) -> Result<Vec<Held>> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let now = self.inner.time.now().await?;
        let until = now.plus_ms(self.inner.ttl_ms);
        let update = heartbeat_update(until, now.estimate());
        let mut groups: Vec<Group> = Vec::new();
        let mut by_token: HashMap<&str, usize> = HashMap::new();
        for job in jobs {
            let g = *by_token.entry(job.lease.token.as_str()).or_insert_with(|| {
                groups.push(Group {
                    token: job.lease.token.as_str().to_owned(),
                    update: Bson::Document(update.clone()),
                    guard: None,
                    ids: Vec::new(),
                });
                groups.len() - 1
            });
            groups[g].ids.push(Bson::ObjectId(job.id()));
        }
        let reply = self
            .bulk_fenced(groups_to_statements(groups, false))
            .await?;
        if reply.matched == jobs.len() {
            return Ok(vec![Held::Yes; jobs.len()]);
        }
        let stored = self
            .read_back(jobs.iter().map(ClaimedJob::id).collect())
            .await?;
        Ok(jobs
            .iter()
            .map(|job| {
                let Some(d) = stored.get(&job.id()) else {
                    return Held::Lost;
                };
                let ours = d
                    .get_document(field::LEASE)
                    .ok()
                    .and_then(|l| l.get_str(field::lease::TOKEN).ok())
                    == Some(job.lease.token.as_str());
                match d.get_str(field::STATE).ok().and_then(JobState::parse) {
                    Some(JobState::Running) if ours => Held::Yes,
                    Some(JobState::Cancelled) if ours => Held::Cancelled,
                    _ => Held::Lost,
                }
            })
            .collect())
    }

    async fn fenced(
        &self,
        job: &ClaimedJob,
        update: impl Into<mongodb::options::UpdateModifications>,
    ) -> Result<()> {
        self.fenced_guarded(job, None, update).await
    }

    /// [`JobQueue::fenced`] for transition `t` (`None`: not a transition), with its
    /// [`guard`] in the filter. When a guarded update matches nothing, the job is read
    /// back: [`Error::Malformed`] if the guard refused it ([`refused_by_guard`]), else
    /// [`Error::LeaseLost`].
    async fn fenced_guarded(
        &self,
        job: &ClaimedJob,
        t: Option<&Transition>,
        update: impl Into<mongodb::options::UpdateModifications>,
    ) -> Result<()> {
        let mut filter =
            super::job::fence_filter(&Bson::ObjectId(job.id()), job.lease.token.as_str());
        let guard = t.and_then(guard);
        if let Some(g) = guard.clone() {
            filter.extend(g);
        }
        let r = self.inner.coll.update_one(filter, update).await?;
        if r.matched_count == 1 {
            return Ok(());
        }
        if let Some(t) = t.filter(|_| guard.is_some())
            && let Some(d) = self.read_back(vec![job.id()]).await?.get(&job.id())
            && let Some(e) = refused_by_guard(d, job, t)
        {
            return Err(e);
        }
        crate::observe::lease_lost(self.metrics_label());
        Err(lease_lost(&Bson::ObjectId(job.job.id), &job.lease.token))
    }

    /// Extends the lease to `lease_ttl` from now (server time) and returns the new
    /// expiry. The permits of a job claimed with [`JobQueue::claim_limited`] are renewed
    /// first (one write per permit; none for a job without permits).
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the claim no longer holds the
    /// job, or a permit of a limited job was lost (stop the job); a database error.
    pub async fn heartbeat(&self, job: &ClaimedJob) -> Result<DateTime> {
        // Permits first, so that a permit always outlives its job's lease (`queue/limit.rs`).
        if self.renew_permits(std::slice::from_ref(job)).await != [true] {
            crate::observe::lease_lost(self.metrics_label());
            return Err(lease_lost(&Bson::ObjectId(job.id()), &job.lease.token));
        }
        let now = self.inner.time.now().await?;
        let until = now.plus_ms(self.inner.ttl_ms);
        self.fenced(job, heartbeat_update(until, now.estimate()))
            .await?;
        Ok(until)
    }

    /// Marks the job succeeded and stores `result`.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the claim no longer holds the
    /// job (nothing written); a database error.
    #[tracing::instrument(skip(self, job, result), fields(job = %job.job.id), level = "debug")]
    pub async fn complete(&self, job: &ClaimedJob, result: impl Into<Bson>) -> Result<()> {
        let result = result.into();
        check_size("result", &result, MAX_RESULT_BYTES)?;
        self.settle_one(job, &Transition::Complete(result)).await?;
        crate::observe::completed(self.metrics_label());
        Ok(())
    }

    /// Writes transition `t` of `job` alone: one fenced `updateOne`.
    async fn settle_one(&self, job: &ClaimedJob, t: &Transition) -> Result<Option<FailOutcome>> {
        let now = self.inner.time.now().await?;
        let (update, outcome) = self.transition_update(job, t, &now);
        self.fenced_guarded(job, Some(t), update).await?;
        Ok(outcome)
    }

    /// Records the handler's progress (any BSON value of at most
    /// [`MAX_PROGRESS_BYTES`]) in the job's `progress`, under the claim's fence: visible
    /// to `docwarden queue list`/`show` and [`JobQueue::get`] while the job runs, and
    /// kept after it finishes.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a value larger than [`MAX_PROGRESS_BYTES`] (nothing
    /// sent); [`Error::LeaseLost`] if the claim no longer holds the job (cancelled,
    /// expired: a handler can take it as a signal to stop); a database error.
    pub async fn progress(&self, job: &ClaimedJob, progress: impl Into<Bson>) -> Result<()> {
        let progress = progress.into();
        check_size("progress", &progress, MAX_PROGRESS_BYTES)?;
        let now = self.inner.time.now().await?.estimate();
        self.fenced(
            job,
            doc! { "$set": { field::PROGRESS: progress, field::UPDATED_AT: now } },
        )
        .await
    }

    /// Snoozes the job: back to `ready` (`retrying` after earlier attempts), due `after`
    /// from now (server time), the attempt given back and `snoozes` counted up. A worker
    /// does this when its handler returns [`snooze`].
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a delay too long to express in ms; [`Error::LeaseLost`]
    /// if the claim no longer holds the job; [`Error::Malformed`] if it does but its
    /// `attempts` (or `snoozes`) was edited into something other than an integer
    /// (nothing written, the job unchanged); a database error.
    pub async fn snooze(&self, job: &ClaimedJob, after: Duration) -> Result<DateTime> {
        let ms = i64::try_from(after.as_millis())
            .map_err(|_| Error::invalid("snooze", "is too long"))?;
        let now = self.inner.time.now().await?;
        let snooze = Transition::Snooze(ms);
        let (update, _) = self.transition_update(job, &snooze, &now);
        self.fenced_guarded(job, Some(&snooze), update).await?;
        Ok(now.plus_ms(ms))
    }

    /// The retry delay after the `attempt`-th attempt failed (1-based): exponential from
    /// `retry_base` up to `retry_max`, with "equal jitter" (uniform in the upper half of
    /// the cap), so delays grow with every attempt yet retries of many jobs spread out.
    pub fn retry_delay(&self, attempt: i64) -> Duration {
        let o = &self.inner.options;
        let cap = Backoff::new(o.retry_base, o.retry_max)
            .map(|b| b.cap(u32::try_from(attempt.saturating_sub(1).max(0)).unwrap_or(u32::MAX)))
            .unwrap_or(o.retry_max);
        let half = cap / 2;
        half + half.mul_f64(rand::random::<f64>())
    }

    /// Records a failure: the job goes to `retrying` with a backoff delay, or to `dead`
    /// once it has used `max_attempts`; `error` is kept as `last_error` either way.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the claim no longer holds the
    /// job (nothing written); a database error.
    #[tracing::instrument(skip(self, job), fields(job = %job.job.id), level = "debug")]
    pub async fn fail(&self, job: &ClaimedJob, error: &str) -> Result<FailOutcome> {
        // `transition_update` gives every failure an outcome; `Dead` is never reached here.
        let outcome = self
            .settle_one(job, &Transition::Fail(error.to_owned()))
            .await?
            .unwrap_or(FailOutcome::Dead);
        crate::observe::failed(self.metrics_label(), &outcome);
        Ok(outcome)
    }

    /// Gives the job back without counting the attempt: it is claimable again at once
    /// (graceful shutdown uses this).
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the claim no longer holds the job; [`Error::Malformed`]
    /// if it does but its `attempts` was edited into something other than an integer
    /// (nothing written, the job unchanged); a database error.
    pub async fn release(&self, job: &ClaimedJob) -> Result<()> {
        self.settle_one(job, &Transition::Release).await.map(|_| ())
    }

    /// Cancels the job this claim holds, keeping `reason` as `last_error`.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the claim no longer holds the
    /// job; a database error.
    pub async fn cancel_claimed(&self, job: &ClaimedJob, reason: &str) -> Result<()> {
        let now = self.inner.time.now().await?.estimate();
        self.fenced(
            job,
            doc! { "$set": {
                field::STATE: JobState::Cancelled.as_str(),
                field::LAST_ERROR: clip(reason),
                field::FINISHED_AT: now,
                field::UPDATED_AT: now,
                field::SETTLED: settled(job.lease.token.as_str(), "cancel"),
            } },
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use docwarden_testkit::TestDb;
    use mongodb::bson::{Bson, DateTime, doc};

    use super::{FailOutcome, Transition};
    use crate::clock::{ClockOptions, TimeSource};
    use crate::error::Error;
    use crate::queue::job::field;
    use crate::queue::{EnqueueOptions, JobQueue, QueueOptions};

    /// CI run of 2026-11-23 (`tests/metrics.rs`, lease losses 8 ≠ stalls 5): a bulk of
    /// transitions fell short because one job's lease was lost, and the read-back found
    /// jobs whose failure *had* applied already claimed again by the worker's other claim
    /// loop (a new token in `lease`), so it reported them as lease losses. With
    /// `settled: {token, by}` the read-back finds its proof after the re-claim. (Fails
    /// without the `settled_by` check in `resolve`: the released and failed jobs come back
    /// `LeaseLost`.)
    #[tokio::test]
    async fn a_job_claimed_again_before_the_read_back_still_counts_as_settled() -> anyhow::Result<()>
    {
        let t = TestDb::new("queue_settle_reclaimed").await?;
        let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
        let opts = QueueOptions::default()
            .retry_delays(Duration::from_millis(1), Duration::from_millis(2))
            .reap_interval(Duration::from_secs(3600))
            .partitions(1);
        let q = JobQueue::open(&t.db, "jobs", time, opts).await?;
        let enqueue = EnqueueOptions::default().max_attempts(5);
        q.enqueue_many((0..3).map(|i| (doc! { "i": i }, enqueue.clone())))
            .await?;
        let jobs = q.claim_batch("w", 3).await?;
        anyhow::ensure!(jobs.len() == 3, "claimed {} jobs", jobs.len());
        // The third job's lease expires and the sweep takes it back: its completion is
        // refused, so the bulk falls short and is read back.
        q.collection()
            .update_one(
                doc! { "_id": jobs[2].id() },
                doc! { "$set": { field::LEASE_UNTIL: DateTime::from_millis(0) } },
            )
            .await?;
        assert_eq!(q.reap_expired().await?, 1);
        let items = vec![
            (jobs[0].clone(), Transition::Release),
            (jobs[1].clone(), Transition::Fail("boom".into())),
            (jobs[2].clone(), Transition::Complete(Bson::Null)),
        ];
        let sent = q.send_transitions(&items).await?;
        assert_eq!(sent.reply.matched, 2);
        // Between the reply and the read-back another claim takes all three again.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let again = q.claim_batch("other", 3).await?;
        assert_eq!(again.len(), 3, "every job claimable again");
        let outcomes = q.resolve(&items, sent).await?;
        assert!(
            matches!(outcomes[0], Ok(None)),
            "release: {:?}",
            outcomes[0]
        );
        assert!(
            matches!(outcomes[1], Ok(Some(FailOutcome::Retrying { .. }))),
            "fail: {:?}",
            outcomes[1]
        );
        assert!(
            matches!(outcomes[2], Err(Error::LeaseLost { .. })),
            "the swept job's completion: {:?}",
            outcomes[2]
        );
        Ok(())
    }
}
