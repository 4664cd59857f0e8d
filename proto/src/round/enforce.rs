//! [`Agreement::Enforce`]'s echo of the input (or version) digests and its recovery step.

use super::*;
use crate::{is_probe, LAGGARD_ROUNDS};

impl<'r, B> Round<'r, B> {
    /// The next relay step of the echo ([`eig`]), or the recovery step once none is left.
    /// Ranks this rank has already counted missing, malformed or out of step (or an earlier
    /// sub-round erased) are not waited for (their relays count as "none"). Ranks whose input
    /// was only *late* here (a quorum step's cut) are waited for through a quorum: the step
    /// may end once the others' relays are in and the grace has passed, and the grace waits
    /// for no laggard ([`Carry::laggards`]). Their inputs are often in time at other ranks,
    /// and the echo's majorities need their relays: counting them "none" at once cost a rank
    /// that saw two inputs late among eight ranks (`f = 2`, one rank dead) the decision on
    /// most inputs.
    pub(super) fn post_echo(&mut self) {
        let (me, n) = (self.spec.me, self.spec.n);
        let echo = &self.echo;
        if echo.first().is_none_or(|e| e.relays_left() == 0) {
            return self.post_recovery();
        }
        // One relay per tree, back to back (each tree's relays have a fixed length).
        let (bytes, len) = match &echo[..] {
            [one] => (one.relay(), one.relay_len()),
            trees => {
                let all: Vec<u8> = trees.iter().flat_map(|t| t.relay().to_vec()).collect();
                let len = all.len();
                (Bytes::from(all), len)
            }
        };
        let sends = to_every_peer(me, n, &bytes);
        let recvs = schedule::direct_peers(me, n)
            .filter(|&p| {
                !self.carried.contains(&p) && self.fault_of(p).is_none_or(|f| *f == Fault::Late)
            })
            .map(|peer| RecvOp { peer, tag: 0, len })
            .collect();
        let grace = self.spec.grace;
        self.post_awaiting_late(Phase::Echo, "enforce_echo", sends, recvs, 0, grace);
    }

    pub(super) fn echoed<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let n = self.spec.n;
        let mut kept: Vec<(Rank, B)> = Vec::new();
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            // A relay the step's grace cut (it waited for late peers, `post_echo`) counts
            // "none" and is no fault of its sender: its input is in, and a fault here would
            // feed the sender's fault memory (a laggard is not waited for).
            if !matches!(a, Arrival::Late) {
                self.arrival_fault(op.peer, &a);
            }
            if let Arrival::Received(b) = a {
                kept.push((op.peer, b));
            }
        }
        let hosts: Vec<(Rank, Cow<'_, [u8]>)> =
            kept.iter().map(|(p, b)| (*p, plane.host(b))).collect();
        let lens: Vec<usize> = self.echo.iter().map(eig::Eig::relay_len).collect();
        // relays[t][p]: rank p's relay for tree t.
        let mut relays: Vec<Vec<Option<&[u8]>>> = vec![vec![None; n]; self.echo.len()];
        let mut malformed = Vec::new();
        for (p, bytes) in &hosts {
            let mut parts = Vec::with_capacity(lens.len());
            let mut rest: &[u8] = bytes;
            for &len in &lens {
                if rest.len() < len {
                    break;
                }
                let (part, tail) = rest.split_at(len);
                parts.push(part);
                rest = tail;
            }
            let whole = parts.len() == lens.len() && rest.is_empty();
            if whole && self.echo.iter().zip(&parts).all(|(t, part)| t.valid(part)) {
                for (t, part) in parts.into_iter().enumerate() {
                    relays[t][*p] = Some(part);
                }
            } else {
                malformed.push(*p);
            }
        }
        for (tree, relays) in self.echo.iter_mut().zip(&relays) {
            tree.receive(relays);
        }
        drop(relays);
        drop(hosts);
        for p in malformed {
            self.add_fault(p, Fault::Malformed("not a relay of the echo".into()));
        }
        self.post_echo()
    }

    /// Every slot is now decided alike ([`eig::Eig::decide`]): in gather mode every rank's
    /// input, in sharded mode every owner's result for each of its shards. A rank that went
    /// without the decided message of slot `k·n + j` (sender `j`) waits for it (the slot is
    /// the tag) from the first `f + 1` ranks that said, in the first relay, that they got it
    /// (its *claimants*); at least one of them is honest and holds it. A holder passes it on
    /// to each rank that said it got something else when it is among the first `2f + 1`
    /// claimants as it sees them: the honest ones among a receiver's first `f + 1` always are
    /// (their views differ only in what the `f` Byzantine ranks claimed), so no receiver holds
    /// more than `f + 1` copies.
    ///
    /// Nothing is passed on to a *laggard* late this round ([`Carry::laggards`]): its relays
    /// were not waited for, so it "said" nothing, yet it got every input that reached it
    /// before it even posted the step. Passing each one on anyway cost a 10x slower rank
    /// about seven inputs per round from every fast rank, until their send budgets cut it off
    /// some 70 rounds behind. So a rank that its peers count as a laggard late this round, as
    /// far as it can tell (its own input left out again after [`LAGGARD_ROUNDS`] rounds
    /// behind, [`Carry::own_late`], and not at a probe), waits for nothing to be passed on: an
    /// agreed input it lacks (its sender's message dropped as it fell behind, say) is not
    /// waited for until the step's deadline, so it catches up. Elsewhere a rank
    /// that lacks an input waits for it until its deadline and fails loudly if none comes.
    pub(super) fn post_recovery(&mut self) {
        let (me, n) = (self.spec.me, self.spec.n);
        let f = self.rule.byzantine();
        let own_late = self.own_late;
        let a_laggard_there = |agreed: &[Option<Digest>]| {
            self.spec.shape == Shape::Gather
                && agreed[me].is_none()
                && own_late >= LAGGARD_ROUNDS
                && !is_probe(own_late)
        };
        let late_laggard = |p: Rank| self.laggards.contains(&p) && self.is_late(p);
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        let mut agreed_all = Vec::with_capacity(self.echo.len() * n);
        let mut differs = vec![false; n];
        for (k, echo) in self.echo.iter().enumerate() {
            let agreed = echo.decide();
            let holds = |j: Rank| agreed[j].is_some() && echo.direct(j) == agreed[j];
            // The ranks other than `j` that got `j`'s decided message, as this rank sees them.
            let claimants = |j: Rank| -> Vec<Rank> {
                (0..n)
                    .filter(|&i| i != j)
                    .filter(|&i| {
                        if i == me {
                            holds(j)
                        } else {
                            echo.reported(i, j) == agreed[j]
                        }
                    })
                    .collect()
            };
            if f > 0 {
                for j in (0..n).filter(|&j| j != me && holds(j)) {
                    if !claimants(j).iter().take(2 * f + 1).any(|&i| i == me) {
                        continue;
                    }
                    for peer in
                        schedule::direct_peers(me, n).filter(|&p| p != j && !late_laggard(p))
                    {
                        if echo.reported(peer, j) != agreed[j] {
                            sends.push(Send {
                                peer,
                                tag: (k * n + j) as Tag,
                                msg: Msg::Forward(k * n + j),
                            });
                        }
                    }
                }
                let waits = !a_laggard_there(&agreed);
                for j in (0..n).filter(|&j| waits && j != me && agreed[j].is_some() && !holds(j)) {
                    let len = self.slot_len(k, j);
                    for peer in claimants(j).into_iter().take(f + 1) {
                        recvs.push(RecvOp {
                            peer,
                            tag: (k * n + j) as Tag,
                            len,
                        });
                    }
                }
            }
            for (j, differs) in differs.iter_mut().enumerate() {
                let mut told = std::iter::once(echo.direct(j))
                    .chain(
                        (0..n)
                            .filter(|&p| p != j && p != me)
                            .map(|p| echo.reported(p, j)),
                    )
                    .flatten();
                *differs |= told
                    .next()
                    .is_some_and(|first| told.any(|other| other != first));
            }
            agreed_all.extend(agreed);
        }
        self.echo_differs = (0..n).filter(|&j| differs[j]).collect();
        self.agreed = agreed_all;
        self.post(Phase::Recover, "enforce_recover", sends, recvs);
    }

    /// The length of slot `k·n + j`'s message: a whole input (gather), or owner `j`'s `k`-th
    /// owned shard.
    pub(super) fn slot_len(&self, k: usize, j: Rank) -> usize {
        match self.spec.shape {
            Shape::Gather => self.bytes(self.spec.d),
            _ => self.bytes(self.shard((j + self.spec.n - k) % self.spec.n).len()),
        }
    }

    pub(super) fn recovered<P: Plane<Buf = B>>(
        &mut self,
        plane: &mut P,
        plan: &StepPlan,
        outcomes: Vec<Arrival<B>>,
    ) {
        let (me, n) = (self.spec.me, self.spec.n);
        let echo = std::mem::take(&mut self.echo);
        let agreed = std::mem::take(&mut self.agreed);
        let mut held = std::mem::take(&mut self.held);
        let what = match self.spec.shape {
            Shape::Gather => "input",
            _ => "result",
        };
        for (slot, agreed) in agreed.iter().enumerate() {
            let (k, j) = (slot / n, slot % n);
            if echo[k].direct(j) != *agreed {
                held[slot] = None;
                if agreed.is_some() && j != me {
                    self.warnings.push(format!(
                        "rank {j} sent this rank another {what} than the ranks agreed on; \
                         recovering the agreed one"
                    ));
                }
            }
        }
        for (op, a) in plan.recvs.iter().zip(outcomes) {
            let slot = op.tag as usize;
            if held[slot].is_some() {
                continue;
            }
            if let Arrival::Received(b) = a {
                if Some(plane.commitment(Src::Got(&b))) == agreed[slot] {
                    held[slot] = Some(b);
                } else {
                    self.add_fault(
                        op.peer,
                        Fault::Malformed(format!(
                            "forwarded another {what} as rank {}'s",
                            slot % n
                        )),
                    );
                }
            }
        }
        if self.spec.shape != Shape::Gather {
            return self.combine_agreed(plane, &echo, &agreed, held);
        }
        let echo = &echo[0];
        let mut ranks = Vec::new();
        for j in 0..n {
            let usable = agreed[j].is_some()
                && (held[j].is_some() || (j == me && echo.direct(me) == agreed[me]));
            if usable {
                self.seen.inputs[j] = agreed[j];
                ranks.push(j);
            } else if j != me {
                let why = match agreed[j] {
                    None => "the ranks' echo agreed on no input of it (silent or equivocating)",
                    Some(_) => "its agreed input could not be recovered",
                };
                self.add_fault(j, Fault::Malformed(why.into()));
            } else {
                self.report.erased_self = true;
                self.warnings.push(
                    "the ranks agreed that this rank's own input did not reach them in time; \
                     it is left out, as they left it out"
                        .into(),
                );
            }
        }
        // An input late here that the echo agreed on and this rank then recovered is in the
        // aggregate: no erasure, so not a fault (nor, through the fault memory, a laggard's).
        self.report
            .faults
            .retain(|f| !(f.fault == Fault::Late && ranks.contains(&f.rank)));
        self.aggregate_inputs(plane, &held, ranks);
    }
}
