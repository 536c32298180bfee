//! The lock collection against the real server: mutual exclusion, fencing across pauses,
//! crashes and deleted lock documents, clock skew, release-all, blocking acquire, bad input
//! and the watchdog. Every concurrency test has a control run without the safeguard.

use std::time::{Duration, Instant};

use anyhow::Context;
use docwarden::Error;
use docwarden::clock::{ClockOptions, LocalClock, TimeSource};
use docwarden::lock::{
    Fence, FenceOptions, FenceOutcome, FencePause, FencingToken, LockCollection, LockListFilter,
    LockOptions, LostReason, Owner, WatchdogOptions,
};
use docwarden_testkit::TestDb;
use docwarden_workloads::counters::{self, Counters};
use docwarden_workloads::{Mode, RunConfig};
use mongodb::bson::{Document, doc};
use mongodb::options::WriteConcern;

const LOCKS: &str = "locks";

async fn open_with(t: &TestDb, time: TimeSource) -> anyhow::Result<LockCollection> {
    Ok(counters::open_locks(&t.db, LOCKS, time).await?)
}

async fn open(t: &TestDb) -> anyhow::Result<LockCollection> {
    open_with(
        t,
        TimeSource::server(t.client.clone(), ClockOptions::default())?,
    )
    .await
}

const TASKS: usize = 16;
const ROUNDS: usize = 300;
const RESOURCES: usize = 4;

/// Seed 004's workload (`docwarden_workloads::counters`): TASKS × ROUNDS locked
/// read-modify-writes on RESOURCES counters. Returns (lost updates, token regressions,
/// releases refused with `LeaseLost`).
async fn run_counters(
    t: &TestDb,
    locks: LockCollection,
    name: &str,
) -> anyhow::Result<(i64, u64, u64)> {
    let c = Counters::new(t.db.collection(name));
    c.setup(RESOURCES).await?;
    let r = counters::run_locked(
        &locks,
        &c,
        RESOURCES,
        RunConfig {
            workers: TASKS,
            ops_per_worker: u64::try_from(ROUNDS)?,
            mode: Mode::Safe,
        },
    )
    .await?;
    Ok((r.lost, r.regressions, r.refused))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mutual_exclusion_16_tasks_300_rounds_loses_no_update() -> anyhow::Result<()> {
    let t = TestDb::new("lock_mutual_exclusion").await?;
    let locks = open(&t).await?;
    let started = Instant::now();
    let (lost, regressions, refused) = run_counters(&t, locks, "counters").await?;
    eprintln!(
        "with lock: {TASKS} tasks × {ROUNDS} rounds on {RESOURCES} resources in {:.1} s: lost {lost}, token regressions {regressions}, releases refused {refused}",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(lost, 0, "lost updates under the lock");
    assert_eq!(
        regressions, 0,
        "fencing tokens must strictly increase per resource"
    );
    assert_eq!(refused, 0, "no lease was lost under the lock");

    // Control: the same lock collection with one safeguard off (the acquire ignores the
    // holder's expiry, so it takes over held leases) loses updates.
    let unsafe_locks = LockCollection::open(
        &t.db,
        LOCKS,
        TimeSource::server(t.client.clone(), ClockOptions::default())?,
        LockOptions::default()
            .backoff(Duration::from_millis(1), Duration::from_millis(20))
            .write_concern(WriteConcern::majority())
            .unsafe_ignore_expiry(),
    )
    .await?;
    let started = Instant::now();
    let (lost, _, refused) = run_counters(&t, unsafe_locks, "counters_control").await?;
    eprintln!(
        "control (expiry check off): lost {lost}, releases refused {refused} in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert!(lost > 0, "the control must lose updates");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_holder_is_refused_renew_release_and_fenced_write() -> anyhow::Result<()> {
    let t = TestDb::new("lock_paused_holder").await?;
    let locks = open(&t).await?;
    let accounts = t.db.collection::<Document>("accounts");
    let fence = Fence::new(accounts.clone(), FenceOptions::default())?;
    let p = counters::paused_holder(&locks, &accounts, &fence).await?;
    let (la, lb, b) = (&p.paused, &p.taker, p.taker.owner.clone());
    assert!(p.first_write.is_applied());
    assert!(p.refused_while_held, "B is refused while A holds the lease");
    assert!(lb.token > la.token, "{} > {}", lb.token, la.token);
    assert_eq!(p.taker_write, FenceOutcome::Applied);

    // A woke up and carried on as if it still held the lease.
    assert!(
        matches!(p.renew, Err(Error::LeaseLost { .. })),
        "{:?}",
        p.renew
    );
    assert!(
        matches!(p.release, Err(Error::LeaseLost { .. })),
        "{:?}",
        p.release
    );
    let write = p.late_write;
    assert_eq!(write, FenceOutcome::Stale { seen: lb.token });
    assert!(matches!(write.into_result(la), Err(Error::Stale { .. })));

    let d = accounts
        .find_one(doc! { "_id": 1 })
        .await?
        .context("account")?;
    assert_eq!(d.get_i64("balance")?, 70, "the stale write was not applied");
    assert_eq!(d.get_i64("fence_token")?, lb.token.get());
    let held = locks
        .list(&LockListFilter::default().resource("account-1"))
        .await?;
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].owner, b);

    // Control: the same fence with its token check off applies the paused holder's write.
    let unfenced = Fence::new(
        accounts.clone(),
        FenceOptions::default().unsafe_without_token_check(),
    )?;
    let control = unfenced
        .apply(
            la,
            doc! { "_id": 1 },
            doc! { "$inc": { "balance": -10_i64 } },
        )
        .await?;
    assert_eq!(
        control,
        FenceOutcome::Applied,
        "the control's stale write is applied"
    );
    let d = accounts
        .find_one(doc! { "_id": 1 })
        .await?
        .context("account")?;
    assert_eq!(
        d.get_i64("balance")?,
        60,
        "the control's stale write was applied"
    );
    locks.release(lb).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lapsed_lease_cannot_be_renewed_even_if_not_taken_over() -> anyhow::Result<()> {
    let t = TestDb::new("lock_lapsed_renew").await?;
    let locks = open(&t).await?;
    let a = Owner::random();
    let mut la = locks
        .try_acquire(&a, "r", Duration::from_secs(1))
        .await?
        .context("acquire")?;
    locks.renew(&mut la, Duration::from_secs(1)).await?;
    // A non-holder cannot renew or release, even knowing the token.
    let mut forged = la.clone();
    forged.owner = Owner::random().id().to_owned();
    assert!(matches!(
        locks.renew(&mut forged, Duration::from_secs(5)).await,
        Err(Error::LeaseLost { .. })
    ));
    assert!(matches!(
        locks.release(&forged).await,
        Err(Error::LeaseLost { .. })
    ));
    let mut wrong_token = la.clone();
    wrong_token.token = FencingToken::new(wrong_token.token.get() + 1);
    assert!(matches!(
        locks.release(&wrong_token).await,
        Err(Error::LeaseLost { .. })
    ));

    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let renew = locks.renew(&mut la, Duration::from_secs(5)).await;
    assert!(matches!(renew, Err(Error::LeaseLost { .. })), "{renew:?}");
    // Releasing still frees it (nobody else took it).
    locks.release(&la).await?;
    assert!(locks.list(&LockListFilter::default()).await?.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_increase_across_crash_expiry_release_and_document_deletion() -> anyhow::Result<()> {
    let t = TestDb::new("lock_crash_tokens").await?;
    let locks = open(&t).await?;
    let lock_docs = t.db.collection::<Document>(LOCKS);
    let mut seen: Vec<i64> = Vec::new();
    let mut regressions = 0;
    let mut check = |token: i64, seen: &mut Vec<i64>| {
        if seen.iter().any(|s| *s >= token) {
            regressions += 1;
        }
        seen.push(token);
    };

    // A acquires with a watchdog and "crashes": everything is dropped without release.
    {
        let a = Owner::random();
        let la = locks
            .try_acquire(&a, "job", Duration::from_secs(1))
            .await?
            .context("a")?;
        check(la.token.get(), &mut seen);
        let dog = locks.watch(la, Duration::from_secs(1), WatchdogOptions::default())?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(dog);
    }
    let b = Owner::random();
    assert!(
        locks
            .try_acquire(&b, "job", Duration::from_secs(1))
            .await?
            .is_none(),
        "still held right after the crash"
    );
    let started = Instant::now();
    let lb = locks
        .acquire(&b, "job", Duration::from_secs(1), Duration::from_secs(6))
        .await?
        .context("b acquires after expiry")?;
    eprintln!(
        "b acquired {:.2} s after a's crash",
        started.elapsed().as_secs_f64()
    );
    check(lb.token.get(), &mut seen);
    locks.release(&lb).await?;

    // c crashes, and its lock document is deleted (what the TTL index does, later).
    let (c, d) = (Owner::random(), Owner::random());
    let (lc, deleted, ld) = counters::crash_and_delete(&locks, &lock_docs, "job", &c, &d).await?;
    check(lc.token.into(), &mut seen);
    assert_eq!(deleted, 1);
    check(ld.token.into(), &mut seen);
    assert_eq!(locks.last_token("job").await?, Some(ld.token));
    // Once more: delete while free, acquire again.
    locks.release(&ld).await?;
    lock_docs.delete_many(doc! { "_id": "job" }).await?;
    let le = locks
        .try_acquire(&d, "job", Duration::from_secs(30))
        .await?
        .context("e")?;
    check(le.token.get(), &mut seen);
    eprintln!("tokens seen: {seen:?}");
    assert_eq!(regressions, 0, "tokens {seen:?}");
    assert!(seen.windows(2).all(|w| w[1] > w[0]));

    // Control: the same lock collection with one safeguard off (the token kept only in the
    // lock document, no counter collection) repeats tokens once the document is deleted.
    let naive = LockCollection::open(
        &t.db,
        "naive_locks",
        locks.time().clone(),
        LockOptions::default().unsafe_token_in_lock_document(),
    )
    .await?;
    let naive_docs = t.db.collection::<Document>("naive_locks");
    let mut naive_seen = Vec::new();
    let mut naive_regressions = 0;
    for _ in 0..3 {
        let lease = naive
            .try_acquire(&d, "job", Duration::from_secs(30))
            .await?
            .context("naive")?;
        if naive_seen.iter().any(|s| *s >= lease.token) {
            naive_regressions += 1;
        }
        naive_seen.push(lease.token);
        naive.release(&lease).await?;
        naive_docs.delete_many(doc! { "_id": "job" }).await?;
    }
    assert!(
        naive_regressions > 0,
        "the control's tokens {naive_seen:?} must repeat"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_30s_ahead_cannot_take_an_unexpired_lease() -> anyhow::Result<()> {
    let t = TestDb::new("lock_clock_skew").await?;
    let holder = open(&t).await?;
    let lease = holder
        .try_acquire(&Owner::random(), "r", Duration::from_secs(10))
        .await?
        .context("holder")?;

    let skewed = open_with(
        &t,
        TimeSource::server_with_local(
            t.new_client().await?,
            LocalClock::with_offset_ms(30_000),
            ClockOptions::default(),
        )?,
    )
    .await?;
    let mut steals = 0;
    for _ in 0..5 {
        if skewed
            .try_acquire(&Owner::random(), "r", Duration::from_secs(10))
            .await?
            .is_some()
        {
            steals += 1;
        }
    }
    assert_eq!(steals, 0, "a skewed client stole an unexpired lease");
    // It computes server time, so a lease it takes expires by the server's clock.
    let own = skewed
        .try_acquire(&Owner::random(), "other", Duration::from_secs(10))
        .await?
        .context("free resource")?;
    let server_now = LocalClock::system().now_ms();
    let left = own.expires_at.timestamp_millis() - server_now;
    assert!((8_000..=12_000).contains(&left), "expires in {left} ms");

    // Control: trusting the client's clock steals the lease.
    let control = open_with(
        &t,
        TimeSource::local_unchecked(LocalClock::with_offset_ms(30_000), ClockOptions::default())?,
    )
    .await?;
    let mut control_steals = 0;
    if let Some(stolen) = control
        .try_acquire(&Owner::random(), "r", Duration::from_secs(10))
        .await?
    {
        control_steals += 1;
        assert!(stolen.token > lease.token);
    }
    assert!(control_steals > 0, "the control must steal the lease");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn release_all_releases_exactly_that_owners_leases() -> anyhow::Result<()> {
    let t = TestDb::new("lock_release_all").await?;
    let locks = open(&t).await?;
    let (a, b, c) = (Owner::random(), Owner::random(), Owner::random());
    let mut b_leases = Vec::new();
    for i in 0..3 {
        locks
            .try_acquire(&a, &format!("a-{i}"), Duration::from_secs(30))
            .await?
            .context("a")?;
        b_leases.push(
            locks
                .try_acquire(&b, &format!("b-{i}"), Duration::from_secs(30))
                .await?
                .context("b")?,
        );
    }
    assert_eq!(locks.release_all(&a).await?, 3);
    assert!(
        locks
            .list(&LockListFilter::default().owner(a.id()))
            .await?
            .is_empty()
    );
    assert_eq!(
        locks
            .list(&LockListFilter::default().owner(b.id()))
            .await?
            .len(),
        3
    );
    assert_eq!(locks.release_all(&c).await?, 0);
    let mut taken_from_a = 0;
    let mut taken_from_b = 0;
    for i in 0..3 {
        if locks
            .try_acquire(&c, &format!("a-{i}"), Duration::from_secs(30))
            .await?
            .is_some()
        {
            taken_from_a += 1;
        }
        if locks
            .try_acquire(&c, &format!("b-{i}"), Duration::from_secs(30))
            .await?
            .is_some()
        {
            taken_from_b += 1;
        }
    }
    assert_eq!((taken_from_a, taken_from_b), (3, 0));
    for mut l in b_leases {
        locks.renew(&mut l, Duration::from_secs(30)).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn blocking_acquire_returns_within_wait_when_held() -> anyhow::Result<()> {
    let t = TestDb::new("lock_blocking_acquire").await?;
    let locks = open(&t).await?;
    let holder = Owner::random();
    let held = locks
        .try_acquire(&holder, "r", Duration::from_secs(30))
        .await?
        .context("holder")?;
    let wait = Duration::from_millis(1_500);
    let started = Instant::now();
    let got = locks
        .acquire(&Owner::random(), "r", Duration::from_secs(5), wait)
        .await?;
    let elapsed = started.elapsed();
    eprintln!(
        "blocking acquire gave up after {:.3} s (wait {:.3} s)",
        elapsed.as_secs_f64(),
        wait.as_secs_f64()
    );
    assert!(got.is_none());
    assert!(elapsed >= wait, "{elapsed:?}");
    assert!(elapsed < wait + Duration::from_millis(750), "{elapsed:?}");

    // And it does return the lease soon after the holder releases.
    let releaser = {
        let locks = locks.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(400)).await;
            locks.release(&held).await
        })
    };
    let started = Instant::now();
    let got = locks
        .acquire(
            &Owner::random(),
            "r",
            Duration::from_secs(5),
            Duration::from_secs(10),
        )
        .await?;
    releaser.await??;
    assert!(got.is_some());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    // An unrepresentably long wait is "forever", not a panic.
    let forever = locks
        .acquire(
            &Owner::random(),
            "free",
            Duration::from_secs(5),
            Duration::MAX,
        )
        .await?;
    assert!(forever.is_some());
    Ok(())
}

#[tokio::test]
async fn bad_input_is_refused_and_nothing_is_written() -> anyhow::Result<()> {
    let t = TestDb::new("lock_bad_input").await?;
    let locks = open(&t).await?;
    let me = Owner::random();
    let invalid = |r: docwarden::Result<Option<docwarden::lock::Lease>>| {
        matches!(r, Err(Error::InvalidInput { .. }))
    };
    assert!(invalid(locks.try_acquire(&me, "r", Duration::ZERO).await));
    assert!(invalid(
        locks.try_acquire(&me, "", Duration::from_secs(1)).await
    ));
    let long = "x".repeat(docwarden::validate::MAX_NAME_LEN + 1);
    assert!(invalid(
        locks.try_acquire(&me, &long, Duration::from_secs(1)).await
    ));
    assert!(invalid(
        locks
            .acquire(&me, "r", Duration::ZERO, Duration::from_secs(1))
            .await
    ));
    assert!(invalid(
        locks
            .acquire(&me, "", Duration::from_secs(1), Duration::from_secs(1))
            .await
    ));
    assert!(matches!(
        Owner::from_existing(""),
        Err(Error::InvalidInput { .. })
    ));
    assert!(matches!(
        Owner::from_existing(long.clone()),
        Err(Error::InvalidInput { .. })
    ));
    assert!(matches!(
        locks.last_token("").await,
        Err(Error::InvalidInput { .. })
    ));
    assert!(matches!(
        LockCollection::open(&t.db, "", locks.time().clone(), LockOptions::default()).await,
        Err(Error::InvalidInput { .. })
    ));
    assert!(matches!(
        LockCollection::open(
            &t.db,
            "x",
            locks.time().clone(),
            LockOptions::default().gc_after(Duration::ZERO)
        )
        .await,
        Err(Error::InvalidInput { .. })
    ));
    let lease = locks
        .try_acquire(&me, "ok", Duration::from_secs(5))
        .await?
        .context("valid")?;
    let mut renewed = lease.clone();
    assert!(matches!(
        locks.renew(&mut renewed, Duration::ZERO).await,
        Err(Error::InvalidInput { .. })
    ));
    assert!(matches!(
        locks.watch(
            lease.clone(),
            Duration::from_secs(1),
            WatchdogOptions::default().renew_fraction(1.5)
        ),
        Err(Error::InvalidInput { .. })
    ));
    locks.release(&lease).await?;
    // Only the valid acquire wrote anything.
    let lock_docs = t.db.collection::<Document>(LOCKS);
    let token_docs = t.db.collection::<Document>(&format!("{LOCKS}.tokens"));
    assert_eq!(
        lock_docs
            .count_documents(doc! { "_id": { "$ne": "ok" } })
            .await?,
        0
    );
    assert_eq!(
        token_docs
            .count_documents(doc! { "_id": { "$ne": "ok" } })
            .await?,
        0
    );
    assert_eq!(lock_docs.count_documents(doc! {}).await?, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_watchdog_keeps_a_lease_alive_and_reports_its_loss_at_once() -> anyhow::Result<()> {
    let t = TestDb::new("lock_watchdog").await?;
    let locks = open(&t).await?;
    let (a, b) = (Owner::random(), Owner::random());
    let ttl = Duration::from_secs(1);
    let lease = locks.try_acquire(&a, "kept", ttl).await?.context("a")?;
    let first_expiry = lease.expires_at;
    let dog = locks.watch(lease, ttl, WatchdogOptions::default())?;

    // Several ttls pass; another owner keeps trying.
    let mut steals = 0;
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(3_500) {
        if locks.try_acquire(&b, "kept", ttl).await?.is_some() {
            steals += 1;
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert_eq!(steals, 0, "the watched lease was stolen");
    let current = dog.lease().context("still held")?;
    assert!(current.expires_at > first_expiry);
    assert!(!dog.is_lost());

    // An operator releases everything a holds: the watchdog notices at its next renewal.
    assert_eq!(locks.release_all(&a).await?, 1);
    let taken = locks
        .try_acquire(&b, "kept", Duration::from_secs(30))
        .await?
        .context("b")?;
    assert!(taken.token > current.token);
    let noticed = Instant::now();
    let reason = tokio::time::timeout(Duration::from_secs(2), dog.lost()).await?;
    eprintln!(
        "watchdog reported {reason:?} after {:.3} s",
        noticed.elapsed().as_secs_f64()
    );
    assert_eq!(reason, LostReason::TakenOver);
    assert!(dog.lease().is_none());
    assert!(matches!(dog.release().await, Err(Error::LeaseLost { .. })));

    // Control: without a watchdog the same lease is stolen after its ttl.
    let unwatched = locks
        .try_acquire(&a, "unwatched", ttl)
        .await?
        .context("a2")?;
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let mut control_steals = 0;
    if locks.try_acquire(&b, "unwatched", ttl).await?.is_some() {
        control_steals += 1;
    }
    assert!(control_steals > 0, "the unwatched lease must be taken over");
    assert!(matches!(
        locks.release(&unwatched).await,
        Err(Error::LeaseLost { .. })
    ));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_released_watchdog_frees_the_lease() -> anyhow::Result<()> {
    let t = TestDb::new("lock_watchdog_release").await?;
    let locks = open(&t).await?;
    let a = Owner::random();
    let lease = locks
        .try_acquire(&a, "r", Duration::from_secs(2))
        .await?
        .context("a")?;
    let dog = locks.watch(lease, Duration::from_secs(2), WatchdogOptions::default())?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    dog.release().await?;
    assert!(
        locks
            .try_acquire(&Owner::random(), "r", Duration::from_secs(2))
            .await?
            .is_some()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_watchdog_reports_expiry_when_the_server_is_unreachable() -> anyhow::Result<()> {
    let Some(mut t) = TestDb::dedicated("lock_watchdog_unreachable").await? else {
        return Ok(()); // TestDb::dedicated reported the skip
    };
    let locks = open(&t).await?;
    let ttl = Duration::from_secs(2);
    let lease = locks
        .try_acquire(&Owner::random(), "r", ttl)
        .await?
        .context("acquire")?;
    let dog = locks.watch(lease, ttl, WatchdogOptions::default())?;
    let server = t.server_mut().context("dedicated server")?;
    server.pause().await?;
    let paused = Instant::now();
    let reason = tokio::time::timeout(Duration::from_secs(5), dog.lost()).await;
    let noticed = paused.elapsed();
    server.resume().await?;
    let reason = reason?;
    eprintln!(
        "watchdog reported {reason:?} {:.2} s after the server stopped answering",
        noticed.as_secs_f64()
    );
    assert_eq!(reason, LostReason::Expired);
    // It gave up before the lease could have been taken over by anyone else.
    assert!(noticed <= ttl, "{noticed:?}");
    assert!(dog.lease().is_none());
    // Once the server is back, the lease (no longer renewed) is free for others.
    let next = locks
        .acquire(&Owner::random(), "r", ttl, Duration::from_secs(10))
        .await?;
    assert!(next.is_some());
    Ok(())
}

/// Session 15: `Fence::apply` refused an update that names the token field, but not a
/// `$rename` onto it (the server then refused the update with a bare conflict error);
/// and for a job claim it checked nothing, so a fenced write could move the fence itself
/// (`$set: {state: "succeeded"}` was `Applied`, and the claim's own completion then
/// failed as lost). Both are `InvalidInput` now, nothing written.
#[tokio::test]
async fn a_fenced_update_cannot_touch_the_fence_itself() -> anyhow::Result<()> {
    let t = TestDb::new("lock_fence_own_fields").await?;
    let locks = open(&t).await?;
    let accounts = t.db.collection::<Document>("accounts");
    accounts.insert_one(doc! { "_id": 1, "n": 0 }).await?;
    let fence = Fence::new(accounts.clone(), FenceOptions::default())?;
    let lease = locks
        .try_acquire(&Owner::random(), "r", Duration::from_secs(30))
        .await?
        .context("free")?;
    let invalid = |r: &docwarden::Result<FenceOutcome>| {
        matches!(
            r,
            Err(Error::InvalidInput {
                what: "fenced update",
                ..
            })
        )
    };
    let renamed = fence
        .apply(
            &lease,
            doc! { "_id": 1 },
            doc! { "$rename": { "n": "fence_token" } },
        )
        .await;
    assert!(
        invalid(&renamed),
        "lease, $rename onto the token: {renamed:?}"
    );
    // A job claim's fence: the job's state and token.
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = docwarden::queue::JobQueue::open(
        &t.db,
        "jobs",
        time,
        docwarden::queue::QueueOptions::default(),
    )
    .await?;
    q.enqueue(doc! {}, &docwarden::queue::EnqueueOptions::default())
        .await?;
    let job = q.claim("w").await?.context("no job")?;
    let jobs = Fence::new(q.collection().clone(), FenceOptions::default())?;
    let moved = jobs
        .apply(
            &job,
            doc! { "_id": job.id() },
            doc! { "$set": { "state": "succeeded" } },
        )
        .await;
    assert!(invalid(&moved), "job, $set of its state: {moved:?}");
    assert_eq!(
        jobs.apply(
            &job,
            doc! { "_id": job.id() },
            doc! { "$set": { "note": 1 } }
        )
        .await?,
        FenceOutcome::Applied
    );
    q.complete(&job, mongodb::bson::Bson::Null).await?;
    Ok(())
}

/// Session 16: numbers an operator writes with mongosh are doubles. A token counter
/// re-seeded by hand (`{$set: {token: 100}}` in `<name>.tokens`, stored 100.0) made every
/// later slow-path acquire fail ("token counter: … not an int64"): the resource could not
/// be locked again. A lock document whose token was restored by hand as a double (with
/// the counter lost) was read as "no previous token" (0): the next block started at the
/// bottom and handed out a token below one already handed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_written_by_hand_as_doubles_are_read_as_numbers() -> anyhow::Result<()> {
    let t = TestDb::new("lock_tokens_as_doubles").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    // Block size 1: every acquire reserves from the counter (the slow path).
    let locks =
        LockCollection::open(&t.db, LOCKS, time, LockOptions::default().token_block(1)).await?;
    let counter = t.db.collection::<Document>(&format!("{LOCKS}.tokens"));
    let lock_docs = t.db.collection::<Document>(LOCKS);
    let owner = Owner::random();
    let ttl = Duration::from_secs(30);
    let mut failures = Vec::new();

    // The counter re-seeded above every token handed out, as a double.
    let first = locks.try_acquire(&owner, "a", ttl).await?.context("a")?;
    locks.release(&first).await?;
    counter
        .update_one(doc! { "_id": "a" }, doc! { "$set": { "token": 100.0 } })
        .await?;
    match locks.try_acquire(&owner, "a", ttl).await {
        Ok(Some(lease)) if lease.token.get() > 100 => locks.release(&lease).await?,
        other => failures.push(format!("counter re-seeded as 100.0: {other:?}")),
    }

    // The lock document's token restored as a double, the counter lost.
    let first = locks.try_acquire(&owner, "b", ttl).await?.context("b")?;
    locks.release(&first).await?;
    lock_docs
        .update_one(doc! { "_id": "b" }, doc! { "$set": { "token": 500.0 } })
        .await?;
    counter.delete_one(doc! { "_id": "b" }).await?;
    match locks.try_acquire(&owner, "b", ttl).await {
        Ok(Some(lease)) if lease.token.get() > 500 => locks.release(&lease).await?,
        other => failures.push(format!(
            "lock token restored as 500.0, counter lost: {other:?} (a token at or below 500 repeats one handed out)"
        )),
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// Issue 17, hole 3: a lease's fenced write whose document changes under the filter
/// between the write and the read that explains the refusal, on each of its three rounds
/// (driven by the test-only pause), reports `Contended`, not `NotFound`: the document
/// exists. `into_result` turns it into a retryable error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_write_on_a_document_changing_under_it_reports_contention() -> anyhow::Result<()> {
    let t = TestDb::new("lock_fence_contention").await?;
    let locks = open(&t).await?;
    let lease = locks
        .try_acquire(&Owner::random(), "r", Duration::from_secs(30))
        .await?
        .context("free")?;
    let fence = Fence::open(&t.db, "data", FenceOptions::default()).await?;
    let data = fence.collection().clone();
    data.insert_one(doc! { "_id": "d", "v": 1 }).await?;
    let pause = std::sync::Arc::new(FencePause::default());
    let paused = fence.with_round_pause(pause.clone());
    let writer = {
        let lease = lease.clone();
        tokio::spawn(async move {
            paused
                .apply(
                    &lease,
                    doc! { "_id": "d", "v": 0 },
                    doc! { "$set": { "w": 1 } },
                )
                .await
        })
    };
    // Each round: the write sees v = 1 (no match), the read sees v = 0 (a match the
    // token would let through), the next write sees v = 1 again.
    for round in 0..3 {
        pause.reached().await;
        data.update_one(doc! { "_id": "d" }, doc! { "$set": { "v": 0 } })
            .await?;
        pause.resume();
        if round < 2 {
            pause.reached().await;
            data.update_one(doc! { "_id": "d" }, doc! { "$set": { "v": 1 } })
                .await?;
            pause.resume();
        }
    }
    let outcome = writer.await??;
    assert_eq!(outcome, FenceOutcome::Contended);
    let stored = data.find_one(doc! { "_id": "d" }).await?.context("kept")?;
    assert!(!stored.contains_key("w"), "nothing written: {stored}");
    let result = outcome.into_result(&lease);
    assert!(matches!(&result, Err(e) if e.is_retryable()), "{result:?}");
    // Without the changes it applies at once.
    assert_eq!(
        fence
            .apply(
                &lease,
                doc! { "_id": "d", "v": 0 },
                doc! { "$set": { "w": 1 } }
            )
            .await?,
        FenceOutcome::Applied
    );
    Ok(())
}
