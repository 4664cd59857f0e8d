//! The libfabric transport: an engine owns the endpoint (and with it the domain, the
//! completion queue and the address vector) and moves in turns, run by the task awaiting an
//! exchange or by a progress thread; tokio tasks talk to it through a bounded command queue
//! and the shared [`Mailbox`].
//!
//! See [`LibfabricTransport`] for the message format, the progress thread and failures.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::c_void;
use std::ptr;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
use byzcoll_libfabric_sys as sys;
use byzcoll_runtime::bootstrap::{FrameSecret, StoreClient};
use byzcoll_runtime::{
    Capabilities, MemoryKind, MsgKey, Payload, Rank, RecvOutcome, Step, Transport, TransportError,
};
use byzcoll_transport_kit::mailbox::{Claim, Closed, Delivery, Mailbox};
use byzcoll_transport_kit::pool::{BufferPool, PoolBuf};
use byzcoll_transport_kit::progress::{
    run_step_on_engine, Idle, Progress, SendCommand, SendCredit, SendDone, Signal,
};
use byzcoll_transport_kit::wire::{
    self as wire, FrameHeader, FrameKeys, Opened, Unsealed, SEALED_LEN,
};
use futures::future::BoxFuture;
use tokio::sync::mpsc;

use crate::safe::{
    self, Completion, Domain, Endpoint, Fabric, FabricError, Info, MemoryRegion, Notifier, Post,
};

pub(crate) const KIND_HEADER: u64 = 1;
pub(crate) const KIND_PAYLOAD: u64 = 2;
const SEQ_BITS: u32 = 36;
const SENDER_SHIFT: u32 = SEQ_BITS + 2;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
/// Tag bits the layout uses: a provider must match at least this many.
const TAG_BITS: u32 = SENDER_SHIFT + 24;
/// Largest world the tag layout can address.
pub const MAX_RANKS: usize = 1 << 24;
pub use byzcoll_transport_kit::progress::MAX_NAP as MAX_PARK;
/// How long the thread blocks at most on the queue's wait object while a header waits for its
/// step to be posted (a step can be retired without waking the thread), and otherwise.
const EARLY_RECHECK_MS: i32 = 2;
const IDLE_RECHECK_MS: i32 = 100;
/// Commands queued before senders wait.
const COMMAND_QUEUE: usize = 1024;
/// Entries of the completion queue.
const CQ_SIZE: usize = 4096;
/// Completions handled per pass of the progress loop.
const COMPLETIONS_PER_PASS: usize = 256;
/// Largest payload message: a longer payload travels as several, so a receive never needs a
/// buffer sized by the sender, and a payload that is not wanted is drained into a fixed
/// scratch buffer without truncation. 1 MiB rather than 4: over `tcp;ofi_rxm` 4 MiB
/// messages ran at 1.8 GB/s and 1 MiB fragments of them (4 in flight) at 4 GB/s; over `shm`
/// it makes no difference beyond noise.
pub const FRAGMENT: usize = 1 << 20;
/// Fragment receives in flight per peer (over all of its messages).
const WINDOW: usize = 8;
/// Header receives kept posted per peer (fewer in worlds so large that the provider's receive
/// queue could not hold this many for every peer).
pub const HEADER_WINDOW: usize = 16;
/// How many times the receive of a one-fragment payload is posted again after a payload that
/// did not match its sealed header (see Authentication in [`LibfabricTransport`]).
pub const PAYLOAD_RETRIES: u8 = 3;

pub(crate) fn tag(sender: Rank, kind: u64, seq: u64) -> u64 {
    ((sender as u64) << SENDER_SHIFT) | (kind << SEQ_BITS) | (seq & SEQ_MASK)
}

/// Settings of the libfabric transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibfabricOptions {
    /// Largest message accepted or sent (payloads travel in fragments of at most
    /// [`FRAGMENT`] bytes, so the provider's own `max_msg_size` does not limit it).
    pub max_message_bytes: u64,
    /// Register every buffer with the domain even when the provider does not ask for it
    /// (`FI_MR_LOCAL`). Registration costs a system call or two per message; this exists to
    /// exercise the registration path on providers that do not need it.
    pub always_register: bool,
    /// Most bytes of idle receive buffers kept for reuse (see [`BufferPool`]).
    pub pool_bytes: usize,
}

impl Default for LibfabricOptions {
    fn default() -> Self {
        LibfabricOptions {
            max_message_bytes: 1 << 40,
            always_register: false,
            pool_bytes: 256 << 20,
        }
    }
}

/// Endpoints that are closed together when the last transport holding this goes.
type Keeper = Arc<Mutex<Vec<Endpoint>>>;

/// The libfabric transport: an engine owns the endpoint (and with it the domain, the
/// completion queue and the address vector) and moves in turns (see Progress below); tokio
/// tasks talk to it through a bounded command queue and the shared [`Mailbox`].
///
/// Payloads are received into buffers from a [`BufferPool`] (at most
/// [`LibfabricOptions::pool_bytes`] idle): a fresh allocation per large message cost a page
/// fault per 4 KiB page, which limited `shm` to about 1.5 GB/s.
///
/// # Messages
/// Every message is a sealed [`FrameHeader`] ([`SEALED_LEN`] bytes: header, payload digest,
/// MAC; see [`byzcoll_transport_kit::wire`]) (tag kind `HEADER`) followed by its payload in
/// fragments of at most [`FRAGMENT`] bytes (kind `PAYLOAD`; none for an empty payload), all
/// tagged messages on a reliable datagram endpoint carrying the same per-pair sequence number:
///
/// ```text
/// tag = 0 (2 bits) | sender (24 bits) | kind (2 bits) | sequence (36 bits)
/// ```
///
/// The progress thread keeps [`HEADER_WINDOW`] header receives posted per peer (fewer when the
/// provider's receive queue could not hold that many for every peer), for the exact tags of
/// the peer's next sequence numbers, restricted to the peer's address where the provider
/// supports `FI_DIRECTED_RECV`, into fixed [`SEALED_LEN`]-byte buffers. It opens each header
/// (MAC, sender, length limit) and claims the matching receive in the mailbox, in sequence
/// order. Only then does it receive the
/// payload: into a buffer of the exact length the receiver expects, or, for a header of another
/// length or for a retired step, fragment by fragment into a fixed scratch buffer that is never
/// read. At most a few fragment receives per peer are posted at a time (over all of its
/// messages, oldest first), each for the exact fragment length the header implies, so no
/// allocation is ever sized by a peer's number, and an honest peer's message is never
/// truncated. A fragment of another length is a protocol violation: the receive is `Malformed`
/// and the peer is closed. Several messages per peer are in flight at once: their headers are
/// matched by the provider as they arrive, and the payloads of claimed messages are received
/// while later headers are checked. (With one header receive per peer, every message waited
/// for a pass of the thread between its header and its payload, and the next header receive
/// was posted only after the payload had arrived.)
///
/// # Authentication
/// Without `FI_DIRECTED_RECV` (and even with it, for a provider that resolves addresses
/// loosely) a receiver cannot tell which endpoint a message came from, so anyone who knows an
/// endpoint name can send messages with any rank's tags. Every frame is therefore sealed under
/// the key of its ordered pair (X25519 keys published with the endpoint names through the
/// authenticated store, mixed with the job secret). A header whose MAC does not verify, or of
/// the wrong length, cannot be attributed to the rank whose tags it used: it is dropped with a
/// warning and the receive is posted again for the same sequence number (the genuine header
/// still matches it); it never closes the peer. A payload whose bytes do not match the digest
/// sealed in its header is never delivered: a payload of one fragment is received again (at
/// most [`PAYLOAD_RETRIES`] times, since a stranger's fragment on the same tag may have
/// matched first), a longer one is `Malformed` (which of its fragments were genuine is not
/// known, and the genuine ones already taken do not come again). A stranger who keeps
/// injecting can still spoil a receive (forged fragments that match first make it
/// `Malformed`, one of the wrong length closes the peer as before): tag matching gives no way
/// to refuse its messages before they match, short of `FI_DIRECTED_RECV`.
///
/// Why not one payload message drained with a zero-length receive, as the UCX transport does
/// after probing? libfabric 1.17 (Debian 12) mishandles it: `ofi_rxm` loses its way on
/// truncated segmented and rendezvous messages (`FI_ETRUNC` on a payload over 16 KiB leaves
/// the next messages of that peer unmatched), and `shm` matches unexpected messages with a
/// stale ignore mask, so receives with an ignore mask may miss messages that already arrived.
/// Exact tags and fragments that always fit avoid both.
///
/// # Progress
/// The engine moves in turns under [`byzcoll_transport_kit::progress::Progress`]: it reads the
/// completion queue (`fi_cq_read`, which also drives providers with manual progress), starts
/// queued sends and moves every peer's receive side. The task awaiting an exchange runs the
/// turns itself while its step is open; a progress thread runs them otherwise, and when idle
/// blocks where the provider gives the queue a wait object (`FI_WAIT_FD`: `tcp;ofi_rxm` does,
/// `shm` in libfabric 1.17 does not), in `poll` on it and on an eventfd that transport methods
/// signal, after `fi_trywait` says nothing is ready; otherwise it naps for short, growing
/// intervals (at most [`MAX_PARK`]), and new commands cut the nap short. (It used to spin
/// without yielding for 50 µs and then park: on a 2-core machine the spinning took the CPU
/// from the tokio threads and the peer's progress thread, and a message that arrived while the
/// thread was parked waited for the timer, which made the one-way latency over `shm` about
/// 100 µs.) Each operation's context pointer is the address of an `fi_context2` that the
/// operation owns (so providers that want `FI_CONTEXT`/`FI_CONTEXT2` scratch space get it);
/// completions find their operation through it. Sends the provider cannot take yet
/// (`-FI_EAGAIN`) wait in order. Buffers (and memory registrations, where the provider asks
/// for `FI_MR_LOCAL`) of unfinished operations stay owned by the engine until the operation
/// completes, and at shutdown until it has been cancelled and completed; if the provider never
/// completes it, they are leaked rather than freed, so libfabric never writes into freed
/// memory.
///
/// # Failures
/// A send that completes with an error marks its peer failed: later sends to it fail at once,
/// and its receive slot is closed (`Missing`) once nothing more from it is pending. A silent
/// peer is `Missing` at the step's deadline.
#[derive(Debug)]
pub struct LibfabricTransport {
    rank: Rank,
    size: usize,
    mailbox: Arc<Mailbox>,
    commands: Option<mpsc::Sender<SendCommand>>,
    progress: Progress<Engine>,
    keeper: Option<Keeper>,
    max_message_bytes: u64,
    provider: String,
}

/// Wakes the progress thread blocked on the completion queue's wait object (through the
/// eventfd it also polls); nothing without a wait object (the thread naps, and is unparked).
struct NotifierSignal(Option<Notifier>);

impl Signal for NotifierSignal {
    fn signal(&self) {
        if let Some(n) = &self.0 {
            n.signal();
        }
    }

    fn drain(&self) {
        if let Some(n) = &self.0 {
            n.drain();
        }
    }
}

fn setup(e: FabricError) -> TransportError {
    TransportError::Setup(format!("libfabric: {e}"))
}

/// Chooses the provider and checks that the tag layout fits it.
pub(crate) fn choose() -> Result<Info, TransportError> {
    let info = Info::rdm_tagged().map_err(setup)?;
    if info.tag_bits() < TAG_BITS {
        return Err(TransportError::Setup(format!(
            "libfabric provider {} matches {} tag bits; the transport needs {TAG_BITS}",
            info.provider(),
            info.tag_bits()
        )));
    }
    Ok(info)
}

/// Opens a fabric, domain and endpoint for a world of `size`.
pub(crate) fn open(info: &Info, size: usize) -> Result<Endpoint, TransportError> {
    let fabric = Fabric::open(info).map_err(setup)?;
    let domain = Domain::open(fabric, info).map_err(setup)?;
    Endpoint::open(domain, info, CQ_SIZE, size).map_err(setup)
}

impl LibfabricTransport {
    /// Opens an RDM endpoint on the provider `fi_getinfo` selects (honouring `FI_PROVIDER`,
    /// `FI_TCP_IFACE` and libfabric's other `FI_` variables), publishes its name through
    /// `store`, inserts every rank's name into the address vector and starts the progress
    /// thread.
    ///
    /// # Errors
    /// [`TransportError::InvalidUsage`] for a rank outside the world or a world larger than
    /// [`MAX_RANKS`]; [`TransportError::Setup`] when no provider offers tagged RDM messaging
    /// (the message names what the selected one lacks), libfabric cannot open the endpoint,
    /// the store fails, or a rank publishes an unusable address.
    ///
    /// Ranks in one process should come from [`LibfabricTransport::local_world`] instead:
    /// `shm` shares an endpoint's memory region with endpoints of the same process, which
    /// that function keeps open until the whole world is gone.
    pub async fn from_store(
        store: &StoreClient,
        rank: Rank,
        size: usize,
        options: LibfabricOptions,
    ) -> Result<Self, TransportError> {
        if size > MAX_RANKS || rank >= size {
            return Err(TransportError::InvalidUsage(format!(
                "rank {rank} of {size}: the libfabric transport addresses at most {MAX_RANKS} ranks"
            )));
        }
        let info = choose()?;
        let endpoint = open(&info, size)?;
        // The frame key is published with the name: the store is authenticated, so the table
        // is the job's (see Authentication above).
        let secret = FrameSecret::generate().map_err(|e| TransportError::Setup(e.to_string()))?;
        let published = store
            .all_gather(
                "byzcoll/libfabric",
                &wire::publish(&secret, endpoint.name()),
            )
            .await
            .map_err(|e| TransportError::Setup(e.to_string()))?;
        let mut publics = Vec::with_capacity(published.len());
        let mut names = Vec::with_capacity(published.len());
        for (peer, value) in published.iter().enumerate() {
            let (key, name) = wire::published(value)
                .map_err(|e| TransportError::Setup(format!("rank {peer}: {e}")))?;
            publics.push(key);
            names.push(value.slice_ref(name));
        }
        if publics.len() != size {
            return Err(TransportError::Setup(format!(
                "{} libfabric addresses for a world of {size}",
                publics.len()
            )));
        }
        let keys =
            FrameKeys::new(store.auth(), rank, &secret, &publics).map_err(TransportError::Setup)?;
        Self::start(&info, endpoint, &names, keys, rank, size, options, None)
    }

    /// Builds a whole world in this process (for tests and threads-as-ranks): one fabric,
    /// domain and endpoint per rank, on the provider `fi_getinfo` selects.
    ///
    /// # Errors
    /// As [`LibfabricTransport::from_store`].
    pub fn local_world(
        size: usize,
        options: LibfabricOptions,
    ) -> Result<Vec<Self>, TransportError> {
        let keys = FrameKeys::local_world(size).map_err(TransportError::Setup)?;
        Self::local_world_with(keys, options).map(|(ranks, _)| ranks)
    }

    /// As [`LibfabricTransport::local_world`] under the given frame keys; also returns the
    /// endpoint names (the tests play strangers and insiders with them).
    pub(crate) fn local_world_with(
        keys: Vec<FrameKeys>,
        options: LibfabricOptions,
    ) -> Result<(Vec<Self>, Vec<Bytes>), TransportError> {
        let size = keys.len();
        if size > MAX_RANKS {
            return Err(TransportError::InvalidUsage(format!(
                "a world of {size}: the libfabric transport addresses at most {MAX_RANKS} ranks"
            )));
        }
        let info = choose()?;
        let endpoints = (0..size)
            .map(|_| open(&info, size))
            .collect::<Result<Vec<_>, _>>()?;
        // shm hands a peer in the same process the owner's own mapping of an endpoint's
        // region, so closing one rank's endpoint while the others may still send to it would
        // leave them a dangling pointer: in-process shm worlds close their endpoints together,
        // once the last rank is gone.
        let keeper = info
            .provider()
            .split(';')
            .any(|p| p == "shm")
            .then(Keeper::default);
        let names: Vec<Bytes> = endpoints
            .iter()
            .map(|e| Bytes::copy_from_slice(e.name()))
            .collect();
        let ranks = endpoints
            .into_iter()
            .zip(keys)
            .enumerate()
            .map(|(rank, (ep, keys))| {
                Self::start(
                    &info,
                    ep,
                    &names,
                    keys,
                    rank,
                    size,
                    options.clone(),
                    keeper.clone(),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((ranks, names))
    }

    #[allow(clippy::too_many_arguments)]
    fn start(
        info: &Info,
        mut endpoint: Endpoint,
        names: &[Bytes],
        keys: FrameKeys,
        rank: Rank,
        size: usize,
        options: LibfabricOptions,
        keeper: Option<Keeper>,
    ) -> Result<Self, TransportError> {
        if names.len() != size {
            return Err(TransportError::Setup(format!(
                "{} libfabric addresses for a world of {size}",
                names.len()
            )));
        }
        let mut addresses = Vec::with_capacity(size);
        for (peer, name) in names.iter().enumerate() {
            let a = endpoint.insert_address(name).map_err(|e| {
                TransportError::Setup(format!("rank {peer}'s libfabric address: {e}"))
            })?;
            addresses.push(a);
        }
        let provider = info.provider();
        let fragment = match usize::try_from(info.max_msg_size()) {
            Ok(0) | Err(_) => FRAGMENT,
            Ok(m) => m.min(FRAGMENT),
        };
        let max = options.max_message_bytes;
        let config = EngineConfig {
            me: rank,
            max,
            fragment,
            directed: info.directed_recv(),
            register: info.needs_local_registration() || options.always_register,
            pool_bytes: options.pool_bytes,
            // Leave half the provider's receive queue for payload fragments.
            header_window: match info.rx_size() {
                0 => HEADER_WINDOW,
                n => (n / (2 * size.max(1))).clamp(1, HEADER_WINDOW),
            },
        };
        let mailbox = Arc::new(Mailbox::new(size));
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        let notifier = endpoint.wait_fd().and_then(|_| Notifier::new());
        let notifier_fd = notifier.as_ref().map(Notifier::fd);
        let engine = Engine::new(
            endpoint,
            addresses,
            config,
            keys,
            mailbox.clone(),
            rx,
            notifier_fd,
        );
        let progress = Progress::start(
            format!("byzcoll-fi-{rank}"),
            engine,
            NotifierSignal(notifier),
        )
        .map_err(TransportError::Io)?;
        tracing::debug!(
            rank,
            size,
            provider = %provider,
            fabric = %info.fabric_name(),
            version = %safe::version(),
            directed = config.directed,
            register = config.register,
            "libfabric transport started"
        );
        Ok(LibfabricTransport {
            rank,
            size,
            mailbox,
            commands: Some(tx),
            progress,
            keeper,
            max_message_bytes: max,
            provider,
        })
    }

    /// The libfabric provider in use (`info->fabric_attr->prov_name`), e.g. `tcp;ofi_rxm`.
    pub fn provider(&self) -> &str {
        &self.provider
    }
}

impl Drop for LibfabricTransport {
    fn drop(&mut self) {
        // The engine cancels and drains its operations and closes the endpoint within a
        // bounded time, on the progress thread.
        self.commands = None;
        let Some(endpoint) = self.progress.finish() else {
            return;
        };
        if let Some(keeper) = &self.keeper {
            keeper
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(endpoint);
        }
    }
}

impl Transport for LibfabricTransport {
    fn name(&self) -> &'static str {
        "libfabric"
    }

    fn rank(&self) -> Rank {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            memory: vec![MemoryKind::Host],
            per_peer_timeout: true,
            max_message_bytes: self.max_message_bytes,
        }
    }

    fn exchange(&self, step: Step) -> BoxFuture<'_, Result<Vec<RecvOutcome>, TransportError>> {
        Box::pin(async move {
            step.validate(self.rank, self.size, &self.capabilities())?;
            run_step_on_engine(
                &self.progress,
                &self.mailbox,
                &step,
                "libfabric",
                self.commands.as_ref(),
            )
            .await
        })
    }
}

#[derive(Debug, Clone, Copy)]
struct EngineConfig {
    me: Rank,
    max: u64,
    /// Largest payload message; longer payloads travel as several.
    fragment: usize,
    /// Post receives for one source address (`FI_DIRECTED_RECV`).
    directed: bool,
    /// Register buffers (`FI_MR_LOCAL`, or forced by the options).
    register: bool,
    /// Most bytes of idle receive buffers kept.
    pool_bytes: usize,
    /// Header receives kept posted per peer.
    header_window: usize,
}

/// What an operation is. Sends and header receives own their buffer; fragment receives write
/// into the buffer of their peer's [`Inbound`] or into the engine's scratch buffer.
enum OpKind {
    SendHeader {
        out: u64,
        peer: Rank,
        tag: u64,
        buf: Box<[u8; SEALED_LEN]>,
    },
    SendFragment {
        out: u64,
        peer: Rank,
        tag: u64,
        data: Bytes,
    },
    RecvHeader {
        peer: Rank,
        seq: u64,
        tag: u64,
        buf: Box<[u8; SEALED_LEN]>,
    },
    RecvFragment {
        peer: Rank,
        seq: u64,
        tag: u64,
        len: usize,
    },
}

/// An operation: posted (in `Engine::ops`) or waiting to be.
struct Op {
    /// Declared first so that it is closed before the buffer it covers is freed.
    mr: Option<MemoryRegion>,
    kind: OpKind,
    /// Scratch space the provider may use while the operation is in flight (`FI_CONTEXT2`).
    /// Its address is the operation's context pointer and its key in `Engine::ops`.
    context: Box<sys::fi_context2>,
}

impl Op {
    fn new(kind: OpKind) -> Self {
        Op {
            mr: None,
            kind,
            context: Box::default(),
        }
    }

    fn id(&self) -> usize {
        ptr::from_ref::<sys::fi_context2>(&self.context) as usize
    }

    /// The send this operation is part of.
    fn send(&self) -> Option<(u64, Rank)> {
        match self.kind {
            OpKind::SendHeader { out, peer, .. } | OpKind::SendFragment { out, peer, .. } => {
                Some((out, peer))
            }
            _ => None,
        }
    }
}

/// A send in flight: done when all of its messages have completed, and reported done to its
/// step before that if it fits in the peer's credit ([`SendCredit`]).
struct Outgoing {
    peer: Rank,
    len: usize,
    /// Reported done to the step (it counts against `Engine::credit`).
    credited: bool,
    remaining: usize,
    done: Option<SendDone>,
    error: Option<String>,
}

/// A payload being received, fragment by fragment.
struct Inbound {
    seq: u64,
    /// The opened header the payload must match.
    opened: Opened,
    /// Payload bytes, as the header announced (and, when delivering, as the receive expects).
    total: usize,
    /// Where the next fragment receive starts.
    next: usize,
    /// Bytes received so far.
    received: usize,
    /// Contexts of the fragment receives in flight.
    in_flight: Vec<usize>,
    /// The receive, until it is completed; `None` while draining into scratch.
    delivery: Option<Delivery>,
    /// Its buffer (capacity `total`); `None` while draining into scratch. It stays here while
    /// fragment receives into it are in flight, even after the receive was completed
    /// otherwise (the peer closed): the provider may still write into it.
    buf: Option<PoolBuf>,
    /// Start of the buffer, taken once: fragments are written through it while the buffer
    /// itself is not touched.
    base: *mut u8,
    /// A fragment failed: nothing more is posted and the peer is closed.
    failed: bool,
    /// Receives posted again after a payload that did not match its header.
    retries: u8,
}

/// A posted header receive of one sequence number, and what became of it.
struct HeaderRecv {
    seq: u64,
    /// Context of the posted receive.
    id: usize,
    /// `None` while in flight; the opened header, or why it is unacceptable: `Err(None)` when
    /// it cannot be attributed to the peer (not sealed by it), so it is dropped and received
    /// again, `Err(Some(why))` when it is the peer's fault or the receive's.
    arrived: Option<Result<Opened, Option<String>>>,
}

/// The receive side of one peer.
#[derive(Default)]
struct PeerRx {
    /// Posted header receives, for consecutive sequence numbers, oldest first.
    headers: VecDeque<HeaderRecv>,
    /// Sequence number of the next header receive to post.
    next_post: u64,
    /// Opened headers whose receive has not been claimed yet, in order.
    early: VecDeque<(u64, Opened)>,
    /// Payloads being received or drained, in order.
    payloads: VecDeque<Box<Inbound>>,
    /// Fragment receives in flight, over all payloads.
    fragments: usize,
}

struct Engine {
    endpoint: Endpoint,
    addresses: Vec<sys::fi_addr_t>,
    config: EngineConfig,
    /// Seals frames to and opens frames from every peer.
    keys: FrameKeys,
    mailbox: Arc<Mailbox>,
    commands: mpsc::Receiver<SendCommand>,
    /// Posted operations by context address.
    ops: HashMap<usize, Op>,
    /// Sends not yet accepted by the provider, in order, per peer (so that a peer that takes
    /// nothing holds up only its own messages).
    backlog: Vec<VecDeque<Op>>,
    /// Sends in flight, oldest first.
    outgoing: BTreeMap<u64, Outgoing>,
    /// Credited sends still in flight.
    credit: SendCredit,
    next_out: u64,
    next_key: u64,
    rx: Vec<PeerRx>,
    /// Sequence number of the next message to send to each peer.
    next_send: Vec<u64>,
    /// Where drained fragments go (`config.fragment` bytes once allocated); never read.
    scratch: Vec<u8>,
    /// Receive buffers.
    pool: BufferPool,
    /// The peer's slot is closed: nothing more is received from it.
    closed: Vec<bool>,
    /// Sending to the peer failed: nothing more is sent to it, and its slot closes once
    /// nothing from it is pending.
    failed: Vec<bool>,
    cq_failed: bool,
    /// The eventfd that transport methods signal, polled with the queue's wait object.
    notifier_fd: Option<i32>,
    /// Completions read in one pass.
    completions: Vec<Completion>,
}

// SAFETY: the engine owns the endpoint (Send; the domain is FI_THREAD_DOMAIN, so one thread
// at a time may use it and its objects) and the buffers the provider writes into; the raw
// pointers in it point into those buffers. It is only ever reached through its `Progress`'s
// mutex, so its turns never overlap.
unsafe impl Send for Engine {}

impl byzcoll_transport_kit::progress::Engine for Engine {
    type Remains = Endpoint;

    /// Completions (which also drive providers with manual progress), queued sends, the
    /// sends the provider can take now, and every peer's receive side.
    fn turn(&mut self) -> Option<bool> {
        let mut busy = self.read_completions();
        busy |= self.take_commands()? > 0;
        busy |= self.post_sends();
        for peer in 0..self.rx.len() {
            busy |= self.advance_receive(peer);
        }
        Some(busy)
    }

    fn in_flight(&self) -> bool {
        !self.outgoing.is_empty() || self.rx.iter().any(|r| !r.payloads.is_empty())
    }

    /// Blocks on the completion queue's wait object and the notifier, after `fi_trywait` says
    /// nothing is ready (briefly while a header waits for its step to be posted: a step can be
    /// retired without a wakeup); naps when the provider has no wait object (`shm` in
    /// libfabric 1.17), completions may be ready, or sends wait for the provider to take them.
    fn idle(&mut self) -> Idle {
        let (Some(cq), Some(notifier)) = (self.endpoint.wait_fd(), self.notifier_fd) else {
            return Idle::Nap;
        };
        if self.backlog.iter().any(|b| !b.is_empty()) || !self.endpoint.try_wait() {
            return Idle::Nap;
        }
        let timeout_ms = if self.rx.iter().any(|r| !r.early.is_empty()) {
            EARLY_RECHECK_MS
        } else {
            IDLE_RECHECK_MS
        };
        Idle::Block {
            fds: vec![cq, notifier],
            timeout_ms,
        }
    }

    fn shutdown(self) -> Endpoint {
        self.close()
    }
}

impl Engine {
    fn new(
        endpoint: Endpoint,
        addresses: Vec<sys::fi_addr_t>,
        config: EngineConfig,
        keys: FrameKeys,
        mailbox: Arc<Mailbox>,
        commands: mpsc::Receiver<SendCommand>,
        notifier_fd: Option<i32>,
    ) -> Self {
        let size = addresses.len();
        Engine {
            endpoint,
            addresses,
            config,
            keys,
            mailbox,
            commands,
            ops: HashMap::new(),
            backlog: (0..size).map(|_| VecDeque::new()).collect(),
            outgoing: BTreeMap::new(),
            credit: SendCredit::new(size),
            next_out: 0,
            next_key: 1,
            rx: (0..size).map(|_| PeerRx::default()).collect(),
            next_send: vec![0; size],
            scratch: Vec::new(),
            pool: BufferPool::new(config.pool_bytes),
            closed: vec![false; size],
            failed: vec![false; size],
            cq_failed: false,
            notifier_fd,
            completions: Vec::with_capacity(COMPLETIONS_PER_PASS),
        }
    }

    /// Reads and handles completions; `true` if there were any.
    fn read_completions(&mut self) -> bool {
        let mut completions = std::mem::take(&mut self.completions);
        if let Err(e) = self
            .endpoint
            .read_completions(&mut completions, COMPLETIONS_PER_PASS)
        {
            if !self.cq_failed {
                tracing::warn!(error = %e, "libfabric: reading the completion queue failed");
                self.cq_failed = true;
            }
        }
        let any = !completions.is_empty();
        for c in completions.drain(..) {
            self.complete(c);
        }
        self.completions = completions;
        any
    }

    /// Queues new sends; `None` once the transport has been dropped.
    fn take_commands(&mut self) -> Option<usize> {
        let mut n = 0;
        loop {
            match self.commands.try_recv() {
                Ok(SendCommand {
                    peer,
                    key,
                    payload,
                    done,
                }) => {
                    n += 1;
                    self.start_send(peer, key, payload, done);
                }
                Err(mpsc::error::TryRecvError::Empty) => return Some(n),
                Err(mpsc::error::TryRecvError::Disconnected) => return None,
            }
        }
    }

    /// Queues the header and the payload's fragments of a message to `peer`.
    fn start_send(&mut self, peer: Rank, key: MsgKey, payload: Bytes, done: SendDone) {
        if self.closed[peer] || self.failed[peer] {
            let _ = done.send(Err(format!("rank {peer} is unreachable")));
            return;
        }
        let me = self.config.me;
        let seq = self.next_send[peer];
        self.next_send[peer] += 1;
        let out = self.next_out;
        self.next_out += 1;
        let header = FrameHeader::new(key, me, payload.len());
        let header = Box::new(self.keys.seal(peer, seq, &header, &payload));
        self.backlog[peer].push_back(Op::new(OpKind::SendHeader {
            out,
            peer,
            tag: tag(me, KIND_HEADER, seq),
            buf: header,
        }));
        let mut parts = 1;
        for start in (0..payload.len()).step_by(self.config.fragment) {
            let end = payload.len().min(start + self.config.fragment);
            self.backlog[peer].push_back(Op::new(OpKind::SendFragment {
                out,
                peer,
                tag: tag(me, KIND_PAYLOAD, seq),
                data: payload.slice(start..end),
            }));
            parts += 1;
        }
        self.outgoing.insert(
            out,
            Outgoing {
                peer,
                len: payload.len(),
                credited: false,
                remaining: parts,
                done: Some(done),
                error: None,
            },
        );
        self.credit(peer);
    }

    /// Reports done the sends to `peer` that are in flight and fit in its credit, oldest first.
    fn credit(&mut self, peer: Rank) {
        for o in self.outgoing.values_mut().filter(|o| o.peer == peer) {
            if o.credited || o.done.is_none() {
                continue;
            }
            if !self.credit.try_take(peer, o.len) {
                break;
            }
            o.credited = true;
            if let Some(done) = o.done.take() {
                let _ = done.send(Ok(()));
            }
        }
    }

    /// The source address receives from `peer` are restricted to.
    fn source(&self, peer: Rank) -> sys::fi_addr_t {
        if self.config.directed {
            self.addresses[peer]
        } else {
            sys::FI_ADDR_UNSPEC
        }
    }

    /// Hands `op`, whose buffer is `buf[..len]`, to the provider: `Ok(None)` when posted (it
    /// is then in `self.ops`), `Ok(Some(op))` when the provider is busy and it should be
    /// retried.
    ///
    /// # Safety
    /// `buf[..len]` must be the buffer `op` owns (heap memory that does not move with it), or
    /// memory the engine keeps valid and unaliased until `op` completes or is leaked: the
    /// buffer of the peer's `Inbound`, or the scratch buffer.
    unsafe fn post(
        &mut self,
        mut op: Op,
        buf: *mut u8,
        len: usize,
    ) -> Result<Option<Op>, (Op, FabricError)> {
        if self.config.register && len > 0 && op.mr.is_none() {
            let key = self.next_key;
            self.next_key += 1;
            let access = if op.send().is_some() {
                sys::FI_SEND
            } else {
                sys::FI_RECV
            };
            // SAFETY: the buffer outlives the region: `op` closes the region before it frees
            // its own buffer (field order) and is dropped before the buffer of an Inbound or
            // the scratch (or leaked with them), and before the endpoint.
            match unsafe { self.endpoint.register(buf, len, access.into(), key) } {
                Ok(mr) => op.mr = Some(mr),
                Err(e) => return Err((op, e)),
            }
        }
        let desc = op.mr.as_ref().map_or(ptr::null_mut(), MemoryRegion::desc);
        let context = ptr::from_mut::<sys::fi_context2>(&mut op.context).cast::<c_void>();
        // SAFETY: per this function's contract the buffer stays valid until the operation
        // completes; the context is heap memory owned by `op`, which moves into `self.ops`
        // (the heap memory does not move) until then; `desc` is null or covers the buffer.
        let result = unsafe {
            match &op.kind {
                OpKind::SendHeader { peer, tag, .. } | OpKind::SendFragment { peer, tag, .. } => {
                    self.endpoint
                        .send(buf, len, desc, self.addresses[*peer], *tag, context)
                }
                OpKind::RecvHeader { peer, tag, .. } | OpKind::RecvFragment { peer, tag, .. } => {
                    self.endpoint
                        .recv(buf, len, desc, self.source(*peer), *tag, 0, context)
                }
            }
        };
        match result {
            Ok(Post::Posted) => {
                self.ops.insert(op.id(), op);
                Ok(None)
            }
            Ok(Post::Busy) => Ok(Some(op)),
            Err(e) => Err((op, e)),
        }
    }

    /// Posts each peer's queued sends in order until the provider is busy.
    fn post_sends(&mut self) -> bool {
        let mut busy = false;
        for peer in 0..self.backlog.len() {
            busy |= self.post_sends_to(peer);
        }
        busy
    }

    fn post_sends_to(&mut self, peer: Rank) -> bool {
        let mut busy = false;
        while let Some(mut op) = self.backlog[peer].pop_front() {
            let (buf, len) = match &mut op.kind {
                OpKind::SendHeader { buf, .. } => (buf.as_mut_ptr(), SEALED_LEN),
                OpKind::SendFragment { data, .. } => (data.as_ptr().cast_mut(), data.len()),
                // Only sends are queued.
                _ => continue,
            };
            // SAFETY: the buffer is heap memory owned by `op` (the provider only reads it).
            match unsafe { self.post(op, buf, len) } {
                Ok(None) => busy = true,
                Ok(Some(op)) => {
                    self.backlog[peer].push_front(op);
                    break;
                }
                Err((op, e)) => {
                    busy = true;
                    if let Some((out, peer)) = op.send() {
                        self.send_failed(out, peer, &e.to_string());
                    }
                }
            }
        }
        busy
    }

    /// A part of send `out` could not be posted: its other queued parts are dropped, and the
    /// stream to `peer` is broken (the peer would wait for the missing part).
    fn send_failed(&mut self, out: u64, peer: Rank, why: &str) {
        tracing::debug!(peer, error = why, "libfabric: cannot post a send");
        self.finish_part(out, Some(why.to_string()));
        while self.backlog[peer]
            .front()
            .and_then(Op::send)
            .is_some_and(|(o, _)| o == out)
        {
            self.backlog[peer].pop_front();
            self.finish_part(out, Some(why.to_string()));
        }
        self.failed[peer] = true;
    }

    /// One message of send `out` is done (with `error` if it failed).
    fn finish_part(&mut self, out: u64, error: Option<String>) {
        let Some(o) = self.outgoing.get_mut(&out) else {
            return;
        };
        if o.error.is_none() {
            o.error = error;
        }
        o.remaining = o.remaining.saturating_sub(1);
        if o.remaining == 0 {
            if let Some(mut o) = self.outgoing.remove(&out) {
                if o.credited {
                    self.credit.give_back(o.peer, o.len);
                    if let Some(e) = &o.error {
                        // Its step has moved on; the receiver counts the message missing.
                        tracing::debug!(peer = o.peer, error = %e, "libfabric: a credited send failed");
                    }
                }
                if let Some(done) = o.done.take() {
                    let _ = done.send(o.error.take().map_or(Ok(()), Err));
                }
                self.credit(o.peer);
            }
        }
    }

    /// Dispatches a completion to its operation.
    fn complete(&mut self, c: Completion) {
        let Some(op) = self.ops.remove(&c.context) else {
            tracing::debug!(
                context = c.context,
                "libfabric: completion of an unknown operation"
            );
            return;
        };
        let Op { mr, kind, context } = op;
        drop(mr);
        drop(context);
        match kind {
            OpKind::SendHeader { out, peer, .. } | OpKind::SendFragment { out, peer, .. } => {
                let error = c.error.map(|e| {
                    // A cancel is ours (at shutdown).
                    if e.code != safe::ECANCELED && !self.failed[peer] {
                        tracing::debug!(peer, error = %e, "libfabric: a send to the peer failed");
                        self.failed[peer] = true;
                    }
                    e.to_string()
                });
                self.finish_part(out, error);
            }
            OpKind::RecvHeader { peer, seq, buf, .. } => self.header_arrived(peer, seq, &buf, &c),
            OpKind::RecvFragment { peer, seq, len, .. } => {
                self.fragment_arrived(peer, seq, len, &c);
            }
        }
    }

    /// Closes `peer`'s slot: its posted header receives are cancelled, and its claimed
    /// payloads get the slot's outcome at once and their fragment receives are cancelled
    /// (their buffers stay until the provider completes them).
    fn close_peer(&mut self, peer: Rank, why: Closed) {
        self.closed[peer] = true;
        let rx = &mut self.rx[peer];
        rx.early.clear();
        for h in rx.headers.drain(..) {
            if h.arrived.is_none() {
                self.endpoint.cancel(h.id);
            }
        }
        for inbound in &mut rx.payloads {
            inbound.failed = true;
            // The buffer stays with its fragments in flight (see `Inbound::buf`).
            if let Some(d) = inbound.delivery.take() {
                d.complete(match &why {
                    Closed::Gone => RecvOutcome::Missing,
                    Closed::Violation(w) => RecvOutcome::Malformed(w.clone()),
                });
            }
            for &id in &inbound.in_flight {
                self.endpoint.cancel(id);
            }
        }
        self.mailbox.close(peer, why);
    }

    /// Records what arrived for header receive `seq` of `peer`: the opened header if it is
    /// acceptable (sealed by the peer, its length within the limit), or why it is not.
    /// Headers are taken in order by [`Engine::advance_headers`].
    fn header_arrived(&mut self, peer: Rank, seq: u64, buf: &[u8; SEALED_LEN], c: &Completion) {
        if self.closed[peer] {
            return;
        }
        let checked = match c.error {
            None if c.len == SEALED_LEN => match self.keys.open(peer, seq, buf) {
                Ok(o)
                    if o.header.len > self.config.max || usize::try_from(o.header.len).is_err() =>
                {
                    Err(Some(format!(
                        "frame of {} bytes exceeds the limit of {}",
                        o.header.len, self.config.max
                    )))
                }
                Ok(o) => Ok(o),
                Err(Unsealed::Invalid(why)) => Err(Some(why)),
                Err(Unsealed::Forged) => Err(None),
            },
            // Another length: not a sealed header, so not the peer's.
            None => Err(None),
            Some(e) if e.code == safe::ETRUNC => Err(None),
            Some(e) => Err(Some(format!("header receive failed: {e}"))),
        };
        if let Some(h) = self.rx[peer].headers.iter_mut().find(|h| h.seq == seq) {
            h.arrived = Some(checked);
        }
    }

    fn fragment_arrived(&mut self, peer: Rank, seq: u64, len: usize, c: &Completion) {
        let rx = &mut self.rx[peer];
        let Some(inbound) = rx.payloads.iter_mut().find(|p| p.seq == seq) else {
            tracing::debug!(peer, "libfabric: a payload fragment for no payload");
            return;
        };
        rx.fragments = rx.fragments.saturating_sub(1);
        inbound.in_flight.retain(|&id| id != c.context);
        let violation = match c.error {
            None if c.len == len => {
                inbound.received += len;
                None
            }
            None => Some(format!(
                "payload fragment of {} bytes where its header announced {len}",
                c.len
            )),
            Some(e) if e.code == safe::ETRUNC => Some(format!(
                "payload fragment longer than the {len} bytes its header announced"
            )),
            Some(e) if e.code == safe::ECANCELED => None,
            Some(e) => Some(format!("payload receive failed: {e}")),
        };
        if let Some(why) = violation {
            if !self.closed[peer] {
                self.close_peer(peer, Closed::Violation(why));
            }
        }
    }

    /// Moves peer `peer`'s receive side forward; `true` if anything happened.
    fn advance_receive(&mut self, peer: Rank) -> bool {
        if peer == self.config.me {
            return false;
        }
        if self.closed[peer] {
            // Fragments still in flight must finish before their buffer may go.
            self.rx[peer].payloads.retain(|p| !p.in_flight.is_empty());
            return false;
        }
        let mut busy = self.advance_headers(peer);
        if !self.closed[peer] {
            busy |= self.advance_claims(peer);
        }
        if !self.closed[peer] {
            busy |= self.advance_payloads(peer);
        }
        busy
    }

    /// Takes the headers that arrived from `peer`, in order, and keeps the header window
    /// posted.
    fn advance_headers(&mut self, peer: Rank) -> bool {
        let mut busy = false;
        while self.rx[peer]
            .headers
            .front()
            .is_some_and(|h| h.arrived.is_some())
        {
            let Some(HeaderRecv {
                seq,
                arrived: Some(checked),
                ..
            }) = self.rx[peer].headers.pop_front()
            else {
                break;
            };
            busy = true;
            match checked {
                Ok(opened) => self.rx[peer].early.push_back((seq, opened)),
                Err(None) => {
                    tracing::warn!(
                        peer,
                        seq,
                        "libfabric: dropped a frame header on the peer's tags that is not \
                         sealed by it (forged, replayed or corrupted)"
                    );
                    match self.post_header(peer, seq) {
                        Ok(Some(h)) => self.rx[peer].headers.push_front(h),
                        // The provider is busy: try again next turn.
                        Ok(None) => {
                            self.rx[peer].headers.push_front(HeaderRecv {
                                seq,
                                id: 0,
                                arrived: Some(Err(None)),
                            });
                            break;
                        }
                        Err(why) => {
                            self.close_peer(peer, Closed::Violation(why));
                            return true;
                        }
                    }
                }
                Err(Some(why)) => {
                    self.close_peer(peer, Closed::Violation(why));
                    return true;
                }
            }
        }
        let rx = &self.rx[peer];
        if self.failed[peer] && rx.early.is_empty() && rx.payloads.is_empty() {
            // Sending to the peer failed and nothing more from it has arrived: it is gone.
            // The cancelled receives still complete (or are leaked at shutdown).
            self.close_peer(peer, Closed::Gone);
            return true;
        }
        while self.rx[peer].headers.len() < self.config.header_window {
            let seq = self.rx[peer].next_post;
            match self.post_header(peer, seq) {
                Ok(Some(h)) => {
                    let rx = &mut self.rx[peer];
                    rx.next_post += 1;
                    rx.headers.push_back(h);
                    busy = true;
                }
                Ok(None) => break,
                Err(why) => {
                    self.close_peer(peer, Closed::Violation(why));
                    return true;
                }
            }
        }
        busy
    }

    /// Posts the header receive of `peer`'s message `seq`: `Ok(None)` when the provider is
    /// busy.
    fn post_header(&mut self, peer: Rank, seq: u64) -> Result<Option<HeaderRecv>, String> {
        let mut op = Op::new(OpKind::RecvHeader {
            peer,
            seq,
            tag: tag(peer, KIND_HEADER, seq),
            buf: Box::new([0u8; SEALED_LEN]),
        });
        let id = op.id();
        let buf = match &mut op.kind {
            OpKind::RecvHeader { buf, .. } => buf.as_mut_ptr(),
            _ => ptr::null_mut(),
        };
        // SAFETY: the buffer is heap memory owned by `op`.
        match unsafe { self.post(op, buf, SEALED_LEN) } {
            Ok(None) => Ok(Some(HeaderRecv {
                seq,
                id,
                arrived: None,
            })),
            Ok(Some(_)) => Ok(None),
            Err((_, e)) => Err(format!("cannot receive from rank {peer}: {e}")),
        }
    }

    /// Claims the receives of `peer`'s checked headers, in order. A header of the expected
    /// length gets a buffer of that length; one of another length, or for a retired step,
    /// is drained into the scratch buffer.
    fn advance_claims(&mut self, peer: Rank) -> bool {
        let mut busy = false;
        while let Some(&(seq, opened)) = self.rx[peer].early.front() {
            let header = opened.header;
            let claim = match self.mailbox.try_claim(peer, header.key()) {
                None => break,
                Some(Claim::Closed) => {
                    self.rx[peer].early.clear();
                    return true;
                }
                Some(claim) => claim,
            };
            self.rx[peer].early.pop_front();
            busy = true;
            // The length was checked against the limit when the header arrived.
            let announced = usize::try_from(header.len).unwrap_or(usize::MAX);
            let mut base = ptr::null_mut();
            let (delivery, buf) = match claim {
                Claim::Posted(d) if announced == d.expected_len() => {
                    let mut buf = self.pool.take(announced);
                    base = buf.as_mut_ptr();
                    (Some(d), Some(buf))
                }
                Claim::Posted(d) => {
                    let expected = d.expected_len();
                    d.complete(RecvOutcome::Malformed(format!(
                        "frame of {} bytes, expected {expected}",
                        header.len
                    )));
                    (None, None)
                }
                _ => (None, None),
            };
            self.rx[peer].payloads.push_back(Box::new(Inbound {
                seq,
                opened,
                total: announced,
                next: 0,
                received: 0,
                in_flight: Vec::new(),
                delivery,
                buf,
                base,
                failed: false,
                retries: 0,
            }));
        }
        busy
    }

    /// Delivers the payloads of `peer` whose fragments have all arrived, and posts the next
    /// fragment receives, oldest payload first, at most [`WINDOW`] in flight for the peer.
    fn advance_payloads(&mut self, peer: Rank) -> bool {
        let mut busy = false;
        let fragment = self.config.fragment;
        let rx = &mut self.rx[peer];
        rx.payloads.retain_mut(|inbound| {
            if !inbound.in_flight.is_empty() || inbound.received != inbound.total {
                return true;
            }
            if let (Some(d), Some(mut buf)) = (inbound.delivery.take(), inbound.buf.take()) {
                // Every fragment completed with its exact length: the provider wrote all
                // `total` bytes.
                buf.set_len(inbound.total);
                if inbound
                    .opened
                    .payload_matches(&buf.as_mut_slice()[..inbound.total])
                {
                    d.complete(RecvOutcome::Received(Payload::Host(buf.freeze())));
                } else if inbound.total <= fragment && inbound.retries < PAYLOAD_RETRIES {
                    tracing::warn!(
                        peer,
                        seq = inbound.seq,
                        "libfabric: dropped a payload on the peer's tags that does not match \
                         its sealed header; receiving it again"
                    );
                    // Posted again by the loop below, into the same buffer.
                    inbound.retries += 1;
                    inbound.next = 0;
                    inbound.received = 0;
                    inbound.delivery = Some(d);
                    inbound.buf = Some(buf);
                    busy = true;
                    return true;
                } else {
                    tracing::warn!(
                        peer,
                        seq = inbound.seq,
                        "libfabric: a payload that does not match its sealed header"
                    );
                    d.complete(RecvOutcome::Malformed(
                        "payload does not match the digest sealed in its header (forged or \
                         corrupted)"
                            .into(),
                    ));
                }
            }
            busy = true;
            false
        });
        let mut i = 0;
        while i < self.rx[peer].payloads.len() && self.rx[peer].fragments < WINDOW {
            let inbound = &mut self.rx[peer].payloads[i];
            if inbound.next >= inbound.total || inbound.failed {
                i += 1;
                continue;
            }
            let len = self.config.fragment.min(inbound.total - inbound.next);
            let seq = inbound.seq;
            let buf = if inbound.buf.is_some() {
                // SAFETY: `next < total`, and the buffer's capacity is at least `total`.
                unsafe { inbound.base.add(inbound.next) }
            } else {
                if self.scratch.len() < self.config.fragment {
                    self.scratch = vec![0; self.config.fragment];
                }
                self.scratch.as_mut_ptr()
            };
            let op = Op::new(OpKind::RecvFragment {
                peer,
                seq,
                tag: tag(peer, KIND_PAYLOAD, seq),
                len,
            });
            let id = op.id();
            // SAFETY: `buf[..len]` lies in the Inbound's buffer, which is not otherwise touched
            // and not freed until its fragments complete (or is leaked with them), with no two
            // fragments overlapping; or in the scratch buffer,
            // which is allocated before any fragment is in flight, never read and never freed
            // while fragments are in flight.
            match unsafe { self.post(op, buf, len) } {
                Ok(None) => {
                    let rx = &mut self.rx[peer];
                    rx.fragments += 1;
                    let inbound = &mut rx.payloads[i];
                    inbound.in_flight.push(id);
                    inbound.next += len;
                    busy = true;
                }
                Ok(Some(_)) => break,
                Err((_, e)) => {
                    let why = format!("cannot receive the payload: {e}");
                    self.close_peer(peer, Closed::Violation(why));
                    return true;
                }
            }
        }
        busy
    }

    /// Fails sends not yet posted, cancels everything in flight and waits (briefly) for it to
    /// complete, then closes the endpoint (and with it the queue, address vector, domain and
    /// fabric). Buffers of operations that never complete are leaked, not freed.
    fn close(mut self) -> Endpoint {
        // Sends already reported done to their steps go out first (for a bounded time): a
        // rank that finished its part and dropped its transport must not take its last
        // messages along.
        let linger = Instant::now() + Duration::from_secs(2);
        while !self.outgoing.is_empty() && Instant::now() < linger {
            let posted = self.post_sends();
            if !self.read_completions() && !posted {
                thread::sleep(Duration::from_micros(50));
            }
        }
        for op in std::mem::take(&mut self.backlog).into_iter().flatten() {
            if let Some((out, _)) = op.send() {
                self.finish_part(out, Some("the transport shut down".into()));
            }
        }
        for &id in self.ops.keys() {
            self.endpoint.cancel(id);
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while !self.ops.is_empty() && Instant::now() < deadline {
            if !self.read_completions() {
                thread::sleep(Duration::from_micros(50));
            }
        }
        if !self.ops.is_empty() {
            // The provider may still own these buffers: never free them under it.
            tracing::warn!(
                operations = self.ops.len(),
                "libfabric shutdown: leaking buffers of operations that did not complete"
            );
            std::mem::forget(std::mem::take(&mut self.ops));
            std::mem::forget(std::mem::take(&mut self.rx));
            std::mem::forget(std::mem::take(&mut self.scratch));
        }
        self.endpoint
    }
}
