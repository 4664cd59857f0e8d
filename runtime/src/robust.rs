//! Byzantine-robust all-reduce in two schedules: gather and sharded (see [`Policy`]).

use std::borrow::Cow;
use std::sync::Arc;

use bytes::Bytes;
use byzcoll_aggregators::{aggregate_into, AggError, Aggregator, Element, Median, Structure};

use crate::comm::{byte_len, cast_payload, fault, recv, send, to_bytes, Sequence};
use crate::schedule::{self, chunk_range, sharded};
use crate::{Communicator, Error, Payload, PeerFault, Rank, RecvOp, RecvOutcome, Result, SendOp};

/// How a robust all-reduce moves data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Policy {
    /// Every rank sends its vector directly to every other rank and aggregates all of them:
    /// memory `n·d` per rank, no relaying through third ranks, strongest guarantees.
    Gather,
    /// Shards of `d/n` coordinates are aggregated by replicated owners and every rank takes
    /// the coordinate-wise median of the owners' results: about `2·r·d` memory and traffic per
    /// rank. Needs a coordinate-wise rule.
    Sharded(Replicas),
}

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
    /// (at most `n`) for [`Replicas::Tolerant`]. A count below `2f + 1` is logged as a warning
    /// (the owners are trusted).
    ///
    /// # Errors
    /// [`Error::InvalidUsage`] for [`Replicas::Exactly`] outside `1..=n`.
    pub fn count(self, f: usize, n: usize) -> Result<usize> {
        self.check_count(f, n)?;
        match self {
            Replicas::Tolerant => Ok(f.saturating_mul(2).saturating_add(1).min(n)),
            Replicas::Exactly(r) if r == 0 || r > n => Err(Error::InvalidUsage(format!(
                "sharded mode with {r} replicas in a world of {n}: need 1 <= r <= n"
            ))),
            Replicas::Exactly(r) => {
                if r < f.saturating_mul(2).saturating_add(1) {
                    tracing::warn!(
                        r,
                        f,
                        "sharded robust_all_reduce with r < 2f + 1: shard owners are trusted"
                    );
                }
                Ok(r)
            }
        }
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
    /// Inputs echoed before aggregating, so that honest ranks exclude equivocating senders
    /// alike. Not built yet: asking for it is an [`Error::Unsupported`].
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
}

/// What the cross-check of [`Agreement::Detect`] found, where this rank's result is the one
/// at least `n − f` ranks hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgreementReport {
    /// Ranks that hold another result (Byzantine, or out of step: they get an error).
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
}

impl Replicas {
    fn check_count(self, f: usize, n: usize) -> Result<usize> {
        match self {
            Replicas::Tolerant => Ok(f.saturating_mul(2).saturating_add(1).min(n)),
            Replicas::Exactly(r) if r == 0 || r > n => Err(Error::InvalidUsage(format!(
                "sharded mode with {r} replicas in a world of {n}: need 1 <= r <= n"
            ))),
            Replicas::Exactly(r) => Ok(r),
        }
    }
}

/// What happened in one robust round.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoundReport {
    /// Number of vectors that entered this rank's aggregation (its own included); in sharded
    /// mode, the smallest count over the shards this rank owns.
    pub inputs: usize,
    /// Peers that were missing or malformed in some step and were treated as erasures.
    pub faults: Vec<PeerFault>,
    /// Ranks whose contribution seen by this rank held NaN or infinities (it still entered the
    /// aggregation, where the rule's non-finite policy applies).
    pub non_finite: Vec<Rank>,
    /// For selection rules (Krum family): the ranks whose vectors were selected.
    pub selected: Option<Vec<Rank>>,
    /// Owners per shard (`None` in gather mode).
    pub replicas: Option<usize>,
    /// Peak bytes of the buffers the collective itself held at once (payloads sent and
    /// received, intermediate results; not the caller's buffer).
    pub peak_bytes: usize,
    /// The job runs without authentication (`BYZCOLL_ALLOW_UNAUTHENTICATED=1`): any process
    /// that reached a rank's port during setup could have joined as a rank.
    pub unauthenticated: bool,
    /// The cross-check's findings under [`Agreement::Detect`] (`None` under
    /// [`Agreement::Off`]).
    pub agreement: Option<AgreementReport>,
    /// Bytes moved and each step's time, the cross-check included.
    pub stats: crate::RoundStats,
}

/// Rewrites the result a Byzantine shard owner sends for `shard` to `dest`.
pub(crate) type Tamper = Arc<dyn Fn(usize, Rank, &[u8]) -> Bytes + Send + Sync>;

/// Fault injection for tests (feature `fault-injection`, for test doubles only): lets a rank
/// act as a Byzantine shard owner by rewriting the result it sends for `shard` to `dest`
/// (equivocation included).
#[cfg(feature = "fault-injection")]
pub type OwnerTamper = Tamper;

impl RoundReport {
    fn add_fault(&mut self, f: PeerFault) {
        if !self.faults.iter().any(|g| g.rank == f.rank) {
            self.faults.push(f);
        }
    }
}

/// Where a sharded round reads its input and delivers the combined shards.
enum Target<'a, T> {
    /// All-reduce: the vector is the input, and every shard comes back into it.
    All(&'a mut [T]),
    /// Reduce-scatter: only this rank's own shard comes back, into `output`.
    OwnShard { input: &'a [T], output: &'a mut [T] },
}

impl<T> Target<'_, T> {
    fn input(&self) -> &[T] {
        match self {
            Target::All(buf) => buf,
            Target::OwnShard { input, .. } => input,
        }
    }
}

/// Maps input indices in an aggregator error to ranks.
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

impl Communicator {
    /// Byzantine-robust all-reduce: every honest rank's `buf` becomes `rule` applied to all
    /// ranks' vectors, moved according to `policy`.
    ///
    /// The rule's precondition is checked for the world size before any data moves. A peer
    /// whose message is missing at the deadline or malformed is an erasure for this round and
    /// named in the report; the round still completes when the precondition holds for what did
    /// arrive. Inputs are aggregated in rank order, so every honest rank computes bitwise the
    /// same result, and sharded mode gives bitwise the gather-mode result for coordinate-wise
    /// rules when nobody misbehaves.
    ///
    /// # Errors
    /// [`Error::Aggregation`] when the precondition fails for the world size or the rule refuses
    /// its inputs (input indices in `NonFiniteInputs` are ranks); [`Error::TooManyFaults`] when
    /// too many peers failed the round; [`Error::Unsupported`] for a rule that sharded mode
    /// cannot run; [`Error::InvalidUsage`] for a replica count outside `1..=n`.
    ///
    /// On error, gather mode leaves `buf` unchanged; sharded mode may have overwritten the
    /// shards combined before the failing one.
    ///
    /// # Cancel safety
    /// Not cancel safe: the other ranks count this rank missing.
    pub async fn robust_all_reduce<T: Element>(
        &mut self,
        buf: &mut [T],
        rule: &dyn Aggregator,
        policy: Policy,
    ) -> Result<RoundReport> {
        let agreement = self.round_agreement()?;
        let n = self.size();
        self.take_stats();
        let r = match policy {
            Policy::Gather => 0,
            Policy::Sharded(replicas) => replicas.check_count(rule.byzantine(), n).unwrap_or(0),
        };
        let mut seen = Seen::new(n, r);
        let round = match policy {
            Policy::Gather => self.gather(buf, rule, &mut seen.inputs).await,
            Policy::Sharded(replicas) => {
                self.sharded(Target::All(buf), rule, replicas, &mut seen)
                    .await
            }
        };
        let result = || blake3::hash(bytemuck::cast_slice(buf)).into();
        self.finish_round(agreement, round, result, seen, rule.byzantine())
            .await
    }

    /// The agreement policy for a robust round, refused up front where it is not built.
    fn round_agreement(&self) -> Result<Agreement> {
        match self.agreement() {
            Agreement::Enforce => Err(Error::Unsupported(
                "Agreement::Enforce is not built yet; Agreement::Detect (the default) names \
                 every disagreement"
                    .into(),
            )),
            agreement => Ok(agreement),
        }
    }

    /// Ends a robust round: the cross-check unless `agreement` is off (`result` gives the
    /// digest the ranks compare, asked only when the round succeeded), then the report's
    /// authentication flag and the round's counters.
    async fn finish_round(
        &mut self,
        agreement: Agreement,
        round: Result<RoundReport>,
        result: impl FnOnce() -> Digest,
        seen: Seen,
        f: usize,
    ) -> Result<RoundReport> {
        let mut report = if agreement == Agreement::Off {
            round?
        } else {
            let result = round.is_ok().then(result);
            self.cross_check(round, result, seen, f).await?
        };
        report.unauthenticated = !self.is_authenticated();
        report.stats = self.take_stats();
        Ok(report)
    }

    /// The cross-check step of [`Agreement::Detect`]: every rank, whether its round succeeded
    /// or not (so that collectives stay numbered alike), sends every other rank its [`Check`];
    /// the ranks this rank erased are not waited for.
    ///
    /// `result` is the digest the ranks compare (`Some` exactly when the round succeeded).
    async fn cross_check(
        &mut self,
        round: Result<RoundReport>,
        result: Option<Digest>,
        seen: Seen,
        f: usize,
    ) -> Result<RoundReport> {
        let (me, n) = (self.rank(), self.size());
        let r = seen.r;
        let mine = match result {
            Some(result) if round.is_ok() => Check {
                result: Some(result),
                seen,
            },
            _ => Check {
                result: None,
                seen: Seen {
                    steps: seen.steps,
                    ..Seen::new(n, r)
                },
            },
        };
        let erased: Vec<Rank> = match &round {
            Ok(report) => report.faults.iter().map(|f| f.rank).collect(),
            Err(_) => Vec::new(),
        };
        let awaited: Vec<Rank> = schedule::direct_peers(me, n)
            .filter(|p| !erased.contains(p))
            .collect();
        let payload = Payload::Host(mine.encode());
        let sends = schedule::direct_peers(me, n).map(|p| send(p, payload.clone()));
        let recvs = awaited.iter().map(|&p| recv(p, Check::len(n, r)));
        let mut seq = self.begin("cross_check");
        // An honest rank can reach this step up to a timeout per step of the round later than
        // this one (a silent Byzantine owner makes only the ranks that wait for it wait), so
        // the cross-check waits that long before counting it unconfirmed.
        seq.stretch_timeout(mine.seen.steps);
        let outcomes = seq.run(sends.collect(), recvs.collect()).await;
        let mut report = round?;
        let outcomes = outcomes?;
        let mut theirs: Vec<Option<Check>> = vec![None; n];
        for (&p, outcome) in awaited.iter().zip(outcomes) {
            if let RecvOutcome::Received(payload) = outcome {
                theirs[p] = Check::decode(crate::comm::host_bytes(&payload), n, r);
            }
        }
        let mut found = AgreementReport::default();
        let mut agreeing = vec![me];
        for p in schedule::direct_peers(me, n) {
            match theirs[p].as_ref().and_then(|c| c.result.map(|r| (c, r))) {
                None => found.unconfirmed.push(p),
                Some((_, r)) if Some(r) != mine.result => found.disagreeing.push(p),
                Some(_) => agreeing.push(p),
            }
        }
        let differ =
            |a: Option<Digest>, b: Option<Digest>| matches!((a, b), (Some(a), Some(b)) if a != b);
        let mut differing_inputs: Vec<Rank> = (0..n)
            .filter(|&j| {
                theirs
                    .iter()
                    .flatten()
                    .any(|c| differ(c.seen.inputs[j], mine.seen.inputs[j]))
            })
            .collect();
        if r > 0 {
            // Co-owners compare the pieces each sender gave them of the shards both own, and
            // every rank compares the versions each owner sent it with those others got.
            let mine_owned: Vec<usize> = sharded::owned(me, n, r).collect();
            for (p, theirs) in theirs.iter().enumerate() {
                let Some(c) = theirs else { continue };
                for (k, s) in sharded::owned(p, n, r).enumerate() {
                    let Some(i) = mine_owned.iter().position(|&t| t == s) else {
                        continue;
                    };
                    for j in 0..n {
                        if differ(c.seen.pieces[k * n + j], mine.seen.pieces[i * n + j]) {
                            differing_inputs.push(j);
                        }
                    }
                }
                for (idx, (&a, &b)) in c.seen.versions.iter().zip(&mine.seen.versions).enumerate() {
                    if differ(a, b) {
                        let (s, k) = (idx / r, idx % r);
                        found.differing_versions.push((s + k) % n);
                    }
                }
            }
            differing_inputs.sort_unstable();
            differing_inputs.dedup();
            found.differing_versions.sort_unstable();
            found.differing_versions.dedup();
        }
        found.differing_inputs = differing_inputs;
        agreeing.sort_unstable();
        if agreeing.len() < n.saturating_sub(f) {
            return Err(Error::Disagreement {
                agreeing,
                disagreeing: found.disagreeing,
                unconfirmed: found.unconfirmed,
                differing_inputs: found.differing_inputs,
            });
        }
        if !found.disagreeing.is_empty()
            || !found.differing_inputs.is_empty()
            || !found.differing_versions.is_empty()
        {
            tracing::warn!(
                disagreeing = ?found.disagreeing,
                differing_inputs = ?found.differing_inputs,
                differing_versions = ?found.differing_versions,
                "robust_all_reduce: ranks ended the round with other results"
            );
        }
        report.agreement = Some(found);
        Ok(report)
    }

    /// Byzantine-robust reduce-scatter: `input` is cut into `n` shards
    /// ([`schedule::chunk_range`]`(input.len(), n, s)` for shard `s`), and rank `s`'s `output`
    /// becomes `rule` applied to every rank's shard `s`. It is the sharded schedule of
    /// [`Communicator::robust_all_reduce`] (each shard aggregated by `replicas` owners) whose
    /// owners send each shard's result only to the rank that takes it, which combines the
    /// owners' versions by their coordinate-wise median: bitwise the own shard of the
    /// all-reduce with the same rule and replicas, for about `(r + 1)/(2r)` of its traffic.
    ///
    /// Under [`Agreement::Detect`] the ranks compare, in the final step, which ranks' inputs
    /// each of them aggregated (results differ by design: every rank holds another shard) and
    /// co-owners compare the pieces each sender gave them: a rank whose input set fewer than
    /// `n − f` ranks share (it stalled past the deadline and resumed, say) gets
    /// [`Error::Disagreement`], and an equivocating sender is named in
    /// [`AgreementReport::differing_inputs`].
    ///
    /// # Errors
    /// As [`Communicator::robust_all_reduce`] in sharded mode, and [`Error::InvalidUsage`] when
    /// `output` is not this rank's shard of `input` in length.
    ///
    /// # Cancel safety
    /// Not cancel safe: the other ranks count this rank missing.
    pub async fn robust_reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        rule: &dyn Aggregator,
        replicas: Replicas,
    ) -> Result<RoundReport> {
        let (me, n) = (self.rank(), self.size());
        let agreement = self.round_agreement()?;
        let own = chunk_range(input.len(), n, me).len();
        if output.len() != own {
            return Err(Error::InvalidUsage(format!(
                "robust_reduce_scatter: rank {me}'s shard of a {}-element input over {n} ranks \
                 has {own} elements, the output has {}",
                input.len(),
                output.len()
            )));
        }
        self.take_stats();
        let r = replicas.check_count(rule.byzantine(), n).unwrap_or(0);
        let mut seen = Seen::new(n, r);
        let round = self
            .sharded(
                Target::OwnShard { input, output },
                rule,
                replicas,
                &mut seen,
            )
            .await;
        let result = seen.erased_inputs_digest(n);
        self.finish_round(agreement, round, || result, seen, rule.byzantine())
            .await
    }

    /// Makes this rank a Byzantine shard owner in later sharded rounds (`None`: honest again).
    /// For tests of what replication and the cross-check protect against (feature
    /// `fault-injection`; never in a production build).
    #[cfg(feature = "fault-injection")]
    pub fn inject_owner_fault(&mut self, tamper: Option<OwnerTamper>) {
        self.owner_tamper = tamper;
    }

    /// Gather mode; `digests[r]` is set to the digest of rank `r`'s vector as this rank used it.
    async fn gather<T: Element>(
        &mut self,
        buf: &mut [T],
        rule: &dyn Aggregator,
        digests: &mut [Option<Digest>],
    ) -> Result<RoundReport> {
        let (me, n) = (self.rank(), self.size());
        let detect = self.agreement() != Agreement::Off;
        let mut seq = self.begin("robust_gather");
        rule.check(n)?;
        let payload = Payload::Host(to_bytes(buf));
        let sends = schedule::direct_peers(me, n).map(|p| send(p, payload.clone()));
        let recvs = schedule::direct_peers(me, n).map(|p| recv(p, byte_len(buf)));
        let outcomes = seq.run(sends.collect(), recvs.collect()).await?;

        let mut report = RoundReport::default();
        let mut received = Vec::with_capacity(n);
        for (p, outcome) in schedule::direct_peers(me, n).zip(outcomes) {
            match outcome {
                RecvOutcome::Received(payload) => received.push((p, payload)),
                other => report.add_fault(fault(p, other)),
            }
        }
        let mut ranks = Vec::with_capacity(n);
        let mut vectors: Vec<Cow<'_, [T]>> = Vec::with_capacity(n);
        let mut theirs = received.iter().peekable();
        for r in 0..n {
            if r == me {
                ranks.push(me);
                vectors.push(Cow::Borrowed(&*buf));
            } else if let Some((_, payload)) = theirs.next_if(|(p, _)| *p == r) {
                ranks.push(r);
                vectors.push(cast_payload::<T>(payload));
            }
        }
        report.inputs = ranks.len();
        if detect {
            for (&r, v) in ranks.iter().zip(&vectors) {
                digests[r] = Some(input_digest(v));
            }
        }
        report.non_finite = non_finite_ranks(&ranks, &vectors);
        report.peak_bytes = (received.len() + 2) * byte_len(buf);
        if !report.faults.is_empty() {
            tracing::warn!(
                collective = seq.collective,
                faults = %crate::Faults(&report.faults),
                "robust_all_reduce: peers treated as erasures"
            );
        }
        if let Err(source) = rule.check(ranks.len()) {
            return Err(Error::TooManyFaults {
                source,
                faults: report.faults,
            });
        }
        let inputs: Vec<&[T]> = vectors.iter().map(|v| v.as_ref()).collect();
        let mut out = vec![T::zeroed(); buf.len()];
        let agg = aggregate_into(rule, &inputs, &mut out).map_err(|e| rank_error(e, &ranks))?;
        report.selected = agg
            .selected
            .map(|s| s.into_iter().map(|i| ranks[i]).collect());
        drop(inputs);
        drop(vectors);
        buf.copy_from_slice(&out);
        Ok(report)
    }

    /// Sharded mode; `seen` gets the digests of the pieces of owned shards and of the
    /// owners' versions, as this rank used them.
    async fn sharded<T: Element>(
        &mut self,
        mut target: Target<'_, T>,
        rule: &dyn Aggregator,
        replicas: Replicas,
        seen: &mut Seen,
    ) -> Result<RoundReport> {
        let (me, n) = (self.rank(), self.size());
        let detect = self.agreement() != Agreement::Off;
        let f = rule.byzantine();
        let tamper = self.owner_tamper.clone();
        let mut seq = self.begin("robust_sharded");
        rule.check(n)?;
        let statistics = match rule.structure() {
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
        };
        let r = replicas.count(f, n)?;
        let input = target.input();
        let d = input.len();
        let size = std::mem::size_of::<T>();
        let shard = |s: usize| chunk_range(d, n, s);
        let mut report = RoundReport {
            replicas: Some(r),
            inputs: n,
            ..RoundReport::default()
        };

        // Phase 1: shard s of this rank's vector goes straight to each owner of s.
        // Only the shards that leave this rank are copied (with r = 1 its own shard stays).
        let scatter = sharded::scatter_sends(me, n, r);
        let pieces: Vec<Option<Payload>> = (0..n)
            .map(|s| {
                let sent = scatter.iter().any(|&(_, t)| t == s);
                sent.then(|| Payload::Host(to_bytes(&input[shard(s)])))
            })
            .collect();
        let sends = scatter
            .iter()
            .filter_map(|&(o, s)| {
                Some(SendOp {
                    peer: o,
                    tag: s as u32,
                    payload: pieces[s].clone()?,
                })
            })
            .collect();
        let plan = sharded::scatter_recvs(me, n, r);
        let recvs = plan
            .iter()
            .map(|&(p, s)| RecvOp {
                peer: p,
                tag: s as u32,
                len: shard(s).len() * size,
            })
            .collect();
        let outcomes = seq.run(sends, recvs).await?;
        drop(pieces);
        let received_bytes: usize = outcomes
            .iter()
            .map(|o| match o {
                RecvOutcome::Received(p) => p.len(),
                _ => 0,
            })
            .sum();

        // Phase 2: aggregate each owned shard over the ranks whose piece arrived, in rank order.
        let mut arrived: Vec<Vec<Option<Payload>>> = vec![vec![None; n]; n];
        for (&(p, s), outcome) in plan.iter().zip(outcomes) {
            match outcome {
                RecvOutcome::Received(payload) => arrived[s][p] = Some(payload),
                other => report.add_fault(fault(p, other)),
            }
        }
        if detect && seen.r == r {
            for (i, s) in sharded::owned(me, n, r).enumerate() {
                for (p, piece) in arrived[s].iter().enumerate() {
                    seen.pieces[i * n + p] = if p == me {
                        Some(input_digest(&input[shard(s)]))
                    } else {
                        piece
                            .as_ref()
                            .map(|x| input_digest::<u8>(crate::comm::host_bytes(x)))
                    };
                }
            }
        }
        // Each owned shard's inputs, indexed by rank (`None`: erased).
        let shard_inputs = |s: usize| -> Vec<Option<Cow<'_, [T]>>> {
            (0..n)
                .map(|p| {
                    if p == me {
                        Some(Cow::Borrowed(&input[shard(s)]))
                    } else {
                        arrived[s][p]
                            .as_ref()
                            .map(|payload| cast_payload::<T>(payload))
                    }
                })
                .collect()
        };
        // The pairwise distance table of each owned shard (erased inputs count as non-finite).
        let distance_tables = || -> Vec<(usize, Bytes)> {
            sharded::owned(me, n, r)
                .map(|s| {
                    let inputs = shard_inputs(s);
                    let present: Vec<bool> = inputs.iter().map(Option::is_some).collect();
                    let views = placeholder_views(&inputs, &input[shard(s)]);
                    let table =
                        byzcoll_aggregators::distance::distance_table_of_present(&views, &present);
                    (s, to_bytes(&table))
                })
                .collect()
        };
        for s in sharded::owned(me, n, r) {
            let inputs = shard_inputs(s);
            let ranks: Vec<Rank> = (0..n).filter(|&p| inputs[p].is_some()).collect();
            report.inputs = report.inputs.min(ranks.len());
            let present: Vec<Cow<'_, [T]>> = inputs.into_iter().flatten().collect();
            for rank in non_finite_ranks(&ranks, &present) {
                if !report.non_finite.contains(&rank) {
                    report.non_finite.push(rank);
                }
            }
        }
        let results: Vec<(usize, Bytes)> = match statistics {
            Statistics::None => sharded::owned(me, n, r)
                .map(|s| {
                    let inputs: Vec<Cow<'_, [T]>> = shard_inputs(s).into_iter().flatten().collect();
                    let ranks: Vec<Rank> = (0..n)
                        .filter(|&p| p == me || arrived[s][p].is_some())
                        .collect();
                    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_ref()).collect();
                    let mut out = vec![T::zeroed(); shard(s).len()];
                    let result = aggregate_into(rule, &refs, &mut out).map(|_| out);
                    owner_result(s, result.map_err(|e| rank_error(e, &ranks)))
                })
                .collect(),
            Statistics::Iterate(iteration) => {
                // One statistic round per step: owners exchange, per owned shard, the partial
                // squared distances from each input to the estimate plus the partial squared
                // change and size of the previous step; every rank combines them (median over
                // versions, sum over shards) and derives the same coefficients; owners step
                // their shards of the estimate.
                let owned: Vec<usize> = sharded::owned(me, n, r).collect();
                let finite_of = |inputs: &[Option<Cow<'_, [T]>>]| -> Vec<bool> {
                    inputs
                        .iter()
                        .map(|x| x.as_ref().is_some_and(|v| v.iter().all(|e| e.is_finite())))
                        .collect()
                };
                let mut z: Vec<Vec<f64>> = Vec::with_capacity(owned.len());
                for &s in &owned {
                    let present: Vec<Cow<'_, [T]>> =
                        shard_inputs(s).into_iter().flatten().collect();
                    let refs: Vec<&[T]> = present.iter().map(|v| v.as_ref()).collect();
                    let mut m = vec![T::zeroed(); shard(s).len()];
                    aggregate_into(&Median::new((refs.len() - 1) / 2), &refs, &mut m)
                        .map_err(Error::Aggregation)?;
                    z.push(m.iter().map(|v| v.to_f64()).collect());
                }
                let mut moved = vec![(0.0f64, 0.0f64); owned.len()];
                for k in 0..=iteration.max_steps() {
                    let partials: Vec<(usize, Bytes)> = owned
                        .iter()
                        .zip(&z)
                        .zip(&moved)
                        .map(|((&s, zs), &(change, size))| {
                            let inputs = shard_inputs(s);
                            let views = placeholder_views(&inputs, &input[shard(s)]);
                            let mut stats = byzcoll_aggregators::iteration::sq_distances_to(
                                &views,
                                &finite_of(&inputs),
                                zs,
                            );
                            stats.extend([change, size]);
                            (s, to_bytes(&stats))
                        })
                        .collect();
                    let total =
                        statistic_round(&mut seq, (me, n, r), &partials, n + 2, &mut report)
                            .await?;
                    let (change, size) = (total[n].sqrt(), total[n + 1].sqrt());
                    let converged = k > 0
                        && iteration
                            .tolerance()
                            .is_some_and(|tol| change <= tol * size.max(f64::MIN_POSITIVE));
                    if converged || k == iteration.max_steps() {
                        break;
                    }
                    let distances: Vec<f64> = total[..n].iter().map(|d| d.sqrt()).collect();
                    let (a, w) = iteration.coefficients(&distances);
                    for (i, &s) in owned.iter().enumerate() {
                        let inputs = shard_inputs(s);
                        let views = placeholder_views(&inputs, &input[shard(s)]);
                        let mut next = vec![0.0f64; z[i].len()];
                        byzcoll_aggregators::iteration::step_into(&views, a, &w, &z[i], &mut next);
                        let change: f64 =
                            next.iter().zip(&z[i]).map(|(p, q)| (p - q) * (p - q)).sum();
                        let size: f64 = z[i].iter().map(|q| q * q).sum();
                        moved[i] = (change, size);
                        z[i] = next;
                    }
                }
                owned
                    .iter()
                    .zip(&z)
                    .map(|(&s, zs)| {
                        let out: Vec<T> = zs.iter().map(|&v| T::from_f64(v)).collect();
                        let finite = out.iter().all(|v| v.is_finite());
                        owner_result(s, finite.then_some(out).ok_or("the estimate is not finite"))
                    })
                    .collect()
            }
            Statistics::Mix(mixing) => {
                // Statistic round for the neighbour sets, then each owner mixes its shards and
                // applies the coordinate-wise inner rule to them.
                let tables = distance_tables();
                let total =
                    statistic_round(&mut seq, (me, n, r), &tables, n * n, &mut report).await?;
                let neighbours = mixing.neighbours(&total, n).map_err(Error::Aggregation)?;
                let inner = mixing.inner();
                sharded::owned(me, n, r)
                    .map(|s| {
                        let inputs = shard_inputs(s);
                        let needed = neighbours
                            .iter()
                            .enumerate()
                            .flat_map(|(i, near)| near.clone().unwrap_or_else(|| vec![i]));
                        if needed.into_iter().any(|j| inputs[j].is_none()) {
                            return owner_result::<T>(s, Err("an input to mix is missing here"));
                        }
                        let views: Vec<&[T]> =
                            inputs.iter().flatten().map(|v| v.as_ref()).collect();
                        let mixed = byzcoll_aggregators::mix(&views, &neighbours);
                        let refs: Vec<&[T]> = mixed.iter().map(Vec::as_slice).collect();
                        let mut out = vec![T::zeroed(); shard(s).len()];
                        owner_result(s, aggregate_into(inner, &refs, &mut out).map(|_| out))
                    })
                    .collect()
            }
            Statistics::Select(selection) => {
                // Statistic round: owners exchange the distance tables of their shards; every
                // rank sums the shard-wise medians of the versions and selects from the total.
                let tables = distance_tables();
                let total =
                    statistic_round(&mut seq, (me, n, r), &tables, n * n, &mut report).await?;
                let selected = selection.select(&total, n).map_err(Error::Aggregation)?;
                report.selected = Some(selected.clone());
                sharded::owned(me, n, r)
                    .map(|s| {
                        let inputs = shard_inputs(s);
                        if selected.iter().any(|&i| inputs[i].is_none()) {
                            return owner_result::<T>(s, Err("a selected input is missing here"));
                        }
                        let views = placeholder_views(&inputs, &input[shard(s)]);
                        let mut out = vec![T::zeroed(); shard(s).len()];
                        let finished =
                            selection.finish(T::inputs(&views), &selected, T::output(&mut out));
                        owner_result(s, finished.map(|()| out))
                    })
                    .collect()
            }
        };
        drop(arrived);
        let result_bytes: usize = results.iter().map(|(_, b)| b.len()).sum();
        let phase1_peak = byte_len(input) + received_bytes + result_bytes;

        // Phase 3: every owner sends its results to every rank that takes the shard: every
        // rank in an all-reduce, the shard's own rank in a reduce-scatter.
        let own_only = matches!(target, Target::OwnShard { .. });
        let takes = |q: Rank, s: usize| !own_only || q == s;
        let result_of = |s: usize| {
            results
                .iter()
                .find(|(t, _)| *t == s)
                .map(|(_, b)| b.clone())
                .unwrap_or_default()
        };
        let sends = sharded::result_sends(me, n, r)
            .into_iter()
            .filter(|&(q, s)| takes(q, s))
            .map(|(q, s)| {
                let honest = result_of(s);
                let bytes = match &tamper {
                    Some(t) => t(s, q, &honest),
                    None => honest,
                };
                SendOp {
                    peer: q,
                    tag: s as u32,
                    payload: Payload::Host(bytes),
                }
            })
            .collect();
        // Owners already erased this round (silent or malformed in an earlier step) are not
        // waited for again.
        let erased: Vec<Rank> = report.faults.iter().map(|f| f.rank).collect();
        let plan: Vec<(Rank, usize)> = sharded::result_recvs(me, n, r)
            .into_iter()
            .filter(|&(o, s)| takes(me, s) && !erased.contains(&o))
            .collect();
        let recvs = plan
            .iter()
            .map(|&(o, s)| RecvOp {
                peer: o,
                tag: s as u32,
                len: shard(s).len() * size,
            })
            .collect();
        let outcomes = seq.run(sends, recvs).await?;
        seen.steps = seq.steps();
        let mut versions: Vec<Vec<(Rank, Payload)>> = vec![Vec::new(); n];
        for (s, bytes) in &results {
            if takes(me, *s) && bytes.len() == shard(*s).len() * size {
                versions[*s].push((me, Payload::Host(bytes.clone())));
            }
        }
        let mut version_bytes = result_bytes;
        for (&(o, s), outcome) in plan.iter().zip(outcomes) {
            match outcome {
                RecvOutcome::Received(payload) => {
                    version_bytes += payload.len();
                    versions[s].push((o, payload));
                }
                other => report.add_fault(fault(o, other)),
            }
        }
        report.peak_bytes = phase1_peak.max(version_bytes);
        if detect && seen.r == r {
            for (s, vs) in versions.iter().enumerate() {
                for (k, o) in sharded::owners(s, n, r).enumerate() {
                    seen.versions[s * r + k] = vs
                        .iter()
                        .find(|(from, _)| *from == o)
                        .map(|(_, p)| input_digest::<u8>(crate::comm::host_bytes(p)));
                }
            }
        }

        // Combine: the coordinate-wise median of the owners' versions of each shard taken
        // here, written straight into the output (in an all-reduce, the input's pieces were
        // copied out in phase 1).
        let taken = |s: usize| !shard(s).is_empty() && takes(me, s);
        if let Some(s) = (0..n).find(|&s| taken(s) && versions[s].is_empty()) {
            return Err(Error::ShardLost {
                shard: s,
                owners: sharded::owners(s, n, r).collect(),
                faults: report.faults,
            });
        }
        for (s, vs) in versions.iter_mut().enumerate() {
            if !taken(s) {
                continue;
            }
            let range = shard(s);
            let start = range.start;
            let out = match &mut target {
                Target::All(buf) => &mut buf[range],
                Target::OwnShard { output, .. } => &mut output[..],
            };
            vs.sort_by_key(|(o, _)| *o);
            let views: Vec<Cow<'_, [T]>> = vs.iter().map(|(_, p)| cast_payload::<T>(p)).collect();
            let refs: Vec<&[T]> = views.iter().map(|v| v.as_ref()).collect();
            let median = Median::new((refs.len() - 1) / 2);
            let combined = if let [only] = refs[..] {
                // The median of one version is that version: copied, refused where it is not
                // finite, as the median would.
                out.copy_from_slice(only);
                match out.iter().position(|v| !v.is_finite()) {
                    Some(coordinate) => Err(AggError::NonFiniteResult {
                        rule: median.name().to_string(),
                        f: 0,
                        coordinate,
                    }),
                    None => Ok(Default::default()),
                }
            } else {
                aggregate_into(&median, &refs, out)
            };
            combined.map_err(|e| match e {
                AggError::NonFiniteResult { f, coordinate, .. } => {
                    Error::Aggregation(AggError::NonFiniteResult {
                        rule: format!("median of the {} owner versions of shard {s}", refs.len()),
                        f,
                        coordinate: start + coordinate,
                    })
                }
                other => Error::Aggregation(other),
            })?;
        }
        if !report.faults.is_empty() {
            tracing::warn!(
                collective = seq.collective,
                faults = %crate::Faults(&report.faults),
                "sharded robust_all_reduce: peers treated as erasures"
            );
        }
        Ok(report)
    }
}

/// One statistic round: every owner sends, for each owned shard, a vector of `len` `f64`
/// statistics to every rank; every rank takes the element-wise median of the versions of each
/// shard and returns the sum over shards (in shard order, so every rank gets the same bits when
/// the owners agree).
async fn statistic_round(
    seq: &mut Sequence<'_>,
    (me, n, r): (Rank, usize, usize),
    parts: &[(usize, Bytes)],
    len: usize,
    report: &mut RoundReport,
) -> Result<Vec<f64>> {
    let sends = sharded::result_sends(me, n, r)
        .into_iter()
        .filter_map(|(q, s)| {
            let (_, t) = parts.iter().find(|(u, _)| *u == s)?;
            Some(SendOp {
                peer: q,
                tag: s as u32,
                payload: Payload::Host(t.clone()),
            })
        })
        .collect();
    let plan = sharded::result_recvs(me, n, r);
    let recvs = plan
        .iter()
        .map(|&(o, s)| RecvOp {
            peer: o,
            tag: s as u32,
            len: len * std::mem::size_of::<f64>(),
        })
        .collect();
    let outcomes = seq.run(sends, recvs).await?;
    let mut versions: Vec<Vec<Payload>> = vec![Vec::new(); n];
    for (s, t) in parts {
        versions[*s].push(Payload::Host(t.clone()));
    }
    for (&(o, s), outcome) in plan.iter().zip(outcomes) {
        match outcome {
            RecvOutcome::Received(payload) => versions[s].push(payload),
            other => report.add_fault(fault(o, other)),
        }
    }
    if let Some(s) = versions.iter().position(Vec::is_empty) {
        return Err(Error::ShardLost {
            shard: s,
            owners: sharded::owners(s, n, r).collect(),
            faults: std::mem::take(&mut report.faults),
        });
    }
    let views: Vec<Vec<Cow<'_, [f64]>>> = versions
        .iter()
        .map(|vs| vs.iter().map(cast_payload::<f64>).collect())
        .collect();
    let refs: Vec<Vec<&[f64]>> = views
        .iter()
        .map(|vs| vs.iter().map(|v| v.as_ref()).collect())
        .collect();
    Ok(sum_of_shard_medians(&refs, len))
}

/// Combines a sharded statistic round: `versions[s]` holds the owners' versions of shard `s`'s
/// `len` statistics (at least one each); the result is, entry by entry, the sum over shards (in
/// shard order) of the median of each shard's versions. Every rank that receives the same
/// versions gets the same bits; up to half of a shard's versions lying cannot move its median
/// outside the honest values (`+inf` entries are ordered as extremes). Used by the sharded
/// schedules here and by the device-vector ones of `byzcoll-cuda`.
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

/// What a global rule needs exchanged in sharded mode.
enum Statistics<'a> {
    /// Nothing: the rule is coordinate-wise.
    None,
    /// One table of pairwise distances, then a selection.
    Select(&'a dyn byzcoll_aggregators::DistanceSelection),
    /// Per-input distances to an estimate, once per step.
    Iterate(&'a dyn byzcoll_aggregators::DistanceIteration),
    /// One table of pairwise distances, then mixing and a coordinate-wise inner rule.
    Mix(&'a dyn byzcoll_aggregators::DistanceMixing),
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

/// What an owner sends for shard `s`: its result, or an empty message when it has none, which
/// receivers count as an erasure of this owner's version (the reason is logged here).
fn owner_result<T: Element>(
    s: usize,
    result: Result<Vec<T>, impl std::fmt::Display>,
) -> (usize, Bytes) {
    match result {
        Ok(out) => (s, to_bytes(&out)),
        Err(why) => {
            tracing::warn!(shard = s, %why, "no result for an owned shard; sending an empty one");
            (s, Bytes::new())
        }
    }
}

/// A shard's inputs by rank, with `placeholder` standing in for erased ones (which callers mark
/// non-finite or never select, so its values are never used).
fn placeholder_views<'a, T>(
    inputs: &'a [Option<Cow<'a, [T]>>],
    placeholder: &'a [T],
) -> Vec<&'a [T]>
where
    [T]: ToOwned,
{
    inputs
        .iter()
        .map(|x| x.as_deref().unwrap_or(placeholder))
        .collect()
}

fn non_finite_ranks<T: Element>(ranks: &[Rank], vectors: &[Cow<'_, [T]>]) -> Vec<Rank> {
    ranks
        .iter()
        .zip(vectors)
        .filter(|(_, v)| !v.iter().all(|x| x.is_finite()))
        .map(|(&r, _)| r)
        .collect()
}

/// A digest in the cross-check: of a result (BLAKE3, 32 bytes), or of an input (XXH3-128 in
/// the first 16 bytes). Inputs only say which sender's vectors differed between ranks (a
/// difference a Byzantine sender hides behind a crafted collision still shows in the results'
/// BLAKE3 digests), and XXH3 hashes them several times faster.
pub(crate) type Digest = [u8; 32];

fn input_digest<T: bytemuck::Pod>(v: &[T]) -> Digest {
    let mut d = [0u8; 32];
    d[..16].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(bytemuck::cast_slice(v)).to_le_bytes());
    d
}

/// What a rank aggregated, as digests (XXH3-128, [`input_digest`]): each rank's vector in
/// gather mode; in sharded mode with `r` owners per shard, each sender's piece of each shard
/// this rank owns (`r · n`, in the order of [`sharded::owned`]) and each owner's version of
/// each shard (`n · r`, in the order of [`sharded::owners`]). `None`: not received.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    r: usize,
    /// The number of steps the round took (not sent).
    steps: u32,
    inputs: Vec<Option<Digest>>,
    pieces: Vec<Option<Digest>>,
    versions: Vec<Option<Digest>>,
}

impl Seen {
    fn new(n: usize, r: usize) -> Self {
        Seen {
            r,
            steps: 1,
            inputs: vec![None; n],
            pieces: vec![None; r * n],
            versions: vec![None; n * r],
        }
    }

    /// The digest of the senders whose piece of some owned shard this rank went without: what
    /// the ranks of a reduce-scatter compare, since each holds a different shard.
    fn erased_inputs_digest(&self, n: usize) -> Digest {
        let mut hasher = blake3::Hasher::new();
        for j in 0..n {
            if self.pieces.chunks_exact(n).any(|shard| shard[j].is_none()) {
                hasher.update(&(j as u64).to_le_bytes());
            }
        }
        hasher.finalize().into()
    }
}

/// One rank's cross-check message. Wire: `status u8` (1: a result), the result's BLAKE3
/// digest (32 bytes), then every digest of [`Seen`] as `present u8` and 16 bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Check {
    result: Option<Digest>,
    seen: Seen,
}

impl Check {
    fn len(n: usize, r: usize) -> usize {
        33 + 17 * (n + 2 * r * n)
    }

    fn encode(&self) -> Bytes {
        let seen = &self.seen;
        let n = seen.inputs.len();
        let mut out = Vec::with_capacity(Self::len(n, seen.r));
        out.push(u8::from(self.result.is_some()));
        out.extend_from_slice(&self.result.unwrap_or([0; 32]));
        for d in seen.inputs.iter().chain(&seen.pieces).chain(&seen.versions) {
            out.push(u8::from(d.is_some()));
            out.extend_from_slice(&d.unwrap_or([0; 32])[..16]);
        }
        out.into()
    }

    /// `None` for a message that is not a cross-check of a world of `n` with `r` owners per
    /// shard (counted unconfirmed).
    fn decode(b: &[u8], n: usize, r: usize) -> Option<Self> {
        if b.len() != Self::len(n, r) || b[0] > 1 {
            return None;
        }
        let digest = |bytes: &[u8]| {
            let mut d = [0u8; 32];
            d[..bytes.len()].copy_from_slice(bytes);
            d
        };
        let mut all = Vec::with_capacity(n + 2 * r * n);
        for chunk in b[33..].chunks_exact(17) {
            all.push(match chunk[0] {
                0 => None,
                1 => Some(digest(&chunk[1..])),
                _ => return None,
            });
        }
        let versions = all.split_off(n + r * n);
        let pieces = all.split_off(n);
        Some(Check {
            result: (b[0] == 1).then(|| digest(&b[1..33])),
            seen: Seen {
                r,
                steps: 1,
                inputs: all,
                pieces,
                versions,
            },
        })
    }
}

#[cfg(test)]
mod cross_check_tests {
    use super::*;

    #[test]
    fn checks_round_trip_and_malformed_ones_are_unconfirmed() {
        let (n, r) = (5, 3);
        let mut seen = Seen::new(n, r);
        seen.inputs[1] = Some(input_digest(&[1.0f32, 2.0]));
        seen.pieces[4] = Some(input_digest(&[3u8]));
        seen.versions[n * r - 1] = Some(input_digest(&[4u8]));
        let check = Check {
            result: Some([9; 32]),
            seen,
        };
        let bytes = check.encode();
        assert_eq!(bytes.len(), Check::len(n, r));
        assert_eq!(Check::decode(&bytes, n, r), Some(check.clone()));
        // Another world or replication, a bad status or flag: not a cross-check.
        assert_eq!(Check::decode(&bytes, n, r - 1), None);
        let mut bad = bytes.to_vec();
        bad[0] = 2;
        assert_eq!(Check::decode(&bad, n, r), None);
        let mut bad = bytes.to_vec();
        bad[33] = 7;
        assert_eq!(Check::decode(&bad, n, r), None);
        let none = Check {
            result: None,
            seen: Seen::new(n, 0),
        };
        assert_eq!(Check::decode(&none.encode(), n, 0), Some(none));
    }
}
