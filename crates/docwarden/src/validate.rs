//! Validation of names, durations and sizes, shared by every handle.
//!
//! Everything a caller passes in is checked here before anything is written, so bad
//! input is always an [`Error::InvalidInput`] and never a half-applied change.

use std::time::Duration;

use crate::error::{Error, Result};

/// The longest resource, owner, queue or key name accepted, in bytes.
pub const MAX_NAME_LEN: usize = 512;

/// The largest BSON document MongoDB stores (16 MiB).
pub const MAX_DOCUMENT_BYTES: usize = 16 * 1024 * 1024;

/// Checks a name (resource, owner, queue, key): non-empty, at most [`MAX_NAME_LEN`] bytes,
/// no NUL byte.
///
/// # Errors
/// [`Error::InvalidInput`] naming `what`.
pub fn name(what: &'static str, value: &str) -> Result<()> {
    if value.is_empty() {
        return Err(Error::invalid(what, "must not be empty"));
    }
    if value.len() > MAX_NAME_LEN {
        return Err(Error::invalid(
            what,
            format!("is {} bytes, the limit is {MAX_NAME_LEN}", value.len()),
        ));
    }
    if value.contains('\0') {
        return Err(Error::invalid(what, "must not contain a NUL byte"));
    }
    Ok(())
}

/// Checks a MongoDB collection name: a valid [`name`], no `$`, not starting with
/// `system.`.
///
/// # Errors
/// [`Error::InvalidInput`] naming `what`.
pub fn collection_name(what: &'static str, value: &str) -> Result<()> {
    name(what, value)?;
    if value.contains('$') || value.starts_with("system.") {
        return Err(Error::invalid(
            what,
            format!("`{value}` is not a usable collection name"),
        ));
    }
    Ok(())
}

/// Checks the name of a queue's jobs collection: a valid [`collection_name`] that does not
/// end in the suffix of a queue's side collection
/// ([`SIDE_COLLECTION_SUFFIXES`](crate::format::job::SIDE_COLLECTION_SUFFIXES): `.meta`,
/// `.schedules`, `.rates`, `.limits`, `.limits.tokens`). Such a name is another queue's
/// side collection (`jobs.meta` holds the options of queue `jobs`), or makes one of its
/// own side collections another queue's jobs collection: two queues would write into one
/// collection. Every other name is accepted, dots included (`app.jobs`).
///
/// # Errors
/// [`Error::InvalidInput`] naming `what` (and the suffix, for a reserved one).
pub fn queue_collection_name(what: &'static str, value: &str) -> Result<()> {
    collection_name(what, value)?;
    let reserved = crate::format::job::SIDE_COLLECTION_SUFFIXES
        .iter()
        .find_map(|suffix| value.strip_suffix(suffix).map(|base| (suffix, base)));
    if let Some((suffix, base)) = reserved {
        return Err(Error::invalid(
            what,
            format!(
                "`{}` ends in `{suffix}`, a suffix queues reserve for their side collections (`{}` is queue `{}`'s): choose another name",
                value.escape_debug(),
                value.escape_debug(),
                base.escape_debug(),
            ),
        ));
    }
    Ok(())
}

/// The characters no MongoDB database name may contain on any platform (MongoDB's
/// "Limits and Thresholds": `/\. "$*<>:|?` on Windows, a superset of the Unix set), and
/// NUL.
const DATABASE_NAME_FORBIDDEN: &[char] = &[
    '/', '\\', '.', ' ', '"', '$', '*', '<', '>', ':', '|', '?', '\0',
];

/// The longest database name MongoDB accepts, in bytes ("fewer than 64 characters").
pub const MAX_DATABASE_NAME_LEN: usize = 63;

/// Checks a MongoDB database name: non-empty, at most [`MAX_DATABASE_NAME_LEN`] bytes, none
/// of the characters a database name may not contain on any platform (`/\. "$*<>:|?`, NUL).
///
/// # Errors
/// [`Error::InvalidInput`] naming `what`.
pub fn database_name(what: &'static str, value: &str) -> Result<()> {
    name(what, value)?;
    if value.len() > MAX_DATABASE_NAME_LEN {
        return Err(Error::invalid(
            what,
            format!(
                "is {} bytes, the limit is {MAX_DATABASE_NAME_LEN}",
                value.len()
            ),
        ));
    }
    if let Some(c) = value.chars().find(|c| DATABASE_NAME_FORBIDDEN.contains(c)) {
        return Err(Error::invalid(
            what,
            format!("`{}` must not contain {c:?}", value.escape_debug()),
        ));
    }
    Ok(())
}

/// Checks a document `_id` the caller names (a guarded update's target, a document lock's
/// id) before it goes into a filter `{_id: id}`: not null, undefined, an array or a
/// regular expression (none can be an `_id`; a regex would *match* ids), not a string
/// [`name`] refuses, and not a document with a `$`-prefixed key, which the server would
/// read as a query operator (`{_id: {$gt: 0}}` matches some other document) and which no
/// `_id` may contain.
///
/// # Errors
/// [`Error::InvalidInput`] naming `what`.
pub fn document_id(what: &'static str, id: &mongodb::bson::Bson) -> Result<()> {
    use mongodb::bson::Bson;
    match id {
        Bson::Null | Bson::Undefined | Bson::Array(_) | Bson::RegularExpression(_) => {
            Err(Error::invalid(
                what,
                format!("a {:?} is not a document id", id.element_type()),
            ))
        }
        Bson::String(s) => name(what, s),
        Bson::Document(d) => match d.keys().find(|k| k.starts_with('$')) {
            Some(k) => Err(Error::invalid(
                what,
                format!(
                    "`{}` is a query operator, not part of a document id",
                    k.escape_debug()
                ),
            )),
            None => Ok(()),
        },
        _ => Ok(()),
    }
}

/// Checks that a duration is positive and fits in BSON milliseconds (`i64`), returning it
/// in milliseconds.
///
/// # Errors
/// [`Error::InvalidInput`] naming `what`.
pub fn duration_ms(what: &'static str, value: Duration) -> Result<i64> {
    if value.is_zero() {
        return Err(Error::invalid(what, "must be greater than zero"));
    }
    let ms = i64::try_from(value.as_millis())
        .map_err(|_| Error::invalid(what, "is too long to store in milliseconds"))?;
    if ms == 0 {
        return Err(Error::invalid(what, "must be at least one millisecond"));
    }
    Ok(ms)
}

/// Checks a ratio such as a renewal fraction: strictly between 0 and 1.
///
/// # Errors
/// [`Error::InvalidInput`] naming `what`.
pub fn fraction(what: &'static str, value: f64) -> Result<f64> {
    if value.is_finite() && value > 0.0 && value < 1.0 {
        Ok(value)
    } else {
        Err(Error::invalid(
            what,
            format!("{value} is not strictly between 0 and 1"),
        ))
    }
}

/// Checks that a count is at least one.
///
/// # Errors
/// [`Error::InvalidInput`] naming `what`.
pub fn positive(what: &'static str, value: usize) -> Result<usize> {
    if value == 0 {
        Err(Error::invalid(what, "must be at least 1"))
    } else {
        Ok(value)
    }
}

/// A random 128-bit identifier rendered as 32 lowercase hex digits: owner ids and claim
/// tokens. Drawn from the operating system's generator, never from a session id.
pub fn random_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(name("resource", "a").is_ok());
        assert!(matches!(
            name("resource", ""),
            Err(Error::InvalidInput {
                what: "resource",
                ..
            })
        ));
        assert!(name("resource", &"x".repeat(MAX_NAME_LEN)).is_ok());
        assert!(name("resource", &"x".repeat(MAX_NAME_LEN + 1)).is_err());
        assert!(name("resource", "a\0b").is_err());
        assert!(collection_name("collection", "locks").is_ok());
        assert!(collection_name("collection", "a$b").is_err());
        assert!(collection_name("collection", "system.x").is_err());
    }

    #[test]
    fn queue_collection_names_refuse_the_side_collection_suffixes() {
        for ok in [
            "jobs",
            "app.jobs",
            "meta",
            "jobs.metadata",
            "jobs.tokens",
            "limits.x",
        ] {
            assert!(
                queue_collection_name("queue", ok).is_ok(),
                "{ok} was refused"
            );
        }
        for suffix in crate::format::job::SIDE_COLLECTION_SUFFIXES {
            match queue_collection_name("queue", &format!("jobs{suffix}")) {
                Err(Error::InvalidInput { what, reason }) => {
                    assert_eq!(what, "queue");
                    assert!(reason.contains(&format!("`{suffix}`")), "{reason}");
                }
                other => panic!("jobs{suffix} accepted: {other:?}"),
            }
        }
        assert!(queue_collection_name("queue", "a$b").is_err());
    }

    #[test]
    fn database_names_are_checked() {
        assert!(database_name("database", "docwarden").is_ok());
        assert!(database_name("database", "app_1-test").is_ok());
        assert!(database_name("database", &"d".repeat(MAX_DATABASE_NAME_LEN)).is_ok());
        assert!(database_name("database", &"d".repeat(MAX_DATABASE_NAME_LEN + 1)).is_err());
        for bad in [
            "", "a.b", ".x", "a b", "a/b", "a\\b", "a$b", "a\"b", "a*b", "a<b", "a>b", "a:b",
            "a|b", "a?b", "a\0b",
        ] {
            assert!(
                matches!(
                    database_name("database", bad),
                    Err(Error::InvalidInput {
                        what: "database",
                        ..
                    })
                ),
                "{bad:?} was accepted"
            );
        }
    }

    /// Session 15: an operator document or a regex as an id matched some *other*
    /// document (a guarded update applied to it, a document lock locked it).
    #[test]
    fn document_ids_are_checked() {
        use mongodb::bson::{Bson, Regex, doc};
        for ok in [
            Bson::Int32(1),
            Bson::String("a".into()),
            Bson::Document(doc! { "tenant": 1, "n": 2 }),
        ] {
            assert!(document_id("target", &ok).is_ok(), "{ok}");
        }
        for bad in [
            Bson::Null,
            Bson::String(String::new()),
            Bson::Array(vec![Bson::Int32(1)]),
            Bson::RegularExpression(Regex {
                pattern: ".*".into(),
                options: String::new(),
            }),
            Bson::Document(doc! { "$gt": 0 }),
            Bson::Document(doc! { "a": 1, "$ne": 0 }),
        ] {
            assert!(
                matches!(
                    document_id("target", &bad),
                    Err(Error::InvalidInput { what: "target", .. })
                ),
                "{bad} was accepted"
            );
        }
    }

    #[test]
    fn durations_are_checked() {
        assert_eq!(duration_ms("ttl", Duration::from_secs(2)).ok(), Some(2000));
        assert!(duration_ms("ttl", Duration::ZERO).is_err());
        assert!(duration_ms("ttl", Duration::from_micros(10)).is_err());
        assert!(duration_ms("ttl", Duration::MAX).is_err());
    }

    #[test]
    fn fractions_and_counts_are_checked() {
        assert!(fraction("f", 0.5).is_ok());
        for bad in [0.0, 1.0, -0.1, f64::NAN, f64::INFINITY] {
            assert!(fraction("f", bad).is_err());
        }
        assert!(positive("n", 0).is_err());
        assert_eq!(positive("n", 3).ok(), Some(3));
    }

    #[test]
    fn random_ids_are_128_bit_hex() {
        let a = random_id();
        let b = random_id();
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
