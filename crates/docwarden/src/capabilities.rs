//! Runtime detection of what the connected server supports.
//!
//! docwarden keeps MongoDB's documented behaviour and asks the server, at runtime, whether
//! it provides a feature (for example change streams for queue wake-ups) instead of
//! assuming it. Each probe runs in a scratch database that is dropped afterwards.

use std::time::Duration;

use futures::StreamExt;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::error::ErrorKind;
use mongodb::options::IndexOptions;
use mongodb::{Client, Collection, Database, IndexModel};

use crate::error::{Result, error_code};

/// Whether one capability is there.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "status", content = "detail", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Support {
    /// It works as MongoDB documents it.
    Supported,
    /// The server refused it or behaved differently; the text says how.
    NotSupported(String),
    /// The probe could not tell (network error, timeout).
    Error(String),
}

impl Support {
    /// Whether the capability is supported.
    pub fn is_supported(&self) -> bool {
        matches!(self, Support::Supported)
    }
}

impl std::fmt::Display for Support {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Support::Supported => f.write_str("supported"),
            Support::NotSupported(why) => write!(f, "not supported ({why})"),
            Support::Error(why) => write!(f, "error ({why})"),
        }
    }
}

/// The capabilities docwarden relies on, in the order `docwarden doctor` prints them.
#[derive(Clone, Debug, serde::Serialize)]
#[non_exhaustive]
pub struct Capabilities {
    /// Update with an aggregation pipeline (`$set` with expressions, `$cond`).
    pub pipeline_updates: Support,
    /// `$$NOW` inside a query's `$expr`.
    pub now_in_query_expr: Support,
    /// Unique indexes reject duplicates with code 11000.
    pub unique_indexes: Support,
    /// Partial indexes: a unique partial index ignores documents outside the filter.
    pub partial_indexes: Support,
    /// An update that moves a document out of a unique partial index's filter frees its
    /// key (MongoDB does; the queue's dedupe keys rely on it).
    pub partial_index_updates: Support,
    /// TTL indexes are accepted (deletion timing is not probed: MongoDB's runs every 60 s).
    pub ttl_indexes: Support,
    /// Change streams deliver an insert.
    pub change_streams: Support,
    /// Multi-document transactions commit.
    pub transactions: Support,
    /// `collMod` validators refuse invalid writes with code 121.
    pub validators: Support,
    /// `updateOne` honours a `sort` (MongoDB 8.0).
    pub update_one_sort: Support,
    /// `findOneAndUpdate` returns the updated document.
    pub find_one_and_update: Support,
}

impl Capabilities {
    /// `(name, support)` pairs in display order.
    pub fn rows(&self) -> Vec<(&'static str, &Support)> {
        vec![
            ("pipeline updates", &self.pipeline_updates),
            ("$$NOW in query $expr", &self.now_in_query_expr),
            ("unique indexes", &self.unique_indexes),
            ("partial indexes", &self.partial_indexes),
            ("partial index updates", &self.partial_index_updates),
            ("TTL indexes", &self.ttl_indexes),
            ("change streams", &self.change_streams),
            ("transactions", &self.transactions),
            ("collMod validators", &self.validators),
            ("updateOne with sort", &self.update_one_sort),
            ("findOneAndUpdate", &self.find_one_and_update),
        ]
    }
}

/// Probes every capability in a scratch database (dropped afterwards).
///
/// # Errors
/// Only if the scratch database cannot be dropped; each probe's own failure is reported
/// in its [`Support`].
pub async fn probe(client: &Client) -> Result<Capabilities> {
    let db = client.database(&format!("docwarden_probe_{:08x}", rand::random::<u32>()));
    let caps = Capabilities {
        pipeline_updates: run(pipeline_updates(&db)).await,
        now_in_query_expr: run(now_in_query_expr(&db)).await,
        unique_indexes: run(unique_indexes(&db)).await,
        partial_indexes: run(partial_indexes(&db)).await,
        partial_index_updates: run(partial_index_updates(&db)).await,
        ttl_indexes: run(ttl_indexes(&db)).await,
        change_streams: run(change_streams(&db)).await,
        transactions: run(transactions(client, &db)).await,
        validators: run(validators(&db)).await,
        update_one_sort: run(update_one_sort(&db)).await,
        find_one_and_update: run(find_one_and_update(&db)).await,
    };
    db.drop().await?;
    Ok(caps)
}

/// Probes only whether updates move documents out of a unique partial index (what the
/// queue's dedupe keys need), in a scratch database.
///
/// # Errors
/// Only if the scratch database cannot be dropped.
pub async fn probe_partial_index_updates(client: &Client) -> Result<Support> {
    let db = client.database(&format!("docwarden_probe_{:08x}", rand::random::<u32>()));
    let support = run(partial_index_updates(&db)).await;
    db.drop().await?;
    Ok(support)
}

/// Probes only change streams (what the queue's wake-up needs), in a scratch database.
///
/// # Errors
/// Only if the scratch database cannot be dropped.
pub async fn probe_change_streams(client: &Client) -> Result<Support> {
    let db = client.database(&format!("docwarden_probe_{:08x}", rand::random::<u32>()));
    let support = run(change_streams(&db)).await;
    db.drop().await?;
    Ok(support)
}

type Probe = std::result::Result<Support, mongodb::error::Error>;

async fn run(probe: impl Future<Output = Probe>) -> Support {
    match tokio::time::timeout(Duration::from_secs(10), probe).await {
        Err(_) => Support::Error("timed out after 10 s".into()),
        Ok(Ok(s)) => s,
        Ok(Err(e)) => classify(&e),
    }
}

/// A server's refusal is "not supported"; anything else is an error of the probe.
fn classify(e: &mongodb::error::Error) -> Support {
    let text = e.to_string();
    let line = text.lines().next().unwrap_or(&text).to_owned();
    match &*e.kind {
        ErrorKind::Command(_) | ErrorKind::Write(_) => Support::NotSupported(line),
        _ if error_code(e).is_some() => Support::NotSupported(line),
        _ => Support::Error(line),
    }
}

fn coll(db: &Database, name: &str) -> Collection<Document> {
    db.collection(name)
}

async fn pipeline_updates(db: &Database) -> Probe {
    let c = coll(db, "pipeline");
    c.insert_one(doc! { "_id": 1, "a": 1 }).await?;
    c.update_one(
        doc! { "_id": 1 },
        vec![
            doc! { "$set": { "b": { "$cond": [{ "$eq": ["$a", 1] }, { "$add": ["$a", 1] }, 0] } } },
        ],
    )
    .await?;
    let d = c.find_one(doc! { "_id": 1 }).await?;
    Ok(match d.and_then(|d| d.get("b").cloned()) {
        Some(Bson::Int32(2) | Bson::Int64(2)) => Support::Supported,
        other => Support::NotSupported(format!("expected b = 2, read {other:?}")),
    })
}

async fn now_in_query_expr(db: &Database) -> Probe {
    let c = coll(db, "now");
    c.insert_one(doc! { "_id": 1, "t": DateTime::from_millis(946_684_800_000) })
        .await?;
    let found = c
        .find_one(doc! { "$expr": { "$lt": ["$t", "$$NOW"] } })
        .await?;
    Ok(if found.is_some() {
        Support::Supported
    } else {
        Support::NotSupported("a document from 2000 was not before $$NOW".into())
    })
}

async fn expect_duplicate(c: &Collection<Document>, d: Document) -> Probe {
    Ok(match c.insert_one(d).await {
        Err(e) if crate::error::is_duplicate_key(&e) => Support::Supported,
        Err(e) => return Err(e),
        Ok(_) => Support::NotSupported("a duplicate key was accepted".into()),
    })
}

async fn unique_indexes(db: &Database) -> Probe {
    let c = coll(db, "unique");
    c.create_index(
        IndexModel::builder()
            .keys(doc! { "k": 1 })
            .options(IndexOptions::builder().unique(true).build())
            .build(),
    )
    .await?;
    c.insert_one(doc! { "k": 1 }).await?;
    expect_duplicate(&c, doc! { "k": 1 }).await
}

async fn partial_indexes(db: &Database) -> Probe {
    let c = unique_partial(db, "partial").await?;
    c.insert_one(doc! { "k": 1, "open": true }).await?;
    if let Err(e) = c.insert_one(doc! { "k": 1, "open": false }).await {
        return Ok(Support::NotSupported(format!(
            "a document outside the partial filter was refused: {e}"
        )));
    }
    expect_duplicate(&c, doc! { "k": 1, "open": true }).await
}

/// A unique index on `k`, partial on `open: true`.
async fn unique_partial(db: &Database, name: &str) -> mongodb::error::Result<Collection<Document>> {
    let c = coll(db, name);
    c.create_index(
        IndexModel::builder()
            .keys(doc! { "k": 1 })
            .options(
                IndexOptions::builder()
                    .unique(true)
                    .partial_filter_expression(doc! { "open": true })
                    .build(),
            )
            .build(),
    )
    .await?;
    Ok(c)
}

async fn partial_index_updates(db: &Database) -> Probe {
    let c = unique_partial(db, "partial_updates").await?;
    c.insert_one(doc! { "k": 1, "open": true }).await?;
    c.update_one(doc! { "k": 1 }, doc! { "$set": { "open": false } })
        .await?;
    Ok(match c.insert_one(doc! { "k": 1, "open": true }).await {
        Ok(_) => Support::Supported,
        Err(e) if crate::error::is_duplicate_key(&e) => Support::NotSupported(
            "the key stays in the index after the document leaves the filter".into(),
        ),
        Err(e) => return Err(e),
    })
}

async fn ttl_indexes(db: &Database) -> Probe {
    let c = coll(db, "ttl");
    c.create_index(
        IndexModel::builder()
            .keys(doc! { "t": 1 })
            .options(
                IndexOptions::builder()
                    .expire_after(Duration::from_secs(60))
                    .build(),
            )
            .build(),
    )
    .await?;
    let mut cursor = c.list_indexes().await?;
    while let Some(ix) = cursor.next().await {
        let ix = ix?;
        if ix.options.and_then(|o| o.expire_after).is_some() {
            return Ok(Support::Supported);
        }
    }
    Ok(Support::NotSupported(
        "index listed without expireAfterSeconds".into(),
    ))
}

async fn change_streams(db: &Database) -> Probe {
    let c = coll(db, "stream");
    c.insert_one(doc! { "_id": 0 }).await?;
    let mut stream = c.watch().await?;
    c.insert_one(doc! { "_id": 1 }).await?;
    match tokio::time::timeout(Duration::from_secs(5), stream.next()).await {
        Ok(Some(Ok(_))) => Ok(Support::Supported),
        Ok(Some(Err(e))) => Err(e),
        Ok(None) => Ok(Support::NotSupported("the stream ended".into())),
        Err(_) => Ok(Support::NotSupported("no event within 5 s".into())),
    }
}

async fn transactions(client: &Client, db: &Database) -> Probe {
    let c = coll(db, "txn");
    c.insert_one(doc! { "_id": 0 }).await?;
    let mut session = client.start_session().await?;
    session.start_transaction().await?;
    c.insert_one(doc! { "_id": 1 })
        .session(&mut session)
        .await?;
    session.commit_transaction().await?;
    Ok(if c.find_one(doc! { "_id": 1 }).await?.is_some() {
        Support::Supported
    } else {
        Support::NotSupported("the committed insert is missing".into())
    })
}

async fn validators(db: &Database) -> Probe {
    let c = coll(db, "validated");
    c.insert_one(doc! { "a": 1 }).await?;
    db.run_command(doc! {
        "collMod": "validated",
        "validator": { "$expr": { "$gte": ["$a", 0] } },
        "validationLevel": "strict",
        "validationAction": "error",
    })
    .await?;
    Ok(match c.insert_one(doc! { "a": -1 }).await {
        Err(e) if error_code(&e) == Some(121) => Support::Supported,
        Err(e) => Support::NotSupported(format!("refused with another error: {e}")),
        Ok(_) => Support::NotSupported("an invalid document was accepted".into()),
    })
}

async fn update_one_sort(db: &Database) -> Probe {
    let c = coll(db, "sort");
    c.insert_many([
        doc! { "_id": 1, "p": 1 },
        doc! { "_id": 2, "p": 9 },
        doc! { "_id": 3, "p": 5 },
    ])
    .await?;
    c.update_one(doc! {}, doc! { "$set": { "hit": true } })
        .sort(doc! { "p": -1 })
        .await?;
    let hit = c.find_one(doc! { "hit": true }).await?;
    Ok(match hit.and_then(|d| d.get("_id").cloned()) {
        Some(Bson::Int32(2)) => Support::Supported,
        other => Support::NotSupported(format!("sort ignored: updated _id {other:?}")),
    })
}

async fn find_one_and_update(db: &Database) -> Probe {
    let c = coll(db, "fam");
    c.insert_one(doc! { "_id": 1, "n": 0 }).await?;
    let after = c
        .find_one_and_update(doc! { "_id": 1 }, doc! { "$inc": { "n": 1 } })
        .return_document(mongodb::options::ReturnDocument::After)
        .await?;
    Ok(match after.and_then(|d| d.get("n").cloned()) {
        Some(Bson::Int32(1) | Bson::Int64(1)) => Support::Supported,
        other => Support::NotSupported(format!("returned n = {other:?}")),
    })
}
