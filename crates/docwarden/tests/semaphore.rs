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
            .acquire(&me, "r", Duration::from_millis(300), Duration::from_secs(5))
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
        .try_acquire(&Owner::random(), "r", Duration::from_millis(300))
        .await?
        .context("old")?;
    // Past its ttl, the skew margin (250 ms) and the clock's bound.
    tokio::time::sleep(Duration::from_millis(700)).await;
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

/// Session 18: a process holding many permits renewed them one `renew` at a time, one
/// round trip each, one after another (the queue's limited jobs at every heartbeat).
/// `renew_many` writes once per resource document, the resources concurrently, and keeps
/// each permit fenced: 5 permits of this owner in 2 resources, next to another owner's
/// permit, a lapsed permit and a released one. Round trips: 7 sequential `renew`s = 7
/// writes; `renew_many` of the same 7 = 2 writes. Counts: permits renewed that must not
/// be (0), valid permits not renewed (0).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn renewing_many_permits_is_one_write_per_resource_and_keeps_each_fenced()
-> anyhow::Result<()> {
    let t = TestDb::new("sem_renew_many").await?;
    let (client, log) = docwarden_testkit::counting_client(t.uri()).await?;
    let sem = Semaphore::open(
        &client.database(t.db.name()),
        SEM,
        time(&t)?,
        SemaphoreOptions::default().default_permits(5),
    )
    .await?;
    let (me, other) = (Owner::random(), Owner::random());
    let long = Duration::from_secs(30);
    let mut mine = Vec::new();
    for _ in 0..3 {
        mine.push(sem.try_acquire(&me, "a", long).await?.context("a")?);
    }
    let others = sem.try_acquire(&other, "a", long).await?.context("other")?;
    for _ in 0..2 {
        mine.push(sem.try_acquire(&me, "b", long).await?.context("b")?);
    }
    let released = sem.try_acquire(&me, "b", long).await?.context("released")?;
    sem.release(&released).await?;
    // Stored but lapsed: nothing acquires "a" after it, so nothing drops it.
    let lapsed = sem
        .try_acquire(&me, "a", Duration::from_millis(300))
        .await?
        .context("lapsed")?;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let stored_until = |doc: &Document, p: &docwarden::lock::Permit| {
        doc.get_array("holders").ok().and_then(|hs| {
            hs.iter()
                .filter_map(|h| h.as_document())
                .find(|h| {
                    h.get_str("owner").ok() == Some(p.owner.as_str())
                        && h.get_i64("token").ok() == Some(p.token.get())
                })
                .and_then(|h| h.get_datetime("until").ok().copied())
        })
    };
    let raw = t.db.collection::<Document>(SEM);
    let before = raw.find_one(doc! { "_id": "a" }).await?.context("a")?;

    // Before: one `renew` per permit, in turn.
    let mut one_by_one = mine.clone();
    one_by_one.push(lapsed.clone());
    one_by_one.push(released.clone());
    log.take();
    let started = std::time::Instant::now();
    let mut sequential = Vec::new();
    for p in &mut one_by_one {
        sequential.push(sem.renew(p, long).await.is_ok());
    }
    let sequential_took = started.elapsed();
    let sequential_writes = log.take().len();

    // After: the same permits in one call.
    let mut batch = mine.clone();
    batch.push(lapsed.clone());
    batch.push(released.clone());
    log.take();
    let started = std::time::Instant::now();
    let results = sem.renew_many(&mut batch, long).await?;
    let batch_took = started.elapsed();
    let counts = log.take_counts();
    println!(
        "7 permits in 2 resources: {sequential_writes} writes one by one ({sequential_took:?}), \
         {counts:?} with renew_many ({batch_took:?})"
    );
    assert_eq!(sequential_writes, 7, "one round trip per permit");
    assert_eq!(
        counts.into_iter().collect::<Vec<_>>(),
        vec![("findAndModify".to_owned(), 2)],
        "one write per resource document"
    );

    let after_a = raw.find_one(doc! { "_id": "a" }).await?.context("a")?;
    let after_b = raw.find_one(doc! { "_id": "b" }).await?.context("b")?;
    let stored = |p: &docwarden::lock::Permit| {
        if p.resource == "a" {
            stored_until(&after_a, p)
        } else {
            stored_until(&after_b, p)
        }
    };
    let mut wrongly_renewed = 0;
    let mut not_renewed = 0;
    for (i, (p, r)) in batch.iter().zip(&results).enumerate() {
        let valid = i < mine.len();
        match (valid, r) {
            (true, Ok(())) if stored(p) == Some(p.expires_at) => {}
            (true, _) => not_renewed += 1,
            (false, Err(docwarden::Error::LeaseLost { .. })) => {}
            (false, _) => wrongly_renewed += 1,
        }
    }
    // The lapsed permit's element is stored unchanged; the other owner's too.
    if stored_until(&after_a, &lapsed) != stored_until(&before, &lapsed) {
        wrongly_renewed += 1;
    }
    if stored_until(&after_a, &others) != stored_until(&before, &others) {
        wrongly_renewed += 1;
    }
    assert_eq!(
        sequential,
        [true, true, true, true, true, false, false],
        "renew one by one"
    );
    assert_eq!(
        wrongly_renewed, 0,
        "a lapsed, released or foreign permit renewed"
    );
    assert_eq!(not_renewed, 0, "a valid permit not renewed: {results:?}");
    assert!(sem.renew_many(&mut [], long).await?.is_empty());
    Ok(())
}

/// Session 18 review: a blocking acquire whose attempts are granted but lose their replies
/// (`failCommand` with a write concern error on this test's own client) for most of the
/// ttl. Until then the next answered attempt returned the first lost attempt's holder
/// entry as it was: its expiry set when that attempt ran, so the permit handed out had
/// a fraction of its ttl left, less than the skew margin: not certainly valid. The
/// acquire must hand out a permit with its ttl from now (the lost entries given back) and
/// still hold one permit only. Counts: permits handed out not certainly valid (0), entries
/// of this owner (1).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_permit_taken_back_from_lost_replies_is_certainly_valid() -> anyhow::Result<()> {
    let test = "sem_lost_replies_fresh_permit";
    let t = TestDb::new(test).await?;
    if docwarden_testkit::fail_point_client(&t, test)
        .await?
        .is_none()
    {
        return Ok(());
    }
    let app = "sem-lost-replies";
    let mut options = mongodb::options::ClientOptions::parse(t.uri()).await?;
    options.app_name = Some(app.to_owned());
    options.heartbeat_freq = Some(Duration::from_millis(500));
    options.server_selection_timeout = Some(Duration::from_secs(20));
    let client = mongodb::Client::with_options(options)?;
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let sem = Semaphore::open(
        &client.database(t.db.name()),
        SEM,
        time.clone(),
        SemaphoreOptions::default()
            .default_permits(2)
            .backoff(Duration::from_millis(5), Duration::from_millis(50)),
    )
    .await?;
    let me = Owner::random();
    // A token block first, so every attempt is one findAndModify.
    let seed = sem
        .try_acquire(&me, "r", Duration::from_secs(1))
        .await?
        .context("seed")?;
    sem.release(&seed).await?;
    t.client
        .database("admin")
        .run_command(doc! {
            "configureFailPoint": "failCommand",
            "mode": "alwaysOn",
            "data": {
                "failCommands": ["findAndModify"],
                "writeConcernError": { "code": 91, "errmsg": "injected: reply lost" },
                "appName": app,
            },
        })
        .await?;
    let ttl = Duration::from_millis(1_500);
    let acquiring = {
        let (sem, me) = (sem.clone(), me.clone());
        tokio::spawn(async move { sem.acquire(&me, "r", ttl, Duration::from_secs(10)).await })
    };
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    docwarden_testkit::fail_commands_off(&t.client).await?;
    let permit = acquiring.await??.context("a permit within the wait")?;
    let now = time.now().await?;
    let status = sem.status("r").await?.context("status")?;
    let entries = status.holders.iter().filter(|h| h.owner == me.id()).count();
    let not_valid = usize::from(!permit.is_certainly_valid(&now, time.skew_margin_ms()));
    println!(
        "permit {:?}: {} ms left of {ttl:?}; {entries} entries of this owner",
        permit.token,
        permit.expires_at.timestamp_millis() - now.estimate_ms
    );
    assert_eq!(
        not_valid, 0,
        "a permit handed out that is not certainly valid"
    );
    assert_eq!(entries, 1, "one permit only: {status:?}");
    sem.release(&permit).await?;
    Ok(())
}
