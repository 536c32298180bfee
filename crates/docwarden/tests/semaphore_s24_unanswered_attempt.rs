//! Session 24: a semaphore acquire attempt that ends without an answer — its reply lost,
//! or its future dropped by a timeout around the call — must not leave a holder entry
//! nobody was told about until its ttl (`lock/landing.rs`, as
//! `tests/lock_s24_unanswered_attempt.rs` for the lock collection). Before, every other
//! contender of a full semaphore waited out the ttl (here 60 s); now the attempt's write
//! appends its holder only before its landing deadline (sent + 2 s), and the entry an
//! unanswered attempt left is pulled once that deadline has passed.
//!
//! Three cases, on a 1-permit semaphore whose token block exists (so the attempt's first
//! `findAndModify` is the write that admits):
//! 1. `try_acquire` whose write applies and whose reply is lost (a retryable write concern
//!    error on the write and on the driver's retry, MongoDB's `failCommand`): the caller
//!    gets an error; another owner's blocking acquire must get the permit within [`BOUND`];
//! 2. `try_acquire` whose future is dropped (a 300 ms `timeout`) while its write is held
//!    at the server (`blockConnection`, 1 s, under the 2 s window) and then applies — the
//!    test checks that the entry did appear: another owner must get the permit within
//!    [`BOUND`];
//! 3. `try_acquire` whose write is held 3.5 s, past its landing deadline: it must admit
//!    nothing, and the attempt answers `Ok(None)` (contention), not a refill and a second
//!    round. (`a_write_after_its_landing_deadline_admits_nothing` in `lock/semaphore.rs`
//!    checks the pipeline itself against the database, without fail points.)
//!
//! Each counts violations. Without the clean-up (never armed), cases 1 and 2 wait out the
//! ttl: 2 violations; without the landing deadline in the pipeline, case 3 admits: 1
//! violation (and the unit test fails). Fail points are server-wide, so this file is its
//! own test binary with one test; without fail points it skips.

use std::time::{Duration, Instant};

use anyhow::Context;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{Owner, Semaphore, SemaphoreOptions};
use docwarden_testkit::{TestDb, fail_commands_off, hold_next, lose_replies};
use mongodb::Client;
use mongodb::bson::{Bson, Document, doc};
use mongodb::options::ClientOptions;

/// How soon another owner must get the permit after the unanswered attempt: the 2 s
/// landing window, the clock's bound and a wake-up, with room for a slow machine; far
/// below the 60 s ttl the entry would otherwise hold it for.
const BOUND: Duration = Duration::from_secs(8);

/// The application name of the client whose acquire writes are held.
const LATE_APP: &str = "late-acquire";

/// Whether `owner` has an entry in the stored holders of `resource`.
async fn holds(
    coll: &mongodb::Collection<Document>,
    resource: &str,
    owner: &Owner,
) -> anyhow::Result<bool> {
    Ok(coll
        .find_one(doc! { "_id": resource, "holders.owner": owner.id() })
        .await?
        .is_some())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_semaphore_attempt_frees_its_permit_soon_after_its_landing_deadline()
-> anyhow::Result<()> {
    let test = "an_unanswered_semaphore_attempt_frees_its_permit_soon_after_its_landing_deadline";
    let t = TestDb::new(test).await?;
    let Some(admin) = docwarden_testkit::fail_point_client(&t, test).await? else {
        return Ok(());
    };
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    time.now().await?;
    let options =
        SemaphoreOptions::default().backoff(Duration::from_millis(5), Duration::from_millis(100));
    let sem = Semaphore::open(&t.db, "permits", time.clone(), options.clone()).await?;
    let coll = t.db.collection::<Document>("permits");
    let mut late_options = ClientOptions::parse(t.uri()).await?;
    late_options.app_name = Some(LATE_APP.to_owned());
    let late_client = Client::with_options(late_options)?;
    let late = Semaphore::new(
        late_client.database(t.db.name()).collection("permits"),
        time.clone(),
        options.clone(),
    )?;
    let ttl = Duration::from_secs(60);
    let mut violations = Vec::new();

    // Each resource gets its document and token block first (a permit taken and given
    // back), so the attempt under test admits in its first write.
    for resource in ["lost", "dropped", "late"] {
        let p = sem
            .try_acquire(&Owner::random(), resource, ttl)
            .await?
            .context("seed")?;
        sem.release(&p).await?;
    }

    // Another owner's blocking acquire of `resource`, started at `since`: a violation
    // unless it gets the permit within BOUND.
    let contend = |case: &'static str, resource: &'static str, since: Instant| {
        let sem = sem.clone();
        let coll = coll.clone();
        async move {
            let other = Owner::random();
            let got = sem
                .acquire(&other, resource, ttl, BOUND + Duration::from_secs(4))
                .await?;
            let waited = since.elapsed();
            let stored = coll.find_one(doc! { "_id": resource }).await?;
            let verdict = match got {
                Some(permit) => {
                    sem.release(&permit).await?;
                    (waited > BOUND).then(|| {
                        format!("{case}: the other owner got the permit only after {waited:?}")
                    })
                }
                None => Some(format!(
                    "{case}: the other owner did not get the permit within {waited:?}: {stored:?}"
                )),
            };
            anyhow::Ok(verdict)
        }
    };

    // 1. A lost reply.
    {
        let lossy = Semaphore::new(
            admin.database(t.db.name()).collection("permits"),
            time.clone(),
            options.clone(),
        )?;
        lose_replies(
            &admin,
            &["findAndModify"],
            Bson::Document(doc! { "times": 2 }),
        )
        .await?;
        let owner = Owner::random();
        let started = Instant::now();
        let answered = lossy.try_acquire(&owner, "lost", ttl).await;
        fail_commands_off(&admin).await?;
        match &answered {
            Err(e) if e.is_retryable() => {
                // The write applied: the entry nobody was told about is there.
                anyhow::ensure!(
                    holds(&coll, "lost", &owner).await?,
                    "lost reply: the write did not apply"
                );
                violations.extend(contend("lost reply", "lost", started).await?);
            }
            other => violations.push(format!("lost reply: the attempt answered {other:?}")),
        }
    }

    // 2. The future dropped while its write is held at the server; the write then applies
    //    (before the landing deadline).
    {
        let owner = Owner::random();
        hold_next(
            &admin,
            LATE_APP,
            "findAndModify",
            Duration::from_millis(1_000),
        )
        .await?;
        let started = Instant::now();
        let answered = tokio::time::timeout(
            Duration::from_millis(300),
            late.try_acquire(&owner, "dropped", ttl),
        )
        .await;
        anyhow::ensure!(
            answered.is_err(),
            "dropped: the attempt answered {answered:?}"
        );
        // Show that the write really applied after the future was dropped.
        let mut applied = false;
        while !applied && started.elapsed() < Duration::from_secs(3) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            applied = holds(&coll, "dropped", &owner).await?;
        }
        fail_commands_off(&admin).await?;
        anyhow::ensure!(applied, "dropped: the held write never applied");
        violations.extend(contend("dropped mid-acquire", "dropped", started).await?);
    }

    // 3. A write that reaches the server after its landing deadline admits nothing, and the
    //    attempt answers as not admitted.
    {
        let owner = Owner::random();
        let hold = Duration::from_millis(3_500);
        hold_next(&admin, LATE_APP, "findAndModify", hold).await?;
        let started = Instant::now();
        let answered = late.try_acquire(&owner, "late", ttl).await;
        let took = started.elapsed();
        fail_commands_off(&admin).await?;
        anyhow::ensure!(took >= hold, "late: the write was not held ({took:?})");
        let stored = coll.find_one(doc! { "_id": "late" }).await?;
        match answered {
            Ok(None) if !holds(&coll, "late", &owner).await? => {}
            Ok(None) => violations.push(format!(
                "late write: answered not admitted but left an entry: {stored:?}"
            )),
            Ok(Some(p)) => violations.push(format!(
                "late write: admitted (token {}) {took:?} after it was sent: {stored:?}",
                p.token.get()
            )),
            Err(e) => violations.push(format!("late write: {e}")),
        }
    }

    assert!(
        violations.is_empty(),
        "{} violations: {violations:#?}",
        violations.len()
    );
    Ok(())
}
