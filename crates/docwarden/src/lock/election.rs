//! Leader election on a lock collection: the leadership of an election is the lease on
//! one resource (the election's name), and its **term** is that lease's fencing token.
//!
//! **Guarantee:** terms strictly increase per election, across resignation, expiry,
//! crashes and deletion of the election's document (the term is drawn from the lock
//! collection's token machinery: the `<name>.tokens` counter no TTL index touches, see
//! `lock/collection.rs`), so each term has at most one leader and a newer leader always has
//! a higher term. At most one leadership is valid at any instant by the server's clock
//! (a campaign takes over only a term that has certainly expired, with the clock's bound
//! and skew margin). The [`Leadership`] is kept alive by a [`super::Watchdog`] and reports
//! its loss ([`Leadership::lost`]) the moment a renewal is refused or its validity has
//! certainly lapsed.
//!
//! **Limits:** a leader that is paused past its term keeps believing it leads until its
//! watchdog runs again; nothing can stop its process from acting. Its *writes* can be
//! stopped: a [`Leadership`] is a [`super::Fenced`] holder, and writes made through
//! [`super::Fence::apply`] with it carry the term and are refused ([`super::FenceOutcome::Stale`])
//! once the target document has seen a newer term. Side effects outside fenced documents
//! (emails, calls to other services) are not protected. [`Election::observe`] reports
//! changes as the change stream delivers them, or at the polling interval where change
//! streams are refused: an observer sees a consistent sequence of leaders with increasing
//! terms, not necessarily every term.

use std::time::{Duration, Instant};

use mongodb::Database;
use mongodb::bson::{DateTime, doc};
use tracing::instrument;

use super::collection::{LockCollection, LockListFilter, LockOptions, LockRecord};
use super::fence::{FenceCondition, Fenced};
use super::lease::{Lease, Owner};
use super::wake::Wake;
use super::watchdog::{LostReason, Watchdog, WatchdogOptions};
use crate::clock::TimeSource;
use crate::error::Result;
use crate::token::FencingToken;
use crate::validate;

/// Options of an [`Election`], validated once by [`Election::new`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ElectionOptions {
    /// How long a term is valid without renewal (the lease's ttl); the leader's watchdog
    /// renews it every `term_ttl · renew_fraction`. Default 10 s.
    pub term_ttl: Duration,
    /// The leader's watchdog. Default: renew every third of the ttl.
    pub watchdog: WatchdogOptions,
    /// How often [`Observer::changed`] and a waiting [`Election::campaign`] re-read the
    /// election when no change arrives (a term that lapses without a resignation is not a
    /// change event; without change streams this is the only way). Default 250 ms.
    pub poll_interval: Duration,
    /// The options of the lock collection [`Election::open`] opens (backoff of a waiting
    /// campaign, `gc_after`, write concern, …). Default [`LockOptions::default`].
    /// [`Election::new`] takes a [`LockCollection`] that already has its own, and ignores
    /// this field.
    pub locks: LockOptions,
}

impl Default for ElectionOptions {
    fn default() -> Self {
        Self {
            term_ttl: Duration::from_secs(10),
            watchdog: WatchdogOptions::default(),
            poll_interval: Duration::from_millis(250),
            locks: LockOptions::default(),
        }
    }
}

impl ElectionOptions {
    /// Sets [`ElectionOptions::locks`], the options of the lock collection
    /// [`Election::open`] opens.
    pub fn locks(mut self, locks: LockOptions) -> Self {
        self.locks = locks;
        self
    }

    /// Sets [`ElectionOptions::term_ttl`].
    pub fn term_ttl(mut self, ttl: Duration) -> Self {
        self.term_ttl = ttl;
        self
    }

    /// Sets [`ElectionOptions::watchdog`].
    pub fn watchdog(mut self, watchdog: WatchdogOptions) -> Self {
        self.watchdog = watchdog;
        self
    }

    /// Sets [`ElectionOptions::poll_interval`].
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    fn validate(&self) -> Result<()> {
        validate::duration_ms("term ttl", self.term_ttl)?;
        validate::fraction("renew fraction", self.watchdog.renew_fraction)?;
        validate::duration_ms("poll interval", self.poll_interval)?;
        Ok(())
    }
}

/// The current leader of an election as stored.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Leader {
    /// The election's name.
    pub election: String,
    /// The leader's owner id.
    pub owner: String,
    /// The term (the leadership's fencing token); `None` while a campaign is between the
    /// steps of its slow path (its term is not committed yet).
    pub term: Option<FencingToken>,
    /// When the term expires unless the leader's watchdog renews it (server time).
    #[serde(serialize_with = "super::collection::as_rfc3339")]
    pub expires_at: Option<DateTime>,
    /// Whether the term has certainly expired (any campaign may take over now).
    pub expired: bool,
}

impl Leader {
    fn from_record(election: &str, r: LockRecord) -> Self {
        Self {
            election: election.to_owned(),
            owner: r.owner,
            term: r.token,
            expires_at: r.expires_at,
            expired: r.expired,
        }
    }
}

/// One election (a named resource in a lock collection); see the module docs.
#[derive(Clone, Debug)]
pub struct Election {
    locks: LockCollection,
    name: String,
    options: ElectionOptions,
}

impl Election {
    /// The election `name` held in `locks` (its terms come from `locks`' token counter).
    /// Only validates.
    ///
    /// # Errors
    /// [`crate::Error::InvalidInput`] for an empty or too long name or invalid options,
    /// among them a term ttl not longer than the time source's skew margin (such a term is
    /// never certainly valid: every leadership would be lost the moment it was won).
    pub fn new(locks: LockCollection, name: &str, options: ElectionOptions) -> Result<Self> {
        validate::name("election", name)?;
        options.validate()?;
        super::lease::ttl_ms("term ttl", options.term_ttl, locks.time().skew_margin_ms())?;
        Ok(Self {
            locks,
            name: name.to_owned(),
            options,
        })
    }

    /// The election `name` in the lock collection `collection` of `db`
    /// ([`LockCollection::open`] with [`ElectionOptions::locks`]: preflight checks and
    /// indexes).
    ///
    /// # Errors
    /// As [`Election::new`] and [`LockCollection::open`].
    pub async fn open(
        db: &Database,
        collection: &str,
        name: &str,
        time: TimeSource,
        options: ElectionOptions,
    ) -> Result<Self> {
        validate::name("election", name)?;
        options.validate()?;
        let locks = LockCollection::open(db, collection, time, options.locks.clone()).await?;
        Self::new(locks, name, options)
    }

    /// Every election of the lock collection `locks` with a leader (expired terms
    /// included, marked), by name: what `docwarden locks list` shows.
    ///
    /// # Errors
    /// A database error.
    pub async fn list(locks: &LockCollection) -> Result<Vec<Leader>> {
        Self::list_matching(locks, &LockListFilter::default()).await
    }

    /// The elections of `locks` with a leader that match `filter` (the leader's owner id,
    /// the election's name, at most `limit` of them), by name. A view that shows leaders
    /// should set a limit: [`Election::list`] reads one document per election.
    ///
    /// # Errors
    /// A database error.
    pub async fn list_matching(
        locks: &LockCollection,
        filter: &LockListFilter,
    ) -> Result<Vec<Leader>> {
        let records = locks.list(filter).await?;
        Ok(records
            .into_iter()
            .map(|r| {
                let name = r.resource.clone();
                Leader::from_record(&name, r)
            })
            .collect())
    }

    /// The election's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The lock collection the election lives in.
    pub fn locks(&self) -> &LockCollection {
        &self.locks
    }

    /// Campaigns once: becomes leader for a new term if there is no leader or its term has
    /// certainly expired. `Ok(None)` when another owner leads (contention is not an error).
    ///
    /// # Errors
    /// [`crate::Error::InvalidInput`] for an invalid owner id; a database error.
    #[instrument(skip(self, owner), fields(election = %self.name, owner = owner.id()))]
    pub async fn try_campaign(&self, owner: &Owner) -> Result<Option<Leadership>> {
        let lease = self
            .locks
            .try_acquire(owner, &self.name, self.options.term_ttl)
            .await?;
        lease.map(|l| self.lead(l)).transpose()
    }

    /// Campaigns until elected or `wait` has passed (`Ok(None)`); the campaign retries
    /// the moment the leader resigns (change streams, see [`LockCollection::acquire`]).
    ///
    /// # Errors
    /// As [`Election::try_campaign`].
    #[instrument(skip(self, owner), fields(election = %self.name, owner = owner.id()))]
    pub async fn campaign(&self, owner: &Owner, wait: Duration) -> Result<Option<Leadership>> {
        let lease = self
            .locks
            .acquire(owner, &self.name, self.options.term_ttl, wait)
            .await?;
        lease.map(|l| self.lead(l)).transpose()
    }

    fn lead(&self, lease: Lease) -> Result<Leadership> {
        tracing::info!(election = %self.name, term = lease.token.get(), "elected");
        let watchdog = Watchdog::start(
            self.locks.clone(),
            lease.clone(),
            self.options.term_ttl,
            self.options.watchdog.clone(),
        )?;
        Ok(Leadership {
            election: self.name.clone(),
            term: lease.token,
            watchdog,
        })
    }

    /// The current leader as stored (possibly with an expired term), or `None` if nobody
    /// leads (never elected, resigned, or the document was collected).
    ///
    /// # Errors
    /// A database error.
    pub async fn leader(&self) -> Result<Option<Leader>> {
        let records = self
            .locks
            .list(&LockListFilter::default().resource(self.name.as_str()))
            .await?;
        Ok(records
            .into_iter()
            .next()
            .map(|r| Leader::from_record(&self.name, r)))
    }

    /// The last term handed out (even if its leader resigned), or `None` if there is no
    /// election document (never elected, or collected: the next term is still higher).
    ///
    /// # Errors
    /// A database error; [`crate::Error::Malformed`] for a hand-edited term.
    pub async fn last_term(&self) -> Result<Option<FencingToken>> {
        self.locks.last_token(&self.name).await
    }

    /// Observes the election: [`Observer::changed`] yields each new view of the leader.
    pub fn observe(&self) -> Observer {
        let any_change = doc! { "operationType": { "$in": ["insert", "update", "replace", "delete", "invalidate"] } };
        Observer {
            wake: Wake::new(self.locks.collection(), self.name.as_str(), any_change),
            election: self.clone(),
            last: None,
            started: false,
        }
    }
}

/// A stream of the leader of one election ([`Election::observe`]): change streams where
/// the server offers them, polling otherwise (detected at run time).
#[derive(Debug)]
pub struct Observer {
    election: Election,
    wake: Wake,
    last: Option<Option<Leader>>,
    started: bool,
}

impl Observer {
    /// The next view of the leader that differs from the last one returned (the first call
    /// returns the current view at once): `Some(leader)` with its term and expiry, or
    /// `None` when nobody leads. A view changes on a new term, a resignation, a renewal
    /// (new expiry) and when the term certainly expires.
    ///
    /// # Errors
    /// A database error.
    pub async fn changed(&mut self) -> Result<Option<Leader>> {
        loop {
            if !self.started {
                // Open the stream before the first read, so no change after it is missed.
                self.wake.arm().await;
                self.started = true;
            } else if self.wake.arm().await {
                // Re-opened after an interruption: read again before waiting.
            } else {
                self.wake.wait(self.election.options.poll_interval).await;
            }
            let now = self.election.leader().await?;
            if self.last.as_ref() != Some(&now) {
                self.last = Some(now.clone());
                return Ok(now);
            }
        }
    }

    /// Whether it listens to a change stream (`false`: it polls).
    pub fn is_listening(&self) -> bool {
        self.wake.is_listening()
    }
}

/// The leadership of one term, kept alive by a watchdog ([`Election::campaign`]).
/// Fence every write made as leader with it ([`super::Fence::apply`]): the write carries
/// the term and is refused once a newer term wrote to the target document.
#[derive(Debug)]
pub struct Leadership {
    election: String,
    term: FencingToken,
    watchdog: Watchdog,
}

impl Leadership {
    /// The election's name.
    pub fn election(&self) -> &str {
        &self.election
    }

    /// The term: this leadership's fencing token.
    pub fn term(&self) -> FencingToken {
        self.term
    }

    /// The term's lease as last renewed, or `None` once leadership is lost.
    pub fn lease(&self) -> Option<Lease> {
        self.watchdog.lease()
    }

    /// Until when leadership is certainly valid by the local monotonic clock, or `None`
    /// once it is lost (see [`Watchdog::valid_until`]). Act as leader only before it, and
    /// fence the writes anyway.
    pub fn valid_until(&self) -> Option<Instant> {
        self.watchdog.valid_until()
    }

    /// Whether leadership is lost, or no longer certainly valid by the local monotonic
    /// clock (see [`Watchdog::is_lost`]).
    pub fn is_lost(&self) -> bool {
        self.watchdog.is_lost()
    }

    /// Resolves as soon as leadership is lost (use it in a `select!` next to the leader's
    /// work): the term was taken over, or renewals failed until it lapsed.
    pub async fn lost(&self) -> LostReason {
        self.watchdog.lost().await
    }

    /// Resigns: stops renewing and frees the election at once (the next campaign gets a
    /// higher term).
    ///
    /// # Errors
    /// [`crate::Error::LeaseLost`] if leadership was already lost; a database error.
    pub async fn resign(self) -> Result<()> {
        tracing::info!(election = %self.election, term = self.term.get(), "resigning");
        self.watchdog.release().await
    }

    /// Stops renewing without resigning: the term lapses by itself after its ttl (what a
    /// crash does; tests use it).
    pub fn abandon(self) {
        self.watchdog.stop();
    }
}

impl Fenced for Leadership {
    fn fence_condition(&self) -> FenceCondition {
        FenceCondition::Token(self.term.get())
    }
}
