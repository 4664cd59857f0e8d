//! The cross-check step of [`Agreement::Detect`]: each rank's [`Check`] to every other, and
//! what they say of this rank's result.

use super::*;
use crate::AgreementReport;

/// The confirmation step's message: status (1: a result), then its BLAKE3 digest.
const CONFIRM_LEN: usize = 33;

/// What a check carries after its digests where the recovery step follows
/// ([`Round::confirms`]): `present u8` (1: a commitment), then BLAKE3 of the sender's own
/// input (zeros where absent).
const OWN_LEN: usize = 33;

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
        // Under `Enforce` a peer that was only late is waited for through a quorum
        // ([`Round::post_awaiting_late`]): the echo agreed on its input, and the check may
        // need it among its `n - f`.
        // Under `Detect` with the confirmation, a late peer's check is waited for too, but
        // only the grace's floor past the others' ([`Round::converge`]): a straggler's list
        // may be the one that shows another input late to it, and a rank that did not hear it
        // would take another set; waiting as long again as the others took would double
        // the cross-check of every round in which a rank is late but not yet a laggard.
        // So is a sharded round's with stragglers allowed: its result needs `n - f` ranks
        // agreeing, and a rank whose piece or version was cut by jitter alone must not fail
        // the others' round (a laggard's check is not waited for).
        let quorum_round = self.confirms() || (self.r > 0 && self.spec.stragglers > 0);
        let detect_late = quorum_round && self.failed.is_none();
        let enforce =
            (self.spec.agreement == Agreement::Enforce || detect_late) && self.failed.is_none();
        let erased: Vec<Rank> = self
            .carried
            .iter()
            .copied()
            .chain(
                self.report
                    .faults
                    .iter()
                    .filter(|f| !(enforce && f.fault == Fault::Late))
                    .map(|f| f.rank),
            )
            .chain(failed_faults.iter().map(|f| f.rank))
            .collect();
        let mut encoded = mine.encode_for_all(me);
        let own_len = self.own_len();
        if own_len > 0 {
            let mut tail = vec![u8::from(self.own_commit.is_some())];
            tail.extend_from_slice(&self.own_commit.unwrap_or([0; 32]));
            // Every peer gets the same check in gather mode: one buffer for all of them.
            let mut shared: Option<Bytes> = None;
            for b in encoded.iter_mut().filter(|b| !b.is_empty()) {
                *b = shared
                    .get_or_insert_with(|| [&b[..], &tail[..]].concat().into())
                    .clone();
            }
        }
        let sends = schedule::direct_peers(me, n)
            .map(|peer| Send {
                peer,
                tag: 0,
                msg: Msg::Bytes(encoded[peer].clone()),
            })
            .collect();
        let recvs: Vec<RecvOp> = schedule::direct_peers(me, n)
            .filter(|p| !erased.contains(p))
            .map(|peer| RecvOp {
                peer,
                tag: 0,
                len: Check::len_between(me, peer, n, r) + own_len,
            })
            .collect();
        // A result stands with `n - f` ranks agreeing (this one among them): a check waits
        // for the late peers until it has heard that many, where the others are too few.
        // Under `Detect` with stragglers, past the others' the grace is only its floor (none
        // in sharded mode): the round waited one grace for the late peers' inputs already.
        let needed = match detect_late && self.r == 0 {
            true => 0,
            false => self.others_needed(),
        };
        // A sharded round's check waits for a late peer only where the others in time are
        // fewer than its `n - f - 1`: the late peer's request was waited for already.
        let grace = match (detect_late, self.r) {
            (true, 0) => Grace {
                min: self.spec.grace.min,
                factor: 0,
            },
            (true, _) => Grace {
                min: Duration::ZERO,
                factor: 0,
            },
            (false, _) => self.spec.grace,
        };
        let phase = Phase::Check { mine, encoded };
        // A peer silent after its input (a Byzantine rank, or one stopped between steps)
        // holds the check no longer than a grace past `n - f - 1` others, at least the round
        // so far: a result stands only with `n - f` ranks agreeing (here, or in the
        // confirmation), so a check cut then leaves the ranks apart loudly at worst. Where a
        // peer was late this round, every peer in time is waited for (until the deadline) and
        // the late ones the grace's floor past them: a late peer's check waited for as long
        // as an in-time one's doubles such rounds (a straggler's check comes as late as its
        // input), and one not waited for past the others' fails more of them (simulated:
        // 5 of 300 rounds at 7 ranks with a slow one, against 2).
        // (A rank whose round failed erased the late peers, and waits so too.)
        let late_here = recvs.iter().any(|r| self.is_late(r.peer));
        if quorum_round && !late_here {
            let needed = self.others_needed();
            return self.post_past_quorum(phase, "cross_check", sends, recvs, needed);
        }
        self.post_awaiting_late(phase, "cross_check", sends, recvs, needed, grace);
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
        // By sender, the commitment to its own input its check carried.
        let mut owns: Vec<Option<Digest>> = vec![None; n];
        let own_len = self.own_len();
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            if let Arrival::Received(b) = a {
                heard.push(op.peer);
                let bytes = plane.host(&b);
                // (The transport checked the length: the commitment's is within it.)
                let Some(split) = bytes.len().checked_sub(own_len) else {
                    continue;
                };
                let (body, own) = bytes.split_at(split);
                let mine_body = &encoded[op.peer][..encoded[op.peer].len() - own_len];
                match own {
                    [] | [0, ..] => {}
                    [1, commit @ ..] => owns[op.peer] = commit.try_into().ok(),
                    // Not a check: counted unconfirmed, as one that fails to decode.
                    _ => continue,
                }
                // The common case, a rank that saw what this one saw, costs one comparison.
                if body == mine_body {
                    same[op.peer] = true;
                } else {
                    theirs[op.peer] = Check::decode_from(body, op.peer, me, n, mine.seen.r);
                }
            }
        }
        if self.failed.is_some() {
            if self.confirms() {
                self.post_mend(Mend::failed(heard), Vec::new(), Vec::new());
            }
            return;
        }
        let f = self.rule.byzantine();
        if self.confirms() {
            return self.converge(mine, &theirs, &same, heard, owns);
        }
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
        match outcome {
            Ok((found, _)) => self.report.agreement = Some(found),
            Err(e) => self.failed = Some(e),
        }
    }

    /// With the confirmation step: every rank moves to the aggregate of the *common inputs*
    /// (those the timely ranks it heard all used, [`Round::common_inputs`]) where they are
    /// enough for the rule, and otherwise of the *named inputs* (those at least `f + 1` ranks
    /// it heard used, the sender's own among them, [`named_inputs`]); the inputs of that set it lacks
    /// (late here) are passed on in one more step by the ranks that hold them, and then the
    /// confirmation decides (`PROTOCOL.md`, "Common inputs", "Named inputs"). At least one of
    /// `f + 1` namers is honest and holds the input, so a Byzantine rank can neither bring in
    /// an input nobody honest has nor make a rank wait for one past the grace; ranks that
    /// heard the same checks compute the same set, whichever late inputs reached each of them
    /// in time.
    fn converge(
        &mut self,
        mine: Check,
        theirs: &[Option<Check>],
        same: &[bool],
        heard: Vec<Rank>,
        owns: Vec<Option<Digest>>,
    ) {
        let (me, n, f) = (self.spec.me, self.spec.n, self.rule.byzantine());
        let mut found = match check::evaluate(me, n, f, &mine, theirs, same) {
            Ok(found) => found,
            Err(Error::Disagreement {
                disagreeing,
                unconfirmed,
                differing_inputs,
                ..
            }) => AgreementReport {
                disagreeing,
                unconfirmed,
                differing_inputs,
                ..AgreementReport::default()
            },
            Err(e) => {
                self.failed = Some(e);
                return self.post_mend(Mend::failed(heard), Vec::new(), Vec::new());
            }
        };
        found.differing_inputs.append(&mut self.echo_differs);
        let used: Vec<Rank> = (0..n).filter(|&j| mine.seen.inputs[j].is_some()).collect();
        // Every list heard with a result, this rank's own among them.
        let lists: Vec<(Rank, &[Option<Digest>])> = (0..n)
            .filter_map(|p| match (&theirs[p], same[p] || p == me) {
                (_, true) => Some((p, &mine.seen.inputs[..])),
                (Some(c), false) if c.result.is_some() => Some((p, &c.seen.inputs[..])),
                _ => None,
            })
            .collect();
        // The common inputs where they are enough for the rule, the named inputs otherwise.
        let common = self.common_inputs(&lists);
        let named = match self.rule.check(common.iter().flatten().count()) {
            Ok(()) => common,
            Err(_) => named_inputs(n, f, &lists, &mut found.differing_inputs),
        };
        found.differing_inputs.sort_unstable();
        found.differing_inputs.dedup();
        let set: Vec<Rank> = (0..n).filter(|&j| named[j].is_some()).collect();
        let (mut sends, mut recvs) = (Vec::new(), Vec::new());
        let mut needed = 0;
        // A plane that keeps no copy of the inputs can neither pass one on nor aggregate
        // again: it keeps its result, and the confirmation decides.
        if !self.kept.is_empty() {
            let len = self.bytes(self.spec.d);
            let list_of: Vec<Option<&[Option<Digest>]>> = (0..n)
                .map(|p| lists.iter().find(|(q, _)| *q == p).map(|&(_, l)| l))
                .collect();
            // The ranks that pass `j`'s input on to `r`: the first `2f + 1` of those whose
            // list names `j` with the set's digest, whose list names `r`'s input, and whose
            // input `r`'s list names. Those got `r`'s input in time, so they waited for its
            // check (a grace past the others', [`Round::post_past_quorum`]) and, unless they
            // cut it, know that it lacks `j` (one that cut it sends nothing, and the recovery
            // step's bound and the confirmation decide); and `r` had theirs, so it
            // heard their checks: a passer places itself no later among them than `r` does,
            // whichever checks of ranks late to one of them the other heard.
            let namers: Vec<Vec<Rank>> = (0..n)
                .map(|j| {
                    lists
                        .iter()
                        .filter(|(p, l)| *p != j && same_input(l[j], named[j]))
                        .map(|&(p, _)| p)
                        .collect()
                })
                .collect();
            let passers = |j: Rank, r: Rank| -> Vec<Rank> {
                namers[j]
                    .iter()
                    .copied()
                    .filter(|&p| {
                        list_of[p].is_some_and(|l| l[r].is_some())
                            && list_of[r].is_some_and(|l| l[p].is_some())
                    })
                    .take(2 * f + 1)
                    .collect()
            };
            // Its own input, to every rank heard without it whose input it had (where that
            // rank heard this rank's check it waits for this copy through the grace; where
            // it did not, the copy is stale there and dropped).
            if named[me].is_some() {
                for &(peer, l) in &lists {
                    let had = mine.seen.inputs[peer].is_some();
                    if peer != me && had && !same_input(l[me], named[me]) {
                        sends.push(Send {
                            peer,
                            tag: me as Tag,
                            msg: Msg::Input,
                        });
                    }
                }
            }
            for &j in set.iter().filter(|&&j| j != me) {
                if !same_input(mine.seen.inputs[j], named[j]) {
                    // It takes the bytes `f + 1` passers sent alike, or else the copy its
                    // sender sent (a Byzantine sender's own copy is still one Byzantine
                    // input), or else a passer's copy with the commitment (BLAKE3) the
                    // sender's check carried here: the vector the sender committed to here,
                    // as its own copy would be. With `f` or fewer passers (all could be
                    // Byzantine) and no commitment it waits for none of them; with one,
                    // for theirs through the grace only. A copy of its own with another
                    // digest than the set's is not this input.
                    self.kept[j] = None;
                    let mut from = passers(j, me);
                    if from.len() > f {
                        needed += f + 1;
                    } else if owns[j].is_none() {
                        from.clear();
                    }
                    // Its sender too, where its list names this rank (it had this rank's
                    // input, so it heard this rank's check and passes its own input on):
                    // waited for through the grace only, so that a Byzantine sender that
                    // names this rank and sends nothing holds the step no longer.
                    if list_of[j].is_some_and(|l| l[me].is_some()) {
                        from.push(j);
                    }
                    recvs.extend(from.into_iter().map(|peer| RecvOp {
                        peer,
                        tag: j as Tag,
                        len,
                    }));
                    continue;
                }
                // Every rank heard without it (or with another copy), but the sender.
                for &(peer, l) in &lists {
                    let lacks = !same_input(l[j], named[j]);
                    if peer != me && peer != j && lacks && passers(j, peer).contains(&me) {
                        sends.push(Send {
                            peer,
                            tag: j as Tag,
                            msg: Msg::Forward(j),
                        });
                    }
                }
            }
        }
        let mend = Mend {
            result: mine.result,
            found,
            heard,
            used,
            named,
            owns,
            needed,
        };
        self.post_mend(mend, sends, recvs);
    }

    /// The recovery step of [`Round::converge`]: `sends` pass inputs on, and `recvs` (from
    /// up to `2f + 1` passers of each input this rank lacks, where it has more than `f` or its
    /// sender's commitment, and from its sender where that named this rank) end once `f + 1`
    /// passers' copies of each (in number, over the inputs with more than `f` passers) have
    /// come and the grace has passed, or all have come.
    /// Every rank posts it, empty where it has nothing to pass on or recover, so that steps
    /// stay numbered alike.
    ///
    /// Its wait follows the round so far, where the driver measures it ([`Round::took`]):
    /// its grace is at least [`Grace::after`] of the round's time until now (the time itself
    /// with the default factor of 1), and it ends at the latest that long again plus one
    /// grace of it after its post, within the step timeout. Passers that heard other checks
    /// than this rank may have moved to another set and pass nothing on, and this rank
    /// cannot tell; without the bound it would wait for their copies until the deadline.
    /// What has not come by then is not recovered, and the confirmation decides.
    fn post_mend(&mut self, mend: Mend, sends: Vec<Send>, recvs: Vec<RecvOp>) {
        if recvs.is_empty() {
            return self.post(Phase::Mend(Box::new(mend)), "mend", sends, recvs);
        }
        // A copy leaves when its passer ends its cross-check, which can be as late as this
        // rank's round so far: the grace is at least that long, before the quorum (a sender's
        // own copy, a lone passer's) and after it.
        let grace = match self.elapsed {
            Some(elapsed) => Grace {
                min: self.spec.grace.after(elapsed),
                factor: self.spec.grace.factor,
            },
            None => self.spec.grace,
        };
        let quorum = Quorum {
            receives: mend.needed,
            grace,
            awaited: recvs.len(),
            core: 0,
        };
        let phase = Phase::Mend(Box::new(mend));
        self.post_quorum(phase, "mend", sends, recvs, Some(quorum));
        self.bound_by_the_round_so_far();
    }

    /// The end of the recovery step: of the copies passed on, this rank takes for each input
    /// the bytes that `f + 1` passers sent alike, with the set's digest (so no `f` ranks can
    /// pass on another input, even one with that XXH3 digest), or else its sender's own copy
    /// with that digest, or else a passer's copy with the commitment the sender's check
    /// carried here; where it then holds every input of the set and the set is not the one
    /// it used, it aggregates again over exactly them.
    pub(super) fn mended<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
        mend: Mend,
    ) {
        let Mend {
            result,
            mut found,
            heard,
            used,
            named,
            owns,
            ..
        } = mend;
        let (me, n, f) = (self.spec.me, self.spec.n, self.rule.byzantine());
        if self.failed.is_some() {
            return self.post_confirm(None, AgreementReport::default(), heard);
        }
        // By input, the copies with the set's digest, and who sent each.
        let mut copies: Vec<Vec<(Rank, B)>> = (0..n).map(|_| Vec::new()).collect();
        let mut forgers = Vec::new();
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            let j = op.tag as usize;
            let Arrival::Received(b) = a else { continue };
            let digest = plane.digest(Src::Got(&b));
            if same_input(named[j], Some(digest)) {
                copies[j].push((op.peer, b));
            } else {
                forgers.push((op.peer, j));
            }
        }
        let mut recovered = Vec::new();
        for (j, copies) in copies.into_iter().enumerate() {
            if copies.is_empty() {
                continue;
            }
            // The passers' copies (all but the sender's own).
            let passed = |i: usize| copies[i].0 != j;
            let (by_passers, differing) = {
                let hosts: Vec<Cow<'_, [u8]>> = copies.iter().map(|(_, b)| plane.host(b)).collect();
                let alike = |i: usize| {
                    (0..hosts.len())
                        .filter(|&k| passed(k) && hosts[k][..] == hosts[i][..])
                        .count()
                };
                let taken = (0..hosts.len()).find(|&i| passed(i) && alike(i) > f);
                let differing: Vec<usize> = match taken {
                    Some(t) => (0..hosts.len())
                        .filter(|&i| hosts[i][..] != hosts[t][..])
                        .collect(),
                    None => Vec::new(),
                };
                (taken, differing)
            };
            let commit = owns.get(j).copied().flatten();
            let committed = |i: usize, plane: &mut P| {
                commit.is_some_and(|c| plane.commitment(Src::Got(&copies[i].1)) == c)
            };
            // Against `f + 1` passers alike, another copy is its sender's fault, unless it is
            // the vector the input's sender committed to here (then the sender sent the ranks
            // two vectors, and this copy's sender passed on the one it got); against one copy
            // alone it is not known whose, so no one is named.
            forgers.extend(
                differing
                    .into_iter()
                    .filter(|&i| !committed(i, plane))
                    .map(|i| (copies[i].0, j)),
            );
            // Failing those, the copy (its sender's own, or a passer's) with the commitment
            // the sender's check carried here: the vector the sender committed to here, so no
            // passer can bring in another; failing that, its sender's own copy.
            let Some(taken) = by_passers
                .or_else(|| (0..copies.len()).find(|&i| committed(i, plane)))
                .or_else(|| (0..copies.len()).find(|&i| !passed(i)))
            else {
                continue;
            };
            let (_, b) = copies.into_iter().nth(taken).expect("a copy taken");
            self.seen.inputs[j] = named[j];
            self.kept[j] = Some(b);
            recovered.push(j);
        }
        let set: Vec<Rank> = (0..n).filter(|&j| named[j].is_some()).collect();
        let holds = |j: &Rank| *j == me || self.kept.get(*j).is_some_and(Option::is_some);
        // Where it cannot aggregate them (an input not passed on, too few for the rule, a
        // plane that keeps no inputs), it keeps its result and the confirmation decides.
        let again = set != used && set.iter().all(holds) && self.rule.check(set.len()).is_ok();
        if again {
            let kept = std::mem::take(&mut self.kept);
            let aggregated = self.aggregate_set(plane, &kept, &set);
            self.kept = kept;
            if let Err(e) = aggregated {
                self.failed = Some(e);
                return self.post_confirm(None, AgreementReport::default(), heard);
            }
            found.realigned = used.iter().copied().filter(|j| !set.contains(j)).collect();
            // An input late here that this rank then recovered is in the aggregate: no
            // erasure, so not a fault (nor, through the fault memory, a laggard's).
            self.report
                .faults
                .retain(|f| !(f.fault == Fault::Late && recovered.contains(&f.rank)));
            found.recovered = recovered;
            self.report.erased_self = !set.contains(&me);
        }
        for (p, j) in forgers {
            self.add_fault(
                p,
                Fault::Malformed(format!("passed on another input as rank {j}'s")),
            );
        }
        let result = match again {
            true => Some(plane.result_digest()),
            false => result,
        };
        self.post_confirm(result, found, heard)
    }

    /// By sender, the digest of its input where it is *common*: named, with one digest, by
    /// the list of every *timely* rank among `lists` (those heard with a result, this rank's
    /// own among them), a timely rank being one whose own input every list names. A rank
    /// whose input was late for some rank is a straggler, and its view (which may miss
    /// another straggler's input) counts for none of the ranks that heard it, as for those
    /// that erased it and never did; that holds for this rank's own list too, so that a
    /// straggler computes the set the others do, and may lack some of it (it recovers them,
    /// [`Round::converge`]). A list naming fewer than this rank's inputs less `s` is left out:
    /// no honest rank's quorum misses more than `s` of the inputs another's got (a Byzantine
    /// rank cannot erase every input by claiming it got none).
    fn common_inputs(&self, lists: &[(Rank, &[Option<Digest>])]) -> Vec<Option<Digest>> {
        let (me, n) = (self.spec.me, self.spec.n);
        let count = |l: &[Option<Digest>]| l.iter().flatten().count();
        let own = lists
            .iter()
            .find(|(p, _)| *p == me)
            .map_or(0, |(_, l)| count(l));
        let floor = own.saturating_sub(self.spec.stragglers);
        let lists: Vec<(Rank, &[Option<Digest>])> = lists
            .iter()
            .copied()
            .filter(|(p, l)| *p == me || count(l) >= floor)
            .collect();
        let named_by = |lists: &[(Rank, &[Option<Digest>])]| -> Vec<Option<Digest>> {
            (0..n)
                .map(|j| {
                    let first = lists.first()?.1[j]?;
                    lists
                        .iter()
                        .all(|(_, l)| same_input(l[j], Some(first)))
                        .then_some(first)
                })
                .collect()
        };
        let everyone = named_by(&lists);
        let timely: Vec<(Rank, &[Option<Digest>])> = lists
            .into_iter()
            .filter(|(p, _)| everyone[*p].is_some())
            .collect();
        named_by(&timely)
    }

    /// How many bytes a check carries after its digests: [`OWN_LEN`] where the recovery step
    /// follows, none otherwise. Alike on every rank (the spec's).
    fn own_len(&self) -> usize {
        if self.confirms() {
            OWN_LEN
        } else {
            0
        }
    }

    /// Whether the cross-check is followed by the recovery and confirmation steps: under
    /// [`Agreement::Detect`] in gather mode with stragglers allowed, where an input late to
    /// some ranks and not others splits them until they move to one set of inputs
    /// (`PROTOCOL.md`, "Common inputs"). Alike on every rank (the spec's).
    pub(super) fn confirms(&self) -> bool {
        self.spec.agreement == Agreement::Detect && self.r == 0 && self.spec.stragglers > 0
    }

    /// The confirmation step, after the recovery step: every rank sends every other the
    /// digest of the result it ends with (after moving to the round's set of inputs; none
    /// where its round failed), and waits for those whose cross-check it heard. `found`: what
    /// the cross-check found.
    fn post_confirm(&mut self, result: Option<Digest>, found: AgreementReport, heard: Vec<Rank>) {
        let (me, n) = (self.spec.me, self.spec.n);
        let mut bytes = Vec::with_capacity(CONFIRM_LEN);
        bytes.push(u8::from(result.is_some()));
        bytes.extend_from_slice(&result.unwrap_or([0; 32]));
        let bytes = Bytes::from(bytes);
        let sends = to_every_peer(me, n, &bytes);
        let recvs: Vec<RecvOp> = heard
            .iter()
            .map(|&peer| RecvOp {
                peer,
                tag: 0,
                len: CONFIRM_LEN,
            })
            .collect();
        let phase = Phase::Confirm { result, found };
        // A rank whose check came and whose confirmation does not (a Byzantine one, or one
        // stopped between steps) holds the step no longer than a grace past `n - f - 1`
        // others' confirmations.
        let needed = self.others_needed();
        self.post_past_quorum(phase, "confirm", sends, recvs, needed);
    }

    /// The end of the confirmation step: this rank's result stands where at least `n − f`
    /// ranks (this one included) end with it; otherwise [`Error::Disagreement`].
    pub(super) fn confirmed<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
        result: Option<Digest>,
        previous: AgreementReport,
    ) {
        let (me, n, f) = (self.spec.me, self.spec.n, self.rule.byzantine());
        let Some(result) = result else {
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

    /// Another result than this rank's that at least `n − f` of the others hold (then no
    /// rank could return another result, `PROTOCOL.md`, "Realignment").
    fn common_result(&self, mine: &Check, theirs: &[Option<Check>]) -> Option<Digest> {
        let (n, f) = (self.spec.n, self.rule.byzantine());
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
            .filter(|d| Some(*d) != mine.result)
            .find(|d| held_by(d) >= n.saturating_sub(f).max(f + 1))
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
            if set.len() >= used.len()
                || !set
                    .iter()
                    .all(|&j| same_input(list[j], mine.seen.inputs[j]))
            {
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
                // The others' checks must show n − f ranks with this result.
                let Ok(mut found) = check::evaluate(me, n, f, &now, &theirs, &vec![false; n])
                else {
                    return None;
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

/// What the recovery step after the cross-check carries to its end ([`Round::mended`]).
pub(super) struct Mend {
    /// This rank's result before the step (none where the round failed).
    result: Option<Digest>,
    /// What the cross-check found.
    found: AgreementReport,
    /// The ranks whose check this rank heard (the confirmation waits for them).
    heard: Vec<Rank>,
    /// The inputs this rank aggregated.
    used: Vec<Rank>,
    /// By sender, the digest of its input where it is in the round's set (common or named).
    named: Vec<Option<Digest>>,
    /// By sender, the commitment to its own input (BLAKE3) its check carried here.
    owns: Vec<Option<Digest>>,
    /// How many copies the step's quorum needs: `f + 1` for each input this rank waits for
    /// from more than `f` passers (a sender's own copy, and the copies of `f` or fewer
    /// passers checked against the sender's commitment, are waited for through the grace
    /// only).
    needed: usize,
}

impl Mend {
    /// The step of a rank whose round failed: it passes nothing on and recovers nothing.
    fn failed(heard: Vec<Rank>) -> Mend {
        Mend {
            result: None,
            found: AgreementReport::default(),
            heard,
            used: Vec::new(),
            named: Vec::new(),
            owns: Vec::new(),
            needed: 0,
        }
    }
}

/// By sender `j`, the digest of its input where at least `f + 1` of `lists` name it (`j`'s
/// own among them), all with that digest (XXH3-128, the digests' first 16 bytes); a sender
/// named with two digests is named by none, and added to `differing`. Of `f + 1` namers at
/// most `f` are Byzantine, `j` among them if it is: the input exists, and where `j` is
/// Byzantine an honest rank other than `j` holds it.
fn named_inputs(
    n: usize,
    f: usize,
    lists: &[(Rank, &[Option<Digest>])],
    differing: &mut Vec<Rank>,
) -> Vec<Option<Digest>> {
    (0..n)
        .map(|j| {
            let mut names = lists.iter().filter_map(|(_, l)| l[j]);
            let first = names.next()?;
            let mut count = 1;
            for d in names {
                if !same_input(Some(d), Some(first)) {
                    differing.push(j);
                    return None;
                }
                count += 1;
            }
            (count > f).then_some(first)
        })
        .collect()
}
