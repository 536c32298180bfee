//! The `docwarden` binary end to end: doctor against the embedded server, and the
//! one-line, bounded failure on an unreachable URI.

use std::process::Command;
use std::time::{Duration, Instant};

fn docwarden() -> Command {
    Command::new(env!("CARGO_BIN_EXE_docwarden"))
}

/// Runs `command`: its exit code and its stderr.
fn code_and_stderr(command: &mut Command) -> anyhow::Result<(Option<i32>, String)> {
    let out = command.output()?;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

#[test]
fn doctor_starts_the_embedded_server_prints_every_capability_and_stops_it() -> anyhow::Result<()> {
    if std::env::var_os("MONGODB_URI").is_some() {
        docwarden_testkit::skip(
            "doctor_starts_the_embedded_server_prints_every_capability_and_stops_it",
            "tests the embedded server's launcher and MONGODB_URI is set",
        );
        return Ok(());
    }
    let out = docwarden()
        .arg("doctor")
        .env_remove("MONGODB_URI")
        .output()?;
    let stdout = String::from_utf8(out.stdout)?;
    let stderr = String::from_utf8(out.stderr)?;
    assert!(out.status.success(), "doctor failed: {stderr}");
    for line in [
        "version",
        "wire version",
        "topology",
        "round trip",
        "clock offset",
        "pipeline updates",
        "$$NOW in query $expr",
        "unique indexes",
        "partial indexes",
        "partial index updates",
        "TTL indexes",
        "change streams",
        "transactions",
        "collMod validators",
        "updateOne with sort",
    ] {
        assert!(stdout.contains(line), "missing `{line}` in:\n{stdout}");
    }
    // The embedded server's directory is named on stderr; it must be gone afterwards.
    let dir = stderr
        .split("log: ")
        .nth(1)
        .and_then(|s| s.split("/server.log").next())
        .ok_or_else(|| anyhow::anyhow!("no log path in: {stderr}"))?;
    assert!(!std::path::Path::new(dir).exists(), "{dir} was removed");
    let still = Command::new("pgrep").args(["-f", dir]).output()?;
    assert!(!still.status.success(), "no server remains for {dir}");
    Ok(())
}

#[test]
fn doctor_json_is_machine_readable() -> anyhow::Result<()> {
    let out = docwarden().args(["doctor", "--json"]).output()?;
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert!(v["clock_bound_ms"].as_i64().is_some());
    assert_eq!(v["capabilities"]["pipeline_updates"]["status"], "supported");
    Ok(())
}

#[test]
fn doctor_on_an_unreachable_uri_fails_in_under_10s_with_one_line() -> anyhow::Result<()> {
    let started = Instant::now();
    let out = docwarden()
        .args(["doctor", "--uri", "mongodb://admin:topsecret@127.0.0.1:1"])
        .output()?;
    let elapsed = started.elapsed();
    let stderr = String::from_utf8(out.stderr)?;
    assert!(!out.status.success());
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains("cannot reach mongodb://***@127.0.0.1:1"),
        "{stderr}"
    );
    assert!(!stderr.contains("topsecret"));
    Ok(())
}

#[test]
fn a_malformed_uri_is_refused_at_once() -> anyhow::Result<()> {
    let started = Instant::now();
    let out = docwarden()
        .args(["doctor", "--uri", "mongo:/nope"])
        .output()?;
    assert!(!out.status.success());
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(String::from_utf8(out.stderr)?.contains("cannot reach"));
    Ok(())
}

/// Bad flags found by a new user's pass (session 14): each is refused before anything
/// connects or runs, with exit 2 and a message naming the flag, never a panic. Before the
/// fix, a huge `--connect-timeout` or `--duration` panicked (overflow, exit 101), a bare
/// `--older-than 5` was read as seconds and purged, an invalid `--db` reached the server
/// and came back as a 1 KB driver dump, and an unwritable `--report` failed only after the
/// whole run, without naming the file.
#[test]
fn bad_flags_are_refused_before_anything_runs_with_the_flag_named() -> anyhow::Result<()> {
    let unreachable = ["--uri", "mongodb://127.0.0.1:1", "--connect-timeout", "1"];
    let report = std::env::temp_dir()
        .join(format!("docwarden-no-such-dir-{}", std::process::id()))
        .join("report.html");
    let report = report.to_string_lossy().into_owned();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "doctor",
                "--uri",
                "mongodb://127.0.0.1:1",
                "--connect-timeout",
                "18446744073709551615",
            ],
            "--connect-timeout",
        ),
        (
            vec![
                "doctor",
                "--uri",
                "mongodb://127.0.0.1:1",
                "--connect-timeout",
                "0",
            ],
            "--connect-timeout",
        ),
        (
            [
                &["verify", "locks", "--duration", "18446744073709551615"][..],
                &unreachable[..],
            ]
            .concat(),
            "--duration",
        ),
        (
            [
                &["queue", "purge", "--older-than", "5"][..],
                &unreachable[..],
            ]
            .concat(),
            "`5` has no unit",
        ),
        (
            [&["queue", "stats", "--db", "a.b"][..], &unreachable[..]].concat(),
            "--db",
        ),
        (
            [&["locks", "list", "--db", "a b"][..], &unreachable[..]].concat(),
            "--db",
        ),
        (
            [
                &[
                    "verify",
                    "locks",
                    "--duration",
                    "1",
                    "--report",
                    report.as_str(),
                ][..],
                &unreachable[..],
            ]
            .concat(),
            "cannot write the report to",
        ),
        (
            [
                &["verify", "locks", "--workers", "100000"][..],
                &unreachable[..],
            ]
            .concat(),
            "--workers 100000 is more than 1024",
        ),
    ];
    for (args, expected) in cases {
        let started = Instant::now();
        let (code, stderr) = code_and_stderr(docwarden().args(&args))?;
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("cannot reach"),
            "{args:?} connected first: {stderr}"
        );
        assert!(started.elapsed() < Duration::from_secs(5), "{args:?}");
    }
    Ok(())
}

/// File-system errors name the path (session 14): a `--data-dir` that is a regular file,
/// and a `ui --listen` address already taken. Before the fix they printed "File exists (os
/// error 17)" and "Address already in use (os error 98)" without saying which path or
/// address.
#[test]
fn file_system_errors_name_the_path_or_address() -> anyhow::Result<()> {
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = taken.local_addr()?.to_string();
    let (code, stderr) = code_and_stderr(
        docwarden()
            .args(["ui", "--listen", addr.as_str()])
            .env_remove("MONGODB_URI"),
    )?;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot listen on {addr}")),
        "{stderr}"
    );

    if std::env::var_os("MONGODB_URI").is_some() {
        docwarden_testkit::skip(
            "file_system_errors_name_the_path_or_address (its --data-dir half)",
            "tests the embedded server's launcher and MONGODB_URI is set",
        );
        return Ok(());
    }
    let file = std::env::temp_dir().join(format!("docwarden-data-dir-file-{}", std::process::id()));
    std::fs::write(&file, "not a directory")?;
    let (code, stderr) = code_and_stderr(
        docwarden()
            .args(["queue", "stats", "--data-dir"])
            .arg(&file)
            .env_remove("MONGODB_URI"),
    )?;
    let _ = std::fs::remove_file(&file);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "cannot use {} as the embedded server's data directory",
            file.display()
        )),
        "{stderr}"
    );
    Ok(())
}

/// `verify --list-faults --json` (and `--faults list --json`) prints JSON a machine can read
/// (session 14; it printed the text table), and a missing module names every module.
#[test]
fn verify_lists_its_faults_as_json_and_names_every_module() -> anyhow::Result<()> {
    for args in [
        &["verify", "--list-faults", "--json"][..],
        &["verify", "--faults", "list", "--json"][..],
    ] {
        let out = docwarden().args(args).output()?;
        assert!(out.status.success(), "{args:?}");
        let faults: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let faults = faults.as_array().cloned().unwrap_or_default();
        assert!(faults.len() >= 10, "{args:?}: {faults:?}");
        assert!(
            faults
                .iter()
                .any(|f| f["fault"] == "pause" && f["server"] == "any")
        );
        assert!(
            faults
                .iter()
                .any(|f| f["fault"] == "crash" && f["server"] == "embedded")
        );
    }
    let (code, stderr) =
        code_and_stderr(docwarden().args(["verify", "--uri", "mongodb://127.0.0.1:1"]))?;
    assert_eq!(code, Some(2), "{stderr}");
    for module in ["locks", "semaphore", "election", "rwlock", "all"] {
        assert!(stderr.contains(module), "{module}: {stderr}");
    }
    Ok(())
}

/// Log lines written to a pipe carry no colour codes (session 14: a log redirected to a
/// file was full of `ESC[2m`).
#[test]
fn logs_to_a_pipe_have_no_escape_codes() -> anyhow::Result<()> {
    if std::env::var_os("MONGODB_URI").is_some() {
        docwarden_testkit::skip(
            "logs_to_a_pipe_have_no_escape_codes",
            "logs the embedded server's start and MONGODB_URI is set",
        );
        return Ok(());
    }
    let (code, stderr) = code_and_stderr(
        docwarden()
            .arg("doctor")
            .env_remove("MONGODB_URI")
            .env_remove("NO_COLOR")
            .env("RUST_LOG", "docwarden_server=info"),
    )?;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("embedded secantusd-rs is up"), "{stderr}");
    assert!(!stderr.contains('\u{1b}'), "{stderr:?}");
    Ok(())
}

/// `--data-dir` next to `--uri` is said to be ignored (session 14: it was silently).
#[test]
fn a_data_dir_next_to_a_uri_is_said_to_be_ignored() -> anyhow::Result<()> {
    let (_, stderr) = code_and_stderr(
        docwarden()
            .args(["queue", "stats", "--uri", "mongodb://127.0.0.1:1"])
            .args(["--connect-timeout", "1"])
            .args(["--data-dir", "/tmp/docwarden-unused-data-dir"]),
    )?;
    assert!(
        stderr.contains("--data-dir /tmp/docwarden-unused-data-dir is ignored"),
        "{stderr}"
    );
    assert!(!std::path::Path::new("/tmp/docwarden-unused-data-dir").exists());
    Ok(())
}

#[test]
fn demo_runs_every_seed_scenario_with_zero_violations() -> anyhow::Result<()> {
    let out = docwarden().arg("demo").output()?;
    let stdout = String::from_utf8(out.stdout)?;
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = stdout
        .split("scenario ")
        .last()
        .ok_or_else(|| anyhow::anyhow!("no summary in {stdout}"))?;
    for scenario in [
        "on-call",
        "document-lock",
        "lock-collection",
        "enrollment",
        "enrich",
    ] {
        let row = summary
            .lines()
            .find(|l| l.starts_with(scenario))
            .ok_or_else(|| anyhow::anyhow!("no {scenario} row in {summary}"))?;
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cols.get(2), Some(&"0"), "violations of {scenario}: {row}");
    }
    Ok(())
}

/// The JSON array a successful `--json` run printed (the run's stderr if it failed).
fn json_rows(out: &std::process::Output) -> anyhow::Result<Vec<serde_json::Value>> {
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

#[test]
fn bench_json_rows_carry_every_number_and_match_the_markdown() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let md = dir.path().join("bench.md");
    let md_arg = md.to_str().ok_or_else(|| anyhow::anyhow!("path"))?;
    let out = docwarden()
        .args(["bench", "--duration", "1", "--json", "--markdown", md_arg])
        .output()?;
    let rows = json_rows(&out)?;
    let table = std::fs::read_to_string(&md)?;
    assert!(
        rows.len() >= 10,
        "reference, guard, locks, queue, sequence, wake-up rows"
    );
    assert_eq!(rows[0]["ratio"], 1.0, "the reference comes first");
    let reference_rt = rows[0]["round_trips_per_op"].as_f64().unwrap_or_default();
    assert!(
        (reference_rt - 1.0).abs() < 0.01,
        "update_one is one round trip: {}",
        rows[0]
    );
    assert!(
        table.lines().next().unwrap_or_default().contains("rt/op"),
        "{table}"
    );
    for row in &rows {
        for field in [
            "ops_per_sec",
            "p50_us",
            "p99_us",
            "ratio",
            "reference_ops_per_sec",
        ] {
            assert!(row[field].is_number(), "{field} missing in {row}");
        }
        // Each ratio divides by the reference measured around its own row.
        let (ops, reference, ratio) = (
            row["ops_per_sec"].as_f64().unwrap_or_default(),
            row["reference_ops_per_sec"].as_f64().unwrap_or_default(),
            row["ratio"].as_f64().unwrap_or_default(),
        );
        assert!(reference > 0.0, "{row}");
        assert!((ratio - ops / reference).abs() < 1e-9, "{row}");
        if row["ops"].as_u64().unwrap_or_default() > 0 {
            let rt = row["round_trips_per_op"].as_f64().unwrap_or_default();
            assert!(rt > 0.0, "round trips per op missing in {row}");
        }
        let name = row["name"].as_str().unwrap_or_default();
        let line = table
            .lines()
            .find(|l| l.starts_with(&format!("| {name} |")))
            .ok_or_else(|| anyhow::anyhow!("{name} not in the markdown table"))?;
        assert!(
            line.contains(&format!("| {} |", row["ops"])),
            "{line} vs {row}"
        );
    }
    Ok(())
}

/// With `--rounds` the bench runs the sweep that many times and each row is the median of
/// its rounds, with every round's ratio and their range; `--rounds 0` is refused.
#[test]
fn bench_with_rounds_reports_each_rows_median_and_range() -> anyhow::Result<()> {
    let out = docwarden()
        .args([
            "bench",
            "--only",
            "guard",
            "--workers",
            "1",
            "--duration",
            "1",
        ])
        .args(["--rounds", "2", "--json"])
        .output()?;
    let rows = json_rows(&out)?;
    assert_eq!(
        rows.len(),
        3,
        "reference, guard and batched guard: {rows:?}"
    );
    for row in &rows {
        assert_eq!(row["rounds"], 2, "{row}");
        let ratios: Vec<f64> = row["ratios"]
            .as_array()
            .ok_or_else(|| anyhow::anyhow!("no ratios in {row}"))?
            .iter()
            .filter_map(serde_json::Value::as_f64)
            .collect();
        assert_eq!(ratios.len(), 2, "{row}");
        let number = |field: &str| {
            row[field]
                .as_f64()
                .ok_or_else(|| anyhow::anyhow!("{field} missing in {row}"))
        };
        let (ratio, min, max) = (number("ratio")?, number("ratio_min")?, number("ratio_max")?);
        assert!(min <= ratio && ratio <= max, "{row}");
        // The median of two rounds is their mean.
        assert!(
            (ratio - (ratios[0] + ratios[1]) / 2.0).abs() < 1e-9,
            "{row}"
        );
    }

    let (code, stderr) = code_and_stderr(docwarden().args(["bench", "--rounds", "0"]))?;
    assert_ne!(code, Some(0), "{stderr}");
    assert!(stderr.contains("--rounds"), "{stderr}");
    for partitions in ["0", "1025"] {
        let (code, stderr) =
            code_and_stderr(docwarden().args(["bench", "--partitions", partitions]))?;
        assert_ne!(code, Some(0), "{stderr}");
        assert!(
            stderr.contains("--partitions must be between 1 and 1024"),
            "{stderr}"
        );
    }
    Ok(())
}

/// With `--stages` the bench ends with issue 14's targets, each beside its floor (the same
/// writes sent raw) and its CPU bound, read off the same run.
#[test]
fn bench_with_stages_prints_each_target_beside_its_floor() -> anyhow::Result<()> {
    let out = docwarden()
        .args(["bench", "--only", "locks", "--stages", "--workers", "1"])
        .args(["--duration", "1"])
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    assert!(text.contains("| target row |"), "{text}");
    for target in ["lock acquire+release", "document lock+release_with"] {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("| {target} | 1 |")) && l.contains("≥ 0.4×"))
            .ok_or_else(|| anyhow::anyhow!("no target line for {target} in {text}"))?;
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // | row | workers | ratio | target | met | floor | share | floor reaches | CPU bound |
        assert!(
            cells[6].ends_with('×'),
            "{target}: a floor is measured: {line}"
        );
        assert!(cells[7].ends_with('%'), "{target}: {line}");
        // The embedded server's CPU is read, so the CPU bound is known.
        assert!(cells[9].ends_with('×'), "{target}: a CPU bound: {line}");
    }
    Ok(())
}

/// The two ways the bench counts round trips agree on what they count: on the embedded
/// server (the test above) the server's own command counters, on a server given with
/// `--uri` (here the suite's shared server, which other tests use at the same time) the
/// driver's command monitoring, which sees only the bench's own commands.
#[tokio::test]
async fn bench_on_a_given_uri_counts_round_trips_by_driver_monitoring() -> anyhow::Result<()> {
    let uri = docwarden_testkit::shared_uri().await?;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_docwarden"))
        .args(["bench", "--only", "guard", "--duration", "1", "--json"])
        .args(["--uri", uri.as_str()])
        .output()
        .await?;
    let rows = json_rows(&out)?;
    assert_eq!(
        rows.len(),
        3,
        "reference, guard and batched guard rows: {rows:?}"
    );
    let rt = |i: usize| rows[i]["round_trips_per_op"].as_f64().unwrap_or_default();
    assert!(
        (rt(0) - 1.0).abs() < 0.01,
        "update_one is one round trip: {}",
        rows[0]
    );
    // A guarded toggle is one update, plus one read when it was refused or unchanged.
    assert!((1.0..1.5).contains(&rt(1)), "guard: {}", rows[1]);
    // A batch of 64 is one `bulkWrite` (or, before MongoDB 8.0, one update each), plus the
    // explaining reads.
    let batched = rt(2);
    assert!(
        (0.0..0.5).contains(&batched) || (1.0..1.5).contains(&batched),
        "batched guard: {}",
        rows[2]
    );
    Ok(())
}
