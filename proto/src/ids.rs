//! Identifiers every layer shares: ranks, tags, message keys, and what a receive expects.

/// A process's index in a communicator, `0..size`.
pub type Rank = usize;

/// A user-chosen message tag; collectives use tag 0 unless a schedule needs several streams.
pub type Tag = u32;

/// Identifies one message between a pair of ranks: which collective call (counted from 0 on every
/// rank, so SPMD programs agree on it), which step of that collective, and the tag.
///
/// The collective number's top [`STREAM_BITS`] bits are the *stream*: the communicator the
/// call belongs to (0 for a world, another value for each communicator made by `split`), the
/// rest counts that communicator's calls. Within a stream keys are ordered: a rank executes a
/// communicator's collectives and their steps in increasing key order, which lets transports
/// tell stale messages (from a step that has already completed) from early ones (for a step
/// not yet posted). Keys of different streams are not ordered against each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MsgKey {
    /// Collective sequence number.
    pub collective: u64,
    /// Step within the collective.
    pub step: u32,
    /// Message tag.
    pub tag: Tag,
}

/// Bits of [`MsgKey::collective`] that hold the stream (the communicator).
pub const STREAM_BITS: u32 = 16;

/// Where the stream starts in [`MsgKey::collective`].
const STREAM_SHIFT: u32 = 64 - STREAM_BITS;

impl MsgKey {
    /// The stream (communicator) this key belongs to; see [`MsgKey`].
    pub fn stream(&self) -> u64 {
        self.collective >> STREAM_SHIFT
    }

    /// The lowest key of `stream`.
    pub fn stream_start(stream: u64) -> MsgKey {
        MsgKey {
            collective: stream << STREAM_SHIFT,
            step: 0,
            tag: 0,
        }
    }
}

/// When a step may end before every receive has an outcome: once `receives` of them have one,
/// the first `core` among them (the quorum), and the [`Grace`] that follows has passed, or
/// once the quorum has formed and the first `awaited` receives all have an outcome. Receives
/// still open then are *late*: erasures for that step, named apart from the missing ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quorum {
    /// Receives whose message must have come before the step may end early (a dead peer's
    /// receive ends at once but does not count: the dead and the late share the budget).
    pub receives: usize,
    /// How long the step waits past the quorum.
    pub grace: Grace,
    /// The grace waits for the step's first `awaited` receives only: the receives after them
    /// are from *laggards*, peers late in each of this rank's last rounds, which it waits for
    /// only up to the quorum (fault memory). The step's receive count where there are none.
    pub awaited: usize,
    /// The quorum forms only once the step's first `core` receives have an outcome too (0:
    /// any `receives` outcomes form it). Under [`Agreement::Enforce`](crate::Agreement) the
    /// echo and the cross-check wait for every peer in time this round and, through the
    /// grace only, for those that were late: a late peer's message that comes first must not
    /// start the grace that cuts one in time.
    pub core: usize,
}

impl Quorum {
    /// A quorum step that waits for all its `receives` (until the deadline), but not for its
    /// sends: a rendezvous transport would otherwise hold a send to a peer that never posts
    /// the step until the deadline.
    pub fn every(receives: usize) -> Quorum {
        Quorum {
            receives,
            grace: Grace {
                min: std::time::Duration::ZERO,
                factor: 0,
            },
            awaited: receives,
            core: 0,
        }
    }
}

/// How long a quorum step waits past its quorum. It adapts to what the step sees: at least
/// [`Grace::min`], and at least [`Grace::factor`] times as long as the quorum took to form,
/// so that it is never a constant too short on a slow network or too long on a fast one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grace {
    /// The shortest wait past the quorum.
    pub min: std::time::Duration,
    /// The wait past the quorum in multiples of the time the quorum took to form.
    pub factor: u32,
}

impl Grace {
    /// The default: at least 1 ms, and as long again as the quorum took to form.
    pub const DEFAULT: Grace = Grace {
        min: std::time::Duration::from_millis(1),
        factor: 1,
    };

    /// How long to wait past a quorum that formed `formed` after the step was posted.
    pub fn after(&self, formed: std::time::Duration) -> std::time::Duration {
        formed.saturating_mul(self.factor).max(self.min)
    }
}

impl Default for Grace {
    fn default() -> Self {
        Grace::DEFAULT
    }
}

/// A receive in a step: exactly `len` bytes are expected from `peer` under `tag`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvOp {
    /// Source rank (never the receiver itself).
    pub peer: Rank,
    /// Message tag.
    pub tag: Tag,
    /// Expected length in bytes; anything else is malformed (`RecvOutcome::Malformed`).
    pub len: usize,
}
