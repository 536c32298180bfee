//! Where a command or test connects: a given URI, `MONGODB_URI`, or an embedded server.

use std::path::PathBuf;
use std::time::Duration;

use mongodb::Client;
use mongodb::bson::doc;
use mongodb::options::ClientOptions;

use crate::error::{Error, Result};
use crate::server::{EmbeddedServer, ServerOptions};

/// `MONGODB_URI` if it is set and not empty.
pub fn uri_from_env() -> Option<String> {
    std::env::var("MONGODB_URI")
        .ok()
        .filter(|s| !s.trim().is_empty())
}

/// Replaces the password (and user) of a URI with `***` so it can be printed.
pub fn mask_uri(uri: &str) -> String {
    let Some((scheme, rest)) = uri.split_once("://") else {
        return uri.to_owned();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
        None => uri.to_owned(),
    }
}

/// Connects to `uri` and checks, within `timeout`, that the server answers `hello`.
///
/// # Errors
/// [`Error::Unreachable`] with a one-line reason and the URI masked.
pub async fn connect(uri: &str, timeout: Duration) -> Result<Client> {
    let unreachable = |reason: String| Error::Unreachable {
        uri: mask_uri(uri),
        reason,
    };
    let mut options = tokio::time::timeout(timeout, ClientOptions::parse(uri))
        .await
        .map_err(|_| unreachable("timed out resolving the URI".into()))?
        .map_err(|e| unreachable(first_line(&e.to_string())))?;
    options.server_selection_timeout = Some(timeout);
    options.connect_timeout = Some(timeout);
    options.app_name.get_or_insert_with(|| "docwarden".into());
    let client =
        Client::with_options(options).map_err(|e| unreachable(first_line(&e.to_string())))?;
    tokio::time::timeout(
        // Saturating: a caller's `Duration::MAX` means "wait as long as it takes".
        timeout.saturating_add(Duration::from_secs(1)),
        client.database("admin").run_command(doc! { "hello": 1 }),
    )
    .await
    .map_err(|_| unreachable(format!("no answer within {} s", timeout.as_secs())))?
    .map_err(|e| unreachable(first_line(&e.to_string())))?;
    Ok(client)
}

/// Ends `client`'s server sessions and closes its connections, waiting at most `within`
/// (an unreachable server is given up on; the server expires the sessions itself).
///
/// Call it before a process that owns the client exits. The driver ends a dropped client's
/// sessions in a task it spawns from `Drop`; when the runtime shuts down while that task
/// waits for a new connection, the driver panics in the task (the panic is caught, but its
/// message and backtrace reach stderr, as in a `verify` worker process after a fault).
/// After this call no drop of the client or its clones spawns anything.
pub async fn disconnect(client: Client, within: Duration) {
    let handle = client.clone();
    if tokio::time::timeout(within, client.shutdown().immediate(true))
        .await
        .is_err()
    {
        // Not shut down: dropping the last handle would spawn the same `endSessions`, so
        // this one is never dropped (the process is exiting).
        std::mem::forget(handle);
    }
}

/// The driver's message reduced to one readable line: for a server-selection timeout, the
/// first server's own error ("Connection refused", "Name or service not known").
fn first_line(s: &str) -> String {
    let inner = s
        .split_once("Error: Kind: ")
        .map(|(_, rest)| rest.split(", labels").next().unwrap_or(rest))
        .or_else(|| {
            s.strip_prefix("Kind: ")
                .map(|r| r.split(", labels").next().unwrap_or(r))
        });
    let line = inner.unwrap_or_else(|| s.lines().next().unwrap_or(s));
    if line.len() > 300 {
        format!("{}…", &line[..line.floor_char_boundary(300)])
    } else {
        line.to_owned()
    }
}

/// The database a command works on: a URI it was given, or an embedded server it started
/// (and stops when dropped).
#[derive(Debug)]
pub enum Target {
    /// A deployment given by `--uri` or `MONGODB_URI`.
    Uri(String),
    /// An embedded `secantusd-rs` started for this run.
    Embedded(EmbeddedServer),
}

impl Target {
    /// Uses `uri` (or `MONGODB_URI`) if given, else starts an embedded server, keeping its
    /// data in `data_dir` if given.
    ///
    /// # Errors
    /// [`Error::NotInstalled`] or [`Error::StartFailed`] for the embedded server.
    pub async fn resolve(uri: Option<String>, data_dir: Option<PathBuf>) -> Result<Self> {
        if let Some(uri) = uri.or_else(uri_from_env) {
            return Ok(Target::Uri(uri));
        }
        let options = ServerOptions {
            data_dir,
            ..ServerOptions::default()
        };
        Ok(Target::Embedded(EmbeddedServer::start(options).await?))
    }

    /// The URI to connect to.
    pub fn uri(&self) -> String {
        match self {
            Target::Uri(u) => u.clone(),
            Target::Embedded(s) => s.uri(),
        }
    }

    /// The embedded server, if this target is one (faults need it).
    pub fn embedded(&mut self) -> Option<&mut EmbeddedServer> {
        match self {
            Target::Uri(_) => None,
            Target::Embedded(s) => Some(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_credentials() {
        assert_eq!(
            mask_uri("mongodb://bob:s3cret@db.example:27017/x?authSource=admin"),
            "mongodb://***@db.example:27017/x?authSource=admin"
        );
        assert_eq!(mask_uri("mongodb://127.0.0.1:1"), "mongodb://127.0.0.1:1");
        assert_eq!(
            mask_uri("mongodb+srv://u:p@c.example/"),
            "mongodb+srv://***@c.example/"
        );
        assert_eq!(mask_uri("garbage"), "garbage");
    }
}
