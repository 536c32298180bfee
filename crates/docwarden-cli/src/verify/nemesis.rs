//! Server-side faults on a schedule: restart the embedded server, crash it (SIGKILL and
//! restart on the same data), step it down (`replSetStepDown`), add latency, reset
//! connections and partition some of the workers (whole processes, chosen at random each
//! time) from it (the last three through the proxy), and
//! MongoDB's `failCommand` fail point (network errors, not-primary errors, blocked
//! connections) limited to the workers' connections by their application name, so the
//! checker's own reads are never hit.
//!
//! Every fault is recorded as a window on the server's lane (`Ctx::injected`).

use std::time::{Duration, Instant};

use mongodb::Client;
use mongodb::bson::{Bson, Document, doc};

use docwarden_workloads::Process;
use rand::{Rng, SeedableRng};

use super::args::Fault;
use super::context::Ctx;
use super::proxy::Proxy;

/// The application name of the workers' client; the fail points match only it.
pub(super) const WORKER_APP: &str = "docwarden-verify-worker";

/// The writes the fail points hit.
const WRITES: [&str; 3] = ["findAndModify", "update", "insert"];

/// Turns `failCommand` on with `mode` and `data` (plus the workers' application name).
async fn fail_point(
    client: &Client,
    mode: mongodb::bson::Bson,
    data: Document,
) -> anyhow::Result<()> {
    let mut data = data;
    if !data.contains_key("failCommands") {
        data.insert("failCommands", WRITES.to_vec());
    }
    data.insert("appName", WORKER_APP);
    client
        .database("admin")
        .run_command(doc! { "configureFailPoint": "failCommand", "mode": mode, "data": data })
        .await?;
    Ok(())
}

/// One round of every fail-point fault in `ctx`, one after the other (there is one
/// `failCommand` fail point: each configuration replaces the previous one). `round` counts
/// the rounds from 0: every other one, the first included, stalls writes past a lease.
async fn fail_points(
    ctx: &Ctx,
    client: &Client,
    rng: &mut impl Rng,
    round: usize,
) -> anyhow::Result<()> {
    let window = Duration::from_millis(400);
    for fault in [
        Fault::FailpointNetwork,
        Fault::FailpointNotprimary,
        Fault::FailpointLatency,
    ] {
        if !ctx.has(fault) {
            continue;
        }
        let mut data = match fault {
            Fault::FailpointNetwork => doc! { "closeConnection": true },
            Fault::FailpointNotprimary => {
                // NotWritablePrimary or ShutdownInProgress: both retryable.
                let code = if rng.random_bool(0.5) { 10107 } else { 91 };
                doc! { "errorCode": code }
            }
            // Every other round a stall past a lease of the `update`s (the fenced writes,
            // which then run long after they were sent); short blocks of every write
            // otherwise.
            _ if round.is_multiple_of(2) => doc! {
                "blockConnection": true,
                "blockTimeMS": 2500,
                "failCommands": ["update"],
            },
            _ => doc! {
                "blockConnection": true,
                "blockTimeMS": rng.random_range(50..200_i32),
            },
        };
        // Three hits per window: a stall of every worker at once would leave nobody to
        // take the stalled leases over. But every other round, the first included, the
        // errors hit every `update` for the whole window (the fenced writes: counters,
        // touches, effects; and the workers' claims, completions, heartbeats and sweeps),
        // so that the writes an application makes are hit, not only the far more frequent
        // renewals and claims that would otherwise take the three.
        let mode = if fault != Fault::FailpointLatency && round.is_multiple_of(2) {
            data.insert("failCommands", vec!["update"]);
            Bson::from("alwaysOn")
        } else {
            doc! { "times": 3 }.into()
        };
        let start = ctx.history.now_us();
        fail_point(client, mode, data).await?;
        tokio::time::sleep(window).await;
        client
            .database("admin")
            .run_command(doc! { "configureFailPoint": "failCommand", "mode": "off" })
            .await?;
        ctx.injected(fault, Process::Server, start, ctx.history.now_us());
    }
    Ok(())
}

/// How long a partition lasts: 1.5 leases of the queue (2 s), 3 of the locks' (1 s).
pub(super) const PARTITION: Duration = Duration::from_secs(3);

/// The worker slots a partition cuts off (a bitmask, slot `s` is bit `s % 64`): each with
/// even odds, at least one, and never all of them when there are two or more — the others
/// must be there to take the cut holders' leases over.
fn cut_hosts(rng: &mut impl Rng, workers: usize) -> u64 {
    let slots = workers.clamp(1, 64);
    let all = if slots == 64 {
        u64::MAX
    } else {
        (1_u64 << slots) - 1
    };
    loop {
        let hosts = rng.random::<u64>() & all;
        if hosts != 0 && (hosts != all || slots == 1) {
            return hosts;
        }
    }
}

/// Seconds the server stays stepped down (MongoDB's `replSetStepDown` takes at least 1).
const STEPDOWN_SECS: i64 = 2;

/// `replSetStepDown` on the server, then waits until it is writable primary again.
/// Records the window from the command to the return of primary.
async fn step_down(ctx: &Ctx, client: &Client) -> anyhow::Result<()> {
    let admin = client.database("admin");
    let start = ctx.history.now_us();
    // `force`: a one-node replica set has no electable secondary to catch up.
    let reply = admin
        .run_command(doc! {
            "replSetStepDown": STEPDOWN_SECS,
            "secondaryCatchUpPeriodSecs": 0,
            "force": true,
        })
        .await;
    // MongoDB closes the connection of the command before 4.2; an error reply is not a
    // failure of the fault as long as the server stops being primary.
    if let Err(e) = &reply {
        tracing::debug!(%e, "replSetStepDown answered with an error");
    }
    let asked = Instant::now();
    let mut saw_secondary = false;
    loop {
        let primary = admin
            .run_command(doc! { "hello": 1 })
            .await
            .ok()
            .and_then(|h| h.get_bool("isWritablePrimary").ok())
            .unwrap_or(false);
        saw_secondary |= !primary;
        let waited = asked.elapsed();
        // Primary again; or primary all along for a second (the stepdown took no effect:
        // recorded, not fatal); or a server that never comes back within 10 s.
        if (primary && (saw_secondary || waited > Duration::from_secs(1)))
            || waited > Duration::from_secs(10)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tracing::debug!(?reply, saw_secondary, "stepdown window over");
    ctx.injected(
        Fault::Stepdown,
        Process::Server,
        start,
        ctx.history.now_us(),
    );
    Ok(())
}

/// Resets of every proxied connection per nemesis round (`reset`).
const RESET_BURST: u32 = 4;

/// The time between two resets of one round: the workers reconnect in between.
const RESET_GAP: Duration = Duration::from_millis(150);

/// Injects the server-side faults of `ctx` for the workload's duration.
pub(super) async fn run(
    ctx: &Ctx,
    session: &mut crate::conn::Session,
    proxy: Option<&Proxy>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + ctx.duration;
    // The nemesis's own random stream (how much latency).
    let mut rng = rand::rngs::StdRng::seed_from_u64(ctx.seed.rotate_left(29));
    let period = (ctx.duration / 4).max(Duration::from_secs(1));
    tokio::time::sleep(period / 2).await;
    let mut round = 0;
    while Instant::now() + Duration::from_secs(1) < deadline {
        if ctx.has(Fault::Restart)
            && let Some(server) = session.target.embedded()
        {
            let start = ctx.history.now_us();
            server.restart().await?;
            ctx.injected(Fault::Restart, Process::Server, start, ctx.history.now_us());
        }
        if ctx.has(Fault::Crash)
            && let Some(server) = session.target.embedded()
        {
            let start = ctx.history.now_us();
            server.crash_and_restart().await?;
            ctx.injected(Fault::Crash, Process::Server, start, ctx.history.now_us());
        }
        if ctx.has(Fault::Stepdown) {
            step_down(ctx, &session.client).await?;
        }
        if ctx.faults.iter().any(|f| f.is_failpoint()) {
            fail_points(ctx, &session.client, &mut rng, round).await?;
        }
        if let Some(proxy) = proxy {
            if ctx.has(Fault::Latency) {
                let start = ctx.history.now_us();
                proxy.set_latency(Duration::from_millis(rng.random_range(5..40)));
                tokio::time::sleep(Duration::from_millis(800)).await;
                proxy.set_latency(Duration::ZERO);
                ctx.injected(Fault::Latency, Process::Server, start, ctx.history.now_us());
            }
            if ctx.has(Fault::Reset) {
                // A reset is an instant; it cuts an operation's reply only if one is in
                // flight then, so each round resets a few times (one per round left the
                // queue's settlement control without a cut effect in 3 of 3 seeds of a
                // fresh-clone suite run).
                for i in 0..RESET_BURST {
                    if i > 0 {
                        tokio::time::sleep(RESET_GAP).await;
                    }
                    let at = ctx.history.now_us();
                    proxy.reset_all();
                    ctx.injected(Fault::Reset, Process::Server, at, at);
                }
            }
            if ctx.has(Fault::Partition) {
                let start = ctx.history.now_us();
                proxy.partition(cut_hosts(&mut rng, ctx.workers));
                tokio::time::sleep(PARTITION).await;
                proxy.heal();
                ctx.injected(
                    Fault::Partition,
                    Process::Server,
                    start,
                    ctx.history.now_us(),
                );
            }
        }
        round += 1;
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::time::sleep(period.min(left)).await;
    }
    Ok(())
}
