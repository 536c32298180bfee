//! The `docwarden` command.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod conn;
mod demo;
mod doctor;
mod locks;
#[cfg(feature = "otel")]
mod otel;
mod output;
mod queue;
mod ui;
mod verify;

/// Concurrency control for MongoDB documents: check a deployment, run the seed scenarios,
/// prove the guarantees, measure them.
#[derive(Debug, Parser)]
#[command(name = "docwarden", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Connect, report server version, topology, clock offset, and probe every capability.
    Doctor(doctor::Args),
    /// Run the seed scenarios, narrated, against the embedded server or --uri.
    Demo(demo::Args),
    /// Measure each module's throughput as a ratio to raw update_one on the same server.
    Bench(bench::Args),
    /// List held leases of a lock collection, or release every lease of an owner.
    Locks(locks::Args),
    /// Prove each guarantee under concurrency and faults; exits non-zero on any violation.
    Verify(verify::Args),
    /// Operate a job queue: stats, list, retry dead jobs, cancel, purge finished jobs.
    Queue(queue::Args),
    /// Serve a web dashboard of the queues and locks (actions need the printed token).
    Ui(ui::Args),
    /// One worker process of `docwarden verify` (started by verify itself).
    #[command(name = verify::WORKER_SUBCOMMAND, hide = true)]
    VerifyWorker(verify::WorkerArgs),
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Doctor(args) => doctor::run(args).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Bench(args) => bench::run(args).await,
        Command::Locks(args) => locks::run(args).await,
        Command::Verify(args) => verify::run(args).await,
        Command::Queue(args) => queue::run(args).await,
        Command::Ui(args) => ui::run(args).await,
        Command::VerifyWorker(args) => verify::run_worker(args).await,
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    use tracing_subscriber::prelude::*;
    // stderr, filtered by RUST_LOG (default `warn`); with the `otel` feature and an OTLP
    // endpoint set, spans are also exported (`otel.rs`), filtered on their own.
    // Colours only on a terminal (and never with NO_COLOR): a log redirected to a file or
    // read by another program carries no escape codes.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let stderr = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .with_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        );
    #[cfg(feature = "otel")]
    let (otel, _otel_guard) = match otel::layer() {
        Ok(Some((layer, guard))) => (Some(layer), Some(guard)),
        Ok(None) => (None, None),
        Err(e) => {
            eprintln!("docwarden: OpenTelemetry export disabled: {e:#}");
            (None, None)
        }
    };
    #[cfg(not(feature = "otel"))]
    let otel: Option<tracing_subscriber::layer::Identity> = None;
    tracing_subscriber::registry()
        .with(stderr)
        .with(otel)
        .init();
    let cli = Cli::parse();
    // Ctrl-C drops the running command, which stops an embedded server it started.
    tokio::select! {
        result = run(cli) => match result {
            Ok(code) => code,
            Err(err) => {
                eprintln!("docwarden: {err:#}");
                ExitCode::from(2)
            }
        },
        _ = tokio::signal::ctrl_c() => {
            eprintln!("docwarden: interrupted");
            ExitCode::from(130)
        }
    }
}
