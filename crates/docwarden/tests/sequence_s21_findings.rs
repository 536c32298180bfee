//! Session 21 findings in the sequenced set: hand-edited documents, against the real server.

#![allow(clippy::unwrap_used)] // a test may panic on a missing document

use docwarden::sequence::{ApplyOutcome, SequencedSet, SetOp, SetOptions};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, Document, doc};

fn options() -> SetOptions {
    SetOptions::default()
        .key_field("student_id")
        .field("classes")
}

/// The outcome of an apply, with a `Malformed` error reduced to its kind (its reason names
/// the server's error, which differs between the operator form and the pipeline).
fn kind(r: &docwarden::Result<ApplyOutcome>) -> String {
    match r {
        Ok(o) => format!("{o:?}"),
        Err(docwarden::Error::Malformed { .. }) => "Malformed".to_owned(),
        Err(e) => format!("{e:?}"),
    }
}

/// The stored document without `_id` and the key, to compare two keys' documents.
async fn stored(set: &SequencedSet, key: i64) -> anyhow::Result<Document> {
    let mut d = set
        .collection()
        .find_one(doc! { "student_id": key })
        .await?
        .unwrap();
    d.remove("_id");
    d.remove("student_id");
    Ok(d)
}

/// An add to a member whose entry is present is sent, by a handle that has seen the entry,
/// as the operator form's `$set` of the entry alone: with the members array hand-edited
/// into a string, a number or a document it was `Applied` (the entry moved on, the array
/// stayed broken), where a handle without the hint sends the pipeline, which the server
/// refuses (`Malformed`). `$push` and `$pull` refused a null members field that the pipeline
/// takes for an empty one. So one operation on one document had two answers, depending on
/// what the handle had seen (and a batch, which sends the operator form, said `Applied`).
/// Now the operator form requires an array, and every form answers as the pipeline does:
/// `Malformed` with nothing written over a scalar, the pipeline's write over null.
#[tokio::test]
async fn an_add_over_a_members_field_that_is_not_an_array_answers_as_without_a_hint()
-> anyhow::Result<()> {
    let t = TestDb::new("seq_s21_members").await?;
    let hinted = SequencedSet::open(&t.db, "students", options()).await?;
    let students = t.db.collection::<Document>("students");
    let edits = [
        Bson::from("CS 101"),
        Bson::from(5),
        Bson::Document(doc! { "CS 101": true }),
        Bson::Null,
    ];
    // Two documents per edit: one written by the hinted handle, one by a fresh handle
    // (no hints: the pipeline) each time.
    let mut wrong = Vec::new();
    for (i, edit) in (0_i64..).zip(edits) {
        let (a, b) = (2 * i, 2 * i + 1);
        for k in [a, b] {
            for m in ["CS 101", "PHYS"] {
                assert_eq!(hinted.add(k, m, 1).await?, ApplyOutcome::Applied);
            }
            assert_eq!(hinted.remove(k, "PHYS", 2).await?, ApplyOutcome::Applied);
            students
                .update_one(
                    doc! { "student_id": k },
                    doc! { "$set": { "classes": edit.clone() } },
                )
                .await?;
        }
        let before = stored(&hinted, a).await?;
        let ops: [(&str, &str, i64, bool); 3] = [
            ("add on a present entry", "CS 101", 3, true),
            ("add on a tombstone", "PHYS", 4, true),
            ("remove", "CS 101", 5, false),
        ];
        for (what, member, seq, present) in ops {
            let fresh = SequencedSet::open(&t.db, "students", options()).await?;
            let (x, y) = if present {
                (
                    hinted.add(a, member, seq).await,
                    fresh.add(b, member, seq).await,
                )
            } else {
                (
                    hinted.remove(a, member, seq).await,
                    fresh.remove(b, member, seq).await,
                )
            };
            if kind(&x) != kind(&y) || stored(&hinted, a).await? != stored(&hinted, b).await? {
                wrong.push(format!(
                    "{edit}: {what}: with the hint {}, without {}",
                    kind(&x),
                    kind(&y)
                ));
            }
            if edit != Bson::Null
                && !matches!(&x, Err(docwarden::Error::Malformed { reason, .. }) if reason.contains("`classes`"))
            {
                wrong.push(format!("{edit}: {what}: {x:?}"));
            }
        }
        if edit != Bson::Null && stored(&hinted, a).await? != before {
            wrong.push(format!("{edit}: written"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    Ok(())
}

/// The pipeline reads the set's bookkeeping through `$ifNull`, and `$set` of a dotted path
/// replaces a scalar on the way: with `_seq_sets` or `_seq_sets.<field>` hand-edited into
/// a scalar (or null, or an array), or the `state` into null or an array, or a member's
/// entry into a scalar, the next apply was `Applied` and wrote fresh bookkeeping over it:
/// every member's history gone, so a stale message below a remove brought the member back.
/// Now the pipeline's filter requires each of them to be missing or a document; such a
/// document matches nothing and the apply is `Malformed` naming the field, nothing written,
/// for a handle with or without hints.
#[tokio::test]
async fn a_sets_bookkeeping_edited_into_a_scalar_is_malformed_not_overwritten() -> anyhow::Result<()>
{
    let t = TestDb::new("seq_s21_bookkeeping").await?;
    let hinted = SequencedSet::open(&t.db, "students", options()).await?;
    let students = t.db.collection::<Document>("students");
    let edits = [
        ("_seq_sets", Bson::from(5)),
        ("_seq_sets", Bson::from("x")),
        ("_seq_sets", Bson::Null),
        (
            "_seq_sets",
            Bson::Array(vec![Bson::Document(doc! { "classes": { "state": {} } })]),
        ),
        ("_seq_sets.classes", Bson::from(5)),
        ("_seq_sets.classes", Bson::Null),
        ("_seq_sets.classes.state", Bson::Null),
        ("_seq_sets.classes.state", Bson::Array(vec![])),
        ("_seq_sets.classes.state.CS 101", Bson::from(5)),
    ];
    let mut wrong = Vec::new();
    for (k, (field, value)) in (1_i64..).zip(edits) {
        assert_eq!(hinted.add(k, "CS 101", 1).await?, ApplyOutcome::Applied);
        assert_eq!(hinted.remove(k, "CS 101", 2).await?, ApplyOutcome::Applied);
        assert_eq!(hinted.add(k, "CS 101", 3).await?, ApplyOutcome::Applied);
        students
            .update_one(
                doc! { "student_id": k },
                doc! { "$set": { field: value.clone() } },
            )
            .await?;
        let before = students.find_one(doc! { "student_id": k }).await?;
        let fresh = SequencedSet::open(&t.db, "students", options()).await?;
        let mut outcomes = vec![
            ("add", hinted.add(k, "CS 101", 4).await),
            ("add without hints", fresh.add(k, "CS 101", 5).await),
            ("remove", hinted.remove(k, "CS 101", 6).await),
            ("stale add", fresh.add(k, "CS 101", 1).await),
        ];
        if field != "_seq_sets.classes.state.CS 101" {
            outcomes.push(("add of a new member", fresh.add(k, "PHYS", 7).await));
        }
        for (what, outcome) in outcomes {
            if !matches!(&outcome, Err(docwarden::Error::Malformed { reason, .. }) if reason.contains(&format!("`{field}`")))
            {
                wrong.push(format!("{field}: {value}: {what}: {outcome:?}"));
            }
        }
        if students.find_one(doc! { "student_id": k }).await? != before {
            wrong.push(format!("{field}: {value}: written"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    // A well-formed set is untouched by the added conditions.
    assert_eq!(hinted.add(100, "CS 101", 1).await?, ApplyOutcome::Applied);
    assert_eq!(hinted.add(100, "CS 101", 1).await?, ApplyOutcome::Duplicate);
    assert_eq!(hinted.remove(100, "CS 101", 0).await?, ApplyOutcome::Stale);
    Ok(())
}

/// `apply_many` sends the operations its handle can predict in one `bulkWrite` and applies
/// the others (and any the bulk did not write) one by one through the single apply. The
/// session 19 docs said its bulk part reported a hand-edited document as a bare `Database`
/// error; it does not: a write the bulk refuses (`$pull` on a string) has no result and is
/// applied alone, which answers `Malformed` as `apply` does. What the batch did get wrong
/// were the two findings above: it answered `Applied` for an add on a present entry over a
/// broken members array (the operator form, now refused), and wrote fresh bookkeeping over
/// a scalar `_seq_sets` (the pipeline, now refused). The batch answers as `apply` does for
/// each of these documents, with the bulk sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_many_reports_a_hand_edited_document_as_apply_does() -> anyhow::Result<()> {
    let t = TestDb::new("seq_s21_batch").await?;
    let (client, log) = docwarden_testkit::counting_client(t.uri()).await?;
    let db = client.database(t.db.name());
    let batch = SequencedSet::open(&db, "students", options()).await?;
    let students = t.db.collection::<Document>("students");
    let edits = [
        ("classes", doc! { "$set": { "classes": "CS 101" } }),
        ("_seq_sets", doc! { "$set": { "_seq_sets": 5 } }),
        (
            "_seq_sets.classes",
            doc! { "$set": { "_seq_sets.classes": Bson::Null } },
        ),
    ];
    let ops: [fn(i64) -> SetOp; 3] = [
        |k| SetOp::add(k, "CS 101", 3),
        |k| SetOp::add(k, "PHYS", 4),
        |k| SetOp::remove(k, "CS 101", 5),
    ];
    let mut wrong = Vec::new();
    let mut k = 0_i64;
    for (field, edit) in edits {
        for op in ops {
            // One document for the batch, one for the single apply; a healthy key next to
            // it, so that the batch has two predicted operations and sends the bulk.
            let (bad, single, healthy) = (k, k + 1, k + 2);
            k += 3;
            for key in [bad, single, healthy] {
                for m in ["CS 101", "PHYS"] {
                    batch.add(key, m, 1).await?;
                }
                batch.remove(key, "PHYS", 2).await?;
            }
            for key in [bad, single] {
                students
                    .update_one(doc! { "student_id": key }, edit.clone())
                    .await?;
            }
            let before = students.find_one(doc! { "student_id": bad }).await?;
            log.take();
            let many = batch
                .apply_many(&[SetOp::add(healthy, "CS 101", 9), op(bad)])
                .await;
            let sent = log.take_counts();
            let op = op(single);
            let fresh = SequencedSet::open(&t.db, "students", options()).await?;
            let one = if op.present {
                fresh.add(single, &op.member, op.seq).await
            } else {
                fresh.remove(single, &op.member, op.seq).await
            };
            let many_kind = match &many {
                Ok(outcomes) => format!("{outcomes:?}"),
                Err(docwarden::Error::Malformed { .. }) => "Malformed".to_owned(),
                Err(e) => format!("{e:?}"),
            };
            if many_kind != kind(&one) || many_kind != "Malformed" {
                wrong.push(format!(
                    "{field}: {op:?}: apply_many {many_kind}, apply {}",
                    kind(&one)
                ));
            }
            if sent.get("bulkWrite") != Some(&1) {
                wrong.push(format!("{field}: {op:?}: no bulk sent: {sent:?}"));
            }
            if students.find_one(doc! { "student_id": bad }).await? != before {
                wrong.push(format!("{field}: {op:?}: written"));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    Ok(())
}
