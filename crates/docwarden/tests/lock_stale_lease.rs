//! A stale lease of the *same* owner id (issue 11, finding 2): between step 1 of a newer
//! acquisition (owner and `pending` written, the previous token still in the document)
//! and its token commit, the old lease must not renew or release the newer acquisition.
//! The interleaving is real: the newer acquire is docwarden's own, paused after step 1.
//! Only the slow path (a new token block) has such a window, so the paused runs reserve
//! blocks of one token (every acquire takes the slow path); the default fast path, where
//! the token is taken in the acquiring write itself, is checked without a pause.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use docwarden::Error;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{AcquirePause, LockCollection, LockOptions, Owner};
use docwarden_testkit::TestDb;
use mongodb::bson::{Document, doc};
use mongodb::options::WriteConcern;

const LOCKS: &str = "locks";

async fn open(t: &TestDb) -> anyhow::Result<LockCollection> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    Ok(docwarden_workloads::counters::open_locks(&t.db, LOCKS, time).await?)
}

/// The same lock collection with blocks of one token: every acquire takes the slow path.
async fn open_slow(t: &TestDb) -> anyhow::Result<LockCollection> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    Ok(LockCollection::open(
        &t.db,
        LOCKS,
        time,
        LockOptions::default()
            .write_concern(WriteConcern::majority())
            .token_block(1),
    )
    .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_lease_of_the_same_owner_cannot_touch_a_fast_path_acquisition() -> anyhow::Result<()>
{
    let t = TestDb::new("lock_stale_same_owner_fast").await?;
    let locks = open(&t).await?;
    let owner = Owner::random();
    let old = locks
        .try_acquire(&owner, "r", Duration::from_secs(30))
        .await?
        .context("first acquisition")?;
    locks.release(&old).await?;
    let newer = locks
        .try_acquire(&owner, "r", Duration::from_secs(30))
        .await?
        .context("second acquisition")?;
    assert_eq!(
        newer.token.get(),
        old.token.get() + 1,
        "taken from the block"
    );
    let mut stale = old.clone();
    let renew = locks.renew(&mut stale, Duration::from_secs(600)).await;
    assert!(matches!(renew, Err(Error::LeaseLost { .. })), "{renew:?}");
    let release = locks.release(&old).await;
    assert!(
        matches!(release, Err(Error::LeaseLost { .. })),
        "{release:?}"
    );
    locks.release(&newer).await?;
    Ok(())
}

/// How the old lease ended before the same owner acquired again.
#[derive(Clone, Copy, Debug)]
enum Ended {
    Released,
    Expired,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_lease_of_the_same_owner_cannot_renew_or_release_a_newer_acquisition()
-> anyhow::Result<()> {
    let t = TestDb::new("lock_stale_same_owner").await?;
    let locks = open_slow(&t).await?;
    let lock_docs = t.db.collection::<Document>(LOCKS);
    let owner = Owner::random();
    let mut violations = Vec::new();

    for (i, ended) in [Ended::Released, Ended::Expired].into_iter().enumerate() {
        let resource = format!("r-{i}");
        let old = locks
            .try_acquire(&owner, &resource, Duration::from_secs(1))
            .await?
            .context("first acquisition")?;
        match ended {
            // A task of this owner releases; another task still keeps a copy of the lease.
            Ended::Released => locks.release(&old).await?,
            // The holder is paused past its ttl.
            Ended::Expired => tokio::time::sleep(Duration::from_millis(1_600)).await,
        }

        // The same owner acquires again; the acquire stops right after its step 1.
        let pause = Arc::new(AcquirePause::default());
        let paused = locks.with_acquire_pause(Arc::clone(&pause));
        let (o, r) = (owner.clone(), resource.clone());
        let newer =
            tokio::spawn(async move { paused.try_acquire(&o, &r, Duration::from_secs(30)).await });
        tokio::time::timeout(Duration::from_secs(10), pause.reached()).await?;
        let step1 = lock_docs
            .find_one(doc! { "_id": &resource })
            .await?
            .context("lock document")?;
        assert_eq!(step1.get_str("owner")?, owner.id());
        assert!(step1.contains_key("pending"), "{step1:?}");
        assert_eq!(step1.get_i64("token")?, old.token, "{step1:?}");

        // The stale lease tries to renew and release the newer acquisition.
        let mut stale = old.clone();
        let renew = locks.renew(&mut stale, Duration::from_secs(600)).await;
        if !matches!(renew, Err(Error::LeaseLost { .. })) {
            violations.push(format!("{ended:?}: renew(old lease) gave {renew:?}"));
        }
        let release = locks.release(&old).await;
        if !matches!(release, Err(Error::LeaseLost { .. })) {
            violations.push(format!("{ended:?}: release(old lease) gave {release:?}"));
        }
        let after = lock_docs
            .find_one(doc! { "_id": &resource })
            .await?
            .context("lock document")?;
        if after != step1 {
            violations.push(format!(
                "{ended:?}: the pending acquisition was changed from {step1:?} to {after:?}"
            ));
        }

        // The newer acquisition completes intact, with a larger token and its own expiry.
        pause.resume();
        let Some(lease) = tokio::time::timeout(Duration::from_secs(10), newer).await??? else {
            violations.push(format!(
                "{ended:?}: the newer acquisition lost its lock before committing its token"
            ));
            continue;
        };
        assert!(lease.token > old.token, "{} > {}", lease.token, old.token);
        let held = lock_docs
            .find_one(doc! { "_id": &resource })
            .await?
            .context("lock document")?;
        assert_eq!(held.get_str("owner")?, owner.id());
        assert_eq!(held.get_i64("token")?, lease.token);
        assert!(!held.contains_key("pending"));
        if *held.get_datetime("expires_at")? != lease.expires_at {
            violations.push(format!(
                "{ended:?}: the newer lease expires at {} in the database, not at its own {}",
                held.get_datetime("expires_at")?,
                lease.expires_at
            ));
        }
        // Once committed, the old lease is refused as before.
        assert!(matches!(
            locks.renew(&mut old.clone(), Duration::from_secs(5)).await,
            Err(Error::LeaseLost { .. })
        ));
        assert!(matches!(
            locks.release(&old).await,
            Err(Error::LeaseLost { .. })
        ));
        locks.release(&lease).await?;
    }
    assert!(
        violations.is_empty(),
        "a stale lease of the same owner acted on a newer acquisition: {violations:#?}"
    );
    Ok(())
}
