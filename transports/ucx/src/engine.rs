//! The UCX transport: a progress thread owns the UCP worker; tokio tasks talk to it through a
//! bounded command queue and the shared [`Mailbox`](byzcoll_transport_kit::mailbox::Mailbox).
//!
//! # Messages
//! Every message is two UCX tag messages from the same sender: a sealed frame header
//! ([`SEALED_LEN`] bytes: header, payload tag, MAC; see [`byzcoll_transport_kit::wire`]) (kind
//! `Header`) and the payload (kind `Payload`), both carrying the same per-pair sequence number
//! in their tags ([`TagLayout`]):
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
//! its header's sealed tag is not delivered: its receive is posted again (at most
//! [`PAYLOAD_RETRIES`] times, since a stranger's payload with the same tag may have matched
//! first), then the receive is `Malformed`. So a forged frame is never delivered; a stranger
//! who keeps injecting can still make a receive `Malformed` or `Missing` (tag matching gives
//! no way to refuse its messages before they match).
//!
//! The receive side is the kit's header → claim → payload state machine ([`Core`], see
//! [`byzcoll_transport_kit::tagged`]): [`HEADER_WINDOW`] header receives posted per peer for the
//! exact tags of its next sequence numbers, headers opened and claimed in sequence order, then
//! the payload receive posted for the exact tag with the length the receiver expects, into a
//! buffer the engine owns; a payload of another length, or one for a retired step, is
//! received into a zero-length buffer and discarded (UCX truncates it). So no allocation is
//! ever sized by a peer's number. This module holds only the UCP calls ([`TaggedNet`]).
//! Claims are in order, but the payload receives of many messages are in flight at once, and
//! UCX matches arriving messages to posted receives itself: no probe, no unexpected-queue
//! copy for headers, no round trip through the thread between a header and its payload.
//!
//! Receive buffers come from a [`BufferPool`](byzcoll_transport_kit::pool::BufferPool) (at most [`UcxOptions::pool_bytes`] idle): a
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
use std::ffi::c_void;
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
use byzcoll_runtime::bootstrap::StoreClient;
use byzcoll_runtime::{Rank, TransportError};
use byzcoll_transport_kit::progress::{Idle, Signal};
use byzcoll_transport_kit::tagged::{
    check_world, gather_addresses, local_memberships, Core, CoreConfig, Frame, HeaderArrival, Kind,
    PayloadPoll, Shell, Started, TagLayout, TaggedNet,
};
use byzcoll_transport_kit::wire::{FrameKeys, SEALED_LEN};
use byzcoll_ucx_sys as sys;

use crate::options::{context_settings, UcxOptions};
use crate::safe::{self, Context, Endpoint, Poll, Request, Signaller, Worker};

/// The tag layout: 38 bits of sequence number.
pub(crate) const TAGS: TagLayout = TagLayout::new(38);
/// See [`byzcoll_transport_kit::progress::SEND_CREDIT`].
pub use byzcoll_transport_kit::progress::SEND_CREDIT;
pub use byzcoll_transport_kit::progress::SPIN;
pub use byzcoll_transport_kit::tagged::{HEADER_WINDOW, MAX_RANKS, PAYLOAD_RETRIES};
/// The UCX transport; see the module docs.
#[derive(Debug)]
pub struct UcxTransport {
    shell: Shell<Engine>,
    options: UcxOptions,
}

byzcoll_transport_kit::shell_transport!(UcxTransport);

/// Wakes the progress thread blocked on the worker's event descriptor.
struct WorkerSignal(Signaller);

impl Signal for WorkerSignal {
    fn signal(&self) {
        // SAFETY: `Progress` signals only while its thread runs, and the worker is destroyed
        // by the engine's shutdown at the end of that thread.
        unsafe { self.0.signal() };
    }
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
    /// The options this transport was started with.
    pub fn options(&self) -> &UcxOptions {
        &self.options
    }

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
        check_world("UCX", rank, size)?;
        let setup = |e: safe::UcxError| TransportError::Setup(e.to_string());
        let context = Context::with_settings(context_settings(&options)).map_err(setup)?;
        let worker = context.worker().map_err(setup)?;
        let address = worker.address().map_err(setup)?;
        // The frame key is published with the address (see the module docs).
        let (addresses, keys, membership) =
            gather_addresses(store, "byzcoll/ucx", "UCX addresses", rank, size, &address).await?;
        let mut t = Self::start(context, worker, &addresses, keys, rank, size, options)?;
        t.shell.set_membership(Some(membership));
        Ok(t)
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
            .zip(local_memberships(size))
            .enumerate()
            .map(|(rank, (((context, worker, _), keys), membership))| {
                let mut t = Self::start(
                    context,
                    worker,
                    addresses,
                    keys,
                    rank,
                    size,
                    options.clone(),
                )?;
                t.shell.set_membership(membership);
                Ok(t)
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
        let config = CoreConfig {
            name: "ucx",
            me: rank,
            max_message_bytes: options.max_message_bytes,
            pool_bytes: options.pool_bytes,
            header_window: HEADER_WINDOW,
        };
        let shell = Shell::start(
            "ucx",
            rank,
            size,
            options.max_message_bytes,
            format!("byzcoll-ucx-{rank}"),
            signal,
            |mailbox, commands| {
                let net = Net {
                    me: rank,
                    worker,
                    endpoints,
                    retiring: Vec::new(),
                };
                Engine::new(net, Core::new(config, size, keys, mailbox, commands))
            },
        )?;
        tracing::debug!(rank, size, version = %safe::version(), "ucx transport started");
        Ok(UcxTransport { shell, options })
    }
}

/// The send state of a message in flight: its buffers stay here until both UCX requests
/// complete.
struct Sending {
    requests: Vec<Request>,
    _header: Box<[u8; SEALED_LEN]>,
    _payload: Bytes,
}

/// A header receive posted for the exact tag of one sequence number.
struct HeaderRecv {
    request: Request,
    buf: Box<[u8; SEALED_LEN]>,
}

/// A payload receive posted for the exact tag of one sequence number, `len` bytes (zero to
/// drain an unwanted payload).
struct PayloadRecv {
    request: Request,
    len: usize,
}

/// The UCP worker and endpoints: the calls [`Core`] makes.
struct Net {
    me: Rank,
    worker: Worker,
    endpoints: Vec<Option<Endpoint>>,
    /// Cancelled header receives whose buffers must outlive them.
    retiring: Vec<(Request, Box<[u8; SEALED_LEN]>)>,
}

impl TaggedNet for Net {
    type Header = HeaderRecv;
    type Payload = PayloadRecv;
    type Send = Sending;

    fn post_header(&mut self, peer: Rank, seq: u64) -> Result<Option<HeaderRecv>, String> {
        let mut buf = Box::new([0u8; SEALED_LEN]);
        // SAFETY: `buf` moves into the `HeaderRecv` (its heap memory does not move), which
        // `Core` keeps until the request completes, or `cancel_header` moves into
        // `self.retiring`. A receive UCX refuses is a request that completed with the error.
        let request = unsafe {
            self.worker.recv(
                buf.as_mut_ptr(),
                SEALED_LEN,
                TAGS.tag(peer, Kind::Header, seq),
                u64::MAX,
            )
        };
        Ok(Some(HeaderRecv { request, buf }))
    }

    fn poll_header(&mut self, _: Rank, header: &mut HeaderRecv) -> Option<HeaderArrival> {
        Some(match header.request.poll_recv() {
            // A failed peer sends no more headers; its slot closes once what it sent before
            // it went is delivered.
            Poll::Pending => return None,
            Poll::Done(Ok(SEALED_LEN)) => HeaderArrival::Sealed(*header.buf),
            Poll::Done(Ok(_) | Err(sys::ucs_status_t::UCS_ERR_MESSAGE_TRUNCATED)) => {
                HeaderArrival::Unsealed
            }
            Poll::Done(Err(e)) => HeaderArrival::Failed(safe::status_text(e)),
        })
    }

    fn cancel_header(&mut self, _: Rank, header: HeaderRecv) {
        self.worker.cancel(&header.request);
        self.retiring.push((header.request, header.buf));
    }

    unsafe fn start_payload(
        &mut self,
        peer: Rank,
        seq: u64,
        dest: Option<*mut u8>,
        len: usize,
    ) -> PayloadRecv {
        // Drained: into zero bytes (UCX truncates the payload).
        let (buf, len) = dest.map_or((std::ptr::NonNull::dangling().as_ptr(), 0), |d| (d, len));
        // SAFETY: per this function's contract `buf` is valid for `len` bytes until the
        // request is no longer pending. A receive that completed at once (or was refused) is
        // a request that completed.
        let request = unsafe {
            self.worker
                .recv(buf, len, TAGS.tag(peer, Kind::Payload, seq), u64::MAX)
        };
        PayloadRecv { request, len }
    }

    fn poll_payload(&mut self, _: Rank, _: u64, p: &mut PayloadRecv) -> PayloadPoll {
        let len = p.len;
        match p.request.poll_recv() {
            Poll::Pending => PayloadPoll::Pending,
            // UCX wrote exactly `len` bytes into the buffer.
            Poll::Done(Ok(got)) if got == len => PayloadPoll::Arrived,
            Poll::Done(Ok(got)) => {
                PayloadPoll::Unmatched(format!("payload of {got} bytes, expected {len}"))
            }
            Poll::Done(Err(sys::ucs_status_t::UCS_ERR_MESSAGE_TRUNCATED)) => {
                PayloadPoll::Unmatched(format!("payload longer than the expected {len} bytes"))
            }
            Poll::Done(Err(e)) => PayloadPoll::Failed(safe::status_text(e)),
        }
    }

    fn cancel_payload(&mut self, _: Rank, p: &mut PayloadRecv) {
        self.worker.cancel(&p.request);
    }

    fn start_send(&mut self, frame: Frame) -> Started<Sending> {
        let Frame {
            peer,
            seq,
            header,
            payload,
            ..
        } = frame;
        let me = self.me;
        let Some(ep) = self.endpoints[peer].as_ref() else {
            return Started::Done(Some(format!("rank {peer} is unreachable")));
        };
        let mut out = Sending {
            requests: Vec::with_capacity(2),
            _header: header,
            _payload: payload,
        };
        // SAFETY: both buffers are owned by `out`, which `Core` keeps until both requests
        // have completed (or leaks at shutdown).
        let sent = unsafe {
            ep.send(
                out._header.as_ptr(),
                SEALED_LEN,
                TAGS.tag(me, Kind::Header, seq),
            )
            .and_then(|h| {
                out.requests.push(h);
                ep.send(
                    out._payload.as_ptr(),
                    out._payload.len(),
                    TAGS.tag(me, Kind::Payload, seq),
                )
            })
        };
        let error = match sent {
            Ok(r) => {
                out.requests.push(r);
                None
            }
            Err(e) => Some(e.to_string()),
        };
        if out.requests.iter().all(|r| r.poll() != Poll::Pending) {
            // Completed at once (small messages usually do): no need to keep it.
            return Started::Done(error);
        }
        Started::InFlight { state: out, error }
    }
}

struct Engine {
    net: Net,
    core: Core<Net>,
    /// The worker's event descriptor, if it has one.
    efd: Option<i32>,
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
        while self.net.worker.progress() > 0 {
            busy = true;
        }
        busy |= self.core.take_commands(&mut self.net)? > 0;
        busy |= self.handle_failures();
        busy |= self.advance_sends();
        busy |= self.core.advance_receives(&mut self.net);
        self.net
            .retiring
            .retain(|(r, _)| matches!(r.poll_recv(), Poll::Pending));
        // Endpoint errors reported by the calls since (cancels) are taken into the engine now:
        // the list is per thread, and the next turn may run on another one.
        busy |= self.handle_failures();
        Some(busy)
    }

    fn in_flight(&self) -> bool {
        self.core.in_flight()
    }

    /// Blocks on the armed worker's event descriptor, briefly while a header waits for its
    /// step to be posted (a step can be retired without a wakeup).
    fn idle(&mut self) -> Idle {
        let timeout_ms = self.core.recheck_ms();
        match self.efd.map(|fd| (fd, self.net.worker.arm())) {
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
    fn new(net: Net, core: Core<Net>) -> Self {
        let efd = match net.worker.event_fd() {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::warn!(error = %e, "ucx: no event descriptor; the progress thread polls");
                None
            }
        };
        Engine { net, core, efd }
    }

    /// Finishes the sends whose requests have all completed.
    fn advance_sends(&mut self) -> bool {
        self.core.finish_sends(|out| {
            let mut pending = false;
            let mut error = None;
            for r in &out.state.requests {
                match r.poll() {
                    Poll::Pending => pending = true,
                    Poll::Done(Err(e)) => error = Some(safe::status_text(e)),
                    Poll::Done(Ok(_)) => {}
                }
            }
            if let Some(e) = error {
                out.fail(e);
            }
            !pending
        })
    }

    fn handle_failures(&mut self) -> bool {
        let failed: Vec<(usize, sys::ucs_status_t::Type)> =
            FAILED.with(|f| std::mem::take(&mut *f.borrow_mut()));
        for &(peer, status) in &failed {
            if self.core.mark_failed(peer) {
                tracing::debug!(peer, status = %safe::status_text(status), "ucx endpoint failed");
            }
        }
        !failed.is_empty()
    }

    /// Cancels receives, lets sends finish (briefly), closes endpoints, then destroys the
    /// worker (and with it the context). Buffers of requests UCX never completes are leaked,
    /// not freed.
    fn close(mut self) {
        self.core.cancel_receives(&mut self.net);
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            self.net.worker.progress();
            self.advance_sends();
            let settled = self.core.settle(&mut self.net);
            self.net
                .retiring
                .retain(|(r, _)| matches!(r.poll_recv(), Poll::Pending));
            if !self.core.sending() && settled && self.net.retiring.is_empty() {
                break;
            }
            thread::sleep(Duration::from_micros(50));
        }
        let closes: Vec<Request> = self
            .net
            .endpoints
            .iter_mut()
            .filter_map(Option::take)
            .map(|ep| ep.close(false))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(2);
        while closes.iter().any(|c| c.poll() == Poll::Pending) && Instant::now() < deadline {
            self.net.worker.progress();
            thread::sleep(Duration::from_micros(50));
        }
        drop(closes);
        if self.core.in_flight() || !self.net.retiring.is_empty() {
            // UCX may still own these buffers: never free them under it.
            tracing::warn!("ucx shutdown: leaking buffers of requests that did not complete");
            self.core.leak();
            std::mem::forget(std::mem::take(&mut self.net.retiring));
        }
        drop(self.core);
        drop(self.net);
    }
}
