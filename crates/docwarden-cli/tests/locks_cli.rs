//! `docwarden locks list`, `locks release` and `locks documents` against the shared test
//! server, including hand-edited lock documents (issue 11, finding 8): they are listed with
//! the reason instead of failing, and a lock whose expiry is not a date counts as expired.

use std::process::{Command, Output};
use std::time::Duration;

use anyhow::Context;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{
    Election, ElectionOptions, LockCollection, LockOptions, Owner, RwLockOptions, RwLocks,
    Semaphore, SemaphoreOptions,
};
use docwarden_testkit::TestDb;
use mongodb::bson::{Document, doc};

fn docwarden() -> Command {
    Command::new(env!("CARGO_BIN_EXE_docwarden"))
}

/// `docwarden <args> --uri … --db <the test's db> --collection <collection>`.
fn run(t: &TestDb, collection: &str, args: &[&str]) -> anyhow::Result<Output> {
    Ok(docwarden()
        .args(args)
        .args([
            "--uri",
            t.uri(),
            "--db",
            t.db.name(),
            "--collection",
            collection,
        ])
        .output()?)
}

/// [`run`] that must succeed and print JSON.
fn json(t: &TestDb, collection: &str, args: &[&str]) -> anyhow::Result<serde_json::Value> {
    let out = run(t, collection, args)?;
    anyhow::ensure!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// [`run`] that must succeed; its standard output.
fn text(t: &TestDb, collection: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = run(t, collection, args)?;
    anyhow::ensure!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

async fn open_locks(t: &TestDb) -> anyhow::Result<LockCollection> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    Ok(LockCollection::open(&t.db, "locks", time, LockOptions::default()).await?)
}

#[tokio::test]
async fn list_and_release_by_owner() -> anyhow::Result<()> {
    let t = TestDb::new("cli_locks").await?;
    let locks = open_locks(&t).await?;
    let (a, b) = (Owner::random(), Owner::random());
    for r in ["r1", "r2"] {
        locks.try_acquire(&a, r, Duration::from_secs(60)).await?;
    }
    locks.try_acquire(&b, "r3", Duration::from_secs(60)).await?;

    let all = json(&t, "locks", &["locks", "list", "--json"])?;
    assert_eq!(all["leases"].as_array().map(Vec::len), Some(3));

    let mine = json(&t, "locks", &["locks", "list", "--json", "--owner", a.id()])?;
    let mine = &mine["leases"];
    assert_eq!(mine.as_array().map(Vec::len), Some(2));
    assert_eq!(mine[0]["owner"], a.id());
    assert!(mine[0]["token"].as_i64().is_some());

    let stdout = text(&t, "locks", &["locks", "release", "--owner", a.id()])?;
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

#[tokio::test]
async fn list_reports_malformed_lock_documents() -> anyhow::Result<()> {
    let t = TestDb::new("cli_locks_malformed").await?;
    let locks = open_locks(&t).await?;
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

    let all = json(&t, "locks", &["locks", "list", "--json"])
        .context("list failed on a hand-edited lock")?;
    let rows = all["leases"].as_array().context("an array")?;
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

    let stdout = text(&t, "locks", &["locks", "list"])?;
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
    let all = json(&t, "dummies", &["locks", "documents", "--json"])?;
    let rows = all.as_array().context("an array")?;
    assert_eq!(rows.len(), 2, "{all}");
    assert_eq!(rows[0]["id"], "held");
    assert_eq!(rows[0]["expired"], false);
    assert_eq!(rows[0]["malformed"], serde_json::Value::Null);
    assert_eq!(rows[1]["id"], "stuck");
    assert_eq!(rows[1]["expired"], true);
    assert_eq!(rows[1]["malformed"], "lock_time is missing");
    let first = json(
        &t,
        "dummies",
        &["locks", "documents", "--json", "--limit", "1"],
    )?;
    assert_eq!(first.as_array().map(Vec::len), Some(1), "{first}");
    assert_eq!(first[0]["id"], "held");
    let stdout = text(&t, "dummies", &["locks", "documents"])?;
    assert!(
        stdout.contains("expired (malformed: lock_time is missing)"),
        "{stdout}"
    );
    // The entity collection is only read: no index was created on it.
    let indexes = coll.list_index_names().await?;
    assert_eq!(indexes, vec!["_id_".to_owned()]);
    let zero = run(
        &t,
        "dummies",
        &["locks", "documents", "--max-duration-secs", "0"],
    )?;
    assert_eq!(zero.status.code(), Some(2));
    Ok(())
}

#[tokio::test]
async fn list_and_release_cover_leaders_rwlocks_and_semaphores() -> anyhow::Result<()> {
    let t = TestDb::new("cli_locks_coordination").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let e = Election::open(
        &t.db,
        "elections",
        "scheduler",
        time.clone(),
        ElectionOptions::default().term_ttl(Duration::from_secs(6)),
    )
    .await?;
    let rw = RwLocks::open(&t.db, "rwlocks", time.clone(), RwLockOptions::default()).await?;
    let sem = Semaphore::open(
        &t.db,
        "semaphores",
        time,
        SemaphoreOptions::default().default_permits(3),
    )
    .await?;
    let (a, b) = (Owner::random(), Owner::random());
    let leader = e.try_campaign(&a).await?.context("elected")?;
    let ttl = Duration::from_secs(60);
    rw.try_write(&a, "config", ttl).await?.context("write")?;
    rw.try_read(&a, "report", ttl).await?.context("read")?;
    rw.try_read(&b, "report", ttl).await?.context("read")?;
    sem.try_acquire(&a, "geo-api", ttl)
        .await?
        .context("permit")?;
    sem.try_acquire(&b, "geo-api", ttl)
        .await?
        .context("permit")?;

    let all = json(&t, "locks", &["locks", "list", "--json"])?;
    let leaders = all["elections"].as_array().context("elections")?;
    assert_eq!(leaders.len(), 1, "{all}");
    assert_eq!(leaders[0]["election"], "scheduler");
    assert_eq!(leaders[0]["owner"], a.id());
    assert_eq!(leaders[0]["term"].as_i64(), Some(leader.term().get()));
    assert_eq!(leaders[0]["expired"], false);
    let rwlocks = all["rwlocks"].as_array().context("rwlocks")?;
    assert_eq!(rwlocks.len(), 2, "{all}");
    assert_eq!(rwlocks[0]["resource"], "config");
    assert_eq!(rwlocks[0]["writer"]["owner"], a.id());
    assert_eq!(rwlocks[1]["readers"].as_array().map(Vec::len), Some(2));
    let semaphores = all["semaphores"].as_array().context("semaphores")?;
    assert_eq!(semaphores.len(), 1, "{all}");
    assert_eq!(semaphores[0]["resource"], "geo-api");
    assert_eq!(semaphores[0]["permits"].as_i64(), Some(3), "{all}");
    assert_eq!(semaphores[0]["holders"].as_array().map(Vec::len), Some(2));
    let stdout = text(&t, "locks", &["locks", "list"])?;
    assert!(stdout.contains("semaphores in"), "{stdout}");
    assert!(stdout.contains("2/3"), "{stdout}");
    assert!(stdout.contains("election leaders in"), "{stdout}");
    assert!(stdout.contains("scheduler"), "{stdout}");
    assert!(stdout.contains("reader"), "{stdout}");
    // The owner and resource filters apply to every kind (the server filters since
    // session 38: a reader's owner is found inside the readers, a writer's at the top).
    let of_b = json(&t, "locks", &["locks", "list", "--json", "--owner", b.id()])?;
    assert_eq!(
        of_b["elections"].as_array().map(Vec::len),
        Some(0),
        "{of_b}"
    );
    let rw_b = of_b["rwlocks"].as_array().context("rwlocks")?;
    assert_eq!(rw_b.len(), 1, "{of_b}");
    assert_eq!(rw_b[0]["resource"], "report");
    let sem_b = of_b["semaphores"].as_array().context("semaphores")?;
    assert_eq!(sem_b.len(), 1, "{of_b}");
    assert_eq!(sem_b[0]["resource"], "geo-api");
    let config = json(
        &t,
        "locks",
        &["locks", "list", "--json", "--resource", "config"],
    )?;
    let rw_config = config["rwlocks"].as_array().context("rwlocks")?;
    assert_eq!(rw_config.len(), 1, "{config}");
    assert_eq!(rw_config[0]["writer"]["owner"], a.id());
    assert_eq!(
        config["semaphores"].as_array().map(Vec::len),
        Some(0),
        "{config}"
    );
    assert_eq!(
        config["elections"].as_array().map(Vec::len),
        Some(0),
        "{config}"
    );
    let scheduler = json(
        &t,
        "locks",
        &["locks", "list", "--json", "--resource", "scheduler"],
    )?;
    assert_eq!(
        scheduler["elections"].as_array().map(Vec::len),
        Some(1),
        "{scheduler}"
    );
    // `--limit` applies to each kind: the first by resource.
    let one = json(&t, "locks", &["locks", "list", "--json", "--limit", "1"])?;
    let rw_one = one["rwlocks"].as_array().context("rwlocks")?;
    assert_eq!(rw_one.len(), 1, "{one}");
    assert_eq!(rw_one[0]["resource"], "config");
    assert_eq!(one["elections"].as_array().map(Vec::len), Some(1), "{one}");
    assert_eq!(one["semaphores"].as_array().map(Vec::len), Some(1), "{one}");
    let none = json(&t, "locks", &["locks", "list", "--json", "--limit", "0"])?;
    for kind in ["leases", "elections", "rwlocks", "semaphores"] {
        assert_eq!(
            none[kind].as_array().map(Vec::len),
            Some(0),
            "{kind}: {none}"
        );
    }

    let released = json(
        &t,
        "locks",
        &["locks", "release", "--owner", a.id(), "--json"],
    )?;
    assert_eq!(released["by_kind"]["elections"], 1, "{released}");
    assert_eq!(released["by_kind"]["rwlocks"], 2, "{released}");
    assert_eq!(released["by_kind"]["semaphores"], 1, "{released}");
    let permits = sem.status("geo-api").await?.context("semaphore")?;
    assert_eq!(permits.live(), 1, "{permits:?}");
    assert_eq!(permits.holders[0].owner, b.id());
    assert_eq!(e.leader().await?, None);
    let left = rw.list().await?;
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0].readers.len(), 1);
    assert_eq!(left[0].readers[0].owner, b.id());
    // The leader learns it was released by the operator.
    let lost = tokio::time::timeout(Duration::from_secs(60), leader.lost()).await?;
    assert_eq!(lost, docwarden::lock::LostReason::TakenOver);
    Ok(())
}
