//! The run's summary: a table on stdout, or JSON with `--json`.

use super::args::Fault;
use super::context::WorkloadResult;

/// Prints the summary (human or JSON) and the final verdict line.
pub(super) fn print(
    results: &[WorkloadResult],
    json: bool,
    seed: u64,
    control: bool,
    faults: &[Fault],
    total: usize,
) -> anyhow::Result<()> {
    if json {
        return crate::output::print_json(&serde_json::json!({
            "seed": seed,
            "control": control,
            "faults": faults.iter().map(|f| f.name()).collect::<Vec<_>>(),
            "violations": total,
            "workloads": results,
        }));
    }
    table(results);
    println!(
        "\n{}",
        if total == 0 {
            "verify: 0 violations".to_owned()
        } else {
            format!("verify: {total} violation(s)")
        }
    );
    Ok(())
}

fn counts(map: &std::collections::BTreeMap<&'static str, impl std::fmt::Display>) -> String {
    map.iter()
        .map(|(k, n)| format!("{k}={n}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn table(results: &[WorkloadResult]) {
    println!(
        "\n{:<9} {:>10}  {:<36} violations",
        "workload", "operations", "faults injected"
    );
    for r in results {
        let faults = if r.faults.is_empty() {
            "-".to_owned()
        } else {
            counts(&r.faults)
        };
        let violations = if r.violations_by_kind.is_empty() {
            "0".to_owned()
        } else {
            counts(&r.violations_by_kind)
        };
        println!(
            "{:<9} {:>10}  {:<36} {violations}",
            r.workload, r.operations, faults
        );
    }
    for r in results {
        for v in r.violations.iter().take(5) {
            println!("  {}: {} on {}: {}", r.workload, v.kind, v.key, v.detail);
        }
    }
}
