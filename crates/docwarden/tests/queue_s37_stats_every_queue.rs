//! `JobQueue::stats_of_every_queue` (session 37): the counts of every named queue of a
//! collection from one aggregation per count, grouped by queue, instead of
//! `queue_names` (a `distinct` over every job) and one `stats` per queue (about six reads
//! each, most of them over every job). At 1,000,000 jobs on the embedded server the
//! dashboard's first view took 15 s for one queue (`docs/ui.md`, "Counts at scale").
//!
//! The test builds a collection with every case the counts distinguish (states, named
//! queues, a queue known only by its control document, hand-edited jobs, `queue:
//! "default"`, a `queue` that is not a string), then checks that every queue's counts
//! equal its own `stats()`, that the names are `queue_names()`'s, and counts the commands:
//! the same number of reads however many named queues there are.

use std::time::Duration;

use anyhow::Context;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{EnqueueOptions, JobQueue, QueueOptions, QueueStats};
use docwarden_testkit::{TestDb, counting_client};
use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};

/// `stats` with the oldest due job's wait cleared, after checking that both are set or
/// unset and within `slack_ms` (each call reads its own clock).
fn same(a: &QueueStats, b: &QueueStats, slack_ms: i64) -> anyhow::Result<()> {
    match (a.oldest_due_ms, b.oldest_due_ms) {
        (Some(x), Some(y)) => anyhow::ensure!((x - y).abs() <= slack_ms, "{x} vs {y}"),
        (None, None) => {}
        other => anyhow::bail!("oldest due differs: {other:?}"),
    }
    let (mut a, mut b) = (a.clone(), b.clone());
    a.oldest_due_ms = None;
    b.oldest_due_ms = None;
    anyhow::ensure!(a == b, "{a:?}\n!=\n{b:?}");
    Ok(())
}

#[tokio::test]
async fn every_queues_counts_equal_its_own_stats_from_a_fixed_number_of_reads() -> anyhow::Result<()>
{
    let t = TestDb::new("queue_stats_every").await?;
    let (client, log) = counting_client(t.uri()).await?;
    let db = client.database(t.db.name());
    let time = TimeSource::server(client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&db, "jobs", time, QueueOptions::default()).await?;
    let mail = q.named("mail", QueueOptions::default())?;
    let sms = q.named("sms", QueueOptions::default())?;
    for n in 0..5 {
        q.enqueue(doc! { "n": n }, &EnqueueOptions::default())
            .await?;
    }
    for n in 0..3 {
        mail.enqueue(doc! { "n": n }, &EnqueueOptions::default().max_attempts(1))
            .await?;
    }
    // Default queue: one succeeded, two left running (one to expire, one unreadable).
    let done = q.claim("w").await?.context("claim")?;
    q.complete(&done, doc! {}).await?;
    let expired = q.claim("w").await?.context("claim")?;
    let unreadable = q.claim("w").await?.context("claim")?;
    // mail: one dead.
    let failing = mail.claim("w").await?.context("claim")?;
    mail.fail(&failing, "boom").await?;
    // sms: known only by its control document.
    sms.pause("test").await?;

    // Hand edits, after every claim (a claim's sweeps would move them).
    let raw = t.db.collection::<Document>("jobs");
    let past = DateTime::from_millis(DateTime::now().timestamp_millis() - 3_600_000);
    raw.update_one(
        doc! { "_id": expired.id() },
        doc! { "$set": { "lease.until": past } },
    )
    .await?;
    raw.update_one(
        doc! { "_id": unreadable.id() },
        doc! { "$set": { "lease.until": "soon" } },
    )
    .await?;
    let waiting: Vec<ObjectId> = {
        let mut ids = Vec::new();
        let mut c = raw
            .find(doc! { "state": "ready", "queue": Bson::Null })
            .await?;
        while c.advance().await? {
            ids.push(c.deserialize_current()?.get_object_id("_id")?);
        }
        ids
    };
    anyhow::ensure!(waiting.len() == 2, "{waiting:?}");
    raw.update_one(
        doc! { "_id": waiting[0] },
        doc! { "$set": { "run_at": "tomorrow" } },
    )
    .await?;
    raw.update_one(doc! { "_id": waiting[1] }, doc! { "$set": { "limits": 5 } })
        .await?;
    let now = DateTime::now();
    let stray = |queue: Bson| {
        doc! { "_id": ObjectId::new(), "queue": queue, "state": "ready", "priority": 0,
        "run_at": now, "attempts": 0, "max_attempts": 3, "partition": 0,
        "limits": Bson::Null, "created_at": now, "updated_at": now, "payload": {} }
    };
    raw.insert_many([stray(Bson::String("default".into())), stray(Bson::Int32(5))])
        .await?;
    // Let the expired lease pass every skew margin.
    tokio::time::sleep(Duration::from_millis(200)).await;

    log.take();
    let every = q.stats_of_every_queue().await?;
    let commands = log.take();
    let names: Vec<&str> = every.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, q.queue_names().await?, "the names are queue_names'");
    assert_eq!(names, ["default", "mail", "sms"]);
    for (name, stats) in &every {
        let own = q.named(name, QueueOptions::default())?.stats().await?;
        same(stats, &own, 5_000).with_context(|| format!("queue {name}"))?;
    }
    let default = &every[0].1;
    assert_eq!(default.total, 5);
    assert_eq!(default.by_state.get("ready"), Some(&2));
    assert_eq!(default.by_state.get("running"), Some(&2));
    assert_eq!(default.by_state.get("succeeded"), Some(&1));
    assert_eq!(
        (
            default.expired_running,
            default.unreadable_leases,
            default.undatable,
            default.malformed_limits,
            default.misnamed_default,
        ),
        (1, 1, 1, 1, 1)
    );
    // The job with malformed limits is due by its `run_at` (as `stats` always counted it).
    assert!(default.oldest_due_ms.is_some());
    let mail_stats = &every[1].1;
    assert_eq!(mail_stats.total, 3);
    assert_eq!(mail_stats.by_state.get("dead"), Some(&1));
    assert!(mail_stats.oldest_due_ms.is_some());
    assert_eq!(every[2].1, QueueStats::default(), "sms has no job");

    // Reads: one aggregation per count over the collection, and the meta collection's
    // names; none per named queue.
    println!("stats_of_every_queue sent {commands:?}");
    let aggregates = commands.iter().filter(|c| *c == "aggregate").count();
    assert_eq!(aggregates, 6, "{commands:?}");
    assert!(
        !commands.iter().any(|c| c == "distinct" || c == "count"),
        "{commands:?}"
    );
    assert_eq!(commands.len(), 7, "{commands:?}");
    Ok(())
}
