//! Seed 000: doctors on call. Concurrent workers take doctors on and off call through
//! guarded updates while a checker counts shifts left with nobody on call; then the same
//! rule is installed as the collection's validator and the seed's bypass update (every
//! doctor off call through `arrayFilters`) is shown refused with code 121.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use docwarden::guard::{
    self, Change, GuardOptions, GuardOutcome, Guarded, ValidatorInstall, ValidatorOptions,
};
use mongodb::Database;
use mongodb::bson::{DateTime, Document, doc};
use mongodb::options::UpdateOptions;

use super::ScenarioReport;

const SHIFTS: i64 = 10;
const WORKERS: usize = 8;
const OPS_PER_WORKER: u64 = 250;

#[derive(Debug, Default)]
struct Counts {
    applied: AtomicU64,
    rejected: AtomicU64,
    unchanged: AtomicU64,
    other: AtomicU64,
    violations: AtomicU64,
}

pub(crate) async fn run(db: &Database) -> anyhow::Result<Vec<ScenarioReport>> {
    let started = Instant::now();
    crate::demo::narrate!(
        "== on-call (seed 000): {SHIFTS} shifts × {} doctors, {WORKERS} workers × {OPS_PER_WORKER} toggles",
        crate::shifts::DOCTORS.len()
    );
    let coll = db.collection::<Document>("shifts");
    crate::shifts::insert(&coll, SHIFTS).await?;
    guard::ensure_array_index(&coll, "doctors.updated").await?;

    let counts = Arc::new(Counts::default());
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        let coll = coll.clone();
        let counts = Arc::clone(&counts);
        tasks.push(tokio::spawn(async move {
            let guarded = Guarded::new(coll.clone(), GuardOptions::default())?;
            let rule = [crate::shifts::at_least_one_on_call()?];
            for _ in 0..OPS_PER_WORKER {
                let shift = rand::random_range(0..SHIFTS);
                let doctor =
                    crate::shifts::DOCTORS[rand::random_range(0..crate::shifts::DOCTORS.len())];
                let on = rand::random_bool(0.5);
                let change = Change::set_member(
                    "doctors",
                    "name",
                    doctor,
                    doc! { "on_call": on, "updated": DateTime::now() },
                )?;
                let counter = match guarded.update(shift, &change, &rule).await? {
                    GuardOutcome::Applied => &counts.applied,
                    GuardOutcome::Rejected { .. } => &counts.rejected,
                    GuardOutcome::NoChange => &counts.unchanged,
                    _ => &counts.other,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                // The seed's checkOnCalls, after every operation.
                if !guard::violations_of(&coll, shift, &rule).await?.is_empty() {
                    counts.violations.fetch_add(1, Ordering::Relaxed);
                }
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    let rule = [crate::shifts::at_least_one_on_call()?];
    let at_end = guard::violations(&coll, &rule, None).await?;
    let mut violations = counts.violations.load(Ordering::Relaxed) + u64::try_from(at_end.len())?;
    crate::demo::narrate!(
        "   applied {}, rejected (would leave a shift uncovered) {}, already so {}, other {}; violations seen {}, at the end {}",
        counts.applied.load(Ordering::Relaxed),
        counts.rejected.load(Ordering::Relaxed),
        counts.unchanged.load(Ordering::Relaxed),
        counts.other.load(Ordering::Relaxed),
        counts.violations.load(Ordering::Relaxed),
        at_end.len()
    );

    match guard::install_validator(&coll, &rule, &ValidatorOptions::default()).await? {
        ValidatorInstall::Installed { .. } => {
            crate::demo::narrate!("   validator installed (strict, error)")
        }
        ValidatorInstall::Refused { violations: v } => {
            crate::demo::narrate!(
                "   validator refused: {} shifts already violate the rule",
                v.len()
            );
            violations += 1;
        }
        other => anyhow::bail!("unexpected validator outcome {other:?}"),
    }
    // The seed's bypass: every doctor of shift 0 off call, no condition.
    let bypass = coll
        .update_one(
            doc! { "_id": 0_i64 },
            doc! { "$set": { "doctors.$[doc].on_call": false, "updated": DateTime::now() } },
        )
        .with_options(
            UpdateOptions::builder()
                .array_filters(vec![doc! { "doc.on_call": true }])
                .build(),
        )
        .await;
    match bypass {
        Err(e) if docwarden::error::error_code(&e) == Some(121) => {
            crate::demo::narrate!(
                "   seed bypass update refused by the validator: code 121 (DocumentValidationFailure)"
            );
        }
        Err(e) => return Err(e.into()),
        Ok(r) => {
            crate::demo::narrate!(
                "   seed bypass update was NOT refused (modified {})",
                r.modified_count
            );
            violations += 1;
        }
    }
    Ok(vec![ScenarioReport {
        scenario: "on-call",
        operations: u64::try_from(WORKERS)? * OPS_PER_WORKER,
        violations,
        elapsed: started.elapsed(),
    }])
}
