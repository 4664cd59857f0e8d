//! Collective schedules as pure rank arithmetic: who sends which block to whom at each step.
//!
//! Nothing here does I/O or reads a clock, so schedules are tested by executing them on
//! in-memory arrays for many world sizes, and the async driver in `Communicator`
//! only follows what these functions say.

use std::ops::Range;

use crate::Rank;

/// The `i`-th of `parts` near-equal contiguous pieces of `0..len`: the first `len % parts`
/// pieces are one element longer. Pieces may be empty when `len < parts`.
///
/// # Panics
/// If `parts == 0` or `i >= parts`.
pub fn chunk_range(len: usize, parts: usize, i: usize) -> Range<usize> {
    assert!(i < parts, "chunk {i} of {parts}");
    let base = len / parts;
    let extra = len % parts;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// Every rank other than `rank`, in increasing order: the peers of a direct (no relaying)
/// exchange such as gather-mode robust all-reduce.
pub fn direct_peers(rank: Rank, size: usize) -> impl Iterator<Item = Rank> {
    (0..size).filter(move |&p| p != rank)
}

/// One step of a ring: send chunk `send_chunk` to `send_to`, receive chunk `recv_chunk` from
/// `recv_from`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingStep {
    /// The next rank on the ring.
    pub send_to: Rank,
    /// Index of the chunk sent.
    pub send_chunk: usize,
    /// The previous rank on the ring.
    pub recv_from: Rank,
    /// Index of the chunk received.
    pub recv_chunk: usize,
}

/// Step `s` (`0..size-1`) of a ring reduce-scatter: the received chunk is combined into the
/// local one. After `size - 1` steps rank `r` holds the full reduction of chunk
/// [`ring_owned_chunk`]`(r, size)`.
pub fn ring_reduce_scatter_step(rank: Rank, size: usize, s: usize) -> RingStep {
    RingStep {
        send_to: (rank + 1) % size,
        send_chunk: (rank + size - s % size) % size,
        recv_from: (rank + size - 1) % size,
        recv_chunk: (rank + 2 * size - s % size - 1) % size,
    }
}

/// The chunk rank `rank` holds fully reduced after the reduce-scatter.
pub fn ring_owned_chunk(rank: Rank, size: usize) -> usize {
    (rank + 1) % size
}

/// Step `s` (`0..size-1`) of the ring all-gather that follows the reduce-scatter: the received
/// chunk replaces the local one.
pub fn ring_all_gather_step(rank: Rank, size: usize, s: usize) -> RingStep {
    RingStep {
        send_to: (rank + 1) % size,
        send_chunk: (rank + 1 + size - s % size) % size,
        recv_from: (rank + size - 1) % size,
        recv_chunk: (rank + size - s % size) % size,
    }
}

/// The sharded robust all-reduce with `r` replicated shard owners.
///
/// `d` coordinates are split into `n` shards ([`chunk_range`]`(d, n, s)`). Shard `s` is owned
/// by ranks `s, s+1, ..., s+r-1` (mod `n`). Phase 1: every rank sends shard `s` of its vector
/// straight to each owner of `s`. Phase 2: each owner aggregates the `n` versions of its shards.
/// Phase 3: every owner sends its result for `s` to every rank, and every rank takes the
/// coordinate-wise median of the `r` versions of each shard. Messages carry the shard index as
/// their tag. Per rank, phase 1 receives `r` shards from each peer and phase 3 at most `r`
/// versions of each shard: at most `2·r·d` elements instead of the `n·d` of gather mode (the
/// round sends versions by digest when `r > 1`, so that a rank without faults receives one
/// version of each shard: `(r + 1)·d`).
pub mod sharded {
    use crate::Rank;

    /// The owners of shard `s`: `s, s+1, ..., s+r-1` (mod `n`).
    pub fn owners(s: usize, n: usize, r: usize) -> impl Iterator<Item = Rank> {
        (0..r).map(move |k| (s + k) % n)
    }

    /// The shards `rank` owns: `rank, rank-1, ..., rank-r+1` (mod `n`), in that order.
    pub fn owned(rank: Rank, n: usize, r: usize) -> impl Iterator<Item = usize> {
        (0..r).map(move |k| (rank + n - k) % n)
    }

    /// Whether `rank` owns shard `s`.
    pub fn owns(rank: Rank, s: usize, n: usize, r: usize) -> bool {
        (rank + n - s) % n < r
    }

    /// Phase 1 sends of `rank`: `(owner, shard)` for every shard and every owner but itself.
    pub fn scatter_sends(rank: Rank, n: usize, r: usize) -> Vec<(Rank, usize)> {
        (0..n)
            .flat_map(|s| owners(s, n, r).map(move |o| (o, s)))
            .filter(|&(o, _)| o != rank)
            .collect()
    }

    /// Phase 1 receives of `rank`: `(peer, shard)` for every owned shard and every other rank.
    pub fn scatter_recvs(rank: Rank, n: usize, r: usize) -> Vec<(Rank, usize)> {
        owned(rank, n, r)
            .flat_map(|s| (0..n).filter(move |&p| p != rank).map(move |p| (p, s)))
            .collect()
    }

    /// Phase 3 sends of `rank`: `(peer, shard)` for every owned shard and every other rank.
    pub fn result_sends(rank: Rank, n: usize, r: usize) -> Vec<(Rank, usize)> {
        scatter_recvs(rank, n, r)
    }

    /// Phase 3 receives of `rank`: `(owner, shard)` for every shard and every owner but itself.
    pub fn result_recvs(rank: Rank, n: usize, r: usize) -> Vec<(Rank, usize)> {
        scatter_sends(rank, n, r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_partition_the_range() {
        for len in [0usize, 1, 2, 7, 8, 100, 101] {
            for parts in 1..=12 {
                let mut next = 0;
                for i in 0..parts {
                    let r = chunk_range(len, parts, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() == len / parts || r.len() == len / parts + 1);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    /// Executes the ring schedule on in-memory vectors, with every rank's step `s` send
    /// matched against its successor's step `s` receive.
    fn simulate_ring_sum(inputs: &[Vec<i64>]) -> Vec<Vec<i64>> {
        let n = inputs.len();
        let d = inputs[0].len();
        let mut bufs = inputs.to_vec();
        let chunk = |c: usize| chunk_range(d, n, c);
        for s in 0..n.saturating_sub(1) {
            let sent: Vec<Vec<i64>> = (0..n)
                .map(|r| {
                    let st = ring_reduce_scatter_step(r, n, s);
                    bufs[r][chunk(st.send_chunk)].to_vec()
                })
                .collect();
            for (r, buf) in bufs.iter_mut().enumerate() {
                let st = ring_reduce_scatter_step(r, n, s);
                let from = ring_reduce_scatter_step(st.recv_from, n, s);
                assert_eq!(from.send_to, r);
                assert_eq!(from.send_chunk, st.recv_chunk);
                for (x, y) in buf[chunk(st.recv_chunk)]
                    .iter_mut()
                    .zip(&sent[st.recv_from])
                {
                    *x += y;
                }
            }
        }
        for s in 0..n.saturating_sub(1) {
            let sent: Vec<Vec<i64>> = (0..n)
                .map(|r| {
                    let st = ring_all_gather_step(r, n, s);
                    bufs[r][chunk(st.send_chunk)].to_vec()
                })
                .collect();
            for (r, buf) in bufs.iter_mut().enumerate() {
                let st = ring_all_gather_step(r, n, s);
                let from = ring_all_gather_step(st.recv_from, n, s);
                assert_eq!((from.send_to, from.send_chunk), (r, st.recv_chunk));
                buf[chunk(st.recv_chunk)].copy_from_slice(&sent[st.recv_from]);
            }
        }
        bufs
    }

    #[test]
    fn ring_all_reduce_sums_at_every_world_size() {
        for n in 1..=12usize {
            for d in [0usize, 1, n.saturating_sub(1), n, 3 * n + 2, 64] {
                let inputs: Vec<Vec<i64>> = (0..n)
                    .map(|r| (0..d).map(|j| (r * 1000 + j) as i64).collect())
                    .collect();
                let want: Vec<i64> = (0..d).map(|j| inputs.iter().map(|x| x[j]).sum()).collect();
                for out in simulate_ring_sum(&inputs) {
                    assert_eq!(out, want, "n={n} d={d}");
                }
            }
        }
    }

    #[test]
    fn sharded_sends_and_receives_match_and_each_shard_has_r_owners() {
        for n in [1usize, 2, 3, 7, 8, 11] {
            for r in 1..=n {
                let mut sent: Vec<(usize, usize, usize)> = Vec::new();
                let mut expected: Vec<(usize, usize, usize)> = Vec::new();
                for p in 0..n {
                    sent.extend(
                        sharded::scatter_sends(p, n, r)
                            .into_iter()
                            .map(|(o, s)| (p, o, s)),
                    );
                    expected.extend(
                        sharded::scatter_recvs(p, n, r)
                            .into_iter()
                            .map(|(q, s)| (q, p, s)),
                    );
                    assert_eq!(sharded::owned(p, n, r).count(), r);
                    for s in sharded::owned(p, n, r) {
                        assert!(sharded::owns(p, s, n, r));
                        assert!(sharded::owners(s, n, r).any(|o| o == p));
                    }
                }
                sent.sort_unstable();
                expected.sort_unstable();
                assert_eq!(sent, expected, "n={n} r={r}");
                for s in 0..n {
                    let mut o: Vec<usize> = sharded::owners(s, n, r).collect();
                    o.sort_unstable();
                    o.dedup();
                    assert_eq!(o.len(), r);
                    assert_eq!((0..n).filter(|&p| sharded::owns(p, s, n, r)).count(), r);
                }
            }
        }
    }

    #[test]
    fn first_all_gather_step_sends_the_owned_chunk() {
        for n in 1..=9 {
            for r in 0..n {
                assert_eq!(
                    ring_all_gather_step(r, n, 0).send_chunk,
                    ring_owned_chunk(r, n)
                );
                assert_eq!(
                    ring_reduce_scatter_step(r, n, n.saturating_sub(2)).recv_chunk,
                    ring_owned_chunk(r, n)
                );
            }
        }
    }
}
