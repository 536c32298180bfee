//! Which names and keys sequenced documents accept, and how they are put into a pipeline.
//!
//! The rule (documented in `docs/sequence.md`):
//! - **Members** of a [`super::SequencedSet`]: any non-empty string of at most
//!   [`crate::validate::MAX_NAME_LEN`] bytes without a NUL byte is accepted: `"$cash"`,
//!   `"a.b@c.d"` and `"CS 101"` are all fine. In the plain members array they are stored
//!   exactly as given (wrapped in `$literal` inside the pipeline, so a member starting with
//!   `$` is never read as a field path). As keys of the per-member state they are
//!   **encoded** with [`member_key`]: `%` → `%25`, `.` → `%2E`, `$` → `%24` (reversible
//!   with [`decode_member_key`]; any other character is kept).
//! - **Field names** (the set's own field, and register fields of
//!   [`super::SequencedFields`]) become document keys and are refused with
//!   [`Error::InvalidInput`] unless they are plain: non-empty, no `.`, no `$` anywhere, no
//!   NUL byte, not `_id`, and not starting with the reserved prefix `_seq`. Field names are
//!   chosen by programmers, not end users, so refusing is safer than an encoding every
//!   reader would have to undo.
//! - **Keys** identify the document: a string (a valid [`crate::validate::name`]), a
//!   32- or 64-bit integer, or an ObjectId. Documents, arrays, null and other types are
//!   refused because an equality filter on them is ambiguous (`{$gt: …}` would be an
//!   operator, an array matches its elements).

use mongodb::bson::{Bson, doc};

use crate::error::{Error, Result};
use crate::validate;

/// The prefix reserved for docwarden's bookkeeping fields.
pub const RESERVED_PREFIX: &str = "_seq";

/// Checks a set member (stored as a value): a valid [`validate::name`].
///
/// # Errors
/// [`Error::InvalidInput`] for an empty member, one over
/// [`validate::MAX_NAME_LEN`] bytes, or one containing NUL.
pub fn member(value: &str) -> Result<()> {
    validate::name("member", value)
}

/// The state key of a member: `%`, `.` and `$` percent-encoded, so the key is never
/// empty, never a path and never an operator.
pub fn member_key(member: &str) -> String {
    let mut out = String::with_capacity(member.len());
    for c in member.chars() {
        match c {
            '%' => out.push_str("%25"),
            '.' => out.push_str("%2E"),
            '$' => out.push_str("%24"),
            c => out.push(c),
        }
    }
    out
}

/// The member a state key ([`member_key`]) stands for, or `None` if the key is not a
/// valid encoding.
pub fn decode_member_key(key: &str) -> Option<String> {
    let mut out = String::with_capacity(key.len());
    let mut rest = key;
    while let Some(i) = rest.find('%') {
        out.push_str(&rest[..i]);
        let code = rest.get(i + 1..i + 3)?;
        out.push(match code {
            "25" => '%',
            "2E" => '.',
            "24" => '$',
            _ => return None,
        });
        rest = &rest[i + 3..];
    }
    if rest.contains(['.', '$']) {
        return None;
    }
    out.push_str(rest);
    Some(out)
}

/// Checks a field name that will become a document key.
///
/// # Errors
/// [`Error::InvalidInput`] naming `what` when the name is empty, too long, contains `.`,
/// `$` or NUL, is `_id`, or starts with [`RESERVED_PREFIX`].
pub fn field(what: &'static str, value: &str) -> Result<()> {
    validate::name(what, value)?;
    if value.contains('.') {
        return Err(Error::invalid(
            what,
            format!("`{value}` contains `.`, which MongoDB reads as a path"),
        ));
    }
    if value.contains('$') {
        return Err(Error::invalid(
            what,
            format!("`{value}` contains `$`, which MongoDB reads as an operator or field path"),
        ));
    }
    if value == "_id" {
        return Err(Error::invalid(what, "`_id` cannot be a sequenced field"));
    }
    if value.starts_with(RESERVED_PREFIX) {
        return Err(Error::invalid(
            what,
            format!("`{value}` starts with the reserved prefix `{RESERVED_PREFIX}`"),
        ));
    }
    Ok(())
}

/// Checks a document key and returns it as BSON.
///
/// # Errors
/// [`Error::InvalidInput`] for a key type other than string, `i32`, `i64` or ObjectId, or
/// an invalid string key.
pub fn key(value: Bson) -> Result<Bson> {
    match &value {
        Bson::String(s) => validate::name("key", s).map(|()| value),
        Bson::Int32(_) | Bson::Int64(_) | Bson::ObjectId(_) => Ok(value),
        other => Err(Error::invalid(
            "key",
            format!(
                "a {:?} key is not accepted; use a string, an integer or an ObjectId",
                other.element_type()
            ),
        )),
    }
}

/// A value as a pipeline constant: `{$literal: value}`, so strings starting with `$` and
/// documents with `$`-keys are never interpreted.
pub(crate) fn literal(value: impl Into<Bson>) -> Bson {
    Bson::Document(doc! { "$literal": value.into() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_stored_as_given() {
        for ok in ["CS 101", "$cash", "a.b@c.d", ".", "$", "é"] {
            assert!(member(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a\0b"] {
            assert!(member(bad).is_err(), "{bad:?}");
        }
        assert!(member(&"x".repeat(validate::MAX_NAME_LEN + 1)).is_err());
    }

    #[test]
    fn member_keys_are_plain_and_reversible() {
        for m in ["CS 101", "$cash", "a.b@c.d", "100%", "%2E", "..$$", "é.ü"] {
            let k = member_key(m);
            assert!(!k.contains('.') && !k.contains('$') && !k.is_empty(), "{k}");
            assert!(field("f", &k).is_ok() || k.starts_with("_seq"), "{k}");
            assert_eq!(decode_member_key(&k).as_deref(), Some(m));
        }
        assert_eq!(member_key("a.b$c%"), "a%2Eb%24c%25");
        assert_eq!(decode_member_key("a%2"), None);
        assert_eq!(decode_member_key("a%41"), None);
        assert_eq!(decode_member_key("a.b"), None);
    }

    proptest::proptest! {
        #[test]
        fn any_member_round_trips(m in "\\PC{1,40}") {
            let k = member_key(&m);
            proptest::prop_assert!(!k.contains('.') && !k.contains('$'));
            proptest::prop_assert_eq!(decode_member_key(&k), Some(m));
        }
    }

    #[test]
    fn field_names_must_be_plain() {
        for ok in ["name", "address", "score_2", "seq", "x_seq"] {
            assert!(field("field", ok).is_ok(), "{ok}");
        }
        for bad in [
            "", "$set", "a.b", "a$b", ".", "_id", "_seq", "_seq_x", "_seqx", "a\0",
        ] {
            assert!(
                matches!(
                    field("field", bad),
                    Err(Error::InvalidInput { what: "field", .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn keys_are_scalars() {
        assert!(key(Bson::Int32(1)).is_ok());
        assert!(key(Bson::Int64(-5)).is_ok());
        assert!(key(Bson::String("$x".into())).is_ok());
        assert!(key(Bson::ObjectId(mongodb::bson::oid::ObjectId::new())).is_ok());
        for bad in [
            Bson::String(String::new()),
            Bson::Null,
            Bson::Document(doc! { "$gt": 1 }),
            Bson::Array(vec![Bson::Int32(1)]),
            Bson::Double(1.5),
        ] {
            assert!(key(bad.clone()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn literals_wrap() {
        assert_eq!(literal("$x"), Bson::Document(doc! { "$literal": "$x" }));
    }
}
