//! Data mode: the vectors ranks contribute, the buffers messages carry, and the checks of what
//! every honest rank ends with against the gather-mode reference.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use byzcoll_aggregators::{
    AggError, AggReport, Aggregator, DType, Element, Inputs, Output, Structure,
};
use byzcoll_proto::Rank;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{Algorithm, RankResult, Role, Run, Scenario, SimError};

/// Handle of a chunk of `f32`s in a [`Store`]; what simulated messages carry.
pub(crate) type ChunkId = u32;
/// An empty payload: a shard owner that could not aggregate (an erasure at the receivers).
pub(crate) const EMPTY: ChunkId = u32::MAX;
/// A payload in timing mode, where nothing is carried.
pub(crate) const NO_DATA: ChunkId = u32::MAX - 1;
/// A receive slot whose message did not arrive.
pub(crate) const ABSENT: ChunkId = u32::MAX - 2;

#[derive(Debug, Clone, Copy)]
struct View {
    buf: u32,
    start: u32,
    len: u32,
}

/// Shared, immutable buffers and views into them, addressed by [`ChunkId`]. Messages carry ids,
/// so sending one vector to `n - 1` peers copies nothing, and an id names one content for the
/// whole run, which is what lets [`Memo`] reuse results.
///
/// Values are `f32`s; in a run of a 16-bit element type ([`Scenario::dtype`]) every value is
/// one of that type, widened exactly: whatever enters the store (a forged input, a lying
/// owner's version, a sum) is rounded to it once, as a rank of that type would hold it.
#[derive(Debug)]
pub(crate) struct Store {
    bufs: Vec<Option<Arc<[f32]>>>,
    views: Vec<View>,
    dtype: DType,
}

impl Store {
    /// An empty store of `dtype` values.
    pub(crate) fn of(dtype: DType) -> Store {
        Store {
            bufs: Vec::new(),
            views: Vec::new(),
            dtype,
        }
    }

    /// Adds a buffer, its values rounded to the store's type; returns the id of a view of all
    /// of it.
    pub(crate) fn insert(&mut self, mut data: Arc<[f32]>) -> ChunkId {
        if self.dtype != DType::F32 && !data.iter().all(|&x| is_of(self.dtype, x)) {
            let dtype = self.dtype;
            Arc::make_mut(&mut data)
                .iter_mut()
                .for_each(|x| *x = round_to(dtype, f64::from(*x)));
        }
        let len = data.len() as u32;
        self.bufs.push(Some(data));
        let buf = (self.bufs.len() - 1) as u32;
        self.push_view(View { buf, start: 0, len })
    }

    /// The element type of its values.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// A view of `range` of chunk `of`.
    pub(crate) fn view(&mut self, of: ChunkId, range: Range<usize>) -> ChunkId {
        let base = self.views[of as usize];
        debug_assert!(range.end <= base.len as usize);
        self.push_view(View {
            buf: base.buf,
            start: base.start + range.start as u32,
            len: range.len() as u32,
        })
    }

    fn push_view(&mut self, v: View) -> ChunkId {
        assert!(
            self.views.len() < ABSENT as usize,
            "simulator store is full"
        );
        self.views.push(v);
        (self.views.len() - 1) as ChunkId
    }

    /// The values of chunk `id` (empty for a released buffer).
    pub(crate) fn get(&self, id: ChunkId) -> &[f32] {
        let v = self.views[id as usize];
        match &self.bufs[v.buf as usize] {
            Some(b) => &b[v.start as usize..(v.start + v.len) as usize],
            None => &[],
        }
    }

    /// The buffer behind chunk `id`, shared, when the chunk is all of it.
    pub(crate) fn arc(&self, id: ChunkId) -> Option<Arc<[f32]>> {
        let v = self.views[id as usize];
        let b = self.bufs[v.buf as usize].as_ref()?;
        (v.start == 0 && v.len as usize == b.len()).then(|| Arc::clone(b))
    }

    /// Frees the buffer behind `id` (for one-off messages such as ring chunks).
    pub(crate) fn release(&mut self, id: ChunkId) {
        let v = self.views[id as usize];
        self.bufs[v.buf as usize] = None;
    }
}

/// Results of deterministic computations keyed by the ids of their inputs: honest ranks that
/// aggregate the same inputs compute bitwise the same output, so it is computed once.
pub(crate) type Memo = HashMap<Vec<ChunkId>, Result<ChunkId, AggError>>;

/// The data plane of a data-mode run.
#[derive(Debug)]
pub(crate) struct Plane {
    pub store: Store,
    /// The vector each rank contributes (forged for Byzantine inputs).
    pub inputs: Vec<ChunkId>,
    rule_memo: Memo,
    combine_memo: Memo,
    concat_memo: HashMap<Vec<ChunkId>, ChunkId>,
}

impl Plane {
    pub(crate) fn new(data: &DataSet) -> Plane {
        let mut store = Store::of(data.dtype);
        let inputs = data
            .inputs
            .iter()
            .map(|v| store.insert(Arc::clone(v)))
            .collect();
        Plane {
            store,
            inputs,
            rule_memo: Memo::new(),
            combine_memo: Memo::new(),
            concat_memo: HashMap::new(),
        }
    }

    /// `rule` over the chunks `ids` (all of length `len`), in that order.
    pub(crate) fn aggregate(
        &mut self,
        rule: &dyn Aggregator,
        ids: &[ChunkId],
        len: usize,
    ) -> Result<ChunkId, AggError> {
        Self::memoized(&mut self.rule_memo, &mut self.store, rule, ids, len)
    }

    /// The coordinate-wise `median` of owner versions `ids` of one shard.
    pub(crate) fn combine(
        &mut self,
        median: &dyn Aggregator,
        ids: &[ChunkId],
        len: usize,
    ) -> Result<ChunkId, AggError> {
        Self::memoized(&mut self.combine_memo, &mut self.store, median, ids, len)
    }

    fn memoized(
        memo: &mut Memo,
        store: &mut Store,
        rule: &dyn Aggregator,
        ids: &[ChunkId],
        len: usize,
    ) -> Result<ChunkId, AggError> {
        if let Some(r) = memo.get(ids) {
            return r.clone();
        }
        let refs: Vec<&[f32]> = ids.iter().map(|&i| store.get(i)).collect();
        let mut out = zeroed(len);
        let result = aggregate_as(store.dtype, rule, &refs, Arc::make_mut(&mut out)).map(|_| ());
        drop(refs);
        let result = result.map(|()| store.insert(out));
        memo.insert(ids.to_vec(), result.clone());
        result
    }

    /// One buffer holding the chunks `ids` one after the other.
    pub(crate) fn concat(&mut self, ids: &[ChunkId]) -> ChunkId {
        if let Some(&id) = self.concat_memo.get(ids) {
            return id;
        }
        let len = ids.iter().map(|&i| self.store.get(i).len()).sum();
        let mut out = zeroed(len);
        let mut at = 0;
        for &i in ids {
            let chunk = self.store.get(i);
            Arc::make_mut(&mut out)[at..at + chunk.len()].copy_from_slice(chunk);
            at += chunk.len();
        }
        let id = self.store.insert(out);
        self.concat_memo.insert(ids.to_vec(), id);
        id
    }
}

/// `len` zeros in a buffer the store can keep as it is (a `Vec` becomes an `Arc<[f32]>` by a
/// copy, twice its size at the peak); unique, so [`Arc::make_mut`] does not copy it.
pub(crate) fn zeroed(len: usize) -> Arc<[f32]> {
    (0..len).map(|_| 0.0).collect()
}

/// `x` rounded once to `dtype` (to nearest, ties to even: [`Element::from_f64`]), as the
/// `f32` that holds it exactly; `f32` itself for `f32` (and for `f64`, which data mode
/// refuses).
pub(crate) fn round_to(dtype: DType, x: f64) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f64(x).to_f64() as f32,
        DType::F16 => half::f16::from_f64(x).to_f64() as f32,
        DType::F32 | DType::F64 => x as f32,
    }
}

/// Whether `x` is a value of `dtype` (NaN counts as one: its payload is not compared).
fn is_of(dtype: DType, x: f32) -> bool {
    x.is_nan() || round_to(dtype, f64::from(x)).to_bits() == x.to_bits()
}

/// Runs `f` on `inputs` and `out` as vectors of `dtype` (each value converted exactly, the
/// output widened exactly back): what a rank of that type computes, bitwise.
pub(crate) fn as_dtype<R>(
    dtype: DType,
    inputs: &[&[f32]],
    out: &mut [f32],
    f: impl FnOnce(Inputs<'_>, Output<'_>) -> Result<R, AggError>,
) -> Result<R, AggError> {
    fn narrow<T: Element, R>(
        inputs: &[&[f32]],
        out: &mut [f32],
        f: impl FnOnce(Inputs<'_>, Output<'_>) -> Result<R, AggError>,
    ) -> Result<R, AggError> {
        let held = held::<T>(inputs);
        let refs: Vec<&[T]> = held.iter().map(Vec::as_slice).collect();
        let mut o = vec![T::from_f64(0.0); out.len()];
        let r = f(T::inputs(&refs), T::output(&mut o))?;
        for (d, s) in out.iter_mut().zip(&o) {
            *d = s.to_f64() as f32;
        }
        Ok(r)
    }
    match dtype {
        DType::BF16 => narrow::<half::bf16, R>(inputs, out, f),
        DType::F16 => narrow::<half::f16, R>(inputs, out, f),
        DType::F32 | DType::F64 => f(f32::inputs(inputs), f32::output(out)),
    }
}

/// `inputs` as vectors of `T`, each value converted exactly (they are values of `T`).
fn held<T: Element>(inputs: &[&[f32]]) -> Vec<Vec<T>> {
    inputs
        .iter()
        .map(|v| v.iter().map(|&x| T::from_f64(f64::from(x))).collect())
        .collect()
}

/// [`byzcoll_aggregators::mix`] of `inputs` in `dtype` (each mean rounded once to it).
pub(crate) fn mix_as(
    dtype: DType,
    inputs: &[&[f32]],
    neighbours: &[Option<Vec<usize>>],
) -> Vec<Vec<f32>> {
    fn typed<T: Element>(inputs: &[&[f32]], neighbours: &[Option<Vec<usize>>]) -> Vec<Vec<f32>> {
        let held = held::<T>(inputs);
        let refs: Vec<&[T]> = held.iter().map(Vec::as_slice).collect();
        byzcoll_aggregators::mix(&refs, neighbours)
            .into_iter()
            .map(|v| v.iter().map(|x| x.to_f64() as f32).collect())
            .collect()
    }
    match dtype {
        DType::BF16 => typed::<half::bf16>(inputs, neighbours),
        DType::F16 => typed::<half::f16>(inputs, neighbours),
        DType::F32 | DType::F64 => byzcoll_aggregators::mix(inputs, neighbours),
    }
}

/// `rule` over `inputs` into `out` in `dtype` ([`as_dtype`]).
pub(crate) fn aggregate_as(
    dtype: DType,
    rule: &(impl Aggregator + ?Sized),
    inputs: &[&[f32]],
    out: &mut [f32],
) -> Result<AggReport, AggError> {
    as_dtype(dtype, inputs, out, |i, o| rule.aggregate(i, o))
}

/// The vectors of a data-mode run: one per rank, the last
/// [`Adversary::byzantine_inputs`](crate::Adversary::byzantine_inputs) forged.
///
/// It holds the inputs and nothing else of their size: the honest range and the direct sum
/// that [`Reference::check`] compares with are computed block by block when it runs, so a
/// world's data costs `4·n·d` bytes here (forged ranks share one buffer).
#[derive(Debug, Clone)]
pub struct DataSet {
    inputs: Vec<Arc<[f32]>>,
    forged: Vec<bool>,
    d: usize,
    /// The element type every value is one of ([`DataSet::dtype`]).
    dtype: DType,
}

impl DataSet {
    /// Honest inputs are integer-valued floats in `[-1000, 1000]` drawn from the scenario's
    /// seed (so sums are exact in any order), of the scenario's element type
    /// ([`Scenario::dtype`]: each value rounded to it, so a bf16 run's inputs are the
    /// integers bf16 holds); the last `byzantine_inputs` ranks contribute the scenario's
    /// attack forged from the honest ones, rounded alike.
    ///
    /// # Errors
    /// [`SimError::InvalidConfig`] for `d = 0`, or an invalid scenario;
    /// [`SimError::Unsupported`] for `f64` ([`DataSet::typed`]).
    pub fn generate(scenario: &Scenario, d: usize) -> Result<DataSet, SimError> {
        let n = scenario.ranks;
        let dtype = scenario.dtype;
        check_dtype(dtype)?;
        scenario.adversary.validate(n)?;
        let mut rng = StdRng::seed_from_u64(scenario.seed ^ 0x6461_7461_7365_7473);
        // Collected straight into the shared buffers: no second copy of the inputs.
        let honest: Vec<Arc<[f32]>> = (0..n)
            .filter(|&r| !scenario.adversary.forges_input(r, n))
            .map(|_| {
                (0..d)
                    .map(|_| round_to(dtype, f64::from(rng.gen_range(-1000i32..=1000))))
                    .collect()
            })
            .collect();
        let forged: Arc<[f32]> = if scenario.adversary.byzantine_inputs > 0 {
            let refs: Vec<&[f32]> = honest.iter().map(|v| &v[..]).collect();
            let mut forged = scenario.adversary.attack.forge(&refs);
            forged
                .iter_mut()
                .for_each(|x| *x = round_to(dtype, f64::from(*x)));
            forged.into()
        } else {
            Arc::from(Vec::new())
        };
        let mut honest = honest.into_iter();
        let mut inputs = Vec::with_capacity(n);
        let mut flags = Vec::with_capacity(n);
        for r in 0..n {
            let f = scenario.adversary.forges_input(r, n);
            flags.push(f);
            inputs.push(if f {
                Arc::clone(&forged)
            } else {
                honest.next().unwrap_or_else(|| Arc::from(Vec::new()))
            });
        }
        DataSet::from_shared(inputs, flags, dtype)
    }

    /// Explicit inputs, one per rank, all of one length `d > 0`; `forged[r]` marks the ranks
    /// whose input is Byzantine (excluded from the honest range).
    ///
    /// # Errors
    /// [`SimError::InvalidConfig`] for no inputs, `d = 0`, different lengths or a `forged` of
    /// another length.
    pub fn new(inputs: Vec<Vec<f32>>, forged: Vec<bool>) -> Result<DataSet, SimError> {
        DataSet::from_shared(
            inputs.into_iter().map(Arc::from).collect(),
            forged,
            DType::F32,
        )
    }

    /// These inputs as vectors of `dtype` (bf16 or f16, held as the `f32`s that are exactly
    /// their values), for a scenario of that type: every value must be one of `dtype` (or
    /// NaN), so nothing is rounded behind the caller's back.
    ///
    /// # Errors
    /// [`SimError::InvalidConfig`] naming the first value `dtype` does not hold;
    /// [`SimError::Unsupported`] for `f64`.
    pub fn typed(self, dtype: DType) -> Result<DataSet, SimError> {
        check_dtype(dtype)?;
        for (r, v) in self.inputs.iter().enumerate() {
            if let Some(k) = v.iter().position(|&x| !is_of(dtype, x)) {
                return Err(SimError::InvalidConfig(format!(
                    "input of rank {r}, coordinate {k}: {} is not a {} value",
                    v[k],
                    dtype.name()
                )));
            }
        }
        Ok(DataSet { dtype, ..self })
    }

    fn from_shared(
        inputs: Vec<Arc<[f32]>>,
        forged: Vec<bool>,
        dtype: DType,
    ) -> Result<DataSet, SimError> {
        let d = inputs.first().map_or(0, |v| v.len());
        if inputs.is_empty() || d == 0 {
            return Err(SimError::InvalidConfig(
                "data mode needs at least one rank and d >= 1 coordinates".into(),
            ));
        }
        if let Some(r) = inputs.iter().position(|v| v.len() != d) {
            return Err(SimError::InvalidConfig(format!(
                "input of rank {r} has length {}, rank 0's has {d}",
                inputs[r].len()
            )));
        }
        if forged.len() != inputs.len() {
            return Err(SimError::InvalidConfig(format!(
                "{} forged flags for {} inputs",
                forged.len(),
                inputs.len()
            )));
        }
        Ok(DataSet {
            inputs,
            forged,
            d,
            dtype,
        })
    }

    /// The element type of every value ([`Scenario::dtype`] of the runs it feeds).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of ranks.
    pub fn ranks(&self) -> usize {
        self.inputs.len()
    }

    /// Coordinates per vector.
    pub fn d(&self) -> usize {
        self.d
    }

    /// Rank `r`'s input.
    pub fn input(&self, r: Rank) -> &[f32] {
        &self.inputs[r]
    }

    /// Whether rank `r`'s input is forged.
    pub fn forged(&self, r: Rank) -> bool {
        self.forged[r]
    }

    /// The gather-mode reference: `rule` applied directly to every rank's input, in rank order
    /// (what every honest rank gets in gather mode when nothing is lost).
    pub fn reference<'a>(&'a self, rule: &dyn Aggregator) -> Reference<'a> {
        let refs: Vec<&[f32]> = self.inputs.iter().map(|v| &v[..]).collect();
        let mut out = vec![0.0f32; self.d];
        let gather = aggregate_as(self.dtype, rule, &refs, &mut out).map(|_| out);
        Reference {
            data: self,
            gather,
            rule: rule.name().to_string(),
            coordinate_wise: rule.structure() == Structure::CoordinateWise,
        }
    }
}

/// What honest ranks should end with, computed directly from all inputs.
#[derive(Debug)]
pub struct Reference<'a> {
    data: &'a DataSet,
    gather: Result<Vec<f32>, AggError>,
    rule: String,
    coordinate_wise: bool,
}

/// How a run's honest results compare with the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Bitwise equal to the gather-mode reference (robust schedules) or to the direct sum
    /// (ring SUM).
    Exact,
    /// Not equal, but every coordinate lies within the honest inputs' range for it (robust
    /// coordinate-wise rules under faults or attack).
    InHonestRange,
    /// Within floating-point reassociation error of the direct sum of every input (ring SUM;
    /// exact for integer-valued inputs).
    MatchesSum,
    /// Finite everywhere: all that is claimed for rules that are not coordinate-wise under
    /// faults or attack.
    Finite,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Exact => "exact",
            Verdict::InHonestRange => "in honest range",
            Verdict::MatchesSum => "matches the sum",
            Verdict::Finite => "finite",
        })
    }
}

/// What went wrong in a check: which algorithm, which rank, what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// The algorithm whose run failed the check.
    pub algorithm: Algorithm,
    /// The honest rank at fault, when one is.
    pub rank: Option<Rank>,
    /// What differs.
    pub what: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.rank {
            Some(r) => write!(f, "{}: rank {r}: {}", self.algorithm, self.what),
            None => write!(f, "{}: {}", self.algorithm, self.what),
        }
    }
}

impl std::error::Error for Mismatch {}

impl Reference<'_> {
    /// The reference vector, or why the rule refuses all inputs.
    pub fn gather(&self) -> Result<&[f32], &AggError> {
        self.gather.as_deref()
    }

    /// Checks every honest rank of `run`: it must have completed, and its result must equal
    /// the reference bitwise when the run was clean (no forged input, no lying owner, no
    /// erasure). Otherwise it must lie inside the honest inputs' per-coordinate range
    /// (coordinate-wise rules; so the non-robust `mean` fails under attack) or be finite (other
    /// rules), and the verdict is [`Verdict::Exact`] only if it also equals the reference.
    /// Ring SUM results must match the direct sum of all inputs, forged ones included.
    ///
    /// The range and the sum are computed 4096 coordinates at a time, so a check allocates no
    /// more than that besides the list of results.
    ///
    /// # Errors
    /// The first [`Mismatch`] found (ranks that did not complete first, in rank order), or one
    /// saying that the run carried no data.
    pub fn check(&self, run: &Run) -> Result<Verdict, Mismatch> {
        let fail = |rank: Option<Rank>, what: String| Mismatch {
            algorithm: run.algorithm,
            rank,
            what,
        };
        let data = self.data;
        let mut results: Vec<(Rank, &[f32])> = Vec::new();
        for (r, outcome) in run.ranks.iter().enumerate() {
            if outcome.role != Role::Honest {
                continue;
            }
            let got = match &outcome.result {
                RankResult::Done(Some(v)) => v,
                RankResult::Done(None) => {
                    return Err(fail(None, "the run carried no data (timing mode)".into()))
                }
                RankResult::Failed(e) => return Err(fail(Some(r), format!("failed: {e}"))),
                RankResult::Crashed => continue,
            };
            if got.len() != data.d {
                return Err(fail(
                    Some(r),
                    format!("result has {} coordinates, expected {}", got.len(), data.d),
                ));
            }
            results.push((r, got));
        }
        if run.algorithm == Algorithm::RingSum {
            return self
                .check_sum(&results)
                .map_err(|(r, what)| fail(Some(r), what));
        }
        let mut all_exact = true;
        for &(r, got) in &results {
            let exact = match &self.gather {
                Ok(want) => {
                    let first = got
                        .iter()
                        .zip(want)
                        .position(|(a, b)| a.to_bits() != b.to_bits());
                    if let (true, Some(j)) = (run.clean, first) {
                        return Err(fail(
                            Some(r),
                            format!(
                                "coordinate {j} = {}, but the gather-mode reference ({}) is {}",
                                got[j], self.rule, want[j]
                            ),
                        ));
                    }
                    first.is_none()
                }
                Err(_) => false,
            };
            all_exact &= exact;
            if !run.clean && !self.coordinate_wise {
                if let Some(j) = got.iter().position(|x| !x.is_finite()) {
                    return Err(fail(
                        Some(r),
                        format!("coordinate {j} = {} is not finite", got[j]),
                    ));
                }
            }
        }
        if run.clean {
            return Ok(Verdict::Exact);
        }
        // Under faults or attack the claim is robustness, whatever the reference (which
        // includes the forged inputs) says.
        if self.coordinate_wise {
            self.check_range(&results)
                .map_err(|(r, what)| fail(Some(r), what))?;
        }
        Ok(match (all_exact, self.coordinate_wise) {
            (true, _) => Verdict::Exact,
            (false, true) => Verdict::InHonestRange,
            (false, false) => Verdict::Finite,
        })
    }

    /// Ring SUM: every result within reassociation error of the direct sum of all inputs
    /// (computed in f64, rounded once), [`Verdict::Exact`] when all are bitwise that sum.
    fn check_sum(&self, results: &[(Rank, &[f32])]) -> Result<Verdict, (Rank, String)> {
        let data = self.data;
        let eps = epsilon(data.dtype) * data.ranks() as f64;
        let mut sum = vec![0.0f64; CHECK_BLOCK.min(data.d)];
        let mut abs_sum = sum.clone();
        let mut exact = true;
        for start in (0..data.d).step_by(CHECK_BLOCK) {
            let block = start..(start + CHECK_BLOCK).min(data.d);
            let (sum, abs_sum) = (&mut sum[..block.len()], &mut abs_sum[..block.len()]);
            sum.fill(0.0);
            abs_sum.fill(0.0);
            for v in &data.inputs {
                for ((s, a), &x) in sum
                    .iter_mut()
                    .zip(abs_sum.iter_mut())
                    .zip(&v[block.clone()])
                {
                    *s += f64::from(x);
                    *a += f64::from(x.abs());
                }
            }
            for &(r, got) in results {
                for (k, &x) in got[block.clone()].iter().enumerate() {
                    let want = round_to(data.dtype, sum[k]);
                    let ok = x.to_bits() == want.to_bits()
                        || (x.is_nan() && want.is_nan())
                        || (f64::from(x) - f64::from(want)).abs()
                            <= eps * abs_sum[k] + f64::from(f32::MIN_POSITIVE);
                    if !ok {
                        let j = block.start + k;
                        return Err((
                            r,
                            format!("coordinate {j} = {x}, but the direct sum is {want}"),
                        ));
                    }
                    exact &= x == want;
                }
            }
        }
        Ok(if exact {
            Verdict::Exact
        } else {
            Verdict::MatchesSum
        })
    }

    /// Coordinate-wise rules under faults or attack: every result inside the honest inputs'
    /// range, coordinate by coordinate, with a few ulps of tolerance.
    fn check_range(&self, results: &[(Rank, &[f32])]) -> Result<(), (Rank, String)> {
        let data = self.data;
        let mut lo = vec![f32::INFINITY; CHECK_BLOCK.min(data.d)];
        let mut hi = vec![f32::NEG_INFINITY; lo.len()];
        for start in (0..data.d).step_by(CHECK_BLOCK) {
            let block = start..(start + CHECK_BLOCK).min(data.d);
            let (lo, hi) = (&mut lo[..block.len()], &mut hi[..block.len()]);
            lo.fill(f32::INFINITY);
            hi.fill(f32::NEG_INFINITY);
            for (v, _) in data
                .inputs
                .iter()
                .zip(&data.forged)
                .filter(|(_, &bad)| !bad)
            {
                for ((l, h), &x) in lo.iter_mut().zip(hi.iter_mut()).zip(&v[block.clone()]) {
                    *l = l.min(x);
                    *h = h.max(x);
                }
            }
            for &(r, got) in results {
                for (k, &x) in got[block.clone()].iter().enumerate() {
                    let (lo, hi) = (lo[k], hi[k]);
                    let tol = 4.0 * epsilon(data.dtype) as f32 * lo.abs().max(hi.abs());
                    if !(x >= lo - tol && x <= hi + tol) {
                        let j = block.start + k;
                        return Err((
                            r,
                            format!(
                                "coordinate {j} = {x} is outside the honest range [{lo}, {hi}]"
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// The gap between 1 and the next value of `dtype`.
fn epsilon(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => f64::from(half::bf16::EPSILON.to_f32()),
        DType::F16 => f64::from(half::f16::EPSILON.to_f32()),
        DType::F32 | DType::F64 => f64::from(f32::EPSILON),
    }
}

/// Data mode carries `f32`, bf16 and f16 vectors.
pub(crate) fn check_dtype(dtype: DType) -> Result<(), SimError> {
    match dtype {
        DType::F64 => Err(SimError::Unsupported(
            "data mode carries f32, bf16 and f16 vectors, not f64: time an f64 run in timing \
             mode"
                .into(),
        )),
        _ => Ok(()),
    }
}

/// Coordinates per block of [`Reference::check`]'s range and sum.
const CHECK_BLOCK: usize = 1 << 12;
