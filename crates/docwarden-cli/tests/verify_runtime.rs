//! `docwarden verify queue`, `verify locks` and `verify sequence` over the real runtime (`Worker`,
//! `Watchdog`): under pauses and kills the checkers find nothing, and the control (fencing
//! off) writes under lost leases, which the checkers find.

mod common;

use common::{count, verify};

/// Runs `module` safe under pause and kill (0 violations, both injected), then its control
/// under pause (exit 1, at least one `kind`).
fn safe_and_control(module: &str, kind: &str) -> anyhow::Result<()> {
    let (code, json) = verify(&[
        module,
        "--duration",
        "6",
        "--workers",
        "4",
        "--faults",
        "pause,kill",
        "--seed",
        "5",
    ])?;
    let w = &json["workloads"][0];
    assert_eq!(json["violations"], 0, "{json:#}");
    assert_eq!(code, 0);
    assert!(count(w, "faults", "pause") > 0, "{w:#}");
    assert!(count(w, "faults", "kill") > 0, "{w:#}");

    let (code, json) = verify(&[
        module,
        "--control",
        "--duration",
        "6",
        "--workers",
        "4",
        "--seed",
        "5",
    ])?;
    let w = &json["workloads"][0];
    assert_eq!(code, 1, "{json:#}");
    assert!(count(w, "violations_by_kind", kind) > 0, "{w:#}");
    Ok(())
}

#[test]
fn the_queue_workload_runs_the_worker_and_its_control_writes_under_a_lost_lease()
-> anyhow::Result<()> {
    safe_and_control("queue", "stale-effect")
}

#[test]
fn the_lock_workload_runs_the_watchdog_and_its_control_accepts_stale_writes() -> anyhow::Result<()>
{
    safe_and_control("locks", "stale-write-accepted")
}

#[test]
fn the_registrar_workload_stores_the_sequential_replays_bytes_and_its_control_does_not()
-> anyhow::Result<()> {
    safe_and_control("sequence", "state-mismatch")
}

/// `slow-reply` puts worker 0's clock ~700 ms behind (inside its bound): injected, 0
/// violations; the control under it fails.
#[test]
fn slow_reply_is_injected_and_the_watchdog_keeps_within_the_bound() -> anyhow::Result<()> {
    let args = |control: bool| {
        let mut a = vec![
            "locks",
            "--duration",
            "10",
            "--workers",
            "4",
            "--faults",
            "slow-reply,pause",
            "--seed",
            "3",
        ];
        if control {
            a.push("--control");
        }
        a
    };
    let (code, json) = verify(&args(false))?;
    let w = &json["workloads"][0];
    assert_eq!(json["violations"], 0, "{json:#}");
    assert_eq!(code, 0);
    assert!(count(w, "faults", "slow-reply") > 0, "{w:#}");
    let (code, json) = verify(&args(true))?;
    assert_eq!(code, 1, "{json:#}");
    assert!(json["violations"].as_u64().unwrap_or(0) > 0, "{json:#}");
    Ok(())
}
