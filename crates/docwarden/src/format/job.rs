//! The job document's format: its field names and its states (see `docs/queue.md`),
//! re-exported as [`crate::queue::format`].

/// Field names of the job document (see `docs/queue.md`).
pub mod field {
    /// The job id (an ObjectId).
    pub const ID: &str = "_id";
    /// The job's [`super::JobState`], as [`super::JobState::as_str`].
    pub const STATE: &str = "state";
    /// What the handler gets.
    pub const PAYLOAD: &str = "payload";
    /// Higher is claimed first.
    pub const PRIORITY: &str = "priority";
    /// Server time from which the job may be claimed.
    pub const RUN_AT: &str = "run_at";
    /// How many times the job was claimed.
    pub const ATTEMPTS: &str = "attempts";
    /// How many claims the job may have before it is dead.
    pub const MAX_ATTEMPTS: &str = "max_attempts";
    /// The claim's sub-document (keys in [`lease`]), present while running.
    pub const LEASE: &str = "lease";
    /// The claim token's path (`lease.token`).
    pub const LEASE_TOKEN: &str = "lease.token";
    /// The claim expiry's path (`lease.until`).
    pub const LEASE_UNTIL: &str = "lease.until";
    /// The claim owner's path (`lease.owner`).
    pub const LEASE_OWNER: &str = "lease.owner";
    /// Why the last attempt failed.
    pub const LAST_ERROR: &str = "last_error";
    /// What the handler returned.
    pub const RESULT: &str = "result";
    /// At most one unfinished job per dedupe key.
    pub const DEDUPE_KEY: &str = "dedupe_key";
    /// Server time the job was enqueued.
    pub const CREATED_AT: &str = "created_at";
    /// Server time of the last transition.
    pub const UPDATED_AT: &str = "updated_at";
    /// Server time the job reached a finished state.
    pub const FINISHED_AT: &str = "finished_at";
    /// The claim partition (an integer in `0..partitions`), drawn at enqueue: batch
    /// claimers read one partition at a time, so they do not all race for the head job.
    /// Jobs stored without it (format 1) are claimable as partition `null`.
    pub const PARTITION: &str = "partition";
    /// How many times a handler snoozed the job ("run again at T", the attempt given
    /// back): `$inc 1` per snooze.
    pub const SNOOZES: &str = "snoozes";
    /// How many times the job's lease expired and the sweep took it over (`$inc 1` per
    /// rescue; absent means 0).
    pub const STALLS: &str = "stalls";
    /// After this many stalls the sweep moves the job to `dead` instead of `retrying`
    /// (absent: no limit). Stored per job at enqueue from the queue's `max_stalls`.
    pub const MAX_STALLS: &str = "max_stalls";
    /// What the handler last reported as its progress (any BSON, size-limited), written
    /// under the claim's fence.
    pub const PROGRESS: &str = "progress";
    /// `<dedupe key>@<window start, ms since the epoch>`: at most one job per key per
    /// uniqueness window, finished jobs included (unique index over every state).
    pub const UNIQUE_SLOT: &str = "unique_slot";
    /// A follow-up run requested while the job was running (`{payload}`): the
    /// completion turns the job back into `ready` with this payload instead of
    /// `succeeded`.
    pub const FOLLOW_UP: &str = "follow_up";
    /// How many follow-up runs the job has started (`$inc 1` per completion that
    /// consumed a [`FOLLOW_UP`]).
    pub const FOLLOW_UPS: &str = "follow_ups";

    /// The claim whose final transition applied last, and which one it was:
    /// `{token, by}` (keys in [`settled`]), written in the same fenced update as the
    /// transition and left alone by claims and sweeps. It is the proof a read-back uses
    /// when the job was claimed again between a bulk of transitions and its read-back
    /// (the `lease` then shows the new claim). Absent on jobs no worker settled since
    /// this field was introduced.
    pub const SETTLED: &str = "settled";
    /// The settling claim's token's path (`settled.token`).
    pub const SETTLED_TOKEN: &str = "settled.token";
    /// The settling transition's path (`settled.by`).
    pub const SETTLED_BY: &str = "settled.by";

    /// Where a windowed job keeps its key in a test's control only (the uniqueness
    /// window's safeguard off, so it has no [`UNIQUE_SLOT`]); never written otherwise.
    #[doc(hidden)]
    pub const CONTROL_UNIQUE_KEY: &str = "control_unique_key";

    /// Keys inside the [`FOLLOW_UP`] sub-document.
    pub mod follow_up {
        /// The payload of the follow-up run.
        pub const PAYLOAD: &str = "payload";
    }

    /// The named queue the job belongs to (format 3). Absent (or `null`) for the default
    /// queue, so jobs of formats 1 and 2 stay in the default queue; a string for a named
    /// queue. Every claim and sweep matches it by equality.
    pub const QUEUE: &str = "queue";
    /// The schedule that enqueued the job (a periodic job, format 3); absent otherwise.
    pub const SCHEDULE: &str = "schedule";
    /// The schedule tick the job was enqueued for (a date, the tick's nominal time);
    /// absent for jobs not enqueued by a schedule.
    pub const TICK: &str = "tick";

    /// The job's limits (`queue/limit.rs`, `docs/queue.md` "Limits and fairness"): a
    /// sub-document `{key, queue, rate}`, absent on a job without limits. A job that has
    /// it is claimed only after the permits and the rate start it names were granted.
    pub const LIMITS: &str = "limits";
    /// Its concurrency key ([`limits::KEY`]).
    pub const LIMITS_KEY: &str = "limits.key";
    /// Its rate key ([`limits::RATE`]).
    pub const LIMITS_RATE: &str = "limits.rate";
    /// When its last start was admitted ([`limits::ADMITTED_AT`]).
    pub const LIMITS_ADMITTED_AT: &str = "limits.admitted_at";

    /// Every field name and dotted path of the job document docwarden writes, `_id`
    /// excepted (it is MongoDB's, not docwarden's), and [`QUEUE`] excepted: `queue` is
    /// also the name of the module in command names, metric labels and workload names,
    /// so the no-literal scan of the CLI cannot forbid the word; code that reads the
    /// field still goes through [`QUEUE`].
    pub const ALL: [&str; 33] = [
        STATE,
        PAYLOAD,
        PRIORITY,
        RUN_AT,
        ATTEMPTS,
        MAX_ATTEMPTS,
        LEASE,
        LEASE_TOKEN,
        LEASE_UNTIL,
        LEASE_OWNER,
        LAST_ERROR,
        RESULT,
        DEDUPE_KEY,
        CREATED_AT,
        UPDATED_AT,
        FINISHED_AT,
        PARTITION,
        SNOOZES,
        STALLS,
        MAX_STALLS,
        PROGRESS,
        UNIQUE_SLOT,
        FOLLOW_UP,
        FOLLOW_UPS,
        SCHEDULE,
        TICK,
        LIMITS,
        LIMITS_KEY,
        LIMITS_RATE,
        LIMITS_ADMITTED_AT,
        SETTLED,
        SETTLED_TOKEN,
        SETTLED_BY,
    ];

    /// Keys inside the [`LIMITS`] sub-document.
    pub mod limits {
        /// The concurrency key (string): at most N jobs of this key run at once, N being
        /// the `permits` of the semaphore document `key:<key>` in `<queue>.limits`.
        pub const KEY: &str = "key";
        /// `true`: the job counts against the queue's own concurrency limit (the
        /// semaphore document `queue` in `<queue>.limits`).
        pub const QUEUE: &str = "queue";
        /// The rate key (string): at most `limit` starts per `interval_ms` of this key,
        /// counted in the document `_id: <rate key>` of `<queue>.rates`.
        pub const RATE: &str = "rate";
        /// Server time (`$$NOW`) the rate document admitted the job's last start, written
        /// by the claim that followed.
        pub const ADMITTED_AT: &str = "admitted_at";
    }

    /// Keys inside the [`SETTLED`] sub-document.
    pub mod settled {
        /// The token of the claim whose transition applied.
        pub const TOKEN: &str = "token";
        /// Which transition: `complete`, `fail`, `release`, `snooze` or `cancel`.
        pub const BY: &str = "by";
    }

    /// Keys inside the [`LEASE`] sub-document.
    pub mod lease {
        /// The worker that holds (or last held) the job.
        pub const OWNER: &str = "owner";
        /// The claim token (a `crate::queue::JobLease::token`).
        pub const TOKEN: &str = "token";
        /// The claim's expiry, server time.
        pub const UNTIL: &str = "until";
    }
}

/// Where a job is in its life.
///
/// ```text
/// ready ──claim──▶ running ──complete──▶ succeeded
///   ▲                │ │ └──fail (attempts < max)──▶ retrying ──claim──▶ running
///   │                │ └────fail (attempts = max)──▶ dead
///   ├──release───────┤      lease expired ──▶ retrying (or dead at max attempts or
///   ├──snooze────────┤                          past max_stalls)
///   └──complete with a follow_up requested (running ──▶ ready, new payload)
/// any unfinished ──cancel──▶ cancelled;   dead ──retry──▶ ready
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum JobState {
    /// Waiting to be claimed once `run_at` has passed.
    Ready,
    /// Claimed: a worker holds the lease.
    Running,
    /// Completed; `result` holds what the handler returned.
    Succeeded,
    /// Failed (or its lease expired) and waits for `run_at` to be tried again.
    Retrying,
    /// Failed `max_attempts` times, or malformed; `last_error` says why.
    Dead,
    /// Cancelled by an operator or its worker.
    Cancelled,
}

impl JobState {
    /// Every state, in display order.
    pub const ALL: [JobState; 6] = [
        JobState::Ready,
        JobState::Running,
        JobState::Succeeded,
        JobState::Retrying,
        JobState::Dead,
        JobState::Cancelled,
    ];

    /// The stored string.
    pub const fn as_str(self) -> &'static str {
        match self {
            JobState::Ready => "ready",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Retrying => "retrying",
            JobState::Dead => "dead",
            JobState::Cancelled => "cancelled",
        }
    }

    /// Parses a stored string.
    pub fn parse(s: &str) -> Option<JobState> {
        JobState::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Whether the job will never run again on its own (succeeded, dead, cancelled).
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Dead | JobState::Cancelled
        )
    }
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The claimable states as the bounds of one string range, `[ready, retrying]`: the
/// partial filter of the partition claim index is `{state: {$gte: CLAIMABLE_LOW, $lte:
/// CLAIMABLE_HIGH}}`, a range every server can prove an equality on `ready` or
/// `retrying` implies (an `$in` partial filter is not provable everywhere). No other
/// state sorts inside the range (checked by a unit test).
pub const CLAIMABLE_LOW: &str = JobState::Ready.as_str();
/// The upper bound of the claimable range, see [`CLAIMABLE_LOW`].
pub const CLAIMABLE_HIGH: &str = JobState::Retrying.as_str();

/// The state names as stored, in [`JobState::ALL`] order.
pub const STATES: [&str; 6] = [
    JobState::Ready.as_str(),
    JobState::Running.as_str(),
    JobState::Succeeded.as_str(),
    JobState::Retrying.as_str(),
    JobState::Dead.as_str(),
    JobState::Cancelled.as_str(),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_claimable_range_holds_exactly_the_claimable_states() {
        for s in JobState::ALL {
            let inside = (CLAIMABLE_LOW..=CLAIMABLE_HIGH).contains(&s.as_str());
            let claimable = matches!(s, JobState::Ready | JobState::Retrying);
            assert_eq!(inside, claimable, "{s}");
        }
    }

    #[test]
    fn the_limits_counter_suffix_is_the_semaphore_counter_of_the_limits_collection() {
        assert_eq!(
            limit::TOKENS_COLLECTION_SUFFIX,
            format!(
                "{}{}",
                limit::COLLECTION_SUFFIX,
                crate::lock::format::TOKENS_SUFFIX
            )
        );
    }
}

/// The rate documents of a queue, in `<queue>.rates` (`queue/rate.rs`).
pub mod rate {
    /// Suffix of the rate collection's name after the queue collection's.
    pub const COLLECTION_SUFFIX: &str = ".rates";
    /// The document's `_id`: the rate key.
    pub const ID: &str = "_id";
    /// Starts allowed per interval (int64).
    pub const LIMIT: &str = "limit";
    /// The interval in milliseconds (int64).
    pub const INTERVAL_MS: &str = "interval_ms";
    /// The admitted starts, `[{at, id}]`; an admission drops those with `at ≤ $$NOW −
    /// interval_ms` and appends one only while fewer than `limit` remain.
    pub const STARTS: &str = "starts";
    /// Every field of a rate document, `_id` excepted.
    pub const ALL: [&str; 3] = [LIMIT, INTERVAL_MS, STARTS];

    /// Fields of one element of `starts`.
    pub mod start {
        /// Server time (`$$NOW`) of the admission.
        pub const AT: &str = "at";
        /// The admission's random id (taken back by it after a failed claim).
        pub const ID: &str = "id";
    }
}

/// The concurrency semaphores of a queue, in `<queue>.limits` (a
/// [`crate::lock::Semaphore`]; document fields in [`super::lock::semaphore`]).
pub mod limit {
    /// Suffix of the semaphore collection's name after the queue collection's.
    pub const COLLECTION_SUFFIX: &str = ".limits";
    /// Suffix of that semaphore's fencing-token counter after the queue collection's
    /// name: [`COLLECTION_SUFFIX`] and [`crate::lock::format::TOKENS_SUFFIX`].
    pub const TOKENS_COLLECTION_SUFFIX: &str = ".limits.tokens";
    /// The semaphore resource of a concurrency key is this prefix and the key.
    pub const KEY_PREFIX: &str = "key:";
    /// The semaphore resource of the default queue's own concurrency limit; a named
    /// queue's is this, `:` and its name.
    pub const QUEUE_RESOURCE: &str = "queue";
}

/// The suffixes of the side collections a queue collection `<name>` keeps next to it:
/// `<name>.meta` (options and control documents), `<name>.schedules`, `<name>.rates`,
/// `<name>.limits` (a [`crate::lock::Semaphore`]) and that semaphore's counter
/// `<name>.limits.tokens`. A queue collection's own name may not end in any of them
/// ([`crate::validate::queue_collection_name`]): queue `jobs.meta` would keep its jobs in
/// queue `jobs`'s options collection, and queue `jobs` its options in queue `jobs.meta`'s
/// jobs collection.
pub const SIDE_COLLECTION_SUFFIXES: [&str; 5] = [
    crate::queue::meta::COLLECTION_SUFFIX,
    crate::format::schedule::SCHEDULES_SUFFIX,
    rate::COLLECTION_SUFFIX,
    limit::COLLECTION_SUFFIX,
    limit::TOKENS_COLLECTION_SUFFIX,
];
