//! Does the server execute a retryable write at most once? MongoDB's retryable writes
//! specification: a write sent again with the same `lsid` and `txnNumber` (the driver's
//! retry after a lost reply) is not executed again; the server answers with the first
//! execution's result, and a retry that arrives while the first execution still runs waits
//! for it (the session is checked out). docwarden's settlement of indeterminate writes and
//! `verify`'s queue checker (`duplicate-effect`) rely on it.
//!
//! The commands are sent as raw `OP_MSG`s over two TCP connections, byte for byte what a
//! driver sends when it retries on a new connection after the first one was reset between
//! the write's execution and its reply: after the first attempt finished, racing it, and
//! after the server crashed or restarted (MongoDB keeps the session's record in
//! `config.transactions`, written with the write). Where the server does not deduplicate, the test
//! reports it as skipped with the numbers (a surrogate difference, `docs/surrogate.md`)
//! rather than failing: docwarden cannot change it. On MongoDB it must hold.

use std::sync::atomic::{AtomicI32, Ordering};

use docwarden_testkit::TestDb;
use mongodb::bson::{Binary, Bson, Document, Uuid, doc, spec::BinarySubtype};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

static REQUEST_ID: AtomicI32 = AtomicI32::new(1);

/// The `host:port` of the server behind `uri`, or `None` if a raw, unauthenticated,
/// plain-TCP connection cannot reach it (credentials or TLS in `MONGODB_URI`).
async fn address(uri: &str) -> anyhow::Result<Option<String>> {
    let options = mongodb::options::ClientOptions::parse(uri).await?;
    if options.credential.is_some() || options.tls.is_some() {
        return Ok(None);
    }
    let host = options
        .hosts
        .first()
        .ok_or_else(|| anyhow::anyhow!("no host in {uri}"))?;
    Ok(Some(host.to_string()))
}

/// Sends `command` as one `OP_MSG` on `stream` and reads the reply.
async fn send(stream: &mut TcpStream, command: &Document) -> anyhow::Result<Document> {
    let mut body = Vec::new();
    command.to_writer(&mut body)?;
    let length = i32::try_from(16 + 4 + 1 + body.len())?;
    let mut message = Vec::with_capacity(usize::try_from(length)?);
    message.extend_from_slice(&length.to_le_bytes());
    message.extend_from_slice(&REQUEST_ID.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    message.extend_from_slice(&0_i32.to_le_bytes());
    message.extend_from_slice(&2013_i32.to_le_bytes()); // OP_MSG
    message.extend_from_slice(&0_u32.to_le_bytes()); // flag bits
    message.push(0); // section kind 0: the body
    message.extend_from_slice(&body);
    stream.write_all(&message).await?;
    let mut header = [0_u8; 16];
    stream.read_exact(&mut header).await?;
    let total = usize::try_from(i32::from_le_bytes([
        header[0], header[1], header[2], header[3],
    ]))?;
    let mut rest = vec![0_u8; total - 16];
    stream.read_exact(&mut rest).await?;
    // flag bits (4), section kind (1), then the body.
    Ok(Document::from_reader(&rest[5..])?)
}

/// An `update` that appends `value` to `effects` of document 1, as retryable write
/// `txn` of session `lsid`.
fn push(db: &str, lsid: &Document, txn: i64, value: i64) -> Document {
    doc! {
        "update": "effects",
        "updates": [ { "q": { "_id": 1 }, "u": { "$push": { "effects": value } } } ],
        "ordered": true,
        "lsid": lsid.clone(),
        "txnNumber": txn,
        "$db": db,
    }
}

async fn setup(test: &str) -> anyhow::Result<Option<(TestDb, String, Document)>> {
    let t = TestDb::new(test).await?;
    t.db.collection::<Document>("effects")
        .insert_one(doc! { "_id": 1, "effects": [] })
        .await?;
    let lsid = doc! { "id": Bson::Binary(Binary { subtype: BinarySubtype::Uuid, bytes: Uuid::new().bytes().to_vec() }) };
    let Some(addr) = address(t.uri()).await? else {
        docwarden_testkit::skip(test, "raw wire messages need a server without auth or TLS");
        return Ok(None);
    };
    Ok(Some((t, addr, lsid)))
}

async fn effects(db: &mongodb::Database) -> anyhow::Result<Vec<i64>> {
    let d = db
        .collection::<Document>("effects")
        .find_one(doc! { "_id": 1 })
        .await?
        .ok_or_else(|| anyhow::anyhow!("document 1 is gone"))?;
    Ok(d.get_array("effects")?
        .iter()
        .filter_map(Bson::as_i64)
        .collect())
}

#[tokio::test]
async fn a_write_retried_after_it_ran_is_not_executed_again() -> anyhow::Result<()> {
    let test = "a_write_retried_after_it_ran_is_not_executed_again";
    let Some((t, addr, lsid)) = setup(test).await? else {
        return Ok(());
    };
    let db = t.db.name().to_owned();
    let mut replies = Vec::new();
    for txn in 1..=10_i64 {
        // The first attempt runs; its connection is dropped as if reset before the reply
        // was read... here the reply is read, and the retry goes out on a new connection.
        let mut first = TcpStream::connect(&addr).await?;
        replies.push(send(&mut first, &push(&db, &lsid, txn, txn)).await?);
        drop(first);
        let mut retry = TcpStream::connect(&addr).await?;
        replies.push(send(&mut retry, &push(&db, &lsid, txn, txn)).await?);
    }
    let found = effects(&t.db).await?;
    println!("10 writes, each sent twice: effects {found:?}");
    println!(
        "replies to the first write and its retry: {:?} / {:?}",
        replies[0], replies[1]
    );
    if found.len() != 10 {
        docwarden_testkit::skip(
            test,
            &format!(
                "the server executed {} of 10 retried writes twice (no retryable-write deduplication)",
                found.len() - 10
            ),
        );
        return Ok(());
    }
    assert_eq!(found, (1..=10).collect::<Vec<_>>());
    Ok(())
}

#[tokio::test]
async fn a_retry_racing_its_first_attempt_is_not_executed_again() -> anyhow::Result<()> {
    let test = "a_retry_racing_its_first_attempt_is_not_executed_again";
    let Some((t, addr, lsid)) = setup(test).await? else {
        return Ok(());
    };
    let db = t.db.name().to_owned();
    const WRITES: i64 = 50;
    let mut errors = Vec::new();
    for txn in 1..=WRITES {
        // The retry reaches the server while the first attempt may still run (the first
        // connection reset after the request left, the driver re-sent at once).
        let mut a = TcpStream::connect(&addr).await?;
        let mut b = TcpStream::connect(&addr).await?;
        let command = push(&db, &lsid, txn, txn);
        let (ra, rb) = tokio::join!(send(&mut a, &command), send(&mut b, &command));
        for r in [ra?, rb?] {
            if r.get_f64("ok").unwrap_or(0.0) != 1.0 || r.contains_key("writeErrors") {
                errors.push(r);
            }
        }
    }
    let found = effects(&t.db).await?;
    let twice = i64::try_from(found.len())? - WRITES;
    println!(
        "{WRITES} writes, each sent twice at once: {} effects ({twice} executed twice), {} error replies {:?}",
        found.len(),
        errors.len(),
        errors.first()
    );
    if twice > 0 {
        docwarden_testkit::skip(
            test,
            &format!(
                "the server executed {twice} of {WRITES} writes twice when the retry raced the first attempt"
            ),
        );
        return Ok(());
    }
    assert_eq!(twice, 0);
    Ok(())
}

/// How the server goes away between a write and its retry.
#[derive(Clone, Copy, Debug)]
enum Outage {
    /// SIGKILL and restart on the same data.
    Crash,
    /// A clean shutdown and restart.
    Restart,
}

/// Sends a write, takes the server down and up again, retries the write (same `lsid`,
/// same `txnNumber`), and returns the effects found and the retry's reply.
async fn retried_after(test: &str, outage: Outage) -> anyhow::Result<Option<(Vec<i64>, Document)>> {
    let Some(mut t) = TestDb::dedicated(test).await? else {
        return Ok(None);
    };
    t.db.collection::<Document>("effects")
        .insert_one(doc! { "_id": 1, "effects": [] })
        .await?;
    let lsid = doc! { "id": Bson::Binary(Binary { subtype: BinarySubtype::Uuid, bytes: Uuid::new().bytes().to_vec() }) };
    let addr = address(t.uri())
        .await?
        .ok_or_else(|| anyhow::anyhow!("an embedded server takes plain connections"))?;
    let db = t.db.name().to_owned();
    // The first attempt runs and is acknowledged (the server is durable: it survives a
    // crash); its reply is taken as lost, and the driver retries on the restarted server.
    let mut first = TcpStream::connect(&addr).await?;
    send(&mut first, &push(&db, &lsid, 1, 1)).await?;
    drop(first);
    let server = t
        .server_mut()
        .ok_or_else(|| anyhow::anyhow!("a dedicated test has its server"))?;
    match outage {
        Outage::Crash => server.crash_and_restart().await?,
        Outage::Restart => server.restart().await?,
    }
    let mut retry = TcpStream::connect(&addr).await?;
    let reply = send(&mut retry, &push(&db, &lsid, 1, 1)).await?;
    // A client made after the restart (the test's own saw the server go away).
    let client = t.new_client().await?;
    let found = effects(&client.database(&db)).await?;
    println!("a write retried after a {outage:?}: effects {found:?}, the retry's reply {reply:?}");
    Ok(Some((found, reply)))
}

#[tokio::test]
async fn a_write_retried_after_a_crash_or_restart_is_not_executed_again() -> anyhow::Result<()> {
    let test = "a_write_retried_after_a_crash_or_restart_is_not_executed_again";
    let mut twice = Vec::new();
    for outage in [Outage::Crash, Outage::Restart] {
        let Some((found, _)) = retried_after(test, outage).await? else {
            return Ok(());
        };
        if found.len() != 1 {
            twice.push(format!("{outage:?}: {} effects", found.len()));
        }
    }
    if !twice.is_empty() {
        docwarden_testkit::skip(
            test,
            &format!(
                "the server executed a write again when it was retried after an outage ({})",
                twice.join(", ")
            ),
        );
    }
    Ok(())
}
