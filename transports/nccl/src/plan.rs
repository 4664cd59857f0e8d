//! Where each operation of a step goes, and in which order it is posted (pure: no NCCL calls).
//!
//! NCCL has no tags: a send and a receive between two ranks match by the order in which the
//! two ranks post them. Every rank posts the same step sequence (the runtime's contract), and
//! within a step both sides post one pair's operations sorted by tag, so the n-th send from
//! `a` to `b` meets the n-th receive at `b` from `a`. Payloads of a step share one device
//! buffer for sends and one for receives, each operation at an offset aligned to [`ALIGN`].
//!
//! An empty message travels as one byte (both sides know the length, so both pad it): a
//! barrier's empty messages then synchronize whatever NCCL does with zero-byte transfers.

use byzcoll_runtime::{Rank, Step, Tag, TransportError};

/// Alignment of each operation's offset in a step's device buffers (NCCL copies aligned
/// buffers faster).
pub(crate) const ALIGN: usize = 256;

/// One operation of a step as posted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Op {
    /// Index in `step.sends` or `step.recvs`.
    pub index: usize,
    /// The peer.
    pub peer: Rank,
    /// Offset in the step's device buffer.
    pub offset: usize,
    /// Bytes of the message.
    pub len: usize,
    /// Bytes posted to NCCL: `len`, or 1 for an empty message.
    pub wire: usize,
}

/// A step's operations in posting order, with their buffer layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Sends in posting order.
    pub sends: Vec<Op>,
    /// Receives in posting order.
    pub recvs: Vec<Op>,
    /// Size of the send buffer.
    pub send_bytes: usize,
    /// Size of the receive buffer.
    pub recv_bytes: usize,
}

impl Plan {
    /// Lays out `step`.
    ///
    /// # Errors
    /// [`TransportError::InvalidUsage`] when the step's buffers would not fit in memory.
    pub(crate) fn new(step: &Step) -> Result<Plan, TransportError> {
        Plan::from_ops(
            step.sends.iter().map(|s| (s.peer, s.tag, s.payload.len())),
            step.recvs.iter().map(|r| (r.peer, r.tag, r.len)),
        )
    }

    /// Lays out sends and receives given as (peer, tag, length), in the caller's order.
    ///
    /// # Errors
    /// As [`Plan::new`].
    pub(crate) fn from_ops(
        sends: impl Iterator<Item = (Rank, Tag, usize)>,
        recvs: impl Iterator<Item = (Rank, Tag, usize)>,
    ) -> Result<Plan, TransportError> {
        let (sends, send_bytes) = layout(sends)?;
        let (recvs, recv_bytes) = layout(recvs)?;
        Ok(Plan {
            sends,
            recvs,
            send_bytes,
            recv_bytes,
        })
    }

    /// `true` when the step has no operation at all.
    pub(crate) fn is_empty(&self) -> bool {
        self.sends.is_empty() && self.recvs.is_empty()
    }

    /// Every peer of the step, sorted, each once.
    pub(crate) fn peers(&self) -> Vec<Rank> {
        let mut peers: Vec<Rank> = self
            .sends
            .iter()
            .chain(&self.recvs)
            .map(|o| o.peer)
            .collect();
        peers.sort_unstable();
        peers.dedup();
        peers
    }
}

fn layout(
    ops: impl Iterator<Item = (Rank, Tag, usize)>,
) -> Result<(Vec<Op>, usize), TransportError> {
    let mut keyed: Vec<(Rank, Tag, usize, usize)> = ops
        .enumerate()
        .map(|(index, (peer, tag, len))| (peer, tag, index, len))
        .collect();
    // Stable on the original index, so equal (peer, tag) keep the caller's order.
    keyed.sort_unstable_by_key(|&(peer, tag, index, _)| (peer, tag, index));
    let too_big =
        || TransportError::InvalidUsage("a step's payloads do not fit in one device buffer".into());
    let mut end = 0usize;
    let mut out = Vec::with_capacity(keyed.len());
    for (peer, _, index, len) in keyed {
        let offset = end.checked_next_multiple_of(ALIGN).ok_or_else(too_big)?;
        let wire = len.max(1);
        end = offset.checked_add(wire).ok_or_else(too_big)?;
        out.push(Op {
            index,
            peer,
            offset,
            len,
            wire,
        });
    }
    Ok((out, end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use byzcoll_runtime::{Payload, RecvOp, SendOp};
    use tokio::time::Instant;

    fn step(sends: &[(Rank, Tag, usize)], recvs: &[(Rank, Tag, usize)]) -> Step {
        Step {
            collective: 0,
            step: 0,
            call: 0,
            sends: sends
                .iter()
                .map(|&(peer, tag, len)| SendOp {
                    peer,
                    tag,
                    payload: Payload::Host(Bytes::from(vec![0u8; len])),
                })
                .collect(),
            recvs: recvs
                .iter()
                .map(|&(peer, tag, len)| RecvOp { peer, tag, len })
                .collect(),
            deadline: Instant::now(),
            quorum: None,
        }
    }

    #[test]
    fn posting_order_is_by_peer_then_tag_on_both_sides() {
        // The sender lists its two messages to rank 1 in one order, the receiver lists them
        // in the other: both post tag 3 before tag 5, so NCCL's order matching pairs them.
        let sender = Plan::new(&step(&[(2, 0, 8), (1, 5, 10), (1, 3, 4)], &[])).unwrap();
        let order: Vec<(Rank, usize)> = sender.sends.iter().map(|o| (o.peer, o.index)).collect();
        assert_eq!(order, vec![(1, 2), (1, 1), (2, 0)]);
        let receiver = Plan::new(&step(&[], &[(0, 3, 4), (0, 5, 10)])).unwrap();
        let lens: Vec<usize> = receiver.recvs.iter().map(|o| o.len).collect();
        assert_eq!(lens, vec![4, 10]);
        let receiver_swapped = Plan::new(&step(&[], &[(0, 5, 10), (0, 3, 4)])).unwrap();
        let lens: Vec<usize> = receiver_swapped.recvs.iter().map(|o| o.len).collect();
        assert_eq!(lens, vec![4, 10]);
    }

    #[test]
    fn equal_keys_keep_the_callers_order() {
        let p = Plan::new(&step(&[(1, 0, 1), (1, 0, 2), (1, 0, 3)], &[])).unwrap();
        let idx: Vec<usize> = p.sends.iter().map(|o| o.index).collect();
        assert_eq!(idx, vec![0, 1, 2]);
    }

    #[test]
    fn offsets_are_aligned_and_do_not_overlap() {
        let p = Plan::new(&step(
            &[],
            &[(1, 0, 1), (2, 0, 0), (3, 0, 300), (4, 0, 256)],
        ))
        .unwrap();
        let offsets: Vec<usize> = p.recvs.iter().map(|o| o.offset).collect();
        assert_eq!(offsets, vec![0, 256, 512, 1024]);
        let wires: Vec<usize> = p.recvs.iter().map(|o| o.wire).collect();
        assert_eq!(wires, vec![1, 1, 300, 256]);
        assert_eq!(p.recv_bytes, 1280);
        assert_eq!(p.send_bytes, 0);
        for w in p.recvs.windows(2) {
            assert!(w[0].offset + w[0].wire <= w[1].offset);
            assert_eq!(w[1].offset % ALIGN, 0);
        }
        assert_eq!(p.peers(), vec![1, 2, 3, 4]);
    }

    #[test]
    fn empty_steps_and_overflow() {
        let p = Plan::new(&step(&[], &[])).unwrap();
        assert!(p.is_empty());
        assert!(p.peers().is_empty());
        let huge = Plan::new(&step(&[], &[(1, 0, usize::MAX), (2, 0, 1)]));
        assert!(matches!(huge, Err(TransportError::InvalidUsage(_))));
    }
}
