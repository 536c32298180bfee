//! The semaphore against the real server: never more than N holders at any server instant
//! (racers with crashes and pauses, checked from recorded inner intervals with token
//! order), its control, tokens across deletion of the document, shrinking N at run time,
//! fencing with a permit, and the listing.

use std::time::Duration;

use anyhow::Context;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{Fence, FenceOptions, FenceOutcome, Owner, Semaphore, SemaphoreOptions};
use docwarden_testkit::TestDb;
use docwarden_workloads::semaphore::{self, Shape};
use docwarden_workloads::{Mode, RunConfig};
use mongodb::bson::{Document, doc};

const SEM: &str = "sem";

fn time(t: &TestDb) -> anyhow::Result<TimeSource> {
    Ok(TimeSource::server(
        t.client.clone(),
        ClockOptions::default(),
    )?)
}

async fn race(test: &str, mode: Mode) -> anyhow::Result<semaphore::SemaphoreCheck> {
    let t = TestDb::new(test).await?;
    let permits = 3;
    let sem = semaphore::open(&t.db, SEM, time(&t)?, permits, mode).await?;
    let (report, check) = semaphore::run(
        &sem,
        permits,
        RunConfig {
            workers: 10,
            ops_per_worker: 25,
            mode,
        },
        Shape::default(),
    )
    .await?;
    eprintln!(
        "{mode:?}: {} holdings, max {} holders of {permits}, {} overlaps, {} token regressions",
        report.operations, check.max_holders, check.overlaps, check.token_regressions
    );
    Ok(check)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn never_more_than_n_holders_with_crashes_and_pauses() -> anyhow::Result<()> {
    let c = race("sem_never_more_than_n", Mode::Safe).await?;
    assert_eq!(c.overlaps, 0, "more than N holders at one instant");
    assert_eq!(c.token_regressions, 0, "tokens out of real-time order");
    assert_eq!(c.max_holders, 3, "the racers fill every permit");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_without_the_expiry_check_admits_too_many() -> anyhow::Result<()> {
    let c = race("sem_control_ignore_expiry", Mode::Control).await?;
    assert!(c.overlaps > 0, "the control must bite: {c:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_increase_across_release_expiry_and_deletion() -> anyhow::Result<()> {
    let t = TestDb::new("sem_tokens_deletion").await?;
    // A block of 3 makes refills frequent.
    let sem = Semaphore::open(
        &t.db,
        SEM,
        time(&t)?,
        SemaphoreOptions::default()
            .default_permits(2)
            .token_block(3),
    )
    .await?;
    let docs = t.db.collection::<Document>(SEM);
    let mut last = 0;
    let mut regressions = 0;
    for round in 0..30 {
        let me = Owner::random();
        let p = sem
            .acquire(&me, "r", Duration::from_millis(200), Duration::from_secs(5))
            .await?
            .context("acquire")?;
        if p.token.get() <= last {
            regressions += 1;
        }
        last = p.token.get();
        match round % 3 {
            0 => sem.release(&p).await?,
            1 => {} // crash: expires by server time
            _ => {
                docs.delete_one(doc! { "_id": "r" }).await?;
            }
        }
    }
    assert_eq!(
        regressions, 0,
        "tokens must strictly increase (last {last})"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shrinking_waits_for_holders_to_leave() -> anyhow::Result<()> {
    let t = TestDb::new("sem_shrink").await?;
    let sem = Semaphore::open(
        &t.db,
        SEM,
        time(&t)?,
        SemaphoreOptions::default().default_permits(3),
    )
    .await?;
    let ttl = Duration::from_secs(30);
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            sem.try_acquire(&Owner::random(), "r", ttl)
                .await?
                .context("room")?,
        );
    }
    assert!(sem.try_acquire(&Owner::random(), "r", ttl).await?.is_none());
    sem.set_permits("r", 1).await?;
    let status = sem.status("r").await?.context("status")?;
    assert_eq!((status.permits, status.live()), (Some(1), 3));
    sem.release(&held[0]).await?;
    sem.release(&held[1]).await?;
    assert!(
        sem.try_acquire(&Owner::random(), "r", ttl).await?.is_none(),
        "one holder and N = 1: full"
    );
    sem.release(&held[2]).await?;
    let p = sem
        .try_acquire(&Owner::random(), "r", ttl)
        .await?
        .context("free after the last left")?;
    sem.set_permits("r", 2).await?;
    assert!(sem.try_acquire(&Owner::random(), "r", ttl).await?.is_some());
    let listed = sem.list(Some(&p.owner), true).await?;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].holders.len(), 2);
    assert!(sem.set_permits("r", 0).await.is_err());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_permit_fences_writes_and_a_lapsed_one_cannot_renew() -> anyhow::Result<()> {
    let t = TestDb::new("sem_fence").await?;
    let sem = Semaphore::open(&t.db, SEM, time(&t)?, SemaphoreOptions::default()).await?;
    let fence = Fence::open(&t.db, "target", FenceOptions::default()).await?;
    fence
        .collection()
        .insert_one(doc! { "_id": 1, "v": 0 })
        .await?;
    let mut old = sem
        .try_acquire(&Owner::random(), "r", Duration::from_millis(100))
        .await?
        .context("old")?;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let new = sem
        .try_acquire(&Owner::random(), "r", Duration::from_secs(10))
        .await?
        .context("new after expiry")?;
    assert!(new.token > old.token);
    let applied = fence
        .apply(&new, doc! { "_id": 1 }, doc! { "$set": { "v": 2 } })
        .await?;
    assert_eq!(applied, FenceOutcome::Applied);
    let stale = fence
        .apply(&old, doc! { "_id": 1 }, doc! { "$set": { "v": 1 } })
        .await?;
    assert!(matches!(stale, FenceOutcome::Stale { .. }), "{stale:?}");
    assert!(matches!(
        sem.renew(&mut old, Duration::from_secs(1)).await,
        Err(docwarden::Error::LeaseLost { .. })
    ));
    assert!(sem.release(&old).await.is_err(), "dropped as expired");
    let mut new = new;
    sem.renew(&mut new, Duration::from_secs(20)).await?;
    assert_eq!(
        sem.release_all(&Owner::from_existing(new.owner.clone())?)
            .await?,
        1
    );
    assert_eq!(sem.status("r").await?.context("doc")?.holders.len(), 0);
    Ok(())
}

/// Session 16: `permits` written by mongosh is a double (`{$set: {permits: 3}}` stores
/// 3.0). The acquire counts it as 3 (`$isNumber`), but `status` and `list` showed `None`
/// (the default), so an operator read a limit that was not the one enforced.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn permits_written_as_a_double_are_shown_as_enforced() -> anyhow::Result<()> {
    let t = TestDb::new("sem_permits_double").await?;
    let sem = Semaphore::open(&t.db, SEM, time(&t)?, SemaphoreOptions::default()).await?;
    let raw = t.db.collection::<Document>(SEM);
    raw.insert_one(doc! { "_id": "r", "permits": 3.0, "holders": [] })
        .await?;
    raw.insert_one(doc! { "_id": "q", "permits": 2_i32, "holders": [] })
        .await?;
    let ttl = Duration::from_secs(30);
    let mut held = 0;
    while sem.try_acquire(&Owner::random(), "r", ttl).await?.is_some() {
        held += 1;
        anyhow::ensure!(held <= 10, "no limit enforced");
    }
    assert_eq!(held, 3, "the acquire enforces 3.0 as 3");
    let status = sem.status("r").await?.context("status")?;
    assert_eq!((status.permits, status.live()), (Some(3), 3));
    let listed = sem.list(None, false).await?;
    let permits: Vec<(String, Option<i64>)> = listed
        .iter()
        .map(|r| (r.resource.clone(), r.permits))
        .collect();
    assert_eq!(
        permits,
        vec![("q".to_owned(), Some(2)), ("r".to_owned(), Some(3))]
    );
    Ok(())
}
