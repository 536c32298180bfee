//! Read/write locks (issue 16): processes take one resource for reading (three times in
//! four) or writing, work a few ms inside, then confirm that their lease is still
//! certainly valid (by server time) and record the stretch they spent inside, in the
//! server's order (a [`crate::marker`] write right after the acquire returned, one right
//! before the confirmation: no holder's clock takes part); now and then a holder is paused
//! inside past its lease.
//!
//! Safe: a writer waits for the readers inside and keeps new ones out. Control: the writer
//! does not wait for the readers inside ([`docwarden::lock::RwLockOptions`]'s unsafe
//! switch), so write stretches overlap read stretches (`rw-overlap`). Checked by
//! [`docwarden::check::rwlock`].

use std::time::Duration;

use docwarden::check::order::Span;
use docwarden::check::rwlock::{self as checker, READ_INSIDE_OP, WRITE_INSIDE_OP};
use docwarden::check::{Event, History, OpOutcome, Violation};
use docwarden::clock::TimeSource;
use docwarden::lock::{LockCollection, LockOptions, Owner, RwLockOptions, RwLocks};
use mongodb::Database;

use crate::Mode;
use crate::marker::Markers;

/// The locked resource (the key of every event).
pub const RESOURCE: &str = "shared";
/// The read/write locks' collection.
pub const RWLOCKS: &str = "verify_rwlocks";
/// The ttl of every read and write lease: what a pause must outlive.
pub const TTL: Duration = Duration::from_millis(1_000);
const WORK: Duration = Duration::from_millis(10);

/// The operations of this workload, as the history names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A read lease taken (or not, within the wait).
    Read,
    /// A write lease taken.
    Write,
    /// A confirmed read stretch.
    ReadInside,
    /// A confirmed write stretch.
    WriteInside,
    /// A release.
    Release,
}

impl Op {
    /// The name in histories and reports.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Op::Read => "read-lock",
            Op::Write => "write-lock",
            Op::ReadInside => READ_INSIDE_OP,
            Op::WriteInside => WRITE_INSIDE_OP,
            Op::Release => "release",
        }
    }
}

/// One process's handle.
#[derive(Clone, Debug)]
pub struct Shared {
    rw: RwLocks,
    markers: Markers,
}

impl Shared {
    /// A handle without touching the server (run [`Shared::setup`] once first).
    ///
    /// # Errors
    /// Invalid options (none here).
    pub fn new(db: &Database, time: TimeSource, mode: Mode) -> docwarden::Result<Self> {
        let locks = LockCollection::new(db.collection(RWLOCKS), time, LockOptions::default())?;
        let options = match mode {
            Mode::Safe => RwLockOptions::default(),
            Mode::Control => RwLockOptions::default().unsafe_writer_ignores_readers(),
        };
        Ok(Self {
            rw: RwLocks::new(locks, options)?,
            markers: Markers::new(db),
        })
    }

    /// Creates the collection's indexes.
    ///
    /// # Errors
    /// A database error.
    pub async fn setup(db: &Database, time: TimeSource) -> anyhow::Result<()> {
        RwLocks::open(db, RWLOCKS, time, RwLockOptions::default()).await?;
        Ok(())
    }

    /// One read (or, with `write`, one write): take the lease (waiting up to 2 s), work
    /// (sleeping `pause` more inside when given), confirm the lease still certainly valid
    /// and record the stretch, release.
    ///
    /// # Errors
    /// Only what the history cannot record (none: errors become events).
    pub async fn round(
        &self,
        history: &History,
        process: u32,
        owner: &Owner,
        write: bool,
        pause: Option<Duration>,
    ) -> anyhow::Result<()> {
        let wait = Duration::from_secs(2);
        let time = self.rw.locks().time().clone();
        if write {
            let got = history
                .record(
                    process,
                    Op::Write.as_str(),
                    RESOURCE,
                    self.rw.write(owner, RESOURCE, TTL, wait),
                    |r, e| match r {
                        Ok(Some(l)) => e.token(l.token.get()),
                        Ok(None) => e.outcome(OpOutcome::Failed).detail("not within the wait"),
                        Err(err) => e.outcome(OpOutcome::Indeterminate).detail(err.to_string()),
                    },
                )
                .await;
            let Ok(Some(lease)) = got else {
                return Ok(());
            };
            self.work_inside(
                history,
                process,
                Op::WriteInside,
                &time,
                pause,
                lease.expires_at,
                Some(lease.token.get()),
            )
            .await;
            let _ = history
                .record(
                    process,
                    Op::Release.as_str(),
                    RESOURCE,
                    self.rw.release_write(&lease),
                    |r, e| match r {
                        Ok(()) => e,
                        Err(err) => e.outcome(OpOutcome::Failed).detail(err.to_string()),
                    },
                )
                .await;
        } else {
            let got = history
                .record(
                    process,
                    Op::Read.as_str(),
                    RESOURCE,
                    self.rw.read(owner, RESOURCE, TTL, wait),
                    |r, e| match r {
                        Ok(Some(_)) => e,
                        Ok(None) => e.outcome(OpOutcome::Failed).detail("not within the wait"),
                        Err(err) => e.outcome(OpOutcome::Indeterminate).detail(err.to_string()),
                    },
                )
                .await;
            let Ok(Some(lease)) = got else {
                return Ok(());
            };
            self.work_inside(
                history,
                process,
                Op::ReadInside,
                &time,
                pause,
                lease.expires_at,
                None,
            )
            .await;
            let _ = history
                .record(
                    process,
                    Op::Release.as_str(),
                    RESOURCE,
                    self.rw.release_read(&lease),
                    |r, e| match r {
                        Ok(()) => e,
                        Err(err) => e.outcome(OpOutcome::Failed).detail(err.to_string()),
                    },
                )
                .await;
        }
        Ok(())
    }
}

impl Shared {
    /// Works inside a held lease (sleeping `pause` more when given), then records the
    /// stretch as `op` (with the write lease's `token`) if the lease expiring at
    /// `expires_at` is still certainly valid: a stretch the holder could not vouch for is
    /// not claimed. The stretch is a span of the server's order, from a marker write made
    /// on entering to one made right before the confirmation; without both (a marker
    /// failed) nothing is claimed.
    #[allow(clippy::too_many_arguments)]
    async fn work_inside(
        &self,
        history: &History,
        process: u32,
        op: Op,
        time: &TimeSource,
        pause: Option<Duration>,
        expires_at: mongodb::bson::DateTime,
        token: Option<i64>,
    ) {
        let start = history.now_us();
        let entered = self.markers.stamp(process).await;
        tokio::time::sleep(WORK + pause.unwrap_or_default()).await;
        let confirmed = self.markers.stamp(process).await;
        let valid = time
            .now()
            .await
            .is_ok_and(|now| now.certainly_before(expires_at, time.skew_margin_ms()));
        let (true, Ok(from), Ok(to)) = (valid, entered, confirmed) else {
            return;
        };
        let Some(span) = Span::new(from, to) else {
            return;
        };
        let event = Event::new(process, op.as_str(), RESOURCE, start, history.now_us()).span(span);
        history.push(match token {
            Some(t) => event.token(t),
            None => event,
        });
    }
}

/// The checker ([`docwarden::check::rwlock::check`]).
#[must_use]
pub fn check(events: &[Event]) -> Vec<Violation> {
    checker::check(events)
}
