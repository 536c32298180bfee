//! `docwarden doctor`: what the server is, how far its clock is, what it supports, and
//! what in the deployment weakens docwarden's guarantees (the warnings; see
//! `docs/deployment.md`).

use std::process::ExitCode;
use std::time::Instant;

use docwarden::capabilities::{self, Capabilities};
use docwarden::clock::{ClockOptions, ClockSample, TimeSource};
use docwarden::format::lock::collection as lock_field;
use docwarden::preflight::{self, MIN_SERVER_VERSION};
use docwarden::queue::{JobQueue, index as queue_index};
use docwarden_server::mask_uri;
use futures::TryStreamExt;
use mongodb::bson::{Document, doc};

use crate::conn::ConnArgs;
use crate::output::print_json;

/// Arguments of `docwarden doctor`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    conn: ConnArgs,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, serde::Serialize)]
pub(crate) struct Report {
    uri: String,
    embedded: bool,
    pub(crate) server_version: String,
    max_wire_version: i64,
    /// Whether the server is at least docwarden's minimum version.
    pub(crate) version_supported: bool,
    /// The minimum version docwarden needs.
    min_version: &'static str,
    pub(crate) topology: String,
    round_trip_ms: f64,
    pub(crate) clock_offset_ms: i64,
    pub(crate) clock_bound_ms: i64,
    pub(crate) capabilities: Capabilities,
    /// The write concern writes get when a handle sets none: the URI's, else the server's
    /// default (`getDefaultRWConcern`), as `w` (`"unknown"` when neither says).
    effective_write_concern: String,
    /// Where [`Report::effective_write_concern`] comes from: `uri`, `server` or `implicit`.
    write_concern_source: String,
    /// What in this deployment weakens a guarantee, with what to do about it.
    pub(crate) warnings: Vec<Warning>,
}

/// One thing `doctor` warns about.
#[derive(Debug, serde::Serialize)]
pub(crate) struct Warning {
    /// A stable name scripts can match (`write-concern-w1`, `retry-writes-off`, …).
    pub(crate) code: &'static str,
    /// What happens and what to do.
    pub(crate) message: String,
}

/// Above this clock bound (ms), lease deadlines lose that much of every lease.
const LARGE_CLOCK_BOUND_MS: i64 = 1_000;

pub(crate) async fn run(args: Args) -> anyhow::Result<ExitCode> {
    let session = args.conn.open(args.json).await?;
    let report = gather(&session.client, &session.uri(), session.embedded()).await?;
    if args.json {
        print_json(&report)?;
    } else {
        print_human(&report);
    }
    Ok(if report.version_supported {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

pub(crate) async fn gather(
    client: &mongodb::Client,
    uri: &str,
    embedded: bool,
) -> anyhow::Result<Report> {
    let admin = client.database("admin");
    let started = Instant::now();
    let hello: Document = admin.run_command(doc! { "hello": 1 }).await?;
    let round_trip = started.elapsed();
    let build: Document = admin.run_command(doc! { "buildInfo": 1 }).await?;
    let topology = if hello.get_str("msg") == Ok("isdbgrid") {
        "sharded (mongos)".to_owned()
    } else if let Ok(set) = hello.get_str("setName") {
        format!("replica set `{set}`")
    } else {
        "standalone".to_owned()
    };
    let max_wire_version = match hello.get("maxWireVersion") {
        Some(mongodb::bson::Bson::Int32(v)) => i64::from(*v),
        Some(mongodb::bson::Bson::Int64(v)) => *v,
        _ => -1,
    };
    let version = preflight::server_version(client).await?;
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let sample: ClockSample = time.refresh().await?;
    let capabilities = capabilities::probe(client).await?;
    let replicated = topology != "standalone";
    let (w, source) = effective_write_concern(client).await;
    let scan = scan_collections(client).await;
    let mut warnings = warnings(uri, replicated, &w, sample.bound_ms);
    warnings.extend(obsolete_index_warnings(&scan.obsolete_lock_ttl));
    warnings.extend(misnamed_default_warnings(&scan.misnamed_default));
    Ok(Report {
        uri: mask_uri(uri),
        embedded,
        server_version: build.get_str("version").unwrap_or("unknown").to_owned(),
        max_wire_version,
        version_supported: version.is_supported(),
        min_version: MIN_SERVER_VERSION,
        topology,
        round_trip_ms: round_trip.as_secs_f64() * 1000.0,
        clock_offset_ms: sample.offset_ms,
        clock_bound_ms: sample.bound_ms,
        capabilities,
        effective_write_concern: w,
        write_concern_source: source.to_owned(),
        warnings,
    })
}

/// The `w` writes get without a per-handle write concern, and where it comes from.
async fn effective_write_concern(client: &mongodb::Client) -> (String, &'static str) {
    if let Some(w) = client.write_concern().and_then(|wc| wc.w.as_ref()) {
        return (w_name(w), "uri");
    }
    // MongoDB 4.4+: the cluster-wide default; since 5.0 an implicit `majority` (or `w: 1`
    // with arbiters), reported with `defaultWriteConcernSource: "implicit"`.
    let reply = client
        .database("admin")
        .run_command(doc! { "getDefaultRWConcern": 1 })
        .await;
    let Ok(reply) = reply else {
        return ("unknown".to_owned(), "server");
    };
    let source = match reply.get_str("defaultWriteConcernSource") {
        Ok("implicit") => "implicit",
        _ => "server",
    };
    let w = reply
        .get_document("defaultWriteConcern")
        .ok()
        .and_then(|wc| wc.get("w"))
        .map_or_else(
            || "unknown".to_owned(),
            |w| match w {
                mongodb::bson::Bson::String(s) => s.clone(),
                other => other.to_string(),
            },
        );
    (w, source)
}

/// Name of the TTL index that lock collections of docwarden versions before session 17
/// carried on `expires_at` (`lock/collection.rs` drops it; its successor is `gc_at_gc`).
const OBSOLETE_LOCK_TTL_INDEX: &str = "expires_at_gc";

/// What [`scan_collections`] found.
#[derive(Debug, Default)]
struct Scan {
    /// The collections, as `db.collection`, that carry [`OBSOLETE_LOCK_TTL_INDEX`] as a
    /// TTL index on `expires_at`: lock collections a process of a version before session
    /// 17 opened (again).
    obsolete_lock_ttl: Vec<String>,
    /// The queue collections (they carry a docwarden claim index), as `db.collection`,
    /// holding jobs stored with `queue: "default"`
    /// ([`JobQueue::misnamed_default_filter`](docwarden::queue::JobQueue::misnamed_default_filter)),
    /// and how many.
    misnamed_default: Vec<(String, String, u64)>,
}

/// Reads every collection's indexes, in every database but `admin`, `config` and
/// `local` (one `listIndexes` per collection), and in each queue collection counts the
/// jobs stored with `queue: "default"` (one count: not indexed, it reads the
/// collection). Best effort: a database or collection the user may not list or count is
/// skipped (logged), never an error of `doctor`.
async fn scan_collections(client: &mongodb::Client) -> Scan {
    let mut found = Scan::default();
    let databases = match client.list_database_names().await {
        Ok(names) => names,
        Err(e) => {
            tracing::debug!(error = %e, "cannot list databases: collections not checked");
            return found;
        }
    };
    for name in databases {
        if matches!(name.as_str(), "admin" | "config" | "local") {
            continue;
        }
        let db = client.database(&name);
        let collections = match db
            .list_collection_names()
            .filter(doc! { "type": "collection" })
            .await
        {
            Ok(names) => names,
            Err(e) => {
                tracing::debug!(error = %e, database = %name, "cannot list collections");
                continue;
            }
        };
        for coll in collections {
            let handle = db.collection::<Document>(&coll);
            let indexes = match handle.list_indexes().await {
                Ok(cursor) => cursor.try_collect::<Vec<_>>().await,
                Err(e) => Err(e),
            };
            let indexes = match indexes {
                Ok(indexes) => indexes,
                Err(e) => {
                    tracing::debug!(error = %e, collection = %coll, "cannot list indexes");
                    continue;
                }
            };
            if indexes.iter().any(is_obsolete_lock_ttl_index) {
                found.obsolete_lock_ttl.push(format!("{name}.{coll}"));
            }
            if indexes.iter().any(is_claim_index) {
                match handle
                    .count_documents(JobQueue::misnamed_default_filter())
                    .await
                {
                    Ok(0) => {}
                    Ok(n) => found.misnamed_default.push((name.clone(), coll.clone(), n)),
                    Err(e) => {
                        tracing::debug!(error = %e, collection = %coll, "cannot count jobs");
                    }
                }
            }
        }
    }
    found.obsolete_lock_ttl.sort();
    found.misnamed_default.sort();
    found
}

/// Whether `index` is one of docwarden's claim indexes (format 3 or a legacy one): its
/// collection is a job queue.
fn is_claim_index(index: &mongodb::IndexModel) -> bool {
    let Some(name) = index.options.as_ref().and_then(|o| o.name.as_deref()) else {
        return false;
    };
    name == queue_index::CLAIM
        || name == queue_index::CLAIM_PARTITION
        || queue_index::LEGACY.contains(&name)
}

/// One `default-queue-field` warning per queue collection whose jobs store `queue:
/// "default"`, with the one-line fix.
fn misnamed_default_warnings(found: &[(String, String, u64)]) -> Vec<Warning> {
    found
        .iter()
        .map(|(db, coll, n)| Warning {
            code: "default-queue-field",
            message: format!(
                "queue collection `{db}.{coll}` has {n} job(s) stored with `queue: \"default\"` \
                 (a foreign producer or a hand edit): the default queue's jobs carry no \
                 `queue` field, so no docwarden worker claims them and `queue list` \
                 does not show them (`queue stats` counts them). Fix (mongosh): {}",
                crate::queue::misnamed_default_fix(db, coll)
            ),
        })
        .collect()
}

/// Whether `index` is the obsolete lock TTL index: its name, a TTL, on `expires_at`.
fn is_obsolete_lock_ttl_index(index: &mongodb::IndexModel) -> bool {
    let named = index
        .options
        .as_ref()
        .and_then(|o| o.name.as_deref())
        .is_some_and(|n| n == OBSOLETE_LOCK_TTL_INDEX);
    let ttl = index
        .options
        .as_ref()
        .is_some_and(|o| o.expire_after.is_some());
    named && ttl && index.keys.keys().next().map(String::as_str) == Some(lock_field::EXPIRES_AT)
}

/// One `obsolete-lock-ttl-index` warning per collection of `collections` (`db.collection`).
fn obsolete_index_warnings(collections: &[String]) -> Vec<Warning> {
    collections
        .iter()
        .map(|c| Warning {
            code: "obsolete-lock-ttl-index",
            message: format!(
                "lock collection `{c}` has the TTL index `{OBSOLETE_LOCK_TTL_INDEX}` on \
                 `expires_at` of a docwarden version before session 17 (a process of that \
                 version opened it: an unfinished rolling upgrade). It can delete a \
                 read/write lock document while readers are inside, and a writer then \
                 overlaps a live reader. Stop every process of the earlier version, then \
                 open the collection once with this version (your service's \
                 `LockCollection::open` / `RwLocks::open` with its own `LockOptions`): it \
                 drops the index and gives each document a `gc_at` (docs/locks.md, \
                 \"Migration from earlier versions\")."
            ),
        })
        .collect()
}

fn w_name(w: &mongodb::options::Acknowledgment) -> String {
    use mongodb::options::Acknowledgment;
    match w {
        Acknowledgment::Nodes(n) => n.to_string(),
        Acknowledgment::Majority => "majority".to_owned(),
        Acknowledgment::Custom(tag) => tag.clone(),
        _ => "unknown".to_owned(),
    }
}

/// What weakens a guarantee here (see `docs/deployment.md`, "What doctor warns about").
fn warnings(uri: &str, replicated: bool, w: &str, clock_bound_ms: i64) -> Vec<Warning> {
    let mut out = Vec::new();
    if replicated && (w == "0" || w == "1") {
        out.push(Warning {
            code: "write-concern-w1",
            message: format!(
                "writes default to w: {w} on a replicated deployment: a failover can roll back \
                 an acknowledged lock acquisition, claim, completion or fenced write, and a \
                 fencing token can be handed out twice. Set w=majority in the URI or \
                 `write_concern(WriteConcern::majority())` on the lock, queue and sequence \
                 handles."
            ),
        });
    }
    let query = uri
        .split_once('?')
        .map_or("", |(_, q)| q)
        .to_ascii_lowercase();
    if query.split('&').any(|kv| kv == "retrywrites=false") {
        out.push(Warning {
            code: "retry-writes-off",
            message: "retryWrites=false: a write whose reply is lost in a failover is not \
                      retried by the driver; docwarden reads the outcome back where it can, \
                      but more operations end indeterminate. Remove retryWrites=false."
                .to_owned(),
        });
    }
    if !replicated {
        out.push(Warning {
            code: "standalone",
            message: "a standalone server has no change streams (workers wake by polling, \
                      enqueue-to-start is poll_min, not milliseconds) and no majority commit; \
                      run a replica set (one member is enough) in production."
                .to_owned(),
        });
    }
    if clock_bound_ms > LARGE_CLOCK_BOUND_MS {
        out.push(Warning {
            code: "clock-bound-large",
            message: format!(
                "the server clock is known only within ±{clock_bound_ms} ms (a slow round \
                 trip): every lease loses that much validity; check the network path."
            ),
        });
    }
    out
}

fn print_human(r: &Report) {
    let kind = if r.embedded {
        " (embedded secantusd-rs)"
    } else {
        ""
    };
    println!("server          {}{kind}", r.uri);
    println!("version         {}", r.server_version);
    println!("wire version    {}", r.max_wire_version);
    println!(
        "minimum         MongoDB {} (wire version 17): {}",
        r.min_version,
        if r.version_supported {
            "ok"
        } else {
            "TOO OLD — docwarden's handles refuse to open on this server"
        }
    );
    println!("topology        {}", r.topology);
    println!("round trip      {:.2} ms", r.round_trip_ms);
    println!(
        "clock offset    {:+} ms ± {} ms (server minus this machine)",
        r.clock_offset_ms, r.clock_bound_ms
    );
    println!(
        "write concern   w: {} ({})",
        r.effective_write_concern, r.write_concern_source
    );
    println!("capabilities:");
    for (name, support) in r.capabilities.rows() {
        println!("  {name:<22} {support}");
    }
    if r.warnings.is_empty() {
        println!("warnings        none");
    } else {
        println!("warnings:");
        for w in &r.warnings {
            println!("  {:<18} {}", w.code, w.message);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use docwarden::clock::{ClockOptions, TimeSource};
    use docwarden::format::lock::collection as lock_field;
    use docwarden::lock::{LockCollection, LockOptions};
    use docwarden::queue::{EnqueueOptions, JobQueue, QueueOptions};
    use docwarden_testkit::TestDb;
    use mongodb::IndexModel;
    use mongodb::bson::oid::ObjectId;
    use mongodb::bson::{Document, doc};
    use mongodb::options::IndexOptions;

    use super::{gather, warnings};

    /// The `obsolete-lock-ttl-index` warnings of `doctor` (against the test's server)
    /// that name a collection of database `db`.
    async fn obsolete_in(t: &TestDb, db: &str) -> anyhow::Result<Vec<String>> {
        let report = gather(&t.client, t.uri(), false).await?;
        Ok(report
            .warnings
            .into_iter()
            .filter(|w| w.code == "obsolete-lock-ttl-index")
            .filter(|w| w.message.contains(&format!("`{db}.")))
            .map(|w| w.message)
            .collect())
    }

    /// Session 18: a lock collection that a process of a version before session 17 opened
    /// keeps (or gets back) the TTL index `expires_at_gc` on `expires_at`, which can delete
    /// a read/write lock document with live readers. `doctor` names it, with what to do;
    /// a collection with only an index of that name that is not a TTL is not named; once
    /// the collection is opened by this version (the migration), the warning goes.
    /// Without the check: no warning (fails).
    #[tokio::test]
    async fn doctor_warns_about_the_obsolete_lock_ttl_index() -> anyhow::Result<()> {
        let t = TestDb::new("doctor_obsolete_ttl").await?;
        let db = t.db.name().to_owned();
        let old = t.db.collection::<Document>("locks_old");
        old.create_index(
            IndexModel::builder()
                .keys(doc! { lock_field::EXPIRES_AT: 1 })
                .options(
                    IndexOptions::builder()
                        .name("expires_at_gc".to_owned())
                        .expire_after(Duration::from_secs(3600))
                        .build(),
                )
                .build(),
        )
        .await?;
        let not_ttl = t.db.collection::<Document>("not_a_ttl");
        not_ttl
            .create_index(
                IndexModel::builder()
                    .keys(doc! { lock_field::EXPIRES_AT: 1 })
                    .options(
                        IndexOptions::builder()
                            .name("expires_at_gc".to_owned())
                            .build(),
                    )
                    .build(),
            )
            .await?;
        let warned = obsolete_in(&t, &db).await?;
        assert_eq!(warned.len(), 1, "{warned:?}");
        assert!(
            warned[0].contains(&format!("`{db}.locks_old`")),
            "{warned:?}"
        );
        assert!(
            warned[0].contains("LockCollection::open"),
            "what to do: {warned:?}"
        );

        let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
        LockCollection::open(&t.db, "locks_old", time, LockOptions::default()).await?;
        let warned = obsolete_in(&t, &db).await?;
        assert!(warned.is_empty(), "migrated: {warned:?}");
        Ok(())
    }

    /// Session 19: a job stored with `queue: "default"` (a foreign producer, a hand edit)
    /// is in no queue: the default queue's jobs carry no `queue` field. `doctor` names
    /// the collection, the count and the one-line fix; after the fix the warning goes and
    /// the job is claimable. Without the check: no warning (fails).
    #[tokio::test]
    async fn doctor_warns_about_jobs_stored_with_queue_default() -> anyhow::Result<()> {
        let t = TestDb::new("doctor_default_queue_field").await?;
        let db = t.db.name().to_owned();
        let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
        let q = JobQueue::open(&t.db, "jobs", time, QueueOptions::default()).await?;
        q.enqueue(doc! { "n": 1 }, &EnqueueOptions::default())
            .await?;
        let jobs = t.db.collection::<Document>("jobs");
        let mut foreign = jobs
            .find_one(doc! {})
            .await?
            .ok_or_else(|| anyhow::anyhow!("no job"))?;
        foreign.insert("_id", ObjectId::new());
        foreign.insert("queue", "default");
        jobs.insert_one(foreign).await?;
        let mine = |r: super::Report| -> Vec<String> {
            r.warnings
                .into_iter()
                .filter(|w| w.code == "default-queue-field")
                .filter(|w| w.message.contains(&format!("`{db}.jobs`")))
                .map(|w| w.message)
                .collect()
        };
        let warned = mine(gather(&t.client, t.uri(), false).await?);
        assert_eq!(warned.len(), 1, "{warned:?}");
        assert!(warned[0].contains("has 1 job(s)"), "{warned:?}");
        assert!(
            warned[0].contains(r#"updateMany({"queue":"default"}, {"$unset": {"queue": ""}})"#),
            "the fix: {warned:?}"
        );

        // The fix as printed, through the driver.
        jobs.update_many(
            JobQueue::misnamed_default_filter(),
            doc! { "$unset": { "queue": "" } },
        )
        .await?;
        assert!(mine(gather(&t.client, t.uri(), false).await?).is_empty());
        assert_eq!(q.stats().await?.total, 2);
        Ok(())
    }

    fn codes(uri: &str, replicated: bool, w: &str, bound: i64) -> Vec<&'static str> {
        warnings(uri, replicated, w, bound)
            .into_iter()
            .map(|w| w.code)
            .collect()
    }

    #[test]
    fn w1_on_a_replica_set_is_a_warning_and_majority_is_not() {
        assert_eq!(
            codes("mongodb://h/?w=1", true, "1", 5),
            ["write-concern-w1"]
        );
        assert!(codes("mongodb://h/", true, "majority", 5).is_empty());
    }

    #[test]
    fn retry_writes_off_standalone_and_a_wide_clock_bound_are_warnings() {
        assert_eq!(
            codes("mongodb://h/?retryWrites=false", false, "1", 2_000),
            ["retry-writes-off", "standalone", "clock-bound-large"]
        );
    }
}
