//! Sequenced set applies of seed 001's set (`docwarden_workloads::enrollment`) over random
//! students, classes and sequence numbers.

use docwarden_workloads::Mode;
use docwarden_workloads::enrollment::{self, CLASSES, Message};
use mongodb::Database;

use super::{BenchRow, Load, measure};

const KEYS: i64 = 1_000;

pub(crate) async fn run(db: &Database, load: &Load) -> anyhow::Result<Vec<BenchRow>> {
    let set = enrollment::open_set(db.collection("bench_sequence")).await?;
    // Create the documents first, as the reference's are: the row measures steady-state
    // applies (one round trip each), not the one-off creation of a key.
    for student in 0..KEYS {
        set.add(student, CLASSES[0], 0).await?;
    }
    let row = measure("sequence: add/remove (random seq)", load, move |_| {
        let set = set.clone();
        async move {
            let msg = Message {
                id: 0,
                student: rand::random_range(0..KEYS),
                class: CLASSES[rand::random_range(0..CLASSES.len())],
                enroll: rand::random_bool(0.5),
                seq: rand::random_range(0..1_000_000_i64),
            };
            enrollment::apply(&set, &msg, Mode::Safe).await?;
            Ok(1)
        }
    })
    .await?;
    Ok(vec![row])
}
