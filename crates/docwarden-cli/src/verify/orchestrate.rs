//! One run of `docwarden verify`: for each module, a fresh database, the proxy if the
//! faults need it, the workload and the nemesis side by side, then the findings.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use docwarden::check::{Event, History, OpOutcome, Violation, count_by_kind};
use docwarden_workloads::Mode;
use indicatif::{ProgressBar, ProgressStyle};

use super::args::{Args, Fault, FaultArg, Module, WorkersAs};
use super::context::{Ctx, FAULT_OP, Findings, WorkloadResult};
use super::{
    election, guard, limits, locks, nemesis, proxy, queue, report, rwlock, schedule, semaphore,
    sequence, summary,
};

/// The most workers per workload `--workers` accepts.
const MAX_WORKERS: usize = 1024;

/// Runs `docwarden verify`.
pub(crate) async fn run(args: Args) -> anyhow::Result<ExitCode> {
    if args.list_faults || args.faults.contains(&FaultArg::List) {
        list_faults(args.json)?;
        return Ok(ExitCode::SUCCESS);
    }
    let module = args.module.ok_or_else(|| {
        anyhow::anyhow!(
            "which module? one of {} (see --help)",
            <Module as clap::ValueEnum>::value_variants()
                .iter()
                .filter_map(
                    |m| clap::ValueEnum::to_possible_value(m).map(|v| v.get_name().to_owned())
                )
                .collect::<Vec<_>>()
                .join(", ")
        )
    })?;
    anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
    anyhow::ensure!(
        args.workers <= MAX_WORKERS,
        "--workers {} is more than {MAX_WORKERS}: each worker holds connections and, with \
         --workers-as processes, is a process",
        args.workers
    );
    let external = args
        .conn
        .uri
        .as_deref()
        .is_some_and(|u| !u.trim().is_empty());
    let mut faults: Vec<Fault> = Vec::new();
    for f in &args.faults {
        match f {
            FaultArg::One(f) => faults.push(*f),
            // Every fault this setting can inject.
            FaultArg::All => faults.extend(Fault::ALL.iter().filter(|f| {
                (!external || !f.needs_embedded())
                    && (args.workers_as == WorkersAs::Processes || !f.needs_processes())
            })),
            FaultArg::List => {}
        }
    }
    faults.sort();
    faults.dedup();
    if let Some(f) = faults.iter().find(|f| f.needs_processes())
        && args.workers_as != WorkersAs::Processes
    {
        anyhow::bail!(
            "the {} fault needs worker processes (--workers-as processes)",
            f.name()
        );
    }
    // The report's file is created before the run, so a path that cannot be written fails
    // at once instead of after the whole run.
    let report_file = args
        .report
        .as_ref()
        .map(|path| {
            std::fs::File::create(path)
                .with_context(|| format!("cannot write the report to {}", path.display()))
        })
        .transpose()?;
    let mut session = open_session(&args, &faults).await?;
    if let Some(f) = faults.iter().find(|f| f.needs_embedded()) {
        anyhow::ensure!(
            session.embedded(),
            "the {} fault needs the embedded server (run without --uri / MONGODB_URI)",
            f.name()
        );
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    if args.control && faults.is_empty() {
        // The safeguards exist for paused holders: a control run without pauses would prove
        // little, so it brings them along (in-task pauses, and real stops of processes). (`--faults pause,skew` adds wrong client clocks,
        // which the control trusts; under skew the queue control mostly starves instead.)
        faults = vec![Fault::Pause];
        // A paused handler of the real `Worker` keeps its lease (the worker's one heartbeat
        // bulk covers it), so the queue's lease is lost only when the whole worker stops:
        // with workers as processes, the control brings SIGSTOP too.
        if args.workers_as == WorkersAs::Processes {
            faults.push(Fault::Sigstop);
        }
    }
    let run = Run {
        args: &args,
        faults,
    };
    let args = &run;
    let modules = module.expand();
    if !args.args.json {
        eprintln!(
            "docwarden verify: {} workload(s) × {} s, {} workers, faults [{}], seed {seed}{}",
            modules.len(),
            args.args.duration,
            args.args.workers,
            args.faults
                .iter()
                .map(|f| f.name())
                .collect::<Vec<_>>()
                .join(","),
            if args.args.control {
                ", CONTROL (safeguards off)"
            } else {
                ""
            }
        );
    }
    let mut results = Vec::new();
    for module in modules {
        results.push(run_module(args, &mut session, module, seed).await?);
    }
    let total: usize = results
        .iter()
        .map(|r| r.violations_by_kind.values().sum::<usize>())
        .sum();
    // The summary first: a report that cannot be written loses no result.
    summary::print(
        &results,
        args.args.json,
        seed,
        args.args.control,
        &args.faults,
        total,
    )?;
    if let (Some(path), Some(mut file)) = (&args.args.report, report_file) {
        std::io::Write::write_all(
            &mut file,
            report::html(&results, args.args.control, seed).as_bytes(),
        )
        .with_context(|| format!("cannot write the report to {}", path.display()))?;
        if !args.args.json {
            eprintln!("docwarden verify: report written to {}", path.display());
        }
    }
    Ok(if total == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The command line with `--faults` resolved.
struct Run<'a> {
    args: &'a Args,
    faults: Vec<Fault>,
}

/// Prints `--faults list`.
fn list_faults(json: bool) -> anyhow::Result<()> {
    if json {
        let faults: Vec<serde_json::Value> = Fault::ALL
            .iter()
            .map(|f| {
                serde_json::json!({
                    "fault": f.name(),
                    "server": if f.needs_embedded() { "embedded" } else { "any" },
                    "needs_processes": f.needs_processes(),
                    "what": f.describe(),
                    "control": f.control(),
                })
            })
            .collect();
        return crate::output::print_json(&faults);
    }
    println!("{:<22} {:<9} what it does", "fault", "server");
    for f in Fault::ALL {
        println!(
            "{:<22} {:<9} {}\n{:<32} --control: {}",
            f.name(),
            if f.needs_embedded() {
                "embedded"
            } else {
                "any"
            },
            f.describe(),
            "",
            f.control()
        );
    }
    println!(
        "{:<22} {:<9} every fault the setting allows (with --uri: those for any server)",
        "all", ""
    );
    Ok(())
}

/// Opens the run's server. Fail points need test commands, and a crash needs a server that
/// is durable (`--sync-on-commit`), except in a control run where durability is the
/// safeguard turned off: for those faults verify starts its embedded server itself.
async fn open_session(args: &Args, faults: &[Fault]) -> anyhow::Result<crate::conn::Session> {
    let external = args
        .conn
        .uri
        .as_deref()
        .is_some_and(|u| !u.trim().is_empty());
    if external || !faults.iter().any(|f| f.needs_own_server()) {
        return args.conn.open(args.json).await;
    }
    let crash = faults.contains(&Fault::Crash);
    let durable = !(crash && args.control);
    if !args.json {
        eprintln!(
            "docwarden: starting an embedded secantusd-rs{}{}…",
            if faults.iter().any(|f| f.is_failpoint()) {
                " with test commands (fail points)"
            } else {
                ""
            },
            if durable {
                ", durable (--sync-on-commit)"
            } else {
                ", NOT durable (control: no --sync-on-commit)"
            }
        );
    }
    let mut options = docwarden_server::ServerOptions::default()
        .test_commands(faults.iter().any(|f| f.is_failpoint()))
        .durable(durable);
    if let Some(dir) = &args.conn.data_dir {
        options = options.data_dir(dir);
    }
    let server = docwarden_server::EmbeddedServer::start(options).await?;
    let client = docwarden_server::connect(
        &server.uri(),
        Duration::from_secs(args.conn.connect_timeout.max(1)),
    )
    .await?;
    Ok(crate::conn::Session {
        target: docwarden_server::Target::Embedded(server),
        client,
    })
}

/// The workers' URI: `uri` with the application name the fail points match, under
/// `crash` with `journal=true` (writes acknowledged only once journaled: the client's half
/// of durability; the server's half is `--sync-on-commit`, see `open_session`), and in a
/// control run with `retryWrites=false` (the control settles no unknown outcome; the
/// driver's own retry of a write whose reply was lost, deduplicated by the server, must
/// not hide that).
fn worker_uri(uri: &str, journal: bool, control: bool) -> String {
    let sep = if uri.contains('?') {
        "&"
    } else if uri
        .split_once("://")
        .is_some_and(|(_, rest)| rest.contains('/'))
    {
        "?"
    } else {
        "/?"
    };
    format!(
        "{uri}{sep}appName={}{}{}",
        nemesis::WORKER_APP,
        if journal { "&journal=true" } else { "" },
        if control { "&retryWrites=false" } else { "" }
    )
}

async fn run_module(
    args: &Run<'_>,
    session: &mut crate::conn::Session,
    module: Module,
    seed: u64,
) -> anyhow::Result<WorkloadResult> {
    let direct_uri = session.uri();
    let proxy = if args.faults.iter().any(|f| f.needs_proxy()) {
        let addr = upstream_addr(&direct_uri)?;
        Some(proxy::Proxy::start(addr).await?)
    } else {
        None
    };
    let uri = worker_uri(
        &proxy
            .as_ref()
            .map_or_else(|| direct_uri.clone(), proxy::Proxy::uri),
        args.faults.contains(&Fault::Crash),
        args.args.control,
    );
    let client = docwarden_server::connect(&uri, Duration::from_secs(10)).await?;
    let db_name = format!(
        "docwarden_verify_{}_{:08x}",
        module.name(),
        rand::random::<u32>()
    );
    let progress = if args.args.json {
        ProgressBar::hidden()
    } else {
        let bar = ProgressBar::new(args.args.duration);
        bar.set_style(
            ProgressStyle::with_template("{prefix:>9} [{bar:30}] {pos}/{len} s {msg}")?
                .progress_chars("=> "),
        );
        bar.set_prefix(module.name());
        bar
    };
    let ctx = Arc::new(Ctx {
        db: client.database(&db_name),
        server_uri: direct_uri.clone(),
        client: client.clone(),
        history: Arc::new(History::new().abandoned_as(in_flight(args.args.control))),
        faults: args.faults.clone(),
        mode: Mode::control_if(args.args.control),
        workers: args.args.workers,
        duration: Duration::from_secs(args.args.duration),
        seed,
        injected: Mutex::new(BTreeMap::new()),
        progress: progress.clone(),
        clocks: Mutex::new(Vec::new()),
        workers_as: args.args.workers_as,
        uri,
        lease: lease(module),
        slot: None,
    });
    let nemesis = nemesis::run(&ctx, session, proxy.as_ref());
    let workload = dispatch(module, Arc::clone(&ctx));
    let clocks = ctx.clock_nemesis();
    let (findings, nemesis, ()) = tokio::join!(workload, nemesis, clocks);
    nemesis?;
    let findings = findings?;
    progress.finish_and_clear();
    // Clean up through a direct connection (the proxy may be resetting).
    let direct = docwarden_server::connect(&direct_uri, Duration::from_secs(10)).await?;
    direct.database(&db_name).drop().await?;
    let events = ctx.history.events();
    let mut violations = findings.violations;
    violations.extend(nothing_verified(&events));
    let violations_by_kind = count_by_kind(&violations).into_iter().collect();
    violations.truncate(20);
    let indeterminate = events
        .iter()
        .filter(|e| e.outcome == docwarden::check::OpOutcome::Indeterminate)
        .count();
    Ok(WorkloadResult {
        workload: module.name(),
        operations: findings.operations,
        indeterminate: u64::try_from(indeterminate).unwrap_or(u64::MAX),
        faults: ctx.injected_counts(),
        violations_by_kind,
        violations,
        events,
    })
}

/// A module whose history holds no operation that took effect (none recorded, or every
/// one refused or unknown: workers that never got going, a deployment that refuses every
/// write) verified nothing: `nothing-verified`, so that its silence does not pass for
/// "0 violations".
fn nothing_verified(events: &[Event]) -> Option<Violation> {
    let operations = events.iter().filter(|e| e.op != FAULT_OP);
    let recorded = operations.clone().count();
    let mut done = operations.filter(|e| e.outcome == OpOutcome::Ok);
    done.next().is_none().then(|| {
        Violation::new(
            "nothing-verified",
            "history",
            format!(
                "{recorded} operation(s) recorded, none took effect: the checkers had nothing to judge"
            ),
        )
    })
}

/// How a history records an operation whose task was aborted (`kill`): indeterminate;
/// in a control run failed, what a client that takes "no reply" for "not applied"
/// believes (as the supervisor records a SIGKILLed process's in-flight operations).
pub(super) fn in_flight(control: bool) -> docwarden::check::OpOutcome {
    if control {
        docwarden::check::OpOutcome::Failed
    } else {
        docwarden::check::OpOutcome::Indeterminate
    }
}

/// The lease a `sigstop` must outlive (the workloads without leases get short stops).
fn lease(module: Module) -> Duration {
    match module {
        Module::Queue => docwarden_workloads::jobs::LEASE,
        Module::Locks => locks::TTL,
        // A stopped scheduler misses ticks that the others must enqueue.
        Module::Schedule => docwarden_workloads::schedule::EVERY * 2,
        Module::Semaphore => semaphore::TTL,
        Module::Limits | Module::Rate => limits::LEASE,
        Module::Election => election::TTL,
        Module::Rwlock => rwlock::TTL,
        Module::Sequence | Module::Guard | Module::All => Duration::from_millis(300),
    }
}

/// One recorder per module.
async fn dispatch(module: Module, ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    match module {
        Module::Locks => locks::run(ctx).await,
        Module::Queue => queue::run(ctx).await,
        Module::Sequence => sequence::run(ctx).await,
        Module::Guard => guard::run(ctx).await,
        Module::Schedule => schedule::run(ctx).await,
        Module::Semaphore => semaphore::run(ctx).await,
        Module::Limits => limits::run(ctx, false).await,
        Module::Rate => limits::run(ctx, true).await,
        Module::Election => election::run(ctx).await,
        Module::Rwlock => rwlock::run(ctx).await,
        Module::All => anyhow::bail!("`all` is expanded into the four modules before this point"),
    }
}

pub(super) fn upstream_addr(uri: &str) -> anyhow::Result<std::net::SocketAddr> {
    let rest = uri.split_once("://").map_or(uri, |(_, r)| r);
    let host = rest.split(['/', '?']).next().unwrap_or(rest);
    let host = host.rsplit('@').next().unwrap_or(host);
    host.parse().map_err(|_| {
        anyhow::anyhow!(
            "latency/reset/partition faults need a single 127.0.0.1:PORT server, not {host}"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty history, or one whose every operation failed or is unknown, proved
    /// nothing: reported, not passed.
    #[test]
    fn a_history_with_no_operation_that_took_effect_is_nothing_verified() {
        let fault = Event::new(0, FAULT_OP, "kill", 0, 1);
        let failed = Event::new(1, "acquire", "r", 0, 1).outcome(OpOutcome::Failed);
        let unknown = Event::new(1, "write", "r", 2, 3).outcome(OpOutcome::Indeterminate);
        for events in [vec![], vec![fault.clone(), failed.clone(), unknown.clone()]] {
            let v = nothing_verified(&events);
            assert_eq!(v.map(|v| v.kind), Some("nothing-verified"), "{events:?}");
        }
        let ok = Event::new(1, "acquire", "r", 4, 5).token(1);
        assert!(nothing_verified(&[fault, failed, unknown, ok]).is_none());
    }
}
