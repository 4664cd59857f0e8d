//! Matching of incoming messages to posted receives, shared by transports.
//!
//! A [`Mailbox`] belongs to one receiving rank and has one slot per peer. The receiving side
//! [`posts`](Mailbox::post) the receives of a step and [`retires`](Mailbox::retire) them when
//! the step ends; whatever delivers messages (a TCP reader task, another in-process rank)
//! [`claims`](Mailbox::claim) the receive that a message is for before it allocates anything,
//! so a message's length is checked against what the receiver expects, never trusted.
//!
//! Because steps are posted in increasing [`MsgKey`] order, a message whose key is not yet
//! posted is either early (the claim waits for it, which back-pressures that one peer) or stale
//! (at or below the retired watermark: the claim says so and the message is dropped).

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::{oneshot, Notify};

use crate::{MsgKey, Payload, Rank, RecvOutcome};

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
    retired: Option<MsgKey>,
    closed: Option<Closed>,
}

#[derive(Debug)]
struct Posted {
    len: usize,
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

    /// Posts a receive of `len` bytes from `peer` under `key`; the returned channel yields its
    /// outcome. A closed slot yields its outcome at once.
    ///
    /// # Panics
    /// If `peer` is out of range (callers validate steps first).
    pub fn post(&self, peer: Rank, key: MsgKey, len: usize) -> oneshot::Receiver<RecvOutcome> {
        let (tx, rx) = oneshot::channel();
        {
            let mut slot = self.slot(peer);
            match &slot.closed {
                Some(c) => {
                    let _ = tx.send(c.outcome());
                }
                None => {
                    slot.posted.insert(key, Posted { len, tx });
                }
            }
        }
        self.changed.notify_waiters();
        rx
    }

    /// Withdraws whatever is still posted from `peer` at or below `key` and raises the
    /// watermark, so that late messages for those keys are [`Claim::Stale`].
    pub fn retire(&self, peer: Rank, key: MsgKey) {
        {
            let mut slot = self.slot(peer);
            let later = slot.posted.split_off(&next_key(key));
            slot.posted = later;
            if slot.retired.is_none_or(|r| r < key) {
                slot.retired = Some(key);
            }
        }
        self.changed.notify_waiters();
    }

    /// Waits until the receive for a message from `peer` under `key` is posted, then takes it.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is taken until the future completes.
    pub async fn claim(&self, peer: Rank, key: MsgKey) -> Claim {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut slot = self.slot(peer);
                if slot.closed.is_some() {
                    return Claim::Closed;
                }
                if let Some(p) = slot.posted.remove(&key) {
                    return Claim::Posted(Delivery { len: p.len, tx: p.tx });
                }
                if slot.retired.is_some_and(|r| key <= r) {
                    return Claim::Stale;
                }
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

fn next_key(k: MsgKey) -> MsgKey {
    match k.tag.checked_add(1) {
        Some(tag) => MsgKey { tag, ..k },
        None => match k.step.checked_add(1) {
            Some(step) => MsgKey { step, tag: 0, ..k },
            None => MsgKey {
                collective: k.collective.saturating_add(1),
                step: 0,
                tag: 0,
            },
        },
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
            match mb2.claim(1, key(0, 0)).await {
                Claim::Posted(d) => {
                    assert_eq!(d.expected_len(), 3);
                    d.deliver(Payload::Host(Bytes::from_static(b"abcd")));
                }
                other => panic!("unexpected {other:?}"),
            }
        });
        tokio::task::yield_now().await;
        let rx = mb.post(1, key(0, 0), 3);
        claimer.await.unwrap();
        assert_eq!(
            rx.await.unwrap(),
            RecvOutcome::Malformed("message of 4 bytes, expected 3".into())
        );
    }

    #[tokio::test]
    async fn retired_keys_are_stale_and_wake_waiting_claims() {
        let mb = std::sync::Arc::new(Mailbox::new(2));
        let mb2 = mb.clone();
        // A bogus key that is never posted: the claim must not wait forever once the steps
        // around it are retired.
        let claimer = tokio::spawn(async move { mb2.claim(0, key(1, 7)).await });
        let _rx = mb.post(0, key(1, 9), 8);
        tokio::task::yield_now().await;
        assert!(!claimer.is_finished());
        mb.retire(0, key(1, 9));
        assert!(matches!(claimer.await.unwrap(), Claim::Stale));
        assert!(matches!(mb.claim(0, key(0, 3)).await, Claim::Stale));
    }

    #[tokio::test]
    async fn close_resolves_posted_and_future_receives() {
        let mb = Mailbox::new(2);
        let rx = mb.post(1, key(0, 0), 1);
        mb.close(1, Closed::Violation("bad magic".into()));
        mb.close(1, Closed::Gone);
        assert_eq!(rx.await.unwrap(), RecvOutcome::Malformed("bad magic".into()));
        let rx = mb.post(1, key(0, 1), 1);
        assert_eq!(rx.await.unwrap(), RecvOutcome::Malformed("bad magic".into()));
        assert!(matches!(mb.claim(1, key(0, 2)).await, Claim::Closed));
    }
}
