//! Data mode: sharded and ring runs against the gather-mode reference, with and without faults
//! and Byzantine ranks.

use byzcoll_aggregators::attacks::Attack;
use byzcoll_aggregators::{by_name, Aggregator};
use byzcoll_proto::schedule::{chunk_range, sharded};
use byzcoll_proto::{Agreement, Error, Stragglers};
use byzcoll_sim::{
    Adversary, Algorithm, Crash, DataSet, Lie, Network, Preset, RankResult, Role, Run, Scenario,
    SimError, Stall, Verdict,
};

const WORLDS: [usize; 6] = [1, 2, 3, 7, 8, 11];

fn scenario(n: usize) -> Scenario {
    Scenario::new(n, Network::preset(Preset::Infiniband))
}

/// The largest `f` with `n > 2f`.
fn max_f(n: usize) -> usize {
    (n - 1) / 2
}

fn results(run: &Run) -> Vec<Vec<f32>> {
    run.ranks
        .iter()
        .filter(|o| o.role == Role::Honest)
        .map(|o| match &o.result {
            RankResult::Done(Some(v)) => v.to_vec(),
            other => panic!("{}: {other:?}", run.algorithm),
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// d < n and d not divisible by n (some shards empty), and d > n not divisible by n.
fn sizes(n: usize) -> Vec<usize> {
    let mut d = vec![n.saturating_sub(1).max(1), 3 * n + 2];
    if n == 1 {
        d = vec![1, 5];
    }
    d
}

#[test]
fn honest_sharded_equals_gather_bitwise_for_coordinate_wise_rules() {
    for n in WORLDS {
        for d in sizes(n) {
            let s = scenario(n);
            let data = DataSet::generate(&s, d).unwrap();
            for name in ["median", "trimmed-mean", "mean"] {
                let f = if name == "mean" { 0 } else { max_f(n) };
                let rule = by_name(name, f).unwrap();
                let reference = data.reference(rule.as_ref());
                let want = bits(reference.gather().unwrap());
                let gather = s.run_data(Algorithm::Gather, &data, rule.as_ref()).unwrap();
                assert!(gather.clean);
                for got in results(&gather) {
                    assert_eq!(bits(&got), want, "gather n={n} d={d} {name}");
                }
                for r in [1, 2 * f + 1] {
                    let run = s
                        .run_data(Algorithm::Sharded { replicas: r }, &data, rule.as_ref())
                        .unwrap();
                    assert_eq!(
                        reference.check(&run),
                        Ok(Verdict::Exact),
                        "n={n} d={d} r={r}"
                    );
                    for got in results(&run) {
                        assert_eq!(bits(&got), want, "sharded r={r} n={n} d={d} {name}");
                    }
                }
            }
        }
    }
}

#[test]
fn ring_sum_equals_the_direct_sum() {
    for n in WORLDS {
        for d in sizes(n) {
            let s = scenario(n);
            let data = DataSet::generate(&s, d).unwrap();
            let want: Vec<f32> = (0..d)
                .map(|j| (0..n).map(|r| data.input(r)[j]).sum())
                .collect();
            let rule = by_name("median", 0).unwrap();
            let run = s
                .run_data(Algorithm::RingSum, &data, rule.as_ref())
                .unwrap();
            assert_eq!(run.stats.messages as usize, 2 * n * (n - 1));
            for got in results(&run) {
                assert_eq!(got, want, "n={n} d={d}");
            }
            assert_eq!(
                data.reference(rule.as_ref()).check(&run),
                Ok(Verdict::Exact)
            );
        }
    }
}

/// The shards rank `liar` owns.
fn shards_of(liar: usize, n: usize, r: usize) -> Vec<usize> {
    sharded::owned(liar, n, r).collect()
}

#[test]
fn lying_owners_are_outvoted_with_2f_plus_1_replicas_only() {
    for lie in [Lie::SignFlip, Lie::Nan, Lie::Equivocate] {
        for (n, f, k) in [(7, 2, 2), (8, 3, 3), (11, 2, 1), (11, 5, 5)] {
            let d = 5 * n + 3;
            let mut s = scenario(n);
            s.adversary = Adversary {
                lying_owners: k,
                lie,
                ..Adversary::default()
            };
            let data = DataSet::generate(&s, d).unwrap();
            let rule = by_name("median", f).unwrap();
            let reference = data.reference(rule.as_ref());
            let want = reference.gather().unwrap().to_vec();

            let tolerant = s
                .run_data(Algorithm::tolerant(n, f), &data, rule.as_ref())
                .unwrap();
            assert!(!tolerant.clean);
            assert_eq!(
                reference.check(&tolerant),
                Ok(Verdict::Exact),
                "{lie} n={n}"
            );
            for got in results(&tolerant) {
                assert_eq!(bits(&got), bits(&want), "{lie} n={n} f={f} k={k}");
            }

            // With one owner per shard nothing outvotes a liar: under Detect an equivocating
            // owner's split is never silent ...
            let detected = s
                .run_data(Algorithm::Sharded { replicas: 1 }, &data, rule.as_ref())
                .unwrap();
            assert_eq!(detected.silent_split(), None, "{lie} n={n}");
            // ... and without the cross-check, the shards it lied about are wrong.
            s.agreement = Agreement::Off;
            let trusting = s
                .run_data(Algorithm::Sharded { replicas: 1 }, &data, rule.as_ref())
                .unwrap();
            if lie != Lie::SignFlip {
                // A negated median may still lie inside the honest range; NaN and garbage not.
                assert!(reference.check(&trusting).is_err(), "{lie} n={n}");
            }
            let liars: Vec<usize> = (n - k..n).collect();
            let lied: Vec<usize> = liars.iter().flat_map(|&l| shards_of(l, n, 1)).collect();
            for o in trusting.ranks.iter().filter(|o| o.role == Role::Honest) {
                let got = match (&o.result, lie) {
                    (RankResult::Done(Some(v)), Lie::SignFlip | Lie::Equivocate) => v,
                    // The driver refuses to return the NaN of a single lying version.
                    (RankResult::Failed(e), Lie::Nan) => {
                        assert!(e.to_string().contains("non-finite"), "{e}");
                        continue;
                    }
                    (other, _) => panic!("{lie} n={n}: {other:?}"),
                };
                for s in 0..n {
                    let range = chunk_range(d, n, s);
                    let same = bits(&got[range.clone()]) == bits(&want[range]);
                    assert_eq!(same, !lied.contains(&s), "{lie} n={n} shard {s}");
                }
            }
        }
    }
}

#[test]
fn attacks_stay_in_the_honest_range() {
    let n = 11;
    let f = 3;
    for attack in Attack::catalogue(n, f) {
        let mut s = scenario(n);
        s.adversary = Adversary {
            byzantine_inputs: f,
            attack: attack.clone(),
            lying_owners: 1,
            lie: Lie::Equivocate,
            ..Adversary::default()
        };
        let data = DataSet::generate(&s, 40).unwrap();
        for name in ["median", "trimmed-mean"] {
            let rule = by_name(name, f).unwrap();
            let reference = data.reference(rule.as_ref());
            for alg in [Algorithm::Gather, Algorithm::tolerant(n, f)] {
                let run = s.run_data(alg, &data, rule.as_ref()).unwrap();
                let verdict = reference.check(&run);
                assert!(
                    matches!(verdict, Ok(Verdict::InHonestRange | Verdict::Exact)),
                    "{attack:?} {name} {alg}: {verdict:?}"
                );
            }
        }
    }
}

#[test]
fn loss_and_crashes_within_f_stay_in_the_honest_range() {
    let n = 11;
    let f = 3;
    let mut s = scenario(n);
    s.faults.crashes = vec![
        Crash {
            rank: 4,
            from_step: 0,
        },
        Crash {
            rank: 9,
            from_step: 1,
        },
    ];
    s.faults.stalls = vec![Stall {
        rank: 2,
        delay: 1e-3,
    }];
    s.faults.max_delay = 5e-6;
    s.timeout = 1e-3;
    s.seed = 11;
    let data = DataSet::generate(&s, 50).unwrap();
    let rule = by_name("median", f).unwrap();
    let reference = data.reference(rule.as_ref());
    for alg in [Algorithm::Gather, Algorithm::tolerant(n, f)] {
        // The stalled rank starts after everyone's deadline, finds every message waiting and
        // would aggregate another input set: under Detect it is told, never silently apart.
        let run = s.run_data(alg, &data, rule.as_ref()).unwrap();
        assert_eq!(run.silent_split(), None, "{alg}");
        match (&run.ranks[2].result, &run.ranks[0].result) {
            // Gather: it aggregated every input, the cross-check shows that the others went
            // without its own, and it aggregates again without it (realignment): their
            // result, bitwise. Sharded, with stragglers allowed by default: its co-owners'
            // syncs say its pieces were late, it leaves them out as they did, and takes
            // their versions: their result, bitwise (before, it failed the round).
            (RankResult::Done(Some(v)), RankResult::Done(Some(w))) => {
                assert_eq!(bits(v), bits(w), "{alg}")
            }
            (other, _) => panic!("{alg}: the stalled rank got {other:?}"),
        }
    }
    s.agreement = Agreement::Off;
    for alg in [Algorithm::Gather, Algorithm::tolerant(n, f)] {
        let run = s.run_data(alg, &data, rule.as_ref()).unwrap();
        assert!(!run.clean);
        assert!(run.stats.erasures > 0);
        let verdict = reference.check(&run);
        assert!(
            matches!(verdict, Ok(Verdict::InHonestRange | Verdict::Exact)),
            "{alg}: {verdict:?}"
        );
        // The stalled rank started after everyone's deadline: others count it missing.
        assert!(run.ranks[0].faults.iter().any(|p| p.rank == 2), "{alg}");
        assert!(run.ranks[0].faults.iter().any(|p| p.rank == 4), "{alg}");
    }
    // Ring SUM cannot lose anyone: the crashed rank's successor fails, clearly.
    let ring = s
        .run_data(Algorithm::RingSum, &data, rule.as_ref())
        .unwrap();
    let failures: Vec<_> = ring.failures().collect();
    assert!(!failures.is_empty());
    assert!(matches!(failures[0].1, Error::PeerFaults { .. }));

    // Random loss in a larger world.
    let mut s = scenario(64);
    s.agreement = Agreement::Off;
    s.faults.loss = 0.002;
    s.seed = 5;
    let data = DataSet::generate(&s, 200).unwrap();
    let reference = data.reference(rule.as_ref());
    for alg in [Algorithm::Gather, Algorithm::tolerant(64, f)] {
        let run = s.run_data(alg, &data, rule.as_ref()).unwrap();
        assert!(run.stats.lost > 0, "{alg}");
        let verdict = reference.check(&run);
        assert!(
            matches!(verdict, Ok(Verdict::InHonestRange | Verdict::Exact)),
            "{alg}: {verdict:?}"
        );
    }
}

/// One dead owner under the default `Detect`, with 2f + 1 owners: the takers whose designated
/// owner (the one that sends them the whole version) is the dead one ask the others for it,
/// and every honest rank still returns the same result (the shards' digests the cross-check
/// compares are made alike whether the round hashed a version or the plane the output).
#[test]
fn a_dead_owner_costs_no_honest_rank_its_result() {
    let (n, f, d) = (16, 2, 40);
    let mut s = scenario(n);
    s.faults.crashes = vec![Crash {
        rank: n - 1,
        from_step: 0,
    }];
    s.timeout = 1e-3;
    let data = DataSet::generate(&s, d).unwrap();
    let rule = by_name("median", f).unwrap();
    let reference = data.reference(rule.as_ref());
    let run = s
        .run_data(Algorithm::tolerant(n, f), &data, rule.as_ref())
        .unwrap();
    assert_eq!(run.failures().count(), 0, "{:?}", run.failures().next());
    let results = results(&run);
    assert!(results.iter().all(|v| bits(v) == bits(&results[0])));
    assert!(matches!(
        reference.check(&run),
        Ok(Verdict::InHonestRange | Verdict::Exact)
    ));
}

#[test]
fn too_many_erasures_is_a_clear_error() {
    // n = 7, f = 3: losing one input breaks n > 2f.
    let n = 7;
    let mut s = scenario(n);
    s.faults.crashes = vec![Crash {
        rank: 6,
        from_step: 0,
    }];
    let data = DataSet::generate(&s, 20).unwrap();
    let rule = by_name("median", 3).unwrap();
    let gather = s.run_data(Algorithm::Gather, &data, rule.as_ref()).unwrap();
    let failures: Vec<_> = gather.failures().collect();
    assert_eq!(failures.len(), n - 1);
    for (_, e) in &failures {
        assert!(matches!(e, Error::TooManyFaults { .. }), "{e}");
        let text = e.to_string();
        assert!(text.contains("n > 2f") && text.contains("rank 6"), "{text}");
    }
    let err = data.reference(rule.as_ref()).check(&gather).unwrap_err();
    assert!(err.to_string().contains("failed"), "{err}");

    // Sharded: the crashed owner's shards lose their only version with r = 1.
    let one = by_name("median", 1).unwrap();
    let run = s
        .run_data(Algorithm::Sharded { replicas: 1 }, &data, one.as_ref())
        .unwrap();
    assert!(run
        .failures()
        .all(|(_, e)| matches!(e, Error::ShardLost { shard: 6, .. })));
    assert_eq!(run.failures().count(), n - 1);

    // And the world-size precondition fails before anything runs.
    let s = scenario(6);
    let data = DataSet::generate(&s, 4).unwrap();
    let err = s
        .run_data(Algorithm::Gather, &data, rule.as_ref())
        .unwrap_err();
    assert!(matches!(err, SimError::Precondition(_)), "{err}");
}

#[test]
fn a_thousand_ranks_complete() {
    // Small d and f = 1 (r = 3) keep this quick in debug builds; `byzcoll simulate --ranks
    // 1024 --d 4096 --f 3` is the release-mode version.
    let n = 1024;
    let f = 1;
    let mut s = scenario(n);
    let data = DataSet::generate(&s, 256).unwrap();
    let rule: Box<dyn Aggregator> = by_name("median", f).unwrap();
    let reference = data.reference(rule.as_ref());
    for alg in [
        Algorithm::Gather,
        Algorithm::Sharded { replicas: 1 },
        Algorithm::tolerant(n, f),
    ] {
        // Sharded rounds run with the cross-check (the default; linear in n per rank); in
        // gather mode its n input digests to each of n − 1 peers make O(n³) bytes for one
        // process to simulate, so the gather round runs without it.
        s.agreement = match alg {
            Algorithm::Gather => Agreement::Off,
            _ => Agreement::Detect,
        };
        let run = s.run_data(alg, &data, rule.as_ref()).unwrap();
        assert_eq!(reference.check(&run), Ok(Verdict::Exact), "{alg}");
        assert!(run.time > 0.0);
        assert!(run.ranks.iter().all(|o| o.faults.is_empty()));
        if alg != Algorithm::Gather {
            assert!(
                run.ranks.iter().all(|o| o
                    .agreement
                    .as_ref()
                    .is_some_and(|a| a.disagreeing.is_empty() && a.unconfirmed.is_empty())),
                "{alg}"
            );
        }
    }
}

#[test]
fn same_seed_same_run() {
    let run = |seed: u64| {
        let mut s = scenario(16);
        s.seed = seed;
        s.faults.loss = 0.01;
        s.faults.max_delay = 3e-6;
        s.timeout = 1e-3;
        s.adversary.byzantine_inputs = 2;
        s.adversary.attack = Attack::Gaussian {
            sigma: 10.0,
            seed: 1,
        };
        let data = DataSet::generate(&s, 33).unwrap();
        let rule = by_name("median", 3).unwrap();
        [Algorithm::Gather, Algorithm::tolerant(16, 3)].map(|alg| {
            let run = s.run_data(alg, &data, rule.as_ref()).unwrap();
            let outs: Vec<(u64, Option<Vec<u32>>)> = run
                .ranks
                .iter()
                .map(|o| {
                    let v = match &o.result {
                        RankResult::Done(Some(v)) => Some(bits(v)),
                        _ => None,
                    };
                    (o.finish.to_bits(), v)
                })
                .collect();
            (run.time.to_bits(), run.stats, outs)
        })
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
}

#[test]
fn input_equivocation_is_named_by_every_honest_rank_that_completes() {
    // The last f ranks forge their inputs and send every destination another vector.
    let (n, f) = (7, 2);
    let mut s = scenario(n);
    s.adversary = Adversary {
        byzantine_inputs: f,
        equivocate_inputs: true,
        ..Adversary::default()
    };
    let data = DataSet::generate(&s, 3 * n + 1).unwrap();
    let rule = by_name("median", f).unwrap();
    for alg in [Algorithm::Gather, Algorithm::tolerant(n, f)] {
        let run = s.run_data(alg, &data, rule.as_ref()).unwrap();
        assert_eq!(run.silent_split(), None, "{alg}");
        let mut completed = 0;
        for o in run.ranks.iter().filter(|o| o.role == Role::Honest) {
            match &o.result {
                RankResult::Done(_) => {
                    completed += 1;
                    let found = o.agreement.as_ref().expect("Detect is the default");
                    for liar in n - f..n {
                        assert!(found.differing_inputs.contains(&liar), "{alg}: {found:?}");
                    }
                }
                // Out of step: in gather mode every honest rank saw other liars' vectors, so
                // none holds a result n - f ranks share, and each is told who differed.
                RankResult::Failed(Error::Disagreement {
                    differing_inputs, ..
                }) => {
                    for liar in n - f..n {
                        assert!(
                            differing_inputs.contains(&liar),
                            "{alg}: {differing_inputs:?}"
                        );
                    }
                }
                other => panic!("{alg}: {other:?}"),
            }
        }
        if alg != Algorithm::Gather {
            // Sharded with 2f + 1 owners: an equivocated piece changes one owner's version
            // only, which the others outvote.
            assert!(completed > 0, "{alg}");
        }
    }
    // Without the cross-check the honest ranks' gather results differ, silently.
    s.agreement = Agreement::Off;
    let run = s.run_data(Algorithm::Gather, &data, rule.as_ref()).unwrap();
    assert!(run.silent_split().is_some());
}

#[test]
fn under_enforce_every_honest_rank_ends_with_bitwise_the_same_result() {
    // The last f ranks forge their inputs and send every destination another vector; under
    // Detect the gather round fails on some honest ranks, under Enforce none: every honest
    // rank leaves the liars out alike and the results are identical, inside the honest range,
    // in gather and in sharded mode. Enforce needs n > 3f: refused up front.
    for (n, f) in [(4, 1), (7, 2), (10, 3)] {
        let mut s = scenario(n);
        s.adversary = Adversary {
            byzantine_inputs: f,
            equivocate_inputs: true,
            ..Adversary::default()
        };
        s.agreement = Agreement::Enforce;
        let data = DataSet::generate(&s, 2 * n + 1).unwrap();
        for name in ["median", "trimmed-mean"] {
            let rule = by_name(name, f).unwrap();
            let run = s.run_data(Algorithm::Gather, &data, rule.as_ref()).unwrap();
            assert_eq!(run.divergence(), None, "n = {n}, {name}");
            assert!(
                data.reference(rule.as_ref()).check(&run).is_ok(),
                "n = {n}, {name}"
            );
            for o in run.ranks.iter().filter(|o| o.role == Role::Honest) {
                let found = o
                    .agreement
                    .as_ref()
                    .expect("Enforce ends with the cross-check");
                assert!(found.disagreeing.is_empty(), "n = {n}: {found:?}");
                assert_eq!(
                    found.differing_inputs,
                    (n - f..n).collect::<Vec<_>>(),
                    "n = {n}, {name}"
                );
            }
        }
        // Sharded with 2f + 1 owners: the owners' results are agreed on alike too (the
        // liars' equivocated pieces change honest owners' versions, the same everywhere).
        let rule = by_name("median", f).unwrap();
        let run = s
            .run_data(Algorithm::tolerant(n, f), &data, rule.as_ref())
            .unwrap();
        assert_eq!(run.divergence(), None, "n = {n}, sharded");
        assert!(
            data.reference(rule.as_ref()).check(&run).is_ok(),
            "n = {n}, sharded"
        );
    }
    let mut s = scenario(6);
    s.agreement = Agreement::Enforce;
    let data = DataSet::generate(&s, 8).unwrap();
    let rule = by_name("median", 2).unwrap();
    let refused = s.run_data(Algorithm::Gather, &data, rule.as_ref());
    let Err(SimError::InvalidConfig(why)) = refused else {
        panic!("{refused:?}")
    };
    assert!(why.contains("n > 3f"), "{why}");
}

#[test]
fn equivocation_toward_one_rank_is_recovered_under_enforce_and_detected_under_detect() {
    // The last two ranks send rank 0 one forged vector and every other rank another.
    let (n, f) = (7, 2);
    let mut s = scenario(n);
    s.adversary = Adversary {
        byzantine_inputs: f,
        equivocate_inputs: true,
        equivocation_victim: Some(0),
        ..Adversary::default()
    };
    let data = DataSet::generate(&s, 2 * n + 1).unwrap();
    let rule = by_name("median", f).unwrap();
    // Detect with stragglers allowed: the ranks move to the common inputs, those every rank
    // they heard used, which leaves the forged ones out, and every honest rank ends with one
    // result inside the honest range.
    s.stragglers = Stragglers::Auto;
    let run = s.run_data(Algorithm::Gather, &data, rule.as_ref()).unwrap();
    assert_eq!(run.silent_split(), None);
    assert_eq!(run.divergence(), None);
    assert!(data.reference(rule.as_ref()).check(&run).is_ok());
    // Detect waiting for every input: rank 0 is out of step and told so. The other four
    // honest ranks agree, but with the two liars (whose own results differ) that is fewer
    // than n - f = 5: they are told too. Nobody is apart silently.
    s.stragglers = Stragglers::Exactly(0);
    let run = s.run_data(Algorithm::Gather, &data, rule.as_ref()).unwrap();
    assert_eq!(run.silent_split(), None);
    for (r, o) in run.ranks.iter().enumerate().take(n - f) {
        match (r, &o.result) {
            (_, RankResult::Failed(Error::Disagreement { agreeing, .. })) => {
                let expected: Vec<usize> = if r == 0 { vec![0] } else { vec![1, 2, 3, 4] };
                assert_eq!(agreeing, &expected, "rank {r}");
            }
            (_, other) => panic!("rank {r} must be told: {other:?}"),
        }
    }
    // Enforce: the echo decides what most ranks got, rank 0 recovers it from the others, and
    // every honest rank ends with the same bits, inside the honest range.
    s.agreement = Agreement::Enforce;
    let run = s.run_data(Algorithm::Gather, &data, rule.as_ref()).unwrap();
    assert_eq!(run.divergence(), None);
    assert!(data.reference(rule.as_ref()).check(&run).is_ok());
    let victim = &run.ranks[0];
    assert!(
        victim
            .warnings
            .iter()
            .any(|w| w.contains("recovering the agreed one")),
        "{:?}",
        victim.warnings
    );
    for o in run.ranks.iter().filter(|o| o.role == Role::Honest) {
        let found = o
            .agreement
            .as_ref()
            .expect("Enforce ends with the cross-check");
        assert_eq!(found.differing_inputs, (n - f..n).collect::<Vec<_>>());
        assert!(o.faults.is_empty(), "{:?}", o.faults);
    }
    // A victim outside the world is refused.
    s.adversary.equivocation_victim = Some(n);
    let refused = s.run_data(Algorithm::Gather, &data, rule.as_ref());
    assert!(
        matches!(refused, Err(SimError::InvalidConfig(_))),
        "{refused:?}"
    );
}

#[test]
fn every_rule_runs_in_every_mode_the_runtime_supports() {
    // The simulator runs the runtime's round, so sharded mode takes the Krum family, the
    // iterative rules and mixing as the runtime does, with the gather result for
    // coordinate-wise and selection rules.
    let (n, f) = (7, 1);
    let s = scenario(n);
    let data = DataSet::generate(&s, 4 * n + 3).unwrap();
    for name in [
        "median",
        "trimmed-mean",
        "krum",
        "multi-krum",
        "geometric-median",
        "nnm+median",
    ] {
        let rule = by_name(name, f).unwrap();
        let gather = s.run_data(Algorithm::Gather, &data, rule.as_ref()).unwrap();
        let want = results(&gather);
        let run = s
            .run_data(Algorithm::tolerant(n, f), &data, rule.as_ref())
            .unwrap();
        let got = results(&run);
        for o in &run.ranks {
            assert!(
                o.agreement
                    .as_ref()
                    .is_some_and(|a| a == &Default::default()),
                "{name}"
            );
        }
        if name.contains("krum") || name == "median" || name == "trimmed-mean" {
            assert_eq!(
                got.iter().map(|v| bits(v)).collect::<Vec<_>>(),
                want.iter().map(|v| bits(v)).collect::<Vec<_>>(),
                "{name}"
            );
        } else {
            // Every rank holds bitwise the same result, close to gather's.
            assert!(got.windows(2).all(|w| bits(&w[0]) == bits(&w[1])), "{name}");
            for (a, b) in got[0].iter().zip(&want[0]) {
                assert!(
                    (a - b).abs() <= 1e-3 * (1.0 + b.abs()),
                    "{name}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn sixteen_bit_runs_hold_values_of_their_type_and_match_the_rule_run_in_it() {
    use byzcoll_aggregators::{aggregate_into, DType, Element};
    fn of_type(dtype: DType, v: &[f32]) -> bool {
        v.iter().all(|&x| match dtype {
            DType::BF16 => half::bf16::from_f32(x).to_f32().to_bits() == x.to_bits(),
            _ => half::f16::from_f32(x).to_f32().to_bits() == x.to_bits(),
        })
    }
    /// `rule` run directly on `data`'s inputs as vectors of `T`, widened back.
    fn direct<T: Element>(rule: &dyn Aggregator, data: &DataSet) -> Vec<f32> {
        let held: Vec<Vec<T>> = (0..data.ranks())
            .map(|r| {
                data.input(r)
                    .iter()
                    .map(|&x| T::from_f64(x.into()))
                    .collect()
            })
            .collect();
        let refs: Vec<&[T]> = held.iter().map(Vec::as_slice).collect();
        let mut out = vec![T::from_f64(0.0); data.d()];
        aggregate_into(rule, &refs, &mut out).unwrap();
        out.iter().map(|x| x.to_f64() as f32).collect()
    }
    let (n, f) = (7, 2);
    for dtype in [DType::BF16, DType::F16] {
        let mut s = scenario(n);
        s.dtype = dtype;
        let d = 4 * n + 3;
        let data = DataSet::generate(&s, d).unwrap();
        assert_eq!(data.dtype(), dtype);
        assert!((0..n).all(|r| of_type(dtype, data.input(r))), "{dtype:?}");
        for name in ["median", "trimmed-mean", "mean", "krum", "multi-krum"] {
            let f = if name == "mean" {
                0
            } else {
                f.min((n - 3) / 2)
            };
            let rule = by_name(name, f).unwrap();
            let want = match dtype {
                DType::BF16 => direct::<half::bf16>(rule.as_ref(), &data),
                _ => direct::<half::f16>(rule.as_ref(), &data),
            };
            assert_eq!(
                bits(data.reference(rule.as_ref()).gather().unwrap()),
                bits(&want),
                "{dtype:?} {name}"
            );
            for algorithm in [Algorithm::Gather, Algorithm::tolerant(n, f)] {
                let run = s.run_data(algorithm, &data, rule.as_ref()).unwrap();
                for got in results(&run) {
                    assert_eq!(bits(&got), bits(&want), "{dtype:?} {name} {algorithm}");
                }
            }
        }
        // The mean of the same inputs rounds differently in f32: the rule ran in the narrow
        // type, not in f32 with its result rounded afterwards (or not at all).
        let mean = by_name("mean", 0).unwrap();
        let f32_mean = {
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| data.input(r).to_vec()).collect();
            let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
            let mut out = vec![0.0f32; d];
            aggregate_into(mean.as_ref(), &refs, &mut out).unwrap();
            out
        };
        let narrow = results(&s.run_data(Algorithm::Gather, &data, mean.as_ref()).unwrap());
        assert_ne!(bits(&narrow[0]), bits(&f32_mean), "{dtype:?}");
        assert!(of_type(dtype, &narrow[0]), "{dtype:?}");
        // Ring SUM rounds each partial sum to the type, within the check's bound.
        let ring = s
            .run_data(Algorithm::RingSum, &data, mean.as_ref())
            .unwrap();
        for got in results(&ring) {
            assert!(of_type(dtype, &got), "{dtype:?}");
        }
        assert!(
            data.reference(mean.as_ref()).check(&ring).is_ok(),
            "{dtype:?}"
        );
        // Data of another type than the scenario's is refused, as is f64.
        let f32_data = DataSet::generate(&scenario(n), d).unwrap();
        assert!(matches!(
            s.run_data(Algorithm::Gather, &f32_data, mean.as_ref()),
            Err(SimError::InvalidConfig(_))
        ));
    }
    let mut s = scenario(4);
    s.dtype = DType::F64;
    assert!(matches!(
        DataSet::generate(&s, 8),
        Err(SimError::Unsupported(why)) if why.contains("f64")
    ));
    // Explicit inputs become bf16 ones only where every value is one.
    let exact = DataSet::new(vec![vec![1.0, 256.0], vec![-3.5, 0.0]], vec![false; 2]).unwrap();
    assert_eq!(exact.typed(DType::BF16).unwrap().dtype(), DType::BF16);
    let inexact = DataSet::new(vec![vec![1.0, 257.0], vec![0.0, 0.0]], vec![false; 2]).unwrap();
    assert!(matches!(
        inexact.typed(DType::BF16),
        Err(SimError::InvalidConfig(why)) if why.contains("rank 0, coordinate 1")
    ));
}
