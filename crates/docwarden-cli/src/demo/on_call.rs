//! Seed 000: doctors on call. Concurrent workers take doctors on and off call through
//! guarded updates while a checker counts shifts left with nobody on call; then the same
//! rule is installed as the collection's validator and the seed's bypass update (every
//! doctor off call through `arrayFilters`) is shown refused with code 121.

use std::time::Instant;

use docwarden::guard::{self, ValidatorInstall, ValidatorOptions};
use docwarden_workloads::on_call::{self, OnCall};
use docwarden_workloads::{Mode, RunConfig};
use mongodb::Database;
use mongodb::bson::Document;

use super::ScenarioReport;

const SHIFTS: i64 = 10;
const WORKERS: usize = 8;
const OPS_PER_WORKER: u64 = 250;

pub(crate) async fn run(db: &Database) -> anyhow::Result<Vec<ScenarioReport>> {
    let started = Instant::now();
    crate::demo::narrate!(
        "== on-call (seed 000): {SHIFTS} shifts × {} doctors, {WORKERS} workers × {OPS_PER_WORKER} toggles",
        on_call::DOCTORS.len()
    );
    let coll = db.collection::<Document>("shifts");
    on_call::setup(&coll, SHIFTS).await?;
    guard::ensure_array_index(&coll, "doctors.updated").await?;
    let workload = OnCall::new(coll.clone())?;
    let counts = on_call::run(
        &workload,
        SHIFTS,
        RunConfig {
            workers: WORKERS,
            ops_per_worker: OPS_PER_WORKER,
            mode: Mode::Safe,
        },
    )
    .await?;
    let mut violations = counts.report().violations;
    crate::demo::narrate!(
        "   applied {}, rejected (would leave a shift uncovered) {}, already so {}, other {}; violations seen {}, at the end {}",
        counts.applied,
        counts.rejected,
        counts.unchanged,
        counts.other,
        counts.seen,
        counts.at_end
    );
    let rule = workload.rules();

    match guard::install_validator(&coll, rule, &ValidatorOptions::default()).await? {
        ValidatorInstall::Installed { .. } => {
            crate::demo::narrate!("   validator installed (strict, error)")
        }
        ValidatorInstall::Upgraded { .. } => {
            crate::demo::narrate!(
                "   validator upgraded from an earlier docwarden's (strict, error)"
            )
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
    let bypass = on_call::seed_bypass(&coll, 0).await;
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
        operations: counts.operations,
        violations,
        elapsed: started.elapsed(),
    }])
}
