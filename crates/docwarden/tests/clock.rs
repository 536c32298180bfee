//! The server clock against the real server: a skewed client still knows server time.

use docwarden::clock::{ClockOptions, LocalClock, TimeSource};
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
        return Ok(()); // needs a server the test can stop
    };
    let time = TimeSource::server(
        t.client.clone(),
        ClockOptions::default().refresh(std::time::Duration::from_millis(1)),
    )?;
    let first = time.now().await?;
    let server = t
        .server_mut()
        .ok_or_else(|| anyhow::anyhow!("dedicated server"))?;
    server.pause().await?;
    tokio::time::sleep(std::time::Duration::from_millis(20)).await; // the sample is now stale
    let during = tokio::time::timeout(std::time::Duration::from_secs(40), time.now()).await;
    server.resume().await?;
    let during = during??;
    // The refresh could not reach the server, so the old sample was used, with drift added.
    assert!(during.estimate_ms >= first.estimate_ms + 20);
    assert!(during.bound_ms >= first.bound_ms);
    Ok(())
}
