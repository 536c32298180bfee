//! Seed 000, doctors on call (`docwarden::guard`): shifts of three doctors, all on call,
//! and the rule "at least one doctor on call".
//!
//! The operation toggles one doctor of one shift on or off call. [`Mode::Safe`] is one
//! guarded update; [`Mode::Control`] reads the shift, decides in the client and writes
//! unconditionally (the write skew the seed demonstrates). The fixed-size run's checks ask
//! docwarden's checker ([`docwarden::guard::violations_of`],
//! [`docwarden::guard::violations`]); the history's checks ([`OnCall::check_event`]) read
//! the shift and evaluate the rule themselves ([`rule_holds`]: a missing shift breaks
//! it), and are judged by [`docwarden::check::state::check_invariant_reads`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use docwarden::check::{Event, OpOutcome, Violation, state::check_invariant_reads};
use docwarden::guard::{
    self, Change, Condition, GuardOptions, GuardOutcome as Outcome, Guarded, Invariant,
};
use mongodb::Collection;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::options::UpdateOptions;
use mongodb::results::UpdateResult;
use rand::Rng;

use crate::{Mode, RunConfig, RunReport, run_tasks};

/// The doctors of every shift.
pub const DOCTORS: [&str; 3] = ["Alice", "Bob", "Carol"];

/// The name of the seed's business rule.
pub const RULE: &str = "at least one doctor on call";

/// How long the control waits between its read and its write (an application deciding in
/// between).
const CONTROL_WINDOW: Duration = Duration::from_millis(1);

/// The operations of the workload, as the history names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A doctor goes on call.
    OnCall,
    /// A doctor goes off call.
    OffCall,
    /// A read of one shift checking the rule.
    Check,
}

impl Op {
    /// The name in histories and reports.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Op::OnCall => "on-call",
            Op::OffCall => "off-call",
            Op::Check => "check",
        }
    }
}

/// The business rule of the seed.
///
/// # Errors
/// Never for these constants; the constructor validates names.
pub fn rule() -> docwarden::Result<Invariant> {
    Invariant::at_least(RULE, "doctors", 1, Condition::eq("on_call", true))
}

/// The key of shift `shift` in histories.
#[must_use]
pub fn shift_key(shift: i64) -> String {
    format!("shift {shift}")
}

/// Setup: inserts shifts `0..shifts`, every doctor on call.
///
/// # Errors
/// The insert's error.
pub async fn setup(coll: &Collection<Document>, shifts: i64) -> anyhow::Result<()> {
    let docs: Vec<Document> = (0..shifts)
        .map(|s| {
            let doctors: Vec<Document> = DOCTORS
                .iter()
                .map(|name| doc! { "name": *name, "on_call": true, "updated": DateTime::now() })
                .collect();
            doc! { "_id": s, "doctors": doctors }
        })
        .collect();
    coll.insert_many(docs).await?;
    Ok(())
}

/// The seed's bypass update: every doctor of `shift` off call through `arrayFilters`, no
/// condition. A collection validator holding the rule must refuse it with code 121.
///
/// # Errors
/// The driver's error, which the caller inspects (121 is the expected refusal).
pub async fn seed_bypass(
    coll: &Collection<Document>,
    shift: i64,
) -> Result<UpdateResult, mongodb::error::Error> {
    coll.update_one(
        doc! { "_id": shift },
        doc! { "$set": { "doctors.$[doc].on_call": false, "updated": DateTime::now() } },
    )
    .with_options(
        UpdateOptions::builder()
            .array_filters(vec![doc! { "doc.on_call": true }])
            .build(),
    )
    .await
}

/// One toggle: a doctor of a shift goes on or off call.
#[derive(Clone, Copy, Debug)]
pub struct Toggle {
    /// The shift's `_id`.
    pub shift: i64,
    /// The doctor's name.
    pub doctor: &'static str,
    /// On call (`true`) or off call.
    pub on: bool,
}

impl Toggle {
    /// A random toggle among shifts `0..shifts`.
    pub fn random(rng: &mut impl Rng, shifts: i64) -> Self {
        Toggle {
            shift: rng.random_range(0..shifts),
            doctor: DOCTORS[rng.random_range(0..DOCTORS.len())],
            on: rng.random_bool(0.5),
        }
    }

    /// The guarded change of this toggle: the doctor's `on_call` set, and `updated` to now.
    ///
    /// # Errors
    /// Never for the workload's names; the constructor validates them.
    pub fn change(&self) -> docwarden::Result<Change> {
        Change::set_member(
            "doctors",
            "name",
            self.doctor,
            doc! { "on_call": self.on, "updated": DateTime::now() },
        )
    }

    /// The history's name of this toggle.
    #[must_use]
    pub fn op(&self) -> Op {
        if self.on { Op::OnCall } else { Op::OffCall }
    }
}

/// What a toggle did.
#[derive(Clone, Debug)]
pub enum Toggled {
    /// Safe mode: the guarded update's outcome.
    Guarded(Outcome),
    /// Control: the client decided to write and wrote.
    Written,
    /// Control: the client read that the change would break the rule and skipped it.
    Skipped,
}

/// The workload's handle on its shifts collection.
#[derive(Clone, Debug)]
pub struct OnCall {
    coll: Collection<Document>,
    guarded: Guarded,
    rules: Arc<[Invariant; 1]>,
}

impl OnCall {
    /// A handle on `coll` (set up with [`setup`]).
    ///
    /// # Errors
    /// The guard's validation of the collection or the rule.
    pub fn new(coll: Collection<Document>) -> docwarden::Result<Self> {
        Ok(Self {
            guarded: Guarded::new(coll.clone(), GuardOptions::default())?,
            rules: Arc::new([rule()?]),
            coll,
        })
    }

    /// The shifts collection.
    #[must_use]
    pub fn collection(&self) -> &Collection<Document> {
        &self.coll
    }

    /// The rule, as a slice for the guard's calls.
    #[must_use]
    pub fn rules(&self) -> &[Invariant] {
        self.rules.as_slice()
    }

    /// The operation. Safe: one guarded update. Control: read, decide, wait, write.
    ///
    /// # Errors
    /// A database error.
    pub async fn toggle(&self, t: &Toggle, mode: Mode) -> docwarden::Result<Toggled> {
        match mode {
            Mode::Safe => {
                let change = t.change()?;
                Ok(Toggled::Guarded(
                    self.guarded.update(t.shift, &change, self.rules()).await?,
                ))
            }
            Mode::Control => {
                let Some(d) = self.coll.find_one(doc! { "_id": t.shift }).await? else {
                    return Ok(Toggled::Skipped);
                };
                let others_on = d
                    .get_array("doctors")
                    .map(|a| {
                        a.iter()
                            .filter_map(Bson::as_document)
                            .filter(|m| {
                                m.get_str("name").ok() != Some(t.doctor)
                                    && m.get_bool("on_call").unwrap_or(false)
                            })
                            .count()
                    })
                    .unwrap_or(0);
                if !t.on && others_on == 0 {
                    return Ok(Toggled::Skipped);
                }
                tokio::time::sleep(CONTROL_WINDOW).await;
                self.coll
                    .update_one(
                        doc! { "_id": t.shift, "doctors": { "$elemMatch": { "name": t.doctor } } },
                        doc! { "$set": { "doctors.$.on_call": t.on, "doctors.$.updated": DateTime::now() } },
                    )
                    .await?;
                Ok(Toggled::Written)
            }
        }
    }

    /// Toggles in one batch ([`Guarded::update_many`]: one round trip on MongoDB 8.0+),
    /// outcomes in order. Safe: with the rule. Control: the same batch without the rule
    /// (the guard with its safeguard off).
    ///
    /// # Errors
    /// A database error.
    pub async fn toggle_batch(
        &self,
        toggles: &[Toggle],
        mode: Mode,
    ) -> docwarden::Result<Vec<Toggled>> {
        let changes = toggles
            .iter()
            .map(|t| Ok((Bson::from(t.shift), t.change()?)))
            .collect::<docwarden::Result<Vec<_>>>()?;
        let rules: &[Invariant] = match mode {
            Mode::Safe => self.rules(),
            Mode::Control => &[],
        };
        Ok(self
            .guarded
            .update_many(&changes, rules)
            .await?
            .into_iter()
            .map(Toggled::Guarded)
            .collect())
    }

    /// The check after an operation: whether the rule holds on `shift`.
    ///
    /// # Errors
    /// A database error.
    pub async fn holds(&self, shift: i64) -> docwarden::Result<bool> {
        Ok(guard::violations_of(&self.coll, shift, self.rules())
            .await?
            .is_empty())
    }

    /// The final read: the shifts that violate the rule.
    ///
    /// # Errors
    /// A database error.
    pub async fn violations_at_end(&self) -> docwarden::Result<u64> {
        let found = guard::violations(&self.coll, self.rules(), None).await?;
        Ok(u64::try_from(found.len()).unwrap_or(u64::MAX))
    }

    /// A [`Op::Check`] event of `shift` for a history: the shift read as stored and the
    /// rule evaluated here ([`rule_holds`]), not by the guard under test (whose
    /// pipeline the guarded updates share, and which finds nothing wrong with a missing
    /// document).
    ///
    /// # Errors
    /// A database error.
    pub async fn check_event(
        &self,
        process: u32,
        shift: i64,
        at_us: u64,
    ) -> docwarden::Result<Event> {
        let stored = self.coll.find_one(doc! { "_id": shift }).await?;
        let event = Event::new(process, Op::Check.as_str(), &shift_key(shift), at_us, at_us);
        Ok(match stored {
            Some(d) if rule_holds(&d) => event,
            Some(_) => event.outcome(OpOutcome::Failed).detail("no doctor on call"),
            None => event
                .outcome(OpOutcome::Failed)
                .detail("the shift is missing"),
        })
    }
}

/// The seed's rule on a stored shift, evaluated without the guard: some member of
/// `doctors` has `on_call: true`.
#[must_use]
pub fn rule_holds(shift: &Document) -> bool {
    shift.get_array("doctors").is_ok_and(|doctors| {
        doctors
            .iter()
            .filter_map(Bson::as_document)
            .any(|d| d.get("on_call") == Some(&Bson::Boolean(true)))
    })
}

/// The checker of a history: every failed [`Op::Check`] is an `invariant-broken` violation.
#[must_use]
pub fn check(events: &[Event]) -> Vec<Violation> {
    check_invariant_reads(
        events
            .iter()
            .filter(|e| e.op == Op::Check.as_str())
            .map(|e| (e.key.as_str(), RULE, e.outcome == OpOutcome::Ok)),
    )
}

/// What a fixed-size run did.
#[derive(Clone, Copy, Debug, Default)]
pub struct OnCallReport {
    /// Guarded updates applied.
    pub applied: u64,
    /// Guarded updates refused by the rule.
    pub rejected: u64,
    /// Guarded updates that changed nothing (already so).
    pub unchanged: u64,
    /// Control writes, and any other outcome.
    pub other: u64,
    /// Checks after an operation that found the rule broken.
    pub seen: u64,
    /// Shifts violating the rule at the end.
    pub at_end: u64,
    /// Toggles performed.
    pub operations: u64,
}

impl OnCallReport {
    /// The runner's summary: every violation seen or left at the end.
    #[must_use]
    pub fn report(&self) -> RunReport {
        RunReport {
            operations: self.operations,
            violations: self.seen + self.at_end,
        }
    }
}

/// Runs `config.workers` × `config.ops_per_worker` random toggles on `shifts` shifts of
/// `on_call` (set up beforehand), checking the shift after every toggle and every shift
/// at the end.
///
/// # Errors
/// A database error.
pub async fn run(on_call: &OnCall, shifts: i64, config: RunConfig) -> anyhow::Result<OnCallReport> {
    run_in_batches(on_call, shifts, config, 1).await
}

/// [`run`] with each worker sending its toggles `batch` at a time
/// ([`OnCall::toggle_batch`]; 1: one [`OnCall::toggle`] each), checking every toggled
/// shift after its batch. Control with batches: the batch without the rule.
///
/// # Errors
/// A database error.
pub async fn run_in_batches(
    on_call: &OnCall,
    shifts: i64,
    config: RunConfig,
    batch: usize,
) -> anyhow::Result<OnCallReport> {
    #[derive(Default)]
    struct Counts {
        applied: AtomicU64,
        rejected: AtomicU64,
        unchanged: AtomicU64,
        other: AtomicU64,
        seen: AtomicU64,
    }
    let counts = Arc::new(Counts::default());
    run_tasks(config.workers, |_| {
        let (on_call, counts) = (on_call.clone(), Arc::clone(&counts));
        async move {
            let mut left = config.ops_per_worker;
            while left > 0 {
                let n = left.min(u64::try_from(batch.max(1))?);
                left -= n;
                let toggles: Vec<Toggle> = (0..n)
                    .map(|_| Toggle::random(&mut rand::rng(), shifts))
                    .collect();
                let outcomes = if batch <= 1 {
                    vec![on_call.toggle(&toggles[0], config.mode).await?]
                } else {
                    on_call.toggle_batch(&toggles, config.mode).await?
                };
                for (t, outcome) in toggles.iter().zip(outcomes) {
                    let counter = match outcome {
                        Toggled::Guarded(Outcome::Applied) => &counts.applied,
                        Toggled::Guarded(Outcome::Rejected { .. }) => &counts.rejected,
                        Toggled::Guarded(Outcome::NoChange) => &counts.unchanged,
                        _ => &counts.other,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    if !on_call.holds(t.shift).await? {
                        counts.seen.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            anyhow::Ok(())
        }
    })
    .await?;
    Ok(OnCallReport {
        applied: counts.applied.load(Ordering::Relaxed),
        rejected: counts.rejected.load(Ordering::Relaxed),
        unchanged: counts.unchanged.load(Ordering::Relaxed),
        other: counts.other.load(Ordering::Relaxed),
        seen: counts.seen.load(Ordering::Relaxed),
        at_end: on_call.violations_at_end().await?,
        operations: u64::try_from(config.workers)?.saturating_mul(config.ops_per_worker),
    })
}

#[cfg(test)]
mod tests {
    use docwarden::check::{Event, OpOutcome};

    use mongodb::bson::doc;

    use super::{Op, check, rule_holds};

    /// The check evaluates the rule on the stored shift itself: one doctor on call, no
    /// doctor on call, no doctors array.
    #[test]
    fn the_rule_is_evaluated_on_the_stored_shift() {
        let shift = |on: [bool; 2]| {
            doc! { "_id": 1, "doctors": [
                { "name": "Alice", "on_call": on[0] },
                { "name": "Bob", "on_call": on[1] },
            ] }
        };
        assert!(rule_holds(&shift([false, true])));
        assert!(!rule_holds(&shift([false, false])));
        assert!(!rule_holds(&doc! { "_id": 1 }));
        assert!(!rule_holds(
            &doc! { "_id": 1, "doctors": [{ "name": "Alice", "on_call": 1 }] }
        ));
    }

    #[test]
    fn only_failed_checks_are_violations() {
        let events = vec![
            Event::new(0, Op::OffCall.as_str(), "shift 1", 0, 1).outcome(OpOutcome::Failed),
            Event::new(0, Op::Check.as_str(), "shift 1", 2, 2),
            Event::new(1, Op::Check.as_str(), "shift 2", 3, 3).outcome(OpOutcome::Failed),
        ];
        let found = check(&events);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].key, "shift 2");
    }
}
