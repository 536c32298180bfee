//! Seeds 003 and 004, counters under locks (`docwarden::lock`): read-modify-writes of
//! counter documents `{ _id: "counter-N", n }` that lose updates unless a lock serialises
//! them.
//!
//! Seed 004 (lock collection): [`run_locked`] is the fixed-size run (owners acquire a
//! lease, read, write `n + 1`, release; the lease's tokens must increase), and
//! [`Counters::touch`] / [`Counters::write`] are the fenced steps of the history-recording
//! run. Seed 003 (document locks): [`document_increment`]. [`Mode::Control`] for the
//! fenced steps is the fence with its token check off
//! ([`FenceOptions::unsafe_without_token_check`]); the lock collection's own control is
//! [`docwarden::lock::LockOptions::unsafe_ignore_expiry`], chosen by the caller. The final
//! read is [`Counters::total`] / [`Counters::finals`], judged by [`check`] with the
//! increments counted from the history by [`tally`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use docwarden::Error;
use docwarden::check::{Event, Violation, lease};
use docwarden::clock::TimeSource;
use docwarden::lock::{
    DocumentLocks, Fence, FenceOptions, FenceOutcome, Lease, LockCollection, LockOptions, Owner,
};
use mongodb::bson::{Bson, Document, doc};
use mongodb::options::WriteConcern;
use mongodb::{Collection, Database};

use crate::{Mode, RunConfig, RunReport, run_tasks};

/// Seed 004's lock collection `name` in `db`: majority write concern (a failover must not
/// roll back an acquire or a token) and a short blocking-acquire backoff (1–20 ms) for
/// contended runs.
///
/// # Errors
/// As [`LockCollection::open`].
pub async fn open_locks(
    db: &Database,
    name: &str,
    time: TimeSource,
) -> docwarden::Result<LockCollection> {
    LockCollection::open(
        db,
        name,
        time,
        LockOptions::default()
            .backoff(Duration::from_millis(1), Duration::from_millis(20))
            .write_concern(WriteConcern::majority()),
    )
    .await
}

/// The operations of the workload, as the history names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A lease acquired (or refused: held).
    Acquire,
    /// The fenced touch that registers the holder's token before it reads.
    Touch,
    /// The fenced write of `n + 1`.
    Write,
    /// The holder confirmed its lease certainly valid (`Watchdog::valid_until`) before
    /// writing; `value` is the validity left, in ms.
    Hold,
    /// The holder gave up before writing: its lease was no longer certainly valid.
    Abandon,
    /// The lease released.
    Release,
    /// A lease renewed directly (`LockCollection::renew`): in the lock workload, a stale
    /// copy of a lease its holder already released, renewed by a second task under the
    /// same owner id (it must be refused).
    Renew,
    /// The control's blind re-send of a write whose reply was lost: a fenced `$inc`
    /// ([`Counters::increment`]), sent as if the first had not run.
    Resend,
}

impl Op {
    /// The name in histories and reports.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Op::Acquire => "acquire",
            Op::Touch => "touch",
            Op::Write => "write",
            Op::Hold => lease::HOLD_OP,
            Op::Abandon => "abandon",
            Op::Release => lease::RELEASE_OP,
            Op::Renew => lease::RENEW_OP,
            Op::Resend => "resend",
        }
    }
}

/// The key of counter `r`, also the lock resource guarding it.
#[must_use]
pub fn resource(r: usize) -> String {
    format!("counter-{r}")
}

/// The counters collection.
#[derive(Clone, Debug)]
pub struct Counters {
    coll: Collection<Document>,
}

impl Counters {
    /// A handle on `coll`.
    #[must_use]
    pub fn new(coll: Collection<Document>) -> Self {
        Self { coll }
    }

    /// The counters collection.
    #[must_use]
    pub fn collection(&self) -> &Collection<Document> {
        &self.coll
    }

    /// Setup: counters `0..resources`, each at 0.
    ///
    /// # Errors
    /// The insert's error.
    pub async fn setup(&self, resources: usize) -> anyhow::Result<()> {
        self.coll
            .insert_many((0..resources).map(|r| doc! { "_id": resource(r), "n": 0_i64 }))
            .await?;
        Ok(())
    }

    /// Reads counter `key`.
    ///
    /// # Errors
    /// A database error, or the counter is missing.
    pub async fn read(&self, key: &str) -> anyhow::Result<i64> {
        let d = self
            .coll
            .find_one(doc! { "_id": key })
            .await?
            .with_context(|| format!("counter {key} is missing"))?;
        Ok(d.get_i64("n").unwrap_or_default())
    }

    /// An unsynchronised read-modify-write of counter `key` (what the lock protects).
    ///
    /// # Errors
    /// A database error.
    pub async fn read_modify_write(&self, key: &str) -> anyhow::Result<()> {
        let n = self.read(key).await?;
        tokio::task::yield_now().await;
        self.coll
            .update_one(doc! { "_id": key }, doc! { "$set": { "n": n + 1 } })
            .await?;
        Ok(())
    }

    /// The fence of the counters: the token check on (safe) or off (control).
    ///
    /// # Errors
    /// The fence's validation.
    pub fn fence(&self, mode: Mode) -> docwarden::Result<Fence> {
        let options = match mode {
            Mode::Safe => FenceOptions::default(),
            Mode::Control => FenceOptions::default().unsafe_without_token_check(),
        };
        Fence::new(self.coll.clone(), options)
    }

    /// The fenced touch: registers `lease`'s token on counter `key` before the holder
    /// reads, so that no older holder can write after this point.
    ///
    /// # Errors
    /// A database error.
    pub async fn touch(
        &self,
        fence: &Fence,
        lease: &Lease,
        key: &str,
        owner: &Owner,
    ) -> docwarden::Result<FenceOutcome> {
        fence
            .apply(
                lease,
                doc! { "_id": key },
                doc! { "$set": { "holder": owner.id() } },
            )
            .await
    }

    /// The fenced write of `value` to counter `key`.
    ///
    /// # Errors
    /// A database error.
    pub async fn write(
        &self,
        fence: &Fence,
        lease: &Lease,
        key: &str,
        value: i64,
    ) -> docwarden::Result<FenceOutcome> {
        fence
            .apply(lease, doc! { "_id": key }, doc! { "$set": { "n": value } })
            .await
    }

    /// The fenced increment of counter `key` (`$inc`): not idempotent, unlike
    /// [`Counters::write`]. Only the control's blind re-send of a write whose reply was
    /// lost uses it: if the first write ran, the counter is incremented twice.
    ///
    /// # Errors
    /// A database error.
    pub async fn increment(
        &self,
        fence: &Fence,
        lease: &Lease,
        key: &str,
    ) -> docwarden::Result<FenceOutcome> {
        fence
            .apply(lease, doc! { "_id": key }, doc! { "$inc": { "n": 1_i64 } })
            .await
    }

    /// The final read: every counter's value.
    ///
    /// # Errors
    /// A database error.
    pub async fn finals(&self) -> anyhow::Result<BTreeMap<String, i64>> {
        let mut out = BTreeMap::new();
        let mut cursor = self.coll.find(doc! {}).await?;
        while cursor.advance().await? {
            let d = cursor.deserialize_current()?;
            let key = match d.get("_id") {
                Some(Bson::String(s)) => s.clone(),
                Some(other) => other.to_string(),
                None => continue,
            };
            out.insert(key, d.get_i64("n").unwrap_or_default());
        }
        Ok(out)
    }

    /// The final read: the sum of all counters.
    ///
    /// # Errors
    /// A database error.
    pub async fn total(&self) -> anyhow::Result<i64> {
        Ok(self.finals().await?.values().sum())
    }
}

/// The increments of a recorded run, per counter: acknowledged (a write accepted) and
/// uncertain (a lease that touched its counter and then neither had its write accepted or
/// refused nor gave up: the write's reply was lost, or its process was killed with the
/// write in flight).
#[must_use]
pub fn tally(events: &[Event]) -> (BTreeMap<String, i64>, BTreeMap<String, i64>) {
    use docwarden::check::OpOutcome;
    let mut acked: BTreeMap<String, i64> = BTreeMap::new();
    let mut uncertain: BTreeMap<String, i64> = BTreeMap::new();
    // (key, token) of every lease that touched its counter, and how its write ended.
    let mut leases: BTreeMap<(&str, i64), Option<OpOutcome>> = BTreeMap::new();
    for e in events {
        let Some(token) = e.token else { continue };
        if e.op == Op::Touch.as_str() && e.outcome == OpOutcome::Ok {
            leases.entry((e.key.as_str(), token)).or_insert(None);
        } else if e.op == Op::Write.as_str() {
            leases.insert((e.key.as_str(), token), Some(e.outcome));
        } else if e.op == Op::Abandon.as_str() {
            leases.insert((e.key.as_str(), token), Some(OpOutcome::Failed));
        }
    }
    for ((key, _), outcome) in leases {
        match outcome {
            Some(OpOutcome::Ok) => *acked.entry(key.to_owned()).or_default() += 1,
            Some(OpOutcome::Failed) => {}
            Some(OpOutcome::Indeterminate) | None => {
                *uncertain.entry(key.to_owned()).or_default() += 1;
            }
        }
    }
    (acked, uncertain)
}

/// The checker of a recorded run: fencing tokens strictly increase per resource, no stale
/// write was accepted, no holder's validity claim overlapped a newer holder, no released
/// or superseded lease was renewed or released again, and each
/// final counter equals its acknowledged increments (give or take the uncertain ones,
/// [`tally`]). A counter above them on which some write was re-sent after a lost reply
/// ([`Op::Resend`]) is reported as `duplicated-update` (an increment applied twice)
/// rather than `unacknowledged-update`.
#[must_use]
pub fn check(events: &[Event], finals: &BTreeMap<String, i64>) -> Vec<Violation> {
    let (acknowledged, uncertain) = tally(events);
    let mut violations = lease::check_tokens(events);
    violations.extend(lease::check_validity(events));
    violations.extend(lease::check_dead_leases(events));
    let resent: BTreeMap<&str, usize> = events
        .iter()
        .filter(|e| e.op == Op::Resend.as_str() && e.outcome != docwarden::check::OpOutcome::Failed)
        .fold(BTreeMap::new(), |mut m, e| {
            *m.entry(e.key.as_str()).or_default() += 1;
            m
        });
    let counted: Vec<Violation> = lease::check_counters(&acknowledged, &uncertain, finals)
        .into_iter()
        .map(|v| match resent.get(v.key.as_str()) {
            Some(n) if v.kind == "unacknowledged-update" => Violation::new(
                "duplicated-update",
                v.key.clone(),
                format!("{}; {n} write(s) re-sent after a lost reply", v.detail),
            ),
            _ => v,
        })
        .collect();
    let lost: Vec<Violation> = lost_by_value(events, finals)
        .into_iter()
        .filter(|v| !counted.iter().any(|c| c.key == v.key && c.kind == v.kind))
        .collect();
    violations.extend(counted);
    violations.extend(lost);
    violations
}

/// Lost updates the count cannot see when uncertain writes make up for them: each write
/// sets `n` to the value its holder read plus one, so two acknowledged writes of the same
/// value both read the same `n` (one increment lost), and a counter below the value of an
/// acknowledged write was set back by a write that read before it (`lost-update`).
fn lost_by_value(events: &[Event], finals: &BTreeMap<String, i64>) -> Vec<Violation> {
    use docwarden::check::OpOutcome;
    let mut written: BTreeMap<&str, BTreeMap<i64, Vec<i64>>> = BTreeMap::new();
    for e in events
        .iter()
        .filter(|e| e.op == Op::Write.as_str() && e.outcome == OpOutcome::Ok && e.token.is_some())
    {
        if let Some(value) = e.value {
            written
                .entry(e.key.as_str())
                .or_default()
                .entry(value)
                .or_default()
                .push(e.token.unwrap_or_default());
        }
    }
    let mut violations = Vec::new();
    for (key, values) in written {
        let found = finals.get(key).copied().unwrap_or(0);
        if let Some((value, tokens)) = values.iter().find(|(_, tokens)| tokens.len() > 1) {
            violations.push(Violation::new(
                "lost-update",
                key,
                format!(
                    "the acknowledged writes of tokens {tokens:?} all set n = {value}: they read the same value, an increment was lost"
                ),
            ));
        } else if let Some((value, tokens)) = values.last_key_value()
            && *value > found
        {
            violations.push(Violation::new(
                "lost-update",
                key,
                format!(
                    "token {} set n = {value}, acknowledged, but the counter reads {found}",
                    tokens.first().copied().unwrap_or_default()
                ),
            ));
        }
    }
    violations
}

/// What a fixed-size run of seed 004 found.
#[derive(Clone, Copy, Debug, Default)]
pub struct LockedReport {
    /// Increments lost (expected minus the final total).
    pub lost: i64,
    /// Tokens of a resource that did not increase.
    pub regressions: u64,
    /// Releases refused with `LeaseLost`.
    pub refused: u64,
    /// Acquire, read, write and release calls.
    pub operations: u64,
}

impl LockedReport {
    /// The runner's summary: lost updates and token regressions.
    #[must_use]
    pub fn report(&self) -> RunReport {
        RunReport {
            operations: self.operations,
            violations: self.lost.unsigned_abs() + self.regressions,
        }
    }
}

/// Seed 004's fixed-size run: `config.workers` owners × `config.ops_per_worker` rounds;
/// round `i` of owner `w` acquires counter `(w + i) % resources` (waiting up to 60 s,
/// lease 30 s), read-modify-writes it and releases. `counters` must be set up with
/// `resources` counters. `config.mode` is not used here: the control is the lock
/// collection opened with `unsafe_ignore_expiry`.
///
/// # Errors
/// A database error, or an acquire that timed out.
pub async fn run_locked(
    locks: &LockCollection,
    counters: &Counters,
    resources: usize,
    config: RunConfig,
) -> anyhow::Result<LockedReport> {
    let tokens: Arc<Mutex<BTreeMap<String, Vec<i64>>>> = Arc::default();
    let refused = run_tasks(config.workers, |worker| {
        let (locks, counters, tokens) = (locks.clone(), counters.clone(), Arc::clone(&tokens));
        async move {
            let owner = Owner::random();
            let mut refused = 0_u64;
            for round in 0..config.ops_per_worker {
                let r = (worker + usize::try_from(round)?) % resources;
                let key = resource(r);
                let lease = locks
                    .acquire(
                        &owner,
                        &key,
                        Duration::from_secs(30),
                        Duration::from_secs(60),
                    )
                    .await?
                    .context("acquire timed out")?;
                tokens
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(key.clone())
                    .or_default()
                    .push(lease.token.into());
                counters.read_modify_write(&key).await?;
                match locks.release(&lease).await {
                    Ok(()) => {}
                    Err(Error::LeaseLost { .. }) => refused += 1,
                    Err(e) => return Err(e.into()),
                }
            }
            anyhow::Ok(refused)
        }
    })
    .await?;
    let rounds = u64::try_from(config.workers)?.saturating_mul(config.ops_per_worker);
    let regressions = tokens
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .values()
        .map(|v| v.windows(2).filter(|w| w[1] <= w[0]).count())
        .sum::<usize>();
    Ok(LockedReport {
        lost: i64::try_from(rounds)? - counters.total().await?,
        regressions: u64::try_from(regressions)?,
        refused: refused.iter().sum(),
        operations: rounds.saturating_mul(4),
    })
}

/// What one [`document_increment`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Increment {
    /// Locked, read, wrote `n + 1` and released in one fenced update.
    Done,
    /// Not locked: the document is locked by someone else (contention) or does not exist;
    /// `DocumentLocks::try_lock` reports both as `None`.
    Busy,
}

/// Seed 003's operation: lock document `id` in place, read its `n`, and write `n + 1` in
/// the release (fenced by the lock id).
///
/// # Errors
/// A database error, or a lock lost before the release.
pub async fn document_increment(
    locks: &DocumentLocks,
    id: impl Into<Bson> + std::fmt::Display,
) -> anyhow::Result<Increment> {
    match locks.try_lock(id).await {
        Ok(Some(guard)) => {
            let n = guard.document.get_i64("n").unwrap_or_default();
            let outcome = locks
                .release_with(guard, doc! { "$set": { "n": n + 1 } })
                .await?;
            anyhow::ensure!(
                outcome.is_applied(),
                "the fenced release was refused: {outcome:?}"
            );
            Ok(Increment::Done)
        }
        Ok(None) => Ok(Increment::Busy),
        Err(e) => Err(e.into()),
    }
}

/// What [`paused_holder`] saw.
#[derive(Debug)]
pub struct PausedHolder {
    /// A's lease (1 s), which lapsed while A was paused.
    pub paused: Lease,
    /// B's lease, taken after A's lapsed.
    pub taker: Lease,
    /// A's fenced write (−10) while it held the lease.
    pub first_write: FenceOutcome,
    /// Whether B's `try_acquire` was refused while A held the lease.
    pub refused_while_held: bool,
    /// B's fenced write (−20).
    pub taker_write: FenceOutcome,
    /// A's renew after waking up.
    pub renew: docwarden::Result<()>,
    /// A's release after waking up.
    pub release: docwarden::Result<()>,
    /// A's fenced write (−10) after waking up.
    pub late_write: FenceOutcome,
}

/// Seed 004's paused holder: account `1` (balance 100) in `accounts`, guarded by lease
/// `account-1`. A leases it for 1 s and writes through `fence`, B is refused, A pauses
/// 2.5 s, B acquires and writes, then A wakes up and renews, releases and writes as if it
/// still held the lease. The caller releases [`PausedHolder::taker`].
///
/// # Errors
/// A database error, or an acquire that did not succeed.
pub async fn paused_holder(
    locks: &LockCollection,
    accounts: &Collection<Document>,
    fence: &Fence,
) -> anyhow::Result<PausedHolder> {
    accounts
        .insert_one(doc! { "_id": 1, "balance": 100_i64 })
        .await?;
    let (a, b) = (Owner::random(), Owner::random());
    let debit = |n: i64| doc! { "$inc": { "balance": -n } };
    let mut paused = locks
        .try_acquire(&a, "account-1", Duration::from_secs(1))
        .await?
        .context("A acquires")?;
    let first_write = fence.apply(&paused, doc! { "_id": 1 }, debit(10)).await?;
    let refused_while_held = locks
        .try_acquire(&b, "account-1", Duration::from_secs(10))
        .await?
        .is_none();
    tokio::time::sleep(Duration::from_millis(2_500)).await; // A is paused past its ttl
    let taker = locks
        .acquire(
            &b,
            "account-1",
            Duration::from_secs(10),
            Duration::from_secs(5),
        )
        .await?
        .context("B acquires after A's lease lapsed")?;
    let taker_write = fence.apply(&taker, doc! { "_id": 1 }, debit(20)).await?;
    let renew = locks.renew(&mut paused, Duration::from_secs(1)).await;
    let release = locks.release(&paused).await;
    let late_write = fence.apply(&paused, doc! { "_id": 1 }, debit(10)).await?;
    Ok(PausedHolder {
        paused,
        taker,
        first_write,
        refused_while_held,
        taker_write,
        renew,
        release,
        late_write,
    })
}

/// Seed 004's crash: `crashed` acquires `resource` (30 s) and crashes, its lock document
/// is deleted from `lock_docs` (what the TTL index does, later), and `next` acquires.
/// Returns the crashed lease, the documents deleted, and the next lease, whose token must
/// be greater.
///
/// # Errors
/// A database error, or an acquire that did not succeed.
pub async fn crash_and_delete(
    locks: &LockCollection,
    lock_docs: &Collection<Document>,
    resource: &str,
    crashed: &Owner,
    next: &Owner,
) -> anyhow::Result<(Lease, u64, Lease)> {
    let lc = locks
        .try_acquire(crashed, resource, Duration::from_secs(30))
        .await?
        .context("the first owner acquires")?;
    let deleted = lock_docs
        .delete_many(doc! { "_id": resource })
        .await?
        .deleted_count;
    let ld = locks
        .try_acquire(next, resource, Duration::from_secs(30))
        .await?
        .context("the next owner acquires")?;
    Ok((lc, deleted, ld))
}

#[cfg(test)]
mod tests {
    use super::*;
    use docwarden::check::OpOutcome;

    fn ev(op: Op, key: &str, token: i64, outcome: OpOutcome) -> Event {
        Event::new(1, op.as_str(), key, 0, 1)
            .token(token)
            .outcome(outcome)
    }

    /// A write accepted is acknowledged; refused or abandoned is nothing; a lost reply or
    /// a lease whose write never recorded an outcome (its process killed) is uncertain.
    #[test]
    fn tally_counts_acknowledged_and_uncertain_increments_from_the_history() {
        let events = vec![
            ev(Op::Touch, "c0", 1, OpOutcome::Ok),
            ev(Op::Write, "c0", 1, OpOutcome::Ok),
            ev(Op::Touch, "c0", 2, OpOutcome::Ok),
            ev(Op::Write, "c0", 2, OpOutcome::Failed),
            ev(Op::Touch, "c0", 3, OpOutcome::Ok),
            ev(Op::Abandon, "c0", 3, OpOutcome::Failed),
            ev(Op::Touch, "c1", 1, OpOutcome::Ok),
            ev(Op::Write, "c1", 1, OpOutcome::Indeterminate),
            ev(Op::Touch, "c1", 2, OpOutcome::Ok),
            // Touch refused: never counted.
            ev(Op::Touch, "c1", 3, OpOutcome::Failed),
        ];
        let (acked, uncertain) = tally(&events);
        assert_eq!(acked, BTreeMap::from([("c0".to_owned(), 1)]));
        assert_eq!(uncertain, BTreeMap::from([("c1".to_owned(), 2)]));
        let finals = BTreeMap::from([("c0".to_owned(), 1), ("c1".to_owned(), 2)]);
        assert!(check(&events, &finals).is_empty());
        let lost = BTreeMap::from([("c0".to_owned(), 0), ("c1".to_owned(), 0)]);
        assert_eq!(
            check(&events, &lost)
                .iter()
                .map(|v| v.kind)
                .collect::<Vec<_>>(),
            vec!["lost-update"]
        );
    }

    /// A lost update that uncertain writes make up for in the count: the final value lies
    /// within acknowledged + uncertain, but two acknowledged writes set the same value, or
    /// the counter reads less than an acknowledged write set.
    #[test]
    fn a_lost_update_hidden_by_uncertain_writes_is_found_by_the_values_written() {
        let write = |token: i64, value: i64, outcome: OpOutcome| {
            ev(Op::Write, "c0", token, outcome).value(value)
        };
        let touches = |n: i64| (1..=n).map(|t| ev(Op::Touch, "c0", t, OpOutcome::Ok));
        let kinds = |events: &[Event], n: i64| {
            check(events, &BTreeMap::from([("c0".to_owned(), n)]))
                .iter()
                .map(|v| v.kind)
                .collect::<Vec<_>>()
        };
        // Tokens 1 and 2 both read 0 and wrote 1; the uncertain token 3 read 1, wrote 2
        // and landed: 2 acknowledged + 1 uncertain, the counter reads 2.
        let mut events: Vec<Event> = touches(3).collect();
        events.extend([
            write(1, 1, OpOutcome::Ok),
            write(3, 2, OpOutcome::Indeterminate),
            write(2, 1, OpOutcome::Ok),
        ]);
        assert_eq!(kinds(&events, 2), vec!["lost-update"]);
        // Token 4 wrote 4 (acknowledged); token 5, which had read 2, set it back to 3.
        let mut events: Vec<Event> = touches(5).collect();
        events.extend([
            write(1, 1, OpOutcome::Ok),
            write(2, 2, OpOutcome::Indeterminate),
            write(3, 3, OpOutcome::Indeterminate),
            write(4, 4, OpOutcome::Ok),
            write(5, 3, OpOutcome::Ok),
        ]);
        assert_eq!(kinds(&events, 3), vec!["lost-update"]);
        // Clean: an uncertain write that did not land, and the next one wrote its value.
        let mut events: Vec<Event> = touches(3).collect();
        events.extend([
            write(1, 1, OpOutcome::Ok),
            write(2, 2, OpOutcome::Indeterminate),
            write(3, 2, OpOutcome::Ok),
        ]);
        assert!(kinds(&events, 2).is_empty());
    }

    /// A counter above its acknowledged and uncertain increments is
    /// `unacknowledged-update`; `duplicated-update` when a write on it was re-sent blindly
    /// after its outcome was unknown (the control's guess).
    #[test]
    fn an_increment_applied_twice_after_a_blind_re_send_is_a_duplicated_update() {
        let mut events = vec![
            ev(Op::Touch, "c0", 1, OpOutcome::Ok),
            ev(Op::Write, "c0", 1, OpOutcome::Ok),
        ];
        let finals = BTreeMap::from([("c0".to_owned(), 2)]);
        let kinds = |events: &[Event]| {
            check(events, &finals)
                .iter()
                .map(|v| v.kind)
                .collect::<Vec<_>>()
        };
        assert_eq!(kinds(&events), vec!["unacknowledged-update"]);
        events.push(ev(Op::Resend, "c0", 1, OpOutcome::Ok));
        assert_eq!(kinds(&events), vec!["duplicated-update"]);
    }
}
