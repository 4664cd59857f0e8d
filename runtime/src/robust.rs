//! Byzantine-robust all-reduce in two schedules: gather and sharded (see [`Policy`]).

use byzcoll_aggregators::{Aggregator, Element, Structure};

use crate::audit::Audit;
use crate::round::host::{HostPlane, Target};
use crate::round::{
    check_agreement, sign_pieces, stragglers_in, Arrival, AuditCtx, Carry, Msg, Round, Shape, Spec,
};
use crate::schedule::chunk_range;
use crate::{
    Agreement, Communicator, Error, Fault, Policy, RecvOutcome, Replicas, Result, RoundReport,
    SendOp,
};

/// Folds a later sub-round's report into the reports merged so far.
fn merge_reports(merged: &mut RoundReport, next: RoundReport) {
    fn union<T: Ord>(into: &mut Vec<T>, more: Vec<T>) {
        into.extend(more);
        into.sort_unstable();
        into.dedup();
    }
    merged.inputs = merged.inputs.min(next.inputs);
    for f in next.faults {
        if !merged.faults.iter().any(|g| g.rank == f.rank) {
            merged.faults.push(f);
        }
    }
    merged.erased_self |= next.erased_self;
    union(&mut merged.skipped_by, next.skipped_by);
    union(&mut merged.non_finite, next.non_finite);
    merged.peak_bytes = merged.peak_bytes.max(next.peak_bytes);
    merged.unauthenticated |= next.unauthenticated;
    merged.identity = merged.identity.weaker(next.identity);
    match (&mut merged.agreement, next.agreement) {
        (Some(a), Some(b)) => {
            union(&mut a.disagreeing, b.disagreeing);
            union(&mut a.unconfirmed, b.unconfirmed);
            union(&mut a.differing_inputs, b.differing_inputs);
            union(&mut a.differing_versions, b.differing_versions);
            union(&mut a.realigned, b.realigned);
            union(&mut a.recovered, b.recovered);
        }
        (a @ None, b) => *a = b,
        (Some(_), None) => {}
    }
    match (&mut merged.attribution, next.attribution) {
        (Some(a), Some(b)) => a.merge(&b),
        (a @ None, b) => *a = b,
        (Some(_), None) => {}
    }
    match (&mut merged.audit, next.audit) {
        (Some(a), Some(b)) => {
            // Sub-rounds shard their parts alike: a shard index names the same owner in each.
            a.audited.extend(b.audited);
            for lie in b.convicted {
                if !a.convicted.iter().any(|l| l.owner == lie.owner) {
                    a.convicted.push(lie);
                }
            }
            union(&mut a.recomputed, b.recomputed);
            union(&mut a.refused, b.refused);
            a.false_accusers.extend(b.false_accusers);
        }
        (a @ None, b) => *a = b,
        (Some(_), None) => {}
    }
    merged.stats.bytes_sent += next.stats.bytes_sent;
    merged.stats.bytes_received += next.stats.bytes_received;
    merged.stats.step_times.extend(next.stats.step_times);
}

/// Fault injection for tests (feature `fault-injection`, for test doubles only): lets a rank
/// act as a Byzantine shard owner by rewriting the result it sends for `shard` to `dest`
/// (equivocation included).
#[cfg(feature = "fault-injection")]
pub type OwnerTamper = crate::round::host::Tamper;

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
    /// `T` is any [`Element`] (`f32`, `f64`, `half::bf16`, `half::f16`): the wire carries its
    /// own bytes (two per element for the 16-bit types), and the call's fingerprint names it,
    /// so ranks that pass different types are out of step, never mixed.
    ///
    /// # Errors
    /// [`Error::Aggregation`] when the precondition fails for the world size or the rule refuses
    /// its inputs (input indices in `NonFiniteInputs` are ranks); [`Error::TooManyFaults`] when
    /// too many peers failed the round; [`Error::Unsupported`] for a rule that sharded mode
    /// cannot run; [`Error::InvalidUsage`] for a replica count outside `1..=n`.
    ///
    /// In sharded mode a coordinate-wise rule (median, trimmed mean, mean) over a vector of
    /// more than [`Communicator::set_sub_round_bytes`] ([`SUB_ROUND_BYTES`](crate::SUB_ROUND_BYTES) by default) runs
    /// as consecutive sub-rounds over parts of at most that size, outside
    /// [`Agreement::Enforce`]: bitwise the same result, with the round's own buffers bounded
    /// by the part rather than the vector. A peer erased in one sub-round is an erasure in the
    /// later ones (neither waited for nor sent to), and the report merges the sub-rounds'.
    ///
    /// On error, gather mode leaves `buf` unchanged; sharded mode may have overwritten the
    /// shards combined before the failing one (with sub-rounds, every part but the failing
    /// one's).
    ///
    /// # Cancel safety
    /// Not cancel safe: the other ranks count this rank missing.
    pub async fn robust_all_reduce<T: Element>(
        &mut self,
        buf: &mut [T],
        rule: &dyn Aggregator,
        policy: Policy,
    ) -> Result<RoundReport> {
        let d = buf.len();
        self.first_call = self.collectives_begun() == 0;
        let quorum =
            self.config().stragglers.forces_quorum() && self.transport().capabilities().quorum;
        let shape = Shape::all_reduce(policy, self.size(), d, size_of::<T>(), rule, quorum);
        let audit = match policy {
            Policy::Audited(audit) => Some(audit),
            _ => None,
        };
        let outcome = if matches!(shape, Shape::Sharded(_))
            && rule.structure() == Structure::CoordinateWise
            && self.agreement() != Agreement::Enforce
            && std::mem::size_of_val(buf) > self.config().sub_round_bytes.max(size_of::<T>())
        {
            self.sub_rounds(buf, rule, shape, audit).await
        } else {
            // Fault memory: the peers late round after round are waited for only up to the
            // quorum.
            let mut carry = Carry {
                laggards: self.health.laggards(),
                own_late: self.health.own_late(),
                ..Carry::default()
            };
            self.run_round(Target::All(buf), d, rule, shape, audit, &mut carry)
                .await
        };
        self.health.record(&outcome);
        outcome
    }

    /// A sharded all-reduce of a coordinate-wise rule as consecutive sub-rounds, one per part
    /// of at most [`Communicator::set_sub_round_bytes`] of `buf` ([`chunk_range`] over the parts): each
    /// coordinate's result depends on that coordinate's inputs only, so the result is bitwise
    /// that of one round, while the round holds the pieces and versions of one part at a time
    /// rather than of the whole vector (`docs/bench/PROFILE.md`: peak memory). Every sub-round
    /// runs on every rank whatever the earlier ones gave, so that the ranks' steps stay alike;
    /// the peers one erased (succeeding or failing) are erasures in the later ones too (a dead
    /// peer costs the timeouts of one round); a sub-round after one in which a peer was found
    /// missing waits the lag that may have left between honest ranks ([`Round::lag`]). The
    /// call returns the first error, or the reports merged.
    async fn sub_rounds<T: Element>(
        &mut self,
        buf: &mut [T],
        rule: &dyn Aggregator,
        shape: Shape,
        audit: Option<Audit>,
    ) -> Result<RoundReport> {
        self.round_agreement(shape, rule)?;
        let parts =
            std::mem::size_of_val(buf).div_ceil(self.config().sub_round_bytes.max(size_of::<T>()));
        let d = buf.len();
        let mut merged: Option<RoundReport> = None;
        let mut first_error = None;
        // The peers erased so far, by a sub-round that succeeded or failed, and the lag the
        // last one left; the laggards as for one round.
        let mut carry = Carry {
            laggards: self.health.laggards(),
            own_late: self.health.own_late(),
            ..Carry::default()
        };
        for k in 0..parts {
            let range = chunk_range(d, parts, k);
            let part = &mut buf[range.clone()];
            let outcome = self
                .run_round(
                    Target::All(part),
                    range.len(),
                    rule,
                    shape,
                    audit,
                    &mut carry,
                )
                .await;
            let faults = match &outcome {
                Ok(report) => &report.faults[..],
                Err(e) => e.faults(),
            };
            for f in faults {
                // A peer only late (stragglers allowed) is still sent to, and waited for up
                // to the quorum, as a laggard: erased, it would get nothing from the later
                // sub-rounds and wait out their deadlines.
                if f.fault == Fault::Late {
                    if !carry.laggards.contains(&f.rank) {
                        carry.laggards.push(f.rank);
                    }
                } else if !carry.erased.iter().any(|g| g.rank == f.rank) {
                    carry.erased.push(f.clone());
                }
            }
            match outcome {
                Ok(report) => match &mut merged {
                    None => merged = Some(report),
                    Some(m) => merge_reports(m, report),
                },
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match (first_error, merged) {
            (Some(e), _) => Err(e),
            (None, Some(m)) => Ok(m),
            (None, None) => unreachable!("a vector longer than a part has parts"),
        }
    }

    /// `s` for a robust round of `rule` in `shape` here ([`Config::stragglers`](crate::Config),
    /// said in [`RoundReport::stragglers`]): none where the round cannot end a step early (a
    /// transport that cannot, NCCL; sharded rounds that cannot, [`stragglers_in`]), where
    /// asking for some is an error rather than a silent wait for everyone.
    fn stragglers(&self, rule: &dyn Aggregator, shape: Shape) -> Result<usize> {
        let agreement = self.agreement();
        let requested = self.config().stragglers.requested(agreement);
        // Under Detect a communicator's first collective waits for every input: the ranks
        // started apart, and a quorum there would leave inputs out for their start-up alone
        // (Enforce's echo passes late inputs on).
        let first = self.first_call && agreement == Agreement::Detect;
        if requested == Some(0) || first {
            return Ok(0);
        }
        match (self.transport().capabilities().quorum, requested) {
            (true, requested) => stragglers_in(rule, self.size(), shape, agreement, requested),
            (false, None | Some(0)) => Ok(0),
            (false, Some(s)) => Err(Error::Unsupported(format!(
                "{s} stragglers allowed in the {} transport, which cannot end a step before its \
                 deadline; allow none (BYZCOLL_STRAGGLERS=0) or auto",
                self.transport().name()
            ))),
        }
    }

    /// The agreement policy for a robust round of `shape`, refused up front where it cannot
    /// run ([`check_agreement`]).
    fn round_agreement(&self, shape: Shape, rule: &dyn Aggregator) -> Result<Agreement> {
        let agreement = self.agreement();
        check_agreement(agreement, shape, self.size(), rule.byzantine())?;
        Ok(agreement)
    }

    /// Runs one robust round ([`crate::round`]) over this communicator's transport on the
    /// host plane: each step's messages are made by the plane, run as one transport step with
    /// the round's timeout, and their outcomes handed back to the round.
    async fn run_round<T: Element>(
        &mut self,
        target: Target<'_, T>,
        d: usize,
        rule: &dyn Aggregator,
        shape: Shape,
        audit: Option<Audit>,
        carry: &mut Carry,
    ) -> Result<RoundReport> {
        let agreement = self.round_agreement(shape, rule)?;
        // An audited round signs with the membership the transport authenticated.
        let membership = match audit {
            None => None,
            Some(_) => Some(self.transport().membership().ok_or_else(|| {
                Error::Unsupported(format!(
                    "an audited round needs every rank's identity key, and this communicator \
                     over {} has none (a transport that keeps no membership)",
                    self.transport().name()
                ))
            })?),
        };
        self.take_stats();
        let spec = Spec {
            me: self.rank(),
            n: self.size(),
            d,
            elem: std::mem::size_of::<T>(),
            shape,
            agreement,
            timeout: self.config().step_timeout,
            stragglers: self.stragglers(rule, shape)?,
            grace: self.config().grace,
        };
        if spec.stragglers > 0 {
            self.ran_quorum_steps();
        }
        let mut plane = HostPlane::new(target, spec.me, spec.n, self.owner_tamper.clone())
            .measuring(self.config().attribution)
            .keeping_input(agreement == Agreement::Detect && shape == Shape::Gather)
            .auditing(audit.is_some());
        let call = crate::calls::robust::<T>(
            rule,
            shape,
            audit.as_ref(),
            spec.stragglers > 0 && shape != Shape::Gather,
            d,
            self.step(),
        );
        let step_tamper = self.step_tamper.clone();
        let mut seq = self.begin("robust", call);
        let mut round = match (audit, &membership) {
            (Some(audit), Some(m)) => {
                let call = m.audit_call(seq.collective);
                let own = sign_pieces(
                    &m.identity,
                    &call,
                    spec.me,
                    spec.n,
                    &plane.input_bytes(),
                    spec.elem,
                    audit.sub_chunks.max(1),
                );
                let mut seed = [0u8; 32];
                getrandom::getrandom(&mut seed).map_err(|e| {
                    Error::Unsupported(format!("no randomness from the OS for the audit: {e}"))
                })?;
                let ctx = AuditCtx {
                    audit,
                    call,
                    dtype: T::DTYPE,
                    signer: &m.identity,
                    verifier: &m.roster,
                    own,
                    seed,
                };
                Round::audited(spec, rule, carry, ctx)
            }
            _ => Round::resuming(spec, rule, carry),
        };
        // Peers that dropped this call's messages to this rank: it fell behind them.
        let mut skipped_by: Vec<crate::Rank> = Vec::new();
        let mut since = tokio::time::Instant::now();
        while let Some(plan) = round.step() {
            let sends: Vec<SendOp> = plan
                .sends
                .iter()
                .map(|s| SendOp {
                    peer: s.peer,
                    tag: s.tag,
                    payload: match (s.msg.clone(), &step_tamper) {
                        (Msg::Bytes(b), Some((op, t))) if *op == plan.op => {
                            crate::Payload::Host(t(s.tag as usize, s.peer, &b))
                        }
                        (Msg::Forward(j), _) => round
                            .held(j)
                            .cloned()
                            .expect("the round holds what it forwards"),
                        (ref msg, _) => plane.payload(msg, s.peer),
                    },
                })
                .collect();
            let outcomes = seq
                .run_as(
                    plan.op,
                    plan.timeout,
                    plan.quorum,
                    sends,
                    plan.recvs.clone(),
                )
                .await?;
            // Since the step before ended (the round's start for the first), so that the work
            // between steps counts too.
            let took = since.elapsed();
            since = tokio::time::Instant::now();
            plane.release_sent();
            let arrivals = outcomes
                .into_iter()
                .zip(&plan.recvs)
                .map(|(o, recv)| match o {
                    RecvOutcome::Received(p) => Arrival::Received(p),
                    RecvOutcome::Missing => Arrival::Missing,
                    RecvOutcome::Late => Arrival::Late,
                    RecvOutcome::Malformed(why) => Arrival::Malformed(why),
                    RecvOutcome::OutOfStep => Arrival::OutOfStep,
                    // An erasure to the round, which goes on as for a missing input.
                    RecvOutcome::Skipped => {
                        skipped_by.push(recv.peer);
                        Arrival::Missing
                    }
                })
                .collect();
            round.took(took);
            round.handle(&mut plane, arrivals);
            for why in round.take_warnings() {
                tracing::warn!(
                    rank = spec.me,
                    collective = seq.collective,
                    "robust round: {why}"
                );
            }
        }
        let collective = seq.collective;
        drop(seq);
        if !round.faults().is_empty() {
            tracing::warn!(
                rank = spec.me,
                collective,
                faults = %crate::Faults(round.faults()),
                "robust round: peers treated as erasures"
            );
        }
        carry.lag = round.lag();
        self.health.note_own_input(round.erased_self());
        skipped_by.sort_unstable();
        skipped_by.dedup();
        // Only a rank behind its peers is skipped, but a Byzantine peer may send notices
        // instead of data: more than `f` peers that skipped this rank cannot all be
        // Byzantine, so an honest one went on without it and it is the one behind; `f` or
        // fewer are erasures at fault like any missing peer.
        let behind = skipped_by.len() > rule.byzantine();
        let mut report = match round.finish() {
            Ok(report) => report,
            // Failed for want of inputs or of agreement: what the skipped messages held. A
            // refusal every rank meets alike (a non-finite input, say) stays what it is.
            Err(
                e @ (Error::TooManyFaults { .. }
                | Error::ShardLost { .. }
                | Error::Disagreement { .. }),
            ) if behind => return Err(Error::fell_behind(skipped_by, e)),
            Err(e) => return Err(e),
        };
        // The round ended without them: their erasures are this rank's lateness.
        if behind {
            report.skipped_by = skipped_by;
        }
        if let Some(found) = report.agreement.as_ref().filter(|a| {
            !a.disagreeing.is_empty()
                || !a.differing_inputs.is_empty()
                || !a.differing_versions.is_empty()
        }) {
            tracing::warn!(
                rank = spec.me,
                collective,
                disagreeing = ?found.disagreeing,
                differing_inputs = ?found.differing_inputs,
                differing_versions = ?found.differing_versions,
                "robust round: ranks ended the round with other results"
            );
        }
        report.unauthenticated = !self.is_authenticated();
        report.identity = self.identity();
        report.stats = self.take_stats();
        Ok(report)
    }

    /// Byzantine-robust reduce-scatter: `input` is cut into `n` shards
    /// ([`schedule::chunk_range`](crate::schedule::chunk_range)`(input.len(), n, s)` for shard `s`), and rank `s`'s `output`
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
    /// [`AgreementReport::differing_inputs`](crate::AgreementReport::differing_inputs).
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
        self.round_agreement(Shape::ReduceScatter(replicas), rule)?;
        let own = chunk_range(input.len(), n, me).len();
        if output.len() != own {
            return Err(Error::InvalidUsage(format!(
                "robust_reduce_scatter: rank {me}'s shard of a {}-element input over {n} ranks \
                 has {own} elements, the output has {}",
                input.len(),
                output.len()
            )));
        }
        let d = input.len();
        self.first_call = self.collectives_begun() == 0;
        let outcome = self
            .run_round(
                Target::OwnShard { input, output },
                d,
                rule,
                Shape::ReduceScatter(replicas),
                None,
                &mut Carry::default(),
            )
            .await;
        self.health.record(&outcome);
        outcome
    }

    /// Makes this rank a Byzantine shard owner in later sharded rounds (`None`: honest again).
    /// For tests of what replication and the cross-check protect against (feature
    /// `fault-injection`; never in a production build).
    #[cfg(feature = "fault-injection")]
    pub fn inject_owner_fault(&mut self, tamper: Option<OwnerTamper>) {
        self.owner_tamper = tamper;
    }

    /// Makes this rank rewrite what it sends in the robust rounds' steps named `op` (a
    /// [`StepPlan::op`](crate::round::StepPlan), such as `audit_proofs`): `tamper(tag, dest,
    /// bytes)` gives the bytes sent instead (`None`: honest again). For tests of what the
    /// protocol does with a Byzantine rank's messages (feature `fault-injection`; never in a
    /// production build).
    #[cfg(feature = "fault-injection")]
    pub fn inject_step_fault(&mut self, op: &'static str, tamper: Option<OwnerTamper>) {
        self.step_tamper = tamper.map(|t| (op, t));
    }
}
