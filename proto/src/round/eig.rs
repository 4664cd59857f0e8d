//! The echo of [`Agreement::Enforce`](crate::Agreement): every rank's input digest broadcast
//! to every rank at once by exponential information gathering (EIG; Lynch, *Distributed
//! Algorithms*, §6.2.3), so that honest ranks end with the same digest per sender, or the same
//! "none", whatever `f` Byzantine ranks send or relay.
//!
//! A node of the tree is labelled by a sequence of distinct ranks `(j, k1, …, kl)`; its value
//! at this rank is what `kl` said that `k(l−1)` said … that rank `j` sent. Level 0 (the gather
//! step) holds what each rank sent this one directly. In each of the `f` relay steps every rank
//! sends every other the values of its last level whose labels do not contain it; the receiver
//! files the value of `σ` from rank `k` under `σ·k`, and its own under `σ·me`. The decision is
//! the strict majority, from the leaves up, over each node's children (none without one).
//!
//! Under synchrony (every honest rank's message of a step arrives within the step's wait) and
//! `n > 3f`, `f + 1` levels give (Lynch, Theorem 6.15, per sender): every honest rank decides
//! the same value for each sender, and an honest sender's own digest. No signatures are
//! needed (the links are authenticated), at the price of messages that grow as `n^l` in the
//! `l`-th relay step: [`MAX_NODES`] bounds the tree, checked before any data moves.

use bytes::Bytes;

use super::Digest;
use crate::Rank;

/// The most nodes an echo tree may have (about 4 M: `n = 1024, f = 1`; `n = 128, f = 2`;
/// `n = 16, f = 4`); larger worlds' `Enforce` rounds are refused up front.
pub(crate) const MAX_NODES: usize = 1 << 22;

/// Bytes of one value on the wire: `present u8`, then the 32-byte digest.
const ENTRY: usize = 33;

/// The number of nodes of a tree of `depth` levels over `n` ranks
/// (`n + n(n−1) + … + n(n−1)…(n−depth+1)`), `None` past `usize`.
pub(crate) fn nodes(n: usize, depth: usize) -> Option<usize> {
    let (mut level, mut total) = (1usize, 0usize);
    for l in 0..depth {
        level = level.checked_mul(n.checked_sub(l)?)?;
        total = total.checked_add(level)?;
    }
    Some(total)
}

/// Calls `visit(index, label)` for every label of `len` distinct ranks below `n`, in
/// lexicographic order, which is the order of the nodes' indices in their level.
fn for_each_label(n: usize, len: usize, mut visit: impl FnMut(usize, &[Rank])) {
    fn walk(
        n: usize,
        len: usize,
        label: &mut Vec<Rank>,
        next: &mut usize,
        visit: &mut dyn FnMut(usize, &[Rank]),
    ) {
        if label.len() == len {
            visit(*next, label);
            *next += 1;
            return;
        }
        for k in 0..n {
            if !label.contains(&k) {
                label.push(k);
                walk(n, len, label, next, visit);
                label.pop();
            }
        }
    }
    let mut label = Vec::with_capacity(len);
    walk(n, len, &mut label, &mut 0, &mut visit);
}

/// The position of child `σ·k` among `σ`'s children (which are `σ·k` for every `k ∉ σ`, in
/// rank order).
fn child_position(label: &[Rank], k: Rank) -> usize {
    k - label.iter().filter(|&&p| p < k).count()
}

/// One rank's echo tree.
#[derive(Debug)]
pub(crate) struct Eig {
    n: usize,
    me: Rank,
    /// Levels the tree gets: `f + 1`.
    depth: usize,
    /// `levels[l][i]`: the value of the `i`-th node whose label has `l + 1` ranks.
    levels: Vec<Vec<Option<Digest>>>,
}

impl Eig {
    /// The tree of rank `me` for `f` Byzantine ranks, from what each rank sent it directly
    /// (its own digest at `me`).
    pub(crate) fn new(n: usize, f: usize, me: Rank, direct: Vec<Option<Digest>>) -> Self {
        debug_assert_eq!(direct.len(), n);
        Eig {
            n,
            me,
            depth: (f + 1).min(n),
            levels: vec![direct],
        }
    }

    /// Relay steps still to run.
    pub(crate) fn relays_left(&self) -> usize {
        self.depth - self.levels.len()
    }

    /// The length of the labels of the last level.
    fn label_len(&self) -> usize {
        self.levels.len()
    }

    /// The length of every rank's message in the next relay step: one entry per node of the
    /// last level whose label does not contain the sender.
    pub(crate) fn relay_len(&self) -> usize {
        let l = self.label_len();
        (self.n - l..self.n).product::<usize>() * ENTRY
    }

    /// This rank's message for the next relay step.
    pub(crate) fn relay(&self) -> Bytes {
        let last = self.levels.last().expect("level 0 is there");
        let mut out = Vec::with_capacity(self.relay_len());
        for_each_label(self.n, self.label_len(), |i, label| {
            if !label.contains(&self.me) {
                out.push(u8::from(last[i].is_some()));
                out.extend_from_slice(&last[i].unwrap_or([0; 32]));
            }
        });
        out.into()
    }

    /// Whether `bytes` is a relay message of the next step (its length and every entry's
    /// flag); anything else counts as a message that did not arrive.
    pub(crate) fn valid(&self, bytes: &[u8]) -> bool {
        bytes.len() == self.relay_len() && bytes.chunks_exact(ENTRY).all(|e| e[0] <= 1)
    }

    /// Files one relay step: `relays[k]` is rank `k`'s [valid](Eig::valid) message, `None`
    /// where it did not arrive (every value it would have carried is "none").
    pub(crate) fn receive(&mut self, relays: &[Option<&[u8]>]) {
        debug_assert_eq!(relays.len(), self.n);
        let (n, me, len) = (self.n, self.me, self.label_len());
        let width = n - len;
        let last = self.levels.last().expect("level 0 is there");
        let mut next: Vec<Option<Digest>> = vec![None; last.len() * width];
        let mut read = vec![0usize; n];
        for_each_label(n, len, |i, label| {
            for k in (0..n).filter(|k| !label.contains(k)) {
                let child = i * width + child_position(label, k);
                next[child] = if k == me {
                    last[i]
                } else {
                    let entry = relays[k].map(|m| &m[read[k] * ENTRY..][..ENTRY]);
                    read[k] += 1;
                    entry.filter(|e| e[0] == 1).map(|e| {
                        let mut d = [0u8; 32];
                        d.copy_from_slice(&e[1..]);
                        d
                    })
                };
            }
        });
        self.levels.push(next);
    }

    /// Every sender's decided digest, once no relay is left.
    pub(crate) fn decide(&self) -> Vec<Option<Digest>> {
        debug_assert_eq!(self.relays_left(), 0);
        let mut values = self.levels.last().expect("level 0 is there").clone();
        for l in (0..self.levels.len() - 1).rev() {
            let width = self.n - (l + 1);
            values = values.chunks_exact(width).map(majority).collect();
        }
        values
    }

    /// What rank `j` sent this rank directly.
    pub(crate) fn direct(&self, j: Rank) -> Option<Digest> {
        self.levels[0][j]
    }

    /// What rank `k` said, in the first relay step, that rank `j` sent it (`k ≠ j`); `None`
    /// before that step or where `k` said nothing.
    pub(crate) fn reported(&self, k: Rank, j: Rank) -> Option<Digest> {
        debug_assert_ne!(k, j);
        let level = self.levels.get(1)?;
        level[j * (self.n - 1) + child_position(&[j], k)]
    }
}

/// The strict majority of `values`, `None` without one.
fn majority(values: &[Option<Digest>]) -> Option<Digest> {
    let mut counts: Vec<(Option<Digest>, usize)> = Vec::new();
    for v in values {
        match counts.iter_mut().find(|(w, _)| w == v) {
            Some((_, c)) => *c += 1,
            None => counts.push((*v, 1)),
        }
    }
    counts
        .into_iter()
        .find(|&(_, c)| 2 * c > values.len())
        .and_then(|(v, _)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(x: u8) -> Option<Digest> {
        Some([x; 32])
    }

    /// How a Byzantine rank acts in [`run`]: what it sends rank `to` directly, and how it
    /// rewrites the relay it sends rank `to`.
    struct Liar {
        rank: Rank,
        direct: fn(Rank) -> Option<Digest>,
        relay: fn(Rank, &mut Vec<u8>),
    }

    /// Runs the echo over `n` ranks (`f` Byzantine allowed) with honest inputs
    /// `digest(rank + 1)`, and returns every honest rank's decisions.
    fn run(n: usize, f: usize, liars: &[Liar]) -> Vec<(Rank, Vec<Option<Digest>>)> {
        let liar = |r: Rank| liars.iter().find(|l| l.rank == r);
        let honest_value = |r: Rank| digest(r as u8 + 1);
        let mut trees: Vec<Eig> = (0..n)
            .map(|me| {
                let direct = (0..n)
                    .map(|j| match liar(j) {
                        Some(l) if j != me => (l.direct)(me),
                        _ => honest_value(j),
                    })
                    .collect();
                Eig::new(n, f, me, direct)
            })
            .collect();
        while trees[0].relays_left() > 0 {
            let sent: Vec<Bytes> = trees.iter().map(Eig::relay).collect();
            for (me, tree) in trees.iter_mut().enumerate() {
                let msgs: Vec<Option<Vec<u8>>> = (0..n)
                    .map(|k| {
                        let mut m = sent[k].to_vec();
                        if let Some(l) = liar(k) {
                            (l.relay)(me, &mut m);
                        }
                        Some(m).filter(|m| k != me && tree.valid(m))
                    })
                    .collect();
                let refs: Vec<Option<&[u8]>> = msgs.iter().map(|m| m.as_deref()).collect();
                tree.receive(&refs);
            }
        }
        (0..n)
            .filter(|&r| liar(r).is_none())
            .map(|r| (r, trees[r].decide()))
            .collect()
    }

    fn agree(decisions: &[(Rank, Vec<Option<Digest>>)]) -> Vec<Option<Digest>> {
        let first = &decisions[0].1;
        for (r, d) in decisions {
            assert_eq!(
                d, first,
                "rank {r} decided otherwise than rank {}",
                decisions[0].0
            );
        }
        first.clone()
    }

    #[test]
    fn sizes_follow_the_falling_factorials() {
        assert_eq!(nodes(4, 2), Some(4 + 12));
        assert_eq!(nodes(7, 3), Some(7 + 42 + 210));
        assert_eq!(nodes(3, 4), Some(3 + 6 + 6));
        assert_eq!(nodes(usize::MAX, 2), None);
        assert!(nodes(1024, 2).unwrap() <= MAX_NODES);
        assert!(nodes(64, 4).unwrap() > MAX_NODES);
        let tree = Eig::new(7, 2, 3, vec![None; 7]);
        assert_eq!(tree.relay_len(), 6 * 33);
        assert_eq!(tree.relay().len(), tree.relay_len());
    }

    #[test]
    fn enforce_is_checked_before_any_data_moves() {
        use crate::round::{check_agreement, Shape};
        use crate::{Agreement, Error, Replicas};
        let enforce = |shape, n, f| check_agreement(Agreement::Enforce, shape, n, f);
        assert!(enforce(Shape::Gather, 4, 1).is_ok());
        assert!(enforce(Shape::Gather, 1024, 1).is_ok());
        assert!(matches!(
            enforce(Shape::Gather, 3, 1),
            Err(Error::InvalidUsage(_))
        ));
        assert!(matches!(
            enforce(Shape::Gather, 64, 4),
            Err(Error::Unsupported(_))
        ));
        // Sharded: one tree per owned shard (r = 2f + 1 of them), so the bound comes sooner.
        assert!(enforce(Shape::Sharded(Replicas::Tolerant), 7, 2).is_ok());
        assert!(enforce(Shape::Gather, 128, 2).is_ok());
        assert!(matches!(
            enforce(Shape::Sharded(Replicas::Tolerant), 128, 2),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            enforce(Shape::Sharded(Replicas::Exactly(1)), 3, 1),
            Err(Error::InvalidUsage(_))
        ));
        assert!(matches!(
            enforce(Shape::ReduceScatter(Replicas::Tolerant), 7, 2),
            Err(Error::Unsupported(_))
        ));
        assert!(check_agreement(Agreement::Detect, Shape::Gather, 3, 1).is_ok());
    }

    #[test]
    fn honest_senders_are_decided_as_they_sent() {
        let out = agree(&run(4, 1, &[]));
        assert_eq!(out, (1..=4).map(digest).collect::<Vec<_>>());
    }

    #[test]
    fn an_equivocating_sender_gets_one_value_everywhere() {
        // n = 4, f = 1: rank 3 sends rank 0 one vector and the others another, and relays
        // lies about what it got.
        let decisions = run(
            4,
            1,
            &[Liar {
                rank: 3,
                direct: |to| if to == 0 { digest(100) } else { digest(200) },
                relay: |to, m| {
                    m.iter_mut()
                        .skip(1)
                        .step_by(33)
                        .for_each(|b| *b ^= to as u8 + 1)
                },
            }],
        );
        let out = agree(&decisions);
        assert_eq!(out[..3], [digest(1), digest(2), digest(3)]);
        assert_eq!(out[3], digest(200), "the value most honest ranks got");
    }

    #[test]
    fn a_three_way_split_is_decided_none_everywhere() {
        // Rank 3 sends each honest rank another vector: no majority, every rank says none.
        let out = agree(&run(
            4,
            1,
            &[Liar {
                rank: 3,
                direct: |to| digest(50 + to as u8),
                relay: |_, _| {},
            }],
        ));
        assert_eq!(out[3], None);
        assert_eq!(out[..3], [digest(1), digest(2), digest(3)]);
    }

    #[test]
    fn two_liars_cannot_split_five_honest_ranks() {
        // n = 7, f = 2: two colluding ranks send selectively and relay to each receiver a
        // different story (flipped digests, dropped entries, malformed flags).
        for seed in 0u8..8 {
            let liar = |rank| Liar {
                rank,
                direct: |to| match to % 3 {
                    0 => digest(90),
                    1 => None,
                    _ => digest(91),
                },
                relay: |to, m| {
                    for (i, e) in m.chunks_exact_mut(33).enumerate() {
                        match (i + to) % 4 {
                            0 => e[0] = 0,
                            1 => e[1] ^= 0x55,
                            2 => e[0] = 1,
                            _ => {}
                        }
                    }
                    if to == 6 {
                        m[0] = 7; // malformed: counted as a message that did not arrive
                    }
                },
            };
            let (a, b) = (usize::from(seed % 7), usize::from((seed * 3 + 1) % 7));
            if a == b {
                continue;
            }
            let decisions = run(7, 2, &[liar(a), liar(b)]);
            let out = agree(&decisions);
            for (r, value) in out.iter().enumerate() {
                if r != a && r != b {
                    assert_eq!(
                        *value,
                        digest(r as u8 + 1),
                        "honest rank {r}, liars {a}, {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn reports_say_what_each_rank_got() {
        let mut trees: Vec<Eig> = (0..4)
            .map(|me| {
                Eig::new(
                    4,
                    1,
                    me,
                    (0..4).map(|j| digest((10 * me + j) as u8)).collect(),
                )
            })
            .collect();
        let sent: Vec<Bytes> = trees.iter().map(Eig::relay).collect();
        for (me, tree) in trees.iter_mut().enumerate() {
            let msgs: Vec<Option<&[u8]>> =
                (0..4).map(|k| (k != me).then(|| &sent[k][..])).collect();
            tree.receive(&msgs);
        }
        for k in 1..4 {
            for j in (0..4).filter(|&j| j != k) {
                assert_eq!(trees[0].reported(k, j), digest((10 * k + j) as u8));
            }
        }
        assert_eq!(trees[2].direct(1), digest(21));
    }
}
