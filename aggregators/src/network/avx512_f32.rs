use super::FINITE_KEYS;
use std::arch::x86_64::{
    __m512, __m512i, _mm256_castpd_ps, _mm256_castps_pd, _mm512_add_pd, _mm512_and_si512,
    _mm512_castpd256_pd512, _mm512_castpd_ps, _mm512_castps512_ps256, _mm512_castps_pd,
    _mm512_castps_si512, _mm512_castsi512_ps, _mm512_cmpeq_epi32_mask, _mm512_cmpgt_epi32_mask,
    _mm512_cmplt_epi32_mask, _mm512_cvtpd_ps, _mm512_cvtps_pd, _mm512_extractf64x4_pd,
    _mm512_insertf64x4, _mm512_loadu_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_epi32,
    _mm512_max_epi32, _mm512_min_epi32, _mm512_mul_pd, _mm512_set1_epi32, _mm512_set1_pd,
    _mm512_setzero_pd, _mm512_srai_epi32, _mm512_srli_epi32, _mm512_storeu_si512, _mm512_xor_si512,
};

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
    macro_rules! by_n {
        ($($n:literal)* ; $($m:literal)*) => {
            match inputs.len() {
                $($n => fused_n::<$n>(inputs, base, out, finish),)*
                $($m => fused_n32::<$m>(inputs, base, out, finish),)*
                other => unreachable!("the fused path takes 1..=32 inputs, not {other}"),
            }
        };
    }
    by_n!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16;
          17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32)
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

/// The two `f64` halves (lanes 0..8, 8..16) of 16 `f32` lanes given as keys.
macro_rules! widen {
    ($k:expr) => {{
        let x: __m512 = _mm512_castsi512_ps(flip!($k));
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

/// [`super::mean_in_order`] on `out.len()` coordinates from `base`: the offset in `out`
/// of the first non-finite result.
#[target_feature(enable = "avx512f")]
pub(super) fn mean_in_order(inputs: &[&[u32]], base: usize, out: &mut [f32]) -> Result<(), usize> {
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
            let x: __m512 = _mm512_castsi512_ps(load16!(row, at, mask, lanes));
            a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
            a1 = _mm512_add_pd(
                a1,
                _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                    _mm512_castps_pd(x),
                ))),
            );
        }
        let result = narrow!(_mm512_mul_pd(a0, scale), _mm512_mul_pd(a1, scale));
        first_bad = first_bad.or(store16!(result, out, start, mask, lanes));
        start += lanes;
    }
    first_bad.map_or(Ok(()), Err)
}

/// `fused_n::<N>` for `N` up to `$wires` (16: the network in registers; 32: two halves of
/// 16 sorted so, then Batcher's odd-even merge, also in registers).
macro_rules! fused_with {
    ($name:ident, $wires:literal, $each:ident, $sort:ident) => {
        #[target_feature(enable = "avx512f")]
        fn $name<const N: usize>(
            inputs: &[&[u32]],
            base: usize,
            out: &mut [f32],
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
                            v[$i] = flip!(load16!(inputs[$i], at, mask, lanes));
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
                let result: __m512 = match finish {
                    super::Finish::Median if N % 2 == 1 => _mm512_castsi512_ps(flip!(v[N / 2])),
                    super::Finish::Median => {
                        let (l0, l1) = widen!(v[N / 2 - 1]);
                        let (h0, h1) = widen!(v[N / 2]);
                        narrow!(
                            _mm512_add_pd(_mm512_mul_pd(l0, half), _mm512_mul_pd(h0, half)),
                            _mm512_add_pd(_mm512_mul_pd(l1, half), _mm512_mul_pd(h1, half))
                        )
                    }
                    super::Finish::Trimmed { .. } => {
                        let (mut a0, mut a1) = (_mm512_setzero_pd(), _mm512_setzero_pd());
                        macro_rules! add {
                            ($i:literal) => {
                                if $i < N && $i >= lo_rank && $i < hi_rank {
                                    let (x0, x1) = widen!(v[$i]);
                                    a0 = _mm512_add_pd(a0, x0);
                                    a1 = _mm512_add_pd(a1, x1);
                                }
                            };
                        }
                        $each!(add);
                        narrow!(_mm512_mul_pd(a0, scale), _mm512_mul_pd(a1, scale))
                    }
                    super::Finish::Nearest { beta } => {
                        let mut rows = [0i32; 16 * $wires];
                        macro_rules! spill {
                            ($i:literal) => {
                                if $i < N {
                                    let dst = &mut rows[$i * 16..$i * 16 + 16];
                                    // SAFETY: `dst` holds exactly 16 `i32`.
                                    unsafe { _mm512_storeu_si512(dst.as_mut_ptr().cast(), v[$i]) };
                                }
                            };
                        }
                        $each!(spill);
                        let means = super::nearest_mean_lanes::<f32>(&rows, N, 16, 0, 16, beta);
                        let means: [f32; 16] = std::array::from_fn(|c| means[c] as f32);
                        // SAFETY: `means` holds exactly 16 `f32`.
                        unsafe { _mm512_loadu_ps(means.as_ptr()) }
                    }
                };
                first_bad = first_bad.or(store16!(result, out, start, mask, lanes));
                start += lanes;
            }
            // Infinities and NaNs have the keys beyond those of `f32::MAX` and
            // `-f32::MAX`.
            let above = _mm512_cmpgt_epi32_mask(largest, _mm512_set1_epi32(FINITE_KEYS.1));
            let below = _mm512_cmplt_epi32_mask(smallest, _mm512_set1_epi32(FINITE_KEYS.0));
            let suspect = (above | below) != 0;
            (first_bad.map_or(Ok(()), Err), suspect)
        }
    };
}

fused_with!(fused_n, 16, each_of_16, merge_exchange_16);
fused_with!(fused_n32, 32, each_of_32, two_halves_merged);
