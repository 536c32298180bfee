//! Lock workloads: acquire + release pairs on random resources of a lock collection (each
//! resource acquired once before the row is measured), and seed 003's locked increments of
//! document locks (`docwarden_workloads::counters`). With `--stages`, the acquire's and the
//! release's commands sent raw on a lock collection of the same indexes (the pair's floor),
//! and the document lock's two writes by `_id` alone (its floor).

use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::format::collection::{ACQUISITION, TOKEN};
use docwarden::lock::{
    DocumentLockOptions, DocumentLocks, FencingToken, Lease, LockCollection, LockOptions, Owner,
};
use docwarden_workloads::counters::{self, Increment};
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};

use super::{BenchRow, Load, measure};

const RESOURCES: i64 = 1_000;

/// Acquire + release on a lock collection (an issue 14 target row).
pub(crate) const PAIR: &str = "lock acquire+release";
/// The acquire's command sent raw (`--stages`).
pub(crate) const ACQUIRE_STAGE: &str =
    "lock stage: the acquire's findOneAndUpdate raw (same indexes)";
/// The acquire's and the release's commands sent raw, one after the other: the pair's floor
/// (`--stages`).
pub(crate) const PAIR_STAGE: &str =
    "lock stage: the acquire's and the release's commands raw (same indexes)";
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

/// The lock pair's commands sent raw, on a lock collection of its own opened as the row's
/// is (`LockCollection::open`: the `gc_at` TTL index and `{owner, _id}`), every resource
/// acquired and released once first: the acquire's `findOneAndUpdate` alone
/// ([`ACQUIRE_STAGE`]) and the acquire followed by the release's `updateOne`
/// ([`PAIR_STAGE`], the pair's floor). Each is the library's own filter and pipeline
/// ([`LockCollection::acquire_update`], [`LockCollection::release_update_for`]) with the
/// client's clock for the server's, without what the library does around them (its time
/// source, the acquisition's landing clean-up, the post-image's checks, tracing and
/// metrics). Before session 31 the floor was the acquire and an operator-form release
/// with the filter `{_id, owner, token, pending}` (the release before session 23), on a
/// collection without the lock collection's indexes.
async fn stages(db: &Database, load: &Load) -> anyhow::Result<Vec<BenchRow>> {
    let mut rows = Vec::new();
    for (name, release) in [(ACQUIRE_STAGE, false), (PAIR_STAGE, true)] {
        let c = raw_lock_collection(db, &format!("bench_lock_stage_{}", rows.len())).await?;
        rows.push(
            measure(name, load, move |worker| {
                let c = c.clone();
                async move { raw_pair(&c, worker, release).await }
            })
            .await?,
        );
    }
    Ok(rows)
}

/// A lock collection `name` opened as the row's, with every resource acquired and released
/// once (its token block reserved), as a plain collection for raw commands.
async fn raw_lock_collection(db: &Database, name: &str) -> anyhow::Result<Collection<Document>> {
    let time = TimeSource::server(db.client().clone(), ClockOptions::default())?;
    let locks = LockCollection::open(db, name, time, LockOptions::default()).await?;
    let owner = Owner::random();
    for r in 0..RESOURCES {
        if let Some(lease) = locks
            .try_acquire(&owner, &format!("r-{r}"), Duration::from_secs(30))
            .await?
        {
            locks.release(&lease).await?;
        }
    }
    Ok(db.collection(name))
}

/// One raw acquire of a random resource for worker `worker`'s owner (30 s lease), and with
/// `release` its release: 1 if the acquire took the lock (0 when another worker held it).
/// The acquire takes the lock while it is free or its expiry is before now, so an acquire
/// without its release (the acquire stage) takes it again next time.
async fn raw_pair(c: &Collection<Document>, worker: usize, release: bool) -> anyhow::Result<u64> {
    let resource = format!("r-{}", rand::random_range(0..RESOURCES));
    let owner = format!("bench-{worker}");
    let nonce = format!("{:x}", rand::random::<u64>());
    let now = DateTime::now();
    let later = |ms: i64| DateTime::from_millis(now.timestamp_millis() + ms);
    let expires_at = later(if release { 30_000 } else { 0 });
    let (filter, update) = LockCollection::acquire_update(
        &resource,
        &owner,
        &nonce,
        now,
        later(2_000),
        now,
        expires_at,
    );
    let after = c
        .find_one_and_update(filter, update)
        .upsert(true)
        .return_document(ReturnDocument::After)
        .await?;
    let Some(token) = after
        .filter(|d| d.get_str(ACQUISITION).ok() == Some(nonce.as_str()))
        .and_then(|d| d.get_i64(TOKEN).ok())
    else {
        return Ok(0);
    };
    if release {
        let lease = Lease {
            resource,
            owner,
            token: FencingToken::new(token),
            acquired_at: now,
            expires_at,
        };
        let (filter, update) = LockCollection::release_update_for(&lease);
        c.update_one(filter, update).await?;
    }
    Ok(1)
}
