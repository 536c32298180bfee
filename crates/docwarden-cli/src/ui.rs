//! `docwarden ui`: a web dashboard for the queues and lock collections of one database,
//! with actions, live updates and Prometheus metrics.
//!
//! Pages: queues (one card per named queue of each queue collection: counts by state,
//! finished jobs and latency per minute, the oldest due job's wait, whether it is paused
//! and since when), the job list (filters: collection, named queue, state, key or id, text
//! in the last error — the library's [`docwarden::queue::JobListFilter`]), a job (payload,
//! attempts, stalls, lease, last error, progress, result, the stored document), locks
//! (leases, election leaders and terms, read/write locks' writer and readers, semaphores'
//! permits and holders, and with `--documents` the document locks of entity collections;
//! holder, token, expiry counting down), and past `verify` reports (`--reports DIR`).
//! `GET /metrics` serves Prometheus text (see [`metrics`]); `GET /events` pushes a change
//! notification (see [`live`]).
//!
//! **Guarantee:** every value read from the database is HTML-escaped by the templates
//! (auto-escaping is on for every `.html` template, and the pages' Content-Security-Policy
//! forbids inline scripts besides); reads never write; the actions (retry dead jobs,
//! cancel, purge, pause and resume a queue) are POSTs that need the token printed at start
//! and are refused cross-site (see [`guard`]). **Limits:** only the last error of a job is
//! stored (the job format has no error history), so the page shows that one with the
//! attempts and transition times; plain HTTP: bind to loopback (the default).

use std::net::SocketAddr;

use anyhow::Context as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Form, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{CancelOutcome, JobState, PauseOutcome};
use minijinja::context;
use mongodb::bson::oid::ObjectId;
use mongodb::{Client, Database};
use tokio_util::sync::CancellationToken;

use crate::conn::ConnArgs;

mod data;
mod guard;
mod live;
mod metrics;
mod snapshot;

use data::Catalog;
use snapshot::Stale;

/// Arguments of `docwarden ui`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    conn: ConnArgs,
    /// Database holding the queues and lock collections.
    #[arg(long, default_value = "docwarden")]
    db: String,
    /// Address to serve on. Port 0 picks a free port (the URL is printed).
    #[arg(long, default_value = "127.0.0.1:7433")]
    listen: SocketAddr,
    /// Show data only: no action is accepted, and no token is printed.
    #[arg(long)]
    read_only: bool,
    /// Queue collections to show (repeatable). Default: every collection `q` of the
    /// database that has a `q.meta` options collection.
    #[arg(long = "queue")]
    queues: Vec<String>,
    /// Lock collections to show (repeatable). Default: every collection `l` that has an
    /// `l.tokens` counter collection.
    #[arg(long = "locks")]
    locks: Vec<String>,
    /// The lock collection of the elections (`docwarden::lock::Election`), shown as
    /// leaders and terms.
    #[arg(long, default_value = docwarden::lock::format::ELECTIONS)]
    elections: String,
    /// The collection of the read/write locks (`docwarden::lock::RwLocks`).
    #[arg(long, default_value = docwarden::lock::format::RWLOCKS)]
    rwlocks: String,
    /// The collection of the semaphores (`docwarden::lock::Semaphore`).
    #[arg(long, default_value = docwarden::lock::format::SEMAPHORES)]
    semaphores: String,
    /// Entity collections that use document locks (`docwarden::lock::DocumentLocks`,
    /// default fields `lock_id`/`lock_time`, 30 s validity): their locked documents are
    /// shown on the locks page (repeatable; none by default, as finding them reads the
    /// collection).
    #[arg(long = "documents")]
    documents: Vec<String>,
    /// A directory of `docwarden verify` HTML reports to list and serve.
    #[arg(long)]
    reports: Option<PathBuf>,
    /// Read the queue and lock counts, and each job listing (per filter), at most every
    /// this many seconds (1 to 3600), and at most every 20 times what reading them took:
    /// every page and scrape in between shows the last ones read (a count reads the whole
    /// collection; a listing, every job its filter matches).
    #[arg(long, default_value_t = 1)]
    counts_every: u64,
    /// Test-only: poll for changes instead of opening a change stream.
    #[arg(long, hide = true)]
    poll_only: bool,
}

/// How the dashboard is served (what [`start`] needs besides the connection).
#[derive(Debug, Clone)]
pub(crate) struct UiConfig {
    /// Address to bind.
    pub(crate) listen: SocketAddr,
    /// No actions, no token.
    pub(crate) read_only: bool,
    /// Queue collections; empty: discover.
    pub(crate) queues: Vec<String>,
    /// Lock collections; empty: discover.
    pub(crate) locks: Vec<String>,
    /// Verify reports directory.
    pub(crate) reports: Option<PathBuf>,
    /// The collections of the elections, read/write locks and semaphores.
    pub(crate) kinds: KindNames,
    /// Entity collections whose document locks are shown.
    pub(crate) documents: Vec<String>,
    /// The shortest time the queue counts are reused (`ui/snapshot.rs`).
    pub(crate) counts_every: Duration,
    /// Poll for changes instead of watching a change stream (tests of the fallback).
    pub(crate) poll_only: bool,
}

impl UiConfig {
    /// Read-only on a free loopback port, discovering everything (what `demo --ui` uses).
    pub(crate) fn read_only_local() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            read_only: true,
            queues: Vec::new(),
            locks: Vec::new(),
            reports: None,
            kinds: KindNames::default(),
            documents: Vec::new(),
            counts_every: snapshot::MIN_FRESH,
            poll_only: false,
        }
    }
}

/// Where the elections, read/write locks and semaphores live (the defaults of
/// `docwarden locks`).
#[derive(Debug, Clone)]
pub(crate) struct KindNames {
    /// The elections' lock collection.
    pub(crate) elections: String,
    /// The read/write locks' collection.
    pub(crate) rwlocks: String,
    /// The semaphores' collection.
    pub(crate) semaphores: String,
}

impl Default for KindNames {
    fn default() -> Self {
        Self {
            elections: docwarden::lock::format::ELECTIONS.to_owned(),
            rwlocks: docwarden::lock::format::RWLOCKS.to_owned(),
            semaphores: docwarden::lock::format::SEMAPHORES.to_owned(),
        }
    }
}

impl KindNames {
    /// Whether `name` is one of these collections (not a plain lease collection).
    pub(crate) fn contains(&self, name: &str) -> bool {
        [&self.elections, &self.rwlocks, &self.semaphores]
            .iter()
            .any(|n| n.as_str() == name)
    }
}

/// Which collections are shown: per kind, the ones named, or else those discovered at
/// each read (`--queue jobs` alone still discovers the lock collections).
#[derive(Debug, Clone)]
pub(crate) struct Catalogue {
    queues: Arc<Vec<String>>,
    locks: Arc<Vec<String>>,
}

impl Catalogue {
    /// The collections to show now.
    pub(crate) async fn get(&self, db: &Database) -> anyhow::Result<Catalog> {
        if !self.queues.is_empty() && !self.locks.is_empty() {
            return Ok(Catalog {
                queues: self.queues.to_vec(),
                locks: self.locks.to_vec(),
            });
        }
        let found = data::discover(db, &[], &[]).await?;
        let named_or = |named: &Arc<Vec<String>>, found: Vec<String>| {
            if named.is_empty() {
                found
            } else {
                named.to_vec()
            }
        };
        Ok(Catalog {
            queues: named_or(&self.queues, found.queues),
            locks: named_or(&self.locks, found.locks),
        })
    }
}

struct AppState {
    db: Database,
    time: TimeSource,
    catalogue: Catalogue,
    templates: minijinja::Environment<'static>,
    token: Option<String>,
    reports: Option<PathBuf>,
    kinds: KindNames,
    documents: Vec<String>,
    live: Arc<live::Live>,
    /// The queue collections' counts, read at a paced rate (`ui/snapshot.rs`).
    snapshots: Arc<snapshot::Snapshots>,
    loopback: bool,
}

type Shared = Arc<AppState>;

/// A running dashboard; dropping it stops the server.
pub(crate) struct Running {
    /// The base URL, e.g. `http://127.0.0.1:7433/`.
    pub(crate) url: String,
    /// The action token (`None` when read-only).
    pub(crate) token: Option<String>,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Running {
    /// Serves until the server fails.
    ///
    /// # Errors
    /// The server's I/O error.
    pub(crate) async fn wait(mut self) -> anyhow::Result<()> {
        (&mut self.task).await??;
        Ok(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

fn templates() -> anyhow::Result<minijinja::Environment<'static>> {
    let mut env = minijinja::Environment::new();
    // Auto-escaping: minijinja's default callback escapes HTML in every template whose
    // name ends in `.html`, which is every template here.
    env.add_template("base.html", include_str!("ui/templates/base.html"))?;
    env.add_template("queues.html", include_str!("ui/templates/queues.html"))?;
    env.add_template("jobs.html", include_str!("ui/templates/jobs.html"))?;
    env.add_template("job.html", include_str!("ui/templates/job.html"))?;
    env.add_template("locks.html", include_str!("ui/templates/locks.html"))?;
    env.add_template("reports.html", include_str!("ui/templates/reports.html"))?;
    env.add_template("error.html", include_str!("ui/templates/error.html"))?;
    Ok(env)
}

/// Binds, prints nothing, and serves in the background.
///
/// # Errors
/// The address cannot be bound; the metrics recorder cannot be installed.
pub(crate) async fn start(client: Client, db: Database, cfg: UiConfig) -> anyhow::Result<Running> {
    metrics::handle()?;
    metrics::describe();
    let time = TimeSource::server(client, ClockOptions::default())?;
    let catalogue = Catalogue {
        queues: Arc::new(cfg.queues),
        locks: Arc::new(cfg.locks),
    };
    let cancel = CancellationToken::new();
    let live = live::Live::new();
    // A page served stale counts is told to fetch itself again once they are read.
    let snapshots = Arc::new(snapshot::Snapshots::new(cfg.counts_every, {
        let live = Arc::clone(&live);
        Arc::new(move || live.changed())
    }));
    live.spawn(
        db.clone(),
        time.clone(),
        catalogue.clone(),
        Arc::clone(&snapshots),
        cfg.poll_only,
        cancel.clone(),
    );
    // The first page shows how live updates run: wait (briefly) for the watcher to pick.
    for _ in 0..50 {
        if live.mode() != live::Mode::Starting {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let token = (!cfg.read_only).then(guard::new_token);
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let state = Arc::new(AppState {
        db,
        time,
        catalogue,
        templates: templates()?,
        token: token.clone(),
        reports: cfg.reports,
        kinds: cfg.kinds,
        documents: cfg.documents,
        live,
        snapshots,
        loopback: addr.ip().is_loopback(),
    });
    let app = router(state);
    let stop = cancel.clone();
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await
    });
    Ok(Running {
        url: format!("http://{addr}/"),
        token,
        cancel,
        task,
    })
}

fn router(state: Shared) -> axum::Router {
    axum::Router::new()
        .route("/", get(queues_page))
        .route("/jobs", get(jobs_page))
        .route("/jobs/{queue}/{id}", get(job_page))
        .route("/locks", get(locks_page))
        .route("/reports", get(reports_page))
        .route("/reports/{name}", get(report_file))
        .route("/events", get(events))
        .route("/metrics", get(metrics_endpoint))
        .route("/static/app.js", get(app_js))
        .route("/static/style.css", get(style_css))
        .route("/actions/retry", post(action_retry))
        .route("/actions/cancel", post(action_cancel))
        .route("/actions/purge", post(action_purge))
        .route("/actions/pause", post(action_pause))
        .route("/actions/resume", post(action_resume))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            protect,
        ))
        .with_state(state)
}

/// Refuses a foreign `Host` on a loopback bind (DNS rebinding) and sets the security
/// headers: no inline script, no framing, no sniffing, no referrer.
async fn protect(State(state): State<Shared>, req: Request, next: Next) -> Response {
    if state.loopback && !guard::loopback_host(req.headers()) {
        return (
            StatusCode::MISDIRECTED_REQUEST,
            "this dashboard answers only on a loopback host name",
        )
            .into_response();
    }
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    if !h.contains_key(header::CONTENT_SECURITY_POLICY) {
        h.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(
                "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                 connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
            ),
        );
    }
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    resp
}

/// An error page (500, or the status given), its message escaped.
struct UiError(StatusCode, String);

impl From<anyhow::Error> for UiError {
    fn from(e: anyhow::Error) -> Self {
        UiError(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}"))
    }
}

impl From<docwarden::Error> for UiError {
    fn from(e: docwarden::Error) -> Self {
        UiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
    }
}

impl IntoResponse for UiError {
    fn into_response(self) -> Response {
        let body = templates()
            .ok()
            .and_then(|env| {
                env.get_template("error.html")
                    .ok()?
                    .render(context! { status => self.0.as_u16(), message => self.1 })
                    .ok()
            })
            .unwrap_or_else(|| "error".to_owned());
        (self.0, Html(body)).into_response()
    }
}

type Page = Result<Response, UiError>;

fn not_found(what: String) -> UiError {
    UiError(StatusCode::NOT_FOUND, what)
}

impl AppState {
    fn render(&self, name: &str, page: &str, ctx: minijinja::Value) -> Page {
        ::metrics::counter!("docwarden_ui_requests_total", "page" => page.to_owned()).increment(1);
        let base = context! {
            page => page,
            db => self.db.name(),
            read_only => self.token.is_none(),
            live => self.live.mode().as_str(),
            version => env!("CARGO_PKG_VERSION"),
        };
        let body = self
            .templates
            .get_template(name)
            .and_then(|t| t.render(context! { ..ctx, ..base }))
            .map_err(|e| anyhow::anyhow!("template {name}: {e:#}"))?;
        Ok(Html(body).into_response())
    }

    async fn now_ms(&self) -> Result<i64, UiError> {
        Ok(self.time.now().await?.estimate_ms)
    }

    /// A handle on the named queue `named` (the default queue when `None` or empty) of
    /// queue collection `name`, which must be one the dashboard shows.
    async fn queue_named(
        &self,
        name: &str,
        named: Option<&str>,
    ) -> Result<docwarden::queue::JobQueue, UiError> {
        let catalog = self.catalogue.get(&self.db).await?;
        if !catalog.queues.iter().any(|q| q == name) {
            return Err(not_found(format!(
                "no queue `{name}` in {}",
                self.db.name()
            )));
        }
        let base = data::queue(&self.db, &self.time, name)?;
        match named.map(str::trim).filter(|n| !n.is_empty()) {
            None => Ok(base),
            Some(n) => base
                .named(n, docwarden::queue::QueueOptions::default())
                .map_err(|e| UiError(StatusCode::BAD_REQUEST, e.to_string())),
        }
    }
}

/// One named queue of a queue collection on the overview.
#[derive(serde::Serialize)]
struct QueueCard {
    /// The queue collection.
    name: String,
    /// The named queue (`default`: jobs without a queue name).
    named: String,
    /// Whether the collection has other named queues than the default one (the card
    /// then names its queue).
    several: bool,
    /// Workers start no claim from this queue.
    paused: bool,
    /// When and by whom it was paused (or last resumed), as text.
    control: Option<String>,
    /// Milliseconds since the pause (the page counts on).
    paused_for_ms: Option<i64>,
    total: u64,
    states: Vec<data::StateCount>,
    oldest_due: Option<String>,
    expired_running: u64,
    unreadable_leases: u64,
    undatable: u64,
    /// Waiting jobs whose `limits` is neither a document nor null (a hand edit).
    malformed_limits: u64,
    /// Jobs stored with `queue: "default"`: in no queue (see `docwarden queue stats`).
    misnamed_default: u64,
    history: Vec<data::Minute>,
    chart: Chart,
}

/// Bar heights (0–60 px) for the two charts of a queue.
#[derive(serde::Serialize)]
struct Chart {
    bars: Vec<Bar>,
    max_done: u64,
    max_latency: String,
}

#[derive(serde::Serialize)]
struct Bar {
    x: i64,
    ok_h: i64,
    fail_h: i64,
    lat_h: i64,
    label: String,
}

const CHART_H: i64 = 60;

fn chart(minutes: &[data::Minute]) -> Chart {
    let max_done = minutes
        .iter()
        .map(|m| m.succeeded + m.failed)
        .max()
        .unwrap_or(0)
        .max(1);
    let max_lat = minutes
        .iter()
        .filter_map(|m| m.mean_latency_ms)
        .max()
        .unwrap_or(0)
        .max(1);
    let scale =
        |v: u64, max: u64| -> i64 { i64::try_from(v.saturating_mul(60) / max).unwrap_or(CHART_H) };
    let bars = minutes
        .iter()
        .enumerate()
        .map(|(i, m)| Bar {
            x: i64::try_from(i).unwrap_or(0) * 14,
            ok_h: scale(m.succeeded, max_done),
            fail_h: scale(m.failed, max_done),
            lat_h: m
                .mean_latency_ms
                .map_or(0, |l| l.saturating_mul(CHART_H) / max_lat),
            label: format!(
                "{} min ago: {} succeeded, {} failed{}",
                m.ago,
                m.succeeded,
                m.failed,
                m.mean_latency_ms
                    .map(|l| format!(", mean enqueue-to-finish {}", human_ms(l)))
                    .unwrap_or_default()
            ),
        })
        .collect();
    Chart {
        bars,
        max_done,
        max_latency: human_ms(max_lat),
    }
}

fn human_ms(ms: i64) -> String {
    if ms.abs() < 1000 {
        format!("{ms} ms")
    } else if ms.abs() < 120_000 {
        format!("{:.1} s", ms as f64 / 1000.0)
    } else {
        format!("{:.1} min", ms as f64 / 60_000.0)
    }
}

#[derive(serde::Deserialize)]
struct Notice {
    notice: Option<String>,
}

async fn queues_page(State(s): State<Shared>, Query(n): Query<Notice>) -> Page {
    let catalog = s.catalogue.get(&s.db).await?;
    let now = s.now_ms().await?;
    let mut cards = Vec::new();
    let mut ages = Vec::new();
    for name in &catalog.queues {
        let snapshot = s.snapshots.get(&s.db, &s.time, name, Stale::Serve).await?;
        ages.extend(
            snapshot::age_note(&snapshot, s.snapshots.min_fresh())
                .map(|note| format!("{name}: {note}")),
        );
        let several = snapshot.queues.len() > 1;
        for counts in &snapshot.queues {
            let (queue_name, q, stats) = (counts.name.clone(), &counts.handle, &counts.stats);
            let history = counts.history.clone();
            let control = q.control().await?;
            let describe = |what: &str, at: Option<mongodb::bson::DateTime>| {
                let mut t = format!("{what} since {}", at.map(data::date).unwrap_or_default());
                if let Some(by) = &control.by {
                    t.push_str(&format!(" by {by}"));
                }
                t
            };
            cards.push(QueueCard {
                name: name.clone(),
                several,
                paused: control.paused,
                control: if control.paused {
                    Some(describe("paused", control.paused_at))
                } else {
                    control
                        .resumed_at
                        .map(|t| describe("running (resumed)", Some(t)))
                },
                paused_for_ms: control
                    .paused
                    .then(|| control.paused_at.map(|t| now - t.timestamp_millis()))
                    .flatten(),
                named: queue_name,
                total: stats.total,
                states: data::state_counts(stats),
                oldest_due: stats.oldest_due_ms.map(human_ms),
                expired_running: stats.expired_running,
                unreadable_leases: stats.unreadable_leases,
                undatable: stats.undatable,
                malformed_limits: stats.malformed_limits,
                misnamed_default: stats.misnamed_default,
                chart: chart(&history),
                history,
            });
        }
    }
    s.render(
        "queues.html",
        "queues",
        context! { queues => cards, locks => catalog.locks, notice => n.notice, minutes => data::HISTORY_MINUTES, counts_age => ages },
    )
}

async fn jobs_page(State(s): State<Shared>, Query(q): Query<data::JobQuery>) -> Page {
    let catalog = s.catalogue.get(&s.db).await?;
    // One listing per filter, paced (`ui/snapshot.rs`): it reads every job it filters.
    let key = format!("{:?} {q:?}", catalog.queues);
    let rows = match s
        .snapshots
        .listing(&key, {
            let (db, time, queues, q) = (
                s.db.clone(),
                s.time.clone(),
                catalog.queues.clone(),
                q.clone(),
            );
            move || async move { data::jobs(&db, &time, &queues, &q).await }
        })
        .await
    {
        Ok(rows) => rows,
        Err(e) => return Err(UiError(StatusCode::BAD_REQUEST, format!("{e:#}"))),
    };
    let listed_age = snapshot::read_note("this list", &rows, s.snapshots.min_fresh());
    // The names for the filter, from the paced snapshot (`queue_names` reads every job).
    let mut named = std::collections::BTreeSet::new();
    for name in &catalog.queues {
        let snapshot = s.snapshots.get(&s.db, &s.time, name, Stale::Serve).await?;
        named.extend(snapshot.queues.iter().map(|c| c.name.clone()));
    }
    let states: Vec<&str> = JobState::ALL.iter().map(|s| s.as_str()).collect();
    s.render(
        "jobs.html",
        "jobs",
        context! { jobs => rows.as_slice(), listed_age => listed_age, queues => catalog.queues, named_queues => named, states => states, filter => q },
    )
}

async fn job_page(
    State(s): State<Shared>,
    Path((queue, id)): Path<(String, String)>,
    Query(n): Query<Notice>,
) -> Page {
    let handle = s.queue_named(&queue, None).await?;
    let oid = ObjectId::parse_str(&id)
        .map_err(|_| not_found(format!("`{id}` is not a job id (24 hex digits)")))?;
    let now = s.now_ms().await?;
    let Some(job) = data::job(&handle, &queue, oid, now).await? else {
        return Err(not_found(format!("no job {id} in queue {queue}")));
    };
    s.render(
        "job.html",
        "job",
        context! { job => job, notice => n.notice },
    )
}

async fn locks_page(State(s): State<Shared>) -> Page {
    let catalog = s.catalogue.get(&s.db).await?;
    let now = s.now_ms().await?;
    let mut collections = Vec::new();
    // Plain leases; the elections', read/write locks' and semaphores' collections have
    // their own sections below.
    for name in catalog.locks.iter().filter(|l| !s.kinds.contains(l)) {
        let snapshot = s
            .snapshots
            .leases(&s.db, &s.time, name, Stale::Serve)
            .await?;
        collections.push(context! {
            name => name,
            leases => data::lock_views(name, &snapshot.first, now),
            counts => snapshot.counts,
            truncated => snapshot.truncated(),
            shown => snapshot::LEASES_SHOWN,
            counts_age => snapshot::age_note(&snapshot, s.snapshots.min_fresh()),
        });
    }
    let kinds = crate::locks::Kinds {
        db: &s.db,
        time: &s.time,
        elections: &s.kinds.elections,
        rwlocks: &s.kinds.rwlocks,
        semaphores: &s.kinds.semaphores,
    };
    // One page of each kind: a lock per entity makes one document per entity. One more
    // than is shown is read, to say whether there are more.
    let shown = usize::try_from(snapshot::LEASES_SHOWN).unwrap_or(usize::MAX);
    let filter = docwarden::lock::LockListFilter::default().limit(snapshot::LEASES_SHOWN + 1);
    let held = crate::locks::holdings(&kinds, &filter).await?;
    let others = data::kinds_view(&kinds, held, shown, now);
    let mut documents = Vec::new();
    for name in &s.documents {
        let (locked, truncated) = data::document_locks(&s.db, &s.time, name, shown, now).await?;
        documents.push(context! { name => name, locked => locked, truncated => truncated });
    }
    s.render(
        "locks.html",
        "locks",
        context! { collections => collections, kinds => others, documents => documents },
    )
}

/// A report file as listed.
#[derive(serde::Serialize)]
struct ReportFile {
    name: String,
    bytes: u64,
    modified: String,
    modified_s: u64,
}

fn report_files(dir: &std::path::Path) -> anyhow::Result<Vec<ReportFile>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".html") || !entry.file_type()?.is_file() {
            continue;
        }
        let meta = entry.metadata()?;
        let modified_s = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        out.push(ReportFile {
            modified: i64::try_from(modified_s)
                .ok()
                .and_then(|s| s.checked_mul(1000))
                .map(|ms| data::date(mongodb::bson::DateTime::from_millis(ms)))
                .unwrap_or_default(),
            name,
            bytes: meta.len(),
            modified_s,
        });
    }
    out.sort_by(|a, b| b.modified_s.cmp(&a.modified_s).then(a.name.cmp(&b.name)));
    Ok(out)
}

async fn reports_page(State(s): State<Shared>) -> Page {
    let files = match &s.reports {
        Some(dir) => report_files(dir)?,
        None => Vec::new(),
    };
    s.render(
        "reports.html",
        "reports",
        context! {
            configured => s.reports.is_some(),
            dir => s.reports.as_ref().map(|d| d.display().to_string()),
            files => files,
        },
    )
}

/// Serves one listed report, sandboxed: it runs in an opaque origin, without scripts,
/// so a report cannot reach the dashboard or its token.
async fn report_file(State(s): State<Shared>, Path(name): Path<String>) -> Page {
    let Some(dir) = &s.reports else {
        return Err(not_found("no --reports directory".to_owned()));
    };
    // Only a name from the listing: no path separators, no parent directories.
    if !report_files(dir)?.iter().any(|f| f.name == name) {
        return Err(not_found(format!("no report `{name}`")));
    }
    let body = std::fs::read(dir.join(&name)).map_err(anyhow::Error::from)?;
    Ok((
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/html; charset=utf-8"),
            ),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(
                    "sandbox; default-src 'none'; style-src 'unsafe-inline'; img-src data:",
                ),
            ),
        ],
        body,
    )
        .into_response())
}

async fn events(State(s): State<Shared>) -> impl IntoResponse {
    let hello = Event::default().event("hello").data(s.live.mode().as_str());
    let rx = s.live.subscribe();
    // A lagging listener missed some notifications: one "change" covers them all.
    let changes = futures::stream::unfold(rx, |mut rx| async move {
        match rx.recv().await {
            Ok(()) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                Some((Event::default().event("change").data("changed"), rx))
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => None,
        }
    });
    let stream = futures::StreamExt::map(
        futures::StreamExt::chain(futures::stream::once(async { hello }), changes),
        Ok::<Event, std::convert::Infallible>,
    );
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

async fn metrics_endpoint(State(s): State<Shared>) -> Result<Response, UiError> {
    let catalog = s.catalogue.get(&s.db).await?;
    let text = metrics::scrape(
        &s.db,
        &s.time,
        &catalog,
        &s.kinds,
        &s.snapshots,
        s.live.listeners(),
    )
    .await?;
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        text,
    )
        .into_response())
}

async fn app_js() -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/javascript; charset=utf-8"),
        )],
        include_str!("ui/assets/app.js"),
    )
}

async fn style_css() -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/css; charset=utf-8"),
        )],
        include_str!("ui/assets/style.css"),
    )
}

/// The fields of an action form (or urlencoded API call).
#[derive(Debug, serde::Deserialize)]
struct ActionForm {
    /// The action token.
    token: Option<String>,
    /// The queue collection (defaulted, so a request without it still meets the token
    /// check first).
    #[serde(default)]
    queue: String,
    /// The named queue (default queue when absent or empty).
    named: Option<String>,
    /// A job id (retry: all dead jobs of the queue when absent).
    id: Option<String>,
    /// Purge: minimum age of finished jobs, e.g. `7d`.
    older_than: Option<String>,
}

/// `s` percent-encoded for a query string.
fn query_value(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The checks every action passes first; the refusal as a response.
fn authorize(
    s: &AppState,
    action: &str,
    headers: &HeaderMap,
    form: &ActionForm,
) -> Option<Response> {
    match guard::check_action(s.token.as_deref(), headers, form.token.as_deref()) {
        Ok(()) => None,
        Err(refusal) => {
            tracing::warn!(action, reason = refusal.message(), "action refused");
            ::metrics::counter!("docwarden_ui_actions_total", "action" => action.to_owned(), "outcome" => refusal.label())
                .increment(1);
            Some((refusal.status(), refusal.message()).into_response())
        }
    }
}

fn done(action: &str) {
    ::metrics::counter!("docwarden_ui_actions_total", "action" => action.to_owned(), "outcome" => "done")
        .increment(1);
}

fn parse_job_id(id: Option<&str>) -> Result<Option<ObjectId>, UiError> {
    match id.map(str::trim).filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some(s) => ObjectId::parse_str(s).map(Some).map_err(|_| {
            UiError(
                StatusCode::BAD_REQUEST,
                format!("`{s}` is not a job id (24 hex digits)"),
            )
        }),
    }
}

fn back(queue: &str, id: Option<ObjectId>, notice: &str) -> Response {
    let to = match id {
        Some(id) => format!("/jobs/{}/{}", query_value(queue), id.to_hex()),
        None => "/".to_owned(),
    };
    Redirect::to(&format!("{to}?notice={}", query_value(notice))).into_response()
}

async fn action_retry(
    State(s): State<Shared>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Page {
    if let Some(refused) = authorize(&s, "retry", &headers, &form) {
        return Ok(refused);
    }
    let q = s.queue_named(&form.queue, form.named.as_deref()).await?;
    let id = parse_job_id(form.id.as_deref())?;
    let ids: Option<Vec<ObjectId>> = id.map(|i| vec![i]);
    let n = q.retry_dead(ids.as_deref()).await?;
    s.snapshots.forget(&form.queue).await;
    done("retry");
    tracing::info!(queue = %form.queue, ?id, revived = n, "retry from the dashboard");
    Ok(back(
        &form.queue,
        id,
        &format!("{n} dead job(s) moved back to ready"),
    ))
}

async fn action_cancel(
    State(s): State<Shared>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Page {
    if let Some(refused) = authorize(&s, "cancel", &headers, &form) {
        return Ok(refused);
    }
    let q = s.queue_named(&form.queue, form.named.as_deref()).await?;
    let Some(id) = parse_job_id(form.id.as_deref())? else {
        return Err(UiError(
            StatusCode::BAD_REQUEST,
            "cancel needs a job id".to_owned(),
        ));
    };
    let text = match q.cancel(id).await? {
        CancelOutcome::Cancelled { was } => format!("cancelled (was {was})"),
        CancelOutcome::AlreadyFinished(st) => format!("already finished ({st}); nothing changed"),
        CancelOutcome::NotFound => "no such job".to_owned(),
        _ => "unknown outcome".to_owned(),
    };
    s.snapshots.forget(&form.queue).await;
    done("cancel");
    tracing::info!(queue = %form.queue, %id, outcome = %text, "cancel from the dashboard");
    Ok(back(&form.queue, Some(id), &text))
}

async fn action_purge(
    State(s): State<Shared>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Page {
    if let Some(refused) = authorize(&s, "purge", &headers, &form) {
        return Ok(refused);
    }
    let q = s.queue_named(&form.queue, form.named.as_deref()).await?;
    let age = crate::queue::parse_age(form.older_than.as_deref().unwrap_or(""))
        .map_err(|e| UiError(StatusCode::BAD_REQUEST, format!("{e:#}")))?;
    let n = q.purge(age).await?;
    s.snapshots.forget(&form.queue).await;
    done("purge");
    tracing::info!(queue = %form.queue, purged = n, "purge from the dashboard");
    Ok(back(
        &form.queue,
        None,
        &format!("{n} finished job(s) purged from {}", form.queue),
    ))
}

/// Who the control document names as having paused or resumed from the dashboard.
const ACTOR: &str = "docwarden-ui";

async fn action_pause(
    State(s): State<Shared>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Page {
    if let Some(refused) = authorize(&s, "pause", &headers, &form) {
        return Ok(refused);
    }
    let q = s.queue_named(&form.queue, form.named.as_deref()).await?;
    let text = match q.pause(ACTOR).await? {
        PauseOutcome::AlreadyPaused => "was already paused",
        _ => "paused: workers start no new claim from it; running jobs finish",
    };
    s.snapshots.forget(&form.queue).await;
    done("pause");
    tracing::info!(queue = %form.queue, named = q.queue_name(), "pause from the dashboard");
    Ok(back(
        &form.queue,
        None,
        &format!("queue {} of {}: {text}", q.queue_name(), form.queue),
    ))
}

async fn action_resume(
    State(s): State<Shared>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Page {
    if let Some(refused) = authorize(&s, "resume", &headers, &form) {
        return Ok(refused);
    }
    let q = s.queue_named(&form.queue, form.named.as_deref()).await?;
    let text = match q.resume(ACTOR).await? {
        PauseOutcome::NotPaused => "was not paused",
        _ => "resumed: workers claim from it again",
    };
    s.snapshots.forget(&form.queue).await;
    done("resume");
    tracing::info!(queue = %form.queue, named = q.queue_name(), "resume from the dashboard");
    Ok(back(
        &form.queue,
        None,
        &format!("queue {} of {}: {text}", q.queue_name(), form.queue),
    ))
}

pub(crate) async fn run(args: Args) -> anyhow::Result<ExitCode> {
    docwarden::validate::database_name("--db", &args.db)?;
    for q in &args.queues {
        docwarden::validate::queue_collection_name("--queue", q)?;
    }
    for q in args.locks.iter().chain(&args.documents).chain([
        &args.elections,
        &args.rwlocks,
        &args.semaphores,
    ]) {
        docwarden::validate::collection_name("collection", q)?;
    }
    if let Some(dir) = &args.reports {
        anyhow::ensure!(dir.is_dir(), "--reports {}: not a directory", dir.display());
    }
    anyhow::ensure!(
        (1..=3600).contains(&args.counts_every),
        "--counts-every must be between 1 and 3600 seconds (got {})",
        args.counts_every
    );
    // An address that is taken fails here, before a server is started or connected to
    // (`start` binds it again for good: a port taken in between still fails there).
    drop(
        std::net::TcpListener::bind(args.listen)
            .with_context(|| format!("cannot listen on {}", args.listen))?,
    );
    let session = args.conn.open(false).await?;
    let db = session.client.database(&args.db);
    let running = start(
        session.client.clone(),
        db,
        UiConfig {
            listen: args.listen,
            read_only: args.read_only,
            queues: args.queues,
            locks: args.locks,
            reports: args.reports,
            kinds: KindNames {
                elections: args.elections,
                rwlocks: args.rwlocks,
                semaphores: args.semaphores,
            },
            documents: args.documents,
            counts_every: Duration::from_secs(args.counts_every),
            poll_only: args.poll_only,
        },
    )
    .await?;
    // The first line is the URL (scripts and tests read it). Written once, and a closed
    // standard output (`docwarden ui | head -1`) does not stop the server.
    let mut banner = format!("docwarden ui: {}\n", running.url);
    match &running.token {
        Some(token) => banner.push_str(&format!(
            "action token: {token}\nopen {}#token={token} to act from the browser (the token stays in the tab)\n",
            running.url
        )),
        None => banner.push_str("read-only: actions are disabled\n"),
    }
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        if out
            .write_all(banner.as_bytes())
            .and_then(|()| out.flush())
            .is_err()
        {
            eprint!("{banner}");
        }
    }
    if !args.listen.ip().is_loopback() {
        eprintln!(
            "docwarden: warning: serving on {} over plain HTTP: anyone who can reach it reads every job; the token travels in clear",
            args.listen
        );
    }
    running.wait().await?;
    drop(session);
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_templates_escape_database_values() -> anyhow::Result<()> {
        let env = templates()?;
        let html = env.get_template("error.html")?.render(context! {
            status => 500, message => "<script>alert(1)</script>",
            page => "error", db => "d", read_only => true, live => "polling", version => "0",
        })?;
        assert!(
            html.contains("&lt;script&gt;alert(1)&lt;&#x2f;script&gt;"),
            "{html}"
        );
        assert!(!html.contains("<script>alert"), "{html}");
        Ok(())
    }

    #[test]
    fn notices_are_percent_encoded() {
        assert_eq!(query_value("a b/<"), "a%20b%2F%3C");
    }
}
