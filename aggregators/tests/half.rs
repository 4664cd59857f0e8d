//! The 16-bit element types (`bf16`, `f16`): every rule against the same rule run in `f64` on
//! the same (widened) inputs.
//!
//! The bound, rule by rule, follows from where the rules round (see `Element`): order
//! statistics are exact in the narrow type, and every sum, mean and distance is taken in
//! `f64` on exactly widened values with the same operations in the same order as the `f64`
//! rule, then rounded once. So the narrow result is **bitwise** the `f64` result rounded to
//! nearest (ties to even): for the median, the trimmed mean, the mean, Krum, Multi-Krum,
//! Bulyan, and for the geometric median and centered clipping when `n` is odd (their start,
//! the coordinate-wise median, is then an input value, exact). Two places round twice, and
//! are checked against references that round where they do:
//! - for even `n` the geometric median and centered clipping start from the median rounded
//!   to the narrow type. Centered clipping's step `z ↦ z + mean_i clip_τ(x_i − z)` is
//!   1-Lipschitz in the ℓ2 norm (`v − clip_τ(v)` is a projection residual), so the result
//!   moves by at most the start's displacement `D = ‖round(m) − m‖₂`: `|out_j − ref_j| ≤ D`
//!   plus the final rounding (half an ulp of the narrow type at `|ref_j| + D`);
//! - NNM rounds each mixed input to the narrow type before the inner rule: its result is
//!   bitwise the inner rule's `f64` result on those rounded mixed inputs, rounded.

#![allow(clippy::unwrap_used)]

use byzcoll_aggregators::{aggregate_into, build, distance, AggError, Element, Params};
use half::{bf16, f16};

fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}

/// `n` rows of `d` values of `T`: mostly spread values, with ties, signed zeros, the
/// smallest subnormal and values near the type's largest.
fn rows<T: Element>(seed: u64, n: usize, d: usize, huge: f64, tiny: f64) -> Vec<Vec<T>> {
    let mut next = xorshift(seed);
    let palette = [-0.0, 0.0, 1.0, -1.0, 2.5, huge, -huge, 7.0];
    (0..n)
        .map(|_| {
            (0..d)
                .map(|_| {
                    let v = match next() % 5 {
                        0 => palette[(next() % palette.len() as u64) as usize],
                        1 => tiny * (next() % 3) as f64,
                        _ => ((next() % 20_000) as f64 - 10_000.0) * 0.0137,
                    };
                    T::from_f64(v)
                })
                .collect()
        })
        .collect()
}

fn widen<T: Element>(x: &[Vec<T>]) -> Vec<Vec<f64>> {
    x.iter()
        .map(|r| r.iter().map(|v| v.to_f64()).collect())
        .collect()
}

fn run<T: Element>(rule: &str, params: &Params, x: &[Vec<T>]) -> Result<Vec<T>, AggError> {
    let rule = build(rule, params)?;
    let refs: Vec<&[T]> = x.iter().map(Vec::as_slice).collect();
    let mut out = vec![T::from_f64(0.0); x[0].len()];
    aggregate_into(rule.as_ref(), &refs, &mut out).map(|_| out)
}

fn bits<T: Element>(x: &[T]) -> Vec<u64> {
    x.iter().map(|v| v.to_f64().to_bits()).collect()
}

fn params(rule: &str, f: usize) -> Params {
    Params {
        f,
        tau: rule.ends_with("centered-clipping").then_some(50.0),
        ..Params::default()
    }
}

/// The rules with the smallest `n` each takes at `f = 1`.
const RULES: &[(&str, usize)] = &[
    ("mean", 1),
    ("median", 3),
    ("trimmed-mean", 3),
    ("krum", 5),
    ("multi-krum", 5),
    ("bulyan", 7),
    ("geometric-median", 3),
    ("centered-clipping", 3),
    ("nnm+median", 3),
    ("nnm+trimmed-mean", 3),
    ("nnm+krum", 5),
];

/// Half an ulp of `T` at `v` (the largest rounding error at `v`), at least half the
/// smallest subnormal.
fn half_ulp(v: f64, significand: i32, min_sub: f64) -> f64 {
    let e = v.abs().max(f64::MIN_POSITIVE).log2().floor() as i32;
    (2f64.powi(e - significand) / 2.0).max(min_sub / 2.0)
}

/// Every rule on `T` against its `f64` run (see the module docs for the bounds).
fn against_f64<T: Element>(huge: f64, significand: i32, min_sub: f64) {
    for &(rule, least) in RULES {
        for n in [least, 7, 8, 11, 40] {
            if n < least || (n == 40 && rule.contains("bulyan")) {
                continue;
            }
            let f = usize::from(rule != "mean");
            let p = params(rule, f);
            for d in [1, 37, 1100] {
                let x: Vec<Vec<T>> = rows(n as u64 * 7919 + d as u64, n, d, huge, min_sub);
                let got = run(rule, &p, &x).unwrap();
                // The same bits twice.
                assert_eq!(bits(&run(rule, &p, &x).unwrap()), bits(&got), "{rule}");
                let wide = widen(&x);
                let want: Vec<f64> = if let Some(inner) = rule.strip_prefix("nnm+") {
                    // The mixed inputs rounded to `T`, as the rule does, then the inner rule.
                    let nnm = build(rule, &p).unwrap();
                    let mixing = nnm.distance_mixing().unwrap();
                    let wide_refs: Vec<&[f64]> = wide.iter().map(Vec::as_slice).collect();
                    let near = mixing
                        .neighbours(&distance::distance_table(&wide_refs), n)
                        .unwrap();
                    let refs: Vec<&[T]> = x.iter().map(Vec::as_slice).collect();
                    let mixed = byzcoll_aggregators::mix(&refs, &near);
                    run(inner, &p, &widen(&mixed)).unwrap()
                } else {
                    run(rule, &p, &wide).unwrap()
                };
                let rounded: Vec<T> = want.iter().map(|&v| T::from_f64(v)).collect();
                let starts_rounded =
                    n % 2 == 0 && (rule == "geometric-median" || rule == "centered-clipping");
                if !starts_rounded {
                    assert_eq!(bits(&got), bits(&rounded), "{rule} n {n} d {d}");
                    continue;
                }
                if rule == "geometric-median" {
                    // No Lipschitz bound for Weiszfeld's steps: only finite and near.
                    for (g, w) in got.iter().zip(&want) {
                        assert!(g.is_finite() && (g.to_f64() - w).abs() <= 1e-2 * (1.0 + w.abs()));
                    }
                    continue;
                }
                // Centered clipping from a rounded start: `D` and the final rounding.
                let median = run(
                    "median",
                    &Params {
                        f,
                        ..Params::default()
                    },
                    &wide,
                )
                .unwrap();
                let start_err = median
                    .iter()
                    .map(|&m| {
                        let r = T::from_f64(m).to_f64() - m;
                        r * r
                    })
                    .sum::<f64>()
                    .sqrt();
                for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                    let bound = start_err * (1.0 + 1e-9)
                        + half_ulp(w.abs() + start_err, significand, min_sub);
                    let err = (g.to_f64() - w).abs();
                    assert!(err <= bound, "{rule} n {n} d {d} at {j}: {err} > {bound}");
                }
            }
        }
    }
}

#[test]
fn bf16_rules_are_the_f64_rules_rounded_once() {
    against_f64::<bf16>(3.0e38, 7, 2f64.powi(-133));
}

#[test]
fn f16_rules_are_the_f64_rules_rounded_once() {
    against_f64::<f16>(6.0e4, 10, 2f64.powi(-24));
}

/// At most `f` non-finite values per coordinate never reach the result; more are refused
/// exactly as in `f64`, and no rule returns a NaN or an infinity.
fn non_finite<T: Element>(nan: T, inf: T) {
    for &(rule, least) in RULES {
        if rule == "mean" {
            continue;
        }
        let n = least.max(7);
        for bad in [1, 2] {
            let p = params(rule, 1);
            let mut x: Vec<Vec<T>> = rows(99 + n as u64, n, 20, 100.0, 0.0);
            for (k, row) in x.iter_mut().take(bad).enumerate() {
                row[3] = if k == 0 { nan } else { inf };
                row[11] = if k == 0 { inf.neg_like() } else { nan };
            }
            let got = run(rule, &p, &x);
            let want = run(rule, &p, &widen(&x));
            match (&got, &want) {
                (Ok(g), Ok(w)) => {
                    assert!(g.iter().all(|v| v.is_finite()), "{rule}: {g:?}");
                    if !rule.starts_with("nnm+") && !rule.ends_with("centered-clipping") {
                        let rounded: Vec<T> = w.iter().map(|&v| T::from_f64(v)).collect();
                        assert_eq!(bits(g), bits(&rounded), "{rule} with {bad} bad");
                    }
                }
                (Err(g), Err(w)) => assert_eq!(g, w, "{rule} with {bad} bad"),
                _ => panic!("{rule} with {bad} bad: {got:?} but in f64 {want:?}"),
            }
            assert!(
                bad == 2 || got.is_ok(),
                "{rule}: one bad input refused: {got:?}"
            );
        }
    }
}

trait Neg {
    fn neg_like(self) -> Self;
}

impl<T: Element> Neg for T {
    fn neg_like(self) -> Self {
        T::from_f64(-self.to_f64())
    }
}

#[test]
fn bf16_non_finite_inputs_never_reach_the_result() {
    non_finite(bf16::NAN, bf16::INFINITY);
}

#[test]
fn f16_non_finite_inputs_never_reach_the_result() {
    non_finite(f16::NAN, f16::INFINITY);
}

#[test]
fn mean_refuses_non_finite_narrow_inputs() {
    let x: Vec<Vec<f16>> = vec![vec![f16::ONE, f16::NAN], vec![f16::ONE, f16::ONE]];
    assert!(matches!(
        run("mean", &Params::default(), &x),
        Err(AggError::NonFiniteInputs { inputs, .. }) if inputs == vec![0]
    ));
}
