use super::*;

/// The `f32` kernels: AVX-512 (`wide`) or AVX2.
#[cfg(target_arch = "x86_64")]
fn f32_kernels(wide: bool) -> Kernels {
    match wide {
        true => Kernels::Avx512F32,
        false => Kernels::Avx2F32,
    }
}

#[test]
fn networks_sort_every_zero_one_input() {
    // The 0-1 principle: a comparator network sorts everything iff it sorts all 0/1 inputs.
    for n in 1..=12usize {
        let net = merge_exchange(n);
        for bits in 0u32..(1 << n) {
            let mut v: Vec<u8> = (0..n).map(|i| ((bits >> i) & 1) as u8).collect();
            apply(&mut v, 1, &net);
            assert!(v.windows(2).all(|w| w[0] <= w[1]), "n={n} bits={bits:b}");
        }
    }
}

/// Both fused paths (AVX2 and AVX-512, where the CPU has them) against sorting each
/// column and finishing it in scalar code: bitwise the same results, the same first
/// non-finite coordinate and exactly the inputs holding NaN or infinities, for every `n`
/// they take, tails of every length and several rayon blocks, with NaN, infinities, signed
/// zeros and the largest finite values in some of the inputs (and none in the others).
#[cfg(target_arch = "x86_64")]
#[test]
fn fused_paths_give_bitwise_the_sorted_column_finish() {
    let Some(paths) = crate::testing::register_paths() else {
        return;
    };
    let specials = [
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        3e38,
        f32::MAX,
        -f32::MAX,
    ];
    let mut next = crate::testing::xorshift(0x9e37_79b9_7f4a_7c15u64);
    for n in 1..=32usize {
        for d in [
            1,
            5,
            8,
            15,
            16,
            17,
            33,
            FUSED_BLOCK + 3,
            2 * FUSED_BLOCK + 21,
        ] {
            for special_rate in [0, 40] {
                let rows: Vec<Vec<f32>> = (0..n)
                    .map(|_| {
                        // One input in three has no special values at all.
                        let rate = match next() % 3 {
                            0 => 0,
                            _ => special_rate,
                        };
                        (0..d)
                            .map(|_| match next() % 1000 < rate {
                                true => specials[(next() % 8) as usize],
                                false => (next() % 2001) as f32 * 0.37 - 370.0,
                            })
                            .collect()
                    })
                    .collect();
                let want_non_finite: Vec<usize> = (0..n)
                    .filter(|&i| rows[i].iter().any(|v| !v.is_finite()))
                    .collect();
                let inputs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
                let columns: Vec<Vec<f32>> = (0..d)
                    .map(|c| {
                        let mut col: Vec<f32> = rows.iter().map(|r| r[c]).collect();
                        col.sort_by(f32::total_cmp);
                        col
                    })
                    .collect();
                let mut finishes = vec![Finish::Median];
                for f in [0, (n - 1) / 4, (n - 1) / 2] {
                    finishes.push(Finish::Trimmed { f });
                }
                for finish in finishes {
                    let want: Vec<f32> = columns
                        .iter()
                        .map(|col| match finish {
                            Finish::Median if n % 2 == 1 => col[n / 2],
                            Finish::Median => {
                                (col[n / 2 - 1] as f64 * 0.5 + col[n / 2] as f64 * 0.5) as f32
                            }
                            Finish::Trimmed { f } => {
                                let sum = col[f..n - f].iter().fold(0.0f64, |a, &v| a + v as f64);
                                (sum * (1.0 / (n - 2 * f) as f64)) as f32
                            }
                            Finish::Nearest { .. } => unreachable!("tested on its own"),
                        })
                        .collect();
                    let first_bad = want.iter().position(|v| !v.is_finite());
                    // AVX2 takes at most 16 inputs.
                    for &wide in paths.iter().filter(|&&wide| wide || n <= 16) {
                        let mut out = vec![0.0f32; d];
                        let got = fused_on(&inputs, &mut out, finish, f32_kernels(wide));
                        let what =
                            format!("wide {wide} n {n} d {d} {finish:?} rate {special_rate}");
                        assert_eq!(got.non_finite, want_non_finite, "{what}");
                        let got = got.result;
                        match first_bad {
                            Some(c) => assert_eq!(got, Err(c), "{what}"),
                            None => {
                                assert_eq!(got, Ok(()), "{what}");
                                let as_bits =
                                    |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                                assert_eq!(as_bits(&out), as_bits(&want), "{what}");
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Bulyan's finish on both register paths against the shrinking loop, bitwise: every `n`
/// and `beta`, data full of ties, signed zeros, huge values whose differences round and
/// subnormals (Bulyan only ever finishes finite inputs), tails and several rayon blocks.
#[cfg(target_arch = "x86_64")]
#[test]
fn fused_nearest_mean_is_the_shrinking_loop() {
    let Some(paths) = crate::testing::register_paths() else {
        return;
    };
    let mut next = crate::testing::xorshift(0x2545_f491_4f6c_dd1du64);
    for n in 1..=32usize {
        for beta in 1..=n {
            let d = [1usize, 15, 17, 33, FUSED_BLOCK + 9][(n + beta) % 5];
            let rows = crate::testing::tie_rows(&mut next, n, d);
            let inputs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
            let want: Vec<f32> = (0..d)
                .map(|c| {
                    let mut col: Vec<f32> = rows.iter().map(|r| r[c]).collect();
                    col.sort_by(f32::total_cmp);
                    crate::krum::nearest_mean(n, beta, |i| col[i] as f64) as f32
                })
                .collect();
            let first_bad = want.iter().position(|v| !v.is_finite());
            for &wide in paths.iter().filter(|&&wide| wide || n <= 16) {
                let mut out = vec![0.0f32; d];
                let got = fused_on(
                    &inputs,
                    &mut out,
                    Finish::Nearest { beta },
                    f32_kernels(wide),
                );
                let what = format!("wide {wide} n {n} beta {beta} d {d}");
                assert_eq!(got.result, first_bad.map_or(Ok(()), Err), "{what}");
                let as_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(as_bits(&out), as_bits(&want), "{what}");
            }
        }
    }
}

/// Both in-order mean paths against the scalar `acc += x as f64` loop: bitwise, every
/// coordinate written, and the first non-finite coordinate named, for counts past the
/// sorting paths' 32, tails of every length and several rayon blocks.
#[cfg(target_arch = "x86_64")]
#[test]
fn mean_paths_give_bitwise_the_scalar_sum() {
    let Some(paths) = crate::testing::register_paths() else {
        return;
    };
    let mut next = crate::testing::xorshift(0x2545_f491_4f6c_dd1du64);
    for n in [1usize, 2, 3, 10, 16, 33, 47] {
        for d in [1, 7, 16, 17, 31, FUSED_BLOCK + 9, 2 * FUSED_BLOCK + 30] {
            for poisoned in [false, true] {
                let rows: Vec<Vec<f32>> = (0..n)
                    .map(|_| {
                        (0..d)
                            .map(|_| match poisoned && next().is_multiple_of(500) {
                                true => f32::INFINITY,
                                false => (next() % 100_001) as f32 * 1.3e-3 - 65.0,
                            })
                            .collect()
                    })
                    .collect();
                let inputs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
                let want: Vec<f32> = (0..d)
                    .map(|c| {
                        let sum = rows.iter().fold(0.0f64, |a, r| a + r[c] as f64);
                        (sum * (1.0 / n as f64)) as f32
                    })
                    .collect();
                let first_bad = want.iter().position(|v| !v.is_finite());
                for &wide in &paths {
                    let mut out = vec![0.0f32; d];
                    let got = mean_on(&inputs, &mut out, f32_kernels(wide));
                    let what = format!("wide {wide} n {n} d {d} poisoned {poisoned}");
                    assert_eq!(got, first_bad.map_or(Ok(()), Err), "{what}");
                    let as_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(as_bits(&out), as_bits(&want), "{what}");
                }
            }
        }
    }
}

#[test]
fn the_spelled_out_merge_is_odd_even_merge_32() {
    let mut spelled = Vec::new();
    macro_rules! cs {
        ($a:literal, $b:literal) => {
            spelled.push(($a, $b));
        };
    }
    odd_even_merge_32!(cs);
    assert_eq!(spelled, odd_even_merge(32));
}

#[test]
fn the_spelled_out_network_is_merge_exchange_16() {
    let mut spelled = Vec::new();
    macro_rules! cs {
        ($a:literal, $b:literal) => {
            spelled.push(($a, $b));
        };
    }
    merge_exchange_16!(cs);
    assert_eq!(spelled, merge_exchange(16));
}

#[test]
fn odd_even_merge_merges_every_zero_one_pair_of_sorted_halves() {
    // The 0-1 principle restricted to sorted halves: a halves' content is its count of 0s.
    let net = odd_even_merge(32);
    for zeros_low in 0..=16 {
        for zeros_high in 0..=16 {
            let mut v: Vec<u8> = (0..16)
                .map(|i| u8::from(i >= zeros_low))
                .chain((0..16).map(|i| u8::from(i >= zeros_high)))
                .collect();
            apply(&mut v, 1, &net);
            assert!(
                v.windows(2).all(|w| w[0] <= w[1]),
                "{zeros_low} {zeros_high}"
            );
        }
    }
}

#[test]
fn pruned_networks_still_place_the_needed_wires() {
    for n in [1usize, 2, 3, 7, 16, 33, 64] {
        let mid = n / 2;
        let net = pruned(n, mid.saturating_sub(1)..mid + 1);
        assert!(net.len() <= merge_exchange(n).len());
        for seed in 0..50u64 {
            let v: Vec<i64> = (0..n as u64)
                .map(|i| ((i * 7919 + seed * 104_729) % 1009) as i64)
                .collect();
            let mut got = v.clone();
            apply(&mut got, 1, &net);
            let mut want = v;
            want.sort_unstable();
            assert_eq!(got[mid], want[mid], "n={n}");
            if mid > 0 {
                assert_eq!(got[mid - 1], want[mid - 1], "n={n}");
            }
        }
    }
}

/// The 16-bit kernels' bounds of finite keys are the sign-extended keys of `∓MAX`.
#[cfg(target_arch = "x86_64")]
#[test]
fn sixteen_bit_finite_keys_are_those_of_the_largest_values() {
    let keys = |max: f64, from_f64: fn(f64) -> i16| (from_f64(-max) as i32, from_f64(max) as i32);
    let bf16 = |v: f64| half::bf16::from_f64(v).key();
    let f16 = |v: f64| half::f16::from_f64(v).key();
    assert_eq!(keys(half::bf16::MAX.to_f64(), bf16), BF16_FINITE_KEYS);
    assert_eq!(keys(half::f16::MAX.to_f64(), f16), F16_FINITE_KEYS);
}
