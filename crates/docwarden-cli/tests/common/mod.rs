//! What the `docwarden verify` test files share: run the binary with `--json`, and read
//! its summary. (Each test file compiles this module on its own and uses part of it.)
#![allow(dead_code)]

use std::process::Command;

/// Runs `docwarden verify ARGS --json`: the exit code and the summary. Fails when
/// anything in the run panicked (stderr names it).
pub(crate) fn verify(args: &[&str]) -> anyhow::Result<(i32, serde_json::Value)> {
    let out = Command::new(env!("CARGO_BIN_EXE_docwarden"))
        .arg("verify")
        .args(args)
        .arg("--json")
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| anyhow::anyhow!("{e}: {stderr}"))?;
    // No thread of the run or of its worker processes panicked, not even in a task whose
    // panic the runtime caught (the driver's session cleanup at a process's exit did).
    anyhow::ensure!(
        !stderr.contains("panicked at"),
        "a thread panicked during the run:\n{stderr}"
    );
    Ok((out.status.code().unwrap_or(-1), json))
}

/// The summary's workloads.
pub(crate) fn workloads(json: &serde_json::Value) -> anyhow::Result<&Vec<serde_json::Value>> {
    json["workloads"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("no workloads in {json:#}"))
}

/// `w[field][key]` as a count (0 when absent): `count(w, "faults", "pause")`,
/// `count(w, "violations_by_kind", "lost-update")`.
pub(crate) fn count(w: &serde_json::Value, field: &str, key: &str) -> u64 {
    w[field][key].as_u64().unwrap_or(0)
}

/// Every violation of one workload, of any kind.
pub(crate) fn violations(w: &serde_json::Value) -> u64 {
    w["violations_by_kind"].as_object().map_or(0, |m| {
        m.values().filter_map(serde_json::Value::as_u64).sum()
    })
}
