//! Hand-edited lock documents (issue 11, finding 8): a lock whose `expires_at` is not a date
//! and a document lock with a `lock_id` but no date in `lock_time` used to stay locked
//! forever. docwarden never writes either shape, so an acquire treats them as expired and
//! takes them over (fencing tokens still increase), and the listing reports them.

use std::time::Duration;

use anyhow::Context;
use docwarden::Error;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{
    DocumentLockOptions, DocumentLocks, FenceOutcome, LockCollection, LockCounts, LockListFilter,
    Owner,
};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, DateTime, Document, doc};

const LOCKS: &str = "locks";

async fn open(t: &TestDb) -> anyhow::Result<LockCollection> {
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    Ok(docwarden_workloads::counters::open_locks(&t.db, LOCKS, time).await?)
}

/// Hand edits of a held lock's `expires_at` that no docwarden version writes.
fn bad_expiries() -> Vec<(&'static str, Document)> {
    vec![
        (
            "a string",
            doc! { "$set": { "expires_at": "2099-01-01T00:00:00Z" } },
        ),
        ("null", doc! { "$set": { "expires_at": Bson::Null } }),
        ("missing", doc! { "$unset": { "expires_at": "" } }),
        (
            "a number",
            doc! { "$set": { "expires_at": 4_102_444_800_000_i64 } },
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_whose_expiry_is_not_a_date_is_taken_over_with_a_larger_token() -> anyhow::Result<()>
{
    let t = TestDb::new("lock_malformed_expiry").await?;
    let locks = open(&t).await?;
    let lock_docs = t.db.collection::<Document>(LOCKS);
    let (holder, next) = (Owner::random(), Owner::random());
    let mut stuck = Vec::new();
    let mut unreported = Vec::new();
    for (i, (shape, edit)) in bad_expiries().into_iter().enumerate() {
        // Two held locks edited the same way: one to take over, one to list.
        let (resource, listed_resource) = (format!("m-{i}"), format!("l-{i}"));
        let old = locks
            .try_acquire(&holder, &resource, Duration::from_secs(60))
            .await?
            .context("first acquisition")?;
        locks
            .try_acquire(&holder, &listed_resource, Duration::from_secs(60))
            .await?
            .context("acquisition to list")?;
        for r in [&resource, &listed_resource] {
            lock_docs
                .update_one(doc! { "_id": r }, edit.clone())
                .await?;
        }

        // The listing reports it (it used to fail as a whole on such a document).
        match locks
            .list(&LockListFilter::default().resource(listed_resource.as_str()))
            .await
        {
            Ok(listed) => {
                let reported = listed.len() == 1
                    && listed[0].owner == holder.id()
                    && listed[0].expired
                    && listed[0]
                        .malformed
                        .as_deref()
                        .is_some_and(|m| m.contains("expires_at"));
                if !reported {
                    unreported.push(format!("expires_at is {shape}: listed as {listed:?}"));
                }
            }
            Err(e) => unreported.push(format!("expires_at is {shape}: list failed: {e}")),
        }

        // A blocking acquire with a generous wait must get it.
        match locks
            .acquire(
                &next,
                &resource,
                Duration::from_secs(30),
                Duration::from_millis(1_500),
            )
            .await?
        {
            Some(lease) => {
                assert!(
                    lease.token > old.token,
                    "{shape}: {} > {}",
                    lease.token,
                    old.token
                );
                assert_eq!(locks.last_token(&resource).await?, Some(lease.token));
                let d = lock_docs
                    .find_one(doc! { "_id": &resource })
                    .await?
                    .context("lock document")?;
                assert_eq!(*d.get_datetime("expires_at")?, lease.expires_at);
                // The old holder is refused, the new one renews and releases.
                assert!(matches!(
                    locks.release(&old).await,
                    Err(Error::LeaseLost { .. })
                ));
                let mut lease = lease;
                locks.renew(&mut lease, Duration::from_secs(30)).await?;
                locks.release(&lease).await?;
            }
            None => stuck.push(format!("expires_at is {shape}")),
        }
    }
    assert!(
        stuck.is_empty() && unreported.is_empty(),
        "locks stuck forever after a hand edit: {stuck:?}; not reported by list: {unreported:#?}"
    );

    // A well-formed held lock is still refused, whatever else is malformed nearby.
    let held = locks
        .try_acquire(&holder, "held", Duration::from_secs(60))
        .await?
        .context("held")?;
    assert!(
        locks
            .try_acquire(&next, "held", Duration::from_secs(5))
            .await?
            .is_none()
    );
    locks.release(&held).await?;
    Ok(())
}

#[tokio::test]
async fn other_malformed_fields_are_listed_not_fatal() -> anyhow::Result<()> {
    let t = TestDb::new("lock_malformed_list").await?;
    let locks = open(&t).await?;
    let lock_docs = t.db.collection::<Document>(LOCKS);
    let owner = Owner::random();
    for (resource, edit) in [
        ("acquired", doc! { "$set": { "acquired_at": "yesterday" } }),
        ("token", doc! { "$set": { "token": "seven" } }),
        ("fine", doc! {}),
    ] {
        locks
            .try_acquire(&owner, resource, Duration::from_secs(60))
            .await?
            .context("acquire")?;
        if !edit.is_empty() {
            lock_docs.update_one(doc! { "_id": resource }, edit).await?;
        }
    }
    let listed = locks.list(&LockListFilter::default()).await?;
    let by = |r: &str| listed.iter().find(|l| l.resource == r).cloned();
    let acquired = by("acquired").context("acquired listed")?;
    assert!(
        acquired
            .malformed
            .as_deref()
            .is_some_and(|m| m.contains("acquired_at")),
        "{acquired:?}"
    );
    // Its expiry is a date: it stays held until then.
    assert!(!acquired.expired);
    let token = by("token").context("token listed")?;
    assert!(
        token
            .malformed
            .as_deref()
            .is_some_and(|m| m.contains("token")),
        "{token:?}"
    );
    let fine = by("fine").context("fine listed")?;
    assert_eq!(fine.malformed, None);
    assert!(
        locks
            .try_acquire(&Owner::random(), "acquired", Duration::from_secs(5))
            .await?
            .is_none(),
        "a lock with a date expiry in the future is held, whatever else is malformed"
    );
    Ok(())
}

/// `counts` (one aggregation, for dashboards) agrees with the listing on every kind of
/// lock document: held by one owner or another, expired, hand-edited expiries (each counts
/// as expired), a malformed token with a future expiry (held), and released ones (not
/// counted). A limit lists the first locks by resource.
#[tokio::test]
async fn counts_agree_with_the_listing_and_a_limit_lists_the_first() -> anyhow::Result<()> {
    let t = TestDb::new("lock_counts").await?;
    let locks = open(&t).await?;
    assert_eq!(locks.counts().await?, LockCounts::default(), "empty");
    let lock_docs = t.db.collection::<Document>(LOCKS);
    let (a, b) = (Owner::random(), Owner::random());
    let long = Duration::from_secs(60);
    for i in 0..5 {
        locks
            .try_acquire(&a, &format!("a-{i}"), long)
            .await?
            .context("a")?;
    }
    for i in 0..3 {
        locks
            .try_acquire(&b, &format!("b-{i}"), long)
            .await?
            .context("b")?;
    }
    // Expired: a short lease left to lapse, and every hand-edited expiry.
    locks
        .try_acquire(&b, "short", Duration::from_millis(300))
        .await?
        .context("short")?;
    for (i, (_, edit)) in bad_expiries().into_iter().enumerate() {
        let r = format!("edited-{i}");
        locks.try_acquire(&a, &r, long).await?.context("edited")?;
        lock_docs.update_one(doc! { "_id": &r }, edit).await?;
    }
    // Held though malformed: the token is not an int64, the expiry is a future date.
    locks
        .try_acquire(&a, "token", long)
        .await?
        .context("token")?;
    lock_docs
        .update_one(
            doc! { "_id": "token" },
            doc! { "$set": { "token": "seven" } },
        )
        .await?;
    // Released: kept as a document without an owner, not counted.
    let gone = locks
        .try_acquire(&b, "released", long)
        .await?
        .context("released")?;
    locks.release(&gone).await?;
    tokio::time::sleep(Duration::from_millis(800)).await;

    let listed = locks.list(&LockListFilter::default()).await?;
    let held = listed.iter().filter(|r| !r.expired).count();
    let holders: std::collections::BTreeSet<&str> = listed
        .iter()
        .filter(|r| !r.expired)
        .map(|r| r.owner.as_str())
        .collect();
    let counts = locks.counts().await?;
    println!("{counts:?}, {} listed", listed.len());
    assert_eq!(counts.held, 5 + 3 + 1, "{listed:?}");
    assert_eq!(counts.expired, 1 + 4, "{listed:?}");
    assert_eq!(counts.holders, 2);
    assert_eq!(
        (counts.held, counts.expired, counts.holders),
        (
            u64::try_from(held)?,
            u64::try_from(listed.len() - held)?,
            u64::try_from(holders.len())?
        ),
        "counts and listing disagree"
    );

    let first = locks.list(&LockListFilter::default().limit(3)).await?;
    let names: Vec<&str> = first.iter().map(|r| r.resource.as_str()).collect();
    assert_eq!(names, ["a-0", "a-1", "a-2"]);
    assert!(
        locks
            .list(&LockListFilter::default().limit(0))
            .await?
            .is_empty()
    );
    assert_eq!(
        locks
            .list(&LockListFilter::default().owner(b.id()).limit(2))
            .await?
            .len(),
        2
    );
    Ok(())
}

/// Hand edits of a document lock's `lock_time` that no docwarden version writes, with
/// `lock_id` left set.
fn bad_lock_times() -> Vec<(&'static str, Document)> {
    vec![
        ("missing", doc! { "$unset": { "lock_time": "" } }),
        ("null", doc! { "$set": { "lock_time": Bson::Null } }),
        (
            "a string",
            doc! { "$set": { "lock_time": "2099-01-01T00:00:00Z" } },
        ),
        (
            "a number",
            doc! { "$set": { "lock_time": 4_102_444_800_000_i64 } },
        ),
    ]
}

#[tokio::test]
async fn a_document_lock_without_a_date_lock_time_is_taken_over() -> anyhow::Result<()> {
    let t = TestDb::new("doclock_malformed").await?;
    let coll = t.db.collection::<Document>("dummies");
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let locks = DocumentLocks::new(
        coll.clone(),
        time,
        DocumentLockOptions::default().max_duration(Duration::from_secs(60)),
    )?;
    let mut stuck = Vec::new();
    for (i, (shape, edit)) in bad_lock_times().into_iter().enumerate() {
        let id = format!("d-{i}");
        let old = locks
            .lock_or_create(id.as_str(), doc! { "value": "start" })
            .await?
            .context("a new document is not held")?;
        coll.update_one(doc! { "_id": &id }, edit).await?;

        // The listing reports it, as expired.
        let listed = locks.list_locked().await?;
        let record = listed
            .iter()
            .find(|r| r.id == id)
            .with_context(|| format!("{id} listed in {listed:?}"))?;
        assert!(record.expired, "{shape}: {record:?}");
        assert_eq!(
            record.malformed.as_deref(),
            Some(format!("lock_time is {shape}").as_str()),
            "{record:?}"
        );

        let mut got = None;
        for _ in 0..3 {
            match locks.try_lock(id.as_str()).await {
                Ok(Some(guard)) => {
                    got = Some(guard);
                    break;
                }
                Ok(None) => {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let Some(guard) = got else {
            stuck.push(format!("lock_time is {shape}"));
            continue;
        };
        assert_ne!(guard.lock_id, old.lock_id);
        // The old holder's fenced release is refused, the new one's applies.
        assert_eq!(
            locks
                .release_with(old, doc! { "$set": { "value": "from old" } })
                .await?,
            FenceOutcome::Lost
        );
        assert_eq!(
            locks
                .release_with(guard, doc! { "$set": { "value": "from new" } })
                .await?,
            FenceOutcome::Applied
        );
        let d = coll.find_one(doc! { "_id": &id }).await?.context("doc")?;
        assert_eq!(d.get_str("value")?, "from new");
    }
    assert!(
        stuck.is_empty(),
        "document locks stuck forever after a hand edit: {stuck:?}"
    );

    // A well-formed lock is still refused, and listed as held.
    let held = locks
        .lock_or_create("held", doc! {})
        .await?
        .context("held is new")?;
    assert!(matches!(locks.try_lock("held").await, Ok(None)));
    let listed = locks.list_locked().await?;
    assert_eq!(
        listed.len(),
        1,
        "only the held document is locked: {listed:?}"
    );
    assert_eq!(listed[0].id, "held");
    assert_eq!(listed[0].lock_id, held.lock_id);
    assert!(!listed[0].expired);
    assert_eq!(listed[0].malformed, None);
    // A fresh lock_time (a date) is honoured even with a hand-written lock id.
    coll.insert_one(doc! { "_id": "hand", "lock_id": "someone", "lock_time": DateTime::now() })
        .await?;
    assert!(matches!(locks.try_lock("hand").await, Ok(None)));
    assert_eq!(locks.release(held).await?, FenceOutcome::Applied);
    Ok(())
}
