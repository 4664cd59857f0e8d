//! The cross-check step of [`Agreement::Detect`]: each rank's [`Check`] to every other, and
//! what they say of this rank's result.

use super::*;

impl<'r, B> Round<'r, B> {
    /// The cross-check step of [`Agreement::Detect`] (or the end under `Off`): every rank,
    /// whether its round succeeded or not (so that collectives stay numbered alike), sends
    /// every other rank its [`Check`]; the ranks this rank erased are not waited for, whether
    /// the round succeeded or not.
    /// `result` is the digest the ranks compare (`Some` exactly when the round succeeded).
    pub(super) fn post_check(&mut self, result: Option<Digest>) {
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
        // Not waited for: the peers erased this round or an earlier sub-round, also where the
        // round failed (its error holds this round's faults).
        let failed_faults = match &self.failed {
            Some(Error::TooManyFaults { faults, .. } | Error::ShardLost { faults, .. }) => {
                &faults[..]
            }
            _ => &[],
        };
        let erased: Vec<Rank> = self
            .carried
            .iter()
            .copied()
            .chain(self.report.faults.iter().map(|f| f.rank))
            .chain(failed_faults.iter().map(|f| f.rank))
            .collect();
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
        self.post(Phase::Check { mine, encoded }, "cross_check", sends, recvs);
    }

    pub(super) fn checked<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
        mine: Check,
        encoded: Vec<Bytes>,
    ) {
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
