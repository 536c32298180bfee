//! The queue's control documents (pause) and schedule documents (periodic jobs), see
//! `docs/queue.md` ("Named queues", "Pause and resume", "Periodic jobs"); re-exported
//! as [`crate::queue::format`].

/// The control document of one named queue, in `<collection>.meta`: `_id` is
/// [`control_id`] of the queue name. Workers stop claiming from a queue whose control
/// document says `paused: true`.
pub mod control {
    /// `_id` prefix of a control document: `control:<queue>` (the default queue is
    /// `control:default`).
    pub const ID_PREFIX: &str = "control:";
    /// The queue's name (`default` for the default queue).
    pub const QUEUE: &str = "queue";
    /// Whether workers may claim from the queue: `true` means no new claim starts.
    pub const PAUSED: &str = "paused";
    /// Server time of the last pause (`null` if never paused).
    pub const PAUSED_AT: &str = "paused_at";
    /// Server time of the last resume (`null` if never resumed).
    pub const RESUMED_AT: &str = "resumed_at";
    /// Who paused or resumed last (free text: a user, a host).
    pub const BY: &str = "by";
    /// Incremented by every pause and resume: a worker that sees a higher version than
    /// the one it acted on re-reads the document.
    pub const VERSION: &str = "version";
    /// Server time of the last change.
    pub const UPDATED_AT: &str = "updated_at";

    /// Every field of the control document, `_id` excepted.
    pub const ALL: [&str; 7] = [
        QUEUE, PAUSED, PAUSED_AT, RESUMED_AT, BY, VERSION, UPDATED_AT,
    ];
}

/// The `_id` of the control document of queue `queue` (the default queue's name is
/// `default`).
pub fn control_id(queue: &str) -> String {
    format!("{}{queue}", control::ID_PREFIX)
}

/// `_id` prefix of a named queue's options document in `<collection>.meta`:
/// `options:<queue>` (the default queue keeps `_id: "options"`, as in format 2).
pub const OPTIONS_ID_PREFIX: &str = "options:";

/// Suffix of the collection holding a queue collection's schedules: the schedules of
/// `jobs` are in `jobs.schedules`.
pub const SCHEDULES_SUFFIX: &str = ".schedules";

/// Fields of a schedule document (one per schedule, `_id` = the schedule's name, unique
/// per queue collection).
pub mod schedule_field {
    /// The schedule's name (also its `_id`).
    pub const ID: &str = "_id";
    /// The named queue its jobs go to (absent or `null`: the default queue).
    pub const QUEUE: &str = "queue";
    /// A cron expression (5 fields, or 6 with seconds first), evaluated in [`TIMEZONE`];
    /// absent for an interval schedule.
    pub const CRON: &str = "cron";
    /// The IANA time zone of [`CRON`] (`UTC`, `Europe/Paris`).
    pub const TIMEZONE: &str = "timezone";
    /// The interval of an interval schedule, in milliseconds; absent for a cron schedule.
    /// Ticks are at `anchor + k × every_ms`.
    pub const EVERY_MS: &str = "every_ms";
    /// The first tick of an interval schedule (server time at creation).
    pub const ANCHOR: &str = "anchor";
    /// The template of every job the schedule enqueues: the payload.
    pub const PAYLOAD: &str = "payload";
    /// The template's priority.
    pub const PRIORITY: &str = "priority";
    /// The template's `max_attempts` (`null`: the queue's default).
    pub const MAX_ATTEMPTS: &str = "max_attempts";
    /// Missed-tick policy: `skip` (enqueue only the latest due tick) or `catch_up`.
    pub const MISSED: &str = "missed";
    /// With `missed: "catch_up"`: most ticks enqueued after an outage (the latest ones).
    pub const CATCH_UP: &str = "catch_up";
    /// The last tick enqueued (a date); advanced by compare-and-set after the tick's
    /// job was inserted. Ticks at or before it are never enqueued again.
    pub const LAST_TICK: &str = "last_tick";
    /// Server time the schedule was created or last replaced.
    pub const UPDATED_AT: &str = "updated_at";

    /// Every field of the schedule document, `_id` excepted.
    pub const ALL: [&str; 12] = [
        QUEUE,
        CRON,
        TIMEZONE,
        EVERY_MS,
        ANCHOR,
        PAYLOAD,
        PRIORITY,
        MAX_ATTEMPTS,
        MISSED,
        CATCH_UP,
        LAST_TICK,
        UPDATED_AT,
    ];
}

/// The stored missed-tick policies ([`schedule_field::MISSED`]).
pub mod missed {
    /// Enqueue only the latest due tick.
    pub const SKIP: &str = "skip";
    /// Enqueue up to `catch_up` of the latest due ticks, oldest first.
    pub const CATCH_UP: &str = "catch_up";
}

/// The name under which the default queue is addressed (`--queue default`, the control
/// document `control:default`); its jobs carry no `queue` field.
pub const DEFAULT_QUEUE: &str = "default";
