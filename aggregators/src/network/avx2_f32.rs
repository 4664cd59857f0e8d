use std::arch::x86_64::{
    __m256, __m256i, _mm256_add_pd, _mm256_and_si256, _mm256_castps256_ps128, _mm256_castps_si256,
    _mm256_castsi256_ps, _mm256_cmpeq_epi32, _mm256_cmpgt_epi32, _mm256_cvtpd_ps, _mm256_cvtps_pd,
    _mm256_extractf128_ps, _mm256_max_epi32, _mm256_min_epi32, _mm256_movemask_ps, _mm256_mul_pd,
    _mm256_or_si256, _mm256_set1_epi32, _mm256_set1_pd, _mm256_set_m128, _mm256_setzero_pd,
    _mm256_srai_epi32, _mm256_srli_epi32, _mm256_xor_si256,
};

use super::FINITE_KEYS;

/// Largest `n` taken.
pub(super) const INPUTS: usize = 32;

/// Sorts every column of the first 16 inputs completely (so whatever rows a rule reads
/// are in place) with the 16-wire network in registers, 8 columns at a time: each column's
/// keys (`f32` total-order keys, as [`crate::Element::key`] makes them) are padded with
/// `i32::MAX`, the largest key, which sorts after every real key (ties are
/// indistinguishable), so rows `0..n` end up exactly the sorted column. With more than 16
/// inputs the others are sorted the same way into rows `16..32` (padded to 16 rows with
/// the largest key) and the halves merged by `merge` (comparators on 32 wires). `rows`:
/// `n` rows of `width` keys, or 32 rows when `n > 16`.
#[target_feature(enable = "avx2")]
pub(super) fn sort_block(
    inputs: &[&[u32]],
    base: usize,
    width: usize,
    rows: &mut [i32],
    merge: &[(usize, usize)],
) {
    let (low, high) = inputs.split_at(inputs.len().min(16));
    sort_block_16(low, base, width, rows);
    if !high.is_empty() {
        sort_block_16(high, base, width, &mut rows[16 * width..]);
        // Pad the second half to 16 rows with the largest key.
        let filled = 16 * width + high.len() * width;
        rows[filled..32 * width].fill(i32::MAX);
        super::apply(rows, width, merge);
    }
}

macro_rules! sort_block_with {
    ($name:ident, $wires:literal, $network:ident, $each:ident) => {
        #[target_feature(enable = "avx2")]
        fn $name(inputs: &[&[u32]], base: usize, width: usize, rows: &mut [i32]) {
            let n = inputs.len();
            let top = _mm256_set1_epi32(i32::MAX);
            let mut start = 0;
            while start < width {
                let lanes = (width - start).min(8);
                let load = |i: usize| -> __m256i {
                    let mut bits = [0u32; 8];
                    let src = &inputs[i][base + start..base + start + lanes];
                    match <&[u32; 8]>::try_from(src) {
                        Ok(full) => bits = *full,
                        Err(_) => bits[..lanes].copy_from_slice(src),
                    }
                    let b: __m256i = bytemuck::cast(bits);
                    // The key of `crate::Element::key` for `f32`: flip the magnitude bits
                    // of negative values.
                    _mm256_xor_si256(b, _mm256_srli_epi32::<1>(_mm256_srai_epi32::<31>(b)))
                };
                let mut v = [top; $wires];
                macro_rules! load {
                    ($i:literal) => {
                        if $i < n {
                            v[$i] = load($i);
                        }
                    };
                }
                $each!(load);
                macro_rules! cs {
                    ($a:literal, $b:literal) => {
                        let (x, y) = (v[$a], v[$b]);
                        v[$a] = _mm256_min_epi32(x, y);
                        v[$b] = _mm256_max_epi32(x, y);
                    };
                }
                $network!(cs);
                macro_rules! store {
                    ($i:literal) => {
                        if $i < n {
                            let keys: [i32; 8] = bytemuck::cast(v[$i]);
                            let at = $i * width + start;
                            let dst = &mut rows[at..at + lanes];
                            match <&mut [i32; 8]>::try_from(&mut *dst) {
                                Ok(full) => *full = keys,
                                Err(_) => dst.copy_from_slice(&keys[..lanes]),
                            }
                        }
                    };
                }
                $each!(store);
                start += lanes;
            }
        }
    };
}

sort_block_with!(sort_block_16, 16, merge_exchange_16, each_of_16);

/// [`super::fused`] on `out.len()` coordinates from `base`, `n = inputs.len()` in `1..=16`
/// (and `2f < n`): the offset in `out` of the first non-finite result, and whether some
/// input value read is not finite.
#[target_feature(enable = "avx2")]
pub(super) fn fused(
    inputs: &[&[u32]],
    base: usize,
    out: &mut [f32],
    finish: super::Finish,
) -> (Result<(), usize>, bool) {
    macro_rules! by_n {
        ($($n:literal)*) => {
            match inputs.len() {
                $($n => fused_n::<$n>(inputs, base, out, finish),)*
                other => unreachable!("the fused path takes 1..=16 inputs, not {other}"),
            }
        };
    }
    by_n!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
}

/// The `f32` bits of total-order keys (the key map is its own inverse).
macro_rules! bits_of {
    ($k:expr) => {{
        let k = $k;
        _mm256_castsi256_ps(_mm256_xor_si256(
            k,
            _mm256_srli_epi32::<1>(_mm256_srai_epi32::<31>(k)),
        ))
    }};
}

/// The two `f64` halves of 8 `f32` lanes (lanes 0..4, 4..8).
macro_rules! widen {
    ($x:expr) => {{
        let x: __m256 = $x;
        (
            _mm256_cvtps_pd(_mm256_castps256_ps128(x)),
            _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x)),
        )
    }};
}

/// `lanes` (at most 8) elements of `row` from `at` as the bits of 8 lanes (the rest 0).
macro_rules! load8 {
    ($row:expr, $at:expr, $lanes:expr) => {{
        let mut bits = [0u32; 8];
        let src = &$row[$at..$at + $lanes];
        match <&[u32; 8]>::try_from(src) {
            Ok(full) => bits = *full,
            Err(_) => bits[..$lanes].copy_from_slice(src),
        }
        bytemuck::cast::<_, __m256i>(bits)
    }};
}

/// Stores the first `lanes` lanes of `result` at `out[start..]`; the offset in `out` of
/// the first of them that is not finite.
macro_rules! store8 {
    ($result:expr, $out:expr, $start:expr, $lanes:expr) => {{
        let (result, start, lanes) = ($result, $start, $lanes);
        let exponent = _mm256_set1_epi32(0x7f80_0000);
        let as_bits = _mm256_castps_si256(result);
        let bad = _mm256_cmpeq_epi32(_mm256_and_si256(as_bits, exponent), exponent);
        let bad = (_mm256_movemask_ps(_mm256_castsi256_ps(bad)) as u32) & ((1u32 << lanes) - 1);
        let values: [f32; 8] = bytemuck::cast(result);
        let dst = &mut $out[start..start + lanes];
        match <&mut [f32; 8]>::try_from(&mut *dst) {
            Ok(full) => *full = values,
            Err(_) => dst.copy_from_slice(&values[..lanes]),
        }
        (bad != 0).then(|| start + bad.trailing_zeros() as usize)
    }};
}

/// [`super::mean_in_order`] on `out.len()` coordinates from `base`: the offset in `out`
/// of the first non-finite result.
#[target_feature(enable = "avx2")]
pub(super) fn mean_in_order(inputs: &[&[u32]], base: usize, out: &mut [f32]) -> Result<(), usize> {
    let width = out.len();
    let scale = _mm256_set1_pd(1.0 / inputs.len() as f64);
    // Every coordinate is written, the first non-finite one remembered.
    let mut first_bad = None;
    let mut start = 0;
    while start < width {
        let lanes = (width - start).min(8);
        let at = base + start;
        let (mut a0, mut a1) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        for row in inputs {
            if at.is_multiple_of(16) {
                super::prefetch_ahead(row, at, inputs.len());
            }
            let (x0, x1) = widen!(_mm256_castsi256_ps(load8!(row, at, lanes)));
            a0 = _mm256_add_pd(a0, x0);
            a1 = _mm256_add_pd(a1, x1);
        }
        let result = _mm256_set_m128(
            _mm256_cvtpd_ps(_mm256_mul_pd(a1, scale)),
            _mm256_cvtpd_ps(_mm256_mul_pd(a0, scale)),
        );
        let bad = store8!(result, out, start, lanes);
        first_bad = first_bad.or(bad);
        start += lanes;
    }
    first_bad.map_or(Ok(()), Err)
}

#[target_feature(enable = "avx2")]
fn fused_n<const N: usize>(
    inputs: &[&[u32]],
    base: usize,
    out: &mut [f32],
    finish: super::Finish,
) -> (Result<(), usize>, bool) {
    let width = out.len();
    let top = _mm256_set1_epi32(i32::MAX);
    // The largest and smallest key of every column sorted, per lane.
    let (mut largest, mut smallest) = (_mm256_set1_epi32(i32::MIN), top);
    let half = _mm256_set1_pd(0.5);
    let (lo_rank, hi_rank, scale) = match finish {
        super::Finish::Median | super::Finish::Nearest { .. } => (0, 0, 0.0),
        super::Finish::Trimmed { f } => (f, N - f, 1.0 / (N - 2 * f) as f64),
    };
    let scale = _mm256_set1_pd(scale);
    // Every coordinate is written, the first non-finite one remembered.
    let mut first_bad = None;
    let mut start = 0;
    while start < width {
        let lanes = (width - start).min(8);
        if (base + start).is_multiple_of(16) {
            // Once per line.
            inputs
                .iter()
                .for_each(|row| super::prefetch_ahead(row, base + start, N));
        }
        let mut v = [top; 16];
        macro_rules! load {
            ($i:literal) => {
                if $i < N {
                    let b = load8!(inputs[$i], base + start, lanes);
                    v[$i] = _mm256_xor_si256(b, _mm256_srli_epi32::<1>(_mm256_srai_epi32::<31>(b)));
                }
            };
        }
        each_of_16!(load);
        macro_rules! cs {
            ($a:literal, $b:literal) => {
                let (x, y) = (v[$a], v[$b]);
                v[$a] = _mm256_min_epi32(x, y);
                v[$b] = _mm256_max_epi32(x, y);
            };
        }
        merge_exchange_16!(cs);
        largest = _mm256_max_epi32(largest, v[N - 1]);
        smallest = _mm256_min_epi32(smallest, v[0]);
        let result = match finish {
            super::Finish::Median if N % 2 == 1 => bits_of!(v[N / 2]),
            super::Finish::Median => {
                let (l0, l1) = widen!(bits_of!(v[N / 2 - 1]));
                let (h0, h1) = widen!(bits_of!(v[N / 2]));
                // Rounded to nearest as `as f32` does.
                _mm256_set_m128(
                    _mm256_cvtpd_ps(_mm256_add_pd(
                        _mm256_mul_pd(l1, half),
                        _mm256_mul_pd(h1, half),
                    )),
                    _mm256_cvtpd_ps(_mm256_add_pd(
                        _mm256_mul_pd(l0, half),
                        _mm256_mul_pd(h0, half),
                    )),
                )
            }
            super::Finish::Trimmed { .. } => {
                let (mut a0, mut a1) = (_mm256_setzero_pd(), _mm256_setzero_pd());
                macro_rules! add {
                    ($i:literal) => {
                        if $i < N && $i >= lo_rank && $i < hi_rank {
                            let (x0, x1) = widen!(bits_of!(v[$i]));
                            a0 = _mm256_add_pd(a0, x0);
                            a1 = _mm256_add_pd(a1, x1);
                        }
                    };
                }
                each_of_16!(add);
                _mm256_set_m128(
                    _mm256_cvtpd_ps(_mm256_mul_pd(a1, scale)),
                    _mm256_cvtpd_ps(_mm256_mul_pd(a0, scale)),
                )
            }
            super::Finish::Nearest { beta } => {
                let mut rows = [0i32; 8 * 16];
                macro_rules! spill {
                    ($i:literal) => {
                        if $i < N {
                            rows[$i * 8..$i * 8 + 8]
                                .copy_from_slice(&bytemuck::cast::<__m256i, [i32; 8]>(v[$i]));
                        }
                    };
                }
                each_of_16!(spill);
                let means = super::nearest_mean_lanes::<f32>(&rows, N, 8, 0, 8, beta);
                bytemuck::cast::<[f32; 8], __m256>(std::array::from_fn(|c| means[c] as f32))
            }
        };
        let bad = store8!(result, out, start, lanes);
        first_bad = first_bad.or(bad);
        start += lanes;
    }
    // Infinities and NaNs have the keys beyond those of `f32::MAX` and `-f32::MAX`.
    let above = _mm256_cmpgt_epi32(largest, _mm256_set1_epi32(FINITE_KEYS.1));
    let below = _mm256_cmpgt_epi32(_mm256_set1_epi32(FINITE_KEYS.0), smallest);
    let outside = _mm256_castsi256_ps(_mm256_or_si256(above, below));
    let suspect = _mm256_movemask_ps(outside) != 0;
    (first_bad.map_or(Ok(()), Err), suspect)
}
