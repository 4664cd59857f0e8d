//! The libfabric engine: the calls [`Core`] makes into libfabric ([`TaggedNet`] for [`Net`]:
//! posting, cancelling, payloads in fragments), the completion queue, and the sends the
//! provider cannot take yet. See [`LibfabricTransport`](crate::LibfabricTransport) for the
//! message format, progress and failures.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::ptr;
use std::thread;
use std::time::{Duration, Instant};

use byzcoll_libfabric_sys as sys;
use byzcoll_runtime::Rank;
use byzcoll_transport_kit::mailbox::Closed;
use byzcoll_transport_kit::progress::Idle;
use byzcoll_transport_kit::tagged::{
    Core, Frame, HeaderArrival, Kind, PayloadPoll, Started, TaggedNet,
};
use byzcoll_transport_kit::wire::SEALED_LEN;

use crate::op::{Fragments, Op, OpKind};
use crate::safe::{self, Completion, Endpoint, FabricError, MemoryRegion, Post};
use crate::setup::TAGS;

/// Completions handled per pass of the progress loop.
const COMPLETIONS_PER_PASS: usize = 256;
/// Fragment receives in flight per peer (over all of its messages).
const WINDOW: usize = 8;

#[derive(Debug, Clone, Copy)]
pub(crate) struct EngineConfig {
    pub(crate) me: Rank,
    /// Largest payload message; longer payloads travel as several.
    pub(crate) fragment: usize,
    /// Post receives for one source address (`FI_DIRECTED_RECV`).
    pub(crate) directed: bool,
    /// Register buffers (`FI_MR_LOCAL`, or forced by the options).
    pub(crate) register: bool,
}

/// The endpoint and the operations posted on it: the calls [`Core`] makes.
pub(crate) struct Net {
    endpoint: Endpoint,
    addresses: Vec<sys::fi_addr_t>,
    config: EngineConfig,
    /// Posted operations by context address.
    ops: HashMap<usize, Op>,
    /// Sends not yet accepted by the provider, in order, per peer (so that a peer that takes
    /// nothing holds up only its own messages).
    backlog: Vec<VecDeque<Op>>,
    next_key: u64,
    /// Fragment receives in flight per peer, over all of its payloads.
    fragments: Vec<usize>,
    /// Where drained fragments go (`config.fragment` bytes once allocated); never read.
    scratch: Vec<u8>,
    cq_failed: bool,
    /// The eventfd that transport methods signal, polled with the queue's wait object.
    notifier_fd: Option<i32>,
    /// Completions read in one pass.
    completions: Vec<Completion>,
}

impl Net {
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
}

impl TaggedNet for Net {
    /// The context of the posted receive.
    type Header = usize;
    type Payload = Fragments;
    /// Messages of the send not yet completed.
    type Send = usize;

    fn post_header(&mut self, peer: Rank, seq: u64) -> Result<Option<usize>, String> {
        let mut op = Op::new(OpKind::RecvHeader {
            peer,
            seq,
            tag: TAGS.tag(peer, Kind::Header, seq),
            buf: Box::new([0u8; SEALED_LEN]),
        });
        let id = op.id();
        let buf = match &mut op.kind {
            OpKind::RecvHeader { buf, .. } => buf.as_mut_ptr(),
            _ => ptr::null_mut(),
        };
        // SAFETY: the buffer is heap memory owned by `op`.
        match unsafe { self.post(op, buf, SEALED_LEN) } {
            Ok(None) => Ok(Some(id)),
            Ok(Some(_)) => Ok(None),
            Err((_, e)) => Err(format!("cannot receive from rank {peer}: {e}")),
        }
    }

    /// Completions are read from the queue and handed to [`Core::header_arrived`].
    fn poll_header(&mut self, _: Rank, _: &mut usize) -> Option<HeaderArrival> {
        None
    }

    fn cancel_header(&mut self, _: Rank, id: usize) {
        self.endpoint.cancel(id);
    }

    unsafe fn start_payload(
        &mut self,
        _: Rank,
        _: u64,
        dest: Option<*mut u8>,
        len: usize,
    ) -> Fragments {
        Fragments {
            total: len,
            next: 0,
            received: 0,
            in_flight: Vec::new(),
            base: dest.unwrap_or(ptr::null_mut()),
            cancelled: false,
        }
    }

    /// Done when every fragment has arrived with its exact length; meanwhile posts the next
    /// fragment receives, at most [`WINDOW`] in flight for the peer (the kit polls its
    /// payloads oldest first).
    fn poll_payload(&mut self, peer: Rank, seq: u64, p: &mut Fragments) -> PayloadPoll {
        if p.cancelled {
            // Fragments still in flight must finish before their buffer may go.
            return if p.in_flight.is_empty() {
                PayloadPoll::Failed("cancelled".into())
            } else {
                PayloadPoll::Pending
            };
        }
        if p.in_flight.is_empty() && p.received == p.total {
            // Every fragment completed with its exact length: the provider wrote all `total`
            // bytes.
            return PayloadPoll::Arrived;
        }
        while p.next < p.total && self.fragments[peer] < WINDOW {
            let len = self.config.fragment.min(p.total - p.next);
            let buf = if p.base.is_null() {
                if self.scratch.len() < self.config.fragment {
                    self.scratch = vec![0; self.config.fragment];
                }
                self.scratch.as_mut_ptr()
            } else {
                // SAFETY: `next < total`, and the buffer has room for `total` bytes.
                unsafe { p.base.add(p.next) }
            };
            let op = Op::new(OpKind::RecvFragment {
                peer,
                seq,
                tag: TAGS.tag(peer, Kind::Payload, seq),
                len,
            });
            let id = op.id();
            // SAFETY: `buf[..len]` lies in the kit's buffer for this payload, which is not
            // otherwise touched and not freed until this receive is no longer pending (or is
            // leaked), with no two fragments overlapping; or in the scratch buffer, which is
            // allocated before any fragment is in flight, never read and never freed while
            // fragments are in flight.
            match unsafe { self.post(op, buf, len) } {
                Ok(None) => {
                    self.fragments[peer] += 1;
                    p.in_flight.push(id);
                    p.next += len;
                }
                Ok(Some(_)) => break,
                Err((_, e)) => {
                    return PayloadPoll::Violation(format!("cannot receive the payload: {e}"))
                }
            }
        }
        PayloadPoll::Pending
    }

    fn cancel_payload(&mut self, _: Rank, p: &mut Fragments) {
        p.cancelled = true;
        for &id in &p.in_flight {
            self.endpoint.cancel(id);
        }
    }

    /// Only a payload of one fragment: which fragments of a longer one were genuine is not
    /// known, and the genuine ones already taken do not come again.
    fn may_retry(&self, len: usize) -> bool {
        len <= self.config.fragment
    }

    /// Queues the header and the payload's fragments.
    fn start_send(&mut self, frame: Frame) -> Started<usize> {
        let Frame {
            peer,
            seq,
            id: out,
            header,
            payload,
        } = frame;
        let me = self.config.me;
        self.backlog[peer].push_back(Op::new(OpKind::SendHeader {
            out,
            peer,
            tag: TAGS.tag(me, Kind::Header, seq),
            buf: header,
        }));
        let mut parts = 1;
        for start in (0..payload.len()).step_by(self.config.fragment) {
            let end = payload.len().min(start + self.config.fragment);
            self.backlog[peer].push_back(Op::new(OpKind::SendFragment {
                out,
                peer,
                tag: TAGS.tag(me, Kind::Payload, seq),
                data: payload.slice(start..end),
            }));
            parts += 1;
        }
        Started::InFlight {
            state: parts,
            error: None,
        }
    }
}

pub(crate) struct Engine {
    net: Net,
    core: Core<Net>,
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
        busy |= self.core.take_commands(&mut self.net)? > 0;
        busy |= self.post_sends();
        busy |= self.core.advance_receives(&mut self.net);
        Some(busy)
    }

    fn in_flight(&self) -> bool {
        self.core.in_flight()
    }

    /// Blocks on the completion queue's wait object and the notifier, after `fi_trywait` says
    /// nothing is ready (briefly while a header waits for its step to be posted: a step can be
    /// retired without a wakeup); naps when the provider has no wait object (`shm` in
    /// libfabric 1.17), completions may be ready, or sends wait for the provider to take them.
    fn idle(&mut self) -> Idle {
        let net = &self.net;
        let (Some(cq), Some(notifier)) = (net.endpoint.wait_fd(), net.notifier_fd) else {
            return Idle::Nap;
        };
        if net.backlog.iter().any(|b| !b.is_empty()) || !net.endpoint.try_wait() {
            return Idle::Nap;
        }
        Idle::Block {
            fds: vec![cq, notifier],
            timeout_ms: self.core.recheck_ms(),
        }
    }

    fn shutdown(self) -> Endpoint {
        self.close()
    }
}

impl Engine {
    pub(crate) fn new(
        endpoint: Endpoint,
        addresses: Vec<sys::fi_addr_t>,
        config: EngineConfig,
        core: Core<Net>,
        notifier_fd: Option<i32>,
    ) -> Self {
        let size = addresses.len();
        let net = Net {
            endpoint,
            addresses,
            config,
            ops: HashMap::new(),
            backlog: (0..size).map(|_| VecDeque::new()).collect(),
            next_key: 1,
            fragments: vec![0; size],
            scratch: Vec::new(),
            cq_failed: false,
            notifier_fd,
            completions: Vec::with_capacity(COMPLETIONS_PER_PASS),
        };
        Engine { net, core }
    }

    /// Reads and handles completions; `true` if there were any.
    fn read_completions(&mut self) -> bool {
        let mut completions = std::mem::take(&mut self.net.completions);
        if let Err(e) = self
            .net
            .endpoint
            .read_completions(&mut completions, COMPLETIONS_PER_PASS)
        {
            if !self.net.cq_failed {
                tracing::warn!(error = %e, "libfabric: reading the completion queue failed");
                self.net.cq_failed = true;
            }
        }
        let any = !completions.is_empty();
        for c in completions.drain(..) {
            self.complete(c);
        }
        self.net.completions = completions;
        any
    }

    /// Posts each peer's queued sends in order until the provider is busy.
    fn post_sends(&mut self) -> bool {
        let mut busy = false;
        for peer in 0..self.net.backlog.len() {
            busy |= self.post_sends_to(peer);
        }
        busy
    }

    fn post_sends_to(&mut self, peer: Rank) -> bool {
        let mut busy = false;
        while let Some(mut op) = self.net.backlog[peer].pop_front() {
            let (buf, len) = match &mut op.kind {
                OpKind::SendHeader { buf, .. } => (buf.as_mut_ptr(), SEALED_LEN),
                OpKind::SendFragment { data, .. } => (data.as_ptr().cast_mut(), data.len()),
                // Only sends are queued.
                _ => continue,
            };
            // SAFETY: the buffer is heap memory owned by `op` (the provider only reads it).
            match unsafe { self.net.post(op, buf, len) } {
                Ok(None) => busy = true,
                Ok(Some(op)) => {
                    self.net.backlog[peer].push_front(op);
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
        while self.net.backlog[peer]
            .front()
            .and_then(Op::send)
            .is_some_and(|(o, _)| o == out)
        {
            self.net.backlog[peer].pop_front();
            self.finish_part(out, Some(why.to_string()));
        }
        self.core.mark_failed(peer);
    }

    /// One message of send `out` is done (with `error` if it failed).
    fn finish_part(&mut self, out: u64, error: Option<String>) {
        let Some(o) = self.core.send_mut(out) else {
            return;
        };
        if let Some(e) = error {
            o.fail(e);
        }
        o.state = o.state.saturating_sub(1);
        if o.state == 0 {
            self.core.finish_send(out);
        }
    }

    /// Dispatches a completion to its operation.
    fn complete(&mut self, c: Completion) {
        let Some(op) = self.net.ops.remove(&c.context) else {
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
                    if e.code != safe::ECANCELED && self.core.mark_failed(peer) {
                        tracing::debug!(peer, error = %e, "libfabric: a send to the peer failed");
                    }
                    e.to_string()
                });
                self.finish_part(out, error);
            }
            OpKind::RecvHeader { peer, seq, buf, .. } => {
                let arrival = match c.error {
                    None if c.len == SEALED_LEN => HeaderArrival::Sealed(*buf),
                    // Another length: not a sealed header, so not the peer's.
                    None => HeaderArrival::Unsealed,
                    Some(e) if e.code == safe::ETRUNC => HeaderArrival::Unsealed,
                    Some(e) => HeaderArrival::Failed(e.to_string()),
                };
                self.core.header_arrived(peer, seq, arrival);
            }
            OpKind::RecvFragment { peer, seq, len, .. } => {
                self.fragment_arrived(peer, seq, len, &c);
            }
        }
    }

    /// A fragment of another length than its header implies is a protocol violation: the
    /// peer is closed.
    fn fragment_arrived(&mut self, peer: Rank, seq: u64, len: usize, c: &Completion) {
        let Some(p) = self.core.payload_mut(peer, seq) else {
            tracing::debug!(peer, "libfabric: a payload fragment for no payload");
            return;
        };
        self.net.fragments[peer] = self.net.fragments[peer].saturating_sub(1);
        p.in_flight.retain(|&id| id != c.context);
        let violation = match c.error {
            None if c.len == len => {
                p.received += len;
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
            if !self.core.is_closed(peer) {
                self.core
                    .close_peer(&mut self.net, peer, Closed::Violation(why));
            }
        }
    }

    /// Fails sends not yet posted, cancels everything in flight and waits (briefly) for it to
    /// complete, then closes the endpoint (and with it the queue, address vector, domain and
    /// fabric). Buffers of operations that never complete are leaked, not freed.
    fn close(mut self) -> Endpoint {
        // Sends already reported done to their steps go out first (for a bounded time): a
        // rank that finished its part and dropped its transport must not take its last
        // messages along.
        let linger = Instant::now() + Duration::from_secs(2);
        while self.core.sending() && Instant::now() < linger {
            let posted = self.post_sends();
            if !self.read_completions() && !posted {
                thread::sleep(Duration::from_micros(50));
            }
        }
        for op in std::mem::take(&mut self.net.backlog).into_iter().flatten() {
            if let Some((out, _)) = op.send() {
                self.finish_part(out, Some("the transport shut down".into()));
            }
        }
        for &id in self.net.ops.keys() {
            self.net.endpoint.cancel(id);
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while !self.net.ops.is_empty() && Instant::now() < deadline {
            if !self.read_completions() {
                thread::sleep(Duration::from_micros(50));
            }
        }
        if !self.net.ops.is_empty() {
            // The provider may still own these buffers: never free them under it.
            tracing::warn!(
                operations = self.net.ops.len(),
                "libfabric shutdown: leaking buffers of operations that did not complete"
            );
            std::mem::forget(std::mem::take(&mut self.net.ops));
            self.core.leak();
            std::mem::forget(std::mem::take(&mut self.net.scratch));
        }
        self.net.endpoint
    }
}
