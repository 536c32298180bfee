//! Leader election (issue 16): processes campaign for one election, each leader appends
//! its term to a log document with writes fenced by its term, claims its validity before
//! each write, and resigns; now and then a leader is paused past its term (its watchdog
//! stopped, as under SIGSTOP) and writes afterwards with its old term.
//!
//! Safe: the fence checks the term, so the paused leader's write is refused once a newer
//! term wrote. Control: the fence checks no term ([`docwarden::lock::FenceOptions`]'s
//! unsafe switch), so the log goes down (`stale-write-accepted`). Checked by
//! [`docwarden::check::election`]: one leader per term, terms increasing, no newer term
//! within a leader's validity claim, and the log.

use std::time::{Duration, Instant};

use docwarden::Error;
use docwarden::check::election::{self as checker, ELECT_OP, HOLD_OP, RESIGN_OP, WRITE_OP};
use docwarden::check::{Event, History, OpOutcome, Violation};
use docwarden::clock::TimeSource;
use docwarden::lock::{
    Election, ElectionOptions, Fence, FenceOptions, FenceOutcome, LockCollection, LockOptions,
    Owner,
};
use mongodb::Database;
use mongodb::bson::{Document, doc};

use crate::Mode;

/// The election's name (the key of every event).
pub const ELECTION: &str = "leader";
/// The lock collection of the election.
pub const ELECTIONS: &str = "elections";
/// The fenced log collection.
pub const LOG: &str = "leader_log";
/// A term's ttl: what a pause must outlive.
pub const TERM_TTL: Duration = Duration::from_millis(800);
const LOG_ID: &str = "log";
const TERMS: &str = "terms";

/// The operations of this workload, as the history names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A campaign (Ok with the term when won).
    Elect,
    /// A validity claim before a write (value: ms left).
    Hold,
    /// A fenced append of the term to the log.
    Write,
    /// A resignation.
    Resign,
}

impl Op {
    /// The name in histories and reports.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Op::Elect => ELECT_OP,
            Op::Hold => HOLD_OP,
            Op::Write => WRITE_OP,
            Op::Resign => RESIGN_OP,
        }
    }
}

/// One process's handles on the election and the log.
#[derive(Clone, Debug)]
pub struct Leaders {
    election: Election,
    fence: Fence,
}

impl Leaders {
    /// Handles without touching the server (run [`Leaders::setup`] once first).
    ///
    /// # Errors
    /// Invalid options (none here).
    pub fn new(db: &Database, time: TimeSource, mode: Mode) -> docwarden::Result<Self> {
        let locks = LockCollection::new(db.collection(ELECTIONS), time, LockOptions::default())?;
        let election = Election::new(
            locks,
            ELECTION,
            ElectionOptions::default().term_ttl(TERM_TTL),
        )?;
        let options = match mode {
            Mode::Safe => FenceOptions::default(),
            Mode::Control => FenceOptions::default().unsafe_without_token_check(),
        };
        Ok(Self {
            election,
            fence: Fence::new(db.collection(LOG), options)?,
        })
    }

    /// Creates the election's indexes and the empty log.
    ///
    /// # Errors
    /// A database error.
    pub async fn setup(db: &Database, time: TimeSource) -> anyhow::Result<()> {
        LockCollection::open(db, ELECTIONS, time, LockOptions::default()).await?;
        db.collection::<Document>(LOG)
            .insert_one(doc! { "_id": LOG_ID, TERMS: [] })
            .await?;
        Ok(())
    }

    /// One campaign and, if won, up to three fenced writes and a resignation. With
    /// `pause`, the leader stops renewing after its first write, sleeps `pause`, and writes
    /// once more with its old term (what a process stopped past its term does). Returns
    /// whether it paused (only a leader does).
    ///
    /// # Errors
    /// Only what the history cannot record (none: errors become events).
    pub async fn round(
        &self,
        history: &History,
        process: u32,
        owner: &Owner,
        pause: Option<Duration>,
    ) -> anyhow::Result<bool> {
        let won = history
            .record(
                process,
                Op::Elect.as_str(),
                ELECTION,
                self.election.campaign(owner, Duration::from_secs(2)),
                |r, e| match r {
                    Ok(Some(l)) => e.token(l.term().get()),
                    Ok(None) => e.outcome(OpOutcome::Failed).detail("not elected"),
                    Err(err) => e.outcome(outcome_of(err)).detail(err.to_string()),
                },
            )
            .await;
        let Ok(Some(leader)) = won else {
            return Ok(false);
        };
        let term = leader.term().get();
        // The watchdog vouches for the term once it has read the server time.
        for _ in 0..50 {
            match leader.valid_until() {
                Some(until) if until > Instant::now() => break,
                None => break,
                Some(_) => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        }
        for i in 0..3 {
            let Some(until) = leader.valid_until() else {
                break;
            };
            let left = until.saturating_duration_since(Instant::now()).as_millis();
            if left == 0 {
                break;
            }
            let at = history.now_us();
            history.push(
                Event::new(process, Op::Hold.as_str(), ELECTION, at, at)
                    .token(term)
                    .value(i64::try_from(left).unwrap_or(i64::MAX)),
            );
            if i == 1
                && let Some(pause) = pause
                && let Some(lease) = leader.lease()
            {
                // Paused with its watchdog: it writes later with its old term.
                leader.abandon();
                tokio::time::sleep(pause).await;
                self.write(history, process, &lease, term).await;
                return Ok(true);
            }
            self.write(history, process, &leader, term).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The term is named from the start: a resignation cut short (the task aborted, the
        // process killed) is recorded as indeterminate *of this term*, which it may have
        // ended (`tests/election_abandoned_resign.rs`).
        history
            .record_with_token(
                process,
                Op::Resign.as_str(),
                ELECTION,
                term,
                leader.resign(),
                |r, e| match r {
                    Ok(()) => e,
                    // A lost reply may have resigned: indeterminate, not refused.
                    Err(err) => e.outcome(outcome_of(err)).detail(err.to_string()),
                },
            )
            .await
            .ok();
        Ok(false)
    }

    async fn write<H: docwarden::lock::Fenced + ?Sized>(
        &self,
        history: &History,
        process: u32,
        holder: &H,
        term: i64,
    ) {
        let _ = history
            .record_with_token(
                process,
                Op::Write.as_str(),
                ELECTION,
                term,
                self.fence.apply(
                    holder,
                    doc! { "_id": LOG_ID },
                    doc! { "$push": { TERMS: term } },
                ),
                |r, e| match r {
                    Ok(FenceOutcome::Applied) => e,
                    Ok(other) => e.outcome(OpOutcome::Failed).detail(format!("{other:?}")),
                    Err(err) => e.outcome(outcome_of(err)).detail(err.to_string()),
                },
            )
            .await;
    }

    /// The final read: the terms of the accepted writes, in the order applied.
    ///
    /// # Errors
    /// A database error.
    pub async fn log(db: &Database) -> anyhow::Result<Vec<i64>> {
        let d = db
            .collection::<Document>(LOG)
            .find_one(doc! { "_id": LOG_ID })
            .await?
            .unwrap_or_default();
        Ok(d.get_array(TERMS)
            .map(|a| a.iter().filter_map(mongodb::bson::Bson::as_i64).collect())
            .unwrap_or_default())
    }
}

/// An error's outcome: a timeout or a lost connection may have applied.
fn outcome_of(err: &Error) -> OpOutcome {
    if err.is_retryable() {
        OpOutcome::Indeterminate
    } else {
        OpOutcome::Failed
    }
}

/// The checker ([`docwarden::check::election::check`]).
#[must_use]
pub fn check(events: &[Event], log: &[i64]) -> Vec<Violation> {
    checker::check(events, log)
}
