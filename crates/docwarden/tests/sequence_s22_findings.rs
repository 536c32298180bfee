//! Session 22 findings in the sequenced set's compaction: hand-edited bookkeeping, against
//! the real server.

#![allow(clippy::unwrap_used)] // a test may panic on a missing document

use docwarden::sequence::{ApplyOutcome, SequencedSet, SetOptions};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, Document, doc};

fn options() -> SetOptions {
    SetOptions::default()
        .key_field("student_id")
        .field("classes")
}

/// The hand edits of the set's bookkeeping compaction reads as documents, each with
/// whether the edited document still has a `state` path (which `compact_all`'s filter
/// needs).
fn edits() -> Vec<(&'static str, Bson, bool)> {
    vec![
        ("_seq_sets", Bson::from(5), false),
        ("_seq_sets", Bson::from("x"), false),
        ("_seq_sets", Bson::Null, false),
        (
            "_seq_sets",
            Bson::Array(vec![Bson::Document(
                doc! { "classes": { "state": { "CS 101": { "seq": 2_i64, "present": false } } } },
            )]),
            true,
        ),
        ("_seq_sets.classes", Bson::from(5), false),
        ("_seq_sets.classes", Bson::Null, false),
        ("_seq_sets.classes.state", Bson::Null, true),
        ("_seq_sets.classes.state", Bson::Array(vec![]), true),
        ("_seq_sets.classes.state", Bson::from("x"), true),
    ]
}

/// A key with a present member and a tombstone below 10, then `field` set to `value`.
async fn edited(
    set: &SequencedSet,
    students: &mongodb::Collection<Document>,
    key: i64,
    edit: Option<(&str, &Bson)>,
) -> anyhow::Result<()> {
    assert_eq!(set.add(key, "CS 101", 1).await?, ApplyOutcome::Applied);
    assert_eq!(set.remove(key, "CS 101", 2).await?, ApplyOutcome::Applied);
    assert_eq!(set.add(key, "PHYS", 3).await?, ApplyOutcome::Applied);
    if let Some((field, value)) = edit {
        students
            .update_one(
                doc! { "student_id": key },
                doc! { "$set": { field: value.clone() } },
            )
            .await?;
    }
    Ok(())
}

/// `compact(key, …)` wrote its dotted `state` and `floor` through a scalar `_seq_sets` or
/// `_seq_sets.classes` and answered `Ok`: the set's history was replaced by a fresh
/// bookkeeping, and a re-delivered add of a member removed before the edit would apply
/// again. Over a `state` that was not a document it failed with a bare database error
/// (`$objectToArray`). Now every such document answers `Malformed` naming the field, and
/// nothing is written. (Fails before session 22's change: seven of the nine edits were
/// written over and `Ok`, two answered a database error.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compacting_a_key_with_bookkeeping_out_of_shape_is_malformed_not_overwritten()
-> anyhow::Result<()> {
    let t = TestDb::new("seq_s22_compact").await?;
    let set = SequencedSet::open(&t.db, "students", options()).await?;
    let students = t.db.collection::<Document>("students");
    let mut wrong = Vec::new();
    for (k, (field, value, _)) in (1_i64..).zip(edits()) {
        edited(&set, &students, k, Some((field, &value))).await?;
        let before = students.find_one(doc! { "student_id": k }).await?;
        let outcome = set.compact(k, 10).await;
        if !matches!(&outcome, Err(docwarden::Error::Malformed { reason, .. }) if reason.contains(&format!("`{field}`")))
        {
            wrong.push(format!("{field}: {value}: {outcome:?}"));
        }
        if students.find_one(doc! { "student_id": k }).await? != before {
            wrong.push(format!("{field}: {value}: written"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");

    // A document in shape is compacted as before: the tombstone below 10 goes, the floor
    // is raised, and a second compaction is a no-op, not an error.
    edited(&set, &students, 100, None).await?;
    let report = set.compact(100, 10).await?;
    assert_eq!((report.matched, report.modified), (1, 1));
    let states = set.states(100).await?.unwrap();
    assert_eq!(states.len(), 1, "{states:?}");
    let again = set.compact(100, 10).await?;
    assert_eq!((again.matched, again.modified), (1, 0));
    Ok(())
}

/// `compact_all` ran one `updateMany` whose pipeline failed on the first `state` that was
/// not a document (`$objectToArray` of an array or a string), so one hand-edited document
/// stopped compaction for the whole collection, every time; a `null` state was replaced by
/// an empty one. Now such documents are left as they are and counted, and the others are
/// compacted. (Fails before session 22's change with a database error.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compact_all_compacts_the_documents_in_shape_and_counts_the_others() -> anyhow::Result<()> {
    let t = TestDb::new("seq_s22_compact_all").await?;
    let set = SequencedSet::open(&t.db, "students", options()).await?;
    let students = t.db.collection::<Document>("students");
    let mut expected_malformed = 0;
    let mut kept = Vec::new();
    for (k, (field, value, has_state)) in (1_i64..).zip(edits()) {
        edited(&set, &students, k, Some((field, &value))).await?;
        expected_malformed += u64::from(has_state);
        kept.push((k, students.find_one(doc! { "student_id": k }).await?));
    }
    for k in 100..105 {
        edited(&set, &students, k, None).await?;
    }
    let report = set.compact_all(10).await?;
    assert_eq!(report.malformed, expected_malformed, "{report:?}");
    assert_eq!(report.modified, 5, "{report:?}");
    for (k, before) in kept {
        assert_eq!(
            students.find_one(doc! { "student_id": k }).await?,
            before,
            "key {k}"
        );
    }
    for k in 100..105 {
        let states = set.states(k).await?.unwrap();
        assert_eq!(states.len(), 1, "key {k}: {states:?}");
    }
    // Nothing left to compact among the documents in shape: no write, and the documents
    // out of shape are counted again.
    let again = set.compact_all(10).await?;
    assert_eq!((again.modified, again.malformed), (0, expected_malformed));
    Ok(())
}

/// An operation the handle's hint says loses is decided by one read of the entry (read
/// concern `majority`) when the stored state confirms it: a stale message is one `find`
/// instead of a pipeline `findAndModify`, and a re-delivery one `find` instead of a
/// `findAndModify` that matches nothing plus a `find`. Nothing is written. (Without the
/// read: `findAndModify` for the stale one, `findAndModify` + `find` for the duplicate.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_the_hint_says_loses_is_decided_by_one_read() -> anyhow::Result<()> {
    let t = TestDb::new("seq_s22_losing_read").await?;
    let (client, log) = docwarden_testkit::counting_client(t.uri()).await?;
    let db = client.database(t.db.name());
    let set = SequencedSet::open(&db, "students", options()).await?;
    let students = t.db.collection::<Document>("students");
    assert_eq!(set.add(1, "CS 101", 5).await?, ApplyOutcome::Applied);
    assert_eq!(set.remove(1, "PHYS", 7).await?, ApplyOutcome::Applied);
    let before = students.find_one(doc! { "student_id": 1 }).await?;
    let cases = [
        ("stale add", "CS 101", 3, true, ApplyOutcome::Stale),
        ("stale remove", "CS 101", 4, false, ApplyOutcome::Stale),
        (
            "re-delivered add",
            "CS 101",
            5,
            true,
            ApplyOutcome::Duplicate,
        ),
        (
            "re-delivered remove",
            "PHYS",
            7,
            false,
            ApplyOutcome::Duplicate,
        ),
        (
            "add losing to a remove at its seq",
            "PHYS",
            7,
            true,
            ApplyOutcome::Stale,
        ),
    ];
    let mut wrong = Vec::new();
    for (what, member, seq, present, expected) in cases {
        log.take();
        let outcome = if present {
            set.add(1, member, seq).await?
        } else {
            set.remove(1, member, seq).await?
        };
        let sent = log.take();
        if outcome != expected || sent != ["find"] {
            wrong.push(format!("{what}: {outcome:?}, sent {sent:?}"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert_eq!(students.find_one(doc! { "student_id": 1 }).await?, before);
    Ok(())
}

/// The read decides only what the stored state confirms; otherwise the pipeline decides
/// as before. With the bookkeeping removed by hand (the documented way to start a set
/// afresh), an operation the hint says is stale applies; below a compaction floor the
/// read answers `Stale`; with the entry edited out of shape the pipeline answers
/// `Malformed`; with the document gone it is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_losing_read_falls_back_to_the_pipeline_unless_the_stored_state_decides()
-> anyhow::Result<()> {
    let t = TestDb::new("seq_s22_losing_fallback").await?;
    let set = SequencedSet::open(&t.db, "students", options()).await?;
    let students = t.db.collection::<Document>("students");

    // Reset by hand: the hint says (5, present) but the bookkeeping is gone.
    assert_eq!(set.add(1, "CS 101", 5).await?, ApplyOutcome::Applied);
    students
        .update_one(
            doc! { "student_id": 1 },
            doc! { "$unset": { "_seq_sets": "", "classes": "" } },
        )
        .await?;
    assert_eq!(set.remove(1, "CS 101", 3).await?, ApplyOutcome::Applied);
    assert_eq!(set.members(1).await?, Some(vec![]));
    assert_eq!(set.add(1, "CS 101", 4).await?, ApplyOutcome::Applied);
    assert_eq!(set.members(1).await?, Some(vec!["CS 101".to_owned()]));

    // Below the floor: the tombstone is compacted away, the hint still says (6, absent).
    assert_eq!(set.add(2, "CS 101", 1).await?, ApplyOutcome::Applied);
    assert_eq!(set.remove(2, "CS 101", 6).await?, ApplyOutcome::Applied);
    set.compact(2, 10).await?;
    assert_eq!(set.add(2, "CS 101", 5).await?, ApplyOutcome::Stale);
    assert_eq!(set.add(2, "CS 101", 9).await?, ApplyOutcome::Stale);
    assert_eq!(set.add(2, "CS 101", 10).await?, ApplyOutcome::Applied);

    // The entry edited into a scalar: not decided by the read; the pipeline refuses it.
    assert_eq!(set.add(3, "CS 101", 5).await?, ApplyOutcome::Applied);
    students
        .update_one(
            doc! { "student_id": 3 },
            doc! { "$set": { "_seq_sets.classes.state.CS 101": 5 } },
        )
        .await?;
    let before = students.find_one(doc! { "student_id": 3 }).await?;
    let outcome = set.add(3, "CS 101", 2).await;
    assert!(
        matches!(&outcome, Err(docwarden::Error::Malformed { .. })),
        "{outcome:?}"
    );
    assert_eq!(students.find_one(doc! { "student_id": 3 }).await?, before);

    // The document deleted: created again, the operation applied.
    assert_eq!(set.add(4, "CS 101", 5).await?, ApplyOutcome::Applied);
    students.delete_one(doc! { "student_id": 4 }).await?;
    assert_eq!(set.add(4, "CS 101", 2).await?, ApplyOutcome::Applied);
    assert_eq!(set.members(4).await?, Some(vec!["CS 101".to_owned()]));
    Ok(())
}
