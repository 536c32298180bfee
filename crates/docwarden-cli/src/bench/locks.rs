//! Lock workloads: acquire + release pairs on random resources of a lock collection (each
//! resource acquired once before the row is measured), and seed 003's locked increments of
//! document locks (`docwarden_workloads::counters`). With `--stages`, the acquire's and the
//! release's writes as raw commands on lock-shaped documents.

use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::format::collection::{
    ACQUIRED_AT, ACQUISITION, CEILING, EXPIRES_AT, OWNER, PENDING, TOKEN,
};
use docwarden::lock::{DocumentLockOptions, DocumentLocks, LockCollection, LockOptions, Owner};
use docwarden_workloads::counters::{self, Increment};
use mongodb::Database;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::options::ReturnDocument;

use super::{BenchRow, Load, measure};

const RESOURCES: i64 = 1_000;

/// Acquire + release on a lock collection (an issue 14 target row).
pub(crate) const PAIR: &str = "lock acquire+release";
/// The acquire's command sent raw (`--stages`).
pub(crate) const ACQUIRE_STAGE: &str =
    "lock stage: the acquire's findOneAndUpdate (pipeline, upsert)";
/// The release's command sent raw (`--stages`).
pub(crate) const RELEASE_STAGE: &str = "lock stage: the release's updateOne";
/// Seed 003's locked increment (an issue 14 target row).
pub(crate) const DOCUMENT: &str = "document lock+release_with";
/// Its two writes by `_id` alone (its floor, `--stages`).
pub(crate) const DOCUMENT_STAGE: &str =
    "document lock stage: its two writes by _id only (no condition, no fence)";

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
    let lease_row = measure(PAIR, load, move |worker| {
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

    let mut rows = vec![lease_row];
    if load.stages {
        rows.extend(stages(db, load).await?);
    }

    let coll = db.collection::<Document>("bench_doclocks");
    coll.insert_many((0..RESOURCES).map(|i| doc! { "_id": i, "n": 0_i64 }))
        .await?;
    let doc_locks = DocumentLocks::new(coll, time, DocumentLockOptions::default())?;
    let doc_row = measure(DOCUMENT, load, move |_| {
        let doc_locks = doc_locks.clone();
        async move {
            let id = rand::random_range(0..RESOURCES);
            Ok(u64::from(
                counters::document_increment(&doc_locks, id).await? == Increment::Done,
            ))
        }
    })
    .await?;
    rows.push(doc_row);
    if load.stages {
        rows.push(document_stage(db, load).await?);
    }
    Ok(rows)
}

/// The floor of seed 003's locked increment: its two writes as raw commands by `{_id}`
/// alone, no expiry condition and no fence — the lock's `findOneAndUpdate` (sets the
/// lock fields, post-image) and the release's `updateOne` (the change, lock fields
/// cleared) — on documents of the same shape, for the document-lock row to be read
/// against.
async fn document_stage(db: &Database, load: &Load) -> anyhow::Result<BenchRow> {
    let coll = db.collection::<Document>("bench_doclock_stage");
    coll.insert_many((0..RESOURCES).map(|i| doc! { "_id": i, "n": 0_i64 }))
        .await?;
    let options = DocumentLockOptions::default();
    let (id_f, time_f) = (options.lock_id_field, options.lock_time_field);
    measure(DOCUMENT_STAGE, load, move |_| {
        let (c, id_f, time_f) = (coll.clone(), id_f.clone(), time_f.clone());
        async move {
            let id = rand::random_range(0..RESOURCES);
            let locked = c
                .find_one_and_update(
                    doc! { "_id": id },
                    doc! { "$set": { &id_f: "stage", &time_f: DateTime::now() } },
                )
                .return_document(ReturnDocument::After)
                .await?;
            let n = locked.and_then(|d| d.get_i64("n").ok()).unwrap_or_default();
            c.update_one(
                doc! { "_id": id },
                doc! { "$set": { "n": n + 1, &id_f: Bson::Null, &time_f: Bson::Null } },
            )
            .await?;
            Ok(1)
        }
    })
    .await
}

/// The two writes of a fast-path acquire + release as raw commands on lock-shaped
/// documents (`docs/locks.md`): the acquire's `findOneAndUpdate` (the library's own filter
/// `{_id}` and one-stage pipeline, [`LockCollection::acquire_update`], upsert, post-image)
/// on locks whose expiry has passed, and the release's `updateOne` (filter `{_id, owner,
/// token, pending absent}`). Their costs against `update_one` say where the time of the
/// acquire+release row goes.
async fn stages(db: &Database, load: &Load) -> anyhow::Result<Vec<BenchRow>> {
    let coll = db.collection::<Document>("bench_lock_stages");
    coll.insert_many((0..RESOURCES).map(|i| {
        doc! {
            "_id": format!("r-{i}"), OWNER: "o", TOKEN: 1_i64,
            CEILING: i64::MAX, ACQUISITION: "n",
            ACQUIRED_AT: DateTime::now(), EXPIRES_AT: DateTime::now(),
        }
    }))
    .await?;
    let c = coll.clone();
    let acquire = measure(ACQUIRE_STAGE, load, move |_| {
        let c = c.clone();
        async move {
            let id = format!("r-{}", rand::random_range(0..RESOURCES));
            let now = DateTime::now();
            let land_by = DateTime::from_millis(now.timestamp_millis() + 2_000);
            // `owner` stays "o" and the expiry in the past: every call takes the lock.
            let (filter, update) = LockCollection::acquire_update(
                &id,
                "o",
                "n",
                now,
                land_by,
                now,
                DateTime::from_millis(0),
            );
            c.find_one_and_update(filter, update)
                .upsert(true)
                .return_document(ReturnDocument::After)
                .await?;
            Ok(1)
        }
    })
    .await?;
    let c = db.collection::<Document>("bench_lock_stages_release");
    c.insert_many((0..RESOURCES).map(|i| {
        doc! {
            "_id": format!("r-{i}"), OWNER: "o", TOKEN: 1_i64,
            CEILING: i64::MAX, ACQUISITION: "n",
            ACQUIRED_AT: DateTime::now(), EXPIRES_AT: DateTime::now(),
        }
    }))
    .await?;
    let release = measure(
        RELEASE_STAGE,
        load,
        move |_| {
            let c = c.clone();
            async move {
                let id = format!("r-{}", rand::random_range(0..RESOURCES));
                // Matches (owner "o", token 1): the write a release makes, kept held.
                c.update_one(
                    doc! { "_id": id, OWNER: "o", TOKEN: 1_i64, PENDING: { "$exists": false } },
                    doc! { "$set": { OWNER: "o" }, "$unset": { PENDING: "" }, "$currentDate": { EXPIRES_AT: true } },
                )
                .await?;
                Ok(1)
            }
        },
    )
    .await?;
    Ok(vec![acquire, release])
}
