//! `JobQueue::list` by key and by error text (issue 17): the key matches a dedupe key, a
//! uniqueness window's key, a concurrency key or a rate key, exactly and only in the
//! handle's named queue; the error text is a case-insensitive literal (regular-expression
//! characters in it match themselves). Also `JobQueue::queue_names`.

use std::time::Duration;

use anyhow::Context;
use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::queue::format::field;
use docwarden::queue::{EnqueueOptions, JobListFilter, JobQueue, JobState, QueueOptions};
use docwarden_testkit::TestDb;
use mongodb::bson::{doc, oid::ObjectId};

async fn enqueue(q: &JobQueue, n: i64, opts: EnqueueOptions) -> anyhow::Result<ObjectId> {
    q.enqueue(doc! { "n": n }, &opts)
        .await?
        .created()
        .with_context(|| format!("job {n} not created"))
}

async fn ids(q: &JobQueue, f: &JobListFilter) -> anyhow::Result<Vec<ObjectId>> {
    let mut out: Vec<ObjectId> = q
        .list(f)
        .await?
        .iter()
        .map(|d| d.get_object_id(field::ID))
        .collect::<Result<_, _>>()?;
    out.sort();
    Ok(out)
}

fn sorted(mut v: Vec<ObjectId>) -> Vec<ObjectId> {
    v.sort();
    v
}

#[tokio::test]
async fn list_filters_by_key_and_by_error_text() -> anyhow::Result<()> {
    let t = TestDb::new("queue_list_filter").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time.clone(), QueueOptions::default()).await?;
    let other = JobQueue::open(&t.db, "jobs", time, QueueOptions::default().queue("mail")).await?;

    let dedupe = enqueue(&q, 1, EnqueueOptions::default().dedupe_key("order-1")).await?;
    let windowed = enqueue(
        &q,
        2,
        EnqueueOptions::default()
            .dedupe_key("order-1")
            .unique_window(Duration::from_secs(3600)),
    )
    .await?;
    let concurrency = enqueue(&q, 3, EnqueueOptions::default().concurrency_key("order-1")).await?;
    let rate = enqueue(&q, 4, EnqueueOptions::default().rate_key("tenant-b")).await?;
    // A key that only starts like the one asked for, and a key with regex characters.
    let longer = enqueue(&q, 5, EnqueueOptions::default().dedupe_key("order-10")).await?;
    let dotted = enqueue(&q, 6, EnqueueOptions::default().dedupe_key("a.c")).await?;
    let plain = enqueue(&q, 7, EnqueueOptions::default().dedupe_key("abc")).await?;
    // The same key in another named queue of the collection (a concurrency key: dedupe
    // keys are unique over the whole collection).
    let elsewhere = enqueue(
        &other,
        8,
        EnqueueOptions::default().concurrency_key("order-1"),
    )
    .await?;

    let all = JobListFilter::default().limit(100);
    assert_eq!(
        ids(&q, &all.clone().key("order-1")).await?,
        sorted(vec![dedupe, windowed, concurrency]),
        "dedupe key, window key and concurrency key, not order-10 nor the mail queue's"
    );
    assert_eq!(ids(&q, &all.clone().key("tenant-b")).await?, vec![rate]);
    assert_eq!(ids(&q, &all.clone().key("a.c")).await?, vec![dotted]);
    assert_eq!(
        ids(&q, &all.clone().key("order")).await?,
        Vec::<ObjectId>::new()
    );
    assert_eq!(
        ids(&other, &all.clone().key("order-1")).await?,
        vec![elsewhere]
    );

    // Errors: set as a failure stores them.
    for (id, error) in [
        (dedupe, "Timeout talking to api.example (after 30 s)"),
        (longer, "TIMEOUT"),
        (plain, "timeouts: a+b"),
        (dotted, "connection refused"),
    ] {
        q.collection()
            .update_one(
                doc! { field::ID: id },
                doc! { "$set": { field::LAST_ERROR: error, field::STATE: JobState::Dead.as_str() } },
            )
            .await?;
    }
    assert_eq!(
        ids(&q, &all.clone().error_contains("timeout")).await?,
        sorted(vec![dedupe, longer, plain]),
        "case-insensitive"
    );
    assert_eq!(
        ids(&q, &all.clone().error_contains("api.example (after")).await?,
        vec![dedupe],
        "regex characters are literal"
    );
    assert_eq!(
        ids(&q, &all.clone().error_contains("a+b")).await?,
        vec![plain]
    );
    assert_eq!(
        ids(&q, &all.clone().error_contains("api.exampl. ")).await?,
        Vec::<ObjectId>::new(),
        "a dot is not a wildcard"
    );
    // Criteria combine: key and error and state.
    assert_eq!(
        ids(
            &q,
            &all.clone()
                .key("order-1")
                .error_contains("timeout")
                .state(JobState::Dead)
        )
        .await?,
        vec![dedupe]
    );
    assert_eq!(
        ids(&q, &all.clone().key("order-1").state(JobState::Ready)).await?,
        sorted(vec![windowed, concurrency])
    );
    assert!(q.list(&all.clone().key("")).await.is_err());
    assert!(q.list(&all.clone().error_contains("")).await.is_err());

    // Queue names: default first, then the named queues (with jobs, or only paused).
    let paused_only = q.named("reports", QueueOptions::default())?;
    paused_only.pause("test").await?;
    assert_eq!(q.queue_names().await?, vec!["default", "mail", "reports"]);
    Ok(())
}

/// Session 17: listing by key matched a uniqueness window's slot by the prefix
/// `<key>@`, so the windowed jobs of key `order@eu` (slot `order@eu@<start>`) were listed
/// for key `order` too. The slot is the key, `@` and the window's start in digits: the
/// filter now matches exactly that. Fails without the anchored digits: the `order@eu`
/// job is listed for `order`.
#[tokio::test]
async fn list_by_key_does_not_match_a_longer_windowed_key_containing_at() -> anyhow::Result<()> {
    let t = TestDb::new("queue_list_filter_at").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let q = JobQueue::open(&t.db, "jobs", time, QueueOptions::default()).await?;
    let window = |key: &str| {
        EnqueueOptions::default()
            .dedupe_key(key)
            .unique_window(Duration::from_secs(3600))
    };
    let order = enqueue(&q, 1, window("order")).await?;
    let eu = enqueue(&q, 2, window("order@eu")).await?;
    assert_eq!(
        ids(&q, &JobListFilter::default().key("order")).await?,
        vec![order],
        "listed for `order`"
    );
    assert_eq!(
        ids(&q, &JobListFilter::default().key("order@eu")).await?,
        vec![eu],
        "listed for `order@eu`"
    );
    Ok(())
}
