//! Probe (temporary): per-step timings of a batch claim at a 10,000-job backlog.

use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::{EnqueueOptions, JobQueue, QueueOptions};
use docwarden_testkit::TestDb;
use mongodb::bson::{Document, doc};

#[tokio::test]
async fn probe() -> anyhow::Result<()> {
    let t = TestDb::new("queue_probe").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time, QueueOptions::default().reap_interval(Duration::from_secs(3600))).await?;
    for _ in 0..10 {
        q.enqueue_many((0..1000).map(|i| (doc! { "i": i }, EnqueueOptions::default()))).await?;
    }
    let coll = t.db.collection::<Document>("jobs");
    for f in [
        doc! { "$or": [{ "partition": 3_i64, "state": "ready" }, { "partition": 3_i64, "state": "retrying" }, { "partition": null, "state": "ready" }, { "partition": null, "state": "retrying" }], "run_at": { "$lte": mongodb::bson::DateTime::now() } },
        doc! { "$or": [{ "partition": 3_i64, "state": "ready" }, { "partition": 3_i64, "state": "retrying" }], "run_at": { "$lte": mongodb::bson::DateTime::now() } },
        doc! { "$or": [{ "partition": 3_i64, "state": "ready" }, { "partition": 3_i64, "state": "retrying" }] },
        doc! { "partition": 3_i64, "state": "ready" },
    ] {
        let t0 = Instant::now();
        let n = coll.find(f.clone()).sort(doc! { "priority": -1, "run_at": 1 }).limit(64).await?;
        let v: Vec<Document> = futures::TryStreamExt::try_collect(n).await?;
        let el = t0.elapsed();
        let ex = t.db.run_command(doc! { "explain": { "find": "jobs", "filter": f.clone(), "sort": { "priority": -1, "run_at": 1 }, "limit": 64 } }).await?;
        eprintln!("{} docs in {el:?}: {f}\n  plan {:?}", v.len(), ex.get_document("queryPlanner").and_then(|p| p.get_document("winningPlan")).map(|w| w.to_string()));
    }
    for i in 0..6_i64 {
        let ps: Vec<mongodb::bson::Bson> = (0..(1_i64 << i)).map(mongodb::bson::Bson::Int64).chain(std::iter::once(mongodb::bson::Bson::Null)).collect();
        let f = doc! { "$or": [{ "state": "ready", "partition": { "$in": ps.clone() } }, { "state": "retrying", "partition": { "$in": ps } }], "run_at": { "$lte": mongodb::bson::DateTime::now() } };
        let t0 = Instant::now();
        let n = coll.find(f.clone()).sort(doc! { "priority": -1, "run_at": 1 }).projection(doc! {"_id": 1}).limit(64).await?;
        let v: Vec<Document> = futures::TryStreamExt::try_collect(n).await?;
        let a = t0.elapsed();
        let t0 = Instant::now();
        let _ = coll.find_one(doc! { "_id": 1 }).await?;
        let b = t0.elapsed();
        let t0 = Instant::now();
        let n = coll.find(doc! { "nope": 1 }).await?;
        let _v: Vec<Document> = futures::TryStreamExt::try_collect(n).await?;
        eprintln!("partition find (span {}) {} in {a:?}; point find {b:?}; collscan {:?}", 1 << i, v.len(), t0.elapsed());
    }
    for k in [64, 64, 64] {
        let t0 = Instant::now();
        let b = q.claim_batch("w", k).await?;
        let el = t0.elapsed();
        let t1 = Instant::now();
        let items: Vec<_> = b.iter().map(|j| j.clone()).collect();
        let hb = q.heartbeat_many(&items).await?;
        eprintln!("claim_batch {} in {el:?}; heartbeat_many {} in {:?}", b.len(), hb.len(), t1.elapsed());
        let t1 = Instant::now();
        for j in &b { q.complete(j, mongodb::bson::Bson::Null).await?; }
        eprintln!("  {} single completions in {:?}", b.len(), t1.elapsed());
    }
    let now = mongodb::bson::DateTime::now();
    for (what, f) in [
        ("expired", doc! { "state": "running", "lease.until": { "$lt": now } }),
        ("unreadable", doc! { "state": "running", "lease.until": { "$not": { "$type": "date" } }, "$or": [{ "updated_at": { "$lt": now } }, { "updated_at": { "$not": { "$type": "date" } } }] }),
        ("unreadable without $or", doc! { "state": "running", "lease.until": { "$not": { "$type": "date" } } }),
        ("undatable", doc! { "state": { "$in": ["ready", "retrying"] }, "run_at": { "$not": { "$type": "date" } } }),
        ("nothing (collscan)", doc! { "nope": 1 }),
        ("point", doc! { "_id": 1 }),
        ("fence", doc! { "_id": 1, "state": "running", "lease.token": "x" }),
    ] {
        let t0 = Instant::now();
        let r = coll.update_many(f, doc! { "$set": { "zz": 1 } }).await?;
        eprintln!("updateMany {what}: {} in {:?}", r.matched_count, t0.elapsed());
        let t0 = Instant::now();
        let r = coll.update_one(doc! { "_id": 1 }, doc! { "$set": { "zz": 1 } }).await?;
        eprintln!("  then point update {} in {:?}", r.matched_count, t0.elapsed());
    }
    let t0 = Instant::now();
    let n = q.reap_expired().await?;
    eprintln!("reap_expired {n} in {:?}", t0.elapsed());
    Ok(())
}
