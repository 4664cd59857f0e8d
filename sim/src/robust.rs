//! The robust collectives in the simulator: every rank runs the runtime's own sans-IO round
//! ([`byzcoll_proto::round::Round`]), the same state machine the `Communicator` drives over
//! a transport, here under virtual time on the simulator's shared store.

use std::collections::HashMap;
use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;
use byzcoll_aggregators::{
    AggError, AggReport, Aggregator, DType, DistanceMixing, DistanceSelection, Median,
};
use byzcoll_proto::round::{
    Arrival, Carry, Dest, Digest, Msg, Plane as RoundPlane, Round, Spec, Src,
};
use byzcoll_proto::schedule::chunk_range;
use byzcoll_proto::{Error, Rank, RoundReport, Tag};

use crate::data::{
    aggregate_as, as_dtype, mix_as, round_to, ChunkId, Plane, ABSENT, EMPTY, NO_DATA,
};
use crate::engine::{Cut, Out, Posted, Program, Work};
use crate::faults::Adversary;
use crate::programs::Common;

/// A simulated message: a chunk of the store (or a blob the round made: statistics, the
/// cross-check) and its size on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SimMsg {
    id: u32,
    bytes: u64,
}

/// Ids at and above this are blobs (`id - BLOB` indexes [`Robust::blobs`]).
const BLOB: u32 = 1 << 31;

/// Every rank's robust round as an engine program.
pub(crate) struct Robust<'a> {
    pub common: Common,
    adversary: &'a Adversary,
    rounds: Vec<Option<Round<'a, SimMsg>>>,
    /// Per rank, the posted step's receives sorted by `(from, tag)`, with their slot.
    slots: Vec<Vec<(u32, Tag, u32)>>,
    /// Per rank, the posted step's expected lengths, by slot.
    lens: Vec<Vec<u64>>,
    /// Per rank: its results by owned shard, estimates, combined shards in shard order.
    ranks: Vec<RankData>,
    blobs: Vec<Bytes>,
    interned: HashMap<Bytes, usize>,
    /// The last blob made, by address (valid while the step that sent it is being posted).
    last_blob: Option<(usize, usize, SimMsg)>,
    digests: HashMap<u32, Digest>,
    finite: HashMap<u32, bool>,
    /// Same-to-everyone lies, made once per (owner, shard).
    lies: HashMap<(Rank, usize), ChunkId>,
    /// Equivocated inputs by (rank, equivocation key, range start, length): destinations with
    /// the same key (all but a victim) share one forged vector.
    forgeries: HashMap<(Rank, Rank, usize, usize), ChunkId>,
    /// Per rank, the reports of rounds that ended well.
    pub reports: Vec<Option<RoundReport>>,
}

#[derive(Debug, Default)]
struct RankData {
    /// Id of the first of the rank's `n` shard views (data mode; shard `s` is `+ s`).
    pieces: ChunkId,
    results: Vec<ChunkId>,
    estimates: Vec<Vec<f64>>,
    combined: Vec<ChunkId>,
    /// The shard each of `combined` is.
    combined_shards: Vec<usize>,
    output: Option<ChunkId>,
}

impl RankData {
    /// The combined shards in shard order (a taker combines the shards whose version it had
    /// to ask for after the others), taken.
    fn take_combined(&mut self) -> Vec<ChunkId> {
        let mut by_shard: Vec<(usize, ChunkId)> = std::mem::take(&mut self.combined_shards)
            .into_iter()
            .zip(std::mem::take(&mut self.combined))
            .collect();
        by_shard.sort_unstable_by_key(|&(s, _)| s);
        by_shard.into_iter().map(|(_, id)| id).collect()
    }
}

impl std::fmt::Debug for Robust<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Robust")
            .field("n", &self.common.n)
            .finish_non_exhaustive()
    }
}

impl<'a> Robust<'a> {
    /// Every rank's round of `rule` as `spec(rank)` says, rank `r` waiting for the peers of
    /// `laggards[r]` only up to a quorum (its fault memory, as the host communicator's).
    pub(crate) fn new(
        common: Common,
        rule: &'a dyn Aggregator,
        adversary: &'a Adversary,
        spec: impl Fn(Rank) -> Spec,
        laggards: &[Vec<Rank>],
    ) -> Self {
        let n = common.n;
        let round = |r: Rank| match laggards.get(r).filter(|l| !l.is_empty()) {
            Some(l) => Round::resuming(
                spec(r),
                rule,
                &Carry {
                    laggards: l.clone(),
                    ..Carry::default()
                },
            ),
            None => Round::new(spec(r), rule),
        };
        Robust {
            rounds: (0..n).map(|r| Some(round(r))).collect(),
            slots: vec![Vec::new(); n],
            lens: vec![Vec::new(); n],
            ranks: (0..n).map(|_| RankData::default()).collect(),
            blobs: Vec::new(),
            interned: HashMap::new(),
            last_blob: None,
            digests: HashMap::new(),
            finite: HashMap::new(),
            lies: HashMap::new(),
            forgeries: HashMap::new(),
            reports: (0..n).map(|_| None).collect(),
            common,
            adversary,
        }
    }

    /// A blob for `b`, interned by content: a round's statistics and cross-checks go to
    /// every peer, and ranks that agree send the same bytes.
    fn blob(&mut self, b: &Bytes) -> SimMsg {
        // A step sends one `Bytes` to every peer: hash it once.
        if let Some((ptr, len, msg)) = self.last_blob {
            if ptr == b.as_ptr() as usize && len == b.len() {
                return msg;
            }
        }
        let msg = self.intern(b);
        self.last_blob = Some((b.as_ptr() as usize, b.len(), msg));
        msg
    }

    /// A blob for `b`, interned by content (no cache by address: for bytes made here and
    /// dropped, whose address the next ones may take).
    fn intern(&mut self, b: &Bytes) -> SimMsg {
        let next = self.blobs.len();
        let i = *self.interned.entry(b.clone()).or_insert(next);
        if i == next {
            self.blobs.push(b.clone());
        }
        SimMsg {
            id: BLOB + i as u32,
            bytes: b.len() as u64,
        }
    }

    /// What `rank` sends as `msg` to `dest`, forged where the adversary says so.
    fn message(&mut self, rank: Rank, msg: &Msg, dest: Rank) -> SimMsg {
        let (n, d, elem) = (self.common.n, self.common.d, self.common.elem);
        let chunk = |id: ChunkId, len: usize| SimMsg {
            id,
            bytes: (len * elem) as u64,
        };
        match msg {
            Msg::Input | Msg::Piece(_) => {
                let range = match msg {
                    Msg::Piece(s) => chunk_range(d, n, *s),
                    _ => 0..d,
                };
                let len = range.len();
                let Some(plane) = self.common.plane.as_mut() else {
                    return chunk(NO_DATA, len);
                };
                if self.adversary.equivocates_inputs(rank, n) {
                    // A different vector to every destination (or to the victim only).
                    let key = self.adversary.equivocation_key(dest);
                    let at = (rank, key, range.start, len);
                    if let Some(&id) = self.forgeries.get(&at) {
                        return chunk(id, len);
                    }
                    let honest = &plane.store.get(plane.inputs[rank])[range];
                    let forged = crate::Lie::Equivocate.forge(honest, key);
                    let id = plane.store.insert(forged.into());
                    self.forgeries.insert(at, id);
                    return chunk(id, len);
                }
                let id = match msg {
                    Msg::Piece(s) => self.ranks[rank].pieces + *s as ChunkId,
                    _ => plane.inputs[rank],
                };
                chunk(id, len)
            }
            Msg::Result(s) => {
                let len = chunk_range(d, n, *s).len();
                let i = (rank + n - s) % n;
                let honest = self.ranks[rank].results.get(i).copied().unwrap_or(EMPTY);
                let Some(plane) = self.common.plane.as_mut() else {
                    return chunk(NO_DATA, len);
                };
                if !self.adversary.lies_as_owner(rank, n) {
                    return chunk(honest, len);
                }
                let lie = self.adversary.lie;
                let equivocates = lie == crate::Lie::Equivocate;
                if !equivocates {
                    if let Some(&id) = self.lies.get(&(rank, *s)) {
                        return chunk(id, len);
                    }
                }
                let base = if honest == EMPTY {
                    vec![0.0; len]
                } else {
                    plane.store.get(honest).to_vec()
                };
                let id = plane.store.insert(lie.forge(&base, dest).into());
                if !equivocates {
                    self.lies.insert((rank, *s), id);
                }
                chunk(id, len)
            }
            Msg::Empty => SimMsg {
                id: EMPTY,
                bytes: 0,
            },
            Msg::Bytes(b) => {
                let b = b.clone();
                self.blob(&b)
            }
            Msg::ResultDigest(s) => {
                // The digest of the version this owner would send `dest` (a liar's included),
                // as the receiver's plane makes it ([`SimPlane::commitment`]).
                let version = self.message(rank, &Msg::Result(*s), dest);
                let digest = match self.common.plane.as_ref() {
                    Some(plane) if version.id != EMPTY && version.id != NO_DATA => {
                        byzcoll_proto::round::input_digest(plane.store.get(version.id))
                    }
                    _ => [0; 32],
                };
                self.intern(&Bytes::copy_from_slice(&digest))
            }
            _ => SimMsg {
                id: EMPTY,
                bytes: 0,
            },
        }
    }
}

impl Program for Robust<'_> {
    type Msg = SimMsg;
    const ABSENT: SimMsg = SimMsg {
        id: ABSENT,
        bytes: 0,
    };

    fn finished(&self, rank: Rank, _step: usize) -> bool {
        self.rounds[rank]
            .as_ref()
            .is_none_or(|r| r.step().is_none())
    }

    fn post(&mut self, rank: Rank, step: usize, sends: &mut Vec<Out<SimMsg>>) -> Posted {
        let (n, d) = (self.common.n, self.common.d);
        if step == 0 {
            if let Some(plane) = &mut self.common.plane {
                let input = plane.inputs[rank];
                let first = plane.store.view(input, chunk_range(d, n, 0));
                for s in 1..n {
                    plane.store.view(input, chunk_range(d, n, s));
                }
                self.ranks[rank].pieces = first;
            }
        }
        let plan = self.rounds[rank]
            .as_ref()
            .and_then(|r| r.step())
            .cloned()
            .expect("the engine posts only unfinished ranks");
        self.last_blob = None;
        for send in &plan.sends {
            let msg = match send.msg {
                Msg::Forward(j) => *self.rounds[rank]
                    .as_ref()
                    .and_then(|r| r.held(j))
                    .expect("the round holds what it forwards"),
                ref msg => self.message(rank, msg, send.peer),
            };
            sends.push(Out::new(send.peer, send.tag, msg));
        }
        // `plan` (and the bytes the cache points at) is dropped after this.
        self.last_blob = None;
        let mut slots: Vec<(u32, Tag, u32)> = plan
            .recvs
            .iter()
            .enumerate()
            .map(|(i, op)| (op.peer as u32, op.tag, i as u32))
            .collect();
        slots.sort_unstable();
        self.slots[rank] = slots;
        self.lens[rank] = plan.recvs.iter().map(|op| op.len as u64).collect();
        let mut posted = Posted::new(plan.recvs.len(), plan.recvs.len());
        // In virtual seconds, as the spec's timeout is (none where that is infinite).
        posted.seconds = (plan.timeout != Duration::MAX).then_some(plan.timeout.as_secs_f64());
        posted.quorum = plan.quorum;
        posted
    }

    fn bytes(&self, _from: Rank, _step: usize, _tag: Tag, msg: SimMsg) -> u64 {
        msg.bytes
    }

    fn slot(&self, rank: Rank, _step: usize, from: Rank, tag: Tag) -> Option<usize> {
        let slots = &self.slots[rank];
        let key = (from as u32, tag);
        slots
            .binary_search_by(|&(f, t, _)| (f, t).cmp(&key))
            .ok()
            .map(|i| slots[i].2 as usize)
    }

    fn ignores(&self, rank: Rank, _step: usize, from: Rank, _tag: Tag) -> bool {
        from != rank && from < self.common.n
    }

    fn took(&mut self, rank: Rank, _step: usize, seconds: f64) {
        if let Some(round) = self.rounds[rank].as_mut() {
            round.took(Duration::try_from_secs_f64(seconds).unwrap_or(Duration::ZERO));
        }
    }

    fn complete(
        &mut self,
        rank: Rank,
        _step: usize,
        got: &[SimMsg],
        cut: Cut,
    ) -> Result<Work, Error> {
        let arrivals: Vec<Arrival<SimMsg>> = got
            .iter()
            .zip(&self.lens[rank])
            .map(|(&m, &len)| match m {
                m if m.id == ABSENT && cut == Cut::Quorum => Arrival::Late,
                m if m.id == ABSENT => Arrival::Missing,
                m if m.bytes != len => {
                    Arrival::Malformed(format!("{} bytes where {len} were expected", m.bytes))
                }
                m => Arrival::Received(m),
            })
            .collect();
        let mut round = self.rounds[rank]
            .take()
            .expect("a running rank has a round");
        let input = self.common.input(rank);
        let mut plane = SimPlane {
            data: self.common.plane.as_mut(),
            input,
            rank: &mut self.ranks[rank],
            blobs: &self.blobs,
            digests: &mut self.digests,
            finite: &mut self.finite,
            n: self.common.n,
            d: self.common.d,
        };
        round.handle(&mut plane, arrivals);
        let work = Work {
            rule_bytes: round.take_work() as f64,
            ..Work::default()
        };
        for fault in round.faults() {
            self.common.add_fault(rank, fault.clone());
        }
        self.common.warnings[rank].extend(round.take_warnings());
        if round.step().is_some() {
            self.rounds[rank] = Some(round);
            return Ok(work);
        }
        let report = round.finish()?;
        let data = &mut self.ranks[rank];
        if let (None, Some(plane)) = (data.output, self.common.plane.as_mut()) {
            // Sharded: the combined shards, in shard order.
            data.output = Some(plane.concat(&data.take_combined()));
        }
        self.common.outputs[rank] = data.output;
        self.reports[rank] = Some(report);
        Ok(work)
    }
}

/// One rank's view of the store, for one call of [`Round::handle`].
struct SimPlane<'p> {
    /// `None` in timing mode: nothing is computed.
    data: Option<&'p mut Plane>,
    rank: &'p mut RankData,
    /// This rank's input chunk.
    input: ChunkId,
    blobs: &'p [Bytes],
    digests: &'p mut HashMap<u32, Digest>,
    finite: &'p mut HashMap<u32, bool>,
    n: usize,
    d: usize,
}

impl SimPlane<'_> {
    /// The chunk `src` names.
    fn id(&self, src: &Src<'_, SimMsg>) -> ChunkId {
        match src {
            Src::Got(m) => m.id,
            Src::Owned(i) => self.rank.results.get(*i).copied().unwrap_or(NO_DATA),
            Src::Mine(range) => self.mine(range.clone()),
        }
    }

    /// The chunk of this rank's input `range`: all of it, or the view of the shard it is.
    fn mine(&self, range: Range<usize>) -> ChunkId {
        if self.data.is_none() {
            return NO_DATA;
        }
        if range == (0..self.d) {
            return self.input;
        }
        // Shards' starts are non-decreasing in the shard index: find the first shard that
        // starts here, then the one that is exactly this range (empty shards share a start).
        let (mut first, mut end) = (0, self.n);
        while first < end {
            let mid = first + (end - first) / 2;
            if chunk_range(self.d, self.n, mid).start < range.start {
                first = mid + 1;
            } else {
                end = mid;
            }
        }
        let s = (first..self.n)
            .find(|&s| chunk_range(self.d, self.n, s) == range)
            .expect("a shard's range");
        self.rank.pieces + s as ChunkId
    }

    /// The run's element type (data mode).
    fn dtype(&self) -> DType {
        self.data.as_deref().map_or(DType::F32, |p| p.store.dtype())
    }

    fn slices<'s>(&'s self, ids: &[ChunkId]) -> Vec<&'s [f32]> {
        let plane = self.data.as_deref().expect("data mode");
        ids.iter().map(|&i| plane.store.get(i)).collect()
    }

    fn insert(&mut self, v: Vec<f32>) -> ChunkId {
        self.data
            .as_deref_mut()
            .expect("data mode")
            .store
            .insert(v.into())
    }

    fn set_result(&mut self, i: usize, id: ChunkId) {
        if self.rank.results.len() <= i {
            self.rank.results.resize(i + 1, EMPTY);
        }
        self.rank.results[i] = id;
    }

    /// A shard's inputs by rank with the first present one standing in for erased ones.
    fn placeholder_ids(&self, inputs: &[Option<Src<'_, SimMsg>>]) -> Vec<ChunkId> {
        let stand_in = inputs.iter().flatten().next().map(|s| self.id(s));
        inputs
            .iter()
            .map(|x| x.as_ref().map(|s| self.id(s)).or(stand_in).unwrap_or(EMPTY))
            .collect()
    }
}

impl RoundPlane for SimPlane<'_> {
    type Buf = SimMsg;

    fn host<'b>(&'b self, buf: &'b SimMsg) -> std::borrow::Cow<'b, [u8]> {
        match buf.id.checked_sub(BLOB) {
            Some(i) if buf.id != ABSENT && buf.id != EMPTY && buf.id != NO_DATA => {
                std::borrow::Cow::Borrowed(&self.blobs[i as usize])
            }
            _ => std::borrow::Cow::Borrowed(&[]),
        }
    }

    fn digest(&mut self, src: Src<'_, SimMsg>) -> Digest {
        let id = self.id(&src);
        if self.data.is_none() {
            return [0; 32];
        }
        if let Some(d) = self.digests.get(&id) {
            return *d;
        }
        let d = byzcoll_proto::round::input_digest(self.slices(&[id])[0]);
        self.digests.insert(id, d);
        d
    }

    /// The simulated adversary forges whole vectors, never collisions: the digest serves.
    fn commitment(&mut self, src: Src<'_, SimMsg>) -> Digest {
        self.digest(src)
    }

    fn finite(&mut self, src: Src<'_, SimMsg>) -> bool {
        if self.data.is_none() {
            return true;
        }
        let id = self.id(&src);
        if let Some(&f) = self.finite.get(&id) {
            return f;
        }
        let f = byzcoll_aggregators::all_finite(self.slices(&[id])[0]);
        self.finite.insert(id, f);
        f
    }

    fn aggregate(
        &mut self,
        rule: &dyn Aggregator,
        inputs: &[Src<'_, SimMsg>],
        to: Dest,
    ) -> Result<AggReport, AggError> {
        let ids: Vec<ChunkId> = inputs.iter().map(|s| self.id(s)).collect();
        let Some(plane) = self.data.as_deref_mut() else {
            return Ok(AggReport::default());
        };
        let len = plane.store.get(ids[0]).len();
        let id = plane.aggregate(rule, &ids, len)?;
        match to {
            Dest::Output => self.rank.output = Some(id),
            Dest::Owned(i) => self.set_result(i, id),
        }
        // The store's memo keeps results, not reports: selections are not simulated.
        Ok(AggReport::default())
    }

    fn combine(
        &mut self,
        s: usize,
        range: Range<usize>,
        versions: &[Src<'_, SimMsg>],
    ) -> Result<(), AggError> {
        let ids: Vec<ChunkId> = versions.iter().map(|s| self.id(s)).collect();
        let Some(plane) = self.data.as_deref_mut() else {
            return Ok(());
        };
        let median = Median::new((ids.len() - 1) / 2);
        let id = plane.combine(&median, &ids, range.len())?;
        self.rank.combined.push(id);
        self.rank.combined_shards.push(s);
        Ok(())
    }

    fn distance_table(&mut self, inputs: &[Option<Src<'_, SimMsg>>]) -> Vec<f64> {
        let n = inputs.len();
        if self.data.is_none() {
            return vec![0.0; n * n];
        }
        let present: Vec<bool> = inputs.iter().map(Option::is_some).collect();
        let ids = self.placeholder_ids(inputs);
        byzcoll_aggregators::distance::distance_table_of_present(&self.slices(&ids), &present)
    }

    fn finish_selected(
        &mut self,
        selection: &dyn DistanceSelection,
        inputs: &[Option<Src<'_, SimMsg>>],
        selected: &[usize],
        i: usize,
    ) -> Result<(), AggError> {
        if self.data.is_none() {
            return Ok(());
        }
        let ids = self.placeholder_ids(inputs);
        let views = self.slices(&ids);
        let mut out = vec![0.0f32; views[0].len()];
        as_dtype(self.dtype(), &views, &mut out, |i, o| {
            selection.finish(i, selected, o)
        })?;
        let id = self.insert(out);
        self.set_result(i, id);
        Ok(())
    }

    fn estimate_start(
        &mut self,
        i: usize,
        inputs: &[Option<Src<'_, SimMsg>>],
    ) -> Result<(), AggError> {
        if self.rank.estimates.len() <= i {
            self.rank.estimates.resize_with(i + 1, Vec::new);
        }
        if self.data.is_none() {
            return Ok(());
        }
        let ids: Vec<ChunkId> = inputs.iter().flatten().map(|s| self.id(s)).collect();
        let views = self.slices(&ids);
        let mut m = vec![0.0f32; views[0].len()];
        let median = Median::new((views.len() - 1) / 2);
        aggregate_as(self.dtype(), &median, &views, &mut m)?;
        self.rank.estimates[i] = m.iter().map(|&v| f64::from(v)).collect();
        Ok(())
    }

    fn estimate_distances(&mut self, i: usize, inputs: &[Option<Src<'_, SimMsg>>]) -> Vec<f64> {
        if self.data.is_none() {
            return vec![0.0; inputs.len()];
        }
        let ids = self.placeholder_ids(inputs);
        let finite: Vec<bool> = inputs
            .iter()
            .zip(&ids)
            .map(|(x, &id)| x.is_some() && byzcoll_aggregators::all_finite(self.slices(&[id])[0]))
            .collect();
        byzcoll_aggregators::iteration::sq_distances_to(
            &self.slices(&ids),
            &finite,
            &self.rank.estimates[i],
        )
    }

    fn estimate_step(
        &mut self,
        i: usize,
        inputs: &[Option<Src<'_, SimMsg>>],
        a: f64,
        w: &[f64],
    ) -> (f64, f64) {
        if self.data.is_none() {
            return (0.0, 0.0);
        }
        let ids = self.placeholder_ids(inputs);
        let z = &self.rank.estimates[i];
        let mut next = vec![0.0f64; z.len()];
        byzcoll_aggregators::iteration::step_into(&self.slices(&ids), a, w, z, &mut next);
        let change: f64 = next.iter().zip(z).map(|(p, q)| (p - q) * (p - q)).sum();
        let size: f64 = z.iter().map(|q| q * q).sum();
        self.rank.estimates[i] = next;
        (change, size)
    }

    fn estimate_finish(&mut self, i: usize) -> Result<(), String> {
        if self.data.is_none() {
            return Ok(());
        }
        let dtype = self.dtype();
        let out: Vec<f32> = self.rank.estimates[i]
            .iter()
            .map(|&v| round_to(dtype, v))
            .collect();
        if !byzcoll_aggregators::all_finite(&out) {
            return Err("the estimate is not finite".into());
        }
        let id = self.insert(out);
        self.set_result(i, id);
        Ok(())
    }

    fn mix(
        &mut self,
        mixing: &dyn DistanceMixing,
        inputs: &[Src<'_, SimMsg>],
        neighbours: &[Option<Vec<usize>>],
        i: usize,
    ) -> Result<(), AggError> {
        if self.data.is_none() {
            return Ok(());
        }
        let ids: Vec<ChunkId> = inputs.iter().map(|s| self.id(s)).collect();
        let mixed = mix_as(self.dtype(), &self.slices(&ids), neighbours);
        let refs: Vec<&[f32]> = mixed.iter().map(Vec::as_slice).collect();
        let mut out = vec![0.0f32; refs[0].len()];
        aggregate_as(self.dtype(), mixing.inner(), &refs, &mut out)?;
        let id = self.insert(out);
        self.set_result(i, id);
        Ok(())
    }

    fn keeps_input(&self) -> bool {
        // Inputs are chunks of the store; outputs are new ones.
        true
    }

    fn result_digest(&mut self) -> Digest {
        let Some(plane) = self.data.as_deref_mut() else {
            return [0; 32];
        };
        if self.rank.output.is_none() {
            let combined = self.rank.take_combined();
            self.rank.output = Some(plane.concat(&combined));
        }
        let id = self.rank.output.expect("set above");
        byzcoll_proto::round::result_digest(plane.store.get(id))
    }

    fn output_digest(&mut self, s: usize, _range: Range<usize>) -> Digest {
        let Some(plane) = self.data.as_deref_mut() else {
            return [0; 32];
        };
        let at = self.rank.combined_shards.iter().position(|&t| t == s);
        // As `commitment` makes a version's digest: the round puts the two side by side (a
        // shard's digest is the version's where the round hashed it, this one's elsewhere).
        match at {
            Some(k) => byzcoll_proto::round::input_digest(plane.store.get(self.rank.combined[k])),
            None => [0; 32],
        }
    }
}
