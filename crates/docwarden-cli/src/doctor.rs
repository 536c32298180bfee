//! `docwarden doctor`: what the server is, how far its clock is, what it supports.

use std::process::ExitCode;
use std::time::Instant;

use docwarden::capabilities::{self, Capabilities};
use docwarden::clock::{ClockOptions, ClockSample, TimeSource};
use docwarden::preflight::{self, MIN_SERVER_VERSION};
use docwarden_server::mask_uri;
use mongodb::bson::{Document, doc};

use crate::conn::ConnArgs;
use crate::output::print_json;

/// Arguments of `docwarden doctor`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    conn: ConnArgs,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, serde::Serialize)]
pub(crate) struct Report {
    uri: String,
    embedded: bool,
    pub(crate) server_version: String,
    max_wire_version: i64,
    /// Whether the server is at least docwarden's minimum version.
    pub(crate) version_supported: bool,
    /// The minimum version docwarden needs.
    min_version: &'static str,
    pub(crate) topology: String,
    round_trip_ms: f64,
    pub(crate) clock_offset_ms: i64,
    pub(crate) clock_bound_ms: i64,
    pub(crate) capabilities: Capabilities,
}

pub(crate) async fn run(args: Args) -> anyhow::Result<ExitCode> {
    let session = args.conn.open(args.json).await?;
    let report = gather(&session.client, &session.uri(), session.embedded()).await?;
    if args.json {
        print_json(&report)?;
    } else {
        print_human(&report);
    }
    Ok(if report.version_supported {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

pub(crate) async fn gather(
    client: &mongodb::Client,
    uri: &str,
    embedded: bool,
) -> anyhow::Result<Report> {
    let admin = client.database("admin");
    let started = Instant::now();
    let hello: Document = admin.run_command(doc! { "hello": 1 }).await?;
    let round_trip = started.elapsed();
    let build: Document = admin.run_command(doc! { "buildInfo": 1 }).await?;
    let topology = if hello.get_str("msg") == Ok("isdbgrid") {
        "sharded (mongos)".to_owned()
    } else if let Ok(set) = hello.get_str("setName") {
        format!("replica set `{set}`")
    } else {
        "standalone".to_owned()
    };
    let max_wire_version = match hello.get("maxWireVersion") {
        Some(mongodb::bson::Bson::Int32(v)) => i64::from(*v),
        Some(mongodb::bson::Bson::Int64(v)) => *v,
        _ => -1,
    };
    let version = preflight::server_version(client).await?;
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let sample: ClockSample = time.refresh().await?;
    let capabilities = capabilities::probe(client).await?;
    Ok(Report {
        uri: mask_uri(uri),
        embedded,
        server_version: build.get_str("version").unwrap_or("unknown").to_owned(),
        max_wire_version,
        version_supported: version.is_supported(),
        min_version: MIN_SERVER_VERSION,
        topology,
        round_trip_ms: round_trip.as_secs_f64() * 1000.0,
        clock_offset_ms: sample.offset_ms,
        clock_bound_ms: sample.bound_ms,
        capabilities,
    })
}

fn print_human(r: &Report) {
    let kind = if r.embedded {
        " (embedded secantusd-rs)"
    } else {
        ""
    };
    println!("server          {}{kind}", r.uri);
    println!("version         {}", r.server_version);
    println!("wire version    {}", r.max_wire_version);
    println!(
        "minimum         MongoDB {} (wire version 17): {}",
        r.min_version,
        if r.version_supported {
            "ok"
        } else {
            "TOO OLD — docwarden's handles refuse to open on this server"
        }
    );
    println!("topology        {}", r.topology);
    println!("round trip      {:.2} ms", r.round_trip_ms);
    println!(
        "clock offset    {:+} ms ± {} ms (server minus this machine)",
        r.clock_offset_ms, r.clock_bound_ms
    );
    println!("capabilities:");
    for (name, support) in r.capabilities.rows() {
        println!("  {name:<22} {support}");
    }
}
