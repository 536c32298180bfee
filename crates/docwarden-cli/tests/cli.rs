//! The `docwarden` binary end to end: doctor against the embedded server, and the
//! one-line, bounded failure on an unreachable URI.

use std::process::Command;
use std::time::{Duration, Instant};

fn docwarden() -> Command {
    Command::new(env!("CARGO_BIN_EXE_docwarden"))
}

#[test]
fn doctor_starts_the_embedded_server_prints_every_capability_and_stops_it() -> anyhow::Result<()> {
    if std::env::var_os("MONGODB_URI").is_some() {
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
