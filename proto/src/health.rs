//! Fault memory: what this rank has seen of each peer in its recent robust rounds. The host
//! communicator keeps one (`Communicator::health`), and so does each rank the simulator runs,
//! so that both wait for laggards alike.
//!
//! Only this rank's own observations go in (a peer's lateness, silence or malformed messages
//! as they reached this rank, and the cross-check's verdict of which results differ from the
//! job's): nothing a peer says about a third rank, so that no Byzantine rank can get an honest
//! one marked unhealthy by lying about it. It is evidence for the application and for the
//! communicator's own choices, never an accusation acted on by itself.

use std::collections::BTreeMap;

use crate::{Fault, InputEvidence, PeerFault, Rank, Result, RoundReport, OUTLYING_SCORE};

/// What this rank has seen of one peer (`Communicator::health`).
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct PeerHealth {
    /// The peer.
    pub rank: Rank,
    /// What it did in the last robust round in which it was at fault, and how many rounds in
    /// a row it has done so up to the last one (`None`: fine in the last round; a peer that
    /// catches up is healthy again at once).
    pub streak: Option<(Symptom, u32)>,
    /// Rounds in which it was late, since the communicator was made.
    pub late: u64,
    /// Rounds in which it was missing at a deadline or its connection was gone.
    pub missing: u64,
    /// Rounds in which it sent something unacceptable.
    pub malformed: u64,
    /// Rounds in which the cross-check found its result differing from the job's.
    pub disagreeing: u64,
    /// Rounds in which its input was outlying: its [`InputEvidence::score`] above
    /// [`OUTLYING_SCORE`] in this rank's [`RoundReport::attribution`]. Evidence of who to look
    /// at (an honest rank with unusual data is outlying too), not a fault: it never changes
    /// [`PeerHealth::streak`].
    pub outlying: u64,
    /// A running [`InputEvidence::score`] of its input: each measured round moves it a
    /// quarter of the way to that round's score (`None` until a round measured it).
    pub score: Option<f64>,
    /// Selection rules: rounds in which the rule left its input out (Krum, Multi-Krum, Bulyan).
    pub not_selected: u64,
    /// Audited rounds in which it was proven to have lied as a shard owner
    /// ([`AuditReport::convicted`](crate::audit::AuditReport): a proof every honest rank checks
    /// alike, not an observation). `Communicator::shrink` leaves a convicted peer out.
    pub convicted: u64,
}

/// How a peer was at fault in a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Symptom {
    /// Its input came after the quorum's grace ([`Fault::Late`]).
    Late,
    /// Nothing came by the deadline, or its connection is gone ([`Fault::Missing`]).
    Missing,
    /// Something unacceptable came ([`Fault::Malformed`]), or a message of another call
    /// ([`Fault::OutOfStep`]).
    Malformed,
    /// Its result differed from the job's (`AgreementReport::disagreeing`).
    Disagreeing,
}

impl PeerHealth {
    /// Whether the peer was fine in the last round.
    pub fn is_healthy(&self) -> bool {
        self.streak.is_none()
    }
}

/// How many robust rounds in a row a peer must have been late to be a *laggard*: a quorum
/// step waits for its input only up to the quorum, not through the grace
/// ([`Carry::laggards`](crate::round::Carry::laggards)), so a rank that is always
/// late does not cost every round a grace. One round in time makes it a peer like any other.
pub const LAGGARD_ROUNDS: u32 = 2;

/// A laggard is probed after this many rounds of its streak, then after twice as many, and so
/// on up to every [`LAGGARD_PROBE_MAX`] rounds ([`is_probe`]): the probe round waits for it
/// through the grace again, so a rank that was merely the last to arrive (the farthest one, or
/// one back from a stall, whose input comes a moment after the others') is taken again once it
/// arrives within the grace, rather than left out for as long as it stays the last. A rank that
/// is really slow costs a grace at each probe: rarely, once its streak is long.
pub const LAGGARD_PROBE: u32 = 4;

/// The longest gap between two probes of a laggard ([`LAGGARD_PROBE`]).
pub const LAGGARD_PROBE_MAX: u32 = 32;

/// Whether a laggard late in each of its last `streak` rounds is probed in the next one:
/// `streak` is [`LAGGARD_PROBE`] times a power of two, or a multiple of [`LAGGARD_PROBE_MAX`].
pub fn is_probe(streak: u32) -> bool {
    streak.is_multiple_of(LAGGARD_PROBE_MAX)
        || (streak >= LAGGARD_PROBE
            && streak.is_multiple_of(LAGGARD_PROBE)
            && (streak / LAGGARD_PROBE).is_power_of_two())
}

/// The health of every peer of a communicator, as one rank saw it. Only the peers ever at
/// fault or measured are held (a simulated job of thousands of ranks keeps one per rank); the
/// others are healthy with nothing counted.
#[derive(Debug, Clone)]
pub struct Health {
    size: usize,
    peers: BTreeMap<Rank, PeerHealth>,
    /// [`Health::own_late`].
    own_late: u32,
}

impl Health {
    /// Every one of `size` ranks healthy.
    pub fn new(size: usize) -> Self {
        Health {
            size,
            peers: BTreeMap::new(),
            own_late: 0,
        }
    }

    /// Every peer but `me`, in rank order.
    pub fn of_peers(&self, me: Rank) -> Vec<PeerHealth> {
        (0..self.size)
            .filter(|&r| r != me)
            .map(|rank| {
                self.peers.get(&rank).cloned().unwrap_or(PeerHealth {
                    rank,
                    ..PeerHealth::default()
                })
            })
            .collect()
    }

    /// The peers late in each of the last [`LAGGARD_ROUNDS`] robust rounds or more, but for
    /// those due a probe ([`is_probe`]).
    pub fn laggards(&self) -> Vec<Rank> {
        let laggard = |k: u32| k >= LAGGARD_ROUNDS && !is_probe(k);
        self.peers
            .values()
            .filter(|p| matches!(p.streak, Some((Symptom::Late, k)) if laggard(k)))
            .map(|p| p.rank)
            .collect()
    }

    /// What this rank has seen of `members` (ranks here, in their order in a communicator made
    /// of them: a split or a shrink), renumbered as there: a peer's streak and counts carry
    /// over, so that a laggard kept by a shrink is still one, rather than waited for through
    /// the grace again as a peer never seen.
    pub fn of_members(&self, members: &[Rank]) -> Health {
        let old: Vec<Option<Rank>> = members.iter().copied().map(Some).collect();
        self.renumbered(&old)
    }

    /// What this rank has seen of the ranks of another communicator, renumbered: `old[new]`
    /// is rank `new`'s rank here, `None` for a rank this communicator does not have (one
    /// admitted after a restart, `byzcoll::admit`, starts healthy with nothing counted).
    pub fn renumbered(&self, old: &[Option<Rank>]) -> Health {
        let peers = old
            .iter()
            .enumerate()
            .filter_map(|(new, old)| {
                let p = self.peers.get(old.as_ref()?)?;
                Some((
                    new,
                    PeerHealth {
                        rank: new,
                        ..p.clone()
                    },
                ))
            })
            .collect();
        Health {
            size: old.len(),
            peers,
            own_late: self.own_late,
        }
    }

    /// Peer `rank`'s entry, made healthy if it had none; `None` outside the communicator.
    fn peer(&mut self, rank: Rank) -> Option<&mut PeerHealth> {
        (rank < self.size).then(|| {
            self.peers.entry(rank).or_insert_with(|| PeerHealth {
                rank,
                ..PeerHealth::default()
            })
        })
    }

    /// How many robust rounds in a row, up to the last, the agreement left this rank's own
    /// input out ([`RoundReport::erased_self`], whether or not the round then succeeded): it
    /// was late at its peers, who count it a laggard after [`LAGGARD_ROUNDS`] such rounds as
    /// it counts them ([`Health::note_own_input`]); `Carry::own_late` takes it into the next
    /// round.
    pub fn own_late(&self) -> u32 {
        self.own_late
    }

    /// Notes whether the agreement left this rank's own input out of a robust round that ran
    /// ([`Health::own_late`]).
    pub fn note_own_input(&mut self, left_out: bool) {
        self.own_late = match left_out {
            true => self.own_late.saturating_add(1),
            false => 0,
        };
    }

    /// Records what one robust call (all its sub-rounds) showed of the peers.
    pub fn record(&mut self, outcome: &Result<RoundReport>) {
        let (faults, disagreeing, skipped_by): (&[PeerFault], &[Rank], &[Rank]) = match outcome {
            Ok(report) => (
                &report.faults,
                report
                    .agreement
                    .as_ref()
                    .map_or(&[][..], |a| &a.disagreeing[..]),
                &report.skipped_by,
            ),
            Err(crate::Error::TooManyFaults { faults, .. })
            | Err(crate::Error::ShardLost { faults, .. }) => (faults, &[], &[]),
            // The round failed before any peer could be at fault, or this rank is the one
            // out of step or behind (more than `f` peers went on without it: what it saw of
            // the others' timing and steps then tells of its own lateness): nothing is learnt
            // of the others.
            Err(_) => return,
        };
        if let Ok(RoundReport {
            attribution: Some(attribution),
            ..
        }) = outcome
        {
            self.record_evidence(&attribution.ranks);
        }
        if let Ok(RoundReport {
            audit: Some(audit), ..
        }) = outcome
        {
            for lie in &audit.convicted {
                if let Some(peer) = self.peer(lie.owner) {
                    peer.convicted += 1;
                }
            }
        }
        // Each peer's symptom in this round (its first fault, else a disagreement).
        let mut symptoms: BTreeMap<Rank, Symptom> = BTreeMap::new();
        for &r in disagreeing {
            symptoms.insert(r, Symptom::Disagreeing);
        }
        // A peer that skipped this rank is not missing: this rank is behind it.
        for f in faults
            .iter()
            .rev()
            .filter(|f| f.fault != Fault::Missing || !skipped_by.contains(&f.rank))
        {
            let symptom = match f.fault {
                Fault::Late => Symptom::Late,
                Fault::Missing => Symptom::Missing,
                Fault::Malformed(_) | Fault::OutOfStep => Symptom::Malformed,
            };
            symptoms.insert(f.rank, symptom);
        }
        for peer in self.peers.values_mut() {
            if !symptoms.contains_key(&peer.rank) {
                peer.streak = None;
            }
        }
        for (rank, symptom) in symptoms {
            let Some(peer) = self.peer(rank) else {
                continue;
            };
            match symptom {
                Symptom::Late => peer.late += 1,
                Symptom::Missing => peer.missing += 1,
                Symptom::Malformed => peer.malformed += 1,
                Symptom::Disagreeing => peer.disagreeing += 1,
            }
            peer.streak = match peer.streak {
                Some((s, k)) if s == symptom => Some((s, k.saturating_add(1))),
                _ => Some((symptom, 1)),
            };
        }
    }

    fn record_evidence(&mut self, evidence: &[InputEvidence]) {
        for (rank, e) in evidence.iter().enumerate() {
            if e.coordinates == 0 {
                continue;
            }
            let Some(peer) = self.peer(rank) else {
                continue;
            };
            peer.outlying += u64::from(e.score > OUTLYING_SCORE);
            peer.not_selected += u64::from(e.selected == Some(false));
            peer.score = Some(match peer.score {
                Some(old) if old.is_finite() && e.score.is_finite() => old + (e.score - old) / 4.0,
                // An infinite score is taken as it is, and left at once for a finite one (a
                // weighted sum would turn `inf - inf` into NaN).
                _ => e.score,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::AgreementReport;

    fn report(faults: &[(Rank, Fault)], disagreeing: &[Rank]) -> Result<RoundReport> {
        Ok(RoundReport {
            faults: faults
                .iter()
                .map(|(rank, fault)| PeerFault {
                    rank: *rank,
                    fault: fault.clone(),
                })
                .collect(),
            agreement: Some(AgreementReport {
                disagreeing: disagreeing.to_vec(),
                ..AgreementReport::default()
            }),
            ..RoundReport::default()
        })
    }

    #[test]
    fn a_communicator_of_members_keeps_what_was_seen_of_them_renumbered() {
        let mut h = Health::new(5);
        for _ in 0..3 {
            h.record(&report(&[(1, Fault::Late), (3, Fault::Missing)], &[4]));
        }
        // Ranks 4, 1 and 0 of the old communicator are ranks 0, 1 and 2 of the new one.
        let kept = h.of_members(&[4, 1, 0]);
        let seen = kept.of_peers(2);
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0].rank, 0);
        assert_eq!(seen[0].streak, Some((Symptom::Disagreeing, 3)));
        assert_eq!(seen[0].disagreeing, 3);
        assert_eq!(seen[1].rank, 1);
        assert_eq!(seen[1].streak, Some((Symptom::Late, 3)));
        assert_eq!(seen[1].late, 3);
        // Rank 1 is a laggard here and stays one there; rank 3, dropped, is nowhere.
        assert_eq!(h.laggards(), [1]);
        assert_eq!(kept.laggards(), [1]);
        assert!(kept.of_peers(0).iter().all(|p| p.missing == 0));
    }

    #[test]
    fn a_rank_admitted_after_a_restart_starts_healthy_and_the_members_keep_their_memory() {
        let mut h = Health::new(3);
        for _ in 0..2 {
            h.record(&report(&[(1, Fault::Late), (2, Fault::Missing)], &[]));
        }
        // A world of job ranks 0, 1, 2 (members, ranks 0 and 1 here; 2 is gone) and 3
        // (admitted): the old rank 2 was shrunk away, rank 3 is new.
        let grown = h.renumbered(&[Some(0), Some(1), None, None]);
        let seen = grown.of_peers(0);
        assert_eq!(seen.iter().map(|p| p.rank).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(seen[0].streak, Some((Symptom::Late, 2)));
        assert_eq!(grown.laggards(), [1]);
        assert_eq!(
            seen[1],
            PeerHealth {
                rank: 2,
                ..PeerHealth::default()
            }
        );
        assert_eq!(
            seen[2],
            PeerHealth {
                rank: 3,
                ..PeerHealth::default()
            }
        );
    }

    /// Peers that went on without this rank (it fell behind them) are not missing: a round
    /// that ended without their messages counts no miss against them (what the others did
    /// still counts), and a call that failed for want of them counts nothing against anyone.
    #[test]
    fn peers_that_went_on_without_this_rank_are_not_counted_at_fault() {
        let mut h = Health::new(4);
        let mut behind = report(&[(1, Fault::Missing), (2, Fault::Missing)], &[]);
        if let Ok(r) = &mut behind {
            r.skipped_by = vec![1];
        }
        h.record(&behind);
        // A call that failed because the peers went on: this rank is the one behind, and
        // learns nothing of them.
        let fault = |rank, fault| PeerFault { rank, fault };
        let failed = crate::Error::fell_behind(
            vec![1],
            crate::Error::ShardLost {
                shard: 0,
                owners: vec![1],
                faults: vec![
                    fault(1, Fault::Missing),
                    fault(2, Fault::Missing),
                    fault(3, Fault::Malformed("x".into())),
                ],
            },
        );
        h.record(&Err(failed));
        let peers = h.of_peers(0);
        assert_eq!(peers[0].missing, 0, "{peers:?}");
        assert_eq!(peers[1].missing, 1, "{peers:?}");
        assert_eq!(peers[2].malformed, 0, "{peers:?}");
    }

    #[test]
    fn this_rank_s_own_lateness_counts_rounds_in_a_row() {
        let mut h = Health::new(4);
        h.note_own_input(true);
        h.note_own_input(true);
        assert_eq!(h.own_late(), 2);
        // A round's outcome says nothing of it: a round that failed for other peers' faults
        // does not make this rank late.
        h.record(&Err(crate::Error::InvalidUsage(
            "a caller's mistake".into(),
        )));
        h.record(&report(&[(1, Fault::Missing)], &[]));
        assert_eq!(h.own_late(), 2);
        assert_eq!(h.of_members(&[0, 1]).own_late(), 2);
        h.note_own_input(false);
        assert_eq!(h.own_late(), 0, "a round with its own input in ends it");
    }

    #[test]
    fn streaks_count_rounds_in_a_row_and_a_peer_that_catches_up_is_healthy() {
        let mut h = Health::new(4);
        h.record(&report(&[(2, Fault::Late)], &[]));
        h.record(&report(&[(2, Fault::Late), (3, Fault::Missing)], &[1]));
        let peers = h.of_peers(0);
        assert_eq!(peers.iter().map(|p| p.rank).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(peers[0].streak, Some((Symptom::Disagreeing, 1)));
        assert_eq!(peers[1].streak, Some((Symptom::Late, 2)));
        assert_eq!(peers[2].streak, Some((Symptom::Missing, 1)));
        h.record(&report(&[(3, Fault::Malformed("x".into()))], &[]));
        let peers = h.of_peers(0);
        assert!(peers[0].is_healthy() && peers[1].is_healthy());
        assert_eq!((peers[1].late, peers[1].missing), (2, 0));
        assert_eq!(peers[2].streak, Some((Symptom::Malformed, 1)));
        assert_eq!((peers[2].missing, peers[2].malformed), (1, 1));
        // A round that failed for this rank's own reasons teaches nothing of the others.
        h.record(&Err(crate::Error::InvalidUsage("x".into())));
        assert_eq!(h.of_peers(0), peers);
    }

    #[test]
    fn a_peer_late_round_after_round_is_a_laggard_until_it_is_in_time() {
        let mut h = Health::new(4);
        for _ in 0..LAGGARD_ROUNDS - 1 {
            h.record(&report(&[(2, Fault::Late), (3, Fault::Missing)], &[]));
        }
        assert_eq!(h.laggards(), Vec::<Rank>::new());
        h.record(&report(&[(2, Fault::Late), (3, Fault::Missing)], &[]));
        // Late in each of the last LAGGARD_ROUNDS rounds; missing is not late.
        assert_eq!(h.laggards(), [2]);
        h.record(&report(&[(2, Fault::Late)], &[]));
        assert_eq!(h.laggards(), [2]);
        // Late round after round: probed after 4, 8, 16, then every 32 rounds of its streak.
        let mut probes = Vec::new();
        for k in LAGGARD_ROUNDS + 2..=100 {
            h.record(&report(&[(2, Fault::Late)], &[]));
            if h.laggards().is_empty() {
                probes.push(k);
            }
        }
        assert_eq!(probes, [4, 8, 16, 32, 64, 96]);
        h.record(&report(&[], &[]));
        assert_eq!(h.laggards(), Vec::<Rank>::new());
    }
}
