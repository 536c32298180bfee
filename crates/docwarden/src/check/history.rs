//! Recording what a run did: one [`Event`] per operation, on a monotonic clock.
//!
//! A history can also stream itself (see [`History::streaming`]): every operation recorded
//! with [`History::record`] is announced as an [`Entry::Invoke`] when it starts and
//! reported as an [`Entry::Complete`] when it ends, so that a reader in another process
//! learns of an operation even if the recording process dies before it completes (the
//! reader then records it as [`OpOutcome::Indeterminate`], Jepsen's `:info`). An operation
//! whose future is dropped before it completes (an aborted task) is recorded as
//! indeterminate too. Limits: times are microseconds on one machine's monotonic clock;
//! histories of several processes share a time base only if they share an origin (see
//! [`History::starting_at`]).

use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// How an operation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpOutcome {
    /// It took effect (or returned what it read).
    Ok,
    /// It certainly did not take effect (refused, contention, stale token).
    Failed,
    /// It may or may not have taken effect (timeout, connection lost).
    Indeterminate,
}

/// One recorded operation.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Event {
    /// The simulated process (worker) that made it.
    pub process: u32,
    /// What it was: `acquire`, `write`, `release`, `claim`, `complete`, `apply`, `fault`…
    pub op: String,
    /// The resource, job or document it concerned.
    pub key: String,
    /// Microseconds since the run started, when the call began.
    pub start_us: u64,
    /// Microseconds since the run started, when the call returned.
    pub end_us: u64,
    /// How it ended.
    pub outcome: OpOutcome,
    /// The fencing token involved, if any.
    pub token: Option<i64>,
    /// A value written or read, if any.
    pub value: Option<i64>,
    /// Free text: the error, the arguments.
    pub detail: String,
    /// Where the operation lies in the server's order, if it recorded that
    /// ([`super::order`]): a holder's stretch between its two marker writes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub span: Option<super::order::Span>,
}

impl Event {
    /// An event with the given identity and times; outcome `Ok`, no token or value.
    pub fn new(process: u32, op: &str, key: &str, start_us: u64, end_us: u64) -> Self {
        Self {
            process,
            op: op.to_owned(),
            key: key.to_owned(),
            start_us,
            end_us,
            outcome: OpOutcome::Ok,
            token: None,
            value: None,
            detail: String::new(),
            span: None,
        }
    }

    /// Sets the outcome.
    pub fn outcome(mut self, outcome: OpOutcome) -> Self {
        self.outcome = outcome;
        self
    }
    /// Sets the token.
    pub fn token(mut self, token: i64) -> Self {
        self.token = Some(token);
        self
    }
    /// Sets the value.
    pub fn value(mut self, value: i64) -> Self {
        self.value = Some(value);
        self
    }
    /// Sets the detail.
    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = detail.into();
        self
    }
    /// Sets the span in the server's order.
    pub fn span(mut self, span: super::order::Span) -> Self {
        self.span = Some(span);
        self
    }
}

/// One line of a streamed history (see [`History::streaming`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Entry {
    /// An operation started; its [`Entry::Complete`] carries the same `id`.
    Invoke {
        /// Identifies the operation within its history.
        id: u64,
        /// The event as known at the start (outcome, end and details not yet known).
        event: Event,
    },
    /// An event: an operation that completed (`id` of its invoke), or one pushed whole.
    Complete {
        /// The id of the operation's [`Entry::Invoke`], if it was announced.
        id: Option<u64>,
        /// The event.
        event: Event,
    },
}

/// Where a streaming history sends its entries.
type Sink = Box<dyn Fn(&Entry) + Send + Sync>;

/// A thread-safe recorder of events for one run.
pub struct History {
    started: Instant,
    events: Mutex<Vec<Event>>,
    next_id: AtomicU64,
    sink: Option<Sink>,
    /// The outcome of an operation dropped before it completed.
    abandoned: OpOutcome,
}

impl std::fmt::Debug for History {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("History")
            .field("started", &self.started)
            .field("events", &self.len())
            .field("streaming", &self.sink.is_some())
            .finish()
    }
}

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

/// An operation in flight: recorded as indeterminate if dropped before it completes.
struct InFlight<'a> {
    history: &'a History,
    id: u64,
    event: Option<Event>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            let mut event = event
                .outcome(self.history.abandoned)
                .detail("abandoned mid-operation");
            event.end_us = self.history.now_us();
            self.history.complete(Some(self.id), event);
        }
    }
}

impl History {
    /// An empty history whose clock starts now.
    pub fn new() -> Self {
        Self::starting_at(Instant::now())
    }

    /// An empty history whose clock started at `origin` (a history in another process of
    /// the same run passes the run's origin, so that their times compare).
    pub fn starting_at(origin: Instant) -> Self {
        Self {
            started: origin,
            events: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(0),
            sink: None,
            abandoned: OpOutcome::Indeterminate,
        }
    }

    /// A control's history: an operation dropped before it completed (its task aborted)
    /// is recorded with `outcome` instead of [`OpOutcome::Indeterminate`]. With
    /// [`OpOutcome::Failed`] it records what a client that takes "no reply" for "not
    /// applied" believes; the checkers must then find the writes that landed all the same.
    #[doc(hidden)]
    #[must_use]
    pub fn abandoned_as(mut self, outcome: OpOutcome) -> Self {
        self.abandoned = outcome;
        self
    }

    /// An empty history whose clock started at `origin` and which, besides recording,
    /// hands every [`Entry`] to `sink` as it happens: invokes when [`History::record`]
    /// starts an operation, completions when it ends or when an event is pushed.
    pub fn streaming(origin: Instant, sink: impl Fn(&Entry) + Send + Sync + 'static) -> Self {
        Self {
            sink: Some(Box::new(sink)),
            ..Self::starting_at(origin)
        }
    }

    /// When the history's clock started.
    pub fn origin(&self) -> Instant {
        self.started
    }

    /// Microseconds since the run started.
    pub fn now_us(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Adds an event.
    pub fn push(&self, event: Event) {
        self.complete(None, event);
    }

    fn complete(&self, id: Option<u64>, event: Event) {
        if let Some(sink) = &self.sink {
            sink(&Entry::Complete {
                id,
                event: event.clone(),
            });
        }
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(event);
    }

    /// Runs `fut`, records it as `op` on `key` by `process`, and returns its output. The
    /// `classify` closure turns the output into the event's outcome, token, value and detail.
    /// If `fut` is dropped before it completes, the operation is recorded as indeterminate.
    pub async fn record<T, F>(
        &self,
        process: u32,
        op: &str,
        key: &str,
        fut: F,
        classify: impl FnOnce(&T, Event) -> Event,
    ) -> T
    where
        F: Future<Output = T>,
    {
        self.record_invoked(Event::new(process, op, key, 0, 0), fut, classify)
            .await
    }

    /// As [`History::record`], for an operation whose fencing token is known before it
    /// starts (a release or renewal of a lease): the invoke carries `token`, so that an
    /// operation cut short (its process killed, its future dropped) is recorded with it —
    /// as that lease's operation, not as one of any lease of its process.
    pub async fn record_with_token<T, F>(
        &self,
        process: u32,
        op: &str,
        key: &str,
        token: i64,
        fut: F,
        classify: impl FnOnce(&T, Event) -> Event,
    ) -> T
    where
        F: Future<Output = T>,
    {
        self.record_invoked(
            Event::new(process, op, key, 0, 0).token(token),
            fut,
            classify,
        )
        .await
    }

    /// Records `fut` as `invoked` (its times set here); `classify` starts from `invoked`.
    async fn record_invoked<T, F>(
        &self,
        mut invoked: Event,
        fut: F,
        classify: impl FnOnce(&T, Event) -> Event,
    ) -> T
    where
        F: Future<Output = T>,
    {
        let start = self.now_us();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        invoked.start_us = start;
        invoked.end_us = start;
        if let Some(sink) = &self.sink {
            sink(&Entry::Invoke {
                id,
                event: invoked.clone(),
            });
        }
        let mut in_flight = InFlight {
            history: self,
            id,
            event: Some(invoked.clone()),
        };
        let out = fut.await;
        in_flight.event = None;
        invoked.end_us = self.now_us();
        let event = classify(&out, invoked);
        self.complete(Some(id), event);
        out
    }

    /// A copy of every event so far, ordered by start time.
    pub fn events(&self) -> Vec<Event> {
        let mut events = self
            .events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        events.sort_by_key(|e| (e.start_us, e.end_us));
        events
    }

    /// How many events were recorded.
    pub fn len(&self) -> usize {
        self.events.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn records_in_start_order_with_outcomes() {
        let h = History::new();
        let v = h
            .record(1, "write", "r", async { 7 }, |out, e| {
                e.value(*out).token(3)
            })
            .await;
        assert_eq!(v, 7);
        h.push(Event::new(2, "acquire", "r", u64::MAX - 1, u64::MAX).outcome(OpOutcome::Failed));
        let events = h.events();
        assert_eq!(events.len(), 2);
        assert_eq!(events[1].op, "acquire", "ordered by start time");
        assert_eq!(events[0].value, Some(7));
        assert_eq!(events[0].token, Some(3));
        assert!(events[0].end_us >= events[0].start_us);
    }

    #[tokio::test]
    async fn streams_invokes_and_completions() {
        let lines = std::sync::Arc::new(Mutex::new(Vec::new()));
        let sink = std::sync::Arc::clone(&lines);
        let h = History::streaming(Instant::now(), move |entry| {
            sink.lock().expect("sink").push(entry.clone());
        });
        h.record(4, "write", "r", async { 1 }, |_, e| e.token(9))
            .await;
        h.push(Event::new(4, "claim", "j", 1, 1));
        let entries: Vec<Entry> = lines.lock().expect("lines").clone();
        assert_eq!(entries.len(), 3);
        assert!(matches!(&entries[0], Entry::Invoke { id: 0, event } if event.op == "write"));
        assert!(
            matches!(&entries[1], Entry::Complete { id: Some(0), event } if event.token == Some(9))
        );
        assert!(matches!(&entries[2], Entry::Complete { id: None, event } if event.op == "claim"));
    }

    /// A release cut short by a kill must stay that lease's release: the invoke, all a
    /// reader in another process gets of it, carries the token.
    #[tokio::test]
    async fn an_operation_recorded_with_its_token_streams_the_token_in_its_invoke() {
        let lines = std::sync::Arc::new(Mutex::new(Vec::new()));
        let sink = std::sync::Arc::clone(&lines);
        let h = History::streaming(Instant::now(), move |entry| {
            sink.lock().expect("sink").push(entry.clone());
        });
        let pending =
            h.record_with_token(4, "release", "r", 7, std::future::pending::<()>(), |_, e| e);
        let timed_out = tokio::time::timeout(std::time::Duration::from_millis(10), pending).await;
        assert!(timed_out.is_err());
        let entries: Vec<Entry> = lines.lock().expect("lines").clone();
        assert!(
            matches!(&entries[0], Entry::Invoke { event, .. } if event.token == Some(7)),
            "{entries:?}"
        );
        assert_eq!(h.events()[0].token, Some(7));
        assert_eq!(h.events()[0].outcome, OpOutcome::Indeterminate);
        h.record_with_token(4, "renew", "r", 8, async {}, |_, e| e)
            .await;
        assert_eq!(h.events()[1].token, Some(8));
    }

    #[tokio::test]
    async fn a_control_history_records_an_abandoned_operation_as_failed() {
        let h = History::new().abandoned_as(OpOutcome::Failed);
        let pending = h.record(1, "write", "r", std::future::pending::<()>(), |_, e| e);
        let timed_out = tokio::time::timeout(std::time::Duration::from_millis(10), pending).await;
        assert!(timed_out.is_err());
        assert_eq!(h.events()[0].outcome, OpOutcome::Failed);
    }

    #[tokio::test]
    async fn an_abandoned_operation_is_indeterminate() {
        let h = History::new();
        let pending = h.record(1, "write", "r", std::future::pending::<()>(), |_, e| e);
        let timed_out = tokio::time::timeout(std::time::Duration::from_millis(10), pending).await;
        assert!(timed_out.is_err());
        let events = h.events();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].outcome, OpOutcome::Indeterminate);
        assert_eq!(events[0].op, "write");
    }
}
