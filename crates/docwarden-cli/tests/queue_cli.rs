//! `docwarden queue list` and `queue show` against the shared test server: a running
//! job's progress, stalls and snoozes are listed, and `show` prints the whole document
//! (issue 15, progress and output).

use std::process::{Command, Output};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::format::field;
use docwarden::queue::{EnqueueOptions, JobQueue, QueueOptions};
use docwarden_testkit::TestDb;
use mongodb::bson::doc;
use mongodb::bson::oid::ObjectId;

/// `docwarden queue <args> --uri … --db <the test's db> --collection jobs`.
fn queue_command(t: &TestDb, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_docwarden"));
    command.arg("queue").args(args).args([
        "--uri",
        t.uri(),
        "--db",
        t.db.name(),
        "--collection",
        "jobs",
    ]);
    command
}

/// [`queue_command`] with `--json`.
fn run(t: &TestDb, args: &[&str]) -> anyhow::Result<Output> {
    Ok(queue_command(t, args).arg("--json").output()?)
}

/// [`queue_command`]'s text output; fails if the command did.
fn text(t: &TestDb, args: &[&str]) -> anyhow::Result<String> {
    let out = queue_command(t, args).output()?;
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// The queue `jobs` of the test's database and one job waiting in it.
async fn one_waiting_job(t: &TestDb) -> anyhow::Result<(JobQueue, ObjectId)> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time, QueueOptions::default()).await?;
    let id = q
        .enqueue(doc! { "n": 1_i64 }, &EnqueueOptions::default())
        .await?
        .created()
        .ok_or_else(|| anyhow::anyhow!("not created"))?;
    Ok((q, id))
}

#[tokio::test]
async fn list_and_show_print_progress_and_the_whole_job() -> anyhow::Result<()> {
    let t = TestDb::new("queue_cli_show").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time, QueueOptions::default()).await?;
    q.enqueue(doc! { "ip": "1.2.3.4" }, &EnqueueOptions::default())
        .await?;
    let job = q
        .claim("w")
        .await?
        .ok_or_else(|| anyhow::anyhow!("no job"))?;
    q.progress(&job, doc! { "done": 3_i64, "of": 7_i64 })
        .await?;

    let out = run(&t, &["list"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let row = &listed[0];
    // Typed values (session 16; every value was a string before, `attempts` was "1/5").
    assert_eq!(row[field::PROGRESS]["done"], 3, "{row}");
    assert_eq!(row[field::PRIORITY], 0, "{row}");
    assert_eq!(row[field::ATTEMPTS], 1, "{row}");
    assert_eq!(row[field::MAX_ATTEMPTS], 5, "{row}");
    assert_eq!(row[field::STATE], "running", "{row}");
    assert_eq!(row[field::lease::OWNER], "w", "{row}");
    assert_eq!(row[field::LAST_ERROR], serde_json::Value::Null, "{row}");
    assert!(
        row[field::RUN_AT]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "{row}"
    );
    let listed = text(&t, &["list"])?;
    assert!(listed.contains(r#"{"done":3,"of":7}"#), "{listed}");
    assert!(listed.contains(" 1/5 "), "{listed}");

    let id = job.id().to_hex();
    let out = run(&t, &["show", &id])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(shown[field::PROGRESS]["done"], 3);
    assert_eq!(shown[field::STATE], "running");

    let out = run(&t, &["show", &ObjectId::new().to_hex()])?;
    assert_eq!(out.status.code(), Some(1), "an unknown id exits 1");
    Ok(())
}

/// `queue list --key` and `--error` (issue 17): the library's `JobListFilter::key` and
/// `error_contains`, so a key matches exactly and the error text literally, ignoring case.
#[tokio::test]
async fn list_filters_by_key_and_error_text() -> anyhow::Result<()> {
    let t = TestDb::new("queue_cli_filters").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time, QueueOptions::default()).await?;
    let mut ids = Vec::new();
    for (key, error) in [
        ("order-1", "Timeout (30 s)"),
        ("order-10", "refused"),
        ("order-2", "timeout (5 s)"),
    ] {
        let id = q
            .enqueue(
                doc! { "k": key },
                &EnqueueOptions::default().dedupe_key(key),
            )
            .await?
            .created()
            .ok_or_else(|| anyhow::anyhow!("not created"))?;
        q.collection()
            .update_one(
                doc! { field::ID: id },
                doc! { "$set": { field::LAST_ERROR: error } },
            )
            .await?;
        ids.push(id.to_hex());
    }
    let listed = |args: &[&str]| -> anyhow::Result<Vec<String>> {
        let out = run(&t, args)?;
        anyhow::ensure!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let mut got: Vec<String> = v
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|r| r["id"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        got.sort();
        Ok(got)
    };
    assert_eq!(listed(&["list", "--key", "order-1"])?, vec![ids[0].clone()]);
    let mut timeouts = vec![ids[0].clone(), ids[2].clone()];
    timeouts.sort();
    assert_eq!(listed(&["list", "--error", "TIMEOUT ("])?, timeouts);
    assert_eq!(
        listed(&["list", "--error", "timeout", "--key", "order-2"])?,
        vec![ids[2].clone()]
    );
    assert!(listed(&["list", "--error", "time.ut"])?.is_empty());
    let out = run(&t, &["list", "--key", ""])?;
    assert!(!out.status.success());
    Ok(())
}

/// Stored text reaches a terminal escaped (session 14): a hand-edited `last_error` with an
/// escape sequence and a newline must not clear the screen or fake a row in `queue list`
/// or `queue show`, and a long one is cut in the listing (`--json` keeps it whole). Before
/// the fix both printed the bytes as they were stored.
#[tokio::test]
async fn text_output_escapes_control_characters_and_cuts_long_cells() -> anyhow::Result<()> {
    let t = TestDb::new("queue_cli_terminal").await?;
    let (_q, id) = one_waiting_job(&t).await?;
    let hostile = format!("\u{1b}[2J cleared\nfake row\0 {}", "x".repeat(5_000));
    t.db.collection::<mongodb::bson::Document>("jobs")
        .update_one(
            doc! { "_id": id },
            doc! { "$set": { field::LAST_ERROR: &hostile } },
        )
        .await?;
    let listed = text(&t, &["list"])?;
    assert!(
        !listed.contains('\u{1b}') && !listed.contains('\0'),
        "{listed:?}"
    );
    assert_eq!(
        listed.lines().count(),
        2,
        "a header and one row: {listed:?}"
    );
    assert!(
        listed.contains("\\u{1b}[2J cleared\\nfake row"),
        "{listed:?}"
    );
    assert!(
        listed.len() < 1_000,
        "the 5 KB error is cut: {} bytes",
        listed.len()
    );
    let shown = text(&t, &["show", &id.to_hex()])?;
    assert!(
        !shown.contains('\u{1b}') && !shown.contains('\0'),
        "{shown:?}"
    );
    assert!(
        shown.contains(&"x".repeat(5_000)),
        "show prints the whole value"
    );
    let json = run(&t, &["list"])?;
    let rows: serde_json::Value = serde_json::from_slice(&json.stdout)?;
    assert_eq!(
        rows[0][field::LAST_ERROR],
        serde_json::Value::String(hostile)
    );
    Ok(())
}

/// `queue retry <ids>` fails when a named job was not retried (session 14): before the fix
/// an unknown id, a job that is not dead, or a dead job of another queue all printed "0 dead
/// job(s) moved back to ready" and exited 0, so a script never noticed.
#[tokio::test]
async fn retry_of_named_jobs_fails_when_one_was_not_retried() -> anyhow::Result<()> {
    let t = TestDb::new("queue_cli_retry").await?;
    let (_q, waiting) = one_waiting_job(&t).await?;
    let unknown = ObjectId::new();
    for id in [unknown, waiting] {
        let out = run(&t, &["retry", &id.to_hex()])?;
        assert_eq!(
            out.status.code(),
            Some(1),
            "{id}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let body: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(body["retried"], 0);
        assert_eq!(body["not_retried"], 1);
    }
    // A dead job is retried: exit 0.
    t.db.collection::<mongodb::bson::Document>("jobs")
        .update_one(
            doc! { "_id": waiting },
            doc! { "$set": { field::STATE: "dead" } },
        )
        .await?;
    let out = run(&t, &["retry", &waiting.to_hex()])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let body: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(body["retried"], 1);
    Ok(())
}

/// Session 21: `--collection jobs.meta` (a queue's options collection) was read as a queue
/// of its own; it is refused before connecting, naming the reserved suffix, as
/// `JobQueue::open` refuses it (`docwarden/tests/queue_s21_side_names.rs`).
#[tokio::test]
async fn a_collection_ending_in_a_side_collection_suffix_is_refused() -> anyhow::Result<()> {
    let t = TestDb::new("queue_cli_side_names").await?;
    let _ = one_waiting_job(&t).await?;
    let out = Command::new(env!("CARGO_BIN_EXE_docwarden"))
        .args(["queue", "stats", "--uri", t.uri(), "--db", t.db.name()])
        .args(["--collection", "jobs.meta"])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "accepted: {stderr}");
    assert!(
        stderr.contains("--collection") && stderr.contains("`.meta`"),
        "{stderr}"
    );
    Ok(())
}
