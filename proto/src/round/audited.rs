//! Audited sharding (`PROTOCOL.md`, "Audited sharding"; [`crate::audit`]): a sharded
//! all-reduce with one owner per shard under [`Agreement::Detect`], whose owners are audited
//! after they are bound to their results.
//!
//! The scatter step carries each sender's signed commitment beside its piece, and an owner
//! aggregates only pieces that match theirs; the versions step carries each owner's signed
//! claim (its signature and the commitment to the inputs it used) beside its result. Then
//! four steps, every rank taking part in each (possibly with nothing to send), so that every
//! rank numbers the steps alike:
//! 1. *requests*: each rank asks the owners it chose, with randomness of its own, for sub-chunks;
//! 2. *audit data*: each owner sends each of its auditors the signed pieces and the sub-chunks;
//!    the auditor checks the claim and replays the rule;
//! 3. *verdicts*: each rank tells every other which owners it accuses (and on which sub-chunk);
//! 4. *proofs*: each accuser sends its accusations; every rank checks every one alike.
//!
//! A fifth step aggregates again, from every rank's piece, the shards of the owners
//! convicted, so that the result holds no proven lie; then the cross-check compares the
//! results, so that honest ranks that saw different verdicts (an accuser that sent its proof
//! to some of them only) never end with different results silently.

use byzcoll_aggregators::DType;

use super::*;
use crate::audit::{
    leaves, replay, sub_range, Accusation, Audit, AuditReport, CallId, Expect, OwnerClaim,
    Signature, SignedPiece, Signer, Verifier,
};

/// What an audited round needs beyond a sharded one: the audit's parameters, the call's name
/// and element type, this rank's keys, its signed pieces and its randomness.
pub struct AuditCtx<'a> {
    /// How the round audits.
    pub audit: Audit,
    /// The call's name in the statements ([`CallId`]).
    pub call: CallId,
    /// The vectors' element type (the replay's).
    pub dtype: DType,
    /// Signs this rank's statements.
    pub signer: &'a dyn Signer,
    /// Checks every rank's statements.
    pub verifier: &'a dyn Verifier,
    /// This rank's signed piece of every shard (`own[s]`, [`sign_pieces`]), made where its
    /// input lives.
    pub own: Vec<SignedPiece>,
    /// Fresh randomness for this rank's audit choices in this round (from the OS), which no
    /// other rank learns before the choices are sent.
    pub seed: [u8; 32],
}

impl std::fmt::Debug for AuditCtx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditCtx")
            .field("audit", &self.audit)
            .field("call", &self.call)
            .field("dtype", &self.dtype)
            .finish_non_exhaustive()
    }
}

/// This rank's signed piece of each of the `n` shards of its input (`input`: bytes of `d`
/// elements of `elem` bytes), for [`AuditCtx::own`].
pub fn sign_pieces(
    signer: &dyn Signer,
    call: &CallId,
    me: Rank,
    n: usize,
    input: &[u8],
    elem: usize,
    m: usize,
) -> Vec<SignedPiece> {
    let d = input.len() / elem.max(1);
    (0..n)
        .map(|s| {
            let r = chunk_range(d, n, s);
            SignedPiece::sign(
                signer,
                call,
                me,
                s,
                &input[r.start * elem..r.end * elem],
                elem,
                m,
            )
        })
        .collect()
}

/// The length of a claim header in the versions step: the owner's signature and the
/// commitment to its inputs.
const HEADER: usize = 64 + 32;

/// No sub-chunk asked for, no accusation.
const NONE: u32 = u32::MAX;

/// A verdict that this rank could not replay an owner's shard (no audit data, data that its
/// claim does not commit to): every rank aggregates that shard again, since a refusal cannot
/// be proven and must not leave a possible lie in the result.
const REFUSED: u32 = u32::MAX - 1;

/// An audited owner's result as this rank took it: the sub-chunks it asks for, and the leaves.
type Kept = (Vec<Vec<u8>>, Vec<Digest>);

/// An audited round's state across its steps.
pub(super) struct Auditing<'a> {
    ctx: AuditCtx<'a>,
    /// The signed pieces of this rank's shard, by sender.
    signed: Vec<Option<SignedPiece>>,
    /// This rank's claim as the owner of its shard (none where it could not aggregate).
    claim: Option<OwnerClaim>,
    /// Each owner's claim header: its signature and input commitment.
    headers: Vec<Option<(Signature, Digest)>>,
    /// The owners this rank audits, each with its sub-chunks (ascending).
    asked: Vec<(Rank, Vec<usize>)>,
    /// The ranks that asked this rank for sub-chunks of its shard, with them.
    askers: Vec<(Rank, Vec<usize>)>,
    /// This rank's accusations, at most one per owner.
    accusations: Vec<Accusation>,
    /// The shard digests the versions step computed (`None`: to hash again).
    known: Vec<Option<Digest>>,
    /// The results of the owners this rank audits, as it took them: the sub-chunks it asks
    /// for (in its order) and the leaves.
    kept: Vec<Option<Kept>>,
    /// The root of each owner's result's leaves (this rank's own included): the result's
    /// digest in the cross-check, in place of a second hash of the same bytes.
    pub(super) roots: Vec<Option<Digest>>,
    /// Shards whose result was not finite here (the first error): the round fails with it
    /// unless the audit convicts their owners and aggregates them again.
    pub(super) non_finite: Option<(Vec<usize>, Error)>,
    /// The shards other ranks (or this one) could not replay: aggregated again by every rank.
    again: Vec<usize>,
    /// The peers found silent before the audit began: a shard aggregated again takes every
    /// other rank's piece, whatever the audit steps showed of them (a false accuser's input
    /// still counts), so that ranks that saw different audit faults still aggregate the same
    /// inputs.
    erased: Vec<Rank>,
    report: AuditReport,
}

impl<'a> Auditing<'a> {
    pub(super) fn new(ctx: AuditCtx<'a>, n: usize) -> Self {
        Auditing {
            ctx,
            signed: vec![None; n],
            claim: None,
            headers: vec![None; n],
            asked: Vec::new(),
            askers: Vec::new(),
            accusations: Vec::new(),
            known: Vec::new(),
            kept: vec![None; n],
            roots: vec![None; n],
            again: Vec::new(),
            non_finite: None,
            erased: Vec::new(),
            report: AuditReport::default(),
        }
    }
}

impl<'r, B> Round<'r, B> {
    fn expect(&self, audit: &Auditing<'r>) -> Expect {
        Expect {
            n: self.spec.n,
            d: self.spec.d,
            elem: self.spec.elem,
            m: audit.ctx.audit.sub_chunks,
        }
    }

    /// Why this round cannot be audited, checked before any data moves: one owner per shard,
    /// an all-reduce under `Detect` without stragglers, a coordinate-wise rule, the element
    /// size of the context's type, a signed piece of every shard, an audit that replays at
    /// least one of at least one sub-chunk.
    pub(super) fn audit_precondition(&self, ctx: &AuditCtx<'_>) -> Result<(), Error> {
        let (me, n) = (self.spec.me, self.spec.n);
        let refuse = |why: String| Err(Error::InvalidUsage(format!("an audited round {why}")));
        match self.spec.shape {
            Shape::Sharded(Replicas::Exactly(1)) => {}
            other => {
                return refuse(format!(
                    "is sharded with one owner per shard, not {other:?}"
                ))
            }
        }
        if self.spec.agreement != Agreement::Detect {
            return refuse(format!(
                "runs under Agreement::Detect, not {:?}",
                self.spec.agreement
            ));
        }
        if self.spec.stragglers > 0 {
            return refuse("waits for every input (stragglers 0)".into());
        }
        if self.rule.structure() != Structure::CoordinateWise {
            return refuse(format!(
                "replays a coordinate-wise rule, and {} is not one",
                self.rule.name()
            ));
        }
        if ctx.dtype.size() != self.spec.elem {
            return refuse(format!(
                "of {:?} elements has {}-byte elements, not {}",
                ctx.dtype,
                ctx.dtype.size(),
                self.spec.elem
            ));
        }
        let a = ctx.audit;
        if a.sub_chunks == 0 || a.samples == 0 || a.samples > a.sub_chunks {
            return refuse(format!(
                "needs 1 <= samples <= sub-chunks, not {} of {}",
                a.samples, a.sub_chunks
            ));
        }
        if ctx.own.len() != n
            || ctx
                .own
                .iter()
                .any(|p| p.sender != me || p.leaves.len() != a.sub_chunks)
        {
            return refuse("needs this rank's signed piece of every shard".into());
        }
        Ok(())
    }

    /// The signed pieces beside the pieces: to each owner, this rank's; from each sender, its
    /// piece of this rank's shard.
    pub(super) fn audit_scatter(
        &self,
        audit: &Auditing<'r>,
        sends: &mut Vec<Send>,
        recvs: &mut Vec<RecvOp>,
    ) {
        let (me, n) = (self.spec.me, self.spec.n);
        for s in schedule::direct_peers(me, n) {
            sends.push(Send {
                peer: s,
                tag: (n + s) as Tag,
                msg: Msg::Bytes(Bytes::from(audit.ctx.own[s].encode())),
            });
        }
        let len = SignedPiece::len(audit.ctx.audit.sub_chunks);
        let pieces: Vec<Rank> = recvs.iter().map(|op| op.peer).collect();
        for peer in pieces {
            recvs.push(RecvOp {
                peer,
                tag: (n + me) as Tag,
                len,
            });
        }
    }

    /// A signed piece's arrival in the scatter step.
    pub(super) fn signed_piece_arrived<P: Plane<Buf = B>>(
        &mut self,
        audit: &mut Auditing<'r>,
        plane: &P,
        peer: Rank,
        a: Arrival<B>,
    ) {
        let m = audit.ctx.audit.sub_chunks;
        match a {
            Arrival::Received(b) => {
                audit.signed[peer] = SignedPiece::decode(peer, &plane.host(&b), m);
            }
            other => self.arrival_fault(peer, &other),
        }
    }

    /// The owner's check before it aggregates: a piece whose bytes or signature are not its
    /// sender's signed commitment is that sender's erasure (a fault this rank sees and cannot
    /// prove, as a malformed message).
    pub(super) fn check_pieces<P: Plane<Buf = B>>(
        &mut self,
        audit: &mut Auditing<'r>,
        plane: &mut P,
    ) {
        let (me, n, elem) = (self.spec.me, self.spec.n, self.spec.elem);
        let own = audit.ctx.own[me].clone();
        audit.signed[me] = Some(own);
        for p in schedule::direct_peers(me, n) {
            let Some(piece) = self.arrived[0][p].as_ref() else {
                continue;
            };
            let a = &*audit;
            let ok = match &a.signed[p] {
                None => false,
                Some(sp) => {
                    sp.signed(a.ctx.verifier, &a.ctx.call, me) && {
                        let bytes = plane.host(piece);
                        sp.leaves == leaves(&bytes, elem, a.ctx.audit.sub_chunks)
                    }
                }
            };
            if !ok {
                self.arrived[0][p] = None;
                self.add_fault(
                    p,
                    Fault::Malformed(format!(
                        "its piece of shard {me} does not match its signed commitment"
                    )),
                );
            }
        }
    }

    /// The owner signs its claim over the result it aggregated and the inputs it used.
    pub(super) fn sign_claim<P: Plane<Buf = B>>(
        &mut self,
        audit: &mut Auditing<'r>,
        plane: &mut P,
    ) -> Result<(), Error> {
        let (me, n, elem) = (self.spec.me, self.spec.n, self.spec.elem);
        if self.no_result[0] {
            return Ok(());
        }
        let Some(result) = plane.host_bytes(Src::Owned(0)) else {
            return Err(no_audits());
        };
        let present: Vec<Rank> = (0..n)
            .filter(|&p| p == me || self.arrived[0][p].is_some())
            .collect();
        let a = &*audit;
        let inputs: Vec<SignedPiece> = present
            .iter()
            .map(|&p| a.signed[p].clone().expect("checked before aggregating"))
            .collect();
        let claim = OwnerClaim::sign(
            a.ctx.signer,
            &a.ctx.call,
            me,
            me,
            &result,
            elem,
            a.ctx.audit.sub_chunks,
            inputs,
        );
        let root = crate::audit::root(&claim.result);
        audit.roots[me] = Some(root);
        audit.claim = Some(claim);
        Ok(())
    }

    /// The claim headers beside the results: this rank's to every taker, each owner's from it.
    pub(super) fn audit_versions(
        &self,
        audit: &Auditing<'r>,
        sends: &mut Vec<Send>,
        recvs: &mut Vec<RecvOp>,
    ) {
        let (me, n) = (self.spec.me, self.spec.n);
        let header = match &audit.claim {
            Some(c) => {
                let mut h = c.signature.to_vec();
                h.extend_from_slice(&OwnerClaim::inputs_digest(&c.inputs));
                Bytes::from(h)
            }
            None => Bytes::from(vec![0u8; HEADER]),
        };
        for peer in schedule::direct_peers(me, n) {
            sends.push(Send {
                peer,
                tag: (n + me) as Tag,
                msg: Msg::Bytes(header.clone()),
            });
        }
        let owners: Vec<Rank> = recvs.iter().map(|op| op.peer).collect();
        for o in owners {
            recvs.push(RecvOp {
                peer: o,
                tag: (n + o) as Tag,
                len: HEADER,
            });
        }
    }

    /// A claim header's arrival in the versions step.
    pub(super) fn header_arrived<P: Plane<Buf = B>>(
        &self,
        audit: &mut Auditing<'r>,
        plane: &P,
        o: Rank,
        a: Arrival<B>,
    ) {
        if let Arrival::Received(b) = a {
            let h = plane.host(&b);
            let sig: Signature = h[..64].try_into().expect("64 bytes");
            let digest: Digest = h[64..HEADER].try_into().expect("32 bytes");
            audit.headers[o] = Some((sig, digest));
        }
    }

    /// Whether owner `o`'s result `b` for its shard is the one its claim header signs: an
    /// owner is bound to the result it sent, and a taker does not take one it is not bound
    /// to (the shard is then lost, the round's error, rather than unauditable). The result of
    /// an owner this rank audits is kept as taken, with its leaves.
    pub(super) fn version_signed<P: Plane<Buf = B>>(
        &self,
        audit: &mut Auditing<'r>,
        plane: &P,
        o: Rank,
        b: &B,
    ) -> bool {
        let a = &*audit;
        let Some((signature, inputs)) = a.headers[o] else {
            return false;
        };
        let (elem, m) = (self.spec.elem, a.ctx.audit.sub_chunks);
        let bytes = plane.host(b);
        let result = leaves(&bytes, elem, m);
        let signed = OwnerClaim::signed_over(
            a.ctx.verifier,
            &a.ctx.call,
            o,
            o,
            &result,
            &inputs,
            &signature,
        );
        if let Some((_, subs)) = a.asked.iter().find(|(p, _)| *p == o).filter(|_| signed) {
            let cut = subs
                .iter()
                .map(|&j| {
                    let r = sub_range(bytes.len() / elem, m, j);
                    bytes[r.start * elem..r.end * elem].to_vec()
                })
                .collect();
            audit.kept[o] = Some((cut, result.clone()));
        }
        if signed {
            audit.roots[o] = Some(crate::audit::root(&result));
        }
        signed
    }

    /// This rank's audit choices, made with its own randomness when the owners' results and
    /// claims arrive (every owner is bound to its result by then, and no other rank learns the
    /// choices before they are sent).
    pub(super) fn choose_audits(&self, audit: &mut Auditing<'r>) {
        let (me, n, d) = (self.spec.me, self.spec.n, self.spec.d);
        let f = self.rule.byzantine();
        let settings = audit.ctx.audit;
        let mut xof = blake3::Hasher::new_keyed(&audit.ctx.seed)
            .update(b"byzcoll-audit-v1 choice")
            .finalize_xof();
        // Uniform below `bound` up to a bias of `bound / 2^64`.
        let mut below = |bound: usize| {
            let mut b = [0u8; 8];
            xof.fill(&mut b);
            (u64::from_le_bytes(b) % bound as u64) as usize
        };
        let m = settings.sub_chunks;
        let mut owners: Vec<Rank> = schedule::direct_peers(me, n).collect();
        let k = settings.owners_per_rank(n, f).min(owners.len());
        let mut asked = Vec::with_capacity(k);
        for _ in 0..k {
            let o = owners.swap_remove(below(owners.len()));
            // Only sub-chunks with elements: a shard shorter than `m` has its first `len`
            // sub-chunks of one element each, and the others empty.
            let live = chunk_range(d, n, o).len().clamp(1, m);
            let mut subs: Vec<usize> = (0..live).collect();
            let mut chosen: Vec<usize> = (0..settings.samples.min(live))
                .map(|_| subs.swap_remove(below(subs.len())))
                .collect();
            chosen.sort_unstable();
            asked.push((o, chosen));
        }
        asked.sort_unstable();
        audit.asked = asked;
    }

    /// The round failed before its audit (a shard lost here, say): it still takes part in the
    /// audit's steps, asking for nothing, so that every rank numbers its steps alike and the
    /// others' audits of this rank as an owner are served; the cross-check then ends it.
    pub(super) fn fail_through_audit(&mut self, mut audit: Box<Auditing<'r>>, e: Error) {
        if self.failed.is_none() {
            self.failed = Some(e);
        }
        let n = self.spec.n;
        audit.asked.clear();
        self.post_audit_requests(audit, vec![None; n]);
    }

    /// After the versions: this rank's audit requests ([`Round::choose_audits`]) to every
    /// owner (`NONE` where it audits none of that owner's sub-chunks).
    pub(super) fn post_audit_requests(
        &mut self,
        mut audit: Box<Auditing<'r>>,
        known: Vec<Option<Digest>>,
    ) {
        let (me, n) = (self.spec.me, self.spec.n);
        let erased = self.silent();
        audit.known = known;
        audit.erased = erased;
        let samples = audit.ctx.audit.samples;
        let asked = &audit.asked;
        let request = |o: Rank| -> Bytes {
            let mut b = Vec::with_capacity(4 * samples);
            match asked.iter().find(|(p, _)| *p == o) {
                Some((_, subs)) => subs
                    .iter()
                    .for_each(|&j| b.extend_from_slice(&(j as u32).to_le_bytes())),
                None => (0..samples).for_each(|_| b.extend_from_slice(&NONE.to_le_bytes())),
            }
            Bytes::from(b)
        };
        let sends = schedule::direct_peers(me, n)
            .map(|peer| Send {
                peer,
                tag: 0,
                msg: Msg::Bytes(request(peer)),
            })
            .collect();
        let recvs = self.audit_peers(4 * samples);
        self.post(Phase::AuditRequest(audit), "audit_request", sends, recvs);
    }

    /// The peers found silent (missing or late) so far: the audit's steps do not wait for
    /// them. A peer that sent something malformed is alive and still heard: a rank whose
    /// shard was lost here (an owner's result it would not take) still serves that owner's
    /// audit and hears its verdicts, as every other rank does.
    fn silent(&self) -> Vec<Rank> {
        self.report
            .faults
            .iter()
            .filter(|f| matches!(f.fault, Fault::Missing | Fault::Late))
            .map(|f| f.rank)
            .chain(self.carried.iter().copied())
            .collect()
    }

    /// One receive of `len` bytes (tag 0) from every peer not found silent.
    fn audit_peers(&self, len: usize) -> Vec<RecvOp> {
        let silent = self.silent();
        schedule::direct_peers(self.spec.me, self.spec.n)
            .filter(|p| !silent.contains(p))
            .map(|peer| RecvOp { peer, tag: 0, len })
            .collect()
    }

    pub(super) fn requests_in<P: Plane<Buf = B>>(
        &mut self,
        mut audit: Box<Auditing<'r>>,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let (me, m, samples) = {
            let a = audit.ctx.audit;
            (self.spec.me, a.sub_chunks, a.samples)
        };
        let mut askers = Vec::new();
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            let Arrival::Received(b) = a else {
                self.arrival_fault(op.peer, &a);
                continue;
            };
            let words = words(&plane.host(&b));
            // The sub-chunks asked for, ascending, then `NONE` to the end (an owner whose
            // shard has fewer elements than `samples` non-empty sub-chunks is asked for fewer).
            let asked = words.iter().take_while(|&&w| w != NONE).count();
            if asked == 0 {
                continue;
            }
            let subs: Vec<usize> = words[..asked].iter().map(|&w| w as usize).collect();
            let live = self.shard(me).len().clamp(1, m);
            if words[asked..].iter().any(|&w| w != NONE)
                || subs.len() > samples
                || subs.iter().any(|&j| j >= live)
                || subs.windows(2).any(|w| w[0] >= w[1])
            {
                self.add_fault(
                    op.peer,
                    Fault::Malformed(format!("an audit request for sub-chunks {words:?} of {m}")),
                );
                continue;
            }
            askers.push((op.peer, subs));
        }
        // The audit data: each input's signed piece and its asked sub-chunks, cut where the
        // input lies (this rank's own from the plane's copy of its input).
        let expect = self.expect(&audit);
        let shard = self.shard(me);
        let elem = self.spec.elem;
        let sends = askers
            .iter()
            .map(|(peer, subs)| {
                let bytes = match &audit.claim {
                    Some(c) => c.audit_data(&expect, subs, |sender, j| {
                        let r = sub_range(shard.len(), m, j);
                        let cut = if sender == me {
                            let at = shard.start;
                            plane.host_bytes(Src::Mine(at + r.start..at + r.end))
                        } else {
                            self.arrived[0][sender]
                                .as_ref()
                                .map(|b| plane.host(b)[r.start * elem..r.end * elem].to_vec())
                        };
                        cut.unwrap_or_else(|| vec![0; r.len() * elem])
                    }),
                    None => vec![0; expect.n * expect.slot_len(me, subs)],
                };
                Send {
                    peer: *peer,
                    tag: 0,
                    msg: Msg::Bytes(Bytes::from(bytes)),
                }
            })
            .collect();
        let recvs = audit
            .asked
            .iter()
            .map(|(o, subs)| RecvOp {
                peer: *o,
                tag: 0,
                len: expect.n * expect.slot_len(*o, subs),
            })
            .collect();
        audit.askers = askers;
        self.post(Phase::AuditData(audit), "audit_data", sends, recvs);
    }

    pub(super) fn data_in<P: Plane<Buf = B>>(
        &mut self,
        mut audit: Box<Auditing<'r>>,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let expect = self.expect(&audit);
        let (n, m, elem) = (self.spec.n, expect.m, self.spec.elem);
        let asked = audit.asked.clone();
        let mut refused = Vec::new();
        for ((op, a), (o, subs)) in plan.recvs.iter().zip(outcomes).zip(&asked) {
            debug_assert_eq!(op.peer, *o);
            let o = *o;
            audit.report.audited.push((o, subs.clone()));
            let Arrival::Received(b) = a else {
                self.arrival_fault(o, &a);
                refused.push(o);
                continue;
            };
            let shard = self.shard(o);
            let (Some((result, result_leaves)), Some((signature, digest))) =
                (audit.kept[o].take(), audit.headers[o])
            else {
                refused.push(o);
                continue;
            };
            let bytes = plane.host(&b);
            let Ok((inputs, chunks)) = OwnerClaim::read_audit_data(&bytes, &expect, o, subs) else {
                drop(bytes);
                self.add_fault(o, Fault::Malformed("audit data not in its form".into()));
                refused.push(o);
                continue;
            };
            drop(bytes);
            let claim = OwnerClaim {
                owner: o,
                shard: o,
                result: result_leaves,
                inputs,
                signature,
            };
            // The owner's signature over its result and input set (the senders' signatures
            // included) was checked when the result came (`version_signed`): the inputs it
            // hands over must be that set.
            if OwnerClaim::inputs_digest(&claim.inputs) != digest {
                refused.push(o);
                continue;
            }
            for (k, &j) in subs.iter().enumerate() {
                let r = sub_range(shard.len(), m, j);
                let theirs: Vec<&[u8]> = chunks.iter().map(|c| c[k].as_slice()).collect();
                if !claim
                    .inputs
                    .iter()
                    .zip(&theirs)
                    .all(|(p, b)| crate::audit::leaf(j, b) == p.leaves[j])
                {
                    // Bytes the owner sent and did not commit to: seen here, not provable.
                    refused.push(o);
                    break;
                }
                self.charge(theirs.len() * r.len() * elem);
                let dtype = audit.ctx.dtype;
                let agrees =
                    matches!(replay(self.rule, dtype, &theirs), Ok(out) if out == result[k]);
                if agrees {
                    continue;
                }
                // The replay differs or cannot run: the full check (signatures included)
                // decides whether this is a proof, as every other rank will.
                let acc = Accusation {
                    claim: claim.clone(),
                    sub: j,
                    result: result[k].clone(),
                    inputs: theirs.iter().map(|b| b.to_vec()).collect(),
                };
                let a = &*audit;
                let rule = self.rule;
                match acc.verify(a.ctx.verifier, &a.ctx.call, &expect, |inputs| {
                    replay(rule, dtype, inputs)
                }) {
                    Ok(_) => audit.accusations.push(acc),
                    Err(_) => refused.push(o),
                }
                break;
            }
        }
        // The verdicts: for each owner, the sub-chunk this rank accuses it on, `REFUSED` where
        // it could not replay (every rank aggregates that shard again), or `NONE`.
        let mut flags = vec![NONE; n];
        for &o in &refused {
            flags[o] = REFUSED;
        }
        for acc in &audit.accusations {
            flags[acc.claim.owner] = acc.sub as u32;
        }
        refused.sort_unstable();
        refused.dedup();
        audit.report.refused = refused;
        let flags: Bytes = flags.iter().flat_map(|w| w.to_le_bytes()).collect();
        let sends = to_every_peer(self.spec.me, n, &flags);
        let recvs = self.audit_peers(4 * n);
        self.post(Phase::Verdicts(audit), "audit_verdicts", sends, recvs);
    }

    pub(super) fn verdicts_in<P: Plane<Buf = B>>(
        &mut self,
        mut audit: Box<Auditing<'r>>,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let expect = self.expect(&audit);
        let (me, n, m) = (self.spec.me, self.spec.n, expect.m);
        // An honest rank flags at most the owners it audits.
        let most = audit.ctx.audit.owners_per_rank(n, self.rule.byzantine());
        let mut recvs = Vec::new();
        let mut again: Vec<usize> = audit.report.refused.clone();
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            let Arrival::Received(b) = a else {
                self.arrival_fault(op.peer, &a);
                continue;
            };
            let words = words(&plane.host(&b));
            let flagged = words.iter().filter(|&&w| w != NONE).count();
            if flagged > most
                || words
                    .iter()
                    .any(|&w| w != NONE && w != REFUSED && w as usize >= m)
            {
                self.add_fault(
                    op.peer,
                    Fault::Malformed(format!(
                        "verdicts on {flagged} owners (at most {most}) or past the sub-chunks"
                    )),
                );
                continue;
            }
            for (o, &w) in words.iter().enumerate() {
                match w {
                    NONE => {}
                    REFUSED => again.push(o),
                    j => recvs.push(RecvOp {
                        peer: op.peer,
                        tag: o as Tag,
                        len: expect.accusation_len(o, j as usize),
                    }),
                }
            }
        }
        again.sort_unstable();
        again.dedup();
        audit.again = again;
        let mut sends = Vec::new();
        for acc in &audit.accusations {
            let proof = Bytes::from(acc.encode(&expect));
            for peer in schedule::direct_peers(me, n) {
                sends.push(Send {
                    peer,
                    tag: acc.claim.owner as Tag,
                    msg: Msg::Bytes(proof.clone()),
                });
            }
        }
        self.post(Phase::Proofs(audit), "audit_proofs", sends, recvs);
    }

    pub(super) fn proofs_in<P: Plane<Buf = B>>(
        &mut self,
        mut audit: Box<Auditing<'r>>,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let expect = self.expect(&audit);
        let (me, n) = (self.spec.me, self.spec.n);
        let (dtype, call) = (audit.ctx.dtype, audit.ctx.call);
        // Every accusation, this rank's own among them, checked alike; one about another
        // owner than the one its sender flagged (the receive's tag) proves nothing here.
        let mut proofs: Vec<(Rank, Result<Accusation, crate::audit::Refuted>)> = audit
            .accusations
            .iter()
            .map(|a| (me, Ok(a.clone())))
            .collect();
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            match a {
                Arrival::Received(b) => {
                    let acc =
                        Accusation::decode(&plane.host(&b), &expect).and_then(|acc| {
                            match acc.claim.owner == op.tag as usize {
                                true => Ok(acc),
                                false => Err(crate::audit::Refuted::Malformed(
                                    "a proof about another owner than the one flagged".into(),
                                )),
                            }
                        });
                    proofs.push((op.peer, acc));
                }
                other => self.arrival_fault(op.peer, &other),
            }
        }
        for (from, proof) in proofs {
            let rule = self.rule;
            let verdict = proof.and_then(|acc| {
                acc.verify(audit.ctx.verifier, &call, &expect, |inputs| {
                    replay(rule, dtype, inputs)
                })
            });
            match verdict {
                Ok(lie) => {
                    let report = &mut audit.report;
                    if !report.convicted.iter().any(|l| l.owner == lie.owner) {
                        report.convicted.push(lie);
                    }
                }
                Err(why) => {
                    let why = why.to_string();
                    self.add_fault(from, Fault::Malformed(format!("a false accusation: {why}")));
                    audit.report.false_accusers.push((from, why));
                }
            }
        }
        audit.report.convicted.sort_unstable_by_key(|l| l.owner);
        // Every rank's piece of each shard to aggregate again (a convicted owner's, or one an
        // auditor could not replay), to every rank.
        let mut shards: Vec<usize> = audit
            .report
            .convicted
            .iter()
            .map(|l| l.shard)
            .chain(audit.again.iter().copied())
            .collect();
        shards.sort_unstable();
        shards.dedup();
        let erased = audit.erased.clone();
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for &s in &shards {
            for peer in schedule::direct_peers(me, n) {
                sends.push(Send {
                    peer,
                    tag: s as Tag,
                    msg: Msg::Piece(s),
                });
                if !erased.contains(&peer) {
                    recvs.push(RecvOp {
                        peer,
                        tag: s as Tag,
                        len: self.bytes(self.shard(s).len()),
                    });
                }
            }
        }
        audit.report.recomputed = shards;
        self.post(Phase::Recompute(audit), "audit_recompute", sends, recvs);
    }

    pub(super) fn recomputed<P: Plane<Buf = B>>(
        &mut self,
        mut audit: Box<Auditing<'r>>,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let me = self.spec.me;
        let dtype = audit.ctx.dtype;
        let shards = audit.report.recomputed.clone();
        let mut pieces: Vec<Vec<(Rank, Vec<u8>)>> = vec![Vec::new(); shards.len()];
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            match a {
                Arrival::Received(b) => {
                    let k = shards
                        .iter()
                        .position(|&s| s == op.tag as usize)
                        .expect("a receive per shard aggregated again");
                    pieces[k].push((op.peer, plane.host(&b).into_owned()));
                }
                // A rank that saw no reason to aggregate this shard again sent nothing: not a
                // fault (the verdicts that asked for it may have reached only some ranks); the
                // cross-check compares what each rank ends with.
                Arrival::Missing | Arrival::Late => {}
                other => self.arrival_fault(op.peer, &other),
            }
        }
        let report = std::mem::take(&mut audit.report);
        let mut known = std::mem::take(&mut audit.known);
        // A round that failed before the audit walked its steps with nothing to say, so that
        // every rank numbers them alike: it ends here.
        if self.failed.is_some() {
            self.report.audit = Some(report);
            return self.post_check(None);
        }
        for (k, &s) in shards.iter().enumerate() {
            let range = self.shard(s);
            let Some(own) = plane.host_bytes(Src::Mine(range.clone())) else {
                return self.fail(no_audits());
            };
            pieces[k].push((me, own));
            pieces[k].sort_by_key(|(p, _)| *p);
            let inputs: Vec<&[u8]> = pieces[k].iter().map(|(_, b)| b.as_slice()).collect();
            if let Err(e) = self.rule.check(inputs.len()) {
                self.report.audit = Some(report);
                return self.fail(Error::Aggregation(e));
            }
            self.charge(inputs.len() * self.bytes(range.len()));
            match replay(self.rule, dtype, &inputs) {
                Ok(out) if plane.write_output(range.start, &out) => {}
                Ok(_) => return self.fail(no_audits()),
                Err(why) => {
                    self.report.audit = Some(report);
                    return self.fail(Error::InvalidUsage(format!(
                        "shard {s}, aggregated again after its audit, could not be: {why}"
                    )));
                }
            }
            if let Some(slot) = known.get_mut(s) {
                *slot = None;
            }
        }
        // A shard whose result was not finite here stands unless it was aggregated again.
        if let Some((failed, e)) = audit.non_finite.take() {
            if failed.iter().any(|s| !report.recomputed.contains(s)) {
                self.report.audit = Some(report);
                return self.fail(e);
            }
        }
        self.report.audit = Some(report);
        let digest = self.sharded_result_digest(plane, &known);
        self.post_check(Some(digest));
    }
}

/// The little-endian `u32` words of a request or a verdict.
fn words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

fn no_audits() -> Error {
    Error::Unsupported("this data plane does not run audited rounds (host vectors do)".into())
}
