//! Sequenced handles apply their write-concern option to every write (issue 11, finding
//! 12).

use std::time::Duration;

use docwarden::sequence::{ApplyOutcome, FieldsOptions, SequencedFields, SequencedSet, SetOptions};
use docwarden_testkit::TestDb;
use mongodb::options::{Acknowledgment, WriteConcern};

/// `w: 5` cannot be satisfied by the test server (one member): a write with it must fail.
fn unsatisfiable() -> WriteConcern {
    WriteConcern::builder()
        .w(Acknowledgment::Nodes(5))
        .w_timeout(Duration::from_millis(300))
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_and_fields_write_with_the_write_concern_they_were_given() -> anyhow::Result<()> {
    let t = TestDb::new("sequence_write_concern").await?;
    let majority = SequencedSet::open(
        &t.db,
        "s",
        SetOptions::default().write_concern(WriteConcern::majority()),
    )
    .await?;
    assert_eq!(
        majority.collection().write_concern(),
        Some(&WriteConcern::majority())
    );
    assert_eq!(majority.add(1, "a", 1).await?, ApplyOutcome::Applied);
    let fields = SequencedFields::open(
        &t.db,
        "f",
        FieldsOptions::default().write_concern(WriteConcern::majority()),
    )
    .await?;
    assert_eq!(
        fields.set(1, "name", "Jane", 1).await?,
        ApplyOutcome::Applied
    );
    assert_eq!(
        fields.collection().write_concern(),
        Some(&WriteConcern::majority())
    );

    // The option reaches the server: an unsatisfiable one makes the writes fail.
    let strict = SequencedSet::open(
        &t.db,
        "s",
        SetOptions::default().write_concern(unsatisfiable()),
    )
    .await?;
    let r = strict.add(1, "b", 2).await;
    assert!(r.is_err(), "w: 5 on one member must fail, got {r:?}");
    let r = strict.compact(1, 1).await;
    assert!(r.is_err(), "compaction with w: 5 must fail, got {r:?}");
    let strict_fields = SequencedFields::open(
        &t.db,
        "f",
        FieldsOptions::default().write_concern(unsatisfiable()),
    )
    .await?;
    let r = strict_fields.set(1, "name", "John", 2).await;
    assert!(r.is_err(), "w: 5 on one member must fail, got {r:?}");
    // Without the option the handle inherits the collection's (here: the default).
    let plain = SequencedSet::open(&t.db, "s", SetOptions::default()).await?;
    assert_eq!(plain.collection().write_concern(), None);
    assert!(plain.members(1).await?.is_some());
    Ok(())
}
