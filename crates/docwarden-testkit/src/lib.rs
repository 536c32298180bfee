//! Test and tool support for docwarden: the embedded `secantusd-rs` server, per-test
//! databases, and connection helpers shared by the tests, the benchmarks and the CLI.
//!
//! With `MONGODB_URI` set nothing is started and everything talks to that deployment;
//! otherwise one embedded server is started per process on a free port, with a temporary
//! storage directory, and stopped when the process exits (even if it is killed).

mod connect;
mod error;
mod server;
mod skip;
mod testdb;

pub use connect::{Target, connect, mask_uri, uri_from_env};
pub use error::{Error, Result};
pub use server::{EmbeddedServer, INSTALL_HINT, SECANTUS_VERSION, ServerOptions};
pub use skip::{SKIP_LOG_ENV, skip, skip_log};
pub use testdb::{TestDb, shared_uri};
