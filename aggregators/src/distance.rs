//! Pairwise squared Euclidean distances, computed from differences (never with the
//! `|a|² + |b|² - 2<a,b>` shortcut, which cancels catastrophically on nearly equal vectors)
//! and accumulated in `f64`.
//!
//! For `f32` inputs each difference is squared and added in one fused multiply-add (one
//! rounding, not two) into 16 `f32` lanes over runs of at most 16 terms per lane, and the runs
//! are added in `f64` lanes (relative error about 1e-6, all terms positive, so nothing
//! cancels); a pair that overflows `f32` is recomputed in `f64`. The fused operation is exact
//! IEEE arithmetic, the same on every path: the AVX-512 and AVX2 kernels run on FMA hardware,
//! and the portable path (a CPU without FMA) gets the same bits from software, slowly. `f64`
//! inputs use `f64`. `f32` pairs are register-blocked, four rows against four with AVX-512
//! (written with intrinsics, so that the 16 accumulators stay in registers; two against two
//! otherwise), so each loaded chunk of a row serves several pairs
//! ([`Element::add_pair_distances`]); neither the blocking nor the kernel changes a bit of the
//! result.
//!
//! The coordinates are cut into a fixed number of contiguous chunks, independent of the thread
//! count; within a chunk, tiles of coordinates are small enough that all `n` inputs' tiles stay
//! in cache while every pair is visited, so each input is read from memory once. Chunk tables
//! are summed in chunk order, so the result is bitwise identical on every run and every rank.

use rayon::prelude::*;

use crate::Element;

/// Coordinates per cache tile.
const TILE: usize = 2048;
/// Fixed number of chunks the coordinates are split into (parallelism without
/// thread-count-dependent rounding).
const CHUNKS: usize = 64;

/// Adds the squared distances over `range` into the upper triangle of `table`.
fn chunk_table<T: Element>(
    inputs: &[&[T]],
    finite: &[bool],
    range: std::ops::Range<usize>,
    table: &mut [f64],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma")
    {
        // SAFETY: the CPU supports AVX-512F and FMA, checked just above.
        unsafe { chunk_table_avx512(inputs, finite, range, table) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA, checked just above.
        unsafe { chunk_table_avx2(inputs, finite, range, table) };
        return;
    }
    chunk_table_portable::<T, 2, 2>(inputs, finite, range, table);
}

/// 32 vector registers of 16 `f32`: four rows against four.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn chunk_table_avx512<T: Element>(
    inputs: &[&[T]],
    finite: &[bool],
    range: std::ops::Range<usize>,
    table: &mut [f64],
) {
    chunk_table_portable::<T, 4, 4>(inputs, finite, range, table);
}

/// 16 registers of 8 `f32` (a 16-lane accumulator takes two): two rows against two.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn chunk_table_avx2<T: Element>(
    inputs: &[&[T]],
    finite: &[bool],
    range: std::ops::Range<usize>,
    table: &mut [f64],
) {
    chunk_table_portable::<T, 2, 2>(inputs, finite, range, table);
}

#[inline(always)]
fn chunk_table_portable<T: Element, const RA: usize, const RB: usize>(
    inputs: &[&[T]],
    finite: &[bool],
    range: std::ops::Range<usize>,
    table: &mut [f64],
) {
    let rows: Vec<usize> = (0..inputs.len()).filter(|&i| finite[i]).collect();
    let mut start = range.start;
    while start < range.end {
        let stop = range.end.min(start + TILE);
        T::add_pair_distances::<RA, RB>(inputs, &rows, start..stop, table);
        start = stop;
    }
}

/// Whether every value of each input is finite.
pub fn finite_inputs<T: Element>(inputs: &[&[T]]) -> Vec<bool> {
    inputs.par_iter().map(|x| crate::all_finite(x)).collect()
}

/// The `n × n` table of squared distances (row-major); `finite[i]` says whether input `i` holds
/// only finite values ([`finite_inputs`]). Distances involving an input with a non-finite value
/// are `+inf` (such an input is infinitely far from everything, itself included), so
/// distance-based rules never select it. Tables of disjoint coordinate ranges add up to the
/// table of their union.
pub fn pairwise_sq_distances<T: Element>(inputs: &[&[T]], finite: &[bool]) -> Vec<f64> {
    let mut table = upper_sums(inputs, finite);
    apply_non_finite(&mut table, finite);
    table
}

/// [`pairwise_sq_distances`] with the non-finite inputs found along the way instead of in a
/// pass of their own over the data (which took about as long as the distances' own pass over
/// memory): the sums run over every input, a non-finite value makes every distance of its
/// input non-finite (`inf - x`, `NaN`), and only an input with a non-finite distance is then
/// scanned. (Two finite inputs never give a non-finite `f32` sum: an overflowing run is redone
/// in `f64`. Finite `f64` inputs whose differences overflow are scanned, found finite, and keep
/// their `+inf`, as [`pairwise_sq_distances`] gives them.)
pub fn distance_table<T: Element>(inputs: &[&[T]]) -> Vec<f64> {
    distance_table_of_present(inputs, &vec![true; inputs.len()])
}

/// [`distance_table`] where only the inputs that `present` marks hold data; the others (erased
/// inputs, standing in as placeholders) count as non-finite and are never read.
pub fn distance_table_of_present<T: Element>(inputs: &[&[T]], present: &[bool]) -> Vec<f64> {
    let n = inputs.len();
    let mut table = upper_sums(inputs, present);
    let upper = |i: usize, j: usize| table[i.min(j) * n + i.max(j)];
    let finite: Vec<bool> = (0..n)
        .map(|i| {
            let others = (0..n).filter(|&j| j != i && present[j]);
            // Without another present input there is no distance to go by: scan it.
            let suspect = others.clone().next().is_none()
                || others.into_iter().any(|j| !upper(i, j).is_finite());
            present[i] && (!suspect || crate::all_finite(inputs[i]))
        })
        .collect();
    apply_non_finite(&mut table, &finite);
    table
}

/// The sums over the rows that `finite` marks, in the upper triangle, chunk by chunk in a fixed
/// order.
fn upper_sums<T: Element>(inputs: &[&[T]], finite: &[bool]) -> Vec<f64> {
    let n = inputs.len();
    let d = inputs.first().map_or(0, |x| x.len());
    let chunk = d.div_ceil(CHUNKS).max(1);
    let partials: Vec<Vec<f64>> = (0..d.div_ceil(chunk))
        .into_par_iter()
        .map(|c| {
            let mut table = vec![0.0f64; n * n];
            chunk_table(
                inputs,
                finite,
                c * chunk..d.min((c + 1) * chunk),
                &mut table,
            );
            table
        })
        .collect();
    let mut table = vec![0.0f64; n * n];
    for p in &partials {
        for (t, v) in table.iter_mut().zip(p) {
            *t += v;
        }
    }
    table
}

/// Mirrors the upper triangle, and makes every distance of a non-finite input `+inf`.
fn apply_non_finite(table: &mut [f64], finite: &[bool]) {
    let n = finite.len();
    for i in 0..n {
        for j in 0..n {
            table[i * n + j] = if !finite[i] || !finite[j] {
                f64::INFINITY
            } else if j < i {
                table[j * n + i]
            } else {
                table[i * n + j]
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_blocking_never_changes_a_bit() {
        // 9 to 12 rows: groups of 4 leave 0 to 3 rows to narrower blocks, and a last group
        // of 1 to 4 rows (of 1 or 2 with blocks of 2).
        let d = 3000;
        for m in [9u32, 10, 11, 12] {
            let rows: Vec<Vec<f32>> = (0..m)
                .map(|i| {
                    (0..d as u32)
                        .map(|j| (((i * 7919 + j * 104_729) % 10_007) as f32).sqrt() * 1.3e-2)
                        .collect()
                })
                .collect();
            let inputs: Vec<&[f32]> = rows.iter().map(|v| &v[..]).collect();
            let finite = vec![true; inputs.len()];
            let cells = (m * m) as usize;
            let mut one = vec![0.0; cells];
            // Pair by pair in portable code, as the reference.
            for i in 0..inputs.len() {
                for j in i + 1..inputs.len() {
                    one[i * inputs.len() + j] =
                        crate::element::sq_dist_f32_portable(inputs[i], inputs[j]);
                }
            }
            assert!(one.iter().any(|&v| v > 0.0));
            let bits = |t: &[f64]| t.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            type Kernel = fn(&[&[f32]], &[bool], std::ops::Range<usize>, &mut [f64]);
            let blocked = |f: Kernel| {
                let mut table = vec![0.0; cells];
                f(&inputs, &finite, 0..d, &mut table);
                bits(&table)
            };
            assert_eq!(
                blocked(chunk_table_portable::<f32, 2, 2>),
                bits(&one),
                "{m}: 2 by 2"
            );
            assert_eq!(
                blocked(chunk_table_portable::<f32, 2, 4>),
                bits(&one),
                "{m}: 2 by 4"
            );
            assert_eq!(
                blocked(chunk_table_portable::<f32, 4, 4>),
                bits(&one),
                "{m}: 4 by 4"
            );
            assert_eq!(
                blocked(chunk_table::<f32>),
                bits(&one),
                "{m}: this CPU's kernel"
            );
        }
    }

    #[test]
    fn squares_are_added_with_one_rounding_on_every_path() {
        // Coordinates 0 and 16 share a lane: the lane holds round(x²), then adds y² fused.
        let (x, y) = (1..2000u32)
            .map(|k| (1.0f32 + k as f32 * 1.7e-4, 3.0f32 + k as f32 * 2.3e-4))
            .find(|&(x, y)| y.mul_add(y, x * x) != x * x + y * y)
            .expect("values where one rounding and two differ");
        let mut a = [0.0f32; 17];
        (a[0], a[16]) = (x, y);
        let zero = [0.0f32; 17];
        let want = y.mul_add(y, x * x) as f64;
        // One chunk (`distance_table` would cut 17 coordinates into chunks of one): the
        // dispatched kernel (FMA hardware here) and the portable path agree bitwise.
        let mut table = vec![0.0; 4];
        chunk_table(&[&a[..], &zero[..]], &[true, true], 0..17, &mut table);
        assert_eq!(table[1].to_bits(), want.to_bits());
        let mut table = vec![0.0; 4];
        chunk_table_portable::<f32, 2, 2>(&[&a[..], &zero[..]], &[true, true], 0..17, &mut table);
        assert_eq!(table[1].to_bits(), want.to_bits());
        // Several blocks and tails: the dispatched table is the portable one, bit for bit.
        let rows: Vec<Vec<f32>> = (0..9u32)
            .map(|i| {
                (0..4111u32)
                    .map(|j| ((i * 37 + j * 11) % 101) as f32 * 0.731 - 30.0)
                    .collect()
            })
            .collect();
        let inputs: Vec<&[f32]> = rows.iter().map(|v| &v[..]).collect();
        let mut portable = vec![0.0; 81];
        chunk_table_portable::<f32, 2, 2>(&inputs, &[true; 9], 0..4111, &mut portable);
        let mut dispatched = vec![0.0; 81];
        chunk_table(&inputs, &[true; 9], 0..4111, &mut dispatched);
        assert_eq!(
            dispatched.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            portable.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn the_table_that_finds_non_finite_inputs_itself_is_the_checked_table() {
        let d = 5000;
        let base: Vec<Vec<f32>> = (0..7)
            .map(|i| {
                (0..d)
                    .map(|j| ((i * 31 + j * 7) % 97) as f32 * 0.37 - 11.0)
                    .collect()
            })
            .collect();
        let mut cases = vec![base.clone()];
        for (bad, value) in [(0, f32::NAN), (3, f32::INFINITY), (6, f32::NEG_INFINITY)] {
            let mut c = base.clone();
            c[bad][d / 2] = value;
            cases.push(c);
        }
        let mut two_bad = base.clone();
        two_bad[1][0] = f32::INFINITY;
        two_bad[2][0] = f32::INFINITY; // inf - inf is NaN between them
        cases.push(two_bad);
        let mut huge = base.clone();
        huge[4][9] = 3.0e38;
        huge[5][9] = -3.0e38; // overflows f32 in the run, finite in f64
        cases.push(huge);
        for (k, case) in cases.iter().enumerate() {
            let inputs: Vec<&[f32]> = case.iter().map(|v| &v[..]).collect();
            let want = pairwise_sq_distances(&inputs, &finite_inputs(&inputs));
            let got = distance_table(&inputs);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "case {k}"
            );
            // Input 2 erased: a placeholder that is never read and counts as non-finite.
            let present: Vec<bool> = (0..inputs.len()).map(|i| i != 2).collect();
            let checked: Vec<bool> = finite_inputs(&inputs)
                .iter()
                .zip(&present)
                .map(|(f, p)| *f && *p)
                .collect();
            let want = pairwise_sq_distances(&inputs, &checked);
            let got = distance_table_of_present(&inputs, &present);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "case {k}, input 2 erased"
            );
        }
        let lone: Vec<f32> = vec![1.0, f32::NAN];
        assert_eq!(distance_table(&[&lone[..]]), vec![f64::INFINITY]);
        // The only present input, among erased ones, is scanned too.
        let fine: Vec<f32> = vec![1.0, 2.0];
        let got =
            distance_table_of_present(&[&lone[..], &fine[..], &fine[..]], &[true, false, false]);
        assert_eq!(got[0], f64::INFINITY);
        let got =
            distance_table_of_present(&[&fine[..], &lone[..], &lone[..]], &[true, false, false]);
        assert_eq!(got[0], 0.0);
        assert_eq!(distance_table(&[&base[0][..]]), vec![0.0]);
    }

    #[test]
    fn nearly_equal_vectors_have_small_positive_distances() {
        // Model-weight-like vectors that differ in the last bits: the Gram shortcut in f32
        // returns 0 or negative numbers here.
        let base: Vec<f32> = (0..10_000).map(|j| 1.0 + (j as f32) * 1e-4).collect();
        let mut other = base.clone();
        other[17] = f32::from_bits(other[17].to_bits() + 1);
        let inputs = [&base[..], &other[..], &base[..]];
        let t = pairwise_sq_distances(&inputs, &[true, true, true]);
        let want = ((other[17] as f64) - (base[17] as f64)).powi(2);
        assert!(want > 0.0);
        assert_eq!(t[1], want);
        assert_eq!(t[3], want);
        assert_eq!(t[2], 0.0);
        assert_eq!(t[4], 0.0);
    }

    #[test]
    fn non_finite_inputs_are_infinitely_far() {
        let a = [1.0f64, 2.0];
        let b = [f64::NAN, 2.0];
        let c = [1.0f64, 3.0];
        let inputs = [&a[..], &b[..], &c[..]];
        let t = pairwise_sq_distances(&inputs, &finite_inputs(&inputs));
        assert_eq!(t[2], 1.0);
        assert!(t[1] == f64::INFINITY && t[3 + 2] == f64::INFINITY && t[4] == f64::INFINITY);
    }
}
