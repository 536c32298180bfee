//! The one error type of the crate.
//!
//! Contention is not an error: a lock that is held or an empty queue is reported as an
//! outcome (`Ok(None)` or an enum). Errors are for what a caller must handle differently:
//! bad input, a lease that was lost, a stale fencing token, or the database failing.

use mongodb::error::{ErrorKind, WriteFailure};

/// A `Result` with docwarden's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in docwarden, with kinds a caller can match on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument or option was refused before anything was written.
    #[error("invalid input: {what}: {reason}")]
    InvalidInput {
        /// Which argument or option.
        what: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// The lease (lock-collection lock or job claim) was lost: it expired and was taken
    /// over, or it was released by someone else. Nothing was written.
    #[error("lease on `{resource}` with token {token} was lost")]
    LeaseLost {
        /// The resource or job id.
        resource: String,
        /// The token that is no longer valid.
        token: crate::token::Token,
    },
    /// A fenced write carried a fencing token lower than one already seen.
    #[error("stale fencing token {token} for `{resource}` (storage has seen {seen})")]
    Stale {
        /// The fenced resource.
        resource: String,
        /// The token offered.
        token: crate::token::FencingToken,
        /// The highest token the storage has seen.
        seen: crate::token::FencingToken,
    },
    /// A write was refused because it would break a named invariant.
    #[error("invariant `{invariant}` would be violated")]
    InvariantViolated {
        /// The invariant's name.
        invariant: String,
    },
    /// A stored document does not have the shape docwarden wrote (hand-edited, or from an
    /// incompatible version).
    #[error("malformed document {id}: {reason}")]
    Malformed {
        /// The document's `_id`, rendered.
        id: String,
        /// What was wrong with it.
        reason: String,
    },
    /// The server lacks a capability this operation needs.
    #[error("server does not support {capability}")]
    Unsupported {
        /// The capability.
        capability: &'static str,
    },
    /// The deployment cannot be used as it is: the server is older than docwarden's
    /// minimum, or a collection is configured in a way docwarden's queries cannot honour
    /// (for example a non-simple default collation). Nothing was written.
    #[error("incompatible deployment: {reason}")]
    Incompatible {
        /// What is wrong and what to do about it.
        reason: String,
    },
    /// The server did not answer in time, or an operation kept meeting a document that
    /// changed under it until it gave up (a fenced write, a guarded update, a sequenced
    /// apply); retryable.
    #[error("{what} is unavailable")]
    Unavailable {
        /// What did not answer.
        what: &'static str,
    },
    /// The database returned an error.
    #[error("database error: {source}")]
    Database {
        /// The driver's error.
        #[source]
        #[from]
        source: mongodb::error::Error,
    },
}

impl Error {
    /// Shorthand for [`Error::InvalidInput`].
    pub fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidInput {
            what,
            reason: reason.into(),
        }
    }

    /// Whether retrying the same operation may succeed: the driver labelled the error
    /// retryable, the server could not be reached, or the server answered with one of the
    /// error codes MongoDB's retryable reads and writes specifications list as transient
    /// ([`RETRYABLE_CODES`]: not-primary, shutting down, stepping down, network errors,
    /// stale routing on a sharded cluster), whether as a command error, a write error or a
    /// write concern error.
    ///
    /// A retryable error says nothing about whether a *write* took effect: retry only
    /// operations that are idempotent (every fenced docwarden transition is) or whose
    /// outcome is read back.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Database { source } => {
                source.contains_label(mongodb::error::RETRYABLE_WRITE_ERROR)
                    || source.contains_label(mongodb::error::TRANSIENT_TRANSACTION_ERROR)
                    || matches!(
                        *source.kind,
                        ErrorKind::Io(_)
                            | ErrorKind::ServerSelection { .. }
                            | ErrorKind::ConnectionPoolCleared { .. }
                    )
                    || error_codes(source).any(|c| RETRYABLE_CODES.contains(&c))
            }
            Error::Unavailable { .. } => true,
            _ => false,
        }
    }

    /// Whether this is a duplicate-key error (code 11000) from a write, a command or a
    /// bulk insert.
    pub fn is_duplicate_key(&self) -> bool {
        match self {
            Error::Database { source } => is_duplicate_key(source),
            _ => false,
        }
    }

    /// Whether the server refused a write because the document failed the collection's
    /// validator (code 121).
    pub fn is_validation_failure(&self) -> bool {
        match self {
            Error::Database { source } => error_code(source) == Some(121),
            _ => false,
        }
    }
}

/// Server error codes after which the same operation may succeed, from MongoDB's retryable
/// writes specification (`InterruptedAtShutdown` 11600, `InterruptedDueToReplStateChange`
/// 11602, `NotWritablePrimary` 10107, `NotPrimaryNoSecondaryOk` 13435,
/// `NotPrimaryOrSecondary` 13436, `PrimarySteppedDown` 189, `ShutdownInProgress` 91,
/// `HostNotFound` 7, `HostUnreachable` 6, `NetworkTimeout` 89, `SocketException` 9001,
/// `ExceededTimeLimit` 262) and retryable reads specification
/// (`ReadConcernMajorityNotAvailableYet` 134, `StaleShardVersion` 63, `StaleEpoch` 150,
/// `StaleConfig` 13388, `RetryChangeStream` 234, `FailedToSatisfyReadPreference` 133).
pub const RETRYABLE_CODES: &[i32] = &[
    11600, 11602, 10107, 13435, 13436, 189, 91, 7, 6, 89, 9001, 262, 134, 63, 150, 13388, 234, 133,
];

/// Every server error code a driver error carries: the command's, each write error's, and
/// the write concern error's.
pub fn error_codes(err: &mongodb::error::Error) -> impl Iterator<Item = i32> + '_ {
    let mut codes = Vec::new();
    match &*err.kind {
        ErrorKind::Command(c) => codes.push(c.code),
        ErrorKind::Write(WriteFailure::WriteError(w)) => codes.push(w.code),
        ErrorKind::Write(WriteFailure::WriteConcernError(w)) => codes.push(w.code),
        ErrorKind::InsertMany(e) => {
            codes.extend(e.write_errors.iter().flatten().map(|w| w.code));
            codes.extend(e.write_concern_error.iter().map(|w| w.code));
        }
        ErrorKind::BulkWrite(e) => {
            codes.extend(e.write_errors.values().map(|w| w.code));
            codes.extend(e.write_concern_errors.iter().map(|w| w.code));
        }
        _ => {}
    }
    codes.into_iter()
}

/// The server error code carried by a driver error, if any.
pub fn error_code(err: &mongodb::error::Error) -> Option<i32> {
    match &*err.kind {
        ErrorKind::Command(c) => Some(c.code),
        ErrorKind::Write(WriteFailure::WriteError(w)) => Some(w.code),
        ErrorKind::Write(WriteFailure::WriteConcernError(w)) => Some(w.code),
        ErrorKind::InsertMany(e) => e
            .write_errors
            .as_ref()
            .and_then(|v| v.first())
            .map(|w| w.code),
        ErrorKind::BulkWrite(e) => e.write_errors.values().next().map(|w| w.code),
        _ => None,
    }
}

/// Whether a driver error is a duplicate-key error (code 11000), wherever it was reported.
pub fn is_duplicate_key(err: &mongodb::error::Error) -> bool {
    match &*err.kind {
        ErrorKind::InsertMany(e) => e
            .write_errors
            .as_ref()
            .is_some_and(|v| v.iter().any(|w| w.code == 11000)),
        ErrorKind::BulkWrite(e) => e.write_errors.values().any(|w| w.code == 11000),
        _ => error_code(err) == Some(11000),
    }
}
