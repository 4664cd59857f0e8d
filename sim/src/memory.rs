//! The memory a simulation holds at its peak, estimated from its parameters before anything is
//! allocated, so that a run too large for the machine is refused, naming what to lower, instead
//! of aborting on a failed allocation.
//!
//! A simulation keeps every rank in one process, and every rank posts a whole step at once: in
//! gather mode `n` ranks each post `n - 1` sends and `n - 1` receives before the first message
//! moves, so the schedule's bookkeeping alone is `O(n²)` (`O(r·n²)` with `r` owners per shard).
//! The estimate adds up, for the largest of a run's algorithms (they run one after the other
//! and free what they held):
//!
//! * [`Footprint::Messages`]: the posted steps — the round's plan, the sends queued on each
//!   NIC, the receive slots — per message of one step, measured per algorithm;
//! * [`Footprint::Vectors`] (data mode): the inputs, the reference, each rank's result (worst
//!   case: all different) and the algorithm's working copies, in units of `4·n·d` bytes;
//! * [`Footprint::Statistics`]: the `n × n` distance tables that sharded rounds of
//!   distance-based rules send for every shard to every rank (`O(r·n³)`), and in data mode the
//!   statistics of every step of an iterative rule;
//! * [`Footprint::Forged`] (data mode): vectors forged per destination by equivocating ranks and
//!   lying owners.
//!
//! The per-message constants were measured as peak RSS of release builds (glibc malloc) at
//! `n` = 400 to 4096 and rounded up by about 10%; the vector terms count buffers exactly. The
//! estimate is an upper bound in the measured cases, not a promise about the allocator.

use std::fmt;

use byzcoll_aggregators::{Aggregator, DType, Structure};

use crate::{Agreement, Algorithm, Scenario, SimError};

/// The bound `byzcoll simulate` applies unless told otherwise: 4 GiB.
pub const DEFAULT_MEMORY_BOUND: u64 = 4 << 30;

/// Bytes of a float32 coordinate.
const F32: u128 = 4;
/// The process itself: code, thread stacks, the allocator's arenas.
const BASE: u128 = 16 << 20;
/// Per message of a gather step (`n²` of them), cross-check included: timing mode, and data
/// mode (whose messages also hold store views and digests, more of them distinct under faults).
const GATHER_PER_MESSAGE: [u128; 2] = [330, 360];
/// Per message of a sharded step, timing and data mode: `SHARDED_PER_MESSAGE + r ·
/// SHARDED_PER_REPLICA` per `n²`.
const SHARDED_PER_MESSAGE: [u128; 2] = [140, 200];
const SHARDED_PER_REPLICA: [u128; 2] = [320, 380];
/// What [`Agreement::Enforce`]'s echo steps add per `n²`.
const ENFORCE_PER_MESSAGE: u128 = 150;
/// Ring SUM in timing mode, per rank (one message per step).
const RING_PER_RANK: u128 = 1024;
/// Ring SUM in data mode, per `n²`: every step stores each rank's chunk (`2n²` store entries).
const RING_DATA_PER_MESSAGE: u128 = 64;
/// Per `r·n³`: the `n × n` f64 distance table of each shard, in every owner's plan and in the
/// statistics every rank receives.
const TABLE_PER_ENTRY: u128 = 17;
/// Bytes of an f64 statistic.
const F64: u128 = 8;
/// What a series of rounds keeps besides one round's run: per rank, where it starts the next
/// round and which peers some honest rank erased; per round, its summary.
const ROUNDS_PER_RANK: u128 = 64;
const ROUNDS_PER_ROUND: u128 = 512;

/// What a simulation's memory goes to; each part grows with other parameters, so that a caller
/// can say which one to lower.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Footprint {
    /// The posted steps: `O(n²)` in gather mode, `O(r·n²)` in sharded mode. Grows with the
    /// world size, the owners per shard and [`Agreement::Enforce`].
    Messages,
    /// Data mode's vectors: inputs, results and working copies, `O(n·d)`. Grows with the world
    /// size and the vector size.
    Vectors,
    /// Distance statistics of rules that are not coordinate-wise in sharded mode: `O(r·n³)`.
    /// Grows with the world size; coordinate-wise rules and gather mode have none.
    Statistics,
    /// Vectors forged per destination by equivocating ranks and lying owners, `O(K·n·d)` in
    /// gather mode. Grows with the number of Byzantine ranks and the vector size.
    Forged,
    /// Audited rounds' evidence: every rank's signed piece of the shards being simulated,
    /// `O(n·(shard + 32·m))` per core, and the round's proofs, `O(n·m)` each.
    Evidence,
}

impl fmt::Display for Footprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Footprint::Messages => "the posted steps, O(n^2) messages per step",
            Footprint::Vectors => "the vectors, O(n*d)",
            Footprint::Statistics => "the distance statistics of sharded rounds, O(r*n^3)",
            Footprint::Forged => "the vectors forged per destination, O(K*n*d)",
            Footprint::Evidence => "the audits' signed pieces and proofs, O(n*(shard+32*m))",
        })
    }
}

/// A simulation's estimated peak, by part, in bytes (each saturates at `u64::MAX`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// [`Footprint::Messages`], with the process's own base.
    pub messages: u64,
    /// [`Footprint::Vectors`].
    pub vectors: u64,
    /// [`Footprint::Statistics`].
    pub statistics: u64,
    /// [`Footprint::Forged`].
    pub forged: u64,
}

impl MemoryEstimate {
    /// The whole estimate.
    pub fn total(&self) -> u64 {
        self.messages
            .saturating_add(self.vectors)
            .saturating_add(self.statistics)
            .saturating_add(self.forged)
    }

    /// The part that weighs most (the one to lower first).
    pub fn largest(&self) -> Footprint {
        [
            (Footprint::Messages, self.messages),
            (Footprint::Vectors, self.vectors),
            (Footprint::Statistics, self.statistics),
            (Footprint::Forged, self.forged),
        ]
        .into_iter()
        .fold((Footprint::Messages, 0), |best, part| {
            if part.1 > best.1 {
                part
            } else {
                best
            }
        })
        .0
    }

    /// Whether the estimate is within `bound` bytes.
    ///
    /// # Errors
    /// [`SimError::TooLarge`] with the estimate, the bound and the largest part.
    pub fn check(&self, bound: u64) -> Result<(), SimError> {
        let needed = self.total();
        if needed <= bound {
            Ok(())
        } else {
            Err(SimError::TooLarge {
                needed,
                bound,
                largest: self.largest(),
            })
        }
    }

    /// This estimate for `rounds` rounds in a row of a world of `n`
    /// ([`Scenario::run_rounds`]): the rounds run one after the other and each frees its run,
    /// so only what the series keeps is added (to [`Footprint::Messages`]).
    pub fn with_rounds(mut self, n: usize, rounds: usize) -> Self {
        let kept = ROUNDS_PER_RANK
            .saturating_mul(n as u128)
            .saturating_add(ROUNDS_PER_ROUND.saturating_mul(rounds as u128));
        self.messages = self
            .messages
            .saturating_add(u64::try_from(kept).unwrap_or(u64::MAX));
        self
    }

    fn from_parts(messages: u128, vectors: u128, statistics: u128, forged: u128) -> Self {
        let clamp = |v: u128| u64::try_from(v).unwrap_or(u64::MAX);
        MemoryEstimate {
            messages: clamp(BASE.saturating_add(messages)),
            vectors: clamp(vectors),
            statistics: clamp(statistics),
            forged: clamp(forged),
        }
    }
}

/// How a rule's statistics weigh: by the shape of what it exchanges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RuleKind {
    CoordinateWise,
    /// Krum, Multi-Krum, Bulyan: an `n × n` distance table.
    Select,
    /// Nearest-neighbour mixing: a table, and `n` mixed vectors.
    Mix,
    /// Geometric median, centered clipping: `n + 2` statistics per step, up to `steps` steps.
    Iterate {
        steps: u128,
    },
}

impl RuleKind {
    fn of(rule: Option<&dyn Aggregator>) -> RuleKind {
        let Some(rule) = rule else {
            return RuleKind::CoordinateWise;
        };
        if rule.structure() == Structure::CoordinateWise {
            RuleKind::CoordinateWise
        } else if rule.distance_selection().is_some() {
            RuleKind::Select
        } else if let Some(i) = rule.distance_iteration() {
            RuleKind::Iterate {
                steps: i.max_steps() as u128,
            }
        } else {
            RuleKind::Mix
        }
    }
}

/// Data mode's parameters besides the world.
#[derive(Debug, Clone, Copy)]
struct Data {
    d: u128,
    /// Ranks that forge inputs and send each destination its own vector.
    equivocators: u128,
    /// Whether one victim gets another vector and every other destination the same one.
    victim: bool,
    lying_owners: u128,
}

/// What `algorithm` holds at its peak in a world of `n` (the parts it adds to the inputs).
fn algorithm_peak(
    n: u128,
    algorithm: Algorithm,
    agreement: Agreement,
    kind: RuleKind,
    data: Option<Data>,
) -> (u128, u128, u128, u128) {
    let n2 = n.saturating_mul(n);
    let mode = usize::from(data.is_some());
    let enforce = if agreement == Agreement::Enforce && algorithm != Algorithm::RingSum {
        ENFORCE_PER_MESSAGE.saturating_mul(n2)
    } else {
        0
    };
    let table = match kind {
        RuleKind::Select | RuleKind::Mix => F64.saturating_mul(n2),
        _ => 0,
    };
    let (mut messages, mut vectors, mut statistics, mut forged) = (enforce, 0u128, 0u128, 0u128);
    match algorithm {
        Algorithm::Gather => {
            messages = messages.saturating_add(GATHER_PER_MESSAGE[mode].saturating_mul(n2));
            statistics = table;
            if let Some(data) = data {
                // Every rank's result, all different under faults.
                vectors = F32.saturating_mul(n).saturating_mul(data.d);
                let copies = if data.victim { 2 } else { n.saturating_sub(1) };
                forged = F32
                    .saturating_mul(data.equivocators)
                    .saturating_mul(copies)
                    .saturating_mul(data.d);
            }
        }
        Algorithm::Sharded { replicas } => {
            let r = replicas as u128;
            let per = SHARDED_PER_MESSAGE[mode]
                .saturating_add(SHARDED_PER_REPLICA[mode].saturating_mul(r));
            messages = messages.saturating_add(per.saturating_mul(n2));
            let n3r = n2.saturating_mul(n).saturating_mul(r);
            statistics = match kind {
                RuleKind::Select | RuleKind::Mix => TABLE_PER_ENTRY.saturating_mul(n3r),
                // Each step's statistics differ in data mode (timing mode's are all zeros, one
                // interned copy).
                RuleKind::Iterate { steps } if data.is_some() => F64
                    .saturating_mul(r)
                    .saturating_mul(n)
                    .saturating_mul(n.saturating_add(2))
                    .saturating_mul(steps.saturating_add(1)),
                _ => 0,
            };
            if let Some(data) = data {
                // Each rank's output, plus the owners' results and the combined shards
                // (shared by the ranks that combine the same versions).
                let d = data.d;
                vectors = F32
                    .saturating_mul(n.saturating_add(1).saturating_add(r))
                    .saturating_mul(d);
                if let RuleKind::Iterate { .. } = kind {
                    vectors = vectors.saturating_add(F64.saturating_mul(r).saturating_mul(d));
                }
                let pieces = if data.victim { 2 } else { r };
                forged = F32
                    .saturating_mul(2)
                    .saturating_mul(data.equivocators)
                    .saturating_mul(pieces)
                    .saturating_mul(d)
                    .saturating_add(
                        F32.saturating_mul(data.lying_owners)
                            .saturating_mul(r)
                            .saturating_mul(d),
                    );
            }
        }
        Algorithm::RingSum => {
            messages = match data {
                Some(_) => RING_DATA_PER_MESSAGE.saturating_mul(n2),
                None => RING_PER_RANK.saturating_mul(n),
            };
            if let Some(data) = data {
                // Every rank's working buffer, which becomes its result.
                vectors = F32.saturating_mul(n).saturating_mul(data.d);
            }
        }
    }
    (messages, vectors, statistics, forged)
}

/// The largest of `algorithms`' peaks plus what every one of them shares (`common`).
fn largest_of(
    n: u128,
    algorithms: &[Algorithm],
    agreement: Agreement,
    kind: RuleKind,
    data: Option<Data>,
    common: u128,
) -> MemoryEstimate {
    algorithms
        .iter()
        .map(|&a| {
            let (m, v, s, f) = algorithm_peak(n, a, agreement, kind, data);
            MemoryEstimate::from_parts(m, v.saturating_add(common), s, f)
        })
        .max_by_key(MemoryEstimate::total)
        .unwrap_or_else(|| MemoryEstimate::from_parts(0, common, 0, 0))
}

/// The estimated peak of [`predict`](crate::predict())`(label, base, n, bytes, f, rule)` with
/// `base.agreement == agreement`: timing mode carries sizes only, so `bytes` does not matter;
/// the world size, `f` (sharded `r = 2f + 1`), the agreement and the rule do.
pub fn prediction_peak(
    n: usize,
    f: usize,
    agreement: Agreement,
    rule: Option<&dyn Aggregator>,
) -> MemoryEstimate {
    let mut algorithms = vec![Algorithm::Gather, Algorithm::Sharded { replicas: 1 }];
    if f > 0 {
        algorithms.push(Algorithm::tolerant(n, f));
    }
    algorithms.push(Algorithm::RingSum);
    // Without a rule, predictions time the mean (or a median under Enforce): coordinate-wise.
    largest_of(
        n as u128,
        &algorithms,
        agreement,
        RuleKind::of(rule),
        None,
        0,
    )
}

impl Scenario {
    /// The estimated peak of a data-mode run of this scenario: [`DataSet::generate`] with `d`
    /// coordinates, [`DataSet::reference`] and [`Scenario::run_data`] of each of `algorithms`
    /// in turn (with their [`Reference::check`], [`Run::silent_split`] and
    /// [`Run::divergence`]), the run of `rule`.
    ///
    /// [`DataSet::generate`]: crate::DataSet::generate
    /// [`DataSet::reference`]: crate::DataSet::reference
    /// [`Reference::check`]: crate::Reference::check
    /// [`Run::silent_split`]: crate::Run::silent_split
    /// [`Run::divergence`]: crate::Run::divergence
    pub fn data_peak(
        &self,
        d: usize,
        algorithms: &[Algorithm],
        rule: &dyn Aggregator,
    ) -> MemoryEstimate {
        let n = self.ranks as u128;
        let d = d as u128;
        let kind = RuleKind::of(Some(rule));
        let adversary = &self.adversary;
        let data = Data {
            d,
            equivocators: if adversary.equivocate_inputs {
                adversary.byzantine_inputs as u128
            } else {
                0
            },
            victim: adversary.equivocation_victim.is_some(),
            lying_owners: adversary.lying_owners as u128,
        };
        let nd = F32.saturating_mul(n).saturating_mul(d);
        // The inputs and the reference, kept through every algorithm, and the rule's scratch
        // (one aggregation at a time).
        let scratch = match kind {
            RuleKind::CoordinateWise => 0,
            RuleKind::Select => F64.saturating_mul(d),
            RuleKind::Mix => nd.saturating_add(F64.saturating_mul(d)),
            RuleKind::Iterate { .. } => F64.saturating_mul(3).saturating_mul(d),
        };
        // A rule of a 16-bit type runs on a copy of its inputs and output in the type.
        let narrow = match self.dtype {
            DType::BF16 | DType::F16 => 2u128.saturating_mul(n.saturating_add(1)).saturating_mul(d),
            DType::F32 | DType::F64 => 0,
        };
        let common = nd
            .saturating_add(F32.saturating_mul(d))
            .saturating_add(scratch)
            .saturating_add(narrow);
        largest_of(n, algorithms, self.agreement, kind, Some(data), common)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Adversary, Network, Preset};

    const GIB: u64 = 1 << 30;

    fn rule(name: &str, f: usize) -> Box<dyn Aggregator> {
        byzcoll_aggregators::by_name(name, f).expect("a known rule")
    }

    #[test]
    fn predictions_grow_with_the_square_of_the_world() {
        let small = prediction_peak(1000, 0, Agreement::Detect, None);
        let large = prediction_peak(2000, 0, Agreement::Detect, None);
        assert_eq!(small.largest(), Footprint::Messages);
        let ratio = (large.total() - BASE as u64) as f64 / (small.total() - BASE as u64) as f64;
        assert!((ratio - 4.0).abs() < 1e-9, "{ratio}");
        // Sharded r = 1 is the largest: (140 + 320) bytes per message of a step.
        assert_eq!(small.total(), BASE as u64 + 460 * 1000 * 1000);
        // f = 3 adds sharded r = 7.
        let tolerant = prediction_peak(1000, 3, Agreement::Detect, None);
        assert_eq!(
            tolerant.total(),
            BASE as u64 + (140 + 7 * 320) * 1000 * 1000
        );
        // Enforce adds its echo steps.
        let enforce = prediction_peak(1000, 0, Agreement::Enforce, None);
        assert_eq!(enforce.total() - small.total(), 150 * 1000 * 1000);
    }

    #[test]
    fn the_issue_cases_are_above_the_default_bound_and_the_readme_ones_below() {
        // 20000 ranks: about 171 GiB for sharded r = 1 alone.
        let huge = prediction_peak(20_000, 0, Agreement::Detect, None);
        assert!(huge.total() > 170 * GIB, "{huge:?}");
        match huge.check(DEFAULT_MEMORY_BOUND) {
            Err(SimError::TooLarge {
                needed,
                bound,
                largest: Footprint::Messages,
            }) => {
                assert_eq!((needed, bound), (huge.total(), DEFAULT_MEMORY_BOUND));
            }
            other => panic!("{other:?}"),
        }
        // The README's prediction: 64 and 1024 ranks with f = 3.
        for n in [64, 1024] {
            let e = prediction_peak(n, 3, Agreement::Detect, None);
            assert!(e.check(DEFAULT_MEMORY_BOUND).is_ok(), "{n}: {e:?}");
        }
        // A million ranks, the most `--ranks` takes, saturates nothing it should not.
        let krum = rule("krum", 1);
        let most = prediction_peak(1_000_000, 499_999, Agreement::Enforce, Some(krum.as_ref()));
        assert_eq!((most.statistics, most.total()), (u64::MAX, u64::MAX));
        assert!(most.check(DEFAULT_MEMORY_BOUND).is_err());
    }

    #[test]
    fn distance_rules_in_sharded_mode_weigh_n_cubed() {
        let krum = rule("krum", 1);
        let e = prediction_peak(1000, 1, Agreement::Detect, Some(krum.as_ref()));
        assert_eq!(e.largest(), Footprint::Statistics);
        // Sharded r = 3: 17 bytes per r·n³.
        assert_eq!(e.statistics, 17 * 3 * 1_000_000_000);
        let median = rule("median", 1);
        let e = prediction_peak(1000, 1, Agreement::Detect, Some(median.as_ref()));
        assert_eq!(e.statistics, 0);
    }

    fn scenario(n: usize) -> Scenario {
        Scenario::new(n, Network::preset(Preset::Infiniband))
    }

    #[test]
    fn data_mode_counts_the_copies_of_the_inputs() {
        let median = rule("median", 0);
        let all = [
            Algorithm::Gather,
            Algorithm::Sharded { replicas: 1 },
            Algorithm::RingSum,
        ];
        // One rank of 2^28 coordinates (1 GiB): inputs, reference, the owner's result, the
        // combined shard and the output: 5 GiB, above the default bound.
        let d = 1 << 28;
        let e = scenario(1).data_peak(d, &all, median.as_ref());
        assert_eq!(e.vectors, 5 * GIB);
        assert_eq!(e.largest(), Footprint::Vectors);
        assert!(e.check(DEFAULT_MEMORY_BOUND).is_err());
        // Gather alone: inputs, reference and output.
        let e = scenario(1).data_peak(d, &[Algorithm::Gather], median.as_ref());
        assert_eq!(e.vectors, 3 * GIB);
        assert!(e.check(DEFAULT_MEMORY_BOUND).is_ok());
        // The README's run: 1024 ranks of 4096 coordinates, every algorithm, f = 3. Sharded
        // r = 7 weighs most: its 7·n² pieces and results (2.3 GiB measured).
        let median = rule("median", 3);
        let mut all = all.to_vec();
        all.push(Algorithm::tolerant(1024, 3));
        let e = scenario(1024).data_peak(4096, &all, median.as_ref());
        assert_eq!(e.largest(), Footprint::Messages);
        assert!(e.check(DEFAULT_MEMORY_BOUND).is_ok(), "{e:?}");
    }

    #[test]
    fn rounds_keep_little_besides_one_run() {
        let median = rule("median", 1);
        let one = scenario(1000).data_peak(16, &[Algorithm::Gather], median.as_ref());
        let many = one.with_rounds(1000, 10_000);
        assert_eq!(many.total() - one.total(), 64 * 1000 + 512 * 10_000);
        assert_eq!(many.largest(), one.largest());
        let most = one.with_rounds(usize::MAX, usize::MAX);
        assert_eq!(most.total(), u64::MAX);
    }

    #[test]
    fn equivocation_to_every_destination_costs_a_vector_each() {
        let median = rule("median", 10);
        let mut s = scenario(32);
        s.adversary = Adversary {
            byzantine_inputs: 10,
            equivocate_inputs: true,
            ..Adversary::default()
        };
        let d = 1 << 18;
        let e = s.data_peak(d, &[Algorithm::Gather], median.as_ref());
        assert_eq!(e.forged, 4 * 10 * 31 * (1 << 18));
        // One victim: two vectors per equivocator.
        s.adversary.equivocation_victim = Some(0);
        let e = s.data_peak(d, &[Algorithm::Gather], median.as_ref());
        assert_eq!(e.forged, 4 * 10 * 2 * (1 << 18));
    }
}
