//! Sequenced set applies over random keys, members and sequence numbers.

use docwarden::sequence::{SequencedSet, SetOptions};
use mongodb::Database;

use super::{BenchRow, Load, measure};

const KEYS: i64 = 1_000;
const MEMBERS: [&str; 8] = ["a", "b", "c", "d", "e", "f", "g", "h"];

pub(crate) async fn run(db: &Database, load: &Load) -> anyhow::Result<Vec<BenchRow>> {
    let set = SequencedSet::open(db, "bench_sequence", SetOptions::default()).await?;
    // Create the documents first, as the reference's are: the row measures steady-state
    // applies (one round trip each), not the one-off creation of a key.
    for key in 0..KEYS {
        set.add(key, MEMBERS[0], 0).await?;
    }
    let row = measure("sequence: add/remove (random seq)", load, move |_| {
        let set = set.clone();
        async move {
            let key = rand::random_range(0..KEYS);
            let member = MEMBERS[rand::random_range(0..MEMBERS.len())];
            let seq = rand::random_range(0..1_000_000_i64);
            if rand::random_bool(0.5) {
                set.add(key, member, seq).await?;
            } else {
                set.remove(key, member, seq).await?;
            }
            Ok(1)
        }
    })
    .await?;
    Ok(vec![row])
}
