//! Exponential backoff with full jitter, shared by blocking acquires, job retries and
//! reconnect loops.
//!
//! "Full jitter" (a uniformly random delay between zero and the exponential cap) spreads
//! retries of many clients apart, so a released lock or a restarted server is not hit by
//! all of them at the same instant.

use std::time::Duration;

use crate::error::Result;
use crate::validate;

/// A backoff schedule: the `n`-th delay is random in `[0, min(max, base · 2ⁿ)]`, and never
/// below `floor`.
#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    floor: Duration,
    attempt: u32,
}

impl Backoff {
    /// A schedule from `base` doubling up to `max`.
    ///
    /// # Errors
    /// [`crate::Error::InvalidInput`] if `base` is zero or `max < base`.
    pub fn new(base: Duration, max: Duration) -> Result<Self> {
        validate::duration_ms("backoff base", base)?;
        if max < base {
            return Err(crate::Error::invalid(
                "backoff max",
                "must not be below the base",
            ));
        }
        Ok(Self {
            base,
            max,
            floor: Duration::ZERO,
            attempt: 0,
        })
    }

    /// Never wait less than `floor` (for example to avoid a busy loop).
    pub fn with_floor(mut self, floor: Duration) -> Self {
        self.floor = floor.min(self.max);
        self
    }

    /// The cap of the `attempt`-th delay (no jitter): `min(max, base · 2^attempt)`.
    pub fn cap(&self, attempt: u32) -> Duration {
        let factor = 1_u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }

    /// The next delay, jittered, and advances the schedule.
    pub fn next_delay(&mut self) -> Duration {
        let cap = self.cap(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        let jittered = cap.mul_f64(rand::random::<f64>());
        jittered.max(self.floor)
    }

    /// How many delays were handed out since the last reset.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// Starts over from `base` (after a success).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_to_the_cap_and_stay_jittered() -> Result<()> {
        let mut b = Backoff::new(Duration::from_millis(10), Duration::from_millis(100))?;
        assert_eq!(b.cap(0), Duration::from_millis(10));
        assert_eq!(b.cap(3), Duration::from_millis(80));
        assert_eq!(b.cap(4), Duration::from_millis(100));
        assert_eq!(b.cap(40), Duration::from_millis(100));
        for _ in 0..50 {
            assert!(b.next_delay() <= Duration::from_millis(100));
        }
        assert_eq!(b.attempts(), 50);
        b.reset();
        assert_eq!(b.attempts(), 0);
        Ok(())
    }

    #[test]
    fn floor_and_validation() -> Result<()> {
        let mut b = Backoff::new(Duration::from_millis(10), Duration::from_millis(20))?
            .with_floor(Duration::from_millis(5));
        for _ in 0..50 {
            assert!(b.next_delay() >= Duration::from_millis(5));
        }
        assert!(Backoff::new(Duration::ZERO, Duration::from_secs(1)).is_err());
        assert!(Backoff::new(Duration::from_secs(2), Duration::from_secs(1)).is_err());
        Ok(())
    }
}
