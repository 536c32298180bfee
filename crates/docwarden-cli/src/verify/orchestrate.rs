//! One run of `docwarden verify`: for each module, a fresh database, the proxy if the
//! faults need it, the workload and the nemesis side by side, then the findings.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use docwarden::check::{History, count_by_kind};
use docwarden_workloads::Mode;
use indicatif::{ProgressBar, ProgressStyle};

use super::args::{Args, Fault, Module};
use super::context::{Ctx, Findings, WorkloadResult};
use super::{guard, locks, nemesis, proxy, queue, report, sequence, summary};

/// Runs `docwarden verify`.
pub(crate) async fn run(args: Args) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
    anyhow::ensure!(args.duration > 0, "--duration must be at least 1 second");
    let mut session = args.conn.open(args.json).await?;
    let needs_embedded = args.faults.contains(&Fault::Restart);
    anyhow::ensure!(
        !needs_embedded || session.embedded(),
        "the restart fault needs the embedded server (run without --uri / MONGODB_URI)"
    );
    let seed = args.seed.unwrap_or_else(rand::random);
    let mut args = args;
    if args.control && args.faults.is_empty() {
        // The safeguards exist for paused holders: a control run without pauses would prove
        // little, so it brings them along. (`--faults pause,skew` adds wrong client clocks,
        // which the control trusts; under skew the queue control mostly starves instead.)
        args.faults = vec![Fault::Pause];
    }
    let modules = args.module.expand();
    if !args.json {
        eprintln!(
            "docwarden verify: {} workload(s) × {} s, {} workers, faults [{}], seed {seed}{}",
            modules.len(),
            args.duration,
            args.workers,
            args.faults
                .iter()
                .map(|f| f.name())
                .collect::<Vec<_>>()
                .join(","),
            if args.control {
                ", CONTROL (safeguards off)"
            } else {
                ""
            }
        );
    }
    let mut results = Vec::new();
    for module in modules {
        results.push(run_module(&args, &mut session, module, seed).await?);
    }
    let total: usize = results
        .iter()
        .map(|r| r.violations_by_kind.values().sum::<usize>())
        .sum();
    if let Some(path) = &args.report {
        std::fs::write(path, report::html(&results, args.control, seed))?;
        if !args.json {
            eprintln!("docwarden verify: report written to {}", path.display());
        }
    }
    summary::print(&results, args.json, seed, args.control, &args.faults, total)?;
    Ok(if total == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

async fn run_module(
    args: &Args,
    session: &mut crate::conn::Session,
    module: Module,
    seed: u64,
) -> anyhow::Result<WorkloadResult> {
    let direct_uri = session.uri();
    let proxy = if args.faults.contains(&Fault::Latency) || args.faults.contains(&Fault::Reset) {
        let addr = upstream_addr(&direct_uri)?;
        Some(proxy::Proxy::start(addr).await?)
    } else {
        None
    };
    let uri = proxy
        .as_ref()
        .map_or_else(|| direct_uri.clone(), proxy::Proxy::uri);
    let client = docwarden_server::connect(&uri, Duration::from_secs(10)).await?;
    let db_name = format!(
        "docwarden_verify_{}_{:08x}",
        module.name(),
        rand::random::<u32>()
    );
    let progress = if args.json {
        ProgressBar::hidden()
    } else {
        let bar = ProgressBar::new(args.duration);
        bar.set_style(
            ProgressStyle::with_template("{prefix:>9} [{bar:30}] {pos}/{len} s {msg}")?
                .progress_chars("=> "),
        );
        bar.set_prefix(module.name());
        bar
    };
    let ctx = Arc::new(Ctx {
        db: client.database(&db_name),
        client: client.clone(),
        history: Arc::new(History::new()),
        faults: args.faults.clone(),
        mode: Mode::control_if(args.control),
        workers: args.workers,
        duration: Duration::from_secs(args.duration),
        seed,
        injected: Mutex::new(BTreeMap::new()),
        progress: progress.clone(),
    });
    let nemesis = nemesis::run(&ctx, session, proxy.as_ref());
    let workload = dispatch(module, Arc::clone(&ctx));
    let (findings, nemesis) = tokio::join!(workload, nemesis);
    nemesis?;
    let findings = findings?;
    progress.finish_and_clear();
    // Clean up through a direct connection (the proxy may be resetting).
    let direct = docwarden_server::connect(&direct_uri, Duration::from_secs(10)).await?;
    direct.database(&db_name).drop().await?;
    let mut violations = findings.violations;
    let violations_by_kind = count_by_kind(&violations).into_iter().collect();
    violations.truncate(20);
    Ok(WorkloadResult {
        workload: module.name(),
        operations: findings.operations,
        faults: ctx.injected_counts(),
        violations_by_kind,
        violations,
        events: ctx.history.events(),
    })
}

/// One recorder per module.
async fn dispatch(module: Module, ctx: Arc<Ctx>) -> anyhow::Result<Findings> {
    match module {
        Module::Locks => locks::run(ctx).await,
        Module::Queue => queue::run(ctx).await,
        Module::Sequence => sequence::run(ctx).await,
        Module::Guard => guard::run(ctx).await,
        Module::All => anyhow::bail!("`all` is expanded into the four modules before this point"),
    }
}

fn upstream_addr(uri: &str) -> anyhow::Result<std::net::SocketAddr> {
    let rest = uri.split_once("://").map_or(uri, |(_, r)| r);
    let host = rest.split(['/', '?']).next().unwrap_or(rest);
    let host = host.rsplit('@').next().unwrap_or(host);
    host.parse().map_err(|_| {
        anyhow::anyhow!("latency/reset faults need a single 127.0.0.1:PORT server, not {host}")
    })
}
