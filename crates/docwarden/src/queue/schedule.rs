//! Periodic jobs: schedules stored in `<collection>.schedules`, one job per tick.
//!
//! **Guarantee:** each tick of a schedule is enqueued at most once, however many
//! schedulers run and however often they restart: the job for tick `T` gets a
//! deterministic `_id` derived from (schedule name, `T`), so a second insert of that
//! tick is a duplicate-key no-op, and the schedule's `last_tick` advances from the tick
//! before to `T` by compare-and-set after the insert, so no scheduler enqueues a tick at
//! or before `last_tick` again. A tick is never lost while at least one scheduler runs
//! within the missed-tick policy's reach: a scheduler that dies between the insert and
//! the compare-and-set leaves `last_tick` behind, and the next one re-inserts the same
//! tick (a no-op) and advances it. Cron expressions are evaluated in the schedule's
//! IANA time zone (daylight-saving gaps and repeats as `croner` defines them).
//!
//! **Limits:** a scheduler that pauses between reading `last_tick` and inserting a tick
//! that others have enqueued meanwhile re-inserts it only as a no-op — unless the job was
//! purged in between ([`JobQueue::purge`] with an age shorter than the pause): purge
//! finished periodic jobs only well after they finished. With
//! [`MissedTicks::Skip`], such a late scheduler may enqueue a tick that a faster one had
//! skipped (still at most once). Ticks are enqueued by the server clock's estimate
//! ([`crate::clock::TimeSource`]), up to the scheduler's poll period after they are due.
//! `docs/queue.md` ("Periodic jobs") describes the documents for other languages.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::TryStreamExt;
use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};
use mongodb::{Collection, Database};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::JobQueue;
use super::job::field;
use super::options::{EnqueueOptions, RunAt, Safeguard};
use crate::backoff::Backoff;
use crate::error::{Error, Result, is_duplicate_key};
use crate::format::schedule::{SCHEDULES_SUFFIX, missed, schedule_field as sf};
use crate::validate;

/// Most ticks one catch-up enqueues ([`MissedTicks::CatchUp`]).
pub const MAX_CATCH_UP: u32 = 10_000;

/// Most compare-and-set rounds of one schedule in one pass.
const MAX_ROUNDS: usize = 64;

/// When a schedule ticks.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ScheduleSpec {
    /// Every `every`, from the schedule's creation (its `anchor`).
    Every(Duration),
    /// A cron expression (5 fields, 6 with seconds first, or 7 with seconds first and a
    /// year last, as the `croner` crate parses them) in an IANA time zone.
    Cron {
        /// The expression, e.g. `0 9 * * 1-5`.
        expr: String,
        /// The time zone, e.g. `Europe/Paris` or `UTC`.
        timezone: String,
    },
}

impl ScheduleSpec {
    /// An interval schedule.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an interval under 1 ms or too long.
    pub fn every(d: Duration) -> Result<Self> {
        validate::duration_ms("schedule interval", d)?;
        Ok(ScheduleSpec::Every(d))
    }

    /// A cron schedule in `timezone` (validated: the expression parses, the zone is
    /// known, and the expression has a next occurrence in that zone).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad expression or zone, or an expression that never
    /// fires (`0 0 31 2 *`: 31 February).
    pub fn cron(expr: &str, timezone: &str) -> Result<Self> {
        let spec = ScheduleSpec::Cron {
            expr: expr.to_owned(),
            timezone: timezone.to_owned(),
        };
        spec.validate()?;
        Ok(spec)
    }

    fn validate(&self) -> Result<()> {
        match self {
            ScheduleSpec::Every(d) => validate::duration_ms("schedule interval", *d).map(|_| ()),
            ScheduleSpec::Cron { expr, timezone } => {
                let cron = parse_cron(expr)?;
                let tz = parse_tz(timezone)?;
                // An expression that parses but names no date that exists (`0 0 31 2 *`,
                // 31 February) would be stored and never tick: refuse it here.
                let now = chrono::Utc::now().with_timezone(&tz);
                cron.find_next_occurrence(&now, false).map_err(|e| {
                    Error::invalid(
                        "cron expression",
                        format!("`{expr}` never fires in {timezone}: {e}"),
                    )
                })?;
                Ok(())
            }
        }
    }
}

impl std::fmt::Display for ScheduleSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScheduleSpec::Every(d) => write!(f, "every {} ms", d.as_millis()),
            ScheduleSpec::Cron { expr, timezone } => write!(f, "cron `{expr}` ({timezone})"),
        }
    }
}

fn parse_cron(expr: &str) -> Result<croner::Cron> {
    croner::Cron::from_str(expr)
        .map_err(|e| Error::invalid("cron expression", format!("`{expr}`: {e}")))
}

fn parse_tz(tz: &str) -> Result<chrono_tz::Tz> {
    tz.parse::<chrono_tz::Tz>()
        .map_err(|_| Error::invalid("time zone", format!("`{tz}` is not an IANA time zone")))
}

/// What a scheduler does with ticks that fell due while no scheduler ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissedTicks {
    /// Enqueue only the latest due tick; the earlier ones are skipped.
    Skip,
    /// Enqueue up to this many of the latest due ticks, oldest first (at most
    /// [`MAX_CATCH_UP`]); older ones are skipped.
    CatchUp(u32),
}

/// A schedule: a name (unique per queue collection), when it ticks, and the template
/// of the job it enqueues for each tick.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Schedule {
    /// The schedule's name (its `_id`).
    pub name: String,
    /// When it ticks.
    pub spec: ScheduleSpec,
    /// The payload of every job.
    pub payload: Bson,
    /// The priority of every job. Default 0.
    pub priority: i64,
    /// `max_attempts` of every job; `None`: the queue's default.
    pub max_attempts: Option<u32>,
    /// The missed-tick policy. Default [`MissedTicks::Skip`].
    pub missed: MissedTicks,
}

impl Schedule {
    /// A schedule named `name` ticking by `spec`, enqueuing `payload`.
    pub fn new(name: impl Into<String>, spec: ScheduleSpec, payload: impl Into<Bson>) -> Self {
        Schedule {
            name: name.into(),
            spec,
            payload: payload.into(),
            priority: 0,
            max_attempts: None,
            missed: MissedTicks::Skip,
        }
    }
    /// Sets [`Schedule::priority`].
    pub fn priority(mut self, p: i64) -> Self {
        self.priority = p;
        self
    }
    /// Sets [`Schedule::max_attempts`].
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n);
        self
    }
    /// Sets [`Schedule::missed`].
    pub fn missed(mut self, policy: MissedTicks) -> Self {
        self.missed = policy;
        self
    }

    fn validate(&self) -> Result<()> {
        validate::name("schedule name", &self.name)?;
        self.spec.validate()?;
        if self.max_attempts == Some(0) {
            return Err(Error::invalid("max attempts", "must be at least 1"));
        }
        if let MissedTicks::CatchUp(n) = self.missed
            && !(1..=MAX_CATCH_UP).contains(&n)
        {
            return Err(Error::invalid(
                "catch up",
                format!("must be between 1 and {MAX_CATCH_UP}"),
            ));
        }
        Ok(())
    }
}

/// A stored schedule, as [`JobQueue::schedules`] lists it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Scheduled {
    /// The schedule's name.
    pub name: String,
    /// Its queue (`default` for the default queue).
    pub queue: String,
    /// When it ticks.
    pub spec: ScheduleSpec,
    /// The missed-tick policy.
    pub missed: MissedTicks,
    /// The last tick enqueued (or the creation time before the first).
    pub last_tick: DateTime,
    /// The next tick after `last_tick`.
    pub next_tick: Option<DateTime>,
}

/// What one pass over a queue's schedules did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct SchedulerReport {
    /// Ticks whose job this scheduler inserted.
    pub enqueued: u64,
    /// Ticks another scheduler had inserted already (duplicate-key no-ops).
    pub duplicates: u64,
    /// Due ticks skipped by the missed-tick policy.
    pub skipped: u64,
    /// Passes that failed (a database error; retried after a backoff, see
    /// [`Scheduler::spawn`]), and schedules a pass skipped because their document does
    /// not parse or their tick cannot be enqueued (a hand edit: a payload too large for a
    /// job, a tick before 1970); the pass goes on with the other schedules, and each is
    /// logged.
    pub errors: u64,
}

/// What happened to one tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TickOutcome {
    /// The tick's job was inserted by this call.
    Enqueued(DateTime),
    /// The tick's job existed already (another scheduler inserted it).
    Duplicate(DateTime),
}

/// The deterministic `_id` of the job of schedule `name`'s tick `tick`: bytes 0–3 are
/// the tick's Unix seconds (so the id's timestamp is the tick), 4–5 its milliseconds,
/// 6–11 the first six bytes of the 64-bit FNV-1a hash of the name (`docs/queue.md`).
///
/// # Errors
/// [`Error::InvalidInput`] for a tick before 1970 or after 2106.
pub fn tick_job_id(name: &str, tick: DateTime) -> Result<ObjectId> {
    let ms = tick.timestamp_millis();
    let secs = u32::try_from(ms.div_euclid(1000))
        .map_err(|_| Error::invalid("tick", "must be between 1970 and 2106"))?;
    let frac = u16::try_from(ms.rem_euclid(1000)).unwrap_or(0);
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.as_bytes() {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    let mut bytes = [0_u8; 12];
    bytes[0..4].copy_from_slice(&secs.to_be_bytes());
    bytes[4..6].copy_from_slice(&frac.to_be_bytes());
    bytes[6..12].copy_from_slice(&hash.to_be_bytes()[0..6]);
    Ok(ObjectId::from_bytes(bytes))
}

fn ms_of(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Parses a stored schedule document (`None` if it is not one docwarden can run).
fn parse(d: &Document) -> Result<(Schedule, String, DateTime, DateTime)> {
    let bad = |reason: String| Error::Malformed {
        id: d.get_str(sf::ID).unwrap_or("?").to_owned(),
        reason,
    };
    let name = d
        .get_str(sf::ID)
        .map_err(|_| bad("`_id` must be a string".into()))?
        .to_owned();
    // int32 is read like int64 (as every integer of the stored formats): tools such as
    // the Node.js driver store small whole numbers as int32.
    let every_ms = match d.get(sf::EVERY_MS) {
        Some(Bson::Int64(n)) => Some(*n),
        Some(Bson::Int32(n)) => Some(i64::from(*n)),
        _ => None,
    };
    let spec = match (d.get(sf::CRON), every_ms) {
        (Some(Bson::String(expr)), _) => ScheduleSpec::Cron {
            expr: expr.clone(),
            timezone: d.get_str(sf::TIMEZONE).unwrap_or("UTC").to_owned(),
        },
        (_, Some(ms)) if ms > 0 => {
            ScheduleSpec::Every(Duration::from_millis(u64::try_from(ms).unwrap_or(1)))
        }
        _ => return Err(bad("neither `cron` nor a positive `every_ms`".into())),
    };
    spec.validate()?;
    let missed = match d.get_str(sf::MISSED) {
        Ok(m) if m == missed::CATCH_UP => {
            let n = match d.get(sf::CATCH_UP) {
                Some(Bson::Int64(n)) => u32::try_from(*n).unwrap_or(MAX_CATCH_UP),
                Some(Bson::Int32(n)) => u32::try_from(*n).unwrap_or(MAX_CATCH_UP),
                _ => 1,
            };
            MissedTicks::CatchUp(n.clamp(1, MAX_CATCH_UP))
        }
        _ => MissedTicks::Skip,
    };
    let max_attempts = match d.get(sf::MAX_ATTEMPTS) {
        Some(Bson::Int64(n)) => u32::try_from(*n).ok().filter(|n| *n > 0),
        Some(Bson::Int32(n)) => u32::try_from(*n).ok().filter(|n| *n > 0),
        _ => None,
    };
    let priority = match d.get(sf::PRIORITY) {
        Some(Bson::Int64(p)) => *p,
        Some(Bson::Int32(p)) => i64::from(*p),
        _ => 0,
    };
    let last_tick = *d
        .get_datetime(sf::LAST_TICK)
        .map_err(|_| bad("`last_tick` must be a date".into()))?;
    let anchor = d.get_datetime(sf::ANCHOR).copied().unwrap_or(last_tick);
    let queue = match d.get(sf::QUEUE) {
        Some(Bson::String(q)) => q.clone(),
        _ => crate::format::schedule::DEFAULT_QUEUE.to_owned(),
    };
    let s = Schedule {
        name,
        spec,
        payload: d.get(sf::PAYLOAD).cloned().unwrap_or(Bson::Null),
        priority,
        max_attempts,
        missed,
    };
    Ok((s, queue, last_tick, anchor))
}

/// The due ticks after `last` and at or before `now`, oldest first: at most `keep` of
/// the latest, and how many earlier ones were skipped.
fn due_ticks(
    spec: &ScheduleSpec,
    anchor: DateTime,
    last: DateTime,
    now: DateTime,
    keep: u32,
) -> Result<(Vec<DateTime>, u64)> {
    let (last, now) = (last.timestamp_millis(), now.timestamp_millis());
    if now <= last {
        return Ok((Vec::new(), 0));
    }
    match spec {
        ScheduleSpec::Every(d) => {
            let every = ms_of(*d).max(1);
            let anchor = anchor.timestamp_millis();
            let k_of = |t: i64| (t.saturating_sub(anchor)).div_euclid(every);
            let k_now = k_of(now);
            let k_last = k_of(last);
            if k_now <= k_last {
                return Ok((Vec::new(), 0));
            }
            let due = k_now - k_last;
            let take = due.min(i64::from(keep));
            let ticks = ((k_now - take + 1)..=k_now)
                .map(|k| DateTime::from_millis(anchor.saturating_add(k.saturating_mul(every))))
                .collect();
            Ok((ticks, u64::try_from(due - take).unwrap_or(0)))
        }
        ScheduleSpec::Cron { expr, timezone } => {
            let cron = parse_cron(expr)?;
            let tz = parse_tz(timezone)?;
            let at = |ms: i64| {
                chrono::DateTime::from_timestamp_millis(ms)
                    .map(|t| t.with_timezone(&tz))
                    .ok_or_else(|| Error::invalid("tick", "out of range"))
            };
            // Walk back from now: the latest `keep` occurrences after `last`.
            let mut ticks = Vec::new();
            let mut cursor = at(now)?;
            let mut inclusive = true;
            while ticks.len() < keep as usize {
                let Ok(prev) = cron.find_previous_occurrence(&cursor, inclusive) else {
                    break;
                };
                if prev.timestamp_millis() <= last {
                    break;
                }
                ticks.push(DateTime::from_millis(prev.timestamp_millis()));
                cursor = prev;
                inclusive = false;
            }
            // Count what lies before them (skipped), walking forward from `last`, bounded.
            let mut skipped = 0_u64;
            if let Some(oldest) = ticks.last().map(|t| t.timestamp_millis()) {
                let mut c = at(last)?;
                while let Ok(next) = cron.find_next_occurrence(&c, false) {
                    if next.timestamp_millis() >= oldest || skipped >= 1_000_000 {
                        break;
                    }
                    skipped += 1;
                    c = next;
                }
            }
            ticks.reverse();
            Ok((ticks, skipped))
        }
    }
}

/// The first tick after `last`.
fn next_tick(spec: &ScheduleSpec, anchor: DateTime, last: DateTime) -> Option<DateTime> {
    match spec {
        ScheduleSpec::Every(d) => {
            let every = ms_of(*d).max(1);
            let a = anchor.timestamp_millis();
            let k = (last.timestamp_millis().saturating_sub(a)).div_euclid(every) + 1;
            Some(DateTime::from_millis(
                a.saturating_add(k.saturating_mul(every)),
            ))
        }
        ScheduleSpec::Cron { expr, timezone } => {
            let cron = parse_cron(expr).ok()?;
            let tz = parse_tz(timezone).ok()?;
            let t = chrono::DateTime::from_timestamp_millis(last.timestamp_millis())?
                .with_timezone(&tz);
            cron.find_next_occurrence(&t, false)
                .ok()
                .map(|n| DateTime::from_millis(n.timestamp_millis()))
        }
    }
}

impl JobQueue {
    /// The collection of this queue collection's schedules (`<collection>.schedules`).
    fn schedules_coll(&self) -> Collection<Document> {
        let db = self
            .collection()
            .client()
            .database(&self.collection().namespace().db);
        schedules_collection(&db, self.collection().name(), self.meta())
    }

    /// Creates or replaces schedule `s.name` on this handle's queue. Replacing keeps the
    /// schedule's `last_tick` and `anchor` (no tick is enqueued twice across a
    /// replacement); a new schedule's first tick is its first one after now. Schedule
    /// names are unique per collection: a name another queue's schedule holds is
    /// refused, never taken over (that schedule, and its queue's ticks, stay as they
    /// are).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad name, spec, or template (a payload too large for
    /// a job, as [`JobQueue::enqueue`] refuses it), or a name held by a schedule of
    /// another queue (`what: "schedule name"`); a database error.
    pub async fn schedule(&self, s: &Schedule) -> Result<()> {
        s.validate()?;
        // The template as a tick's job (checked the way every tick will be): a payload
        // no tick could enqueue is refused here, not at every pass.
        self.new_job(s.payload.clone(), &tick_options(s)).await?;
        let now = self.time().now().await?.estimate();
        let mut set = doc! {
            sf::QUEUE: self.queue_value(),
            sf::PAYLOAD: s.payload.clone(),
            sf::PRIORITY: s.priority,
            sf::MAX_ATTEMPTS: s.max_attempts.map_or(Bson::Null, |n| Bson::Int64(i64::from(n))),
            sf::UPDATED_AT: now,
        };
        let mut unset = Document::new();
        match &s.spec {
            ScheduleSpec::Every(d) => {
                set.insert(sf::EVERY_MS, ms_of(*d));
                unset.insert(sf::CRON, "");
                unset.insert(sf::TIMEZONE, "");
            }
            ScheduleSpec::Cron { expr, timezone } => {
                set.insert(sf::CRON, expr.clone());
                set.insert(sf::TIMEZONE, timezone.clone());
                unset.insert(sf::EVERY_MS, "");
            }
        }
        match s.missed {
            MissedTicks::Skip => {
                set.insert(sf::MISSED, missed::SKIP);
                unset.insert(sf::CATCH_UP, "");
            }
            MissedTicks::CatchUp(n) => {
                set.insert(sf::MISSED, missed::CATCH_UP);
                set.insert(sf::CATCH_UP, i64::from(n));
            }
        }
        // `{_id, queue}`: a schedule of this name in another queue does not match, and the
        // upsert's insert of the same `_id` is refused as a duplicate key.
        let written = self
            .schedules_coll()
            .update_one(
                doc! { sf::ID: &s.name, sf::QUEUE: self.queue_value() },
                doc! {
                    "$set": set,
                    "$unset": unset,
                    "$setOnInsert": { sf::LAST_TICK: now, sf::ANCHOR: now },
                },
            )
            .upsert(true)
            .await;
        match written {
            Ok(_) => Ok(()),
            Err(e) if is_duplicate_key(&e) => {
                let holder = self
                    .schedules_coll()
                    .find_one(doc! { sf::ID: &s.name })
                    .projection(doc! { sf::QUEUE: 1 })
                    .await?
                    .map(|d| match d.get(sf::QUEUE) {
                        Some(Bson::String(q)) => format!("queue `{q}`"),
                        _ => "the default queue".to_owned(),
                    })
                    .unwrap_or_else(|| "another queue".to_owned());
                Err(Error::invalid(
                    "schedule name",
                    format!(
                        "`{}` is a schedule of {holder} (schedule names are unique per collection); nothing was changed",
                        s.name
                    ),
                ))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Deletes schedule `name`; returns whether it existed. Jobs it enqueued stay.
    ///
    /// # Errors
    /// A database error.
    pub async fn unschedule(&self, name: &str) -> Result<bool> {
        let r = self
            .schedules_coll()
            .delete_one(doc! { sf::ID: name, sf::QUEUE: self.queue_value() })
            .await?;
        Ok(r.deleted_count == 1)
    }

    /// This queue's schedules, by name. Documents that do not parse are logged and left
    /// out.
    ///
    /// # Errors
    /// A database error.
    pub async fn schedules(&self) -> Result<Vec<Scheduled>> {
        let docs: Vec<Document> = self
            .schedules_coll()
            .find(doc! { sf::QUEUE: self.queue_value() })
            .sort(doc! { sf::ID: 1 })
            .await?
            .try_collect()
            .await?;
        let mut out = Vec::with_capacity(docs.len());
        for d in &docs {
            match parse(d) {
                Ok((s, queue, last_tick, anchor)) => out.push(Scheduled {
                    next_tick: next_tick(&s.spec, anchor, last_tick),
                    name: s.name,
                    queue,
                    spec: s.spec,
                    missed: s.missed,
                    last_tick,
                }),
                Err(e) => tracing::warn!(error = %e, "schedule document skipped"),
            }
        }
        Ok(out)
    }

    /// One scheduler pass: for every schedule of this queue, enqueues its due ticks
    /// (per its missed-tick policy), each as an insert with the tick's deterministic
    /// `_id` followed by a compare-and-set of `last_tick`. Safe to run from any number
    /// of processes at once.
    ///
    /// # Errors
    /// A database error (a pass that failed part-way is safe to repeat).
    pub async fn run_due_ticks(&self) -> Result<SchedulerReport> {
        let coll = self.schedules_coll();
        let docs: Vec<Document> = coll
            .find(doc! { sf::QUEUE: self.queue_value() })
            .await?
            .try_collect()
            .await?;
        let mut report = SchedulerReport::default();
        for d in docs {
            match parse(&d) {
                Ok((s, _, last, anchor)) => {
                    let name = s.name.clone();
                    match self.fire(&coll, s, last, anchor, &mut report).await {
                        Ok(()) => self.schedule_ticked(&name),
                        // This schedule's own fault (a hand edit): skip it, run the others.
                        Err(e @ (Error::InvalidInput { .. } | Error::Malformed { .. })) => {
                            report.errors += 1;
                            self.schedule_problem(
                                &name,
                                &e,
                                "schedule skipped: its tick cannot be enqueued",
                            );
                        }
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => {
                    report.errors += 1;
                    let id = match d.get(sf::ID) {
                        Some(Bson::String(name)) => name.clone(),
                        Some(other) => other.to_string(),
                        None => "?".to_owned(),
                    };
                    self.schedule_problem(&id, &e, "schedule document skipped");
                }
            }
        }
        Ok(report)
    }

    /// Logs that schedule `id` cannot tick because of `error`: as a warning the first
    /// time this handle sees that problem, at debug level on every later pass (a pass
    /// runs every 200 ms by default, in every process whose workers run schedules and in
    /// every [`Scheduler`]), so a broken
    /// schedule is reported once per handle, and again once its problem changes or
    /// after it was fixed and broke again.
    fn schedule_problem(&self, id: &str, error: &Error, what: &'static str) {
        let reason = error.to_string();
        let new = {
            let mut seen = self
                .inner
                .schedule_problems
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            seen.insert(id.to_owned(), reason.clone()).as_ref() != Some(&reason)
        };
        if new {
            tracing::warn!(schedule = %id, error = %reason, "{what} (logged once until it changes)");
        } else {
            tracing::debug!(schedule = %id, error = %reason, "{what}");
        }
    }

    /// Schedule `name` ticked (or had nothing due): a later problem is new again.
    fn schedule_ticked(&self, name: &str) {
        let mut seen = self
            .inner
            .schedule_problems
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if !seen.is_empty() {
            seen.remove(name);
        }
    }

    async fn fire(
        &self,
        coll: &Collection<Document>,
        s: Schedule,
        mut last: DateTime,
        anchor: DateTime,
        report: &mut SchedulerReport,
    ) -> Result<()> {
        let keep = match s.missed {
            MissedTicks::Skip => 1,
            MissedTicks::CatchUp(n) => n,
        };
        for _ in 0..MAX_ROUNDS {
            let now = self.time().now().await?.estimate();
            let (ticks, skipped) = due_ticks(&s.spec, anchor, last, now, keep)?;
            if ticks.is_empty() {
                return Ok(());
            }
            let mut advanced = true;
            for tick in ticks {
                match self.enqueue_tick(&s, tick).await? {
                    TickOutcome::Enqueued(_) => report.enqueued += 1,
                    TickOutcome::Duplicate(_) => report.duplicates += 1,
                }
                let r = coll
                    .update_one(
                        doc! { sf::ID: &s.name, sf::LAST_TICK: last },
                        doc! { "$set": { sf::LAST_TICK: tick } },
                    )
                    .await?;
                if r.matched_count == 0 {
                    advanced = false;
                    break;
                }
                last = tick;
            }
            if advanced {
                report.skipped += skipped;
                return Ok(());
            }
            // Another scheduler advanced `last_tick`: re-read it and go on from there.
            match coll.find_one(doc! { sf::ID: &s.name }).await? {
                Some(d) => match d.get_datetime(sf::LAST_TICK) {
                    Ok(t) => last = *t,
                    Err(_) => return Ok(()),
                },
                None => return Ok(()),
            }
        }
        Ok(())
    }

    /// Inserts the job of `s`'s tick `tick` with its deterministic `_id`.
    async fn enqueue_tick(&self, s: &Schedule, tick: DateTime) -> Result<TickOutcome> {
        let mut opts = tick_options(s);
        opts.run_at = RunAt::At(tick);
        let mut d = self.new_job(s.payload.clone(), &opts).await?;
        let id = if self.options().unsafe_without == Some(Safeguard::ScheduleTickId) {
            ObjectId::new()
        } else {
            tick_job_id(&s.name, tick)?
        };
        d.insert(field::ID, id);
        d.insert(field::SCHEDULE, s.name.clone());
        d.insert(field::TICK, tick);
        match self.collection().insert_one(d).await {
            Ok(_) => {
                tracing::debug!(schedule = %s.name, tick = %tick, "tick enqueued");
                Ok(TickOutcome::Enqueued(tick))
            }
            Err(e) if is_duplicate_key(&e) => Ok(TickOutcome::Duplicate(tick)),
            Err(e) => Err(e.into()),
        }
    }
}

/// The enqueue options of `s`'s tick jobs (the tick's `run_at` aside).
fn tick_options(s: &Schedule) -> EnqueueOptions {
    let mut opts = EnqueueOptions::default().priority(s.priority);
    opts.max_attempts = s.max_attempts;
    opts
}

/// `<name>.schedules` of `db`, with the meta collection's write concern.
fn schedules_collection(
    db: &Database,
    name: &str,
    like: &Collection<Document>,
) -> Collection<Document> {
    let options = mongodb::options::CollectionOptions::builder()
        .write_concern(like.write_concern().cloned())
        .read_concern(like.read_concern().cloned())
        .selection_criteria(like.selection_criteria().cloned())
        .build();
    db.collection_with_options(&format!("{name}{SCHEDULES_SUFFIX}"), options)
}

/// Counts of a running [`Scheduler`].
#[derive(Debug, Default)]
pub(crate) struct SchedulerCounters {
    enqueued: AtomicU64,
    duplicates: AtomicU64,
    skipped: AtomicU64,
    errors: AtomicU64,
}

impl SchedulerCounters {
    pub(crate) fn report(&self) -> SchedulerReport {
        SchedulerReport {
            enqueued: self.enqueued.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            skipped: self.skipped.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }
}

/// The longest wait between failed scheduler passes (or the period, if longer).
const FAILED_PASS_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Runs [`JobQueue::run_due_ticks`] every `every` until `stop`. A pass that fails is
/// counted, logged, and tried again after a backoff: from `every`, doubling (jittered,
/// never shorter than `every`) up to [`FAILED_PASS_BACKOFF_MAX`], so a server that is
/// down or stepping down is not asked again every period, nor the log written to. The
/// first pass that succeeds returns to one pass every `every`; ticks that fell due
/// meanwhile follow their schedule's missed-tick policy, as after any pause.
pub(crate) async fn run_scheduler(
    queue: JobQueue,
    every: Duration,
    counters: Arc<SchedulerCounters>,
    stop: CancellationToken,
) {
    // `every` is validated by every caller; a zero period would only lose the backoff.
    let mut failing = Backoff::new(every, every.max(FAILED_PASS_BACKOFF_MAX))
        .ok()
        .map(|b| b.with_floor(every));
    loop {
        let delay = match queue.run_due_ticks().await {
            Ok(r) => {
                counters.enqueued.fetch_add(r.enqueued, Ordering::Relaxed);
                counters
                    .duplicates
                    .fetch_add(r.duplicates, Ordering::Relaxed);
                counters.skipped.fetch_add(r.skipped, Ordering::Relaxed);
                counters.errors.fetch_add(r.errors, Ordering::Relaxed);
                if let Some(b) = failing.as_mut() {
                    b.reset();
                }
                every
            }
            Err(e) => {
                counters.errors.fetch_add(1, Ordering::Relaxed);
                let delay = failing.as_mut().map_or(every, Backoff::next_delay);
                tracing::warn!(error = %e, ?delay, "scheduler pass failed; retrying");
                delay
            }
        };
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

/// A scheduler running on its own (without a worker): enqueues the due ticks of a
/// queue's schedules every `every`. Workers run one with
/// [`WorkerOptions::run_schedules`](super::WorkerOptions::run_schedules), one per queue
/// per process (`queue/schedulers.rs`); each `Scheduler` runs its own. Dropping it
/// stops it.
#[derive(Debug)]
pub struct Scheduler {
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
    counters: Arc<SchedulerCounters>,
}

impl Scheduler {
    /// Starts a scheduler for `queue`'s schedules on the current tokio runtime, one
    /// pass every `every`. After a pass that fails (a database error, counted in
    /// [`SchedulerReport::errors`] and logged), the next waits longer each time, doubling
    /// from `every` up to 5 s (or `every`, if longer), until one succeeds.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a zero period.
    pub fn spawn(queue: JobQueue, every: Duration) -> Result<Scheduler> {
        validate::duration_ms("scheduler period", every)?;
        let stop = CancellationToken::new();
        let counters = Arc::new(SchedulerCounters::default());
        let task = tokio::spawn(run_scheduler(
            queue,
            every,
            Arc::clone(&counters),
            stop.clone(),
        ));
        Ok(Scheduler {
            stop,
            task: Some(task),
            counters,
        })
    }

    /// What it has done so far.
    pub fn report(&self) -> SchedulerReport {
        self.counters.report()
    }

    /// Stops after the current pass and returns the counts.
    pub async fn shutdown(mut self) -> SchedulerReport {
        self.stop.cancel();
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
        self.counters.report()
    }

    /// Stops at once, as a crash would (a pass may stop between an insert and its
    /// compare-and-set).
    pub async fn kill(mut self) -> SchedulerReport {
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
        self.counters.report()
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: i64) -> DateTime {
        DateTime::from_millis(ms)
    }

    #[test]
    fn interval_ticks_after_last_up_to_now() -> Result<()> {
        let spec = ScheduleSpec::every(Duration::from_secs(1))?;
        let (t, skipped) = due_ticks(&spec, at(0), at(0), at(3_500), 10)?;
        assert_eq!(t, vec![at(1_000), at(2_000), at(3_000)]);
        assert_eq!(skipped, 0);
        let (t, skipped) = due_ticks(&spec, at(0), at(1_000), at(3_500), 1)?;
        assert_eq!(t, vec![at(3_000)]);
        assert_eq!(skipped, 1);
        assert!(
            due_ticks(&spec, at(0), at(3_000), at(3_999), 5)?
                .0
                .is_empty()
        );
        assert_eq!(next_tick(&spec, at(0), at(3_000)), Some(at(4_000)));
        Ok(())
    }

    #[test]
    fn cron_ticks_honour_the_time_zone() -> Result<()> {
        // 09:00 every day in Paris is 08:00 UTC in winter, 07:00 UTC in summer.
        let spec = ScheduleSpec::cron("0 9 * * *", "Europe/Paris")?;
        let jan = chrono::DateTime::parse_from_rfc3339("2026-01-10T00:00:00Z")
            .map_err(|e| Error::invalid("t", e.to_string()))?
            .timestamp_millis();
        let next = next_tick(&spec, at(jan), at(jan)).map(|t| t.timestamp_millis());
        assert_eq!(next, Some(jan + 8 * 3_600_000));
        let jul = chrono::DateTime::parse_from_rfc3339("2026-07-10T00:00:00Z")
            .map_err(|e| Error::invalid("t", e.to_string()))?
            .timestamp_millis();
        let next = next_tick(&spec, at(jul), at(jul)).map(|t| t.timestamp_millis());
        assert_eq!(next, Some(jul + 7 * 3_600_000));
        // Three days missed, catch up 2: the last two, one skipped.
        let (t, skipped) = due_ticks(&spec, at(jan), at(jan), at(jan + 3 * 86_400_000), 2)?;
        assert_eq!(
            t,
            vec![
                at(jan + 86_400_000 + 8 * 3_600_000),
                at(jan + 2 * 86_400_000 + 8 * 3_600_000)
            ]
        );
        assert_eq!(skipped, 1);
        assert!(ScheduleSpec::cron("not cron", "UTC").is_err());
        assert!(ScheduleSpec::cron("* * * * *", "Mars/Olympus").is_err());
        Ok(())
    }

    #[test]
    fn a_cron_expression_that_never_fires_is_refused() -> Result<()> {
        // 31 February and 30 February parse, but no date matches them: stored, they would
        // never tick and nobody would be told.
        for never in ["0 0 31 2 *", "0 12 30 2 *"] {
            match ScheduleSpec::cron(never, "UTC") {
                Err(Error::InvalidInput { what, reason }) => {
                    assert_eq!(what, "cron expression");
                    assert!(reason.contains("never fires"), "{reason}");
                }
                other => panic!("`{never}` accepted: {other:?}"),
            }
        }
        // 29 February fires (in a leap year), and so does the last day of any month.
        ScheduleSpec::cron("0 0 29 2 *", "UTC")?;
        ScheduleSpec::cron("0 0 L * *", "Europe/Paris")?;
        Ok(())
    }

    #[test]
    fn tick_ids_are_deterministic_and_distinct() -> Result<()> {
        let a = tick_job_id("s", at(1_700_000_000_123))?;
        assert_eq!(a, tick_job_id("s", at(1_700_000_000_123))?);
        assert_ne!(a, tick_job_id("s", at(1_700_000_000_124))?);
        assert_ne!(a, tick_job_id("t", at(1_700_000_000_123))?);
        assert_eq!(a.timestamp().timestamp_millis(), 1_700_000_000_000);
        assert!(tick_job_id("s", at(-1)).is_err());
        Ok(())
    }
}
