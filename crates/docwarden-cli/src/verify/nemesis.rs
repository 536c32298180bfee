//! Server-side faults on a schedule: restart the embedded server, add latency, reset
//! connections (the last two through the proxy).

use std::time::{Duration, Instant};

use docwarden_workloads::Process;
use rand::{Rng, SeedableRng};

use super::args::Fault;
use super::context::Ctx;
use super::proxy::Proxy;

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
    while Instant::now() + Duration::from_secs(1) < deadline {
        if ctx.has(Fault::Restart)
            && let Some(server) = session.target.embedded()
        {
            let start = ctx.history.now_us();
            server.restart().await?;
            ctx.injected(Fault::Restart, Process::Server, start, ctx.history.now_us());
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
                let at = ctx.history.now_us();
                proxy.reset_all();
                ctx.injected(Fault::Reset, Process::Server, at, at);
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::time::sleep(period.min(left)).await;
    }
    Ok(())
}
