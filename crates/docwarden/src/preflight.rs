//! Checks a handle makes when it is opened: the server is new enough, and the collection
//! compares strings the way docwarden's filters and pipelines assume.
//!
//! **Minimum server:** MongoDB 6.0 (wire version 17). The queue's claim index has a partial
//! filter with `$in`, which MongoDB accepts from 6.0; pipeline updates and `$$NOW` are older.
//! Below it, `open` fails with [`Error::Incompatible`] instead of failing later in an
//! index build or, worse, behaving differently.
//!
//! **Collation:** docwarden compares resource names, owners, tokens, set members and field
//! values byte for byte (MongoDB's *simple* collation). A collection whose default
//! collation is anything else would make `"Job"` and `"job"` one resource, or two different
//! members equal, and the indexes on it (including `_id`) follow that collation. Stating the
//! simple collation per operation would keep the comparisons right but stop those
//! operations from using the collection's indexes, so `open` refuses such a collection with
//! a clear error instead.

use mongodb::bson::{Document, doc};
use mongodb::{Client, Database};

use crate::error::{Error, Result};

/// The oldest MongoDB release docwarden supports.
pub const MIN_SERVER_VERSION: &str = "6.0";

/// The wire version of [`MIN_SERVER_VERSION`] (MongoDB 6.0 speaks wire version 17).
pub const MIN_WIRE_VERSION: i32 = 17;

/// What the server says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerVersion {
    /// `buildInfo.version`, if the server answers `buildInfo`.
    pub version: Option<String>,
    /// `hello.maxWireVersion`.
    pub max_wire_version: i32,
}

impl ServerVersion {
    /// Whether this server is at least [`MIN_SERVER_VERSION`].
    pub fn is_supported(&self) -> bool {
        self.max_wire_version >= MIN_WIRE_VERSION
    }
}

impl std::fmt::Display for ServerVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.version {
            Some(v) => write!(f, "{v} (wire version {})", self.max_wire_version),
            None => write!(f, "wire version {}", self.max_wire_version),
        }
    }
}

/// Asks the server for its version (`hello`, then `buildInfo`).
///
/// # Errors
/// A database error.
pub async fn server_version(client: &Client) -> Result<ServerVersion> {
    let admin = client.database("admin");
    let hello = admin.run_command(doc! { "hello": 1 }).await?;
    let max_wire_version = match hello.get("maxWireVersion") {
        Some(v) => v
            .as_i32()
            .or_else(|| v.as_i64().and_then(|w| i32::try_from(w).ok()))
            .unwrap_or(0),
        None => 0,
    };
    let version = admin
        .run_command(doc! { "buildInfo": 1 })
        .await
        .ok()
        .and_then(|b| b.get_str("version").ok().map(str::to_owned));
    Ok(ServerVersion {
        version,
        max_wire_version,
    })
}

/// Fails unless the server is at least [`MIN_SERVER_VERSION`].
///
/// # Errors
/// [`Error::Incompatible`] naming the server's version and the minimum; a database error.
pub async fn require_min_version(client: &Client) -> Result<ServerVersion> {
    let v = server_version(client).await?;
    if v.is_supported() {
        Ok(v)
    } else {
        Err(Error::Incompatible {
            reason: format!(
                "the server is {v}; docwarden needs MongoDB {MIN_SERVER_VERSION} or newer (wire version {MIN_WIRE_VERSION})"
            ),
        })
    }
}

/// The default collation of `db.name`, if the collection exists and has one.
///
/// # Errors
/// A database error.
pub async fn default_collation(db: &Database, name: &str) -> Result<Option<Document>> {
    let mut specs = db.list_collections().filter(doc! { "name": name }).await?;
    let Some(spec) = futures::TryStreamExt::try_next(&mut specs).await? else {
        return Ok(None);
    };
    Ok(spec
        .options
        .collation
        .map(|c| mongodb::bson::to_document(&c).unwrap_or_else(|_| doc! { "locale": c.locale })))
}

/// Fails if `db.name` exists with a default collation other than the simple one.
///
/// # Errors
/// [`Error::Incompatible`] naming the collation; a database error.
pub async fn require_simple_collation(db: &Database, name: &str) -> Result<()> {
    match default_collation(db, name).await? {
        Some(c) if c.get_str("locale").is_ok_and(|l| l != "simple") => Err(Error::Incompatible {
            reason: format!(
                "collection {}.{name} has the default collation {c}; docwarden compares names, owners and values byte for byte and needs the simple collation (use another collection, or recreate it without a collation)",
                db.name()
            ),
        }),
        _ => Ok(()),
    }
}

/// Both checks, as every `open` runs them on the collection it is given.
///
/// # Errors
/// As [`require_min_version`] and [`require_simple_collation`].
pub async fn check<T: Send + Sync>(collection: &mongodb::Collection<T>) -> Result<()> {
    require_min_version(collection.client()).await?;
    let ns = collection.namespace();
    require_simple_collation(&collection.client().database(&ns.db), &ns.coll).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_below_six_are_refused() {
        let old = ServerVersion {
            version: Some("5.0.26".into()),
            max_wire_version: 13,
        };
        assert!(!old.is_supported());
        assert_eq!(old.to_string(), "5.0.26 (wire version 13)");
        let six = ServerVersion {
            version: None,
            max_wire_version: 17,
        };
        assert!(six.is_supported());
    }
}
