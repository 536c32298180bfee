//! `docwarden verify semaphore|limits|rwlock` judge holders' stretches in the server's
//! order (marker writes and their `operationTime`, `docwarden::check::order`), never by
//! the workers' clocks: under the clock faults (`skew`, `step`, `drift`) a short safe run
//! reports 0 violations with every clock fault injected and stretches recorded, and the
//! control (`--control`) still reports violations of the module's kind.
//!
//! Three modules, a safe and a control run each, a few seconds per run.

mod common;

use common::{count, verify, workloads};

/// Runs `module` safe under the clock faults, then as its control, and checks both.
fn clock_faults_then_control(module: &str, kind: &str) -> anyhow::Result<()> {
    let (code, json) = verify(&[
        module,
        "--faults",
        "skew,step,drift",
        "--duration",
        "6",
        "--seed",
        "17",
    ])?;
    assert_eq!(json["violations"].as_u64(), Some(0), "{json:#}");
    assert_eq!(code, 0, "{json:#}");
    for w in workloads(&json)? {
        for fault in ["skew", "step", "drift"] {
            assert!(count(w, "faults", fault) > 0, "{fault} not injected: {w:#}");
        }
        assert!(
            w["operations"].as_u64().unwrap_or(0) > 0,
            "nothing recorded: {w:#}"
        );
    }
    let (code, json) = verify(&[module, "--control", "--duration", "6", "--seed", "17"])?;
    let bit: u64 = workloads(&json)?
        .iter()
        .map(|w| count(w, "violations_by_kind", kind))
        .sum();
    assert!(bit > 0, "the control did not bite with {kind}: {json:#}");
    assert_eq!(code, 1, "{json:#}");
    Ok(())
}

#[test]
fn semaphore_in_the_servers_order() -> anyhow::Result<()> {
    clock_faults_then_control("semaphore", "semaphore-over-capacity")
}

#[test]
fn limits_in_the_servers_order() -> anyhow::Result<()> {
    clock_faults_then_control("limits", "over-concurrency-limit")
}

#[test]
fn rwlock_in_the_servers_order() -> anyhow::Result<()> {
    clock_faults_then_control("rwlock", "rw-overlap")
}
