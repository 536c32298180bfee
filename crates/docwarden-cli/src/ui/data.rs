//! What the dashboard shows, read from the database: the queues and lock collections of
//! one database, their counts, jobs, leases and a per-minute history of finished jobs.
//!
//! Every read goes through the library's handles ([`JobQueue`], [`LockCollection`]) and
//! names stored fields only through `docwarden::queue::format` / `docwarden::lock::format`.
//! Nothing here writes: handles are built with `new` (no index creation, no options
//! document), so opening the dashboard on a database changes nothing in it.

use std::collections::BTreeSet;

use docwarden::clock::TimeSource;
use docwarden::lock::{LockCollection, LockOptions, LockRecord};
use docwarden::queue::format::{field, meta};
use docwarden::queue::{Job, JobListFilter, JobQueue, JobState, QueueOptions, QueueStats};
use futures::TryStreamExt;
use mongodb::Database;
use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};

/// Suffix of a lock collection's fencing-token counter collection (`docs/locks.md`,
/// "The fencing-token counter").
const LOCK_TOKENS_SUFFIX: &str = docwarden::lock::format::TOKENS_SUFFIX;
/// A queue's concurrency-limit semaphore collection: `<queue>.limits`.
const LIMITS_SUFFIX: &str = docwarden::queue::format::limit::COLLECTION_SUFFIX;

/// Minutes of history the queue page charts.
pub(crate) const HISTORY_MINUTES: i64 = 15;

/// At most this many finished jobs are read for the chart (the newest).
const HISTORY_CAP: i64 = 20_000;

/// The queues and lock collections the dashboard shows.
#[derive(Clone, Debug, Default)]
pub(crate) struct Catalog {
    /// Queue collections: named with `--queue`, or found by their `<name>.meta`.
    pub(crate) queues: Vec<String>,
    /// Lock collections: named with `--locks`, or found by their `<name>.tokens`.
    pub(crate) locks: Vec<String>,
}

/// Finds docwarden's collections in `db`: a queue `q` is recognised by `q.meta`, a lock
/// collection `l` by `l.tokens`, except a queue's own concurrency-limit semaphore
/// (`q.limits`, which has `q.limits.tokens`: its documents are permits, not leases); the
/// names given explicitly are always included.
pub(crate) async fn discover(
    db: &Database,
    queues: &[String],
    locks: &[String],
) -> anyhow::Result<Catalog> {
    let names: BTreeSet<String> = db.list_collection_names().await?.into_iter().collect();
    let mut q: BTreeSet<String> = queues.iter().cloned().collect();
    let mut l: BTreeSet<String> = locks.iter().cloned().collect();
    for name in &names {
        // A `q.meta` of a name no queue may have (`q` ends in a side collection's
        // suffix, see `validate::queue_collection_name`) is not a queue's.
        if let Some(base) = name.strip_suffix(meta::COLLECTION_SUFFIX)
            && names.contains(base)
            && docwarden::validate::queue_collection_name("queue", base).is_ok()
        {
            q.insert(base.to_owned());
        }
        if let Some(base) = name.strip_suffix(LOCK_TOKENS_SUFFIX) {
            let queue_limits = base
                .strip_suffix(LIMITS_SUFFIX)
                .is_some_and(|q| names.contains(&format!("{q}{}", meta::COLLECTION_SUFFIX)));
            if !queue_limits {
                // The counter exists from the first acquire; the lock collection may have
                // been dropped or not created yet: still list it (it shows no leases).
                l.insert(base.to_owned());
            }
        }
    }
    Ok(Catalog {
        queues: q.into_iter().collect(),
        locks: l.into_iter().collect(),
    })
}

/// A read-only handle on queue `name`.
pub(crate) fn queue(db: &Database, time: &TimeSource, name: &str) -> anyhow::Result<JobQueue> {
    Ok(JobQueue::new(
        db.collection(name),
        time.clone(),
        QueueOptions::default(),
    )?)
}

/// A read-only handle on lock collection `name`.
pub(crate) fn locks(
    db: &Database,
    time: &TimeSource,
    name: &str,
) -> anyhow::Result<LockCollection> {
    Ok(LockCollection::new(
        db.collection(name),
        time.clone(),
        LockOptions::default(),
    )?)
}

/// One state's count, for display.
#[derive(Debug, serde::Serialize)]
pub(crate) struct StateCount {
    pub(crate) state: String,
    pub(crate) count: u64,
    /// Not one of docwarden's states (a hand edit).
    pub(crate) foreign: bool,
}

/// Every docwarden state (zeros included) and then any foreign state found.
pub(crate) fn state_counts(stats: &QueueStats) -> Vec<StateCount> {
    let mut out: Vec<StateCount> = JobState::ALL
        .iter()
        .map(|s| StateCount {
            state: s.as_str().to_owned(),
            count: stats.by_state.get(s.as_str()).copied().unwrap_or(0),
            foreign: false,
        })
        .collect();
    for (state, n) in &stats.by_state {
        if JobState::parse(state).is_none() {
            out.push(StateCount {
                state: state.clone(),
                count: *n,
                foreign: true,
            });
        }
    }
    out
}

/// One minute of the chart.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub(crate) struct Minute {
    /// Minutes before now (0 = the current minute).
    pub(crate) ago: i64,
    /// Jobs that succeeded in that minute.
    pub(crate) succeeded: u64,
    /// Jobs that went dead or were cancelled in that minute.
    pub(crate) failed: u64,
    /// Mean time from enqueue to finish of the jobs finished in that minute, ms.
    pub(crate) mean_latency_ms: Option<i64>,
}

/// Finished jobs of named queue `named` per minute over the last [`HISTORY_MINUTES`]
/// minutes (by `finished_at`), oldest minute first, and the mean enqueue-to-finish
/// latency per minute.
pub(crate) async fn history(
    queue: &JobQueue,
    named: &str,
    now_ms: i64,
) -> anyhow::Result<Vec<Minute>> {
    // The default queue's jobs have no `queue` field (null matches a missing field).
    let queue_value = if named == docwarden::queue::format::DEFAULT_QUEUE {
        Bson::Null
    } else {
        Bson::String(named.to_owned())
    };
    let start_ms = now_ms - HISTORY_MINUTES * 60_000;
    let finished: Vec<Bson> = [JobState::Succeeded, JobState::Dead, JobState::Cancelled]
        .iter()
        .map(|s| Bson::String(s.as_str().to_owned()))
        .collect();
    let docs: Vec<Document> = queue
        .collection()
        .find(doc! {
            field::STATE: { "$in": finished },
            field::FINISHED_AT: { "$gte": DateTime::from_millis(start_ms) },
            field::QUEUE: queue_value,
        })
        .projection(doc! { field::STATE: 1, field::CREATED_AT: 1, field::FINISHED_AT: 1 })
        .sort(doc! { field::FINISHED_AT: -1 })
        .limit(HISTORY_CAP)
        .await?
        .try_collect()
        .await?;
    let n = usize::try_from(HISTORY_MINUTES).unwrap_or(15);
    let mut minutes: Vec<Minute> = (0..n)
        .map(|i| Minute {
            ago: HISTORY_MINUTES - 1 - i64::try_from(i).unwrap_or(0),
            ..Minute::default()
        })
        .collect();
    let mut latency_sum = vec![0_i64; n];
    let mut latency_n = vec![0_i64; n];
    for d in &docs {
        let Ok(finished_at) = d.get_datetime(field::FINISHED_AT) else {
            continue;
        };
        let ago = (now_ms - finished_at.timestamp_millis()).max(0) / 60_000;
        let Ok(slot) = usize::try_from(HISTORY_MINUTES - 1 - ago) else {
            continue;
        };
        let Some(m) = minutes.get_mut(slot) else {
            continue;
        };
        if d.get_str(field::STATE) == Ok(JobState::Succeeded.as_str()) {
            m.succeeded += 1;
        } else {
            m.failed += 1;
        }
        if let Ok(created) = d.get_datetime(field::CREATED_AT) {
            latency_sum[slot] += finished_at.timestamp_millis() - created.timestamp_millis();
            latency_n[slot] += 1;
        }
    }
    for (i, m) in minutes.iter_mut().enumerate() {
        if latency_n[i] > 0 {
            m.mean_latency_ms = Some(latency_sum[i] / latency_n[i]);
        }
    }
    Ok(minutes)
}

/// Filters of the job list (all optional).
#[derive(Debug, Default, Clone, serde::Deserialize, serde::Serialize)]
pub(crate) struct JobQuery {
    /// Only this queue collection.
    #[serde(default)]
    pub(crate) queue: Option<String>,
    /// Only this named queue (`default`: jobs without a queue name).
    #[serde(default)]
    pub(crate) named: Option<String>,
    /// Only this state.
    #[serde(default)]
    pub(crate) in_state: Option<String>,
    /// A job id, or a key ([`JobListFilter::key`]: dedupe, window, concurrency or rate
    /// key).
    #[serde(default)]
    pub(crate) key: Option<String>,
    /// Text the last error contains (case-insensitive).
    #[serde(default)]
    pub(crate) error: Option<String>,
    /// At most this many (default 100).
    #[serde(default)]
    pub(crate) limit: Option<i64>,
}

impl JobQuery {
    fn clean(v: &Option<String>) -> Option<&str> {
        v.as_deref().map(str::trim).filter(|s| !s.is_empty())
    }
}

/// One job as a row of the list.
#[derive(Debug, serde::Serialize)]
pub(crate) struct JobRow {
    pub(crate) queue: String,
    pub(crate) named: String,
    pub(crate) id: String,
    pub(crate) state: String,
    pub(crate) attempts: String,
    pub(crate) priority: String,
    pub(crate) key: String,
    pub(crate) updated: String,
    pub(crate) error: String,
    updated_ms: i64,
}

/// A stored value as text for a table cell.
pub(crate) fn text(b: Option<&Bson>) -> String {
    match b {
        None | Some(Bson::Null) => String::new(),
        Some(Bson::String(s)) => s.clone(),
        Some(Bson::ObjectId(o)) => o.to_hex(),
        Some(Bson::DateTime(t)) => date(*t),
        Some(other) => other.to_string(),
    }
}

/// RFC 3339, or the milliseconds if the date has no such form.
pub(crate) fn date(t: DateTime) -> String {
    t.try_to_rfc3339_string()
        .unwrap_or_else(|_| t.timestamp_millis().to_string())
}

fn row(queue: &str, named: &str, d: &Document) -> JobRow {
    JobRow {
        queue: queue.to_owned(),
        named: named.to_owned(),
        id: text(d.get(field::ID)),
        state: text(d.get(field::STATE)),
        attempts: format!(
            "{}/{}",
            text(d.get(field::ATTEMPTS)),
            text(d.get(field::MAX_ATTEMPTS))
        ),
        priority: text(d.get(field::PRIORITY)),
        key: text(d.get(field::DEDUPE_KEY)),
        updated: text(d.get(field::UPDATED_AT)),
        error: shorten(&text(d.get(field::LAST_ERROR)), 160),
        updated_ms: d
            .get_datetime(field::UPDATED_AT)
            .map(|t| t.timestamp_millis())
            .unwrap_or(i64::MIN),
    }
}

/// At most `n` characters of `s`, with an ellipsis when cut.
fn shorten(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

/// The jobs matching `q` in `queues` (or only `q.queue`, and only the named queue
/// `q.named`), newest change first: [`JobQueue::list`] with a [`JobListFilter`] per
/// named queue; a key that is a job id is looked up by id instead.
pub(crate) async fn jobs(
    db: &Database,
    time: &TimeSource,
    queues: &[String],
    q: &JobQuery,
) -> anyhow::Result<Vec<JobRow>> {
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let mut filter = JobListFilter::default().limit(limit);
    if let Some(s) = JobQuery::clean(&q.in_state) {
        filter =
            filter.state(JobState::parse(s).ok_or_else(|| anyhow::anyhow!("unknown state `{s}`"))?);
    }
    let by_id = JobQuery::clean(&q.key).and_then(|k| ObjectId::parse_str(k).ok());
    if by_id.is_none()
        && let Some(k) = JobQuery::clean(&q.key)
    {
        filter = filter.key(k);
    }
    if let Some(e) = JobQuery::clean(&q.error) {
        filter = filter.error_contains(e);
    }
    let mut rows = Vec::new();
    for name in queues {
        if let Some(only) = JobQuery::clean(&q.queue)
            && only != name
        {
            continue;
        }
        if let Some(id) = by_id {
            // A job id: that job (one lookup by `_id`), whatever the other filters say.
            if let Some(d) = queue(db, time, name)?
                .collection()
                .find_one(doc! { field::ID: id })
                .await?
            {
                let named = named_of(&d);
                if JobQuery::clean(&q.named).is_none_or(|only| only == named) {
                    rows.push(row(name, &named, &d));
                }
            }
            continue;
        }
        let handle = queue(db, time, name)?;
        let docs = match JobQuery::clean(&q.named) {
            // One named queue: its own listing.
            Some(only) => {
                handle
                    .named(only, QueueOptions::default())?
                    .list(&filter)
                    .await?
            }
            // Every named queue in one read; each row says which from its document (not
            // `queue_names`, which reads every job, on each view).
            None => handle.list(&filter.clone().every_queue()).await?,
        };
        rows.extend(docs.iter().map(|d| row(name, &named_of(d), d)));
    }
    rows.sort_by_key(|r| std::cmp::Reverse(r.updated_ms));
    rows.truncate(usize::try_from(limit).unwrap_or(100));
    Ok(rows)
}

/// The named queue a stored job belongs to: `default` when it has no `queue` (or null),
/// and a `queue` that is not a string shown as `<value>` (a hand edit: in no queue).
pub(crate) fn named_of(d: &Document) -> String {
    match d.get(field::QUEUE) {
        None | Some(Bson::Null) => docwarden::queue::format::DEFAULT_QUEUE.to_owned(),
        Some(Bson::String(s)) => s.clone(),
        Some(other) => format!("<{other}>"),
    }
}

/// One job, for its page.
#[derive(Debug, serde::Serialize)]
pub(crate) struct JobView {
    pub(crate) queue: String,
    /// The named queue (`default` for jobs without a queue name).
    pub(crate) named: String,
    /// Times the lease expired and the sweep took the job over.
    pub(crate) stalls: String,
    /// Times a handler snoozed the job.
    pub(crate) snoozes: String,
    /// What the handler last reported, as JSON.
    pub(crate) progress: Option<String>,
    pub(crate) id: String,
    pub(crate) state: String,
    pub(crate) priority: String,
    pub(crate) attempts: String,
    pub(crate) max_attempts: String,
    pub(crate) run_at: String,
    pub(crate) created_at: String,
    pub(crate) updated_at: String,
    pub(crate) finished_at: String,
    pub(crate) key: String,
    pub(crate) payload: String,
    pub(crate) result: Option<String>,
    pub(crate) last_error: Option<String>,
    pub(crate) lease: Option<LeaseView>,
    /// Whether the lease is the current claim (the job is running); otherwise it is the
    /// last claim's, kept for the record.
    pub(crate) lease_held: bool,
    /// Why the stored document does not parse as a job (a hand edit).
    pub(crate) malformed: Option<String>,
    /// The whole stored document, as relaxed extended JSON.
    pub(crate) raw: String,
    pub(crate) can_cancel: bool,
    pub(crate) can_retry: bool,
}

/// A job's lease.
#[derive(Debug, serde::Serialize)]
pub(crate) struct LeaseView {
    pub(crate) owner: String,
    pub(crate) token: String,
    pub(crate) until: String,
    /// Milliseconds until it expires by the server's clock (negative: expired).
    pub(crate) remaining_ms: Option<i64>,
}

/// A BSON value as pretty relaxed extended JSON.
pub(crate) fn json(b: &Bson) -> String {
    serde_json::to_string_pretty(&b.clone().into_relaxed_extjson())
        .unwrap_or_else(|_| b.to_string())
}

/// The job `id` of `queue_name`, raw and parsed; `None` if there is no such job.
pub(crate) async fn job(
    handle: &JobQueue,
    queue_name: &str,
    id: ObjectId,
    now_ms: i64,
) -> anyhow::Result<Option<JobView>> {
    let Some(d) = handle.collection().find_one(doc! { field::ID: id }).await? else {
        return Ok(None);
    };
    let parsed = Job::from_document(&d);
    let state = text(d.get(field::STATE));
    let lease = d.get_document(field::LEASE).ok().map(|l| LeaseView {
        owner: text(l.get(field::lease::OWNER)),
        token: text(l.get(field::lease::TOKEN)),
        until: text(l.get(field::lease::UNTIL)),
        remaining_ms: l
            .get_datetime(field::lease::UNTIL)
            .ok()
            .map(|t| t.timestamp_millis() - now_ms),
    });
    let parsed_state = JobState::parse(&state);
    Ok(Some(JobView {
        queue: queue_name.to_owned(),
        named: named_of(&d),
        stalls: text(d.get(field::STALLS)),
        snoozes: text(d.get(field::SNOOZES)),
        progress: d
            .get(field::PROGRESS)
            .filter(|b| **b != Bson::Null)
            .map(json),
        id: id.to_hex(),
        priority: text(d.get(field::PRIORITY)),
        attempts: text(d.get(field::ATTEMPTS)),
        max_attempts: text(d.get(field::MAX_ATTEMPTS)),
        run_at: text(d.get(field::RUN_AT)),
        created_at: text(d.get(field::CREATED_AT)),
        updated_at: text(d.get(field::UPDATED_AT)),
        finished_at: text(d.get(field::FINISHED_AT)),
        key: text(d.get(field::DEDUPE_KEY)),
        payload: d.get(field::PAYLOAD).map(json).unwrap_or_default(),
        result: d.get(field::RESULT).filter(|b| **b != Bson::Null).map(json),
        last_error: d
            .get(field::LAST_ERROR)
            .filter(|b| **b != Bson::Null)
            .map(|b| text(Some(b))),
        lease,
        lease_held: parsed_state == Some(JobState::Running),
        malformed: parsed.err().map(|e| e.to_string()),
        raw: json(&Bson::Document(d.clone())),
        can_cancel: parsed_state.is_some_and(|s| !s.is_finished()),
        can_retry: parsed_state == Some(JobState::Dead),
        state,
    }))
}

/// A lease of a lock collection, for display.
#[derive(Debug, serde::Serialize)]
pub(crate) struct LockView {
    pub(crate) collection: String,
    pub(crate) resource: String,
    pub(crate) owner: String,
    pub(crate) token: String,
    pub(crate) acquired_at: String,
    pub(crate) expires_at: String,
    /// Milliseconds until it expires by the server's clock (negative: expired).
    pub(crate) remaining_ms: Option<i64>,
    pub(crate) expired: bool,
    pub(crate) malformed: Option<String>,
}

/// A lock record as a view.
pub(crate) fn lock_view(collection: &str, r: &LockRecord, now_ms: i64) -> LockView {
    LockView {
        collection: collection.to_owned(),
        resource: r.resource.clone(),
        owner: r.owner.clone(),
        token: r.token.map_or_else(
            || docwarden::lock::format::collection::PENDING.to_owned(),
            |t| t.to_string(),
        ),
        acquired_at: r.acquired_at.map(date).unwrap_or_default(),
        expires_at: r.expires_at.map(date).unwrap_or_default(),
        remaining_ms: r.expires_at.map(|t| t.timestamp_millis() - now_ms),
        expired: r.expired,
        malformed: r.malformed.clone(),
    }
}

/// The first held leases of `collection` (from its snapshot) as views.
pub(crate) fn lock_views(collection: &str, records: &[LockRecord], now_ms: i64) -> Vec<LockView> {
    records
        .iter()
        .map(|r| lock_view(collection, r, now_ms))
        .collect()
}

/// One holder of a semaphore, an election, a read/write lock or a document, for
/// display: who, with which token, and when it expires.
#[derive(Debug, serde::Serialize)]
pub(crate) struct HolderView {
    /// What is held: the resource, the election, the document's id.
    pub(crate) resource: String,
    /// The role: `leader`, `writer`, `writer waiting`, `reader`, `holder`, `lock`.
    pub(crate) role: String,
    /// The owner id (the lock id for a document lock).
    pub(crate) owner: String,
    /// The fencing token (the term of an election); empty when the kind has none.
    pub(crate) token: String,
    /// The server time it expires (RFC 3339).
    pub(crate) expires_at: String,
    /// Milliseconds until it expires by the server's clock (negative: expired).
    pub(crate) remaining_ms: Option<i64>,
    pub(crate) expired: bool,
    pub(crate) malformed: Option<String>,
}

fn holder(
    resource: &str,
    role: &str,
    owner: &str,
    token: Option<String>,
    expires_at: Option<DateTime>,
    expired: bool,
    now_ms: i64,
) -> HolderView {
    HolderView {
        resource: resource.to_owned(),
        role: role.to_owned(),
        owner: owner.to_owned(),
        token: token.unwrap_or_default(),
        expires_at: expires_at.map(date).unwrap_or_default(),
        remaining_ms: expires_at.map(|t| t.timestamp_millis() - now_ms),
        expired,
        malformed: None,
    }
}

/// A semaphore: permits in use of its limit, and its holders.
#[derive(Debug, serde::Serialize)]
pub(crate) struct SemaphoreView {
    pub(crate) resource: String,
    /// Live holders (not certainly expired).
    pub(crate) used: usize,
    /// The stored limit (`None`: the handle's default applies).
    pub(crate) limit: Option<i64>,
    pub(crate) holders: Vec<HolderView>,
}

/// The elections, read/write locks and semaphores, for the locks page.
#[derive(Debug, serde::Serialize)]
pub(crate) struct KindsView {
    pub(crate) elections_collection: String,
    pub(crate) rwlocks_collection: String,
    pub(crate) semaphores_collection: String,
    /// One row per leader.
    pub(crate) leaders: Vec<HolderView>,
    /// One row per writer or reader.
    pub(crate) rwlocks: Vec<HolderView>,
    pub(crate) semaphores: Vec<SemaphoreView>,
    /// There are more elections with a leader than [`KindsView::leaders`] shows.
    pub(crate) leaders_truncated: bool,
    /// There are more read/write locks held than [`KindsView::rwlocks`] shows.
    pub(crate) rwlocks_truncated: bool,
    /// There are more semaphores than [`KindsView::semaphores`] shows.
    pub(crate) semaphores_truncated: bool,
    /// How many of each kind a view shows at most (elections, read/write resources,
    /// semaphores).
    pub(crate) shown: usize,
}

/// Keeps the first `shown` of `v`; whether there were more.
fn truncate<T>(v: &mut Vec<T>, shown: usize) -> bool {
    let more = v.len() > shown;
    v.truncate(shown);
    more
}

fn token_text(t: Option<docwarden::lock::FencingToken>) -> String {
    t.map_or_else(
        || docwarden::lock::format::collection::PENDING.to_owned(),
        |t| t.to_string(),
    )
}

/// The [`crate::locks::Holdings`] (read by `docwarden locks list`'s reader) as views: at
/// most `shown` elections, read/write resources and semaphores each (read `shown + 1` of
/// each to know whether there are more).
pub(crate) fn kinds_view(
    kinds: &crate::locks::Kinds<'_>,
    mut held: crate::locks::Holdings,
    shown: usize,
    now_ms: i64,
) -> KindsView {
    let leaders_truncated = truncate(&mut held.elections, shown);
    let rwlocks_truncated = truncate(&mut held.rwlocks, shown);
    let semaphores_truncated = truncate(&mut held.semaphores, shown);
    let leaders = held
        .elections
        .iter()
        .map(|l| {
            holder(
                &l.election,
                "leader",
                &l.owner,
                Some(token_text(l.term)),
                l.expires_at,
                l.expired,
                now_ms,
            )
        })
        .collect();
    let mut rwlocks = Vec::new();
    for r in &held.rwlocks {
        if let Some(w) = &r.writer {
            rwlocks.push(holder(
                &r.resource,
                if w.waiting {
                    "writer waiting"
                } else {
                    "writer"
                },
                &w.owner,
                Some(token_text(w.token)),
                w.expires_at,
                w.expired,
                now_ms,
            ));
        }
        for x in &r.readers {
            rwlocks.push(holder(
                &r.resource,
                "reader",
                &x.owner,
                None,
                x.expires_at,
                x.expired,
                now_ms,
            ));
        }
    }
    let semaphores = held
        .semaphores
        .iter()
        .map(|s| SemaphoreView {
            resource: s.resource.clone(),
            used: s.live(),
            limit: s.permits,
            holders: s
                .holders
                .iter()
                .map(|h| {
                    holder(
                        &s.resource,
                        "holder",
                        &h.owner,
                        h.token.map(|t| t.to_string()),
                        h.expires_at,
                        h.expired,
                        now_ms,
                    )
                })
                .collect(),
        })
        .collect();
    KindsView {
        elections_collection: kinds.elections.to_owned(),
        rwlocks_collection: kinds.rwlocks.to_owned(),
        semaphores_collection: kinds.semaphores.to_owned(),
        leaders,
        rwlocks,
        semaphores,
        leaders_truncated,
        rwlocks_truncated,
        semaphores_truncated,
        shown,
    }
}

/// The locked documents of entity collection `collection` (document locks: the lock id
/// and lock time stored in the entity, default fields and a 30 s validity), the first
/// `shown` by `_id`, read with [`docwarden::lock::DocumentLocks::list_locked_first`];
/// and whether more are locked.
pub(crate) async fn document_locks(
    db: &Database,
    time: &TimeSource,
    collection: &str,
    shown: usize,
    now_ms: i64,
) -> anyhow::Result<(Vec<HolderView>, bool)> {
    let options = docwarden::lock::DocumentLockOptions::default();
    let max_ms = i64::try_from(options.max_duration.as_millis()).unwrap_or(i64::MAX);
    let locks =
        docwarden::lock::DocumentLocks::new(db.collection(collection), time.clone(), options)?;
    let mut records = locks
        .list_locked_first(Some(
            u64::try_from(shown).unwrap_or(u64::MAX).saturating_add(1),
        ))
        .await?;
    let more = truncate(&mut records, shown);
    let views = records
        .iter()
        .map(|r| {
            let until = r
                .locked_at
                .map(|t| DateTime::from_millis(t.timestamp_millis().saturating_add(max_ms)));
            let mut v = holder(&r.id, "lock", &r.lock_id, None, until, r.expired, now_ms);
            v.malformed = r.malformed.clone();
            v
        })
        .collect();
    Ok((views, more))
}
