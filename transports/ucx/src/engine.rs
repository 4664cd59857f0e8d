//! The UCX transport: a progress thread owns the UCP worker; tokio tasks talk to it through a
//! bounded command queue and the shared [`Mailbox`].
//!
//! # Messages
//! Every message is two UCX tag messages from the same sender: a sealed [`FrameHeader`]
//! ([`SEALED_LEN`] bytes: header, payload digest, MAC; see [`byzcoll_transport_kit::wire`]) (kind
//! `HEADER`) and the payload (kind `PAYLOAD`), both carrying the same per-pair sequence number
//! in their tags:
//!
//! ```text
//! tag = sender (24 bits) | kind (2 bits) | sequence (38 bits)
//! ```
//!
//! # Authentication
//! A receiver cannot tell which endpoint a tag message came from, so anyone who knows a
//! worker address can send messages with any rank's tags. Every frame is therefore sealed
//! under the key of its ordered pair (X25519 keys published with the worker addresses through
//! the authenticated store, mixed with the job secret): a header whose MAC does not verify
//! (or of the wrong length) cannot be attributed to the rank whose tags it used, so it is
//! dropped with a warning and the receive is posted again for the same sequence number (the
//! genuine header still matches it); it never closes the peer. A payload that does not match
//! its header's sealed digest is not delivered: its receive is posted again (at most
//! [`PAYLOAD_RETRIES`] times, since a stranger's payload with the same tag may have matched
//! first), then the receive is `Malformed`. So a forged frame is never delivered; a stranger
//! who keeps injecting can still make a receive `Malformed` or `Missing` (tag matching gives
//! no way to refuse its messages before they match).
//!
//! The progress thread keeps [`HEADER_WINDOW`] header receives posted per peer, for the exact
//! tags of that peer's next sequence numbers, into fixed [`SEALED_LEN`]-byte buffers. It opens
//! each header (MAC, sender, length limit) and claims the matching receive in the mailbox, in
//! sequence order. Only then does it post the payload
//! receive, for the exact tag, with the length the receiver expects, into a buffer it owns; a
//! payload of another length, or one for a retired step, is received into a zero-length
//! buffer and discarded (UCX truncates it). So no allocation is ever sized by a peer's number.
//! Claims are in order, but the payload receives of many messages are in flight at once, and
//! UCX matches arriving messages to posted receives itself: no probe, no unexpected-queue
//! copy for headers, no round trip through the thread between a header and its payload.
//!
//! Receive buffers come from a [`BufferPool`] (at most [`UcxOptions::pool_bytes`] idle): a
//! fresh allocation per large message cost a page fault per 4 KiB page, which limited shared
//! memory to about 2 GB/s where UCX itself moves 10.
//!
//! # Progress
//! The engine (worker, endpoints, requests, buffers) moves in turns under
//! [`byzcoll_transport_kit::progress::Progress`]: `ucp_worker_progress` until it finds nothing, then
//! queued sends, endpoint failures and completions. The task awaiting an exchange runs the
//! turns itself while its step is open; a progress thread runs them otherwise, and when idle
//! arms the worker (`UCP_FEATURE_WAKEUP`) and blocks in `poll` on its event descriptor until
//! UCX has events or a transport method signals it (`ucp_worker_signal`). See that module for
//! who runs turns when, and the measurements behind it. The worker is created
//! `UCS_THREAD_MODE_SERIALIZED`: several threads use it, one at a time. Buffers of unfinished
//! UCX requests stay owned by the engine until the request completes, and at shutdown until it
//! has been cancelled and completed (or leaked if UCX never completes it), so UCX never writes
//! into freed memory.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
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
use byzcoll_ucx_sys as sys;
use futures::future::BoxFuture;
use tokio::sync::mpsc;

use crate::safe::{self, Context, Endpoint, Poll, Request, Signaller, Worker};

pub(crate) const KIND_HEADER: u64 = 1;
pub(crate) const KIND_PAYLOAD: u64 = 2;
const SEQ_BITS: u32 = 38;
const SENDER_SHIFT: u32 = SEQ_BITS + 2;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
/// Largest world the tag layout can address.
pub const MAX_RANKS: usize = 1 << 24;
pub use byzcoll_transport_kit::progress::SPIN;
/// Header receives kept posted per peer.
pub const HEADER_WINDOW: usize = 16;
/// How many times a payload receive is posted again after a payload that did not match its
/// sealed header (see the module docs).
pub const PAYLOAD_RETRIES: u8 = 3;
/// See [`byzcoll_transport_kit::progress::SEND_CREDIT`].
pub use byzcoll_transport_kit::progress::SEND_CREDIT;
/// How long the blocked thread sleeps at most while a header waits for its step to be posted
/// (a step can be retired without waking the thread), and otherwise.
const EARLY_RECHECK_MS: i32 = 2;
const IDLE_RECHECK_MS: i32 = 100;
/// Commands queued before senders wait.
const COMMAND_QUEUE: usize = 1024;
/// TCP segment sizes byzcoll sets on its own context (`UCX_TCP_TX_SEG_SIZE` and
/// `UCX_TCP_RX_SEG_SIZE`, 8 and 64 KiB by default) unless the environment sets either.
///
/// With peer failure handling (on by default over TCP, see [`UcxOptions::peer_failure`]) UCX
/// gives up TCP's zero-copy put for rendezvous (`ucx_info -e -u twe` shows no `rma_bw` lane)
/// and moves large messages as active-message fragments of one send segment each: with 8 KiB
/// segments that is a round of UCX work per 8 KiB. Measured with the p2p bench over loopback
/// (interleaved runs): 4 and 16 MiB messages went from 1.5-2.4 GB/s to 3.3-4.8 GB/s, about
/// what `ucx_perftest` (no failure handling, zero-copy put) moves; 64 KiB-1 MiB got faster
/// too. Larger segments (256 KiB / 1 MiB) were no faster for large messages and halved
/// 64 KiB messages, which then go eagerly and arrive before their receive is posted.
const TCP_SEGMENTS: &[(&str, &str)] = &[("TX_SEG_SIZE", "64k"), ("RX_SEG_SIZE", "256k")];

/// The settings for [`Context::with_settings`]: [`TCP_SEGMENTS`] when endpoints handle peer
/// failures and the user chose neither segment size. (Only UCX's TCP transport has settings
/// of these names, checked with `ucx_info -c -a` on UCX 1.13 with InfiniBand built in.)
/// Without failure handling TCP rendezvous uses the zero-copy put, large messages gain
/// nothing from larger segments, and 16 KiB messages measured slower.
pub(crate) fn context_settings(options: &UcxOptions) -> &'static [(&'static str, &'static str)] {
    let user_set = ["UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
    if user_set || !options.peer_failure_handling() {
        &[]
    } else {
        TCP_SEGMENTS
    }
}

pub(crate) fn tag(sender: Rank, kind: u64, seq: u64) -> u64 {
    ((sender as u64) << SENDER_SHIFT) | (kind << SEQ_BITS) | (seq & SEQ_MASK)
}

/// Settings of the UCX transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxOptions {
    /// Largest message accepted or sent.
    pub max_message_bytes: u64,
    /// Most bytes of idle receive buffers kept for reuse (see [`BufferPool`]).
    pub pool_bytes: usize,
    /// Whether endpoints ask UCX to report peer failures (`BYZCOLL_UCX_PEER_FAILURE`, read by
    /// `byzcoll::JobConfig`). UCX can only do so over transports that support it (TCP,
    /// InfiniBand), not over shared memory, and refuses the endpoint otherwise; so `None` (the
    /// default) means on unless `UCX_TLS` names only shared-memory transports. Without it, a
    /// dead peer is noticed at the step deadline.
    pub peer_failure: Option<bool>,
}

impl Default for UcxOptions {
    fn default() -> Self {
        UcxOptions {
            max_message_bytes: 1 << 40,
            pool_bytes: 256 << 20,
            peer_failure: None,
        }
    }
}

impl UcxOptions {
    /// Whether endpoints handle peer failures: [`UcxOptions::peer_failure`], or its default.
    fn peer_failure_handling(&self) -> bool {
        if let Some(on) = self.peer_failure {
            return on;
        }
        let Ok(tls) = std::env::var("UCX_TLS") else {
            return true;
        };
        let shared_memory = ["sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self"];
        !tls.trim_start_matches('^')
            .split(',')
            .all(|t| shared_memory.contains(&t.trim()))
    }
}

/// The UCX transport; see the module docs.
#[derive(Debug)]
pub struct UcxTransport {
    rank: Rank,
    size: usize,
    mailbox: Arc<Mailbox>,
    commands: Option<mpsc::Sender<SendCommand>>,
    progress: Progress<Engine>,
    max_message_bytes: u64,
}

/// Wakes the progress thread blocked on the worker's event descriptor.
struct WorkerSignal(Signaller);

impl Signal for WorkerSignal {
    fn signal(&self) {
        // SAFETY: `Progress` signals only while its thread runs, and the worker is destroyed
        // by the engine's shutdown at the end of that thread.
        unsafe { self.0.signal() };
    }
}

/// The UCP handles of one worker.
struct Handles {
    worker: Worker,
    endpoints: Vec<Option<Endpoint>>,
}

thread_local! {
    /// Peers whose endpoint reported an error, filled by `on_endpoint_error` during progress
    /// and emptied into the engine by the same turn.
    static FAILED: RefCell<Vec<(usize, sys::ucs_status_t::Type)>> = const { RefCell::new(Vec::new()) };
}

unsafe extern "C" fn on_endpoint_error(
    arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t::Type,
) {
    // Called by UCX inside a UCP call on the thread running a turn; `arg` is the peer rank.
    FAILED.with(|f| f.borrow_mut().push((arg as usize, status)));
}

impl UcxTransport {
    /// Creates a UCP context and worker (honouring `UCX_TLS`, `UCX_NET_DEVICES` and the other
    /// `UCX_` variables), publishes the worker address through `store`, connects endpoints to
    /// every other rank and starts the progress thread.
    ///
    /// # Errors
    /// [`TransportError::Setup`] when UCX cannot initialise, the store fails, or a rank
    /// publishes an unusable address.
    pub async fn from_store(
        store: &StoreClient,
        rank: Rank,
        size: usize,
        options: UcxOptions,
    ) -> Result<Self, TransportError> {
        if size > MAX_RANKS || rank >= size {
            return Err(TransportError::InvalidUsage(format!(
                "rank {rank} of {size}: the UCX transport addresses at most {MAX_RANKS} ranks"
            )));
        }
        let setup = |e: safe::UcxError| TransportError::Setup(e.to_string());
        let context = Context::with_settings(context_settings(&options)).map_err(setup)?;
        let worker = context.worker().map_err(setup)?;
        let address = worker.address().map_err(setup)?;
        // The frame key is published with the address: the store is authenticated, so the
        // table is the job's (see the module docs).
        let secret = FrameSecret::generate().map_err(|e| TransportError::Setup(e.to_string()))?;
        let published = store
            .all_gather("byzcoll/ucx", &wire::publish(&secret, &address))
            .await
            .map_err(|e| TransportError::Setup(e.to_string()))?;
        if published.len() != size {
            return Err(TransportError::Setup(format!(
                "{} UCX addresses for a world of {size}",
                published.len()
            )));
        }
        let mut publics = Vec::with_capacity(size);
        let mut addresses = Vec::with_capacity(size);
        for (peer, value) in published.iter().enumerate() {
            let (key, address) = wire::published(value)
                .map_err(|e| TransportError::Setup(format!("rank {peer}: {e}")))?;
            publics.push(key);
            addresses.push(value.slice_ref(address));
        }
        let keys =
            FrameKeys::new(store.auth(), rank, &secret, &publics).map_err(TransportError::Setup)?;
        Self::start(context, worker, &addresses, keys, rank, size, options)
    }

    /// Connects a world whose worker addresses are known (for tests that build all ranks in
    /// one process): `worlds[r]` is rank `r`'s (context, worker, address).
    ///
    /// # Errors
    /// As [`UcxTransport::from_store`].
    pub fn local_world(size: usize, options: UcxOptions) -> Result<Vec<Self>, TransportError> {
        let setup = |e: safe::UcxError| TransportError::Setup(e.to_string());
        let mut parts = Vec::with_capacity(size);
        for _ in 0..size {
            let context = Context::with_settings(context_settings(&options)).map_err(setup)?;
            let worker = context.worker().map_err(setup)?;
            let address = worker.address().map_err(setup)?;
            parts.push((context, worker, Bytes::from(address)));
        }
        let addresses: Vec<Bytes> = parts.iter().map(|p| p.2.clone()).collect();
        let keys = FrameKeys::local_world(size).map_err(TransportError::Setup)?;
        Self::local_world_of(parts, &addresses, keys, options)
    }

    /// Starts the ranks of an in-process world from their parts, worker addresses and keys
    /// (the tests keep the addresses and keys to play strangers and insiders).
    pub(crate) fn local_world_of(
        parts: Vec<(Context, Worker, Bytes)>,
        addresses: &[Bytes],
        keys: Vec<FrameKeys>,
        options: UcxOptions,
    ) -> Result<Vec<Self>, TransportError> {
        let size = parts.len();
        parts
            .into_iter()
            .zip(keys)
            .enumerate()
            .map(|(rank, ((context, worker, _), keys))| {
                Self::start(
                    context,
                    worker,
                    addresses,
                    keys,
                    rank,
                    size,
                    options.clone(),
                )
            })
            .collect()
    }

    fn start(
        context: Context,
        worker: Worker,
        addresses: &[Bytes],
        keys: FrameKeys,
        rank: Rank,
        size: usize,
        options: UcxOptions,
    ) -> Result<Self, TransportError> {
        let mut endpoints = Vec::with_capacity(size);
        for (peer, address) in addresses.iter().enumerate() {
            if peer == rank {
                endpoints.push(None);
                continue;
            }
            let ep = if options.peer_failure_handling() {
                worker.connect(address, peer, Some(Some(on_endpoint_error)))
            } else {
                worker.connect(address, peer, None)
            }
            .map_err(|e| TransportError::Setup(format!("rank {peer}'s address: {e}")))?;
            endpoints.push(Some(ep));
        }
        drop(context);
        let signal = WorkerSignal(worker.signaller());
        let handles = Handles { worker, endpoints };
        let mailbox = Arc::new(Mailbox::new(size));
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        let engine = Engine::new(handles, rank, size, keys, mailbox.clone(), rx, &options);
        let progress = Progress::start(format!("byzcoll-ucx-{rank}"), engine, signal)
            .map_err(TransportError::Io)?;
        tracing::debug!(rank, size, version = %safe::version(), "ucx transport started");
        Ok(UcxTransport {
            rank,
            size,
            mailbox,
            commands: Some(tx),
            progress,
            max_message_bytes: options.max_message_bytes,
        })
    }
}

impl Drop for UcxTransport {
    fn drop(&mut self) {
        // The engine cancels and drains its requests and closes the endpoints within a
        // bounded time, on the progress thread.
        self.commands = None;
        self.progress.finish();
    }
}

impl Transport for UcxTransport {
    fn name(&self) -> &'static str {
        "ucx"
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
                "ucx",
                self.commands.as_ref(),
            )
            .await
        })
    }
}

/// A send in flight: the buffers stay here until both UCX requests complete.
struct Outgoing {
    peer: Rank,
    /// Reported done to the step (it counts against `Engine::credit`).
    credited: bool,
    requests: Vec<Request>,
    _header: Box<[u8; SEALED_LEN]>,
    _payload: Bytes,
    done: Option<SendDone>,
    error: Option<String>,
}

/// A header receive posted for the exact tag of one sequence number.
struct HeaderRecv {
    seq: u64,
    request: Request,
    buf: Box<[u8; SEALED_LEN]>,
}

/// A payload receive posted for the exact tag of one sequence number, into a buffer of the
/// length the receiver expects (`delivery`), or of length zero to drain an unwanted payload.
struct PayloadRecv {
    peer: Rank,
    seq: u64,
    request: Request,
    buf: PoolBuf,
    len: usize,
    delivery: Option<Delivery>,
    /// The opened header the payload must match.
    opened: Opened,
    /// Receives posted again after a payload that did not match.
    retries: u8,
}

/// The receive side of one peer.
#[derive(Default)]
struct PeerRx {
    /// Header receives in flight, in sequence order.
    headers: VecDeque<HeaderRecv>,
    /// Sequence number of the next header receive to post.
    next_post: u64,
    /// Opened headers whose claim is not settled yet, in sequence order.
    early: VecDeque<(u64, Opened)>,
}

struct Engine {
    handles: Handles,
    /// The worker's event descriptor, if it has one.
    efd: Option<i32>,
    me: Rank,
    /// Seals frames to and opens frames from every peer.
    keys: FrameKeys,
    mailbox: Arc<Mailbox>,
    commands: mpsc::Receiver<SendCommand>,
    pool: BufferPool,
    outgoing: Vec<Outgoing>,
    /// Credited sends still in flight (see [`SEND_CREDIT`]).
    credit: SendCredit,
    rx: Vec<PeerRx>,
    payloads: Vec<PayloadRecv>,
    /// Cancelled receives whose buffers must outlive them.
    retiring: Vec<(Request, Box<[u8; SEALED_LEN]>)>,
    next_seq: Vec<u64>,
    /// The peer's slot is closed: nothing more is received from it.
    closed: Vec<bool>,
    /// The peer's endpoint failed: nothing more is sent to it, and its slot closes once the
    /// messages that did arrive have been taken.
    failed: Vec<bool>,
    max: u64,
}

// SAFETY: the engine holds the UCP worker, its endpoints and requests, and the buffers UCX
// writes into. UCP allows a worker and its objects to be used from any thread as long as only
// one uses them at a time (the worker is created UCS_THREAD_MODE_SERIALIZED); the engine is
// only ever reached through its `Progress`'s mutex, so its turns never overlap.
unsafe impl Send for Engine {}

impl byzcoll_transport_kit::progress::Engine for Engine {
    type Remains = ();

    /// UCX progress until it finds nothing, then queued sends, failures, completions.
    fn turn(&mut self) -> Option<bool> {
        let mut busy = false;
        while self.handles.worker.progress() > 0 {
            busy = true;
        }
        busy |= self.take_commands()? > 0;
        busy |= self.handle_failures();
        busy |= self.advance_sends();
        busy |= self.advance_receives();
        // Endpoint errors reported by the calls since (cancels) are taken into the engine now:
        // the list is per thread, and the next turn may run on another one.
        busy |= self.handle_failures();
        Some(busy)
    }

    fn in_flight(&self) -> bool {
        !self.outgoing.is_empty() || !self.payloads.is_empty()
    }

    /// Blocks on the armed worker's event descriptor, briefly while a header waits for its
    /// step to be posted (a step can be retired without a wakeup).
    fn idle(&mut self) -> Idle {
        let timeout_ms = if self.rx.iter().any(|r| !r.early.is_empty()) {
            EARLY_RECHECK_MS
        } else {
            IDLE_RECHECK_MS
        };
        match self.efd.map(|fd| (fd, self.handles.worker.arm())) {
            Some((fd, Ok(true))) => Idle::Block {
                fds: vec![fd],
                timeout_ms,
            },
            Some((_, Ok(false))) => Idle::Busy,
            Some((_, Err(_))) | None => Idle::Nap,
        }
    }

    fn shutdown(self) {
        self.close();
    }
}

impl Engine {
    fn new(
        handles: Handles,
        me: Rank,
        size: usize,
        keys: FrameKeys,
        mailbox: Arc<Mailbox>,
        commands: mpsc::Receiver<SendCommand>,
        options: &UcxOptions,
    ) -> Self {
        let efd = match handles.worker.event_fd() {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::warn!(error = %e, "ucx: no event descriptor; the progress thread polls");
                None
            }
        };
        let mut engine = Engine {
            efd,
            handles,
            me,
            keys,
            mailbox,
            commands,
            pool: BufferPool::new(options.pool_bytes),
            outgoing: Vec::new(),
            credit: SendCredit::new(size),
            rx: (0..size).map(|_| PeerRx::default()).collect(),
            payloads: Vec::new(),
            retiring: Vec::new(),
            next_seq: vec![0; size],
            closed: vec![false; size],
            failed: vec![false; size],
            max: options.max_message_bytes,
        };
        for peer in 0..size {
            engine.post_headers(peer);
        }
        engine
    }

    /// Starts queued sends; `None` once the transport has been dropped.
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

    fn start_send(&mut self, peer: Rank, key: MsgKey, payload: Bytes, done: SendDone) {
        let Some(ep) = self.handles.endpoints[peer]
            .as_ref()
            .filter(|_| !self.closed[peer] && !self.failed[peer])
        else {
            let _ = done.send(Err(format!("rank {peer} is unreachable")));
            return;
        };
        let seq = self.next_seq[peer];
        self.next_seq[peer] += 1;
        let header = FrameHeader::new(key, self.me, payload.len());
        let header = Box::new(self.keys.seal(peer, seq, &header, &payload));
        let mut out = Outgoing {
            peer,
            credited: false,
            requests: Vec::with_capacity(2),
            _header: header,
            _payload: payload,
            done: Some(done),
            error: None,
        };
        // SAFETY: both buffers are owned by `out`, which stays in `self.outgoing` until both
        // requests have completed (or the worker is gone).
        let sent = unsafe {
            ep.send(
                out._header.as_ptr(),
                SEALED_LEN,
                tag(self.me, KIND_HEADER, seq),
            )
            .and_then(|h| {
                out.requests.push(h);
                ep.send(
                    out._payload.as_ptr(),
                    out._payload.len(),
                    tag(self.me, KIND_PAYLOAD, seq),
                )
            })
        };
        match sent {
            Ok(r) => out.requests.push(r),
            Err(e) => out.error = Some(e.to_string()),
        }
        if out.requests.iter().all(|r| r.poll() != Poll::Pending) {
            // Completed at once (small messages usually do): no need to keep it.
            if let Some(done) = out.done.take() {
                let _ = done.send(out.error.take().map_or(Ok(()), Err));
            }
            return;
        }
        self.outgoing.push(out);
        self.credit(peer);
    }

    /// Reports done the sends to `peer` that are in flight and fit in its credit, oldest first.
    fn credit(&mut self, peer: Rank) {
        for out in self.outgoing.iter_mut().filter(|o| o.peer == peer) {
            if out.credited || out.done.is_none() {
                continue;
            }
            if !self.credit.try_take(peer, out._payload.len()) {
                break;
            }
            out.credited = true;
            if let Some(done) = out.done.take() {
                let _ = done.send(Ok(()));
            }
        }
    }

    fn advance_sends(&mut self) -> bool {
        let before = self.outgoing.len();
        let credit = &mut self.credit;
        let mut freed = Vec::new();
        self.outgoing.retain_mut(|out| {
            let mut pending = false;
            for r in &out.requests {
                match r.poll() {
                    Poll::Pending => pending = true,
                    Poll::Done(Err(e)) => out.error = Some(safe::status_text(e)),
                    Poll::Done(Ok(_)) => {}
                }
            }
            if pending {
                return true;
            }
            if out.credited {
                credit.give_back(out.peer, out._payload.len());
                freed.push(out.peer);
                if let Some(e) = &out.error {
                    // Its step has moved on; the receiver counts the message missing.
                    tracing::debug!(peer = out.peer, error = %e, "ucx: a credited send failed");
                }
            }
            if let Some(done) = out.done.take() {
                let _ = done.send(out.error.take().map_or(Ok(()), Err));
            }
            false
        });
        freed.dedup();
        for peer in freed {
            self.credit(peer);
        }
        self.outgoing.len() != before
    }

    fn handle_failures(&mut self) -> bool {
        let failed: Vec<(usize, sys::ucs_status_t::Type)> =
            FAILED.with(|f| std::mem::take(&mut *f.borrow_mut()));
        for &(peer, status) in &failed {
            if peer < self.failed.len() && !self.failed[peer] {
                tracing::debug!(peer, status = %safe::status_text(status), "ucx endpoint failed");
                self.failed[peer] = true;
            }
        }
        !failed.is_empty()
    }

    /// Closes `peer`'s slot: cancels its header receives, and its payload receives get the
    /// slot's outcome at once (their buffers stay until UCX completes them).
    fn close_peer(&mut self, peer: Rank, why: Closed) {
        self.closed[peer] = true;
        let rx = &mut self.rx[peer];
        rx.early.clear();
        for h in rx.headers.drain(..) {
            self.handles.worker.cancel(&h.request);
            self.retiring.push((h.request, h.buf));
        }
        for p in self.payloads.iter_mut().filter(|p| p.peer == peer) {
            if let Some(d) = p.delivery.take() {
                d.complete(match &why {
                    Closed::Gone => RecvOutcome::Missing,
                    Closed::Violation(w) => RecvOutcome::Malformed(w.clone()),
                });
            }
            self.handles.worker.cancel(&p.request);
        }
        self.mailbox.close(peer, why);
    }

    /// Keeps [`HEADER_WINDOW`] header receives posted for `peer`'s next sequence numbers.
    fn post_headers(&mut self, peer: Rank) {
        if peer == self.me || self.closed[peer] {
            return;
        }
        while self.rx[peer].headers.len() < HEADER_WINDOW {
            let seq = self.rx[peer].next_post;
            let h = self.header_recv(peer, seq);
            self.rx[peer].next_post += 1;
            self.rx[peer].headers.push_back(h);
        }
    }

    /// Posts the header receive of `peer`'s message `seq`.
    fn header_recv(&self, peer: Rank, seq: u64) -> HeaderRecv {
        let mut buf = Box::new([0u8; SEALED_LEN]);
        // SAFETY: `buf` moves into `self.rx[peer].headers` (its heap memory does not
        // move) and is kept, there or in `self.retiring`, until the request completes.
        // A receive UCX refuses is a request that completed with the error.
        let request = unsafe {
            self.handles.worker.recv(
                buf.as_mut_ptr(),
                SEALED_LEN,
                tag(peer, KIND_HEADER, seq),
                u64::MAX,
            )
        };
        HeaderRecv { seq, request, buf }
    }

    /// Moves every peer's receive side forward; `true` if anything happened.
    fn advance_receives(&mut self) -> bool {
        let mut busy = false;
        for peer in 0..self.rx.len() {
            if peer != self.me && !self.closed[peer] {
                busy |= self.advance_headers(peer);
                busy |= self.advance_claims(peer);
            }
        }
        busy |= self.advance_payloads();
        for peer in 0..self.rx.len() {
            if self.failed[peer] && !self.closed[peer] && self.drained(peer) {
                self.close_peer(peer, Closed::Gone);
                busy = true;
            }
        }
        self.retiring
            .retain(|(r, _)| matches!(r.poll_recv(), Poll::Pending));
        busy
    }

    /// Whether a failed `peer` has nothing left to deliver: its next header receive is still
    /// open (UCX delivers a peer's messages before reporting its failure, so none will come)
    /// and every header that did arrive has had its payload delivered, drained or refused.
    /// Closing its slot earlier would lose messages that arrived before the failure, such as
    /// the last ones of a peer that finished its work and shut down before this rank read them.
    fn drained(&self, peer: Rank) -> bool {
        let rx = &self.rx[peer];
        rx.early.is_empty()
            && rx
                .headers
                .front()
                .is_none_or(|h| matches!(h.request.poll_recv(), Poll::Pending))
            && !self.payloads.iter().any(|p| p.peer == peer)
    }

    /// Checks the headers that arrived from `peer`, in order, and reposts their receives.
    fn advance_headers(&mut self, peer: Rank) -> bool {
        let mut busy = false;
        while let Some(front) = self.rx[peer].headers.front() {
            let result = match front.request.poll_recv() {
                // A failed peer sends no more headers; its slot closes once what it sent
                // before it went is delivered (`drained`).
                Poll::Pending => break,
                Poll::Done(result) => result,
            };
            busy = true;
            let Some(HeaderRecv { seq, buf, .. }) = self.rx[peer].headers.pop_front() else {
                break;
            };
            // `Err(None)`: not attributable to the peer (anyone may use its tags), so dropped
            // and received again; `Err(Some(why))`: the peer's own fault, or the receive's.
            let checked = match result {
                Ok(SEALED_LEN) => match self.keys.open(peer, seq, &buf) {
                    Ok(o) if o.header.len > self.max || usize::try_from(o.header.len).is_err() => {
                        Err(Some(format!(
                            "frame of {} bytes exceeds the limit of {}",
                            o.header.len, self.max
                        )))
                    }
                    Ok(o) => Ok(o),
                    Err(Unsealed::Invalid(why)) => Err(Some(why)),
                    Err(Unsealed::Forged) => Err(None),
                },
                Ok(_) | Err(sys::ucs_status_t::UCS_ERR_MESSAGE_TRUNCATED) => Err(None),
                Err(e) => Err(Some(format!(
                    "header receive failed: {}",
                    safe::status_text(e)
                ))),
            };
            match checked {
                Ok(opened) => self.rx[peer].early.push_back((seq, opened)),
                Err(None) => {
                    tracing::warn!(
                        peer,
                        seq,
                        "ucx: dropped a frame header on the peer's tags that is not sealed \
                         by it (forged, replayed or corrupted)"
                    );
                    let again = self.header_recv(peer, seq);
                    self.rx[peer].headers.push_front(again);
                }
                Err(Some(why)) => {
                    self.close_peer(peer, Closed::Violation(why));
                    return true;
                }
            }
        }
        if busy {
            self.post_headers(peer);
        }
        busy
    }

    /// Claims the receives of `peer`'s checked headers, in order, and posts their payload
    /// receives: into a buffer of the expected length, or (stale step, wrong length) into an
    /// empty one that drains the payload. So no allocation is sized by a peer's number.
    fn advance_claims(&mut self, peer: Rank) -> bool {
        let mut busy = false;
        while let Some(&(seq, opened)) = self.rx[peer].early.front() {
            let header = opened.header;
            let delivery = match self.mailbox.try_claim(peer, header.key()) {
                None => break,
                Some(Claim::Closed) => {
                    self.rx[peer].early.clear();
                    return true;
                }
                Some(Claim::Stale) => None,
                Some(Claim::Posted(d)) if header.len != d.expected_len() as u64 => {
                    let expected = d.expected_len();
                    d.complete(RecvOutcome::Malformed(format!(
                        "frame of {} bytes, expected {expected}",
                        header.len
                    )));
                    None
                }
                Some(Claim::Posted(d)) => Some(d),
            };
            self.rx[peer].early.pop_front();
            busy = true;
            let len = delivery.as_ref().map_or(0, Delivery::expected_len);
            let mut buf = self.pool.take(len);
            // SAFETY: `buf` has room for `len` bytes and moves into `self.payloads` (its heap
            // memory does not move), which keeps it until the request completes. A receive
            // that completed at once (or was refused) is handled there too.
            let request = unsafe {
                self.handles.worker.recv(
                    buf.as_mut_ptr(),
                    len,
                    tag(peer, KIND_PAYLOAD, seq),
                    u64::MAX,
                )
            };
            self.payloads.push(PayloadRecv {
                peer,
                seq,
                request,
                buf,
                len,
                delivery,
                opened,
                retries: 0,
            });
        }
        busy
    }

    /// Delivers the payloads that arrived and match their sealed header. One that does not
    /// (another length, another digest) is received again, at most [`PAYLOAD_RETRIES`] times
    /// (a stranger's payload on the same tag may have matched first), then `Malformed`; a
    /// drained one is dropped.
    fn advance_payloads(&mut self) -> bool {
        let mut busy = false;
        let mut i = 0;
        while i < self.payloads.len() {
            let result = match self.payloads[i].request.poll_recv() {
                Poll::Pending => {
                    i += 1;
                    continue;
                }
                Poll::Done(result) => result,
            };
            busy = true;
            let PayloadRecv {
                peer,
                seq,
                request,
                mut buf,
                len,
                delivery,
                opened,
                retries,
            } = self.payloads.swap_remove(i);
            drop(request);
            let Some(d) = delivery else {
                tracing::trace!(peer, "ucx: drained a payload");
                continue;
            };
            let unmatched = match result {
                // UCX wrote exactly `len` bytes into the buffer.
                Ok(got) if got == len && opened.payload_matches(&buf.as_mut_slice()[..len]) => {
                    buf.set_len(len);
                    d.complete(RecvOutcome::Received(Payload::Host(buf.freeze())));
                    continue;
                }
                Ok(got) if got == len => "a payload that does not match its sealed digest".into(),
                Ok(got) => format!("payload of {got} bytes, expected {len}"),
                Err(sys::ucs_status_t::UCS_ERR_MESSAGE_TRUNCATED) => {
                    format!("payload longer than the expected {len} bytes")
                }
                // The payload of a peer that went away: it never arrived whole.
                Err(_) if self.failed[peer] => {
                    d.complete(RecvOutcome::Missing);
                    continue;
                }
                Err(e) => {
                    d.complete(RecvOutcome::Malformed(format!(
                        "payload receive failed: {}",
                        safe::status_text(e)
                    )));
                    continue;
                }
            };
            if retries >= PAYLOAD_RETRIES || self.closed[peer] {
                d.complete(RecvOutcome::Malformed(unmatched));
                continue;
            }
            tracing::warn!(peer, seq, why = %unmatched, "ucx: dropped a payload on the peer's tags; receiving it again");
            // SAFETY: as for the first receive into `buf` (`advance_claims`).
            let request = unsafe {
                self.handles.worker.recv(
                    buf.as_mut_ptr(),
                    len,
                    tag(peer, KIND_PAYLOAD, seq),
                    u64::MAX,
                )
            };
            self.payloads.push(PayloadRecv {
                peer,
                seq,
                request,
                buf,
                len,
                delivery: Some(d),
                opened,
                retries: retries + 1,
            });
        }
        busy
    }

    /// Cancels receives, lets sends finish (briefly), closes endpoints, then destroys the
    /// worker (and with it the context). Buffers of requests UCX never completes are leaked,
    /// not freed.
    fn close(mut self) {
        for rx in &mut self.rx {
            for h in rx.headers.drain(..) {
                self.handles.worker.cancel(&h.request);
                self.retiring.push((h.request, h.buf));
            }
        }
        for p in &self.payloads {
            self.handles.worker.cancel(&p.request);
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            self.handles.worker.progress();
            self.advance_sends();
            self.payloads
                .retain(|p| matches!(p.request.poll_recv(), Poll::Pending));
            self.retiring
                .retain(|(r, _)| matches!(r.poll_recv(), Poll::Pending));
            if self.outgoing.is_empty() && self.payloads.is_empty() && self.retiring.is_empty() {
                break;
            }
            thread::sleep(Duration::from_micros(50));
        }
        let closes: Vec<Request> = self
            .handles
            .endpoints
            .iter_mut()
            .filter_map(Option::take)
            .map(|ep| ep.close(false))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(2);
        while closes.iter().any(|c| c.poll() == Poll::Pending) && Instant::now() < deadline {
            self.handles.worker.progress();
            thread::sleep(Duration::from_micros(50));
        }
        drop(closes);
        if !self.outgoing.is_empty() || !self.payloads.is_empty() || !self.retiring.is_empty() {
            // UCX may still own these buffers: never free them under it.
            tracing::warn!("ucx shutdown: leaking buffers of requests that did not complete");
            std::mem::forget(std::mem::take(&mut self.outgoing));
            std::mem::forget(std::mem::take(&mut self.payloads));
            std::mem::forget(std::mem::take(&mut self.retiring));
        }
        drop(self.handles);
    }
}
