//! `docwarden queue`: operate a job queue collection — stats, list, retry dead jobs,
//! cancel a job, purge finished jobs, pause and resume a named queue, list schedules.
//! Every command acts on one named queue of the collection (`--queue`, default
//! `default`).

use crate::output::terminal_safe;
use std::process::ExitCode;
use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::format::schedule::DEFAULT_QUEUE;
use docwarden::queue::format::field;
use docwarden::queue::{
    CancelOutcome, JobListFilter, JobQueue, JobState, MissedTicks, PauseOutcome, QueueOptions,
    ScheduleSpec,
};
use mongodb::bson::{Bson, Document, oid::ObjectId};

use crate::conn::ConnArgs;

/// Arguments of `docwarden queue`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(subcommand)]
    command: QueueCommand,
    #[command(flatten)]
    conn: ConnArgs,
    /// Database holding the queue collection.
    #[arg(long, default_value = "docwarden", global = true)]
    db: String,
    /// The queue collection.
    #[arg(long, default_value = "jobs", global = true)]
    collection: String,
    /// The named queue in the collection (`default`: jobs without a queue name). Default
    /// `default`, except for `show`, which without it shows a job of any queue (and says
    /// which).
    #[arg(long, global = true)]
    queue: Option<String>,
    /// Print JSON.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Debug, clap::Subcommand)]
enum QueueCommand {
    /// Counts by state, the oldest due job's wait, running jobs with expired leases, and
    /// hand-edited jobs that cannot progress (a lease.until or run_at that is not a date;
    /// for the default queue, jobs stored with queue: "default", which are in no queue).
    Stats,
    /// List jobs, newest change first.
    List {
        /// Only jobs in this state (ready, running, succeeded, retrying, dead, cancelled).
        #[arg(long)]
        state: Option<String>,
        /// Only jobs with this key: dedupe key, uniqueness-window key, concurrency key or
        /// rate key (exact match).
        #[arg(long)]
        key: Option<String>,
        /// Only jobs whose last error contains this text (case-insensitive, literal).
        #[arg(long)]
        error: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 20)]
        limit: i64,
    },
    /// Show one job's whole document (progress, result, stalls, snoozes, follow-up) and
    /// the queue it belongs to. With `--queue`, a job of another queue is not found (as
    /// for `cancel`). `--json` prints the stored document as it is: its `queue` field
    /// names its queue (none: the default queue).
    Show {
        /// The job id (24 hex digits).
        id: String,
    },
    /// Move dead jobs back to ready (all of them, or the given ids).
    Retry {
        /// Job ids (24 hex digits); all dead jobs when omitted.
        ids: Vec<String>,
    },
    /// Cancel an unfinished job (a running job's worker loses its lease).
    Cancel {
        /// The job id (24 hex digits).
        id: String,
    },
    /// Delete finished jobs (succeeded, dead, cancelled) older than a duration.
    Purge {
        /// Minimum age, e.g. `30s`, `15m`, `12h`, `7d`.
        #[arg(long)]
        older_than: String,
    },
    /// Pause the queue: workers start no new claim from it within one wake-up; running
    /// jobs finish. Persisted in the database until `resume`.
    Pause {
        /// Who pauses (stored in the control document).
        #[arg(long, default_value = "docwarden-cli")]
        by: String,
    },
    /// Resume a paused queue.
    Resume {
        /// Who resumes (stored in the control document).
        #[arg(long, default_value = "docwarden-cli")]
        by: String,
    },
    /// The queue's periodic schedules: spec, missed-tick policy, last and next tick;
    /// and whether the queue is paused.
    Schedules,
}

/// Parses an age like `30s`, `15m`, `12h`, `7d` (also used by the dashboard's purge).
pub(crate) fn parse_age(s: &str) -> anyhow::Result<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| anyhow::anyhow!("`{s}` is not a duration like 30s, 15m, 12h or 7d"))?;
    let secs = match unit {
        // A bare number is refused rather than read as seconds: `--older-than 5` meant as
        // five days would otherwise delete every job finished more than 5 s ago.
        "" => anyhow::bail!("`{s}` has no unit: write {n}s, {n}m, {n}h or {n}d"),
        "s" => n,
        "m" => n.saturating_mul(60),
        "h" => n.saturating_mul(3600),
        "d" => n.saturating_mul(86_400),
        _ => anyhow::bail!("unknown unit `{unit}` (use s, m, h or d)"),
    };
    anyhow::ensure!(secs > 0, "the age must be positive");
    Ok(Duration::from_secs(secs))
}

/// The one-line `mongosh` fix of the jobs stored with `queue: "default"`
/// ([`JobQueue::misnamed_default_filter`]): `$unset` their `queue` (also printed by
/// `docwarden doctor`).
pub(crate) fn misnamed_default_fix(db: &str, collection: &str) -> String {
    let filter = Bson::Document(JobQueue::misnamed_default_filter()).into_relaxed_extjson();
    format!(
        "db.getSiblingDB({}).getCollection({}).updateMany({filter}, {{\"$unset\": {{\"{}\": \"\"}}}})",
        serde_json::Value::from(db),
        serde_json::Value::from(collection),
        field::QUEUE
    )
}

/// What `queue show` found.
#[derive(Debug)]
enum Shown {
    /// The job, and which queue it belongs to (a sentence).
    Found { job: Document, belongs: String },
    /// No such job (in the queue asked for), and why (a sentence).
    NotFound { why: String },
}

/// The queue a stored job belongs to: its `queue` field, the default queue when it has
/// none; `Err` with the reason when it is in no queue (a `queue` that no handle reads:
/// `"default"`, or not a string — a foreign producer or a hand edit).
fn queue_of(d: &Document) -> std::result::Result<String, String> {
    match d.get(field::QUEUE) {
        None | Some(Bson::Null) => Ok(DEFAULT_QUEUE.to_owned()),
        Some(Bson::String(s)) if s == DEFAULT_QUEUE => Err(format!(
            "stored with `queue: \"{DEFAULT_QUEUE}\"`, so in no queue: the default queue's jobs \
             carry no queue field (see `queue stats`)"
        )),
        Some(Bson::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!(
            "its queue field is {other}, not a queue name, so it is in no queue"
        )),
    }
}

/// `queue show`: job `id` of the collection, with the queue it belongs to. With `asked`
/// (`--queue`), a job of another queue (or of none) is not found, as for `cancel`.
async fn show(
    jobs: &mongodb::Collection<Document>,
    id: ObjectId,
    asked: Option<&str>,
) -> anyhow::Result<Shown> {
    let Some(job) = jobs.find_one(mongodb::bson::doc! { field::ID: id }).await? else {
        return Ok(Shown::NotFound {
            why: match asked {
                Some(q) => format!("no such job in queue `{q}`"),
                None => "no such job".to_owned(),
            },
        });
    };
    Ok(match (queue_of(&job), asked) {
        (Ok(q), None) => Shown::Found {
            belongs: format!("in queue `{q}`"),
            job,
        },
        (Ok(q), Some(a)) if q == a => Shown::Found {
            belongs: format!("in queue `{q}`"),
            job,
        },
        (Ok(q), Some(a)) => Shown::NotFound {
            why: format!("no such job in queue `{a}` (it is in queue `{q}`: use `--queue {q}`)"),
        },
        (Err(why), None) => Shown::Found { belongs: why, job },
        (Err(why), Some(a)) => Shown::NotFound {
            why: format!("no such job in queue `{a}` ({why})"),
        },
    })
}

fn parse_id(s: &str) -> anyhow::Result<ObjectId> {
    ObjectId::parse_str(s).map_err(|_| anyhow::anyhow!("`{s}` is not a job id (24 hex digits)"))
}

fn parse_state(s: &str) -> anyhow::Result<JobState> {
    JobState::parse(s).ok_or_else(|| anyhow::anyhow!("unknown state `{s}`"))
}

/// One job as a row of the listing, with typed JSON values: numbers stay numbers, dates
/// are RFC 3339 strings, an id is its hex string, and `progress` is the stored document
/// as relaxed extended JSON. A field the job lacks is `null`. The keys are the stored
/// field names (`_id` shown as `id`, the lease's owner as `owner`).
fn summary(d: &Document) -> serde_json::Value {
    let value = |k: &str| d.get(k).map_or(serde_json::Value::Null, json_value);
    serde_json::json!({
        "id": value(field::ID),
        (field::STATE): value(field::STATE),
        (field::PRIORITY): value(field::PRIORITY),
        (field::ATTEMPTS): value(field::ATTEMPTS),
        (field::MAX_ATTEMPTS): value(field::MAX_ATTEMPTS),
        (field::RUN_AT): value(field::RUN_AT),
        (field::lease::OWNER): d
            .get_document(field::LEASE)
            .ok()
            .and_then(|l| l.get(field::lease::OWNER))
            .map_or(serde_json::Value::Null, json_value),
        (field::LAST_ERROR): value(field::LAST_ERROR),
        (field::PROGRESS): value(field::PROGRESS),
        (field::STALLS): value(field::STALLS),
        (field::SNOOZES): value(field::SNOOZES),
    })
}

/// A stored value as JSON for [`summary`]: an `ObjectId` as its hex string, a date as RFC
/// 3339, anything else as relaxed extended JSON (numbers, strings, documents, arrays).
fn json_value(b: &Bson) -> serde_json::Value {
    match b {
        Bson::ObjectId(o) => serde_json::Value::String(o.to_hex()),
        Bson::DateTime(_) => serde_json::Value::String(render(b)),
        other => other.clone().into_relaxed_extjson(),
    }
}

/// A [`summary`] value as a cell of the text listing: strings as they are, `null` empty,
/// anything else as compact JSON.
fn cell_text(v: Option<&serde_json::Value>) -> String {
    match v {
        None | Some(serde_json::Value::Null) => String::new(),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// Prints the queue's control state after a pause or resume.
async fn print_control(queue: &JobQueue, outcome: &str, json: bool) -> anyhow::Result<()> {
    let c = queue.control().await?;
    if json {
        crate::output::print_json(&serde_json::json!({
            "queue": c.queue,
            "outcome": outcome,
            "paused": c.paused,
            "paused_at": c.paused_at.map(|t| render(&Bson::DateTime(t))),
            "resumed_at": c.resumed_at.map(|t| render(&Bson::DateTime(t))),
            "by": c.by,
        }))?;
    } else {
        println!("queue {}: {outcome}", c.queue);
    }
    Ok(())
}

fn render(b: &Bson) -> String {
    match b {
        Bson::String(s) => s.clone(),
        Bson::ObjectId(o) => o.to_hex(),
        Bson::DateTime(t) => t.try_to_rfc3339_string().unwrap_or_else(|_| t.to_string()),
        Bson::Null => String::new(),
        other => other.to_string(),
    }
}

pub(crate) async fn run(args: Args) -> anyhow::Result<ExitCode> {
    // Bad input is refused before anything is started or written.
    docwarden::validate::queue_collection_name("--collection", &args.collection)?;
    docwarden::validate::database_name("--db", &args.db)?;
    match &args.command {
        QueueCommand::Stats => {}
        QueueCommand::List {
            state,
            limit,
            key,
            error,
        } => {
            if let Some(s) = state {
                parse_state(s)?;
            }
            anyhow::ensure!(key.as_deref() != Some(""), "--key must not be empty");
            anyhow::ensure!(error.as_deref() != Some(""), "--error must not be empty");
            anyhow::ensure!(*limit >= 1, "--limit must be at least 1");
        }
        QueueCommand::Retry { ids } => {
            for id in ids {
                parse_id(id)?;
            }
        }
        QueueCommand::Cancel { id } | QueueCommand::Show { id } => {
            parse_id(id)?;
        }
        QueueCommand::Purge { older_than } => {
            parse_age(older_than)?;
        }
        QueueCommand::Pause { by } | QueueCommand::Resume { by } => {
            docwarden::validate::name("--by", by)?;
        }
        QueueCommand::Schedules => {}
    }
    if let Some(q) = &args.queue {
        docwarden::validate::name("queue", q)?;
    }
    // Every command but `show` acts on one queue: `default` unless named.
    let queue_name = args
        .queue
        .clone()
        .unwrap_or_else(|| DEFAULT_QUEUE.to_owned());
    let session = args.conn.open(args.json).await?;
    let db = session.client.database(&args.db);
    let time = TimeSource::server(session.client.clone(), ClockOptions::default())?;
    let queue = JobQueue::new(
        db.collection(&args.collection),
        time,
        QueueOptions::default().queue(queue_name.as_str()),
    )?;
    match args.command {
        QueueCommand::Stats => {
            let stats = queue.stats().await?;
            if args.json {
                crate::output::print_json(&stats)?;
            } else {
                println!(
                    "{} jobs in {}.{} (queue {})",
                    stats.total, args.db, args.collection, queue_name
                );
                for state in JobState::ALL {
                    let n = stats.by_state.get(state.as_str()).copied().unwrap_or(0);
                    println!("  {:<10} {n:>10}", state.as_str());
                }
                for (state, n) in &stats.by_state {
                    if JobState::parse(state).is_none() {
                        println!(
                            "  {:<10} {n:>10}  (not a docwarden state)",
                            crate::output::cell(state)
                        );
                    }
                }
                match stats.oldest_due_ms {
                    Some(ms) => println!("oldest due job waiting {:.1} s", ms as f64 / 1000.0),
                    None => println!("no job is due"),
                }
                println!("running with expired lease: {}", stats.expired_running);
                if stats.unreadable_leases > 0 {
                    println!(
                        "running with a lease.until that is not a date: {} (hand-edited; the sweep treats the lease as expired after a quiet lease TTL)",
                        stats.unreadable_leases
                    );
                }
                if stats.undatable > 0 {
                    println!(
                        "ready/retrying with a run_at that is not a date: {} (hand-edited; never due; the next sweep moves them to dead)",
                        stats.undatable
                    );
                }
                if stats.malformed_limits > 0 {
                    println!(
                        "ready/retrying with a limits field that is neither a document nor null: {} (hand-edited; no claim takes them; the next sweep moves them to dead)",
                        stats.malformed_limits
                    );
                }
                if stats.misnamed_default > 0 {
                    println!(
                        "stored with queue: \"default\": {} (in no queue: the default queue's jobs carry no queue field, so nothing claims, lists or counts them; fix: {})",
                        stats.misnamed_default,
                        misnamed_default_fix(&args.db, &args.collection)
                    );
                }
            }
        }
        QueueCommand::List {
            state,
            limit,
            key,
            error,
        } => {
            let mut filter = JobListFilter::default().limit(limit);
            if let Some(s) = state {
                filter = filter.state(parse_state(&s)?);
            }
            if let Some(k) = key {
                filter = filter.key(k);
            }
            if let Some(e) = error {
                filter = filter.error_contains(e);
            }
            let jobs: Vec<serde_json::Value> =
                queue.list(&filter).await?.iter().map(summary).collect();
            if args.json {
                crate::output::print_json(&jobs)?;
            } else {
                println!(
                    "{:<24} {:<10} {:>8} {:>8} {:>6} {:>7} {:<24} {:<20} error",
                    "id",
                    field::STATE,
                    field::PRIORITY,
                    field::ATTEMPTS,
                    field::STALLS,
                    field::SNOOZES,
                    field::RUN_AT,
                    field::PROGRESS,
                );
                for j in &jobs {
                    let s = |k: &str| crate::output::cell(&cell_text(j.get(k)));
                    let attempts = format!(
                        "{}/{}",
                        cell_text(j.get(field::ATTEMPTS)),
                        cell_text(j.get(field::MAX_ATTEMPTS))
                    );
                    println!(
                        "{:<24} {:<10} {:>8} {:>8} {:>6} {:>7} {:<24} {:<20} {}",
                        s("id"),
                        s(field::STATE),
                        s(field::PRIORITY),
                        crate::output::cell(&attempts),
                        s(field::STALLS),
                        s(field::SNOOZES),
                        s(field::RUN_AT),
                        s(field::PROGRESS),
                        s(field::LAST_ERROR)
                    );
                }
            }
        }
        QueueCommand::Show { id } => {
            let shown = show(queue.collection(), parse_id(&id)?, args.queue.as_deref()).await?;
            let (d, belongs) = match shown {
                Shown::Found { job, belongs } => (job, belongs),
                Shown::NotFound { why } => {
                    if args.json {
                        crate::output::print_json(&serde_json::Value::Null)?;
                    } else {
                        println!("{id}: {}", terminal_safe(&why));
                    }
                    return Ok(ExitCode::from(1));
                }
            };
            if args.json {
                crate::output::print_json(&Bson::Document(d).into_relaxed_extjson())?;
            } else {
                println!("{id}: {}", terminal_safe(&belongs));
                for (k, v) in &d {
                    match v {
                        Bson::Document(sub) => {
                            println!("{}:", terminal_safe(k));
                            for (sk, sv) in sub {
                                println!("  {}: {}", terminal_safe(sk), terminal_safe(&render(sv)));
                            }
                        }
                        other => {
                            println!("{}: {}", terminal_safe(k), terminal_safe(&render(other)))
                        }
                    }
                }
            }
        }
        QueueCommand::Retry { ids } => {
            let mut ids: Vec<ObjectId> = ids
                .iter()
                .map(|s| parse_id(s))
                .collect::<anyhow::Result<_>>()?;
            ids.sort();
            ids.dedup();
            let n = queue
                .retry_dead(if ids.is_empty() { None } else { Some(&ids) })
                .await?;
            // Named jobs that were not retried make the command fail (as `cancel` does),
            // so a script notices a typo, a job that is not dead, or the wrong `--queue`.
            let missed = if ids.is_empty() {
                0
            } else {
                (ids.len() as u64).saturating_sub(n)
            };
            if args.json {
                crate::output::print_json(
                    &serde_json::json!({ "retried": n, "not_retried": missed }),
                )?;
            } else {
                println!("{n} dead job(s) moved back to ready");
                if missed > 0 {
                    eprintln!(
                        "docwarden: {missed} of {} named job(s) not retried: no such job, not \
                         dead, or not in queue `{}` (see `queue show <id>`, `--queue`)",
                        ids.len(),
                        queue_name
                    );
                }
            }
            if missed > 0 {
                return Ok(ExitCode::from(1));
            }
        }
        QueueCommand::Cancel { id } => {
            let outcome = queue.cancel(parse_id(&id)?).await?;
            let (text, code) = match outcome {
                CancelOutcome::Cancelled { was } => {
                    (format!("cancelled (was {was})"), ExitCode::SUCCESS)
                }
                CancelOutcome::AlreadyFinished(s) => {
                    (format!("already finished ({s})"), ExitCode::from(1))
                }
                CancelOutcome::NotFound => (
                    format!(
                        "no such job in queue `{}` (see `queue show <id>`, `--queue`)",
                        queue_name
                    ),
                    ExitCode::from(1),
                ),
                _ => ("unknown outcome".to_owned(), ExitCode::from(1)),
            };
            if args.json {
                crate::output::print_json(&serde_json::json!({ "id": id, "outcome": text }))?;
            } else {
                println!("{id}: {text}");
            }
            return Ok(code);
        }
        QueueCommand::Purge { older_than } => {
            let n = queue.purge(parse_age(&older_than)?).await?;
            if args.json {
                crate::output::print_json(&serde_json::json!({ "purged": n }))?;
            } else {
                println!("{n} finished job(s) purged");
            }
        }
        QueueCommand::Pause { by } => {
            let text = match queue.pause(&by).await? {
                PauseOutcome::AlreadyPaused => "already paused",
                _ => "paused",
            };
            print_control(&queue, text, args.json).await?;
        }
        QueueCommand::Resume { by } => {
            let text = match queue.resume(&by).await? {
                PauseOutcome::NotPaused => "not paused",
                _ => "resumed",
            };
            print_control(&queue, text, args.json).await?;
        }
        QueueCommand::Schedules => {
            let control = queue.control().await?;
            let schedules = queue.schedules().await?;
            let rows: Vec<serde_json::Value> = schedules
                .iter()
                .map(|s| {
                    let (kind, spec) = match &s.spec {
                        ScheduleSpec::Every(d) => ("every", format!("{} ms", d.as_millis())),
                        ScheduleSpec::Cron { expr, timezone } => {
                            ("cron", format!("{expr} ({timezone})"))
                        }
                        _ => ("other", s.spec.to_string()),
                    };
                    let missed = match s.missed {
                        MissedTicks::Skip => "skip".to_owned(),
                        MissedTicks::CatchUp(n) => format!("catch up {n}"),
                        _ => "other".to_owned(),
                    };
                    serde_json::json!({
                        "name": s.name,
                        "kind": kind,
                        "spec": spec,
                        "missed": missed,
                        "last": render(&Bson::DateTime(s.last_tick)),
                        "next": s.next_tick.map(|t| render(&Bson::DateTime(t))),
                    })
                })
                .collect();
            if args.json {
                crate::output::print_json(&serde_json::json!({
                    "queue": queue_name,
                    "paused": control.paused,
                    "schedules": rows,
                }))?;
            } else {
                println!(
                    "queue {} of {}.{}: {}",
                    queue_name,
                    args.db,
                    args.collection,
                    if control.paused {
                        "paused"
                    } else {
                        "not paused"
                    }
                );
                if rows.is_empty() {
                    println!("no schedules");
                }
                for r in &rows {
                    let s = |k: &str| r.get(k).and_then(|v| v.as_str()).unwrap_or("").to_owned();
                    println!(
                        "  {:<20} {:<5} {:<28} {:<12} last {:<24} next {}",
                        s("name"),
                        s("kind"),
                        s("spec"),
                        s("missed"),
                        s("last"),
                        s("next")
                    );
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_parse() {
        assert_eq!(parse_age("30s").ok(), Some(Duration::from_secs(30)));
        assert_eq!(parse_age("2d").ok(), Some(Duration::from_secs(172_800)));
        assert!(parse_age("0s").is_err());
        assert!(parse_age("5 weeks").is_err());
        // A bare number has no unit: refused, not read as seconds (it deletes jobs).
        let bare = parse_age("5")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(bare.contains("has no unit"), "{bare}");
        assert!(parse_id("nope").is_err());
    }

    /// Session 19: `queue show <id>` read the job by `_id` across queues and never said
    /// which queue it was in, so `--queue` was ignored (`cancel` with the same `--queue`
    /// said "no such job"). Now it names the job's queue, and with `--queue` a job of
    /// another queue (or of none) is not found, naming both. Fails without the check:
    /// the job of `emails` is shown for `--queue default`.
    #[tokio::test]
    async fn show_names_the_queue_and_honours_queue() -> anyhow::Result<()> {
        use docwarden::queue::EnqueueOptions;
        use docwarden_testkit::TestDb;
        use mongodb::bson::doc;

        let t = TestDb::new("cli_queue_show_queue").await?;
        let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
        let q = JobQueue::open(&t.db, "jobs", time, QueueOptions::default()).await?;
        let emails = q.named("emails", QueueOptions::default())?;
        let created = |e: docwarden::queue::Enqueued| {
            e.created().ok_or_else(|| anyhow::anyhow!("not created"))
        };
        let plain = created(q.enqueue(doc! {}, &EnqueueOptions::default()).await?)?;
        let mail = created(emails.enqueue(doc! {}, &EnqueueOptions::default()).await?)?;
        let jobs = t.db.collection::<Document>("jobs");
        let nowhere = ObjectId::new();
        let mut d = jobs
            .find_one(doc! { "_id": plain })
            .await?
            .ok_or_else(|| anyhow::anyhow!("gone"))?;
        d.insert("_id", nowhere);
        d.insert("queue", "default");
        jobs.insert_one(d).await?;

        let found = |s: Shown| match s {
            Shown::Found { belongs, .. } => Ok(belongs),
            Shown::NotFound { why } => Err(why),
        };
        let said = |id, asked| {
            let jobs = jobs.clone();
            async move { anyhow::Ok(found(show(&jobs, id, asked).await?)) }
        };
        assert_eq!(said(plain, None).await?, Ok("in queue `default`".into()));
        assert_eq!(
            said(plain, Some("default")).await?,
            Ok("in queue `default`".into())
        );
        assert_eq!(said(mail, None).await?, Ok("in queue `emails`".into()));
        assert_eq!(
            said(mail, Some("emails")).await?,
            Ok("in queue `emails`".into())
        );
        assert_eq!(
            said(mail, Some("default")).await?,
            Err(
                "no such job in queue `default` (it is in queue `emails`: use `--queue emails`)"
                    .into()
            )
        );
        assert_eq!(
            said(plain, Some("emails")).await?,
            Err(
                "no such job in queue `emails` (it is in queue `default`: use `--queue default`)"
                    .into()
            )
        );
        let misnamed = said(nowhere, None).await?;
        assert!(
            misnamed.as_ref().is_ok_and(|s| s.contains("in no queue")),
            "{misnamed:?}"
        );
        let refused = said(nowhere, Some("default")).await?;
        assert!(
            refused
                .as_ref()
                .is_err_and(|s| s.starts_with("no such job in queue `default` (")
                    && s.contains("in no queue")),
            "{refused:?}"
        );
        assert_eq!(
            said(ObjectId::new(), Some("emails")).await?,
            Err("no such job in queue `emails`".into())
        );
        assert_eq!(
            said(ObjectId::new(), None).await?,
            Err("no such job".into())
        );
        // `cancel` agrees: a job of `emails` is not found in the default queue.
        assert_eq!(q.cancel(mail).await?, CancelOutcome::NotFound);
        Ok(())
    }

    #[test]
    fn the_misnamed_default_fix_is_one_update_many() {
        assert_eq!(
            misnamed_default_fix("app", "jobs"),
            r#"db.getSiblingDB("app").getCollection("jobs").updateMany({"queue":"default"}, {"$unset": {"queue": ""}})"#
        );
    }
}
