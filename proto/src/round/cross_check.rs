//! The cross-check step of [`Agreement::Detect`]: each rank's [`Check`] to every other, and
//! what they say of this rank's result.

use super::*;
use crate::AgreementReport;

/// The confirmation step's message: status (1: a result), then its BLAKE3 digest.
const CONFIRM_LEN: usize = 33;

/// The tag of rank `j`'s input passed on in the confirmation step (0 is the confirmation).
fn input_tag(j: Rank) -> Tag {
    Tag::try_from(j + 1).unwrap_or(Tag::MAX)
}

/// What a rank that went without some of the inputs of the common result waits for in the
/// confirmation step (`PROTOCOL.md`, "Realignment").
#[derive(Debug)]
pub(super) struct Fetch {
    /// The common result's digest.
    target: Digest,
    /// The rank that passes the inputs on: the first after this one that holds the result.
    server: Rank,
    /// The server's inputs, ascending: what the result is made of.
    set: Vec<Rank>,
    /// Those this rank went without.
    missing: Vec<Rank>,
    /// Those this rank used and the server did not.
    left_out: Vec<Rank>,
}

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
                self.post_confirm(None, Err(None), heard, None, Vec::new());
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
            Ok((found, result)) => {
                // A rank whose result the cross-check confirmed passes the inputs it used on
                // to the ranks that went without them (where it is their server).
                let serve = match found.realigned.is_empty() {
                    true => self.to_serve(&mine, &theirs, &same),
                    false => Vec::new(),
                };
                self.post_confirm(result, Ok(found), heard, None, serve)
            }
            Err(e) => match self.fetch_plan(&mine, &theirs) {
                // It will make their result with the inputs its server passes on.
                Some(fetch) => {
                    let target = fetch.target;
                    self.post_confirm(Some(target), Err(Some(e)), heard, Some(fetch), Vec::new())
                }
                // Outvoted for now: the ranks that realign may still take this result.
                None => self.post_confirm(mine.result, Err(Some(e)), heard, None, Vec::new()),
            },
        }
    }

    /// The rank that passes rank `p` the inputs it went without, as `holds` says which ranks
    /// hold the common result: the first such rank after `p`, cyclically.
    fn server_of(p: Rank, n: usize, holds: impl Fn(Rank) -> bool) -> Option<Rank> {
        (1..n).map(|k| (p + k) % n).find(|&k| holds(k))
    }

    /// The ranks this rank serves in the confirmation step, with the inputs each went without:
    /// those whose cross-check shows another result (or none) and an input list that lacks
    /// some of this rank's inputs and agrees on the rest, and whose server this rank is.
    fn to_serve(
        &self,
        mine: &Check,
        theirs: &[Option<Check>],
        same: &[bool],
    ) -> Vec<(Rank, Vec<Rank>)> {
        let (me, n) = (self.spec.me, self.spec.n);
        if self.kept.is_empty() {
            return Vec::new();
        }
        let holds = |k: Rank| {
            k == me || same[k] || theirs[k].as_ref().is_some_and(|c| c.result == mine.result)
        };
        let mut serve = Vec::new();
        for (p, c) in theirs.iter().enumerate() {
            let Some(c) = c.as_ref().filter(|c| c.result != mine.result) else {
                continue;
            };
            let agree = (0..n).all(|j| match (mine.seen.inputs[j], c.seen.inputs[j]) {
                (Some(a), Some(b)) => a[..16] == b[..16],
                _ => true,
            });
            let lacks: Vec<Rank> = (0..n)
                .filter(|&j| mine.seen.inputs[j].is_some() && c.seen.inputs[j].is_none())
                .filter(|&j| j == me || self.kept.get(j).is_some_and(Option::is_some))
                .collect();
            if agree && !lacks.is_empty() && Self::server_of(p, n, holds) == Some(me) {
                serve.push((p, lacks));
            }
        }
        serve
    }

    /// Where this rank cannot make the common result from what it holds because it went
    /// without some of its inputs: the result, its server (the first rank after this one
    /// that holds it) and the server's input list, if every input of that list this rank
    /// holds has the server's digest and the rule takes that many inputs.
    fn fetch_plan(&self, mine: &Check, theirs: &[Option<Check>]) -> Option<Fetch> {
        let (me, n) = (self.spec.me, self.spec.n);
        if self.kept.is_empty() {
            return None;
        }
        let target = self.common_result(mine, theirs)?;
        let server = Self::server_of(me, n, |k| {
            theirs[k].as_ref().is_some_and(|c| c.result == Some(target))
        })?;
        let list = theirs[server].as_ref()?.seen.inputs.clone();
        let set: Vec<Rank> = (0..n).filter(|&j| list[j].is_some()).collect();
        let mut missing = Vec::new();
        for &j in &set {
            match mine.seen.inputs[j] {
                Some(d) if d[..16] == list[j]?[..16] => {}
                Some(_) => return None,
                None => missing.push(j),
            }
        }
        if missing.is_empty() || self.rule.check(set.len()).is_err() {
            return None;
        }
        let used = (0..n).filter(|&j| mine.seen.inputs[j].is_some());
        let left_out = used.filter(|j| !set.contains(j)).collect();
        Some(Fetch {
            target,
            server,
            set,
            missing,
            left_out,
        })
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
    /// `fetch`: the inputs this rank waits for from its server; `serve`: the inputs it passes
    /// on, by rank (tag `1 + j` for rank `j`'s input).
    fn post_confirm(
        &mut self,
        result: Option<Digest>,
        first: Result<AgreementReport, Option<Error>>,
        heard: Vec<Rank>,
        fetch: Option<Fetch>,
        serve: Vec<(Rank, Vec<Rank>)>,
    ) {
        let (me, n) = (self.spec.me, self.spec.n);
        let mut bytes = Vec::with_capacity(CONFIRM_LEN);
        bytes.push(u8::from(result.is_some()));
        bytes.extend_from_slice(&result.unwrap_or([0; 32]));
        let bytes = Bytes::from(bytes);
        let mut sends: Vec<Send> = schedule::direct_peers(me, n)
            .map(|peer| Send {
                peer,
                tag: 0,
                msg: Msg::Bytes(bytes.clone()),
            })
            .collect();
        for (peer, lacks) in serve {
            sends.extend(lacks.into_iter().map(|j| Send {
                peer,
                tag: input_tag(j),
                msg: if j == me { Msg::Input } else { Msg::Forward(j) },
            }));
        }
        let mut recvs: Vec<RecvOp> = heard
            .iter()
            .map(|&peer| RecvOp {
                peer,
                tag: 0,
                len: CONFIRM_LEN,
            })
            .collect();
        if let Some(fetch) = &fetch {
            let len = self.bytes(self.spec.d);
            recvs.extend(fetch.missing.iter().map(|&j| RecvOp {
                peer: fetch.server,
                tag: input_tag(j),
                len,
            }));
        }
        let phase = Phase::Confirm {
            result,
            first,
            fetch,
        };
        self.post(phase, "confirm", sends, recvs);
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
        fetch: Option<Fetch>,
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
        let mut passed_on = Vec::new();
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            if op.tag != 0 {
                passed_on.push((op.tag, a));
                continue;
            }
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
        if let Some(fetch) = fetch {
            match self.fetched(plane, &fetch, passed_on) {
                Some(fetched) => found = Ok(fetched),
                // Its server did not pass on what makes the result it said it would take.
                None => {
                    return self.fail(Error::Disagreement {
                        agreeing: vec![me],
                        disagreeing: (0..n).filter(|&p| p != me).collect(),
                        unconfirmed: Vec::new(),
                        differing_inputs: Vec::new(),
                    })
                }
            }
        }
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
            return self.fail(Error::Disagreement {
                agreeing,
                disagreeing,
                unconfirmed,
                differing_inputs: previous.differing_inputs,
            });
        }
        self.report.agreement = Some(AgreementReport {
            disagreeing,
            unconfirmed,
            ..previous
        });
    }

    /// The inputs passed on by the server (`passed_on`: tag and arrival) into the inputs
    /// this rank holds, and the rule over the server's input set: the report's findings where
    /// every one arrived and the result's digest is the one it said it would take.
    fn fetched<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        fetch: &Fetch,
        passed_on: Vec<(Tag, Arrival<B>)>,
    ) -> Option<AgreementReport> {
        for (tag, a) in passed_on {
            let j = (tag as usize).checked_sub(1)?;
            match a {
                Arrival::Received(b) if fetch.missing.contains(&j) => self.kept[j] = Some(b),
                _ => return None,
            }
        }
        let kept = std::mem::take(&mut self.kept);
        let again = self.aggregate_set(plane, &kept, &fetch.set);
        self.kept = kept;
        if again.is_err() || plane.result_digest() != fetch.target {
            return None;
        }
        self.report.erased_self = !fetch.set.contains(&self.spec.me);
        Some(AgreementReport {
            realigned: fetch.left_out.clone(),
            passed_on: fetch.missing.clone(),
            ..AgreementReport::default()
        })
    }

    /// Another result than this rank's that enough of the others hold to take it: at least
    /// `f + 1` (so an honest rank holds it), and `n − f` without the confirmation step, where
    /// no rank could return another (`n − f − 1` with it, where the ranks' final results
    /// decide). At most one result can be (`n > 2f`).
    fn common_result(&self, mine: &Check, theirs: &[Option<Check>]) -> Option<Digest> {
        let (n, f) = (self.spec.n, self.rule.byzantine());
        let enough = match self.confirms() {
            true => n.saturating_sub(f + 1).max(f + 1),
            false => n.saturating_sub(f).max(f + 1),
        };
        let held_by = |d: &Digest| {
            theirs
                .iter()
                .flatten()
                .filter(|c| c.result == Some(*d))
                .count()
        };
        theirs
            .iter()
            .flatten()
            .filter_map(|c| c.result)
            .find(|d| Some(*d) != mine.result && held_by(d) >= enough)
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
        let target = self.common_result(mine, theirs)?;
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
