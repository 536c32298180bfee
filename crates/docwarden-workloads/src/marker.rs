//! Marker writes: how a holder reads the server's order ([`docwarden::check::order`]).
//!
//! A marker is one `update` of the process's own document in [`COLLECTION`] (an upserted
//! counter, so the collection stays one document per process); its reply's
//! `operationTime` is the [`Stamp`]. It is sent as a plain command, not retried: a marker
//! whose reply is lost gives no stamp, and the holder then records no stretch.

use docwarden::check::order::Stamp;
use mongodb::Database;
use mongodb::bson::{Bson, doc};

/// The collection of the marker documents (one per process).
pub const COLLECTION: &str = "verify_markers";

/// Marker writes into one database.
#[derive(Clone, Debug)]
pub struct Markers {
    db: Database,
}

impl Markers {
    /// Markers into `db` (the workload's database).
    pub fn new(db: &Database) -> Self {
        Self { db: db.clone() }
    }

    /// One marker write for `process`; its stamp in the server's order.
    ///
    /// # Errors
    /// A database error, a write error, or a reply without `operationTime` (a standalone
    /// server: no cluster time to order by).
    pub async fn stamp(&self, process: u32) -> anyhow::Result<Stamp> {
        let reply = self
            .db
            .run_command(doc! {
                "update": COLLECTION,
                "updates": [{
                    "q": { "_id": i64::from(process) },
                    "u": { "$inc": { "n": 1_i64 } },
                    "upsert": true,
                }],
            })
            .await?;
        if let Ok(errors) = reply.get_array("writeErrors") {
            anyhow::bail!("marker write refused: {errors:?}");
        }
        match reply.get("operationTime") {
            Some(Bson::Timestamp(ts)) => Ok(Stamp::of(*ts)),
            _ => anyhow::bail!(
                "the server sent no operationTime (a standalone?): no order to record in"
            ),
        }
    }
}
