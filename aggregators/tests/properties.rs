//! Every rule against a plain, obviously correct reference on random shapes, f32 and f64;
//! every rule against every attack at its bound; preconditions exactly at the bound.

#![allow(clippy::unwrap_used)]

use byzcoll_aggregators::attacks::Attack;
use byzcoll_aggregators::{aggregate_into, build, AggError, Aggregator, Element, Params};
use proptest::prelude::*;
use rand::{rngs::StdRng, Rng, SeedableRng};

// ---------- references: f64, per coordinate or per pair, no cleverness ----------

fn column(x: &[Vec<f64>], j: usize) -> Vec<f64> {
    let mut c: Vec<f64> = x.iter().map(|v| v[j]).collect();
    c.sort_by(f64::total_cmp);
    c
}

fn ref_median(x: &[Vec<f64>]) -> Vec<f64> {
    let n = x.len();
    (0..x[0].len())
        .map(|j| {
            let c = column(x, j);
            if n % 2 == 1 {
                c[n / 2]
            } else {
                c[n / 2 - 1] * 0.5 + c[n / 2] * 0.5
            }
        })
        .collect()
}

fn ref_trimmed(x: &[Vec<f64>], f: usize) -> Vec<f64> {
    let n = x.len();
    (0..x[0].len())
        .map(|j| column(x, j)[f..n - f].iter().sum::<f64>() / (n - 2 * f) as f64)
        .collect()
}

fn dist2(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum()
}

fn ref_scores(x: &[Vec<f64>], active: &[usize], f: usize) -> Vec<f64> {
    let k = active.len().saturating_sub(f + 2);
    active
        .iter()
        .map(|&i| {
            let mut d: Vec<f64> = active
                .iter()
                .filter(|&&j| j != i)
                .map(|&j| dist2(&x[i], &x[j]))
                .collect();
            d.sort_by(f64::total_cmp);
            d[..k].iter().sum()
        })
        .collect()
}

fn best(scores: &[f64]) -> usize {
    let mut b = 0;
    for i in 1..scores.len() {
        if scores[i] < scores[b] {
            b = i;
        }
    }
    b
}

fn mean_of(x: &[Vec<f64>], idx: &[usize]) -> Vec<f64> {
    (0..x[0].len())
        .map(|j| idx.iter().map(|&i| x[i][j]).sum::<f64>() / idx.len() as f64)
        .collect()
}

fn ref_krum(x: &[Vec<f64>], f: usize) -> (Vec<f64>, Vec<usize>) {
    let all: Vec<usize> = (0..x.len()).collect();
    let b = best(&ref_scores(x, &all, f));
    (x[b].clone(), vec![b])
}

fn ref_multi_krum(x: &[Vec<f64>], f: usize) -> (Vec<f64>, Vec<usize>) {
    let all: Vec<usize> = (0..x.len()).collect();
    let s = ref_scores(x, &all, f);
    let mut order = all.clone();
    order.sort_by(|&a, &b| s[a].total_cmp(&s[b]).then(a.cmp(&b)));
    let mut sel = order[..x.len() - f].to_vec();
    sel.sort();
    (mean_of(x, &sel), sel)
}

fn ref_bulyan(x: &[Vec<f64>], f: usize) -> (Vec<f64>, Vec<usize>) {
    let n = x.len();
    let theta = n - 2 * f;
    let beta = theta - 2 * f;
    let mut active: Vec<usize> = (0..n).collect();
    let mut sel = Vec::new();
    for _ in 0..theta {
        let b = best(&ref_scores(x, &active, f));
        sel.push(active.remove(b));
    }
    let chosen: Vec<Vec<f64>> = sel.iter().map(|&i| x[i].clone()).collect();
    let med = ref_median(&chosen);
    let out = (0..x[0].len())
        .map(|j| {
            let mut c: Vec<f64> = chosen.iter().map(|v| v[j]).collect();
            c.sort_by(|a, b| (a - med[j]).abs().total_cmp(&(b - med[j]).abs()));
            c[..beta].iter().sum::<f64>() / beta as f64
        })
        .collect();
    (out, sel)
}

fn ref_geomed(x: &[Vec<f64>]) -> Vec<f64> {
    let mut z = ref_median(x);
    for _ in 0..100 {
        let w: Vec<f64> = x
            .iter()
            .map(|v| 1.0 / dist2(v, &z).sqrt().max(1e-6))
            .collect();
        let tw: f64 = w.iter().sum();
        let next: Vec<f64> = (0..z.len())
            .map(|j| x.iter().zip(&w).map(|(v, w)| w * v[j]).sum::<f64>() / tw)
            .collect();
        let change = dist2(&next, &z).sqrt();
        let size = z.iter().map(|v| v * v).sum::<f64>().sqrt();
        z = next;
        if change <= 1e-7 * size.max(f64::MIN_POSITIVE) {
            break;
        }
    }
    z
}

fn ref_cc(x: &[Vec<f64>], tau: f64) -> Vec<f64> {
    let mut v = ref_median(x);
    for _ in 0..3 {
        let mut step = vec![0.0; v.len()];
        for xi in x {
            let u: Vec<f64> = xi.iter().zip(&v).map(|(a, b)| a - b).collect();
            let norm = u.iter().map(|a| a * a).sum::<f64>().sqrt();
            let s = if norm <= tau { 1.0 } else { tau / norm };
            for (st, ui) in step.iter_mut().zip(&u) {
                *st += s * ui / x.len() as f64;
            }
        }
        for (vi, s) in v.iter_mut().zip(&step) {
            *vi += s;
        }
    }
    v
}

fn ref_nnm(x: &[Vec<f64>], f: usize) -> Vec<Vec<f64>> {
    let n = x.len();
    (0..n)
        .map(|i| {
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| {
                dist2(&x[i], &x[a])
                    .total_cmp(&dist2(&x[i], &x[b]))
                    .then(a.cmp(&b))
            });
            mean_of(x, &order[..n - f])
        })
        .collect()
}

// ---------- harness ----------

fn random(n: usize, d: usize, seed: u64) -> Vec<Vec<f64>> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| (0..d).map(|_| rng.gen_range(-4.0..4.0)).collect())
        .collect()
}

/// Runs `rule` on `x` converted to `T`; returns the output widened to f64 and the report.
fn run<T: Element>(
    rule: &dyn Aggregator,
    x: &[Vec<f64>],
) -> Result<(Vec<f64>, Option<Vec<usize>>), AggError> {
    let xt: Vec<Vec<T>> = x
        .iter()
        .map(|v| v.iter().map(|&a| T::from_f64(a)).collect())
        .collect();
    let refs: Vec<&[T]> = xt.iter().map(Vec::as_slice).collect();
    let mut out = vec![T::from_f64(0.0); x[0].len()];
    let report = aggregate_into(rule, &refs, &mut out)?;
    Ok((out.iter().map(|v| v.to_f64()).collect(), report.selected))
}

/// The inputs as the rule sees them (rounded to T), in f64.
fn rounded<T: Element>(x: &[Vec<f64>]) -> Vec<Vec<f64>> {
    x.iter()
        .map(|v| v.iter().map(|&a| T::from_f64(a).to_f64()).collect())
        .collect()
}

fn close(a: &[f64], b: &[f64], tol: f64) -> bool {
    a.iter()
        .zip(b)
        .all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
}

fn check_rule<T: Element>(
    name: &str,
    n: usize,
    d: usize,
    f: usize,
    seed: u64,
) -> Result<(), TestCaseError> {
    let tau = 2.0;
    let params = Params {
        f,
        tau: name.ends_with("centered-clipping").then_some(tau),
        ..Params::default()
    };
    let rule = build(name, &params).unwrap();
    let x = rounded::<T>(&random(n, d, seed));
    let eps = if T::DTYPE == byzcoll_aggregators::DType::F32 {
        1e-6
    } else {
        1e-12
    };
    let (got, selected) = run::<T>(rule.as_ref(), &x).unwrap();
    let (want, want_sel): (Vec<f64>, Option<Vec<usize>>) = match name {
        "median" => (ref_median(&x), None),
        "trimmed-mean" => (ref_trimmed(&x, f), None),
        "mean" => (mean_of(&x, &(0..n).collect::<Vec<_>>()), None),
        "krum" => {
            let (o, s) = ref_krum(&x, f);
            (o, Some(s))
        }
        "multi-krum" => {
            let (o, s) = ref_multi_krum(&x, f);
            (o, Some(s))
        }
        "bulyan" => {
            let (o, s) = ref_bulyan(&x, f);
            (o, Some(s))
        }
        "geometric-median" => (ref_geomed(&x), None),
        "centered-clipping" => (ref_cc(&x, tau), None),
        "nnm+median" => (ref_median(&ref_nnm(&x, f)), None),
        other => unreachable!("{other}"),
    };
    let tol = if name == "geometric-median" {
        1e-5
    } else {
        eps
    };
    prop_assert!(
        close(&got, &want, tol),
        "{name} n={n} d={d} f={f}: {:?} vs {:?}",
        &got[..d.min(4)],
        &want[..d.min(4)]
    );
    prop_assert_eq!(selected, want_sel, "{} n={} f={}", name, n, f);
    Ok(())
}

fn max_f(name: &str, n: usize) -> Option<usize> {
    let f = match name {
        "mean" => return Some(0),
        "krum" | "multi-krum" => (n.checked_sub(3)?) / 2,
        "bulyan" => (n.checked_sub(3)?) / 4,
        _ => (n.checked_sub(1)?) / 2,
    };
    Some(f)
}

const ALL_RULES: [&str; 9] = [
    "mean",
    "median",
    "trimmed-mean",
    "krum",
    "multi-krum",
    "bulyan",
    "geometric-median",
    "centered-clipping",
    "nnm+median",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn every_rule_matches_its_reference(n in 1usize..=40, d in 1usize..=1000, seed in any::<u64>(), frac in 0.0f64..=1.0, wide in any::<bool>()) {
        for name in ALL_RULES {
            let Some(fmax) = max_f(name, n) else { continue };
            // Krum-family references are O(n² d): keep their shapes moderate.
            let d = if matches!(name, "krum" | "multi-krum" | "bulyan" | "nnm+median") { d.min(200) } else { d };
            let f = ((fmax as f64) * frac).round() as usize;
            if wide {
                check_rule::<f64>(name, n, d, f, seed)?;
            } else {
                check_rule::<f32>(name, n, d, f, seed)?;
            }
        }
    }
}

#[test]
fn preconditions_fail_exactly_at_the_bound() {
    for name in ALL_RULES.iter().filter(|&&r| r != "mean") {
        for f in 0..5usize {
            let params = Params {
                f,
                tau: name.ends_with("clipping").then_some(1.0),
                ..Params::default()
            };
            let rule = build(name, &params).unwrap();
            let n_min = match *name {
                "krum" | "multi-krum" => 2 * f + 3,
                "bulyan" => 4 * f + 3,
                _ => 2 * f + 1,
            };
            assert!(rule.check(n_min).is_ok(), "{name} f={f} n={n_min}");
            if n_min > 0 {
                let err = rule.check(n_min - 1).unwrap_err();
                assert!(
                    matches!(err, AggError::Precondition { .. }),
                    "{name} f={f}: {err}"
                );
            }
        }
    }
}

/// Honest inputs around a common centre, f attackers at the rule's bound.
fn attacked(
    n: usize,
    f: usize,
    d: usize,
    attack: &Attack,
    seed: u64,
) -> (Vec<Vec<f64>>, Vec<Vec<f32>>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let centre: Vec<f64> = (0..d).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let honest: Vec<Vec<f32>> = (0..n - f)
        .map(|_| {
            centre
                .iter()
                .map(|c| (c + rng.gen_range(-0.01..0.01)) as f32)
                .collect()
        })
        .collect();
    let refs: Vec<&[f32]> = honest.iter().map(Vec::as_slice).collect();
    let mut all = honest.clone();
    for _ in 0..f {
        all.push(attack.forge(&refs));
    }
    (
        honest
            .iter()
            .map(|v| v.iter().map(|&a| a as f64).collect())
            .collect(),
        all,
    )
}

#[test]
fn every_rule_withstands_every_attack_at_its_bound() {
    for name in ALL_RULES.iter().filter(|&&r| r != "mean") {
        for f in [1usize, 2] {
            let n = match *name {
                "krum" | "multi-krum" => 2 * f + 3,
                "bulyan" => 4 * f + 3,
                _ => 2 * f + 1,
            };
            let d = 64;
            for attack in Attack::catalogue(n, f) {
                let (honest, inputs) = attacked(n, f, d, &attack, 11);
                let mu = mean_of(&honest, &(0..n - f).collect::<Vec<_>>());
                let spread = honest
                    .iter()
                    .map(|h| dist2(h, &mu).sqrt())
                    .fold(0.0, f64::max);
                let params = Params {
                    f,
                    tau: name.ends_with("clipping").then_some(spread),
                    ..Params::default()
                };
                let rule = build(name, &params).unwrap();
                let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
                let mut out = vec![0.0f32; d];
                let report = aggregate_into(rule.as_ref(), &refs, &mut out)
                    .unwrap_or_else(|e| panic!("{name} f={f} {attack:?}: {e}"));
                let out: Vec<f64> = out.iter().map(|&v| v as f64).collect();
                assert!(out.iter().all(|v| v.is_finite()), "{name} {attack:?}");
                match *name {
                    "median" | "trimmed-mean" => {
                        for (j, v) in out.iter().enumerate() {
                            let c = column(&honest, j);
                            assert!(
                                c[0] <= *v && *v <= c[c.len() - 1],
                                "{name} f={f} {attack:?} coordinate {j}"
                            );
                        }
                    }
                    _ => {
                        let off = dist2(&out, &mu).sqrt();
                        assert!(
                            off <= 4.0 * spread,
                            "{name} f={f} {attack:?}: {off} from the honest mean, spread {spread}"
                        );
                    }
                }
                // Krum and Multi-Krum pick honest inputs when attackers are far. (Bulyan's
                // repeated selection may take colluding identical attackers in its last rounds,
                // when few inputs remain; its coordinate-wise phase is what bounds it, checked
                // above.)
                let far = !matches!(attack, Attack::Alie { .. } | Attack::Mimic(_));
                let selecting = matches!(*name, "krum" | "multi-krum");
                if let (Some(sel), true) = (&report.selected, far && selecting) {
                    assert!(
                        sel.iter().all(|&i| i < n - f),
                        "{name} f={f} {attack:?} selected {sel:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn nan_and_infinities_never_come_out_of_robust_rules() {
    // One input all-NaN, one all +inf, f = 2, for every robust rule at its bound.
    for name in ALL_RULES.iter().filter(|&&r| r != "mean") {
        let f = 2;
        let n = match *name {
            "krum" | "multi-krum" => 2 * f + 3,
            "bulyan" => 4 * f + 3,
            _ => 2 * f + 1,
        };
        let mut x: Vec<Vec<f64>> = random(n - 2, 32, 5);
        x.push(vec![f64::NAN; 32]);
        x.push(vec![f64::INFINITY; 32]);
        let rule = build(
            name,
            &Params {
                f,
                tau: name.ends_with("clipping").then_some(1.0),
                ..Params::default()
            },
        )
        .unwrap();
        let (out, selected) = run::<f64>(rule.as_ref(), &x).unwrap();
        assert!(out.iter().all(|v| v.is_finite()), "{name}");
        if let Some(sel) = selected {
            assert!(
                sel.iter().all(|&i| i < n - 2),
                "{name} selected a non-finite input: {sel:?}"
            );
        }
    }
}
