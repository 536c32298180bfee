//! Server time, estimated from `hello.localTime` (Cristian's algorithm).
//!
//! **Guarantee:** [`TimeSource::now`] returns an estimate of the server's clock and a bound
//! such that, as long as the client's *monotonic* clock does not run faster or slower than
//! the configured `drift_ppm`, the server's true time lies within `estimate ± bound`. The
//! estimate is the server's reading plus half the round trip, projected forward on the
//! monotonic clock; the client's wall clock is never part of it. So a client whose wall
//! clock is wrong by minutes — constantly, or because NTP or a VM resume *steps* it
//! mid-run — agrees with every other client on when a lease expires. All lease arithmetic
//! in docwarden goes through a [`TimeSource`].
//!
//! **Limits:** the bound is half the best round trip of the last sampling, plus the
//! millisecond resolution of `localTime`, plus drift since then. A sample is re-taken when
//! it is older than [`ClockOptions::refresh`], when the wall clock and the monotonic clock
//! disagree about the time since the sample by more than the drift allows (a step, or a
//! suspend the monotonic clock did not count), and when a [`PrimaryWatch`] reports a new
//! primary (a failover brings a new server clock). A server whose own clock jumps moves
//! every lease with it; add a skew margin ([`ClockOptions::skew_margin`]) sized for your
//! deployment.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mongodb::Client;
use mongodb::ServerType;
use mongodb::bson::{DateTime, doc};
use mongodb::event::EventHandler;
use mongodb::event::sdam::SdamEvent;
use mongodb::options::ClientOptions;

use crate::error::{Error, Result};
use crate::validate;

/// The client's own wall clock, optionally shifted by an offset that can be stepped while
/// it is in use.
///
/// docwarden's server-time estimate does not depend on it (see the module docs); tests and
/// the checker shift and step it to show exactly that. Clones share one offset, so a
/// [`LocalClock::step_ms`] on any clone moves them all.
#[derive(Clone, Debug, Default)]
pub struct LocalClock {
    offset_ms: Arc<AtomicI64>,
}

impl PartialEq for LocalClock {
    fn eq(&self, other: &Self) -> bool {
        self.offset_ms() == other.offset_ms()
    }
}

impl Eq for LocalClock {}

impl LocalClock {
    /// The system clock, unshifted.
    pub fn system() -> Self {
        Self::default()
    }

    /// The system clock shifted by `offset_ms` milliseconds (positive: ahead).
    pub fn with_offset_ms(offset_ms: i64) -> Self {
        Self {
            offset_ms: Arc::new(AtomicI64::new(offset_ms)),
        }
    }

    /// The offset from the system clock in milliseconds.
    pub fn offset_ms(&self) -> i64 {
        self.offset_ms.load(Ordering::Relaxed)
    }

    /// Steps this clock (and every clone of it) by `delta_ms` milliseconds, the way an NTP
    /// step or a VM resume moves a machine's wall clock.
    pub fn step_ms(&self, delta_ms: i64) {
        // Saturating: an absurd step is clamped rather than wrapped.
        let _ = self
            .offset_ms
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |o| {
                Some(o.saturating_add(delta_ms))
            });
    }

    /// Milliseconds since the Unix epoch by this clock.
    pub fn now_ms(&self) -> i64 {
        let sys = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        sys.saturating_add(self.offset_ms())
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
    /// Server clock minus local wall clock, milliseconds (informative: `doctor` shows it;
    /// the estimate does not use it).
    pub offset_ms: i64,
    /// Error bound of the server reading at the moment the reply arrived, milliseconds.
    pub bound_ms: i64,
    /// Round trip of the `hello` that gave this sample, on the monotonic clock.
    pub round_trip: Duration,
}

impl ClockSample {
    /// Cristian's algorithm: `hello` was sent at local `sent_ms`, answered with
    /// `server_ms`, and the answer arrived at local `received_ms`.
    pub fn from_exchange(sent_ms: i64, server_ms: i64, received_ms: i64) -> Self {
        let rtt = received_ms.saturating_sub(sent_ms).max(0);
        Self::from_round_trip(
            server_ms,
            Duration::from_millis(u64::try_from(rtt).unwrap_or(0)),
            received_ms,
        )
    }

    /// Cristian's algorithm with the round trip measured on a monotonic clock: the server
    /// answered `server_ms`, the exchange took `round_trip`, and the wall clock read
    /// `received_ms` when the answer arrived (only for [`ClockSample::offset_ms`]).
    pub fn from_round_trip(server_ms: i64, round_trip: Duration, received_ms: i64) -> Self {
        let rtt = millis(round_trip);
        Self {
            offset_ms: server_ms
                .saturating_add(rtt / 2)
                .saturating_sub(received_ms),
            // Half the round trip (rounded up) plus the 1 ms resolution of localTime.
            bound_ms: (rtt.saturating_add(1)) / 2 + 1,
            round_trip,
        }
    }
}

/// Counters of a [`TimeSource`]: how often it sampled and why.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClockStats {
    /// Samplings that succeeded (each is `samples` `hello` exchanges).
    pub samples: u64,
    /// Samplings that failed (the previous sample was used, its bound widened).
    pub failed_refreshes: u64,
    /// Samples discarded early because the wall clock and the monotonic clock disagreed.
    pub wall_clock_steps: u64,
    /// Samples discarded early because a [`PrimaryWatch`] reported a new primary.
    pub primary_changes: u64,
}

/// Reports a new primary to every [`TimeSource`] that holds it, so their next `now()`
/// re-samples the new primary's clock instead of projecting the old one's for up to a
/// refresh period.
///
/// Install it on the client's options before the client is built:
///
/// ```no_run
/// # async fn example() -> docwarden::Result<()> {
/// use docwarden::clock::{ClockOptions, PrimaryWatch, TimeSource};
/// let mut options = mongodb::options::ClientOptions::parse("mongodb://localhost").await?;
/// let watch = PrimaryWatch::install(&mut options);
/// let client = mongodb::Client::with_options(options)?;
/// let time = TimeSource::server(client, ClockOptions::default().primary_watch(watch))?;
/// # Ok(()) }
/// ```
///
/// If the options already carry an SDAM event handler, call [`PrimaryWatch::observe`]
/// from it instead.
#[derive(Clone, Debug, Default)]
pub struct PrimaryWatch {
    epoch: Arc<AtomicU64>,
}

impl PrimaryWatch {
    /// A watch that has seen no primary yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A new watch installed as `options`' SDAM event handler. An existing handler is kept
    /// and the watch is not installed (call [`PrimaryWatch::observe`] from it).
    pub fn install(options: &mut ClientOptions) -> Self {
        let watch = Self::new();
        if options.sdam_event_handler.is_none() {
            options.sdam_event_handler = Some(watch.event_handler());
        } else {
            tracing::warn!(
                "client options already have an SDAM event handler: call PrimaryWatch::observe from it"
            );
        }
        watch
    }

    /// An SDAM event handler that feeds this watch.
    pub fn event_handler(&self) -> EventHandler<SdamEvent> {
        let watch = self.clone();
        EventHandler::callback(move |event: SdamEvent| watch.observe(&event))
    }

    /// Looks at one SDAM event: a server that becomes primary (it was not before) is a new
    /// primary.
    pub fn observe(&self, event: &SdamEvent) {
        if let SdamEvent::ServerDescriptionChanged(change) = event
            && change.new_description.server_type() == ServerType::RsPrimary
            && change.previous_description.server_type() != ServerType::RsPrimary
        {
            tracing::debug!(address = %change.address, "new primary: server clock to be re-sampled");
            self.note_new_primary();
        }
    }

    /// Records a new primary by hand (for example from an application's own failover
    /// signal).
    pub fn note_new_primary(&self) {
        self.epoch.fetch_add(1, Ordering::Relaxed);
    }

    /// How many new primaries this watch has seen.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }
}

/// The most `hello` exchanges one refresh may make ([`ClockOptions::samples`]): the best
/// of a few round trips is as good as the best of many, and the refresh holds up every
/// `now()` of its source while it runs.
pub const MAX_SAMPLES: usize = 16;

/// Options of a [`TimeSource`], validated by [`TimeSource::server`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClockOptions {
    /// How long a sample is trusted before `now` takes a new one. Default 30 s.
    pub refresh: Duration,
    /// Extra safety added by lease code on top of the measured bound. Default 250 ms.
    pub skew_margin: Duration,
    /// Assumed worst drift of the local monotonic clock, parts per million. Default 500.
    pub drift_ppm: u32,
    /// `hello` exchanges per refresh; the one with the shortest round trip wins. Default 3;
    /// at least 1 and at most [`MAX_SAMPLES`] (each is a round trip, and every `now()` of
    /// the source waits for a refresh in progress).
    pub samples: usize,
    /// How long one refresh may take before the previous sample is used. Default 5 s.
    pub hello_timeout: Duration,
    /// How far the wall clock may disagree with the monotonic clock about the time since
    /// the sample (beyond drift) before the sample is re-taken. Default 100 ms.
    pub step_tolerance: Duration,
    /// Re-sample when this watch reports a new primary. Default none.
    pub primary_watch: Option<PrimaryWatch>,
    /// The control of the clock-step tests and `verify`: project the sample on the *wall*
    /// clock (as docwarden did before 0.2) and ignore steps. Never set it in production.
    #[doc(hidden)]
    pub unsafe_wall_clock_projection: bool,
}

impl Default for ClockOptions {
    fn default() -> Self {
        Self {
            refresh: Duration::from_secs(30),
            skew_margin: Duration::from_millis(250),
            drift_ppm: 500,
            samples: 3,
            hello_timeout: Duration::from_secs(5),
            step_tolerance: Duration::from_millis(100),
            primary_watch: None,
            unsafe_wall_clock_projection: false,
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
    /// Sets [`ClockOptions::step_tolerance`].
    pub fn step_tolerance(mut self, tolerance: Duration) -> Self {
        self.step_tolerance = tolerance;
        self
    }
    /// The control: projects samples on the wall clock, so a step of the wall clock moves
    /// the estimate. Never use it in production.
    #[doc(hidden)]
    pub fn unsafe_wall_clock_projection(mut self) -> Self {
        self.unsafe_wall_clock_projection = true;
        self
    }
    /// Sets [`ClockOptions::primary_watch`].
    pub fn primary_watch(mut self, watch: PrimaryWatch) -> Self {
        self.primary_watch = Some(watch);
        self
    }

    fn validate(&self) -> Result<()> {
        validate::duration_ms("clock refresh", self.refresh)?;
        // A zero margin is allowed (tests of the bound itself); it must fit in i64 ms.
        if i64::try_from(self.skew_margin.as_millis()).is_err() {
            return Err(Error::invalid("skew margin", "is too long"));
        }
        if i64::try_from(self.step_tolerance.as_millis()).is_err() {
            return Err(Error::invalid("clock step tolerance", "is too long"));
        }
        validate::positive("clock samples", self.samples)?;
        if self.samples > MAX_SAMPLES {
            return Err(Error::invalid(
                "clock samples",
                format!("must be at most {MAX_SAMPLES}"),
            ));
        }
        validate::duration_ms("clock hello timeout", self.hello_timeout)?;
        Ok(())
    }
}

/// A sample anchored on the monotonic clock.
#[derive(Clone, Copy, Debug)]
struct Estimate {
    sample: ClockSample,
    /// Estimated server time when the reply arrived.
    server_ms: i64,
    /// The monotonic instant the reply arrived.
    anchor: Instant,
    /// The wall clock when the reply arrived (only to detect steps).
    wall_ms: i64,
    /// The primary watch's epoch when the sample was taken.
    epoch: u64,
}

#[derive(Debug, Default)]
struct Counters {
    samples: AtomicU64,
    failed_refreshes: AtomicU64,
    wall_clock_steps: AtomicU64,
    primary_changes: AtomicU64,
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
    counters: Counters,
}

/// Why a sample is no longer trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Staleness {
    Fresh,
    Old,
    WallClockStep,
    NewPrimary,
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
    /// Server time estimated over `client`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] if the options are invalid.
    pub fn server(client: Client, options: ClockOptions) -> Result<Self> {
        Self::server_with_local(client, LocalClock::system(), options)
    }

    /// Server time estimated over `client`, with `local` as the wall clock it watches for
    /// steps (tests inject skew and steps here: the estimate must come out right anyway).
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
                counters: Counters::default(),
            }),
        })
    }

    /// Trusts a local clock as if it were the server's, with a zero bound. This is the
    /// *unsafe* configuration the checker's control runs use to show what client clocks
    /// do to leases; never use it in production.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] if the options are invalid.
    pub fn local_unchecked(local: LocalClock, options: ClockOptions) -> Result<Self> {
        options.validate()?;
        Ok(Self {
            inner: Arc::new(Inner {
                local,
                options,
                mode: Mode::Local,
                counters: Counters::default(),
            }),
        })
    }

    /// The address this source and its clones share: equal for two handles only if they
    /// are clones of one source, and never reused while one of them is alive.
    pub(crate) fn identity(&self) -> *const () {
        Arc::as_ptr(&self.inner).cast()
    }

    /// [`TimeSource::now`] without any I/O: the projection of the last sample if it is
    /// still fresh (`None` otherwise; a local source always answers).
    pub(crate) fn now_if_fresh(&self) -> Option<ServerTime> {
        match &self.inner.mode {
            Mode::Local => Some(ServerTime {
                estimate_ms: self.inner.local.now_ms(),
                bound_ms: 0,
            }),
            Mode::Server { state, .. } => {
                let current = *state.read().unwrap_or_else(|p| p.into_inner());
                current
                    .filter(|est| self.staleness(est) == Staleness::Fresh)
                    .map(|est| self.project(est))
            }
        }
    }

    /// The configured skew margin in milliseconds.
    pub fn skew_margin_ms(&self) -> i64 {
        millis(self.inner.options.skew_margin)
    }

    /// The local wall clock this source watches (or, for a local source, reads).
    pub fn local(&self) -> LocalClock {
        self.inner.local.clone()
    }

    /// How often this source sampled, failed to, and discarded a sample early.
    pub fn stats(&self) -> ClockStats {
        let c = &self.inner.counters;
        ClockStats {
            samples: c.samples.load(Ordering::Relaxed),
            failed_refreshes: c.failed_refreshes.load(Ordering::Relaxed),
            wall_clock_steps: c.wall_clock_steps.load(Ordering::Relaxed),
            primary_changes: c.primary_changes.load(Ordering::Relaxed),
        }
    }

    /// Forgets the current sample: the next [`TimeSource::now`] takes a new one.
    pub fn invalidate(&self) {
        if let Mode::Server { state, .. } = &self.inner.mode {
            *state.write().unwrap_or_else(|p| p.into_inner()) = None;
        }
    }

    /// The current server time and its bound. Takes a new sample when the last one is
    /// older than the refresh interval, when the wall clock stepped since it, or when a new
    /// primary was reported; if that fails but an older sample exists, the old one is used
    /// with its bound widened by drift (and by the size of any wall-clock step, since a
    /// step may also be a suspend the monotonic clock did not count).
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
        let current = *state.read().unwrap_or_else(|p| p.into_inner());
        if let Some(est) = current
            && self.staleness(&est) == Staleness::Fresh
        {
            return Ok(self.project(est));
        }
        let _single_flight = refreshing.lock().await;
        let current = *state.read().unwrap_or_else(|p| p.into_inner());
        if let Some(est) = current {
            match self.staleness(&est) {
                Staleness::Fresh => return Ok(self.project(est)),
                Staleness::WallClockStep => {
                    self.inner
                        .counters
                        .wall_clock_steps
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("wall clock stepped since the last sample: re-sampling");
                }
                Staleness::NewPrimary => {
                    self.inner
                        .counters
                        .primary_changes
                        .fetch_add(1, Ordering::Relaxed);
                }
                Staleness::Old => {}
            }
        }
        match self.refresh().await {
            Ok(_) => {}
            Err(err) => {
                self.inner
                    .counters
                    .failed_refreshes
                    .fetch_add(1, Ordering::Relaxed);
                match current {
                    Some(est) => {
                        tracing::warn!(%err, "clock refresh failed; using the previous sample");
                        let mut t = self.project(est);
                        t.bound_ms = t.bound_ms.saturating_add(self.wall_disagreement_ms(&est));
                        return Ok(t);
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
        let epoch = self.watch_epoch();
        let admin = client.database("admin");
        let mut best: Option<Estimate> = None;
        for _ in 0..self.inner.options.samples {
            let sent = Instant::now();
            let reply = tokio::time::timeout(
                self.inner.options.hello_timeout,
                admin.run_command(doc! { "hello": 1 }),
            )
            .await
            .map_err(|_| Error::Unavailable {
                what: "server clock (hello timed out)",
            })??;
            let anchor = Instant::now();
            let wall_ms = self.inner.local.now_ms();
            let server = reply
                .get_datetime("localTime")
                .map_err(|_| Error::Unsupported {
                    capability: "hello.localTime",
                })?
                .timestamp_millis();
            let round_trip = anchor.duration_since(sent);
            let sample = ClockSample::from_round_trip(server, round_trip, wall_ms);
            let est = Estimate {
                sample,
                server_ms: server.saturating_add(millis(round_trip) / 2),
                anchor,
                wall_ms,
                epoch,
            };
            if best.is_none_or(|b| sample.bound_ms < b.sample.bound_ms) {
                best = Some(est);
            }
        }
        let est = best.ok_or(Error::Unsupported {
            capability: "hello.localTime",
        })?;
        *state.write().unwrap_or_else(|p| p.into_inner()) = Some(est);
        self.inner.counters.samples.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            offset_ms = est.sample.offset_ms,
            bound_ms = est.sample.bound_ms,
            "server clock sampled"
        );
        Ok(est.sample)
    }

    fn watch_epoch(&self) -> u64 {
        self.inner
            .options
            .primary_watch
            .as_ref()
            .map_or(0, PrimaryWatch::epoch)
    }

    fn staleness(&self, est: &Estimate) -> Staleness {
        if est.anchor.elapsed() >= self.inner.options.refresh {
            Staleness::Old
        } else if est.epoch != self.watch_epoch() {
            Staleness::NewPrimary
        } else if !self.inner.options.unsafe_wall_clock_projection
            && self.wall_disagreement_ms(est) > millis(self.inner.options.step_tolerance)
        {
            Staleness::WallClockStep
        } else {
            Staleness::Fresh
        }
    }

    /// How far the wall clock's view of the time since the sample differs from the
    /// monotonic clock's, beyond the drift both may have.
    fn wall_disagreement_ms(&self, est: &Estimate) -> i64 {
        let mono = est.anchor.elapsed();
        let wall = self.inner.local.now_ms().saturating_sub(est.wall_ms);
        let diff = wall.saturating_sub(millis(mono)).saturating_abs();
        diff.saturating_sub(drift_ms(mono, self.inner.options.drift_ppm))
            .max(0)
    }

    fn project(&self, est: Estimate) -> ServerTime {
        if self.inner.options.unsafe_wall_clock_projection {
            // The control: today's wall clock plus the offset measured at the sample.
            return ServerTime {
                estimate_ms: self
                    .inner
                    .local
                    .now_ms()
                    .saturating_add(est.sample.offset_ms),
                bound_ms: est
                    .sample
                    .bound_ms
                    .saturating_add(drift_ms(est.anchor.elapsed(), self.inner.options.drift_ppm)),
            };
        }
        project(
            est.server_ms,
            est.sample.bound_ms,
            est.anchor.elapsed(),
            self.inner.options.drift_ppm,
        )
    }
}

/// A duration in whole milliseconds, saturating at `i64::MAX`.
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The most a clock off by `drift_ppm` gains or loses over `elapsed`, rounded up.
fn drift_ms(elapsed: Duration, drift_ppm: u32) -> i64 {
    millis(elapsed).saturating_mul(i64::from(drift_ppm)) / 1_000_000 + 1
}

/// Server time `elapsed` (monotonic) after a sample that read `server_ms ± bound_ms`.
fn project(server_ms: i64, bound_ms: i64, elapsed: Duration, drift_ppm: u32) -> ServerTime {
    ServerTime {
        estimate_ms: server_ms.saturating_add(millis(elapsed)),
        bound_ms: bound_ms.saturating_add(drift_ms(elapsed, drift_ppm)),
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
                    let server_reading = true_server_at_send + there;
                    let received_wall = true_server_at_send + skew + rtt;
                    let round_trip = Duration::from_millis(u64::try_from(rtt).unwrap_or(0));
                    let sample =
                        ClockSample::from_round_trip(server_reading, round_trip, received_wall);
                    assert_eq!(
                        sample.offset_ms + skew,
                        server_reading + rtt / 2 - true_server_at_send - rtt
                    );
                    let now = project(
                        server_reading + rtt / 2,
                        sample.bound_ms,
                        Duration::ZERO,
                        500,
                    );
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
    fn the_projection_reads_no_wall_clock() {
        // The projection is a pure function of the sample and monotonic time: the same
        // sample projected 2 s later says 2 s later, whatever the wall clock does.
        let a = project(1_000_000, 3, Duration::ZERO, 500);
        let b = project(1_000_000, 3, Duration::from_secs(2), 500);
        assert_eq!(b.estimate_ms - a.estimate_ms, 2_000);
    }

    #[test]
    fn bound_grows_with_drift() {
        let a = project(0, 1, Duration::ZERO, 500);
        let b = project(0, 1, Duration::from_secs(100), 500);
        assert_eq!(b.bound_ms - a.bound_ms, 50);
    }

    #[test]
    fn local_clock_steps_are_shared_by_clones() {
        let a = LocalClock::with_offset_ms(5);
        let b = a.clone();
        b.step_ms(20_000);
        assert_eq!(a.offset_ms(), 20_005);
        a.step_ms(i64::MAX);
        assert_eq!(b.offset_ms(), i64::MAX);
    }

    #[test]
    fn a_watch_counts_new_primaries() {
        let w = PrimaryWatch::new();
        let c = w.clone();
        assert_eq!(w.epoch(), 0);
        c.note_new_primary();
        assert_eq!(w.epoch(), 1);
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
        assert!(
            ClockOptions::default()
                .samples(MAX_SAMPLES)
                .validate()
                .is_ok()
        );
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
