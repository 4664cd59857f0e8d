//! The UCX transport: a progress thread owns the UCP worker; tokio tasks talk to it through a
//! bounded command queue and the shared [`Mailbox`].
//!
//! # Messages
//! Every message is two UCX tag messages from the same sender: a 32-byte
//! [`FrameHeader`] (kind `HEADER`) and the payload (kind `PAYLOAD`), both carrying the same
//! per-pair sequence number in their tags:
//!
//! ```text
//! tag = sender (24 bits) | kind (2 bits) | sequence (38 bits)
//! ```
//!
//! The progress thread probes for one header per peer at a time, receives it into a fixed
//! 32-byte buffer, checks it (sender, length limit), and claims the matching receive in the
//! mailbox. Only then does it post the payload receive, with the exact length the receiver
//! expects, into a buffer it owns; a payload of another length, or one for a retired step, is
//! received into a zero-length buffer and discarded. So no allocation is ever sized by a
//! peer's number.
//!
//! # Progress
//! The thread polls `ucp_worker_progress`, spins briefly after activity and then parks for
//! short, growing intervals (at most [`MAX_PARK`]); new commands and newly posted receives
//! unpark it at once. Buffers of unfinished UCX requests stay owned by the thread until the
//! request completes, and at shutdown until it has been cancelled and completed (or leaked if
//! UCX never completes it), so UCX never writes into freed memory.

use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::Arc;
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use byzcoll_runtime::bootstrap::StoreClient;
use byzcoll_runtime::mailbox::{run_step, Claim, Closed, Delivery, Mailbox};
use byzcoll_runtime::wire::{FrameHeader, HEADER_LEN};
use byzcoll_runtime::{
    Capabilities, MemoryKind, MsgKey, Payload, Rank, RecvOutcome, Step, Transport, TransportError,
};
use byzcoll_ucx_sys as sys;
use futures::future::BoxFuture;
use tokio::sync::{mpsc, oneshot};

use crate::safe::{self, Context, Endpoint, Poll, Request, Worker};

const KIND_HEADER: u64 = 1;
const KIND_PAYLOAD: u64 = 2;
const SEQ_BITS: u32 = 38;
const SENDER_SHIFT: u32 = SEQ_BITS + 2;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
/// Largest world the tag layout can address.
pub const MAX_RANKS: usize = 1 << 24;
/// Longest the progress thread parks when idle.
pub const MAX_PARK: Duration = Duration::from_micros(500);
/// How long the thread keeps spinning after the last activity before it starts parking.
const SPIN: Duration = Duration::from_micros(500);
/// Commands queued before senders wait.
const COMMAND_QUEUE: usize = 1024;

fn tag(sender: Rank, kind: u64, seq: u64) -> u64 {
    ((sender as u64) << SENDER_SHIFT) | (kind << SEQ_BITS) | (seq & SEQ_MASK)
}

fn kind_mask() -> u64 {
    !SEQ_MASK
}

/// Settings of the UCX transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxOptions {
    /// Largest message accepted or sent.
    pub max_message_bytes: u64,
}

impl Default for UcxOptions {
    fn default() -> Self {
        UcxOptions {
            max_message_bytes: 1 << 40,
        }
    }
}

enum Command {
    Send {
        peer: Rank,
        key: MsgKey,
        payload: Bytes,
        done: oneshot::Sender<Result<(), String>>,
    },
}

/// The UCX transport; see the module docs.
#[derive(Debug)]
pub struct UcxTransport {
    rank: Rank,
    size: usize,
    mailbox: Arc<Mailbox>,
    commands: Option<mpsc::Sender<Command>>,
    thread: Option<JoinHandle<()>>,
    waker: Thread,
    max_message_bytes: u64,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Send {
                peer, key, payload, ..
            } => f
                .debug_struct("Send")
                .field("peer", peer)
                .field("key", key)
                .field("len", &payload.len())
                .finish(),
        }
    }
}

/// The UCP handles, moved into the progress thread once.
struct Handles {
    worker: Worker,
    endpoints: Vec<Option<Endpoint>>,
}

// SAFETY: UCP handles may be used from any thread as long as only one thread uses them at a
// time (the worker is UCS_THREAD_MODE_SINGLE). They are created on the caller's thread and
// then moved, whole, into the progress thread, which is the only one that touches them.
unsafe impl Send for Handles {}

thread_local! {
    /// Peers whose endpoint reported an error, filled by `on_endpoint_error` during progress.
    static FAILED: RefCell<Vec<(usize, sys::ucs_status_t::Type)>> = const { RefCell::new(Vec::new()) };
}

unsafe extern "C" fn on_endpoint_error(
    arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t::Type,
) {
    // Called by UCX inside ucp_worker_progress on the progress thread; `arg` is the peer rank.
    FAILED.with(|f| f.borrow_mut().push((arg as usize, status)));
}

/// Whether endpoints ask UCX to report peer failures. UCX can only do so over transports that
/// support it (TCP, InfiniBand), not over shared memory, and refuses the endpoint otherwise; so
/// it is off when `UCX_TLS` names only shared-memory transports, and `BYZCOLL_UCX_PEER_FAILURE`
/// (`on`/`off`) overrides. Without it, a dead peer is noticed at the step deadline.
fn peer_failure_handling() -> bool {
    match std::env::var("BYZCOLL_UCX_PEER_FAILURE").as_deref() {
        Ok("on") => return true,
        Ok("off") => return false,
        _ => {}
    }
    let Ok(tls) = std::env::var("UCX_TLS") else {
        return true;
    };
    let shared_memory = ["sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self"];
    !tls.trim_start_matches('^')
        .split(',')
        .all(|t| shared_memory.contains(&t.trim()))
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
        let context = Context::new().map_err(setup)?;
        let worker = context.worker().map_err(setup)?;
        let address = worker.address().map_err(setup)?;
        let addresses = store
            .all_gather("byzcoll/ucx", &address)
            .await
            .map_err(|e| TransportError::Setup(e.to_string()))?;
        Self::start(context, worker, &addresses, rank, size, options)
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
            let context = Context::new().map_err(setup)?;
            let worker = context.worker().map_err(setup)?;
            let address = worker.address().map_err(setup)?;
            parts.push((context, worker, Bytes::from(address)));
        }
        let addresses: Vec<Bytes> = parts.iter().map(|p| p.2.clone()).collect();
        parts
            .into_iter()
            .enumerate()
            .map(|(rank, (context, worker, _))| {
                Self::start(context, worker, &addresses, rank, size, options.clone())
            })
            .collect()
    }

    fn start(
        context: Context,
        worker: Worker,
        addresses: &[Bytes],
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
            let ep = if peer_failure_handling() {
                worker.connect(address, peer, Some(Some(on_endpoint_error)))
            } else {
                worker.connect(address, peer, None)
            }
            .map_err(|e| TransportError::Setup(format!("rank {peer}'s address: {e}")))?;
            endpoints.push(Some(ep));
        }
        drop(context);
        let handles = Handles { worker, endpoints };
        let mailbox = Arc::new(Mailbox::new(size));
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        let engine_mailbox = mailbox.clone();
        let max = options.max_message_bytes;
        let thread = thread::Builder::new()
            .name(format!("byzcoll-ucx-{rank}"))
            .spawn(move || Engine::new(handles, rank, size, engine_mailbox, rx, max).run())
            .map_err(TransportError::Io)?;
        tracing::debug!(rank, size, version = %safe::version(), "ucx transport started");
        Ok(UcxTransport {
            rank,
            size,
            mailbox,
            commands: Some(tx),
            waker: thread.thread().clone(),
            thread: Some(thread),
            max_message_bytes: max,
        })
    }
}

impl Drop for UcxTransport {
    fn drop(&mut self) {
        // Closing the queue tells the thread to shut down; it cancels and drains its requests
        // and closes the endpoints within a bounded time.
        self.commands = None;
        self.waker.unpark();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
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
            let commands = self
                .commands
                .as_ref()
                .ok_or_else(|| TransportError::Setup("the UCX transport is shut down".into()))?;
            let outcomes = run_step(
                &self.mailbox,
                &step,
                "ucx",
                || self.waker.unpark(),
                |s, key, payload| {
                    let peer = s.peer;
                    async move {
                        let (done, finished) = oneshot::channel();
                        commands
                            .send(Command::Send {
                                peer,
                                key,
                                payload,
                                done,
                            })
                            .await
                            .map_err(|_| "the progress thread is gone".to_string())?;
                        self.waker.unpark();
                        finished
                            .await
                            .map_err(|_| "the progress thread is gone".to_string())?
                    }
                },
            )
            .await;
            Ok(outcomes)
        })
    }
}

/// A send in flight: the buffers stay here until both UCX requests complete.
struct Outgoing {
    requests: Vec<Request>,
    _header: Box<[u8; HEADER_LEN]>,
    _payload: Bytes,
    done: Option<oneshot::Sender<Result<(), String>>>,
    error: Option<String>,
}

/// Where the receive side of one peer stands.
enum Incoming {
    /// Waiting for the next header.
    Idle,
    /// Receiving a header into `buf`.
    Header {
        request: Request,
        buf: Box<[u8; HEADER_LEN]>,
        seq: u64,
    },
    /// A valid header whose receive is not posted yet.
    Early { header: FrameHeader, seq: u64 },
    /// The receive is claimed (`None`: the payload is to be discarded); waiting for the
    /// payload message to show up in a probe, which tells its real length.
    Claimed {
        seq: u64,
        expected: usize,
        delivery: Option<Delivery>,
    },
    /// Receiving a payload into `buf` for `delivery` (`None`: discarding it).
    Payload {
        request: Request,
        buf: BytesMut,
        len: usize,
        delivery: Option<Delivery>,
    },
}

struct Engine {
    handles: Handles,
    me: Rank,
    mailbox: Arc<Mailbox>,
    commands: mpsc::Receiver<Command>,
    outgoing: Vec<Outgoing>,
    incoming: Vec<Incoming>,
    next_seq: Vec<u64>,
    /// The peer's slot is closed: nothing more is received from it.
    closed: Vec<bool>,
    /// The peer's endpoint failed: nothing more is sent to it, and its slot closes once the
    /// messages that did arrive have been taken.
    failed: Vec<bool>,
    max: u64,
}

impl Engine {
    fn new(
        handles: Handles,
        me: Rank,
        size: usize,
        mailbox: Arc<Mailbox>,
        commands: mpsc::Receiver<Command>,
        max: u64,
    ) -> Self {
        Engine {
            handles,
            me,
            mailbox,
            commands,
            outgoing: Vec::new(),
            incoming: (0..size).map(|_| Incoming::Idle).collect(),
            next_seq: vec![0; size],
            closed: vec![false; size],
            failed: vec![false; size],
            max,
        }
    }

    fn run(mut self) {
        let mut last_activity = Instant::now();
        let mut park = Duration::from_micros(5);
        loop {
            let mut busy = false;
            while self.handles.worker.progress() > 0 {
                busy = true;
            }
            match self.take_commands() {
                None => break,
                Some(n) => busy |= n > 0,
            }
            busy |= self.handle_failures();
            busy |= self.advance_sends();
            for peer in 0..self.incoming.len() {
                busy |= self.advance_receive(peer);
            }
            if busy {
                last_activity = Instant::now();
                park = Duration::from_micros(5);
            } else if last_activity.elapsed() > SPIN {
                thread::park_timeout(park);
                park = (park * 2).min(MAX_PARK);
            }
        }
        self.shutdown();
    }

    /// Starts queued sends; `None` once the transport has been dropped.
    fn take_commands(&mut self) -> Option<usize> {
        let mut n = 0;
        loop {
            match self.commands.try_recv() {
                Ok(Command::Send {
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

    fn start_send(
        &mut self,
        peer: Rank,
        key: MsgKey,
        payload: Bytes,
        done: oneshot::Sender<Result<(), String>>,
    ) {
        let Some(ep) = self.handles.endpoints[peer]
            .as_ref()
            .filter(|_| !self.closed[peer] && !self.failed[peer])
        else {
            let _ = done.send(Err(format!("rank {peer} is unreachable")));
            return;
        };
        let seq = self.next_seq[peer];
        self.next_seq[peer] += 1;
        let header = Box::new(FrameHeader::new(key, self.me, payload.len()).encode());
        let mut out = Outgoing {
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
                HEADER_LEN,
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
        self.outgoing.push(out);
    }

    fn advance_sends(&mut self) -> bool {
        let before = self.outgoing.len();
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
            if let Some(done) = out.done.take() {
                let _ = done.send(out.error.take().map_or(Ok(()), Err));
            }
            false
        });
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

    fn close_peer(&mut self, peer: Rank, why: Closed) {
        self.closed[peer] = true;
        self.mailbox.close(peer, why);
    }

    /// Moves peer `peer`'s receive side forward; `true` if anything happened.
    fn advance_receive(&mut self, peer: Rank) -> bool {
        if peer == self.me || self.closed[peer] {
            return false;
        }
        let state = std::mem::replace(&mut self.incoming[peer], Incoming::Idle);
        let (next, busy) = match state {
            Incoming::Idle => match self
                .handles
                .worker
                .probe(tag(peer, KIND_HEADER, 0), kind_mask())
            {
                None if self.failed[peer] => {
                    // Everything the failed peer sent before it went has been taken.
                    self.close_peer(peer, Closed::Gone);
                    (Incoming::Idle, true)
                }
                None => (Incoming::Idle, false),
                Some(probed) => {
                    let seq = probed.tag & SEQ_MASK;
                    let mut buf = Box::new([0u8; HEADER_LEN]);
                    // SAFETY: `buf` moves into the returned state and lives until the request
                    // completes; a longer message is truncated into it and refused below.
                    match unsafe {
                        self.handles
                            .worker
                            .recv_probed(buf.as_mut_ptr(), HEADER_LEN, &probed)
                    } {
                        Ok(request) => (Incoming::Header { request, buf, seq }, true),
                        Err(e) => {
                            self.close_peer(peer, Closed::Violation(e.to_string()));
                            (Incoming::Idle, true)
                        }
                    }
                }
            },
            Incoming::Header { request, buf, seq } => match request.poll_recv() {
                Poll::Pending => (Incoming::Header { request, buf, seq }, false),
                Poll::Done(Ok(HEADER_LEN)) => match FrameHeader::decode(&buf) {
                    Ok(h) if h.sender as usize != peer => {
                        let why = format!("frame claims sender {} on rank {peer}'s tags", h.sender);
                        self.close_peer(peer, Closed::Violation(why));
                        (Incoming::Idle, true)
                    }
                    Ok(h) if h.len > self.max => {
                        let why =
                            format!("frame of {} bytes exceeds the limit of {}", h.len, self.max);
                        self.close_peer(peer, Closed::Violation(why));
                        (Incoming::Idle, true)
                    }
                    Ok(header) => (Incoming::Early { header, seq }, true),
                    Err(why) => {
                        self.close_peer(peer, Closed::Violation(why));
                        (Incoming::Idle, true)
                    }
                },
                Poll::Done(result) => {
                    let why = match result {
                        Ok(len) => format!("header of {len} bytes"),
                        Err(e) => format!("header receive failed: {}", safe::status_text(e)),
                    };
                    self.close_peer(peer, Closed::Violation(why));
                    (Incoming::Idle, true)
                }
            },
            Incoming::Early { header, seq } => match self.mailbox.try_claim(peer, header.key()) {
                None => (Incoming::Early { header, seq }, false),
                Some(Claim::Closed) => (Incoming::Idle, true),
                Some(Claim::Stale) => (
                    Incoming::Claimed {
                        seq,
                        expected: 0,
                        delivery: None,
                    },
                    true,
                ),
                Some(Claim::Posted(d)) if header.len != d.expected_len() as u64 => {
                    let expected = d.expected_len();
                    d.complete(RecvOutcome::Malformed(format!(
                        "frame of {} bytes, expected {expected}",
                        header.len
                    )));
                    (
                        Incoming::Claimed {
                            seq,
                            expected: 0,
                            delivery: None,
                        },
                        true,
                    )
                }
                Some(Claim::Posted(d)) => {
                    let expected = d.expected_len();
                    (
                        Incoming::Claimed {
                            seq,
                            expected,
                            delivery: Some(d),
                        },
                        true,
                    )
                }
            },
            Incoming::Claimed {
                seq,
                expected,
                delivery,
            } => {
                match self
                    .handles
                    .worker
                    .probe(tag(peer, KIND_PAYLOAD, seq), u64::MAX)
                {
                    None => (
                        Incoming::Claimed {
                            seq,
                            expected,
                            delivery,
                        },
                        false,
                    ),
                    Some(probed) => (self.receive_payload(peer, probed, expected, delivery), true),
                }
            }
            Incoming::Payload {
                request,
                mut buf,
                len,
                delivery,
            } => match request.poll_recv() {
                Poll::Pending => (
                    Incoming::Payload {
                        request,
                        buf,
                        len,
                        delivery,
                    },
                    false,
                ),
                Poll::Done(result) => {
                    drop(request);
                    if let Some(d) = delivery {
                        match result {
                            Ok(got) if got == len => {
                                // SAFETY: UCX wrote exactly `len` bytes into the capacity.
                                unsafe { buf.set_len(len) };
                                d.complete(RecvOutcome::Received(Payload::Host(buf.freeze())));
                            }
                            Ok(got) => d.complete(RecvOutcome::Malformed(format!(
                                "payload of {got} bytes, expected {len}"
                            ))),
                            Err(e) => d.complete(RecvOutcome::Malformed(format!(
                                "payload receive failed: {}",
                                safe::status_text(e)
                            ))),
                        }
                    }
                    (Incoming::Idle, true)
                }
            },
        };
        self.incoming[peer] = next;
        busy
    }

    /// Receives a probed payload into a buffer of exactly `expected` bytes when its length is
    /// that, and otherwise (or with no delivery) into an empty buffer, which UCX truncates:
    /// the payload is consumed and discarded without allocating what the peer announced.
    fn receive_payload(
        &mut self,
        peer: Rank,
        probed: safe::Probed,
        expected: usize,
        delivery: Option<Delivery>,
    ) -> Incoming {
        let (len, delivery) = match delivery {
            Some(d) if probed.length == expected => (expected, Some(d)),
            Some(d) => {
                d.complete(RecvOutcome::Malformed(format!(
                    "payload of {} bytes, expected {expected}",
                    probed.length
                )));
                (0, None)
            }
            None => (0, None),
        };
        let mut buf = BytesMut::with_capacity(len);
        // SAFETY: `buf` owns `len` bytes of capacity and moves into the returned state, which
        // keeps it (without reallocation) until the request completes.
        let posted = unsafe {
            self.handles.worker.recv_probed(
                buf.spare_capacity_mut().as_mut_ptr().cast(),
                len,
                &probed,
            )
        };
        match posted {
            Ok(request) => Incoming::Payload {
                request,
                buf,
                len,
                delivery,
            },
            Err(e) => {
                // A discarded payload reports truncation here; that is the point.
                if let Some(d) = delivery {
                    d.complete(RecvOutcome::Malformed(e.to_string()));
                } else {
                    tracing::trace!(peer, error = %e, "discarded a payload");
                }
                Incoming::Idle
            }
        }
    }

    /// Cancels receives, lets sends finish (briefly), closes endpoints, then destroys the
    /// worker (and with it the context). Buffers of requests UCX never completes are leaked, not freed.
    fn shutdown(mut self) {
        for state in &self.incoming {
            match state {
                Incoming::Header { request, .. } | Incoming::Payload { request, .. } => {
                    self.handles.worker.cancel(request)
                }
                _ => {}
            }
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            self.handles.worker.progress();
            self.advance_sends();
            let receiving = self.incoming.iter().any(|s| {
                matches!(s, Incoming::Header { request, .. } | Incoming::Payload { request, .. }
                    if matches!(request.poll(), Poll::Pending))
            });
            if self.outgoing.is_empty() && !receiving {
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
        let unfinished = !self.outgoing.is_empty()
            || self
                .incoming
                .iter()
                .any(|s| matches!(s, Incoming::Header { .. } | Incoming::Payload { .. }));
        if unfinished {
            // UCX may still own these buffers: never free them under it.
            tracing::warn!("ucx shutdown: leaking buffers of requests that did not complete");
            std::mem::forget(std::mem::take(&mut self.outgoing));
            std::mem::forget(std::mem::take(&mut self.incoming));
        }
        drop(self.handles);
    }
}
