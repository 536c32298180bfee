//! The database a docwarden command or test talks to: a deployment given by URI
//! (`--uri`, `MONGODB_URI`), or an embedded `secantusd-rs` started for the run.
//!
//! The embedded server runs as a separate process under a tiny controller that stops it
//! (and removes its temporary directory) when the owning process exits, panics or is
//! killed, so no server outlives its owner. A server whose data is kept
//! ([`ServerOptions::data_dir`]) runs durable: every acknowledged write survives a crash.
//!
//! The shipped `docwarden` binary depends on this crate only; the test helpers (per-test
//! databases, skip reporting) live in `docwarden-testkit`, which builds on it.

mod connect;
mod error;
mod server;

pub use connect::{Target, connect, disconnect, mask_uri, uri_from_env};
pub use error::{Error, Result};
pub use server::{EmbeddedServer, INSTALL_HINT, SECANTUS_VERSION, ServerOptions};
