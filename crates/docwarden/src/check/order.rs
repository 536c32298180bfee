//! The server's order: a time base the clocks under test cannot touch.
//!
//! A checker that judges *when* holders held something (a permit, a job's place, a read
//! or write lock) must not read the holders' own clocks: those are the clocks a run
//! skews, steps and drifts, so they can hide an overlap or invent one. Instead a holder
//! makes a small write right after it entered (a marker) and another right before it
//! confirms that its lease is still certainly valid, and records each write's
//! `operationTime` — the server's cluster time, a [`Stamp`]. The [`Span`] between the two
//! stamps lies inside the holding in real time, whatever any client clock says.
//!
//! **Why the order is sound.** A reply's `operationTime` is a value of the server's
//! cluster clock read while the command ran (MongoDB: the timestamp of the write's oplog
//! entry; the embedded server: the latest cluster time it minted, read as it answers),
//! and that clock only moves forward. So `a < b` for the stamps of two commands means the
//! first was read before the second: the first command was *sent* before the second's
//! reply *arrived*. Two spans with `a.from < b.to` and `b.from < a.to` therefore share a
//! real instant at which both holders were inside. Equal stamps (no write minted a new
//! time between the two reads) order nothing: spans that only touch do not overlap.
//!
//! **Limits:** one replica set (cluster time is not comparable across deployments); a
//! standalone server sends no `operationTime`, so nothing is recorded there. A holder that
//! cannot confirm its lease claims no span: what it did past that point is judged by the
//! other checks (fencing), not by this order.

use std::fmt;

/// One reading of the server's cluster clock (a BSON timestamp: seconds, increment),
/// totally ordered.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct Stamp(u64);

impl Stamp {
    /// The stamp of a BSON timestamp's `time` (seconds) and `increment`.
    pub fn new(time: u32, increment: u32) -> Self {
        Self((u64::from(time) << 32) | u64::from(increment))
    }

    /// The stamp of a reply's `operationTime`.
    pub fn of(ts: mongodb::bson::Timestamp) -> Self {
        Self::new(ts.time, ts.increment)
    }

    /// The seconds part.
    pub fn time(self) -> u32 {
        u32::try_from(self.0 >> 32).unwrap_or(u32::MAX)
    }

    /// The increment within the second.
    pub fn increment(self) -> u32 {
        u32::try_from(self.0 & u64::from(u32::MAX)).unwrap_or(u32::MAX)
    }
}

impl fmt::Display for Stamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.time(), self.increment())
    }
}

/// A stretch of the server's order, from one stamp to a later one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Span {
    /// The stamp read first.
    pub from: Stamp,
    /// The stamp read last.
    pub to: Stamp,
}

impl Span {
    /// The span `from..to`; `None` unless `from < to` (an empty span holds nothing).
    pub fn new(from: Stamp, to: Stamp) -> Option<Self> {
        (from < to).then_some(Self { from, to })
    }

    /// Whether both spans certainly share an instant (equal stamps order nothing, so spans
    /// that only touch do not overlap).
    pub fn overlaps(&self, other: &Span) -> bool {
        self.from < other.to && other.from < self.to
    }
}

impl fmt::Display for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}–{}", self.from, self.to)
    }
}

/// How crowded a set of spans was ([`crowding`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Crowding {
    /// Most spans certainly overlapping at one instant.
    pub most: usize,
    /// Spans that started while `capacity` others were open (each counted once).
    pub beyond: u64,
}

/// Counts the spans that began while `capacity` others certainly were open: the sweep of a
/// semaphore's permits, a key's concurrency limit (`capacity` N) or a lock's writers
/// (`capacity` 1). Generic over the order, so that a recorder with another trusted order
/// (one process's monotonic clock) can use it; `(from, to)` pairs with `from >= to` are
/// ignored. At equal instants ends come first: intervals are half-open, and equal stamps
/// order nothing.
pub fn crowding<T: Ord + Copy>(
    intervals: impl IntoIterator<Item = (T, T)>,
    capacity: usize,
) -> Crowding {
    let mut events: Vec<(T, i8)> = Vec::new();
    for (from, to) in intervals {
        if from < to {
            events.push((from, 1));
            events.push((to, -1));
        }
    }
    events.sort_unstable();
    let mut out = Crowding::default();
    let mut open = 0_usize;
    for (_, delta) in events {
        if delta > 0 {
            open += 1;
            if open > capacity {
                out.beyond += 1;
            }
            out.most = out.most.max(open);
        } else {
            open = open.saturating_sub(1);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(time: u32, inc: u32) -> Stamp {
        Stamp::new(time, inc)
    }

    #[test]
    fn stamps_order_by_seconds_then_increment() {
        assert!(s(10, 7) < s(11, 1));
        assert!(s(10, 1) < s(10, 2));
        assert_eq!(s(10, 7).time(), 10);
        assert_eq!(s(10, 7).increment(), 7);
        assert_eq!(s(10, 7).to_string(), "10:7");
        assert_eq!(
            Stamp::of(mongodb::bson::Timestamp {
                time: 3,
                increment: 4
            }),
            s(3, 4)
        );
    }

    #[test]
    fn spans_that_only_touch_do_not_overlap() {
        let a = Span::new(s(1, 1), s(1, 5)).expect("span");
        let b = Span::new(s(1, 5), s(1, 9)).expect("span");
        let c = Span::new(s(1, 4), s(1, 6)).expect("span");
        assert!(!a.overlaps(&b));
        assert!(a.overlaps(&c) && c.overlaps(&b));
        assert_eq!(Span::new(s(1, 5), s(1, 5)), None);
    }

    #[test]
    fn crowding_counts_spans_beyond_capacity() {
        let spans = [
            (s(1, 1), s(1, 10)),
            (s(1, 2), s(1, 10)),
            (s(1, 3), s(1, 10)),
        ];
        assert_eq!(crowding(spans, 2).beyond, 1);
        assert_eq!(crowding(spans, 2).most, 3);
        assert_eq!(crowding(spans, 3).beyond, 0);
        // Touching spans, one after the other: never two at once.
        let chain = [(s(1, 1), s(1, 2)), (s(1, 2), s(1, 3)), (s(1, 3), s(1, 4))];
        assert_eq!(crowding(chain, 1), Crowding { most: 1, beyond: 0 });
    }
}
