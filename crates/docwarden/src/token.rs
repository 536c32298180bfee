//! The token types, one per kind of holder: a [`FencingToken`] for a lock-collection lease
//! (a per-resource counter, compared by order) and a [`JobToken`] for a job claim (128
//! random bits, 32 hex digits on the wire, compared by equality). [`Token`] is either, as
//! carried by [`crate::Error::LeaseLost`].
//!
//! A leaf module: it depends on nothing else in the crate.

use mongodb::bson::Bson;

/// The fencing token of a lock-collection lease: strictly increasing per resource, stored
/// as a BSON int64.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct FencingToken(i64);

impl FencingToken {
    /// The token with value `value` (as stored).
    pub const fn new(value: i64) -> Self {
        Self(value)
    }

    /// The value as stored.
    pub const fn get(self) -> i64 {
        self.0
    }
}

impl PartialEq<i64> for FencingToken {
    fn eq(&self, other: &i64) -> bool {
        self.0 == *other
    }
}

impl PartialEq<FencingToken> for i64 {
    fn eq(&self, other: &FencingToken) -> bool {
        *self == other.0
    }
}

impl std::fmt::Display for FencingToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl From<FencingToken> for Bson {
    fn from(token: FencingToken) -> Self {
        Bson::Int64(token.0)
    }
}

impl From<FencingToken> for i64 {
    fn from(token: FencingToken) -> Self {
        token.0
    }
}

/// The token of a job claim: 128 random bits, stored as 32 hex digits in `lease.token`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct JobToken(String);

impl JobToken {
    /// The token as stored (read from a job document or written by a claim).
    pub fn new(stored: impl Into<String>) -> Self {
        Self(stored.into())
    }

    /// The token as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&JobToken> for Bson {
    fn from(token: &JobToken) -> Self {
        Bson::String(token.0.clone())
    }
}

impl PartialEq<str> for JobToken {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

/// A holder's token, whichever kind: what [`crate::Error::LeaseLost`] carries.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Token {
    /// A lock-collection lease's fencing token.
    Fencing(FencingToken),
    /// A job claim's token.
    Job(JobToken),
}

impl std::fmt::Display for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Token::Fencing(t) => t.fmt(f),
            Token::Job(t) => t.fmt(f),
        }
    }
}

impl From<FencingToken> for Token {
    fn from(token: FencingToken) -> Self {
        Token::Fencing(token)
    }
}

impl From<JobToken> for Token {
    fn from(token: JobToken) -> Self {
        Token::Job(token)
    }
}
