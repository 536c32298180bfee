//! Recording what a run did: one [`Event`] per operation, on a monotonic clock.

use std::future::Future;
use std::sync::Mutex;
use std::time::Instant;

/// How an operation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
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
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
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
}

/// A thread-safe recorder of events for one run.
#[derive(Debug)]
pub struct History {
    started: Instant,
    events: Mutex<Vec<Event>>,
}

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

impl History {
    /// An empty history whose clock starts now.
    pub fn new() -> Self {
        Self {
            started: Instant::now(),
            events: Mutex::new(Vec::new()),
        }
    }

    /// Microseconds since the run started.
    pub fn now_us(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Adds an event.
    pub fn push(&self, event: Event) {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(event);
    }

    /// Runs `fut`, records it as `op` on `key` by `process`, and returns its output. The
    /// `classify` closure turns the output into the event's outcome, token, value and detail.
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
        let start = self.now_us();
        let out = fut.await;
        let event = classify(&out, Event::new(process, op, key, start, self.now_us()));
        self.push(event);
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
}
