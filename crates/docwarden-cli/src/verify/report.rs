//! The self-contained HTML report: a summary table and, per workload, a timeline picture
//! (inline SVG, no scripts, no external files) of lock ownership, operations and fault
//! windows.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use docwarden::check::{Event, OpOutcome};
use docwarden_workloads::Process;
use docwarden_workloads::counters::Op;

use super::context::{FAULT_OP, WorkloadResult};

const WIDTH: f64 = 1100.0;
const LANE: f64 = 16.0;
const LEFT: f64 = 90.0;
const MAX_LANES: usize = 40;

/// Renders the whole report.
pub(super) fn html(results: &[WorkloadResult], control: bool, seed: u64) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>docwarden verify report</title>\
<style>body{{font-family:system-ui,sans-serif;margin:24px;color:#222}}table{{border-collapse:collapse}}\
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}.bad{{color:#b00;font-weight:bold}}\
.ok{{color:#070;font-weight:bold}}svg{{border:1px solid #ddd;background:#fcfcfc}}\
.legend span{{display:inline-block;margin-right:14px}}.sw{{display:inline-block;width:12px;height:10px;margin-right:4px;vertical-align:middle}}</style></head><body>\
<h1>docwarden verify</h1><p>seed {seed}{}</p>",
        if control {
            " — <b>control run: safeguards disabled</b>"
        } else {
            ""
        }
    );
    out.push_str("<table><tr><th>workload</th><th>operations</th><th>faults injected</th><th>violations</th></tr>");
    for r in results {
        let faults: Vec<String> = r.faults.iter().map(|(k, n)| format!("{k}={n}")).collect();
        let total: usize = r.violations_by_kind.values().sum();
        let v: Vec<String> = r
            .violations_by_kind
            .iter()
            .map(|(k, n)| format!("{k}={n}"))
            .collect();
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"{}\">{}</td></tr>",
            r.workload,
            r.operations,
            esc(&faults.join(" ")),
            if total == 0 { "ok" } else { "bad" },
            if total == 0 {
                "0".to_owned()
            } else {
                esc(&v.join(" "))
            }
        );
    }
    out.push_str("</table>");
    out.push_str("<p class=\"legend\"><span><i class=\"sw\" style=\"background:#4a7bd0\"></i>lease held (acquire → release), labelled with its token</span>\
<span><i class=\"sw\" style=\"background:#2a2\"></i>operation ok</span><span><i class=\"sw\" style=\"background:#e80\"></i>refused / failed</span>\
<span><i class=\"sw\" style=\"background:#999\"></i>indeterminate</span><span><i class=\"sw\" style=\"background:rgba(220,0,0,.25)\"></i>fault window</span></p>");
    for r in results {
        let _ = write!(out, "<h2>{}</h2>", r.workload);
        out.push_str(&timeline(&r.events));
        if !r.violations.is_empty() {
            out.push_str("<ul>");
            for v in &r.violations {
                let _ = write!(
                    out,
                    "<li class=\"bad\">{}: {} — {}</li>",
                    v.kind,
                    esc(&v.key),
                    esc(&v.detail)
                );
            }
            out.push_str("</ul>");
        }
    }
    out.push_str("</body></html>\n");
    out
}

/// One workload's timeline as an SVG.
fn timeline(events: &[Event]) -> String {
    let end = events.iter().map(|e| e.end_us).max().unwrap_or(1).max(1);
    let lanes: Vec<u32> = events
        .iter()
        .filter(|e| Process::from_id(e.process) != Process::Server)
        .map(|e| e.process)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .take(MAX_LANES)
        .collect();
    let lane_of: BTreeMap<u32, usize> = lanes.iter().enumerate().map(|(i, p)| (*p, i)).collect();
    #[allow(clippy::cast_precision_loss)]
    let x = |us: u64| LEFT + (us as f64 / end as f64) * (WIDTH - LEFT - 10.0);
    #[allow(clippy::cast_precision_loss)]
    let height = 30.0 + LANE * (lanes.len() as f64 + 1.0);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" font-size=\"10\">"
    );
    // Fault windows: server-wide faults as bands across every lane, a worker's own fault
    // (pause, kill) in its lane only.
    for f in events
        .iter()
        .filter(|e| e.op == FAULT_OP && e.key != "skew")
    {
        let (x0, x1) = (x(f.start_us), x(f.end_us));
        #[allow(clippy::cast_precision_loss)]
        let (y, h) = match lane_of.get(&f.process) {
            Some(&lane) => (20.0 + LANE * lane as f64, LANE - 2.0),
            None => (14.0, height - 14.0),
        };
        let _ = write!(
            svg,
            "<rect x=\"{x0:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{h:.1}\" fill=\"rgba(220,0,0,.25)\"><title>{} fault</title></rect>",
            (x1 - x0).max(2.0),
            f.key
        );
        if !lane_of.contains_key(&f.process) {
            let _ = write!(
                svg,
                "<text x=\"{x0:.1}\" y=\"11\" fill=\"#b00\">{}</text>",
                f.key
            );
        }
    }
    for (i, p) in lanes.iter().enumerate() {
        #[allow(clippy::cast_precision_loss)]
        let y = 20.0 + LANE * i as f64;
        let _ = write!(
            svg,
            "<text x=\"4\" y=\"{:.1}\">{}</text>",
            y + 10.0,
            Process::from_id(*p).label()
        );
        let _ = write!(
            svg,
            "<line x1=\"{LEFT}\" x2=\"{WIDTH}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#eee\"/>",
            y + 13.0,
            y + 13.0
        );
    }
    let mut ticks_left: usize = 20_000;
    // Lease holds: an acquire until the same process's next release of that key.
    let mut open: BTreeMap<(u32, &str), &Event> = BTreeMap::new();
    for e in events {
        let Some(&lane) = lane_of.get(&e.process) else {
            continue;
        };
        #[allow(clippy::cast_precision_loss)]
        let y = 20.0 + LANE * lane as f64;
        let op = e.op.as_str();
        match e.outcome {
            OpOutcome::Ok if op == Op::Acquire.as_str() => {
                open.insert((e.process, e.key.as_str()), e);
            }
            _ if op == Op::Release.as_str() => {
                if let Some(a) = open.remove(&(e.process, e.key.as_str())) {
                    let (x0, x1) = (x(a.end_us), x(e.start_us));
                    let _ = write!(
                        svg,
                        "<rect x=\"{x0:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"10\" fill=\"{}\"><title>{} token {}</title></rect>",
                        y + 2.0,
                        (x1 - x0).max(1.5),
                        color(&a.key),
                        esc(&a.key),
                        a.token.unwrap_or_default()
                    );
                    if x1 - x0 > 24.0 {
                        let _ = write!(
                            svg,
                            "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"#fff\">{}</text>",
                            x0 + 2.0,
                            y + 10.0,
                            a.token.unwrap_or_default()
                        );
                    }
                }
            }
            _ if op == FAULT_OP => {}
            // Operation ticks: at most a few per pixel column are visible anyway.
            outcome if ticks_left > 0 => {
                ticks_left -= 1;
                let fill = match outcome {
                    OpOutcome::Ok => "#2a2",
                    OpOutcome::Failed => "#e80",
                    OpOutcome::Indeterminate => "#999",
                };
                let _ = write!(
                    svg,
                    "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"1.5\" height=\"4\" fill=\"{fill}\"/>",
                    x(e.start_us),
                    y + 12.0
                );
            }
            _ => {}
        }
    }
    #[allow(clippy::cast_precision_loss)]
    let seconds = end as f64 / 1e6;
    let _ = write!(
        svg,
        "<text x=\"{:.1}\" y=\"{:.1}\">{seconds:.1} s</text></svg>",
        WIDTH - 50.0,
        height - 2.0
    );
    svg
}

fn color(key: &str) -> &'static str {
    const PALETTE: [&str; 6] = [
        "#4a7bd0", "#7a4ad0", "#2a8a8a", "#c05a9a", "#5a8a2a", "#b07a2a",
    ];
    let h = key.bytes().fold(0_usize, |h, b| {
        h.wrapping_mul(31).wrapping_add(usize::from(b))
    });
    PALETTE[h % PALETTE.len()]
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timeline_draws_holds_and_fault_windows() {
        let events = vec![
            Event::new(1, Op::Acquire.as_str(), "r1", 0, 10).token(7),
            Event::new(1, Op::Write.as_str(), "r1", 20, 30),
            Event::new(1, Op::Release.as_str(), "r1", 500, 510),
            Event::new(Process::Server.id(), FAULT_OP, "restart", 600, 900),
        ];
        let svg = timeline(&events);
        assert!(svg.contains("token 7"));
        assert!(svg.contains("restart fault"));
        assert!(svg.contains("process 1"));
    }
}
