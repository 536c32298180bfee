//! Connection options shared by every subcommand, and the session they open.

use std::path::PathBuf;
use std::time::Duration;

use docwarden_server::{Target, connect, mask_uri};
use mongodb::Client;

/// The longest `--connect-timeout` accepted, in seconds (an hour).
const MAX_CONNECT_TIMEOUT_SECS: u64 = 3600;

/// Where to connect.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ConnArgs {
    /// MongoDB URI. Without it (and without MONGODB_URI) an embedded secantusd-rs is
    /// started for the run and stopped afterwards.
    #[arg(long, env = "MONGODB_URI", global = true)]
    pub(crate) uri: Option<String>,
    /// Keep the embedded server's data (and log) in this directory. A server whose data is
    /// kept runs durable (`--sync-on-commit`): every acknowledged write survives a crash,
    /// at a few times the cost per write.
    #[arg(long, global = true)]
    pub(crate) data_dir: Option<PathBuf>,
    /// Seconds to wait for the server to answer (1 to 3600).
    #[arg(long, default_value_t = 8, global = true,
          value_parser = clap::value_parser!(u64).range(1..=MAX_CONNECT_TIMEOUT_SECS))]
    pub(crate) connect_timeout: u64,
}

/// An open connection; drop it to stop an embedded server.
pub(crate) struct Session {
    pub(crate) target: Target,
    pub(crate) client: Client,
}

impl Session {
    pub(crate) fn uri(&self) -> String {
        self.target.uri()
    }

    /// Whether this run started its own server.
    pub(crate) fn embedded(&self) -> bool {
        matches!(self.target, Target::Embedded(_))
    }
}

impl ConnArgs {
    /// Connects to `--uri` / `MONGODB_URI`, or starts the embedded server.
    pub(crate) async fn open(&self, quiet: bool) -> anyhow::Result<Session> {
        let uri = self.uri.clone().filter(|u| !u.trim().is_empty());
        if uri.is_some()
            && let Some(dir) = &self.data_dir
        {
            // Said even when quiet: the user asked for a data directory nothing will use.
            eprintln!(
                "docwarden: --data-dir {} is ignored: --uri / MONGODB_URI names the server",
                dir.display()
            );
        }
        if uri.is_none() && !quiet {
            eprintln!("docwarden: no --uri or MONGODB_URI: starting an embedded secantusd-rs…");
        }
        let target = Target::resolve(uri, self.data_dir.clone()).await?;
        if !quiet && let Target::Embedded(server) = &target {
            eprintln!(
                "docwarden: embedded server on {} (log: {}{})",
                server.uri(),
                server.log_path().display(),
                if server.is_durable() {
                    "; durable: acknowledged writes survive a crash"
                } else {
                    ""
                }
            );
        }
        let client = connect(&target.uri(), Duration::from_secs(self.connect_timeout))
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        tracing::debug!(uri = %mask_uri(&target.uri()), "connected");
        Ok(Session { target, client })
    }
}
