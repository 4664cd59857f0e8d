//! Sharded mode's last phase: the owners' versions of each shard to the ranks that take it
//! (whole, or by digest with the requests and resends), and their median.

use super::*;

impl<'r, B> Round<'r, B> {
    /// Phase 3: every owner sends its results to every rank that takes the shard (or, when
    /// versions go by digest, their digest to the takers another owner sends its version).
    pub(super) fn post_versions(&mut self) {
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        let by_digest = self.by_digest();
        // The pieces are not needed any more, but where versions go by digest under a
        // coordinate-wise rule: there an owner whose version turns out not to be its
        // co-owners' tries its shard again without its own piece (`Round::rejoin_shard`).
        // An audited owner keeps them for its auditors.
        if !(by_digest && self.rejoins()) && self.audit.is_none() {
            self.arrived.clear();
        }
        let mut sends: Vec<Send> = sharded::result_sends(me, n, r)
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
        let mut recvs: Vec<RecvOp> = sharded::result_recvs(me, n, r)
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
        if let Some(audit) = &self.audit {
            self.audit_versions(audit, &mut sends, &mut recvs);
        }
        if self.spec.stragglers > 0 && by_digest {
            return self.post_owner_quorum(Phase::Versions, "robust_sharded", sends, recvs, r);
        }
        self.post(Phase::Versions, "robust_sharded", sends, recvs);
    }

    /// The versions step with stragglers allowed ([`stragglers_in`]): a late owner is handled
    /// like a missing one. The step ends once all but `s` owners' messages are in
    /// (`per_sender` each: an owner sends a taker one version per shard it owns; the owners
    /// already late this round are not posted, and spent their part of `s`) and the grace
    /// has passed, the grace waiting for no laggard ([`Carry::laggards`]).
    pub(super) fn post_owner_quorum(
        &mut self,
        phase: Phase<'r, B>,
        op: &'static str,
        sends: Vec<Send>,
        mut recvs: Vec<RecvOp>,
        per_sender: usize,
    ) {
        let late_now = |p: Rank| self.is_late(p);
        let laggard = |p: Rank| self.laggards.contains(&p);
        recvs.sort_by_key(|op| (late_now(op.peer) || laggard(op.peer), laggard(op.peer)));
        // The owners already erased this round for their lateness (not posted here) spent
        // their part of the budget.
        let spent = self
            .report
            .faults
            .iter()
            .filter(|f| f.fault == Fault::Late)
            .count();
        let budget = self.spec.stragglers.saturating_sub(spent);
        // An owner in time sends when its own scatter ended, which may have waited a grace
        // for a piece this rank had in time: the grace is at least the round so far.
        let grace = Grace {
            min: self.spec.grace.after(self.elapsed.unwrap_or_default()),
            factor: self.spec.grace.factor,
        };
        let quorum = Quorum {
            receives: recvs
                .len()
                .saturating_sub(budget.saturating_mul(per_sender)),
            grace,
            awaited: recvs.iter().filter(|op| !laggard(op.peer)).count(),
            core: 0,
        };
        self.post_quorum(phase, op, sends, recvs, Some(quorum));
    }

    pub(super) fn versions_done<P: Plane<Buf = B>>(
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
        // An audited round's state, out of the round while the results are taken in.
        let mut audit = self.audit.take();
        let auditing = audit.is_some();
        let mut headers = Vec::new();
        let outcomes: Vec<(Rank, usize, Arrival<B>)> = plan
            .recvs
            .iter()
            .zip(outcomes)
            .filter_map(|(op, a)| match auditing && op.tag as usize >= n {
                true => {
                    headers.push((op.peer, a));
                    None
                }
                false => Some((op.peer, op.tag as usize, a)),
            })
            .collect();
        let outcomes: Vec<(Rank, usize, Arrival<B>)> = match audit.as_deref_mut() {
            None => outcomes,
            Some(audit) => {
                for (o, a) in headers {
                    self.header_arrived(audit, plane, o, a);
                }
                self.choose_audits(audit);
                outcomes
                    .into_iter()
                    .map(|(o, s, a)| match a {
                        Arrival::Received(b) if !self.version_signed(audit, plane, o, &b) => (
                            o,
                            s,
                            Arrival::Malformed(format!(
                                "its result for shard {s} is not the one its claim signs"
                            )),
                        ),
                        a => (o, s, a),
                    })
                    .collect()
            }
        };
        for (o, s, a) in &outcomes {
            match a {
                Arrival::Received(b) => {
                    version_bytes += self.bytes(self.shard(*s).len());
                    versions[*s].push((*o, Src::Got(b)));
                }
                Arrival::Missing => faults.push((*o, Fault::Missing)),
                Arrival::Late => faults.push((*o, Fault::Late)),
                Arrival::Malformed(why) => faults.push((*o, Fault::Malformed(why.clone()))),
                Arrival::OutOfStep => faults.push((*o, Fault::OutOfStep)),
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
                        // An audited round hashed each result already (its leaves' root).
                        let root = audit.as_ref().and_then(|a| a.roots[o]);
                        let digest = root.unwrap_or_else(|| plane.commitment(src.clone()));
                        digests.push((s * r + k, digest));
                    }
                }
            }
        }
        self.audit = audit;
        let (lost, combined, non_finite) = self.combine_versions(plane, &mut versions);
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
        // A shard whose result was not finite here: an audited round goes on to the audit,
        // which may convict its owner and aggregate it again, and fails with `e` otherwise.
        let combined = match (combined, self.audit.as_deref_mut()) {
            (Err(e), Some(audit)) if !non_finite.is_empty() => {
                audit.non_finite = Some((non_finite, e));
                Ok(())
            }
            (other, _) => other,
        };
        self.end_versions(plane, lost, combined, Some(shards));
    }

    /// Versions by digest, after the versions step: the version held for each taken shard
    /// (the designated owner's, or this rank's own), each owner's digest, and the versions to
    /// ask for: those whose digest differs from the one held, or all where none is held.
    pub(super) fn digests_arrived<P: Plane<Buf = B>>(
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
        // An owned shard whose version every co-owner contradicts alike: this rank may have
        // been late for them (its piece erased), so it tries the shard without its piece.
        for (i, &s) in owned.iter().enumerate() {
            let at = owned_index(me, s, n);
            let others: Vec<Option<Digest>> = (0..r)
                .filter(|&k| k != at)
                .map(|k| announced[s][k])
                .collect();
            let Some(Some(theirs)) = others.first().copied() else {
                continue;
            };
            if !self.rejoins()
                || full[s].is_some()
                || held[s] == Some(theirs)
                || others.iter().any(|d| *d != Some(theirs))
            {
                continue;
            }
            if self.rejoin_shard(plane, i, s, theirs) {
                held[s] = Some(theirs);
                announced[s][at] = Some(theirs);
                wanted.retain(|&(_, t)| t != s);
            }
        }
        self.arrived.clear();
        if self.detect() {
            for (s, digests) in announced.iter().enumerate() {
                self.seen.versions[s * r..(s + 1) * r].copy_from_slice(digests);
            }
        }
        self.post_requests(Pending {
            full,
            held,
            announced,
            wanted,
        });
    }

    /// Versions by digest: every taker tells every other owner of a shard it takes which of
    /// that owner's versions it wants (one byte per shard the owner owns, in
    /// [`sharded::owned`] order: 1 wanted, 0 not), even when it wants none, so that no owner
    /// waits out a deadline for a request, not even one this rank erased (a late owner that
    /// did not erase this rank waits for its request). This rank waits only for the requests
    /// of takers it did not erase.
    pub(super) fn post_requests(&mut self, pending: Pending<B>) {
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        let wanted = &pending.wanted;
        // Owners this rank erased get their (small) request too: one that is merely late
        // waits for it, and without it would wait out the deadline in every later round.
        let sends = (0..n)
            .filter(|&o| o != me)
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
        // With stragglers allowed, a taker that was only late this round may still ask for a
        // version (one it got by digest from an owner in time): its request is waited for,
        // past the others', up to the grace's floor.
        let quorum = self.spec.stragglers > 0;
        let waited = |t: Rank| match self.fault_of(t) {
            None => true,
            Some(fault) => quorum && *fault == Fault::Late && !self.carried.contains(&t),
        };
        let recvs: Vec<RecvOp> = (0..n)
            .filter(|&t| t != me && waited(t))
            .filter(|&t| owned.iter().any(|&s| self.takes(t, s)))
            .map(|t| RecvOp {
                peer: t,
                tag: 0,
                len: r,
            })
            .collect();
        let phase = Phase::Request(pending);
        // Where no taker was late, one silent after its pieces (a Byzantine rank, or one
        // stopped) is waited for only a grace past all but `f` others' requests (a grace of
        // the round so far plus one of it): an honest taker whose request is cut so gets no
        // version resent, and its resend wait is bounded the same way.
        if quorum && !recvs.iter().any(|r: &RecvOp| self.is_late(r.peer)) {
            let needed = recvs.len().saturating_sub(self.rule.byzantine());
            return self.post_past_quorum(phase, "robust_sharded_requests", sends, recvs, needed);
        }
        match quorum {
            true => {
                let grace = Grace {
                    min: self.spec.grace.min,
                    factor: 0,
                };
                self.post_awaiting_late(phase, "robust_sharded_requests", sends, recvs, 0, grace);
            }
            false => self.post(phase, "robust_sharded_requests", sends, recvs),
        }
    }

    /// Versions by digest: the requests are in; this rank sends the versions asked of it and
    /// receives those it asked for.
    pub(super) fn requests_arrived<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
        pending: Pending<B>,
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
        let recvs = pending
            .wanted
            .iter()
            .filter(|(o, _)| !erased.contains(o))
            .map(|&(o, s)| RecvOp {
                peer: o,
                tag: s as Tag,
                len: self.bytes(self.shard(s).len()),
            })
            .collect();
        self.post(
            Phase::Resend(pending),
            "robust_sharded_resend",
            sends,
            recvs,
        );
        // With stragglers allowed, an owner that counted this rank late answers its request
        // only where it came within its grace: the versions asked for are waited for about as
        // long as the round so far, and then the shard stands or falls on those in hand
        // ([`Round::unsupported_shard`]), loudly.
        if self.spec.stragglers > 0 {
            self.bound_by_the_round_so_far();
        }
    }

    /// Versions by digest, the end: each taken shard's versions are the one held, once for
    /// every owner whose digest matched it, and the versions asked for that hash to the
    /// digest their owner sent (one that does not is malformed); their median goes into the
    /// output. Where nothing was asked for, the one version held is the median.
    pub(super) fn resent<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
        pending: Pending<B>,
    ) {
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        let Pending {
            full,
            held,
            announced,
            ..
        } = pending;
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
        let (lost, combined) = match self.unsupported_shard(&held, &announced, &fetched) {
            Some(e) => (None, Err(e)),
            None => {
                let (lost, combined, _) = self.combine_versions(plane, &mut versions);
                (lost, combined)
            }
        };
        drop(versions);
        self.report.peak_bytes = peak;
        self.end_versions(plane, lost, combined, Some(shards));
    }

    /// With stragglers allowed, the first taken shard whose versions in hand are too few to
    /// stand, as the round's error: fewer than `2f + 1` owners' versions (the held one counts
    /// for every owner that announced its digest, a fetched one for its owner), none of them
    /// `f + 1` alike. A late owner is handled like a missing one ([`stragglers_in`]), so the
    /// median of the versions that came must hold `f` Byzantine ones, or `f + 1` alike must
    /// vouch for one (and the median of versions `f + 1` of which are alike is that one).
    fn unsupported_shard(
        &self,
        held: &[Option<Digest>],
        announced: &[Vec<Option<Digest>>],
        fetched: &[(Rank, usize, B)],
    ) -> Option<Error> {
        if self.spec.stragglers == 0 {
            return None;
        }
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        let f = self.rule.byzantine();
        (0..n)
            .filter(|&s| self.takes(me, s) && !self.shard(s).is_empty())
            .find_map(|s| {
                let mut versions: Vec<Digest> = (0..r)
                    .filter_map(|k| announced[s][k].filter(|d| held[s] == Some(*d)))
                    .collect();
                versions.extend(
                    fetched
                        .iter()
                        .filter(|(_, t, _)| *t == s)
                        .filter_map(|(o, _, _)| announced[s][owned_index(*o, s, n)]),
                );
                let alike = versions
                    .iter()
                    .map(|d| versions.iter().filter(|e| *e == d).count())
                    .max()
                    .unwrap_or(0);
                (versions.len() < 2 * f + 1 && alike < f + 1).then(|| Error::TooManyFaults {
                    source: AggError::Precondition {
                        rule: format!("the versions of shard {s}"),
                        requirement: "2f + 1 owners' versions, or f + 1 alike",
                        n: versions.len(),
                        f,
                    },
                    faults: self.report.faults.clone(),
                })
            })
    }

    /// Whether an owner may try an owned shard again without its own piece
    /// ([`Round::rejoin_shard`]): under a coordinate-wise rule, with co-owners to compare
    /// with, where the owners' sync did not already leave its piece out ([`Round::syncs`]:
    /// there its announced version is the one it keeps, and resends).
    pub(super) fn rejoins(&self) -> bool {
        matches!(self.statistics, Statistics::None) && self.r > 1 && !self.syncs()
    }

    /// Owned shard `i` (`s`) again without this rank's own piece, kept where its digest is
    /// `theirs`, the version every co-owner announced: what the co-owners computed when this
    /// rank's piece was late for them (a stall, a straggler). Then this rank holds their
    /// version, asks nobody for it, and reports `erased_self`; otherwise its own version is
    /// made again and kept. Without this, a rank that stalled once would wait out a deadline in
    /// every later round for versions its co-owners, which erased it, never resend, and never
    /// get back in step.
    pub(super) fn rejoin_shard<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        i: usize,
        s: usize,
        theirs: Digest,
    ) -> bool {
        let me = self.spec.me;
        let all = self.shard_inputs(i, s);
        let without: Vec<Src<'_, B>> = all
            .iter()
            .enumerate()
            .filter(|&(p, _)| p != me)
            .filter_map(|(_, src)| src.clone())
            .collect();
        if self.rule.check(without.len()).is_err() {
            return false;
        }
        let with: Vec<Src<'_, B>> = all.into_iter().flatten().collect();
        self.charge(without.len() * self.bytes(self.shard(s).len()));
        let matched = plane.aggregate(self.rule, &without, Dest::Owned(i)).is_ok()
            && plane.commitment(Src::Owned(i)) == theirs;
        if !matched {
            // The shard as this rank sent it (bitwise: the rule is deterministic).
            let _ = plane.aggregate(self.rule, &with, Dest::Owned(i));
            return false;
        }
        self.report.erased_self = true;
        true
    }

    /// The round's peak of data bytes held at once, given the versions received: the input,
    /// the pieces and the owned results (phase 1), or the results and the versions.
    pub(super) fn versions_peak(&self, version_bytes: usize) -> usize {
        let results_bytes: usize = self
            .owned()
            .iter()
            .map(|&s| self.bytes(self.shard(s).len()))
            .sum();
        let phase1 = self.bytes(self.spec.d) + self.received_bytes + results_bytes;
        // Where an owner may try a shard again, the pieces stay through the versions step.
        let pieces = match self.by_digest() && self.rejoins() {
            true => self.received_bytes,
            false => 0,
        };
        phase1.max(results_bytes + version_bytes + pieces)
    }

    /// The median of each taken shard's `versions` (owner order) into the output: the first
    /// shard without any version, or the first failure.
    pub(super) fn combine_versions<P: Plane<Buf = B>>(
        &self,
        plane: &mut P,
        versions: &mut [Vec<(Rank, Src<'_, B>)>],
    ) -> (Option<usize>, Result<(), Error>, Vec<usize>) {
        let me = self.spec.me;
        let taken = |s: usize| !self.shard(s).is_empty() && self.takes(me, s);
        let lost = (0..versions.len()).find(|&s| taken(s) && versions[s].is_empty());
        if lost.is_some() {
            return (lost, Ok(()), Vec::new());
        }
        // An audited round combines every shard whatever one gave: a non-finite result waits
        // for the audit, which may convict its owner and aggregate it again.
        let mut first_error = None;
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
                let e = match e {
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
                };
                match (&self.audit, &mut first_error) {
                    (None, _) => return (None, Err(e), Vec::new()),
                    (Some(_), None) => first_error = Some((vec![s], e)),
                    (Some(_), Some((shards, _))) => shards.push(s),
                }
            }
        }
        match first_error {
            None => (None, Ok(()), Vec::new()),
            Some((shards, e)) => (None, Err(e), shards),
        }
    }

    /// The end of the versions (a lost shard or a failed median fails the round), then the
    /// cross-check. `shards`: where the result digest is made from the shards' digests
    /// ([`Round::sharded_result_digest`]), those already known (`None`: hash that shard);
    /// `None`: the plane hashes the whole output.
    pub(super) fn end_versions<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        lost: Option<usize>,
        combined: Result<(), Error>,
        shards: Option<Vec<Option<Digest>>>,
    ) {
        let (n, r) = (self.spec.n, self.r);
        if let Some(s) = lost {
            let faults = self.report.faults.clone();
            let e = Error::ShardLost {
                shard: s,
                owners: sharded::owners(s, n, r).collect(),
                faults,
            };
            return match self.audit.take() {
                Some(audit) => self.fail_through_audit(audit, e),
                None => self.fail(e),
            };
        }
        if let Err(e) = combined {
            return match self.audit.take() {
                Some(audit) => self.fail_through_audit(audit, e),
                None => self.fail(e),
            };
        }
        if let Some(audit) = self.audit.take() {
            return self.post_audit_requests(audit, shards.unwrap_or_else(|| vec![None; n]));
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
    pub(super) fn sharded_result_digest<P: Plane<Buf = B>>(
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
    pub(super) fn versions_to_echo<P: Plane<Buf = B>>(
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
    pub(super) fn combine_agreed<P: Plane<Buf = B>>(
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
        let (lost, combined, _) = self.combine_versions(plane, &mut versions);
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
}
