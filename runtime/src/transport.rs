//! The transport plug-in boundary.
//!
//! A transport moves owned buffers between ranks and reports one outcome per receive; it knows
//! nothing about aggregation. The runtime hands it one [`Step`] at a time: a batch of sends and
//! receives that all complete, or time out, by the step's deadline.

use std::fmt;

use futures::future::BoxFuture;
use tokio::time::Instant;

use crate::{MemoryKind, MsgKey, Payload, Quorum, Rank, RecvOp, Tag, TransportError};

/// A send in a step: `payload` goes to `peer` under `tag`.
#[derive(Debug, Clone)]
pub struct SendOp {
    /// Destination rank (never the sender itself).
    pub peer: Rank,
    /// Message tag.
    pub tag: Tag,
    /// The buffer; the transport keeps it alive until the bytes have left.
    pub payload: Payload,
}

/// One step of a collective: sends and receives posted together.
#[derive(Debug, Clone)]
pub struct Step {
    /// Collective sequence number (identical on every rank for the same call).
    pub collective: u64,
    /// Step number within the collective.
    pub step: u32,
    /// The collective call's fingerprint ([`crate::calls`]): what the caller asked for.
    /// Framed transports carry it with every message; a message whose fingerprint is not the
    /// receive's is [`RecvOutcome::OutOfStep`], never delivered. 0 for point-to-point
    /// messages.
    pub call: u64,
    /// Messages to send.
    pub sends: Vec<SendOp>,
    /// Messages to receive.
    pub recvs: Vec<RecvOp>,
    /// When to stop waiting: receives still open then are [`RecvOutcome::Missing`].
    pub deadline: Instant,
    /// When the step may end before the deadline: once the quorum's receives have an outcome
    /// and its grace has passed; receives still open then are [`RecvOutcome::Late`]. A quorum
    /// step does not wait for its sends to leave either (a quorum of every receive: the step
    /// ends with its receives): a send still in flight then is left to the transport, as at
    /// a deadline. `None`: every receive is waited for until the deadline, and every send
    /// until it has left. Only for transports that declare [`Capabilities::quorum`].
    pub quorum: Option<Quorum>,
}

impl Step {
    /// The message key of a send or receive with `tag` in this step.
    pub fn key(&self, tag: Tag) -> MsgKey {
        MsgKey {
            collective: self.collective,
            step: self.step,
            tag,
        }
    }

    /// Checks the parts of the contract every transport shares: peers in range and not `me`,
    /// no duplicate receive, payloads in a memory kind the transport supports.
    ///
    /// # Errors
    /// [`TransportError::InvalidUsage`] naming the offending operation.
    pub fn validate(
        &self,
        me: Rank,
        size: usize,
        caps: &Capabilities,
    ) -> Result<(), TransportError> {
        let peer_ok = |p: Rank| p < size && p != me;
        if let Some(s) = self.sends.iter().find(|s| !peer_ok(s.peer)) {
            return Err(TransportError::InvalidUsage(format!(
                "send to rank {} from rank {me} in a world of {size}",
                s.peer
            )));
        }
        if let Some(s) = self
            .sends
            .iter()
            .find(|s| !caps.memory.contains(&s.payload.memory_kind()))
        {
            return Err(TransportError::InvalidUsage(format!(
                "payload in {:?} memory, which this transport does not support",
                s.payload.memory_kind()
            )));
        }
        if self.quorum.is_some() && !caps.quorum {
            return Err(TransportError::InvalidUsage(
                "a quorum step on a transport that cannot end a step before its deadline".into(),
            ));
        }
        if let Some(r) = self.recvs.iter().find(|r| !peer_ok(r.peer)) {
            return Err(TransportError::InvalidUsage(format!(
                "receive from rank {} at rank {me} in a world of {size}",
                r.peer
            )));
        }
        if let Some(m) = self
            .sends
            .iter()
            .map(|s| s.payload.len())
            .chain(self.recvs.iter().map(|r| r.len))
            .find(|&len| len as u64 > caps.max_message_bytes)
        {
            return Err(TransportError::InvalidUsage(format!(
                "message of {m} bytes exceeds this transport's limit of {}",
                caps.max_message_bytes
            )));
        }
        let mut seen: Vec<(Rank, Tag)> = self.recvs.iter().map(|r| (r.peer, r.tag)).collect();
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(TransportError::InvalidUsage(format!(
                "two receives from rank {} with tag {} in one step",
                w[0].0, w[0].1
            )));
        }
        Ok(())
    }
}

/// What became of one receive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecvOutcome {
    /// The expected bytes arrived.
    Received(Payload),
    /// Nothing arrived by the deadline, or the peer's connection is gone.
    Missing,
    /// Nothing arrived by the end of the step's quorum and grace ([`Step::quorum`]), before
    /// the deadline.
    Late,
    /// Something arrived that was not acceptable; the string says what.
    Malformed(String),
    /// A message for another call arrived: its [`Step::call`] fingerprint is not this step's.
    OutOfStep,
    /// The peer dropped the message unsent because this rank fell behind it (a TCP skip
    /// notice, `PROTOCOL.md` "TCP transport"): this rank is the one late, not the peer.
    Skipped,
}

/// What a transport can do, declared rather than discovered by trial.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// Memory kinds payloads may live in.
    pub memory: Vec<MemoryKind>,
    /// Whether one peer can time out without tearing down the whole communicator
    /// (TCP, UCX, libfabric: yes; NCCL: no, it must abort).
    pub per_peer_timeout: bool,
    /// Whether a step can end at its [`Step::quorum`] (the transports whose receives are
    /// matched by key, the transport kit's mailbox: yes; NCCL: no, its group calls complete
    /// whole).
    pub quorum: bool,
    /// Largest message in bytes.
    pub max_message_bytes: u64,
    /// How many steps of one collective may be in flight at once: posted in increasing order,
    /// each completing on its own (1: one at a time). The ring all-reduce pipelines its parts
    /// over up to this many (TCP, UCX, libfabric, local: [`PIPELINED_STEPS`]; NCCL: 1, its
    /// steps are group calls on one stream).
    pub steps_in_flight: usize,
}

/// The [`Capabilities::steps_in_flight`] of the transports whose receives are matched by key
/// (the transport kit's mailbox): a step's transfer overlaps the work on the one before.
pub const PIPELINED_STEPS: usize = 2;

/// A transport under byzcoll's collectives.
///
/// Implementations own their connections; the runtime owns schedules and deadlines. Steps are
/// posted in increasing ([`Step::collective`], [`Step::step`]) order on every rank: a step's
/// future is polled once (which must post its receives and queue its sends) before the next
/// step's is created. One collective at a time holds the transport, and it has at most
/// [`Capabilities::steps_in_flight`] steps in flight, all polled until each completes.
pub trait Transport: Send + Sync + fmt::Debug {
    /// Short name (`tcp`, `local`, ...), as accepted by `BYZCOLL_TRANSPORT`.
    fn name(&self) -> &'static str;

    /// This process's rank.
    fn rank(&self) -> Rank;

    /// Number of ranks.
    fn size(&self) -> usize;

    /// What the transport supports.
    fn capabilities(&self) -> Capabilities;

    /// Posts a step and completes when every receive has an outcome and every send has left,
    /// or at the step's deadline, whichever comes first. Returns one outcome per receive, in
    /// the order of `step.recvs`. A send has left when the transport no longer needs the
    /// step to wait for it: written to the socket (TCP), taken by the receiver (local), or
    /// held by the progress thread within `byzcoll_transport_kit::progress::SEND_CREDIT` bytes in flight per
    /// peer (UCX, libfabric), which delivers it even if the transport is dropped right after
    /// (for a bounded time).
    ///
    /// # Errors
    /// [`TransportError::InvalidUsage`] when the step breaks the contract ([`Step::validate`]);
    /// other errors when the transport as a whole has failed. A single peer's failure is an
    /// outcome, not an error.
    ///
    /// # Cancel safety
    /// Dropping the future retires the step: its receives are withdrawn and messages for it
    /// that arrive later are discarded. Buffers are owned, so nothing is left pointing into
    /// freed memory; sends already queued may still be delivered.
    fn exchange(&self, step: Step) -> BoxFuture<'_, Result<Vec<RecvOutcome>, TransportError>>;

    /// The job's membership this transport authenticated its peers with (every rank's identity
    /// key, this rank's own): what an audited round signs and checks with
    /// ([`Policy::Audited`](crate::Policy::Audited)). `None` (the default): the transport
    /// keeps none, and a communicator over it audits only with one it is given
    /// (`Communicator::set_membership`).
    fn membership(&self) -> Option<std::sync::Arc<crate::bootstrap::Membership>> {
        None
    }

    /// The transport itself, for extensions that need more than this trait: the device-vector
    /// robust all-reduce (`byzcoll::cuda::robust_all_reduce_device`) finds the NCCL transport
    /// this way. `None` unless the transport offers it.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }

    /// Finishes what the steps left in flight before the transport is dropped, for at most a
    /// bounded time of the transport's own: a step may end (at its deadline or quorum) before
    /// its sends have reached the peer, and a process that exits right after its last call
    /// would cut them. The default has nothing to finish. After it, the transport sends
    /// nothing; dropping it without this call finishes the same in the background, as long
    /// as the async runtime lives.
    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}
