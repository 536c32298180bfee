//! A lease on a resource, kept alive by a watchdog, and a write fenced by its token.
//!
//! `cargo run -p docwarden --example lock` (against `MONGODB_URI`, or an embedded server).

use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{
    Fence, FenceOptions, FenceOutcome, LockCollection, LockOptions, Owner, WatchdogOptions,
};
use docwarden_server::{Target, connect};
use mongodb::bson::doc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let target = Target::resolve(None, None).await?; // MONGODB_URI, or an embedded server
    let client = connect(&target.uri(), Duration::from_secs(10)).await?;
    let db = client.database("docwarden_example_lock");

    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let locks = LockCollection::open(&db, "locks", time, LockOptions::default()).await?;
    let accounts = Fence::open(&db, "accounts", FenceOptions::default()).await?;
    accounts
        .collection()
        .update_one(
            doc! { "_id": 42 },
            doc! { "$setOnInsert": { "balance": 100 } },
        )
        .upsert(true)
        .await?;

    let me = Owner::random();
    let Some(lease) = locks
        .try_acquire(&me, "account-42", Duration::from_secs(5))
        .await?
    else {
        println!("account-42 is held by someone else");
        return Ok(());
    };
    println!("acquired account-42 with fencing token {}", lease.token);

    // The watchdog renews the lease in the background and says at once if it is lost.
    let watchdog = locks.watch(
        lease.clone(),
        Duration::from_secs(5),
        WatchdogOptions::default(),
    )?;
    let debit = doc! { "$inc": { "balance": -10 } };
    match accounts.apply(&lease, doc! { "_id": 42 }, debit).await? {
        FenceOutcome::Applied => println!("debited 10 under token {}", lease.token),
        other => println!("the storage refused the write: {other:?}"),
    }
    watchdog.release().await?;

    // A holder that lost its lease cannot write: the next holder's token is higher.
    let next = locks
        .try_acquire(&Owner::random(), "account-42", Duration::from_secs(5))
        .await?
        .ok_or_else(|| anyhow::anyhow!("free after the release"))?;
    let _ = accounts
        .apply(&next, doc! { "_id": 42 }, doc! { "$set": {} })
        .await?;
    let late = accounts
        .apply(
            &lease,
            doc! { "_id": 42 },
            doc! { "$inc": { "balance": -10 } },
        )
        .await?;
    println!(
        "the old holder's late write: {late:?} (token {} < {})",
        lease.token, next.token
    );
    locks.release(&next).await?;
    db.drop().await?;
    Ok(())
}
