//! The launcher's error type.

use std::path::PathBuf;

/// A `Result` with the launcher's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong while starting, using or stopping a server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `secantusd-rs` is not installed.
    #[error("secantusd-rs was not found on PATH or in ~/.cargo/bin.\n{hint}")]
    NotInstalled {
        /// The exact commands that install it.
        hint: &'static str,
    },
    /// The server did not start; its log is kept at `log`.
    #[error("the embedded server did not start: {reason} (server log kept at {})\n{tail}", log.display())]
    StartFailed {
        /// What went wrong.
        reason: String,
        /// Where the server's log was kept.
        log: PathBuf,
        /// The end of the log.
        tail: String,
    },
    /// The URI could not be parsed or the server did not answer.
    #[error("cannot reach {uri}: {reason}")]
    Unreachable {
        /// The URI, credentials masked.
        uri: String,
        /// The driver's one-line reason.
        reason: String,
    },
    /// The data directory cannot be created or used (a file in the way, no permission).
    #[error("cannot use {} as the embedded server's data directory: {source}", path.display())]
    DataDir {
        /// The directory asked for.
        path: PathBuf,
        /// What the file system said.
        source: std::io::Error,
    },
    /// An I/O error while controlling the server process.
    #[error("embedded server control: {0}")]
    Io(#[from] std::io::Error),
    /// A database error.
    #[error("database error: {0}")]
    Database(#[from] mongodb::error::Error),
}
