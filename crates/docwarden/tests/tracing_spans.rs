//! The spans docwarden opens (`docwarden::observe`): a `job` span per handler run with the
//! job's id, queue, attempt and claim token; `settle`/`claim_batch` spans on the bulks;
//! lock operations with collection, resource, owner and fencing token. A capturing
//! `tracing` layer (process-global: one test in this binary) records every span.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{LockCollection, LockOptions, Owner};
use docwarden::queue::{EnqueueOptions, JobQueue, QueueOptions, Worker, WorkerOptions};
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, Document, doc};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

/// A span seen: its name and fields (values as text, quotes trimmed).
#[derive(Debug, Clone, Default)]
struct Seen {
    name: String,
    fields: BTreeMap<String, String>,
}

impl Seen {
    fn get(&self, k: &str) -> Option<&str> {
        self.fields.get(k).map(String::as_str)
    }
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_owned(), value.to_string());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_owned(), value.to_string());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let text = format!("{value:?}");
        self.0
            .insert(field.name().to_owned(), text.trim_matches('"').to_owned());
    }
}

/// Collects every span with its fields, including those recorded after creation.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<BTreeMap<u64, Seen>>>);

impl<S: tracing::Subscriber> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        let mut seen = Seen {
            name: attrs.metadata().name().to_owned(),
            ..Seen::default()
        };
        attrs.record(&mut Fields(&mut seen.fields));
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.into_u64(), seen);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        if let Some(seen) = self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&id.into_u64())
        {
            values.record(&mut Fields(&mut seen.fields));
        }
    }
}

impl Capture {
    fn named(&self, name: &str) -> Vec<Seen> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|s| s.name == name)
            .cloned()
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn job_and_lock_spans_carry_id_queue_attempt_and_token() -> anyhow::Result<()> {
    let capture = Capture::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(capture.clone()))?;

    let t = TestDb::new("tracing_spans").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let opts =
        QueueOptions::default().retry_delays(Duration::from_millis(10), Duration::from_millis(20));
    let queue = JobQueue::open(&t.db, "jobs", time.clone(), opts).await?;
    let locks = LockCollection::open(&t.db, "locks", time, LockOptions::default()).await?;
    const JOBS: usize = 12;
    for i in 0..JOBS {
        // Every fourth job fails its first attempt: its two runs have attempts 1 and 2.
        let flaky = i % 4 == 0;
        queue
            .enqueue(
                doc! { "i": i64::try_from(i)?, "flaky": flaky },
                &EnqueueOptions::default(),
            )
            .await?;
    }
    let worker = Worker::spawn(
        queue.clone(),
        WorkerOptions::default().concurrency(4).batch_size(8),
        |job| async move {
            let flaky = job
                .payload()
                .as_document()
                .and_then(|d| d.get_bool("flaky").ok())
                .unwrap_or(false);
            if flaky && job.job.attempts == 1 {
                return Err("first attempt fails".into());
            }
            tracing::info!("handled"); // inside the job span
            Ok(Bson::Null)
        },
    )?;
    let started = Instant::now();
    while queue
        .collection()
        .count_documents(doc! { "state": "succeeded" })
        .await?
        < u64::try_from(JOBS)?
    {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(60),
            "jobs did not finish"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    worker.shutdown().await;

    let owner = Owner::random();
    let lease = locks
        .acquire(
            &owner,
            "report",
            Duration::from_secs(10),
            Duration::from_secs(5),
        )
        .await?
        .ok_or_else(|| anyhow::anyhow!("acquire timed out"))?;
    let mut renewed = lease.clone();
    locks.renew(&mut renewed, Duration::from_secs(10)).await?;
    locks.release(&renewed).await?;

    // Jobs: every run has a span with its id, queue, attempt and the claim's token; the
    // last run's token is the one stored with the job.
    let job_spans = capture.named("job");
    let docs: Vec<Document> = {
        use futures::TryStreamExt;
        queue
            .collection()
            .find(doc! {})
            .await?
            .try_collect()
            .await?
    };
    assert_eq!(docs.len(), JOBS);
    let mut runs = 0;
    for d in &docs {
        let id = d.get_object_id("_id")?.to_hex();
        let attempts = d.get_i64("attempts")?;
        let token = d.get_document("lease")?.get_str("token")?;
        let mine: Vec<&Seen> = job_spans
            .iter()
            .filter(|s| s.get("id") == Some(id.as_str()))
            .collect();
        assert_eq!(
            mine.len(),
            usize::try_from(attempts)?,
            "one span per run of {id}: {mine:?}"
        );
        runs += mine.len();
        for s in &mine {
            assert_eq!(s.get("queue"), Some("jobs"), "{s:?}");
            assert!(s.get("token").is_some_and(|t| !t.is_empty()), "{s:?}");
        }
        let last = mine
            .iter()
            .find(|s| s.get("attempt") == Some(attempts.to_string().as_str()))
            .ok_or_else(|| anyhow::anyhow!("no span of attempt {attempts} of {id}: {mine:?}"))?;
        assert_eq!(last.get("token"), Some(token), "{last:?}");
    }
    assert_eq!(runs, JOBS + JOBS / 4);

    // Bulks of transitions and claims.
    let settles = capture.named("settle");
    let completed: u64 = settles
        .iter()
        .filter_map(|s| s.get("completed")?.parse::<u64>().ok())
        .sum();
    let failed: u64 = settles
        .iter()
        .filter_map(|s| s.get("failed")?.parse::<u64>().ok())
        .sum();
    assert_eq!(completed, u64::try_from(JOBS)?, "{settles:?}");
    assert_eq!(failed, u64::try_from(JOBS / 4)?, "{settles:?}");
    assert!(
        settles.iter().all(|s| s.get("queue") == Some("jobs")),
        "{settles:?}"
    );
    let claims = capture.named("claim_batch");
    assert!(!claims.is_empty());
    assert!(
        claims
            .iter()
            .all(|s| s.get("queue") == Some("jobs") && s.get("owner").is_some()),
        "{claims:?}"
    );

    // Lock operations: collection, resource, owner and token.
    let token = lease.token.get().to_string();
    for name in ["acquire", "try_acquire", "renew", "release"] {
        let spans = capture.named(name);
        let s = spans
            .iter()
            .find(|s| s.get("resource") == Some("report"))
            .ok_or_else(|| anyhow::anyhow!("no {name} span on the resource: {spans:?}"))?;
        assert_eq!(s.get("collection"), Some("locks"), "{s:?}");
        assert_eq!(s.get("owner"), Some(owner.id()), "{s:?}");
        assert_eq!(s.get("token"), Some(token.as_str()), "{name}: {s:?}");
    }
    Ok(())
}
