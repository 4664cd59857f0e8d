//! The collectives as engine programs. Who sends what to whom comes from
//! `byzcoll_proto::schedule`; what a rank does with what arrived follows
//! the runtime's driver of the same collectives: erasures, rank-order aggregation, empty
//! results of owners that cannot aggregate, the median of owner versions.

use std::sync::Arc;

use byzcoll_proto::schedule::{self, chunk_range};
use byzcoll_proto::{Error, Fault, PeerFault, Rank, Tag};

use crate::data::{round_to, ChunkId, Plane, ABSENT, NO_DATA};
use crate::engine::{Cut, Out, Posted, Program, Work};

/// What every program shares: the world, the rule, the data plane (data mode only) and what
/// each rank ends with.
#[derive(Debug)]
pub(crate) struct Common {
    pub n: usize,
    pub d: usize,
    /// Bytes per element ([`crate::Scenario::dtype`]).
    pub elem: usize,
    /// `None` in timing mode.
    pub plane: Option<Plane>,
    /// Peers each rank treated as erasures, first fault per peer.
    pub faults: Vec<Vec<PeerFault>>,
    /// Things each rank would log as warnings (an owned shard it could not aggregate).
    pub warnings: Vec<Vec<String>>,
    /// Each rank's result in data mode.
    pub outputs: Vec<Option<ChunkId>>,
}

impl Common {
    pub(crate) fn new(n: usize, d: usize, elem: usize, plane: Option<Plane>) -> Self {
        Common {
            n,
            d,
            elem,
            plane,
            faults: vec![Vec::new(); n],
            warnings: vec![Vec::new(); n],
            outputs: vec![None; n],
        }
    }

    pub(crate) fn add_fault(&mut self, rank: Rank, fault: PeerFault) {
        let list = &mut self.faults[rank];
        if !list.iter().any(|f| f.rank == fault.rank) {
            list.push(fault);
        }
    }

    pub(crate) fn input(&self, rank: Rank) -> ChunkId {
        self.plane.as_ref().map_or(NO_DATA, |p| p.inputs[rank])
    }
}

/// A receive slot's payload, `None` when it did not arrive.
fn arrived(slot: ChunkId) -> Option<ChunkId> {
    (slot != ABSENT).then_some(slot)
}

/// Ring SUM all-reduce: `n - 1` reduce-scatter steps, then `n - 1` all-gather steps
/// ([`schedule::ring_reduce_scatter_step`], [`schedule::ring_all_gather_step`]). Not robust:
/// a missing chunk fails the rank, as in the real driver.
#[derive(Debug)]
pub(crate) struct Ring {
    pub common: Common,
    /// Each rank's working buffer (data mode), unique until [`Ring::finish`] stores it.
    bufs: Vec<Arc<[f32]>>,
}

impl Ring {
    pub(crate) fn new(common: Common) -> Self {
        let bufs = match &common.plane {
            Some(plane) => plane
                .inputs
                .iter()
                .map(|&id| Arc::from(plane.store.get(id)))
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
            for (r, buf) in std::mem::take(&mut self.bufs).into_iter().enumerate() {
                self.common.outputs[r] = Some(plane.store.insert(buf));
            }
        }
    }
}

impl Program for Ring {
    type Msg = ChunkId;
    const ABSENT: ChunkId = ABSENT;

    fn finished(&self, _rank: Rank, step: usize) -> bool {
        step >= 2 * self.common.n.saturating_sub(1)
    }

    fn post(&mut self, rank: Rank, step: usize, sends: &mut Vec<Out<ChunkId>>) -> Posted {
        let (st, _) = self.step(rank, step);
        let range = chunk_range(self.common.d, self.common.n, st.send_chunk);
        let msg = match &mut self.common.plane {
            Some(plane) => plane.store.insert(self.bufs[rank][range].into()),
            None => NO_DATA,
        };
        sends.push(Out::new(st.send_to, 0, msg));
        Posted::new(1, 1)
    }

    fn bytes(&self, from: Rank, step: usize, _tag: Tag, _msg: ChunkId) -> u64 {
        let (st, _) = self.step(from, step);
        (chunk_range(self.common.d, self.common.n, st.send_chunk).len() * self.common.elem) as u64
    }

    fn slot(&self, rank: Rank, step: usize, from: Rank, tag: Tag) -> Option<usize> {
        (tag == 0 && self.step(rank, step).0.recv_from == from).then_some(0)
    }

    fn complete(
        &mut self,
        rank: Rank,
        step: usize,
        got: &[ChunkId],
        _cut: Cut,
    ) -> Result<Work, Error> {
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
                (2 * range.len() * self.common.elem) as f64
            } else {
                0.0
            },
            ..Work::default()
        };
        if let Some(plane) = &mut self.common.plane {
            let theirs = plane.store.get(id);
            let mine = &mut Arc::make_mut(&mut self.bufs[rank])[range];
            if reduce {
                // As the real driver: through f64, rounded once to the element type (exact
                // for f32 pairs).
                let dtype = plane.store.dtype();
                for (a, &b) in mine.iter_mut().zip(theirs) {
                    *a = round_to(dtype, f64::from(*a) + f64::from(b));
                }
            } else {
                mine.copy_from_slice(theirs);
            }
            plane.store.release(id);
        }
        Ok(work)
    }
}
