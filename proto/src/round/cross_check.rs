//! The cross-check step of [`Agreement::Detect`]: each rank's [`Check`] to every other, and
//! what they say of this rank's result.

use super::*;
use crate::AgreementReport;

/// The confirmation step's message: status (1: a result), then its BLAKE3 digest.
const CONFIRM_LEN: usize = 33;

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
        let (me, n) = (self.spec.me, self.spec.n);
        let mut theirs: Vec<Option<Check>> = vec![None; n];
        let mut same = vec![false; n];
        let mut heard = Vec::new();
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            if let Arrival::Received(b) = a {
                heard.push(op.peer);
                let bytes = plane.host(&b);
                // The common case, a rank that saw what this one saw, costs one comparison.
                if bytes[..] == encoded[op.peer][..] {
                    same[op.peer] = true;
                } else {
                    theirs[op.peer] = Check::decode_from(&bytes, op.peer, me, n, mine.seen.r);
                }
            }
        }
        if self.failed.is_some() {
            if self.confirms() {
                self.post_confirm(None, Err(None), heard);
            }
            return;
        }
        let f = self.rule.byzantine();
        let outcome = match check::evaluate(me, n, f, &mine, &theirs, &same) {
            Ok(mut found) => {
                found.differing_inputs.append(&mut self.echo_differs);
                found.differing_inputs.sort_unstable();
                found.differing_inputs.dedup();
                Ok((found, mine.result))
            }
            Err(e) => match self.realign(plane, &mine, &theirs, &same) {
                Some((found, result)) => Ok((found, Some(result))),
                None => Err(e),
            },
        };
        if !self.confirms() {
            match outcome {
                Ok((found, _)) => self.report.agreement = Some(found),
                Err(e) => self.failed = Some(e),
            }
            return;
        }
        match outcome {
            Ok((found, result)) => self.post_confirm(result, Ok(found), heard),
            // Outvoted for now: the ranks that realign may still take this result.
            Err(e) => self.post_confirm(mine.result, Err(Some(e)), heard),
        }
    }

    /// Whether the cross-check is followed by the confirmation step: under
    /// [`Agreement::Detect`] in gather mode with stragglers allowed, where an input late to
    /// some ranks and not others splits them and the ranks that realign say so
    /// (`PROTOCOL.md`, "Realignment"). Alike on every rank (the spec's).
    pub(super) fn confirms(&self) -> bool {
        self.spec.agreement == Agreement::Detect && self.r == 0 && self.spec.stragglers > 0
    }

    /// The confirmation step: every rank sends every other the digest of the result it
    /// ends with (after realigning; none where its round failed), and waits for those whose
    /// cross-check it heard. `first`: what the cross-check found (`Err(None)`: the round had
    /// failed already).
    fn post_confirm(
        &mut self,
        result: Option<Digest>,
        first: Result<AgreementReport, Option<Error>>,
        heard: Vec<Rank>,
    ) {
        let (me, n) = (self.spec.me, self.spec.n);
        let mut bytes = Vec::with_capacity(CONFIRM_LEN);
        bytes.push(u8::from(result.is_some()));
        bytes.extend_from_slice(&result.unwrap_or([0; 32]));
        let bytes = Bytes::from(bytes);
        let sends = to_every_peer(me, n, &bytes);
        let recvs = heard
            .iter()
            .map(|&peer| RecvOp {
                peer,
                tag: 0,
                len: CONFIRM_LEN,
            })
            .collect();
        self.post(Phase::Confirm { result, first }, "confirm", sends, recvs);
    }

    /// The end of the confirmation step: this rank's result stands where at least `n − f`
    /// ranks (this one included) end with it; otherwise [`Error::Disagreement`].
    pub(super) fn confirmed<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
        result: Option<Digest>,
        first: Result<AgreementReport, Option<Error>>,
    ) {
        let (me, n, f) = (self.spec.me, self.spec.n, self.rule.byzantine());
        let (Some(result), mut found) = (result, first) else {
            return;
        };
        if self.failed.is_some() {
            return;
        }
        let mut agreeing = vec![me];
        let (mut disagreeing, mut unconfirmed) = (Vec::new(), Vec::new());
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            let theirs = match &a {
                Arrival::Received(b) => {
                    let bytes = plane.host(b);
                    (bytes.len() == CONFIRM_LEN && bytes[0] == 1).then(|| bytes[1..].to_vec())
                }
                _ => None,
            };
            match theirs {
                Some(d) if d[..] == result[..] => agreeing.push(op.peer),
                Some(_) => disagreeing.push(op.peer),
                None => unconfirmed.push(op.peer),
            }
        }
        agreeing.sort_unstable();
        let previous = match &mut found {
            Ok(found) => Some(found.clone()),
            Err(Some(Error::Disagreement {
                unconfirmed,
                differing_inputs,
                ..
            })) => Some(AgreementReport {
                unconfirmed: std::mem::take(unconfirmed),
                differing_inputs: std::mem::take(differing_inputs),
                ..AgreementReport::default()
            }),
            Err(_) => None,
        };
        let previous = previous.unwrap_or_default();
        // Silent in either step: unconfirmed.
        unconfirmed.extend(
            (0..n)
                .filter(|p| *p != me && previous.unconfirmed.contains(p) && !agreeing.contains(p)),
        );
        unconfirmed.sort_unstable();
        unconfirmed.dedup();
        unconfirmed.retain(|p| !disagreeing.contains(p));
        if agreeing.len() < n.saturating_sub(f) {
            // The round's last step: failing posts nothing more (`Round::fail` would post a
            // cross-check that no other rank waits for).
            self.failed = Some(Error::Disagreement {
                agreeing,
                disagreeing,
                unconfirmed,
                differing_inputs: previous.differing_inputs,
            });
            return;
        }
        self.report.agreement = Some(AgreementReport {
            disagreeing,
            unconfirmed,
            ..previous
        });
    }

    /// Another result than this rank's that enough of the others hold to take it. Without
    /// the confirmation step, `n − f` of them (then no rank could return another result,
    /// `PROTOCOL.md`, "Realignment"). With it, where the ranks' final results decide: of the
    /// results held by more than `f` ranks (so by an honest one), this rank's among them, the
    /// one made of the fewest inputs (the smaller digest among equals), so that the ranks an
    /// input reached in time leave it out as those it reached late did, and a rank takes
    /// more inputs only where no such result exists.
    fn common_result(
        &self,
        mine: &Check,
        theirs: &[Option<Check>],
        same: &[bool],
    ) -> Option<Digest> {
        let (n, f) = (self.spec.n, self.rule.byzantine());
        let held_by = |d: &Digest| {
            theirs
                .iter()
                .flatten()
                .filter(|c| c.result == Some(*d))
                .count()
        };
        let others = theirs
            .iter()
            .flatten()
            .filter(|c| c.result.is_some() && c.result != mine.result);
        if !self.confirms() {
            return others
                .filter_map(|c| c.result)
                .find(|d| held_by(d) >= n.saturating_sub(f).max(f + 1));
        }
        let inputs = |c: &Check| c.seen.inputs.iter().flatten().count();
        let mine_held =
            1 + same.iter().filter(|&&s| s).count() + mine.result.map_or(0, |d| held_by(&d));
        let own = mine
            .result
            .filter(|_| mine_held > f)
            .map(|d| (inputs(mine), d));
        let best = others
            .filter_map(|c| c.result.map(|d| (inputs(c), d)))
            .filter(|(_, d)| held_by(d) > f)
            .chain(own)
            .min()?;
        (Some(best.1) != mine.result).then_some(best.1)
    }

    /// Where this rank's result is not the one at least `n − f` ranks hold (gather mode,
    /// [`Agreement::Detect`]): if those ranks aggregated a subset of the inputs this rank
    /// holds (each with the digest this rank's copy has), aggregates again over exactly that
    /// subset, and takes the result if its digest is theirs (`PROTOCOL.md`, "Realignment").
    /// The common case: an input that reached this rank just in time and the others late.
    /// `None` (the round keeps its [`Error::Disagreement`]) where no such result or subset
    /// exists, or none of at most `f + 1` subsets gives it.
    fn realign<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        mine: &Check,
        theirs: &[Option<Check>],
        same: &[bool],
    ) -> Option<(AgreementReport, Digest)> {
        let (me, n, f) = (self.spec.me, self.spec.n, self.rule.byzantine());
        if self.kept.is_empty() || self.r != 0 || self.spec.agreement != Agreement::Detect {
            return None;
        }
        let target = self.common_result(mine, theirs, same)?;
        let used: Vec<Rank> = (0..n).filter(|&j| mine.seen.inputs[j].is_some()).collect();
        let mut tried: Vec<&[Option<Digest>]> = Vec::new();
        for c in theirs.iter().flatten().filter(|c| c.result == Some(target)) {
            let list = &c.seen.inputs[..];
            if tried.contains(&list) {
                continue;
            }
            if tried.len() > f {
                break;
            }
            tried.push(list);
            // Every input of theirs is one this rank holds, with the same digest.
            let set: Vec<Rank> = (0..n).filter(|&j| list[j].is_some()).collect();
            let held = |j: Rank| match (list[j], mine.seen.inputs[j]) {
                (Some(a), Some(b)) => a[..16] == b[..16],
                _ => false,
            };
            if set.len() >= used.len() || !set.iter().all(|&j| held(j)) {
                continue;
            }
            let kept = std::mem::take(&mut self.kept);
            let again = self.aggregate_set(plane, &kept, &set);
            self.kept = kept;
            if again.is_ok() && plane.result_digest() == target {
                let realigned: Vec<Rank> =
                    used.iter().copied().filter(|j| !set.contains(j)).collect();
                let now = Check {
                    result: Some(target),
                    seen: Seen {
                        inputs: list.to_vec(),
                        ..mine.seen.clone()
                    },
                };
                // The ranks that sent this rank's first check now hold another result.
                let theirs: Vec<Option<Check>> = (0..n)
                    .map(|p| match same[p] {
                        true => Some(mine.clone()),
                        false => theirs[p].clone(),
                    })
                    .collect();
                // Without the confirmation step, the others' checks must show n − f ranks with
                // this result; with it, the ranks' final results decide.
                let mut found = match check::evaluate(me, n, f, &now, &theirs, &vec![false; n]) {
                    Ok(found) => found,
                    Err(Error::Disagreement {
                        disagreeing,
                        unconfirmed,
                        differing_inputs,
                        ..
                    }) if self.confirms() => AgreementReport {
                        disagreeing,
                        unconfirmed,
                        differing_inputs,
                        ..AgreementReport::default()
                    },
                    Err(_) => return None,
                };
                found.realigned = realigned;
                self.report.erased_self = !set.contains(&me);
                return Some((found, target));
            }
        }
        // The output holds an attempt's result: the round fails, and its output is not read.
        None
    }
}
