//! The embedded server's lifecycle: start, restart on the same data, stop without orphans.

use std::process::Command;
use std::time::Duration;

use docwarden_testkit::{EmbeddedServer, ServerOptions, TestDb, connect, skip, uri_from_env};
use mongodb::bson::{Document, doc};

/// Whether any process still has `needle` on its command line.
fn process_with(needle: &str) -> bool {
    Command::new("pgrep")
        .args(["-f", needle])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

#[tokio::test]
async fn restart_keeps_data_and_stop_leaves_no_process_or_directory() -> anyhow::Result<()> {
    if uri_from_env().is_some() {
        skip(
            "restart_keeps_data",
            "exercises the embedded server only; MONGODB_URI is set",
        );
        return Ok(());
    }
    let mut server = EmbeddedServer::start(ServerOptions::default()).await?;
    let dir = server.dir().to_path_buf();
    let needle = dir.display().to_string();
    assert!(
        process_with(&needle),
        "the server runs with its storage in {needle}"
    );

    let client = connect(&server.uri(), Duration::from_secs(10)).await?;
    let coll = client.database("lifecycle").collection::<Document>("c");
    coll.insert_one(doc! { "_id": 1, "kept": true })
        .write_concern(
            mongodb::options::WriteConcern::builder()
                .journal(true)
                .build(),
        )
        .await?;

    server.restart().await?;
    let client = connect(&server.uri(), Duration::from_secs(10)).await?;
    let coll = client.database("lifecycle").collection::<Document>("c");
    assert!(
        coll.find_one(doc! { "_id": 1 }).await?.is_some(),
        "data survives a restart"
    );

    // A crash (SIGKILL) and recovery: the server comes back on the same port. Durability
    // of the last writes before a SIGKILL is a known surrogate difference (docs/surrogate.md),
    // so only liveness is asserted here.
    server.crash_and_restart().await?;
    let client = connect(&server.uri(), Duration::from_secs(10)).await?;
    client
        .database("admin")
        .run_command(doc! { "ping": 1 })
        .await?;

    server.stop();
    assert!(!process_with(&needle), "no secantusd-rs remains after stop");
    assert!(!dir.exists(), "the temporary directory is removed");
    Ok(())
}

#[tokio::test]
async fn a_kept_data_dir_survives_and_holds_the_log() -> anyhow::Result<()> {
    if uri_from_env().is_some() {
        skip(
            "a_kept_data_dir_survives",
            "exercises the embedded server only; MONGODB_URI is set",
        );
        return Ok(());
    }
    let keep = tempfile::tempdir()?;
    let server = EmbeddedServer::start(ServerOptions::default().data_dir(keep.path())).await?;
    let log = server.log_path().to_path_buf();
    server.stop();
    assert!(log.exists(), "the log is kept in the data dir");
    assert!(std::fs::read_to_string(&log)?.contains("listening on"));
    Ok(())
}

#[tokio::test]
async fn a_killed_owner_leaves_no_orphan() -> anyhow::Result<()> {
    if uri_from_env().is_some() {
        skip(
            "a_killed_owner_leaves_no_orphan",
            "exercises the embedded server only; MONGODB_URI is set",
        );
        return Ok(());
    }
    // A child process starts a server and is SIGKILLed: the server must go with it.
    let exe = env!("CARGO_BIN_EXE_docwarden-testkit-hold");
    let mut child = Command::new(exe)
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(
            child
                .stdout
                .take()
                .ok_or_else(|| anyhow::anyhow!("stdout"))?,
        ),
        &mut line,
    )?;
    let dir = line.trim().to_owned();
    assert!(process_with(&dir), "server of the child runs in {dir}");
    child.kill()?;
    child.wait()?;
    let mut gone = false;
    for _ in 0..100 {
        if !process_with(&dir) {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "the server of a SIGKILLed owner was stopped");
    Ok(())
}

#[tokio::test]
async fn each_test_database_is_dropped() -> anyhow::Result<()> {
    let t = TestDb::new("testkit_drop").await?;
    let name = t.db.name().to_owned();
    let client = t.new_client().await?;
    t.db.collection::<Document>("c")
        .insert_one(doc! { "x": 1 })
        .await?;
    drop(t);
    let names = client.list_database_names().await?;
    assert!(!names.contains(&name), "{name} was dropped");
    Ok(())
}

#[tokio::test]
async fn unreachable_uri_fails_fast_with_a_masked_message() -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let err = connect(
        "mongodb://user:hunter2@127.0.0.1:1/?directConnection=true",
        Duration::from_secs(2),
    )
    .await
    .err()
    .ok_or_else(|| anyhow::anyhow!("connected to port 1?"))?;
    let text = err.to_string();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(!text.contains("hunter2"), "{text}");
    assert!(text.contains("***@127.0.0.1:1"), "{text}");
    Ok(())
}
