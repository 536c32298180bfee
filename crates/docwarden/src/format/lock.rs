//! The stored lock formats (re-exported as [`crate::lock::format`]), typed, for tools and other languages (see `docs/locks.md`):
//! the fields of a lock-collection document and the default fields of a document lock.
//! Code outside the library (the CLI, `check`) names stored fields through these constants.

/// Suffix of the fencing-token counter collection of a lock collection or a semaphore
/// collection `<name>`: `<name>.tokens`.
pub const TOKENS_SUFFIX: &str = ".tokens";

/// Fields of a lock document in a [`crate::lock::LockCollection`] (`_id` is the resource).
pub mod collection {
    /// The holder's owner id.
    pub const OWNER: &str = "owner";
    /// The fencing token of the acquisition (set once committed).
    pub const TOKEN: &str = "token";
    /// The top of the block of tokens reserved in the counter for this document: an
    /// acquire takes `token + 1` in its own write while `token < ceiling`.
    pub const CEILING: &str = "ceiling";
    /// The random nonce of the current (or last) acquisition, written by every acquire.
    pub const ACQUISITION: &str = "acquisition";
    /// The acquisition's nonce while its token is not committed yet (slow path only).
    pub const PENDING: &str = "pending";
    /// Server time the lease was acquired.
    pub const ACQUIRED_AT: &str = "acquired_at";
    /// Server time the lease expires unless renewed (set to the server's now on release).
    pub const EXPIRES_AT: &str = "expires_at";
    /// The garbage-collection date, the TTL index's field: never before the latest lease
    /// expiry in the document — the holder's and, in a read/write lock, every reader's,
    /// renewals included. Every write raises it, none lowers it; the TTL index deletes the
    /// document `gc_after` after it.
    pub const GC_AT: &str = "gc_at";

    /// Every field docwarden writes in a lock document, `_id` excepted.
    pub const ALL: [&str; 8] = [
        OWNER,
        TOKEN,
        CEILING,
        ACQUISITION,
        PENDING,
        ACQUIRED_AT,
        EXPIRES_AT,
        GC_AT,
    ];
}

/// Fields of a semaphore document in a [`crate::lock::Semaphore`] (`_id` is the resource).
/// The counter collection `<name>.tokens` holds `{_id: resource, token}` (the top of the
/// last reserved block), as for the lock collection.
pub mod semaphore {
    /// The document's `_id`: the resource.
    pub const ID: &str = "_id";
    /// How many holders the resource admits (int64; the handle's default when missing).
    pub const PERMITS: &str = "permits";
    /// The holders: an array of `{owner, token, acquisition, acquired_at, until}`.
    pub const HOLDERS: &str = "holders";
    /// The last fencing token handed out (int64).
    pub const TOKEN: &str = "token";
    /// The top of the token block reserved in the counter: a permit takes `token + 1`
    /// only while `token < ceiling`.
    pub const CEILING: &str = "ceiling";
    /// A refill's random nonce between marking the document and committing a new block.
    pub const REFILL: &str = "refill";

    /// Every field docwarden writes in a semaphore document, `_id` excepted.
    pub const ALL: [&str; 5] = [PERMITS, HOLDERS, TOKEN, CEILING, REFILL];

    /// Fields of one element of `holders`.
    pub mod holder {
        /// The holder's owner id.
        pub const OWNER: &str = "owner";
        /// The permit's fencing token (int64, strictly increasing per resource).
        pub const TOKEN: &str = "token";
        /// The random nonce of the acquire that added this holder.
        pub const ACQUISITION: &str = "acquisition";
        /// Server time the permit was granted.
        pub const ACQUIRED_AT: &str = "acquired_at";
        /// Server time the permit expires unless renewed; an acquire drops the holder
        /// once `until` is before server time minus the clock bound and skew margin.
        pub const UNTIL: &str = "until";

        /// Every field of a holder.
        pub const ALL: [&str; 5] = [OWNER, TOKEN, ACQUISITION, ACQUIRED_AT, UNTIL];
    }
}

/// Fields a read/write lock ([`crate::lock::RwLocks`]) adds to a lock document of its
/// collection. The writer is the lock document's own holder (`owner`, `token`,
/// `expires_at` of [`collection`]); while it is set and not expired, no reader enters.
pub mod rwlock {
    /// The array of read holders: one entry per read acquisition.
    pub const READERS: &str = "readers";
    /// In a reader entry: the reader's owner id.
    pub const READER_OWNER: &str = "owner";
    /// In a reader entry: the random id of this read acquisition.
    pub const READER_ID: &str = "id";
    /// In a reader entry: server time the read lease was acquired.
    pub const READER_ACQUIRED_AT: &str = "acquired_at";
    /// In a reader entry: server time the read lease expires unless renewed.
    pub const READER_EXPIRES_AT: &str = "expires_at";

    /// Every field of a reader entry.
    pub const READER_ALL: [&str; 4] = [
        READER_OWNER,
        READER_ID,
        READER_ACQUIRED_AT,
        READER_EXPIRES_AT,
    ];
}

/// An election ([`crate::lock::Election`]) is a lock document of [`collection`] whose
/// `_id` is the election's name: the leader is `owner`, the term is `token`, the term's
/// expiry is `expires_at`. Its default collection name:
pub const ELECTIONS: &str = "elections";

/// The default collection of read/write locks ([`crate::lock::RwLocks`]).
pub const RWLOCKS: &str = "rwlocks";

/// The default collection of semaphores ([`crate::lock::Semaphore`]), as `docwarden locks`
/// reads it.
pub const SEMAPHORES: &str = "semaphores";

/// Default fields of a document lock ([`crate::lock::DocumentLockOptions`]).
pub mod document {
    /// The random lock id of the holder (`null` when unlocked).
    pub const LOCK_ID: &str = "lock_id";
    /// Server time the lock was taken.
    pub const LOCK_TIME: &str = "lock_time";

    /// Every field docwarden writes in a locked document by default.
    pub const ALL: [&str; 2] = [LOCK_ID, LOCK_TIME];
}

/// The default token field of a [`crate::lock::Fence`] target document.
pub const FENCE_TOKEN: &str = "fence_token";
