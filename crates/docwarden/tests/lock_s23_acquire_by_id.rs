//! Session 23 (issue 14): the lock collection's acquire writes by `{_id}` alone and decides
//! in its pipeline whether the lock is free (`acquire_condition`), where it used to match
//! the free lock with the query filter `{$and: [{_id}, {$or: [owner null, expires_at <
//! cutoff, expires_at not a date]}]}`. The two must take exactly the same documents, leave
//! a held one untouched, and hand out a larger token each time. Checked here over every
//! combination of stored shapes a hand edit or an earlier version can leave: owner, expiry,
//! token block and a `pending` nonce.

use std::time::Duration;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::Owner;
use docwarden_testkit::TestDb;
use mongodb::bson::{Bson, DateTime, Document, Timestamp, doc};

const LOCKS: &str = "locks";

/// A stored number as the acquire reads a previous token: int64, int32, or a double rounded
/// up.
fn number(v: Option<&Bson>) -> Option<i64> {
    match v? {
        Bson::Int64(n) => Some(*n),
        Bson::Int32(n) => Some(i64::from(*n)),
        Bson::Double(d) => format!("{:.0}", d.ceil()).parse().ok(),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_acquire_by_id_takes_exactly_what_the_free_lock_filter_matches() -> anyhow::Result<()> {
    let t = TestDb::new("lock_s23_acquire_by_id").await?;
    let time = TimeSource::server(t.client.clone(), ClockOptions::default())?;
    let locks = docwarden_workloads::counters::open_locks(&t.db, LOCKS, time).await?;
    let docs = t.db.collection::<Document>(LOCKS);
    let me = Owner::random();

    let now = DateTime::now().timestamp_millis();
    let hour = 3_600_000;
    let owners = [
        ("owner missing", None),
        ("owner null", Some(Bson::Null)),
        ("owner another", Some(Bson::from("another"))),
        ("owner a number", Some(Bson::Int32(7))),
    ];
    let expiries = [
        ("expiry missing", None),
        ("expiry null", Some(Bson::Null)),
        (
            "expired",
            Some(Bson::DateTime(DateTime::from_millis(now - hour))),
        ),
        (
            "valid",
            Some(Bson::DateTime(DateTime::from_millis(now + hour))),
        ),
        ("expiry a string", Some(Bson::from("2099-01-01"))),
        ("expiry a number", Some(Bson::Int64(now + hour))),
        (
            "expiry a timestamp",
            Some(Bson::Timestamp(Timestamp {
                time: u32::MAX,
                increment: 1,
            })),
        ),
    ];
    let blocks = [
        ("block left", Some((Bson::Int64(3), Bson::Int64(1_000_000)))),
        ("block used up", Some((Bson::Int64(9), Bson::Int64(9)))),
        ("no token", None),
        (
            "token a double",
            Some((Bson::Double(4.5), Bson::Int64(100))),
        ),
    ];
    let pendings = [("no pending", None), ("pending", Some(Bson::from("stale")))];

    let mut disagreements = Vec::new();
    let mut written_while_held = Vec::new();
    let mut tokens_not_above = Vec::new();
    let (mut taken, mut held) = (0, 0);
    let mut i = 0;
    for (o_name, o) in &owners {
        for (e_name, e) in &expiries {
            for (b_name, b) in &blocks {
                for (p_name, p) in &pendings {
                    i += 1;
                    let shape = format!("{o_name}, {e_name}, {b_name}, {p_name}");
                    let resource = format!("r-{i}");
                    let mut stored = doc! { "_id": &resource, "acquisition": "earlier" };
                    if let Some(o) = o {
                        stored.insert("owner", o.clone());
                    }
                    if let Some(e) = e {
                        stored.insert("expires_at", e.clone());
                    }
                    if let Some((token, ceiling)) = b {
                        stored.insert("token", token.clone());
                        stored.insert("ceiling", ceiling.clone());
                    }
                    if let Some(p) = p {
                        stored.insert("pending", p.clone());
                    }
                    docs.insert_one(stored.clone()).await?;
                    // The query filter the acquire used to send (docs/locks.md), with the
                    // same cutoff up to the skew margin: no expiry here is near it.
                    let free = docs
                        .find_one(doc! { "$and": [{ "_id": &resource }, { "$or": [
                            { "owner": Bson::Null },
                            { "expires_at": { "$lt": DateTime::now() } },
                            { "expires_at": { "$not": { "$type": "date" } } },
                        ] }] })
                        .await?
                        .is_some();
                    let lease = locks
                        .try_acquire(&me, &resource, Duration::from_secs(30))
                        .await?;
                    let after = docs
                        .find_one(doc! { "_id": &resource })
                        .await?
                        .unwrap_or_default();
                    if lease.is_some() != free {
                        disagreements.push(format!(
                            "{shape}: the filter matches {free}, the acquire took {}",
                            lease.is_some()
                        ));
                    }
                    match lease {
                        None => {
                            held += 1;
                            if after != stored {
                                written_while_held.push(format!("{shape}: {after}"));
                            }
                        }
                        Some(lease) => {
                            taken += 1;
                            let token = lease.token.get();
                            let previous = number(stored.get("token")).unwrap_or(0);
                            let committed = after.get_str("owner").ok() == Some(me.id())
                                && after.get_i64("token").ok() == Some(token)
                                && !after.contains_key("pending");
                            if token <= previous || !committed {
                                tokens_not_above.push(format!(
                                    "{shape}: token {token} after {previous}, stored {after}"
                                ));
                            }
                            locks.release(&lease).await?;
                        }
                    }
                }
            }
        }
    }
    println!("{i} shapes: {taken} taken, {held} held");
    assert!(taken > 0 && held > 0, "{taken} taken, {held} held");
    assert!(disagreements.is_empty(), "{disagreements:#?}");
    assert!(
        written_while_held.is_empty(),
        "held locks written: {written_while_held:#?}"
    );
    assert!(tokens_not_above.is_empty(), "{tokens_not_above:#?}");
    Ok(())
}
