//! The lease value and the owner handle.

use std::time::Duration;

use mongodb::bson::DateTime;

use crate::clock::ServerTime;
use crate::error::{Error, Result};
use crate::token::FencingToken;
use crate::validate;

/// Who holds leases: a random 128-bit id (32 hex digits).
///
/// Owner ids are secrets that let their bearer renew and release leases, so they are drawn
/// from the operating system's generator and never derived from web session ids.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Owner {
    id: String,
}

impl Owner {
    /// A new owner with a random 128-bit id.
    pub fn random() -> Self {
        Self {
            id: validate::random_id(),
        }
    }

    /// An owner whose id was created earlier (persisted by a process that restarted, or
    /// given to `docwarden locks release --owner`).
    ///
    /// # Errors
    /// [`crate::Error::InvalidInput`] if `id` is empty, longer than
    /// [`validate::MAX_NAME_LEN`] or contains a NUL byte.
    pub fn from_existing(id: impl Into<String>) -> Result<Self> {
        let id = id.into();
        validate::name("owner", &id)?;
        Ok(Self { id })
    }

    /// The owner id as stored in lock documents.
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.id)
    }
}

/// A lease on one resource of a [`super::LockCollection`]: the value a holder keeps and
/// passes back to renew, release and fence writes.
///
/// The `token` is the fencing token: it strictly increases per resource, so storage that
/// remembers the highest token it has seen can refuse a write from a holder whose lease was
/// lost ([`super::Fence`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The locked resource (the lock document's `_id`).
    pub resource: String,
    /// The owner id of the holder.
    pub owner: String,
    /// The fencing token of this acquisition.
    pub token: FencingToken,
    /// Server time (estimated) when the lease was acquired.
    pub acquired_at: DateTime,
    /// Server time (estimated) when the lease expires unless renewed.
    pub expires_at: DateTime,
}

impl Lease {
    /// Whether the lease is still certainly valid at `now`, `margin_ms` included: the
    /// check a holder makes before acting on it (the storage-side check is [`super::Fence`]).
    pub fn is_certainly_valid(&self, now: &ServerTime, margin_ms: i64) -> bool {
        now.certainly_before(self.expires_at, margin_ms)
    }

    /// Milliseconds left until `expires_at`, by the estimate `now` (negative once expired).
    pub fn remaining_ms(&self, now: &ServerTime) -> i64 {
        self.expires_at
            .timestamp_millis()
            .saturating_sub(now.estimate_ms)
    }
}

/// Checks the ttl of a lease, permit, read lease or term before anything is written, and
/// returns it in milliseconds: positive, storable in BSON milliseconds
/// ([`validate::duration_ms`]), and longer than the time source's skew margin `margin_ms`.
/// A lease is certainly valid only while more than the margin (plus the clock's bound) of
/// it is left, so one of at most the margin never is: its holder could not act on it, and
/// the watchdog, the renewals and the fences would all treat it as lost from the start.
/// The one check for every entry point that takes a ttl (acquire, renew, watch, read,
/// write, campaign).
///
/// # Errors
/// [`Error::InvalidInput`] naming `what`, the ttl and the margin.
pub(crate) fn ttl_ms(what: &'static str, ttl: Duration, margin_ms: i64) -> Result<i64> {
    let ttl_ms = validate::duration_ms(what, ttl)?;
    if ttl_ms <= margin_ms {
        return Err(Error::invalid(
            what,
            format!(
                "{ttl_ms} ms is never certainly valid with a skew margin of {margin_ms} ms: \
                 give it more than the margin"
            ),
        ));
    }
    Ok(ttl_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_are_random_and_validated() {
        let a = Owner::random();
        let b = Owner::random();
        assert_ne!(a, b);
        assert_eq!(a.id().len(), 32);
        assert!(Owner::from_existing("").is_err());
        assert!(Owner::from_existing("x".repeat(validate::MAX_NAME_LEN + 1)).is_err());
        assert_eq!(
            Owner::from_existing("abc").map(|o| o.to_string()).ok(),
            Some("abc".into())
        );
    }

    #[test]
    fn validity_uses_bound_and_margin() {
        let lease = Lease {
            resource: "r".into(),
            owner: "o".into(),
            token: FencingToken::new(1),
            acquired_at: DateTime::from_millis(0),
            expires_at: DateTime::from_millis(1_000),
        };
        let now = ServerTime {
            estimate_ms: 800,
            bound_ms: 10,
        };
        assert!(lease.is_certainly_valid(&now, 100));
        assert!(!lease.is_certainly_valid(&now, 190));
        assert_eq!(lease.remaining_ms(&now), 200);
    }

    #[test]
    fn a_ttl_must_be_longer_than_the_margin() {
        let ms = Duration::from_millis;
        assert_eq!(ttl_ms("ttl", ms(251), 250).ok(), Some(251));
        assert_eq!(ttl_ms("ttl", ms(1), 0).ok(), Some(1));
        for (ttl, margin) in [(ms(250), 250), (ms(100), 250), (ms(0), 0)] {
            match ttl_ms("ttl", ttl, margin) {
                Err(Error::InvalidInput { what: "ttl", .. }) => {}
                other => panic!("{ttl:?} with margin {margin}: {other:?}"),
            }
        }
    }
}
