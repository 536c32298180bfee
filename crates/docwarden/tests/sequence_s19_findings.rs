//! Session 19 findings in the sequenced set and registers, against the real server.

#![allow(clippy::unwrap_used)] // a test may panic on a missing document

use std::str::FromStr;

use docwarden::sequence::{ApplyOutcome, FieldsOptions, SequencedFields, SequencedSet, SetOptions};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, Decimal128, Document, doc};

/// A sequence number another writer stored as a double (JavaScript's default number type,
/// a hand edit in a shell) or a decimal, equal to an int64: both servers compare it
/// numerically, so the apply's filter "this operation is not in effect yet" did not match a
/// re-delivered message, while the client read the stored number as "not an i64" and took
/// the document for one that changed between two reads. Every re-delivery went round the
/// loop until `Error::Unavailable` (retryable: a consumer that retries it never gets past
/// the message); now it is `Duplicate`, for sets and registers. A decimal that is not a
/// plain integer is `Malformed`, not a loop.
#[tokio::test]
async fn a_sequence_number_stored_as_an_equal_double_is_read_as_that_number() -> anyhow::Result<()>
{
    let t = TestDb::new("seq_s19_double").await?;
    let set = SequencedSet::open(
        &t.db,
        "students",
        SetOptions::default()
            .key_field("student_id")
            .field("classes"),
    )
    .await?;
    let students = t.db.collection::<Document>("students");
    let entry_seq = "_seq_sets.classes.state.CS 101.seq";
    for (k, stored) in [
        (1_i64, Bson::Double(1001.0)),
        (2, Bson::Decimal128(Decimal128::from_str("1001")?)),
    ] {
        assert_eq!(set.add(k, "CS 101", 1001).await?, ApplyOutcome::Applied);
        students
            .update_one(
                doc! { "student_id": k },
                doc! { "$set": { entry_seq: stored.clone() } },
            )
            .await?;
        assert_eq!(
            set.add(k, "CS 101", 1001).await?,
            ApplyOutcome::Duplicate,
            "{stored}"
        );
        let states = set.states(k).await?.unwrap();
        assert_eq!((states[0].seq, states[0].present), (1001, true), "{stored}");
        assert_eq!(set.add(k, "CS 101", 1000).await?, ApplyOutcome::Stale);
        assert_eq!(set.remove(k, "CS 101", 1001).await?, ApplyOutcome::Applied);
        assert_eq!(set.members(k).await?, Some(vec![]));
    }
    // A decimal that is not a plain integer cannot be compared exactly: Malformed.
    assert_eq!(set.add(3, "CS 101", 1001).await?, ApplyOutcome::Applied);
    students
        .update_one(
            doc! { "student_id": 3 },
            doc! { "$set": { entry_seq: Decimal128::from_str("1001.0")? } },
        )
        .await?;
    let odd = set.add(3, "CS 101", 1001).await;
    assert!(
        matches!(odd, Err(docwarden::Error::Malformed { .. })),
        "{odd:?}"
    );
    // A floor is only ordered, never compared for equality: any number will do.
    assert_eq!(set.add(4, "CS 101", 1001).await?, ApplyOutcome::Applied);
    students
        .update_one(
            doc! { "student_id": 4 },
            doc! { "$set": { "_seq_sets.classes.floor": Decimal128::from_str("900.0")? } },
        )
        .await?;
    assert_eq!(set.add(4, "PHYS", 1000).await?, ApplyOutcome::Applied);
    assert_eq!(set.add(4, "MATH", 800).await?, ApplyOutcome::Stale);

    let profiles = SequencedFields::open(&t.db, "profiles", FieldsOptions::default()).await?;
    let address = doc! { "city": "Oslo" };
    assert_eq!(
        profiles.set(1, "address", address.clone(), 17).await?,
        ApplyOutcome::Applied
    );
    t.db.collection::<Document>("profiles")
        .update_one(doc! { "_id": 1 }, doc! { "$set": { "_seq.address": 17.0 } })
        .await?;
    assert_eq!(
        profiles.set(1, "address", address.clone(), 17).await?,
        ApplyOutcome::Duplicate
    );
    assert_eq!(
        profiles.get(1, "address").await?,
        Some((Bson::Document(address), 17))
    );
    Ok(())
}

/// The API block of `docs/sequence.md`, run as written, with the outcomes its comments
/// promise and the stored document its "Document format" section shows.
#[tokio::test]
async fn the_api_block_of_the_sequence_docs_does_what_it_says() -> anyhow::Result<()> {
    use docwarden::sequence::SetOp;
    let t = TestDb::new("seq_s19_docs").await?;
    let db = &t.db;
    let classes = SequencedSet::open(
        db,
        "students",
        SetOptions::default()
            .key_field("student_id")
            .field("classes"),
    )
    .await?;
    assert_eq!(classes.add(1, "CS 101", 1001).await?, ApplyOutcome::Applied);
    assert_eq!(
        classes.remove(1, "CS 101", 1002).await?,
        ApplyOutcome::Applied
    );
    assert_eq!(classes.add(1, "CS 101", 1001).await?, ApplyOutcome::Stale);
    assert_eq!(
        classes.remove(1, "CS 101", 1002).await?,
        ApplyOutcome::Duplicate
    );
    assert_eq!(classes.members(1).await?, Some(vec![]));
    assert_eq!(
        classes.apply_many(&[SetOp::add(1, "CS 101", 1003)]).await?,
        vec![ApplyOutcome::Applied]
    );
    classes.add(1, "a.b$c", 1002).await?;
    classes.add(1, "PHYS 1", 1000).await?;
    classes.remove(1, "PHYS 1", 1003).await?;
    let watermark = 900;
    classes.compact_all(watermark).await?;
    let stored =
        t.db.collection::<Document>("students")
            .find_one(doc! { "student_id": 1 })
            .await?
            .unwrap();
    assert_eq!(
        stored.get_array("classes")?,
        &vec![Bson::from("CS 101"), Bson::from("a.b$c")]
    );
    let set = stored.get_document("_seq_sets")?.get_document("classes")?;
    assert_eq!(
        set.get_document("state")?,
        &doc! {
            "CS 101": { "seq": 1003_i64, "present": true },
            "PHYS 1": { "seq": 1003_i64, "present": false },
            "a%2Eb%24c": { "seq": 1002_i64, "present": true },
        }
    );
    assert_eq!(set.get("floor"), Some(&Bson::Int64(900)));

    let profile = SequencedFields::open(db, "profiles", FieldsOptions::default()).await?;
    assert_eq!(
        profile
            .set(1, "address", doc! { "city": "Oslo" }, 17)
            .await?,
        ApplyOutcome::Applied
    );
    assert_eq!(
        profile.get(1, "address").await?,
        Some((Bson::Document(doc! { "city": "Oslo" }), 17))
    );
    profile.set(1, "name", "Jane", 3).await?;
    let stored =
        t.db.collection::<Document>("profiles")
            .find_one(doc! { "_id": 1 })
            .await?
            .unwrap();
    let keys: Vec<&str> = stored.keys().map(String::as_str).collect();
    assert_eq!(keys, ["_id", "_seq", "_seq_tie", "address", "name"]);
    assert_eq!(
        stored.get_document("_seq")?,
        &doc! { "address": 17_i64, "name": 3_i64 }
    );
    Ok(())
}

/// A set's document hand-edited into a shape the pipeline cannot work on — the members
/// array replaced by a string, the state sub-document by a string — failed every later
/// operation with a bare `Error::Database` (code 2 "Cannot apply $pull to a non-array
/// value" from the operator form, 40081 "$in requires an array", 40390 "$objectToArray
/// requires a document input"), where the docs promise `Malformed` for a hand-edited
/// document (and `members`/`states` already said so). Now the apply answers `Malformed`
/// naming the field; nothing is written. (Since session 21 an add to a member whose entry
/// is present, which changes only the entry, is refused too: it applied over a broken
/// members array.)
#[tokio::test]
async fn a_hand_edited_set_document_is_malformed_not_a_bare_database_error() -> anyhow::Result<()> {
    let t = TestDb::new("seq_s19_malformed").await?;
    let set = SequencedSet::open(
        &t.db,
        "students",
        SetOptions::default()
            .key_field("student_id")
            .field("classes"),
    )
    .await?;
    let students = t.db.collection::<Document>("students");
    let edits = [
        ("classes", doc! { "$set": { "classes": "CS 101" } }),
        (
            "_seq_sets.classes.state",
            doc! { "$set": { "_seq_sets.classes.state": "x" } },
        ),
    ];
    for (k, (field, edit)) in (1_i64..).zip(edits) {
        assert_eq!(set.add(k, "CS 101", 1001).await?, ApplyOutcome::Applied);
        students.update_one(doc! { "student_id": k }, edit).await?;
        let before = students.find_one(doc! { "student_id": k }).await?;
        let outcomes = [
            ("remove", set.remove(k, "CS 101", 1002).await),
            ("add of a new member", set.add(k, "PHYS", 5).await),
            ("add", set.add(k, "CS 101", 1003).await),
        ];
        for (what, outcome) in outcomes {
            assert!(
                matches!(&outcome, Err(docwarden::Error::Malformed { reason, .. }) if reason.contains(field)),
                "{field}: {what}: {outcome:?}"
            );
        }
        assert_eq!(
            students.find_one(doc! { "student_id": k }).await?,
            before,
            "{field}"
        );
    }
    Ok(())
}
