//! Matching of incoming messages to posted receives, shared by transports.
//!
//! A [`Mailbox`] belongs to one receiving rank and has one slot per peer. The receiving side
//! [`posts`](Mailbox::post) the receives of a step and [`retires`](Mailbox::retire) them when
//! the step ends; whatever delivers messages (a TCP reader task, another in-process rank)
//! [`claims`](Mailbox::claim) the receive that a message is for before it allocates anything,
//! so a message's length is checked against what the receiver expects, never trusted.
//!
//! Because the steps of a stream (a communicator, [`MsgKey::stream`]) are posted in increasing
//! [`MsgKey`] order, and all receives of a step from one peer are posted at once, a message
//! whose key is not posted is either early (above every key of its stream posted so far: the
//! claim waits for it, which back-pressures that one peer) or stale (below a key of its stream
//! already posted, or at or below its stream's retired watermark: it will never be posted, so
//! the claim says so and the message is dropped). Streams are independent: a communicator and
//! the ones split from it may run their collectives concurrently over one transport.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::{oneshot, Notify};

use tokio::time::{Duration, Instant};

use std::future::Future;

use bytes::Bytes;

use byzcoll_runtime::{MsgKey, Payload, Quorum, Rank, RecvOutcome, SendOp, Step};

/// Why a peer's slot was closed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Closed {
    /// The peer went away (connection closed, process gone): its receives are `Missing`.
    Gone,
    /// The peer broke the protocol; everything it might still send is distrusted and its
    /// receives are `Malformed` with this reason.
    Violation(String),
}

impl Closed {
    fn outcome(&self) -> RecvOutcome {
        match self {
            Closed::Gone => RecvOutcome::Missing,
            Closed::Violation(why) => RecvOutcome::Malformed(why.clone()),
        }
    }
}

#[derive(Debug, Default)]
struct Slot {
    posted: BTreeMap<MsgKey, Posted>,
    /// Highest key ever posted, by stream.
    high: BTreeMap<u64, MsgKey>,
    /// Highest key retired, by stream.
    retired: BTreeMap<u64, MsgKey>,
    /// Highest key the peer said it dropped unsent, by stream ([`Mailbox::skip_through`]).
    skipped: BTreeMap<u64, MsgKey>,
    closed: Option<Closed>,
}

impl Slot {
    fn post(&mut self, key: MsgKey, call: u64, len: usize) -> oneshot::Receiver<RecvOutcome> {
        let (tx, rx) = oneshot::channel();
        match &self.closed {
            Some(c) => {
                let _ = tx.send(c.outcome());
            }
            None => {
                if self
                    .skipped
                    .get(&key.stream())
                    .is_some_and(|&last| key <= last)
                {
                    let _ = tx.send(RecvOutcome::Skipped);
                } else {
                    self.posted.insert(key, Posted { len, call, tx });
                }
                let high = self.high.entry(key.stream()).or_insert(key);
                *high = (*high).max(key);
            }
        }
        rx
    }

    fn is_stale(&self, key: MsgKey) -> bool {
        let at_or_below =
            |marks: &BTreeMap<u64, MsgKey>| marks.get(&key.stream()).is_some_and(|&m| key <= m);
        at_or_below(&self.retired) || at_or_below(&self.high)
    }
}

#[derive(Debug)]
struct Posted {
    len: usize,
    /// The fingerprint of the call the receive belongs to ([`Step::call`]).
    call: u64,
    tx: oneshot::Sender<RecvOutcome>,
}

/// Receive matching for one rank; see the module docs.
#[derive(Debug)]
pub struct Mailbox {
    slots: Vec<Mutex<Slot>>,
    changed: Notify,
}

/// The result of [`Mailbox::claim`].
#[derive(Debug)]
pub enum Claim {
    /// The receive is posted; deliver into it.
    Posted(Delivery),
    /// The step this message belongs to has been retired: drop the message.
    Stale,
    /// The slot is closed: stop delivering.
    Closed,
}

/// A claimed receive, waiting for its outcome.
#[derive(Debug)]
pub struct Delivery {
    len: usize,
    tx: oneshot::Sender<RecvOutcome>,
}

impl Delivery {
    /// The length the receiver expects.
    pub fn expected_len(&self) -> usize {
        self.len
    }

    /// Completes the receive. A receive whose step was retired meanwhile ignores it.
    pub fn complete(self, outcome: RecvOutcome) {
        let _ = self.tx.send(outcome);
    }

    /// Completes the receive with `payload` if its length is the expected one, and with
    /// [`RecvOutcome::Malformed`] otherwise.
    pub fn deliver(self, payload: Payload) {
        let outcome = if payload.len() == self.len {
            RecvOutcome::Received(payload)
        } else {
            RecvOutcome::Malformed(format!(
                "message of {} bytes, expected {}",
                payload.len(),
                self.len
            ))
        };
        self.complete(outcome);
    }
}

impl Mailbox {
    /// A mailbox with one slot for each of `size` peers.
    pub fn new(size: usize) -> Self {
        Mailbox {
            slots: (0..size).map(|_| Mutex::new(Slot::default())).collect(),
            changed: Notify::new(),
        }
    }

    fn slot(&self, peer: Rank) -> MutexGuard<'_, Slot> {
        // A panic while holding the lock cannot leave a slot inconsistent (every update is a
        // single map operation), so poisoning is ignored.
        self.slots[peer]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Posts a receive of `len` bytes from `peer` under `key`, for the call with fingerprint
    /// `call`; the returned channel yields its outcome. A closed slot yields its outcome at
    /// once.
    ///
    /// # Panics
    /// If `peer` is out of range (callers validate steps first).
    pub fn post(
        &self,
        peer: Rank,
        key: MsgKey,
        call: u64,
        len: usize,
    ) -> oneshot::Receiver<RecvOutcome> {
        let rx = self.slot(peer).post(key, call, len);
        self.changed.notify_waiters();
        rx
    }

    /// Withdraws whatever is still posted from `peer` at or below `key` in its stream and
    /// raises that stream's watermark, so that late messages for those keys are
    /// [`Claim::Stale`].
    pub fn retire(&self, peer: Rank, key: MsgKey) {
        {
            let mut slot = self.slot(peer);
            let start = MsgKey::stream_start(key.stream());
            while let Some((&k, _)) = slot.posted.range(start..=key).next() {
                slot.posted.remove(&k);
            }
            let retired = slot.retired.entry(key.stream()).or_insert(key);
            *retired = (*retired).max(key);
        }
        self.changed.notify_waiters();
    }

    /// The peer dropped unsent every message to this rank of `last`'s stream up to `last`
    /// that this rank has not had yet (it fell behind the peer: a TCP skip notice): the
    /// receives for them, posted or posted later, are [`RecvOutcome::Skipped`] at once
    /// rather than [`RecvOutcome::Missing`] at their deadline, so this rank catches up with
    /// the peer, and knows that it is the one behind.
    pub fn skip_through(&self, peer: Rank, last: MsgKey) {
        {
            let mut slot = self.slot(peer);
            let start = MsgKey::stream_start(last.stream());
            let skipped: Vec<MsgKey> = slot.posted.range(start..=last).map(|(&k, _)| k).collect();
            for k in skipped {
                if let Some(p) = slot.posted.remove(&k) {
                    let _ = p.tx.send(RecvOutcome::Skipped);
                }
            }
            let mark = slot.skipped.entry(last.stream()).or_insert(last);
            *mark = (*mark).max(last);
        }
        self.changed.notify_waiters();
    }

    /// Takes the receive for a message from `peer` under `key` of the call with fingerprint
    /// `call` if its fate is known now: `None` while the message is early (its receive not
    /// posted yet). A message whose call is not the posted receive's completes that receive
    /// as [`RecvOutcome::OutOfStep`] and is [`Claim::Stale`] (dropped). For transports that
    /// poll from their own thread.
    pub fn try_claim(&self, peer: Rank, key: MsgKey, call: u64) -> Option<Claim> {
        let mut slot = self.slot(peer);
        if slot.closed.is_some() {
            return Some(Claim::Closed);
        }
        if let Some(p) = slot.posted.remove(&key) {
            if p.call != call {
                let _ = p.tx.send(RecvOutcome::OutOfStep);
                return Some(Claim::Stale);
            }
            return Some(Claim::Posted(Delivery {
                len: p.len,
                tx: p.tx,
            }));
        }
        slot.is_stale(key).then_some(Claim::Stale)
    }

    /// Waits until the receive for a message from `peer` under `key` is posted, then takes it
    /// (as [`Mailbox::try_claim`]).
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is taken until the future completes.
    pub async fn claim(&self, peer: Rank, key: MsgKey, call: u64) -> Claim {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(claim) = self.try_claim(peer, key, call) {
                return claim;
            }
            changed.await;
        }
    }

    /// Closes `peer`'s slot: every posted receive and every later one gets the outcome for
    /// `why`, and claims return [`Claim::Closed`]. The first reason given is kept.
    pub fn close(&self, peer: Rank, why: Closed) {
        {
            let mut slot = self.slot(peer);
            if slot.closed.is_none() {
                for (_, p) in std::mem::take(&mut slot.posted) {
                    let _ = p.tx.send(why.outcome());
                }
                slot.closed = Some(why);
            }
        }
        self.changed.notify_waiters();
    }

    /// Why `peer`'s slot is closed, if it is.
    pub fn closed(&self, peer: Rank) -> Option<Closed> {
        self.slot(peer).closed.clone()
    }
}

/// The receives of one step, posted together; see [`Mailbox::post_step`].
///
/// Dropping it retires the step for every peer, so messages for it that arrive later are
/// stale, whether the step completed or its future was dropped.
#[derive(Debug)]
pub struct PostedStep<'a> {
    mailbox: &'a Mailbox,
    receivers: Vec<oneshot::Receiver<RecvOutcome>>,
    last: MsgKey,
}

impl Mailbox {
    /// Posts every receive of `step`.
    ///
    /// # Panics
    /// If a receive's peer is out of range (validate the step first).
    pub fn post_step(&self, step: &Step) -> PostedStep<'_> {
        // All receives from one peer are posted under one lock, so a claim never sees a later
        // tag of the step without the earlier ones (which would make those look stale).
        let mut order: Vec<usize> = (0..step.recvs.len()).collect();
        order.sort_by_key(|&i| step.recvs[i].peer);
        let mut receivers: Vec<Option<oneshot::Receiver<RecvOutcome>>> =
            (0..step.recvs.len()).map(|_| None).collect();
        for group in order.chunk_by(|&a, &b| step.recvs[a].peer == step.recvs[b].peer) {
            let mut slot = self.slot(step.recvs[group[0]].peer);
            for &i in group {
                let r = &step.recvs[i];
                receivers[i] = Some(slot.post(step.key(r.tag), step.call, r.len));
            }
        }
        self.changed.notify_waiters();
        PostedStep {
            mailbox: self,
            receivers: receivers.into_iter().flatten().collect(),
            last: step.key(byzcoll_runtime::Tag::MAX),
        }
    }
}

impl PostedStep<'_> {
    /// Waits for every receive until `deadline`; those still open then are
    /// [`RecvOutcome::Missing`]. With a `quorum`, stops earlier: once that many messages have
    /// come (a dead peer's receive ends at once but does not count) and its grace has passed,
    /// those still open are [`RecvOutcome::Late`].
    /// Outcomes are in the order of the step's receives.
    ///
    /// # Cancel safety
    /// Dropping the future retires the step (see [`PostedStep`]).
    pub async fn outcomes(mut self, deadline: Instant, quorum: Option<Quorum>) -> Vec<RecvOutcome> {
        let receivers = std::mem::take(&mut self.receivers);
        match quorum {
            Some(q) if q.receives < receivers.len() => until_quorum(receivers, deadline, q).await,
            _ => until_deadline(receivers, deadline).await,
        }
    }
}

/// Every receive's outcome, those still open at `deadline` missing.
async fn until_deadline(
    receivers: Vec<oneshot::Receiver<RecvOutcome>>,
    deadline: Instant,
) -> Vec<RecvOutcome> {
    let waits = receivers.into_iter().map(|rx| async move {
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) | Err(_) => RecvOutcome::Missing,
        }
    });
    futures::future::join_all(waits).await
}

/// Every receive's outcome until `quorum` of them have one (the first `quorum.core` among
/// them) and its grace has passed (or the deadline, whichever is first), or until the quorum
/// has formed and the first `quorum.awaited` receives (all but the laggards') have an
/// outcome; those still open then are late (missing at the deadline). Only messages that
/// came count towards the quorum: a dead peer's receive (or a malformed one) has its outcome
/// at once and is waited for no more, but it is an erasure like a late one, and the budget of
/// `s` stragglers covers both, so the quorum still needs the others' messages (with one peer
/// dead and `s = 1`, a round of 4 that ended at its quorum would otherwise go on with 2
/// inputs, too few for a median with `f = 1`).
async fn until_quorum(
    receivers: Vec<oneshot::Receiver<RecvOutcome>>,
    deadline: Instant,
    quorum: Quorum,
) -> Vec<RecvOutcome> {
    use futures::stream::{FuturesUnordered, StreamExt};
    let posted = Instant::now();
    let mut outcomes: Vec<Option<RecvOutcome>> = (0..receivers.len()).map(|_| None).collect();
    let mut open: FuturesUnordered<_> = receivers
        .into_iter()
        .enumerate()
        .map(|(i, rx)| async move { (i, rx.await.unwrap_or(RecvOutcome::Missing)) })
        .collect();
    let mut core_open = quorum.core.min(outcomes.len());
    // A quorum of none forms at once.
    let mut formed = quorum.receives == 0 && core_open == 0;
    let mut end = match formed {
        true => deadline.min(posted + quorum.grace.after(Duration::ZERO)),
        false => deadline,
    };
    let mut have = 0;
    let mut awaited_open = quorum.awaited.min(outcomes.len());
    loop {
        tokio::select! {
            next = open.next() => match next {
                Some((i, outcome)) => {
                    if matches!(outcome, RecvOutcome::Received(_)) {
                        have += 1;
                    }
                    outcomes[i] = Some(outcome);
                    if i < quorum.awaited {
                        awaited_open -= 1;
                    }
                    if i < quorum.core {
                        core_open -= 1;
                    }
                    if !formed && have >= quorum.receives && core_open == 0 {
                        formed = true;
                        let now = Instant::now();
                        end = end.min(now + quorum.grace.after(now - posted));
                    }
                    if formed && awaited_open == 0 {
                        end = end.min(Instant::now());
                        break;
                    }
                }
                None => break,
            },
            () = tokio::time::sleep_until(end) => break,
        }
    }
    let cut = if end < deadline {
        RecvOutcome::Late
    } else {
        RecvOutcome::Missing
    };
    outcomes
        .into_iter()
        .map(|o| o.unwrap_or_else(|| cut.clone()))
        .collect()
}

impl Drop for PostedStep<'_> {
    fn drop(&mut self) {
        for peer in 0..self.mailbox.slots.len() {
            self.mailbox.retire(peer, self.last);
        }
    }
}

/// The part of [`byzcoll_runtime::Transport::exchange`] that every mailbox-based transport shares: posts
/// the step's receives (then calls `on_posted`, e.g. to wake a progress thread), runs `send`
/// (with the message's key and the step's call fingerprint) for every send (each bounded by the step's deadline; a failure or a timeout is logged, not
/// an error: the peer will count this rank missing; in a quorum step, bounded by the step's
/// end), and returns the receive outcomes in the order of `step.recvs`.
///
/// # Cancel safety
/// Dropping the future retires the step (see [`PostedStep`]).
pub async fn run_step<F, Fut>(
    mailbox: &Mailbox,
    step: &Step,
    transport: &'static str,
    on_posted: impl FnOnce(),
    send: F,
) -> Vec<RecvOutcome>
where
    F: Fn(&SendOp, MsgKey, u64, Bytes) -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let posted = mailbox.post_step(step);
    on_posted();
    let sends = step.sends.iter().map(|s| {
        // Host memory only: `Step::validate` refuses other payloads for a host transport.
        let sending = s
            .payload
            .as_host()
            .map(|payload| send(s, step.key(s.tag), step.call, payload.clone()));
        async move {
            let Some(sending) = sending else {
                tracing::debug!(transport, peer = s.peer, "send of non-host memory skipped");
                return;
            };
            match tokio::time::timeout_at(step.deadline, sending).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(transport, peer = s.peer, error = %e, "send failed"),
                Err(_) => tracing::debug!(
                    transport,
                    peer = s.peer,
                    "send did not complete before the deadline"
                ),
            }
        }
    });
    let sends = futures::future::join_all(sends);
    let outcomes = posted.outcomes(step.deadline, step.quorum);
    if step.quorum.is_none() {
        return tokio::join!(outcomes, sends).0;
    }
    // A quorum step ends with its receives: a send still in flight then (to a straggler that
    // has not posted the step) is left to the transport, so that a slow receiver cannot hold
    // the step through back-pressure. TCP's queued frames are still written; the in-process
    // transport hands a quorum step's sends to a task of their own, which delivers them until
    // the deadline.
    // The sends are polled first, each time: when the receives are done, every peer they
    // came from has posted the step, and the sends to those peers go through in that poll.
    tokio::pin!(sends, outcomes);
    let mut sent = false;
    loop {
        tokio::select! {
            biased;
            _ = &mut sends, if !sent => sent = true,
            outcomes = &mut outcomes => return outcomes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn key(collective: u64, step: u32) -> MsgKey {
        MsgKey {
            collective,
            step,
            tag: 0,
        }
    }

    #[tokio::test]
    async fn claim_waits_for_post_and_delivers_checked_lengths() {
        let mb = std::sync::Arc::new(Mailbox::new(2));
        let mb2 = mb.clone();
        let claimer = tokio::spawn(async move {
            match mb2.claim(1, key(0, 0), 0).await {
                Claim::Posted(d) => {
                    assert_eq!(d.expected_len(), 3);
                    d.deliver(Payload::Host(Bytes::from_static(b"abcd")));
                }
                other => panic!("unexpected {other:?}"),
            }
        });
        tokio::task::yield_now().await;
        let rx = mb.post(1, key(0, 0), 0, 3);
        claimer.await.unwrap();
        assert_eq!(
            rx.await.unwrap(),
            RecvOutcome::Malformed("message of 4 bytes, expected 3".into())
        );
    }

    #[tokio::test]
    async fn skipped_keys_end_their_receives_at_once_and_only_in_their_stream() {
        let mb = Mailbox::new(2);
        let other_stream = MsgKey::stream_start(1);
        let posted = mb.post(1, key(3, 0), 0, 8);
        let above = mb.post(1, key(9, 0), 0, 8);
        let elsewhere = mb.post(1, other_stream, 0, 8);
        mb.skip_through(1, key(5, 2));
        assert_eq!(posted.await.unwrap(), RecvOutcome::Skipped);
        // Posted later at or below the notice's key: at once too; above it: waited for.
        assert_eq!(
            mb.post(1, key(4, 1), 0, 8).await.unwrap(),
            RecvOutcome::Skipped
        );
        assert_eq!(
            mb.post(1, key(5, 2), 0, 8).await.unwrap(),
            RecvOutcome::Skipped
        );
        let next = mb.post(1, key(5, 3), 0, 8);
        for (rx, k) in [
            (above, key(9, 0)),
            (elsewhere, other_stream),
            (next, key(5, 3)),
        ] {
            match mb.claim(1, k, 0).await {
                Claim::Posted(d) => d.deliver(Payload::Host(Bytes::from_static(b"12345678"))),
                other => panic!("{k:?}: {other:?}"),
            }
            assert!(
                matches!(rx.await.unwrap(), RecvOutcome::Received(_)),
                "{k:?}"
            );
        }
    }

    #[tokio::test]
    async fn retired_keys_are_stale_and_wake_waiting_claims() {
        let mb = std::sync::Arc::new(Mailbox::new(2));
        let mb2 = mb.clone();
        // A bogus key that is never posted: the claim must not wait forever once the steps
        // around it are retired.
        let claimer = tokio::spawn(async move { mb2.claim(0, key(1, 7), 0).await });
        let _rx = mb.post(0, key(1, 5), 0, 8);
        tokio::task::yield_now().await;
        assert!(
            !claimer.is_finished(),
            "a key above every posted one is early, not stale"
        );
        mb.retire(0, key(1, 9));
        assert!(matches!(claimer.await.unwrap(), Claim::Stale));
        assert!(matches!(mb.claim(0, key(0, 3), 0).await, Claim::Stale));
    }

    #[tokio::test]
    async fn keys_below_a_posted_key_are_stale_at_once() {
        let mb = Mailbox::new(2);
        let _rx = mb.post(1, key(2, 1), 0, 8);
        assert!(matches!(mb.claim(1, key(2, 0), 0).await, Claim::Stale));
        assert!(matches!(mb.claim(1, key(2, 1), 0).await, Claim::Posted(_)));
        // Claimed already: a duplicate is stale too.
        assert!(matches!(mb.claim(1, key(2, 1), 0).await, Claim::Stale));
    }

    /// A message of another call (its fingerprint is not the posted receive's) completes the
    /// receive as out of step and is dropped; the call's own message would have been taken.
    #[tokio::test]
    async fn a_message_of_another_call_is_out_of_step_never_delivered() {
        let mb = Mailbox::new(2);
        let rx = mb.post(1, key(4, 0), 77, 8);
        assert!(matches!(mb.claim(1, key(4, 0), 78).await, Claim::Stale));
        assert_eq!(rx.await.unwrap(), RecvOutcome::OutOfStep);
        // The receive is gone: the genuine message, arriving after, is stale.
        assert!(matches!(mb.claim(1, key(4, 0), 77).await, Claim::Stale));
        let _rx = mb.post(1, key(4, 1), 77, 8);
        assert!(matches!(mb.claim(1, key(4, 1), 77).await, Claim::Posted(_)));
    }

    #[tokio::test]
    async fn close_resolves_posted_and_future_receives() {
        let mb = Mailbox::new(2);
        let rx = mb.post(1, key(0, 0), 0, 1);
        mb.close(1, Closed::Violation("bad magic".into()));
        mb.close(1, Closed::Gone);
        assert_eq!(
            rx.await.unwrap(),
            RecvOutcome::Malformed("bad magic".into())
        );
        let rx = mb.post(1, key(0, 1), 0, 1);
        assert_eq!(
            rx.await.unwrap(),
            RecvOutcome::Malformed("bad magic".into())
        );
        assert!(matches!(mb.claim(1, key(0, 2), 0).await, Claim::Closed));
    }

    /// A step of receives from ranks 1 to 3 of 4 with a quorum of `receives`, its grace at
    /// least 10 ms and as long again as the quorum took, and a deadline of 1 s; rank `p`'s
    /// message arrives after `at[p - 1]` (never for `None`). Its outcomes (received or not)
    /// and when it ended.
    async fn quorum_step(receives: usize, at: [Option<u64>; 3]) -> (Vec<RecvOutcome>, Duration) {
        laggard_step(receives, 3, at).await
    }

    /// [`quorum_step`] whose grace waits for the first `awaited` receives only (rank 3 a
    /// laggard where `awaited` is 2).
    async fn laggard_step(
        receives: usize,
        awaited: usize,
        at: [Option<u64>; 3],
    ) -> (Vec<RecvOutcome>, Duration) {
        core_step(receives, awaited, 0, at).await
    }

    /// [`laggard_step`] whose quorum forms only once its first `core` receives are in.
    async fn core_step(
        receives: usize,
        awaited: usize,
        core: usize,
        at: [Option<u64>; 3],
    ) -> (Vec<RecvOutcome>, Duration) {
        dead_step(receives, awaited, core, at, None).await
    }

    /// [`core_step`] with peer `dead`'s connection gone before the step is posted.
    async fn dead_step(
        receives: usize,
        awaited: usize,
        core: usize,
        at: [Option<u64>; 3],
        dead: Option<Rank>,
    ) -> (Vec<RecvOutcome>, Duration) {
        use byzcoll_runtime::{Grace, RecvOp};
        let mb = std::sync::Arc::new(Mailbox::new(4));
        let start = Instant::now();
        let step = Step {
            collective: 0,
            step: 0,
            call: 0,
            sends: Vec::new(),
            recvs: (1..4)
                .map(|peer| RecvOp {
                    peer,
                    tag: 0,
                    len: 1,
                })
                .collect(),
            deadline: start + Duration::from_secs(1),
            quorum: Some(Quorum {
                receives,
                grace: Grace {
                    min: Duration::from_millis(10),
                    factor: 1,
                },
                awaited,
                core,
            }),
        };
        if let Some(dead) = dead {
            mb.close(dead, Closed::Gone);
        }
        let posted = mb.post_step(&step);
        for (i, ms) in at.into_iter().enumerate() {
            let Some(ms) = ms else { continue };
            let mb = mb.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                if let Claim::Posted(d) = mb.claim(i + 1, key(0, 0), 0).await {
                    d.deliver(Payload::Host(Bytes::from_static(b"x")));
                }
            });
        }
        let outcomes = posted.outcomes(step.deadline, step.quorum).await;
        (outcomes, start.elapsed())
    }

    #[tokio::test(start_paused = true)]
    async fn a_quorum_step_ends_one_grace_after_its_quorum_and_names_the_rest_late() {
        let got = RecvOutcome::Received(Payload::Host(Bytes::from_static(b"x")));
        // The quorum of 2 forms at 20 ms; the grace is as long again (over its 10 ms floor).
        let (outcomes, took) = quorum_step(2, [Some(5), Some(20), Some(900)]).await;
        assert_eq!(outcomes, vec![got.clone(), got.clone(), RecvOutcome::Late]);
        assert_eq!(took, Duration::from_millis(40));
        // Within the grace the straggler still counts, and the step ends when all are in.
        let (outcomes, took) = quorum_step(2, [Some(5), Some(20), Some(35)]).await;
        assert_eq!(outcomes, vec![got.clone(), got.clone(), got.clone()]);
        assert_eq!(took, Duration::from_millis(35));
        // A fast quorum gets the floor: 2 ms + 10 ms.
        let (outcomes, took) = quorum_step(2, [Some(1), Some(2), Some(13)]).await;
        assert_eq!(outcomes[2], RecvOutcome::Late);
        assert_eq!(took, Duration::from_millis(12));
        // No quorum before the deadline: the open receives are missing, not late.
        let (outcomes, took) = quorum_step(2, [Some(5), None, None]).await;
        assert_eq!(
            outcomes,
            vec![got, RecvOutcome::Missing, RecvOutcome::Missing]
        );
        assert_eq!(took, Duration::from_secs(1));
    }

    /// `Quorum::core`: ranks 1 and 2 in time, rank 3 late (an `Enforce` echo step). Rank 3's
    /// message coming first does not form the quorum of 2: it forms when rank 2's is in too.
    #[tokio::test(start_paused = true)]
    async fn a_quorum_forms_only_with_its_core_in() {
        let got = RecvOutcome::Received(Payload::Host(Bytes::from_static(b"x")));
        // Without a core, ranks 3 (5 ms) and 1 (10 ms) form it; the grace cuts rank 2.
        let (outcomes, took) = core_step(2, 3, 0, [Some(10), Some(100), Some(5)]).await;
        assert_eq!(outcomes[1], RecvOutcome::Late);
        assert_eq!(took, Duration::from_millis(20));
        // With ranks 1 and 2 the core, it forms at 100 ms, with every receive in.
        let (outcomes, took) = core_step(2, 3, 2, [Some(10), Some(100), Some(5)]).await;
        assert_eq!(outcomes, vec![got.clone(), got.clone(), got.clone()]);
        assert_eq!(took, Duration::from_millis(100));
        // And rank 3 gets the grace after it, no more.
        let (outcomes, took) = core_step(2, 3, 2, [Some(10), Some(20), Some(900)]).await;
        assert_eq!(outcomes, vec![got.clone(), got, RecvOutcome::Late]);
        assert_eq!(took, Duration::from_millis(40));
    }

    /// A dead peer is an erasure like a late one: its outcome comes at once but does not
    /// count towards the quorum, so the budget of stragglers covers the dead too.
    #[tokio::test(start_paused = true)]
    async fn a_dead_peer_is_not_waited_for_but_does_not_form_the_quorum() {
        let got = RecvOutcome::Received(Payload::Host(Bytes::from_static(b"x")));
        // Rank 1 dead, rank 2 in at 5 ms: a quorum of 2 needs rank 3's message too, which a
        // grace from 5 ms would have cut at 15 ms.
        let (outcomes, took) = dead_step(2, 3, 0, [None, Some(5), Some(100)], Some(1)).await;
        assert_eq!(
            outcomes,
            vec![RecvOutcome::Missing, got.clone(), got.clone()]
        );
        assert_eq!(took, Duration::from_millis(100));
        // A quorum of 1: rank 2's message forms it, and the grace cuts rank 3.
        let (outcomes, took) = dead_step(1, 3, 0, [None, Some(5), Some(100)], Some(1)).await;
        assert_eq!(outcomes, vec![RecvOutcome::Missing, got, RecvOutcome::Late]);
        assert_eq!(took, Duration::from_millis(15));
    }

    #[tokio::test(start_paused = true)]
    async fn a_quorum_step_spends_no_grace_on_a_laggard_and_takes_it_when_in_time() {
        let got = RecvOutcome::Received(Payload::Host(Bytes::from_static(b"x")));
        // Rank 3 a laggard: the quorum of 2 forms at 20 ms with every other receive in, and
        // the step ends there (a grace would have taken rank 3's message at 35 ms).
        let (outcomes, took) = laggard_step(2, 2, [Some(5), Some(20), Some(35)]).await;
        assert_eq!(outcomes, vec![got.clone(), got.clone(), RecvOutcome::Late]);
        assert_eq!(took, Duration::from_millis(20));
        // A laggard in time is taken as any other: rank 3 at 3 ms forms the quorum with rank
        // 1 at 5 ms, and the grace (to 15 ms) waits for rank 2, in at 12 ms.
        let (outcomes, took) = laggard_step(2, 2, [Some(5), Some(12), Some(3)]).await;
        assert_eq!(outcomes, vec![got.clone(), got.clone(), got.clone()]);
        assert_eq!(took, Duration::from_millis(12));
        // The grace still bounds the wait for the others: the same quorum, rank 2 at 30 ms is
        // late at the grace's end.
        let (outcomes, took) = laggard_step(2, 2, [Some(5), Some(30), Some(3)]).await;
        assert_eq!(outcomes, vec![got.clone(), RecvOutcome::Late, got]);
        assert_eq!(took, Duration::from_millis(15));
    }
}
