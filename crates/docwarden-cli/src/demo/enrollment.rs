//! Seed 001: students enroll and unenroll through a queue; consumers see the messages
//! shuffled and partly duplicated, yet every student ends with the classes the sequential
//! history gives. The workload is `docwarden_workloads::enrollment`.

use std::collections::BTreeSet;
use std::time::Instant;

use docwarden::sequence::ApplyOutcome as Outcome;
use docwarden_workloads::enrollment::{self, Mailbox};
use docwarden_workloads::{Mode, run_tasks};
use mongodb::Database;
use mongodb::bson::Document;

use super::ScenarioReport;

const STUDENTS: i64 = 40;
const MESSAGES: usize = 1_200;
const CONSUMERS: usize = 5;

pub(crate) async fn run(db: &Database) -> anyhow::Result<Vec<ScenarioReport>> {
    let started = Instant::now();
    crate::demo::narrate!(
        "== enrollment: {MESSAGES} enroll/unenroll messages for {STUDENTS} students, \
         delivered shuffled ({:.0}% twice) to {CONSUMERS} consumers",
        enrollment::DUPLICATED * 100.0
    );
    let plan = enrollment::produce(&mut rand::rng(), STUDENTS, MESSAGES);
    let deliveries = enrollment::deliver(&mut rand::rng(), &plan.messages);
    let coll = db.collection::<Document>("enrollment");
    let set = enrollment::open_set(coll.clone()).await?;

    let mailbox = Mailbox::new(deliveries.clone());
    let per_consumer = run_tasks(CONSUMERS, |_| {
        let (set, mailbox) = (set.clone(), mailbox.clone());
        async move {
            let mut counts = [0_u64; 3];
            while let Some(m) = mailbox.take() {
                let outcome = enrollment::apply(&set, &m, Mode::Safe).await?;
                mailbox.ack(&m);
                counts[match outcome {
                    Some(Outcome::Applied) => 0,
                    Some(Outcome::Stale) => 1,
                    _ => 2,
                }] += 1;
            }
            anyhow::Ok(counts)
        }
    })
    .await?;
    let mut counts = [0_u64; 3];
    for c in per_consumer {
        for (total, n) in counts.iter_mut().zip(c) {
            *total += n;
        }
    }
    let operations = u64::try_from(deliveries.len())?;
    crate::demo::narrate!(
        "   {operations} deliveries: {} applied, {} stale (a newer message had won), {} duplicates",
        counts[0],
        counts[1],
        counts[2]
    );

    let read = enrollment::final_read(&coll).await?;
    let violations = enrollment::check(&plan, &read);
    crate::demo::narrate!(
        "   {:<8} {:<48} sequential expectation",
        "student",
        "final classes"
    );
    let mut shown = 0;
    for (student, want) in &plan.expected {
        let got = read.classes.get(student).cloned().unwrap_or_default();
        let ok = &got == want;
        if shown < 8 || !ok {
            shown += 1;
            crate::demo::narrate!(
                "   {:<8} {:<48} {} {}",
                student,
                join(&got),
                join(want),
                if ok { "ok" } else { "DIFFERENT" }
            );
        }
    }
    let wrong = violations
        .iter()
        .filter(|v| v.kind != "duplicate-document")
        .count();
    let documents = read.total_documents();
    let touched = u64::try_from(plan.expected.len())?;
    let duplicates = documents.saturating_sub(touched);
    crate::demo::narrate!(
        "   {wrong} students differ from the sequential history; {documents} documents for \
         {touched} students ({duplicates} duplicates)"
    );

    // For contrast: the seed's two-update upsert on the same deliveries (not counted).
    let seed_coll = db.collection::<Document>("enrollment_seed");
    for m in &deliveries {
        enrollment::seed_apply(&seed_coll, m.student, m.class, m.seq, m.enroll).await?;
    }
    let seed_read = enrollment::final_read(&seed_coll).await?;
    let seed_wrong = enrollment::check(&plan, &seed_read)
        .iter()
        .filter(|v| v.kind != "duplicate-document")
        .count();
    crate::demo::narrate!(
        "   the seed's upsert approach on the same deliveries: {seed_wrong} students wrong, \
         {} duplicate documents",
        seed_read.total_documents().saturating_sub(touched)
    );

    Ok(vec![ScenarioReport {
        scenario: "enrollment",
        operations,
        violations: u64::try_from(wrong)? + duplicates,
        elapsed: started.elapsed(),
    }])
}

fn join(classes: &BTreeSet<String>) -> String {
    if classes.is_empty() {
        "-".to_owned()
    } else {
        classes.iter().cloned().collect::<Vec<_>>().join(", ")
    }
}
