//! The watchdog's validity after renewals (issue 11, finding 3), end to end: with a clock
//! bound far above the skew margin, every deadline the watchdog reports
//! ([`Watchdog::valid_until`]) stays within `expires_at − bound − margin` of the server time.
//!
//! [`Watchdog::valid_until`]: docwarden::lock::Watchdog::valid_until

use std::time::{Duration, Instant};

use anyhow::Context;
use docwarden::clock::{ClockOptions, LocalClock, TimeSource};
use docwarden::lock::{LockCollection, LockOptions, Owner, WatchdogOptions};
use docwarden_testkit::TestDb;

fn signed_ms(from: Instant, to: Instant) -> i64 {
    let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    if to >= from {
        ms(to - from)
    } else {
        -ms(from - to)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_renewals_the_watchdog_claims_at_most_expires_at_minus_bound_and_margin()
-> anyhow::Result<()> {
    let t = TestDb::new("lock_watchdog_bound").await?;
    // No skew margin, and a bound that grows by 1 ms per ms since the one sample (an
    // assumed drift of 100 %): two seconds after the sample the bound is ~2 s.
    let time = TimeSource::server(
        t.client.clone(),
        ClockOptions::default()
            .skew_margin(Duration::ZERO)
            .drift_ppm(1_000_000)
            .refresh(Duration::from_secs(3_600)),
    )?;
    time.refresh().await?;
    let locks = LockCollection::open(&t.db, "locks", time.clone(), LockOptions::default()).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    let ttl = Duration::from_secs(20);
    let lease = locks
        .try_acquire(&Owner::random(), "r", ttl)
        .await?
        .context("acquire")?;
    // Renew every 400 ms.
    let dog = locks.watch(
        lease.clone(),
        ttl,
        WatchdogOptions::default().renew_fraction(0.02),
    )?;
    let mut last = lease.expires_at;
    let mut renewals = 0;
    let mut violations = Vec::new();
    let give_up = Instant::now() + Duration::from_secs(5);
    while renewals < 3 && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let before = dog.valid_until().context("lost")?;
        let current = dog.lease().context("lost")?;
        let until = dog.valid_until().context("lost")?;
        if current.expires_at == last || before != until {
            continue;
        }
        last = current.expires_at;
        renewals += 1;
        // By the estimate read now (at `at`), the lease is certainly valid for at most
        // `expires_at − estimate − bound − margin` (margin 0).
        let at = Instant::now();
        let now = time.now().await?;
        let allowed = current.expires_at.timestamp_millis() - now.estimate_ms - now.bound_ms;
        let claimed = signed_ms(at, until);
        eprintln!(
            "renewal {renewals}: bound {} ms, watchdog claims {claimed} ms, allowed {allowed} ms",
            now.bound_ms
        );
        // Slack: the bound grew (1 ms per ms) between the renewal's read and this one.
        if claimed > allowed + 300 {
            violations.push(format!(
                "renewal {renewals}: claims {claimed} ms, allowed {allowed} ms (bound {} ms)",
                now.bound_ms
            ));
        }
    }
    dog.stop();
    assert!(renewals >= 2, "only {renewals} renewals seen");
    assert!(
        violations.is_empty(),
        "the watchdog over-claims the lease after renewals: {violations:?}"
    );
    Ok(())
}

/// Session 16: the watchdog's state is updated by its task only, so a holder that resumed
/// after a pause longer than its lease (a GC pause, a blocked runtime thread, SIGSTOP)
/// read `lease()` = `Some`, `is_lost()` = `false` — and an election's leader kept leading —
/// while another owner already held the resource: two holders. The accessors now check
/// `valid_until` themselves. The pause is the test's only runtime thread blocked; the
/// competitor runs on its own thread, runtime and client.
#[tokio::test(flavor = "current_thread")]
async fn a_holder_resuming_after_a_pause_longer_than_its_lease_is_told_at_once()
-> anyhow::Result<()> {
    let t = TestDb::new("lock_watchdog_pause").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let locks = LockCollection::open(&t.db, "locks", time, LockOptions::default()).await?;
    let ttl = Duration::from_secs(1);
    let lease = locks
        .try_acquire(&Owner::random(), "r", ttl)
        .await?
        .context("acquire")?;
    let dog = locks.watch(lease.clone(), ttl, WatchdogOptions::default())?;
    // Let the watchdog read the server time and renew once.
    tokio::time::sleep(Duration::from_millis(500)).await;
    anyhow::ensure!(dog.lease().is_some(), "lost before the pause");

    let uri = t.uri().to_owned();
    let db_name = t.db.name().to_owned();
    let competitor = std::thread::spawn(move || -> anyhow::Result<bool> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let client = mongodb::Client::with_uri_str(&uri).await?;
            let time = TimeSource::server(client.clone(), ClockOptions::default())?;
            let locks = LockCollection::new(
                client.database(&db_name).collection("locks"),
                time,
                LockOptions::default(),
            )?;
            let give_up = Instant::now() + Duration::from_millis(2_500);
            while Instant::now() < give_up {
                if locks
                    .try_acquire(&Owner::random(), "r", Duration::from_secs(30))
                    .await?
                    .is_some()
                {
                    return Ok(true);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok(false)
        })
    });
    // The pause: this thread (the runtime the watchdog runs on) is blocked.
    std::thread::sleep(Duration::from_millis(3_000));
    // Read before anything yields to the watchdog task.
    let (held, lost) = (dog.lease().is_some(), dog.is_lost());
    let taken_over = competitor
        .join()
        .map_err(|_| anyhow::anyhow!("competitor panicked"))??;
    assert!(taken_over, "the competitor never got the lapsed lease");
    let violations = usize::from(held) + usize::from(!lost);
    assert_eq!(
        violations, 0,
        "after the pause the watchdog said held = {held}, lost = {lost}, while another owner held the lock"
    );
    Ok(())
}

/// Session 16: a suspend of the whole machine (a VM paused, a laptop asleep) is not counted
/// by the monotonic clock (Linux `CLOCK_MONOTONIC`), only by the wall clock: on resume the
/// watchdog's deadline by `Instant` had not passed, and `lease()` said held. The suspend is
/// simulated as the clock tests do: the time source's wall clock steps ahead by more than
/// the lease while the monotonic clock does not move.
#[tokio::test(flavor = "current_thread")]
async fn a_holder_resuming_from_a_suspend_longer_than_its_lease_is_told_at_once()
-> anyhow::Result<()> {
    let t = TestDb::new("lock_watchdog_suspend").await?;
    let local = LocalClock::system();
    let time =
        TimeSource::server_with_local(t.client.clone(), local.clone(), ClockOptions::default())?;
    let locks = LockCollection::open(&t.db, "locks", time, LockOptions::default()).await?;
    let ttl = Duration::from_secs(2);
    let lease = locks
        .try_acquire(&Owner::random(), "r", ttl)
        .await?
        .context("acquire")?;
    let dog = locks.watch(lease, ttl, WatchdogOptions::default())?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    anyhow::ensure!(dog.lease().is_some(), "lost before the suspend");
    // The suspend: 10 s by the wall clock, nothing by the monotonic clock.
    local.step_ms(10_000);
    let (held, lost) = (dog.lease().is_some(), dog.is_lost());
    let violations = usize::from(held) + usize::from(!lost);
    assert_eq!(
        violations, 0,
        "after a 10 s suspend of a 2 s lease the watchdog said held = {held}, lost = {lost}"
    );
    Ok(())
}

/// Session 16: until the watchdog task first read the server time, `lease()` returned the
/// lease as acquired with no deadline at all, so a holder whose thread blocked right after
/// `watch` (before the task ever ran) was told "held" long after the lease had lapsed.
/// The start now takes its deadline from the time source's fresh sample (no I/O).
#[tokio::test(flavor = "current_thread")]
async fn a_holder_blocked_right_after_starting_the_watchdog_is_told_at_once() -> anyhow::Result<()>
{
    let t = TestDb::new("lock_watchdog_blocked_at_start").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let locks = LockCollection::open(&t.db, "locks", time, LockOptions::default()).await?;
    let ttl = Duration::from_secs(1);
    let lease = locks
        .try_acquire(&Owner::random(), "r", ttl)
        .await?
        .context("acquire")?;
    let dog = locks.watch(lease, ttl, WatchdogOptions::default())?;
    // Blocked before the watchdog task ever ran, for twice the lease.
    std::thread::sleep(Duration::from_millis(2_000));
    let (held, lost) = (dog.lease().is_some(), dog.is_lost());
    let violations = usize::from(held) + usize::from(!lost);
    assert_eq!(
        violations, 0,
        "2 s after a 1 s lease the watchdog said held = {held}, lost = {lost}"
    );
    Ok(())
}
