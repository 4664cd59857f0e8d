#![allow(clippy::unwrap_used)]

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use byzcoll_runtime::{MsgKey, Payload, RecvOutcome};
use tokio::sync::{mpsc, oneshot};

use super::*;
use crate::mailbox::Mailbox;
use crate::progress::{SendCommand, SEND_BUDGET, SEND_CREDIT};
use crate::wire::{FrameHeader, FrameKeys, SEALED_LEN};

const TAGS: TagLayout = TagLayout::new(38);
/// Rank 1 of 2 receives from rank 0.
const FROM: usize = 0;
const ME: usize = 1;

/// Test double of a tag-matching network's FFI, not a real transport: messages "arrive" in
/// `inbox` under their tag, and posted receives take them oldest first, as tag matching does.
/// Sends are only recorded.
#[derive(Default)]
struct FakeNet {
    inbox: HashMap<u64, VecDeque<Vec<u8>>>,
    /// Header receives posted, by sequence number.
    header_posts: HashMap<u64, usize>,
    cancelled_headers: usize,
    /// Payload receives started: (sequence number, into a buffer, length).
    payload_starts: Vec<(u64, bool, usize)>,
    sent: Vec<Frame>,
}

struct FakeHeader {
    tag: u64,
}

struct FakePayload {
    tag: u64,
    dest: Option<*mut u8>,
    len: usize,
    cancelled: bool,
}

impl FakeNet {
    fn arrive(&mut self, kind: Kind, seq: u64, bytes: &[u8]) {
        self.inbox
            .entry(TAGS.tag(FROM, kind, seq))
            .or_default()
            .push_back(bytes.to_vec());
    }

    fn take(&mut self, tag: u64) -> Option<Vec<u8>> {
        self.inbox.get_mut(&tag)?.pop_front()
    }
}

impl TaggedNet for FakeNet {
    type Header = FakeHeader;
    type Payload = FakePayload;
    type Send = ();

    fn post_header(&mut self, peer: Rank, seq: u64) -> Result<Option<FakeHeader>, String> {
        *self.header_posts.entry(seq).or_default() += 1;
        Ok(Some(FakeHeader {
            tag: TAGS.tag(peer, Kind::Header, seq),
        }))
    }

    fn poll_header(&mut self, _: Rank, header: &mut FakeHeader) -> Option<HeaderArrival> {
        let m = self.take(header.tag)?;
        Some(match <[u8; SEALED_LEN]>::try_from(m.as_slice()) {
            Ok(sealed) => HeaderArrival::Sealed(sealed),
            Err(_) => HeaderArrival::Unsealed,
        })
    }

    fn cancel_header(&mut self, _: Rank, _: FakeHeader) {
        self.cancelled_headers += 1;
    }

    unsafe fn start_payload(
        &mut self,
        peer: Rank,
        seq: u64,
        dest: Option<*mut u8>,
        len: usize,
    ) -> FakePayload {
        self.payload_starts.push((seq, dest.is_some(), len));
        FakePayload {
            tag: TAGS.tag(peer, Kind::Payload, seq),
            dest,
            len,
            cancelled: false,
        }
    }

    fn poll_payload(&mut self, _: Rank, _: u64, p: &mut FakePayload) -> PayloadPoll {
        if p.cancelled {
            return PayloadPoll::Failed("cancelled".into());
        }
        let Some(m) = self.take(p.tag) else {
            return PayloadPoll::Pending;
        };
        let Some(dest) = p.dest else {
            return PayloadPoll::Arrived;
        };
        if m.len() != p.len {
            return PayloadPoll::Unmatched(format!(
                "payload of {} bytes, expected {}",
                m.len(),
                p.len
            ));
        }
        // SAFETY: `start_payload`'s contract: `dest` is valid for `len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), dest, m.len()) };
        PayloadPoll::Arrived
    }

    fn cancel_payload(&mut self, _: Rank, p: &mut FakePayload) {
        p.cancelled = true;
    }

    fn start_send(&mut self, frame: Frame) -> Started<()> {
        self.sent.push(frame);
        Started::InFlight {
            state: (),
            error: None,
        }
    }
}

struct Rig {
    core: Core<FakeNet>,
    net: FakeNet,
    mailbox: Arc<Mailbox>,
    keys: Vec<FrameKeys>,
    commands: mpsc::Sender<SendCommand>,
}

fn key(step: u32) -> MsgKey {
    MsgKey {
        collective: 0,
        step,
        tag: 0,
    }
}

fn rig() -> Rig {
    let keys = FrameKeys::local_world(2).unwrap();
    let mailbox = Arc::new(Mailbox::new(2));
    let (commands, rx) = mpsc::channel(16);
    let config = CoreConfig {
        name: "fake",
        me: ME,
        max_message_bytes: 1 << 40,
        pool_bytes: 1 << 20,
        header_window: 4,
    };
    let core = Core::new(config, 2, keys[ME].clone(), mailbox.clone(), rx);
    Rig {
        core,
        net: FakeNet::default(),
        mailbox,
        keys,
        commands,
    }
}

impl Rig {
    /// Rank 0's sealed header of message `seq` for step `step`, announcing `len` bytes.
    fn header(&self, seq: u64, step: u32, len: usize, payload: &[u8]) -> [u8; SEALED_LEN] {
        self.keys[FROM]
            .seal(ME, seq, &FrameHeader::new(key(step), 0, FROM, len), payload)
            .unwrap()
    }

    /// Rank 0's genuine message `seq` for step `step`.
    fn genuine(&mut self, seq: u64, step: u32, payload: &[u8]) {
        let h = self.header(seq, step, payload.len(), payload);
        self.net.arrive(Kind::Header, seq, &h);
        self.net.arrive(Kind::Payload, seq, payload);
    }

    fn turn(&mut self) {
        self.core.advance_receives(&mut self.net);
    }

    fn post(&self, step: u32, len: usize) -> oneshot::Receiver<RecvOutcome> {
        self.mailbox.post(FROM, key(step), 0, len)
    }
}

fn received(rx: &mut oneshot::Receiver<RecvOutcome>) -> Option<RecvOutcome> {
    rx.try_recv().ok()
}

fn host(bytes: &[u8]) -> Option<RecvOutcome> {
    Some(RecvOutcome::Received(Payload::Host(
        Bytes::copy_from_slice(bytes),
    )))
}

#[test]
fn the_tag_layout_puts_sender_kind_and_sequence_in_their_bits() {
    let t = TAGS.tag(3, Kind::Payload, 5);
    assert_eq!(t, (3 << 40) | (2 << 38) | 5);
    assert_eq!(
        TAGS.tag(1, Kind::Header, (1 << 38) + 7),
        TAGS.tag(1, Kind::Header, 7)
    );
    assert_eq!(TagLayout::new(36).bits(), 62);
}

#[test]
fn claims_are_made_in_sequence_order() {
    let mut r = rig();
    let mut first = r.post(0, 3);
    let mut second = r.post(1, 2);
    // Message 1 arrives first: it waits for message 0.
    r.genuine(1, 1, b"yz");
    r.turn();
    r.turn();
    assert_eq!(received(&mut second), None);
    assert!(
        r.net.payload_starts.is_empty(),
        "nothing claimed out of order"
    );
    r.genuine(0, 0, b"abc");
    r.turn();
    r.turn();
    assert_eq!(received(&mut first), host(b"abc"));
    assert_eq!(received(&mut second), host(b"yz"));
    assert_eq!(
        r.net.payload_starts,
        vec![(0, true, 3), (1, true, 2)],
        "claimed in order, each into a buffer of the expected length"
    );
}

#[test]
fn a_forged_header_is_dropped_and_its_receive_posted_again() {
    let mut r = rig();
    let mut rx = r.post(0, 4);
    // A header sealed under another job's keys, and one of another length, on rank 0's tags
    // ahead of its genuine one.
    let strangers = FrameKeys::local_world(2).unwrap();
    let forged = strangers[FROM]
        .seal(ME, 0, &FrameHeader::new(key(0), 0, FROM, 4), b"evil")
        .unwrap();
    r.net.arrive(Kind::Header, 0, &forged);
    r.net.arrive(Kind::Header, 0, &[7; 10]);
    r.genuine(0, 0, b"good");
    r.turn();
    r.turn();
    assert_eq!(received(&mut rx), host(b"good"));
    assert_eq!(
        r.net.header_posts[&0], 3,
        "posted, and again after each forgery"
    );
    assert!(!r.core.is_closed(FROM), "a forgery never closes the peer");
}

#[test]
fn a_payload_that_does_not_match_its_tag_is_received_again_then_malformed() {
    let mut r = rig();
    // One forged payload ahead of the genuine one: received again, delivered.
    let mut rx = r.post(0, 4);
    let h = r.header(0, 0, 4, b"good");
    r.net.arrive(Kind::Header, 0, &h);
    r.net.arrive(Kind::Payload, 0, b"evil");
    r.net.arrive(Kind::Payload, 0, b"good");
    r.turn();
    assert_eq!(received(&mut rx), host(b"good"));
    // Only forgeries: received again PAYLOAD_RETRIES times, then Malformed.
    let mut rx = r.post(1, 4);
    let h = r.header(1, 1, 4, b"good");
    r.net.arrive(Kind::Header, 1, &h);
    for _ in 0..=PAYLOAD_RETRIES {
        r.net.arrive(Kind::Payload, 1, b"evil");
    }
    r.net.arrive(Kind::Payload, 1, b"good");
    r.turn();
    r.turn();
    match received(&mut rx) {
        Some(RecvOutcome::Malformed(why)) => assert!(why.contains("tag sealed"), "{why}"),
        other => panic!("{other:?}"),
    }
    let starts = r.net.payload_starts.iter().filter(|s| s.0 == 1).count();
    assert_eq!(starts, 1 + usize::from(PAYLOAD_RETRIES));
    assert!(!r.core.is_closed(FROM));
}

#[test]
fn a_payload_of_another_length_gets_no_buffer_sized_by_the_peer() {
    let mut r = rig();
    // The header announces 1 GiB where 4 bytes are expected: the receive is Malformed and the
    // payload drained without a buffer.
    let mut rx = r.post(0, 4);
    let h = r.header(0, 0, 1 << 30, b"");
    r.net.arrive(Kind::Header, 0, &h);
    r.turn();
    assert_eq!(
        received(&mut rx),
        Some(RecvOutcome::Malformed(format!(
            "frame of {} bytes, expected 4",
            1 << 30
        )))
    );
    assert_eq!(r.net.payload_starts, vec![(0, false, 1 << 30)], "drained");
    r.net.arrive(Kind::Payload, 0, b"x");
    r.turn();
    assert!(!r.core.in_flight(), "the drained payload is gone");
    // A payload message of another length than its (genuine) header's: not the peer's, so
    // received again into the same buffer.
    let mut rx = r.post(1, 4);
    let h = r.header(1, 1, 4, b"good");
    r.net.arrive(Kind::Header, 1, &h);
    r.net.arrive(Kind::Payload, 1, &[1; 4096]);
    r.net.arrive(Kind::Payload, 1, b"good");
    r.turn();
    assert_eq!(received(&mut rx), host(b"good"));
    assert_eq!(&r.net.payload_starts[1..], &[(1, true, 4), (1, true, 4)]);
}

#[test]
fn a_header_over_the_limit_closes_the_peer() {
    let mut r = rig();
    r.core.config.max_message_bytes = 100;
    let mut rx = r.post(0, 4);
    let h = r.header(0, 0, 101, b"");
    r.net.arrive(Kind::Header, 0, &h);
    r.turn();
    assert!(r.core.is_closed(FROM));
    match received(&mut rx) {
        Some(RecvOutcome::Malformed(why)) => assert!(why.contains("exceeds"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        r.net.cancelled_headers, 3,
        "the rest of the window is cancelled"
    );
}

#[test]
fn sends_are_done_within_the_credit_and_wait_beyond_it() {
    let mut r = rig();
    let half = Bytes::from(vec![0u8; SEND_CREDIT / 2]);
    let mut dones = Vec::new();
    for step in 0..3 {
        let (done, finished) = oneshot::channel();
        r.commands
            .try_send(SendCommand {
                peer: FROM,
                key: key(step),
                call: 0,
                payload: half.clone(),
                done,
            })
            .unwrap();
        dones.push(finished);
    }
    assert_eq!(r.core.take_commands(&mut r.net), Some(3));
    let seqs: Vec<u64> = r.net.sent.iter().map(|f| f.seq).collect();
    assert_eq!(seqs, vec![0, 1, 2]);
    assert_eq!(dones[0].try_recv().ok(), Some(Ok(())));
    assert_eq!(dones[1].try_recv().ok(), Some(Ok(())));
    assert!(dones[2].try_recv().is_err(), "beyond the credit: waits");
    // The network is done with the first: the third fits now.
    let first = r.net.sent[0].id;
    assert!(!r.core.finish_sends(|_| false));
    r.core.finish_send(first);
    assert_eq!(dones[2].try_recv().ok(), Some(Ok(())));
    assert!(r.core.sending());
    assert!(r.core.finish_sends(|_| true));
    assert!(!r.core.sending());
    // A sealed header opens on the receiving side.
    let header = &r.net.sent[2].header;
    let opened = r.keys[FROM].open(ME, 2, header).unwrap();
    assert_eq!(opened.header.key(), key(2));
    drop(r.commands);
    assert_eq!(
        r.core.take_commands(&mut r.net),
        None,
        "the transport is gone"
    );
}

/// A peer that takes nothing holds at most its budget of this rank's memory ([`SEND_BUDGET`]
/// where its messages are small): sends past it fail at once without a sequence number (no
/// gap: the next message after the peer has taken some goes out in sequence); a message larger
/// than the budget still goes alone, and raises the budget to three of it.
#[test]
fn sends_to_a_peer_that_takes_nothing_stop_at_the_budget() {
    let mut r = rig();
    let quarter = Bytes::from(vec![0u8; SEND_BUDGET / 4]);
    let send = |r: &mut Rig, step: u32, payload: Bytes| {
        let (done, finished) = oneshot::channel();
        r.commands
            .try_send(SendCommand {
                peer: FROM,
                key: key(step),
                call: 0,
                payload,
                done,
            })
            .unwrap();
        r.core.take_commands(&mut r.net);
        finished
    };
    let mut dones: Vec<_> = (0..6)
        .map(|step| send(&mut r, step, quarter.clone()))
        .collect();
    let seqs: Vec<u64> = r.net.sent.iter().map(|f| f.seq).collect();
    assert_eq!(seqs, vec![0, 1, 2, 3], "four quarters fill the budget");
    assert_eq!(r.core.outstanding(FROM), SEND_BUDGET);
    for refused in &mut dones[4..] {
        match refused.try_recv() {
            Ok(Err(why)) => assert!(why.contains("send budget"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
    // The peer takes the first: the next send goes out with the next sequence number.
    let first = r.net.sent[0].id;
    r.core.finish_send(first);
    let _next = send(&mut r, 6, quarter.clone());
    assert_eq!(r.net.sent.last().map(|f| f.seq), Some(4), "no gap");
    assert_eq!(r.core.outstanding(FROM), SEND_BUDGET);
    // Once it has taken everything, a message larger than the budget goes, alone; the budget
    // is then three of it, so the round's small messages still go beside it in flight.
    let ids: Vec<u64> = r.net.sent.iter().map(|f| f.id).collect();
    for id in ids {
        r.core.finish_send(id);
    }
    assert_eq!(r.core.outstanding(FROM), 0);
    let _huge = send(&mut r, 7, Bytes::from(vec![0u8; SEND_BUDGET + 1]));
    assert_eq!(r.net.sent.last().map(|f| f.seq), Some(5));
    assert_eq!(r.core.budget(FROM), 3 * (SEND_BUDGET + 1));
    let _digest = send(&mut r, 8, Bytes::from_static(&[0u8; 32]));
    assert_eq!(
        r.net.sent.last().map(|f| f.seq),
        Some(6),
        "a small message beside it"
    );
}

#[test]
fn a_failed_peer_closes_once_what_it_sent_is_delivered() {
    let mut r = rig();
    let mut rx = r.post(0, 2);
    let mut later = r.post(1, 2);
    r.genuine(0, 0, b"ok");
    assert!(r.core.mark_failed(FROM));
    assert!(!r.core.mark_failed(FROM));
    r.turn();
    assert_eq!(
        received(&mut rx),
        host(b"ok"),
        "delivered before the slot closed"
    );
    assert!(r.core.is_closed(FROM));
    assert_eq!(received(&mut later), Some(RecvOutcome::Missing));
    // Sends to it are refused.
    let (done, mut finished) = oneshot::channel();
    r.commands
        .try_send(SendCommand {
            peer: FROM,
            key: key(2),
            call: 0,
            payload: Bytes::from_static(b"x"),
            done,
        })
        .unwrap();
    r.core.take_commands(&mut r.net);
    assert!(matches!(finished.try_recv(), Ok(Err(_))));
    assert!(r.net.sent.is_empty());
}

#[test]
fn a_failed_header_receive_closes_the_peer_and_its_pending_payloads() {
    let mut r = rig();
    let mut rx = r.post(0, 4);
    let h = r.header(0, 0, 4, b"good");
    r.net.arrive(Kind::Header, 0, &h);
    r.turn();
    // The payload receive is pending; message 1's header receive fails.
    r.core
        .header_arrived(FROM, 1, HeaderArrival::Failed("gone wrong".into()));
    r.turn();
    assert!(r.core.is_closed(FROM));
    match received(&mut rx) {
        Some(RecvOutcome::Malformed(why)) => assert!(why.contains("gone wrong"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert!(
        r.core.in_flight(),
        "the cancelled payload receive is still pending"
    );
    r.turn();
    assert!(
        !r.core.in_flight(),
        "dropped once the network is done with it"
    );
}
