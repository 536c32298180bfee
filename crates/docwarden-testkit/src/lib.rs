//! Test support for docwarden: per-test databases on the embedded `secantusd-rs` server
//! (or on `MONGODB_URI`), servers a test may restart, crash or pause, and loud skips.
//!
//! With `MONGODB_URI` set nothing is started and everything talks to that deployment;
//! otherwise one embedded server is started per test process on a free port, with a
//! temporary storage directory and MongoDB's test commands (fail points) enabled, and
//! stopped when the process exits (even if it is killed). The launcher itself is the
//! `docwarden-server` crate, re-exported here.

mod commands;
mod fail_point;
mod skip;
mod testdb;

pub use commands::{CommandLog, counting_client};
pub use docwarden_server::{
    EmbeddedServer, Error, INSTALL_HINT, Result, SECANTUS_VERSION, ServerOptions, Target, connect,
    mask_uri, uri_from_env,
};
pub use fail_point::{
    app_client, app_faults, fail_commands, fail_commands_of, fail_commands_off, fail_point_client,
    hold_next, lose_replies,
};
pub use skip::{SKIP_LOG_ENV, skip, skip_log};
pub use testdb::{TestDb, shared_uri};
