//! Session 22: the sequenced set's losing-operation read on a server that refuses read
//! concern `majority`. Its own binary: the `failCommand` fail point is server-wide.

use docwarden::sequence::{ApplyOutcome, SequencedSet, SetOptions};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, doc};

/// A server that answers majority reads with `ReadConcernMajorityNotEnabled` (148) gets
/// the losing operation decided by the pipeline update, the same outcome, and the handle
/// stops sending the read. (Without the fallback the apply failed with the read's error.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_majority_reads_leaves_the_losing_operation_to_the_pipeline()
-> anyhow::Result<()> {
    let test = "a_server_without_majority_reads_leaves_the_losing_operation_to_the_pipeline";
    let t = TestDb::new("seq_s22_no_majority").await?;
    if docwarden_testkit::fail_point_client(&t, test)
        .await?
        .is_none()
    {
        return Ok(());
    }
    let (client, log) = docwarden_testkit::counting_client(t.uri()).await?;
    let set = SequencedSet::open(
        &client.database(t.db.name()),
        "students",
        SetOptions::default()
            .key_field("student_id")
            .field("classes"),
    )
    .await?;
    assert_eq!(set.add(1, "CS 101", 5).await?, ApplyOutcome::Applied);
    docwarden_testkit::fail_commands(&t.client, &["find"], 148, Bson::from(doc! { "times": 1 }))
        .await?;
    log.take();
    let refused = set.add(1, "CS 101", 3).await;
    let sent_refused = log.take();
    let again = set.add(1, "CS 101", 2).await;
    let sent_again = log.take();
    docwarden_testkit::fail_commands_off(&t.client).await?;
    assert_eq!(refused?, ApplyOutcome::Stale);
    assert_eq!(sent_refused, ["find", "findAndModify"]);
    assert_eq!(again?, ApplyOutcome::Stale);
    assert_eq!(sent_again, ["findAndModify"]);
    Ok(())
}
