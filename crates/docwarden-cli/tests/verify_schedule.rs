//! `docwarden verify schedule` end to end (issue 15, item 1): 8 worker processes race
//! for the ticks of a 1 s schedule under `sigkill` and `sigstop`, and every tick is
//! enqueued exactly once; the control (random tick ids) enqueues ticks twice.

mod common;

use common::{count, verify, violations, workloads};

#[test]
fn every_tick_once_under_kills_and_stops_and_the_control_duplicates() -> anyhow::Result<()> {
    let (code, json) = verify(&[
        "schedule",
        "--duration",
        "6",
        "--faults",
        "sigkill,sigstop",
        "--seed",
        "21",
    ])?;
    assert_eq!(json["violations"], 0, "{json:#}");
    assert_eq!(code, 0);
    let w = &workloads(&json)?[0];
    assert!(
        w["operations"].as_u64().unwrap_or(0) >= 4,
        "ticks enqueued: {w:#}"
    );
    for fault in ["sigkill", "sigstop"] {
        assert!(count(w, "faults", fault) > 0, "{fault} not injected: {w:#}");
    }

    let (code, json) = verify(&["schedule", "--control", "--duration", "6", "--seed", "22"])?;
    assert_eq!(code, 1, "{json:#}");
    let w = &workloads(&json)?[0];
    assert!(violations(w) > 0, "the control found nothing: {w:#}");
    assert!(
        count(w, "violations_by_kind", "duplicate-tick") > 0,
        "{w:#}"
    );
    Ok(())
}
