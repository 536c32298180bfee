//! The run's summary: a table on stdout, or JSON with `--json`.

use docwarden::check::queue::RETRY_EXECUTED_TWICE;

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
    let by_server = by_server(results);
    if json {
        return crate::output::print_json(&serde_json::json!({
            "seed": seed,
            "control": control,
            "faults": faults.iter().map(|f| f.name()).collect::<Vec<_>>(),
            "violations": total,
            "violations_by_server": by_server,
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
    if by_server > 0 {
        println!(
            "  of which {by_server} {RETRY_EXECUTED_TWICE}: the server executed a driver's retry of a write twice \
             (retryable-write deduplication failed), a fault of the server, not of docwarden; see docs/surrogate.md"
        );
    }
    Ok(())
}

/// The violations the checkers attribute to the server rather than to docwarden or the
/// workload: [`RETRY_EXECUTED_TWICE`] (counted among the violations all the same: the
/// run's at-most-once effect was broken, whoever broke it).
fn by_server(results: &[WorkloadResult]) -> usize {
    results
        .iter()
        .filter_map(|r| r.violations_by_kind.get(RETRY_EXECUTED_TWICE))
        .sum()
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
