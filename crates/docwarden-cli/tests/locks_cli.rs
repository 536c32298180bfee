//! `docwarden locks list` and `docwarden locks release` against the shared test server.

use std::process::Command;
use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{LockCollection, LockOptions, Owner};
use docwarden_testkit::TestDb;

fn docwarden() -> Command {
    Command::new(env!("CARGO_BIN_EXE_docwarden"))
}

#[tokio::test]
async fn list_and_release_by_owner() -> anyhow::Result<()> {
    let t = TestDb::new("cli_locks").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let locks = LockCollection::open(&t.db, "locks", time, LockOptions::default()).await?;
    let (a, b) = (Owner::random(), Owner::random());
    for r in ["r1", "r2"] {
        locks.try_acquire(&a, r, Duration::from_secs(60)).await?;
    }
    locks.try_acquire(&b, "r3", Duration::from_secs(60)).await?;
    let db = t.db.name().to_owned();
    let common = ["--uri", t.uri(), "--db", &db, "--collection", "locks"];

    let out = docwarden()
        .args(["locks", "list", "--json"])
        .args(common)
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let all: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(all.as_array().map(Vec::len), Some(3));

    let out = docwarden()
        .args(["locks", "list", "--json", "--owner", a.id()])
        .args(common)
        .output()?;
    let mine: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(mine.as_array().map(Vec::len), Some(2));
    assert_eq!(mine[0]["owner"], a.id());
    assert!(mine[0]["token"].as_i64().is_some());

    let out = docwarden()
        .args(["locks", "release", "--owner", a.id()])
        .args(common)
        .output()?;
    let stdout = String::from_utf8(out.stdout)?;
    assert!(out.status.success());
    assert!(stdout.contains("released 2 lease(s)"), "{stdout}");
    let left = locks
        .list(&docwarden::lock::LockListFilter::default())
        .await?;
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].owner, b.id());
    Ok(())
}

#[test]
fn an_empty_owner_is_refused_before_connecting() -> anyhow::Result<()> {
    let out = docwarden()
        .args([
            "locks",
            "release",
            "--owner",
            "",
            "--uri",
            "mongodb://127.0.0.1:1",
        ])
        .output()?;
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr)?;
    assert!(stderr.contains("owner"), "{stderr}");
    Ok(())
}
