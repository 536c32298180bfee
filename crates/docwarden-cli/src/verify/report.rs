//! The self-contained HTML report: a summary table and, per workload, a timeline picture
//! (inline SVG, no scripts, no external files) of lock ownership, operations and fault
//! windows, and for each violation its counterexample.
//!
//! Lanes: one for the server (its faults: restarts, crashes, stepdowns, partitions,
//! fail-point windows, proxy latency and resets) and one per process (the producer, each
//! worker, the drain). A fault is drawn from its history event alone (`op == "fault"`,
//! `key` = the fault's name, `process` = where it hit, `start_us..end_us` = its window),
//! so a fault added later (say `sigstop`/`sigkill` of an OS-process worker) appears without
//! changes here: a window is a band in its lane, an instant (`start == end`) a mark, a
//! fault recorded at time 0 (a skew or drift the worker lives with) a tag on the lane's
//! label. Every fault name gets its own colour and a legend entry.
//!
//! The counterexample of a violation is the set of operations the checker's finding names:
//! the operations on its key whose token the finding mentions or, when it mentions none,
//! pairs of operations on the key by different processes that overlapped in time (a
//! race), else the key's operations. They are highlighted on the timeline and drawn again
//! in a zoomed picture of their own with a table.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use docwarden::check::{Event, OpOutcome, Violation};
use docwarden_workloads::Process;
use docwarden_workloads::counters::Op;

use super::context::{FAULT_OP, WorkloadResult};

const WIDTH: f64 = 1300.0;
const LANE: f64 = 16.0;
const LEFT: f64 = 130.0;
const TOP: f64 = 16.0;
const MAX_LANES: usize = 40;
/// Violations per workload that get a counterexample.
const COUNTEREXAMPLES: usize = 5;
/// Operations at most in one counterexample.
const MAX_OPS: usize = 12;

/// Renders the whole report.
pub(super) fn html(results: &[WorkloadResult], control: bool, seed: u64) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>docwarden verify report</title>\
<style>body{{font-family:system-ui,sans-serif;margin:24px;color:#222}}table{{border-collapse:collapse}}\
td,th{{border:1px solid #ccc;padding:3px 7px;text-align:left;font-size:13px}}.bad{{color:#b00;font-weight:bold}}\
.ok{{color:#070;font-weight:bold}}svg{{border:1px solid #ddd;background:#fcfcfc}}tr.hit td{{background:#fee}}\
.legend span{{display:inline-block;margin-right:14px;font-size:13px}}.sw{{display:inline-block;width:12px;height:10px;margin-right:4px;vertical-align:middle}}</style></head><body>\
<h1>docwarden verify</h1><p>seed {seed}{}</p>",
        if control {
            " — <b>control run: safeguards disabled</b>"
        } else {
            ""
        }
    );
    out.push_str("<table><tr><th>workload</th><th>operations</th><th>indeterminate</th><th>faults injected</th><th>violations</th></tr>");
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
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"{}\">{}</td></tr>",
            r.workload,
            r.operations,
            r.indeterminate,
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
    out.push_str(&legend(results));
    for r in results {
        let _ = write!(out, "<h2>{}</h2>", r.workload);
        let examples: Vec<(&Violation, Vec<usize>)> = r
            .violations
            .iter()
            .take(COUNTEREXAMPLES)
            .map(|v| (v, counterexample(v, &r.events)))
            .collect();
        let highlighted: BTreeSet<usize> = examples
            .iter()
            .flat_map(|(_, ops)| ops.iter().copied())
            .collect();
        out.push_str(&timeline(&r.events, &highlighted));
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
        for (i, (v, ops)) in examples.iter().enumerate() {
            out.push_str(&counterexample_html(i + 1, v, ops, &r.events));
        }
    }
    out.push_str("</body></html>\n");
    out
}

/// The legend: operations, holds, and one entry per fault name in the results.
fn legend(results: &[WorkloadResult]) -> String {
    let mut out = String::from(
        "<p class=\"legend\"><span><i class=\"sw\" style=\"background:#4a7bd0\"></i>lease held (acquire → release), labelled with its token</span>\
<span><i class=\"sw\" style=\"background:#2a2\"></i>operation ok</span><span><i class=\"sw\" style=\"background:#e80\"></i>refused / failed</span>\
<span><i class=\"sw\" style=\"background:#999\"></i>indeterminate</span>\
<span><i class=\"sw\" style=\"background:none;border:2px solid #d00\"></i>counterexample operation</span></p><p class=\"legend\">faults: ",
    );
    let names: BTreeSet<&str> = results
        .iter()
        .flat_map(|r| r.events.iter())
        .filter(|e| e.op == FAULT_OP)
        .map(|e| e.key.as_str())
        .collect();
    if names.is_empty() {
        out.push_str("none");
    }
    for name in names {
        let _ = write!(
            out,
            "<span><i class=\"sw\" style=\"background:{}\"></i>{}</span>",
            fault_color(name),
            esc(name)
        );
    }
    out.push_str("</p>");
    out
}

/// The lanes of a timeline: the server first, then every other process (at most
/// [`MAX_LANES`]).
fn lanes_of(events: &[Event]) -> Vec<u32> {
    let mut lanes = vec![Process::Server.id()];
    lanes.extend(
        events
            .iter()
            .map(|e| e.process)
            .filter(|p| *p != Process::Server.id())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .take(MAX_LANES),
    );
    lanes
}

/// One workload's timeline as an SVG; the operations at the indices in `highlighted` are
/// marked.
fn timeline(events: &[Event], highlighted: &BTreeSet<usize>) -> String {
    let end = events.iter().map(|e| e.end_us).max().unwrap_or(1).max(1);
    let lanes = lanes_of(events);
    let lane_of: BTreeMap<u32, usize> = lanes.iter().enumerate().map(|(i, p)| (*p, i)).collect();
    #[allow(clippy::cast_precision_loss)]
    let x = |us: u64| LEFT + (us as f64 / end as f64) * (WIDTH - LEFT - 10.0);
    #[allow(clippy::cast_precision_loss)]
    let lane_y = |lane: usize| TOP + LANE * lane as f64;
    #[allow(clippy::cast_precision_loss)]
    let height = TOP + 14.0 + LANE * lanes.len() as f64;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" font-size=\"10\">"
    );
    // Lane labels, with the faults a process lives with (skew, drift) as tags.
    let mut tags: BTreeMap<u32, BTreeSet<&str>> = BTreeMap::new();
    for f in events
        .iter()
        .filter(|e| e.op == FAULT_OP && e.start_us == 0 && e.end_us == 0)
    {
        tags.entry(f.process).or_default().insert(f.key.as_str());
    }
    for (i, p) in lanes.iter().enumerate() {
        let y = lane_y(i);
        let tag = tags
            .get(p)
            .map(|t| format!(" ({})", t.iter().copied().collect::<Vec<_>>().join(",")))
            .unwrap_or_default();
        let _ = write!(
            svg,
            "<text x=\"4\" y=\"{:.1}\"{}>{}{}</text>",
            y + 10.0,
            if *p == Process::Server.id() {
                " font-weight=\"bold\""
            } else {
                ""
            },
            esc(&Process::from_id(*p).label()),
            esc(&tag)
        );
        let _ = write!(
            svg,
            "<line x1=\"{LEFT}\" x2=\"{WIDTH}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#eee\"/>",
            y + 15.0,
            y + 15.0
        );
    }
    // Fault windows in their lane; a server fault also shades every lane lightly.
    for f in events
        .iter()
        .filter(|e| e.op == FAULT_OP && !(e.start_us == 0 && e.end_us == 0))
    {
        let Some(&lane) = lane_of.get(&f.process) else {
            continue;
        };
        let (x0, x1) = (x(f.start_us), x(f.end_us));
        let color = fault_color(&f.key);
        let title = format!(
            "{} on {}: {:.3}–{:.3} s",
            f.key,
            Process::from_id(f.process).label(),
            secs(f.start_us),
            secs(f.end_us)
        );
        if f.process == Process::Server.id() {
            let _ = write!(
                svg,
                "<rect x=\"{x0:.1}\" y=\"{TOP}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\" opacity=\".12\"/>",
                (x1 - x0).max(1.0),
                height - TOP - 14.0
            );
        }
        let y = lane_y(lane);
        if f.end_us > f.start_us && x1 - x0 >= 1.0 {
            let _ = write!(
                svg,
                "<rect x=\"{x0:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\" opacity=\".8\"><title>{}</title></rect>",
                y + 1.0,
                x1 - x0,
                LANE - 3.0,
                esc(&title)
            );
            if x1 - x0 > 40.0 {
                let _ = write!(
                    svg,
                    "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"#fff\">{}</text>",
                    x0 + 2.0,
                    y + 11.0,
                    esc(&f.key)
                );
            }
        } else {
            // An instant: a kill, a reset, a clock step.
            let _ = write!(
                svg,
                "<path d=\"M{x0:.1} {:.1} l-4 -5 h8 z M{x0:.1} {:.1} V{:.1}\" fill=\"{color}\" stroke=\"{color}\" stroke-width=\"2\"><title>{}</title></path>",
                y + 6.0,
                y + 6.0,
                y + LANE - 1.0,
                esc(&title)
            );
        }
    }
    let mut ticks_left: usize = 20_000;
    // Lease holds: an acquire until the same process's next release of that key.
    let mut open: BTreeMap<(u32, &str), &Event> = BTreeMap::new();
    for (i, e) in events.iter().enumerate() {
        let Some(&lane) = lane_of.get(&e.process) else {
            continue;
        };
        let y = lane_y(lane);
        let op = e.op.as_str();
        if op == FAULT_OP {
            continue;
        }
        if highlighted.contains(&i) {
            let (x0, x1) = (x(e.start_us), x(e.end_us));
            let _ = write!(
                svg,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"none\" stroke=\"#d00\" stroke-width=\"2\"><title>{}</title></rect>",
                x0 - 2.0,
                y,
                (x1 - x0).max(0.0) + 4.0,
                LANE - 1.0,
                esc(&describe(e))
            );
        }
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
            // Operation ticks: at most a few per pixel column are visible anyway.
            outcome if ticks_left > 0 => {
                ticks_left -= 1;
                // A failed or indeterminate operation says why when hovered.
                let title = if outcome == OpOutcome::Ok {
                    String::new()
                } else {
                    format!("<title>{}</title>", esc(&describe(e)))
                };
                let _ = write!(
                    svg,
                    "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"1.5\" height=\"4\" fill=\"{}\">{title}</rect>",
                    x(e.start_us),
                    y + 11.0,
                    outcome_color(outcome)
                );
            }
            _ => {}
        }
    }
    let _ = write!(
        svg,
        "<text x=\"{:.1}\" y=\"{:.1}\">{:.1} s</text><text x=\"{LEFT}\" y=\"{:.1}\">0 s</text></svg>",
        WIDTH - 50.0,
        height - 2.0,
        secs(end),
        height - 2.0
    );
    svg
}

/// The indices of the events that make up `v`'s counterexample (see the module docs).
fn counterexample(v: &Violation, events: &[Event]) -> Vec<usize> {
    let on_key: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| e.key == v.key && e.op != FAULT_OP)
        .map(|(i, _)| i)
        .collect();
    let tokens = numbers_after(&v.detail, "token"); // not a stored field: a word of the detail
    if !tokens.is_empty() {
        let named: Vec<usize> = on_key
            .iter()
            .copied()
            .filter(|&i| events[i].token.is_some_and(|t| tokens.contains(&t)))
            .take(MAX_OPS)
            .collect();
        if !named.is_empty() {
            return named;
        }
    }
    if on_key.len() <= MAX_OPS {
        return on_key;
    }
    // Races: operations on the key by different processes whose calls overlapped, that
    // changed something (not refused, not a read-only check).
    let mut writes: Vec<usize> = on_key
        .iter()
        .copied()
        .filter(|&i| events[i].outcome != OpOutcome::Failed && events[i].op != "check")
        .collect();
    // The history is in order of completion; the scan below wants order of start.
    writes.sort_by_key(|&i| events[i].start_us);
    let mut picked = BTreeSet::new();
    for (n, &a) in writes.iter().enumerate() {
        for &b in &writes[n + 1..] {
            let (ea, eb) = (&events[a], &events[b]);
            if eb.start_us > ea.end_us {
                break;
            }
            if ea.process != eb.process {
                picked.insert(a);
                picked.insert(b);
            }
        }
        if picked.len() >= MAX_OPS {
            break;
        }
    }
    if picked.is_empty() {
        let mut on_key = on_key;
        on_key.sort_by_key(|&i| events[i].start_us);
        on_key.into_iter().rev().take(MAX_OPS).rev().collect()
    } else {
        picked.into_iter().take(MAX_OPS).collect()
    }
}

/// The numbers that follow `word` in `text` ("token 53 after token 54" → [53, 54]).
fn numbers_after(text: &str, word: &str) -> Vec<i64> {
    let words: Vec<&str> = text.split_whitespace().collect();
    words
        .windows(2)
        .filter(|w| w[0] == word)
        .filter_map(|w| {
            w[1].trim_matches(|c: char| !c.is_ascii_digit() && c != '-')
                .parse()
                .ok()
        })
        .collect()
}

/// One counterexample: the finding, a zoomed picture of its operations (and the faults
/// around them), and their table.
fn counterexample_html(n: usize, v: &Violation, ops: &[usize], events: &[Event]) -> String {
    let mut out = format!(
        "<h3>counterexample {n}: <span class=\"bad\">{}</span> on {}</h3><p>{}</p>",
        v.kind,
        esc(&v.key),
        esc(&v.detail)
    );
    if ops.is_empty() {
        out.push_str(
            "<p>(no recorded operation on this key: the finding comes from the final read)</p>",
        );
        return out;
    }
    let from = ops.iter().map(|&i| events[i].start_us).min().unwrap_or(0);
    let to = ops.iter().map(|&i| events[i].end_us).max().unwrap_or(from);
    let pad = ((to - from) / 10).max(2_000);
    let (from, to) = (from.saturating_sub(pad), to + pad);
    let mut lanes: Vec<u32> = ops
        .iter()
        .map(|&i| events[i].process)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let faults: Vec<&Event> = events
        .iter()
        .filter(|e| e.op == FAULT_OP && e.start_us <= to && e.end_us >= from && e.end_us > 0)
        .collect();
    if faults.iter().any(|f| f.process == Process::Server.id()) {
        lanes.insert(0, Process::Server.id());
    }
    let lane_of: BTreeMap<u32, usize> = lanes.iter().enumerate().map(|(i, p)| (*p, i)).collect();
    #[allow(clippy::cast_precision_loss)]
    let x = |us: u64| {
        LEFT + ((us.clamp(from, to) - from) as f64 / (to - from).max(1) as f64)
            * (WIDTH - LEFT - 10.0)
    };
    let row = 22.0;
    #[allow(clippy::cast_precision_loss)]
    let height = TOP + 16.0 + row * lanes.len() as f64;
    let _ = write!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" font-size=\"10\">"
    );
    for (i, p) in lanes.iter().enumerate() {
        #[allow(clippy::cast_precision_loss)]
        let y = TOP + row * i as f64;
        let _ = write!(
            out,
            "<text x=\"4\" y=\"{:.1}\">{}</text><line x1=\"{LEFT}\" x2=\"{WIDTH}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#eee\"/>",
            y + 13.0,
            esc(&Process::from_id(*p).label()),
            y + row - 1.0,
            y + row - 1.0
        );
    }
    for f in &faults {
        let Some(&lane) = lane_of.get(&f.process) else {
            continue;
        };
        #[allow(clippy::cast_precision_loss)]
        let y = TOP + row * lane as f64;
        let (x0, x1) = (x(f.start_us), x(f.end_us));
        let _ = write!(
            out,
            "<rect x=\"{x0:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\" opacity=\".6\"><title>{}</title></rect><text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            y + 2.0,
            (x1 - x0).max(2.0),
            row - 5.0,
            fault_color(&f.key),
            esc(&f.key),
            x0 + 3.0,
            y + 14.0,
            esc(&f.key)
        );
    }
    // Labels: operations too close to label one by one share one label ("acquire t4,
    // touch t4").
    let mut labels: BTreeMap<usize, Vec<(f64, String)>> = BTreeMap::new();
    let mut sorted = ops.to_vec();
    sorted.sort_by_key(|&i| events[i].start_us);
    for &i in &sorted {
        let e = &events[i];
        let Some(&lane) = lane_of.get(&e.process) else {
            continue;
        };
        #[allow(clippy::cast_precision_loss)]
        let y = TOP + row * lane as f64;
        let (x0, x1) = (x(e.start_us), x(e.end_us));
        let _ = write!(
            out,
            "<rect x=\"{x0:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\" stroke=\"#d00\" stroke-width=\"2\"><title>{}</title></rect>",
            y + 3.0,
            (x1 - x0).max(3.0),
            row - 7.0,
            outcome_color(e.outcome),
            esc(&describe(e)),
        );
        let group = labels.entry(lane).or_default();
        match group.last_mut() {
            #[allow(clippy::cast_precision_loss)]
            Some((at, text)) if x0 < *at + 6.0 * text.chars().count() as f64 + 8.0 => {
                text.push_str(", ");
                text.push_str(&short(e));
            }
            _ => group.push((x0, short(e))),
        }
    }
    for (lane, group) in labels {
        #[allow(clippy::cast_precision_loss)]
        let y = TOP + row * lane as f64;
        for (at, text) in group {
            let _ = write!(
                out,
                "<text x=\"{:.1}\" y=\"{:.1}\" font-weight=\"bold\">{}</text>",
                at + 4.0,
                y + 13.0,
                esc(&text)
            );
        }
    }
    let _ = write!(
        out,
        "<text x=\"{LEFT}\" y=\"{:.1}\">{:.3} s</text><text x=\"{:.1}\" y=\"{:.1}\">{:.3} s</text></svg>",
        height - 2.0,
        secs(from),
        WIDTH - 70.0,
        height - 2.0,
        secs(to)
    );
    out.push_str("<table><tr><th>process</th><th>operation</th><th>key</th><th>token</th><th>value</th><th>outcome</th><th>start → end (s)</th><th>detail</th></tr>");
    for &i in ops {
        let e = &events[i];
        let _ = write!(
            out,
            "<tr class=\"hit\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:?}</td><td>{:.3} → {:.3}</td><td>{}</td></tr>",
            esc(&Process::from_id(e.process).label()),
            esc(&e.op),
            esc(&e.key),
            e.token.map(|t| t.to_string()).unwrap_or_default(),
            e.value.map(|v| v.to_string()).unwrap_or_default(),
            e.outcome,
            secs(e.start_us),
            secs(e.end_us),
            esc(&e.detail)
        );
    }
    out.push_str("</table>");
    out
}

/// An operation in one line (tooltips).
fn describe(e: &Event) -> String {
    format!(
        "{} {} {} {:?}{}{}{} {:.3}–{:.3} s {}",
        Process::from_id(e.process).label(),
        e.op,
        e.key,
        e.outcome,
        e.token.map(|t| format!(" token {t}")).unwrap_or_default(),
        e.value.map(|v| format!(" value {v}")).unwrap_or_default(),
        e.span
            .map(|s| format!(" server order {s}"))
            .unwrap_or_default(),
        secs(e.start_us),
        secs(e.end_us),
        e.detail
    )
}

/// An operation's label in the zoomed picture.
fn short(e: &Event) -> String {
    let mut s = e.op.clone();
    if let Some(t) = e.token {
        let _ = write!(s, " t{t}");
    }
    if let Some(v) = e.value {
        let _ = write!(s, " ={v}");
    }
    s
}

#[allow(clippy::cast_precision_loss)]
fn secs(us: u64) -> f64 {
    us as f64 / 1e6
}

fn outcome_color(outcome: OpOutcome) -> &'static str {
    match outcome {
        OpOutcome::Ok => "#2a2",
        OpOutcome::Failed => "#e80",
        OpOutcome::Indeterminate => "#999",
    }
}

fn hash(key: &str) -> usize {
    key.bytes().fold(0_usize, |h, b| {
        h.wrapping_mul(31).wrapping_add(usize::from(b))
    })
}

fn color(key: &str) -> &'static str {
    const PALETTE: [&str; 6] = [
        "#4a7bd0", "#7a4ad0", "#2a8a8a", "#c05a9a", "#5a8a2a", "#b07a2a",
    ];
    PALETTE[hash(key) % PALETTE.len()]
}

/// A fault's colour: fixed for the known ones, from its name for any other.
fn fault_color(name: &str) -> &'static str {
    match name {
        "pause" | "sigstop" => "#d08000",
        "kill" | "sigkill" => "#c00000",
        "crash" => "#800000",
        "restart" => "#a05050",
        "stepdown" => "#8040c0",
        "partition" => "#303030", // not a stored field: the fault's name
        "latency" | "failpoint-latency" => "#d0a000",
        "reset" | "failpoint-network" => "#e04080",
        "failpoint-notprimary" => "#c060c0",
        "step" | "drift" | "skew" => "#0090b0",
        other => {
            const PALETTE: [&str; 5] = ["#b03060", "#607020", "#2060a0", "#a06020", "#506080"];
            PALETTE[hash(other) % PALETTE.len()]
        }
    }
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
            // A fault this file has never heard of, in a worker's lane.
            Event::new(2, FAULT_OP, "sigstop", 100, 700),
            Event::new(2, FAULT_OP, "sigkill", 800, 800),
            Event::new(3, FAULT_OP, "drift", 0, 0),
        ];
        let svg = timeline(&events, &BTreeSet::new());
        assert!(svg.contains("token 7"));
        assert!(svg.contains("restart on server"), "{svg}");
        assert!(svg.contains("sigstop on process 2"), "{svg}");
        assert!(svg.contains("sigkill on process 2"), "{svg}");
        assert!(svg.contains("process 3 (drift)"), "{svg}");
        assert!(svg.contains(">server<"));
    }

    #[test]
    fn a_counterexample_names_the_operations_of_its_tokens() {
        let events = vec![
            Event::new(1, Op::Write.as_str(), "counter-0", 10, 20).token(53),
            Event::new(2, Op::Write.as_str(), "counter-0", 5, 8).token(54),
            Event::new(3, Op::Write.as_str(), "counter-0", 30, 40).token(55),
            Event::new(1, Op::Write.as_str(), "counter-1", 10, 20).token(53),
        ];
        let v = Violation::new(
            "stale-write-accepted",
            "counter-0",
            "process 1 wrote with token 53 after the storage had accepted token 54 from process 2",
        );
        assert_eq!(counterexample(&v, &events), vec![0, 1]);
        let html = counterexample_html(1, &v, &[0, 1], &events);
        assert!(html.contains("counterexample 1"));
        assert!(html.contains("write t53"), "{html}");
    }

    #[test]
    fn without_tokens_a_counterexample_is_the_overlapping_writes() {
        let mut events: Vec<Event> = (0..20_u64)
            .map(|i| Event::new(1, "complete", "job", i * 100, i * 100 + 10))
            .collect();
        events.push(Event::new(2, "complete", "job", 505, 520));
        let v = Violation::new("duplicate-effect", "job", "effect committed 2 times");
        assert_eq!(counterexample(&v, &events), vec![5, 20]);
    }
}
