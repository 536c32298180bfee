//! A resignation cut short must still name its term in the history.
//!
//! `docwarden verify election --faults all` reported `two-leaders` about one run in ten
//! (sessions 18–19): "process 22 won term 25 while process 20 claimed term 23 valid for
//! 545 ms more". Process 20's task was aborted (the `kill` fault) while its resignation of
//! term 23 was in flight; the resignation landed, and the next campaigns won at once. The
//! history recorded the abandoned resignation as indeterminate (it may have landed) but
//! without its term, because the term was only added when the call returned; the checker
//! matches resignations to terms, so term 23 counted as never resigned and every later
//! term as a second leader. The workload now records the resignation (and each fenced
//! write) with its term from the start (`History::record_with_token`).
//!
//! Here a leader's round is aborted while its resignation is held by MongoDB's
//! `failCommand` fail point (`blockConnection`, matched by the client's application name,
//! after the round's three fenced writes), then another process campaigns. The abandoned
//! resignation must carry the term, and the checker must find no violation. Fail points are
//! server-wide: this file is its own test binary with one test.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use docwarden::check::election::{ELECT_OP, RESIGN_OP, WRITE_OP};
use docwarden::check::{History, OpOutcome};
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::Owner;
use docwarden_testkit::fail_commands_off;
use docwarden_workloads::Mode;
use docwarden_workloads::election::{self, Leaders};
use mongodb::bson::doc;

/// The application name of the leader whose resignation is held.
const APP: &str = "abandoned-resign";

#[tokio::test]
async fn an_abandoned_resignation_is_recorded_with_its_term() -> anyhow::Result<()> {
    let test = "an_abandoned_resignation_is_recorded_with_its_term";
    let Some((t, admin, leader_client)) = docwarden_testkit::app_faults(test, APP).await? else {
        return Ok(());
    };
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let leader_time = TimeSource::server(leader_client.clone(), ClockOptions::default())?;
    Leaders::setup(&t.db, time.clone()).await?;
    let other = Leaders::new(&t.db, time.clone(), Mode::Safe)?;
    let leader = Leaders::new(
        &leader_client.database(t.db.name()),
        leader_time,
        Mode::Safe,
    )?;
    let history = Arc::new(History::new());

    // A first round, so that the election document has its token block (the campaign is
    // then one `findAndModify`, no `update`).
    other.round(&history, 2, &Owner::random(), None).await?;

    // The leader's fourth `update` (after its three fenced writes) is its resignation:
    // held 300 ms by the server before it runs.
    admin
        .database("admin")
        .run_command(doc! {
            "configureFailPoint": "failCommand",
            "mode": { "skip": 3 },
            "data": {
                "failCommands": ["update"],
                "blockConnection": true,
                "blockTimeMS": 300,
                "appName": APP,
            },
        })
        .await?;
    let round = {
        let history = Arc::clone(&history);
        tokio::spawn(async move {
            leader
                .round(&history, 1, &Owner::random(), None)
                .await
                .map(|_| ())
        })
    };
    // Its three writes done, the round sleeps 20 ms and resigns: abort it 100 ms later,
    // while the resignation is held.
    let deadline = Instant::now() + Duration::from_secs(10);
    while history
        .events()
        .iter()
        .filter(|e| e.process == 1 && e.op == WRITE_OP)
        .count()
        < 3
    {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the leader never wrote three times"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    round.abort();
    let _ = round.await;
    // Another process campaigns: it wins once the held resignation lands.
    other.round(&history, 3, &Owner::random(), None).await?;
    fail_commands_off(&admin).await?;

    let events = history.events();
    let term = events
        .iter()
        .find(|e| e.process == 1 && e.op == ELECT_OP && e.outcome == OpOutcome::Ok)
        .and_then(|e| e.token)
        .context("the leader's term")?;
    let resign = events
        .iter()
        .find(|e| e.process == 1 && e.op == RESIGN_OP)
        .context("the leader's resignation")?;
    let won_after = events
        .iter()
        .filter(|e| e.process == 3 && e.op == ELECT_OP && e.outcome == OpOutcome::Ok)
        .count();
    let log = Leaders::log(&t.db).await?;
    let violations = election::check(&events, &log);
    println!(
        "term {term}; resignation: {:?}, token {:?}; later terms won: {won_after}; violations: {violations:?}",
        resign.outcome, resign.token
    );
    assert_eq!(
        resign.outcome,
        OpOutcome::Indeterminate,
        "the resignation was not cut short: {resign:?}"
    );
    assert_eq!(
        resign.token,
        Some(term),
        "the abandoned resignation does not name its term"
    );
    assert!(violations.is_empty(), "{violations:#?}");
    Ok(())
}
