//! Session 19, item 2: `RwLocks::open` and `Election::open` open their lock collection with
//! the caller's `LockOptions` (`RwLockOptions::locks`, `ElectionOptions::locks`). Before,
//! both used `LockOptions::default()`, so backoff, `gc_after`, write concern and the wake-up
//! could not be set through them. Checked through what `open` creates on the server: the
//! TTL index on `gc_at` carries the `gc_after` given (default 3,600 s).

use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{Election, ElectionOptions, LockOptions, Owner, RwLockOptions, RwLocks};
use docwarden_testkit::TestDb;
use futures::TryStreamExt;
use mongodb::bson::Document;

/// The `expireAfterSeconds` of the TTL index of collection `name`.
async fn gc_after(t: &TestDb, name: &str) -> anyhow::Result<Option<Duration>> {
    let indexes: Vec<mongodb::IndexModel> =
        t.db.collection::<Document>(name)
            .list_indexes()
            .await?
            .try_collect()
            .await?;
    Ok(indexes
        .iter()
        .find_map(|i| i.options.as_ref().and_then(|o| o.expire_after)))
}

#[tokio::test]
async fn open_uses_the_lock_options_given() -> anyhow::Result<()> {
    let t = TestDb::new("s19_open_options").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let two_minutes = Duration::from_secs(120);
    let locks = LockOptions::default().gc_after(two_minutes);

    let rw = RwLocks::open(
        &t.db,
        "rw",
        time.clone(),
        RwLockOptions::default().locks(locks.clone()),
    )
    .await?;
    let election = Election::open(
        &t.db,
        "elections",
        "leader",
        time.clone(),
        ElectionOptions::default().locks(locks),
    )
    .await?;
    // The defaults, for comparison.
    RwLocks::open(&t.db, "rw_default", time.clone(), RwLockOptions::default()).await?;
    Election::open(
        &t.db,
        "elections_default",
        "leader",
        time,
        ElectionOptions::default(),
    )
    .await?;

    let seen = [
        gc_after(&t, "rw").await?,
        gc_after(&t, "elections").await?,
        gc_after(&t, "rw_default").await?,
        gc_after(&t, "elections_default").await?,
    ];
    println!("gc_after of rw, election, rw default, election default: {seen:?}");
    assert_eq!(seen[0], Some(two_minutes), "RwLocks::open");
    assert_eq!(seen[1], Some(two_minutes), "Election::open");
    assert_eq!(seen[2], Some(Duration::from_secs(3600)));
    assert_eq!(seen[3], Some(Duration::from_secs(3600)));

    // The handles work as before.
    let me = Owner::random();
    let lease = rw
        .try_write(&me, "r", Duration::from_secs(5))
        .await?
        .expect("free");
    rw.release_write(&lease).await?;
    let leader = election.try_campaign(&me).await?.expect("elected");
    leader.resign().await?;
    Ok(())
}
