//! Issue 14's targets read off one run: each target row beside its **floor**, the same
//! writes sent raw (the `--stages` rows), so a run says by itself how far a missed target
//! is from what the server allows.
//!
//! A floor is the rate of the writes the workload cannot do without, as bare commands on
//! documents of the same shape: the unguarded toggle under the guarded one, the bare
//! `update_one` by `_id` on the in-order row's documents under a sequenced apply (since
//! session 30; before, the bare write on the seed's set, keyed by `student_id` with a
//! members index: another shape), the acquire's and the release's commands sent raw one
//! after the other under a lock pair (since session 31, on a collection with the lock
//! collection's indexes and the release the library sends; before, `1 / (1/a + 1/b)` of
//! two stage rows on a collection without them), the two writes by `_id` under a
//! document lock, and two `updateMany` of 64 jobs under the `Worker`. `share` is the row
//! over its floor: what docwarden's reads, conditions and fences leave of the bare
//! writes. When the floor itself is below the target, no design that makes those writes
//! reaches the target on this server.
//!
//! `CPU bound` is the reference's CPU per operation over the row's (server + client
//! microseconds, both measured in the run): the ratio the row would have if it kept the
//! machine's CPU as busy as the reference does. Where bench and server share a machine
//! and the ratio is near it, the row's cost per operation decides, and only a cheaper
//! operation moves it; well below it, the row leaves CPU idle (it waits on round trips,
//! and more work in flight would help). `—` where a CPU reading is missing (a server
//! given with `--uri`).
//!
//! With `--rounds` the table reads the aggregated rows: every ratio, floor and CPU reading
//! in it is the median of the rounds (the main table's `ratio range` gives each row's
//! spread).

use std::fmt::Write as _;

use super::{BenchRow, REFERENCE, guard, locks, queue, sequence};

/// One target: the row's name, the ratio it should reach, and its floor.
struct Target {
    row: String,
    min: f64,
    /// The stage row that bounds it from above.
    floor: &'static str,
}

fn targets() -> Vec<Target> {
    let worker_floor = || queue::TWO_WRITES;
    vec![
        Target {
            row: queue::worker_name(10_000),
            min: 1.0,
            floor: worker_floor(),
        },
        Target {
            row: queue::worker_name(100_000),
            min: 0.5,
            floor: worker_floor(),
        },
        Target {
            row: locks::PAIR.to_owned(),
            min: 0.4,
            floor: locks::PAIR_STAGE,
        },
        Target {
            row: locks::DOCUMENT.to_owned(),
            min: 0.4,
            floor: locks::DOCUMENT_STAGE,
        },
        Target {
            row: guard::ONE_PER_CALL.to_owned(),
            min: 0.8,
            floor: guard::UNGUARDED,
        },
        Target {
            row: sequence::IN_ORDER.to_owned(),
            min: 0.8,
            floor: sequence::IN_ORDER_BARE,
        },
    ]
}

/// Row `name` at `workers`, if the run has it.
fn row_of<'a>(rows: &'a [BenchRow], name: &str, workers: usize) -> Option<&'a BenchRow> {
    rows.iter().find(|r| r.name == name && r.workers == workers)
}

/// Server + client CPU per operation of row `name` at `workers`, if both were measured.
fn cpu_per_op(rows: &[BenchRow], name: &str, workers: usize) -> Option<f64> {
    let r = row_of(rows, name, workers)?;
    Some(r.server_cpu_us_per_op? + r.client_cpu_us_per_op?).filter(|c| *c > 0.0)
}

/// The ratio of row `name` at `workers`, if the run has it.
fn ratio(rows: &[BenchRow], name: &str, workers: usize) -> Option<f64> {
    row_of(rows, name, workers)
        .map(|r| r.ratio)
        .filter(|r| r.is_finite() && *r > 0.0)
}

/// The `met` cell of a row whose ratio is `got`: `yes` or `no` for the ratio (the median
/// with rounds), and with rounds how many of them met the target on their own, so that a
/// median that meets it in a lucky minority of rounds (or misses it in an unlucky one)
/// says so.
fn met(row: Option<&BenchRow>, got: f64, min: f64) -> String {
    let verdict = if got >= min { "yes" } else { "no" };
    match row {
        Some(r) if r.ratios.len() > 1 => {
            let hits = r.ratios.iter().filter(|x| **x >= min).count();
            format!("{verdict} ({hits} of {} rounds)", r.ratios.len())
        }
        _ => verdict.to_owned(),
    }
}

/// The targets this run measured, as a markdown table (empty when it measured none).
pub(crate) fn markdown(rows: &[BenchRow]) -> String {
    let mut workers: Vec<usize> = rows.iter().map(|r| r.workers).collect();
    workers.sort_unstable();
    workers.dedup();
    let mut lines = String::new();
    for target in targets() {
        for &w in &workers {
            let Some(got) = ratio(rows, &target.row, w) else {
                continue;
            };
            let floor = ratio(rows, target.floor, w);
            let cpu_bound = cpu_per_op(rows, REFERENCE, w)
                .zip(cpu_per_op(rows, &target.row, w))
                .map(|(reference, row)| reference / row);
            let cell = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or("—".to_owned(), f);
            let _ = writeln!(
                lines,
                "| {} | {w} | {got:.2}× | ≥ {:.1}× | {} | {} | {} | {} | {} |",
                target.row,
                target.min,
                met(row_of(rows, &target.row, w), got, target.min),
                cell(floor, &|f| format!("{f:.2}×")),
                cell(floor, &|f| format!("{:.0} %", 100.0 * got / f)),
                cell(floor, &|f| if f >= target.min { "yes" } else { "no" }
                    .to_owned()),
                cell(cpu_bound, &|c| format!("{c:.2}×")),
            );
        }
    }
    if lines.is_empty() {
        return lines;
    }
    let rounds = rows.iter().map(|r| r.rounds).max().unwrap_or(1);
    let medians = if rounds > 1 {
        format!("; ratios, floors and CPU bounds from the medians of {rounds} rounds")
    } else {
        String::new()
    };
    format!(
        "\nTargets (issue 14) and their floors (the same writes sent raw; `--stages`); CPU \
         bound: the reference's server + client CPU per operation over the row's{medians}:\n\n\
         | target row | workers | ratio | target | met | floor | share of floor | floor reaches target | CPU bound |\n\
         |---|---:|---:|---:|---|---:|---:|---|---:|\n{lines}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, workers: usize, ratio: f64) -> BenchRow {
        cpu_row(name, workers, ratio, None)
    }

    /// A row with `cpu` µs of server and as many of client CPU per operation.
    fn cpu_row(name: &str, workers: usize, ratio: f64, cpu: Option<f64>) -> BenchRow {
        BenchRow {
            name: name.to_owned(),
            workers,
            ops: 1,
            ops_per_sec: ratio,
            p50_us: 1,
            p99_us: 1,
            ratio,
            reference_ops_per_sec: 1.0,
            round_trips_per_op: 1.0,
            server_cpu_us_per_op: cpu,
            client_cpu_us_per_op: cpu,
            rounds: 1,
            ratios: vec![ratio],
            ratio_min: ratio,
            ratio_max: ratio,
        }
    }

    #[test]
    fn a_row_is_read_against_its_floor_and_a_missing_floor_is_a_dash() {
        let rows = vec![
            row(locks::PAIR, 8, 0.3),
            row(locks::ACQUIRE_STAGE, 8, 0.6),
            row(locks::PAIR_STAGE, 8, 0.375),
            row(guard::ONE_PER_CALL, 8, 0.7),
        ];
        let table = markdown(&rows);
        // The pair reaches 80 % of its floor, which misses 0.4.
        assert!(
            table.contains(
                "| lock acquire+release | 8 | 0.30× | ≥ 0.4× | no | 0.38× | 80 % | no | — |"
            ),
            "{table}"
        );
        assert!(
            table.contains(&format!(
                "| {} | 8 | 0.70× | ≥ 0.8× | no | — | — | — | — |",
                guard::ONE_PER_CALL
            )),
            "{table}"
        );
    }

    #[test]
    fn the_cpu_bound_is_the_reference_cpu_per_op_over_the_rows() {
        let rows = vec![
            cpu_row(REFERENCE, 8, 1.0, Some(50.0)),
            cpu_row(guard::ONE_PER_CALL, 8, 0.55, Some(75.0)),
            cpu_row(REFERENCE, 1, 1.0, Some(50.0)),
            row(guard::ONE_PER_CALL, 1, 0.6),
        ];
        let table = markdown(&rows);
        // 100 µs per reference write over 150 per guarded update.
        assert!(
            table.contains(&format!(
                "| {} | 8 | 0.55× | ≥ 0.8× | no | — | — | — | 0.67× |",
                guard::ONE_PER_CALL
            )),
            "{table}"
        );
        assert!(
            table.contains(&format!(
                "| {} | 1 | 0.60× | ≥ 0.8× | no | — | — | — | — |",
                guard::ONE_PER_CALL
            )),
            "{table}"
        );
    }

    #[test]
    fn with_rounds_the_heading_says_the_ratios_are_medians() {
        let one = vec![row(guard::ONE_PER_CALL, 8, 0.7)];
        assert!(!markdown(&one).contains("median"), "{}", markdown(&one));
        let rounds = vec![BenchRow {
            rounds: 3,
            ..row(guard::ONE_PER_CALL, 8, 0.7)
        }];
        let table = markdown(&rounds);
        assert!(table.contains("the medians of 3 rounds:"), "{table}");
    }

    #[test]
    fn with_rounds_the_met_cell_counts_the_rounds_that_met_the_target() {
        let rows = vec![BenchRow {
            rounds: 5,
            ratios: vec![0.89, 0.89, 0.86, 1.01, 0.91],
            ..row(locks::DOCUMENT, 8, 0.89)
        }];
        let table = markdown(&rows);
        assert!(
            table.contains(
                "| document lock+release_with | 8 | 0.89× | ≥ 0.4× | yes (5 of 5 rounds) |"
            ),
            "{table}"
        );
        let rows = vec![BenchRow {
            rounds: 5,
            ratios: vec![0.89, 0.89, 0.86, 1.01, 0.91],
            ..row(&queue::worker_name(10_000), 8, 0.89)
        }];
        let table = markdown(&rows);
        assert!(
            table.contains("| 0.89× | ≥ 1.0× | no (1 of 5 rounds) |"),
            "{table}"
        );
    }

    #[test]
    fn a_run_without_target_rows_prints_no_table() {
        assert_eq!(markdown(&[row(REFERENCE, 1, 1.0)]), "");
    }
}
