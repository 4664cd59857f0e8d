//! The CUDA kernels run under the CPU emulation (`byzcoll-cuda-emu`, which compiles the same
//! `kernels/robust.cu` as C++ over emulated grids) and are checked against the CPU rules of
//! `byzcoll-aggregators`, with the launch geometry of `byzcoll_cuda::plan`. This is where the
//! kernels' logic is tested on machines without a GPU; `tests/device.rs` runs them for real.
//!
//! Tolerances: f32 results of the sorting-network path (n ≤ 64), Multi-Krum's mean and Bulyan's
//! phase are bitwise those of the CPU rules (same order statistics, same f64 sums in the same
//! order). The selection path (n > 64) sums the kept values in another order: relative 1e-12 of
//! the largest kept magnitude before rounding to f32, so at most one f32 ulp. Distances: relative
//! 1e-5 (f32 chunks of 32 terms).

use byzcoll_aggregators::distance::{finite_inputs, pairwise_sq_distances};
use byzcoll_aggregators::{aggregate_into, build, AggError, Params};
use byzcoll_cuda::plan::{self, Mode};
use byzcoll_cuda_emu::{self as emu, elem, Grid, NONE_BAD};
mod common;

use common::{assert_close, inputs};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn views(x: &[Vec<f32>]) -> Vec<&[f32]> {
    x.iter().map(|v| v.as_slice()).collect()
}

/// A small grid so grid-stride loops wrap several times.
fn small_grid(d: usize, threads: u32) -> Grid {
    Grid {
        blocks: plan::blocks(d, threads, 2, 2),
        threads,
    }
}

fn run_coordinate(mode: Mode, x: &[&[f32]], f: usize, out: &mut [f32]) -> u64 {
    let n = x.len();
    if n <= plan::NETWORK_MAX_INPUTS {
        let ranks = plan::ranks(mode, n, f);
        let network = plan::network(n, ranks.clone());
        emu::coordinate_network(
            elem::F32,
            x,
            out,
            &network,
            mode.code(),
            ranks,
            small_grid(out.len(), plan::COORDINATE_THREADS),
        )
    } else {
        emu::coordinate_select(
            elem::F32,
            x,
            out,
            f,
            mode.code(),
            small_grid(out.len(), plan::SELECT_THREADS),
            plan::select_shared_bytes(n),
        )
    }
}

fn cpu(rule: &str, f: usize, x: &[&[f32]], d: usize) -> Result<Vec<f32>, AggError> {
    let mut out = vec![0.0f32; d];
    aggregate_into(
        &*build(
            rule,
            &Params {
                f,
                ..Params::default()
            },
        )?,
        x,
        &mut out,
    )?;
    Ok(out)
}

#[test]
fn median_and_trimmed_mean_match_the_cpu_rules_for_every_n() {
    let mut rng = StdRng::seed_from_u64(7);
    let sizes: Vec<usize> = (1..=18).chain([31, 32, 33, 63, 64, 65, 100, 129]).collect();
    for n in sizes {
        let d = 300 + n; // not a multiple of any block size
        let x = inputs(&mut rng, n, d);
        let x = views(&x);
        for f in [0, (n - 1) / 4, (n - 1) / 2] {
            for (mode, rule) in [(Mode::Median, "median"), (Mode::Trimmed, "trimmed-mean")] {
                let mut got = vec![0.0f32; d];
                let bad = run_coordinate(mode, &x, f, &mut got);
                assert_eq!(bad, NONE_BAD, "{rule} n = {n} f = {f}");
                let want = cpu(rule, f, &x, d).expect("cpu rule");
                let what = format!("{rule} n = {n} f = {f}");
                if n <= plan::NETWORK_MAX_INPUTS {
                    assert_eq!(got, want, "{what}: network path must be bitwise");
                } else {
                    assert_close(&got, &want, &what);
                }
            }
        }
    }
}

#[test]
fn ties_and_repeated_values_keep_the_right_ranks() {
    // Few distinct values: selection's tie counting and the networks see many equal keys.
    let mut rng = StdRng::seed_from_u64(8);
    for n in [5, 8, 64, 65, 90] {
        let d = 257;
        let x: Vec<Vec<f32>> = (0..n)
            .map(|_| (0..d).map(|_| rng.gen_range(-2..=2) as f32 * 0.5).collect())
            .collect();
        let x = views(&x);
        for f in [0, 1, (n - 1) / 2] {
            for (mode, rule) in [(Mode::Median, "median"), (Mode::Trimmed, "trimmed-mean")] {
                let mut got = vec![0.0f32; d];
                assert_eq!(run_coordinate(mode, &x, f, &mut got), NONE_BAD);
                let want = cpu(rule, f, &x, d).expect("cpu rule");
                assert_close(&got, &want, &format!("{rule} n = {n} f = {f} with ties"));
            }
        }
    }
}

/// f NaN / ±inf inputs are discarded exactly as on the CPU; f + 1 make the call fail at the
/// first coordinate they reach, never produce NaN silently.
#[test]
fn non_finite_inputs_follow_the_cpu_policy() {
    let mut rng = StdRng::seed_from_u64(9);
    for n in [5, 7, 8, 33, 64, 65, 101] {
        let f = (n - 1) / 2;
        let d = 200;
        let mut x = inputs(&mut rng, n, d);
        let poison = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN];
        for (i, v) in x.iter_mut().take(f).enumerate() {
            for (j, c) in v.iter_mut().enumerate() {
                *c = poison[(i + j) % 4];
            }
        }
        let xs = views(&x);
        for (mode, rule) in [(Mode::Median, "median"), (Mode::Trimmed, "trimmed-mean")] {
            let mut got = vec![0.0f32; d];
            assert_eq!(
                run_coordinate(mode, &xs, f, &mut got),
                NONE_BAD,
                "{rule} n = {n}"
            );
            assert!(got.iter().all(|v| v.is_finite()), "{rule} n = {n}");
            let want = cpu(rule, f, &xs, d).expect("f non-finite inputs are tolerated");
            assert_close(
                &got,
                &want,
                &format!("{rule} n = {n} with f poisoned inputs"),
            );
        }
        // f + 1 NaN at coordinate 37, all at the same end of the order.
        for v in x.iter_mut().take(f + 1) {
            v[37] = f32::NAN;
        }
        let xs = views(&x);
        let mut got = vec![0.0f32; d];
        let bad = run_coordinate(Mode::Trimmed, &xs, f, &mut got);
        assert_eq!(
            bad, 37,
            "trimmed mean n = {n}: the coordinate with f + 1 NaN"
        );
        match cpu("trimmed-mean", f, &xs, d) {
            Err(AggError::NonFiniteResult { coordinate, .. }) => assert_eq!(coordinate, 37),
            other => panic!("cpu rule: {other:?}"),
        }
    }
}

#[test]
fn bf16_and_f16_inputs_are_read_and_rounded_like_the_cpu_rules_on_their_values() {
    let mut rng = StdRng::seed_from_u64(10);
    for n in [4, 7, 16, 65] {
        let d = 301;
        let x = inputs(&mut rng, n, d);
        for code in [elem::BF16, elem::F16] {
            type Convert = (fn(f32) -> u16, fn(u16) -> f32);
            let (to, from): Convert = if code == elem::BF16 {
                (
                    |v| half::bf16::from_f32(v).to_bits(),
                    |b| half::bf16::from_bits(b).to_f32(),
                )
            } else {
                (
                    |v| half::f16::from_f32(v).to_bits(),
                    |b| half::f16::from_bits(b).to_f32(),
                )
            };
            let bits: Vec<Vec<u16>> = x
                .iter()
                .map(|v| v.iter().map(|&c| to(c)).collect())
                .collect();
            let widened: Vec<Vec<f32>> = bits
                .iter()
                .map(|v| v.iter().map(|&b| from(b)).collect())
                .collect();
            let rows: Vec<&[u16]> = bits.iter().map(|v| v.as_slice()).collect();
            for (mode, rule) in [(Mode::Median, "median"), (Mode::Trimmed, "trimmed-mean")] {
                for f in [(n - 1) / 4, (n - 1) / 2] {
                    let mut got = vec![0u16; d];
                    let bad = if n <= plan::NETWORK_MAX_INPUTS {
                        let ranks = plan::ranks(mode, n, f);
                        emu::coordinate_network(
                            code,
                            &rows,
                            &mut got,
                            &plan::network(n, ranks.clone()),
                            mode.code(),
                            ranks,
                            small_grid(d, plan::COORDINATE_THREADS),
                        )
                    } else {
                        emu::coordinate_select(
                            code,
                            &rows,
                            &mut got,
                            f,
                            mode.code(),
                            small_grid(d, plan::SELECT_THREADS),
                            plan::select_shared_bytes(n),
                        )
                    };
                    assert_eq!(bad, NONE_BAD);
                    let want = cpu(rule, f, &views(&widened), d).expect("cpu rule");
                    let want: Vec<u16> = want.iter().map(|&v| to(v)).collect();
                    let what = format!("{rule} of {n} inputs, f = {f}, element code {code}");
                    if n <= plan::NETWORK_MAX_INPUTS || mode == Mode::Median {
                        assert_eq!(got, want, "{what}");
                    } else {
                        // Sums in another order: at most one step of the element type apart.
                        for (j, (&g, &w)) in got.iter().zip(&want).enumerate() {
                            assert!(
                                g.abs_diff(w) <= 1,
                                "{what}: coordinate {j}: {g:#x} vs {w:#x}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Krum, Multi-Krum and Bulyan: the tiled distance table against the CPU table, then the CPU
/// selection on it and the finish kernels against the CPU rules.
#[test]
fn krum_family_distances_selection_and_finish_match_the_cpu_rules() {
    let mut rng = StdRng::seed_from_u64(11);
    for n in [7, 11, 16, 19, 32, 33, 64, 65, 70] {
        let d = 1000 + n;
        let mut x = inputs(&mut rng, n, d);
        let f = (n - 3) / 4;
        // f Byzantine inputs far away, one of them with a NaN.
        for v in x.iter_mut().take(f) {
            v.iter_mut().for_each(|c| *c = *c * -50.0 + 3.0);
        }
        if f > 0 {
            x[0][5] = f32::NAN;
        }
        let xs = views(&x);

        let tiles = plan::distance_tiles(n);
        let splits = plan::distance_splits(d, tiles.len(), 2);
        let got = emu::distances(
            elem::F32,
            plan::distance_tile(n),
            &xs,
            d,
            &tiles,
            splits,
            small_grid(tiles.len() * 1024, 256),
        );
        let finite = finite_inputs(&xs);
        let want = pairwise_sq_distances(&xs, &finite);
        for i in 0..n {
            assert_eq!(got.flags[i] != 0, !finite[i], "flag of input {i}");
            for j in 0..n {
                let (g, w) = (got.table[i * n + j], want[i * n + j]);
                if w.is_finite() {
                    assert!((g - w).abs() <= w * 1e-5, "n = {n} d({i},{j}) = {g} vs {w}");
                }
            }
        }
        let mut table = got.table.clone();
        for i in 0..n {
            for j in 0..n {
                if got.flags[i] != 0 || got.flags[j] != 0 {
                    table[i * n + j] = f64::INFINITY;
                }
            }
        }

        for rule in ["krum", "multi-krum", "bulyan"] {
            let params = Params {
                f,
                ..Params::default()
            };
            let reference = build(rule, &params).expect("rule");
            if reference.check(n).is_err() {
                continue;
            }
            let selection = reference.distance_selection().expect("a selection rule");
            let selected = selection.select(&table, n).expect("selection");
            assert_eq!(
                selected,
                selection.select(&want, n).expect("cpu"),
                "{rule} n = {n}"
            );
            let chosen: Vec<&[f32]> = selected.iter().map(|&i| xs[i]).collect();
            let mut out = vec![0.0f32; d];
            let bad = if rule == "bulyan" {
                let m = chosen.len();
                emu::bulyan_network(
                    elem::F32,
                    &chosen,
                    &mut out,
                    &plan::network(m, 0..m),
                    m - 2 * f,
                    small_grid(d, plan::COORDINATE_THREADS),
                )
            } else {
                emu::mean_rows(
                    elem::F32,
                    &chosen,
                    &mut out,
                    small_grid(d, plan::COORDINATE_THREADS),
                )
            };
            assert_eq!(bad, NONE_BAD);
            let want_out = cpu(rule, f, &xs, d).expect("cpu rule");
            assert_eq!(out, want_out, "{rule} n = {n}: finish must be bitwise");
        }
    }
}

/// Nearly equal vectors: the table comes from differences, so tiny distances stay positive
/// and accurate (the |a|² + |b|² - 2ab shortcut returns 0 or negatives here).
#[test]
fn distances_of_nearly_equal_vectors_do_not_cancel() {
    let d = 4096;
    let base: Vec<f32> = (0..d).map(|j| 1000.0 + (j % 97) as f32).collect();
    let x: Vec<Vec<f32>> = (0..5)
        .map(|i| {
            base.iter()
                .enumerate()
                .map(|(j, &b)| {
                    if j % 7 == i {
                        f32::from_bits(b.to_bits() + 1)
                    } else {
                        b
                    }
                })
                .collect()
        })
        .collect();
    let xs = views(&x);
    let tiles = plan::distance_tiles(5);
    let got = emu::distances(
        elem::F32,
        plan::distance_tile(xs.len()),
        &xs,
        d,
        &tiles,
        3,
        small_grid(4096, 256),
    );
    let want = pairwise_sq_distances(&xs, &finite_inputs(&xs));
    for i in 0..5 {
        for j in 0..5 {
            let (g, w) = (got.table[i * 5 + j], want[i * 5 + j]);
            if i != j {
                assert!(
                    w > 0.0 && (g - w).abs() <= w * 1e-6,
                    "d({i},{j}) = {g} vs {w}"
                );
            }
        }
    }
}

/// Values whose squared differences overflow f32 are redone in f64 and stay finite.
#[test]
fn distances_that_overflow_float_are_redone_in_double() {
    let d = 100;
    let x: Vec<Vec<f32>> = vec![vec![1e30; d], vec![-1e30; d], vec![0.5; d]];
    let xs = views(&x);
    let got = emu::distances(
        elem::F32,
        plan::distance_tile(3),
        &xs,
        d,
        &plan::distance_tiles(3),
        2,
        small_grid(4096, 256),
    );
    let want = pairwise_sq_distances(&xs, &finite_inputs(&xs));
    assert!(got.flags.iter().all(|&f| f == 0));
    for (k, (g, w)) in got.table.iter().zip(&want).enumerate() {
        assert!(
            g.is_finite() && (g - w).abs() <= w * 1e-6,
            "entry {k}: {g} vs {w}"
        );
    }
}
