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
