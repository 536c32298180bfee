//! `docwarden locks list` on hand-edited lock documents (issue 11, finding 8): it lists them
//! with the reason instead of failing, and marks a lock whose expiry is not a date expired.

use std::process::Command;
use std::time::Duration;

use anyhow::Context;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{LockCollection, LockOptions, Owner};
use docwarden_testkit::TestDb;
use mongodb::bson::{Document, doc};

fn docwarden() -> Command {
    Command::new(env!("CARGO_BIN_EXE_docwarden"))
}

#[tokio::test]
async fn list_reports_malformed_lock_documents() -> anyhow::Result<()> {
    let t = TestDb::new("cli_locks_malformed").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let locks = LockCollection::open(&t.db, "locks", time, LockOptions::default()).await?;
    let owner = Owner::random();
    for r in ["bad", "good"] {
        locks
            .try_acquire(&owner, r, Duration::from_secs(60))
            .await?
            .context("acquire")?;
    }
    t.db.collection::<Document>("locks")
        .update_one(
            doc! { "_id": "bad" },
            doc! { "$set": { "expires_at": "2099-01-01" } },
        )
        .await?;
    let db = t.db.name().to_owned();
    let common = ["--uri", t.uri(), "--db", &db, "--collection", "locks"];

    let out = docwarden()
        .args(["locks", "list", "--json"])
        .args(common)
        .output()?;
    assert!(
        out.status.success(),
        "list failed on a hand-edited lock: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let all: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let rows = all.as_array().context("an array")?;
    assert_eq!(rows.len(), 2, "{all}");
    let bad = rows
        .iter()
        .find(|r| r["resource"] == "bad")
        .context("bad listed")?;
    assert_eq!(bad["malformed"], "expires_at is a string", "{bad}");
    assert_eq!(bad["expires_at"], serde_json::Value::Null, "{bad}");
    assert_eq!(bad["expired"], true, "{bad}");
    let good = rows
        .iter()
        .find(|r| r["resource"] == "good")
        .context("good listed")?;
    assert_eq!(good["malformed"], serde_json::Value::Null, "{good}");
    assert_eq!(good["expired"], false, "{good}");

    let out = docwarden().args(["locks", "list"]).args(common).output()?;
    let stdout = String::from_utf8(out.stdout)?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("expired (malformed: expires_at is a string)"),
        "{stdout}"
    );
    Ok(())
}

#[tokio::test]
async fn documents_lists_document_locks_with_malformed_ones() -> anyhow::Result<()> {
    let t = TestDb::new("cli_doclocks_malformed").await?;
    let coll = t.db.collection::<Document>("dummies");
    coll.insert_many([
        doc! { "_id": "held", "lock_id": "a", "lock_time": mongodb::bson::DateTime::now() },
        doc! { "_id": "stuck", "lock_id": "b" },
        doc! { "_id": "free", "lock_id": null, "lock_time": null },
    ])
    .await?;
    let db = t.db.name().to_owned();
    let common = ["--uri", t.uri(), "--db", &db, "--collection", "dummies"];
    let out = docwarden()
        .args(["locks", "documents", "--json"])
        .args(common)
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let all: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let rows = all.as_array().context("an array")?;
    assert_eq!(rows.len(), 2, "{all}");
    assert_eq!(rows[0]["id"], "held");
    assert_eq!(rows[0]["expired"], false);
    assert_eq!(rows[0]["malformed"], serde_json::Value::Null);
    assert_eq!(rows[1]["id"], "stuck");
    assert_eq!(rows[1]["expired"], true);
    assert_eq!(rows[1]["malformed"], "lock_time is missing");
    let out = docwarden()
        .args(["locks", "documents"])
        .args(common)
        .output()?;
    let stdout = String::from_utf8(out.stdout)?;
    assert!(
        stdout.contains("expired (malformed: lock_time is missing)"),
        "{stdout}"
    );
    // The entity collection is only read: no index was created on it.
    let indexes = coll.list_index_names().await?;
    assert_eq!(indexes, vec!["_id_".to_owned()]);
    let zero = docwarden()
        .args(["locks", "documents", "--max-duration-secs", "0"])
        .args(common)
        .output()?;
    assert_eq!(zero.status.code(), Some(2));
    Ok(())
}
