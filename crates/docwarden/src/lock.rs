//! Locks and leases: a lock collection with fencing tokens (seed 004) and document locks
//! stored in the entity itself (seed 003).
//!
//! **Guarantee:** at most one [`Lease`] on a resource is valid at any instant *by the
//! server's clock* (expiry is decided in the acquire's atomic write against the estimated
//! server time, with its error bound and a skew margin), renew and release are
//! compare-and-set on `(resource, owner, token)` of a committed acquisition (a stale lease
//! of the same owner id cannot touch a newer acquisition, even before its token is
//! committed), and fencing tokens strictly increase per resource across release, expiry,
//! garbage collection of the lock document and crashes (each lock document hands out
//! tokens from a block reserved in a counter collection no TTL index touches, so an
//! uncontended acquire is one write and a release one write; see `lock/collection.rs` and
//! `docs/locks.md` for the argument and its one assumption: the counter collection is
//! never deleted or rolled back). [`DocumentLocks`] hands out a random lock id
//! per acquisition and fences the releasing write by it. A [`Semaphore`] admits N
//! holders per resource, each [`Permit`] with its own fencing token (`lock/semaphore.rs`).
//!
//! **Fencing, one shape for every holder:** [`Fence::apply`]`(&holder, filter, update)`
//! returns a [`FenceOutcome`] for any [`Fenced`] holder. A [`Lease`] fences any document,
//! by token order (the document stores the highest token applied); a [`DocumentGuard`]
//! fences the locked document (it must still carry the guard's lock id); a
//! [`crate::queue::ClaimedJob`] fences the job document (still running under the claim's
//! token). [`DocumentLocks::release_with`] writes and unlocks in one statement and returns
//! the same [`FenceOutcome`].
//!
//! **Handles:** [`LockCollection`], [`DocumentLocks`] and [`Fence`] each have a sync `new`
//! that only validates and an async `open(db, name, …)` that runs
//! [`crate::preflight::check`] and creates the indexes. Contention is `Ok(None)`
//! ([`LockCollection::try_acquire`], [`DocumentLocks::try_lock`]), never an error.
//!
//! **Limits:** a lease is a promise about time, not about the holder: a process paused past
//! its ttl still believes it holds the lease. Writes made under a lease must therefore be
//! fenced ([`Fence`]). With
//! `w:1` a failover can roll back an acquire or a counter increment; use majority write
//! concern where that matters. See `docs/locks.md`.

pub(crate) mod collection;
mod deadline;
mod document;
mod election;
mod fence;
pub(crate) mod landing;
mod lease;
mod rwlock;
mod semaphore;
mod wake;
mod watchdog;

/// The stored lock formats (field names), typed.
pub use crate::format::lock as format;
pub use crate::token::FencingToken;
#[doc(hidden)]
pub use collection::AcquirePause;
pub use collection::{
    LockCollection, LockCounts, LockListFilter, LockOptions, LockRecord, MAX_GC_AFTER,
};
pub use document::{DocumentGuard, DocumentLockOptions, DocumentLockRecord, DocumentLocks};
pub use election::{Election, ElectionOptions, Leader, Leadership, Observer};
pub use fence::{Fence, FenceOptions, FenceOutcome, Fenced};
#[doc(hidden)]
pub use fence::{FenceCondition, FencePause};
pub use lease::{Lease, Owner};
pub use rwlock::{ReadLease, RwLockOptions, RwLockRecord, RwLocks, RwReaderRecord, RwWriterRecord};
pub use semaphore::{HolderRecord, Permit, Semaphore, SemaphoreOptions, SemaphoreRecord};
pub use watchdog::{LostReason, Watchdog, WatchdogOptions};
