//! Data mode: the vectors ranks contribute, the buffers messages carry, and the checks of what
//! every honest rank ends with against the gather-mode reference.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use byzcoll_aggregators::{aggregate_into, AggError, Aggregator, Structure};
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
#[derive(Debug, Default)]
pub(crate) struct Store {
    bufs: Vec<Option<Arc<[f32]>>>,
    views: Vec<View>,
}

impl Store {
    /// Adds a buffer; returns the id of a view of all of it.
    pub(crate) fn insert(&mut self, data: Arc<[f32]>) -> ChunkId {
        let len = data.len() as u32;
        self.bufs.push(Some(data));
        let buf = (self.bufs.len() - 1) as u32;
        self.push_view(View { buf, start: 0, len })
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
        let mut store = Store::default();
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
        let mut out = vec![0.0f32; len];
        let result = aggregate_into(rule, &refs, &mut out).map(|_| ());
        drop(refs);
        let result = result.map(|()| store.insert(out.into()));
        memo.insert(ids.to_vec(), result.clone());
        result
    }

    /// One buffer holding the chunks `ids` one after the other.
    pub(crate) fn concat(&mut self, ids: &[ChunkId]) -> ChunkId {
        if let Some(&id) = self.concat_memo.get(ids) {
            return id;
        }
        let mut out = Vec::new();
        for &i in ids {
            out.extend_from_slice(self.store.get(i));
        }
        let id = self.store.insert(out.into());
        self.concat_memo.insert(ids.to_vec(), id);
        id
    }
}

/// The vectors of a data-mode run: one per rank, the last
/// [`Adversary::byzantine_inputs`](crate::Adversary::byzantine_inputs) forged.
#[derive(Debug, Clone)]
pub struct DataSet {
    inputs: Vec<Arc<[f32]>>,
    forged: Vec<bool>,
    d: usize,
    lo: Vec<f32>,
    hi: Vec<f32>,
    sum: Vec<f32>,
    abs_sum: Vec<f64>,
}

impl DataSet {
    /// Honest inputs are integer-valued floats in `[-1000, 1000]` drawn from the scenario's
    /// seed (so sums are exact in any order); the last `byzantine_inputs` ranks contribute the
    /// scenario's attack forged from the honest ones.
    ///
    /// # Errors
    /// [`SimError::InvalidConfig`] for `d = 0`, or an invalid scenario.
    pub fn generate(scenario: &Scenario, d: usize) -> Result<DataSet, SimError> {
        let n = scenario.ranks;
        scenario.adversary.validate(n)?;
        let mut rng = StdRng::seed_from_u64(scenario.seed ^ 0x6461_7461_7365_7473);
        let honest: Vec<Vec<f32>> = (0..n)
            .filter(|&r| !scenario.adversary.forges_input(r, n))
            .map(|_| {
                (0..d)
                    .map(|_| rng.gen_range(-1000i32..=1000) as f32)
                    .collect()
            })
            .collect();
        let forged = if scenario.adversary.byzantine_inputs > 0 {
            let refs: Vec<&[f32]> = honest.iter().map(|v| v.as_slice()).collect();
            scenario.adversary.attack.forge(&refs)
        } else {
            Vec::new()
        };
        let mut honest = honest.into_iter();
        let mut inputs = Vec::with_capacity(n);
        let mut flags = Vec::with_capacity(n);
        for r in 0..n {
            let f = scenario.adversary.forges_input(r, n);
            flags.push(f);
            inputs.push(if f {
                forged.clone()
            } else {
                honest.next().unwrap_or_default()
            });
        }
        DataSet::new(inputs, flags)
    }

    /// Explicit inputs, one per rank, all of one length `d > 0`; `forged[r]` marks the ranks
    /// whose input is Byzantine (excluded from the honest range).
    ///
    /// # Errors
    /// [`SimError::InvalidConfig`] for no inputs, `d = 0`, different lengths or a `forged` of
    /// another length.
    pub fn new(inputs: Vec<Vec<f32>>, forged: Vec<bool>) -> Result<DataSet, SimError> {
        let d = inputs.first().map_or(0, Vec::len);
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
        let mut lo = vec![f32::INFINITY; d];
        let mut hi = vec![f32::NEG_INFINITY; d];
        let mut sum = vec![0.0f64; d];
        let mut abs_sum = vec![0.0f64; d];
        for (v, &bad) in inputs.iter().zip(&forged) {
            for (j, &x) in v.iter().enumerate() {
                sum[j] += f64::from(x);
                abs_sum[j] += f64::from(x.abs());
                if !bad {
                    lo[j] = lo[j].min(x);
                    hi[j] = hi[j].max(x);
                }
            }
        }
        Ok(DataSet {
            inputs: inputs.into_iter().map(Arc::from).collect(),
            forged,
            d,
            lo,
            hi,
            sum: sum.into_iter().map(|s| s as f32).collect(),
            abs_sum,
        })
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
        let gather = aggregate_into(rule, &refs, &mut out).map(|_| out);
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
    /// # Errors
    /// The first [`Mismatch`] found, or one saying that the run carried no data.
    pub fn check(&self, run: &Run) -> Result<Verdict, Mismatch> {
        let fail = |rank: Option<Rank>, what: String| Mismatch {
            algorithm: run.algorithm,
            rank,
            what,
        };
        let data = self.data;
        let mut verdict = match run.algorithm {
            Algorithm::RingSum => Verdict::MatchesSum,
            _ => Verdict::Exact,
        };
        let mut sum_exact = true;
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
            if run.algorithm == Algorithm::RingSum {
                let eps = f64::from(f32::EPSILON) * data.ranks() as f64;
                for (j, (&x, &want)) in got.iter().zip(&data.sum).enumerate() {
                    let ok = x.to_bits() == want.to_bits()
                        || (x.is_nan() && want.is_nan())
                        || (f64::from(x) - f64::from(want)).abs()
                            <= eps * data.abs_sum[j] + f64::from(f32::MIN_POSITIVE);
                    if !ok {
                        return Err(fail(
                            Some(r),
                            format!("coordinate {j} = {x}, but the direct sum is {want}"),
                        ));
                    }
                }
                sum_exact &= got.iter().zip(&data.sum).all(|(a, b)| a == b);
                continue;
            }
            let exact = match &self.gather {
                Ok(want) => {
                    let first = got
                        .iter()
                        .zip(want)
                        .position(|(a, b)| a.to_bits() != b.to_bits());
                    if run.clean {
                        if let Some(j) = first {
                            return Err(fail(
                                Some(r),
                                format!(
                                    "coordinate {j} = {}, but the gather-mode reference ({}) is {}",
                                    got[j], self.rule, want[j]
                                ),
                            ));
                        }
                    }
                    first.is_none()
                }
                Err(_) => false,
            };
            if run.clean {
                continue;
            }
            // Under faults or attack the claim is robustness, whatever the reference (which
            // includes the forged inputs) says.
            if self.coordinate_wise {
                for (j, &x) in got.iter().enumerate() {
                    let (lo, hi) = (data.lo[j], data.hi[j]);
                    let tol = 4.0 * f32::EPSILON * lo.abs().max(hi.abs());
                    if !(x >= lo - tol && x <= hi + tol) {
                        return Err(fail(
                            Some(r),
                            format!(
                                "coordinate {j} = {x} is outside the honest range [{lo}, {hi}]"
                            ),
                        ));
                    }
                }
            } else if let Some(j) = got.iter().position(|x| !x.is_finite()) {
                return Err(fail(
                    Some(r),
                    format!("coordinate {j} = {} is not finite", got[j]),
                ));
            }
            if !exact {
                verdict = if self.coordinate_wise {
                    Verdict::InHonestRange
                } else {
                    Verdict::Finite
                };
            }
        }
        if run.algorithm == Algorithm::RingSum && sum_exact {
            verdict = Verdict::Exact;
        }
        Ok(verdict)
    }
}
