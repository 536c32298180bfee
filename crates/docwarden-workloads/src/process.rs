//! Typed process ids of a run's history, with a stable numeric encoding.

use rand::SeedableRng;
use rand::rngs::StdRng;

/// Who performed an operation in a history: a numbered worker, or one of the run's own
/// helpers. [`Process::id`] is the `u32` stored in [`docwarden::check::Event::process`];
/// the helpers take the top three values, so worker numbers stay below
/// [`Process::FIRST_RESERVED`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Process {
    /// A worker, numbered from 0 (a replaced worker gets the next number).
    Worker(u32),
    /// The server side: restarts, latency, connection resets (the nemesis).
    Server,
    /// The drain after the run, and the final read.
    Drain,
    /// A producer of messages or jobs.
    Producer,
}

impl Process {
    /// The lowest id reserved for the helpers.
    pub const FIRST_RESERVED: u32 = u32::MAX - 2;

    /// The id stored in a history event.
    #[must_use]
    pub const fn id(self) -> u32 {
        match self {
            Process::Worker(n) => n,
            Process::Server => u32::MAX,
            Process::Drain => u32::MAX - 1,
            Process::Producer => u32::MAX - 2,
        }
    }

    /// The process of a stored id (the inverse of [`Process::id`]).
    #[must_use]
    pub const fn from_id(id: u32) -> Self {
        match id {
            u32::MAX => Process::Server,
            n if n == u32::MAX - 1 => Process::Drain,
            n if n == u32::MAX - 2 => Process::Producer,
            n => Process::Worker(n),
        }
    }

    /// The worker numbered `n` (saturating below the reserved ids).
    #[must_use]
    pub fn worker(n: usize) -> Self {
        Process::Worker(
            u32::try_from(n)
                .unwrap_or(Self::FIRST_RESERVED - 1)
                .min(Self::FIRST_RESERVED - 1),
        )
    }

    /// A label for reports: `process N`, `server`, `drain / final read`, `producer`.
    #[must_use]
    pub fn label(self) -> String {
        match self {
            Process::Worker(n) => format!("process {n}"),
            Process::Server => "server".to_owned(),
            Process::Drain => "drain / final read".to_owned(),
            Process::Producer => "producer".to_owned(),
        }
    }

    /// A deterministic random generator of this process in a run seeded with `seed`.
    #[must_use]
    pub fn rng(self, seed: u64) -> StdRng {
        StdRng::seed_from_u64(seed ^ (u64::from(self.id()) << 32) ^ 0x9E37_79B9)
    }
}

#[cfg(test)]
mod tests {
    use super::Process;

    #[test]
    fn ids_round_trip() {
        for p in [
            Process::Worker(0),
            Process::Worker(7),
            Process::Server,
            Process::Drain,
            Process::Producer,
        ] {
            assert_eq!(Process::from_id(p.id()), p);
        }
        assert_eq!(
            Process::worker(usize::MAX).id(),
            Process::FIRST_RESERVED - 1
        );
    }
}
