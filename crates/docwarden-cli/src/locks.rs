//! `docwarden locks`: list held leases of a lock collection, and release every lease of an
//! owner (for example after a process died holding them).

use std::process::ExitCode;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::format as lock_format;
use docwarden::lock::{
    DocumentLockOptions, DocumentLocks, LockCollection, LockListFilter, LockOptions, Owner,
};

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
}

#[derive(Debug, clap::Subcommand)]
enum LocksCommand {
    /// List held leases (expired ones are marked; anyone may take those over). Lock
    /// documents docwarden did not write are listed as malformed, with the reason.
    List {
        /// Only leases of this owner id.
        #[arg(long)]
        owner: Option<String>,
        /// Only the lease on this resource.
        #[arg(long)]
        resource: Option<String>,
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
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Release every lease held by an owner id; prints how many were released.
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
    let session = args.conn.open(quiet).await?;
    let db = session.client.database(&args.db);
    let time = TimeSource::server(session.client.clone(), ClockOptions::default())?;
    if let LocksCommand::Documents {
        max_duration_secs,
        lock_id_field,
        lock_time_field,
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
        let records = locks.list_locked().await?;
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
                println!("{:<32} {:<32} {:<26} {}", r.id, r.lock_id, locked_at, state);
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    let locks = LockCollection::open(&db, &args.collection, time, LockOptions::default()).await?;
    match args.command {
        LocksCommand::List {
            owner,
            resource,
            json,
        } => {
            let mut filter = LockListFilter::default();
            if let Some(owner) = owner {
                filter = filter.owner(Owner::from_existing(owner)?.id());
            }
            if let Some(resource) = resource {
                docwarden::validate::name("resource", &resource)?;
                filter = filter.resource(resource);
            }
            let records = locks.list(&filter).await?;
            if json {
                crate::output::print_json(&records)?;
            } else if records.is_empty() {
                println!("no held leases in {}.{}", args.db, args.collection);
            } else {
                println!(
                    "{:<32} {:<32} {:>8} {:<26} state",
                    "resource",
                    lock_format::collection::OWNER,
                    lock_format::collection::TOKEN,
                    "expires at (server)"
                );
                for r in &records {
                    let expires = r.expires_at.map_or_else(
                        || "-".to_owned(),
                        |e| e.try_to_rfc3339_string().unwrap_or_else(|_| e.to_string()),
                    );
                    let mut state = (if r.expired { "expired" } else { "held" }).to_owned();
                    if let Some(why) = &r.malformed {
                        state.push_str(&format!(" (malformed: {why})"));
                    }
                    println!(
                        "{:<32} {:<32} {:>8} {:<26} {}",
                        r.resource,
                        r.owner,
                        r.token.map_or_else(
                            || lock_format::collection::PENDING.to_owned(),
                            |t| t.to_string()
                        ),
                        expires,
                        state
                    );
                }
                let malformed = records.iter().filter(|r| r.malformed.is_some()).count();
                if malformed > 0 {
                    println!(
                        "{malformed} lock document(s) were not written by docwarden (edited by hand?); \
                         one whose expires_at is not a date counts as expired and the next acquire takes it over"
                    );
                }
            }
        }
        LocksCommand::Release { owner, json } => {
            let owner = Owner::from_existing(owner)?;
            let released = locks.release_all(&owner).await?;
            if json {
                crate::output::print_json(
                    &serde_json::json!({ (lock_format::collection::OWNER): owner.id(), "released": released }),
                )?;
            } else {
                println!("released {released} lease(s) of owner {owner}");
            }
        }
        LocksCommand::Documents { .. } => {}
    }
    Ok(ExitCode::SUCCESS)
}
