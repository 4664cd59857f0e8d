//! Sharded mode: the pieces to their owners, the owners' aggregation, and the statistic
//! rounds of global rules.

use super::*;

impl<'r, B> Round<'r, B> {
    pub(super) fn owned(&self) -> Vec<usize> {
        sharded::owned(self.spec.me, self.spec.n, self.r).collect()
    }

    /// Whether rank `q` takes shard `s`'s result (everyone in an all-reduce, rank `s` in a
    /// reduce-scatter).
    pub(super) fn takes(&self, q: Rank, s: usize) -> bool {
        !matches!(self.spec.shape, Shape::ReduceScatter(_)) || q == s
    }

    /// Whether the versions go by digest: with `r > 1` owners per shard outside
    /// [`Agreement::Enforce`], a taker gets one owner's version ([`Round::full_owner`]) and
    /// the BLAKE3 digest of every other owner's, then asks for the versions whose digest
    /// differs from the one it holds (two more steps, `PROTOCOL.md`: "Versions by digest").
    /// Honest owners of a shard hold the same version, so in a round without faults the
    /// versions cost the bytes of `r = 1`, and the median of equal versions is that version.
    pub(super) fn by_digest(&self) -> bool {
        self.r > 1 && self.spec.agreement != Agreement::Enforce
    }

    /// The owner of shard `s` that sends taker `t` its whole version when versions go by
    /// digest: none where `t` owns `s` (it holds its own); otherwise the owners take the
    /// takers in turn, so that each sends about `n / r` of them a version.
    pub(super) fn full_owner(&self, t: Rank, s: usize) -> Option<Rank> {
        let (n, r) = (self.spec.n, self.r);
        if sharded::owns(t, s, n, r) {
            return None;
        }
        sharded::owners(s, n, r).nth((t + n - s) % n % r)
    }

    pub(super) fn post_scatter(&mut self) {
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        self.arrived = (0..r).map(|_| (0..n).map(|_| None).collect()).collect();
        self.no_result = vec![false; r];
        let mut sends = sharded::scatter_sends(me, n, r)
            .into_iter()
            .map(|(peer, s)| Send {
                peer,
                tag: s as Tag,
                msg: Msg::Piece(s),
            })
            .collect();
        let erased: Vec<Rank> = self.report.faults.iter().map(|f| f.rank).collect();
        let mut recvs = sharded::scatter_recvs(me, n, r)
            .into_iter()
            .filter(|(peer, _)| !erased.contains(peer))
            .map(|(peer, s)| RecvOp {
                peer,
                tag: s as Tag,
                len: self.bytes(self.shard(s).len()),
            })
            .collect();
        if let Some(audit) = &self.audit {
            self.audit_scatter(audit, &mut sends, &mut recvs);
        }
        // Each sender sends this rank a piece of each of its `r` owned shards.
        self.post_inputs(Phase::Scatter, "robust_sharded", sends, recvs, r);
    }

    /// The inputs of the `i`-th owned shard `s`, by rank (`None`: erased).
    pub(super) fn shard_inputs(&self, i: usize, s: usize) -> Vec<Option<Src<'_, B>>> {
        (0..self.spec.n)
            .map(|p| {
                if p == self.spec.me && self.dropped.get(i).is_some_and(|d| d.contains(&p)) {
                    None
                } else if p == self.spec.me {
                    Some(Src::Mine(self.shard(s)))
                } else {
                    self.arrived[i][p].as_ref().map(Src::Got)
                }
            })
            .collect()
    }

    pub(super) fn scattered<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let (me, n) = (self.spec.me, self.spec.n);
        // An audited round's state, out of the round while the pieces are taken in.
        let mut audit = self.audit.take();
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            if let Some(audit) = audit.as_deref_mut().filter(|_| op.tag as usize >= n) {
                self.signed_piece_arrived(audit, plane, op.peer, a);
                continue;
            }
            self.arrival_fault(op.peer, &a);
            if let Arrival::Received(b) = a {
                self.received_bytes += op.len;
                let i = owned_index(me, op.tag as usize, n);
                self.arrived[i][op.peer] = Some(b);
            }
        }
        if let Some(audit) = audit.as_deref_mut() {
            self.check_pieces(audit, plane);
        }
        self.audit = audit;
        if self.syncs() {
            return self.post_sync();
        }
        self.pieces_settled(plane);
    }

    /// Whether the owners tell each other which senders' pieces they hold before they
    /// aggregate ([`Round::post_sync`]): with stragglers allowed, where versions go by digest
    /// under a coordinate-wise rule (the rounds [`stragglers_in`] lets end early).
    pub(super) fn syncs(&self) -> bool {
        self.spec.stragglers > 0
            && self.by_digest()
            && matches!(self.statistics, Statistics::None)
            && self.audit.is_none()
    }

    /// The ranks that own a shard this rank owns, but this rank.
    fn co_owners(&self) -> Vec<Rank> {
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        let mut co: Vec<Rank> = self
            .owned()
            .into_iter()
            .flat_map(|s| sharded::owners(s, n, r))
            .filter(|&o| o != me)
            .collect();
        co.sort_unstable();
        co.dedup();
        co
    }

    /// The owners' sync, with stragglers allowed: each owner sends its co-owners one byte per
    /// rank, 1 where every piece that rank sent it arrived in time, and leaves out of each
    /// shard every sender a co-owner of that shard lacks. Owners in time that heard each other then
    /// aggregate the same inputs, whichever pieces came within their own grace, and hold
    /// the same versions: a piece late at one owner and in time at another no longer splits
    /// their versions (`PROTOCOL.md`, "Sharded rounds with stragglers").
    fn post_sync(&mut self) {
        let n = self.spec.n;
        // A sender whose pieces came in part (a quorum counts pieces, not senders) is left
        // out of every owned shard here, as this rank's sync tells its co-owners to do.
        let partial: Vec<Rank> = (0..n).filter(|&p| !self.holds_all_of(p)).collect();
        for p in partial {
            for by in &mut self.arrived {
                by[p] = None;
            }
        }
        let held: Vec<u8> = (0..n).map(|p| u8::from(self.holds_all_of(p))).collect();
        let held = Bytes::from(held);
        let co = self.co_owners();
        let sends = co
            .iter()
            .map(|&peer| Send {
                peer,
                tag: 0,
                msg: Msg::Bytes(held.clone()),
            })
            .collect();
        // Every co-owner in time is waited for (its sync says which pieces its version will
        // lack); one whose pieces were late here only up to the grace's floor past the others
        // (a straggler's sync comes as late as its pieces, but a co-owner cut by jitter alone
        // may lack a piece this rank holds), and a laggard not at all.
        let late = |p: Rank| self.is_late(p);
        let recvs: Vec<RecvOp> = co
            .iter()
            .filter(|&&p| (self.fault_of(p).is_none() || late(p)) && !self.carried.contains(&p))
            .map(|&peer| RecvOp {
                peer,
                tag: 0,
                len: n,
            })
            .collect();
        // Where none was late, a co-owner in time that stays silent (a Byzantine one, or one
        // stopped after its pieces) is waited for only the round so far plus one grace of it
        // past all but `f` of the others' syncs ([`Round::post_past_quorum`]). It is then not synced with, nor counted late
        // (its pieces came in time: [`Round::synced`]); its version, if any comes, is one of
        // the shard's owners', and `f + 1` alike ones do without it. (Bounding the wait by
        // the round so far from this rank's post instead cut honest co-owners still in their
        // scatter's grace: simulated, 4 ranks with 2 ms of jitter.) Where one was late, the
        // co-owners in time are waited for until the deadline.
        if !recvs.iter().any(|r| late(r.peer)) {
            let needed = recvs.len().saturating_sub(self.rule.byzantine());
            return self.post_past_quorum(Phase::Sync, "robust_sharded_sync", sends, recvs, needed);
        }
        let floor = Grace {
            min: self.spec.grace.min,
            factor: 0,
        };
        self.post_awaiting_late(Phase::Sync, "robust_sharded_sync", sends, recvs, 0, floor);
    }

    /// Whether every piece `p` sent this rank arrived (its own always did).
    fn holds_all_of(&self, p: Rank) -> bool {
        p == self.spec.me || self.arrived.iter().all(|by| by[p].is_some())
    }

    /// The owners' sync is in: every sender whose pieces a co-owner lacks (by a sync that
    /// names at most `s` senders apart from what this rank lacks itself; a longer one is
    /// ignored) leaves the shards this rank owns with that co-owner (`dropped`), its own
    /// piece among them where the co-owners went without it; then the shards are aggregated.
    pub(super) fn synced<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let (me, n, r) = (self.spec.me, self.spec.n, self.r);
        let s = self.spec.stragglers;
        let owned = self.owned();
        let mut dropped: Vec<Vec<Rank>> = vec![Vec::new(); owned.len()];
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            let b = match a {
                Arrival::Received(b) => b,
                // Cut by the grace past the others' syncs ([`Round::post_past_quorum`]): not
                // synced with, but not counted late either. Its pieces came in time, and a
                // co-owner counted late would not be waited for in the later steps (an honest
                // one's check then cut failed the round: simulated, 7 ranks with 2 ms of
                // jitter). Its version, if it differs, is one of the shard's owners' versions.
                Arrival::Late => continue,
                other => {
                    self.arrival_fault(op.peer, &other);
                    continue;
                }
            };
            let flags = plane.host(&b);
            if flags.len() != n || flags.iter().any(|&f| f > 1) {
                self.add_fault(
                    op.peer,
                    Fault::Malformed(format!("an owners' sync that is not {n} flags of 0 or 1")),
                );
                continue;
            }
            let lacks: Vec<Rank> = (0..n)
                .filter(|&p| flags[p] == 0 && self.holds_all_of(p))
                .collect();
            // More than `s`: ignored, so that no co-owner strips a shard of its inputs (not
            // named malformed: a quorum counts pieces, and an honest owner cut in the middle
            // of several senders' pieces may lack more than `s` of them).
            if lacks.len() > s {
                self.warnings.push(format!(
                    "rank {}'s owners' sync lacks {} senders this rank holds, more than the {s} \
                     stragglers allowed: ignored",
                    op.peer,
                    lacks.len()
                ));
                continue;
            }
            // Only from the shards this co-owner owns too: the others' owners did not hear
            // its sync, and keep what they hold.
            for (i, &t) in owned.iter().enumerate() {
                if sharded::owns(op.peer, t, n, r) {
                    dropped[i].extend(&lacks);
                }
            }
        }
        for (i, d) in dropped.iter_mut().enumerate() {
            d.sort_unstable();
            d.dedup();
            for &p in d.iter() {
                self.arrived[i][p] = None;
            }
        }
        if dropped.iter().any(|d| d.contains(&me)) {
            // Said in the report, but on a co-owner's word: not counted in this rank's own
            // fault memory (`Round::erased_self`).
            self.report.erased_self = true;
            self.erased_by_sync = true;
        }
        self.dropped = dropped;
        self.pieces_settled(plane);
    }

    /// The pieces are settled (arrived, and with stragglers allowed, synced with the
    /// co-owners): their digests for the cross-check, and each owned shard's aggregate (or a
    /// global rule's statistic rounds).
    fn pieces_settled<P: Plane<Buf = B>>(&mut self, plane: &mut P) {
        let (me, n) = (self.spec.me, self.spec.n);
        let owned = self.owned();
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
                        .filter(|&p| {
                            (p == me && !self.dropped.get(i).is_some_and(|d| d.contains(&p)))
                                || self.arrived[i][p].is_some()
                        })
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
                    self.owner_outcome(plane, i, s, done);
                }
                non_finite.sort_unstable();
                self.report.non_finite = non_finite;
                if let Some(mut audit) = self.audit.take() {
                    let signed = self.sign_claim(&mut audit, plane);
                    self.audit = Some(audit);
                    if let Err(e) = signed {
                        return self.fail(e);
                    }
                }
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
    pub(super) fn owner_outcome<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        i: usize,
        s: usize,
        done: Result<(), impl std::fmt::Display>,
    ) {
        if done.is_ok() {
            let inputs = self.shard_inputs(i, s);
            let measured = plane.measure(&inputs, Dest::Owned(i), self.rule.byzantine());
            drop(inputs);
            self.add_measure(measured);
        }
        if let Err(why) = done {
            self.warnings.push(format!(
                "cannot aggregate owned shard {s}: {why}; sending an empty result"
            ));
            self.no_result[i] = true;
        }
    }

    pub(super) fn post_iteration<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        k: usize,
        moved: &[(f64, f64)],
    ) {
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
    pub(super) fn post_statistic(&mut self, k: usize, parts: &[(usize, Bytes)], len: usize) {
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

    pub(super) fn statistic_done<P: Plane<Buf = B>>(
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
                    self.owner_outcome(plane, i, s, done);
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
                    self.owner_outcome(plane, i, s, done);
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
                        self.owner_outcome(plane, i, s, done);
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
}
