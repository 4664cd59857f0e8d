//! A deterministic cluster simulator for byzcoll's collective schedules: virtual time, discrete
//! events, no threads, no sockets, no wall clock.
//!
//! It drives the schedules of `byzcoll_proto::schedule` — gather-mode robust all-reduce
//! (every rank sends its vector to every other rank), sharded robust all-reduce with `r`
//! owners per shard, and the ring SUM all-reduce — over a modelled network, at world sizes no
//! laptop can host as processes. The per-rank logic mirrors the real driver: a step ends when
//! its receives arrived or its deadline passed; a receive missing at the deadline is an
//! erasure; robust rules aggregate what arrived in rank order and check their precondition
//! against it; a shard owner that cannot aggregate sends an empty result; every rank takes the
//! coordinate-wise `Median::new((v-1)/2)` of the `v` versions of each shard.
//!
//! # Two modes
//! * **Data mode** ([`Scenario::run_data`]): messages carry real `f32` vectors (shared buffers,
//!   never copied per destination), the real aggregators run, and [`Reference::check`] compares
//!   every honest rank's result with the gather-mode reference computed directly from all
//!   inputs.
//! * **Timing mode** ([`Scenario::run_timing`], [`predict()`]): only sizes travel; it predicts
//!   completion times for vectors up to gigabytes.
//!
//! # The model
//! * **Network** ([`Network`]): a message of `B` bytes costs `α + B/β`. Each rank has one NIC
//!   that transmits its messages one after the other at `β_inj` and receives messages one after
//!   the other at `β_inj`, in order of head arrival (cut-through: a message's reception
//!   overlaps its transmission, so one message on an idle path takes exactly `α + B/β`). A
//!   rank transmits a step's sends in the schedule's order rotated to start at its nearest
//!   successor (pairwise-exchange order), so that `n` ranks sending to everyone do not all
//!   start with the same receiver.
//! * **Steps** are bulk-synchronous per rank, as in the driver: a rank starts step `k+1` when
//!   step `k` has all its receives and its sends have left the NIC, or at step `k`'s deadline,
//!   plus the local computation charged by [`Compute`]. Messages that reach a rank before it
//!   posts the matching step wait in its mailbox; messages for a step that has ended are late.
//! * **Quorum steps** ([`Scenario::stragglers`], the runtime's `BYZCOLL_STRAGGLERS`): where
//!   the round allows `s` stragglers, its input step ends once all but `s` inputs are in plus
//!   the [`Scenario::grace`] (as the transport kit's mailbox ends it); the receives still open
//!   then are `Arrival::Late`, and the round's later steps do not wait for their sends.
//! * **Faults** ([`Faults`], [`Adversary`]): message loss and random extra latency, ranks that
//!   start late or crash, Byzantine inputs forged by an
//!   [`Attack`](byzcoll_aggregators::attacks::Attack), and shard owners that lie (sign flip,
//!   NaN, or different garbage to every destination).
//! * **Rounds** ([`Scenario::run_rounds`]): calls in a row, each rank starting a round when it
//!   finished the one before, on NICs still busy with what it queued; slow ranks ([`Slow`])
//!   start each round a delay late drawn from a [`Delay`] distribution, dying ranks
//!   ([`Deaths`]) are silent from one round until they rejoin. [`Rounds::check`] says whether
//!   the honest ranks agreed and each round's time followed the quorum rather than the
//!   slowest rank.
//!
//! # Limits
//! The fabric between NICs is ideal (full bisection, no congestion control, no packet loss
//! other than injected, no switch buffering limits); there is no per-message CPU overhead, no
//! message header, no flow control (a sender never waits for a receiver), and a NIC serves one
//! message at a time instead of interleaving flows. Gather and sharded steps post up to
//! `r·(n-1)` messages per rank where the ring posts one, so without a per-message cost their
//! small-vector times are optimistic (latency-bound ring steps are not). Local computation is a
//! throughput, not a cache model. Timing-mode predictions are for the schedules, not for a
//! particular transport implementation.
//!
//! Every simulated rank lives in one process and posts a whole step at once, so memory grows
//! as `O(n²)` messages per step (`O(r·n³)` for sharded rounds of distance-based rules, `O(n·d)`
//! for data mode's vectors): [`prediction_peak`] and [`Scenario::data_peak`] estimate a run's
//! peak from its parameters, and [`MemoryEstimate::check`] refuses it before it allocates.
//!
//! ```
//! use byzcoll_sim::{Algorithm, DataSet, Network, Preset, Scenario, Verdict};
//!
//! let scenario = Scenario::new(16, Network::preset(Preset::Infiniband));
//! let rule = byzcoll_aggregators::by_name("median", 2).unwrap();
//! let data = DataSet::generate(&scenario, 100).unwrap();
//! let reference = data.reference(rule.as_ref());
//! let run = scenario.run_data(Algorithm::tolerant(16, 2), &data, rule.as_ref()).unwrap();
//! assert_eq!(reference.check(&run), Ok(Verdict::Exact));
//! assert!(run.time > 0.0);
//! ```

mod audits;
mod data;
mod engine;
mod faults;
mod memory;
mod model;
mod predict;
mod programs;
mod robust;
mod rounds;

use std::fmt;
use std::sync::Arc;

use byzcoll_aggregators::{AggError, Aggregator, DType};
use byzcoll_proto::round::{Shape, Spec};
use byzcoll_proto::{
    Agreement, AgreementReport, Error, Grace, PeerFault, Rank, Replicas, Stragglers,
};

pub use audits::{AuditRound, AuditRun, AuditSim, Lying, ALL_CHECK, CHECKERS};
pub use data::{DataSet, Mismatch, Reference, Verdict};
pub use faults::{
    attack_by_name, Adversary, Crash, Deaths, Delay, Faults, Lie, Slow, Stall, ATTACKS, MAX_DELAY,
    MAX_SIGMA,
};
pub use memory::{prediction_peak, Footprint, MemoryEstimate, DEFAULT_MEMORY_BOUND};
pub use model::{Compute, Network, Preset};
pub use predict::{format_bytes, format_time, predict, prediction_table, sweep_sizes, Prediction};
pub use rounds::{Named, RoundOutcome, Rounds, MAX_ROUNDS, TIME_TOLERANCE};

use data::Plane;
use engine::Start;
use programs::{Common, Ring};
use robust::Robust;

/// The largest world data mode runs: buffers are addressed by 32-bit ids, and sharded and ring
/// runs create about `2n²` of them.
pub const MAX_DATA_RANKS: usize = 32_768;

/// Why a simulation cannot run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// A parameter is out of range or malformed; the message names it.
    #[error("invalid simulation: {0}")]
    InvalidConfig(String),
    /// The rule's precondition fails for the world size (e.g. `n <= 2f` for the median).
    #[error(transparent)]
    Precondition(AggError),
    /// The algorithm cannot run this rule.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A rank received a message its schedule does not expect: the schedules disagree. A bug in
    /// byzcoll, never a simulated fault.
    #[error("schedule mismatch: {0}")]
    Schedule(String),
    /// A rank waits for a message that never comes and its step has no deadline
    /// (`timeout = ∞` with lost messages or crashed peers).
    #[error("stuck: {0}")]
    Stuck(String),
    /// The simulation's estimated peak ([`MemoryEstimate`]) is above the caller's bound:
    /// lower the parameter `largest` grows with, or allow more memory.
    #[error(
        "the simulation needs about {} of memory, above the bound of {}; most of it is {largest}",
        format_gib(*needed),
        format_gib(*bound)
    )]
    TooLarge {
        /// The estimated peak, in bytes.
        needed: u64,
        /// The bound, in bytes.
        bound: u64,
        /// The part of the estimate that weighs most.
        largest: Footprint,
    },
}

/// `4 GiB`, `11 GiB`, `5.0 GiB`, `0.50 GiB`: bytes in GiB, whole when exact, to two
/// significant digits below 10.
pub fn format_gib(bytes: u64) -> String {
    const GIB: u64 = 1 << 30;
    let gib = bytes as f64 / GIB as f64;
    if bytes.is_multiple_of(GIB) || gib >= 10.0 {
        format!("{gib:.0} GiB")
    } else if gib >= 1.0 {
        format!("{gib:.1} GiB")
    } else {
        format!("{gib:.2} GiB")
    }
}

/// A collective the simulator runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Gather-mode robust all-reduce: direct all-to-all of whole vectors, then the rule.
    Gather,
    /// Sharded robust all-reduce with `replicas` owners per shard.
    Sharded {
        /// Owners per shard, `1..=n`.
        replicas: usize,
    },
    /// Ring SUM all-reduce (reduce-scatter then all-gather, `2(n-1)` steps): the non-robust
    /// baseline.
    RingSum,
}

impl Algorithm {
    /// Sharded mode with `2f + 1` owners per shard (at most `n`): safe with `f` lying owners.
    pub fn tolerant(n: usize, f: usize) -> Algorithm {
        Algorithm::Sharded {
            replicas: f.saturating_mul(2).saturating_add(1).min(n.max(1)),
        }
    }

    fn seed_salt(&self) -> u64 {
        match self {
            Algorithm::Gather => 1,
            Algorithm::Sharded { replicas } => 2 + ((*replicas as u64) << 8),
            Algorithm::RingSum => 3,
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Algorithm::Gather => f.write_str("gather"),
            Algorithm::Sharded { replicas } => write!(f, "sharded r={replicas}"),
            Algorithm::RingSum => f.write_str("ring SUM"),
        }
    }
}

/// What a rank is in a scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Follows the protocol (possibly late); its result is checked.
    Honest,
    /// Forges its input or lies as a shard owner.
    Byzantine,
    /// Crashes at some step.
    Crashed,
}

/// How a rank's part in a run ended.
#[derive(Debug)]
pub enum RankResult {
    /// It completed: its result in data mode, `None` in timing mode.
    Done(Option<Arc<[f32]>>),
    /// It failed with the error the real driver would return.
    Failed(Error),
    /// It crashed (injected).
    Crashed,
}

/// One rank's view of a run.
#[derive(Debug)]
pub struct RankOutcome {
    /// What the rank is.
    pub role: Role,
    /// Virtual time at which it finished (completed, failed or crashed), in seconds.
    pub finish: f64,
    /// How it ended.
    pub result: RankResult,
    /// Peers it treated as erasures (first fault per peer), as in the driver's round report.
    pub faults: Vec<PeerFault>,
    /// What it would log as warnings, e.g. an owned shard it could not aggregate.
    pub warnings: Vec<String>,
    /// What the cross-check found (robust rounds under [`Agreement::Detect`] that ended
    /// well; a rank out of step fails with [`Error::Disagreement`] instead).
    pub agreement: Option<AgreementReport>,
}

/// Counters of one run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Messages posted.
    pub messages: u64,
    /// Bytes transmitted.
    pub bytes: u64,
    /// Messages lost (injected).
    pub lost: u64,
    /// Messages that arrived after their step had ended.
    pub late: u64,
    /// Receives missing when their step ended, over all ranks.
    pub erasures: u64,
}

/// The result of running one algorithm in a scenario.
#[derive(Debug)]
pub struct Run {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// Virtual completion time in seconds: when the last honest rank finished.
    pub time: f64,
    /// Every rank's outcome, indexed by rank.
    pub ranks: Vec<RankOutcome>,
    /// Counters.
    pub stats: Stats,
    /// Whether nothing went wrong that could change a result: no forged input, no lying owner
    /// involved, no erasure, no owner that could not aggregate.
    pub clean: bool,
    /// The inputs each robust round was allowed to go without for their lateness (`s`,
    /// [`Scenario::stragglers`] resolved for this algorithm and world).
    pub stragglers: usize,
}

impl Run {
    /// Honest ranks that failed, with their errors.
    pub fn failures(&self) -> impl Iterator<Item = (Rank, &Error)> + '_ {
        self.ranks
            .iter()
            .enumerate()
            .filter(|(_, o)| o.role == Role::Honest)
            .filter_map(|(r, o)| match &o.result {
                RankResult::Failed(e) => Some((r, e)),
                _ => None,
            })
    }
}

/// A simulated cluster: world size, network, computation rates, faults and adversary.
#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    /// Number of ranks `n`.
    pub ranks: usize,
    /// The network.
    pub network: Network,
    /// Local computation rates.
    pub compute: Compute,
    /// Network and crash faults.
    pub faults: Faults,
    /// Byzantine ranks.
    pub adversary: Adversary,
    /// Per-step deadline in virtual seconds (the driver's `BYZCOLL_TIMEOUT_MS`; 30 s by
    /// default); `f64::INFINITY` for none.
    pub timeout: f64,
    /// Seed of every random choice: inputs, losses, delays.
    pub seed: u64,
    /// The robust rounds' cross-check ([`Agreement::Detect`] by default, as in the runtime):
    /// one more step, whose findings land in each rank's [`RankOutcome::agreement`].
    pub agreement: Agreement,
    /// The inputs a gather-mode round may go without for their lateness alone, as the
    /// runtime's `BYZCOLL_STRAGGLERS` (by default `auto`, as there): its input step ends once all but `s` inputs are in plus
    /// [`Scenario::grace`], the rest are late. Sharded and ring runs allow none (`auto` is 0
    /// there, a count is refused), and so does `auto` under [`Agreement::Off`], as in the
    /// runtime.
    pub stragglers: Stragglers,
    /// How long a quorum step waits past its quorum ([`Grace::DEFAULT`]: at least 1 ms, and as
    /// long as the quorum took to form), in virtual time.
    pub grace: Grace,
    /// The vectors' element type (`f32` by default): the bytes every message carries follow its
    /// width, so a `bf16` run times half the wire of an `f32` one. Data mode carries `f32`, `bf16`
    /// and `f16` vectors (every value one of the type, held as the `f32` that is exactly it;
    /// each rule runs in the type, each sum is rounded to it once) and refuses `f64`; its
    /// [`DataSet`] must be of the same type ([`DataSet::generate`] takes this one).
    pub dtype: DType,
}

impl Scenario {
    /// `ranks` ranks on `network`, free computation, no faults, a 30 s step deadline, seed 0.
    pub fn new(ranks: usize, network: Network) -> Scenario {
        Scenario {
            ranks,
            network,
            compute: Compute::default(),
            faults: Faults::default(),
            adversary: Adversary::default(),
            timeout: 30.0,
            seed: 0,
            agreement: Agreement::Detect,
            stragglers: Stragglers::default(),
            grace: Grace::DEFAULT,
            dtype: DType::F32,
        }
    }

    /// What `rank` is in this scenario's first round (a rank dying there, or crashing at some
    /// step, is [`Role::Crashed`]).
    pub fn role(&self, rank: Rank) -> Role {
        let dead =
            self.faults.deaths.is_some_and(|d| d.dead_in(0)) && self.dying_ranks().contains(&rank);
        self.role_in(rank, self.faults.crashed(rank) || dead)
    }

    fn role_in(&self, rank: Rank, crashed: bool) -> Role {
        let n = self.ranks;
        if crashed {
            Role::Crashed
        } else if self.adversary.forges_input(rank, n) || self.adversary.lies_as_owner(rank, n) {
            Role::Byzantine
        } else {
            Role::Honest
        }
    }

    /// The slow ranks ([`Faults::slow`]): the first ones, `0..K`.
    pub fn slow_ranks(&self) -> std::ops::Range<Rank> {
        0..self.faults.slow.map_or(0, |s| s.ranks).min(self.ranks)
    }

    /// The ranks that die ([`Faults::deaths`]): the last honest ones, just below the Byzantine
    /// ones (the last `max(byzantine_inputs, lying_owners)` ranks).
    pub fn dying_ranks(&self) -> std::ops::Range<Rank> {
        let end = self.ranks.saturating_sub(
            self.adversary
                .byzantine_inputs
                .max(self.adversary.lying_owners),
        );
        end.saturating_sub(self.faults.deaths.map_or(0, |d| d.ranks))..end
    }

    /// This scenario without its slow and dying ranks: the healthy round that
    /// [`Rounds::check`] compares round times with.
    pub fn healthy(&self) -> Scenario {
        let mut healthy = self.clone();
        healthy.faults.slow = None;
        healthy.faults.deaths = None;
        healthy
    }

    /// Checks every parameter.
    ///
    /// # Errors
    /// [`SimError::InvalidConfig`] naming the first bad one.
    pub fn validate(&self) -> Result<(), SimError> {
        if self.ranks == 0 {
            return Err(SimError::InvalidConfig(
                "a world needs at least 1 rank".into(),
            ));
        }
        if self.ranks > u32::MAX as usize / 4 {
            return Err(SimError::InvalidConfig(format!(
                "{} ranks is more than the simulator supports",
                self.ranks
            )));
        }
        self.network.validate()?;
        self.compute.validate()?;
        self.faults.validate(self.ranks)?;
        self.adversary.validate(self.ranks)?;
        if self.timeout.is_nan() || self.timeout <= 0.0 || self.timeout < self.network.alpha {
            return Err(SimError::InvalidConfig(format!(
                "step deadline {} s must be positive and at least the latency alpha = {} s",
                self.timeout, self.network.alpha
            )));
        }
        if self.timeout.is_infinite()
            && (self.faults.loss > 0.0
                || !self.faults.crashes.is_empty()
                || self.faults.deaths.is_some())
        {
            return Err(SimError::InvalidConfig(
                "lost messages and crashed or dead ranks need a finite step deadline, or ranks \
                 wait forever"
                    .into(),
            ));
        }
        if self.grace.min.as_secs_f64() > MAX_DELAY {
            return Err(SimError::InvalidConfig(format!(
                "grace of {} s is longer than a day",
                self.grace.min.as_secs_f64()
            )));
        }
        let byzantine = self
            .adversary
            .byzantine_inputs
            .max(self.adversary.lying_owners);
        let slow = self.slow_ranks().len();
        if slow > 0 && slow + byzantine > self.ranks {
            return Err(SimError::InvalidConfig(format!(
                "{slow} slow ranks (the first) and {byzantine} Byzantine ranks (the last) are \
                 more than the {} ranks",
                self.ranks
            )));
        }
        if let Some(deaths) = self.faults.deaths {
            if slow + deaths.ranks + byzantine > self.ranks
                || deaths.ranks + byzantine >= self.ranks
            {
                return Err(SimError::InvalidConfig(format!(
                    "{} dying ranks (the last honest ones), {slow} slow ranks (the first) and \
                     {byzantine} Byzantine ranks (the last) do not fit in {} ranks with one \
                     rank alive",
                    deaths.ranks, self.ranks
                )));
            }
        }
        Ok(())
    }

    /// Runs `algorithm` carrying `data`'s vectors through the real aggregators.
    ///
    /// # Errors
    /// [`SimError::InvalidConfig`] for a bad parameter or data of another world size,
    /// [`SimError::Precondition`] when `rule`'s precondition fails for the world size,
    /// [`SimError::Unsupported`] for sharded mode with a rule that is not coordinate-wise.
    /// Failures of single ranks (too many faults, a lost shard) are in the [`Run`].
    pub fn run_data(
        &self,
        algorithm: Algorithm,
        data: &DataSet,
        rule: &dyn Aggregator,
    ) -> Result<Run, SimError> {
        self.check_data(data)?;
        self.run_one(algorithm, data.d(), Some(rule), Some(data))
    }

    /// Whether `data` fits this world and data mode holds it.
    fn check_data(&self, data: &DataSet) -> Result<(), SimError> {
        data::check_dtype(self.dtype)?;
        if data.dtype() != self.dtype {
            return Err(SimError::InvalidConfig(format!(
                "data of {} values for a scenario of {} (DataSet::generate takes the \
                 scenario's type, DataSet::typed makes explicit inputs one)",
                data.dtype().name(),
                self.dtype.name()
            )));
        }
        if data.ranks() != self.ranks {
            return Err(SimError::InvalidConfig(format!(
                "data for {} ranks in a world of {}",
                data.ranks(),
                self.ranks
            )));
        }
        if self.ranks > MAX_DATA_RANKS {
            return Err(SimError::InvalidConfig(format!(
                "data mode supports up to {MAX_DATA_RANKS} ranks (every message is a stored \
                 chunk); use timing mode for {}",
                self.ranks
            )));
        }
        Ok(())
    }

    /// Runs `algorithm` with vectors of `d` coordinates of [`Scenario::dtype`], carrying sizes
    /// only. `rule`, when given, decides from the number of arrived inputs whether a rank or
    /// shard owner can aggregate, as in data mode.
    ///
    /// # Errors
    /// As [`Scenario::run_data`].
    pub fn run_timing(
        &self,
        algorithm: Algorithm,
        d: usize,
        rule: Option<&dyn Aggregator>,
    ) -> Result<Run, SimError> {
        self.run_one(algorithm, d, rule, None)
    }

    /// The first round of [`Scenario::rounds`], as a whole [`Run`].
    fn run_one(
        &self,
        algorithm: Algorithm,
        d: usize,
        rule: Option<&dyn Aggregator>,
        data: Option<&DataSet>,
    ) -> Result<Run, SimError> {
        let mut first = None;
        self.rounds(algorithm, 1, d, rule, data, |_, run| first = Some(run))?;
        first.ok_or_else(|| SimError::Schedule("a run of one round ran none".into()))
    }

    /// `s` for `algorithm` of `rule` in this world ([`Scenario::stragglers`]), as the runtime
    /// resolves it ([`byzcoll_proto::round::stragglers_in`]): `auto` or a count checked
    /// against the rule's precondition, and in sharded mode against the owners per shard;
    /// `auto` is 0 in ring runs.
    ///
    /// # Errors
    /// [`SimError::InvalidConfig`] for a count the rule's precondition or the owners refuse
    /// (or of `n` or more), [`SimError::Unsupported`] for a count above 0 where the round
    /// cannot end a step early (ring runs; sharded runs under `Enforce` or of a global rule).
    pub fn stragglers_in(
        &self,
        algorithm: Algorithm,
        rule: &dyn Aggregator,
    ) -> Result<usize, SimError> {
        let shape = match algorithm {
            Algorithm::Gather => Shape::Gather,
            Algorithm::Sharded { replicas } => Shape::Sharded(Replicas::Exactly(replicas)),
            other => {
                return match self.stragglers.requested(self.agreement) {
                    None | Some(0) => Ok(0),
                    Some(s) => Err(SimError::Unsupported(format!(
                        "{s} stragglers allowed in {other}: ring SUM is not robust and has no \
                         quorum steps; allow none or auto, or run gather or sharded mode"
                    ))),
                };
            }
        };
        let requested = self.stragglers.requested(self.agreement);
        byzcoll_proto::round::stragglers_in(rule, self.ranks, shape, self.agreement, requested)
            .map_err(|e| match e {
                Error::InvalidUsage(why) => SimError::InvalidConfig(why),
                other => SimError::Unsupported(other.to_string()),
            })
    }

    /// One round of `algorithm`, rank `r` starting as `starts[r]` says; round `round` of a
    /// series (its random draws). Returns the run and where each rank's NIC is free again.
    #[allow(clippy::too_many_arguments)]
    fn run_round(
        &self,
        algorithm: Algorithm,
        d: usize,
        rule: Option<&dyn Aggregator>,
        plane: Option<Plane>,
        starts: &[Start],
        round: usize,
        laggards: &[Vec<Rank>],
    ) -> Result<(Run, Vec<Start>), SimError> {
        self.validate()?;
        let n = self.ranks;
        if d == 0 {
            return Err(SimError::InvalidConfig(
                "d = 0 coordinates: nothing to reduce".into(),
            ));
        }
        if let Some(rule) = rule {
            if algorithm != Algorithm::RingSum {
                rule.check(n).map_err(SimError::Precondition)?;
            }
        }
        if let Algorithm::Sharded { replicas } = algorithm {
            if replicas == 0 || replicas > n {
                return Err(SimError::InvalidConfig(format!(
                    "sharded mode with {replicas} replicas in a world of {n}: need 1 <= r <= n"
                )));
            }
        }
        let params = engine::Params {
            network: &self.network,
            compute: &self.compute,
            faults: &self.faults,
            timeout: self.timeout,
            seed: match round {
                0 => mix(self.seed, algorithm.seed_salt()),
                k => mix(mix(self.seed, algorithm.seed_salt()), k as u64),
            },
        };
        // Timing mode without a rule: the mean's precondition (none) decides nothing.
        let any = byzcoll_aggregators::by_name("mean", 0).map_err(SimError::Precondition)?;
        let stragglers = self.stragglers_in(algorithm, rule.unwrap_or(any.as_ref()))?;
        let common = Common::new(n, d, self.dtype.size(), plane);
        let robust = |common, shape| {
            let spec = |me| Spec {
                me,
                n,
                d,
                elem: self.dtype.size(),
                shape,
                agreement: self.agreement,
                // In virtual time, as the grace is (`Duration::MAX`: none).
                timeout: std::time::Duration::try_from_secs_f64(self.timeout)
                    .unwrap_or(std::time::Duration::MAX),
                stragglers,
                grace: self.grace,
            };
            Robust::new(
                common,
                rule.unwrap_or(any.as_ref()),
                &self.adversary,
                spec,
                laggards,
            )
        };
        let (ends, stats, common, reports) = match algorithm {
            Algorithm::Gather | Algorithm::Sharded { .. } => {
                let shape = match algorithm {
                    Algorithm::Sharded { replicas } => Shape::Sharded(Replicas::Exactly(replicas)),
                    _ => Shape::Gather,
                };
                let f = rule.unwrap_or(any.as_ref()).byzantine();
                byzcoll_proto::round::check_agreement(self.agreement, shape, n, f).map_err(
                    |e| match e {
                        Error::InvalidUsage(why) => SimError::InvalidConfig(why),
                        other => SimError::Unsupported(format!("{algorithm}: {other}")),
                    },
                )?;
                if self.agreement == Agreement::Enforce {
                    // Every simulated rank holds its own echo trees (33 bytes a node): one,
                    // or one per owned shard.
                    let trees = match algorithm {
                        Algorithm::Sharded { replicas } => replicas,
                        _ => 1,
                    };
                    let all = byzcoll_proto::round::echo_nodes(n, f)
                        .and_then(|t| t.checked_mul(n))
                        .and_then(|t| t.checked_mul(trees))
                        .unwrap_or(usize::MAX);
                    if all > MAX_SIM_ECHO_NODES {
                        return Err(SimError::InvalidConfig(format!(
                            "Agreement::Enforce over {n} ranks with f = {f}: the simulator \
                             would hold {all} echo-tree nodes for all ranks, more than \
                             {MAX_SIM_ECHO_NODES}; simulate fewer ranks"
                        )));
                    }
                }
                let mut prog = robust(common, shape);
                let (ends, stats) = engine::run(&mut prog, starts, params)?;
                (ends, stats, prog.common, prog.reports)
            }
            Algorithm::RingSum => {
                let mut prog = Ring::new(common);
                let (ends, stats) = engine::run(&mut prog, starts, params)?;
                prog.finish();
                (ends, stats, prog.common, (0..n).map(|_| None).collect())
            }
        };
        let lying =
            matches!(algorithm, Algorithm::Sharded { .. }) && self.adversary.lying_owners > 0;
        let clean = self.adversary.byzantine_inputs == 0
            && !lying
            && stats.erasures == 0
            && common.faults.iter().all(Vec::is_empty)
            && common.warnings.iter().all(Vec::is_empty);
        let Common {
            plane,
            faults,
            warnings,
            outputs,
            ..
        } = common;
        let nics: Vec<Start> = ends
            .iter()
            .map(|end| Start {
                at: end.at,
                tx_free: end.tx_free,
                rx_free: end.rx_free,
                crash_at: None,
            })
            .collect();
        let ranks: Vec<RankOutcome> = ends
            .into_iter()
            .zip(faults.into_iter().zip(warnings))
            .zip(outputs)
            .zip(reports)
            .enumerate()
            .map(
                |(r, (((end, (faults, warnings)), output), report))| RankOutcome {
                    agreement: report.and_then(|r: byzcoll_proto::RoundReport| r.agreement),
                    role: self.role_in(r, starts[r].crash_at.is_some()),
                    finish: end.at,
                    result: match end.end {
                        engine::End::Done => RankResult::Done(
                            plane
                                .as_ref()
                                .zip(output)
                                .and_then(|(p, id)| p.store.arc(id)),
                        ),
                        engine::End::Failed(e) => RankResult::Failed(e),
                        engine::End::Crashed => RankResult::Crashed,
                    },
                    faults,
                    warnings,
                },
            )
            .collect();
        let honest = ranks.iter().filter(|o| o.role == Role::Honest);
        let time = honest
            .map(|o| o.finish)
            .reduce(f64::max)
            .or_else(|| ranks.iter().map(|o| o.finish).reduce(f64::max))
            .unwrap_or(0.0);
        let run = Run {
            algorithm,
            time,
            ranks,
            stats,
            clean,
            stragglers,
        };
        Ok((run, nics))
    }
}

impl Run {
    /// Honest ranks that ended with different results and said nothing: `None` when every
    /// honest rank that completed holds bitwise the same result, or when each of them names a
    /// difference in its cross-check ([`RankOutcome::agreement`]); otherwise what was seen.
    /// Under [`Agreement::Detect`] with `n > 3f` it is always `None` (ranks out of step fail
    /// with [`Error::Disagreement`]); under [`Agreement::Off`] a split is silent by design.
    pub fn silent_split(&self) -> Option<String> {
        let done: Vec<(Rank, &RankOutcome, &[f32])> = self
            .ranks
            .iter()
            .enumerate()
            .filter(|(_, o)| o.role == Role::Honest)
            .filter_map(|(r, o)| match &o.result {
                RankResult::Done(Some(v)) => Some((r, o, &v[..])),
                _ => None,
            })
            .collect();
        // Compared in place: no copy of the results.
        let mut distinct: Vec<&[f32]> = done.iter().map(|(_, _, v)| *v).collect();
        distinct.sort_by(|a, b| bitwise_cmp(a, b));
        distinct.dedup_by(|a, b| bitwise_cmp(a, b) == std::cmp::Ordering::Equal);
        if distinct.len() <= 1 {
            return None;
        }
        let quiet = done.iter().find(|(_, o, _)| {
            o.agreement.as_ref().is_none_or(|a| {
                a.disagreeing.is_empty()
                    && a.differing_inputs.is_empty()
                    && a.differing_versions.is_empty()
            })
        })?;
        Some(format!(
            "{}: honest ranks completed with {} different results and rank {} reported no \
             difference",
            self.algorithm,
            distinct.len(),
            quiet.0
        ))
    }
}

/// The order of the bit patterns of `a` and `b`: equal exactly when they are bitwise equal
/// (one buffer shared by several ranks compares equal without reading it).
fn bitwise_cmp(a: &[f32], b: &[f32]) -> std::cmp::Ordering {
    if std::ptr::eq(a, b) {
        return std::cmp::Ordering::Equal;
    }
    a.iter()
        .map(|x| x.to_bits())
        .cmp(b.iter().map(|x| x.to_bits()))
}

impl Run {
    /// Honest ranks that did not end alike, whether they said so or not: `None` when every
    /// honest rank completed with bitwise the same result (what [`Agreement::Enforce`]
    /// promises under synchrony), otherwise what differed.
    pub fn divergence(&self) -> Option<String> {
        let honest: Vec<(Rank, &RankOutcome)> = self
            .ranks
            .iter()
            .enumerate()
            .filter(|(_, o)| o.role == Role::Honest)
            .collect();
        let mut first: Option<(Rank, &[f32])> = None;
        for (r, o) in honest {
            match &o.result {
                RankResult::Done(Some(v)) => match first {
                    None => first = Some((r, &v[..])),
                    Some((q, w)) if bitwise_cmp(w, v) != std::cmp::Ordering::Equal => {
                        return Some(format!(
                            "{}: honest ranks {q} and {r} completed with different results",
                            self.algorithm
                        ))
                    }
                    Some(_) => {}
                },
                RankResult::Done(None) => {}
                RankResult::Failed(e) => {
                    return Some(format!("{}: honest rank {r} failed: {e}", self.algorithm))
                }
                RankResult::Crashed => {}
            }
        }
        None
    }
}

/// The most echo-tree nodes ([`Agreement::Enforce`]) a simulation holds for all its ranks
/// together: 2^25, about 1.1 GB.
const MAX_SIM_ECHO_NODES: usize = 1 << 25;

/// SplitMix64 finalizer of `seed + salt`: independent streams per algorithm.
fn mix(seed: u64, salt: u64) -> u64 {
    let mut z = seed.wrapping_add(salt.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
