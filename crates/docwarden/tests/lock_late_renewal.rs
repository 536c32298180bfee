//! A renewal that lands late must not shorten a lease.
//!
//! A holder stops waiting for a renewal that is slow (the watchdog's timeout, a dropped
//! future, a lost connection) and sends another. The server may still run the first one
//! afterwards: MongoDB runs a command it has received even when the client has gone, and a
//! write can wait inside the server (a write conflict retried with back-off, a lock, a
//! stalled connection). Found by `docwarden verify election --faults all` (session 18,
//! "two-leaders"): the holder counted its term from the second renewal while the first,
//! computed 266 ms earlier, landed after it and moved the stored expiry back, so a
//! campaign could take over while the holder still certainly led.
//!
//! Each case renews the same lease twice from two clients: the first renewal's connection
//! is held by MongoDB's `failCommand` fail point (`blockConnection`, matched by the
//! client's application name), the second is sent 150 ms later and answers first; then
//! the first lands. The stored expiry must stay at least the second's. Cases: a lock
//! collection's lease, a semaphore permit (one permit of a resource, and two of one
//! resource: the pipeline form), a read lease, and a job's lease (`heartbeat` and
//! `heartbeat_many`). Fail points are server-wide, so this file is its own test binary
//! with one test that runs its cases in turn.

use std::time::Duration;

use anyhow::Context;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{
    LockCollection, LockOptions, Owner, RwLockOptions, RwLocks, Semaphore, SemaphoreOptions,
};
use docwarden::queue::{EnqueueOptions, JobQueue, QueueOptions};
use docwarden_testkit::{fail_commands_off, hold_next};
use mongodb::Database;
use mongodb::bson::{DateTime, Document, doc};

/// The application name of the client whose renewals are held.
const LATE_APP: &str = "late-renewal";
/// How long the first renewal's connection is held.
const HOLD: Duration = Duration::from_millis(900);
/// How long after the first renewal the second is sent.
const GAP: Duration = Duration::from_millis(150);

/// Runs `late` (its first command held) and, [`GAP`] later, `prompt`; returns their
/// outputs and whether the late one answered after the prompt one (the fail point held it).
async fn race<A, B>(
    late: impl Future<Output = A>,
    prompt: impl Future<Output = B>,
) -> (A, B, bool) {
    let late = async {
        let out = late.await;
        (out, std::time::Instant::now())
    };
    let prompt = async {
        tokio::time::sleep(GAP).await;
        let out = prompt.await;
        (out, std::time::Instant::now())
    };
    let ((a, late_at), (b, prompt_at)) = tokio::join!(late, prompt);
    (a, b, late_at > prompt_at)
}

/// A date field of the stored document `id` of `coll` at `path` (dotted, first array
/// element when the path crosses an array).
async fn stored_date(
    db: &Database,
    coll: &str,
    id: &str,
    path: &[&str],
) -> anyhow::Result<DateTime> {
    let d = db
        .collection::<Document>(coll)
        .find_one(doc! { "_id": id })
        .await?
        .context("document")?;
    let mut value = mongodb::bson::Bson::Document(d);
    for key in path {
        value = match value {
            mongodb::bson::Bson::Document(d) => d.get(*key).cloned().context("field")?,
            mongodb::bson::Bson::Array(a) => a.first().cloned().context("element")?,
            other => anyhow::bail!("{other} at {key}"),
        };
        if let mongodb::bson::Bson::Array(a) = &value
            && path.last() != Some(key)
        {
            value = a.first().cloned().context("element")?;
        }
    }
    value.as_datetime().copied().context("a date")
}

#[tokio::test]
async fn a_renewal_that_lands_late_does_not_shorten_the_lease() -> anyhow::Result<()> {
    let test = "a_renewal_that_lands_late_does_not_shorten_the_lease";
    let Some((t, admin, late_client)) = docwarden_testkit::app_faults(test, LATE_APP).await? else {
        return Ok(());
    };
    let db = t.client.database(t.db.name());
    let late_db = late_client.database(t.db.name());
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let late_time = TimeSource::server(late_client.clone(), ClockOptions::default())?;
    // Read both clocks once, so the renewals below send nothing but their write.
    time.now().await?;
    late_time.now().await?;
    let ttl = Duration::from_secs(30);
    let mut violations = Vec::new();
    let mut not_held = Vec::new();

    // A lock collection's lease (the watchdog's renewal, `LockCollection::renew`).
    {
        let locks =
            LockCollection::open(&db, "locks", time.clone(), LockOptions::default()).await?;
        let late = LockCollection::new(
            late_db.collection("locks"),
            late_time.clone(),
            LockOptions::default(),
        )?;
        let owner = Owner::random();
        let lease = locks
            .try_acquire(&owner, "r", ttl)
            .await?
            .context("acquire")?;
        let (mut first, mut second) = (lease.clone(), lease);
        hold_next(&admin, LATE_APP, "update", HOLD).await?;
        let (a, b, held) = race(late.renew(&mut first, ttl), locks.renew(&mut second, ttl)).await;
        fail_commands_off(&admin).await?;
        a?;
        b?;
        let stored = stored_date(&db, "locks", "r", &["expires_at"]).await?;
        if !held {
            not_held.push("lock collection");
        }
        if stored < second.expires_at {
            violations.push(format!(
                "lock collection: stored expiry {stored}, the last renewal's answer {}",
                second.expires_at
            ));
        }
    }

    // A semaphore: one permit of a resource (`updateOne`, positional), then two permits of
    // one resource renewed together (`findAndModify` with a pipeline).
    {
        let options = SemaphoreOptions::default().default_permits(2);
        let sem = Semaphore::open(&db, "permits", time.clone(), options.clone()).await?;
        let late = Semaphore::new(late_db.collection("permits"), late_time.clone(), options)?;
        let owner = Owner::random();
        let permit = sem
            .try_acquire(&owner, "one", ttl)
            .await?
            .context("permit")?;
        let (mut first, mut second) = (permit.clone(), permit);
        hold_next(&admin, LATE_APP, "update", HOLD).await?;
        let (a, b, held) = race(late.renew(&mut first, ttl), sem.renew(&mut second, ttl)).await;
        fail_commands_off(&admin).await?;
        a?;
        b?;
        let stored = stored_date(&db, "permits", "one", &["holders", "until"]).await?;
        if !held {
            not_held.push("semaphore, one permit");
        }
        if stored < second.expires_at {
            violations.push(format!(
                "semaphore, one permit: stored until {stored}, the last renewal's answer {}",
                second.expires_at
            ));
        }

        let p1 = sem
            .try_acquire(&owner, "two", ttl)
            .await?
            .context("permit 1")?;
        let p2 = sem
            .try_acquire(&Owner::random(), "two", ttl)
            .await?
            .context("permit 2")?;
        let mut first = vec![p1.clone(), p2.clone()];
        let mut second = vec![p1, p2];
        hold_next(&admin, LATE_APP, "findAndModify", HOLD).await?;
        let (a, b, held) = race(
            late.renew_many(&mut first, ttl),
            sem.renew_many(&mut second, ttl),
        )
        .await;
        fail_commands_off(&admin).await?;
        let (a, b) = (a?, b?);
        if !held {
            not_held.push("semaphore, two permits");
        }
        if let Some(e) = b.iter().find_map(|r| r.as_ref().err()) {
            violations.push(format!(
                "semaphore, two permits: the prompt renewal failed: {e}"
            ));
        }
        // The late renewal answered after a newer expiry was stored: whatever it reports,
        // it must not have moved the permits back.
        let _ = a;
        let stored = db
            .collection::<Document>("permits")
            .find_one(doc! { "_id": "two" })
            .await?
            .context("permits document")?;
        for h in stored
            .get_array("holders")?
            .iter()
            .filter_map(|h| h.as_document())
        {
            let until = *h.get_datetime("until")?;
            if until < second[0].expires_at {
                violations.push(format!(
                    "semaphore, two permits: stored until {until}, the last renewal's answer {}",
                    second[0].expires_at
                ));
            }
        }
    }

    // A read lease (`RwLocks::renew_read`).
    {
        let rw = RwLocks::open(&db, "rw", time.clone(), RwLockOptions::default()).await?;
        let late = RwLocks::new(
            LockCollection::new(
                late_db.collection("rw"),
                late_time.clone(),
                LockOptions::default(),
            )?,
            RwLockOptions::default(),
        )?;
        let lease = rw
            .try_read(&Owner::random(), "doc", ttl)
            .await?
            .context("read")?;
        let (mut first, mut second) = (lease.clone(), lease);
        hold_next(&admin, LATE_APP, "update", HOLD).await?;
        let (a, b, held) = race(
            late.renew_read(&mut first, ttl),
            rw.renew_read(&mut second, ttl),
        )
        .await;
        fail_commands_off(&admin).await?;
        a?;
        b?;
        let stored = stored_date(&db, "rw", "doc", &["readers", "expires_at"]).await?;
        if !held {
            not_held.push("read lease");
        }
        if stored < second.expires_at {
            violations.push(format!(
                "read lease: stored expiry {stored}, the last renewal's answer {}",
                second.expires_at
            ));
        }
    }

    // A job's lease: `heartbeat` (one fenced `updateOne`) and `heartbeat_many` (a bulk).
    for many in [false, true] {
        let name = if many { "jobs_many" } else { "jobs_one" };
        let q = JobQueue::open(&db, name, time.clone(), QueueOptions::default()).await?;
        let late = JobQueue::new(
            late_db.collection(name),
            late_time.clone(),
            QueueOptions::default(),
        )?;
        q.enqueue(doc! { "n": 1 }, &EnqueueOptions::default())
            .await?;
        let job = q.claim("w").await?.context("claim")?;
        hold_next(&admin, LATE_APP, "update", HOLD).await?;
        let (a, b, held) = if many {
            let (a, b, held) = race(
                late.heartbeat_many(std::slice::from_ref(&job)),
                q.heartbeat_many(std::slice::from_ref(&job)),
            )
            .await;
            (a.map(|_| ()), b.map(|_| ()), held)
        } else {
            let (a, b, held) = race(late.heartbeat(&job), q.heartbeat(&job)).await;
            (a.map(|_| ()), b.map(|_| ()), held)
        };
        fail_commands_off(&admin).await?;
        a?;
        b?;
        // `heartbeat_many` does not return the new expiry: the prompt heartbeat's is at
        // least the claim's plus the gap (less a margin for the clocks' rounding), the
        // late one's only a few milliseconds past the claim's.
        let stored = db
            .collection::<Document>(name)
            .find_one(doc! { "_id": job.id() })
            .await?
            .context("job")?;
        let until = *stored.get_document("lease")?.get_datetime("until")?;
        let prompt_at_least = DateTime::from_millis(
            job.lease.until.timestamp_millis() + i64::try_from(GAP.as_millis())? / 2,
        );
        if !held {
            not_held.push(if many { "heartbeat_many" } else { "heartbeat" });
        }
        if until < prompt_at_least {
            violations.push(format!(
                "{name}: stored lease.until {until}, before the prompt heartbeat's expiry (≥ {prompt_at_least})"
            ));
        }
    }

    assert!(
        not_held.is_empty(),
        "the fail point did not hold the first renewal past the second in: {not_held:?}"
    );
    assert!(violations.is_empty(), "{violations:#?}");
    Ok(())
}
