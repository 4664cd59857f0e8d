//! Element types that aggregators and collectives operate on.

use crate::{Inputs, Output};

/// Data type of a vector's elements, as carried in reports and error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE-754 binary32.
    F32,
    /// IEEE-754 binary64.
    F64,
    /// bfloat16 ([`half::bf16`]): `f32`'s range with 8 significant bits.
    BF16,
    /// IEEE-754 binary16 ([`half::f16`]).
    F16,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// The name used in tables (`float`, `double`, `bfloat16`, `half`, as nccl-tests prints
    /// them).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F64 => "double",
            DType::BF16 => "bfloat16",
            DType::F16 => "half",
        }
    }
}

/// A floating-point element type: `f32`, `f64`, [`half::bf16`] or [`half::f16`].
///
/// Sealed: the aggregators are written for these four types only.
///
/// The 16-bit types are ordered exactly as the others (a total-order key on 16 bits), so
/// order statistics (the median, the values a trimmed mean keeps) are exact in the narrow
/// type. Every sum, mean and distance is taken in `f64` (exact widening) and a result is
/// rounded once, to nearest with ties to even, to the narrow type at the end
/// ([`Element::from_f64`]).
///
/// ```
/// use byzcoll_aggregators::{aggregate_into, Median, TrimmedMean};
/// use half::bf16;
/// let rows = [[1.0f32, 2.0], [2.0, f32::NAN], [3.0, 4.0], [1e30, 5.0]]
///     .map(|r| r.map(bf16::from_f32));
/// let inputs: Vec<&[bf16]> = rows.iter().map(|r| &r[..]).collect();
/// let mut out = [bf16::ZERO; 2];
/// // An even count: the mean of the two middle values, in f64, rounded once.
/// aggregate_into(&Median::new(1), &inputs, &mut out).unwrap();
/// assert_eq!(out, [bf16::from_f32(2.5), bf16::from_f32(4.5)]);
/// // 2 and 3 kept of the first coordinate; 4 and 5 of the second (NaN is the largest).
/// aggregate_into(&TrimmedMean::new(1), &inputs, &mut out).unwrap();
/// assert_eq!(out, [bf16::from_f32(2.5), bf16::from_f32(4.5)]);
/// ```
pub trait Element:
    bytemuck::Pod + PartialOrd + Send + Sync + std::fmt::Debug + sealed::Sealed + 'static
{
    /// The matching [`DType`].
    const DTYPE: DType;
    /// A key whose integer order is IEEE-754 `totalOrder` on `Self`:
    /// `-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN`.
    type Key: Ord + Copy + Send + Sync + Default + bytemuck::Pod;

    /// Maps a value to its total-order key.
    fn key(self) -> Self::Key;
    /// Inverse of [`Element::key`].
    fn from_key(key: Self::Key) -> Self;
    /// Widens to `f64` for accumulation.
    fn to_f64(self) -> f64;
    /// Narrows from `f64`, rounding once to nearest with ties to even (values beyond the
    /// type's range become infinities, NaN stays NaN); the same bits on every CPU.
    fn from_f64(v: f64) -> Self;
    /// `true` unless NaN or infinite.
    fn is_finite(self) -> bool;
    /// `Σ (a_j - b_j)²`, returned in `f64`; see [`crate::distance`] for the accuracy.
    fn sq_dist(a: &[Self], b: &[Self]) -> f64;
    /// For every pair `x < y` of positions in `rows`, adds `Σ (a_j - b_j)²` over `range` of
    /// inputs `rows[x]` and `rows[y]` into `table[rows[x] * n + rows[y]]` (`n = inputs.len()`).
    /// `B` is how many rows the `f32` kernel takes at once against two (4 where the CPU has
    /// registers for it, AVX-512); it changes the speed, never a bit of the result.
    fn add_pair_distances<const RA: usize, const RB: usize>(
        inputs: &[&[Self]],
        rows: &[usize],
        range: std::ops::Range<usize>,
        table: &mut [f64],
    );
    /// Wraps borrowed input slices for an [`crate::Aggregator`].
    fn inputs<'a>(inputs: &'a [&'a [Self]]) -> Inputs<'a>;
    /// Wraps an output slice for an [`crate::Aggregator`].
    fn output(out: &mut [Self]) -> Output<'_>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

macro_rules! float_element {
    ($t:ty, $bits:ty, $key:ty, $dtype:ident, $sq_dist:ident, $pairs:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$dtype;
            type Key = $key;

            #[inline(always)]
            fn key(self) -> $key {
                // Flip the magnitude bits of negative numbers so that signed integer order
                // matches totalOrder (the same trick as `f32::total_cmp`).
                let b = self.to_bits() as $key;
                b ^ ((((b >> (<$key>::BITS - 1)) as $bits) >> 1) as $key)
            }

            #[inline(always)]
            fn from_key(key: $key) -> Self {
                let b = key ^ ((((key >> (<$key>::BITS - 1)) as $bits) >> 1) as $key);
                <$t>::from_bits(b as $bits)
            }

            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }

            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                v as $t
            }

            #[inline(always)]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }

            #[inline(always)]
            fn sq_dist(a: &[Self], b: &[Self]) -> f64 {
                $sq_dist(a, b)
            }

            #[inline(always)]
            fn add_pair_distances<const RA: usize, const RB: usize>(
                inputs: &[&[Self]],
                rows: &[usize],
                range: std::ops::Range<usize>,
                table: &mut [f64],
            ) {
                $pairs::<RA, RB>(inputs, rows, range, table)
            }

            fn inputs<'a>(inputs: &'a [&'a [Self]]) -> Inputs<'a> {
                Inputs::$dtype(inputs)
            }

            fn output(out: &mut [Self]) -> Output<'_> {
                Output::$dtype(out)
            }
        }
    };
}

float_element!(f32, u32, i32, F32, sq_dist_f32, pair_distances_f32);
float_element!(f64, u64, i64, F64, sq_dist_f64, pair_distances_f64);

/// The 16-bit types: keys as for `f32` on 16 bits, `f64` for every sum and distance, results
/// narrowed by [`narrow`] (correctly rounded; `half`'s own `from_f64` is not: its `f16` goes
/// through `f32` where the CPU has F16C, rounding twice, and its `bf16` drops the low 32 bits
/// before it rounds).
macro_rules! half_element {
    ($t:ty, $dtype:ident, $format:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$dtype;
            type Key = i16;

            #[inline(always)]
            fn key(self) -> i16 {
                let b = self.to_bits() as i16;
                b ^ ((((b >> 15) as u16) >> 1) as i16)
            }

            #[inline(always)]
            fn from_key(key: i16) -> Self {
                let b = key ^ ((((key >> 15) as u16) >> 1) as i16);
                <$t>::from_bits(b as u16)
            }

            #[inline(always)]
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }

            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                <$t>::from_bits(narrow(v, $format))
            }

            #[inline(always)]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }

            #[inline(always)]
            fn sq_dist(a: &[Self], b: &[Self]) -> f64 {
                sq_dist_wide(a, b)
            }

            #[inline(always)]
            fn add_pair_distances<const RA: usize, const RB: usize>(
                inputs: &[&[Self]],
                rows: &[usize],
                range: std::ops::Range<usize>,
                table: &mut [f64],
            ) {
                pair_distances_wide(inputs, rows, range, table)
            }

            fn inputs<'a>(inputs: &'a [&'a [Self]]) -> Inputs<'a> {
                Inputs::$dtype(inputs)
            }

            fn output(out: &mut [Self]) -> Output<'_> {
                Output::$dtype(out)
            }
        }
    };
}

/// A 16-bit binary format: exponent and significand (stored) bits.
#[derive(Clone, Copy)]
struct Format {
    exponent: u32,
    significand: u32,
}

const BF16: Format = Format {
    exponent: 8,
    significand: 7,
};
const F16: Format = Format {
    exponent: 5,
    significand: 10,
};

half_element!(half::bf16, BF16, BF16);
half_element!(half::f16, F16, F16);

/// The bits of `v` rounded once to nearest, ties to even, in `format`: subnormals, overflow
/// to infinity, NaN kept NaN (quiet, sign and leading payload bits kept).
fn narrow(v: f64, format: Format) -> u16 {
    let Format {
        exponent,
        significand,
    } = format;
    let bits = v.to_bits();
    let sign = ((bits >> 63) as u16) << 15;
    let max_exp: u16 = (1 << exponent) - 1;
    let inf = sign | (max_exp << significand);
    if v.is_nan() {
        let payload = ((bits >> (52 - significand)) as u16) & ((1 << significand) - 1);
        return inf | (1 << (significand - 1)) | payload;
    }
    let a = v.abs();
    let bias = (1i32 << (exponent - 1)) - 1;
    // Unit in the last place of the result: of `a`'s binade, or of the subnormals below it.
    let e = ((bits >> 52) & 0x7ff) as i32 - 1023;
    let ulp_exp = e.max(1 - bias) - significand as i32;
    // Half the smallest subnormal or less (this takes every subnormal f64): ±0, a tie to even.
    if a <= pow2(1 - bias - significand as i32 - 1) {
        return sign;
    }
    // Exact: a power-of-two scale, the integer rounding, and its product.
    let y = (a / pow2(ulp_exp)).round_ties_even() * pow2(ulp_exp);
    if y >= pow2(bias + 1) {
        return inf;
    }
    let y_bits = y.to_bits();
    let y_exp = ((y_bits >> 52) & 0x7ff) as i32 - 1023;
    let stored = (y_bits >> (52 - significand)) as u16 & ((1 << significand) - 1);
    sign | if y_exp >= 1 - bias {
        (((y_exp + bias) as u16) << significand) | stored
    } else {
        // A subnormal: `y` is a multiple of the smallest one.
        (y / pow2(1 - bias - significand as i32)) as u16
    }
}

/// `2^e` for `e` in `f64`'s normal range.
fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// `Σ (a_j - b_j)²` with each value widened to `f64` (exactly), in 8 `f64` lanes: the `f64`
/// kernel (widening is the identity there) and the 16-bit types' alike, so the same sums bit
/// for bit.
#[inline(always)]
fn sq_dist_wide<T: Element>(a: &[T], b: &[T]) -> f64 {
    let mut acc = [0.0f64; 8];
    let split = a.len() - a.len() % 8;
    for (x, y) in a[..split].chunks_exact(8).zip(b[..split].chunks_exact(8)) {
        for k in 0..8 {
            let d = x[k].to_f64() - y[k].to_f64();
            acc[k] += d * d;
        }
    }
    for (x, y) in a[split..].iter().zip(&b[split..]) {
        let d = x.to_f64() - y.to_f64();
        acc[0] += d * d;
    }
    acc.iter().sum()
}

/// Pair by pair, with [`sq_dist_wide`].
#[inline(always)]
fn pair_distances_wide<T: Element>(
    inputs: &[&[T]],
    rows: &[usize],
    range: std::ops::Range<usize>,
    table: &mut [f64],
) {
    let n = inputs.len();
    for (x, &i) in rows.iter().enumerate() {
        let a = &inputs[i][range.clone()];
        for &j in &rows[x + 1..] {
            table[i * n + j] += sq_dist_wide(a, &inputs[j][range.clone()]);
        }
    }
}

/// Pair by pair, with [`Element::sq_dist`] ([`pair_distances_wide`], whose widening is the
/// identity here).
#[inline(always)]
fn pair_distances_f64<const RA: usize, const RB: usize>(
    inputs: &[&[f64]],
    rows: &[usize],
    range: std::ops::Range<usize>,
    table: &mut [f64],
) {
    pair_distances_wide(inputs, rows, range, table);
}

/// Lanes of the `f32` kernel, and coordinates per run: at most 16 terms per lane are summed
/// in `f32` before a run is added in `f64`. Fixed, whatever the CPU: every pair's sum is the
/// same sequence of operations on every machine, so replicas on different CPUs agree bitwise.
const LANES: usize = 16;
const BLOCK_RUN: usize = 16 * LANES;

/// Register blocking for `f32`: `RA` rows against `RB` at a time, so each loaded chunk of a
/// row serves several pairs (with 4 against 4, 8 loads for 16 pairs instead of 32). The rows go
/// in groups of `RA`; a group's own pairs go as one row against the rest of the group, and the
/// rows after the group in blocks of `RB`, the ones left over as one narrower block; the same
/// arithmetic for every pair.
#[inline(always)]
fn pair_distances_f32<const RA: usize, const RB: usize>(
    inputs: &[&[f32]],
    rows: &[usize],
    range: std::ops::Range<usize>,
    table: &mut [f64],
) {
    let n = inputs.len();
    let m = rows.len();
    let slice = |r: usize| &inputs[rows[r]][range.clone()];
    // `block_f32::<A, B>` of rows `x..x + A` against rows `y..y + B`, into the table.
    macro_rules! block {
        ($a:expr, $b:expr, $x:expr, $y:expr) => {{
            let (x, y) = ($x, $y);
            let d = block_f32::<$a, $b>(
                std::array::from_fn(|p| slice(x + p)),
                std::array::from_fn(|q| slice(y + q)),
            );
            for (p, dp) in d.iter().enumerate() {
                for (q, dq) in dp.iter().enumerate() {
                    table[rows[x + p] * n + rows[y + q]] += dq;
                }
            }
        }};
    }
    let mut x = 0;
    while x < m {
        let group = RA.min(m - x);
        // The group's own pairs: each row against the group's rows after it.
        for i in x..x + group - 1 {
            match x + group - 1 - i {
                1 => block!(1, 1, i, i + 1),
                2 => block!(1, 2, i, i + 1),
                3 => block!(1, 3, i, i + 1),
                more => unreachable!("{more} rows after a row of a group of at most 4"),
            }
        }
        if group < RA {
            break;
        }
        let mut y = x + RA;
        while y + RB <= m {
            block!(RA, RB, x, y);
            y += RB;
        }
        // The rows left over (fewer than `RB`) as one narrower block: a pair-by-pair loop
        // loads both rows for every pair (a quarter of the kernel's time at `n = 16`).
        match m - y {
            0 => {}
            1 => block!(RA, 1, x, y),
            2 => block!(RA, 2, x, y),
            3 => block!(RA, 3, x, y),
            more => unreachable!("{more} rows left over from blocks of {RB}"),
        }
        x += RA;
    }
}

/// Squared distances of `RA` rows to `RB` rows over the same coordinates, in `f32` lanes over
/// runs of [`BLOCK_RUN`] coordinates, each run's lanes added to `f64` lanes, which are summed
/// once at the end (adding every run's lanes into one `f64` right away cost a horizontal sum
/// per pair per 128 coordinates: about a third of the kernel). A pair whose sum is not finite
/// (a run overflowed `f32`) is redone in `f64`.
#[inline(always)]
fn block_f32<const RA: usize, const RB: usize>(
    a: [&[f32]; RA],
    b: [&[f32]; RB],
) -> [[f64; RB]; RA] {
    #[cfg(target_arch = "x86_64")]
    if RA <= 4 && RB <= 4 && avx512::available() {
        // SAFETY: the CPU supports AVX-512F and FMA, checked just above.
        let wide = unsafe { avx512::lanes(a, b) };
        return finish_block(wide, a, b);
    }
    finish_block(portable_lanes(a, b), a, b)
}

/// The `f64` lanes of [`block_f32`], in portable code.
#[inline(always)]
fn portable_lanes<const RA: usize, const RB: usize>(
    a: [&[f32]; RA],
    b: [&[f32]; RB],
) -> [[[f64; LANES]; RB]; RA] {
    let len = a[0].len();
    let mut wide = [[[0.0f64; LANES]; RB]; RA];
    let mut start = 0;
    while start < len {
        let stop = (start + BLOCK_RUN).min(len);
        let full = start + (stop - start) / LANES * LANES;
        let mut acc = [[[0.0f32; LANES]; RB]; RA];
        let mut c = start;
        while c < full {
            let mut y = [[0.0f32; LANES]; RB];
            for (yq, bq) in y.iter_mut().zip(&b) {
                yq.copy_from_slice(&bq[c..c + LANES]);
            }
            for (accp, ap) in acc.iter_mut().zip(&a) {
                let mut xp = [0.0f32; LANES];
                xp.copy_from_slice(&ap[c..c + LANES]);
                for (accpq, yq) in accp.iter_mut().zip(&y) {
                    for k in 0..LANES {
                        let d = xp[k] - yq[k];
                        accpq[k] = d.mul_add(d, accpq[k]);
                    }
                }
            }
            c += LANES;
        }
        for c in full..stop {
            for (accp, ap) in acc.iter_mut().zip(&a) {
                for (accpq, bq) in accp.iter_mut().zip(&b) {
                    let d = ap[c] - bq[c];
                    accpq[0] = d.mul_add(d, accpq[0]);
                }
            }
        }
        for (widep, accp) in wide.iter_mut().zip(&acc) {
            for (wideq, accq) in widep.iter_mut().zip(accp) {
                for k in 0..LANES {
                    wideq[k] += accq[k] as f64;
                }
            }
        }
        start = stop;
    }
    wide
}

/// Each pair's `f64` lanes summed in lane order, or, for a pair whose sum is not finite (a run
/// overflowed `f32`), the pair redone in `f64`.
#[inline(always)]
fn finish_block<const RA: usize, const RB: usize>(
    wide: [[[f64; LANES]; RB]; RA],
    a: [&[f32]; RA],
    b: [&[f32]; RB],
) -> [[f64; RB]; RA] {
    let mut total = [[0.0f64; RB]; RA];
    for p in 0..RA {
        for q in 0..RB {
            let sum: f64 = wide[p][q].iter().sum();
            total[p][q] = if sum.is_finite() {
                sum
            } else {
                a[p].iter()
                    .zip(b[q])
                    .map(|(&u, &v)| {
                        let d = u as f64 - v as f64;
                        d * d
                    })
                    .sum()
            };
        }
    }
    total
}

/// [`block_f32`]'s blocks of up to four rows against four written with AVX-512 intrinsics: the same
/// operations on the same lanes in the same order (so the same bits), but the accumulators
/// stay in registers and each fused multiply-add adds into its accumulator (the portable code,
/// vectorised by the compiler, copied every accumulator once per step).
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{BLOCK_RUN, LANES};
    use std::arch::x86_64::*;

    /// Whether the CPU runs [`lanes`] (detected once, then a cached load).
    #[inline(always)]
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma")
    }

    /// The `f64` lanes of [`super::block_f32`] for `RA` rows against `RB`, each at most 4 (16
    /// accumulators, 4 rows of the other side, a row and a difference in 32 registers).
    ///
    /// # Safety
    /// The CPU must support AVX-512F and FMA ([`available`]).
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn lanes<const RA: usize, const RB: usize>(
        a: [&[f32]; RA],
        b: [&[f32]; RB],
    ) -> [[[f64; LANES]; RB]; RA] {
        let len = a[0].len();
        assert!(
            a.iter().chain(&b).all(|r| r.len() == len),
            "rows of one length"
        );
        let mut wide = [[[0.0f64; LANES]; RB]; RA];
        let mut start = 0;
        while start < len {
            let stop = (start + BLOCK_RUN).min(len);
            let full = start + (stop - start) / LANES * LANES;
            let mut acc = [[_mm512_setzero_ps(); RB]; RA];
            let mut c = start;
            while c < full {
                // SAFETY: c + LANES <= full <= len, the length of every row.
                let y = b.map(|row| unsafe { _mm512_loadu_ps(row.as_ptr().add(c)) });
                for p in 0..RA {
                    // SAFETY: as above.
                    let x = unsafe { _mm512_loadu_ps(a[p].as_ptr().add(c)) };
                    for q in 0..RB {
                        let d = _mm512_sub_ps(x, y[q]);
                        acc[p][q] = _mm512_fmadd_ps(d, d, acc[p][q]);
                    }
                }
                c += LANES;
            }
            for p in 0..RA {
                for q in 0..RB {
                    let mut lanes = [0.0f32; LANES];
                    // SAFETY: `lanes` holds 16 `f32`.
                    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc[p][q]) };
                    // The run's last terms, in lane 0, one by one as the portable code.
                    for c in full..stop {
                        let d = a[p][c] - b[q][c];
                        lanes[0] = d.mul_add(d, lanes[0]);
                    }
                    // Lane by lane into the `f64` lanes, as the portable code.
                    let sums = wide[p][q].as_mut_ptr();
                    for half in 0..2 {
                        // SAFETY: 8 `f32` of `lanes` and 8 `f64` of `wide[p][q]` from 8·half.
                        unsafe {
                            let run =
                                _mm512_cvtps_pd(_mm256_loadu_ps(lanes.as_ptr().add(8 * half)));
                            let sum = _mm512_loadu_pd(sums.add(8 * half));
                            _mm512_storeu_pd(sums.add(8 * half), _mm512_add_pd(sum, run));
                        }
                    }
                }
            }
            start = stop;
        }
        wide
    }
}

/// `Σ (a_j - b_j)²` with the arithmetic of [`block_f32`]: squares added by fused
/// multiply-adds in 16 `f32` lanes
/// over runs of at most 16 terms per lane (at most ~1e-6 relative error on positive terms),
/// runs added in `f64` lanes, a pair that overflows `f32` redone in `f64`.
#[inline(always)]
pub(crate) fn sq_dist_f32(a: &[f32], b: &[f32]) -> f64 {
    block_f32::<1, 1>([a], [b])[0][0]
}

/// [`sq_dist_f32`] in portable code on every CPU (the reference the kernels are tested with).
#[cfg(test)]
pub(crate) fn sq_dist_f32_portable(a: &[f32], b: &[f32]) -> f64 {
    finish_block(portable_lanes([a], [b]), [a], [b])[0][0]
}

#[inline(always)]
fn sq_dist_f64(a: &[f64], b: &[f64]) -> f64 {
    sq_dist_wide(a, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_order_is_total_order() {
        let vals = [
            -f32::NAN,
            f32::NEG_INFINITY,
            -3.5,
            -f32::MIN_POSITIVE,
            -0.0,
            0.0,
            1e-40,
            2.0,
            f32::MAX,
            f32::INFINITY,
            f32::NAN,
        ];
        for w in vals.windows(2) {
            assert!(w[0].key() < w[1].key(), "{:?} !< {:?}", w[0], w[1]);
            assert_eq!(w[0].total_cmp(&w[1]), w[0].key().cmp(&w[1].key()));
        }
        for v in vals {
            assert_eq!(f32::from_key(v.key()).to_bits(), v.to_bits());
            assert_eq!(
                f64::from_key((v as f64).key()).to_bits(),
                (v as f64).to_bits()
            );
        }
    }

    /// Every 16-bit pattern: its key's order is totalOrder (as in `f64`), `from_key` inverts
    /// `key`, widening and narrowing round-trip (NaN quieted); every midpoint of two
    /// neighbours rounds to the even one and anything off the midpoint to the nearer one; past
    /// the largest finite value, to infinity as IEEE-754 says.
    fn narrow_and_keys<T: Element>(from_bits: impl Fn(u16) -> T, to_bits: impl Fn(T) -> u16) {
        // All values in totalOrder: negative patterns descending, then positive ascending.
        let ordered: Vec<u16> = (0x8000..=0xffffu16).rev().chain(0..0x8000).collect();
        for w in ordered.windows(2) {
            let (a, b) = (from_bits(w[0]), from_bits(w[1]));
            assert!(a.key() < b.key(), "{:#06x} !< {:#06x}", w[0], w[1]);
            assert_eq!(to_bits(T::from_key(a.key())), w[0]);
            let (x, y) = (a.to_f64(), b.to_f64());
            if x.is_nan() {
                // Quieted, sign kept.
                let back = T::from_f64(x);
                assert!(back.to_f64().is_nan());
                assert_eq!(to_bits(back) & 0x8000, w[0] & 0x8000);
            } else {
                assert_eq!(to_bits(T::from_f64(x)), w[0], "{x} round-trips");
            }
            if x.is_finite() && y.is_finite() && x < y {
                let mid = x * 0.5 + y * 0.5;
                let even = if w[0] & 1 == 0 { w[0] } else { w[1] };
                let got = to_bits(T::from_f64(mid));
                if mid == 0.0 {
                    // Between -min and +min: a tie, to a zero.
                    assert_eq!(T::from_f64(mid).to_f64(), 0.0);
                } else {
                    assert_eq!(got, even, "{x} .. {y}: midpoint {mid}");
                }
                let below = f64::from_bits(mid.to_bits() - 1);
                let above = f64::from_bits(mid.to_bits() + 1);
                let (lo, hi) = if mid > 0.0 {
                    (below, above)
                } else {
                    (above, below)
                };
                if mid != 0.0 {
                    assert_eq!(T::from_f64(lo).to_f64(), x, "just above {x}'s side");
                    assert_eq!(T::from_f64(hi).to_f64(), y, "just below {y}'s side");
                }
            }
        }
        let max = ordered
            .iter()
            .map(|&b| from_bits(b).to_f64())
            .filter(|v| v.is_finite())
            .fold(0.0f64, f64::max);
        let ulp = max - from_bits(to_bits(T::from_f64(max)) - 1).to_f64();
        assert_eq!(T::from_f64(max + ulp * 0.499).to_f64(), max);
        assert_eq!(T::from_f64(max + ulp * 0.5).to_f64(), f64::INFINITY);
        assert_eq!(T::from_f64(-1e300).to_f64(), f64::NEG_INFINITY);
        assert_eq!(to_bits(T::from_f64(f64::MIN_POSITIVE)), 0);
        assert_eq!(to_bits(T::from_f64(-f64::MIN_POSITIVE)), 0x8000);
        assert!(T::from_f64(f64::NAN).to_f64().is_nan());
        assert!(T::from_f64(-f64::NAN).to_f64().is_sign_negative());
    }

    #[test]
    fn bf16_narrows_once_and_keys_in_total_order() {
        narrow_and_keys(half::bf16::from_bits, half::bf16::to_bits);
    }

    #[test]
    fn f16_narrows_once_and_keys_in_total_order() {
        narrow_and_keys(half::f16::from_bits, half::f16::to_bits);
    }
}
