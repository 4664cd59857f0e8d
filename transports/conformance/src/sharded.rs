//! Sharded rounds: bitwise the gather-mode result for every rule family, sub-rounds, dead and
//! Byzantine owners, versions sent by digest, and the reduce-scatter.

use std::future::Future;
use std::time::Duration;

use byzcoll_aggregators::{
    Aggregator, Bulyan, CenteredClipping, GeometricMedian, Krum, Mean, Median, MultiKrum, Nnm,
    TrimmedMean,
};
use byzcoll_runtime::schedule::chunk_range;
use byzcoll_runtime::{
    Error, Fault, OwnerTamper, Policy, RecvOutcome, Replicas, RoundReport, Step, Transport,
};

use crate::harness::{bits, comms, filled, passed_to_inner, reference, run_ranks, vector};
use crate::WORLD_SIZES;

/// A sharded all-reduce of a coordinate-wise rule longer than a sub-round runs as sub-rounds
/// (here three, of 1000 elements): bitwise the result of one round and of gather mode, with a
/// Byzantine sender's NaN in the last part named by the rank that owns it there; then, with a
/// rank dead, the others finish in about the time one round takes (the sub-rounds after the
/// first neither wait for it nor send to it) and name it once; and with two dead, the call
/// fails, in about the time of one round too.
pub async fn sharded_sub_rounds_match_one_round_and_erase_a_dead_peer_once<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, d, part) = (4usize, 3000usize, 4000usize);
    let timeout = Duration::from_millis(500);
    let comms = comms(factory(n).await, timeout);
    let results = run_ranks(comms, move |mut c| async move {
        let me = c.rank();
        let input = |me: usize| -> Vec<f32> {
            let mut v = vector(me, d);
            if me == 3 {
                v.iter_mut().for_each(|x| *x *= -1e6);
                v[2500] = f32::NAN;
            }
            v
        };
        let rule = Median::new(1);
        let mut whole = input(me);
        let one = c
            .robust_all_reduce(&mut whole, &rule, Policy::Sharded(Replicas::Exactly(1)))
            .await
            .unwrap();
        c.set_sub_round_bytes(part);
        let mut parts = input(me);
        let three = c
            .robust_all_reduce(&mut parts, &rule, Policy::Sharded(Replicas::Exactly(1)))
            .await
            .unwrap();
        let mut gathered = input(me);
        c.robust_all_reduce(&mut gathered, &rule, Policy::Gather)
            .await
            .unwrap();
        // Rank 3 dies before the next call.
        if me == 3 {
            return (me, one, three, whole, parts, gathered, None);
        }
        let mut v = vector(me, d);
        let started = std::time::Instant::now();
        let without = c
            .robust_all_reduce(&mut v, &rule, Policy::Sharded(Replicas::Tolerant))
            .await
            .map(|report| (report, v, started.elapsed()));
        // Rank 2 dies too: a median of the two left fails (f = 1 needs three), and the
        // sub-rounds after the first, failed, one still wait for neither dead rank.
        if me == 2 {
            return (
                me,
                one,
                three,
                whole,
                parts,
                gathered,
                Some((without, None)),
            );
        }
        let mut v = vector(me, d);
        let started = std::time::Instant::now();
        let failed = c
            .robust_all_reduce(&mut v, &rule, Policy::Sharded(Replicas::Exactly(1)))
            .await
            .map(|_| ())
            .map_err(|e| (e, started.elapsed()));
        (
            me,
            one,
            three,
            whole,
            parts,
            gathered,
            Some((without, Some(failed))),
        )
    })
    .await;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut honest_results = Vec::new();
    for (me, one, three, whole, parts, gathered, without) in results {
        assert_eq!(
            bits(&parts),
            bits(&whole),
            "rank {me}: sub-rounds differ from one round"
        );
        assert_eq!(
            bits(&parts),
            bits(&gathered),
            "rank {me}: sub-rounds differ from gather"
        );
        // Each rank names the senders of the non-finite pieces it owns: rank 3's NaN is in
        // shard 3 of one round (owned by rank 3) and in shard 2 of the last sub-round.
        let want = |owner: usize| if me == owner { vec![3] } else { vec![] };
        assert_eq!(one.non_finite, want(3), "rank {me}, one round");
        assert_eq!(three.non_finite, want(2), "rank {me}, sub-rounds");
        assert!(three.faults.is_empty(), "rank {me}: {:?}", three.faults);
        assert_eq!(
            three.stats.step_times.len(),
            3 * one.stats.step_times.len(),
            "rank {me}: three sub-rounds of the one round's steps"
        );
        let Some((without, failed)) = without else {
            continue;
        };
        let (report, v, took) = without.unwrap();
        assert_eq!(report.faults.len(), 1, "rank {me}: {:?}", report.faults);
        assert_eq!(report.faults[0].rank, 3);
        assert_eq!(report.faults[0].fault, Fault::Missing);
        assert_eq!(report.inputs, n - 1, "rank {me}");
        // The dead rank costs the first sub-round what it costs one round (up to a timeout
        // for its piece, one for the versions step and three for the cross-check where a send
        // to it waits for its receive, as over the in-process transport) and the later
        // sub-rounds nothing: 15 timeouts if each sub-round waited for it again (the bound
        // leaves room for a loaded machine).
        assert!(
            took < timeout * 10,
            "rank {me}: {took:?} for three sub-rounds with a dead peer"
        );
        honest_results.push(bits(&v));
        let Some(failed) = failed else { continue };
        let (e, took) = failed.expect_err("a median of two inputs with f = 1");
        assert!(
            matches!(e, Error::TooManyFaults { .. } | Error::ShardLost { .. }),
            "rank {me}: {e}"
        );
        assert!(
            took < timeout * 10,
            "rank {me}: {took:?} for three failing sub-rounds with two dead peers"
        );
    }
    assert_eq!(honest_results.len(), 3);
    assert!(honest_results.windows(2).all(|w| w[0] == w[1]));
}

/// A transport that sees peer `dead` dead at once, the way a rank whose connection to a dead
/// peer broke sees it: receives from it come back missing without waiting, and nothing is sent
/// to it. The other ranks wait for that peer until the deadline.
#[derive(Debug)]
struct SeesDeadAtOnce {
    inner: Box<dyn Transport>,
    dead: usize,
}

impl Transport for SeesDeadAtOnce {
    passed_to_inner!();

    fn exchange(
        &self,
        mut step: Step,
    ) -> futures::future::BoxFuture<'_, Result<Vec<RecvOutcome>, byzcoll_runtime::TransportError>>
    {
        Box::pin(async move {
            let dead = self.dead;
            let recvs = std::mem::take(&mut step.recvs);
            step.recvs = recvs.iter().filter(|r| r.peer != dead).copied().collect();
            step.sends.retain(|s| s.peer != dead);
            let mut outcomes = self.inner.exchange(step).await?.into_iter();
            Ok(recvs
                .iter()
                .map(|r| match r.peer == dead {
                    true => RecvOutcome::Missing,
                    false => outcomes.next().expect("one outcome per receive"),
                })
                .collect())
        })
    }
}

/// A silent peer that one rank sees dead at once and the others only at the deadline leaves
/// that rank ahead of them: a step timeout after the scatter, and a step's deadline after each
/// later step in which their sends to the silent peer are not taken. Every step waits a timeout
/// more than the one before, and a sub-round after one that found a peer at fault waits the
/// last step's deadline more, so the rank ahead never counts an honest rank missing. Three
/// sub-rounds, then one round, of a sharded median with 2f + 1 owners: each honest rank names
/// the silent one, and only it.
pub async fn a_peer_one_rank_sees_dead_at_once_costs_no_honest_rank<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, d, part, silent, ahead) = (4usize, 3000usize, 4000usize, 3usize, 1usize);
    let timeout = Duration::from_millis(300);
    let mut transports = factory(n).await;
    let inner = transports.remove(ahead);
    transports.insert(
        ahead,
        Box::new(SeesDeadAtOnce {
            inner,
            dead: silent,
        }),
    );
    let comms = comms(transports, timeout);
    let results = run_ranks(comms, move |mut c| async move {
        let me = c.rank();
        if me == silent {
            // Alive but silent: it keeps its transport open past every deadline of both calls.
            tokio::time::sleep(timeout * 20).await;
            return (me, Vec::new());
        }
        let rule = Median::new(1);
        let mut outcomes = Vec::new();
        // Sub-rounds first: a call leaves the ranks as far apart as its last step's deadline
        // when a rank's sends to the silent peer wait out each step (`PROTOCOL.md`, "Step
        // deadlines"), and the next call does not wait for that.
        for sub_round_bytes in [part, usize::MAX] {
            c.set_sub_round_bytes(sub_round_bytes);
            let mut v = vector(me, d);
            let report = c
                .robust_all_reduce(&mut v, &rule, Policy::Sharded(Replicas::Tolerant))
                .await;
            outcomes.push(report.map(|r| (r.faults, v)));
        }
        (me, outcomes)
    })
    .await;
    let mut honest = Vec::new();
    for (me, outcomes) in results {
        for (call, outcome) in outcomes.into_iter().enumerate() {
            let (faults, v) = outcome.unwrap_or_else(|e| panic!("rank {me}, call {call}: {e}"));
            let named: Vec<usize> = faults.iter().map(|f| f.rank).collect();
            assert_eq!(named, [silent], "rank {me}, call {call}: {faults:?}");
            assert_eq!(faults[0].fault, Fault::Missing);
            honest.push((call, v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()));
        }
    }
    assert_eq!(honest.len(), 2 * (n - 1));
    for call in 0..2 {
        let bits: Vec<_> = honest.iter().filter(|(c, _)| *c == call).collect();
        assert!(bits.windows(2).all(|w| w[0].1 == w[1].1), "call {call}");
    }
}

/// Sharded mode gives bitwise the gather-mode result for coordinate-wise rules with honest
/// inputs, at world sizes 1, 2, 3, 7, 8, 11, for d below, at and above n and not divisible by
/// n, with r = 1, 2 and 2f + 1; and it holds less memory than gather mode.
pub async fn sharded_matches_gather_bitwise<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    for n in [1usize, 2, 3, 7, 8, 11] {
        for d in [0usize, 1, n.saturating_sub(1), n + 3, 1000, 4099] {
            let comms = comms(factory(n).await, Duration::from_secs(20));
            let results = run_ranks(comms, move |mut c| async move {
                let me = c.rank();
                let f = (n - 1) / 2;
                let rules: [Box<dyn Aggregator>; 3] = [
                    Box::new(Median::new(f)),
                    Box::new(TrimmedMean::new(f)),
                    Box::new(Mean::new()),
                ];
                let mut out = Vec::new();
                for rule in &rules {
                    let mut g = vector(me, d);
                    let gather = c
                        .robust_all_reduce(&mut g, rule.as_ref(), Policy::Gather)
                        .await
                        .unwrap();
                    for replicas in [
                        Replicas::Tolerant,
                        Replicas::Exactly(1),
                        Replicas::Exactly(2.min(n)),
                    ] {
                        let mut v = vector(me, d);
                        let report = c
                            .robust_all_reduce(&mut v, rule.as_ref(), Policy::Sharded(replicas))
                            .await
                            .unwrap();
                        assert!(report.faults.is_empty(), "{:?}", report.faults);
                        let r = report.replicas.unwrap();
                        if d >= 64 {
                            assert!(
                                report.peak_bytes <= 2 * r * d * 4 + 64 * n,
                                "n={n} d={d} r={r}: peak {} bytes",
                                report.peak_bytes
                            );
                            assert!(
                                gather.peak_bytes >= n * d * 4,
                                "gather peak {}",
                                gather.peak_bytes
                            );
                        }
                        out.push((rule.name().to_string(), replicas, v == g, g.clone()));
                    }
                }
                out
            })
            .await;
            for rank_results in &results {
                for (rule, replicas, same, _) in rank_results {
                    assert!(
                        same,
                        "{rule} {replicas:?} n={n} d={d}: sharded differs from gather"
                    );
                }
            }
            // And every rank has the same result.
            for rank_results in &results[1..] {
                for (a, b) in rank_results.iter().zip(&results[0]) {
                    assert_eq!(a.3, b.3, "n={n} d={d}");
                }
            }
        }
    }
}

/// Seven ranks, f = 2, all inputs honest; ranks 5 and 6 lie as shard owners (5 flips signs and
/// scales, 6 equivocates: NaN to some ranks, 1e30 to others). With r = 2f + 1 every honest rank
/// gets exactly the honest result; with r = 1 the shards they own come out corrupted, which is
/// the documented price of trusting owners.
pub async fn sharded_survives_byzantine_owners_only_with_replication<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, f, d) = (7usize, 2usize, 701usize);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| vector(r, d)).collect();
    let honest = reference(&Median::new(f), &inputs);
    let comms = comms(factory(n).await, Duration::from_secs(20));
    let results = run_ranks(comms, move |mut c| async move {
        let me = c.rank();
        let tamper: Option<OwnerTamper> = match me {
            5 => Some(std::sync::Arc::new(
                |_s: usize, _dest: usize, honest: &[u8]| {
                    let v: Vec<f32> = honest
                        .chunks_exact(4)
                        .map(|b| -1000.0 * f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect();
                    v.iter()
                        .flat_map(|x| x.to_le_bytes())
                        .collect::<Vec<u8>>()
                        .into()
                },
            )),
            6 => Some(std::sync::Arc::new(
                |_s: usize, dest: usize, honest: &[u8]| {
                    let x: f32 = if dest.is_multiple_of(2) {
                        f32::NAN
                    } else {
                        1e30
                    };
                    filled(x, honest.len() / 4).into()
                },
            )),
            _ => None,
        };
        c.inject_owner_fault(tamper);
        let mut tolerant = vector(me, d);
        let tolerant_report = c
            .robust_all_reduce(
                &mut tolerant,
                &Median::new(f),
                Policy::Sharded(Replicas::Tolerant),
            )
            .await
            .unwrap();
        // Trusting owners without the cross-check: the corruption goes through.
        c.set_agreement(byzcoll_runtime::Agreement::Off);
        let mut trusting = vector(me, d);
        let trusted = c
            .robust_all_reduce(
                &mut trusting,
                &Median::new(f),
                Policy::Sharded(Replicas::Exactly(1)),
            )
            .await
            .map(|_| trusting)
            .map_err(|e| e.to_string());
        // With it (the default), no honest rank returns a corrupted result as success.
        c.set_agreement(byzcoll_runtime::Agreement::Detect);
        let mut checked = vector(me, d);
        let detected = c
            .robust_all_reduce(
                &mut checked,
                &Median::new(f),
                Policy::Sharded(Replicas::Exactly(1)),
            )
            .await
            .map(|_| checked)
            .map_err(|e| e.to_string());
        (me, (tolerant, tolerant_report), trusted, detected)
    })
    .await;
    for (me, (tolerant, tolerant_report), trusting, detected) in results {
        if me >= 5 {
            continue;
        }
        // Owner 6 sent even and odd ranks different versions: the cross-check names it.
        let found = tolerant_report.agreement.expect("Detect reports");
        assert!(
            found.differing_versions.contains(&6),
            "rank {me}: {found:?}"
        );
        assert!(
            !found.differing_versions.iter().any(|&o| o < 5),
            "rank {me}: {found:?}"
        );
        match detected {
            Err(e) => assert!(
                e.contains("non-finite") || e.contains("disagrees"),
                "rank {me}: {e}"
            ),
            Ok(v) => assert_eq!(
                v, honest,
                "rank {me} returned a corrupted result as success"
            ),
        }
        assert_eq!(
            tolerant, honest,
            "rank {me}: r = 2f + 1 must give the honest result"
        );
        // With r = 1, shard s is owned by rank s alone: shards 5 and 6 are the liars'. Ranks
        // that got NaN refuse the round (never a NaN result); the others get corrupted shards.
        let trusting = match trusting {
            Err(e) => {
                assert!(me % 2 == 0 && e.contains("non-finite"), "rank {me}: {e}");
                continue;
            }
            Ok(v) => {
                assert!(
                    me % 2 == 1,
                    "rank {me} got NaN from rank 6 but returned a result"
                );
                v
            }
        };
        for s in 0..n {
            let range = byzcoll_runtime::schedule::chunk_range(d, n, s);
            let same = trusting[range.clone()] == honest[range];
            assert_eq!(same, s < 5, "rank {me}, shard {s}: r = 1 trusts its owner");
        }
    }
}

/// With `r = 2f + 1` owners per shard the versions go by digest (`PROTOCOL.md`): a taker
/// receives one owner's version and the other owners' digests, so that an honest round moves
/// the pieces of `r` owners but the versions of one. Four ranks, `f = 1`, `r = 3`, shards of
/// 1000 `f32`; then rank 3 lies as an owner, first consistently (its digests match its
/// versions: the takers ask for its version and outvote it), then with versions that do not
/// match the digests it sent (every honest rank asked it for one, and names it).
pub async fn replicated_owners_send_one_version_and_digests<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, f, d) = (4usize, 1usize, 4000usize);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| vector(r, d)).collect();
    let honest = reference(&Median::new(f), &inputs);
    let comms = comms(factory(n).await, Duration::from_secs(20));
    let results = run_ranks(comms, move |mut c| async move {
        let me = c.rank();
        let three = Policy::Sharded(Replicas::Exactly(3));
        let mut outcomes = Vec::new();
        for lie in 0..3 {
            let tamper: Option<OwnerTamper> = match (me, lie) {
                (3, 1) => Some(std::sync::Arc::new(
                    |_s: usize, _d: usize, honest: &[u8]| filled(-1000.0, honest.len() / 4).into(),
                )),
                (3, 2) => {
                    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
                    Some(std::sync::Arc::new(
                        move |_s: usize, _d: usize, honest: &[u8]| {
                            let k = calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            filled(k as f32, honest.len() / 4).into()
                        },
                    ))
                }
                _ => None,
            };
            c.inject_owner_fault(tamper);
            let mut v = vector(me, d);
            let done = c.robust_all_reduce(&mut v, &Median::new(f), three).await;
            outcomes.push(done.map(|report| (report, v)).map_err(|e| e.to_string()));
        }
        (me, outcomes)
    })
    .await;
    let piece = d / n * 4;
    // Three owned shards' pieces from three peers, and one version.
    let floor = (3 * 3 * piece + piece) as u64;
    for (me, outcomes) in results.into_iter().filter(|(me, _)| *me < 3) {
        let reports: Vec<RoundReport> = outcomes
            .into_iter()
            .enumerate()
            .map(|(lie, o)| {
                let (report, v) = o.unwrap_or_else(|e| panic!("rank {me}, lie {lie}: {e}"));
                assert_eq!(bits(&v), bits(&honest), "rank {me}, lie {lie}");
                report
            })
            .collect();
        // Honest: the pieces, one version, and under 2 KiB of digests, requests and checks
        // (every owner's version would be 9 more pieces).
        let got = reports[0].stats.bytes_received;
        assert!(
            (floor..floor + 2048).contains(&got),
            "rank {me}: {got} bytes received, {floor} of pieces and one version"
        );
        assert!(
            reports[0].faults.is_empty(),
            "rank {me}: {:?}",
            reports[0].faults
        );
        // A consistent liar: its versions were asked for and outvoted, nobody is at fault.
        assert!(reports[1].stats.bytes_received > got, "rank {me}");
        assert!(
            reports[1].faults.is_empty(),
            "rank {me}: {:?}",
            reports[1].faults
        );
        // Versions that do not match their digests: the owner is named.
        let named = reports[2].faults.iter().any(|pf| {
            pf.rank == 3
                && matches!(&pf.fault, Fault::Malformed(why) if why.contains("does not match"))
        });
        assert!(named, "rank {me}: {:?}", reports[2].faults);
    }
}

/// The Krum family in sharded mode (distance tables computed on shards, exchanged with the
/// same replication, combined by median and summed) selects the same ranks and gives bitwise
/// the gather-mode result on honest inputs.
pub async fn sharded_krum_family_matches_gather<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    for n in [3usize, 7, 8, 11] {
        for d in [1usize, n + 3, 1000] {
            let comms = comms(factory(n).await, Duration::from_secs(20));
            let results = run_ranks(comms, move |mut c| async move {
                let me = c.rank();
                let fk = (n - 3) / 2;
                let mut rules: Vec<Box<dyn Aggregator>> =
                    vec![Box::new(Krum::new(fk)), Box::new(MultiKrum::new(fk, None))];
                if n >= 7 {
                    rules.push(Box::new(Bulyan::new((n - 3) / 4)));
                }
                let mut out = Vec::new();
                for rule in &rules {
                    let mut g = vector(me, d);
                    let gather = c
                        .robust_all_reduce(&mut g, rule.as_ref(), Policy::Gather)
                        .await
                        .unwrap();
                    for replicas in [Replicas::Tolerant, Replicas::Exactly(1)] {
                        let mut v = vector(me, d);
                        let report = c
                            .robust_all_reduce(&mut v, rule.as_ref(), Policy::Sharded(replicas))
                            .await
                            .unwrap();
                        assert_eq!(
                            report.selected,
                            gather.selected,
                            "{} n={n} d={d}",
                            rule.name()
                        );
                        assert_eq!(v, g, "{} {replicas:?} n={n} d={d}", rule.name());
                    }
                    out.push(g);
                }
                out
            })
            .await;
            for r in &results[1..] {
                assert_eq!(r, &results[0], "n={n} d={d}: ranks disagree");
            }
        }
    }
}

/// The geometric median and centered clipping in sharded mode (one statistic round per step:
/// partial distances to the estimate exchanged with r-fold replication) agree with gather mode
/// to 1e-4 relative (the sums run in another order), on every rank identically; NNM followed by
/// a coordinate-wise rule gives bitwise the gather result, and NNM followed by a rule that needs
/// its own statistics is refused with a typed error instead of a silent fallback.
pub async fn sharded_iterative_rules_match_gather<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    for n in [3usize, 7, 8] {
        for d in [1usize, n + 3, 1000] {
            let comms = comms(factory(n).await, Duration::from_secs(20));
            let results = run_ranks(comms, move |mut c| async move {
                let me = c.rank();
                let f = (n - 1) / 2;
                let rules: [Box<dyn Aggregator>; 2] = [
                    Box::new(GeometricMedian::new(f)),
                    Box::new(CenteredClipping::new(f, 5.0, 3).unwrap()),
                ];
                let mut out = Vec::new();
                for rule in &rules {
                    let mut g = vector(me, d);
                    c.robust_all_reduce(&mut g, rule.as_ref(), Policy::Gather)
                        .await
                        .unwrap();
                    for replicas in [Replicas::Tolerant, Replicas::Exactly(1)] {
                        let mut v = vector(me, d);
                        c.robust_all_reduce(&mut v, rule.as_ref(), Policy::Sharded(replicas))
                            .await
                            .unwrap();
                        for (a, b) in v.iter().zip(&g) {
                            assert!(
                                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                                "{} {replicas:?} n={n} d={d}: {a} vs {b}",
                                rule.name()
                            );
                        }
                        out.push(v);
                    }
                }
                // NNM followed by a coordinate-wise rule shards (one distance-table round);
                // followed by a rule that needs statistics of its own, it is refused.
                let nnm = Nnm::new(f, Box::new(Median::new(f)));
                let mut g = vector(me, d);
                c.robust_all_reduce(&mut g, &nnm, Policy::Gather)
                    .await
                    .unwrap();
                let mut v = vector(me, d);
                c.robust_all_reduce(&mut v, &nnm, Policy::Sharded(Replicas::Tolerant))
                    .await
                    .unwrap();
                assert_eq!(v, g, "nnm+median n={n} d={d}");
                out.push(v);
                let nested = Nnm::new((n - 3) / 2, Box::new(Krum::new((n - 3) / 2)));
                let mut v = vector(me, d);
                let refused = c
                    .robust_all_reduce(&mut v, &nested, Policy::Sharded(Replicas::Tolerant))
                    .await;
                assert!(matches!(refused, Err(Error::Unsupported(_))), "{refused:?}");
                out
            })
            .await;
            for r in &results[1..] {
                assert_eq!(r, &results[0], "n={n} d={d}: ranks disagree");
            }
        }
    }
}

/// `robust_reduce_scatter` gives every rank bitwise its own shard of the sharded all-reduce
/// (and of the gather-mode one, for coordinate-wise rules) at every world size, for vectors
/// shorter than the world and not divisible by it, with r = 1, 2 and 2f + 1, for
/// coordinate-wise rules and the Krum family; a wrong output length is refused on every rank
/// before any data moves.
pub async fn robust_reduce_scatter_gives_each_rank_its_shard_of_the_all_reduce<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    for n in WORLD_SIZES {
        for d in [0usize, 1, n + 3, 1000] {
            let comms = comms(factory(n).await, Duration::from_secs(20));
            run_ranks(comms, move |mut c| async move {
                let me = c.rank();
                let f = (n - 1) / 2;
                let mut rules: Vec<Box<dyn Aggregator>> =
                    vec![Box::new(Median::new(f)), Box::new(TrimmedMean::new(f))];
                if n >= 5 {
                    rules.push(Box::new(Krum::new((n - 3) / 2)));
                }
                let shard = chunk_range(d, n, me);
                let mut wrong = vec![0.0f32; shard.len() + 1];
                let refused = c
                    .robust_reduce_scatter(
                        &vector(me, d),
                        &mut wrong,
                        &Median::new(f),
                        Replicas::Tolerant,
                    )
                    .await;
                assert!(
                    matches!(refused, Err(Error::InvalidUsage(_))),
                    "{refused:?}"
                );
                for rule in &rules {
                    for replicas in [
                        Replicas::Tolerant,
                        Replicas::Exactly(1),
                        Replicas::Exactly(2.min(n)),
                    ] {
                        let mut all = vector(me, d);
                        c.robust_all_reduce(&mut all, rule.as_ref(), Policy::Sharded(replicas))
                            .await
                            .unwrap();
                        let mut out = vec![f32::NAN; shard.len()];
                        let report = c
                            .robust_reduce_scatter(
                                &vector(me, d),
                                &mut out,
                                rule.as_ref(),
                                replicas,
                            )
                            .await
                            .unwrap();
                        let what = format!("{} {replicas:?} n={n} d={d} rank {me}", rule.name());
                        assert_eq!(out, all[shard.clone()], "{what}");
                        assert!(report.faults.is_empty(), "{what}: {:?}", report.faults);
                        let found = report.agreement.expect("Detect is the default");
                        assert_eq!(found, byzcoll_runtime::AgreementReport::default(), "{what}");
                        let krum = rule.name().starts_with("krum");
                        if krum {
                            assert!(report.selected.is_some(), "{what}");
                        }
                        // Phase 1, the distance tables for Krum, phase 3 (with r > 1 owners
                        // the versions go by digest: the requests and the resends follow),
                        // the cross-check.
                        let stats = &report.stats;
                        let r = report.replicas.unwrap();
                        let steps = 3 + usize::from(krum) + if r > 1 { 2 } else { 0 };
                        assert_eq!(stats.step_times.len(), steps, "{what}");
                        let scattered: usize =
                            byzcoll_runtime::schedule::sharded::scatter_sends(me, n, r)
                                .into_iter()
                                .map(|(_, s)| chunk_range(d, n, s).len() * 4)
                                .sum();
                        assert!(stats.bytes_sent >= scattered as u64, "{what}: {stats:?}");
                        assert_eq!(stats.bytes_received > 0, n > 1, "{what}: {stats:?}");
                    }
                }
            })
            .await;
        }
    }
}

/// `Policy::Auto` runs what [`Policy::resolve`] says, alike on every rank, and the report
/// tells which (`replicas`: `None` for gather): over 8 ranks with `f = 1`, gather for a vector
/// of 1 KiB and sharded with 3 owners for one of 1 MiB (4 bytes of traffic per element per
/// rank against gather's 7), each bitwise what the forced policy gives; over 3 ranks, gather.
pub async fn auto_runs_what_it_resolves_to_and_says_so<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    for (n, d, want) in [
        (8, 256, None),
        (8, byzcoll_runtime::AUTO_SHARDED_MIN_BYTES / 4, Some(3)),
        (3, byzcoll_runtime::AUTO_SHARDED_MIN_BYTES / 4, None),
    ] {
        let comms = comms(factory(n).await, Duration::from_secs(30));
        let results = run_ranks(comms, move |mut c| async move {
            let rule = Median::new(if c.size() > 3 { 1 } else { 0 });
            let me = c.rank();
            let mut auto = vector(me, d);
            let report = c
                .robust_all_reduce(&mut auto, &rule, Policy::Auto)
                .await
                .unwrap();
            let forced = match report.replicas {
                None => Policy::Gather,
                Some(_) => Policy::Sharded(Replicas::Tolerant),
            };
            let mut same = vector(me, d);
            c.robust_all_reduce(&mut same, &rule, forced).await.unwrap();
            (report.replicas, bits(&auto), bits(&same))
        })
        .await;
        for (me, (replicas, auto, forced)) in results.iter().enumerate() {
            assert_eq!(*replicas, want, "n = {n} d = {d} rank {me}");
            assert!(auto == forced, "n = {n} d = {d} rank {me}: auto != forced");
            assert!(auto == &results[0].1, "n = {n} d = {d} rank {me} differs");
        }
    }
}
