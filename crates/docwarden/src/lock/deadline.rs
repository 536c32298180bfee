//! The wait of a blocking acquire ([`super::LockCollection::acquire`],
//! [`super::Semaphore::acquire`], [`super::RwLocks::read`] and [`super::RwLocks::write`],
//! [`super::Election::campaign`], [`super::DocumentLocks::lock`]) and what a transient error does to it.
//!
//! **Behaviour:** a blocking acquire keeps trying through errors that
//! [`Error::is_retryable`] calls transient (not primary, stepping down, a network error, no
//! server selectable) until its wait has passed, as it keeps trying through contention. A
//! failover, a restart or a network blip shorter than the wait is then a delay, not an
//! error. When the wait passes, the acquire returns the last attempt's error if that attempt
//! failed (so "the server was unreachable" is never reported as "someone else holds it":
//! `Ok(None)`), and `Ok(None)` otherwise. Any other error (invalid input, a malformed lock
//! document, a refused write) ends the wait at once. A zero wait tries once, as the `try_*`
//! calls do, and returns its error as it is.
//!
//! **Why retrying is safe:** an attempt whose reply was lost may have taken the lock. The
//! lock collection's acquire (and the election and the write lock built on it) then takes
//! it back from itself: each later attempt also matches the acquisitions of the earlier
//! attempts that failed transiently (their nonces, the last 16), never the current one's,
//! and hands out a fresh token; nobody else was ever told they hold it. The semaphore's
//! acquire likewise gives back the holder entries such attempts were granted, in the write
//! that admits its next attempt, and takes one fresh, certainly valid permit (session 18;
//! before, it returned the lost attempt's entry as it was, which could have lapsed). A blocking read ([`super::RwLocks::read`]) removes the entries its earlier
//! attempts may have left in the readers (so they do not hold a writer up until their
//! ttl), and, when a writer's intent arrived behind such an entry, enters by renewing that
//! entry under the new attempt's id while it is still certainly valid (the writer waits for
//! it anyway) instead of waiting behind the writer. A blocking document lock
//! ([`super::DocumentLocks::lock`]) takes over a lock carrying one of its earlier attempts'
//! lock ids. Where an acquire does not recognise its own lost acquisition (a `try_*` call
//! retried by its caller), the next attempt finds it held and waits like any other contender,
//! until that lease expires or the wait passes. Nobody ever holds two leases at once: the
//! cost of an unrecognised lost reply is at most one ttl of waiting — except for the lock
//! collection's acquire (and the election and the write lock built on it) and the
//! document lock's `try_lock`/`lock`, the semaphore's acquire and `RwLocks::try_read`
//! since session 24: each of
//! their attempts carries a landing deadline, and what an attempt that ended without an
//! answer took (the lock, or the semaphore's holder entry) is freed once that deadline has
//! passed (`lock/landing.rs`), so the wait is about 2 s.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// The wait budget of one blocking acquire, and the transient error of its last attempt.
#[derive(Debug)]
pub(crate) struct Deadline {
    /// `None`: a wait too long to represent, waiting "forever".
    at: Option<Instant>,
    /// The last attempt's error, if it was transient and absorbed.
    last_error: Option<Error>,
}

impl Deadline {
    /// A wait of `wait` from now.
    pub(crate) fn after(wait: Duration) -> Self {
        Self {
            at: Instant::now().checked_add(wait),
            last_error: None,
        }
    }

    /// The time left, or `None` once the wait has passed (`Duration::MAX` for a wait
    /// without end).
    pub(crate) fn left(&self) -> Option<Duration> {
        match self.at {
            None => Some(Duration::MAX),
            Some(at) => {
                let now = Instant::now();
                (now < at).then(|| at - now)
            }
        }
    }

    /// Records an attempt that ended without error (contention): the wait's outcome is
    /// `Ok(None)` again if it passes now.
    pub(crate) fn attempted(&mut self) {
        self.last_error = None;
    }

    /// Whether the last attempt failed with a transient error (the caller then backs off
    /// instead of waiting for a release it would not see).
    pub(crate) fn failing(&self) -> bool {
        self.last_error.is_some()
    }

    /// Takes an attempt's error: a transient one while time is left is kept, logged and
    /// absorbed (`Ok(())`: try again); any other error, or any error once the wait has
    /// passed, is returned.
    ///
    /// # Errors
    /// `e` itself, when it ends the wait.
    pub(crate) fn absorb(&mut self, e: Error) -> Result<()> {
        if !e.is_retryable() || self.left().is_none() {
            return Err(e);
        }
        tracing::debug!(error = %e, "transient error while waiting: trying again");
        self.last_error = Some(e);
        Ok(())
    }

    /// Takes one attempt's result: `Some(value)` when it succeeded; `None` after
    /// contention ([`Deadline::attempted`]) or a transient error absorbed while time is
    /// left ([`Deadline::absorb`]).
    ///
    /// # Errors
    /// The attempt's error, when it ends the wait.
    pub(crate) fn attempt<T>(&mut self, result: Result<Option<T>>) -> Result<Option<T>> {
        match result {
            Ok(Some(value)) => Ok(Some(value)),
            Ok(None) => {
                self.attempted();
                Ok(None)
            }
            Err(e) => self.absorb(e).map(|()| None),
        }
    }

    /// The outcome of a wait that passed: the last attempt's error if it failed,
    /// `Ok(None)` if it met contention.
    ///
    /// # Errors
    /// The last attempt's transient error.
    pub(crate) fn passed<T>(self) -> Result<Option<T>> {
        match self.last_error {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }
}

/// How many earlier attempts' nonces a blocking acquire recognises as its own; an older
/// one's lost acquisition is waited out until its ttl, as before.
const MAX_UNANSWERED: usize = 16;

/// The acquisition nonces of a blocking acquire's earlier attempts that failed with a
/// transient error: their write may have applied all the same (a lost reply), so the next
/// attempts take that acquisition back as their own instead of waiting behind it until
/// its ttl (`LockCollection::acquire`, `Semaphore::acquire`, `RwLocks::read`, the
/// writer's intent through `LockCollection::acquire`, and `DocumentLocks::lock`, whose
/// "nonces" are its attempts' lock ids). Only earlier attempts are
/// listed, never the one in flight; the last [`MAX_UNANSWERED`] are kept.
#[derive(Debug, Default)]
pub(crate) struct Unanswered {
    nonces: Vec<String>,
}

impl Unanswered {
    /// Records the attempt with `nonce` if `result` is a transient error.
    pub(crate) fn note<T>(&mut self, nonce: String, result: &Result<T>) {
        if matches!(result, Err(e) if e.is_retryable()) {
            if self.nonces.len() >= MAX_UNANSWERED {
                self.nonces.remove(0);
            }
            self.nonces.push(nonce);
        }
    }

    /// The nonces recorded so far, oldest first.
    pub(crate) fn nonces(&self) -> &[String] {
        &self.nonces
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_transient_errors_are_absorbed_and_only_while_time_is_left() {
        let transient = || Error::Unavailable { what: "test" };
        let mut d = Deadline::after(Duration::from_secs(60));
        assert!(d.absorb(transient()).is_ok());
        assert!(d.failing());
        assert!(d.absorb(Error::invalid("ttl", "zero")).is_err());
        d.attempted();
        assert!(!d.failing());
        assert!(matches!(d.passed::<()>(), Ok(None)));

        let mut d = Deadline::after(Duration::from_secs(60));
        assert!(matches!(d.attempt(Ok(Some(1))), Ok(Some(1))));
        assert!(matches!(d.attempt::<i32>(Err(transient())), Ok(None)));
        assert!(d.failing());
        assert!(matches!(d.attempt::<i32>(Ok(None)), Ok(None)));
        assert!(!d.failing());

        let mut zero = Deadline::after(Duration::ZERO);
        assert!(zero.left().is_none());
        assert!(zero.absorb(transient()).is_err(), "a zero wait tries once");

        let mut forever = Deadline::after(Duration::MAX);
        assert_eq!(forever.left(), Some(Duration::MAX));
        assert!(forever.absorb(transient()).is_ok());
        assert!(matches!(
            forever.passed::<()>(),
            Err(Error::Unavailable { .. })
        ));
    }
}
