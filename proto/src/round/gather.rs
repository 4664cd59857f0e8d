//! Gather mode: every rank sends its input straight to every other and aggregates them all.

use super::*;

impl<'r, B> Round<'r, B> {
    pub(super) fn post_gather(&mut self) {
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
        self.post_inputs(Phase::Gather, "robust_gather", sends, recvs, 1);
    }

    pub(super) fn gathered<P: Plane<Buf = B>>(
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
        // With the recovery step, the check carries this rank's commitment to its own input,
        // so that a copy one passer sends can be checked exactly ([`Round::converge`]).
        if self.confirms() && plane.keeps_input() {
            self.own_commit = Some(plane.commitment(Src::Mine(0..d)));
        }
        self.aggregate_inputs(plane, &got, ranks);
        if self.spec.agreement == Agreement::Detect && plane.keeps_input() {
            self.kept = got;
        }
    }

    /// Aggregates the inputs of `ranks` (in rank order): `got[p]`, or this rank's own; then
    /// the cross-check.
    pub(super) fn aggregate_inputs<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        got: &[Option<B>],
        ranks: Vec<Rank>,
    ) {
        match self.aggregate_set(plane, got, &ranks) {
            Ok(()) => {
                let digest = self.detect().then(|| plane.result_digest());
                self.post_check(digest);
            }
            Err(e) => self.fail(e),
        }
    }

    /// The rule over the inputs of `ranks` into the output, with what the report says of
    /// them (count, bytes, selection, non-finite inputs, attribution).
    pub(super) fn aggregate_set<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        got: &[Option<B>],
        ranks: &[Rank],
    ) -> Result<(), Error> {
        let (me, d) = (self.spec.me, self.spec.d);
        let src = |p: Rank| match &got[p] {
            Some(b) if p != me => Src::Got(b),
            _ => Src::Mine(0..d),
        };
        let others = ranks.iter().filter(|&&p| p != me).count();
        self.report.inputs = ranks.len();
        self.received_bytes = others * self.bytes(d);
        self.report.peak_bytes = (others + 2) * self.bytes(d);
        for &p in ranks {
            // Under Enforce the agreed commitments are already there (BLAKE3 serves the
            // cross-check as well as XXH3 and saves a pass over every input).
            if self.detect() && self.seen.inputs[p].is_none() {
                self.seen.inputs[p] = Some(plane.digest(src(p)));
            }
        }
        let inputs: Vec<Src<'_, B>> = ranks.iter().map(|&p| src(p)).collect();
        if let Err(source) = self.rule.check(ranks.len()) {
            self.report.non_finite = non_finite_ranks(plane, None, &inputs, ranks);
            let faults = self.report.faults.clone();
            return Err(Error::TooManyFaults { source, faults });
        }
        self.charge(inputs.len() * self.bytes(d));
        let aggregated = plane.aggregate(self.rule, &inputs, Dest::Output);
        let found = aggregated
            .as_ref()
            .ok()
            .and_then(|a| a.non_finite.as_deref());
        self.report.non_finite = non_finite_ranks(plane, found, &inputs, ranks);
        let agg = aggregated.map_err(|e| rank_error(e, ranks))?;
        self.report.selected = agg
            .selected
            .map(|s| s.into_iter().map(|i| ranks[i]).collect());
        drop(inputs);
        let mut all: Vec<Option<Src<'_, B>>> = (0..self.spec.n).map(|_| None).collect();
        for &p in ranks {
            all[p] = Some(src(p));
        }
        let measured = plane.measure(&all, Dest::Output, self.rule.byzantine());
        drop(all);
        self.measured = None;
        self.add_measure(measured);
        Ok(())
    }
}
