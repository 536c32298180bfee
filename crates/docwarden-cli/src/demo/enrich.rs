//! `docwarden demo enrich`: seed 002 — messages with random originating IPs, enriched by
//! N workers with a location from a geo HTTP service, through the job queue.
//!
//! The network here is closed, so the demo starts its own small geo service on
//! 127.0.0.1 (hand-written HTTP/1.1 over tokio) with configurable latency and failure
//! rate, and the workers call it over real HTTP. One worker is killed mid-run; its jobs
//! are re-claimed after their lease.
//!
//! Two queue features a real deployment of this seed needs: the geo service takes at most
//! [`GEO_CONCURRENCY`] calls at once, so every job carries the concurrency key `geo` and
//! the database grants at most that many permits across all workers (the service counts
//! the calls it sees at once: more than the limit is a violation); and a periodic job,
//! scheduled every second, writes a progress snapshot — every worker runs the scheduler,
//! and each tick must be enqueued exactly once (a tick with two jobs is a violation).
//! Configure with environment variables:
//! `DOCWARDEN_ENRICH_MESSAGES` (200), `DOCWARDEN_ENRICH_WORKERS` (4),
//! `DOCWARDEN_ENRICH_LATENCY_MS` (20), `DOCWARDEN_ENRICH_FAILURE_RATE` (0.1).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::format::field;
use futures::TryStreamExt;

use docwarden::queue::{
    EnqueueOptions, JobQueue, JobState, LimitOptions, QueueOptions, Schedule, ScheduleSpec, Worker,
    WorkerOptions,
};
use mongodb::Database;
use mongodb::bson::{Bson, Document, doc};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::ScenarioReport;

struct Config {
    messages: usize,
    workers: usize,
    latency: Duration,
    failure_rate: f64,
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

impl Config {
    fn from_env() -> anyhow::Result<Self> {
        let c = Config {
            messages: env_or("DOCWARDEN_ENRICH_MESSAGES", 200),
            workers: env_or("DOCWARDEN_ENRICH_WORKERS", 4),
            latency: Duration::from_millis(env_or("DOCWARDEN_ENRICH_LATENCY_MS", 20)),
            failure_rate: env_or("DOCWARDEN_ENRICH_FAILURE_RATE", 0.1),
        };
        anyhow::ensure!(
            c.messages >= 1 && c.workers >= 2,
            "need at least 1 message and 2 workers"
        );
        anyhow::ensure!(
            (0.0..1.0).contains(&c.failure_rate),
            "failure rate must be in [0, 1)"
        );
        Ok(c)
    }
}

/// Calls the geo service may serve at once, across all workers (a concurrency limit).
pub(crate) const GEO_CONCURRENCY: u32 = 3;

/// The concurrency key every enrichment job carries.
const GEO_KEY: &str = "geo";

/// The periodic job's schedule name and period.
const PROGRESS_SCHEDULE: &str = "enrich-progress";
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// Calls in flight at the geo service now, and the most seen at once.
#[derive(Default)]
struct InFlight {
    now: AtomicUsize,
    max: AtomicUsize,
}

const COUNTRIES: [(&str, &str); 6] = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Brazil", "São Paulo"),
    ("Kenya", "Nairobi"),
    ("Canada", "Toronto"),
    ("India", "Mumbai"),
];

/// The geo service: `GET /json/<ip>` → 200 with a location, or 503 at the failure rate.
async fn geo_service(
    listener: TcpListener,
    latency: Duration,
    failure_rate: f64,
    in_flight: Arc<InFlight>,
    stop: CancellationToken,
) {
    loop {
        let (mut sock, _) = tokio::select! {
            () = stop.cancelled() => return,
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(_) => continue,
            },
        };
        let in_flight = Arc::clone(&in_flight);
        tokio::spawn(async move {
            let mut buf = Vec::with_capacity(512);
            let mut chunk = [0_u8; 512];
            while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 8192 {
                match sock.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            let text = String::from_utf8_lossy(&buf);
            let path = text.split_whitespace().nth(1).unwrap_or("/");
            let ip = path.strip_prefix("/json/").unwrap_or("").to_owned();
            let now = in_flight.now.fetch_add(1, Ordering::SeqCst) + 1;
            in_flight.max.fetch_max(now, Ordering::SeqCst);
            let jitter = latency.mul_f64(0.5 + rand::random::<f64>());
            tokio::time::sleep(jitter).await;
            in_flight.now.fetch_sub(1, Ordering::SeqCst);
            let (status, body) = if ip.is_empty() {
                (
                    "404 Not Found",
                    serde_json::json!({ "status": "fail", "message": "invalid query" }),
                )
            } else if rand::random::<f64>() < failure_rate {
                (
                    "503 Service Unavailable",
                    serde_json::json!({ "status": "fail", "message": "overloaded" }),
                )
            } else {
                let h = ip.bytes().fold(7_usize, |h, b| {
                    h.wrapping_mul(31).wrapping_add(usize::from(b))
                });
                let (country, city) = COUNTRIES[h % COUNTRIES.len()];
                (
                    "200 OK",
                    serde_json::json!({ "status": "success", "query": ip, "country": country, "city": city }),
                )
            };
            let body = body.to_string();
            let reply = format!(
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(reply.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}

/// A minimal HTTP/1.1 GET: returns the JSON body of a 200, or an error naming the status.
async fn fetch_location(addr: std::net::SocketAddr, ip: &str) -> anyhow::Result<serde_json::Value> {
    let exchange = async {
        let mut sock = TcpStream::connect(addr).await?;
        let req = format!("GET /json/{ip} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        sock.write_all(req.as_bytes()).await?;
        let mut raw = Vec::new();
        sock.read_to_end(&mut raw).await?;
        anyhow::Ok(raw)
    };
    let raw = tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .context("geo service timed out")??;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("malformed HTTP reply")?;
    let status = head.lines().next().unwrap_or("");
    anyhow::ensure!(status.contains(" 200 "), "geo service answered `{status}`");
    Ok(serde_json::from_str(body)?)
}

fn random_ip() -> String {
    (0..4)
        .map(|_| rand::random_range(1..=255_u16).to_string())
        .collect::<Vec<_>>()
        .join(".")
}

pub(crate) async fn run(
    session: &crate::conn::Session,
    db: &Database,
) -> anyhow::Result<Vec<ScenarioReport>> {
    let cfg = Config::from_env()?;
    let started = Instant::now();
    crate::demo::narrate!(
        "== enrich (seed 002): {} messages, {} workers, geo service latency ~{} ms, failure rate {:.0}%",
        cfg.messages,
        cfg.workers,
        cfg.latency.as_millis(),
        cfg.failure_rate * 100.0
    );
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = CancellationToken::new();
    let in_flight = Arc::new(InFlight::default());
    let service = tokio::spawn(geo_service(
        listener,
        cfg.latency,
        cfg.failure_rate,
        Arc::clone(&in_flight),
        stop.clone(),
    ));
    crate::demo::narrate!(
        "   geo service on http://{addr}/json/<ip>; it takes at most {GEO_CONCURRENCY} calls at once"
    );

    // The messages, as in the seed: `location: null` marks one still to enrich.
    let messages = db.collection::<Document>("message");
    let docs: Vec<Document> = (0..cfg.messages)
        .map(|i| doc! { "_id": i64::try_from(i).unwrap_or(i64::MAX), "originatingIp": random_ip(), "location": Bson::Null })
        .collect();
    messages.insert_many(docs.clone()).await?;
    let time = TimeSource::server(session.client.clone(), ClockOptions::default())?;
    let queue = JobQueue::open(
        db,
        "enrich_jobs",
        time,
        QueueOptions::default()
            .lease_ttl(Duration::from_secs(3))
            .reap_interval(Duration::from_millis(250))
            .retry_delays(Duration::from_millis(100), Duration::from_secs(2))
            .max_attempts(8)
            .limits(LimitOptions::default().key_concurrency(GEO_CONCURRENCY)),
    )
    .await?;
    queue
        .schedule(&Schedule::new(
            PROGRESS_SCHEDULE,
            ScheduleSpec::every(PROGRESS_EVERY)?,
            doc! { "snapshot": true },
        ))
        .await?;
    crate::demo::narrate!(
        "   concurrency limit: every job carries the key `{GEO_KEY}`; the database grants at most {GEO_CONCURRENCY} running at once across all workers"
    );
    crate::demo::narrate!(
        "   periodic job `{PROGRESS_SCHEDULE}` every {} s (a progress snapshot); every worker runs the scheduler, each tick is enqueued once",
        PROGRESS_EVERY.as_secs()
    );
    let jobs = docs.iter().map(|d| {
        let id = d.get("_id").cloned().unwrap_or(Bson::Null);
        let key = format!("message-{id}");
        (
            doc! { "message": id, "ip": d.get("originatingIp").cloned().unwrap_or(Bson::Null) },
            EnqueueOptions::default()
                .dedupe_key(key)
                .concurrency_key(GEO_KEY),
        )
    });
    queue.enqueue_many(jobs).await?;
    crate::demo::narrate!(
        "   {} jobs enqueued (one per message, deduplicated by message id)",
        cfg.messages
    );

    let spawn = |w: usize, messages: mongodb::Collection<Document>| {
        Worker::spawn(
            queue.clone(),
            WorkerOptions::default()
                .name(format!("enricher{w}"))
                .concurrency(4)
                .poll(Duration::from_millis(20), Duration::from_millis(500))
                .run_schedules(true),
            move |job| {
                let messages = messages.clone();
                async move {
                    let p = job.payload().as_document().cloned().unwrap_or_default();
                    if p.get_bool("snapshot").unwrap_or(false) {
                        // The periodic job: a snapshot of how many messages are enriched.
                        let enriched = messages
                            .count_documents(doc! { "location": { "$ne": Bson::Null } })
                            .await?;
                        return Ok(Bson::Int64(i64::try_from(enriched).unwrap_or(i64::MAX)));
                    }
                    let ip = p
                        .get_str("ip")
                        .map_err(|e| format!("payload: {e}"))?
                        .to_owned();
                    let location = fetch_location(addr, &ip).await.map_err(|e| e.to_string())?;
                    let location = mongodb::bson::to_bson(&location)?;
                    // Idempotent write, as in the seed: only a message still without a
                    // location is enriched, so a re-run after a lost lease cannot double it.
                    let msg = p.get("message").cloned().unwrap_or(Bson::Null);
                    messages
                        .update_one(
                            doc! { "_id": msg, "location": Bson::Null },
                            doc! { "$set": { "location": location.clone() }, "$inc": { "enrichments": 1 } },
                        )
                        .await?;
                    Ok(location)
                }
            },
        )
    };
    let mut workers = Vec::new();
    for w in 0..cfg.workers {
        workers.push(spawn(w, messages.clone())?);
    }
    let coll = queue.collection().clone();
    let total = u64::try_from(cfg.messages)?;
    let mut killed = false;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let stats = queue.stats().await?;
        let get = |s: JobState| stats.by_state.get(s.as_str()).copied().unwrap_or(0);
        let finished = messages
            .count_documents(doc! { "location": { "$ne": Bson::Null } })
            .await?
            + coll
                .count_documents(doc! { field::STATE: JobState::Dead.as_str() })
                .await?;
        crate::demo::narrate!(
            "   {:>5.1}s  succeeded {:>4}  running {:>3}  retrying {:>3}  ready {:>4}  dead {}  geo calls at once: max {}",
            started.elapsed().as_secs_f64(),
            get(JobState::Succeeded),
            get(JobState::Running),
            get(JobState::Retrying),
            get(JobState::Ready),
            get(JobState::Dead),
            in_flight.max.load(Ordering::SeqCst)
        );
        if !killed && get(JobState::Running) > 0 && get(JobState::Succeeded) >= total / 4 {
            let victim = workers.remove(0);
            let owner = victim.owner().to_owned();
            let r = victim.kill().await;
            crate::demo::narrate!(
                "   killed worker {owner} mid-run ({} jobs claimed); its jobs return after the 3 s lease",
                r.claimed
            );
            killed = true;
        }
        // Done when every message is enriched (or dead) and no job is running: a job
        // the killed worker held may have enriched its message already and stays
        // `running` until its lease expires and the sweep hands it to a live worker;
        // only one still running at the deadline is stuck.
        if (finished >= total && get(JobState::Running) == 0) || Instant::now() > deadline {
            break;
        }
    }
    let mut retried = 0;
    for w in workers {
        retried += w.shutdown().await.retried;
    }
    stop.cancel();
    let _ = service.await;

    let enriched = messages
        .count_documents(doc! { "location": { "$ne": Bson::Null } })
        .await?;
    let duplicated = messages
        .count_documents(doc! { "enrichments": { "$gt": 1 } })
        .await?;
    let running = coll
        .count_documents(doc! { field::STATE: JobState::Running.as_str() })
        .await?;
    let dead = coll
        .count_documents(doc! { field::STATE: JobState::Dead.as_str() })
        .await?;
    let lost = total.saturating_sub(enriched).saturating_sub(dead);
    // The concurrency limit, as the geo service saw it.
    let max_calls = in_flight.max.load(Ordering::SeqCst);
    let over_limit = u64::from(max_calls > GEO_CONCURRENCY as usize);
    // The periodic job: one job per tick.
    let ticks: Vec<Document> = coll
        .aggregate(vec![
            doc! { "$match": { field::SCHEDULE: PROGRESS_SCHEDULE } },
            doc! { "$group": { "_id": format!("${}", field::TICK), "jobs": { "$sum": 1 } } },
        ])
        .await?
        .try_collect()
        .await?;
    let tick_count = u64::try_from(ticks.len())?;
    let twice = u64::try_from(
        ticks
            .iter()
            .filter(|t| {
                t.get_i32("jobs")
                    .map(i64::from)
                    .or_else(|_| t.get_i64("jobs"))
                    .unwrap_or(0)
                    > 1
            })
            .count(),
    )?;
    crate::demo::narrate!(
        "   concurrency limit: at most {max_calls} geo calls at once (limit {GEO_CONCURRENCY}){}",
        if over_limit > 0 { " — VIOLATED" } else { "" }
    );
    crate::demo::narrate!(
        "   periodic job `{PROGRESS_SCHEDULE}`: {tick_count} ticks enqueued, {twice} enqueued twice"
    );
    crate::demo::narrate!("   final documents:");
    let mut by_country = std::collections::BTreeMap::<String, u64>::new();
    let mut cursor = messages.find(doc! {}).await?;
    let mut shown = 0;
    while cursor.advance().await? {
        let d = cursor.deserialize_current()?;
        let country = d
            .get_document("location")
            .ok()
            .and_then(|l| l.get_str("country").ok())
            .unwrap_or("(none)")
            .to_owned();
        if shown < 5 {
            crate::demo::narrate!(
                "     {{ _id: {}, originatingIp: {}, location.country: {country} }}",
                d.get("_id").map(ToString::to_string).unwrap_or_default(),
                d.get_str("originatingIp").unwrap_or("?")
            );
            shown += 1;
        }
        *by_country.entry(country).or_default() += 1;
    }
    crate::demo::narrate!("     … by country: {by_country:?}");
    crate::demo::narrate!(
        "   {enriched}/{total} enriched, {retried} failed calls retried, {dead} dead after {} attempts, lost {lost}, duplicated {duplicated}, stuck running {running}",
        8
    );
    Ok(vec![ScenarioReport {
        scenario: "enrich",
        operations: total,
        violations: lost + duplicated + running + over_limit + twice,
        elapsed: started.elapsed(),
    }])
}
