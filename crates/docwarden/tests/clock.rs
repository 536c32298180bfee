//! The server clock against the real server: a skewed client still knows server time.

use std::time::Duration;

use docwarden::clock::{ClockOptions, LocalClock, PrimaryWatch, TimeSource};
use docwarden::lock::{LockCollection, LockOptions, Owner};
use docwarden_testkit::TestDb;
use mongodb::bson::doc;

/// Reads the server's clock directly, with the local round trip around it.
async fn server_reading(client: &mongodb::Client) -> anyhow::Result<(i64, i64, i64)> {
    let sys = LocalClock::system();
    let before = sys.now_ms();
    let hello = client
        .database("admin")
        .run_command(doc! { "hello": 1 })
        .await?;
    let after = sys.now_ms();
    Ok((
        before,
        hello.get_datetime("localTime")?.timestamp_millis(),
        after,
    ))
}

#[tokio::test]
async fn a_client_30s_ahead_still_computes_server_time_within_the_bound() -> anyhow::Result<()> {
    let t = TestDb::new("clock_skew_ahead").await?;
    for skew_ms in [30_000_i64, -30_000, 0] {
        let time = TimeSource::server_with_local(
            t.client.clone(),
            LocalClock::with_offset_ms(skew_ms),
            ClockOptions::default(),
        )?;
        let sample = time.refresh().await?;
        assert!(
            (sample.offset_ms + skew_ms).abs() <= sample.bound_ms + 1,
            "offset {} should cancel the skew {skew_ms} (bound {})",
            sample.offset_ms,
            sample.bound_ms
        );
        let (_, server_before, _) = server_reading(&t.client).await?;
        let now = time.now().await?;
        let (_, server_after, _) = server_reading(&t.client).await?;
        // The estimate lies between two direct readings, widened by the bound.
        assert!(
            now.estimate_ms + now.bound_ms >= server_before
                && now.estimate_ms - now.bound_ms <= server_after,
            "skew {skew_ms}: {now:?} not within [{server_before}, {server_after}]"
        );
        assert!(
            now.bound_ms < 1_000,
            "bound {} ms is too loose",
            now.bound_ms
        );
    }
    Ok(())
}

#[tokio::test]
async fn an_unchecked_local_clock_is_off_by_its_skew() -> anyhow::Result<()> {
    // The control: trusting the client's clock gets server time wrong by the skew.
    let t = TestDb::new("clock_local_control").await?;
    let time =
        TimeSource::local_unchecked(LocalClock::with_offset_ms(30_000), ClockOptions::default())?;
    let (_, server, _) = server_reading(&t.client).await?;
    let now = time.now().await?;
    assert!(now.estimate_ms - server > 29_000);
    Ok(())
}

#[tokio::test]
async fn a_failed_refresh_keeps_the_last_sample() -> anyhow::Result<()> {
    let Some(mut t) = TestDb::dedicated("clock_refresh_failure").await? else {
        return Ok(());
    };
    let time = TimeSource::server(
        t.client.clone(),
        ClockOptions::default()
            .refresh(Duration::from_millis(1))
            .hello_timeout(Duration::from_secs(2)),
    )?;
    let first = time.now().await?;
    assert_eq!(time.stats().samples, 1);
    let server = t
        .server_mut()
        .ok_or_else(|| anyhow::anyhow!("dedicated server"))?;
    server.pause().await?;
    tokio::time::sleep(Duration::from_millis(20)).await; // the sample is now stale
    let during = tokio::time::timeout(Duration::from_secs(40), time.now()).await;
    server.resume().await?;
    let during = during??;
    // The refresh could not reach the server, so the old sample was used: no new sample
    // was stored, one refresh failed, and the bound grew by the drift of the ≥ 2 s wait.
    let stats = time.stats();
    assert_eq!(
        stats.samples, 1,
        "no new sample while the server was paused"
    );
    assert_eq!(stats.failed_refreshes, 1, "{stats:?}");
    assert!(during.estimate_ms >= first.estimate_ms + 2_000);
    assert!(
        during.bound_ms > first.bound_ms,
        "the old sample's bound widens with drift: {first:?} then {during:?}"
    );
    Ok(())
}

/// Whether `now` is within its bound of the server's own reading, taken right after.
async fn within_bound(
    time: &TimeSource,
    client: &mongodb::Client,
) -> anyhow::Result<(bool, String)> {
    let (_, server_before, _) = server_reading(client).await?;
    let now = time.now().await?;
    let (_, server_after, _) = server_reading(client).await?;
    let ok = now.estimate_ms + now.bound_ms >= server_before
        && now.estimate_ms - now.bound_ms <= server_after;
    Ok((
        ok,
        format!("{now:?} vs server [{server_before}, {server_after}]"),
    ))
}

#[tokio::test]
async fn a_wall_clock_step_of_20s_between_samples_leaves_now_within_its_bound() -> anyhow::Result<()>
{
    let t = TestDb::new("clock_wall_step").await?;
    let local = LocalClock::system();
    let time =
        TimeSource::server_with_local(t.client.clone(), local.clone(), ClockOptions::default())?;
    time.now().await?;
    for step in [20_000_i64, -40_000, 20_000] {
        local.step_ms(step);
        let (ok, what) = within_bound(&time, &t.client).await?;
        assert!(ok, "after a wall-clock step of {step} ms: {what}");
    }
    assert_eq!(
        time.stats().wall_clock_steps,
        3,
        "each step is noticed and re-sampled"
    );
    Ok(())
}

#[tokio::test]
async fn control_projecting_on_the_wall_clock_moves_with_the_step() -> anyhow::Result<()> {
    let t = TestDb::new("clock_wall_step_control").await?;
    let local = LocalClock::system();
    let time = TimeSource::server_with_local(
        t.client.clone(),
        local.clone(),
        ClockOptions::default().unsafe_wall_clock_projection(),
    )?;
    time.now().await?;
    local.step_ms(20_000);
    let (ok, what) = within_bound(&time, &t.client).await?;
    assert!(
        !ok,
        "control: a wall-clock projection should be 20 s off: {what}"
    );
    Ok(())
}

/// A holder's lease is never taken over because the taker's wall clock stepped forward.
async fn takeover_after_step(test: &str, options: ClockOptions) -> anyhow::Result<bool> {
    let t = TestDb::new(test).await?;
    let holder_time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let locks = LockCollection::open(&t.db, "locks", holder_time, LockOptions::default()).await?;
    let holder = Owner::random();
    let lease = locks
        .try_acquire(&holder, "r", Duration::from_secs(10))
        .await?
        .ok_or_else(|| anyhow::anyhow!("the first acquire succeeds"))?;
    let local = LocalClock::system();
    let taker_time = TimeSource::server_with_local(t.client.clone(), local.clone(), options)?;
    let taker = LockCollection::open(&t.db, "locks", taker_time, LockOptions::default()).await?;
    let other = Owner::random();
    assert!(
        taker
            .try_acquire(&other, "r", Duration::from_secs(10))
            .await?
            .is_none()
    );
    local.step_ms(20_000);
    let stolen = taker
        .try_acquire(&other, "r", Duration::from_secs(10))
        .await?;
    if stolen.is_none() {
        locks.release(&lease).await?;
    }
    Ok(stolen.is_some())
}

#[tokio::test]
async fn a_holders_lease_is_never_taken_over_because_of_a_wall_clock_step() -> anyhow::Result<()> {
    let stolen = takeover_after_step("lease_wall_step", ClockOptions::default()).await?;
    assert!(
        !stolen,
        "a 20 s wall-clock step let another owner take a live lease"
    );
    let stolen = takeover_after_step(
        "lease_wall_step_control",
        ClockOptions::default().unsafe_wall_clock_projection(),
    )
    .await?;
    assert!(
        stolen,
        "control: with the wall-clock projection the step steals the lease"
    );
    Ok(())
}

/// Connects with a [`PrimaryWatch`] installed, as an application would.
async fn watched_client(uri: &str) -> anyhow::Result<(mongodb::Client, PrimaryWatch)> {
    let mut options = mongodb::options::ClientOptions::parse(uri).await?;
    options.server_selection_timeout = Some(Duration::from_secs(20));
    let watch = PrimaryWatch::install(&mut options);
    Ok((mongodb::Client::with_options(options)?, watch))
}

#[tokio::test]
async fn a_new_primary_makes_the_next_now_resample() -> anyhow::Result<()> {
    let Some(mut t) = TestDb::dedicated("clock_new_primary").await? else {
        return Ok(());
    };
    let (client, watch) = watched_client(t.uri()).await?;
    let watched = TimeSource::server(
        client.clone(),
        ClockOptions::default().primary_watch(watch.clone()),
    )?;
    // The control: the same client, no watch.
    let unwatched = TimeSource::server(client.clone(), ClockOptions::default())?;
    watched.now().await?;
    unwatched.now().await?;
    let epoch = watch.epoch();
    let server = t
        .server_mut()
        .ok_or_else(|| anyhow::anyhow!("dedicated server"))?;
    // A restart is what a client sees of a failover on a one-member set: the primary goes
    // away and a primary (with its own clock) comes back.
    server.restart().await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while watch.epoch() == epoch {
        assert!(
            std::time::Instant::now() < deadline,
            "the driver never reported the primary again"
        );
        // Any operation makes the driver notice the restart.
        let _ = client
            .database("admin")
            .run_command(doc! { "ping": 1 })
            .await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    watched.now().await?;
    unwatched.now().await?;
    let stats = watched.stats();
    assert_eq!(
        stats.samples, 2,
        "the new primary's clock was sampled: {stats:?}"
    );
    assert_eq!(stats.primary_changes, 1);
    assert_eq!(
        unwatched.stats().samples,
        1,
        "control: without the watch the old primary's sample is kept for the refresh period"
    );
    Ok(())
}

/// Session 16: `samples` was unbounded. Each sample is a `hello` round trip (with its own
/// `hello_timeout`) made while every other `now()` of the source waits for the refresh, so
/// `samples(usize::MAX)` stalled every lease operation for good instead of being refused.
/// The limit is `docwarden::clock::MAX_SAMPLES` (16).
#[tokio::test]
async fn clock_samples_are_bounded() -> anyhow::Result<()> {
    let t = TestDb::new("clock_samples_bounded").await?;
    for (samples, ok) in [(1, true), (16, true), (17, false), (usize::MAX, false)] {
        let r = TimeSource::server(t.client.clone(), ClockOptions::default().samples(samples));
        match r {
            Ok(_) => assert!(ok, "{samples} samples were accepted"),
            Err(docwarden::Error::InvalidInput {
                what: "clock samples",
                ..
            }) => assert!(!ok, "{samples} samples were refused"),
            Err(e) => anyhow::bail!("{samples} samples: {e}"),
        }
    }
    Ok(())
}
