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
//!
//! The round's face, its vocabulary and the phase machine are here, the data side drivers
//! implement in `plane`; each phase's posting and handling is a file of its own: `gather`, `scatter` (pieces to owners, the owners'
//! aggregation, statistic rounds), `versions` (owners' results to the takers, by digest where
//! `r > 1`), `enforce` (the echo and the recovery of [`Agreement::Enforce`]) and
//! `cross_check` (the last step of [`Agreement::Detect`]). What a phase's handler alone needs
//! travels in its `Phase` variant.

mod audited;
mod check;
mod cross_check;
mod eig;
mod enforce;
mod gather;
mod plane;
mod scatter;
mod versions;

use std::borrow::Cow;
use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;
use byzcoll_aggregators::evidence::Measure;
use byzcoll_aggregators::{
    AggError, Aggregator, DistanceIteration, DistanceMixing, DistanceSelection, Structure,
};

use crate::schedule::{self, chunk_range, sharded};
use crate::{
    Agreement, Attribution, Error, Fault, Grace, PeerFault, Policy, Quorum, Rank, RecvOp, Replicas,
    RoundReport, Tag, AUTO_GATHER_MAX_BYTES, AUTO_SHARDED_MIN_BYTES,
};

pub use audited::{sign_pieces, AuditCtx};
pub use check::{commitment, input_digest, result_digest, Digest};
use check::{same_input, Check, Seen};
pub use plane::{Dest, Plane};

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
    /// When the step may end before then: the steps that carry inputs, where the round
    /// allows stragglers ([`Spec::stragglers`]).
    pub quorum: Option<Quorum>,
}

/// One receive's outcome, as a driver hands it back.
#[derive(Debug)]
pub enum Arrival<B> {
    /// The expected bytes arrived (the driver checked the length).
    Received(B),
    /// Nothing arrived by the deadline, or the peer is gone.
    Missing,
    /// Nothing arrived by the end of the step's quorum and grace ([`StepPlan::quorum`]).
    Late,
    /// Something unacceptable arrived; the string says what.
    Malformed(String),
    /// A message for another call arrived ([`Fault::OutOfStep`]).
    OutOfStep,
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

/// The same bytes from rank `me` to every other rank of `n` (tag 0).
fn to_every_peer(me: Rank, n: usize, bytes: &Bytes) -> Vec<Send> {
    schedule::direct_peers(me, n)
        .map(|peer| Send {
            peer,
            tag: 0,
            msg: Msg::Bytes(bytes.clone()),
        })
        .collect()
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
    /// The shape of an all-reduce of `d` elements of `elem` bytes by `rule` over `n` ranks
    /// that moves data as `policy` says ([`Policy::Auto`] resolved by [`Policy::resolve`];
    /// `quorum`: the round may end its input step early, which sharded rounds cannot).
    pub fn all_reduce(
        policy: Policy,
        n: usize,
        d: usize,
        elem: usize,
        rule: &dyn Aggregator,
        quorum: bool,
    ) -> Shape {
        match policy.resolve(n, d, elem, rule, quorum) {
            Policy::Sharded(replicas) => Shape::Sharded(replicas),
            Policy::Audited(_) => Shape::Sharded(Replicas::Exactly(1)),
            _ => Shape::Gather,
        }
    }
}

impl Policy {
    /// What [`Policy::Auto`] runs for an all-reduce of `d` elements of `elem` bytes by `rule`
    /// over `n` ranks (any other policy is itself). A function of what every rank of a call
    /// shares, so every rank chooses alike:
    /// - gather where sharded mode cannot run the rule, where the round must be able to end
    ///   its input step early (`quorum`: a stragglers count above 0 asked for,
    ///   [`Stragglers::forces_quorum`](crate::Stragglers::forces_quorum); sharded rounds
    ///   cannot), or for `n <= 2`;
    /// - sharded with `2f + 1` owners where gather would hold more than
    ///   [`AUTO_GATHER_MAX_BYTES`] of inputs;
    /// - otherwise sharded where the vector has at least [`AUTO_SHARDED_MIN_BYTES`] and its
    ///   traffic, about `(r + 1)·d` per rank with `r = 2f + 1` owners, is less than gather's
    ///   `(n − 1)·d`; gather elsewhere (small vectors, where each of sharded mode's extra
    ///   steps costs more than the bytes it saves, and few ranks).
    pub fn resolve(
        self,
        n: usize,
        d: usize,
        elem: usize,
        rule: &dyn Aggregator,
        quorum: bool,
    ) -> Policy {
        if self != Policy::Auto {
            return self;
        }
        if n <= 2 || quorum || statistics_of(rule).is_err() {
            return Policy::Gather;
        }
        let bytes = d.saturating_mul(elem);
        let owners = rule.byzantine().saturating_mul(2).saturating_add(1).min(n);
        let held = bytes.saturating_mul(n);
        let fewer_bytes = owners + 1 < n - 1;
        if held > AUTO_GATHER_MAX_BYTES || (bytes >= AUTO_SHARDED_MIN_BYTES && fewer_bytes) {
            Policy::Sharded(Replicas::Tolerant)
        } else {
            Policy::Gather
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
    /// `s`, the inputs the round may go without for their lateness alone
    /// ([`stragglers_allowed`]): the steps that carry inputs end once all but `s` of them are
    /// in and the [`Spec::grace`] has passed, rather than at the deadline. 0: every input is
    /// waited for until the deadline. The rule's precondition holds with `f` Byzantine inputs
    /// among the `n - s` (an attacker can make sure its inputs are among the first).
    pub stragglers: usize,
    /// How long those steps wait past their quorum.
    pub grace: Grace,
}

/// What a global rule needs exchanged in sharded mode.
#[derive(Clone, Copy)]
enum Statistics<'a> {
    None,
    Select(&'a dyn DistanceSelection),
    Iterate(&'a dyn DistanceIteration),
    Mix(&'a dyn DistanceMixing),
}

/// Where the round is: the step whose outcomes it waits for, with what that step's handler
/// alone needs.
enum Phase<'r, B> {
    Gather,
    Scatter,
    /// A statistic round; `k` counts iterations of an iterative rule.
    Statistic {
        k: usize,
    },
    Versions,
    /// Sharded mode with stragglers allowed: the owners tell each other which senders' pieces
    /// they hold ([`Round::post_sync`]).
    Sync,
    /// Versions by digest: each taker asks for the versions whose digest differs from the
    /// one it holds.
    Request(Pending<B>),
    /// Versions by digest: the owners send the versions asked for.
    Resend(Pending<B>),
    /// A relay step of [`Agreement::Enforce`]'s echo.
    Echo,
    /// [`Agreement::Enforce`]'s recovery step.
    Recover,
    /// The cross-check: this rank's check, and its encoding for each rank.
    Check {
        mine: Check,
        encoded: Vec<Bytes>,
    },
    /// Audited sharding (`audited`): the audit requests, the audit data, the verdicts, the
    /// proofs, and the convicted owners' shards aggregated again, each with the audit's state
    /// (which moves here from [`Round`]'s `audit` at the audit's first step).
    AuditRequest(Box<audited::Auditing<'r>>),
    AuditData(Box<audited::Auditing<'r>>),
    Verdicts(Box<audited::Auditing<'r>>),
    Proofs(Box<audited::Auditing<'r>>),
    Recompute(Box<audited::Auditing<'r>>),
    /// The recovery step after the cross-check (gather mode, `Detect`, stragglers allowed):
    /// the inputs of the round's set that this rank lacks come from ranks that hold them
    /// (`cross_check`; "Common inputs" in `PROTOCOL.md`).
    Mend(Box<cross_check::Mend>),
    /// The confirmation step after the recovery step (gather mode, `Detect`, stragglers
    /// allowed): the result this rank ends with (none where the round failed), and what the
    /// cross-check found.
    Confirm {
        result: Option<Digest>,
        found: crate::AgreementReport,
    },
    Done,
}

impl<B> Phase<'_, B> {
    fn name(&self) -> &'static str {
        match self {
            Phase::Gather => "gather",
            Phase::Scatter => "scatter",
            Phase::Statistic { .. } => "statistic",
            Phase::Versions => "versions",
            Phase::Sync => "sync",
            Phase::Request(_) => "request",
            Phase::Resend(_) => "resend",
            Phase::Echo => "echo",
            Phase::Recover => "recover",
            Phase::AuditRequest(_) => "audit request",
            Phase::AuditData(_) => "audit data",
            Phase::Verdicts(_) => "verdicts",
            Phase::Proofs(_) => "proofs",
            Phase::Recompute(_) => "recompute",
            Phase::Check { .. } => "check",
            Phase::Mend(_) => "mend",
            Phase::Confirm { .. } => "confirm",
            Phase::Done => "done",
        }
    }
}

/// One rank's robust round (see the module docs). `B` is the driver's received-message type.
pub struct Round<'r, B> {
    spec: Spec,
    rule: &'r dyn Aggregator,
    /// Owners per shard (0 in gather mode).
    r: usize,
    statistics: Statistics<'r>,
    phase: Phase<'r, B>,
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
    /// Bytes of input the rules read since the last [`Round::take_work`].
    work: std::cell::Cell<u64>,
    /// [`Agreement::Enforce`]: what the ranks agree on, by *slot* `k·n + j`: in gather mode
    /// (`k = 0`) rank `j`'s input, in sharded mode owner `j`'s result for its `k`-th owned
    /// shard. The messages received (the agreed ones after the recovery step), one echo tree
    /// per `k`, and the decisions.
    held: Vec<Option<B>>,
    /// Gather mode under [`Agreement::Detect`], where the plane [keeps its
    /// input](Plane::keeps_input): the inputs received (and those passed on to it in the
    /// recovery step), kept for the cross-check, which may aggregate again over another set
    /// of inputs, and for passing them on ([`Round::held`]).
    kept: Vec<Option<B>>,
    echo: Vec<eig::Eig>,
    agreed: Vec<Option<Digest>>,
    /// Senders of which the echo carried two different inputs (named in the report's
    /// `differing_inputs`).
    echo_differs: Vec<Rank>,
    /// Peers an earlier sub-round of the same call erased ([`Carry::erased`]).
    carried: Vec<Rank>,
    /// [`Carry::laggards`].
    laggards: Vec<Rank>,
    /// Sharded mode with stragglers allowed, by owned shard: the senders left out of it after
    /// the owners' sync, because a co-owner of it lacked their pieces (`synced`); this rank
    /// among them where its own piece was late for one.
    dropped: Vec<Vec<Rank>>,
    /// This rank's own piece was left out on a co-owner's sync (`synced`).
    erased_by_sync: bool,
    /// [`Carry::own_late`].
    own_late: u32,
    /// The step timeouts an honest rank may start this round later than this one
    /// ([`Carry::lag`]).
    lag_in: u32,
    /// Whether a receive came back missing ([`Round::lag`]).
    saw_missing: bool,
    /// BLAKE3 of this rank's own input, which its check carries where the recovery step
    /// follows ([`Round::confirms`]; `None` where the plane keeps no inputs).
    own_commit: Option<Digest>,
    /// How long the round's steps have taken so far, as the driver measured them
    /// ([`Round::took`]); `None` where it measures nothing.
    elapsed: Option<Duration>,
    /// The plane's measurements of the inputs against the results this rank made, summed
    /// over its owned shards ([`RoundReport::attribution`]).
    measured: Option<Measure>,
    /// An audited round's state (`audited`) through the scatter and versions phases, which
    /// audited and plain rounds share; `None` in any other round, and once the audit's own
    /// phases begin: their [`Phase`] variants carry it from there.
    audit: Option<Box<audited::Auditing<'r>>>,
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
    /// *Laggards*: peers this rank saw late in each of its last rounds (its own observations,
    /// never a peer's word). A quorum step waits for their inputs only up to its quorum: its
    /// grace waits for the other senders alone, so a rank that is always late does not cost
    /// a grace every round. A laggard whose input comes in time is taken as any other.
    pub laggards: Vec<Rank>,
    /// How many robust rounds in a row, up to the last, the agreement left this rank's own
    /// input out ([`Health::own_late`](crate::Health::own_late)). Its peers then count it a laggard, as
    /// it counts them, and under [`Agreement::Enforce`] pass it nothing it lacks; so where it
    /// is one again, it waits for nothing to be passed on (module `enforce`).
    pub own_late: u32,
}

impl<B> std::fmt::Debug for Round<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Round")
            .field("spec", &self.spec)
            .field("rule", &self.rule.name())
            .field("phase", &self.phase.name())
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
        Self::start(spec, rule, carry, None)
    }

    /// An audited round (`PROTOCOL.md`, "Audited sharding"): `spec` a sharded all-reduce with
    /// one owner per shard under [`Agreement::Detect`], without stragglers, of a
    /// coordinate-wise rule; `carry` as [`Round::resuming`]; `ctx` this rank's keys, signed
    /// pieces and randomness. A spec or
    /// context that does not allow it is the round's error ([`Error::InvalidUsage`]), and a
    /// plane that cannot audit ([`Plane::host_bytes`]) fails it with [`Error::Unsupported`].
    pub fn audited(spec: Spec, rule: &'r dyn Aggregator, carry: &Carry, ctx: AuditCtx<'r>) -> Self {
        Self::start(spec, rule, carry, Some(ctx))
    }

    fn start(
        spec: Spec,
        rule: &'r dyn Aggregator,
        carry: &Carry,
        audit: Option<AuditCtx<'r>>,
    ) -> Self {
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
            warnings: Vec::new(),
            work: std::cell::Cell::new(0),
            held: Vec::new(),
            kept: Vec::new(),
            echo: Vec::new(),
            agreed: Vec::new(),
            echo_differs: Vec::new(),
            carried: erased.iter().map(|f| f.rank).collect(),
            laggards: carry.laggards.clone(),
            dropped: Vec::new(),
            erased_by_sync: false,
            own_late: carry.own_late,
            lag_in: carry.lag,
            saw_missing: false,
            own_commit: None,
            elapsed: None,
            measured: None,
            audit: None,
        };
        if let Some(ctx) = audit {
            if let Err(e) = round.audit_precondition(&ctx) {
                round.r = 1;
                round.seen = Seen::new(n, 1);
                round.fail(e);
                return round;
            }
            round.audit = Some(Box::new(audited::Auditing::new(ctx, n)));
        }
        round.report.faults = erased.to_vec();
        round.report.stragglers = spec.stragglers;
        let start = match spec.shape {
            Shape::Gather => rule
                .check(n)
                .map_err(Error::Aggregation)
                .and_then(|()| check_agreement(spec.agreement, spec.shape, n, f))
                .and_then(|()| stragglers_allowed(rule, n, Some(spec.stragglers)))
                .map(|_| round.post_gather()),
            Shape::Sharded(replicas) | Shape::ReduceScatter(replicas) => {
                // The digest layout follows the count even when the rule is refused, so that
                // every rank's cross-check has the same length.
                round.r = replicas.count(f, n).unwrap_or(0);
                round.seen = Seen::new(n, round.r);
                check_agreement(spec.agreement, spec.shape, n, f)
                    .and_then(|()| rule.check(n).map_err(Error::Aggregation))
                    .and_then(|()| {
                        stragglers_in(rule, n, spec.shape, spec.agreement, Some(spec.stragglers))
                    })
                    .and_then(|_| statistics_of(rule))
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

    /// The message this rank received for slot `j` while the round holds it (what
    /// [`Msg::Forward`] sends): rank `j`'s input in gather mode ([`Agreement::Enforce`], and
    /// [`Agreement::Detect`] where it recovers late inputs); in sharded mode, for
    /// `j = k·n + o`, owner `o`'s result for its `k`-th owned shard.
    pub fn held(&self, j: usize) -> Option<&B> {
        match self.held.get(j) {
            Some(Some(b)) => Some(b),
            _ => self.kept.get(j)?.as_ref(),
        }
    }

    /// Whether the round has failed (the cross-check may still run).
    pub fn has_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// The driver's measure of the step it is about to [`Round::handle`]: how long passed
    /// from the end of the step before (the round's start, for the first) to its end, so that
    /// the sum is the round's time so far, the work between steps included. Optional; where
    /// given, it bounds the recovery step of [`Agreement::Detect`] with stragglers, which
    /// otherwise waits until its deadline for copies that may never come (`PROTOCOL.md`,
    /// "Recovery step").
    pub fn took(&mut self, step: Duration) {
        self.elapsed = Some(self.elapsed.unwrap_or_default().saturating_add(step));
    }

    /// The outcomes of [`Round::step`]'s receives, in its order, one each.
    ///
    /// # Panics
    /// When no step is posted or the outcomes do not match its receives: a driver bug.
    pub fn handle<P: Plane<Buf = B>>(&mut self, plane: &mut P, outcomes: Vec<Arrival<B>>) {
        let plan = self.plan.take().expect("a step is posted");
        assert_eq!(plan.recvs.len(), outcomes.len(), "one outcome per receive");
        self.saw_missing |= outcomes
            .iter()
            .any(|a| matches!(a, Arrival::Missing | Arrival::Late));
        // The phase's data moves into its handler, which posts the next phase (or ends).
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Gather => self.gathered(plane, &plan, outcomes),
            Phase::Scatter => self.scattered(plane, &plan, outcomes),
            Phase::Statistic { k } => self.statistic_done(plane, &plan, outcomes, k),
            Phase::Versions => self.versions_done(plane, &plan, outcomes),
            Phase::Sync => self.synced(plane, &plan, outcomes),
            Phase::Request(pending) => self.requests_arrived(plane, &plan, outcomes, pending),
            Phase::Resend(pending) => self.resent(plane, &plan, outcomes, pending),
            Phase::Echo => self.echoed(plane, &plan, outcomes),
            Phase::Recover => self.recovered(plane, &plan, outcomes),
            Phase::AuditRequest(a) => self.requests_in(a, plane, &plan, outcomes),
            Phase::AuditData(a) => self.data_in(a, plane, &plan, outcomes),
            Phase::Verdicts(a) => self.verdicts_in(a, plane, &plan, outcomes),
            Phase::Proofs(a) => self.proofs_in(a, plane, &plan, outcomes),
            Phase::Recompute(a) => self.recomputed(a, plane, &plan, outcomes),
            Phase::Check { mine, encoded } => self.checked(plane, &plan, outcomes, mine, encoded),
            Phase::Mend(m) => self.mended(plane, &plan, outcomes, *m),
            Phase::Confirm { result, found } => {
                self.confirmed(plane, &plan, outcomes, result, found)
            }
            Phase::Done => unreachable!("no step is posted when done"),
        }
    }

    /// Whether the agreement left this rank's own input (or version) out of the round
    /// ([`RoundReport::erased_self`]), known even where the round then fails: for the fault
    /// memory's count of this rank's own rounds behind (`Health::note_own_input`).
    ///
    /// Not where only an owners' sync left it out (sharded mode with stragglers): that is a
    /// co-owner's word, and nothing a peer says moves this rank's own fault memory.
    pub fn erased_self(&self) -> bool {
        self.report.erased_self && !self.erased_by_sync
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
            None => {
                let mut report = self.report;
                report.attribution = self
                    .measured
                    .map(|m| Attribution::of(&m, report.selected.as_deref()));
                Ok(report)
            }
        }
    }

    /// Adds a plane's measurement of one result's inputs ([`Plane::measure`]).
    fn add_measure(&mut self, m: Option<Measure>) {
        match (&mut self.measured, m) {
            (Some(sum), Some(m)) => sum.add(&m),
            (none @ None, Some(m)) => *none = Some(m),
            (_, None) => {}
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

    fn post(
        &mut self,
        phase: Phase<'r, B>,
        op: &'static str,
        sends: Vec<Send>,
        recvs: Vec<RecvOp>,
    ) {
        // With stragglers allowed, no step waits for its sends to a straggler to leave (a
        // rendezvous transport would hold it until the straggler posts the step): each ends
        // with its receives, all of them.
        let quorum = (self.spec.stragglers > 0).then_some(Quorum::every(recvs.len()));
        self.post_quorum(phase, op, sends, recvs, quorum);
    }

    /// [`Round::post`] of a step that carries inputs: with stragglers allowed, it may end
    /// once all but `s` senders' receives are in (`per_sender` receives each) and the grace
    /// has passed, the grace waiting for no laggard ([`Carry::laggards`]; their receives go
    /// last).
    fn post_inputs(
        &mut self,
        phase: Phase<'r, B>,
        op: &'static str,
        sends: Vec<Send>,
        mut recvs: Vec<RecvOp>,
        per_sender: usize,
    ) {
        let s = self.spec.stragglers;
        let laggards = &self.laggards;
        if s > 0 && !laggards.is_empty() {
            recvs.sort_by_key(|r| laggards.contains(&r.peer));
        }
        let awaited = recvs.iter().filter(|r| !laggards.contains(&r.peer)).count();
        let quorum = (s > 0).then(|| Quorum {
            receives: recvs.len().saturating_sub(s.saturating_mul(per_sender)),
            grace: self.spec.grace,
            awaited,
            core: 0,
        });
        self.post_quorum(phase, op, sends, recvs, quorum);
    }

    /// [`Round::post`] of a step whose receives include peers that were only late this round
    /// (a quorum step's cut, [`Fault::Late`]): it may end once the other receives are all in
    /// ([`Quorum::core`]), and at least `at_least` in all, and the grace has passed, the grace
    /// waiting for no laggard ([`Carry::laggards`]). Under [`Agreement::Enforce`] the echo
    /// and the cross-check need the relays and checks of such peers (their inputs were often
    /// in time elsewhere), but must not wait a deadline for a straggler where they do not
    /// need it.
    fn post_awaiting_late(
        &mut self,
        phase: Phase<'r, B>,
        op: &'static str,
        sends: Vec<Send>,
        mut recvs: Vec<RecvOp>,
        at_least: usize,
        grace: Grace,
    ) {
        let late = |p: Rank| self.is_late(p);
        let laggard = |p: Rank| late(p) && self.laggards.contains(&p);
        // The peers in time first, then the late ones, the laggards last.
        recvs.sort_by_key(|r| (late(r.peer), laggard(r.peer)));
        let late_ones = recvs.iter().filter(|r| late(r.peer)).count();
        if late_ones == 0 {
            return self.post(phase, op, sends, recvs);
        }
        // The peers in time must all have an outcome (`core`: a dead one's comes at once),
        // and `at_least` messages must have come, the late peers' among them where the others
        // are fewer; only messages that came count towards `receives`, so asking there for
        // every peer in time would wait for a late one's whenever one in time is dead.
        let quorum = Quorum {
            receives: at_least.min(recvs.len()),
            grace,
            awaited: recvs.len() - recvs.iter().filter(|r| laggard(r.peer)).count(),
            core: recvs.len() - late_ones,
        };
        self.post_quorum(phase, op, sends, recvs, Some(quorum));
    }

    /// Bounds the step just posted, where the driver measures the round ([`Round::took`]):
    /// it waits at most as long again as the round so far, plus one grace of it
    /// ([`Grace::after`]), within its step timeout. For the steps after a quorum step whose
    /// messages only some peers may send: what has not come by then is missing, and the
    /// step's rule decides on what came, loudly where that is too little.
    fn bound_by_the_round_so_far(&mut self) {
        if let (Some(bound), Some(plan)) = (self.so_far_and_a_grace(), &mut self.plan) {
            plan.timeout = plan.timeout.min(bound);
        }
    }

    /// The round so far plus one grace of it ([`Grace::after`]), where the driver measures
    /// the round ([`Round::took`]).
    fn so_far_and_a_grace(&self) -> Option<Duration> {
        self.elapsed
            .map(|elapsed| elapsed.saturating_add(self.spec.grace.after(elapsed)))
    }

    /// How many other ranks a result needs besides this one's own: `n − f − 1`.
    fn others_needed(&self) -> usize {
        self.spec.n.saturating_sub(self.rule.byzantine() + 1)
    }

    /// Whether this round counted `rank` late ([`Fault::Late`]).
    fn is_late(&self, rank: Rank) -> bool {
        self.fault_of(rank) == Some(&Fault::Late)
    }

    /// [`Round::post`] of a step after the inputs whose messages a rank silent after its
    /// input (a Byzantine rank, or one stopped between steps) would hold until the deadline:
    /// it waits for every receive, but once `needed` messages have come (as many as the step
    /// needs from others where the rest are Byzantine), for the rest only a grace of the
    /// round so far plus one grace of it ([`Grace::after`]). Measured from those messages
    /// rather than from this rank's post, the wait follows the other ranks' pace: a peer
    /// whose input step lasted longer (a late input it waited for, up to a grace of its
    /// quorum) sends later. (A grace of the round so far alone cut such honest checks:
    /// simulated, 4 ranks, a straggler late by an exponential 3 ms, 2 ms of jitter, seeds 1
    /// to 15 of 1000 rounds, 105 rounds failed loudly against 72 with every check waited
    /// for; with this grace 76, and 91 rounds over the simulator's bound against 107.)
    /// Receives still open then are late; sends live until the step timeout, as any step's.
    /// A plain step where the driver does not measure the round ([`Round::took`]) or nothing
    /// is needed before the grace (its grace would run from the post, and cut honest peers
    /// still in their own input step's grace).
    fn post_past_quorum(
        &mut self,
        phase: Phase<'r, B>,
        op: &'static str,
        sends: Vec<Send>,
        recvs: Vec<RecvOp>,
        needed: usize,
    ) {
        // A step needing every receive but one waits for the last only the grace too: a
        // silent peer would otherwise hold it to the deadline, and its rule fails it loudly
        // without that message either way.
        let receives = needed.min(recvs.len().saturating_sub(1));
        let (Some(grace), true) = (self.so_far_and_a_grace(), receives > 0) else {
            return self.post(phase, op, sends, recvs);
        };
        let quorum = Quorum {
            receives,
            grace: Grace {
                min: grace,
                factor: self.spec.grace.factor,
            },
            awaited: recvs.len(),
            core: 0,
        };
        self.post_quorum(phase, op, sends, recvs, Some(quorum));
    }

    /// The fault this round has counted `rank` at, if any.
    fn fault_of(&self, rank: Rank) -> Option<&Fault> {
        self.report
            .faults
            .iter()
            .find(|f| f.rank == rank)
            .map(|f| &f.fault)
    }

    fn post_quorum(
        &mut self,
        phase: Phase<'r, B>,
        op: &'static str,
        sends: Vec<Send>,
        recvs: Vec<RecvOp>,
        quorum: Option<Quorum>,
    ) {
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
            quorum,
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
            Arrival::Late => self.add_fault(rank, Fault::Late),
            Arrival::Malformed(why) => self.add_fault(rank, Fault::Malformed(why.clone())),
            Arrival::OutOfStep => self.add_fault(rank, Fault::OutOfStep),
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

/// `s`, the inputs a round of `rule` over `n` ranks may go without for their lateness alone
/// ([`Spec::stragglers`]): `requested`, checked, or for `None` the largest value up to the
/// rule's `f` that keeps its precondition with `n - s` inputs (0 where none does). The
/// precondition must hold with `f` Byzantine inputs among the `n - s` that end a step early,
/// since an attacker can make sure its inputs are among the first: a median needs
/// `n - s > 2f`, Krum `n - s > 2f + 2`, Bulyan `n - s >= 4f + 3`.
///
/// # Errors
/// [`Error::InvalidUsage`] for a requested `s` of `n` or more, or one that leaves too few
/// inputs for the rule (the message says how many it needs).
pub fn stragglers_allowed(
    rule: &dyn Aggregator,
    n: usize,
    requested: Option<usize>,
) -> Result<usize, Error> {
    match requested {
        None => Ok((0..=rule.byzantine().min(n.saturating_sub(1)))
            .rev()
            .find(|&s| rule.check(n - s).is_ok())
            .unwrap_or(0)),
        Some(0) => Ok(0),
        Some(s) if s >= n => Err(Error::InvalidUsage(format!(
            "{s} stragglers allowed in a world of {n}: a round needs at least one input"
        ))),
        Some(s) => rule.check(n - s).map(|()| s).map_err(|e| {
            Error::InvalidUsage(format!(
                "{s} stragglers allowed leave {} inputs, too few for {} with f = {}: {e}; allow \
                 fewer stragglers (0 waits for every input)",
                n - s,
                rule.name(),
                rule.byzantine()
            ))
        }),
    }
}

/// `s` for a round of `shape` ([`stragglers_allowed`] in gather mode). In sharded mode a late
/// owner is handled like a missing one: its versions are not waited for past the quorum, and a
/// taker takes a shard's result where `2f + 1` versions are in (their median holds `f`
/// Byzantine ones) or `f + 1` alike are (at least one honest owner computed it). So one shard
/// needs `f + 1 + s` owners, `r >= f + 1 + s` (the `2f + 1` of [`Replicas::Tolerant`] allow
/// `s = f`); only versions by digest (`r > 1` outside [`Agreement::Enforce`], whose echo of
/// the versions waits for every owner) of a coordinate-wise rule (a global rule's statistic
/// steps wait for every owner) can end early. `None` asks for the largest `s` all that allows
/// (0 where nothing does).
///
/// # Errors
/// As [`stragglers_allowed`]; [`Error::InvalidUsage`] for a requested `s` above `r - f - 1`
/// in sharded mode; [`Error::Unsupported`] for one above 0 where sharded mode cannot end its
/// versions step early.
pub fn stragglers_in(
    rule: &dyn Aggregator,
    n: usize,
    shape: Shape,
    agreement: Agreement,
    requested: Option<usize>,
) -> Result<usize, Error> {
    let replicas = match shape {
        Shape::Gather => return stragglers_allowed(rule, n, requested),
        Shape::Sharded(replicas) => replicas,
        // Its cross-check compares the input sets, which the owners' sync may leave apart.
        Shape::ReduceScatter(_) => {
            return match requested {
                None | Some(0) => Ok(0),
                Some(s) => Err(Error::Unsupported(format!(
                    "{s} stragglers allowed in a sharded reduce-scatter, whose cross-check \
                     compares the input sets; allow none or auto"
                ))),
            }
        }
    };
    if requested == Some(0) {
        return Ok(0);
    }
    let f = rule.byzantine();
    // A replica count or a rule sharded mode refuses is the round's own error, where auto
    // asks (the round still runs its cross-check, so that ranks stay in step).
    let r = match (replicas.count(f, n), requested) {
        (Ok(r), _) => r,
        (Err(_), None) => return Ok(0),
        (Err(e), Some(_)) => return Err(e),
    };
    let cannot = if agreement == Agreement::Enforce {
        Some("under Agreement::Enforce, whose echo of the owners' versions waits for every owner")
    } else if !matches!(statistics_of(rule), Ok(Statistics::None)) {
        Some("of a rule that is not coordinate-wise, whose statistic steps wait for every owner")
    } else if r < 2 {
        Some("with one owner per shard, where a late owner's shard would be lost")
    } else {
        None
    };
    let room = r.saturating_sub(f + 1);
    match (cannot, requested) {
        (Some(_), None) => Ok(0),
        (Some(why), Some(s)) => Err(Error::Unsupported(format!(
            "{s} stragglers allowed in sharded rounds {why}; allow none or auto, or run gather mode"
        ))),
        (None, Some(s)) if s > room => Err(Error::InvalidUsage(format!(
            "{s} stragglers allowed in sharded rounds with r = {r} owners per shard and f = {f}: a \
             shard's result needs f + 1 alike versions from owners in time, so r >= f + 1 + s = \
             {}; ask for more owners per shard or fewer stragglers (0 waits for every input)",
            f + 1 + s
        ))),
        (None, None) => Ok(stragglers_allowed(rule, n, None)?.min(room)),
        (None, requested) => stragglers_allowed(rule, n, requested),
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
