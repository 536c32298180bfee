//! Probe (temporary): cost of claim filter shapes.
use std::time::Instant;
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, DateTime, Document, doc};

#[tokio::test]
async fn probe3() -> anyhow::Result<()> {
    let t = TestDb::new("queue_probe3").await?;
    let time = docwarden::clock::TimeSource::server(t.client.clone(), Default::default())?;
    let q = docwarden::queue::JobQueue::open(&t.db, "jobs", time, Default::default()).await?;
    for _ in 0..10 {
        q.enqueue_many((0..1000).map(|i| (doc! { "i": i }, Default::default()))).await?;
    }
    let coll = t.db.collection::<Document>("jobs");
    let now = DateTime::now();
    let p = |v: Vec<Bson>| Bson::Array(v);
    let shapes: Vec<(&str, Document, bool)> = vec![
        ("eq state+partition", doc! { "state": "ready", "partition": 3_i64 }, false),
        ("eq state+partition sorted", doc! { "state": "ready", "partition": 3_i64 }, true),
        ("state + partition $in [3]", doc! { "state": "ready", "partition": { "$in": p(vec![Bson::Int64(3)]) } }, true),
        ("state + partition $in [3,null]", doc! { "state": "ready", "partition": { "$in": p(vec![Bson::Int64(3), Bson::Null]) } }, true),
        ("$or 2 arms", doc! { "$or": [{ "state": "ready", "partition": { "$in": [3_i64] } }, { "state": "retrying", "partition": { "$in": [3_i64] } }] }, true),
        ("$or 2 arms + run_at", doc! { "$or": [{ "state": "ready", "partition": { "$in": [3_i64] } }, { "state": "retrying", "partition": { "$in": [3_i64] } }], "run_at": { "$lte": now } }, true),
        ("$and[$or, run_at]", doc! { "$and": [{ "$or": [{ "state": "ready", "partition": { "$in": [3_i64] } }, { "state": "retrying", "partition": { "$in": [3_i64] } }] }, { "run_at": { "$lte": now } }] }, true),
        ("collscan", doc! { "nope": 1 }, false),
        ("point", doc! { "_id": 1 }, false),
    ];
    for _round in 0..2 {
        for (name, f, sorted) in &shapes {
            let mut v = Vec::new();
            let mut n = 0;
            for _ in 0..30 {
                let t0 = Instant::now();
                let mut find = coll.find(f.clone()).projection(doc! { "_id": 1 }).limit(64);
                if *sorted { find = find.sort(doc! { "priority": -1, "run_at": 1 }); }
                let r: Vec<Document> = futures::TryStreamExt::try_collect(find.await?).await?;
                n = r.len();
                v.push(t0.elapsed().as_micros());
            }
            v.sort();
            eprintln!("{name}: {n} docs, median {} µs", v[15]);
        }
    }
    Ok(())
}
