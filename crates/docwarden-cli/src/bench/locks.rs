//! Lock workloads: acquire + release pairs on random resources of a lock collection (each
//! resource acquired once before the row is measured), and seed 003's locked increments of
//! document locks (`docwarden_workloads::counters`).

use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{DocumentLockOptions, DocumentLocks, LockCollection, LockOptions, Owner};
use docwarden_workloads::counters::{self, Increment};
use mongodb::Database;
use mongodb::bson::{Document, doc};

use super::{BenchRow, Load, measure};

const RESOURCES: i64 = 1_000;

pub(crate) async fn run(db: &Database, load: &Load) -> anyhow::Result<Vec<BenchRow>> {
    let time = TimeSource::server(db.client().clone(), ClockOptions::default())?;
    let locks =
        LockCollection::open(db, "bench_locks", time.clone(), LockOptions::default()).await?;
    let owners: Vec<Owner> = (0..load.workers).map(|_| Owner::random()).collect();
    // Acquire and release every resource once first, as the reference's documents exist
    // before it is measured: the row measures steady-state acquires (one write each), not
    // the first acquire of a resource (three writes: it reserves the resource's token
    // block; see `docs/locks.md`).
    if let Some(owner) = owners.first() {
        for r in 0..RESOURCES {
            if let Some(lease) = locks
                .try_acquire(owner, &format!("r-{r}"), Duration::from_secs(30))
                .await?
            {
                locks.release(&lease).await?;
            }
        }
    }
    let lease_row = measure("lock acquire+release", load, move |worker| {
        let locks = locks.clone();
        let owner = owners[worker % owners.len()].clone();
        async move {
            let r = rand::random_range(0..RESOURCES);
            match locks
                .try_acquire(&owner, &format!("r-{r}"), Duration::from_secs(30))
                .await?
            {
                Some(lease) => {
                    locks.release(&lease).await?;
                    Ok(1)
                }
                None => Ok(0),
            }
        }
    })
    .await?;

    let coll = db.collection::<Document>("bench_doclocks");
    coll.insert_many((0..RESOURCES).map(|i| doc! { "_id": i, "n": 0_i64 }))
        .await?;
    let doc_locks = DocumentLocks::new(coll, time, DocumentLockOptions::default())?;
    let doc_row = measure("document lock+release_with", load, move |_| {
        let doc_locks = doc_locks.clone();
        async move {
            let id = rand::random_range(0..RESOURCES);
            Ok(u64::from(
                counters::document_increment(&doc_locks, id).await? == Increment::Done,
            ))
        }
    })
    .await?;
    Ok(vec![lease_row, doc_row])
}
