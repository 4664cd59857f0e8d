use std::arch::x86_64::{
    __m128, __m128i, __m256, __m256d, __m256i, _mm256_add_epi32, _mm256_add_pd, _mm256_and_pd,
    _mm256_and_si256, _mm256_blendv_epi8, _mm256_castpd_si256, _mm256_castps256_ps128,
    _mm256_castps_si256, _mm256_castsi256_pd, _mm256_castsi256_ps, _mm256_castsi256_si128,
    _mm256_cmp_pd, _mm256_cmpeq_epi32, _mm256_cmpgt_epi32, _mm256_cvtepi16_epi32,
    _mm256_cvtepu16_epi32, _mm256_cvtpd_ps, _mm256_cvtph_ps, _mm256_cvtps_pd, _mm256_cvtps_ph,
    _mm256_extractf128_ps, _mm256_extracti128_si256, _mm256_max_epi32, _mm256_min_epi32,
    _mm256_movemask_ps, _mm256_mul_pd, _mm256_or_si256, _mm256_permutevar8x32_epi32,
    _mm256_set1_epi32, _mm256_set1_epi64x, _mm256_set1_pd, _mm256_set_m128, _mm256_set_m128i,
    _mm256_setr_epi32, _mm256_setzero_pd, _mm256_slli_epi32, _mm256_srai_epi32, _mm256_srli_epi32,
    _mm256_xor_si256, _mm_add_epi32, _mm_and_si128, _mm_castps_si128, _mm_cmpeq_epi16,
    _mm_movemask_epi8, _mm_or_si128, _mm_packs_epi16, _mm_packs_epi32, _mm_packus_epi32,
    _mm_set1_epi16, _mm_set1_epi32, _mm_setzero_si128, _CMP_GT_OQ, _CMP_NEQ_UQ,
    _MM_FROUND_TO_NEAREST_INT,
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

/// `$n::<N>` for `N` in `1..=16`.
macro_rules! by_n {
    ($n:ident, $inputs:ident, $base:ident, $out:ident, $finish:ident) => {
        by_n!(@ $n, $inputs, $base, $out, $finish; 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
    };
    (@ $n:ident, $inputs:ident, $base:ident, $out:ident, $finish:ident; $($m:literal)*) => {
        match $inputs.len() {
            $($m => $n::<$m>($inputs, $base, $out, $finish),)*
            other => unreachable!("the fused path takes 1..=16 inputs, not {other}"),
        }
    };
}

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
    by_n!(fused_n, inputs, base, out, finish)
}

/// [`fused`] for `bf16` bits: sorted on 16-bit keys in 32-bit lanes, sums in `f64` narrowed
/// once, correctly rounded ([`crate::Element::from_f64`]); not Bulyan's finish.
#[target_feature(enable = "avx2")]
pub(super) fn fused_bf16(
    inputs: &[&[u16]],
    base: usize,
    out: &mut [u16],
    finish: super::Finish,
) -> (Result<(), usize>, bool) {
    by_n!(fused_bf16_n, inputs, base, out, finish)
}

/// [`fused_bf16`] for `f16` bits (F16C widens and narrows).
#[target_feature(enable = "avx2,f16c")]
pub(super) fn fused_f16(
    inputs: &[&[u16]],
    base: usize,
    out: &mut [u16],
    finish: super::Finish,
) -> (Result<(), usize>, bool) {
    by_n!(fused_f16_n, inputs, base, out, finish)
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

/// Keys from 16-bit patterns sign-extended to 32 bits, and back: the 16-bit key
/// ([`crate::Element::key`]) sign-extended, so the 32-bit order is the 16-bit one.
macro_rules! flip16 {
    ($k:expr) => {{
        let k: __m256i = $k;
        _mm256_xor_si256(k, _mm256_srli_epi32::<17>(_mm256_srai_epi32::<31>(k)))
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

/// 8 `f32` lanes from two `f64` halves, each rounded to nearest as `as f32` does.
macro_rules! narrow {
    ($lo:expr, $hi:expr) => {{
        let (lo, hi) = ($lo, $hi);
        _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo))
    }};
}

/// 4 `f64` lanes as `f32` bits rounded to odd: toward zero (the nearest, one step back
/// towards zero where it was above in magnitude), the last bit set if that was inexact;
/// see the AVX-512 kernels' `odd!` for why that rounds the 16-bit types once.
macro_rules! odd {
    ($x:expr) => {{
        let x: __m256d = $x;
        let y: __m128 = _mm256_cvtpd_ps(x);
        let back = _mm256_cvtps_pd(y);
        let magnitude = _mm256_castsi256_pd(_mm256_set1_epi64x(i64::MAX));
        let above = _mm256_cmp_pd::<_CMP_GT_OQ>(
            _mm256_and_pd(back, magnitude),
            _mm256_and_pd(x, magnitude),
        );
        let inexact = _mm256_cmp_pd::<_CMP_NEQ_UQ>(back, x);
        // The 64-bit masks' low halves, as 32-bit lanes.
        let low = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
        macro_rules! to32 {
            ($m:expr) => {
                _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(_mm256_castpd_si256($m), low))
            };
        }
        let (above, inexact) = (to32!(above), to32!(inexact));
        // `above` is -1 where the nearest was the larger magnitude.
        let toward_zero = _mm_add_epi32(_mm_castps_si128(y), above);
        _mm_or_si128(toward_zero, _mm_and_si128(inexact, _mm_set1_epi32(1)))
    }};
}

/// 8 lanes of `f32` bits rounded to odd ([`odd`]) from two `f64` halves.
macro_rules! narrow_odd {
    ($lo:expr, $hi:expr) => {{
        let lo = odd!($lo);
        _mm256_set_m128i(odd!($hi), lo)
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

/// As [`load8`] for 16-bit elements, in 8 lanes of 16 bits.
macro_rules! load8_half {
    ($row:expr, $at:expr, $lanes:expr) => {{
        let mut bits = [0u16; 8];
        let src = &$row[$at..$at + $lanes];
        match <&[u16; 8]>::try_from(src) {
            Ok(full) => bits = *full,
            Err(_) => bits[..$lanes].copy_from_slice(src),
        }
        bytemuck::cast::<_, __m128i>(bits)
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

/// As [`store8`] for 8 lanes of 16-bit elements whose exponent field is `$exponent`.
macro_rules! store8_half {
    ($result:expr, $out:expr, $start:expr, $lanes:expr, $exponent:expr) => {{
        let (result, start, lanes): (__m128i, usize, usize) = ($result, $start, $lanes);
        let exponent = _mm_set1_epi16($exponent);
        let bad = _mm_cmpeq_epi16(_mm_and_si128(result, exponent), exponent);
        let bad = _mm_movemask_epi8(_mm_packs_epi16(bad, _mm_setzero_si128())) as u32;
        let bad = bad & ((1u32 << lanes) - 1);
        let values: [u16; 8] = bytemuck::cast(result);
        let dst = &mut $out[start..start + lanes];
        match <&mut [u16; 8]>::try_from(&mut *dst) {
            Ok(full) => *full = values,
            Err(_) => dst.copy_from_slice(&values[..lanes]),
        }
        (bad != 0).then(|| start + bad.trailing_zeros() as usize)
    }};
}

// How each element type enters and leaves the kernels, as in the AVX-512 ones, on 8 lanes:
// `key!(row, at, lanes)`, `value!(key)`, `load!(row, at, lanes)`, `exact!(key)`,
// `round!(lo, hi)`, `store!(result, out, start, lanes)`.

macro_rules! f32_key {
    ($row:expr, $at:expr, $lanes:expr) => {{
        let b = load8!($row, $at, $lanes);
        _mm256_xor_si256(b, _mm256_srli_epi32::<1>(_mm256_srai_epi32::<31>(b)))
    }};
}
macro_rules! f32_value {
    ($k:expr) => {
        bits_of!($k)
    };
}
macro_rules! f32_load {
    ($row:expr, $at:expr, $lanes:expr) => {
        _mm256_castsi256_ps(load8!($row, $at, $lanes))
    };
}
macro_rules! f32_store {
    ($result:expr, $out:expr, $start:expr, $lanes:expr) => {
        store8!($result, $out, $start, $lanes)
    };
}

macro_rules! half_key {
    ($row:expr, $at:expr, $lanes:expr) => {
        flip16!(_mm256_cvtepi16_epi32(load8_half!($row, $at, $lanes)))
    };
}
/// The 16 bits of sign-extended keys, packed (the saturation never bites).
macro_rules! half_exact {
    ($k:expr) => {{
        let b = flip16!($k);
        _mm_packs_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256::<1>(b))
    }};
}

macro_rules! bf16_value {
    ($k:expr) => {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(flip16!($k)))
    };
}
macro_rules! bf16_load {
    ($row:expr, $at:expr, $lanes:expr) => {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(load8_half!(
            $row, $at, $lanes
        ))))
    };
}
/// To nearest, ties to even, on the bits; a NaN keeps its leading bits.
macro_rules! bf16_round {
    ($lo:expr, $hi:expr) => {{
        let b = narrow_odd!($lo, $hi);
        let magnitude = _mm256_and_si256(b, _mm256_set1_epi32(0x7fff_ffff));
        let nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f80_0000));
        let even = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
        let bias = _mm256_add_epi32(even, _mm256_set1_epi32(0x7fff));
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, bias));
        let r = _mm256_blendv_epi8(rounded, _mm256_srli_epi32::<16>(b), nan);
        _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256::<1>(r))
    }};
}
macro_rules! bf16_store {
    ($result:expr, $out:expr, $start:expr, $lanes:expr) => {
        store8_half!($result, $out, $start, $lanes, 0x7f80)
    };
}

macro_rules! f16_value {
    ($k:expr) => {
        _mm256_cvtph_ps(half_exact!($k))
    };
}
macro_rules! f16_load {
    ($row:expr, $at:expr, $lanes:expr) => {
        _mm256_cvtph_ps(load8_half!($row, $at, $lanes))
    };
}
macro_rules! f16_round {
    ($lo:expr, $hi:expr) => {
        _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_castsi256_ps(narrow_odd!($lo, $hi)))
    };
}
macro_rules! f16_store {
    ($result:expr, $out:expr, $start:expr, $lanes:expr) => {
        store8_half!($result, $out, $start, $lanes, 0x7c00)
    };
}

/// [`super::mean_in_order`] on `out.len()` coordinates from `base`: the offset in `out`
/// of the first non-finite result.
macro_rules! mean_with {
    ($name:ident, $features:literal, $bits:ty, $out:ty, $load:ident, $round:ident, $store:ident) => {
        #[target_feature(enable = $features)]
        pub(super) fn $name(
            inputs: &[&[$bits]],
            base: usize,
            out: &mut [$out],
        ) -> Result<(), usize> {
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
                    let (x0, x1) = widen!($load!(row, at, lanes));
                    a0 = _mm256_add_pd(a0, x0);
                    a1 = _mm256_add_pd(a1, x1);
                }
                let result = $round!(_mm256_mul_pd(a0, scale), _mm256_mul_pd(a1, scale));
                first_bad = first_bad.or($store!(result, out, start, lanes));
                start += lanes;
            }
            first_bad.map_or(Ok(()), Err)
        }
    };
}

mean_with!(mean_in_order, "avx2", u32, f32, f32_load, narrow, f32_store);
mean_with!(
    mean_in_order_bf16,
    "avx2",
    u16,
    u16,
    bf16_load,
    bf16_round,
    bf16_store
);
mean_with!(
    mean_in_order_f16,
    "avx2,f16c",
    u16,
    u16,
    f16_load,
    f16_round,
    f16_store
);

/// Bulyan's finish of `f32` columns: the sorted keys spilled, finished in scalar code.
macro_rules! f32_nearest {
    ($v:ident, $n:ident, $beta:ident) => {{
        let mut rows = [0i32; 8 * 16];
        macro_rules! spill {
            ($i:literal) => {
                if $i < $n {
                    rows[$i * 8..$i * 8 + 8]
                        .copy_from_slice(&bytemuck::cast::<__m256i, [i32; 8]>($v[$i]));
                }
            };
        }
        each_of_16!(spill);
        let means = super::nearest_mean_lanes::<f32>(&rows, $n, 8, 0, 8, $beta);
        bytemuck::cast::<[f32; 8], __m256>(std::array::from_fn(|c| means[c] as f32))
    }};
}

/// Bulyan's finish is not taken for 16-bit elements ([`super::fused`] refuses it).
macro_rules! no_nearest {
    ($v:ident, $n:ident, $beta:ident) => {{
        let _ = $beta;
        unreachable!("Bulyan's finish of 16-bit elements takes the memory network")
    }};
}

/// `fused_n::<N>` for `N` up to 16, for the element type of the macros named.
macro_rules! fused_with {
    ($name:ident, $features:literal, $bits:ty, $out:ty, $finite:expr, $key:ident,
     $value:ident, $exact:ident, $round:ident, $store:ident, $nearest:ident) => {
        #[target_feature(enable = $features)]
        fn $name<const N: usize>(
            inputs: &[&[$bits]],
            base: usize,
            out: &mut [$out],
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
                    // Once per line of `f32`.
                    inputs
                        .iter()
                        .for_each(|row| super::prefetch_ahead(row, base + start, N));
                }
                let mut v = [top; 16];
                macro_rules! load {
                    ($i:literal) => {
                        if $i < N {
                            v[$i] = $key!(inputs[$i], base + start, lanes);
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
                    super::Finish::Median if N % 2 == 1 => $exact!(v[N / 2]),
                    super::Finish::Median => {
                        let (l0, l1) = widen!($value!(v[N / 2 - 1]));
                        let (h0, h1) = widen!($value!(v[N / 2]));
                        $round!(
                            _mm256_add_pd(_mm256_mul_pd(l0, half), _mm256_mul_pd(h0, half)),
                            _mm256_add_pd(_mm256_mul_pd(l1, half), _mm256_mul_pd(h1, half))
                        )
                    }
                    super::Finish::Trimmed { .. } => {
                        let (mut a0, mut a1) = (_mm256_setzero_pd(), _mm256_setzero_pd());
                        macro_rules! add {
                            ($i:literal) => {
                                if $i < N && $i >= lo_rank && $i < hi_rank {
                                    let (x0, x1) = widen!($value!(v[$i]));
                                    a0 = _mm256_add_pd(a0, x0);
                                    a1 = _mm256_add_pd(a1, x1);
                                }
                            };
                        }
                        each_of_16!(add);
                        $round!(_mm256_mul_pd(a0, scale), _mm256_mul_pd(a1, scale))
                    }
                    super::Finish::Nearest { beta } => $nearest!(v, N, beta),
                };
                first_bad = first_bad.or($store!(result, out, start, lanes));
                start += lanes;
            }
            // Infinities and NaNs have the keys beyond those of the largest finite values.
            let (low, high): (i32, i32) = $finite;
            let above = _mm256_cmpgt_epi32(largest, _mm256_set1_epi32(high));
            let below = _mm256_cmpgt_epi32(_mm256_set1_epi32(low), smallest);
            let outside = _mm256_castsi256_ps(_mm256_or_si256(above, below));
            let suspect = _mm256_movemask_ps(outside) != 0;
            (first_bad.map_or(Ok(()), Err), suspect)
        }
    };
}

fused_with!(
    fused_n,
    "avx2",
    u32,
    f32,
    FINITE_KEYS,
    f32_key,
    f32_value,
    f32_value,
    narrow,
    f32_store,
    f32_nearest
);
fused_with!(
    fused_bf16_n,
    "avx2",
    u16,
    u16,
    super::BF16_FINITE_KEYS,
    half_key,
    bf16_value,
    half_exact,
    bf16_round,
    bf16_store,
    no_nearest
);
fused_with!(
    fused_f16_n,
    "avx2,f16c",
    u16,
    u16,
    super::F16_FINITE_KEYS,
    half_key,
    f16_value,
    half_exact,
    f16_round,
    f16_store,
    no_nearest
);
