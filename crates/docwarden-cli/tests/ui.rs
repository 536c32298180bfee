//! `docwarden ui` end to end (issue 17): the binary serves the dashboard on port 0 against
//! the shared test server, with jobs and a lease created through the library. The tests
//! read the pages over HTTP and in headless Chromium, post actions with and without the
//! token, and parse `/metrics`.

use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{
    DocumentLockOptions, DocumentLocks, Election, ElectionOptions, Leadership, LockCollection,
    LockOptions, Owner, RwLockOptions, RwLocks, Semaphore, SemaphoreOptions,
};
use docwarden::queue::format::field;
use docwarden::queue::{EnqueueOptions, JobQueue, JobState, QueueOptions, Worker, WorkerOptions};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, doc, oid::ObjectId};
use tokio::io::{AsyncBufReadExt, BufReader};

const EVIL: &str = "<script>alert(1)</script>";
const EVIL_ESCAPED: &str = "&lt;script&gt;alert(1)&lt;";

/// What the fixture put in the database.
struct Fixture {
    queue: JobQueue,
    dead: ObjectId,
    running: ObjectId,
    owner: Owner,
    token: i64,
}

/// A queue `jobs` with three ready jobs, one running, one succeeded and one dead whose
/// payload and last error are HTML; a lock collection `locks` with a lease on
/// `invoice-42`.
async fn fixture(t: &TestDb) -> anyhow::Result<Fixture> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let queue = JobQueue::open(&t.db, "jobs", time.clone(), QueueOptions::default()).await?;
    for i in 0..3 {
        queue
            .enqueue(
                doc! { "n": i },
                &EnqueueOptions::default().dedupe_key(format!("order-{i}")),
            )
            .await?;
    }
    let dead = queue
        .enqueue(
            doc! { "html": EVIL },
            &EnqueueOptions::default()
                .priority(10)
                .max_attempts(1)
                .dedupe_key("evil"),
        )
        .await?
        .created()
        .context("evil job not created")?;
    let job = queue.claim("worker-a").await?.context("nothing to claim")?;
    anyhow::ensure!(
        job.id() == dead,
        "claimed {} instead of the evil job",
        job.id()
    );
    queue.fail(&job, EVIL).await?;
    let running = queue
        .enqueue(doc! { "n": "runs" }, &EnqueueOptions::default().priority(5))
        .await?
        .created()
        .context("not created")?;
    queue.claim("worker-b").await?.context("nothing to claim")?;
    queue
        .enqueue(doc! { "n": "done" }, &EnqueueOptions::default().priority(4))
        .await?;
    let done = queue.claim("worker-c").await?.context("nothing to claim")?;
    queue.complete(&done, doc! { "country": "NZ" }).await?;
    let locks = LockCollection::open(&t.db, "locks", time, LockOptions::default()).await?;
    let owner = Owner::random();
    let lease = locks
        .acquire(
            &owner,
            "invoice-42",
            Duration::from_secs(300),
            Duration::from_secs(2),
        )
        .await?
        .context("lock not acquired")?;
    Ok(Fixture {
        queue,
        dead,
        running,
        owner,
        token: lease.token.get(),
    })
}

/// What [`coordination`] holds: keep it alive while the pages are read (the leader's
/// watchdog renews the term).
struct Coordination {
    _leader: Leadership,
    term: i64,
    /// Holds a semaphore permit and a read lock.
    holder: Owner,
    /// The leader, whose id is HTML.
    evil: Owner,
}

/// A leader elected in `elections` (owner id [`EVIL`]), a writer and a reader in
/// `rwlocks`, two holders of the semaphore `geo-api` (3 permits) in `semaphores`, and a
/// locked document `<b>doc-1</b>` in the entity collection `entities`.
async fn coordination(t: &TestDb) -> anyhow::Result<Coordination> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let ttl = Duration::from_secs(300);
    let election = Election::open(
        &t.db,
        "elections",
        "scheduler",
        time.clone(),
        ElectionOptions::default().term_ttl(Duration::from_secs(60)),
    )
    .await?;
    let evil = Owner::from_existing(EVIL)?;
    let leader = election.try_campaign(&evil).await?.context("not elected")?;
    let rw = RwLocks::open(&t.db, "rwlocks", time.clone(), RwLockOptions::default()).await?;
    let holder = Owner::random();
    rw.try_write(&Owner::random(), "config", ttl)
        .await?
        .context("no write lock")?;
    rw.try_read(&holder, "report", ttl)
        .await?
        .context("no read lock")?;
    let sem = Semaphore::open(
        &t.db,
        "semaphores",
        time.clone(),
        SemaphoreOptions::default().default_permits(3),
    )
    .await?;
    sem.set_permits("geo-api", 3).await?;
    for o in [&holder, &Owner::random()] {
        sem.try_acquire(o, "geo-api", ttl)
            .await?
            .context("no permit")?;
    }
    let docs = DocumentLocks::open(&t.db, "entities", time, DocumentLockOptions::default()).await?;
    // Dropping the guard keeps the lock (it is released by `release` or expires).
    let _locked = docs
        .lock_or_create("<b>doc-1</b>", doc! { "v": 1 })
        .await?
        .context("document not locked")?;
    Ok(Coordination {
        term: leader.term().get(),
        _leader: leader,
        holder,
        evil,
    })
}

/// A running `docwarden ui`, killed on drop.
struct Ui {
    _child: tokio::process::Child,
    url: String,
    token: Option<String>,
}

async fn start_ui(t: &TestDb, extra: &[&str]) -> anyhow::Result<Ui> {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_docwarden"))
        .args([
            "ui",
            "--uri",
            t.uri(),
            "--db",
            t.db.name(),
            "--listen",
            "127.0.0.1:0",
        ])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let mut url = None;
    let mut token = None;
    let read = async {
        while let Some(line) = lines.next_line().await? {
            if let Some(u) = line.strip_prefix("docwarden ui: ") {
                url = Some(u.trim_end_matches('/').to_owned());
            } else if let Some(tk) = line.strip_prefix("action token: ") {
                token = Some(tk.to_owned());
                break;
            } else if line.starts_with("read-only") {
                break;
            }
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .context("docwarden ui printed no URL within 60 s")??;
    // Keep reading, so the rest of the output never meets a closed pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(Ui {
        _child: child,
        url: url.context("no URL line")?,
        token,
    })
}

fn client() -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .build()?)
}

async fn page(ui: &Ui, path: &str) -> anyhow::Result<String> {
    let resp = client()?.get(format!("{}{path}", ui.url)).send().await?;
    let status = resp.status();
    let body = resp.text().await?;
    anyhow::ensure!(status.is_success(), "GET {path}: {status}: {body}");
    Ok(body)
}

/// The page at `path` once it satisfies `shows` (the queue counts are a snapshot reused
/// for at least a second, `ui/snapshot.rs`): tried for up to 5 s.
async fn page_once(ui: &Ui, path: &str, shows: impl Fn(&str) -> bool) -> anyhow::Result<String> {
    let started = std::time::Instant::now();
    loop {
        let p = page(ui, path).await?;
        if shows(&p) || started.elapsed() > Duration::from_secs(5) {
            return Ok(p);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn state_of(f: &Fixture, id: ObjectId) -> anyhow::Result<String> {
    let d = f
        .queue
        .collection()
        .find_one(doc! { field::ID: id })
        .await?
        .context("job gone")?;
    Ok(d.get_str(field::STATE)?.to_owned())
}

#[tokio::test]
async fn the_pages_show_queues_jobs_and_locks_with_database_values_escaped() -> anyhow::Result<()> {
    let t = TestDb::new("ui_pages").await?;
    let f = fixture(&t).await?;
    let reports = tempfile::tempdir()?;
    std::fs::write(reports.path().join("run-1.html"), "<h1>verify run one</h1>")?;
    std::fs::write(reports.path().join("notes.txt"), "not a report")?;
    let dir = reports.path().display().to_string();
    let ui = start_ui(&t, &["--reports", dir.as_str()]).await?;

    let home = page(&ui, "/").await?;
    assert!(home.contains("data-queue=\"jobs\""), "{home}");
    // Counts by state: 3 ready, 1 running, 1 succeeded, 1 dead.
    for (state, n) in [("ready", 3), ("running", 1), ("succeeded", 1), ("dead", 1)] {
        assert!(
            home.contains(&format!("data-state=\"{state}\">{n}</a>")),
            "{state} should count {n}: {home}"
        );
    }
    assert!(home.contains("oldest due job waiting"), "{home}");

    let dead_list = page(&ui, "/jobs?queue=jobs&in_state=dead").await?;
    assert!(dead_list.contains(&f.dead.to_hex()), "{dead_list}");
    assert!(!dead_list.contains(&f.running.to_hex()), "{dead_list}");
    assert!(dead_list.contains(EVIL_ESCAPED), "{dead_list}");
    assert!(
        !dead_list.contains(EVIL),
        "unescaped error in the list: {dead_list}"
    );
    let by_error = page(&ui, "/jobs?error=ALERT(1)").await?;
    assert_eq!(by_error.matches("class=\"job\"").count(), 1, "{by_error}");
    let by_key = page(&ui, "/jobs?key=order-1").await?;
    assert_eq!(by_key.matches("class=\"job\"").count(), 1, "{by_key}");
    let all = page(&ui, "/jobs").await?;
    assert_eq!(all.matches("class=\"job\"").count(), 6, "{all}");

    let job = page(&ui, &format!("/jobs/jobs/{}", f.dead.to_hex())).await?;
    assert!(job.contains(EVIL_ESCAPED), "{job}");
    assert!(
        !job.contains(EVIL),
        "a database value was not escaped: {job}"
    );
    assert!(job.contains("Retry this dead job"), "{job}");
    let running = page(&ui, &format!("/jobs/jobs/{}", f.running.to_hex())).await?;
    assert!(
        running.contains("worker-b"),
        "lease holder missing: {running}"
    );
    assert!(running.contains("data-remaining-ms"), "{running}");

    let locks = page(&ui, "/locks").await?;
    assert!(locks.contains("invoice-42"), "{locks}");
    assert!(locks.contains(f.owner.id()), "{locks}");
    assert!(
        locks.contains(&format!("<td class=\"token\">{}</td>", f.token)),
        "{locks}"
    );

    // Verify reports: the .html files are listed and served in a sandbox; nothing else is.
    let list = page(&ui, "/reports").await?;
    assert!(list.contains("run-1.html"), "{list}");
    assert!(!list.contains("notes.txt"), "{list}");
    let report = client()?
        .get(format!("{}/reports/run-1.html", ui.url))
        .send()
        .await?;
    let csp = report
        .headers()
        .get("content-security-policy")
        .context("no CSP on a report")?
        .to_str()?
        .to_owned();
    assert!(csp.starts_with("sandbox"), "{csp}");
    assert!(report.text().await?.contains("verify run one"));
    for path in [
        "/reports/notes.txt",
        "/reports/..%2Fnotes.txt",
        "/reports/%2Fetc%2Fpasswd",
    ] {
        let r = client()?.get(format!("{}{path}", ui.url)).send().await?;
        assert_eq!(r.status().as_u16(), 404, "{path}");
    }

    // Every HTML page forbids inline scripts, whatever escaping does.
    let resp = client()?.get(format!("{}/", ui.url)).send().await?;
    let csp = resp
        .headers()
        .get("content-security-policy")
        .context("no CSP")?
        .to_str()?;
    assert!(csp.contains("script-src 'self'"), "{csp}");
    // A foreign Host (DNS rebinding) is refused.
    let rebind = client()?
        .get(format!("{}/", ui.url))
        .header("host", "rebind.example")
        .send()
        .await?;
    assert_eq!(rebind.status().as_u16(), 421);
    // Live updates answer as server-sent events.
    let events = client()?.get(format!("{}/events", ui.url)).send().await?;
    assert!(
        events
            .headers()
            .get("content-type")
            .is_some_and(|v| v.to_str().unwrap_or("").starts_with("text/event-stream"))
    );
    Ok(())
}

#[tokio::test]
async fn actions_need_the_token_and_change_nothing_without_it() -> anyhow::Result<()> {
    let t = TestDb::new("ui_actions").await?;
    let f = fixture(&t).await?;
    let ui = start_ui(&t, &[]).await?;
    let token = ui.token.clone().context("no token printed")?;
    let http = client()?;
    let retry = format!("{}/actions/retry", ui.url);
    let dead = f.dead.to_hex();

    // No token: 401, the dead job stays dead.
    let r = http
        .post(&retry)
        .form(&[("queue", "jobs"), ("id", dead.as_str())])
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(state_of(&f, f.dead).await?, JobState::Dead.as_str());
    // A wrong token: 403.
    let r = http
        .post(&retry)
        .form(&[("queue", "jobs"), ("id", dead.as_str()), ("token", "0123")])
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 403);
    // The right token from another site (a CSRF attempt): 403.
    let r = http
        .post(&retry)
        .header("origin", "http://evil.example")
        .form(&[
            ("queue", "jobs"),
            ("id", dead.as_str()),
            ("token", token.as_str()),
        ])
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 403);
    let r = http
        .post(&retry)
        .header("sec-fetch-site", "cross-site")
        .form(&[
            ("queue", "jobs"),
            ("id", dead.as_str()),
            ("token", token.as_str()),
        ])
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 403);
    // A GET never acts.
    let r = http.get(&retry).send().await?;
    assert_eq!(r.status().as_u16(), 405);
    assert_eq!(state_of(&f, f.dead).await?, JobState::Dead.as_str());
    let cancel = format!("{}/actions/cancel", ui.url);
    let running = f.running.to_hex();
    let r = http
        .post(&cancel)
        .form(&[("queue", "jobs"), ("id", running.as_str())])
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(state_of(&f, f.running).await?, JobState::Running.as_str());

    // With the token (form field): the dead job is ready again.
    let r = http
        .post(&retry)
        .form(&[
            ("queue", "jobs"),
            ("id", dead.as_str()),
            ("token", token.as_str()),
        ])
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 303, "{}", r.text().await?);
    assert_eq!(state_of(&f, f.dead).await?, JobState::Ready.as_str());
    // With the token in the header, from the same origin: the running job is cancelled.
    let r = http
        .post(&cancel)
        .header("x-docwarden-token", token.as_str())
        .header("origin", ui.url.as_str())
        .form(&[("queue", "jobs"), ("id", running.as_str())])
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 303, "{}", r.text().await?);
    assert_eq!(state_of(&f, f.running).await?, JobState::Cancelled.as_str());
    let notice = r
        .headers()
        .get("location")
        .context("no redirect")?
        .to_str()?
        .to_owned();
    let after = page(&ui, &notice).await?;
    assert!(after.contains("cancelled (was running)"), "{after}");

    // Purge: refused without the token, then deletes the finished jobs (the succeeded and
    // the cancelled one) older than a second.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let purge = format!("{}/actions/purge", ui.url);
    let finished = doc! { field::STATE: { "$in": [JobState::Succeeded.as_str(), JobState::Cancelled.as_str()] } };
    assert_eq!(
        f.queue
            .collection()
            .count_documents(finished.clone())
            .await?,
        2
    );
    let r = http
        .post(&purge)
        .form(&[("queue", "jobs"), ("older_than", "1s")])
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(
        f.queue
            .collection()
            .count_documents(finished.clone())
            .await?,
        2
    );
    let r = http
        .post(&purge)
        .form(&[
            ("queue", "jobs"),
            ("older_than", "1s"),
            ("token", token.as_str()),
        ])
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 303, "{}", r.text().await?);
    assert_eq!(f.queue.collection().count_documents(finished).await?, 0);

    // Read-only: even the token does not act.
    let ro = start_ui(&t, &["--read-only"]).await?;
    assert!(ro.token.is_none());
    let r = http
        .post(format!("{}/actions/retry", ro.url))
        .form(&[("queue", "jobs"), ("token", token.as_str())])
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 403);
    Ok(())
}

async fn post(ui: &Ui, action: &str, form: &[(&str, &str)]) -> anyhow::Result<reqwest::Response> {
    Ok(client()?
        .post(format!("{}/actions/{action}", ui.url))
        .form(form)
        .send()
        .await?)
}

/// Posts `action` with `form` and the dashboard's action token, and asserts it was done
/// (303, redirected to the page that shows the result).
async fn act(ui: &Ui, action: &str, form: &[(&str, &str)]) -> anyhow::Result<()> {
    let token = ui.token.clone().context("no token printed")?;
    let mut form = form.to_vec();
    form.push(("token", token.as_str()));
    let r = post(ui, action, &form).await?;
    assert_eq!(r.status().as_u16(), 303, "{action}: {}", r.text().await?);
    Ok(())
}

/// Pause and resume a named queue from the dashboard (token-protected like every
/// action); every named queue of the collection on the queues page and in the job list's
/// filters; the key and error filters; the locks page's leaders, read/write locks,
/// semaphores and document locks, with an HTML owner id escaped.
#[tokio::test]
async fn pause_resume_named_queues_filters_and_every_kind_of_lock() -> anyhow::Result<()> {
    let t = TestDb::new("ui_pause_kinds").await?;
    let f = fixture(&t).await?;
    let c = coordination(&t).await?;
    let mail = f.queue.named("mail", QueueOptions::default())?;
    let tenant = mail
        .enqueue(
            doc! { "to": "a@example.com" },
            &EnqueueOptions::default().concurrency_key("tenant-a"),
        )
        .await?
        .created()
        .context("not created")?;
    let bounced = mail
        .enqueue(doc! { "to": "b@example.com" }, &EnqueueOptions::default())
        .await?
        .created()
        .context("not created")?;
    mail.collection()
        .update_one(
            doc! { field::ID: bounced },
            doc! { "$set": { field::LAST_ERROR: "SMTP 550: mailbox (b) unavailable" } },
        )
        .await?;
    // A third named queue, for the pause: three ready jobs.
    let reports = f.queue.named("reports", QueueOptions::default())?;
    for i in 0..3 {
        reports
            .enqueue(doc! { "report": i }, &EnqueueOptions::default())
            .await?;
    }
    let ui = start_ui(&t, &["--documents", "entities"]).await?;
    let token = ui.token.clone().context("no token printed")?;

    // Each named queue of `jobs` has its card, with its own counts.
    let home = page(&ui, "/").await?;
    assert!(home.contains("data-named=\"default\""), "{home}");
    assert!(home.contains("data-named=\"mail\""), "{home}");
    assert!(
        home.contains("named=mail&amp;in_state=ready\" data-state=\"ready\">2</a>"),
        "{home}"
    );
    assert!(
        home.contains("named=default&amp;in_state=ready\" data-state=\"ready\">3</a>"),
        "{home}"
    );
    assert!(!home.contains("paused since"), "{home}");

    // Pause without the token, with a wrong one, cross-site: refused, still running.
    let form = [("queue", "jobs"), ("named", "reports")];
    assert_eq!(post(&ui, "pause", &form).await?.status().as_u16(), 401);
    let mut wrong = form.to_vec();
    wrong.push(("token", "0123"));
    assert_eq!(post(&ui, "pause", &wrong).await?.status().as_u16(), 403);
    let r = client()?
        .post(format!("{}/actions/pause", ui.url))
        .header("sec-fetch-site", "cross-site")
        .form(&[
            ("queue", "jobs"),
            ("named", "reports"),
            ("token", token.as_str()),
        ])
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 403);
    assert!(!reports.is_paused().await?);
    // With the token: the control document says paused, by the dashboard; the default
    // queue is untouched.
    let mut good = form.to_vec();
    good.push(("token", token.as_str()));
    let r = post(&ui, "pause", &good).await?;
    assert_eq!(r.status().as_u16(), 303, "{}", r.text().await?);
    let control = reports.control().await?;
    assert!(control.paused, "{control:?}");
    assert_eq!(control.by.as_deref(), Some("docwarden-ui"));
    assert!(control.paused_at.is_some());
    assert!(!f.queue.is_paused().await?);
    assert!(!mail.is_paused().await?);
    // A worker of the paused queue claims nothing.
    let worker = Worker::spawn(
        reports.clone(),
        WorkerOptions::default()
            .name("ui-test-worker")
            .poll(Duration::from_millis(50), Duration::from_millis(300)),
        |_job| async move { Ok(Bson::Null) },
    )?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let ready = doc! { field::STATE: JobState::Ready.as_str(), field::QUEUE: "reports" };
    assert_eq!(
        reports.collection().count_documents(ready.clone()).await?,
        3,
        "a worker claimed from the paused queue"
    );
    let home = page(&ui, "/").await?;
    assert!(home.contains("paused since"), "{home}");
    assert!(home.contains("Resume queue"), "{home}");
    assert!(home.contains("data-elapsed-ms"), "{home}");
    // Resume: without the token nothing changes; with it the queue runs again.
    assert_eq!(post(&ui, "resume", &form).await?.status().as_u16(), 401);
    assert!(reports.is_paused().await?);
    let r = post(&ui, "resume", &good).await?;
    assert_eq!(r.status().as_u16(), 303, "{}", r.text().await?);
    assert!(!reports.is_paused().await?);
    // The worker takes the jobs now.
    let done = doc! { field::STATE: JobState::Succeeded.as_str(), field::QUEUE: "reports" };
    let started = std::time::Instant::now();
    while reports.collection().count_documents(done.clone()).await? < 3 {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(20),
            "the resumed queue's jobs did not run"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    worker.shutdown().await;
    let home = page(&ui, "/").await?;
    assert!(home.contains("running (resumed) since"), "{home}");
    assert!(!home.contains("Resume queue"), "{home}");

    // The job list: by named queue, by key (a concurrency key), by error text.
    let rows = |html: &str| html.matches("class=\"job\"").count();
    let by_queue = page(&ui, "/jobs?queue=jobs&named=mail").await?;
    assert_eq!(rows(&by_queue), 2, "{by_queue}");
    assert!(
        by_queue.contains("<option value=\"mail\" selected>"),
        "{by_queue}"
    );
    let by_key = page(&ui, "/jobs?key=tenant-a").await?;
    assert_eq!(rows(&by_key), 1, "{by_key}");
    assert!(by_key.contains(&tenant.to_hex()), "{by_key}");
    let by_error = page(&ui, "/jobs?error=mailbox+(B)").await?;
    assert_eq!(rows(&by_error), 1, "{by_error}");
    assert!(by_error.contains(&bounced.to_hex()), "{by_error}");
    let by_dedupe = page(&ui, "/jobs?key=order-2&named=default").await?;
    assert_eq!(rows(&by_dedupe), 1, "{by_dedupe}");
    assert_eq!(rows(&page(&ui, "/jobs?key=order-2&named=mail").await?), 0);
    let by_id = page(&ui, &format!("/jobs?key={}", f.dead.to_hex())).await?;
    assert_eq!(rows(&by_id), 1, "{by_id}");
    // A job of a named queue: its page names the queue, and retry acts on that queue.
    let job = page(&ui, &format!("/jobs/jobs/{}", bounced.to_hex())).await?;
    assert!(job.contains("named=mail"), "{job}");
    assert!(job.contains("SMTP 550"), "{job}");
    mail.collection()
        .update_one(
            doc! { field::ID: bounced },
            doc! { "$set": { field::STATE: JobState::Dead.as_str() } },
        )
        .await?;
    let job = page(&ui, &format!("/jobs/jobs/{}", bounced.to_hex())).await?;
    assert!(
        job.contains("<input type=\"hidden\" name=\"named\" value=\"mail\">"),
        "{job}"
    );
    let id = bounced.to_hex();
    act(
        &ui,
        "retry",
        &[("queue", "jobs"), ("named", "mail"), ("id", id.as_str())],
    )
    .await?;
    assert_eq!(state_of(&f, bounced).await?, JobState::Ready.as_str());
    // Session 18: by-id operations act only on the handle's own queue, so the Cancel form
    // must name the queue too (without it the default queue's handle finds no such job).
    let job = page(&ui, &format!("/jobs/jobs/{}", bounced.to_hex())).await?;
    let cancel_form = job
        .split("action=\"/actions/cancel\"")
        .nth(1)
        .and_then(|rest| rest.split("</form>").next())
        .context("no cancel form")?;
    assert!(
        cancel_form.contains("<input type=\"hidden\" name=\"named\" value=\"mail\">"),
        "{cancel_form}"
    );
    act(&ui, "cancel", &[("queue", "jobs"), ("id", id.as_str())]).await?;
    assert_eq!(
        state_of(&f, bounced).await?,
        JobState::Ready.as_str(),
        "the default queue's handle cancelled a job of `mail`"
    );
    act(
        &ui,
        "cancel",
        &[("queue", "jobs"), ("named", "mail"), ("id", id.as_str())],
    )
    .await?;
    assert_eq!(state_of(&f, bounced).await?, JobState::Cancelled.as_str());

    // The locks page: every kind, the HTML owner id as text.
    let locks = page(&ui, "/locks").await?;
    assert!(locks.contains("scheduler"), "{locks}");
    assert!(locks.contains(EVIL_ESCAPED), "{locks}");
    assert!(
        !locks.contains(EVIL),
        "an owner id was not escaped: {locks}"
    );
    assert!(
        locks.contains(&format!("<td class=\"token\">{}</td>", c.term)),
        "the leader's term: {locks}"
    );
    assert!(locks.contains("<td class=\"role\">reader</td>"), "{locks}");
    assert!(locks.contains("<td class=\"role\">writer</td>"), "{locks}");
    assert!(locks.contains("<td class=\"permits\">2/3</td>"), "{locks}");
    assert!(
        locks.matches(c.holder.id()).count() >= 2,
        "the semaphore and read-lock holder: {locks}"
    );
    assert!(locks.contains("&lt;b&gt;doc-1&lt;"), "{locks}");
    assert!(!locks.contains("<b>doc-1"), "{locks}");
    // The elections', rwlocks' and semaphores' collections are not listed as plain
    // lease collections.
    assert!(!locks.contains("id=\"lock-semaphores\""), "{locks}");
    assert!(locks.contains("id=\"lock-locks\""), "{locks}");
    let _ = c.evil.id();
    Ok(())
}

/// A Prometheus sample: name, labels, value.
type Sample = (String, Vec<(String, String)>, f64);

/// `name{labels} value` → (name, labels, value); `None` for a line that is not a sample.
fn sample(line: &str) -> Option<Sample> {
    let (series, value) = line.rsplit_once(' ')?;
    let value: f64 = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    let (name, labels) = match series.split_once('{') {
        Some((n, rest)) => (n, rest.strip_suffix('}')?),
        None => (series, ""),
    };
    let valid_name = name.chars().enumerate().all(|(i, c)| {
        c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit())
    });
    if name.is_empty() || !valid_name {
        return None;
    }
    let mut pairs = Vec::new();
    for pair in labels.split(',').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=')?;
        let v = v.strip_prefix('"')?.strip_suffix('"')?;
        pairs.push((k.to_owned(), v.to_owned()));
    }
    Some((name.to_owned(), pairs, value))
}

#[tokio::test]
async fn metrics_are_prometheus_text_and_match_the_database() -> anyhow::Result<()> {
    let t = TestDb::new("ui_metrics").await?;
    let f = fixture(&t).await?;
    // A named queue's jobs are their own series, labelled `<collection>/<queue>`.
    let mail = f.queue.named("mail", QueueOptions::default())?;
    for n in 0..2 {
        mail.enqueue(doc! { "n": n }, &EnqueueOptions::default())
            .await?;
    }
    let mail_label = mail.metrics_label().to_owned();
    let ui = start_ui(&t, &["--read-only"]).await?;
    // A page view first, so the dashboard's own counter has a sample.
    page(&ui, "/").await?;
    let text = page(&ui, "/metrics").await?;
    let mut mail_ready = None;
    let mut jobs: Vec<(String, f64)> = Vec::new();
    let mut lock_holders = None;
    let mut names = std::collections::BTreeSet::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, value) =
            sample(line).with_context(|| format!("not Prometheus text: `{line}`"))?;
        let label = |k: &str| labels.iter().find(|(l, _)| l == k).map(|(_, v)| v.clone());
        if name == "docwarden_jobs" && label("queue").as_deref() == Some("jobs") {
            jobs.push((label(field::STATE).context("no state label")?, value));
        }
        if name == "docwarden_jobs"
            && label("queue").as_deref() == Some(mail_label.as_str())
            && label(field::STATE).as_deref() == Some("ready")
        {
            mail_ready = Some(value);
        }
        if name == "docwarden_lock_holders" && label("collection").as_deref() == Some("locks") {
            lock_holders = Some(value);
        }
        names.insert(name);
    }
    for state in JobState::ALL {
        let stored = f
            .queue
            .collection()
            .count_documents(doc! { field::STATE: state.as_str(), field::QUEUE: Bson::Null })
            .await?;
        let shown = jobs
            .iter()
            .find(|(s, _)| s == state.as_str())
            .map(|(_, v)| *v)
            .with_context(|| format!("no docwarden_jobs series for {state}:\n{text}"))?;
        assert_eq!(shown, stored as f64, "{state}:\n{text}");
    }
    assert_eq!(mail_ready, Some(2.0), "the named queue's series:\n{text}");
    assert_eq!(lock_holders, Some(1.0), "{text}");
    for expected in [
        "docwarden_queue_oldest_due_seconds",
        "docwarden_queue_expired_leases",
        "docwarden_locks",
        "docwarden_ui_requests_total",
        "docwarden_ui_scrape_seconds_bucket",
    ] {
        assert!(names.contains(expected), "no {expected}:\n{text}");
    }
    assert!(text.contains("# TYPE docwarden_jobs gauge"), "{text}");
    Ok(())
}

#[test]
fn the_metrics_line_parser_rejects_what_is_not_a_sample() {
    assert!(sample("docwarden_jobs{queue=\"q\",state=\"ready\"} 3").is_some());
    assert!(sample("up 1").is_some());
    assert!(sample("2bad 1").is_none());
    assert!(sample("docwarden_jobs{queue=q} 1").is_none());
    assert!(sample("docwarden_jobs 1x").is_none());
}

fn chromium() -> Option<&'static str> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| {
            std::process::Command::new(b)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
}

/// Runs headless Chromium with `args` and the URL; its standard output.
async fn headless(
    browser: &str,
    profile: &std::path::Path,
    args: &[&str],
    url: &str,
) -> anyhow::Result<String> {
    let out = tokio::time::timeout(
        Duration::from_secs(90),
        tokio::process::Command::new(browser)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--hide-scrollbars",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .args(args)
            .arg(url)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .context("chromium took more than 90 s")??;
    anyhow::ensure!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Loads the queue, job and locks pages in headless Chromium and checks what it rendered
/// (after the page's script ran: countdowns filled, no injected script). Screenshots go to
/// `$DOCWARDEN_UI_SCREENSHOTS` (the repository's `docs/` when refreshing them), else to a
/// temporary directory.
#[tokio::test]
async fn chromium_renders_the_queue_job_and_locks_pages() -> anyhow::Result<()> {
    let test = "chromium_renders_the_queue_job_and_locks_pages";
    let Some(browser) = chromium() else {
        docwarden_testkit::skip(test, "no chromium on PATH (apt-get install chromium)");
        return Ok(());
    };
    let t = TestDb::new("ui_chromium").await?;
    let f = fixture(&t).await?;
    // Some history for the charts: a few more finished jobs.
    for i in 0..4 {
        f.queue
            .enqueue(
                doc! { "n": format!("extra-{i}") },
                &EnqueueOptions::default().priority(3),
            )
            .await?;
        let j = f
            .queue
            .claim("worker-d")
            .await?
            .context("nothing to claim")?;
        f.queue.complete(&j, Bson::Int64(i)).await?;
    }
    // A paused named queue, and every kind of lock.
    let mail = f.queue.named("mail", QueueOptions::default())?;
    for i in 0..2 {
        mail.enqueue(doc! { "mail": i }, &EnqueueOptions::default())
            .await?;
    }
    mail.pause("ops@example.com").await?;
    let c = coordination(&t).await?;
    let ui = start_ui(&t, &["--documents", "entities"]).await?;
    let profile = tempfile::tempdir()?;
    let temp_shots = tempfile::tempdir()?;
    let shots = std::env::var_os("DOCWARDEN_UI_SCREENSHOTS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| temp_shots.path().to_owned());

    let pages = [
        ("ui-queues.png", format!("{}/", ui.url)),
        (
            "ui-job.png",
            format!("{}/jobs/jobs/{}", ui.url, f.dead.to_hex()),
        ),
        ("ui-locks.png", format!("{}/locks", ui.url)),
    ];
    let queues = headless(browser, profile.path(), &["--dump-dom"], &pages[0].1).await?;
    assert!(queues.contains("data-queue=\"jobs\""), "{queues}");
    assert!(queues.contains("data-state=\"dead\">1</a>"), "{queues}");
    assert!(queues.contains("data-named=\"mail\""), "{queues}");
    assert!(queues.contains("paused since"), "{queues}");
    // The time since the pause was filled in by the page's script.
    assert!(
        !queues.contains("data-elapsed-ms=\"") || queues.contains(" s</span> ago"),
        "the pause's clock did not run: {queues}"
    );
    // The token from the URL fragment is not needed to render; forms stay token-less.
    let job = headless(browser, profile.path(), &["--dump-dom"], &pages[1].1).await?;
    assert!(job.contains(EVIL_ESCAPED), "{job}");
    assert!(
        !job.contains(EVIL),
        "an injected script is in the DOM: {job}"
    );
    let locks = headless(browser, profile.path(), &["--dump-dom"], &pages[2].1).await?;
    assert!(locks.contains("invoice-42"), "{locks}");
    assert!(locks.contains(f.owner.id()), "{locks}");
    assert!(locks.contains(c.holder.id()), "{locks}");
    assert!(locks.contains(EVIL_ESCAPED), "{locks}");
    assert!(
        !locks.contains(EVIL),
        "an injected script is in the DOM: {locks}"
    );
    assert!(locks.contains("2/3"), "{locks}");
    // The countdown was filled in by the page's script: "299 s" or so, not empty.
    assert!(
        locks.contains(" s</span>") || locks.contains(" min "),
        "the countdown did not run: {locks}"
    );
    for (file, url) in &pages {
        let path = shots.join(file);
        headless(
            browser,
            profile.path(),
            &[
                &format!("--screenshot={}", path.display()),
                // The locks page has five sections: a taller window shows them all.
                if *file == "ui-locks.png" {
                    "--window-size=1400,1250"
                } else {
                    "--window-size=1400,900"
                },
            ],
            url,
        )
        .await?;
        let png = std::fs::read(&path).with_context(|| format!("no {}", path.display()))?;
        assert!(
            png.starts_with(b"\x89PNG"),
            "{} is not a PNG",
            path.display()
        );
        assert!(png.len() > 10_000, "{} is nearly empty", path.display());
    }
    Ok(())
}

/// Reads the event stream until an event `name` arrives; its data.
async fn next_event(
    resp: &mut reqwest::Response,
    buf: &mut String,
    name: &str,
) -> anyhow::Result<String> {
    let needle = format!("event: {name}\n");
    let read = async {
        loop {
            if let Some(i) = buf.find(&needle) {
                let rest = &buf[i + needle.len()..];
                if let Some(end) = rest.find("\n\n") {
                    let data = rest[..end].strip_prefix("data: ").unwrap_or("").to_owned();
                    buf.drain(..i + needle.len() + end + 2);
                    return anyhow::Ok(data);
                }
            }
            let chunk = resp.chunk().await?.context("the event stream ended")?;
            buf.push_str(&String::from_utf8_lossy(&chunk));
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .with_context(|| format!("no `{name}` event within 20 s (got: {buf:?})"))?
}

/// A page listening on `/events` hears of a job enqueued after it connected: through the
/// change stream, and through the polling fallback (`--poll-only`).
#[tokio::test]
async fn live_updates_arrive_by_change_stream_and_by_polling() -> anyhow::Result<()> {
    let t = TestDb::new("ui_live").await?;
    let f = fixture(&t).await?;
    for (extra, mode) in [
        (&[][..], "change stream"),
        (&["--poll-only"][..], "polling"),
    ] {
        let mut args = vec!["--read-only"];
        args.extend_from_slice(extra);
        let ui = start_ui(&t, &args).await?;
        let home = page(&ui, "/").await?;
        assert!(
            home.contains(&format!("<span id=\"live-mode\">{mode}</span>")),
            "{home}"
        );
        let mut events = reqwest::Client::new()
            .get(format!("{}/events", ui.url))
            .send()
            .await?;
        let mut buf = String::new();
        assert_eq!(next_event(&mut events, &mut buf, "hello").await?, mode);
        if mode == "polling" {
            // The poller's first look is its baseline.
            tokio::time::sleep(Duration::from_millis(2500)).await;
        }
        f.queue
            .enqueue(
                doc! { "n": format!("live {mode}") },
                &EnqueueOptions::default(),
            )
            .await?;
        next_event(&mut events, &mut buf, "change").await?;
        // A pause (a write to the meta collection, no job changes) is heard too, so the
        // queue page shows "paused since" without a reload; then the resume.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        buf.clear();
        f.queue.pause("live-test").await?;
        next_event(&mut events, &mut buf, "change").await?;
        tokio::time::sleep(Duration::from_millis(1000)).await;
        buf.clear();
        f.queue.resume("live-test").await?;
        next_event(&mut events, &mut buf, "change").await?;
    }
    Ok(())
}

/// `docwarden demo --ui` prints the dashboard's URL before the scenarios' narration (and,
/// with standard input closed, does not wait at the end).
#[tokio::test]
async fn demo_with_ui_prints_the_dashboard_url() -> anyhow::Result<()> {
    let uri = docwarden_testkit::shared_uri().await?;
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_docwarden"))
            .args(["demo", "server", "--ui", "--uri", uri.as_str()])
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .context("demo --ui took more than 120 s")??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = stdout.lines().next().unwrap_or("");
    assert!(
        first.starts_with("dashboard: http://127.0.0.1:"),
        "{stdout}"
    );
    Ok(())
}

/// A count of jobs in a state docwarden never writes (a hand edit) is shown but not linked
/// (session 14): the job list filters by docwarden's states, and the link led to a 400
/// page. Every link the queues page keeps opens.
#[tokio::test]
async fn a_foreign_state_is_counted_but_not_linked_to_a_page_that_fails() -> anyhow::Result<()> {
    let t = TestDb::new("ui_foreign_state").await?;
    let f = fixture(&t).await?;
    f.queue
        .collection()
        .update_one(
            doc! { field::ID: f.dead },
            doc! { "$set": { field::STATE: "weird-state" } },
        )
        .await?;
    let ui = start_ui(&t, &[]).await?;
    let home = page(&ui, "/").await?;
    assert!(
        home.contains("weird-state (not a docwarden state)"),
        "{home}"
    );
    assert!(home.contains("data-state=\"weird-state\""), "{home}");
    assert!(!home.contains("in_state=weird-state"), "{home}");
    let mut links = 0;
    for part in home.split("href=\"").skip(1) {
        let Some(href) = part.split('"').next() else {
            continue;
        };
        if href.starts_with("/jobs?") {
            page(&ui, &href.replace("&amp;", "&")).await?;
            links += 1;
        }
    }
    assert!(links >= 4, "{links} job links on {home}");
    Ok(())
}

/// A job stored with `queue: "default"` (a foreign producer, a hand edit) is in no queue:
/// no handle claims, lists or counts it. The queues page says how many there are (session
/// 19, as `docwarden queue stats` and `doctor` do).
#[tokio::test]
async fn jobs_stored_with_queue_default_are_reported_on_the_queues_page() -> anyhow::Result<()> {
    let t = TestDb::new("ui_misnamed_default").await?;
    let f = fixture(&t).await?;
    let ui = start_ui(&t, &[]).await?;
    let before = page(&ui, "/").await?;
    assert!(!before.contains("in no queue"), "{before}");
    f.queue
        .collection()
        .update_one(
            doc! { field::ID: f.dead },
            doc! { "$set": { field::QUEUE: "default" } },
        )
        .await?;
    // The counts are a snapshot reused for at least a second (`ui/snapshot.rs`).
    let home = page_once(&ui, "/", |p| p.contains("in no queue")).await?;
    assert!(
        home.contains("shows the fix): <strong>1</strong>"),
        "{home}"
    );
    Ok(())
}

/// Session 16 (docs review): naming one kind of collection turned discovery off for the
/// other, although `--help` promises it per option (`--queue jobs` alone showed no lock
/// collection); and a queue's concurrency-limit semaphore `jobs.limits` (it has
/// `jobs.limits.tokens`) was discovered as a plain lease collection.
#[tokio::test]
async fn the_kind_not_named_is_discovered_and_a_queues_limits_are_not_leases() -> anyhow::Result<()>
{
    let t = TestDb::new("ui_discover_per_kind").await?;
    let _f = fixture(&t).await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let limits = Semaphore::open(
        &t.db,
        "jobs.limits",
        time.clone(),
        SemaphoreOptions::default().default_permits(2),
    )
    .await?;
    limits
        .try_acquire(&Owner::random(), "tenant-7", Duration::from_secs(300))
        .await?
        .context("no permit")?;
    let other = LockCollection::open(&t.db, "other_locks", time, LockOptions::default()).await?;
    other
        .try_acquire(&Owner::random(), "payroll-7", Duration::from_secs(300))
        .await?
        .context("no lease")?;

    let ui = start_ui(&t, &["--queue", "jobs"]).await?;
    let locks = page(&ui, "/locks").await?;
    for lease in ["invoice-42", "payroll-7"] {
        assert!(locks.contains(lease), "{lease} not discovered: {locks}");
    }
    assert!(
        !locks.contains("jobs.limits") && !locks.contains("tenant-7"),
        "the queue's limit semaphore listed as leases: {locks}"
    );
    let home = page(&ui, "/").await?;
    assert!(home.contains("data-queue=\"jobs\""), "{home}");
    Ok(())
}

/// Session 36: `JobQueue::stats` reads the whole collection (6.5–6.9 s at 1,000,000 jobs on
/// the embedded server), and every page view and `/metrics` scrape called it for every
/// named queue. The counts are now one snapshot per collection (`ui/snapshot.rs`), read
/// again at most every `--counts-every` (and 20 times the read's own duration). The
/// server's profiler of the test's database counts the counts' `$group` reads: ten views
/// and scrapes within `--counts-every 600` read them once per named queue. Without the
/// snapshot (and its option) the test fails.
#[tokio::test]
async fn queue_counts_are_read_once_per_snapshot_however_many_views_and_scrapes()
-> anyhow::Result<()> {
    let t = TestDb::new("ui_counts_snapshot").await?;
    let f = fixture(&t).await?;
    let ui = start_ui(&t, &["--counts-every", "600"]).await?;
    let jobs = f.queue.collection().name().to_owned();
    let groups = || async {
        let n =
            t.db.collection::<mongodb::bson::Document>("system.profile")
                .count_documents(doc! {
                    "command.aggregate": &jobs,
                    "command.pipeline.1.$group": { "$exists": true },
                })
                .await?;
        anyhow::Ok(n)
    };
    t.db.run_command(doc! { "profile": 2 }).await?;
    page(&ui, "/").await?;
    let once = groups().await?;
    for _ in 0..5 {
        page(&ui, "/metrics").await?;
        page(&ui, "/").await?;
    }
    let after = groups().await?;
    t.db.run_command(doc! { "profile": 0 }).await?;
    println!("counts read {once} time(s) for the first view, {after} after ten more requests");
    assert!(
        once >= 1,
        "the profiler saw no count: the test observed nothing"
    );
    assert_eq!(
        after, once,
        "views and scrapes within --counts-every read the counts again"
    );

    let (code, stderr) = {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_docwarden"))
            .args(["ui", "--counts-every", "0"])
            .output()?;
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    assert_ne!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains("--counts-every must be between 1 and 3600"),
        "{stderr}"
    );
    Ok(())
}

/// Session 38: a page view that finds its counts or its listing no longer fresh is served
/// the ones held at once, and they are read again in the background (at 1,000,000 jobs a
/// read of the counts took 5.6 s and a listing 1.2 s, which a view used to wait for). Once
/// the background read is stored, open pages get a `change` event (nothing else would tell
/// a page shown stale counts of a quiet queue), and the next view shows the new job.
/// Without the change the stale view already shows it (the view waited for the read).
#[tokio::test]
async fn a_stale_view_is_served_at_once_and_read_again_in_the_background() -> anyhow::Result<()> {
    let t = TestDb::new("ui_serve_stale").await?;
    let f = fixture(&t).await?;
    let ui = start_ui(&t, &["--counts-every", "1"]).await?;
    let ready_of = |home: &str| -> Option<u64> {
        let marker = "named=default&amp;in_state=ready\" data-state=\"ready\">";
        let at = home.find(marker)? + marker.len();
        home[at..].split('<').next()?.parse().ok()
    };
    let listing = "/jobs?queue=jobs&in_state=ready";
    let before = ready_of(&page(&ui, "/").await?).context("no ready count")?;
    page(&ui, listing).await?;
    let id = f
        .queue
        .enqueue(doc! { "n": "stale" }, &EnqueueOptions::default())
        .await?
        .created()
        .context("not created")?
        .to_hex();
    // Both are past `--counts-every` (their reads took far less than 1/20 of it), and
    // the enqueue's own change event has been sent.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let mut events = reqwest::Client::new()
        .get(format!("{}/events", ui.url))
        .send()
        .await?;
    let mut buf = String::new();
    next_event(&mut events, &mut buf, "hello").await?;
    let stale_home = page(&ui, "/").await?;
    let stale_list = page(&ui, listing).await?;
    assert_eq!(
        ready_of(&stale_home),
        Some(before),
        "the view waited for new counts"
    );
    assert!(
        !stale_list.contains(&id),
        "the view waited for a new listing"
    );
    // Nothing was written since: the page is told to fetch itself again because the
    // background reads stored new snapshots.
    next_event(&mut events, &mut buf, "change").await?;
    let fresh_home = page_once(&ui, "/", |p| ready_of(p) == Some(before + 1)).await?;
    assert_eq!(ready_of(&fresh_home), Some(before + 1), "never read again");
    let fresh_list = page_once(&ui, listing, |p| p.contains(&id)).await?;
    assert!(fresh_list.contains(&id), "the listing was never read again");
    Ok(())
}

/// How many documents the server's profiler saw returned by reads (`find`, `getMore`) of
/// collection `coll` since profiling was switched on.
async fn returned(t: &TestDb, coll: &str) -> anyhow::Result<i64> {
    let ns = format!("{}.{coll}", t.db.name());
    let mut cursor =
        t.db.collection::<mongodb::bson::Document>("system.profile")
            .find(doc! { "ns": ns, "op": { "$in": ["query", "getmore"] } })
            .await?;
    let mut n = 0_i64;
    while cursor.advance().await? {
        let entry = cursor.deserialize_current()?;
        n += match entry.get("nreturned") {
            Some(Bson::Int32(v)) => i64::from(*v),
            Some(Bson::Int64(v)) => *v,
            _ => 0,
        };
    }
    Ok(n)
}

/// Session 37: the locks page, the lock gauges of `GET /metrics` and the live-update
/// fingerprint used to list every held lease of a lock collection on each view and scrape
/// (with a lock per entity, many thousands of documents each time). They now share the
/// collection's paced snapshot: `LockCollection::counts` (one small reply) and the first
/// 200 leases by resource. The server's profiler sums the lock documents returned to the
/// dashboard over ten views and scrapes of a collection of 1,000 leases: about 10,000
/// before, at most one page (200) after.
#[tokio::test]
async fn lock_views_read_counts_and_one_page_not_every_lease() -> anyhow::Result<()> {
    const LEASES: usize = 1_000;
    let t = TestDb::new("ui_lock_snapshot").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let locks = LockCollection::open(&t.db, "locks", time, LockOptions::default()).await?;
    let owners = [Owner::random(), Owner::random(), Owner::random()];
    for i in 0..LEASES {
        locks
            .try_acquire(
                &owners[i % owners.len()],
                &format!("user-{i:05}"),
                Duration::from_secs(300),
            )
            .await?
            .context("acquire")?;
    }
    let ui = start_ui(&t, &["--counts-every", "600"]).await?;
    t.db.run_command(doc! { "profile": 2 }).await?;
    let first = page(&ui, "/locks").await?;
    for _ in 0..5 {
        page(&ui, "/metrics").await?;
        page(&ui, "/locks").await?;
    }
    let metrics = page(&ui, "/metrics").await?;
    let n = returned(&t, "locks").await?;
    t.db.run_command(doc! { "profile": 0 }).await?;
    println!("{n} lock documents returned to the dashboard over twelve views and scrapes");
    assert!(
        n <= 200,
        "{n} lock documents returned: the views list every lease"
    );
    assert!(
        first.contains("1000 held, 0 expired, 3 holder(s)"),
        "the counts of the whole collection: {first}"
    );
    assert!(first.contains("user-00000") && first.contains("user-00199"));
    assert!(!first.contains("user-00200"), "more than one page listed");
    assert!(first.contains("The first 200 leases by resource"));
    let gauge = |name: &str, status: Option<&str>| {
        metrics
            .lines()
            .filter_map(sample)
            .find_map(|(n, labels, v)| {
                let has = |k: &str, val: &str| labels.iter().any(|(a, b)| a == k && b == val);
                (n == name
                    && has("collection", "locks")
                    && status.is_none_or(|st| has("status", st)))
                .then_some(v)
            })
    };
    assert_eq!(
        gauge("docwarden_locks", Some("held")),
        Some(1000.0),
        "{metrics}"
    );
    assert_eq!(
        gauge("docwarden_locks", Some("expired")),
        Some(0.0),
        "{metrics}"
    );
    assert_eq!(
        gauge("docwarden_lock_holders", None),
        Some(3.0),
        "{metrics}"
    );
    Ok(())
}

/// Session 38: the locks page listed every election, read/write lock, semaphore and
/// locked document on each view (one document per resource; with one per entity, many
/// thousands). Now it reads one page of each kind (the first 200, and one more to say
/// there are more), counted with the server's profiler over three views of 300 of each:
/// 900 documents returned per collection before, at most 603 after.
#[tokio::test]
async fn lock_kinds_views_read_one_page_of_each_kind() -> anyhow::Result<()> {
    const EACH: usize = 300;
    const VIEWS: i64 = 3;
    let t = TestDb::new("ui_lock_kinds_page").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let ttl = Duration::from_secs(300);
    // An election is a lease in the elections' lock collection.
    let elections =
        LockCollection::open(&t.db, "elections", time.clone(), LockOptions::default()).await?;
    let rw = RwLocks::open(&t.db, "rwlocks", time.clone(), RwLockOptions::default()).await?;
    let sem = Semaphore::open(
        &t.db,
        "semaphores",
        time.clone(),
        SemaphoreOptions::default().default_permits(3),
    )
    .await?;
    let docs = DocumentLocks::open(&t.db, "entities", time, DocumentLockOptions::default()).await?;
    let owner = Owner::random();
    let mut guards = Vec::new();
    for i in 0..EACH {
        let r = format!("r-{i:05}");
        elections
            .try_acquire(&owner, &r, ttl)
            .await?
            .context("elected")?;
        rw.try_write(&owner, &r, ttl).await?.context("write lock")?;
        sem.try_acquire(&owner, &r, ttl).await?.context("permit")?;
        guards.push(
            docs.lock_or_create(&r, doc! { "v": 1 })
                .await?
                .context("document lock")?,
        );
    }
    let ui = start_ui(&t, &["--documents", "entities"]).await?;
    t.db.run_command(doc! { "profile": 2 }).await?;
    let mut first = String::new();
    for _ in 0..VIEWS {
        first = page(&ui, "/locks").await?;
    }
    t.db.run_command(doc! { "profile": 0 }).await?;
    for coll in ["elections", "rwlocks", "semaphores", "entities"] {
        let n = returned(&t, coll).await?;
        println!("{coll}: {n} documents returned over {VIEWS} views");
        assert!(
            n <= 201 * VIEWS,
            "{coll}: {n} documents returned over {VIEWS} views: every one is listed"
        );
    }
    for note in [
        "The first 200 elections by name",
        "The first 200 read/write locks by resource",
        "The first 200 semaphores by resource",
        "The first 200 locked documents by id",
    ] {
        assert!(first.contains(note), "no note {note:?}: {first}");
    }
    assert!(first.contains("r-00000") && first.contains("r-00199"));
    assert!(!first.contains("r-00200"), "more than one page listed");
    drop(guards);
    Ok(())
}

/// Session 37: a view of the jobs page read every job twice over on a large collection:
/// `JobQueue::queue_names` (a `distinct` over the whole collection) and then one listing
/// per named queue; and every view of the queues page read each named queue's chart of
/// finished jobs. Now the jobs page lists every named queue in one read
/// (`JobListFilter::every_queue`), and the chart is part of the paced snapshot. Counted
/// with the server's profiler over five views of each page: no `distinct`, one chart read
/// per named queue in all. Session 38: a listing is paced like the counts (it reads every
/// job it filters, and an open page fetches itself after every burst of writes): five
/// views of one filter read it once (5 before), another filter once more, and an action
/// drops the listings so that the next view shows its effect.
#[tokio::test]
async fn the_jobs_page_reads_once_per_filter_and_the_chart_once_per_snapshot() -> anyhow::Result<()>
{
    let t = TestDb::new("ui_jobs_reads").await?;
    let f = fixture(&t).await?;
    let mail = f.queue.named("mail", QueueOptions::default())?;
    mail.enqueue(doc! { "to": "a@example.com" }, &EnqueueOptions::default())
        .await?;
    // A hand-edited job whose `queue` is not a string: listed, marked as such.
    let now = mongodb::bson::DateTime::now();
    f.queue
        .collection()
        .insert_one(doc! { "queue": 5, "state": "ready", "run_at": now, "updated_at": now })
        .await?;
    let ui = start_ui(&t, &["--counts-every", "600"]).await?;
    let jobs = f.queue.collection().name().to_owned();
    let profiled = |filter: mongodb::bson::Document| {
        let coll = t.db.collection::<mongodb::bson::Document>("system.profile");
        async move { anyhow::Ok(coll.count_documents(filter).await?) }
    };
    t.db.run_command(doc! { "profile": 2 }).await?;
    page(&ui, "/").await?;
    let distinct_first = profiled(doc! { "command.distinct": &jobs }).await?;
    let mut listed = String::new();
    for _ in 0..5 {
        page(&ui, "/").await?;
        listed = page(&ui, "/jobs").await?;
    }
    let distinct = profiled(doc! { "command.distinct": &jobs }).await?;
    let charts = profiled(doc! {
        "command.find": &jobs,
        "command.filter.finished_at": { "$exists": true },
    })
    .await?;
    let listings = profiled(doc! {
        "command.find": &jobs,
        "command.sort.updated_at": -1,
    })
    .await?;
    t.db.run_command(doc! { "profile": 0 }).await?;
    println!(
        "distinct: {distinct_first} for the first view, {distinct} in all; chart reads {charts}; listings {listings}"
    );
    // The counts' snapshot reads the names with the counts (`stats_of_every_queue`).
    assert_eq!(distinct, 0, "a view read the queue names with a distinct");
    assert_eq!(listings, 1, "one listing per filter while it is fresh");
    assert_eq!(charts, 2, "one chart read per named queue (default, mail)");
    // Every named queue's jobs are on the page, each with its queue.
    assert!(
        listed.contains("a@example.com") || listed.contains("mail"),
        "{listed}"
    );
    assert!(listed.contains(&f.running.to_hex()), "{listed}");
    assert!(
        listed.contains("&lt;5&gt;"),
        "the foreign queue value: {listed}"
    );
    // Another filter is another listing; the dead job is listed as dead.
    t.db.run_command(doc! { "profile": 2 }).await?;
    let dead = f.dead.to_hex();
    for _ in 0..3 {
        let d = page(&ui, "/jobs?in_state=dead").await?;
        assert!(d.contains(&dead), "{d}");
    }
    let listings_of_two = profiled(doc! {
        "command.find": &jobs,
        "command.sort.updated_at": -1,
    })
    .await?;
    t.db.run_command(doc! { "profile": 0 }).await?;
    assert_eq!(listings_of_two, 2, "one more listing for the second filter");
    // An action drops the listings: the retried job is no longer listed as dead.
    act(&ui, "retry", &[("queue", "jobs"), ("id", dead.as_str())]).await?;
    let after = page(&ui, "/jobs?in_state=dead").await?;
    assert!(
        !after.contains(&dead),
        "the listing after the retry is stale: {after}"
    );
    Ok(())
}
