use super::FINITE_KEYS;
use std::arch::x86_64::{
    __m256i, __m512, __m512d, __m512i, _mm256_and_si256, _mm256_castpd_ps, _mm256_castps_pd,
    _mm256_castps_si256, _mm256_cmpeq_epi16_mask, _mm256_mask_or_epi32, _mm256_mask_storeu_epi16,
    _mm256_maskz_loadu_epi16, _mm256_set1_epi16, _mm256_set1_epi32, _mm512_add_epi32,
    _mm512_add_pd, _mm512_and_si512, _mm512_castpd256_pd512, _mm512_castpd_ps,
    _mm512_castps512_ps256, _mm512_castps_pd, _mm512_castps_si512, _mm512_castsi256_si512,
    _mm512_castsi512_ps, _mm512_cmp_pd_mask, _mm512_cmpeq_epi32_mask, _mm512_cmpgt_epi32_mask,
    _mm512_cmplt_epi32_mask, _mm512_cvt_roundpd_ps, _mm512_cvtepi16_epi32, _mm512_cvtepi32_epi16,
    _mm512_cvtepu16_epi32, _mm512_cvtpd_ps, _mm512_cvtph_ps, _mm512_cvtps_pd, _mm512_cvtps_ph,
    _mm512_extractf64x4_pd, _mm512_insertf64x4, _mm512_inserti64x4, _mm512_loadu_ps,
    _mm512_mask_mov_epi32, _mm512_mask_storeu_ps, _mm512_maskz_loadu_epi32, _mm512_max_epi32,
    _mm512_min_epi32, _mm512_mul_pd, _mm512_set1_epi32, _mm512_set1_pd, _mm512_setzero_pd,
    _mm512_slli_epi32, _mm512_srai_epi32, _mm512_srli_epi32, _mm512_storeu_si512, _mm512_xor_si512,
    _CMP_NEQ_UQ, _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT, _MM_FROUND_TO_ZERO,
};

/// `$n::<N>` for `N` in `1..=16` and `$n32::<N>` above, up to 32.
macro_rules! by_n {
    ($n:ident, $n32:ident, $inputs:ident, $base:ident, $out:ident, $finish:ident) => {
        by_n!(@ $n, $n32, $inputs, $base, $out, $finish;
              1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16;
              17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32)
    };
    (@ $n:ident, $n32:ident, $inputs:ident, $base:ident, $out:ident, $finish:ident;
     $($low:literal)*; $($high:literal)*) => {
        match $inputs.len() {
            $($low => $n::<$low>($inputs, $base, $out, $finish),)*
            $($high => $n32::<$high>($inputs, $base, $out, $finish),)*
            other => unreachable!("the fused path takes 1..=32 inputs, not {other}"),
        }
    };
}

/// [`super::fused`] on `out.len()` coordinates from `base` (`n = inputs.len()` in
/// `1..=32`, `2f < n`): the offset in `out` of the first non-finite result, and whether
/// some input value read is not finite.
#[target_feature(enable = "avx512f")]
pub(super) fn fused(
    inputs: &[&[u32]],
    base: usize,
    out: &mut [f32],
    finish: super::Finish,
) -> (Result<(), usize>, bool) {
    by_n!(fused_n, fused_n32, inputs, base, out, finish)
}

/// [`fused`] for `bf16` bits: sorted on 16-bit keys in 32-bit lanes, sums in `f64` narrowed
/// once, correctly rounded ([`crate::Element::from_f64`]); not Bulyan's finish.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) fn fused_bf16(
    inputs: &[&[u16]],
    base: usize,
    out: &mut [u16],
    finish: super::Finish,
) -> (Result<(), usize>, bool) {
    by_n!(fused_bf16_n, fused_bf16_n32, inputs, base, out, finish)
}

/// [`fused_bf16`] for `f16` bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) fn fused_f16(
    inputs: &[&[u16]],
    base: usize,
    out: &mut [u16],
    finish: super::Finish,
) -> (Result<(), usize>, bool) {
    by_n!(fused_f16_n, fused_f16_n32, inputs, base, out, finish)
}

/// The 32 wires sorted: each half of 16 by `merge_exchange(16)`, then the halves merged
/// by Batcher's odd-even merge (`$cs!(a, b)` on literal indices throughout).
macro_rules! two_halves_merged {
    ($cs:ident) => {
        merge_exchange_16!($cs);
        macro_rules! cs_high {
            ($a:literal, $b:literal) => {
                $cs!($a + 16, $b + 16);
            };
        }
        merge_exchange_16!(cs_high);
        odd_even_merge_32!($cs);
    };
}

/// Keys from `f32` bits and back (the map is its own inverse).
macro_rules! flip {
    ($k:expr) => {{
        let k: __m512i = $k;
        _mm512_xor_si512(k, _mm512_srli_epi32::<1>(_mm512_srai_epi32::<31>(k)))
    }};
}

/// Keys from 16-bit patterns sign-extended to 32 bits, and back: the 16-bit key
/// ([`crate::Element::key`]) sign-extended, so the 32-bit order is the 16-bit one.
macro_rules! flip16 {
    ($k:expr) => {{
        let k: __m512i = $k;
        _mm512_xor_si512(k, _mm512_srli_epi32::<17>(_mm512_srai_epi32::<31>(k)))
    }};
}

/// The two `f64` halves (lanes 0..8, 8..16) of 16 `f32` lanes.
macro_rules! widen {
    ($x:expr) => {{
        let x: __m512 = $x;
        (
            _mm512_cvtps_pd(_mm512_castps512_ps256(x)),
            _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                _mm512_castps_pd(x),
            ))),
        )
    }};
}

/// 16 `f32` lanes from two `f64` halves, each rounded to nearest as `as f32` does.
macro_rules! narrow {
    ($lo:expr, $hi:expr) => {{
        let lo = _mm512_cvtpd_ps($lo);
        let hi = _mm512_cvtpd_ps($hi);
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
            _mm256_castps_pd(hi),
        ))
    }};
}

/// 8 `f64` lanes as `f32` bits rounded to odd: toward zero, the last bit set if that was
/// inexact. Rounding that once more to 16 bits, to nearest, is rounding the `f64` once
/// (24 bits are at least 2 more than the 16-bit formats' 8 and 11, at every exponent of
/// theirs), so the 16-bit results are those of [`crate::Element::from_f64`]; a NaN stays a
/// quiet NaN with its leading payload bits, as there.
macro_rules! odd {
    ($x:expr) => {{
        let x: __m512d = $x;
        let y = _mm512_cvt_roundpd_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(x);
        let inexact = _mm512_cmp_pd_mask::<_CMP_NEQ_UQ>(_mm512_cvtps_pd(y), x);
        let y = _mm256_castps_si256(y);
        _mm256_mask_or_epi32(y, inexact, y, _mm256_set1_epi32(1))
    }};
}

/// 16 lanes of `f32` bits rounded to odd ([`odd`]) from two `f64` halves.
macro_rules! narrow_odd {
    ($lo:expr, $hi:expr) => {{
        let lo = odd!($lo);
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), odd!($hi))
    }};
}

/// The mask of the first `lanes` (at most 16) lanes.
fn lanes_mask(lanes: usize) -> u16 {
    if lanes == 16 {
        u16::MAX
    } else {
        (1u16 << lanes) - 1
    }
}

/// `lanes` (at most 16, `mask` their mask) elements of `row` from `at`, as bits; the
/// masked-off lanes are 0.
macro_rules! load16 {
    ($row:expr, $at:expr, $mask:expr, $lanes:expr) => {{
        let src = &$row[$at..$at + $lanes];
        // SAFETY: the mask covers exactly the elements of `src`.
        unsafe { _mm512_maskz_loadu_epi32($mask, src.as_ptr().cast()) }
    }};
}

/// As [`load16`] for 16-bit elements, in 16 lanes of 16 bits.
macro_rules! load16_half {
    ($row:expr, $at:expr, $mask:expr, $lanes:expr) => {{
        let src = &$row[$at..$at + $lanes];
        // SAFETY: the mask covers exactly the elements of `src`.
        unsafe { _mm256_maskz_loadu_epi16($mask, src.as_ptr().cast()) }
    }};
}

/// Stores the `lanes` masked lanes of `result` at `out[start..]`; the offset in `out` of
/// the first of them that is not finite.
macro_rules! store16 {
    ($result:expr, $out:expr, $start:expr, $mask:expr, $lanes:expr) => {{
        let (result, start, mask) = ($result, $start, $mask);
        let exponent = _mm512_set1_epi32(0x7f80_0000);
        let bad = _mm512_cmpeq_epi32_mask(
            _mm512_and_si512(_mm512_castps_si512(result), exponent),
            exponent,
        ) & mask;
        let dst = &mut $out[start..start + $lanes];
        // SAFETY: the mask covers exactly the elements of `dst`.
        unsafe { _mm512_mask_storeu_ps(dst.as_mut_ptr(), mask, result) };
        (bad != 0).then(|| start + bad.trailing_zeros() as usize)
    }};
}

/// As [`store16`] for 16 lanes of 16-bit elements whose exponent field is `$exponent`.
macro_rules! store16_half {
    ($result:expr, $out:expr, $start:expr, $mask:expr, $lanes:expr, $exponent:expr) => {{
        let (result, start, mask): (__m256i, usize, u16) = ($result, $start, $mask);
        let exponent = _mm256_set1_epi16($exponent);
        let bad = _mm256_cmpeq_epi16_mask(_mm256_and_si256(result, exponent), exponent) & mask;
        let dst = &mut $out[start..start + $lanes];
        // SAFETY: the mask covers exactly the elements of `dst`.
        unsafe { _mm256_mask_storeu_epi16(dst.as_mut_ptr().cast(), mask, result) };
        (bad != 0).then(|| start + bad.trailing_zeros() as usize)
    }};
}

// How each element type enters and leaves the kernels, as macros the kernels take by name:
// `key!(row, at, mask, lanes)`: 16 lanes of 32-bit total-order keys (the masked-off lanes
// hold the key of +0); `value!(key)`: their `f32` values; `load!(row, at, mask, lanes)`:
// 16 `f32` values; `exact!(key)`: the element a key stands for, as output lanes;
// `round!(lo, hi)`: output lanes from two `f64` halves, rounded once as
// `crate::Element::from_f64` does; `store!(lanes, out, start, mask, lanes)`.

macro_rules! f32_key {
    ($row:expr, $at:expr, $mask:expr, $lanes:expr) => {
        flip!(load16!($row, $at, $mask, $lanes))
    };
}
macro_rules! f32_value {
    ($k:expr) => {
        _mm512_castsi512_ps(flip!($k))
    };
}
macro_rules! f32_load {
    ($row:expr, $at:expr, $mask:expr, $lanes:expr) => {
        _mm512_castsi512_ps(load16!($row, $at, $mask, $lanes))
    };
}

macro_rules! half_key {
    ($row:expr, $at:expr, $mask:expr, $lanes:expr) => {
        flip16!(_mm512_cvtepi16_epi32(load16_half!(
            $row, $at, $mask, $lanes
        )))
    };
}
macro_rules! half_exact {
    ($k:expr) => {
        _mm512_cvtepi32_epi16(flip16!($k))
    };
}

macro_rules! bf16_value {
    ($k:expr) => {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(flip16!($k)))
    };
}
macro_rules! bf16_load {
    ($row:expr, $at:expr, $mask:expr, $lanes:expr) => {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            load16_half!($row, $at, $mask, $lanes),
        )))
    };
}
/// To nearest, ties to even, on the bits (the carry may reach the exponent, or infinity);
/// a NaN keeps its leading bits.
macro_rules! bf16_round {
    ($lo:expr, $hi:expr) => {{
        let b = narrow_odd!($lo, $hi);
        let magnitude = _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff));
        let nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7f80_0000));
        let even = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let bias = _mm512_add_epi32(even, _mm512_set1_epi32(0x7fff));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, bias));
        _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(
            rounded,
            nan,
            _mm512_srli_epi32::<16>(b),
        ))
    }};
}
macro_rules! bf16_store {
    ($result:expr, $out:expr, $start:expr, $mask:expr, $lanes:expr) => {
        store16_half!($result, $out, $start, $mask, $lanes, 0x7f80)
    };
}

macro_rules! f16_value {
    ($k:expr) => {
        _mm512_cvtph_ps(half_exact!($k))
    };
}
macro_rules! f16_load {
    ($row:expr, $at:expr, $mask:expr, $lanes:expr) => {
        _mm512_cvtph_ps(load16_half!($row, $at, $mask, $lanes))
    };
}
macro_rules! f16_round {
    ($lo:expr, $hi:expr) => {
        _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_castsi512_ps(
            narrow_odd!($lo, $hi),
        ))
    };
}
macro_rules! f16_store {
    ($result:expr, $out:expr, $start:expr, $mask:expr, $lanes:expr) => {
        store16_half!($result, $out, $start, $mask, $lanes, 0x7c00)
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
            let scale = _mm512_set1_pd(1.0 / inputs.len() as f64);
            // Every coordinate is written, the first non-finite one remembered.
            let mut first_bad = None;
            let mut start = 0;
            while start < width {
                let lanes = (width - start).min(16);
                let mask = lanes_mask(lanes);
                let at = base + start;
                let (mut a0, mut a1) = (_mm512_setzero_pd(), _mm512_setzero_pd());
                for row in inputs {
                    super::prefetch_ahead(row, at, inputs.len());
                    let (x0, x1) = widen!($load!(row, at, mask, lanes));
                    a0 = _mm512_add_pd(a0, x0);
                    a1 = _mm512_add_pd(a1, x1);
                }
                let result = $round!(_mm512_mul_pd(a0, scale), _mm512_mul_pd(a1, scale));
                first_bad = first_bad.or($store!(result, out, start, mask, lanes));
                start += lanes;
            }
            first_bad.map_or(Ok(()), Err)
        }
    };
}

mean_with!(
    mean_in_order,
    "avx512f",
    u32,
    f32,
    f32_load,
    narrow,
    store16
);
mean_with!(
    mean_in_order_bf16,
    "avx512f,avx512bw,avx512vl",
    u16,
    u16,
    bf16_load,
    bf16_round,
    bf16_store
);
mean_with!(
    mean_in_order_f16,
    "avx512f,avx512bw,avx512vl",
    u16,
    u16,
    f16_load,
    f16_round,
    f16_store
);

/// Bulyan's finish of `f32` columns: the sorted keys spilled, finished in scalar code.
macro_rules! f32_nearest {
    ($v:ident, $n:ident, $wires:literal, $each:ident, $beta:ident) => {{
        let mut rows = [0i32; 16 * $wires];
        macro_rules! spill {
            ($i:literal) => {
                if $i < $n {
                    let dst = &mut rows[$i * 16..$i * 16 + 16];
                    // SAFETY: `dst` holds exactly 16 `i32`.
                    unsafe { _mm512_storeu_si512(dst.as_mut_ptr().cast(), $v[$i]) };
                }
            };
        }
        $each!(spill);
        let means = super::nearest_mean_lanes::<f32>(&rows, $n, 16, 0, 16, $beta);
        let means: [f32; 16] = std::array::from_fn(|c| means[c] as f32);
        // SAFETY: `means` holds exactly 16 `f32`.
        unsafe { _mm512_loadu_ps(means.as_ptr()) }
    }};
}

/// Bulyan's finish is not taken for 16-bit elements ([`super::fused`] refuses it).
macro_rules! no_nearest {
    ($v:ident, $n:ident, $wires:literal, $each:ident, $beta:ident) => {{
        let _ = $beta;
        unreachable!("Bulyan's finish of 16-bit elements takes the memory network")
    }};
}

/// `fused_n::<N>` for `N` up to `$wires` (16: the network in registers; 32: two halves of
/// 16 sorted so, then Batcher's odd-even merge, also in registers), for the element type
/// of the macros named.
macro_rules! fused_with {
    ($name:ident, $wires:literal, $each:ident, $sort:ident, $features:literal, $bits:ty,
     $out:ty, $finite:expr, $key:ident, $value:ident, $exact:ident, $round:ident,
     $store:ident, $nearest:ident) => {
        #[target_feature(enable = $features)]
        fn $name<const N: usize>(
            inputs: &[&[$bits]],
            base: usize,
            out: &mut [$out],
            finish: super::Finish,
        ) -> (Result<(), usize>, bool) {
            let width = out.len();
            let top = _mm512_set1_epi32(i32::MAX);
            // The largest and smallest key of every column sorted, per lane.
            let (mut largest, mut smallest) = (_mm512_set1_epi32(i32::MIN), top);
            let half = _mm512_set1_pd(0.5);
            let (lo_rank, hi_rank, scale) = match finish {
                super::Finish::Median | super::Finish::Nearest { .. } => (0, 0, 0.0),
                super::Finish::Trimmed { f } => (f, N - f, 1.0 / (N - 2 * f) as f64),
            };
            let scale = _mm512_set1_pd(scale);
            // Every coordinate is written, the first non-finite one remembered.
            let mut first_bad = None;
            let mut start = 0;
            while start < width {
                let lanes = (width - start).min(16);
                let mask = lanes_mask(lanes);
                let at = base + start;
                let mut v = [top; $wires];
                macro_rules! load {
                    ($i:literal) => {
                        if $i < N {
                            super::prefetch_ahead(inputs[$i], at, N);
                            v[$i] = $key!(inputs[$i], at, mask, lanes);
                        }
                    };
                }
                $each!(load);
                macro_rules! cs {
                    ($a:expr, $b:expr) => {
                        let (x, y) = (v[$a], v[$b]);
                        v[$a] = _mm512_min_epi32(x, y);
                        v[$b] = _mm512_max_epi32(x, y);
                    };
                }
                $sort!(cs);
                largest = _mm512_max_epi32(largest, v[N - 1]);
                smallest = _mm512_min_epi32(smallest, v[0]);
                let result = match finish {
                    super::Finish::Median if N % 2 == 1 => $exact!(v[N / 2]),
                    super::Finish::Median => {
                        let (l0, l1) = widen!($value!(v[N / 2 - 1]));
                        let (h0, h1) = widen!($value!(v[N / 2]));
                        $round!(
                            _mm512_add_pd(_mm512_mul_pd(l0, half), _mm512_mul_pd(h0, half)),
                            _mm512_add_pd(_mm512_mul_pd(l1, half), _mm512_mul_pd(h1, half))
                        )
                    }
                    super::Finish::Trimmed { .. } => {
                        let (mut a0, mut a1) = (_mm512_setzero_pd(), _mm512_setzero_pd());
                        macro_rules! add {
                            ($i:literal) => {
                                if $i < N && $i >= lo_rank && $i < hi_rank {
                                    let (x0, x1) = widen!($value!(v[$i]));
                                    a0 = _mm512_add_pd(a0, x0);
                                    a1 = _mm512_add_pd(a1, x1);
                                }
                            };
                        }
                        $each!(add);
                        $round!(_mm512_mul_pd(a0, scale), _mm512_mul_pd(a1, scale))
                    }
                    super::Finish::Nearest { beta } => $nearest!(v, N, $wires, $each, beta),
                };
                first_bad = first_bad.or($store!(result, out, start, mask, lanes));
                start += lanes;
            }
            // Infinities and NaNs have the keys beyond those of the largest finite values.
            let (low, high): (i32, i32) = $finite;
            let above = _mm512_cmpgt_epi32_mask(largest, _mm512_set1_epi32(high));
            let below = _mm512_cmplt_epi32_mask(smallest, _mm512_set1_epi32(low));
            let suspect = (above | below) != 0;
            (first_bad.map_or(Ok(()), Err), suspect)
        }
    };
}

fused_with!(
    fused_n,
    16,
    each_of_16,
    merge_exchange_16,
    "avx512f",
    u32,
    f32,
    FINITE_KEYS,
    f32_key,
    f32_value,
    f32_value,
    narrow,
    store16,
    f32_nearest
);
fused_with!(
    fused_n32,
    32,
    each_of_32,
    two_halves_merged,
    "avx512f",
    u32,
    f32,
    FINITE_KEYS,
    f32_key,
    f32_value,
    f32_value,
    narrow,
    store16,
    f32_nearest
);
fused_with!(
    fused_bf16_n,
    16,
    each_of_16,
    merge_exchange_16,
    "avx512f,avx512bw,avx512vl",
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
    fused_bf16_n32,
    32,
    each_of_32,
    two_halves_merged,
    "avx512f,avx512bw,avx512vl",
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
    16,
    each_of_16,
    merge_exchange_16,
    "avx512f,avx512bw,avx512vl",
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
fused_with!(
    fused_f16_n32,
    32,
    each_of_32,
    two_halves_merged,
    "avx512f,avx512bw,avx512vl",
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
