//! Server time, estimated from `hello.localTime` (Cristian's algorithm).
//!
//! **Guarantee:** [`TimeSource::now`] returns an estimate of the server's clock and a bound
//! such that, as long as the client's clock does not drift faster than the configured
//! `drift_ppm`, the server's true time lies within `estimate ± bound`. All lease
//! arithmetic in docwarden goes through a [`TimeSource`], so a client whose own clock is
//! wrong by minutes still agrees with every other client on when a lease expires.
//!
//! **Limits:** the bound is half the best round trip of the last sampling, plus the
//! millisecond resolution of `localTime`, plus drift since then. A server whose own clock
//! jumps (NTP step, VM restore) moves every lease with it; add a skew margin
//! ([`ClockOptions::skew_margin`]) sized for your deployment.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mongodb::Client;
use mongodb::bson::{DateTime, doc};

use crate::error::{Error, Result};
use crate::validate;

/// The client's own wall clock, optionally shifted by a fixed offset.
///
/// Tests and the checker use the offset to simulate a machine whose clock is wrong.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LocalClock {
    offset_ms: i64,
}

impl LocalClock {
    /// The system clock, unshifted.
    pub fn system() -> Self {
        Self::default()
    }

    /// The system clock shifted by `offset_ms` milliseconds (positive: ahead).
    pub fn with_offset_ms(offset_ms: i64) -> Self {
        Self { offset_ms }
    }

    /// The offset from the system clock in milliseconds.
    pub fn offset_ms(&self) -> i64 {
        self.offset_ms
    }

    /// Milliseconds since the Unix epoch by this clock.
    pub fn now_ms(&self) -> i64 {
        let sys = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        sys.saturating_add(self.offset_ms)
    }
}

/// A point in server time: an estimate and the bound of its error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerTime {
    /// Estimated server time, milliseconds since the Unix epoch.
    pub estimate_ms: i64,
    /// The server's true time is within `estimate_ms ± bound_ms`.
    pub bound_ms: i64,
}

impl ServerTime {
    /// The estimate as a BSON date.
    pub fn estimate(&self) -> DateTime {
        DateTime::from_millis(self.estimate_ms)
    }

    /// The earliest the server's clock can read now.
    pub fn earliest(&self) -> DateTime {
        DateTime::from_millis(self.estimate_ms.saturating_sub(self.bound_ms))
    }

    /// The latest the server's clock can read now.
    pub fn latest(&self) -> DateTime {
        DateTime::from_millis(self.estimate_ms.saturating_add(self.bound_ms))
    }

    /// A deadline `ms` after the estimate: what to store as a lease's expiry.
    pub fn plus_ms(&self, ms: i64) -> DateTime {
        DateTime::from_millis(self.estimate_ms.saturating_add(ms))
    }

    /// The cut-off for taking over a lease: a lease whose expiry is before this instant has
    /// certainly expired by the server's clock, with `margin_ms` to spare.
    pub fn expired_before(&self, margin_ms: i64) -> DateTime {
        DateTime::from_millis(
            self.estimate_ms
                .saturating_sub(self.bound_ms)
                .saturating_sub(margin_ms),
        )
    }

    /// Whether a lease expiring at `expires_at` is still certainly valid, `margin_ms`
    /// included: what a holder checks before acting on its lease.
    pub fn certainly_before(&self, expires_at: DateTime, margin_ms: i64) -> bool {
        self.estimate_ms
            .saturating_add(self.bound_ms)
            .saturating_add(margin_ms)
            < expires_at.timestamp_millis()
    }
}

/// One measurement of the server clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClockSample {
    /// Server clock minus local clock, milliseconds.
    pub offset_ms: i64,
    /// Error bound of the offset, milliseconds.
    pub bound_ms: i64,
    /// Round trip of the `hello` that gave this sample.
    pub round_trip: Duration,
}

impl ClockSample {
    /// Cristian's algorithm: `hello` was sent at local `sent_ms`, answered with
    /// `server_ms`, and the answer arrived at local `received_ms`.
    pub fn from_exchange(sent_ms: i64, server_ms: i64, received_ms: i64) -> Self {
        let rtt = received_ms.saturating_sub(sent_ms).max(0);
        let midpoint = sent_ms.saturating_add(rtt / 2);
        Self {
            offset_ms: server_ms.saturating_sub(midpoint),
            // Half the round trip (rounded up) plus the 1 ms resolution of localTime.
            bound_ms: (rtt + 1) / 2 + 1,
            round_trip: Duration::from_millis(u64::try_from(rtt).unwrap_or(0)),
        }
    }
}

/// Options of a [`TimeSource`], validated by [`TimeSource::server`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClockOptions {
    /// How long a sample is trusted before `now` takes a new one. Default 30 s.
    pub refresh: Duration,
    /// Extra safety added by lease code on top of the measured bound. Default 250 ms.
    pub skew_margin: Duration,
    /// Assumed worst drift of the local clock, parts per million. Default 500.
    pub drift_ppm: u32,
    /// `hello` exchanges per refresh; the one with the shortest round trip wins. Default 3.
    pub samples: usize,
    /// How long one refresh may take before the previous sample is used. Default 5 s.
    pub hello_timeout: Duration,
}

impl Default for ClockOptions {
    fn default() -> Self {
        Self {
            refresh: Duration::from_secs(30),
            skew_margin: Duration::from_millis(250),
            drift_ppm: 500,
            samples: 3,
            hello_timeout: Duration::from_secs(5),
        }
    }
}

impl ClockOptions {
    /// Sets [`ClockOptions::refresh`].
    pub fn refresh(mut self, refresh: Duration) -> Self {
        self.refresh = refresh;
        self
    }
    /// Sets [`ClockOptions::skew_margin`].
    pub fn skew_margin(mut self, margin: Duration) -> Self {
        self.skew_margin = margin;
        self
    }
    /// Sets [`ClockOptions::drift_ppm`].
    pub fn drift_ppm(mut self, ppm: u32) -> Self {
        self.drift_ppm = ppm;
        self
    }
    /// Sets [`ClockOptions::hello_timeout`].
    pub fn hello_timeout(mut self, timeout: Duration) -> Self {
        self.hello_timeout = timeout;
        self
    }
    /// Sets [`ClockOptions::samples`].
    pub fn samples(mut self, samples: usize) -> Self {
        self.samples = samples;
        self
    }

    fn validate(&self) -> Result<()> {
        validate::duration_ms("clock refresh", self.refresh)?;
        // A zero margin is allowed (tests of the bound itself); it must fit in i64 ms.
        if i64::try_from(self.skew_margin.as_millis()).is_err() {
            return Err(Error::invalid("skew margin", "is too long"));
        }
        validate::positive("clock samples", self.samples)?;
        validate::duration_ms("clock hello timeout", self.hello_timeout)?;
        Ok(())
    }
}

#[derive(Clone, Copy, Debug)]
struct Estimate {
    sample: ClockSample,
    taken: Instant,
}

#[derive(Debug)]
enum Mode {
    Server {
        client: Client,
        state: RwLock<Option<Estimate>>,
        refreshing: tokio::sync::Mutex<()>,
    },
    Local,
}

#[derive(Debug)]
struct Inner {
    local: LocalClock,
    options: ClockOptions,
    mode: Mode,
}

/// Where docwarden gets the time: the server's clock (estimated), or a local clock.
///
/// Cloning is cheap; clones share one estimate.
///
/// ```no_run
/// # async fn example(client: mongodb::Client) -> docwarden::Result<()> {
/// use docwarden::clock::{ClockOptions, TimeSource};
/// let time = TimeSource::server(client, ClockOptions::default())?;
/// let now = time.now().await?;
/// println!("server time {} ± {} ms", now.estimate(), now.bound_ms);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct TimeSource {
    inner: Arc<Inner>,
}

impl TimeSource {
    /// Server time estimated over `client`, from the system clock.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] if the options are invalid.
    pub fn server(client: Client, options: ClockOptions) -> Result<Self> {
        Self::server_with_local(client, LocalClock::system(), options)
    }

    /// Server time estimated over `client` from a given local clock (tests inject skew
    /// here: the estimate must come out right anyway).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] if the options are invalid.
    pub fn server_with_local(
        client: Client,
        local: LocalClock,
        options: ClockOptions,
    ) -> Result<Self> {
        options.validate()?;
        Ok(Self {
            inner: Arc::new(Inner {
                local,
                options,
                mode: Mode::Server {
                    client,
                    state: RwLock::new(None),
                    refreshing: tokio::sync::Mutex::new(()),
                },
            }),
        })
    }

    /// Trusts a local clock as if it were the server's, with a zero bound. This is the
    /// *unsafe* configuration the checker's control runs use to show what client clocks
    /// do to leases; never use it in production.
    pub fn local_unchecked(local: LocalClock, options: ClockOptions) -> Result<Self> {
        options.validate()?;
        Ok(Self {
            inner: Arc::new(Inner {
                local,
                options,
                mode: Mode::Local,
            }),
        })
    }

    /// The configured skew margin in milliseconds.
    pub fn skew_margin_ms(&self) -> i64 {
        i64::try_from(self.inner.options.skew_margin.as_millis()).unwrap_or(i64::MAX)
    }

    /// The local clock this source reads.
    pub fn local(&self) -> LocalClock {
        self.inner.local
    }

    /// The current server time and its bound. Takes a new sample when the last one is
    /// older than the refresh interval; if that fails but an older sample exists, the old
    /// one is used with its bound widened by drift.
    ///
    /// # Errors
    /// A database error when no sample could ever be taken.
    pub async fn now(&self) -> Result<ServerTime> {
        let (state, refreshing) = match &self.inner.mode {
            Mode::Local => {
                return Ok(ServerTime {
                    estimate_ms: self.inner.local.now_ms(),
                    bound_ms: 0,
                });
            }
            Mode::Server {
                state, refreshing, ..
            } => (state, refreshing),
        };
        if let Some(est) = self.fresh(state) {
            return Ok(self.project(est));
        }
        let _single_flight = refreshing.lock().await;
        if let Some(est) = self.fresh(state) {
            return Ok(self.project(est));
        }
        match self.refresh().await {
            Ok(_) => {}
            Err(err) => {
                let old = *state.read().unwrap_or_else(|p| p.into_inner());
                match old {
                    Some(est) => {
                        tracing::warn!(%err, "clock refresh failed; using the previous sample");
                        return Ok(self.project(est));
                    }
                    None => return Err(err),
                }
            }
        }
        let est = (*state.read().unwrap_or_else(|p| p.into_inner())).ok_or(Error::Unsupported {
            capability: "hello.localTime",
        })?;
        Ok(self.project(est))
    }

    /// Measures the server clock now (several `hello` exchanges, best round trip wins) and
    /// stores the result. For a local source it returns a zero sample.
    ///
    /// # Errors
    /// A database error, [`Error::Unavailable`] if `hello` timed out, or
    /// [`Error::Unsupported`] if `hello` has no `localTime`.
    pub async fn refresh(&self) -> Result<ClockSample> {
        let Mode::Server { client, state, .. } = &self.inner.mode else {
            return Ok(ClockSample {
                offset_ms: 0,
                bound_ms: 0,
                round_trip: Duration::ZERO,
            });
        };
        let admin = client.database("admin");
        let mut best: Option<ClockSample> = None;
        for _ in 0..self.inner.options.samples {
            let sent = self.inner.local.now_ms();
            let reply = tokio::time::timeout(
                self.inner.options.hello_timeout,
                admin.run_command(doc! { "hello": 1 }),
            )
            .await
            .map_err(|_| Error::Unavailable {
                what: "server clock (hello timed out)",
            })??;
            let received = self.inner.local.now_ms();
            let server = reply
                .get_datetime("localTime")
                .map_err(|_| Error::Unsupported {
                    capability: "hello.localTime",
                })?
                .timestamp_millis();
            let sample = ClockSample::from_exchange(sent, server, received);
            if best.is_none_or(|b| sample.bound_ms < b.bound_ms) {
                best = Some(sample);
            }
        }
        let sample = best.ok_or(Error::Unsupported {
            capability: "hello.localTime",
        })?;
        *state.write().unwrap_or_else(|p| p.into_inner()) = Some(Estimate {
            sample,
            taken: Instant::now(),
        });
        tracing::debug!(
            offset_ms = sample.offset_ms,
            bound_ms = sample.bound_ms,
            "server clock sampled"
        );
        Ok(sample)
    }

    fn fresh(&self, state: &RwLock<Option<Estimate>>) -> Option<Estimate> {
        let est = (*state.read().unwrap_or_else(|p| p.into_inner()))?;
        (est.taken.elapsed() < self.inner.options.refresh).then_some(est)
    }

    fn project(&self, est: Estimate) -> ServerTime {
        project(
            est.sample,
            self.inner.local.now_ms(),
            est.taken.elapsed(),
            self.inner.options.drift_ppm,
        )
    }
}

/// Server time from a sample, the local clock now, and the time since the sample.
fn project(
    sample: ClockSample,
    local_now_ms: i64,
    elapsed: Duration,
    drift_ppm: u32,
) -> ServerTime {
    let elapsed_ms = i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX);
    let drift_ms = elapsed_ms.saturating_mul(i64::from(drift_ppm)) / 1_000_000 + 1;
    ServerTime {
        estimate_ms: local_now_ms.saturating_add(sample.offset_ms),
        bound_ms: sample.bound_ms.saturating_add(drift_ms),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cristian_offset_and_bound() {
        // Client 30 s ahead: sends at 1_030_000, server says 1_000_010, reply at 1_030_020.
        let s = ClockSample::from_exchange(1_030_000, 1_000_010, 1_030_020);
        assert_eq!(s.offset_ms, -30_000);
        assert_eq!(s.bound_ms, 11);
        assert_eq!(s.round_trip, Duration::from_millis(20));
    }

    #[test]
    fn true_time_is_within_bound_for_any_split_of_the_round_trip() {
        // Whatever part of the round trip the request took, the server's reading at the
        // moment of projection is within the bound.
        for skew in [-30_000_i64, 0, 30_000] {
            for rtt in [0_i64, 1, 7, 40] {
                for there in 0..=rtt {
                    let true_server_at_send = 5_000_000;
                    let sent = true_server_at_send + skew;
                    let server_reading = true_server_at_send + there;
                    let received = sent + rtt;
                    let sample = ClockSample::from_exchange(sent, server_reading, received);
                    let now = project(sample, received, Duration::ZERO, 500);
                    let truth = true_server_at_send + rtt;
                    assert!(
                        (now.estimate_ms - truth).abs() <= now.bound_ms,
                        "skew {skew} rtt {rtt} there {there}: {now:?} vs {truth}"
                    );
                }
            }
        }
    }

    #[test]
    fn bound_grows_with_drift() {
        let s = ClockSample::from_exchange(0, 0, 0);
        let a = project(s, 0, Duration::ZERO, 500);
        let b = project(s, 0, Duration::from_secs(100), 500);
        assert_eq!(b.bound_ms - a.bound_ms, 50);
    }

    #[test]
    fn expiry_helpers_include_bound_and_margin() {
        let t = ServerTime {
            estimate_ms: 10_000,
            bound_ms: 5,
        };
        assert_eq!(t.expired_before(100).timestamp_millis(), 9_895);
        assert!(t.certainly_before(DateTime::from_millis(10_106), 100));
        assert!(!t.certainly_before(DateTime::from_millis(10_105), 100));
        assert_eq!(t.plus_ms(1_000).timestamp_millis(), 11_000);
    }

    #[test]
    fn options_are_validated() {
        assert!(ClockOptions::default().validate().is_ok());
        assert!(
            ClockOptions::default()
                .refresh(Duration::ZERO)
                .validate()
                .is_err()
        );
        assert!(ClockOptions::default().samples(0).validate().is_err());
    }

    #[tokio::test]
    async fn local_source_reads_the_shifted_clock() -> Result<()> {
        let t = TimeSource::local_unchecked(
            LocalClock::with_offset_ms(30_000),
            ClockOptions::default(),
        )?;
        let now = t.now().await?;
        let sys = LocalClock::system().now_ms();
        assert!((now.estimate_ms - sys - 30_000).abs() < 1_000);
        assert_eq!(now.bound_ms, 0);
        Ok(())
    }
}
