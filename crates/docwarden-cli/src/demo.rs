//! `docwarden demo`: the seed scenarios, narrated, each ending in a count of violations.
//!
//! Every scenario lives in its own file under `demo/` and returns a [`ScenarioReport`];
//! `docwarden demo` with no argument runs them all and prints a summary table.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use mongodb::Database;

use crate::conn::ConnArgs;

/// Set by `--json`: narration goes to stderr so stdout holds only the JSON summary.
pub(crate) static NARRATE_TO_STDERR: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// `println!` for a scenario's narration: stdout normally, stderr under `--json`.
macro_rules! narrate {
    ($($arg:tt)*) => {
        if $crate::demo::NARRATE_TO_STDERR.load(std::sync::atomic::Ordering::Relaxed) {
            eprintln!($($arg)*);
        } else {
            println!($($arg)*);
        }
    };
}
pub(crate) use narrate;

mod enrich;
mod enrollment;
mod locks;
mod on_call;

/// Arguments of `docwarden demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Which scenario to run; all of them when omitted.
    scenario: Option<Scenario>,
    #[command(flatten)]
    conn: ConnArgs,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// Serve the dashboard (`docwarden ui`, read-only) on the demo's database while the
    /// scenarios run, print its URL, and keep it up until Enter is pressed at the end.
    #[arg(long)]
    ui: bool,
}

/// The seed scenarios.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Scenario {
    /// Only check the server (what `docwarden doctor` prints, in short).
    Server,
    /// Seed 000: doctors on call; racing toggles never leave a shift uncovered.
    #[value(name = "on-call")]
    OnCall,
    /// Seed 003 (document locks) and seed 004 (lock collection with fencing tokens).
    Locks,
    /// Seed 001: enroll/unenroll messages shuffled and duplicated still converge.
    Enrollment,
    /// Seed 002: workers enrich messages from a geo HTTP service through the job queue.
    Enrich,
}

impl Scenario {
    fn all() -> Vec<Scenario> {
        vec![
            Scenario::Server,
            Scenario::OnCall,
            Scenario::Locks,
            Scenario::Enrollment,
            Scenario::Enrich,
        ]
    }
}

/// What one scenario did. A scenario file returns one or more of these; each measures its
/// own `elapsed`.
#[derive(Debug, serde::Serialize)]
pub(crate) struct ScenarioReport {
    pub(crate) scenario: &'static str,
    pub(crate) operations: u64,
    pub(crate) violations: u64,
    #[serde(serialize_with = "as_secs")]
    pub(crate) elapsed: Duration,
}

fn as_secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

pub(crate) async fn run(args: Args) -> anyhow::Result<ExitCode> {
    NARRATE_TO_STDERR.store(args.json, std::sync::atomic::Ordering::Relaxed);
    let session = args.conn.open(args.json).await?;
    let scenarios = args.scenario.map_or_else(Scenario::all, |s| vec![s]);
    let db = session
        .client
        .database(&format!("docwarden_demo_{:08x}", rand::random::<u32>()));
    let dashboard = if args.ui {
        let running = crate::ui::start(
            session.client.clone(),
            db.clone(),
            crate::ui::UiConfig::read_only_local(),
        )
        .await?;
        // On stderr under --json, so stdout stays one JSON document.
        if args.json {
            eprintln!("dashboard: {}", running.url);
        } else {
            println!("dashboard: {} (watch the scenarios live)", running.url);
        }
        Some(running)
    } else {
        None
    };
    let mut reports = Vec::new();
    for scenario in scenarios {
        reports.extend(run_one(scenario, &session, &db).await?);
    }
    if let Some(running) = dashboard {
        eprintln!(
            "dashboard still up at {}: press Enter to stop it and drop the demo database",
            running.url
        );
        // Returns at once when standard input is closed (scripts, tests).
        let _ =
            tokio::task::spawn_blocking(|| std::io::stdin().read_line(&mut String::new())).await;
        drop(running);
    }
    db.drop().await?;
    let violations: u64 = reports.iter().map(|r| r.violations).sum();
    if args.json {
        crate::output::print_json(&reports)?;
    } else {
        println!();
        println!(
            "{:<18} {:>10} {:>10} {:>9}",
            "scenario", "operations", "violations", "time"
        );
        for r in &reports {
            println!(
                "{:<18} {:>10} {:>10} {:>8.1}s",
                r.scenario,
                r.operations,
                r.violations,
                r.elapsed.as_secs_f64()
            );
        }
    }
    Ok(if violations == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

async fn run_one(
    scenario: Scenario,
    session: &crate::conn::Session,
    _db: &Database,
) -> anyhow::Result<Vec<ScenarioReport>> {
    match scenario {
        Scenario::OnCall => on_call::run(_db).await,
        Scenario::Locks => locks::run(session, _db).await,
        Scenario::Enrollment => enrollment::run(_db).await,
        Scenario::Enrich => enrich::run(session, _db).await,
        Scenario::Server => {
            let started = Instant::now();
            let r =
                crate::doctor::gather(&session.client, &session.uri(), session.embedded()).await?;
            narrate!("== server: {} ({})", r.server_version, r.topology);
            let supported = r
                .capabilities
                .rows()
                .iter()
                .filter(|(_, s)| s.is_supported())
                .count();
            narrate!(
                "   clock offset {:+} ms ± {} ms; {supported} of {} capabilities supported",
                r.clock_offset_ms,
                r.clock_bound_ms,
                r.capabilities.rows().len()
            );
            Ok(vec![ScenarioReport {
                scenario: "server",
                operations: 1,
                violations: 0,
                elapsed: started.elapsed(),
            }])
        }
    }
}
