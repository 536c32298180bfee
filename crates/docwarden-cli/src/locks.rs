//! `docwarden locks`: list held leases of a lock collection, and release every lease of an
//! owner (for example after a process died holding them).

use std::process::ExitCode;

use docwarden::clock::{ClockOptions, TimeSource};
use docwarden::lock::{ListFilter, LockCollection, LockOptions, Owner};

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
    /// The lock collection (its token counters live in `<collection>.tokens`).
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
        LocksCommand::List { json, .. } | LocksCommand::Release { json, .. } => *json,
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
    }
    docwarden::validate::collection_name("collection", &args.collection)?;
    let session = args.conn.open(quiet).await?;
    let db = session.client.database(&args.db);
    let time = TimeSource::server(session.client.clone(), ClockOptions::default())?;
    let locks = LockCollection::open(&db, &args.collection, time, LockOptions::default()).await?;
    match args.command {
        LocksCommand::List {
            owner,
            resource,
            json,
        } => {
            let mut filter = ListFilter::default();
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
                    "resource", "owner", "token", "expires at (server)"
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
                        r.token
                            .map_or_else(|| "pending".to_owned(), |t| t.to_string()),
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
                    &serde_json::json!({ "owner": owner.id(), "released": released }),
                )?;
            } else {
                println!("released {released} lease(s) of owner {owner}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
