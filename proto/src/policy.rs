//! The robust round's vocabulary: how data moves ([`Policy`], [`Replicas`]), how honest ranks
//! make sure they agree ([`Agreement`]), and what a round reports ([`RoundReport`]).

use crate::{Attribution, Error, PeerFault, Rank};

/// How a robust all-reduce moves data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Policy {
    /// Every rank sends its vector directly to every other rank and aggregates all of them:
    /// memory `n·d` per rank, no relaying through third ranks, strongest guarantees.
    Gather,
    /// Shards of `d/n` coordinates are aggregated by replicated owners and every rank takes
    /// the coordinate-wise median of the owners' results: about `(r + 1)·d` traffic per rank
    /// without faults (with `r > 1` a taker gets one owner's result and the others' digests,
    /// `PROTOCOL.md`, "Versions by digest"). Needs a coordinate-wise rule.
    Sharded(Replicas),
    /// Gather or sharded with `2f + 1` owners, chosen for each call from the world size, the
    /// vector's bytes and the rule ([`Policy::resolve`]), alike on every rank; the report's
    /// [`RoundReport::replicas`] says which ran (`None`: gather). Never sharded with fewer
    /// than `2f + 1` owners, which trusts the owners: that takes an explicit
    /// `Sharded(Replicas::Exactly(r))`.
    Auto,
    /// Sharded with one owner per shard, whose owners are audited after they are bound to
    /// their results (`PROTOCOL.md`, "Audited sharding"): signed pieces and claims, replays
    /// of sub-chunks chosen by each rank's own randomness, proofs every rank checks alike,
    /// and a convicted owner's shard aggregated again within the round
    /// ([`RoundReport::audit`]). Needs [`Agreement::Detect`], a coordinate-wise rule, ranks
    /// with identity keys (an authenticated membership) and a host plane.
    Audited(crate::audit::Audit),
}

/// [`Policy::Auto`] shards vectors of at least this many bytes per rank, where the fewer
/// bytes of sharded mode outweigh its two more steps (`docs/bench/PROFILE.md`).
pub const AUTO_SHARDED_MIN_BYTES: usize = 1 << 20;

/// [`Policy::Auto`] shards where gather mode would hold more than this many bytes of inputs
/// per rank (`n · d` elements), whatever the traffic.
pub const AUTO_GATHER_MAX_BYTES: usize = 256 << 20;

/// How many owners aggregate each shard in [`Policy::Sharded`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replicas {
    /// `2f + 1` owners: the median of their results is safe with up to `f` Byzantine owners.
    Tolerant,
    /// Exactly `r` owners, `1 <= r <= n`. Fewer than `2f + 1` trusts the owners (it protects
    /// against faulty inputs, not against owners that lie about their result) and is logged
    /// as a warning.
    Exactly(usize),
}

impl Replicas {
    /// The number of owners per shard for `f` Byzantine ranks in a world of `n`: `2f + 1`
    /// (at most `n`) for [`Replicas::Tolerant`]. The one place the count is computed; a
    /// [`Round`](crate::round::Round) with fewer than `2f + 1` owners says in its warnings
    /// that the owners are trusted.
    ///
    /// # Errors
    /// [`Error::InvalidUsage`] for [`Replicas::Exactly`] outside `1..=n`.
    pub fn count(self, f: usize, n: usize) -> Result<usize, Error> {
        match self {
            Replicas::Tolerant => Ok(Self::tolerant(f).min(n)),
            Replicas::Exactly(r) if r == 0 || r > n => Err(Error::InvalidUsage(format!(
                "sharded mode with {r} replicas in a world of {n}: need 1 <= r <= n"
            ))),
            Replicas::Exactly(r) => Ok(r),
        }
    }

    /// `2f + 1`: the owners per shard whose median is safe with `f` Byzantine ones.
    pub fn tolerant(f: usize) -> usize {
        f.saturating_mul(2).saturating_add(1)
    }
}

/// How a robust round makes sure that honest ranks do not end it with different results
/// silently (`PROTOCOL.md`, "Agreement").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Agreement {
    /// No cross-check: honest ranks can end a round with different results (a rank that
    /// stalled past the deadline, an equivocating sender) and nothing says so. Explicit only.
    Off,
    /// Every round ends with one extra step in which each rank sends every other the digest
    /// of its result and of each input it used. A rank whose result fewer than `n − f` ranks
    /// share gets [`Error::Disagreement`]; the others get the differences named in
    /// [`RoundReport::agreement`]. With `n > 3f`, two honest ranks that both return `Ok` hold
    /// bitwise the same result.
    #[default]
    Detect,
    /// With `n > 3f`: before aggregating (gather mode) or combining the owners' versions
    /// (sharded mode), the ranks echo the BLAKE3 digests of the inputs, or of the owners'
    /// results, they received for `f` steps (Byzantine broadcast of every digest by
    /// exponential information gathering), decide alike which one each sender or owner
    /// contributed (or that it contributed none, when it equivocated without a majority),
    /// pass the agreed ones on to the ranks that went without, and end with the cross-check
    /// of `Detect`. Under synchrony (every honest message arrives within its step's wait),
    /// honest ranks aggregate the same inputs (combine the same versions) and return bitwise
    /// the same result; when that fails, the cross-check still names it. Refused up front
    /// ([`check_agreement`](crate::round::check_agreement)) in a reduce-scatter (no
    /// common result), for `n <= 3f` and past the echo trees' bound (messages grow as `n^f`).
    Enforce,
}

impl Agreement {
    /// Parses `off`, `detect` or `enforce`.
    ///
    /// # Errors
    /// The accepted values, for any other.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "off" => Ok(Agreement::Off),
            "detect" => Ok(Agreement::Detect),
            "enforce" => Ok(Agreement::Enforce),
            other => Err(format!("{other:?}: expected off, detect or enforce")),
        }
    }

    /// The name [`Agreement::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            Agreement::Off => "off",
            Agreement::Detect => "detect",
            Agreement::Enforce => "enforce",
        }
    }

    /// A byte that names the policy in setup records (`Agreement::from_code` reads it).
    pub fn code(self) -> u8 {
        match self {
            Agreement::Off => 0,
            Agreement::Detect => 1,
            Agreement::Enforce => 2,
        }
    }

    /// The policy [`Agreement::code`] gave `code`, if any.
    pub fn from_code(code: u8) -> Option<Self> {
        [Agreement::Off, Agreement::Detect, Agreement::Enforce]
            .into_iter()
            .find(|a| a.code() == code)
    }
}

/// How many inputs a robust round may go without for their lateness alone (`s`, a budget of
/// its own beside the rule's `f` Byzantine ranks): the steps that carry inputs end once all
/// but `s` of them are in and a grace has passed ([`crate::Grace`]), so that no rank, honest
/// or not, sets the pace of the others. Late inputs are erasures named
/// [`Fault::Late`](crate::Fault::Late) in the report.
///
/// Under [`Agreement::Detect`] a communicator's first collective waits for every input
/// whatever `s` (the ranks start apart, and none has been seen late yet).
///
/// Under [`Agreement::Detect`] a straggler's input can reach some honest ranks before their
/// quorum and others after it: every rank moves to the *common inputs*, those every timely
/// rank it heard in the cross-check used, or, where those are too few for the rule, to the
/// inputs `f + 1` of them used; it names the inputs it left out
/// ([`AgreementReport::realigned`](crate::AgreementReport::realigned)), and the ranks holding
/// an input pass it on to those it was late for
/// ([`AgreementReport::recovered`](crate::AgreementReport::recovered)); a confirmation step
/// turns ranks that still end apart into an error, never a silent split.
/// [`Agreement::Enforce`] agrees on the inputs and keeps them all in step (`PROTOCOL.md`,
/// "Quorum rounds", "Common inputs").
///
/// A peer late round after round (a *laggard*, [`Carry::laggards`](crate::round::Carry)) is
/// waited for only up to the quorum, not through the grace.
///
/// [`Stragglers::Auto`] by default, so that out of the box one late rank does not set the
/// pace: the largest count up to the rule's `f` that its precondition allows at this `n`
/// (in sharded mode also at most `r − f − 1`, so that a shard's `f + 1` alike versions come
/// from owners in time: [`stragglers_in`](crate::round::stragglers_in)); 0 for a rule with
/// `f = 0` (the mean), in the rounds that cannot end a step early (sharded rounds under
/// `Enforce`, of a global rule or with one owner per shard; NCCL), and under
/// [`Agreement::Off`], where nothing brings ranks that went without different late inputs
/// back to one result (a count asked for there is the user's risk). In sharded mode the
/// owners tell each other which senders' pieces they hold before they aggregate, and a late
/// owner is handled like a missing one (`PROTOCOL.md`, "Sharded rounds with stragglers").
/// Under [`Agreement::Enforce`] the echo decides alike for every rank which inputs were in;
/// under [`Agreement::Detect`] the ranks move to one set of inputs after the cross-check and
/// pass late inputs on to the ranks that lack them, and a confirmation step turns ranks that
/// still end apart into an error (on a simulated jittery network at the default grace, about
/// one round in a hundred of a 4-rank job; `PROTOCOL.md`, "Common inputs"). That costs `Detect` one
/// small all-to-all step per gather round. An honest rank's input can be left out of a round
/// for its timing alone, which a robust rule tolerates as it tolerates `f` faulty inputs; the
/// report names it `Late`.
/// `Exactly(0)` waits for every input until the deadline: for a job that compares exact
/// results. A rank can be rounds behind the others when they finish: `Communicator::close`
/// (collective) waits for it before they go. A rank further behind than its peers' send
/// budgets (a few rounds of a large vector) has the messages it did not read dropped by them
/// (over TCP, with a skip notice): it fails those rounds at once, loudly, and takes part in
/// the later ones (`PROTOCOL.md`, "TCP transport" and "Not covered yet").
///
/// Under `Auto` the schedule is chosen as without stragglers ([`Policy::resolve`]): a vector
/// large enough for sharded mode goes sharded, where `s` then follows from the owners. Only an
/// explicit count above 0 makes [`Policy::Auto`] choose gather mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Stragglers {
    /// The largest `s` up to the rule's `f` that keeps its precondition with `n - s` inputs
    /// ([`stragglers_allowed`](crate::round::stragglers_allowed)); 0 where none does, on
    /// transports that cannot end a step early (NCCL), and under [`Agreement::Off`]. The
    /// default.
    #[default]
    Auto,
    /// Exactly `s`: refused up front where the rule's precondition does not hold with `f`
    /// Byzantine inputs among `n - s`. `Exactly(0)` waits for every input until the deadline.
    Exactly(usize),
}

impl Stragglers {
    /// Parses `auto` (or `default`, the same) or a count.
    ///
    /// # Errors
    /// What is accepted, for anything else.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" | "default" => Ok(Stragglers::Auto),
            v => v
                .parse()
                .map(Stragglers::Exactly)
                .map_err(|_| format!("{v:?}: expected auto or a number of ranks")),
        }
    }

    /// What this choice means under `agreement`: `Auto` is `Exactly(0)` under
    /// [`Agreement::Off`]; everything else stays itself.
    pub fn under(self, agreement: Agreement) -> Stragglers {
        match (self, agreement) {
            (Stragglers::Auto, Agreement::Off) => Stragglers::Exactly(0),
            (other, _) => other,
        }
    }

    /// The count asked for under `agreement` ([`Stragglers::under`]; `None`: `Auto`).
    pub fn requested(self, agreement: Agreement) -> Option<usize> {
        match self.under(agreement) {
            Stragglers::Exactly(s) => Some(s),
            _ => None,
        }
    }

    /// How a job's configuration names it (`BYZCOLL_STRAGGLERS`).
    pub fn name(self) -> String {
        match self {
            Stragglers::Auto => "auto".to_string(),
            Stragglers::Exactly(s) => s.to_string(),
        }
    }

    /// Whether the count asked for is above 0: then [`Policy::Auto`] runs gather mode, whose
    /// input step can end early. Under [`Stragglers::Auto`] the schedule is chosen first, and
    /// `s` follows from it (0 in sharded mode).
    pub fn forces_quorum(self) -> bool {
        matches!(self, Stragglers::Exactly(s) if s > 0)
    }
}

/// How the job's ranks proved who they are when the communicator was set up, shown in every
/// [`RoundReport`] so that a result never hides how much its membership can be trusted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IdentityMode {
    /// No peers to authenticate: a world of one, or ranks that share this process.
    #[default]
    Local,
    /// Each rank proved the key a public roster binds to it (`BYZCOLL_ROSTER_FILE`, or
    /// `byzcoll launch`): a process holding the job secret can still claim only its own rank.
    PerRank,
    /// Ranks proved the job's shared secret and a key made at start: strangers are kept out,
    /// but an insider (a process holding the secret) can register as another rank.
    SharedSecret,
    /// No authentication (`BYZCOLL_ALLOW_UNAUTHENTICATED=1`): any process that reached a
    /// rank's port during setup could have joined as a rank.
    Unauthenticated,
}

impl IdentityMode {
    /// The mode's name in reports: `local`, `per-rank`, `shared-secret`, `unauthenticated`.
    pub fn name(self) -> &'static str {
        match self {
            IdentityMode::Local => "local",
            IdentityMode::PerRank => "per-rank",
            IdentityMode::SharedSecret => "shared-secret",
            IdentityMode::Unauthenticated => "unauthenticated",
        }
    }

    /// Of two modes (merged reports), the one with the weaker guarantee.
    pub fn weaker(self, other: Self) -> Self {
        let rank = |m: Self| match m {
            IdentityMode::Local => 0,
            IdentityMode::PerRank => 1,
            IdentityMode::SharedSecret => 2,
            IdentityMode::Unauthenticated => 3,
        };
        if rank(other) > rank(self) {
            other
        } else {
            self
        }
    }
}

impl std::fmt::Display for IdentityMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the cross-check of [`Agreement::Detect`] found, where this rank's result is the one
/// at least `n − f` ranks hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgreementReport {
    /// Ranks that hold another result (Byzantine, or out of step: they get an error, or
    /// realign to this one, [`AgreementReport::realigned`]).
    pub disagreeing: Vec<Rank>,
    /// Ranks whose result is unknown: erased this round, failed, or silent in the cross-check.
    pub unconfirmed: Vec<Rank>,
    /// Senders whose vectors differed between the ranks that aggregated them: they sent
    /// different ranks different vectors (gather mode), or different owners of one shard
    /// different pieces (sharded mode).
    pub differing_inputs: Vec<Rank>,
    /// Shard owners whose result for a shard differed between the ranks that received it
    /// (sharded mode): they sent different ranks different versions.
    pub differing_versions: Vec<Rank>,
    /// Senders whose input this rank received but left out, aggregating again without it:
    /// to take the result that at least `n − f` ranks hold (`s = 0`; `PROTOCOL.md`,
    /// "Realignment"), or, in quorum rounds, because a rank it heard went without it (it
    /// reached that rank late or not at all; "Common inputs"). Gather mode under
    /// [`Agreement::Detect`].
    pub realigned: Vec<Rank>,
    /// Senders whose input the ranks moved to but this rank lacked (it came late here, or
    /// with another digest than the others used): `f + 1` ranks passed it on alike, and it
    /// is in the result (not counted [`Fault::Late`](crate::Fault::Late)). Gather mode under
    /// [`Agreement::Detect`] with stragglers allowed (`PROTOCOL.md`, "Common inputs").
    pub recovered: Vec<Rank>,
}

/// What happened in one robust round.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoundReport {
    /// Number of vectors that entered this rank's aggregation (its own included); in sharded
    /// mode, the smallest count over the shards this rank owns.
    pub inputs: usize,
    /// Peers that were missing or malformed in some step and were treated as erasures.
    pub faults: Vec<PeerFault>,
    /// This rank's own input (gather mode), or its own result for some owned shard (sharded
    /// mode), is not in the result: under [`Agreement::Enforce`] the ranks agreed that it did
    /// not reach them in time (this rank stalled past a deadline, say), and this rank left it
    /// out as they did, so that its result is theirs.
    pub erased_self: bool,
    /// Peers that dropped some of this round's messages to this rank unsent because it fell
    /// behind them (TCP skip notices), ascending, where more than the rule's `f` did (not
    /// all of them can be Byzantine): the round ended without those messages, and their
    /// erasures in `faults` are this rank's lateness, not theirs (the communicator's health
    /// does not count them). Where the round cannot end without them it fails with
    /// [`Error::FellBehind`](crate::Error::FellBehind) instead. `f` or fewer skips are
    /// erasures at fault like missing peers, and leave this empty.
    pub skipped_by: Vec<Rank>,
    /// Ranks whose contribution seen by this rank held NaN or infinities (it still entered the
    /// aggregation, where the rule's non-finite policy applies).
    pub non_finite: Vec<Rank>,
    /// For selection rules (Krum family): the ranks whose vectors were selected.
    pub selected: Option<Vec<Rank>>,
    /// Owners per shard (`None` in gather mode).
    pub replicas: Option<usize>,
    /// `s`, the inputs the round could go without for their lateness alone ([`Stragglers`]):
    /// 0 where every input was waited for until the deadline.
    pub stragglers: usize,
    /// Peak bytes of the buffers the collective itself held at once (payloads sent and
    /// received, intermediate results; not the caller's buffer).
    pub peak_bytes: usize,
    /// The job runs without authentication (`BYZCOLL_ALLOW_UNAUTHENTICATED=1`): any process
    /// that reached a rank's port during setup could have joined as a rank.
    pub unauthenticated: bool,
    /// How the ranks proved who they are ([`IdentityMode`]); `unauthenticated` is
    /// `identity == IdentityMode::Unauthenticated`.
    pub identity: IdentityMode,
    /// The cross-check's findings under [`Agreement::Detect`] (`None` under
    /// [`Agreement::Off`]).
    pub agreement: Option<AgreementReport>,
    /// How far each rank's input lay from the aggregate, and whether the rule set it aside
    /// ([`Attribution`]: evidence, never acted on). In gather mode every honest rank measures
    /// the same inputs against the same result, so it is bitwise the same wherever the inputs
    /// agree; in sharded mode each rank measures the shards it owns. `None` where the plane
    /// does not measure (the simulator, the device path).
    pub attribution: Option<Attribution>,
    /// Bytes moved and each step's time, the cross-check included.
    pub stats: RoundStats,
    /// What the audits found in an audited sharded round (`PROTOCOL.md`, "Audited
    /// sharding"); `None` in any other round.
    pub audit: Option<crate::audit::AuditReport>,
}

/// The most bytes of the vector one sub-round of a sharded all-reduce of a coordinate-wise rule
/// covers: a longer vector runs as consecutive sub-rounds over parts of at most this size
/// (`Communicator::robust_all_reduce`), so that the round's own buffers (pieces, results,
/// versions) stay about this size instead of growing with the vector. The default of
/// `Communicator::set_sub_round_bytes`; every rank must use the same value (`PROTOCOL.md`).
pub const SUB_ROUND_BYTES: usize = 4 << 20;

/// Counters of the steps of one or more collectives (`Communicator::take_stats`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoundStats {
    /// Payload bytes this rank handed to the transport (each destination counted).
    pub bytes_sent: u64,
    /// Payload bytes this rank received (delivered payloads only).
    pub bytes_received: u64,
    /// Each step's time from posting its operations to its last outcome, in order.
    pub step_times: Vec<std::time::Duration>,
}
