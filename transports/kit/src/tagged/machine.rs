//! [`Core`]: the receive state machine, the sends and their credit of a tag-matching engine.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use byzcoll_runtime::{Payload, Rank, RecvOutcome};
use tokio::sync::mpsc;

use super::{
    HeaderArrival, PayloadPoll, Started, TaggedNet, EARLY_RECHECK_MS, IDLE_RECHECK_MS,
    PAYLOAD_RETRIES,
};
use crate::mailbox::{Claim, Closed, Delivery, Mailbox};
use crate::pool::{BufferPool, PoolBuf};
use crate::progress::{SendCommand, SendCredit, SendDone, SEND_BUDGET};
use crate::wire::{FrameHeader, FrameKeys, Opened, Unsealed, SEALED_LEN};
use byzcoll_runtime::bootstrap::gate::LOG_INTERVAL;

/// A sealed frame for the network to send ([`TaggedNet::start_send`]).
#[derive(Debug)]
pub struct Frame {
    /// The receiving rank.
    pub peer: Rank,
    /// The per-pair sequence number (in both messages' tags).
    pub seq: u64,
    /// Names the send in [`Core::send_mut`] and [`Core::finish_send`].
    pub id: u64,
    /// The sealed header.
    pub header: Box<[u8; SEALED_LEN]>,
    /// The payload.
    pub payload: Bytes,
}

/// A send in flight, with the network's `state` of it.
#[derive(Debug)]
pub struct Outgoing<S> {
    peer: Rank,
    len: usize,
    /// Reported done to its step (it counts against the credit).
    credited: bool,
    done: Option<SendDone>,
    error: Option<String>,
    /// The network's buffers and handles of the send.
    pub state: S,
}

impl<S> Outgoing<S> {
    /// The receiving rank.
    pub fn peer(&self) -> Rank {
        self.peer
    }

    /// Records that a part failed (the first error is kept).
    pub fn fail(&mut self, error: String) {
        self.error.get_or_insert(error);
    }
}

/// Settings of a [`Core`].
#[derive(Debug, Clone, Copy)]
pub struct CoreConfig {
    /// The transport's name, in logs.
    pub name: &'static str,
    /// This rank.
    pub me: Rank,
    /// Largest frame accepted.
    pub max_message_bytes: u64,
    /// Most bytes of idle receive buffers kept.
    pub pool_bytes: usize,
    /// Header receives kept posted per peer.
    pub header_window: usize,
}

/// A header receive of one sequence number.
struct HeaderSlot<H> {
    seq: u64,
    /// `None` before it is posted (the network was busy) and once it arrived.
    posted: Option<H>,
    arrived: Option<HeaderArrival>,
}

/// A payload being received (or drained, without `delivery` and `buf`).
struct Inbound<P> {
    seq: u64,
    /// The opened header the payload must match.
    opened: Opened,
    /// The length the header announced (and, when delivering, the receive expects).
    len: usize,
    delivery: Option<Delivery>,
    /// Capacity `len`; the network writes into it while the receive is pending, so it stays
    /// here until then, even after the delivery was completed otherwise (the peer closed).
    buf: Option<PoolBuf>,
    /// Receives posted again after a payload that did not match.
    retries: u8,
    recv: P,
}

/// The receive side of one peer.
struct PeerRx<N: TaggedNet> {
    /// Header receives for consecutive sequence numbers, oldest first.
    headers: VecDeque<HeaderSlot<N::Header>>,
    /// Sequence number of the next header receive to post.
    next_post: u64,
    /// Opened headers whose claim is not settled yet, in sequence order.
    early: VecDeque<(u64, Opened)>,
    /// Payloads being received or drained, in sequence order.
    payloads: VecDeque<Inbound<N::Payload>>,
}

impl<N: TaggedNet> Default for PeerRx<N> {
    fn default() -> Self {
        PeerRx {
            headers: VecDeque::new(),
            next_post: 0,
            early: VecDeque::new(),
            payloads: VecDeque::new(),
        }
    }
}

/// The network-independent part of a tag-matching engine (see the module docs): queued send
/// commands, sealing, the send credit, and every peer's header → claim → payload state
/// machine, driven through a [`TaggedNet`].
pub struct Core<N: TaggedNet> {
    pub(super) config: CoreConfig,
    /// Seals frames to and opens frames from every peer.
    keys: FrameKeys,
    mailbox: Arc<Mailbox>,
    commands: mpsc::Receiver<SendCommand>,
    pool: BufferPool,
    rx: Vec<PeerRx<N>>,
    /// When a warning about each peer was last written, and how many were held back since
    /// (at most one a peer per [`LOG_INTERVAL`]: a peer, or whoever forges its frames, cannot
    /// flood the log).
    warned: Vec<(Option<std::time::Instant>, u64)>,
    /// The same for sends refused past a peer's budget ([`Core::budget`]), by receiving peer.
    over_budget: Vec<(Option<std::time::Instant>, u64)>,
    /// The largest message started to each peer (its budget is three of them, at least
    /// [`SEND_BUDGET`]).
    largest: Vec<usize>,
    /// The peer's slot is closed: nothing more is received from it.
    closed: Vec<bool>,
    /// The peer failed: nothing more is sent to it, and its slot closes once what did arrive
    /// has been taken.
    failed: Vec<bool>,
    /// Sequence number of the next message to each peer.
    next_seq: Vec<u64>,
    /// Sends in flight, oldest first.
    sends: BTreeMap<u64, Outgoing<N::Send>>,
    next_send: u64,
    /// Credited sends still in flight.
    credit: SendCredit,
    /// Sends finished in one pass of [`Core::finish_sends`].
    finished: Vec<u64>,
}

impl<N: TaggedNet> std::fmt::Debug for Core<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("config", &self.config)
            .field("sends", &self.sends.len())
            .finish_non_exhaustive()
    }
}

impl<N: TaggedNet> Core<N> {
    /// The core of a world of `size` ranks, taking send commands from `commands` and
    /// delivering into `mailbox`. Header receives are posted by the first
    /// [`Core::advance_receives`].
    pub fn new(
        config: CoreConfig,
        size: usize,
        keys: FrameKeys,
        mailbox: Arc<Mailbox>,
        commands: mpsc::Receiver<SendCommand>,
    ) -> Self {
        Core {
            config,
            keys,
            mailbox,
            commands,
            pool: BufferPool::new(config.pool_bytes),
            rx: (0..size).map(|_| PeerRx::default()).collect(),
            warned: vec![(None, 0); size],
            over_budget: vec![(None, 0); size],
            largest: vec![0; size],
            closed: vec![false; size],
            failed: vec![false; size],
            next_seq: vec![0; size],
            sends: BTreeMap::new(),
            next_send: 0,
            credit: SendCredit::new(size),
            finished: Vec::new(),
        }
    }

    /// Whether `peer`'s slot is closed.
    pub fn is_closed(&self, peer: Rank) -> bool {
        self.closed[peer]
    }

    /// Marks `peer` failed (see [`Core::advance_receives`]); whether it was not already.
    pub fn mark_failed(&mut self, peer: Rank) -> bool {
        match self.failed.get_mut(peer) {
            Some(f) if !*f => {
                *f = true;
                true
            }
            _ => false,
        }
    }

    /// Whether sends or payload receives are in flight (they move only with progress).
    pub fn in_flight(&self) -> bool {
        !self.sends.is_empty() || self.rx.iter().any(|r| !r.payloads.is_empty())
    }

    /// Whether sends are in flight.
    pub fn sending(&self) -> bool {
        !self.sends.is_empty()
    }

    /// How long an idle progress thread may block: briefly while a header waits for its step
    /// to be posted (a step can be retired without a wakeup).
    pub fn recheck_ms(&self) -> i32 {
        if self.rx.iter().any(|r| !r.early.is_empty()) {
            EARLY_RECHECK_MS
        } else {
            IDLE_RECHECK_MS
        }
    }

    /// Starts the queued sends; `None` once the transport has been dropped.
    pub fn take_commands(&mut self, net: &mut N) -> Option<usize> {
        let mut n = 0;
        loop {
            match self.commands.try_recv() {
                Ok(command) => {
                    n += 1;
                    self.start_send(net, command);
                }
                Err(mpsc::error::TryRecvError::Empty) => return Some(n),
                Err(mpsc::error::TryRecvError::Disconnected) => return None,
            }
        }
    }

    /// Seals a send and hands it to the network.
    fn start_send(&mut self, net: &mut N, command: SendCommand) {
        let SendCommand {
            peer,
            key,
            call,
            payload,
            done,
        } = command;
        if self.closed[peer] || self.failed[peer] {
            let _ = done.send(Err(format!("rank {peer} is unreachable")));
            return;
        }
        let (outstanding, budget) = (self.outstanding(peer), self.budget(peer));
        if outstanding > 0 && outstanding + payload.len() > budget {
            let why = format!(
                "rank {peer} has not taken the {outstanding} bytes in flight to it: past its \
                 send budget of {budget} bytes, this message is dropped (the receiver finds it \
                 missing)"
            );
            if let Some(held_back) = may_warn(&mut self.over_budget, peer) {
                tracing::warn!(transport = self.config.name, peer, held_back, "{why}");
            }
            let _ = done.send(Err(why));
            return;
        }
        // Refused before `seq` is taken: a dropped message leaves no gap.
        let seq = self.next_seq[peer];
        let header = FrameHeader::new(key, call, self.config.me, payload.len());
        // Sealed before `seq` is taken: a frame that cannot be sealed leaves no gap.
        let header = match self.keys.seal(peer, seq, &header, &payload) {
            Ok(sealed) => Box::new(sealed),
            Err(why) => {
                let _ = done.send(Err(why));
                return;
            }
        };
        self.next_seq[peer] += 1;
        self.largest[peer] = self.largest[peer].max(payload.len());
        let id = self.next_send;
        self.next_send += 1;
        let len = payload.len();
        let frame = Frame {
            peer,
            seq,
            id,
            header,
            payload,
        };
        match net.start_send(frame) {
            Started::Done(error) => {
                let _ = done.send(error.map_or(Ok(()), Err));
            }
            Started::InFlight { state, error } => {
                let out = Outgoing {
                    peer,
                    len,
                    credited: false,
                    done: Some(done),
                    error,
                    state,
                };
                self.sends.insert(id, out);
                self.credit(peer);
            }
        }
    }

    /// The most bytes in flight to `peer` before its sends are refused: three of the largest
    /// message sent to it (a step's vector, then the small messages of the same round, while
    /// the vector is still in flight), at least [`SEND_BUDGET`].
    pub fn budget(&self, peer: Rank) -> usize {
        self.largest[peer].saturating_mul(3).max(SEND_BUDGET)
    }

    /// Bytes of the sends to `peer` the network has not finished with.
    pub fn outstanding(&self, peer: Rank) -> usize {
        self.sends
            .values()
            .filter(|o| o.peer == peer)
            .map(|o| o.len)
            .sum()
    }

    /// Reports done the sends to `peer` that are in flight and fit in its credit, oldest first.
    fn credit(&mut self, peer: Rank) {
        for o in self.sends.values_mut().filter(|o| o.peer == peer) {
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

    /// The send `id`, while in flight.
    pub fn send_mut(&mut self, id: u64) -> Option<&mut Outgoing<N::Send>> {
        self.sends.get_mut(&id)
    }

    /// The network is done with send `id`: its step learns the outcome (unless it was
    /// credited), its credit is given back, and later sends to its peer may be credited.
    pub fn finish_send(&mut self, id: u64) {
        let Some(mut o) = self.sends.remove(&id) else {
            return;
        };
        if o.credited {
            self.credit.give_back(o.peer, o.len);
            if let Some(e) = &o.error {
                // Its step has moved on; the receiver counts the message missing.
                tracing::debug!(transport = self.config.name, peer = o.peer, error = %e, "a credited send failed");
            }
        }
        if let Some(done) = o.done.take() {
            let _ = done.send(o.error.take().map_or(Ok(()), Err));
        }
        self.credit(o.peer);
    }

    /// Finishes the sends for which `done` says the network is done with them; whether any.
    pub fn finish_sends(&mut self, mut done: impl FnMut(&mut Outgoing<N::Send>) -> bool) -> bool {
        let mut finished = std::mem::take(&mut self.finished);
        finished.extend(
            self.sends
                .iter_mut()
                .filter_map(|(&id, o)| done(o).then_some(id)),
        );
        let any = !finished.is_empty();
        for id in finished.drain(..) {
            self.finish_send(id);
        }
        self.finished = finished;
        any
    }

    /// Moves every peer's receive side forward; `true` if anything happened. A failed peer's
    /// slot closes (`Missing`) once it has nothing left to deliver: its next header has not
    /// arrived and every header that did has had its payload delivered, drained or refused.
    /// Closing it earlier would lose messages that arrived before the failure, such as the last
    /// ones of a peer that finished its work and shut down before this rank read them.
    pub fn advance_receives(&mut self, net: &mut N) -> bool {
        let mut busy = false;
        for peer in 0..self.rx.len() {
            if peer == self.config.me {
                continue;
            }
            if self.closed[peer] {
                busy |= self.settle_peer(net, peer);
                continue;
            }
            busy |= self.advance_headers(net, peer);
            if !self.closed[peer] {
                busy |= self.advance_claims(net, peer);
            }
            if !self.closed[peer] {
                busy |= self.advance_payloads(net, peer);
            }
            if self.failed[peer] && !self.closed[peer] && self.drained(net, peer) {
                self.close_peer(net, peer, Closed::Gone);
                busy = true;
            }
        }
        busy
    }

    /// Whether `peer`'s oldest posted header has arrived (polling it).
    fn front_arrived(&mut self, net: &mut N, peer: Rank) -> bool {
        let Some(front) = self.rx[peer].headers.front_mut() else {
            return false;
        };
        if front.arrived.is_none() {
            if let Some(h) = front.posted.as_mut() {
                front.arrived = net.poll_header(peer, h);
                if front.arrived.is_some() {
                    front.posted = None;
                }
            }
        }
        front.arrived.is_some()
    }

    /// See [`Core::advance_receives`].
    fn drained(&mut self, net: &mut N, peer: Rank) -> bool {
        let rx = &self.rx[peer];
        rx.early.is_empty() && rx.payloads.is_empty() && !self.front_arrived(net, peer)
    }

    /// Records what a network that reads completions from a queue found for header receive
    /// `seq` of `peer` (see [`TaggedNet::poll_header`]); it is taken in order by the next
    /// [`Core::advance_receives`].
    pub fn header_arrived(&mut self, peer: Rank, seq: u64, arrival: HeaderArrival) {
        if self.closed[peer] {
            return;
        }
        let slot = self.rx[peer]
            .headers
            .iter_mut()
            .find(|h| h.seq == seq && h.posted.is_some());
        if let Some(h) = slot {
            h.posted = None;
            h.arrived = Some(arrival);
        }
    }

    /// The network's state of the payload receive `seq` of `peer`, while it is pending.
    pub fn payload_mut(&mut self, peer: Rank, seq: u64) -> Option<&mut N::Payload> {
        self.rx[peer]
            .payloads
            .iter_mut()
            .find(|p| p.seq == seq)
            .map(|p| &mut p.recv)
    }

    /// The opened header, or why it is unacceptable: `Err(None)` when it cannot be attributed
    /// to the peer (anyone may use its tags), so it is dropped and received again;
    /// `Err(Some(why))` when it is the peer's own fault, or the receive's.
    fn open(&self, peer: Rank, seq: u64, arrival: HeaderArrival) -> Result<Opened, Option<String>> {
        let max = self.config.max_message_bytes;
        match arrival {
            HeaderArrival::Sealed(buf) => match self.keys.open(peer, seq, &buf) {
                Ok(o) if o.header.len > max || usize::try_from(o.header.len).is_err() => Err(Some(
                    format!("frame of {} bytes exceeds the limit of {max}", o.header.len),
                )),
                Ok(o) => Ok(o),
                Err(Unsealed::Invalid(why)) => Err(Some(why)),
                Err(Unsealed::Forged) => Err(None),
            },
            HeaderArrival::Unsealed => Err(None),
            HeaderArrival::Failed(why) => Err(Some(format!("header receive failed: {why}"))),
        }
    }

    /// Takes the headers that arrived from `peer`, in order, and keeps the header window
    /// posted.
    fn advance_headers(&mut self, net: &mut N, peer: Rank) -> bool {
        let Some(mut busy) = self.fill_window(net, peer) else {
            return true;
        };
        while let Some(front) = self.rx[peer].headers.front_mut() {
            if front.posted.is_none() && front.arrived.is_none() {
                // Posted again after a header that was not the peer's.
                match net.post_header(peer, front.seq) {
                    Ok(Some(h)) => front.posted = Some(h),
                    // The network is busy: next turn.
                    Ok(None) => break,
                    Err(why) => {
                        self.close_peer(net, peer, Closed::Violation(why));
                        return true;
                    }
                }
            }
            if !self.front_arrived(net, peer) {
                break;
            }
            busy = true;
            let Some(HeaderSlot {
                seq,
                arrived: Some(arrival),
                ..
            }) = self.rx[peer].headers.pop_front()
            else {
                break;
            };
            match self.open(peer, seq, arrival) {
                Ok(opened) => self.rx[peer].early.push_back((seq, opened)),
                Err(None) => {
                    if let Some(held_back) = may_warn(&mut self.warned, peer) {
                        tracing::warn!(
                            transport = self.config.name,
                            peer,
                            seq,
                            held_back,
                            "dropped a frame header on the peer's tags that is not sealed by \
                             it (forged, replayed or corrupted)"
                        );
                    }
                    self.rx[peer].headers.push_front(HeaderSlot {
                        seq,
                        posted: None,
                        arrived: None,
                    });
                }
                Err(Some(why)) => {
                    self.close_peer(net, peer, Closed::Violation(why));
                    return true;
                }
            }
        }
        match self.fill_window(net, peer) {
            Some(posted) => busy | posted,
            None => true,
        }
    }

    /// Keeps `peer`'s header window posted; whether it posted any, `None` when it closed the
    /// peer.
    fn fill_window(&mut self, net: &mut N, peer: Rank) -> Option<bool> {
        let mut posted = false;
        while self.rx[peer].headers.len() < self.config.header_window {
            let seq = self.rx[peer].next_post;
            match net.post_header(peer, seq) {
                Ok(Some(h)) => {
                    let rx = &mut self.rx[peer];
                    rx.next_post += 1;
                    rx.headers.push_back(HeaderSlot {
                        seq,
                        posted: Some(h),
                        arrived: None,
                    });
                    posted = true;
                }
                Ok(None) => break,
                Err(why) => {
                    self.close_peer(net, peer, Closed::Violation(why));
                    return None;
                }
            }
        }
        Some(posted)
    }

    /// Claims the receives of `peer`'s opened headers, in order, and starts their payload
    /// receives: into a buffer of the expected length, or (retired step, another length)
    /// drained without one. So no allocation is sized by a peer's number.
    fn advance_claims(&mut self, net: &mut N, peer: Rank) -> bool {
        let mut busy = false;
        while let Some(&(seq, opened)) = self.rx[peer].early.front() {
            let header = opened.header;
            let claim = match self.mailbox.try_claim(peer, header.key(), header.call) {
                None => break,
                Some(Claim::Closed) => {
                    self.rx[peer].early.clear();
                    return true;
                }
                Some(claim) => claim,
            };
            self.rx[peer].early.pop_front();
            busy = true;
            // The length was checked against the limit when the header was opened.
            let len = usize::try_from(header.len).unwrap_or(usize::MAX);
            let delivery = match claim {
                Claim::Posted(d) if len == d.expected_len() => Some(d),
                Claim::Posted(d) => {
                    let expected = d.expected_len();
                    d.complete(RecvOutcome::Malformed(format!(
                        "frame of {} bytes, expected {expected}",
                        header.len
                    )));
                    None
                }
                Claim::Stale | Claim::Closed => None,
            };
            let mut buf = delivery.as_ref().map(|_| self.pool.take(len));
            let dest = buf.as_mut().map(PoolBuf::as_mut_ptr);
            // SAFETY: `buf` has room for `len` bytes and moves into the `Inbound` (its heap
            // memory does not move), which keeps it, untouched, until the receive is no longer
            // pending (or leaks it with the engine).
            let recv = unsafe { net.start_payload(peer, seq, dest, len) };
            self.rx[peer].payloads.push_back(Inbound {
                seq,
                opened,
                len,
                delivery,
                buf,
                retries: 0,
                recv,
            });
        }
        busy
    }

    /// Delivers the payloads of `peer` that arrived and match their sealed header, oldest
    /// first, and lets the network move the others. One that does not match is received
    /// again, at most [`PAYLOAD_RETRIES`] times, then `Malformed`; a drained one is dropped.
    fn advance_payloads(&mut self, net: &mut N, peer: Rank) -> bool {
        let name = self.config.name;
        let mut busy = false;
        let mut i = 0;
        while i < self.rx[peer].payloads.len() {
            let p = &mut self.rx[peer].payloads[i];
            let unmatched = match net.poll_payload(peer, p.seq, &mut p.recv) {
                PayloadPoll::Pending => {
                    i += 1;
                    continue;
                }
                PayloadPoll::Violation(why) => {
                    self.close_peer(net, peer, Closed::Violation(why));
                    return true;
                }
                _ if p.delivery.is_none() => {
                    tracing::trace!(transport = name, peer, "drained a payload");
                    self.rx[peer].payloads.remove(i);
                    busy = true;
                    continue;
                }
                PayloadPoll::Arrived => {
                    let len = p.len;
                    let keys = &self.keys;
                    let matches = p
                        .buf
                        .as_mut()
                        .is_some_and(|b| keys.payload_matches(&p.opened, &b.as_mut_slice()[..len]));
                    if matches {
                        if let Some(Inbound {
                            delivery: Some(d),
                            buf: Some(mut buf),
                            ..
                        }) = self.rx[peer].payloads.remove(i)
                        {
                            // The network wrote exactly `len` bytes into the buffer.
                            buf.set_len(len);
                            d.complete(RecvOutcome::Received(Payload::Host(buf.freeze())));
                        }
                        busy = true;
                        continue;
                    }
                    "payload does not match the tag sealed in its header (forged or \
                     corrupted)"
                        .to_string()
                }
                PayloadPoll::Unmatched(why) => why,
                PayloadPoll::Failed(why) => {
                    let outcome = if self.failed[peer] {
                        // The payload of a peer that went away: it never arrived whole.
                        RecvOutcome::Missing
                    } else {
                        RecvOutcome::Malformed(format!("payload receive failed: {why}"))
                    };
                    if let Some(d) = self.rx[peer].payloads.remove(i).and_then(|p| p.delivery) {
                        d.complete(outcome);
                    }
                    busy = true;
                    continue;
                }
            };
            busy = true;
            let seq = p.seq;
            if p.retries >= PAYLOAD_RETRIES || !net.may_retry(p.len) {
                if let Some(held_back) = may_warn(&mut self.warned, peer) {
                    tracing::warn!(transport = name, peer, seq, held_back, why = %unmatched, "a payload on the peer's tags does not match its sealed header");
                }
                if let Some(d) = self.rx[peer].payloads.remove(i).and_then(|p| p.delivery) {
                    d.complete(RecvOutcome::Malformed(unmatched));
                }
                continue;
            }
            if let Some(held_back) = may_warn(&mut self.warned, peer) {
                tracing::warn!(transport = name, peer, seq, held_back, why = %unmatched, "dropped a payload on the peer's tags; receiving it again");
            }
            p.retries += 1;
            let dest = p.buf.as_mut().map(PoolBuf::as_mut_ptr);
            // SAFETY: as for the first receive into the buffer (`advance_claims`); the
            // network is done with the previous one. It is polled again next.
            p.recv = unsafe { net.start_payload(peer, seq, dest, p.len) };
        }
        busy
    }

    /// Drops the payload receives of closed `peer` that the network is done with; whether
    /// any.
    fn settle_peer(&mut self, net: &mut N, peer: Rank) -> bool {
        let payloads = &mut self.rx[peer].payloads;
        let before = payloads.len();
        payloads.retain_mut(|p| {
            matches!(
                net.poll_payload(peer, p.seq, &mut p.recv),
                PayloadPoll::Pending
            )
        });
        payloads.len() != before
    }

    /// Closes `peer`'s slot: its posted header receives are cancelled, and its claimed
    /// payloads get the slot's outcome at once and their receives are cancelled (their
    /// buffers stay until the network is done with them).
    pub fn close_peer(&mut self, net: &mut N, peer: Rank, why: Closed) {
        self.closed[peer] = true;
        for p in &mut self.rx[peer].payloads {
            if let Some(d) = p.delivery.take() {
                d.complete(match &why {
                    Closed::Gone => RecvOutcome::Missing,
                    Closed::Violation(w) => RecvOutcome::Malformed(w.clone()),
                });
            }
        }
        self.cancel_peer(net, peer);
        self.mailbox.close(peer, why);
    }

    /// Cancels `peer`'s posted receives; its payload receives stay until the network is done
    /// with them.
    fn cancel_peer(&mut self, net: &mut N, peer: Rank) {
        let rx = &mut self.rx[peer];
        rx.early.clear();
        for h in rx.headers.drain(..) {
            if let Some(posted) = h.posted {
                net.cancel_header(peer, posted);
            }
        }
        for p in &mut rx.payloads {
            net.cancel_payload(peer, &mut p.recv);
        }
    }

    /// At shutdown: cancels every posted receive (see [`Core::settle`]).
    pub fn cancel_receives(&mut self, net: &mut N) {
        for peer in 0..self.rx.len() {
            self.cancel_peer(net, peer);
        }
    }

    /// At shutdown: drops the payload receives the network is done with; whether none is left.
    pub fn settle(&mut self, net: &mut N) -> bool {
        for peer in 0..self.rx.len() {
            self.settle_peer(net, peer);
        }
        self.rx.iter().all(|r| r.payloads.is_empty())
    }

    /// At shutdown, when the network may still own buffers of sends or receives: leaks them,
    /// never frees them under it.
    pub fn leak(&mut self) {
        std::mem::forget(std::mem::take(&mut self.sends));
        std::mem::forget(std::mem::take(&mut self.rx));
    }
}

/// Whether a warning about `peer` may be written now: `Some(held_back)` (the warnings
/// held back since the last one), or `None` within [`LOG_INTERVAL`] of it.
fn may_warn(warned: &mut [(Option<std::time::Instant>, u64)], peer: Rank) -> Option<u64> {
    let now = std::time::Instant::now();
    let (at, held) = &mut warned[peer];
    match at {
        Some(t) if now.duration_since(*t) < LOG_INTERVAL => {
            *held += 1;
            None
        }
        _ => {
            *at = Some(now);
            Some(std::mem::take(held))
        }
    }
}

#[cfg(test)]
mod log_tests {
    use super::*;

    /// A flood of forgeries on one peer's tags writes one warning per interval; the next one
    /// counts what was held back; another peer is not held back by it.
    #[test]
    fn warnings_about_a_peer_are_one_per_interval() {
        let mut warned = vec![(None, 0); 2];
        assert_eq!(may_warn(&mut warned, 0), Some(0));
        for _ in 0..1000 {
            assert_eq!(may_warn(&mut warned, 0), None);
        }
        assert_eq!(may_warn(&mut warned, 1), Some(0));
        warned[0].0 = Some(std::time::Instant::now() - LOG_INTERVAL);
        assert_eq!(may_warn(&mut warned, 0), Some(1000));
    }
}
