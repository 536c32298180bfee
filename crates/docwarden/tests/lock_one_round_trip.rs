//! Issue 14, item 3: an uncontended acquire of the lock collection is one write, a release
//! is one write (counted by the driver's command monitoring), and fencing tokens still
//! strictly increase when the lock document is deleted between acquisitions (by hand or by
//! the TTL index), held or free, sequentially and under concurrent acquirers. The control
//! is docwarden's own lock collection without the counter collection
//! (`LockOptions::unsafe_token_in_lock_document`): its tokens repeat after a deletion.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{LockCollection, LockOptions, Owner};
use docwarden_testkit::{CommandLog, TestDb};
use mongodb::Client;
use mongodb::bson::{Document, doc};
use mongodb::options::WriteConcern;

const LOCKS: &str = "locks";

/// The write commands (by name) `log` recorded since it was last read.
fn writes(log: &CommandLog) -> BTreeMap<String, u32> {
    log.take_counts()
        .into_iter()
        .filter(|(name, _)| {
            ["findAndModify", "update", "insert", "delete"].contains(&name.as_str())
        })
        .collect()
}

fn total(map: &BTreeMap<String, u32>) -> u32 {
    map.values().sum()
}

async fn open(client: &Client, t: &TestDb, options: LockOptions) -> anyhow::Result<LockCollection> {
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let db = client.database(t.db.name());
    Ok(LockCollection::open(
        &db,
        LOCKS,
        time,
        options.write_concern(WriteConcern::majority()),
    )
    .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_uncontended_acquire_is_one_write_and_a_release_is_one_write() -> anyhow::Result<()> {
    let t = TestDb::new("lock_one_write").await?;
    let (client, log) = docwarden_testkit::counting_client(t.uri()).await?;
    let locks = open(&client, &t, LockOptions::default()).await?;
    let (a, b) = (Owner::random(), Owner::random());
    let ttl = Duration::from_secs(30);
    writes(&log);

    // The first acquire of a resource reserves its token block: the slow path.
    let first = locks.try_acquire(&a, "r", ttl).await?.context("first")?;
    let w = writes(&log);
    eprintln!("first acquire: {w:?}");
    assert_eq!(first.token.get(), 1);
    assert_eq!(total(&w), 3, "acquire, reserve, commit: {w:?}");
    locks.release(&first).await?;
    assert_eq!(total(&writes(&log)), 1, "release");

    // Every later acquire of the resource: one findAndModify; every release: one update.
    let mut previous = first.token;
    for i in 0..100 {
        let owner = if i % 2 == 0 { &a } else { &b };
        let lease = locks
            .try_acquire(owner, "r", ttl)
            .await?
            .context("acquire")?;
        let w = writes(&log);
        assert_eq!(
            w,
            BTreeMap::from([("findAndModify".to_owned(), 1)]),
            "acquire {i}"
        );
        assert!(lease.token > previous, "{} > {previous}", lease.token);
        previous = lease.token;
        // Contention: one write (the upsert's duplicate key), Ok(None).
        let other = if i % 2 == 0 { &b } else { &a };
        assert!(locks.try_acquire(other, "r", ttl).await?.is_none());
        assert_eq!(total(&writes(&log)), 1, "contended acquire {i}");
        locks.release(&lease).await?;
        let w = writes(&log);
        assert_eq!(w, BTreeMap::from([("update".to_owned(), 1)]), "release {i}");
    }
    assert_eq!(previous.get(), 101);
    Ok(())
}

/// Sequential acquisitions by three owners; between them the lock document is deleted
/// (while free, while held — a crashed holder whose document the TTL index collected),
/// or not. Returns the tokens in acquisition order.
async fn acquire_with_deletions(
    locks: &LockCollection,
    lock_docs: &together::Coll,
    rounds: usize,
) -> anyhow::Result<Vec<i64>> {
    let owners = [Owner::random(), Owner::random(), Owner::random()];
    let mut tokens = Vec::new();
    for round in 0..rounds {
        let owner = &owners[round % owners.len()];
        let lease = locks
            .try_acquire(owner, "job", Duration::from_secs(30))
            .await?
            .with_context(|| format!("round {round}"))?;
        tokens.push(lease.token.get());
        match round % 4 {
            // Released, then deleted.
            0 => {
                locks.release(&lease).await?;
                lock_docs.delete_many(doc! { "_id": "job" }).await?;
            }
            // Deleted while held: the holder crashed and its document was collected.
            1 => {
                lock_docs.delete_many(doc! { "_id": "job" }).await?;
            }
            // Released, kept: the next acquire takes the fast path.
            _ => locks.release(&lease).await?,
        }
    }
    Ok(tokens)
}

/// The lock documents' collection (a named alias keeps the helper's signature short).
mod together {
    pub(crate) type Coll = mongodb::Collection<mongodb::bson::Document>;
}

fn regressions(tokens: &[i64]) -> usize {
    tokens.windows(2).filter(|w| w[1] <= w[0]).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deleting_the_lock_document_between_acquisitions_never_lowers_the_token()
-> anyhow::Result<()> {
    let t = TestDb::new("lock_delete_tokens").await?;
    let locks = open(&t.client, &t, LockOptions::default()).await?;
    let lock_docs = t.db.collection::<Document>(LOCKS);
    let tokens = acquire_with_deletions(&locks, &lock_docs, 40).await?;
    eprintln!("tokens: {tokens:?}");
    assert_eq!(regressions(&tokens), 0, "tokens {tokens:?}");
    // After a deletion the token jumps to the next block; otherwise it is the next one.
    assert!(tokens.windows(2).any(|w| w[1] == w[0] + 1), "{tokens:?}");

    // Small blocks: the block runs out between deletions too.
    let small = LockCollection::open(
        &t.db,
        "small_blocks",
        locks.time().clone(),
        LockOptions::default().token_block(2),
    )
    .await?;
    let small_tokens = acquire_with_deletions(&small, &t.db.collection("small_blocks"), 40).await?;
    eprintln!("tokens with blocks of 2: {small_tokens:?}");
    assert_eq!(regressions(&small_tokens), 0, "tokens {small_tokens:?}");

    // Control: the same sequence with the token kept only in the lock document.
    let naive = LockCollection::open(
        &t.db,
        "naive_locks",
        locks.time().clone(),
        LockOptions::default().unsafe_token_in_lock_document(),
    )
    .await?;
    let naive_tokens = acquire_with_deletions(&naive, &t.db.collection("naive_locks"), 40).await?;
    eprintln!("control tokens: {naive_tokens:?}");
    assert!(
        regressions(&naive_tokens) > 0,
        "the control's tokens {naive_tokens:?} must fall after a deletion"
    );
    Ok(())
}

/// Eight tasks acquire and release one resource while a ninth deletes its lock document
/// every few milliseconds (held or free). Deleting a held lock breaks mutual exclusion by
/// design (that is what fencing is for), but no token may be handed out twice, and each
/// task sees its own tokens increase. Returns (duplicated tokens, per-task regressions,
/// acquisitions).
async fn race_with_deleter(
    locks: LockCollection,
    lock_docs: together::Coll,
) -> anyhow::Result<(usize, usize, usize)> {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let deleter = {
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            let mut deleted = 0_u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                deleted += lock_docs
                    .delete_many(doc! { "_id": "hot" })
                    .await?
                    .deleted_count;
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
            anyhow::Ok(deleted)
        })
    };
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let locks = locks.clone();
        tasks.push(tokio::spawn(async move {
            let owner = Owner::random();
            let mut mine = Vec::new();
            for _ in 0..60 {
                if let Some(lease) = locks
                    .try_acquire(&owner, "hot", Duration::from_secs(30))
                    .await?
                {
                    mine.push(lease.token.get());
                    // A release after a deletion is refused: the lease is gone.
                    let _ = locks.release(&lease).await;
                }
            }
            anyhow::Ok(mine)
        }));
    }
    let mut all = Vec::new();
    let mut per_task = 0;
    for task in tasks {
        let mine = task.await??;
        per_task += regressions(&mine);
        all.extend(mine);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let deleted = deleter.await??;
    let distinct: HashSet<i64> = all.iter().copied().collect();
    eprintln!(
        "{} acquisitions, {} distinct tokens, {deleted} deletions",
        all.len(),
        distinct.len()
    );
    anyhow::ensure!(deleted > 0, "the deleter never deleted a lock document");
    Ok((all.len() - distinct.len(), per_task, all.len()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_acquirers_and_a_deleter_never_share_a_token() -> anyhow::Result<()> {
    let t = TestDb::new("lock_delete_race").await?;
    let locks = open(&t.client, &t, LockOptions::default().token_block(3)).await?;
    let (duplicated, regressed, acquired) =
        race_with_deleter(locks, t.db.collection(LOCKS)).await?;
    assert!(acquired > 0);
    assert_eq!(
        (duplicated, regressed),
        (0, 0),
        "duplicated, regressed tokens"
    );

    // Control: without the counter collection, deletions hand out tokens again.
    let naive = LockCollection::open(
        &t.db,
        "naive_locks",
        TimeSource::server(t.client.clone(), ClockOptions::default())?,
        LockOptions::default().unsafe_token_in_lock_document(),
    )
    .await?;
    let (duplicated, regressed, _) =
        race_with_deleter(naive, t.db.collection("naive_locks")).await?;
    assert!(
        duplicated + regressed > 0,
        "the control must hand out a token twice or regress"
    );
    Ok(())
}
