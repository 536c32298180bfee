//! `docwarden locks`: list what is held — leases of a lock collection, leaders of
//! elections, read/write locks — and release everything an owner holds (for example after
//! a process died holding it).
//!
//! Each kind of lock is one [`Section`] of the listing and one [`Released`] count of the
//! release: [`list_sections`] and [`release_everywhere`] call one function per kind, so a
//! new kind is added with one call in each.

use std::process::ExitCode;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::format as lock_format;
use docwarden::lock::{
    DocumentLockOptions, DocumentLocks, Election, Leader, LockCollection, LockListFilter,
    LockOptions, Owner, RwLockOptions, RwLockRecord, RwLocks, Semaphore, SemaphoreOptions,
    SemaphoreRecord,
};
use mongodb::Database;
use mongodb::bson::DateTime;

use crate::conn::ConnArgs;

/// Arguments of `docwarden locks`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(subcommand)]
    command: LocksCommand,
    #[command(flatten)]
    conn: ConnArgs,
    /// Database holding the lock collection.
    #[arg(long, default_value = "docwarden", global = true)]
    db: String,
    /// The lock collection (its token counters live in `<collection>.tokens`); for
    /// `documents`, the entity collection whose documents carry the locks.
    #[arg(long, default_value = "locks", global = true)]
    collection: String,
    /// The lock collection of the elections (`docwarden::lock::Election`).
    #[arg(long, default_value = lock_format::ELECTIONS, global = true)]
    elections: String,
    /// The collection of the read/write locks (`docwarden::lock::RwLocks`).
    #[arg(long, default_value = lock_format::RWLOCKS, global = true)]
    rwlocks: String,
    /// The collection of the semaphores (`docwarden::lock::Semaphore`).
    #[arg(long, default_value = lock_format::SEMAPHORES, global = true)]
    semaphores: String,
}

#[derive(Debug, clap::Subcommand)]
enum LocksCommand {
    /// List held leases, election leaders (term, holder, expiry), read/write locks
    /// (writer, readers) and semaphores (holders of permits); expired ones are marked
    /// (anyone may take those over). Lock documents docwarden did not write are listed as
    /// malformed, with the reason. JSON: one array per kind (`leases`, `elections`,
    /// `rwlocks`, `semaphores`).
    List {
        /// Only leases of this owner id.
        #[arg(long)]
        owner: Option<String>,
        /// Only the lease on this resource.
        #[arg(long)]
        resource: Option<String>,
        /// At most this many of each kind (leases, elections, read/write locks,
        /// semaphores), the first by resource; 0 lists none. Default: all of them.
        #[arg(long)]
        limit: Option<u64>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List the locked documents of a collection that uses document locks (the lock id and
    /// lock time stored in the entity itself): held, expired, or malformed (a lock id next
    /// to a lock time that is missing or not a date; the next lock takes it over).
    Documents {
        /// How long a document lock is valid after its lock time, in seconds.
        #[arg(long, default_value_t = 30)]
        max_duration_secs: u64,
        /// The field holding the lock id.
        #[arg(long, default_value = lock_format::document::LOCK_ID)]
        lock_id_field: String,
        /// The field holding the lock time.
        #[arg(long, default_value = lock_format::document::LOCK_TIME)]
        lock_time_field: String,
        /// At most this many documents, the first by `_id`; 0 lists none. Default: all.
        #[arg(long)]
        limit: Option<u64>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Release everything an owner id holds — leases, leaderships, read and write locks,
    /// semaphore permits;
    /// prints how many were released, per kind.
    Release {
        /// The owner id whose leases are released.
        #[arg(long)]
        owner: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

pub(crate) async fn run(args: Args) -> anyhow::Result<ExitCode> {
    let quiet = match &args.command {
        LocksCommand::List { json, .. }
        | LocksCommand::Documents { json, .. }
        | LocksCommand::Release { json, .. } => *json,
    };
    // Bad input is refused before anything is started or written.
    match &args.command {
        LocksCommand::List {
            owner, resource, ..
        } => {
            if let Some(owner) = owner {
                Owner::from_existing(owner.as_str())?;
            }
            if let Some(resource) = resource {
                docwarden::validate::name("resource", resource)?;
            }
        }
        LocksCommand::Release { owner, .. } => {
            Owner::from_existing(owner.as_str())?;
        }
        LocksCommand::Documents {
            max_duration_secs,
            lock_id_field,
            lock_time_field,
            ..
        } => {
            if *max_duration_secs == 0 {
                return Err(
                    docwarden::Error::invalid("max duration", "must be at least 1 s").into(),
                );
            }
            docwarden::validate::name("lock id field", lock_id_field)?;
            docwarden::validate::name("lock time field", lock_time_field)?;
        }
    }
    docwarden::validate::collection_name("collection", &args.collection)?;
    docwarden::validate::collection_name("elections collection", &args.elections)?;
    docwarden::validate::collection_name("rwlocks collection", &args.rwlocks)?;
    docwarden::validate::collection_name("semaphores collection", &args.semaphores)?;
    docwarden::validate::database_name("--db", &args.db)?;
    let session = args.conn.open(quiet).await?;
    let db = session.client.database(&args.db);
    let time = TimeSource::server(session.client.clone(), ClockOptions::default())?;
    if let LocksCommand::Documents {
        max_duration_secs,
        lock_id_field,
        lock_time_field,
        limit,
        json,
    } = args.command
    {
        // The entity collection is only read: no index is created on it.
        let locks = DocumentLocks::new(
            db.collection(&args.collection),
            time,
            DocumentLockOptions::default()
                .max_duration(std::time::Duration::from_secs(max_duration_secs))
                .fields(lock_id_field, lock_time_field),
        )?;
        let records = locks.list_locked_first(limit).await?;
        if json {
            crate::output::print_json(&records)?;
        } else if records.is_empty() {
            println!("no locked documents in {}.{}", args.db, args.collection);
        } else {
            println!(
                "{:<32} {:<32} {:<26} state",
                "document", "lock id", "locked at (server)"
            );
            for r in &records {
                let locked_at = r.locked_at.map_or_else(
                    || "-".to_owned(),
                    |t| t.try_to_rfc3339_string().unwrap_or_else(|_| t.to_string()),
                );
                let mut state = (if r.expired { "expired" } else { "held" }).to_owned();
                if let Some(why) = &r.malformed {
                    state.push_str(&format!(" (malformed: {why})"));
                }
                println!(
                    "{:<32} {:<32} {:<26} {}",
                    crate::output::cell(&r.id),
                    crate::output::cell(&r.lock_id),
                    locked_at,
                    crate::output::terminal_safe(&state)
                );
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    let locks =
        LockCollection::open(&db, &args.collection, time.clone(), LockOptions::default()).await?;
    match args.command {
        LocksCommand::List {
            owner,
            resource,
            limit,
            json,
        } => {
            let mut filter = LockListFilter::default();
            if let Some(limit) = limit {
                filter = filter.limit(limit);
            }
            if let Some(owner) = owner {
                filter = filter.owner(Owner::from_existing(owner)?.id());
            }
            if let Some(resource) = resource {
                docwarden::validate::name("resource", &resource)?;
                filter = filter.resource(resource);
            }
            let kinds = Kinds {
                db: &db,
                time: &time,
                elections: &args.elections,
                rwlocks: &args.rwlocks,
                semaphores: &args.semaphores,
            };
            let sections = list_sections(&kinds, &locks, &filter).await?;
            if json {
                let map: serde_json::Map<String, serde_json::Value> = sections
                    .into_iter()
                    .map(|s| (s.key.to_owned(), s.json))
                    .collect();
                crate::output::print_json(&map)?;
            } else {
                for (i, s) in sections.iter().enumerate() {
                    if i > 0 {
                        println!();
                    }
                    if s.lines.is_empty() {
                        println!("no {} in {}.{}", s.title, args.db, s.collection);
                    } else {
                        println!("{} in {}.{}:", s.title, args.db, s.collection);
                        for line in &s.lines {
                            println!("{}", crate::output::terminal_safe(line));
                        }
                    }
                }
            }
        }
        LocksCommand::Release { owner, json } => {
            let owner = Owner::from_existing(owner)?;
            let kinds = Kinds {
                db: &db,
                time: &time,
                elections: &args.elections,
                rwlocks: &args.rwlocks,
                semaphores: &args.semaphores,
            };
            let released = release_everywhere(&kinds, &locks, &owner).await?;
            let total: u64 = released.iter().map(|r| r.count).sum();
            if json {
                let by_kind: serde_json::Map<String, serde_json::Value> = released
                    .iter()
                    .map(|r| (r.key.to_owned(), r.count.into()))
                    .collect();
                crate::output::print_json(&serde_json::json!({
                    (lock_format::collection::OWNER): owner.id(),
                    "released": total,
                    "by_kind": by_kind,
                }))?;
            } else {
                let parts: Vec<String> = released
                    .iter()
                    .map(|r| format!("{} {}", r.count, r.key))
                    .collect();
                println!(
                    "released {total} lease(s) of owner {owner} ({})",
                    parts.join(", ")
                );
            }
        }
        LocksCommand::Documents { .. } => {}
    }
    Ok(ExitCode::SUCCESS)
}

/// Where the elections, read/write locks and semaphores live, for [`holdings`],
/// [`list_sections`] and [`release_everywhere`] (the plain leases' lock collection is
/// passed on its own: the dashboard shows several).
pub(crate) struct Kinds<'a> {
    /// The database of the collections.
    pub(crate) db: &'a Database,
    /// The server's clock.
    pub(crate) time: &'a TimeSource,
    /// The lock collection of the elections.
    pub(crate) elections: &'a str,
    /// The collection of the read/write locks.
    pub(crate) rwlocks: &'a str,
    /// The collection of the semaphores.
    pub(crate) semaphores: &'a str,
}

/// What is held besides plain leases, read through the library's list functions
/// ([`Election::list`], [`RwLocks::list`], [`Semaphore::list`]) and filtered by owner and
/// resource: the one reader behind `docwarden locks list` and the dashboard's locks page.
#[derive(Debug, Default, serde::Serialize)]
pub(crate) struct Holdings {
    /// Election leaders (expired terms included, marked).
    pub(crate) elections: Vec<Leader>,
    /// Read/write locks with a writer or readers.
    pub(crate) rwlocks: Vec<RwLockRecord>,
    /// Semaphores (every document, with its holders).
    pub(crate) semaphores: Vec<SemaphoreRecord>,
}

/// Reads the [`Holdings`] of `kinds` that match `filter` (owner, resource, and at most
/// `limit` elections, read/write resources and semaphores each). The server does the
/// filtering: each kind is one read of the matching documents only.
pub(crate) async fn holdings(
    kinds: &Kinds<'_>,
    filter: &LockListFilter,
) -> anyhow::Result<Holdings> {
    let elections =
        Election::list_matching(&kinds.lock_collection(kinds.elections)?, filter).await?;
    let rw = RwLocks::new(
        kinds.lock_collection(kinds.rwlocks)?,
        RwLockOptions::default(),
    )?;
    let rwlocks = rw.list_matching(filter).await?;
    let semaphores = kinds.semaphore()?.list_matching(filter, false).await?;
    Ok(Holdings {
        elections,
        rwlocks,
        semaphores,
    })
}

impl Kinds<'_> {
    /// A handle on the semaphore collection, without creating it or its indexes.
    fn semaphore(&self) -> anyhow::Result<Semaphore> {
        Ok(Semaphore::new(
            self.db.collection(self.semaphores),
            self.time.clone(),
            SemaphoreOptions::default(),
        )?)
    }

    /// A handle on another lock collection, without creating it or its indexes (listing
    /// and releasing must not create collections that are not used).
    fn lock_collection(&self, name: &str) -> anyhow::Result<LockCollection> {
        Ok(LockCollection::new(
            self.db.collection(name),
            self.time.clone(),
            LockOptions::default(),
        )?)
    }
}

/// One kind of lock in `docwarden locks list`: its JSON array and its human lines.
pub(crate) struct Section {
    /// The JSON key (`leases`, `elections`, `rwlocks`).
    key: &'static str,
    /// What is listed, for the human output (`held leases`).
    title: &'static str,
    /// The collection it was read from.
    collection: String,
    /// The records as JSON.
    json: serde_json::Value,
    /// The human output: a header line, then one line per holder; empty if none.
    lines: Vec<String>,
}

/// One kind of lock in `docwarden locks release`: how many were released.
pub(crate) struct Released {
    /// The JSON key (`leases`, `elections`, `rwlocks`).
    key: &'static str,
    count: u64,
}

/// Every section of the listing, one call per kind of lock.
async fn list_sections(
    kinds: &Kinds<'_>,
    locks: &LockCollection,
    filter: &LockListFilter,
) -> anyhow::Result<Vec<Section>> {
    let held = holdings(kinds, filter).await?;
    Ok(vec![
        leases_section(locks, filter).await?,
        elections_section(kinds, held.elections)?,
        rwlocks_section(kinds, held.rwlocks)?,
        semaphores_section(kinds, held.semaphores)?,
    ])
}

/// Releases what `owner` holds, one call per kind of lock.
async fn release_everywhere(
    kinds: &Kinds<'_>,
    locks: &LockCollection,
    owner: &Owner,
) -> anyhow::Result<Vec<Released>> {
    let rwlocks = RwLocks::new(
        kinds.lock_collection(kinds.rwlocks)?,
        RwLockOptions::default(),
    )?;
    Ok(vec![
        Released {
            key: "leases",
            count: locks.release_all(owner).await?,
        },
        Released {
            key: "elections",
            count: kinds
                .lock_collection(kinds.elections)?
                .release_all(owner)
                .await?,
        },
        Released {
            key: "rwlocks",
            count: rwlocks.release_all(owner).await?,
        },
        Released {
            key: "semaphores",
            count: kinds.semaphore()?.release_all(owner).await?,
        },
    ])
}

fn date(d: Option<DateTime>) -> String {
    d.map_or_else(
        || "-".to_owned(),
        |e| e.try_to_rfc3339_string().unwrap_or_else(|_| e.to_string()),
    )
}

fn state(expired: bool) -> &'static str {
    if expired { "expired" } else { "held" }
}

/// A fencing token as shown: the number, or `missing` (a lock not yet granted one).
fn token<T: std::fmt::Display>(t: Option<T>, missing: &str) -> String {
    t.map_or_else(|| missing.to_owned(), |t| t.to_string())
}

/// The columns every section ends with: holder, token, expiry, state.
/// The last two column headers of every section (the lease's expiry, its state).
const EXPIRES_HEADER: &str = "expires at (server)";
const STATE_HEADER: &str = "state"; // not a stored field: a column header

fn holder_columns(holder: &str, token: &str, expires: &str, state: &str) -> String {
    format!("{holder:<32} {token:>8} {expires:<26} {state}")
}

async fn leases_section(
    locks: &LockCollection,
    filter: &LockListFilter,
) -> anyhow::Result<Section> {
    let records = locks.list(filter).await?;
    let mut lines = Vec::new();
    if !records.is_empty() {
        lines.push(format!(
            "{:<32} {}",
            "resource",
            holder_columns(
                lock_format::collection::OWNER,
                lock_format::collection::TOKEN,
                EXPIRES_HEADER,
                STATE_HEADER
            )
        ));
        for r in &records {
            let mut st = state(r.expired).to_owned();
            if let Some(why) = &r.malformed {
                st.push_str(&format!(" (malformed: {why})"));
            }
            lines.push(format!(
                "{:<32} {}",
                r.resource,
                holder_columns(
                    &r.owner,
                    &token(r.token, lock_format::collection::PENDING),
                    &date(r.expires_at),
                    &st
                )
            ));
        }
        let malformed = records.iter().filter(|r| r.malformed.is_some()).count();
        if malformed > 0 {
            lines.push(format!(
                "{malformed} lock document(s) were not written by docwarden (edited by hand?); \
                 one whose expires_at is not a date counts as expired and the next acquire takes it over"
            ));
        }
    }
    Ok(Section {
        key: "leases",
        title: "held leases",
        collection: locks.name().to_owned(),
        json: serde_json::to_value(&records)?,
        lines,
    })
}

fn elections_section(kinds: &Kinds<'_>, leaders: Vec<Leader>) -> anyhow::Result<Section> {
    let mut lines = Vec::new();
    if !leaders.is_empty() {
        lines.push(format!(
            "{:<32} {}",
            "election",
            holder_columns("leader", "term", EXPIRES_HEADER, STATE_HEADER)
        ));
        for l in &leaders {
            lines.push(format!(
                "{:<32} {}",
                l.election,
                holder_columns(
                    &l.owner,
                    &token(l.term, lock_format::collection::PENDING),
                    &date(l.expires_at),
                    state(l.expired)
                )
            ));
        }
    }
    Ok(Section {
        key: "elections",
        title: "election leaders",
        collection: kinds.elections.to_owned(),
        json: serde_json::to_value(&leaders)?,
        lines,
    })
}

fn rwlocks_section(kinds: &Kinds<'_>, records: Vec<RwLockRecord>) -> anyhow::Result<Section> {
    let mut lines = Vec::new();
    if !records.is_empty() {
        lines.push(format!(
            "{:<32} {:<14} {}",
            "resource",
            "role",
            holder_columns(
                lock_format::collection::OWNER,
                lock_format::collection::TOKEN,
                EXPIRES_HEADER,
                STATE_HEADER
            )
        ));
        for r in &records {
            if let Some(w) = &r.writer {
                lines.push(format!(
                    "{:<32} {:<14} {}",
                    r.resource,
                    if w.waiting {
                        "writer waiting"
                    } else {
                        "writer"
                    },
                    holder_columns(
                        &w.owner,
                        &token(w.token, lock_format::collection::PENDING),
                        &date(w.expires_at),
                        state(w.expired)
                    )
                ));
            }
            for x in &r.readers {
                lines.push(format!(
                    "{:<32} {:<14} {}",
                    r.resource,
                    "reader",
                    holder_columns(&x.owner, "-", &date(x.expires_at), state(x.expired))
                ));
            }
        }
    }
    Ok(Section {
        key: "rwlocks",
        title: "read/write locks",
        collection: kinds.rwlocks.to_owned(),
        json: serde_json::to_value(&records)?,
        lines,
    })
}

fn semaphores_section(kinds: &Kinds<'_>, records: Vec<SemaphoreRecord>) -> anyhow::Result<Section> {
    let mut lines = Vec::new();
    if !records.is_empty() {
        lines.push(format!(
            "{:<32} {:>9} {}",
            "resource",
            "permits",
            holder_columns(
                "holder",
                lock_format::collection::TOKEN,
                EXPIRES_HEADER,
                STATE_HEADER
            )
        ));
        for r in &records {
            let permits = format!(
                "{}/{}",
                r.live(),
                r.permits.map_or_else(|| "-".to_owned(), |p| p.to_string())
            );
            if r.holders.is_empty() {
                lines.push(format!(
                    "{:<32} {:>9} {}",
                    r.resource,
                    permits,
                    holder_columns("-", "-", "-", "free")
                ));
            }
            for h in &r.holders {
                lines.push(format!(
                    "{:<32} {:>9} {}",
                    r.resource,
                    permits,
                    holder_columns(
                        &h.owner,
                        &token(h.token, "-"),
                        &date(h.expires_at),
                        state(h.expired)
                    )
                ));
            }
        }
    }
    Ok(Section {
        key: "semaphores",
        title: "semaphores",
        collection: kinds.semaphores.to_owned(),
        json: serde_json::to_value(&records)?,
        lines,
    })
}
