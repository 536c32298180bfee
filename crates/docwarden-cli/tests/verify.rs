//! `docwarden verify` end to end: with faults every checker reports 0 violations and
//! every fault is actually injected; the control run (safeguards off) must fail.

mod common;

use common::verify;

#[test]
fn all_workloads_under_faults_report_zero_violations() -> anyhow::Result<()> {
    // The restart fault needs the embedded server.
    let faults = if std::env::var_os("MONGODB_URI").is_some() {
        "pause,kill,skew"
    } else {
        "pause,kill,skew,restart"
    };
    let (code, json) = verify(&["all", "--duration", "5", "--faults", faults, "--seed", "7"])?;
    assert_eq!(json["violations"], 0, "{json:#}");
    assert_eq!(code, 0);
    let workloads = json["workloads"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("workloads"))?;
    assert_eq!(workloads.len(), 4);
    for w in workloads {
        for fault in faults.split(',').filter(|f| *f != "skew") {
            assert!(
                w["faults"][fault].as_u64().unwrap_or(0) > 0,
                "{} did not inject {fault}: {w:#}",
                w["workload"]
            );
        }
    }
    // Skew applies to the lease-based workloads (each worker gets its own clock).
    for w in workloads
        .iter()
        .filter(|w| w["workload"] == "locks" || w["workload"] == "queue")
    {
        assert!(w["faults"]["skew"].as_u64().unwrap_or(0) > 0, "{w:#}");
    }
    Ok(())
}

#[test]
fn the_control_run_reports_violations_in_every_workload() -> anyhow::Result<()> {
    let (code, json) = verify(&["all", "--control", "--duration", "8", "--seed", "8"])?;
    assert_eq!(code, 1, "{json:#}");
    for w in json["workloads"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("workloads"))?
    {
        let n: u64 = w["violations_by_kind"]
            .as_object()
            .map(|m| m.values().filter_map(serde_json::Value::as_u64).sum())
            .unwrap_or(0);
        assert!(
            n > 0,
            "the control of {} found nothing: {w:#}",
            w["workload"]
        );
    }
    Ok(())
}

#[test]
fn the_html_report_has_a_timeline() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("report.html");
    let path_str = path.to_str().ok_or_else(|| anyhow::anyhow!("path"))?;
    let (code, _) = verify(&[
        "locks",
        "--duration",
        "3",
        "--faults",
        "pause,kill",
        "--report",
        path_str,
    ])?;
    assert_eq!(code, 0);
    let html = std::fs::read_to_string(&path)?;
    assert!(html.contains("<svg"), "a timeline picture");
    assert!(html.contains("process 0"), "one lane per process");
    assert!(html.contains("token"), "lease bars carry their tokens");
    assert!(html.contains("fault"), "fault windows are drawn");
    Ok(())
}

#[test]
fn latency_and_connection_resets_through_the_proxy_break_nothing() -> anyhow::Result<()> {
    if std::env::var_os("MONGODB_URI").is_some() {
        docwarden_testkit::skip(
            "latency_and_connection_resets_through_the_proxy_break_nothing",
            "the proxy fronts a single embedded 127.0.0.1 server and MONGODB_URI is set",
        );
        return Ok(());
    }
    let (code, json) = verify(&[
        "locks",
        "--duration",
        "4",
        "--faults",
        "latency,reset",
        "--seed",
        "9",
    ])?;
    assert_eq!(code, 0, "{json:#}");
    let w = &json["workloads"][0];
    assert!(w["faults"]["latency"].as_u64().unwrap_or(0) > 0, "{w:#}");
    assert!(w["faults"]["reset"].as_u64().unwrap_or(0) > 0, "{w:#}");
    Ok(())
}

#[test]
fn clock_steps_drift_and_fail_points_break_nothing() -> anyhow::Result<()> {
    // The fail points need the embedded server (verify starts it with test commands).
    let faults = if std::env::var_os("MONGODB_URI").is_some() {
        "step,drift"
    } else {
        "step,drift,failpoint-network,failpoint-notprimary,failpoint-latency"
    };
    let (code, json) = verify(&[
        "locks",
        "--duration",
        "4",
        "--faults",
        faults,
        "--seed",
        "11",
    ])?;
    assert_eq!(json["violations"], 0, "{json:#}");
    assert_eq!(code, 0);
    let w = &json["workloads"][0];
    for fault in faults.split(',') {
        assert!(
            w["faults"][fault].as_u64().unwrap_or(0) > 0,
            "{fault} was not injected: {w:#}"
        );
    }
    // Lost replies are recorded as indeterminate and the checker accepts them; how many
    // there are is chance (the driver's one retry usually succeeds after a closed
    // connection), so the count is not asserted here: tests/verify_faults.rs and the
    // checkers' unit tests cover indeterminate outcomes.
    assert!(w["indeterminate"].as_u64().is_some(), "{w:#}");
    Ok(())
}

#[test]
fn the_clock_step_control_projects_on_the_wall_clock_and_fails() -> anyhow::Result<()> {
    let (code, json) = verify(&[
        "locks",
        "--control",
        "--faults",
        "step",
        "--duration",
        "4",
        "--seed",
        "1",
    ])?;
    assert_eq!(code, 1, "{json:#}");
    let w = &json["workloads"][0];
    assert!(w["faults"]["step"].as_u64().unwrap_or(0) > 0, "{w:#}");
    assert!(json["violations"].as_u64().unwrap_or(0) > 0, "{json:#}");
    Ok(())
}
