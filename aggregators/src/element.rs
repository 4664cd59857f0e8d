//! Element types that aggregators and collectives operate on.

use crate::{Inputs, Output};

/// Data type of a vector's elements, as carried in reports and error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE-754 binary32.
    F32,
    /// IEEE-754 binary64.
    F64,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }

    /// The name used in tables (`float`, `double`, as nccl-tests prints them).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F64 => "double",
        }
    }
}

/// A floating-point element type (`f32` or `f64`).
///
/// Sealed: the aggregators are written for these two types only.
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
    /// Narrows from `f64` (round to nearest).
    fn from_f64(v: f64) -> Self;
    /// `true` unless NaN or infinite.
    fn is_finite(self) -> bool;
    /// `Σ (a_j - b_j)²`, returned in `f64`; see [`crate::distance`] for the accuracy.
    fn sq_dist(a: &[Self], b: &[Self]) -> f64;
    /// For every pair `x < y` of positions in `rows`, adds `Σ (a_j - b_j)²` over `range` of
    /// inputs `rows[x]` and `rows[y]` into `table[rows[x] * n + rows[y]]` (`n = inputs.len()`).
    /// `B` is how many rows the `f32` kernel takes at once against two (4 where the CPU has
    /// registers for it, AVX-512); it changes the speed, never a bit of the result.
    fn add_pair_distances<const B: usize>(
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
            fn add_pair_distances<const B: usize>(
                inputs: &[&[Self]],
                rows: &[usize],
                range: std::ops::Range<usize>,
                table: &mut [f64],
            ) {
                $pairs::<B>(inputs, rows, range, table)
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

/// Pair by pair, with [`Element::sq_dist`].
#[inline(always)]
fn pair_distances_f64<const B: usize>(
    inputs: &[&[f64]],
    rows: &[usize],
    range: std::ops::Range<usize>,
    table: &mut [f64],
) {
    let n = inputs.len();
    for (x, &i) in rows.iter().enumerate() {
        let a = &inputs[i][range.clone()];
        for &j in &rows[x + 1..] {
            table[i * n + j] += sq_dist_f64(a, &inputs[j][range.clone()]);
        }
    }
}

/// Lanes of the `f32` kernel, and coordinates per run: at most 16 terms per lane are summed
/// in `f32` before a run is added in `f64`. Fixed, whatever the CPU: every pair's sum is the
/// same sequence of operations on every machine, so replicas on different CPUs agree bitwise.
const LANES: usize = 16;
const BLOCK_RUN: usize = 16 * LANES;

/// Register blocking for `f32`: two rows against `B` at a time, so each loaded chunk of a row
/// serves several pairs (with `B = 4`, 6 loads for 8 pairs instead of 16). Rows that do not
/// fill a block go as one narrower block, and each block's own pair alone, with the same
/// arithmetic for every pair.
#[inline(always)]
fn pair_distances_f32<const B: usize>(
    inputs: &[&[f32]],
    rows: &[usize],
    range: std::ops::Range<usize>,
    table: &mut [f64],
) {
    let n = inputs.len();
    let m = rows.len();
    let slice = |r: usize| &inputs[rows[r]][range.clone()];
    let mut x = 0;
    while x + 1 < m {
        let (i0, i1) = (rows[x], rows[x + 1]);
        table[i0 * n + i1] += sq_dist_f32(slice(x), slice(x + 1));
        let mut y = x + 2;
        while y + B <= m {
            let d = block_f32::<2, B>(
                [slice(x), slice(x + 1)],
                std::array::from_fn(|q| slice(y + q)),
            );
            for (p, i) in [i0, i1].into_iter().enumerate() {
                for (q, dq) in d[p].iter().enumerate() {
                    table[i * n + rows[y + q]] += dq;
                }
            }
            y += B;
        }
        // The rows left over (fewer than `B`) as one narrower block: a pair-by-pair loop
        // loads both rows for every pair (a quarter of the kernel's time at `n = 16`).
        macro_rules! rest {
            ($r:literal) => {{
                let d = block_f32::<2, $r>(
                    [slice(x), slice(x + 1)],
                    std::array::from_fn(|q| slice(y + q)),
                );
                for (p, i) in [i0, i1].into_iter().enumerate() {
                    for (q, dq) in d[p].iter().enumerate() {
                        table[i * n + rows[y + q]] += dq;
                    }
                }
            }};
        }
        match m - y {
            0 => {}
            1 => rest!(1),
            2 => rest!(2),
            3 => rest!(3),
            more => unreachable!("{more} rows left over from blocks of {B}"),
        }
        x += 2;
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

/// `Σ (a_j - b_j)²` with the arithmetic of [`block_f32`]: squares added by fused
/// multiply-adds in 16 `f32` lanes
/// over runs of at most 16 terms per lane (at most ~1e-6 relative error on positive terms),
/// runs added in `f64` lanes, a pair that overflows `f32` redone in `f64`.
#[inline(always)]
pub(crate) fn sq_dist_f32(a: &[f32], b: &[f32]) -> f64 {
    block_f32::<1, 1>([a], [b])[0][0]
}

#[inline(always)]
fn sq_dist_f64(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0.0f64; 8];
    let split = a.len() - a.len() % 8;
    for (x, y) in a[..split].chunks_exact(8).zip(b[..split].chunks_exact(8)) {
        for k in 0..8 {
            let d = x[k] - y[k];
            acc[k] += d * d;
        }
    }
    for (x, y) in a[split..].iter().zip(&b[split..]) {
        let d = x - y;
        acc[0] += d * d;
    }
    acc.iter().sum()
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
}
