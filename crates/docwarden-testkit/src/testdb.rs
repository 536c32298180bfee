//! A fresh, uniquely named database per test, dropped afterwards.

use std::time::Duration;

use mongodb::{Client, Database};
use tokio::sync::OnceCell;

use docwarden_server::{EmbeddedServer, Result, ServerOptions, connect, uri_from_env};

static SHARED: OnceCell<(String, Option<EmbeddedServer>)> = OnceCell::const_new();

/// The URI every test in this process shares: `MONGODB_URI`, or one embedded server
/// started on first use (stopped when the process exits).
///
/// # Errors
/// The embedded server could not be started.
pub async fn shared_uri() -> Result<String> {
    let (uri, _) = SHARED
        .get_or_try_init(|| async {
            match uri_from_env() {
                Some(uri) => Ok::<_, crate::Error>((uri, None)),
                None => {
                    let server =
                        EmbeddedServer::start(ServerOptions::default().test_commands(true)).await?;
                    Ok((server.uri(), Some(server)))
                }
            }
        })
        .await?;
    Ok(uri.clone())
}

/// A database of its own for one test. Dropping it drops the database.
///
/// ```no_run
/// # async fn t() -> docwarden_testkit::Result<()> {
/// let t = docwarden_testkit::TestDb::new("locks_mutual_exclusion").await?;
/// let coll = t.db.collection::<mongodb::bson::Document>("c");
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct TestDb {
    /// A client for this test (created on the test's runtime).
    pub client: Client,
    /// The test's database.
    pub db: Database,
    uri: String,
    /// A server owned by this test alone (see [`TestDb::dedicated`]).
    pub server: Option<EmbeddedServer>,
}

impl TestDb {
    /// A fresh database named after `test` on the shared server.
    ///
    /// # Errors
    /// The server could not be started or reached.
    pub async fn new(test: &str) -> Result<Self> {
        let uri = shared_uri().await?;
        Self::on(uri, test, None).await
    }

    /// A fresh database on a server of its own, which the test may restart, crash or
    /// pause. The server is durable (acknowledged writes survive a crash) and has test
    /// commands enabled. Returns `None`, and reports the test as skipped (see
    /// [`crate::skip`]), when `MONGODB_URI` is set: a real deployment cannot be restarted
    /// by a test.
    ///
    /// # Errors
    /// The server could not be started or reached.
    pub async fn dedicated(test: &str) -> Result<Option<Self>> {
        Self::dedicated_with(test, ServerOptions::default().durable(true)).await
    }

    /// Like [`TestDb::dedicated`], with the server's options given (for example a server
    /// that is *not* durable, for a control run). Test commands are always enabled.
    ///
    /// # Errors
    /// The server could not be started or reached.
    pub async fn dedicated_with(test: &str, options: ServerOptions) -> Result<Option<Self>> {
        if uri_from_env().is_some() {
            crate::skip(
                test,
                "needs an embedded server it can restart, crash or pause, and MONGODB_URI is set",
            );
            return Ok(None);
        }
        let server = EmbeddedServer::start(options.test_commands(true)).await?;
        Self::on(server.uri(), test, Some(server)).await.map(Some)
    }

    async fn on(uri: String, test: &str, server: Option<EmbeddedServer>) -> Result<Self> {
        let client = connect(&uri, Duration::from_secs(20)).await?;
        let db = client.database(&db_name(test));
        Ok(Self {
            client,
            db,
            uri,
            server,
        })
    }

    /// The URI of the server this database lives on.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// Another client to the same server (for example one per simulated process).
    ///
    /// # Errors
    /// The server could not be reached.
    pub async fn new_client(&self) -> Result<Client> {
        connect(&self.uri, Duration::from_secs(20)).await
    }

    /// The validator of `collection` in this database (`None` when it has none, or an
    /// empty one), as `listCollections` reports it.
    ///
    /// # Errors
    /// The command failed.
    pub async fn validator_of(
        &self,
        collection: &str,
    ) -> mongodb::error::Result<Option<mongodb::bson::Document>> {
        let mut cursor = self
            .db
            .list_collections()
            .filter(mongodb::bson::doc! { "name": collection })
            .await?;
        let spec = if cursor.advance().await? {
            Some(cursor.deserialize_current()?)
        } else {
            None
        };
        Ok(spec
            .and_then(|s| s.options.validator)
            .filter(|v| !v.is_empty()))
    }

    /// The embedded server owned by this test, if any.
    pub fn server_mut(&mut self) -> Option<&mut EmbeddedServer> {
        self.server.as_mut()
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if self.server.is_some() {
            // The whole server (and its directory) goes away with it.
            return;
        }
        // The test's runtime may be shutting down: drop the database from a thread with
        // its own runtime and client.
        let uri = self.uri.clone();
        let name = self.db.name().to_owned();
        let joined = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                if let Ok(client) = connect(&uri, Duration::from_secs(10)).await {
                    let _ = client.database(&name).drop().await;
                }
            });
        })
        .join();
        if joined.is_err() {
            tracing::warn!("could not drop a test database");
        }
    }
}

/// `dw_<test>_<random>`: unique, within MongoDB's 63-byte limit, only safe characters.
fn db_name(test: &str) -> String {
    let clean: String = test
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(40)
        .collect();
    format!("dw_{clean}_{:08x}", rand::random::<u32>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_names_are_unique_and_safe() {
        let a = db_name("queue::claims/are.fenced$ and a very long name that goes on and on");
        let b = db_name("queue::claims/are.fenced$ and a very long name that goes on and on");
        assert_ne!(a, b);
        assert!(a.len() <= 63);
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
    }
}
