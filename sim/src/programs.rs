//! The collectives as engine programs. Who sends what to whom comes from
//! `byzcoll_runtime::schedule`; what a rank does with what arrived follows
//! `byzcoll_runtime`'s driver (robust.rs, comm.rs): erasures, rank-order aggregation, empty
//! results of owners that cannot aggregate, the median of owner versions.

use byzcoll_aggregators::{AggError, Aggregator, Median};
use byzcoll_runtime::schedule::{self, chunk_range, sharded};
use byzcoll_runtime::{Error, Fault, PeerFault, Rank, Tag};

use crate::data::{ChunkId, Plane, ABSENT, EMPTY, NO_DATA};
use crate::engine::{Out, Posted, Program, Work};
use crate::faults::Adversary;

const F32: usize = std::mem::size_of::<f32>();

/// What every program shares: the world, the rule, the data plane (data mode only) and what
/// each rank ends with.
#[derive(Debug)]
pub(crate) struct Common<'a> {
    pub n: usize,
    pub d: usize,
    /// The robust rule; `None` in timing mode without a rule (no precondition is applied).
    pub rule: Option<&'a dyn Aggregator>,
    /// `None` in timing mode.
    pub plane: Option<Plane>,
    /// Peers each rank treated as erasures, first fault per peer.
    pub faults: Vec<Vec<PeerFault>>,
    /// Things each rank would log as warnings (an owned shard it could not aggregate).
    pub warnings: Vec<Vec<String>>,
    /// Each rank's result in data mode.
    pub outputs: Vec<Option<ChunkId>>,
}

impl<'a> Common<'a> {
    pub(crate) fn new(
        n: usize,
        d: usize,
        rule: Option<&'a dyn Aggregator>,
        plane: Option<Plane>,
    ) -> Self {
        Common {
            n,
            d,
            rule,
            plane,
            faults: vec![Vec::new(); n],
            warnings: vec![Vec::new(); n],
            outputs: vec![None; n],
        }
    }

    fn add_fault(&mut self, rank: Rank, fault: PeerFault) {
        let list = &mut self.faults[rank];
        if !list.iter().any(|f| f.rank == fault.rank) {
            list.push(fault);
        }
    }

    fn missing(&mut self, rank: Rank, peer: Rank) {
        self.add_fault(
            rank,
            PeerFault {
                rank: peer,
                fault: Fault::Missing,
            },
        );
    }

    fn input(&self, rank: Rank) -> ChunkId {
        self.plane.as_ref().map_or(NO_DATA, |p| p.inputs[rank])
    }
}

/// A receive slot's payload, `None` when it did not arrive.
fn arrived(slot: ChunkId) -> Option<ChunkId> {
    (slot != ABSENT).then_some(slot)
}

/// Maps input indices in an aggregator error to ranks (as the real driver does).
fn rank_error(e: AggError, ranks: &[Rank]) -> Error {
    match e {
        AggError::NonFiniteInputs { rule, inputs } => {
            Error::Aggregation(AggError::NonFiniteInputs {
                rule,
                inputs: inputs.into_iter().map(|i| ranks[i]).collect(),
            })
        }
        other => Error::Aggregation(other),
    }
}

/// Gather mode: every rank sends its whole vector to every other rank
/// ([`schedule::direct_peers`]) and aggregates what arrived, in rank order.
#[derive(Debug)]
pub(crate) struct Gather<'a> {
    pub common: Common<'a>,
}

impl Program for Gather<'_> {
    type Msg = ChunkId;
    const ABSENT: ChunkId = ABSENT;

    fn steps(&self) -> usize {
        1
    }

    fn post(&mut self, rank: Rank, _step: usize, sends: &mut Vec<Out<ChunkId>>) -> Posted {
        let n = self.common.n;
        let msg = self.common.input(rank);
        sends.extend(schedule::direct_peers(rank, n).map(|to| Out::new(to, 0, msg)));
        Posted {
            slots: n,
            expected: schedule::direct_peers(rank, n).count(),
        }
    }

    fn bytes(&self, _from: Rank, _step: usize, _tag: Tag, _msg: ChunkId) -> u64 {
        (self.common.d * F32) as u64
    }

    fn slot(&self, rank: Rank, _step: usize, from: Rank, tag: Tag) -> Option<usize> {
        // The peers of `schedule::direct_peers`: everyone else.
        (tag == 0 && from != rank && from < self.common.n).then_some(from)
    }

    fn complete(&mut self, rank: Rank, _step: usize, got: &[ChunkId]) -> Result<Work, Error> {
        let (n, d) = (self.common.n, self.common.d);
        for p in schedule::direct_peers(rank, n) {
            if got[p] == ABSENT {
                self.common.missing(rank, p);
            }
        }
        let own = self.common.input(rank);
        let (ranks, ids): (Vec<Rank>, Vec<ChunkId>) = (0..n)
            .filter_map(|p| {
                if p == rank {
                    Some(own)
                } else {
                    arrived(got[p])
                }
                .map(|id| (p, id))
            })
            .unzip();
        let work = Work {
            rule_bytes: (ranks.len() * d * F32) as f64,
            ..Work::default()
        };
        let Some(rule) = self.common.rule else {
            return Ok(work);
        };
        if let Err(source) = rule.check(ranks.len()) {
            return Err(Error::TooManyFaults {
                source,
                faults: self.common.faults[rank].clone(),
            });
        }
        if let Some(plane) = &mut self.common.plane {
            let out = plane
                .aggregate(rule, &ids, d)
                .map_err(|e| rank_error(e, &ranks))?;
            self.common.outputs[rank] = Some(out);
        }
        Ok(work)
    }
}

/// Sharded mode with `r` owners per shard ([`sharded`]): step 0 scatters shards to their
/// owners, owners aggregate, step 1 sends every owner's results to every rank, and each rank
/// takes the coordinate-wise median of the versions of each shard.
#[derive(Debug)]
pub(crate) struct Sharded<'a> {
    pub common: Common<'a>,
    pub r: usize,
    pub adversary: &'a Adversary,
    /// Id of the first of each rank's `n` shard views (data mode).
    pieces: Vec<ChunkId>,
    /// `results[rank * r + k]`: the rank's result for its `k`-th owned shard.
    results: Vec<ChunkId>,
    /// Same-to-everyone lies, made once per owned shard.
    lies: Vec<Option<ChunkId>>,
}

impl<'a> Sharded<'a> {
    pub(crate) fn new(common: Common<'a>, r: usize, adversary: &'a Adversary) -> Self {
        let n = common.n;
        Sharded {
            common,
            r,
            adversary,
            pieces: vec![NO_DATA; n],
            results: vec![EMPTY; n * r],
            lies: vec![None; n * r],
        }
    }

    fn shard_len(&self, s: usize) -> usize {
        chunk_range(self.common.d, self.common.n, s).len()
    }

    /// Position of shard `s` among the shards `rank` owns ([`sharded::owned`] lists
    /// `rank, rank-1, ...`), or `None` when `rank` does not own it. Also the position of `rank`
    /// among the owners of `s` ([`sharded::owners`] lists `s, s+1, ...`). Arithmetic instead of
    /// a scan: this runs once per simulated message.
    fn owned_index(&self, rank: Rank, s: usize) -> Option<usize> {
        let n = self.common.n;
        let k = if rank >= s { rank - s } else { rank + n - s };
        let owned = k < self.r;
        debug_assert_eq!(owned, sharded::owns(rank, s, n, self.r));
        debug_assert!(!owned || sharded::owned(rank, n, self.r).nth(k) == Some(s));
        debug_assert!(!owned || sharded::owners(s, n, self.r).nth(k) == Some(rank));
        owned.then_some(k)
    }

    /// What `rank` sends as its result for its `k`-th owned shard `s` to `dest`.
    fn result_for(&mut self, rank: Rank, k: usize, s: usize, dest: Rank) -> ChunkId {
        let honest = self.results[rank * self.r + k];
        let n = self.common.n;
        let Some(plane) = self.common.plane.as_mut() else {
            return honest;
        };
        if !self.adversary.lies_as_owner(rank, n) {
            return honest;
        }
        let lie = self.adversary.lie;
        let equivocates = lie == crate::Lie::Equivocate;
        if !equivocates {
            if let Some(id) = self.lies[rank * self.r + k] {
                return id;
            }
        }
        let len = chunk_range(self.common.d, n, s).len();
        let base = if honest == EMPTY {
            vec![0.0; len]
        } else {
            plane.store.get(honest).to_vec()
        };
        let id = plane.store.insert(lie.forge(&base, dest).into());
        if !equivocates {
            self.lies[rank * self.r + k] = Some(id);
        }
        id
    }

    fn scatter_done(&mut self, rank: Rank, got: &[ChunkId]) -> Work {
        let (n, r, d) = (self.common.n, self.r, self.common.d);
        for (p, s) in sharded::scatter_recvs(rank, n, r) {
            let k = self
                .owned_index(rank, s)
                .expect("scatter_recvs lists the shards this rank owns");
            if got[p * r + k] == ABSENT {
                self.common.missing(rank, p);
            }
        }
        let mut work = Work::default();
        let owned: Vec<usize> = sharded::owned(rank, n, r).collect();
        for (k, s) in owned.into_iter().enumerate() {
            let range = chunk_range(d, n, s);
            let own = match self.common.plane {
                Some(_) => self.pieces[rank] + s as ChunkId,
                None => NO_DATA,
            };
            let (ranks, ids): (Vec<Rank>, Vec<ChunkId>) = (0..n)
                .filter_map(|p| {
                    if p == rank {
                        Some(own)
                    } else {
                        arrived(got[p * r + k])
                    }
                    .map(|id| (p, id))
                })
                .unzip();
            work.rule_bytes += (ids.len() * range.len() * F32) as f64;
            let result = match self.common.rule {
                None => Ok(NO_DATA),
                Some(rule) => match rule.check(ids.len()) {
                    Err(e) => Err(Error::Aggregation(e)),
                    Ok(()) => match &mut self.common.plane {
                        None => Ok(NO_DATA),
                        Some(plane) => plane
                            .aggregate(rule, &ids, range.len())
                            .map_err(|e| rank_error(e, &ranks)),
                    },
                },
            };
            // Receivers count an empty result as an erasure of this owner's version.
            self.results[rank * r + k] = result.unwrap_or_else(|e| {
                self.common.warnings[rank].push(format!("cannot aggregate owned shard {s}: {e}"));
                EMPTY
            });
        }
        work
    }

    fn results_done(&mut self, rank: Rank, got: &[ChunkId]) -> Result<Work, Error> {
        let (n, r, d) = (self.common.n, self.r, self.common.d);
        for (o, s) in sharded::result_recvs(rank, n, r) {
            let k = self
                .owned_index(o, s)
                .expect("result_recvs lists owners of their shards");
            match arrived(got[o * r + k]) {
                None => self.common.missing(rank, o),
                Some(EMPTY) if self.shard_len(s) > 0 => self.common.add_fault(
                    rank,
                    PeerFault {
                        rank: o,
                        fault: Fault::Malformed(format!(
                            "empty result for shard {s}: the owner could not aggregate it"
                        )),
                    },
                ),
                Some(_) => {}
            }
        }
        let mut work = Work::default();
        let mut shard_results = Vec::with_capacity(n);
        for s in 0..n {
            let range = chunk_range(d, n, s);
            if range.is_empty() {
                continue;
            }
            let mut versions: Vec<(Rank, ChunkId)> = Vec::with_capacity(r);
            for (k, o) in sharded::owners(s, n, r).enumerate() {
                let id = if o == rank {
                    self.owned_index(rank, s)
                        .map(|j| self.results[rank * r + j])
                } else {
                    arrived(got[o * r + k])
                };
                if let Some(id) = id.filter(|&id| id != EMPTY) {
                    versions.push((o, id));
                }
            }
            if versions.is_empty() {
                return Err(Error::ShardLost {
                    shard: s,
                    owners: sharded::owners(s, n, r).collect(),
                    faults: self.common.faults[rank].clone(),
                });
            }
            versions.sort_by_key(|&(o, _)| o);
            let v = versions.len();
            if v > 1 {
                work.rule_bytes += (v * range.len() * F32) as f64;
            }
            if let Some(plane) = &mut self.common.plane {
                let ids: Vec<ChunkId> = versions.iter().map(|&(_, id)| id).collect();
                let median = Median::new((v - 1) / 2);
                let id = plane
                    .combine(&median, &ids, range.len())
                    .map_err(|e| match e {
                        AggError::NonFiniteResult { f, coordinate, .. } => {
                            Error::Aggregation(AggError::NonFiniteResult {
                                rule: format!("median of the {v} owner versions of shard {s}"),
                                f,
                                coordinate: range.start + coordinate,
                            })
                        }
                        other => Error::Aggregation(other),
                    })?;
                shard_results.push(id);
            }
        }
        if let Some(plane) = &mut self.common.plane {
            self.common.outputs[rank] = Some(plane.concat(&shard_results));
        }
        Ok(work)
    }
}

impl Program for Sharded<'_> {
    type Msg = ChunkId;
    const ABSENT: ChunkId = ABSENT;

    fn steps(&self) -> usize {
        2
    }

    fn post(&mut self, rank: Rank, step: usize, sends: &mut Vec<Out<ChunkId>>) -> Posted {
        let (n, r, d) = (self.common.n, self.r, self.common.d);
        if step == 0 {
            if let Some(plane) = &mut self.common.plane {
                let input = plane.inputs[rank];
                let first = plane.store.view(input, chunk_range(d, n, 0));
                for s in 1..n {
                    plane.store.view(input, chunk_range(d, n, s));
                }
                self.pieces[rank] = first;
            }
            let data = self.common.plane.is_some();
            let base = self.pieces[rank];
            sends.extend(
                sharded::scatter_sends(rank, n, r)
                    .into_iter()
                    .map(|(to, s)| {
                        let msg = if data { base + s as ChunkId } else { NO_DATA };
                        Out::new(to, s as Tag, msg)
                    }),
            );
            Posted {
                slots: r * n,
                expected: sharded::scatter_recvs(rank, n, r).len(),
            }
        } else {
            for (q, s) in sharded::result_sends(rank, n, r) {
                let k = self
                    .owned_index(rank, s)
                    .expect("result_sends lists the shards this rank owns");
                let msg = self.result_for(rank, k, s, q);
                sends.push(Out::new(q, s as Tag, msg));
            }
            Posted {
                slots: n * r,
                expected: sharded::result_recvs(rank, n, r).len(),
            }
        }
    }

    fn bytes(&self, _from: Rank, _step: usize, tag: Tag, msg: ChunkId) -> u64 {
        if msg == EMPTY {
            0
        } else {
            (self.shard_len(tag as usize) * F32) as u64
        }
    }

    fn slot(&self, rank: Rank, step: usize, from: Rank, tag: Tag) -> Option<usize> {
        let (n, r) = (self.common.n, self.r);
        let s = tag as usize;
        if from == rank || from >= n || s >= n {
            return None;
        }
        if step == 0 {
            self.owned_index(rank, s).map(|k| from * r + k)
        } else {
            self.owned_index(from, s).map(|k| from * r + k)
        }
    }

    fn complete(&mut self, rank: Rank, step: usize, got: &[ChunkId]) -> Result<Work, Error> {
        if step == 0 {
            Ok(self.scatter_done(rank, got))
        } else {
            self.results_done(rank, got)
        }
    }
}

/// Ring SUM all-reduce: `n - 1` reduce-scatter steps, then `n - 1` all-gather steps
/// ([`schedule::ring_reduce_scatter_step`], [`schedule::ring_all_gather_step`]). Not robust:
/// a missing chunk fails the rank, as in the real driver.
#[derive(Debug)]
pub(crate) struct Ring<'a> {
    pub common: Common<'a>,
    /// Each rank's working buffer (data mode).
    bufs: Vec<Vec<f32>>,
}

impl<'a> Ring<'a> {
    pub(crate) fn new(common: Common<'a>) -> Self {
        let bufs = match &common.plane {
            Some(plane) => plane
                .inputs
                .iter()
                .map(|&id| plane.store.get(id).to_vec())
                .collect(),
            None => Vec::new(),
        };
        Ring { common, bufs }
    }

    fn step(&self, rank: Rank, step: usize) -> (schedule::RingStep, bool) {
        let n = self.common.n;
        if step + 1 < n {
            (schedule::ring_reduce_scatter_step(rank, n, step), true)
        } else {
            (schedule::ring_all_gather_step(rank, n, step + 1 - n), false)
        }
    }

    /// The final buffers, stored, for ranks that completed.
    pub(crate) fn finish(&mut self) {
        if let Some(plane) = &mut self.common.plane {
            for (r, buf) in self.bufs.iter_mut().enumerate() {
                let done = std::mem::take(buf);
                self.common.outputs[r] = Some(plane.store.insert(done.into()));
            }
        }
    }
}

impl Program for Ring<'_> {
    type Msg = ChunkId;
    const ABSENT: ChunkId = ABSENT;

    fn steps(&self) -> usize {
        2 * self.common.n.saturating_sub(1)
    }

    fn post(&mut self, rank: Rank, step: usize, sends: &mut Vec<Out<ChunkId>>) -> Posted {
        let (st, _) = self.step(rank, step);
        let range = chunk_range(self.common.d, self.common.n, st.send_chunk);
        let msg = match &mut self.common.plane {
            Some(plane) => plane.store.insert(self.bufs[rank][range].into()),
            None => NO_DATA,
        };
        sends.push(Out::new(st.send_to, 0, msg));
        Posted {
            slots: 1,
            expected: 1,
        }
    }

    fn bytes(&self, from: Rank, step: usize, _tag: Tag, _msg: ChunkId) -> u64 {
        let (st, _) = self.step(from, step);
        (chunk_range(self.common.d, self.common.n, st.send_chunk).len() * F32) as u64
    }

    fn slot(&self, rank: Rank, step: usize, from: Rank, tag: Tag) -> Option<usize> {
        (tag == 0 && self.step(rank, step).0.recv_from == from).then_some(0)
    }

    fn complete(&mut self, rank: Rank, step: usize, got: &[ChunkId]) -> Result<Work, Error> {
        let (st, reduce) = self.step(rank, step);
        let Some(id) = arrived(got[0]) else {
            let fault = PeerFault {
                rank: st.recv_from,
                fault: Fault::Missing,
            };
            self.common.add_fault(rank, fault.clone());
            return Err(Error::PeerFaults {
                collective: "all_reduce",
                step: step as u32,
                faults: vec![fault],
            });
        };
        let range = chunk_range(self.common.d, self.common.n, st.recv_chunk);
        let work = Work {
            sum_bytes: if reduce {
                (2 * range.len() * F32) as f64
            } else {
                0.0
            },
            ..Work::default()
        };
        if let Some(plane) = &mut self.common.plane {
            let theirs = plane.store.get(id);
            let mine = &mut self.bufs[rank][range];
            if reduce {
                // As the real driver: through f64, rounded once (exact for f32 pairs).
                for (a, &b) in mine.iter_mut().zip(theirs) {
                    *a = (f64::from(*a) + f64::from(b)) as f32;
                }
            } else {
                mine.copy_from_slice(theirs);
            }
            plane.store.release(id);
        }
        Ok(work)
    }
}
