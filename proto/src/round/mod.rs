//! The robust round as a sans-IO state machine: one implementation of gather, sharded (with
//! the statistic rounds of global rules), reduce-scatter, the cross-check of
//! [`Agreement::Detect`] and the echo and recovery of [`Agreement::Enforce`], executed by the
//! async host driver (`Communicator`), the simulator (virtual time) and the device path over
//! NCCL (`byzcoll_cuda::robust_all_reduce_nccl`), each with its own data plane.
//!
//! A [`Round`] never reads a clock, never awaits and never touches a socket. Its driver loops:
//!
//! 1. [`Round::step`] says what the next step sends ([`Send`]: a [`Msg`] named, not made, so
//!    each driver builds the bytes where its data lives), what it receives
//!    ([`RecvOp`]: peer, tag, exact length) and how long it may take ([`StepPlan::timeout`],
//!    counted from when the driver posts it: the round's deadlines, emitted, never read off a
//!    clock; each step waits one step timeout more than the step before, because a rank that
//!    waited out a deadline for a silent peer is that much behind the ranks that did not);
//! 2. the driver runs the step on its transport and hands the outcomes, one per receive, to
//!    [`Round::handle`] with its [`Plane`] (aggregation, digests and statistics on the data
//!    wherever it lives);
//! 3. when [`Round::step`] is `None`, [`Round::finish`] gives the [`RoundReport`] or the
//!    error.
//!
//! Everything a rank decides in a round lives here: which peers are erasures, which inputs an
//! aggregation takes (in rank order), the preconditions, owners that cannot aggregate sending
//! an empty result, the median of the owners' versions, the statistic rounds and the
//! cross-check. Drivers only move bytes and run the plane.

mod check;
mod eig;

use std::borrow::Cow;
use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;
use byzcoll_aggregators::{
    AggError, AggReport, Aggregator, DistanceIteration, DistanceMixing, DistanceSelection,
    Structure,
};

use crate::schedule::{self, chunk_range, sharded};
use crate::{Agreement, Error, Fault, PeerFault, Policy, Rank, RecvOp, Replicas, RoundReport, Tag};

pub use check::{commitment, input_digest, result_digest, Digest};
use check::{Check, Seen};

/// What a step's message carries, named so that each driver makes the bytes where its data
/// lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// This rank's whole input vector (gather mode).
    Input,
    /// Shard `s` of this rank's input ([`chunk_range`]`(d, n, s)`).
    Piece(usize),
    /// This rank's result for owned shard `s` (sharded mode, to the ranks that take it).
    Result(usize),
    /// An empty message: an owner's result for a shard it could not aggregate (receivers count
    /// it as an erasure of that owner's version).
    Empty,
    /// Bytes the round made itself: statistics, the echo, the cross-check, version requests.
    Bytes(Bytes),
    /// The BLAKE3 digest ([`Plane::commitment`]) of what [`Msg::Result`] for shard `s` would
    /// carry to this receiver: what an owner sends a taker in place of its version when
    /// versions go by digest (`r > 1` owners outside [`Agreement::Enforce`]: a taker gets one
    /// owner's version and the others' digests, `PROTOCOL.md`, "Versions by digest").
    ResultDigest(usize),
    /// The message this rank received for slot `j` ([`Round::held`]: a rank's input in
    /// gather mode, an owner's result for one of its shards in sharded mode), passed on to a
    /// rank that went without the one the ranks agreed on ([`Agreement::Enforce`]'s recovery
    /// step; the tag is `j`).
    Forward(usize),
}

/// One send of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Send {
    /// The receiver.
    pub peer: Rank,
    /// The message's tag (the shard, in sharded steps).
    pub tag: Tag,
    /// What it carries.
    pub msg: Msg,
}

/// One step of a round: its sends, its receives and how long it may take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlan {
    /// The step's name, for spans and logs.
    pub op: &'static str,
    /// The step's index in the round (every rank numbers steps alike).
    pub index: u32,
    /// What this rank sends.
    pub sends: Vec<Send>,
    /// What this rank waits for, with exact lengths.
    pub recvs: Vec<RecvOp>,
    /// How long after posting the step its receives may still arrive.
    pub timeout: Duration,
}

/// One receive's outcome, as a driver hands it back.
#[derive(Debug)]
pub enum Arrival<B> {
    /// The expected bytes arrived (the driver checked the length).
    Received(B),
    /// Nothing arrived by the deadline, or the peer is gone.
    Missing,
    /// Something unacceptable arrived; the string says what.
    Malformed(String),
}

/// Where an input or a version is, as the round names it to the plane.
#[derive(Debug)]
pub enum Src<'a, B> {
    /// This element range of this rank's own input.
    Mine(Range<usize>),
    /// A received message.
    Got(&'a B),
    /// This rank's own result for its `i`-th owned shard ([`sharded::owned`] order).
    Owned(usize),
}

impl<B> Clone for Src<'_, B> {
    fn clone(&self) -> Self {
        match self {
            Src::Mine(r) => Src::Mine(r.clone()),
            Src::Got(b) => Src::Got(b),
            Src::Owned(i) => Src::Owned(*i),
        }
    }
}

/// Where an aggregation writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dest {
    /// The caller's output (gather mode: the whole vector, written only on success).
    Output,
    /// The result of the `i`-th owned shard.
    Owned(usize),
}

/// The data side of a round: where the vectors live and what runs on them. The host driver's
/// plane works on host slices (`HostPlane` in `byzcoll-runtime`), the simulator's on its shared store, the
/// device path's on GPU memory. Every method is synchronous and deterministic.
pub trait Plane {
    /// A received message.
    type Buf;

    /// A received message's bytes on the host (statistics and cross-checks: small).
    fn host<'b>(&'b self, buf: &'b Self::Buf) -> Cow<'b, [u8]>;

    /// The digest of an input as this rank used it (XXH3-128, [`check::input_digest`]).
    fn digest(&mut self, src: Src<'_, Self::Buf>) -> Digest;

    /// A collision-resistant digest of a whole input (BLAKE3 of its bytes): what the ranks
    /// agree on under [`Agreement::Enforce`], where a sender could otherwise craft two vectors
    /// with one [`Plane::digest`].
    fn commitment(&mut self, src: Src<'_, Self::Buf>) -> Digest;

    /// Whether every element of `src` is finite.
    fn finite(&mut self, src: Src<'_, Self::Buf>) -> bool;

    /// `rule` over `inputs` (rank order) into `to`.
    ///
    /// # Errors
    /// The rule's (input indices are positions in `inputs`).
    fn aggregate(
        &mut self,
        rule: &dyn Aggregator,
        inputs: &[Src<'_, Self::Buf>],
        to: Dest,
    ) -> Result<AggReport, AggError>;

    /// The coordinate-wise median of `versions` (owner order) into shard `s` of the output
    /// (its elements `range`, or the whole output in a reduce-scatter): one version is copied,
    /// refused where it is not finite.
    ///
    /// # Errors
    /// [`AggError::NonFiniteResult`] with the coordinate within the shard.
    fn combine(
        &mut self,
        s: usize,
        range: Range<usize>,
        versions: &[Src<'_, Self::Buf>],
    ) -> Result<(), AggError>;

    /// The pairwise squared-distance table (`n × n`, `f64`) of one shard's inputs, rank order;
    /// erased inputs (`None`) count as infinitely far.
    fn distance_table(&mut self, inputs: &[Option<Src<'_, Self::Buf>>]) -> Vec<f64>;

    /// A selection rule's owned shard `i`: `selection` finishes over the `selected` inputs.
    ///
    /// # Errors
    /// The rule's; [`AggError::Backend`] where the plane cannot run it.
    fn finish_selected(
        &mut self,
        selection: &dyn DistanceSelection,
        inputs: &[Option<Src<'_, Self::Buf>>],
        selected: &[usize],
        i: usize,
    ) -> Result<(), AggError>;

    /// Starts the estimate of an iterative rule on owned shard `i`: the median of the present
    /// inputs.
    ///
    /// # Errors
    /// The median's; [`AggError::Backend`] where the plane cannot run iterative rules.
    fn estimate_start(
        &mut self,
        i: usize,
        inputs: &[Option<Src<'_, Self::Buf>>],
    ) -> Result<(), AggError>;

    /// The squared distances (`n`, rank order; erased or non-finite inputs: `+inf`) from each
    /// input of owned shard `i` to its estimate.
    fn estimate_distances(&mut self, i: usize, inputs: &[Option<Src<'_, Self::Buf>>]) -> Vec<f64>;

    /// One step of the estimate of owned shard `i` with coefficients `a`, `w`; returns the
    /// squared change and the squared size of the previous estimate.
    fn estimate_step(
        &mut self,
        i: usize,
        inputs: &[Option<Src<'_, Self::Buf>>],
        a: f64,
        w: &[f64],
    ) -> (f64, f64);

    /// Writes the estimate of owned shard `i` as its result.
    ///
    /// # Errors
    /// Why it cannot (the estimate is not finite).
    fn estimate_finish(&mut self, i: usize) -> Result<(), String>;

    /// A mixing rule's owned shard `i`: mixes the inputs with `neighbours`, then applies the
    /// coordinate-wise `inner` rule.
    ///
    /// # Errors
    /// The rule's.
    fn mix(
        &mut self,
        mixing: &dyn DistanceMixing,
        inputs: &[Src<'_, Self::Buf>],
        neighbours: &[Option<Vec<usize>>],
        i: usize,
    ) -> Result<(), AggError>;

    /// The BLAKE3 digest of the output (all-reduce), what the cross-check compares.
    fn result_digest(&mut self) -> Digest;

    /// The BLAKE3 digest ([`check::commitment`] of its bytes) of shard `s` of the output
    /// (its elements `range`) as [`Plane::combine`] wrote it.
    fn output_digest(&mut self, s: usize, range: Range<usize>) -> Digest;
}

/// What a round computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Gather mode: every rank aggregates every rank's vector.
    Gather,
    /// Sharded all-reduce with `r` owners per shard (the [`Replicas`], not
    /// yet checked).
    Sharded(Replicas),
    /// Sharded reduce-scatter: each rank takes only its own shard.
    ReduceScatter(Replicas),
}

impl Shape {
    /// The shape of an all-reduce that moves data as `policy` says.
    pub fn all_reduce(policy: Policy) -> Shape {
        match policy {
            Policy::Gather => Shape::Gather,
            Policy::Sharded(replicas) => Shape::Sharded(replicas),
        }
    }
}

/// What every rank of a round must agree on, plus who this rank is.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// This rank.
    pub me: Rank,
    /// The world size.
    pub n: usize,
    /// Elements per vector.
    pub d: usize,
    /// Bytes per element.
    pub elem: usize,
    /// What the round computes.
    pub shape: Shape,
    /// The agreement policy ([`check_agreement`] says where [`Agreement::Enforce`] runs).
    pub agreement: Agreement,
    /// The step timeout of the communicator.
    pub timeout: Duration,
}

/// What a global rule needs exchanged in sharded mode.
#[derive(Clone, Copy)]
enum Statistics<'a> {
    None,
    Select(&'a dyn DistanceSelection),
    Iterate(&'a dyn DistanceIteration),
    Mix(&'a dyn DistanceMixing),
}

/// Where the round is: the step whose outcomes it waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Gather,
    Scatter,
    /// A statistic round; `k` counts iterations of an iterative rule.
    Statistic {
        k: usize,
    },
    Versions,
    /// Versions by digest: each taker asks for the versions whose digest differs from the
    /// one it holds.
    Request,
    /// Versions by digest: the owners send the versions asked for.
    Resend,
    /// A relay step of [`Agreement::Enforce`]'s echo.
    Echo,
    /// [`Agreement::Enforce`]'s recovery step.
    Recover,
    Check,
    Done,
}

/// One rank's robust round (see the module docs). `B` is the driver's received-message type.
pub struct Round<'r, B> {
    spec: Spec,
    rule: &'r dyn Aggregator,
    /// Owners per shard (0 in gather mode).
    r: usize,
    statistics: Statistics<'r>,
    phase: Phase,
    plan: Option<StepPlan>,
    steps: u32,
    report: RoundReport,
    seen: Seen,
    /// The round's error, once it has one (the cross-check still runs).
    failed: Option<Error>,
    /// Received pieces of owned shards: `arrived[i][p]` for the `i`-th owned shard.
    arrived: Vec<Vec<Option<B>>>,
    /// Owned shards whose result is missing (sent empty).
    no_result: Vec<bool>,
    /// Selection, once made.
    selected: Option<Vec<usize>>,
    /// Received bytes of pieces and versions, for the report's peak.
    received_bytes: usize,
    /// This rank's own statistics of the statistic round in flight.
    own_statistics: Vec<(usize, Bytes)>,
    /// Warnings since the last [`Round::take_warnings`].
    warnings: Vec<String>,
    /// This rank's cross-check, once posted, and its encoding for each rank.
    check: Option<(Check, Vec<Bytes>)>,
    /// Bytes of input the rules read since the last [`Round::take_work`].
    work: std::cell::Cell<u64>,
    /// [`Agreement::Enforce`]: what the ranks agree on, by *slot* `k·n + j`: in gather mode
    /// (`k = 0`) rank `j`'s input, in sharded mode owner `j`'s result for its `k`-th owned
    /// shard. The messages received (the agreed ones after the recovery step), one echo tree
    /// per `k`, and the decisions.
    held: Vec<Option<B>>,
    echo: Vec<eig::Eig>,
    agreed: Vec<Option<Digest>>,
    /// Senders of which the echo carried two different inputs (named in the report's
    /// `differing_inputs`).
    echo_differs: Vec<Rank>,
    /// Peers an earlier sub-round of the same call erased ([`Carry::erased`]).
    carried: Vec<Rank>,
    /// The step timeouts an honest rank may start this round later than this one
    /// ([`Carry::lag`]).
    lag_in: u32,
    /// Whether a receive came back missing ([`Round::lag`]).
    saw_missing: bool,
    /// Versions by digest: what the versions step left for the request and resend steps.
    pending: Option<Pending<B>>,
}

/// The digest an owner sends in place of a version it does not have (an owner that could not
/// aggregate its shard); BLAKE3 gives it with probability 2^-256.
const NO_VERSION: Digest = [0xff; 32];

/// Versions by digest ([`Round::full_owner`]): what a taker holds between the versions step
/// and the end of the resend step, by shard.
struct Pending<B> {
    /// The version its designated owner sent (none where this rank owns the shard).
    full: Vec<Option<(Rank, B)>>,
    /// The digest of the version held, the designated owner's or this rank's own.
    held: Vec<Option<Digest>>,
    /// The digest each owner (in [`sharded::owners`] order) sent, or that of the version it
    /// sent; `None` where nothing usable came.
    announced: Vec<Vec<Option<Digest>>>,
    /// `(owner, shard)`: the versions asked for, whose digest differs from the one held (all
    /// of them where none is held).
    wanted: Vec<(Rank, usize)>,
}

/// What one sub-round of a call hands the next ([`Round::resuming`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Carry {
    /// The peers erased so far in the call: the next sub-round sends them nothing, waits for
    /// none of their pieces nor for their cross-check, and reports them among its faults, so
    /// that a dead peer costs one timeout per call, not one per sub-round.
    pub erased: Vec<PeerFault>,
    /// How many step timeouts later than this rank an honest rank may start the next
    /// sub-round ([`Round::lag`] of the one before): each of its steps waits that many more.
    pub lag: u32,
}

impl<B> std::fmt::Debug for Round<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Round")
            .field("spec", &self.spec)
            .field("rule", &self.rule.name())
            .field("phase", &self.phase)
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

impl<'r, B> Round<'r, B> {
    /// A round of `rule` as `spec` says. Errors the caller could have avoided (a replica
    /// count outside `1..=n`, a rule sharded mode cannot run, the precondition for the world
    /// size) become the round's error; under [`Agreement::Detect`] the cross-check step still
    /// runs, so that every rank takes part in the same steps.
    pub fn new(spec: Spec, rule: &'r dyn Aggregator) -> Self {
        Self::resuming(spec, rule, &Carry::default())
    }

    /// [`Round::new`] for a sub-round that follows another of the same call: it counts the
    /// peers `carry` erased as erasures, and waits `carry.lag` step timeouts more in each step.
    pub fn resuming(spec: Spec, rule: &'r dyn Aggregator, carry: &Carry) -> Self {
        let erased = &carry.erased;
        let n = spec.n;
        let f = rule.byzantine();
        let mut round = Round {
            spec,
            rule,
            r: 0,
            statistics: Statistics::None,
            phase: Phase::Done,
            plan: None,
            steps: 0,
            report: RoundReport::default(),
            seen: Seen::new(n, 0),
            failed: None,
            arrived: Vec::new(),
            no_result: Vec::new(),
            selected: None,
            received_bytes: 0,
            own_statistics: Vec::new(),
            check: None,
            warnings: Vec::new(),
            work: std::cell::Cell::new(0),
            held: Vec::new(),
            echo: Vec::new(),
            agreed: Vec::new(),
            echo_differs: Vec::new(),
            carried: erased.iter().map(|f| f.rank).collect(),
            lag_in: carry.lag,
            saw_missing: false,
            pending: None,
        };
        round.report.faults = erased.to_vec();
        let start = match spec.shape {
            Shape::Gather => rule
                .check(n)
                .map_err(Error::Aggregation)
                .and_then(|()| check_agreement(spec.agreement, spec.shape, n, f))
                .map(|()| round.post_gather()),
            Shape::Sharded(replicas) | Shape::ReduceScatter(replicas) => {
                // The digest layout follows the count even when the rule is refused, so that
                // every rank's cross-check has the same length.
                round.r = replicas.count(f, n).unwrap_or(0);
                round.seen = Seen::new(n, round.r);
                check_agreement(spec.agreement, spec.shape, n, f)
                    .and_then(|()| rule.check(n).map_err(Error::Aggregation))
                    .and_then(|()| statistics_of(rule))
                    .and_then(|s| {
                        round.statistics = s;
                        replicas.count(f, n)
                    })
                    .map(|r| {
                        if r < Replicas::tolerant(f) {
                            round.warnings.push(format!(
                                "sharded round with r = {r} < 2f + 1 = {} owners per shard: \
                                 shard owners are trusted",
                                Replicas::tolerant(f)
                            ));
                        }
                        round.r = r;
                        round.report.replicas = Some(r);
                        round.report.inputs = n;
                        round.post_scatter();
                    })
            }
        };
        if let Err(e) = start {
            round.fail(e);
        }
        round
    }

    /// The step to run next, `None` when the round is over ([`Round::finish`]).
    pub fn step(&self) -> Option<&StepPlan> {
        self.plan.as_ref()
    }

    /// The number of steps posted so far.
    pub fn steps(&self) -> u32 {
        self.steps
    }

    /// How many step timeouts later than this rank an honest rank may end this round (what
    /// the next sub-round of the call waits more, [`Carry::lag`]): the stretch of the round's
    /// last step when a receive came back missing or the round found a peer at fault, 0
    /// otherwise. A peer that dies is seen at once by the ranks whose connection to it breaks
    /// and only at the deadline by the others; and a rank whose sends to a silent peer are not
    /// taken (a rendezvous transport, a full socket buffer) waits out each later step's
    /// deadline, up to the last, where a rank that saw the peer gone does not.
    pub fn lag(&self) -> u32 {
        let new_fault = self
            .report
            .faults
            .iter()
            .any(|f| !self.carried.contains(&f.rank));
        match self.saw_missing || new_fault {
            true => self.stretch_of(self.steps.saturating_sub(1)),
            false => 0,
        }
    }

    /// Bytes of input the rules read since the last call (the simulator charges them as
    /// compute time).
    pub fn take_work(&mut self) -> u64 {
        self.work.take()
    }

    /// The peers this rank has counted as erasures so far.
    pub fn faults(&self) -> &[PeerFault] {
        &self.report.faults
    }

    /// What the round would warn about since the last call (an owned shard this rank could
    /// not aggregate): the core logs nothing, its drivers do (or collect it, the simulator).
    pub fn take_warnings(&mut self) -> Vec<String> {
        std::mem::take(&mut self.warnings)
    }

    /// The message this rank received for slot `j` while the round holds it
    /// ([`Agreement::Enforce`]; what [`Msg::Forward`] sends): rank `j`'s input in gather mode;
    /// in sharded mode, for `j = k·n + o`, owner `o`'s result for its `k`-th owned shard.
    pub fn held(&self, j: usize) -> Option<&B> {
        self.held.get(j)?.as_ref()
    }

    /// Whether the round has failed (the cross-check may still run).
    pub fn has_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// The outcomes of [`Round::step`]'s receives, in its order, one each.
    ///
    /// # Panics
    /// When no step is posted or the outcomes do not match its receives: a driver bug.
    pub fn handle<P: Plane<Buf = B>>(&mut self, plane: &mut P, outcomes: Vec<Arrival<B>>) {
        let plan = self.plan.take().expect("a step is posted");
        assert_eq!(plan.recvs.len(), outcomes.len(), "one outcome per receive");
        self.saw_missing |= outcomes.iter().any(|a| matches!(a, Arrival::Missing));
        match self.phase {
            Phase::Gather => self.gathered(plane, &plan, outcomes),
            Phase::Scatter => self.scattered(plane, &plan, outcomes),
            Phase::Statistic { k } => self.statistic_done(plane, &plan, outcomes, k),
            Phase::Versions => self.versions_done(plane, &plan, outcomes),
            Phase::Request => self.requests_arrived(plane, &plan, outcomes),
            Phase::Resend => self.resent(plane, &plan, outcomes),
            Phase::Echo => self.echoed(plane, &plan, outcomes),
            Phase::Recover => self.recovered(plane, &plan, outcomes),
            Phase::Check => self.checked(plane, &plan, outcomes),
            Phase::Done => unreachable!("no step is posted when done"),
        }
    }

    /// The round's report or error, once [`Round::step`] is `None`.
    ///
    /// # Errors
    /// What the round failed with, or [`Error::Disagreement`] from the cross-check.
    ///
    /// # Panics
    /// Before the round is over.
    pub fn finish(self) -> Result<RoundReport, Error> {
        assert!(self.plan.is_none(), "the round is not over");
        match self.failed {
            Some(e) => Err(e),
            None => Ok(self.report),
        }
    }

    fn detect(&self) -> bool {
        self.spec.agreement != Agreement::Off
    }

    /// How many step timeouts step `index` waits: one more than the step before, and the lag
    /// an earlier sub-round left. A rank that waited out a step's deadline for a silent peer
    /// (a dead one that others saw die at once, a Byzantine sender silent towards some ranks
    /// only) starts the next step up to that deadline later than the ranks that did not:
    /// each step allows that, so that an honest rank is never counted missing for it.
    fn stretch_of(&self, index: u32) -> u32 {
        self.lag_in.saturating_add(index).saturating_add(1)
    }

    fn post(&mut self, phase: Phase, op: &'static str, sends: Vec<Send>, recvs: Vec<RecvOp>) {
        // Peers an earlier sub-round erased get nothing more in this call: a send to a dead
        // peer can hold a step until its deadline (a rendezvous transport), and a peer that
        // was only late is out of step for the rest of the call anyway.
        let mut sends = sends;
        sends.retain(|s| !self.carried.contains(&s.peer));
        self.phase = phase;
        self.plan = Some(StepPlan {
            op,
            index: self.steps,
            sends,
            recvs,
            timeout: self
                .spec
                .timeout
                .saturating_mul(self.stretch_of(self.steps)),
        });
        self.steps += 1;
    }

    /// Records the round's error and moves on to the cross-check (or ends).
    fn fail(&mut self, e: Error) {
        if self.failed.is_none() {
            self.failed = Some(e);
        }
        self.post_check(None);
    }

    fn add_fault(&mut self, rank: Rank, fault: Fault) {
        if !self.report.faults.iter().any(|g| g.rank == rank) {
            self.report.faults.push(PeerFault { rank, fault });
        }
    }

    fn arrival_fault(&mut self, rank: Rank, a: &Arrival<B>) {
        match a {
            Arrival::Received(_) => {}
            Arrival::Missing => self.add_fault(rank, Fault::Missing),
            Arrival::Malformed(why) => self.add_fault(rank, Fault::Malformed(why.clone())),
        }
    }

    /// Counts `bytes` of input read by a rule.
    fn charge(&self, bytes: usize) {
        self.work.set(self.work.get() + bytes as u64);
    }

    fn bytes(&self, elements: usize) -> usize {
        elements * self.spec.elem
    }

    fn shard(&self, s: usize) -> Range<usize> {
        chunk_range(self.spec.d, self.spec.n, s)
    }

    // ---- gather ------------------------------------------------------------------------

    fn post_gather(&mut self) {
        let (me, n) = (self.spec.me, self.spec.n);
        let len = self.bytes(self.spec.d);
        let sends = schedule::direct_peers(me, n)
            .map(|peer| Send {
                peer,
                tag: 0,
                msg: Msg::Input,
            })
            .collect();
        let recvs = schedule::direct_peers(me, n)
            .map(|peer| RecvOp { peer, tag: 0, len })
            .collect();
        self.post(Phase::Gather, "robust_gather", sends, recvs);
    }

    fn gathered<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let (me, n, d) = (self.spec.me, self.spec.n, self.spec.d);
        let mut got: Vec<Option<B>> = (0..n).map(|_| None).collect();
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            self.arrival_fault(op.peer, &a);
            if let Arrival::Received(b) = a {
                got[op.peer] = Some(b);
            }
        }
        if self.spec.agreement == Agreement::Enforce {
            let direct = (0..n)
                .map(|p| match &got[p] {
                    Some(b) => Some(plane.commitment(Src::Got(b))),
                    None if p == me => Some(plane.commitment(Src::Mine(0..d))),
                    None => None,
                })
                .collect();
            self.held = got;
            self.echo = vec![eig::Eig::new(n, self.rule.byzantine(), me, direct)];
            return self.post_echo();
        }
        let ranks: Vec<Rank> = (0..n).filter(|&p| p == me || got[p].is_some()).collect();
        self.aggregate_inputs(plane, &got, ranks);
    }

    /// Aggregates the inputs of `ranks` (in rank order): `got[p]`, or this rank's own.
    fn aggregate_inputs<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        got: &[Option<B>],
        ranks: Vec<Rank>,
    ) {
        let (me, d) = (self.spec.me, self.spec.d);
        let src = |p: Rank| match &got[p] {
            Some(b) if p != me => Src::Got(b),
            _ => Src::Mine(0..d),
        };
        let others = ranks.iter().filter(|&&p| p != me).count();
        self.report.inputs = ranks.len();
        self.received_bytes = others * self.bytes(d);
        self.report.peak_bytes = (others + 2) * self.bytes(d);
        for &p in &ranks {
            // Under Enforce the agreed commitments are already there (BLAKE3 serves the
            // cross-check as well as XXH3 and saves a pass over every input).
            if self.detect() && self.seen.inputs[p].is_none() {
                self.seen.inputs[p] = Some(plane.digest(src(p)));
            }
        }
        let inputs: Vec<Src<'_, B>> = ranks.iter().map(|&p| src(p)).collect();
        if let Err(source) = self.rule.check(ranks.len()) {
            self.report.non_finite = non_finite_ranks(plane, None, &inputs, &ranks);
            let faults = self.report.faults.clone();
            return self.fail(Error::TooManyFaults { source, faults });
        }
        self.charge(inputs.len() * self.bytes(d));
        let aggregated = plane.aggregate(self.rule, &inputs, Dest::Output);
        let found = aggregated
            .as_ref()
            .ok()
            .and_then(|a| a.non_finite.as_deref());
        self.report.non_finite = non_finite_ranks(plane, found, &inputs, &ranks);
        match aggregated {
            Ok(agg) => {
                self.report.selected = agg
                    .selected
                    .map(|s| s.into_iter().map(|i| ranks[i]).collect());
                drop(inputs);
                let digest = self.detect().then(|| plane.result_digest());
                self.post_check(digest);
            }
            Err(e) => self.fail(rank_error(e, &ranks)),
        }
    }

    // ---- Agreement::Enforce: the echo and the recovery -----------------------------------

    /// The next relay step of the echo ([`eig`]), or the recovery step once none is left.
    /// Ranks this rank has already counted at fault are not waited for (their relays count as
    /// "none").
    fn post_echo(&mut self) {
        let (me, n) = (self.spec.me, self.spec.n);
        let echo = &self.echo;
        if echo.first().is_none_or(|e| e.relays_left() == 0) {
            return self.post_recovery();
        }
        // One relay per tree, back to back (each tree's relays have a fixed length).
        let (bytes, len) = match &echo[..] {
            [one] => (one.relay(), one.relay_len()),
            trees => {
                let all: Vec<u8> = trees.iter().flat_map(|t| t.relay().to_vec()).collect();
                let len = all.len();
                (Bytes::from(all), len)
            }
        };
        let sends = schedule::direct_peers(me, n)
            .map(|peer| Send {
                peer,
                tag: 0,
                msg: Msg::Bytes(bytes.clone()),
            })
            .collect();
        let recvs = schedule::direct_peers(me, n)
            .filter(|&p| !self.report.faults.iter().any(|f| f.rank == p))
            .map(|peer| RecvOp { peer, tag: 0, len })
            .collect();
        self.post(Phase::Echo, "enforce_echo", sends, recvs);
    }

    fn echoed<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let n = self.spec.n;
        let mut kept: Vec<(Rank, B)> = Vec::new();
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            self.arrival_fault(op.peer, &a);
            if let Arrival::Received(b) = a {
                kept.push((op.peer, b));
            }
        }
        let hosts: Vec<(Rank, Cow<'_, [u8]>)> =
            kept.iter().map(|(p, b)| (*p, plane.host(b))).collect();
        let lens: Vec<usize> = self.echo.iter().map(eig::Eig::relay_len).collect();
        // relays[t][p]: rank p's relay for tree t.
        let mut relays: Vec<Vec<Option<&[u8]>>> = vec![vec![None; n]; self.echo.len()];
        let mut malformed = Vec::new();
        for (p, bytes) in &hosts {
            let mut parts = Vec::with_capacity(lens.len());
            let mut rest: &[u8] = bytes;
            for &len in &lens {
                if rest.len() < len {
                    break;
                }
                let (part, tail) = rest.split_at(len);
                parts.push(part);
                rest = tail;
            }
            let whole = parts.len() == lens.len() && rest.is_empty();
            if whole && self.echo.iter().zip(&parts).all(|(t, part)| t.valid(part)) {
                for (t, part) in parts.into_iter().enumerate() {
                    relays[t][*p] = Some(part);
                }
            } else {
                malformed.push(*p);
            }
        }
        for (tree, relays) in self.echo.iter_mut().zip(&relays) {
            tree.receive(relays);
        }
        drop(relays);
        drop(hosts);
        for p in malformed {
            self.add_fault(p, Fault::Malformed("not a relay of the echo".into()));
        }
        self.post_echo()
    }

    /// Every slot is now decided alike ([`eig::Eig::decide`]): in gather mode every rank's
    /// input, in sharded mode every owner's result for each of its shards. A rank that went
    /// without the decided message of slot `k·n + j` (sender `j`) waits for it (the slot is
    /// the tag) from the first `f + 1` ranks that said, in the first relay, that they got it
    /// (its *claimants*); at least one of them is honest and holds it. A holder passes it on
    /// to each rank that said it got something else when it is among the first `2f + 1`
    /// claimants as it sees them: the honest ones among a receiver's first `f + 1` always are
    /// (their views differ only in what the `f` Byzantine ranks claimed), so no receiver holds
    /// more than `f + 1` copies.
    fn post_recovery(&mut self) {
        let (me, n) = (self.spec.me, self.spec.n);
        let f = self.rule.byzantine();
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        let mut agreed_all = Vec::with_capacity(self.echo.len() * n);
        let mut differs = vec![false; n];
        for (k, echo) in self.echo.iter().enumerate() {
            let agreed = echo.decide();
            let holds = |j: Rank| agreed[j].is_some() && echo.direct(j) == agreed[j];
            // The ranks other than `j` that got `j`'s decided message, as this rank sees them.
            let claimants = |j: Rank| -> Vec<Rank> {
                (0..n)
                    .filter(|&i| i != j)
                    .filter(|&i| {
                        if i == me {
                            holds(j)
                        } else {
                            echo.reported(i, j) == agreed[j]
                        }
                    })
                    .collect()
            };
            if f > 0 {
                for j in (0..n).filter(|&j| j != me && holds(j)) {
                    if !claimants(j).iter().take(2 * f + 1).any(|&i| i == me) {
                        continue;
                    }
                    for peer in schedule::direct_peers(me, n).filter(|&p| p != j) {
                        if echo.reported(peer, j) != agreed[j] {
                            sends.push(Send {
                                peer,
                                tag: (k * n + j) as Tag,
                                msg: Msg::Forward(k * n + j),
                            });
                        }
                    }
                }
                for j in (0..n).filter(|&j| j != me && agreed[j].is_some() && !holds(j)) {
                    let len = self.slot_len(k, j);
                    for peer in claimants(j).into_iter().take(f + 1) {
                        recvs.push(RecvOp {
                            peer,
                            tag: (k * n + j) as Tag,
                            len,
                        });
                    }
                }
            }
            for (j, differs) in differs.iter_mut().enumerate() {
                let mut told = std::iter::once(echo.direct(j))
                    .chain(
                        (0..n)
                            .filter(|&p| p != j && p != me)
                            .map(|p| echo.reported(p, j)),
                    )
                    .flatten();
                *differs |= told
                    .next()
                    .is_some_and(|first| told.any(|other| other != first));
            }
            agreed_all.extend(agreed);
        }
        self.echo_differs = (0..n).filter(|&j| differs[j]).collect();
        self.agreed = agreed_all;
        self.post(Phase::Recover, "enforce_recover", sends, recvs);
    }

    /// The length of slot `k·n + j`'s message: a whole input (gather), or owner `j`'s `k`-th
    /// owned shard.
    fn slot_len(&self, k: usize, j: Rank) -> usize {
        match self.spec.shape {
            Shape::Gather => self.bytes(self.spec.d),
            _ => self.bytes(self.shard((j + self.spec.n - k) % self.spec.n).len()),
        }
    }

    fn recovered<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let (me, n) = (self.spec.me, self.spec.n);
        let echo = std::mem::take(&mut self.echo);
        let agreed = std::mem::take(&mut self.agreed);
        let mut held = std::mem::take(&mut self.held);
        let what = match self.spec.shape {
            Shape::Gather => "input",
            _ => "result",
        };
        for (slot, agreed) in agreed.iter().enumerate() {
            let (k, j) = (slot / n, slot % n);
            if echo[k].direct(j) != *agreed {
                held[slot] = None;
                if agreed.is_some() && j != me {
                    self.warnings.push(format!(
                        "rank {j} sent this rank another {what} than the ranks agreed on; \
                         recovering the agreed one"
                    ));
                }
            }
        }
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            let slot = op.tag as usize;
            if held[slot].is_some() {
                continue;
            }
            if let Arrival::Received(b) = a {
                if Some(plane.commitment(Src::Got(&b))) == agreed[slot] {
                    held[slot] = Some(b);
                } else {
                    self.add_fault(
                        op.peer,
                        Fault::Malformed(format!(
                            "forwarded another {what} as rank {}'s",
                            slot % n
                        )),
                    );
                }
            }
        }
        if self.spec.shape != Shape::Gather {
            return self.combine_agreed(plane, &echo, &agreed, held);
        }
        let echo = &echo[0];
        let mut ranks = Vec::new();
        for j in 0..n {
            let usable = agreed[j].is_some()
                && (held[j].is_some() || (j == me && echo.direct(me) == agreed[me]));
            if usable {
                self.seen.inputs[j] = agreed[j];
                ranks.push(j);
            } else if j != me {
                let why = match agreed[j] {
                    None => "the ranks' echo agreed on no input of it (silent or equivocating)",
                    Some(_) => "its agreed input could not be recovered",
                };
                self.add_fault(j, Fault::Malformed(why.into()));
            } else {
                self.report.erased_self = true;
                self.warnings.push(
                    "the ranks agreed that this rank's own input did not reach them in time; \
                     it is left out, as they left it out"
                        .into(),
                );
            }
        }
        self.aggregate_inputs(plane, &held, ranks);
    }

    // ---- sharded -----------------------------------------------------------------------

    fn owned(&self) -> Vec<usize> {
        sharded::owned(self.spec.me, self.spec.n, self.r).collect()
    }

    /// Whether rank `q` takes shard `s`'s result (everyone in an all-reduce, rank `s` in a
    /// reduce-scatter).
    fn takes(&self, q: Rank, s: usize) -> bool {
        !matches!(self.spec.shape, Shape::ReduceScatter(_)) || q == s
    }

    /// Whether the versions go by digest: with `r > 1` owners per shard outside
    /// [`Agreement::Enforce`], a taker gets one owner's version ([`Round::full_owner`]) and
    /// the BLAKE3 digest of every other owner's, then asks for the versions whose digest
    /// differs from the one it holds (two more steps, `PROTOCOL.md`: "Versions by digest").
    /// Honest owners of a shard hold the same version, so in a round without faults the
    /// versions cost the bytes of `r = 1`, and the median of equal versions is that version.
    fn by_digest(&self) -> bool {
        self.r > 1 && self.spec.agreement != Agreement::Enforce
    }

    /// The owner of shard `s` that sends taker `t` its whole version when versions go by
    /// digest: none where `t` owns `s` (it holds its own); otherwise the owners take the
    /// takers in turn, so that each sends about `n / r` of them a version.
    fn full_owner(&self, t: Rank, s: usize) -> Option<Rank> {
        let (n, r) = (self.spec.n, self.r);
        if sharded::owns(t, s, n, r) {
            return None;
        }
        sharded::owners(s, n, r).nth((t + n - s) % n % r)
    }

    fn post_scatter(&mut self) {
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        self.arrived = (0..r).map(|_| (0..n).map(|_| None).collect()).collect();
        self.no_result = vec![false; r];
        let sends = sharded::scatter_sends(me, n, r)
            .into_iter()
            .map(|(peer, s)| Send {
                peer,
                tag: s as Tag,
                msg: Msg::Piece(s),
            })
            .collect();
        let erased: Vec<Rank> = self.report.faults.iter().map(|f| f.rank).collect();
        let recvs = sharded::scatter_recvs(me, n, r)
            .into_iter()
            .filter(|(peer, _)| !erased.contains(peer))
            .map(|(peer, s)| RecvOp {
                peer,
                tag: s as Tag,
                len: self.bytes(self.shard(s).len()),
            })
            .collect();
        self.post(Phase::Scatter, "robust_sharded", sends, recvs);
    }

    /// The inputs of the `i`-th owned shard `s`, by rank (`None`: erased).
    fn shard_inputs(&self, i: usize, s: usize) -> Vec<Option<Src<'_, B>>> {
        (0..self.spec.n)
            .map(|p| {
                if p == self.spec.me {
                    Some(Src::Mine(self.shard(s)))
                } else {
                    self.arrived[i][p].as_ref().map(Src::Got)
                }
            })
            .collect()
    }

    fn scattered<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let (me, n) = (self.spec.me, self.spec.n);
        let owned = self.owned();
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            self.arrival_fault(op.peer, &a);
            if let Arrival::Received(b) = a {
                self.received_bytes += op.len;
                let i = owned_index(me, op.tag as usize, n);
                self.arrived[i][op.peer] = Some(b);
            }
        }
        let mut digests = Vec::new();
        let mut non_finite = Vec::new();
        let mut inputs = n;
        // Only co-owners compare pieces: with one owner per shard the cross-check carries none,
        // and only which pieces arrived counts (a reduce-scatter's input set), so they are
        // not hashed.
        let compared = self.r > 1;
        // A coordinate-wise rule names the inputs holding NaN or infinities as it reads them,
        // where it can ([`AggReport::non_finite`]); the others' inputs are scanned here.
        let scanned = !matches!(self.statistics, Statistics::None);
        for (i, &s) in owned.iter().enumerate() {
            let shard_inputs = self.shard_inputs(i, s);
            inputs = inputs.min(shard_inputs.iter().flatten().count());
            for (p, src) in shard_inputs.into_iter().enumerate() {
                let Some(src) = src else { continue };
                if self.detect() {
                    let digest = match compared {
                        true => plane.digest(src.clone()),
                        false => [0; 32],
                    };
                    digests.push((i * n + p, digest));
                }
                if scanned && !non_finite.contains(&p) && !plane.finite(src) {
                    non_finite.push(p);
                }
            }
        }
        for (at, d) in digests {
            self.seen.pieces[at] = Some(d);
        }
        self.report.inputs = inputs;
        match self.statistics {
            Statistics::None => {
                for (i, &s) in owned.iter().enumerate() {
                    let ranks: Vec<Rank> = (0..n)
                        .filter(|&p| p == me || self.arrived[i][p].is_some())
                        .collect();
                    let srcs: Vec<Src<'_, B>> =
                        self.shard_inputs(i, s).into_iter().flatten().collect();
                    let (done, found) = match self.rule.check(ranks.len()) {
                        Err(e) => (Err(Error::Aggregation(e)), None),
                        Ok(()) => {
                            self.charge(srcs.len() * self.bytes(self.shard(s).len()));
                            match plane.aggregate(self.rule, &srcs, Dest::Owned(i)) {
                                Ok(agg) => (Ok(()), agg.non_finite),
                                Err(e) => (Err(rank_error(e, &ranks)), None),
                            }
                        }
                    };
                    let shard_non_finite = non_finite_ranks(plane, found.as_deref(), &srcs, &ranks);
                    drop(srcs);
                    for p in shard_non_finite {
                        if !non_finite.contains(&p) {
                            non_finite.push(p);
                        }
                    }
                    self.owner_outcome(i, s, done);
                }
                non_finite.sort_unstable();
                self.report.non_finite = non_finite;
                self.post_versions();
            }
            Statistics::Select(_) | Statistics::Mix(_) => {
                non_finite.sort_unstable();
                self.report.non_finite = non_finite;
                let tables: Vec<(usize, Bytes)> = owned
                    .iter()
                    .enumerate()
                    .map(|(i, &s)| {
                        let inputs = self.shard_inputs(i, s);
                        self.charge(
                            inputs.iter().flatten().count() * self.bytes(self.shard(s).len()),
                        );
                        (s, f64_bytes(&plane.distance_table(&inputs)))
                    })
                    .collect();
                self.post_statistic(0, &tables, n * n);
            }
            Statistics::Iterate(_) => {
                for (i, &s) in owned.iter().enumerate() {
                    let inputs = self.shard_inputs(i, s);
                    if let Err(e) = plane.estimate_start(i, &inputs) {
                        return self.fail(Error::Aggregation(e));
                    }
                }
                self.post_iteration(plane, 0, &vec![(0.0, 0.0); owned.len()]);
            }
        }
    }

    /// An owner's result for its `i`-th shard `s`: on failure it sends an empty one, which
    /// receivers count as an erasure of its version (the reason is a warning, for the driver
    /// to log).
    fn owner_outcome(&mut self, i: usize, s: usize, done: Result<(), impl std::fmt::Display>) {
        if let Err(why) = done {
            self.warnings.push(format!(
                "cannot aggregate owned shard {s}: {why}; sending an empty result"
            ));
            self.no_result[i] = true;
        }
    }

    fn post_iteration<P: Plane<Buf = B>>(&mut self, plane: &mut P, k: usize, moved: &[(f64, f64)]) {
        let n = self.spec.n;
        let partials: Vec<(usize, Bytes)> = self
            .owned()
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let inputs = self.shard_inputs(i, s);
                let mut stats = plane.estimate_distances(i, &inputs);
                stats.extend([moved[i].0, moved[i].1]);
                (s, f64_bytes(&stats))
            })
            .collect();
        self.post_statistic(k, &partials, n + 2);
    }

    /// One statistic round: every owner sends, for each owned shard, `len` `f64` statistics
    /// to every rank; every rank combines them ([`sum_of_shard_medians`]).
    fn post_statistic(&mut self, k: usize, parts: &[(usize, Bytes)], len: usize) {
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        let sends = sharded::result_sends(me, n, r)
            .into_iter()
            .filter_map(|(peer, s)| {
                let (_, t) = parts.iter().find(|(u, _)| *u == s)?;
                Some(Send {
                    peer,
                    tag: s as Tag,
                    msg: Msg::Bytes(t.clone()),
                })
            })
            .collect();
        let recvs = sharded::result_recvs(me, n, r)
            .into_iter()
            .map(|(peer, s)| RecvOp {
                peer,
                tag: s as Tag,
                len: len * std::mem::size_of::<f64>(),
            })
            .collect();
        self.own_statistics = parts.to_vec();
        self.post(Phase::Statistic { k }, "robust_sharded", sends, recvs);
    }

    fn statistic_done<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
        k: usize,
    ) {
        let (n, r) = (self.spec.n, self.r);
        let mut versions: Vec<Vec<Vec<f64>>> = vec![Vec::new(); n];
        for (s, t) in std::mem::take(&mut self.own_statistics) {
            versions[s].push(f64_vec(&t));
        }
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            self.arrival_fault(op.peer, &a);
            if let Arrival::Received(b) = a {
                versions[op.tag as usize].push(f64_vec(&plane.host(&b)));
            }
        }
        if let Some(s) = versions.iter().position(Vec::is_empty) {
            let faults = std::mem::take(&mut self.report.faults);
            let owners = sharded::owners(s, n, r).collect();
            return self.fail(Error::ShardLost {
                shard: s,
                owners,
                faults,
            });
        }
        let len = versions[0][0].len();
        let refs: Vec<Vec<&[f64]>> = versions
            .iter()
            .map(|vs| vs.iter().map(Vec::as_slice).collect())
            .collect();
        let total = sum_of_shard_medians(&refs, len);
        let owned = self.owned();
        match self.statistics {
            Statistics::Select(selection) => {
                let selected = match selection.select(&total, n) {
                    Ok(s) => s,
                    Err(e) => return self.fail(Error::Aggregation(e)),
                };
                self.report.selected = Some(selected.clone());
                for (i, &s) in owned.iter().enumerate() {
                    let inputs = self.shard_inputs(i, s);
                    let done = if selected.iter().any(|&j| inputs[j].is_none()) {
                        Err("a selected input is missing here".to_string())
                    } else {
                        self.charge(selected.len() * self.bytes(self.shard(s).len()));
                        plane
                            .finish_selected(selection, &inputs, &selected, i)
                            .map_err(|e| e.to_string())
                    };
                    self.owner_outcome(i, s, done);
                }
                self.selected = Some(selected);
                self.post_versions();
            }
            Statistics::Mix(mixing) => {
                let neighbours = match mixing.neighbours(&total, n) {
                    Ok(nb) => nb,
                    Err(e) => return self.fail(Error::Aggregation(e)),
                };
                for (i, &s) in owned.iter().enumerate() {
                    let inputs = self.shard_inputs(i, s);
                    let needed = neighbours
                        .iter()
                        .enumerate()
                        .flat_map(|(j, near)| near.clone().unwrap_or_else(|| vec![j]));
                    let done = if needed.into_iter().any(|j| inputs[j].is_none()) {
                        Err("an input to mix is missing here".to_string())
                    } else {
                        let present: Vec<Src<'_, B>> = inputs.into_iter().flatten().collect();
                        self.charge(present.len() * self.bytes(self.shard(s).len()));
                        plane
                            .mix(mixing, &present, &neighbours, i)
                            .map_err(|e| e.to_string())
                    };
                    self.owner_outcome(i, s, done);
                }
                self.post_versions();
            }
            Statistics::Iterate(iteration) => {
                let (change, size) = (total[n].sqrt(), total[n + 1].sqrt());
                let converged = k > 0
                    && iteration
                        .tolerance()
                        .is_some_and(|tol| change <= tol * size.max(f64::MIN_POSITIVE));
                if converged || k == iteration.max_steps() {
                    for (i, &s) in owned.iter().enumerate() {
                        let done = plane.estimate_finish(i);
                        self.owner_outcome(i, s, done);
                    }
                    return self.post_versions();
                }
                let distances: Vec<f64> = total[..n].iter().map(|d| d.sqrt()).collect();
                let (a, w) = iteration.coefficients(&distances);
                let moved: Vec<(f64, f64)> = owned
                    .iter()
                    .enumerate()
                    .map(|(i, &s)| {
                        let inputs = self.shard_inputs(i, s);
                        self.charge(
                            inputs.iter().flatten().count() * self.bytes(self.shard(s).len()),
                        );
                        plane.estimate_step(i, &inputs, a, &w)
                    })
                    .collect();
                self.post_iteration(plane, k + 1, &moved);
            }
            Statistics::None => unreachable!("coordinate-wise rules have no statistic round"),
        }
    }

    /// Phase 3: every owner sends its results to every rank that takes the shard (or, when
    /// versions go by digest, their digest to the takers another owner sends its version).
    fn post_versions(&mut self) {
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        let by_digest = self.by_digest();
        // The pieces are not needed any more.
        self.arrived.clear();
        let sends = sharded::result_sends(me, n, r)
            .into_iter()
            .filter(|&(q, s)| self.takes(q, s))
            .map(|(peer, s)| {
                let i = owned_index(me, s, n);
                let digest = by_digest && self.full_owner(peer, s) != Some(me);
                Send {
                    peer,
                    tag: s as Tag,
                    msg: match (self.no_result[i], digest) {
                        (true, false) => Msg::Empty,
                        (false, false) => Msg::Result(s),
                        (true, true) => Msg::Bytes(Bytes::from_static(&NO_VERSION)),
                        (false, true) => Msg::ResultDigest(s),
                    },
                }
            })
            .collect();
        // Owners already erased this round (silent or malformed in an earlier step) are not
        // waited for again.
        let erased: Vec<Rank> = self.report.faults.iter().map(|f| f.rank).collect();
        let recvs = sharded::result_recvs(me, n, r)
            .into_iter()
            .filter(|&(o, s)| self.takes(me, s) && !erased.contains(&o))
            .map(|(peer, s)| RecvOp {
                peer,
                tag: s as Tag,
                len: match by_digest && self.full_owner(me, s) != Some(peer) {
                    true => NO_VERSION.len(),
                    false => self.bytes(self.shard(s).len()),
                },
            })
            .collect();
        self.post(Phase::Versions, "robust_sharded", sends, recvs);
    }

    fn versions_done<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        if self.spec.agreement == Agreement::Enforce {
            return self.versions_to_echo(plane, plan, outcomes);
        }
        if self.by_digest() {
            return self.digests_arrived(plane, plan, outcomes);
        }
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        let owned = self.owned();
        let mut versions: Vec<Vec<(Rank, Src<'_, B>)>> = (0..n).map(|_| Vec::new()).collect();
        let mut faults = Vec::new();
        let mut version_bytes = 0;
        let outcomes: Vec<(Rank, usize, Arrival<B>)> = plan
            .recvs
            .iter()
            .zip(outcomes)
            .map(|(op, a)| (op.peer, op.tag as usize, a))
            .collect();
        for (o, s, a) in &outcomes {
            match a {
                Arrival::Received(b) => {
                    version_bytes += self.bytes(self.shard(*s).len());
                    versions[*s].push((*o, Src::Got(b)));
                }
                Arrival::Missing => faults.push((*o, Fault::Missing)),
                Arrival::Malformed(why) => faults.push((*o, Fault::Malformed(why.clone()))),
            }
        }
        for (i, &s) in owned.iter().enumerate() {
            if self.takes(me, s) && !self.no_result[i] {
                versions[s].push((me, Src::Owned(i)));
            }
        }
        let peak = self.versions_peak(version_bytes);
        // With one owner per shard, a shard's result is its owner's version, so the BLAKE3
        // digests of the versions serve both the ring neighbours' comparison and the result's
        // digest ([`Round::sharded_result_digest`]): one pass over the vector, not two.
        let mut digests = Vec::new();
        if self.detect() {
            for (s, vs) in versions.iter().enumerate() {
                for (k, o) in sharded::owners(s, n, r).enumerate() {
                    if let Some((_, src)) = vs.iter().find(|(from, _)| *from == o) {
                        digests.push((s * r + k, plane.commitment(src.clone())));
                    }
                }
            }
        }
        let (lost, combined) = self.combine_versions(plane, &mut versions);
        drop(versions);
        drop(outcomes);
        for (rank, fault) in faults {
            self.add_fault(rank, fault);
        }
        let mut shards = vec![None; n];
        if r == 1 {
            for &(s, d) in &digests {
                shards[s] = Some(d);
            }
        }
        for (at, d) in digests {
            self.seen.versions[at] = Some(d);
        }
        self.report.peak_bytes = peak;
        self.end_versions(plane, lost, combined, Some(shards));
    }

    /// Versions by digest, after the versions step: the version held for each taken shard
    /// (the designated owner's, or this rank's own), each owner's digest, and the versions to
    /// ask for: those whose digest differs from the one held, or all where none is held.
    fn digests_arrived<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        let mut full: Vec<Option<(Rank, B)>> = (0..n).map(|_| None).collect();
        let mut announced = vec![vec![None; r]; n];
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            let (o, s) = (op.peer, op.tag as usize);
            match a {
                Arrival::Received(b) if self.full_owner(me, s) == Some(o) => full[s] = Some((o, b)),
                Arrival::Received(b) => match <Digest>::try_from(&plane.host(&b)[..]) {
                    Ok(d) if d != NO_VERSION => announced[s][owned_index(o, s, n)] = Some(d),
                    Ok(_) => self.add_fault(
                        o,
                        Fault::Malformed(format!("it has no version of shard {s}")),
                    ),
                    Err(_) => self.add_fault(
                        o,
                        Fault::Malformed(format!("a digest of shard {s} that is not 32 bytes")),
                    ),
                },
                other => self.arrival_fault(o, &other),
            }
        }
        let owned = self.owned();
        let mut held = vec![None; n];
        let mut wanted = Vec::new();
        for s in (0..n).filter(|&s| self.takes(me, s)) {
            let mine = owned.iter().position(|&t| t == s);
            let (holder, digest) = match (&full[s], mine) {
                (Some((o, b)), _) => (*o, Some(plane.commitment(Src::Got(b)))),
                (None, Some(i)) if !self.no_result[i] => {
                    (me, Some(plane.commitment(Src::Owned(i))))
                }
                _ => (me, None),
            };
            if digest.is_some() {
                announced[s][owned_index(holder, s, n)] = digest;
            }
            for (k, o) in sharded::owners(s, n, r).enumerate() {
                if announced[s][k].is_some() && announced[s][k] != digest {
                    wanted.push((o, s));
                }
            }
            held[s] = digest;
        }
        if self.detect() {
            for (s, digests) in announced.iter().enumerate() {
                self.seen.versions[s * r..(s + 1) * r].copy_from_slice(digests);
            }
        }
        self.pending = Some(Pending {
            full,
            held,
            announced,
            wanted,
        });
        self.post_requests();
    }

    /// Versions by digest: every taker tells every other owner of a shard it takes which of
    /// that owner's versions it wants (one byte per shard the owner owns, in
    /// [`sharded::owned`] order: 1 wanted, 0 not), even when it wants none, so that no owner
    /// waits out a deadline for a request. Owners already at fault here are not asked (a send
    /// to a dead peer can hold a step until its deadline): one that is alive, was late and
    /// did not erase this rank waits for its request, then counts it missing, as a late rank
    /// counts the others.
    fn post_requests(&mut self) {
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        let wanted = &self
            .pending
            .as_ref()
            .expect("posted after the versions")
            .wanted;
        let erased: Vec<Rank> = self.report.faults.iter().map(|f| f.rank).collect();
        let sends = (0..n)
            .filter(|&o| o != me && !erased.contains(&o))
            .filter(|&o| sharded::owned(o, n, r).any(|s| self.takes(me, s)))
            .map(|o| Send {
                peer: o,
                tag: 0,
                msg: Msg::Bytes(
                    sharded::owned(o, n, r)
                        .map(|s| u8::from(wanted.contains(&(o, s))))
                        .collect::<Vec<u8>>()
                        .into(),
                ),
            })
            .collect();
        let owned = self.owned();
        let recvs = (0..n)
            .filter(|&t| t != me && !erased.contains(&t))
            .filter(|&t| owned.iter().any(|&s| self.takes(t, s)))
            .map(|t| RecvOp {
                peer: t,
                tag: 0,
                len: r,
            })
            .collect();
        self.post(Phase::Request, "robust_sharded_requests", sends, recvs);
    }

    /// Versions by digest: the requests are in; this rank sends the versions asked of it and
    /// receives those it asked for.
    fn requests_arrived<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let owned = self.owned();
        let mut sends = Vec::new();
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            let t = op.peer;
            let Arrival::Received(b) = a else {
                self.arrival_fault(t, &a);
                continue;
            };
            let flags = plane.host(&b);
            if flags.len() != owned.len() || flags.iter().any(|&f| f > 1) {
                self.add_fault(
                    t,
                    Fault::Malformed(format!(
                        "a version request that is not {} flags of 0 or 1",
                        owned.len()
                    )),
                );
                continue;
            }
            for (i, &s) in owned.iter().enumerate() {
                if flags[i] == 1 && self.takes(t, s) {
                    sends.push(Send {
                        peer: t,
                        tag: s as Tag,
                        msg: match self.no_result[i] {
                            true => Msg::Empty,
                            false => Msg::Result(s),
                        },
                    });
                }
            }
        }
        let erased: Vec<Rank> = self.report.faults.iter().map(|f| f.rank).collect();
        let wanted = &self
            .pending
            .as_ref()
            .expect("posted after the versions")
            .wanted;
        let recvs = wanted
            .iter()
            .filter(|(o, _)| !erased.contains(o))
            .map(|&(o, s)| RecvOp {
                peer: o,
                tag: s as Tag,
                len: self.bytes(self.shard(s).len()),
            })
            .collect();
        self.post(Phase::Resend, "robust_sharded_resend", sends, recvs);
    }

    /// Versions by digest, the end: each taken shard's versions are the one held, once for
    /// every owner whose digest matched it, and the versions asked for that hash to the
    /// digest their owner sent (one that does not is malformed); their median goes into the
    /// output. Where nothing was asked for, the one version held is the median.
    fn resent<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        let Pending {
            full,
            held,
            announced,
            ..
        } = self.pending.take().expect("posted after the requests");
        let mut fetched: Vec<(Rank, usize, B)> = Vec::new();
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            let (o, s) = (op.peer, op.tag as usize);
            match a {
                Arrival::Received(b) => {
                    if Some(plane.commitment(Src::Got(&b))) == announced[s][owned_index(o, s, n)] {
                        fetched.push((o, s, b));
                    } else {
                        self.add_fault(
                            o,
                            Fault::Malformed(format!(
                                "its version of shard {s} does not match the digest it sent"
                            )),
                        );
                    }
                }
                other => self.arrival_fault(o, &other),
            }
        }
        let owned = self.owned();
        let shard_bytes = |s: usize| self.bytes(self.shard(s).len());
        let mut version_bytes = fetched.iter().map(|(_, s, _)| shard_bytes(*s)).sum();
        let mut versions: Vec<Vec<(Rank, Src<'_, B>)>> = (0..n).map(|_| Vec::new()).collect();
        let mut shards = vec![None; n];
        for s in (0..n).filter(|&s| self.takes(me, s)) {
            let held_src = match &full[s] {
                Some((o, b)) => {
                    version_bytes += shard_bytes(s);
                    Some((*o, Src::Got(b)))
                }
                None => owned
                    .iter()
                    .position(|&t| t == s)
                    .filter(|&i| !self.no_result[i])
                    .map(|i| (me, Src::Owned(i))),
            };
            let others = fetched.iter().filter(|(_, t, _)| *t == s);
            match held_src {
                Some((o, src)) if others.clone().next().is_none() => {
                    // The median of the held version alone is that version: its digest is the
                    // shard's, and the output need not be hashed again.
                    shards[s] = held[s];
                    versions[s].push((o, src));
                }
                Some((_, src)) => {
                    for (k, o) in sharded::owners(s, n, r).enumerate() {
                        if announced[s][k].is_some() && announced[s][k] == held[s] {
                            versions[s].push((o, src.clone()));
                        }
                    }
                }
                None => {}
            }
            versions[s].extend(others.map(|(o, _, b)| (*o, Src::Got(b))));
        }
        let peak = self.versions_peak(version_bytes);
        let (lost, combined) = self.combine_versions(plane, &mut versions);
        drop(versions);
        self.report.peak_bytes = peak;
        self.end_versions(plane, lost, combined, Some(shards));
    }

    /// The round's peak of data bytes held at once, given the versions received: the input,
    /// the pieces and the owned results (phase 1), or the results and the versions.
    fn versions_peak(&self, version_bytes: usize) -> usize {
        let results_bytes: usize = self
            .owned()
            .iter()
            .map(|&s| self.bytes(self.shard(s).len()))
            .sum();
        let phase1 = self.bytes(self.spec.d) + self.received_bytes + results_bytes;
        phase1.max(results_bytes + version_bytes)
    }

    /// The median of each taken shard's `versions` (owner order) into the output: the first
    /// shard without any version, or the first failure.
    fn combine_versions<P: Plane<Buf = B>>(
        &self,
        plane: &mut P,
        versions: &mut [Vec<(Rank, Src<'_, B>)>],
    ) -> (Option<usize>, Result<(), Error>) {
        let me = self.spec.me;
        let taken = |s: usize| !self.shard(s).is_empty() && self.takes(me, s);
        let lost = (0..versions.len()).find(|&s| taken(s) && versions[s].is_empty());
        if lost.is_some() {
            return (lost, Ok(()));
        }
        for (s, vs) in versions.iter_mut().enumerate() {
            if !taken(s) {
                continue;
            }
            vs.sort_by_key(|(o, _)| *o);
            let range = self.shard(s);
            let srcs: Vec<Src<'_, B>> = vs.iter().map(|(_, src)| src.clone()).collect();
            if srcs.len() > 1 {
                self.charge(srcs.len() * self.bytes(range.len()));
            }
            let start = range.start;
            if let Err(e) = plane.combine(s, range, &srcs) {
                return (
                    None,
                    Err(match e {
                        AggError::NonFiniteResult { f, coordinate, .. } => {
                            Error::Aggregation(AggError::NonFiniteResult {
                                rule: format!(
                                    "median of the {} owner versions of shard {s}",
                                    srcs.len()
                                ),
                                f,
                                coordinate: start + coordinate,
                            })
                        }
                        other => Error::Aggregation(other),
                    }),
                );
            }
        }
        (None, Ok(()))
    }

    /// The end of the versions (a lost shard or a failed median fails the round), then the
    /// cross-check. `shards`: where the result digest is made from the shards' digests
    /// ([`Round::sharded_result_digest`]), those already known (`None`: hash that shard);
    /// `None`: the plane hashes the whole output.
    fn end_versions<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        lost: Option<usize>,
        combined: Result<(), Error>,
        shards: Option<Vec<Option<Digest>>>,
    ) {
        let (n, r) = (self.spec.n, self.r);
        if let Some(s) = lost {
            let faults = self.report.faults.clone();
            return self.fail(Error::ShardLost {
                shard: s,
                owners: sharded::owners(s, n, r).collect(),
                faults,
            });
        }
        if let Err(e) = combined {
            return self.fail(e);
        }
        let digest = match self.spec.shape {
            _ if !self.detect() => None,
            Shape::ReduceScatter(_) => Some(self.seen.erased_inputs_digest(n)),
            _ => Some(match shards {
                Some(shards) => self.sharded_result_digest(plane, &shards),
                None => plane.result_digest(),
            }),
        };
        self.post_check(digest);
    }

    /// The digest of a sharded all-reduce's result outside `Enforce`, as the cross-check
    /// compares it: [`check::result_digest_of_shards`] of the BLAKE3 digest of every shard
    /// with elements, ascending. A shard's digest is `known[s]` where the round already has
    /// it (the version that is the shard's result was hashed to check it), else the plane
    /// hashes that shard of the output: each byte of the result is hashed once.
    fn sharded_result_digest<P: Plane<Buf = B>>(
        &self,
        plane: &mut P,
        known: &[Option<Digest>],
    ) -> Digest {
        let shards: Vec<Digest> = (0..self.spec.n)
            .filter(|&s| !self.shard(s).is_empty())
            .map(|s| known[s].unwrap_or_else(|| plane.output_digest(s, self.shard(s))))
            .collect();
        check::result_digest_of_shards(shards.iter())
    }

    /// [`Agreement::Enforce`] in sharded mode: the owners' results are held, one echo tree per
    /// owned-shard position `k` decides every owner's `k`-th result alike (slot `k·n + o`),
    /// and the recovery step brings each rank the agreed ones it lacks
    /// ([`Round::combine_agreed`] then takes the median of exactly those).
    fn versions_to_echo<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        let f = self.rule.byzantine();
        let mut held: Vec<Option<B>> = (0..r * n).map(|_| None).collect();
        let mut version_bytes = 0;
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            self.arrival_fault(op.peer, &a);
            if let Arrival::Received(b) = a {
                version_bytes += op.len;
                held[owned_index(op.peer, op.tag as usize, n) * n + op.peer] = Some(b);
            }
        }
        self.report.peak_bytes = self.versions_peak(version_bytes);
        let echo = (0..r)
            .map(|k| {
                let direct = (0..n)
                    .map(|o| match o == me {
                        true => (!self.no_result[k]).then(|| plane.commitment(Src::Owned(k))),
                        false => held[k * n + o]
                            .as_ref()
                            .map(|b| plane.commitment(Src::Got(b))),
                    })
                    .collect();
                eig::Eig::new(n, f, me, direct)
            })
            .collect();
        self.held = held;
        self.echo = echo;
        self.post_echo();
    }

    /// [`Agreement::Enforce`] in sharded mode, after the recovery: each shard's median over
    /// the agreed versions only, the same on every honest rank. An owner whose result the
    /// ranks agreed on no value of, or whose agreed result could not be recovered, is at
    /// fault and left out of that shard everywhere; so is this rank's own result when the
    /// others agreed it did not reach them ([`RoundReport::erased_self`]).
    fn combine_agreed<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        echo: &[eig::Eig],
        agreed: &[Option<Digest>],
        held: Vec<Option<B>>,
    ) {
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        let mut versions: Vec<Vec<(Rank, Src<'_, B>)>> = (0..n).map(|_| Vec::new()).collect();
        let mut digests = Vec::new();
        let mut erased: Vec<(Rank, String)> = Vec::new();
        for (s, vs) in versions.iter_mut().enumerate() {
            for (pos, o) in sharded::owners(s, n, r).enumerate() {
                let k = owned_index(o, s, n);
                let slot = k * n + o;
                let src = match (&held[slot], agreed[slot]) {
                    (Some(b), Some(_)) => Some(Src::Got(b)),
                    (None, Some(_)) if o == me && echo[k].direct(me) == agreed[slot] => {
                        Some(Src::Owned(k))
                    }
                    _ => None,
                };
                match src {
                    Some(src) => {
                        vs.push((o, src));
                        if self.detect() {
                            digests.push((s * r + pos, agreed[slot]));
                        }
                    }
                    None if o != me => erased.push((
                        o,
                        match agreed[slot] {
                            None => format!(
                                "the ranks' echo agreed on no result of it for shard {s} \
                                 (silent or equivocating)"
                            ),
                            Some(_) => {
                                format!("its agreed result for shard {s} could not be recovered")
                            }
                        },
                    )),
                    None if echo[k].direct(me).is_some() => {
                        self.report.erased_self = true;
                        self.warnings.push(format!(
                            "the ranks agreed that this rank's own result for shard {s} did \
                             not reach them in time; it is left out, as they left it out"
                        ));
                    }
                    None => {}
                }
            }
        }
        let (lost, combined) = self.combine_versions(plane, &mut versions);
        drop(versions);
        drop(held);
        for (rank, why) in erased {
            self.add_fault(rank, Fault::Malformed(why));
        }
        for (at, d) in digests {
            self.seen.versions[at] = d;
        }
        self.end_versions(plane, lost, combined, None);
    }

    // ---- the cross-check ---------------------------------------------------------------

    /// The cross-check step of [`Agreement::Detect`] (or the end under `Off`): every rank,
    /// whether its round succeeded or not (so that collectives stay numbered alike), sends
    /// every other rank its [`Check`]; the ranks this rank erased are not waited for.
    /// `result` is the digest the ranks compare (`Some` exactly when the round succeeded).
    fn post_check(&mut self, result: Option<Digest>) {
        if !self.detect() {
            self.phase = Phase::Done;
            self.plan = None;
            return;
        }
        let (me, n, r) = (self.spec.me, self.spec.n, self.seen.r);
        let ok = self.failed.is_none() && result.is_some();
        let steps = self.steps;
        let seen = if ok {
            Seen {
                steps,
                ..self.seen.clone()
            }
        } else {
            Seen {
                steps,
                ..Seen::new(n, r)
            }
        };
        let mine = Check {
            result: result.filter(|_| ok),
            seen,
        };
        let erased: Vec<Rank> = if self.failed.is_none() {
            self.report.faults.iter().map(|f| f.rank).collect()
        } else {
            self.carried.clone()
        };
        let encoded = mine.encode_for_all(me);
        let sends = schedule::direct_peers(me, n)
            .map(|peer| Send {
                peer,
                tag: 0,
                msg: Msg::Bytes(encoded[peer].clone()),
            })
            .collect();
        let recvs = schedule::direct_peers(me, n)
            .filter(|p| !erased.contains(p))
            .map(|peer| RecvOp {
                peer,
                tag: 0,
                len: Check::len_between(me, peer, n, r),
            })
            .collect();
        self.check = Some((mine, encoded));
        self.post(Phase::Check, "cross_check", sends, recvs);
    }

    fn checked<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        self.phase = Phase::Done;
        let (mine, encoded) = self.check.take().expect("the check was posted");
        if self.failed.is_some() {
            return;
        }
        let (me, n) = (self.spec.me, self.spec.n);
        let mut theirs: Vec<Option<Check>> = vec![None; n];
        let mut same = vec![false; n];
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            if let Arrival::Received(b) = a {
                let bytes = plane.host(&b);
                // The common case, a rank that saw what this one saw, costs one comparison.
                if bytes[..] == encoded[op.peer][..] {
                    same[op.peer] = true;
                } else {
                    theirs[op.peer] = Check::decode_from(&bytes, op.peer, me, n, mine.seen.r);
                }
            }
        }
        match check::evaluate(me, n, self.rule.byzantine(), &mine, &theirs, &same) {
            Ok(mut found) => {
                found.differing_inputs.append(&mut self.echo_differs);
                found.differing_inputs.sort_unstable();
                found.differing_inputs.dedup();
                self.report.agreement = Some(found);
            }
            Err(e) => self.failed = Some(e),
        }
    }
}

/// Position of shard `s` among the shards `rank` owns ([`sharded::owned`] lists
/// `rank, rank-1, ...`), which is also `rank`'s position among the owners of `s`.
pub fn owned_index(rank: Rank, s: usize, n: usize) -> usize {
    (rank + n - s) % n
}

/// Whether `agreement` can run a round of `shape` over `n` ranks with `f` Byzantine ones:
/// [`Agreement::Enforce`] runs in gather mode and sharded all-reduce, with `n > 3f` and echo
/// trees (one, or one per owned shard) of at most [`MAX_ECHO_NODES`] nodes in all (`f + 1`
/// levels over `n` ranks each). The drivers call it before any data moves; a [`Round`] fails
/// with it too.
///
/// # Errors
/// [`Error::Unsupported`] for `Enforce` in a reduce-scatter or past the trees' bound,
/// [`Error::InvalidUsage`] for `n <= 3f`.
pub fn check_agreement(
    agreement: Agreement,
    shape: Shape,
    n: usize,
    f: usize,
) -> Result<(), Error> {
    if agreement != Agreement::Enforce {
        return Ok(());
    }
    // One echo tree per value each rank contributes: its input, or its result for each of
    // its `r` owned shards (a bad count is the round's own error, reported there).
    let trees = match shape {
        Shape::Gather => 1,
        Shape::Sharded(replicas) => replicas.count(f, n).unwrap_or(1),
        Shape::ReduceScatter(_) => {
            return Err(Error::Unsupported(
                "Agreement::Enforce in a reduce-scatter: each rank takes a shard of its own, \
                 so there is no common result to agree on; reduce-scatter runs \
                 Agreement::Detect"
                    .into(),
            ))
        }
    };
    if n <= 3 * f {
        return Err(Error::InvalidUsage(format!(
            "Agreement::Enforce needs n > 3f: {n} ranks cannot agree despite {f} Byzantine ones"
        )));
    }
    match echo_nodes(n, f).and_then(|t| t.checked_mul(trees)) {
        Some(nodes) if nodes <= MAX_ECHO_NODES && trees * n <= Tag::MAX as usize => Ok(()),
        _ => Err(Error::Unsupported(format!(
            "Agreement::Enforce's echo for {n} ranks and f = {f} needs {trees} tree(s) of \
             f + 1 = {} relay levels of up to n^{} digests, past the bound of \
             {MAX_ECHO_NODES} nodes; use Agreement::Detect or a smaller f",
            f + 1,
            f + 1
        ))),
    }
}

/// The most nodes of [`Agreement::Enforce`]'s echo tree ([`check_agreement`]).
pub const MAX_ECHO_NODES: usize = eig::MAX_NODES;

/// The nodes of one rank's echo tree for `n` ranks and `f` Byzantine ones (`f + 1` levels),
/// `None` past `usize`: what [`check_agreement`] bounds, and what a simulator holding every
/// rank's tree multiplies by `n`.
pub fn echo_nodes(n: usize, f: usize) -> Option<usize> {
    eig::nodes(n, f + 1)
}

/// What a rule needs exchanged in sharded mode, or why sharded mode cannot run it.
fn statistics_of(rule: &dyn Aggregator) -> Result<Statistics<'_>, Error> {
    Ok(match rule.structure() {
        Structure::CoordinateWise => Statistics::None,
        Structure::Global => match (
            rule.distance_selection(),
            rule.distance_iteration(),
            rule.distance_mixing(),
        ) {
            (Some(s), _, _) => Statistics::Select(s),
            (None, Some(i), _) => Statistics::Iterate(i),
            (None, None, Some(m)) if m.inner().structure() == Structure::CoordinateWise => {
                Statistics::Mix(m)
            }
            _ => {
                return Err(Error::Unsupported(format!(
                    "{} needs statistics that sharded mode does not combine (it combines \
                     distance tables, distance iterations, and mixing followed by a \
                     coordinate-wise rule); use Policy::Gather for it",
                    rule.name()
                )))
            }
        },
    })
}

/// The ranks that sent a NaN or an infinity, ascending, among `ranks` (whose inputs are `srcs`,
/// in order): those the rule named while it read them (`found`: positions in `srcs`), or, where
/// it did not look, those a pass over each input finds.
fn non_finite_ranks<P: Plane>(
    plane: &mut P,
    found: Option<&[usize]>,
    srcs: &[Src<'_, P::Buf>],
    ranks: &[Rank],
) -> Vec<Rank> {
    match found {
        Some(found) => found.iter().map(|&k| ranks[k]).collect(),
        None => srcs
            .iter()
            .zip(ranks)
            .filter(|(src, _)| !plane.finite((*src).clone()))
            .map(|(_, &p)| p)
            .collect(),
    }
}

/// Maps input indices in an aggregator error to ranks.
pub fn rank_error(e: AggError, ranks: &[Rank]) -> Error {
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

fn f64_bytes(v: &[f64]) -> Bytes {
    Bytes::copy_from_slice(bytemuck::cast_slice(v))
}

fn f64_vec(b: &[u8]) -> Vec<f64> {
    b.chunks_exact(8)
        .map(|c| f64::from_ne_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

/// Combines a sharded statistic round: `versions[s]` holds the owners' versions of shard `s`'s
/// `len` statistics (at least one each); the result is, entry by entry, the sum over shards (in
/// shard order) of the median of each shard's versions. Every rank that receives the same
/// versions gets the same bits; up to half of a shard's versions lying cannot move its median
/// outside the honest values (`+inf` entries are ordered as extremes).
///
/// # Panics
/// If a shard has no version or a version is not `len` long.
pub fn sum_of_shard_medians(versions: &[Vec<&[f64]>], len: usize) -> Vec<f64> {
    let mut total = vec![0.0f64; len];
    let mut part = vec![0.0f64; len];
    for vs in versions {
        assert!(!vs.is_empty(), "a shard without any version");
        assert!(
            vs.iter().all(|v| v.len() == len),
            "a version not {len} long"
        );
        combine_versions(vs, &mut part);
        for (t, p) in total.iter_mut().zip(&part) {
            *t += p;
        }
    }
    total
}

/// The element-wise median of the owners' versions of a table (`+inf` entries are ordered as
/// extremes, so up to half of the versions lying cannot move it outside the honest values).
fn combine_versions(versions: &[&[f64]], out: &mut [f64]) {
    if versions.len() == 1 {
        out.copy_from_slice(versions[0]);
        return;
    }
    let mut col = vec![0.0f64; versions.len()];
    for (j, o) in out.iter_mut().enumerate() {
        for (c, v) in col.iter_mut().zip(versions) {
            *c = v[j];
        }
        col.sort_by(f64::total_cmp);
        let m = col.len();
        *o = if m % 2 == 1 {
            col[m / 2]
        } else {
            col[m / 2 - 1] * 0.5 + col[m / 2] * 0.5
        };
    }
}
