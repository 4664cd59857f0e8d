//! What the tag-matching transports (UCX, libfabric) share: the tag layout, the
//! header → claim → payload state machine of every peer's receive side ([`Core`]), the sends
//! and their credit, and the [`Transport`](byzcoll_runtime::Transport) shell ([`Shell`]).
//!
//! # Messages
//! Every message is a sealed [`FrameHeader`](crate::wire::FrameHeader) ([`SEALED_LEN`] bytes:
//! header, payload tag, MAC; see [`crate::wire`]) (tag kind [`Kind::Header`]) and its
//! payload (kind [`Kind::Payload`]), on tags that carry the same per-pair sequence number
//! ([`TagLayout`]).
//!
//! # The receive side
//! [`Core`] keeps [`HEADER_WINDOW`] (or fewer) header receives posted per peer, for the exact
//! tags of that peer's next sequence numbers, into fixed [`SEALED_LEN`]-byte buffers. It opens
//! each header (MAC, sender, length limit) and claims the matching receive in the mailbox, in
//! sequence order. Only then does it receive the payload: into a buffer of the length the
//! receiver expects, or (a header of another length, a retired step) drained without a buffer.
//! So no allocation is ever sized by a peer's number. A header that is not sealed by the peer
//! (forged, replayed, corrupted, of another length) cannot be attributed to it: it is dropped
//! with a warning and its receive is posted again (the genuine header still matches it). A
//! payload that does not match its header's sealed tag is received again, at most
//! [`PAYLOAD_RETRIES`] times (a stranger's payload with the same tag may have matched first),
//! then the receive is `Malformed`.
//!
//! What differs between networks is behind [`TaggedNet`]: posting, testing and cancelling
//! receives and sends (UCX polls requests; libfabric reads a completion queue, whose
//! completions it hands to [`Core::header_arrived`], and moves payloads in fragments).

mod machine;
mod shell;
#[cfg(test)]
mod tests;

pub use machine::{Core, CoreConfig, Frame, Outgoing};
pub use shell::{check_world, gather_addresses, local_memberships, Exchange, Shell};

use byzcoll_runtime::Rank;

use crate::wire::SEALED_LEN;

/// Header receives kept posted per peer (at most).
pub const HEADER_WINDOW: usize = 16;
/// How many times a payload receive is posted again after a payload that did not match its
/// sealed header (see the module docs).
pub const PAYLOAD_RETRIES: u8 = 3;
/// Largest world the tag layout can address (24 bits of sender).
pub const MAX_RANKS: usize = 1 << 24;
/// Commands queued before senders wait.
const COMMAND_QUEUE: usize = 1024;
/// How long an idle progress thread blocks at most while a header waits for its step to be
/// posted (a step can be retired without waking the thread), and otherwise.
const EARLY_RECHECK_MS: i32 = 2;
const IDLE_RECHECK_MS: i32 = 100;

/// What a tagged message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A sealed frame header.
    Header = 1,
    /// A payload (or a fragment of one).
    Payload = 2,
}

/// The tag layout, `sender (24 bits) | kind (2 bits) | sequence (seq_bits)`, high bits first;
/// each transport chooses how many bits the sequence number gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TagLayout {
    seq_bits: u32,
}

impl TagLayout {
    /// A layout whose sequence numbers have `seq_bits` bits.
    ///
    /// # Panics
    /// If the layout does not fit in 64 bits.
    pub const fn new(seq_bits: u32) -> Self {
        assert!(seq_bits + 2 + 24 <= 64, "the tag layout exceeds 64 bits");
        TagLayout { seq_bits }
    }

    /// The tag of `sender`'s message `seq` of `kind` (the sequence number wraps).
    pub const fn tag(self, sender: Rank, kind: Kind, seq: u64) -> u64 {
        ((sender as u64) << (self.seq_bits + 2))
            | ((kind as u64) << self.seq_bits)
            | (seq & ((1 << self.seq_bits) - 1))
    }

    /// Tag bits the layout uses: a network must match at least this many.
    pub const fn bits(self) -> u32 {
        self.seq_bits + 2 + 24
    }
}

/// What arrived for a posted header receive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderArrival {
    /// Exactly [`SEALED_LEN`] bytes: opened and checked by [`Core`].
    Sealed([u8; SEALED_LEN]),
    /// A message of another length (or truncated): not a sealed header, so not the peer's; it
    /// is dropped and the receive posted again.
    Unsealed,
    /// The receive failed: the peer is closed with this reason.
    Failed(String),
}

/// What became of a payload receive ([`TaggedNet::poll_payload`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PayloadPoll {
    /// Still in flight.
    Pending,
    /// Exactly the expected bytes were written into the destination.
    Arrived,
    /// Another message took the receive (of another length): it may be a stranger's, so the
    /// payload is received again (at most [`PAYLOAD_RETRIES`] times), then the receive is
    /// `Malformed` with this reason.
    Unmatched(String),
    /// The receive failed: `Missing` if the peer failed, otherwise `Malformed` with this reason.
    Failed(String),
    /// The peer broke the protocol (or cannot be received from): it is closed with this reason.
    Violation(String),
}

/// What a sent frame became when the network took it ([`TaggedNet::start_send`]).
#[derive(Debug)]
pub enum Started<S> {
    /// Already done (with an error if it failed): nothing is kept.
    Done(Option<String>),
    /// In flight; `state` (the buffers and the network's handles) is kept in an [`Outgoing`]
    /// until the transport finishes it ([`Core::finish_sends`], [`Core::finish_send`]).
    InFlight {
        /// Kept until the send is finished.
        state: S,
        /// A part already failed.
        error: Option<String>,
    },
}

/// The calls into a tag-matching network that [`Core`] makes: each transport implements them
/// with its FFI. Every method runs on the engine's thread of the moment, with the engine's
/// lock held.
pub trait TaggedNet {
    /// A posted header receive (it owns its [`SEALED_LEN`]-byte buffer).
    type Header;
    /// A payload receive in progress.
    type Payload;
    /// A send in flight.
    type Send;

    /// Posts the receive of `peer`'s header `seq` (its exact tag). `Ok(None)`: the network is
    /// busy, try again next turn.
    ///
    /// # Errors
    /// Why `peer` cannot be received from (the peer is closed).
    fn post_header(&mut self, peer: Rank, seq: u64) -> Result<Option<Self::Header>, String>;

    /// What arrived for `header`, `None` while nothing has. A network whose completions are
    /// read from a queue hands them to [`Core::header_arrived`] instead and returns `None`.
    fn poll_header(&mut self, peer: Rank, header: &mut Self::Header) -> Option<HeaderArrival>;

    /// Cancels a posted header receive that is no longer wanted; its buffer must outlive the
    /// network's use of it.
    fn cancel_header(&mut self, peer: Rank, header: Self::Header);

    /// Starts receiving `peer`'s payload `seq` of `len` bytes into `dest`, or draining it
    /// (`dest` is `None`) without a buffer of that size.
    ///
    /// # Safety
    /// `dest`, if given, must be valid for writes of `len` bytes and not otherwise accessed
    /// until [`TaggedNet::poll_payload`] has returned something other than
    /// [`PayloadPoll::Pending`] for this receive, or the memory is leaked.
    unsafe fn start_payload(
        &mut self,
        peer: Rank,
        seq: u64,
        dest: Option<*mut u8>,
        len: usize,
    ) -> Self::Payload;

    /// Moves a payload receive forward (posting what it may) and says what became of it.
    fn poll_payload(&mut self, peer: Rank, seq: u64, payload: &mut Self::Payload) -> PayloadPoll;

    /// Cancels a payload receive; it is polled until it is no longer pending.
    fn cancel_payload(&mut self, peer: Rank, payload: &mut Self::Payload);

    /// Whether a payload of `len` bytes that did not match may be received again (a network
    /// that moves payloads in fragments cannot receive again what already arrived).
    fn may_retry(&self, len: usize) -> bool {
        let _ = len;
        true
    }

    /// Hands a sealed frame to the network.
    fn start_send(&mut self, frame: Frame) -> Started<Self::Send>;
}
