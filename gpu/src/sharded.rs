//! Where the pieces of a sharded robust all-reduce live when the vectors stay on the device
//! (pure: no CUDA calls, so it is tested on any machine).
//!
//! The schedule is the runtime's ([`byzcoll_runtime::schedule::sharded`]): shard `s` of
//! [`chunk_range`]`(d, n, s)` coordinates is owned by ranks `s, …, s+r-1` (mod `n`); phase 1
//! sends each shard to its owners, the owners aggregate, phase 3 sends each owner's result to
//! every rank, and every rank takes the coordinate-wise median of the `r` versions. Messages
//! carry the shard as their tag. Empty shards (`d < n`) are left out of every phase on every
//! rank alike, so nothing is sent for them and the pairwise order of messages still agrees.
//!
//! [`ShardLayout`] says, for one rank, which element ranges of its vector go where and where
//! each input of an owned shard and each version of a result comes from: its own vector, its
//! own results, or the `k`-th receive of a phase.

use std::ops::Range;

use byzcoll_runtime::schedule::{chunk_range, sharded};
use byzcoll_runtime::Rank;

/// One message of a phase: shard `shard` to or from `peer` (its tag is the shard).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    /// The other rank.
    pub peer: Rank,
    /// The shard, also the message's tag.
    pub shard: usize,
}

/// Where a shard's input or version is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// This element range of this rank's own vector.
    Mine(Range<usize>),
    /// This rank's own result for the `i`-th owned shard ([`ShardLayout::owned`]).
    Owned(usize),
    /// The `k`-th receive of the phase.
    Received(usize),
}

/// One rank's view of the sharded schedule over `d` coordinates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLayout {
    me: Rank,
    n: usize,
    r: usize,
    d: usize,
}

impl ShardLayout {
    /// Rank `me` of `n`, `r` owners per shard, vectors of `d` elements.
    ///
    /// # Panics
    /// Unless `me < n` and `1 <= r <= n` (callers check the replica count first).
    pub fn new(me: Rank, n: usize, r: usize, d: usize) -> Self {
        assert!(
            me < n && (1..=n).contains(&r),
            "rank {me}, r = {r}, n = {n}"
        );
        ShardLayout { me, n, r, d }
    }

    /// The world size: ranks, shards, and inputs of each shard.
    pub fn size(&self) -> usize {
        self.n
    }

    /// Owners per shard.
    pub fn replicas(&self) -> usize {
        self.r
    }

    /// The element range of shard `s`.
    pub fn shard(&self, s: usize) -> Range<usize> {
        chunk_range(self.d, self.n, s)
    }

    /// The shards that hold at least one element, in order.
    pub fn shards(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.n).filter(move |&s| !self.shard(s).is_empty())
    }

    fn live(&self, t: &[(Rank, usize)]) -> Vec<Transfer> {
        t.iter()
            .filter(|&&(_, s)| !self.shard(s).is_empty())
            .map(|&(peer, shard)| Transfer { peer, shard })
            .collect()
    }

    /// The non-empty shards this rank owns, in the schedule's order; results are indexed by
    /// position in this list ([`Source::Owned`]).
    pub fn owned(&self) -> Vec<usize> {
        sharded::owned(self.me, self.n, self.r)
            .filter(|&s| !self.shard(s).is_empty())
            .collect()
    }

    /// Phase 1 sends: [`ShardLayout::shard`]`(t.shard)` of this rank's vector to `t.peer`.
    pub fn scatter_sends(&self) -> Vec<Transfer> {
        self.live(&sharded::scatter_sends(self.me, self.n, self.r))
    }

    /// Phase 1 receives: the peer's piece of an owned shard.
    pub fn scatter_recvs(&self) -> Vec<Transfer> {
        self.live(&sharded::scatter_recvs(self.me, self.n, self.r))
    }

    /// The `n` inputs of owned shard `s`, in rank order, after phase 1.
    ///
    /// # Panics
    /// If this rank does not own `s` or `s` is empty.
    pub fn inputs(&self, s: usize) -> Vec<Source> {
        assert!(
            sharded::owns(self.me, s, self.n, self.r) && !self.shard(s).is_empty(),
            "rank {} does not own a non-empty shard {s}",
            self.me
        );
        let recvs = self.scatter_recvs();
        (0..self.n)
            .map(|p| match p == self.me {
                true => Source::Mine(self.shard(s)),
                false => Source::Received(position(&recvs, p, s)),
            })
            .collect()
    }

    /// Phase 3 sends (and the statistic round's): this rank's result for `t.shard` to `t.peer`.
    pub fn result_sends(&self) -> Vec<Transfer> {
        self.live(&sharded::result_sends(self.me, self.n, self.r))
    }

    /// Phase 3 receives (and the statistic round's): an owner's version of a shard.
    pub fn result_recvs(&self) -> Vec<Transfer> {
        self.live(&sharded::result_recvs(self.me, self.n, self.r))
    }

    /// The `r` versions of non-empty shard `s` after phase 3, in owner rank order (the order
    /// the host schedule combines them in).
    pub fn versions(&self, s: usize) -> Vec<Source> {
        let recvs = self.result_recvs();
        let owned = self.owned();
        let mut owners: Vec<Rank> = sharded::owners(s, self.n, self.r).collect();
        owners.sort_unstable();
        owners
            .into_iter()
            .map(|o| match o == self.me {
                true => Source::Owned(owned.iter().position(|&t| t == s).unwrap_or_else(|| {
                    unreachable!("rank {o} owns shard {s} but does not list it")
                })),
                false => Source::Received(position(&recvs, o, s)),
            })
            .collect()
    }
}

/// The index of the transfer `(peer, shard)` in `list`.
fn position(list: &[Transfer], peer: Rank, shard: usize) -> usize {
    list.iter()
        .position(|t| *t == Transfer { peer, shard })
        .unwrap_or_else(|| {
            unreachable!("the schedule has no transfer of shard {shard} with {peer}")
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use byzcoll_aggregators::{aggregate_into, Median, TrimmedMean};

    /// The `k`-th message between `from` and `to` in tag order, as NCCL matches them.
    fn pair_order(list: &[Transfer], peer: Rank) -> Vec<usize> {
        let mut shards: Vec<usize> = list
            .iter()
            .filter(|t| t.peer == peer)
            .map(|t| t.shard)
            .collect();
        shards.sort_unstable();
        shards
    }

    fn element(rank: usize, j: usize) -> f32 {
        // Distinct, unordered values with ties across ranks at some coordinates.
        ((rank * 7919 + j * 104_729) % 1009) as f32 * 0.25 - (j % 3) as f32
    }

    /// Runs the layout for every rank on host vectors, with the messages moved between ranks
    /// exactly as the layout's sends and receives say, and returns every rank's result.
    fn simulate(
        n: usize,
        r: usize,
        d: usize,
        rule: &dyn byzcoll_aggregators::Aggregator,
    ) -> Vec<Vec<f32>> {
        let layouts: Vec<ShardLayout> = (0..n).map(|me| ShardLayout::new(me, n, r, d)).collect();
        let vectors: Vec<Vec<f32>> = (0..n)
            .map(|p| (0..d).map(|j| element(p, j)).collect())
            .collect();
        // Pairwise, sends and receives agree in count, shards and order.
        for a in 0..n {
            for b in (0..n).filter(|&b| b != a) {
                assert_eq!(
                    pair_order(&layouts[a].scatter_sends(), b),
                    pair_order(&layouts[b].scatter_recvs(), a)
                );
                assert_eq!(
                    pair_order(&layouts[a].result_sends(), b),
                    pair_order(&layouts[b].result_recvs(), a)
                );
            }
        }
        // Phase 1: each receive gets the sender's piece.
        let received: Vec<Vec<Vec<f32>>> = layouts
            .iter()
            .enumerate()
            .map(|(me, l)| {
                l.scatter_recvs()
                    .iter()
                    .map(|t| {
                        assert!(layouts[t.peer].scatter_sends().contains(&Transfer {
                            peer: me,
                            shard: t.shard
                        }));
                        vectors[t.peer][l.shard(t.shard)].to_vec()
                    })
                    .collect()
            })
            .collect();
        // Phase 2: owners aggregate their shards' inputs.
        let results: Vec<Vec<Vec<f32>>> = layouts
            .iter()
            .enumerate()
            .map(|(me, l)| {
                l.owned()
                    .iter()
                    .map(|&s| {
                        let inputs: Vec<&[f32]> = l
                            .inputs(s)
                            .iter()
                            .map(|src| match src {
                                Source::Mine(range) => &vectors[me][range.clone()],
                                Source::Received(k) => &received[me][*k],
                                Source::Owned(_) => panic!("an input from a result"),
                            })
                            .collect();
                        let mut out = vec![0.0; l.shard(s).len()];
                        aggregate_into(rule, &inputs, &mut out).expect("owner aggregates");
                        out
                    })
                    .collect()
            })
            .collect();
        // Phase 3 and the combination.
        layouts
            .iter()
            .enumerate()
            .map(|(me, l)| {
                let versions: Vec<Vec<f32>> = l
                    .result_recvs()
                    .iter()
                    .map(|t| {
                        let sender = &layouts[t.peer];
                        assert!(sender.result_sends().contains(&Transfer {
                            peer: me,
                            shard: t.shard
                        }));
                        let i = sender.owned().iter().position(|&s| s == t.shard);
                        results[t.peer][i.expect("the sender owns the shard")].clone()
                    })
                    .collect();
                let mut out = vec![f32::NAN; d];
                for s in l.shards() {
                    let sources = l.versions(s);
                    assert_eq!(sources.len(), r);
                    let refs: Vec<&[f32]> = sources
                        .iter()
                        .map(|src| match src {
                            Source::Owned(i) => results[me][*i].as_slice(),
                            Source::Received(k) => versions[*k].as_slice(),
                            Source::Mine(_) => panic!("a version from the input"),
                        })
                        .collect();
                    aggregate_into(&Median::new((r - 1) / 2), &refs, &mut out[l.shard(s)])
                        .expect("median of versions");
                }
                out
            })
            .collect()
    }

    #[test]
    fn every_rank_gets_the_gather_result_at_every_shape() {
        for n in 1..=9usize {
            for r in 1..=n {
                for d in [0usize, 1, n.saturating_sub(1), n, 3 * n + 2, 61] {
                    let f = (n - 1) / 2;
                    let rules: [&dyn byzcoll_aggregators::Aggregator; 2] =
                        [&Median::new(f), &TrimmedMean::new((n - 1) / 4)];
                    for rule in rules {
                        let vectors: Vec<Vec<f32>> = (0..n)
                            .map(|p| (0..d).map(|j| element(p, j)).collect())
                            .collect();
                        let refs: Vec<&[f32]> = vectors.iter().map(Vec::as_slice).collect();
                        let mut want = vec![0.0f32; d];
                        aggregate_into(rule, &refs, &mut want).expect("gather");
                        for (me, got) in simulate(n, r, d, rule).into_iter().enumerate() {
                            assert_eq!(got, want, "{} n={n} r={r} d={d} rank {me}", rule.name());
                        }
                    }
                }
            }
        }
    }

    /// Every input of an owned shard comes from its own rank, and every version from its own
    /// owner, in rank order (the gather test cannot tell: order-free rules, equal versions).
    #[test]
    fn inputs_and_versions_come_from_the_ranks_they_stand_for() {
        for n in 1..=9usize {
            for r in 1..=n {
                for d in [n.saturating_sub(2), 3 * n + 1] {
                    for me in 0..n {
                        let l = ShardLayout::new(me, n, r, d);
                        let (scatter, results) = (l.scatter_recvs(), l.result_recvs());
                        let owned = l.owned();
                        for &s in &owned {
                            for (p, src) in l.inputs(s).into_iter().enumerate() {
                                match src {
                                    Source::Mine(range) => {
                                        assert_eq!((p, range), (me, l.shard(s)));
                                    }
                                    Source::Received(k) => {
                                        assert_eq!(scatter[k], Transfer { peer: p, shard: s });
                                    }
                                    Source::Owned(_) => panic!("an input from a result"),
                                }
                            }
                        }
                        for s in l.shards() {
                            let mut owners: Vec<Rank> = sharded::owners(s, n, r).collect();
                            owners.sort_unstable();
                            for (o, src) in owners.into_iter().zip(l.versions(s)) {
                                match src {
                                    Source::Owned(i) => assert_eq!((o, owned[i]), (me, s)),
                                    Source::Received(k) => {
                                        assert_eq!(results[k], Transfer { peer: o, shard: s });
                                    }
                                    Source::Mine(_) => panic!("a version from the input"),
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn empty_shards_are_never_sent() {
        let l = ShardLayout::new(1, 8, 3, 5);
        let empty: Vec<usize> = (0..8).filter(|&s| l.shard(s).is_empty()).collect();
        assert_eq!(empty, vec![5, 6, 7]);
        for t in [
            l.scatter_sends(),
            l.scatter_recvs(),
            l.result_sends(),
            l.result_recvs(),
        ]
        .concat()
        {
            assert!(!empty.contains(&t.shard), "{t:?}");
        }
        assert_eq!(l.owned(), vec![1, 0]);
        assert_eq!(l.shards().collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn versions_come_in_owner_order() {
        // n = 5, r = 3: shard 4 is owned by 4, 0, 1; rank 0's own version comes first.
        let l = ShardLayout::new(0, 5, 3, 50);
        let v = l.versions(4);
        let recvs = l.result_recvs();
        let owned = l.owned();
        assert_eq!(
            v,
            vec![
                Source::Owned(owned.iter().position(|&s| s == 4).expect("owned")),
                Source::Received(position(&recvs, 1, 4)),
                Source::Received(position(&recvs, 4, 4)),
            ]
        );
    }
}
