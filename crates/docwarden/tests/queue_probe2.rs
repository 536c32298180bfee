//! Probe (temporary): cost of fence filter shapes.
use std::time::Instant;
use docwarden_testkit::TestDb;
use mongodb::bson::{Document, doc, oid::ObjectId};

#[tokio::test]
async fn probe2() -> anyhow::Result<()> {
    let t = TestDb::new("queue_probe2").await?;
    let time = docwarden::clock::TimeSource::server(t.client.clone(), Default::default())?;
    let q = docwarden::queue::JobQueue::open(&t.db, "jobs", time, Default::default()).await?;
    for _ in 0..10 {
        q.enqueue_many((0..1000).map(|i| (doc! { "i": i }, Default::default()))).await?;
    }
    let coll = t.db.collection::<Document>("jobs");
    let ids: Vec<ObjectId> = futures::TryStreamExt::try_collect::<Vec<Document>>(coll.find(doc! {}).limit(300).await?).await?.iter().map(|d| d.get_object_id("_id").unwrap()).collect();
    let shapes: Vec<(&str, Box<dyn Fn(ObjectId) -> Document>)> = vec![
        ("_id only", Box::new(|id| doc! { "_id": id })),
        ("_id, state, token", Box::new(|id| doc! { "_id": id, "state": "ready", "lease.token": null })),
        ("_id $eq, state, token", Box::new(|id| doc! { "_id": { "$eq": id }, "state": "ready", "lease.token": null })),
        ("$and [_id] [state token]", Box::new(|id| doc! { "$and": [{ "_id": id }, { "state": "ready", "lease.token": null }] })),
        ("_id, state", Box::new(|id| doc! { "_id": id, "state": "ready" })),
    ];
    for round in 0..2 {
        for (name, f) in &shapes {
            let mut v = Vec::new();
            for id in &ids[..100] {
                let t0 = Instant::now();
                coll.update_one(f(*id), doc! { "$set": { "z": round } }).await?;
                v.push(t0.elapsed().as_micros());
            }
            v.sort();
            eprintln!("{name}: median {} µs", v[50]);
        }
    }
    Ok(())
}
