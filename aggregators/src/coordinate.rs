//! Coordinate-wise rules: mean, median, trimmed mean.
//!
//! Each coordinate is reduced independently, on total-order keys (so NaN and infinities are
//! ordered extremes). For `n` up to [`network::MAX_INPUTS`] a block of coordinates is sorted by a
//! sorting network applied row-wise ([`crate::network`]): SIMD min/max across 8 or 16
//! coordinates at a time, in registers for `f32` up to 16 inputs (and two register-sorted halves
//! merged in memory up to 32). Larger `n` transposes blocks into columns and uses selection. rayon
//! splits the blocks.

use rayon::prelude::*;

use crate::network;
use crate::{check_lengths, AggError, AggReport, Aggregator, Element, Inputs, Output, Structure};

/// Coordinates per block: enough to amortise the transpose, small enough to stay in L2.
fn block_len(n: usize) -> usize {
    (16 * 1024 / n.max(1)).clamp(16, 2048)
}

/// Runs `reduce` on every coordinate's column of keys and writes the result.
/// `reduce` returns `None` when the result would be non-finite.
pub(crate) fn reduce_columns<T: Element>(
    inputs: &[&[T]],
    out: &mut [T],
    reduce: impl Fn(&mut [T::Key]) -> Option<T> + Sync,
) -> Result<(), usize> {
    let n = inputs.len();
    let block = block_len(n);
    let first_bad = out
        .par_chunks_mut(block)
        .enumerate()
        .map_init(Vec::new, |scratch: &mut Vec<T::Key>, (b, chunk)| {
            let base = b * block;
            let len = chunk.len();
            scratch.clear();
            scratch.resize(n * len, T::Key::default());
            for (i, x) in inputs.iter().enumerate() {
                for (c, v) in x[base..base + len].iter().enumerate() {
                    scratch[c * n + i] = v.key();
                }
            }
            for (c, (o, col)) in chunk
                .iter_mut()
                .zip(scratch.chunks_exact_mut(n))
                .enumerate()
            {
                *o = reduce(col).ok_or(base + c)?;
            }
            Ok(())
        })
        .filter_map(Result::err)
        .min();
    // The first over all blocks, whichever thread found it first.
    first_bad.map_or(Ok(()), Err)
}

/// Coordinates per network block: `n` rows of this many keys stay in L2.
const NETWORK_BLOCK: usize = 512;

/// Sorts each block of coordinates with a network that places rows `needed` (for `n` inputs),
/// then lets `finish` turn the sorted rows (`n × width` keys, row-major) into the block's output.
/// `finish` returns the offset of a coordinate whose result would be non-finite.
pub(crate) fn network_blocks<T: Element>(
    inputs: &[&[T]],
    out: &mut [T],
    needed: std::ops::Range<usize>,
    finish: impl Fn(&[T::Key], usize, &mut [T]) -> Result<(), usize> + Sync,
) -> Result<(), usize> {
    let plan = network::Plan::new(inputs.len(), needed);
    let first_bad = out
        .par_chunks_mut(NETWORK_BLOCK)
        .enumerate()
        .map_init(Vec::new, |rows: &mut Vec<T::Key>, (b, chunk)| {
            let base = b * NETWORK_BLOCK;
            let width = chunk.len();
            network::sort_block(inputs, base, width, rows, &plan);
            finish(rows, width, chunk).map_err(|c| base + c)
        })
        .filter_map(Result::err)
        .min();
    // The first over all blocks, whichever thread found it first.
    first_bad.map_or(Ok(()), Err)
}

/// `rule` by the register path for `finish` where it applies (with the inputs it found
/// holding NaN or infinities), else by `portable`.
fn fused_or_portable<T: Element>(
    rule: &dyn Aggregator,
    finish: network::Finish,
    inputs: &[&[T]],
    out: &mut [T],
    portable: impl FnOnce(&[&[T]], &mut [T]) -> Result<(), AggError>,
) -> Result<Option<Vec<usize>>, AggError> {
    match network::fused(inputs, out, finish) {
        Some(done) => done
            .result
            .map(|()| Some(done.non_finite))
            .map_err(|coordinate| AggError::NonFiniteResult {
                rule: rule.name().to_string(),
                f: rule.byzantine(),
                coordinate,
            }),
        None => portable(inputs, out).map(|()| None),
    }
}

/// Offset of the first non-finite value, if any.
fn first_non_finite<T: Element>(out: &[T]) -> Result<(), usize> {
    match crate::first_non_finite(out) {
        Some(c) => Err(c),
        None => Ok(()),
    }
}

pub(crate) fn precondition(rule: &str, n: usize, f: usize) -> Result<(), AggError> {
    // Checked: an f near usize::MAX must fail the precondition, not wrap past it.
    if f.checked_mul(2).is_some_and(|two_f| n > two_f) {
        Ok(())
    } else {
        Err(AggError::Precondition {
            rule: rule.to_string(),
            requirement: "n > 2f",
            n,
            f,
        })
    }
}

/// Coordinate-wise median; for an even count, the mean of the two middle values.
///
/// Exact in every element type for an odd count (an input value); for an even count the mean
/// is taken in `f64` (exact for every element type but `f64`) and rounded once.
///
/// Tolerates `f` Byzantine inputs when `n > 2f`: each output coordinate then lies between two
/// honest values of that coordinate.
#[derive(Debug, Clone)]
pub struct Median {
    f: usize,
}

impl Median {
    /// A median configured to tolerate `f` Byzantine inputs.
    pub fn new(f: usize) -> Self {
        Median { f }
    }

    /// The median into `out`; the inputs holding NaN or infinities where the path found them
    /// while reading (see [`AggReport::non_finite`]).
    pub(crate) fn run<T: Element>(
        &self,
        inputs: &[&[T]],
        out: &mut [T],
    ) -> Result<Option<Vec<usize>>, AggError> {
        check_lengths(inputs, out.len())?;
        self.check(inputs.len())?;
        fused_or_portable(self, network::Finish::Median, inputs, out, |i, o| {
            self.run_portable(i, o)
        })
    }

    /// The median without the register paths: sorting networks on keys in memory up to
    /// [`network::MAX_INPUTS`] inputs, selection above (what those paths are tested against).
    pub(crate) fn run_portable<T: Element>(
        &self,
        inputs: &[&[T]],
        out: &mut [T],
    ) -> Result<(), AggError> {
        check_lengths(inputs, out.len())?;
        self.check(inputs.len())?;
        let n = inputs.len();
        let mid = n / 2;
        let even = n.is_multiple_of(2);
        let non_finite = |coordinate| AggError::NonFiniteResult {
            rule: self.name().to_string(),
            f: self.f,
            coordinate,
        };
        if n <= network::MAX_INPUTS {
            let needed = if even { mid - 1..mid + 1 } else { mid..mid + 1 };
            return network_blocks(inputs, out, needed, |rows, w, chunk| {
                let hi = &rows[mid * w..(mid + 1) * w];
                if even {
                    let lo = &rows[(mid - 1) * w..mid * w];
                    for ((o, &l), &h) in chunk.iter_mut().zip(lo).zip(hi) {
                        *o = T::from_f64(
                            T::from_key(l).to_f64() * 0.5 + T::from_key(h).to_f64() * 0.5,
                        );
                    }
                } else {
                    for (o, &h) in chunk.iter_mut().zip(hi) {
                        *o = T::from_key(h);
                    }
                }
                first_non_finite(chunk)
            })
            .map_err(non_finite);
        }
        reduce_columns(inputs, out, |col| {
            let (low, hi, _) = col.select_nth_unstable(mid);
            let hi = T::from_key(*hi);
            let v = if even {
                let lo = T::from_key(*low.iter().max()?);
                if !lo.is_finite() {
                    return None;
                }
                T::from_f64(lo.to_f64() * 0.5 + hi.to_f64() * 0.5)
            } else {
                hi
            };
            v.is_finite().then_some(v)
        })
        .map_err(non_finite)
    }
}

impl Aggregator for Median {
    fn name(&self) -> &str {
        "median"
    }

    fn byzantine(&self) -> usize {
        self.f
    }

    fn check(&self, n: usize) -> Result<(), AggError> {
        precondition(self.name(), n, self.f)
    }

    fn structure(&self) -> Structure {
        Structure::CoordinateWise
    }

    fn aggregate(&self, inputs: Inputs<'_>, out: Output<'_>) -> Result<AggReport, AggError> {
        crate::dispatch!(self, inputs, out).map(|found| AggReport {
            non_finite: found,
            ..AggReport::default()
        })
    }
}

/// Coordinate-wise trimmed mean: drop the `f` smallest and `f` largest values of each
/// coordinate, average the remaining `n - 2f` (accumulated in `f64`). Requires `n > 2f`.
#[derive(Debug, Clone)]
pub struct TrimmedMean {
    f: usize,
}

impl TrimmedMean {
    /// A trimmed mean that drops `f` values at each end.
    pub fn new(f: usize) -> Self {
        TrimmedMean { f }
    }

    /// As [`Median::run`].
    fn run<T: Element>(
        &self,
        inputs: &[&[T]],
        out: &mut [T],
    ) -> Result<Option<Vec<usize>>, AggError> {
        check_lengths(inputs, out.len())?;
        self.check(inputs.len())?;
        let finish = network::Finish::Trimmed { f: self.f };
        fused_or_portable(self, finish, inputs, out, |i, o| self.run_portable(i, o))
    }

    /// As [`Median::run_portable`].
    pub(crate) fn run_portable<T: Element>(
        &self,
        inputs: &[&[T]],
        out: &mut [T],
    ) -> Result<(), AggError> {
        check_lengths(inputs, out.len())?;
        self.check(inputs.len())?;
        let f = self.f;
        let n = inputs.len();
        let keep = n - 2 * f;
        let non_finite = |coordinate| AggError::NonFiniteResult {
            rule: self.name().to_string(),
            f,
            coordinate,
        };
        if n <= network::MAX_INPUTS {
            let scale = 1.0 / keep as f64;
            return network_blocks(inputs, out, f..n - f, |rows, w, chunk| {
                let mut acc = [0.0f64; NETWORK_BLOCK];
                let acc = &mut acc[..w];
                for r in f..n - f {
                    for (a, &k) in acc.iter_mut().zip(&rows[r * w..(r + 1) * w]) {
                        *a += T::from_key(k).to_f64();
                    }
                }
                for (o, a) in chunk.iter_mut().zip(acc.iter()) {
                    *o = T::from_f64(a * scale);
                }
                first_non_finite(chunk)
            })
            .map_err(non_finite);
        }
        reduce_columns(inputs, out, |col| {
            let middle = if f == 0 {
                &mut col[..]
            } else {
                let (_, _, upper) = col.select_nth_unstable(f - 1);
                upper.select_nth_unstable(keep).0
            };
            let mut sum = 0.0f64;
            for &k in middle.iter() {
                let v = T::from_key(k);
                if !v.is_finite() {
                    return None;
                }
                sum += v.to_f64();
            }
            let v = T::from_f64(sum / keep as f64);
            v.is_finite().then_some(v)
        })
        .map_err(non_finite)
    }
}

impl Aggregator for TrimmedMean {
    fn name(&self) -> &str {
        "trimmed-mean"
    }

    fn byzantine(&self) -> usize {
        self.f
    }

    fn check(&self, n: usize) -> Result<(), AggError> {
        precondition(self.name(), n, self.f)
    }

    fn structure(&self) -> Structure {
        Structure::CoordinateWise
    }

    fn aggregate(&self, inputs: Inputs<'_>, out: Output<'_>) -> Result<AggReport, AggError> {
        crate::dispatch!(self, inputs, out).map(|found| AggReport {
            non_finite: found,
            ..AggReport::default()
        })
    }
}

/// Arithmetic mean, accumulated in `f64`. **Not robust**: one input moves it arbitrarily far.
/// It exists as a baseline and tolerates `f = 0`; non-finite inputs are refused.
#[derive(Debug, Clone, Default)]
pub struct Mean;

impl Mean {
    /// The non-robust mean.
    pub fn new() -> Self {
        Mean
    }

    fn run<T: Element>(&self, inputs: &[&[T]], out: &mut [T]) -> Result<(), AggError> {
        check_lengths(inputs, out.len())?;
        self.check(inputs.len())?;
        let summed = match network::mean_in_order(inputs, out) {
            Some(done) => done,
            None => Self::sum_blocks(inputs, out),
        };
        let Err(coordinate) = summed else {
            return Ok(());
        };
        let bad: Vec<usize> = inputs
            .par_iter()
            .enumerate()
            .filter(|(_, x)| !crate::all_finite(x))
            .map(|(i, _)| i)
            .collect();
        Err(if bad.is_empty() {
            AggError::NonFiniteResult {
                rule: self.name().to_string(),
                f: 0,
                coordinate,
            }
        } else {
            AggError::NonFiniteInputs {
                rule: self.name().to_string(),
                inputs: bad,
            }
        })
    }

    /// The portable mean: blocks of coordinates summed in `f64`, input by input; the offset
    /// of the first non-finite result in the block that found one.
    fn sum_blocks<T: Element>(inputs: &[&[T]], out: &mut [T]) -> Result<(), usize> {
        let scale = 1.0 / inputs.len() as f64;
        let block = 4096;
        // One pass: a non-finite input makes its coordinates non-finite, which is checked on
        // the output; only then are the inputs scanned to name the culprits.
        let summed = out.par_chunks_mut(block).enumerate().try_for_each_init(
            Vec::new,
            |acc: &mut Vec<f64>, (b, chunk)| {
                let base = b * block;
                acc.clear();
                acc.resize(chunk.len(), 0.0);
                for x in inputs {
                    for (a, v) in acc.iter_mut().zip(&x[base..base + chunk.len()]) {
                        *a += v.to_f64();
                    }
                }
                for (o, a) in chunk.iter_mut().zip(acc.iter()) {
                    *o = T::from_f64(a * scale);
                }
                first_non_finite(chunk).map_err(|c| base + c)
            },
        );
        summed
    }
}

impl Aggregator for Mean {
    fn name(&self) -> &str {
        "mean"
    }

    fn byzantine(&self) -> usize {
        0
    }

    fn check(&self, n: usize) -> Result<(), AggError> {
        if n >= 1 {
            Ok(())
        } else {
            Err(AggError::Precondition {
                rule: self.name().to_string(),
                requirement: "n >= 1",
                n,
                f: 0,
            })
        }
    }

    fn structure(&self) -> Structure {
        Structure::CoordinateWise
    }

    fn aggregate(&self, inputs: Inputs<'_>, out: Output<'_>) -> Result<AggReport, AggError> {
        // The mean refuses any non-finite input, so a result means there was none.
        crate::dispatch!(self, inputs, out).map(|()| AggReport::non_finite(Vec::new()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aggregate_into;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Straightforward per-coordinate reference: sort with `total_cmp`.
    fn reference(inputs: &[Vec<f64>], f: usize, median: bool) -> Vec<f64> {
        let n = inputs.len();
        (0..inputs[0].len())
            .map(|c| {
                let mut col: Vec<f64> = inputs.iter().map(|x| x[c]).collect();
                col.sort_by(|a, b| a.total_cmp(b));
                if median {
                    if n % 2 == 1 {
                        col[n / 2]
                    } else {
                        col[n / 2 - 1] * 0.5 + col[n / 2] * 0.5
                    }
                } else {
                    col[f..n - f].iter().sum::<f64>() / (n - 2 * f) as f64
                }
            })
            .collect()
    }

    fn random_inputs(rng: &mut StdRng, n: usize, d: usize) -> Vec<Vec<f64>> {
        (0..n)
            .map(|_| (0..d).map(|_| rng.gen_range(-10.0..10.0)).collect())
            .collect()
    }

    #[test]
    fn median_and_trimmed_mean_match_reference_on_random_inputs() {
        let mut rng = StdRng::seed_from_u64(7);
        for n in [1usize, 2, 3, 4, 7, 8, 11, 33, 64, 65, 70] {
            for d in [0usize, 1, 5, 1000, 5000] {
                let inputs = random_inputs(&mut rng, n, d);
                let refs: Vec<&[f64]> = inputs.iter().map(Vec::as_slice).collect();
                let f = (n - 1) / 2;
                let mut out = vec![0.0; d];
                aggregate_into(&Median::new(f), &refs, &mut out).unwrap();
                assert_eq!(out, reference(&inputs, f, true), "median n={n} d={d}");
                aggregate_into(&TrimmedMean::new(f), &refs, &mut out).unwrap();
                let want = reference(&inputs, f, false);
                for (a, b) in out.iter().zip(&want) {
                    assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "trimmed n={n}");
                }
            }
        }
    }

    /// Every path (registers for n <= 16, register halves and a merge up to 32, the memory
    /// network above) against a sort of each column, bitwise, on `f32` inputs with NaN,
    /// infinities and signed zeros sprinkled in, at widths that end mid-group and mid-block.
    #[test]
    fn f32_rules_match_a_column_sort_with_non_finite_values_at_block_edges() {
        let mut rng = StdRng::seed_from_u64(11);
        let specials = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
        ];
        for n in 1..=34usize {
            for d in [1usize, 7, 8, 9, 513, 1029] {
                let rows: Vec<Vec<f32>> = (0..n)
                    .map(|_| {
                        (0..d)
                            .map(|_| {
                                if rng.gen_bool(0.05) {
                                    specials[rng.gen_range(0..specials.len())]
                                } else {
                                    rng.gen_range(-4i32..4) as f32 * 0.75
                                }
                            })
                            .collect()
                    })
                    .collect();
                let inputs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
                let columns: Vec<Vec<f32>> = (0..d)
                    .map(|c| {
                        let mut col: Vec<f32> = rows.iter().map(|r| r[c]).collect();
                        col.sort_by(f32::total_cmp);
                        col
                    })
                    .collect();
                let check = |rule: &dyn Aggregator, want: &dyn Fn(&[f32]) -> f32| {
                    let want: Vec<f32> = columns.iter().map(|c| want(c)).collect();
                    let mut out = vec![0.0f32; d];
                    let got = aggregate_into(rule, &inputs, &mut out);
                    match want.iter().position(|v| !v.is_finite()) {
                        Some(c) => assert!(
                            matches!(got, Err(AggError::NonFiniteResult { coordinate, .. }) if coordinate == c),
                            "{} n={n} d={d}: {got:?}, want coordinate {c}",
                            rule.name()
                        ),
                        None => {
                            assert!(got.is_ok(), "{} n={n} d={d}: {got:?}", rule.name());
                            let bits =
                                |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(bits(&out), bits(&want), "{} n={n} d={d}", rule.name());
                        }
                    }
                };
                let mid = n / 2;
                check(&Median::new((n - 1) / 2), &|c: &[f32]| {
                    if n % 2 == 1 {
                        c[mid]
                    } else {
                        (c[mid - 1] as f64 * 0.5 + c[mid] as f64 * 0.5) as f32
                    }
                });
                for f in [0, (n - 1) / 4, (n - 1) / 2] {
                    check(&TrimmedMean::new(f), &|c: &[f32]| {
                        let sum = c[f..n - f].iter().fold(0.0f64, |a, &v| a + v as f64);
                        (sum * (1.0 / (n - 2 * f) as f64)) as f32
                    });
                }
            }
        }
    }

    /// Random 16-bit rows: half ties (multiples of 1/4), half arbitrary finite bit patterns
    /// (every binade, subnormals included: sums that round, midpoints that tie), and at
    /// `special_rate` per mille NaN (quiet and signalling, both signs), infinities, signed
    /// zeros, the smallest subnormals and the largest finite values.
    fn rows_16<T: Element>(rng: &mut StdRng, n: usize, d: usize, special_rate: u32) -> Vec<Vec<T>> {
        let (exponent, quiet) = match T::DTYPE {
            crate::DType::BF16 => (0x7f80u16, 0x0040u16),
            _ => (0x7c00, 0x0200),
        };
        let specials = [
            exponent | quiet,
            0x8000 | exponent | quiet | 3,
            exponent | 1,
            0x8000 | exponent | 5,
            exponent,
            0x8000 | exponent,
            0,
            0x8000,
            1,
            0x8001,
            exponent - 1,
            0x8000 | (exponent - 1),
        ];
        (0..n)
            .map(|_| {
                (0..d)
                    .map(|_| {
                        let bits = match rng.gen_range(0..1000) {
                            r if r < special_rate => specials[rng.gen_range(0..specials.len())],
                            r if r < 500 => {
                                bytemuck::cast(T::from_f64(rng.gen_range(-12i32..12) as f64 * 0.25))
                            }
                            _ => loop {
                                let b: u16 = rng.gen();
                                if b & exponent != exponent {
                                    break b;
                                }
                            },
                        };
                        bytemuck::cast::<u16, T>(bits)
                    })
                    .collect()
            })
            .collect()
    }

    /// The register paths of the 16-bit types against the portable ones (and, for the mean,
    /// the portable sum of every coordinate), bitwise: every `n` up to 33 (the fused paths
    /// take up to 32), widths that end mid-vector and cross a rayon block, inputs with and
    /// without NaN, infinities, signed zeros and subnormals. Where the portable path fails,
    /// the same error; where it succeeds, the same bits; the inputs named as non-finite are
    /// exactly those holding a NaN or an infinity.
    fn sixteen_bit_paths_match_the_portable_ones<T: Element>(seed: u64) {
        let mut rng = StdRng::seed_from_u64(seed);
        let bits = |v: &[T]| -> Vec<u16> { v.iter().map(|&x| bytemuck::cast(x)).collect() };
        for n in 1..=33usize {
            for d in [1usize, 7, 15, 16, 17, 33, 8192 + 21] {
                if d > 33 && n % 4 != 1 {
                    continue;
                }
                for special_rate in [0, 30] {
                    let rows = rows_16::<T>(&mut rng, n, d, special_rate);
                    let inputs: Vec<&[T]> = rows.iter().map(Vec::as_slice).collect();
                    let holding: Vec<usize> =
                        (0..n).filter(|&i| !crate::all_finite(&rows[i])).collect();
                    let what = format!("{:?} n {n} d {d} rate {special_rate}", T::DTYPE);
                    let check = |got: Result<Option<Vec<usize>>, AggError>,
                                 fast: &[T],
                                 want: Result<(), AggError>,
                                 slow: &[T],
                                 rule: &str| {
                        if let Ok(Some(found)) = &got {
                            assert_eq!(found, &holding, "{rule} {what}");
                        }
                        assert_eq!(got.clone().map(|_| ()), want, "{rule} {what}");
                        if want.is_ok() {
                            let differ =
                                bits(fast).iter().zip(bits(slow)).position(|(a, b)| *a != b);
                            assert_eq!(differ, None, "{rule} {what}: first differing coordinate");
                        }
                    };
                    let zero = T::from_f64(0.0);
                    let (mut fast, mut slow) = (vec![zero; d], vec![zero; d]);
                    // Every kernel this CPU runs against the portable path; `run` (the dispatch
                    // and the report) as well.
                    let by_every = |finish, want: &Result<(), AggError>, slow: &[T], rule: &str| {
                        for (kernels, done, out) in
                            network::fused_by_every_kernel(&inputs, finish, zero)
                        {
                            let got =
                                done.result.map(|()| Some(done.non_finite)).map_err(
                                    |c| match want {
                                        Err(AggError::NonFiniteResult { rule, f, .. }) => {
                                            AggError::NonFiniteResult {
                                                rule: rule.clone(),
                                                f: *f,
                                                coordinate: c,
                                            }
                                        }
                                        _ => panic!(
                                            "{rule} {kernels} {what}: Err({c}), want {want:?}"
                                        ),
                                    },
                                );
                            check(got, &out, want.clone(), slow, &format!("{rule} {kernels}"));
                        }
                    };
                    let median = Median::new((n - 1) / 2);
                    let got = median.run(&inputs, &mut fast);
                    let want = median.run_portable(&inputs, &mut slow);
                    by_every(network::Finish::Median, &want, &slow, "median");
                    check(got, &fast, want, &slow, "median");
                    for f in [0, (n - 1) / 4, (n - 1) / 2] {
                        let trimmed = TrimmedMean::new(f);
                        let got = trimmed.run(&inputs, &mut fast);
                        let want = trimmed.run_portable(&inputs, &mut slow);
                        by_every(network::Finish::Trimmed { f }, &want, &slow, "trimmed");
                        check(got, &fast, want, &slow, "trimmed");
                    }
                    // The mean: every coordinate, finite or not, against the portable sum.
                    let scale = 1.0 / n as f64;
                    let sums: Vec<T> = (0..d)
                        .map(|c| {
                            T::from_f64(rows.iter().fold(0.0, |a, r| a + r[c].to_f64()) * scale)
                        })
                        .collect();
                    let first_bad = sums.iter().position(|v| !v.is_finite());
                    for (kernels, got, out) in network::mean_by_every_kernel(&inputs, zero) {
                        assert_eq!(got, first_bad.map_or(Ok(()), Err), "mean {kernels} {what}");
                        for (c, (g, w)) in out.iter().zip(&sums).enumerate() {
                            // A NaN's payload depends on which NaN the sum met first.
                            let same = match w.to_f64().is_nan() {
                                true => g.to_f64().is_nan(),
                                false => bits(&[*g]) == bits(&[*w]),
                            };
                            assert!(same, "mean {kernels} {what} coordinate {c}: {g:?} != {w:?}");
                        }
                    }
                    let got = aggregate_into(&Mean::new(), &inputs, &mut fast);
                    let want = Mean::sum_blocks(&inputs, &mut slow);
                    assert_eq!(got.is_ok(), want.is_ok(), "mean {what}");
                    if want.is_ok() {
                        let differ = bits(&fast)
                            .iter()
                            .zip(bits(&slow))
                            .position(|(a, b)| *a != b);
                        assert_eq!(differ, None, "mean {what}: first differing coordinate");
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_register_paths_match_the_portable_ones_bitwise() {
        sixteen_bit_paths_match_the_portable_ones::<half::bf16>(38);
    }

    #[test]
    fn f16_register_paths_match_the_portable_ones_bitwise() {
        sixteen_bit_paths_match_the_portable_ones::<half::f16>(39);
    }

    #[test]
    fn f32_median_matches_f64_reference() {
        let mut rng = StdRng::seed_from_u64(9);
        let inputs = random_inputs(&mut rng, 5, 3000);
        let f32s: Vec<Vec<f32>> = inputs
            .iter()
            .map(|x| x.iter().map(|&v| v as f32).collect())
            .collect();
        let as64: Vec<Vec<f64>> = f32s
            .iter()
            .map(|x| x.iter().map(|&v| v as f64).collect())
            .collect();
        let refs: Vec<&[f32]> = f32s.iter().map(Vec::as_slice).collect();
        let mut out = vec![0.0f32; 3000];
        aggregate_into(&Median::new(2), &refs, &mut out).unwrap();
        let want = reference(&as64, 2, true);
        assert!(out.iter().zip(&want).all(|(a, b)| *a as f64 == *b));
    }

    #[test]
    fn up_to_f_non_finite_inputs_never_reach_the_output() {
        let honest = [[1.0f32, 2.0, 3.0], [1.5, 2.5, 3.5], [2.0, 3.0, 4.0]];
        let attacks = [
            [f32::NAN, -f32::NAN, f32::NAN],
            [f32::INFINITY, f32::NEG_INFINITY, f32::NAN],
        ];
        let mut inputs: Vec<&[f32]> = honest.iter().map(|x| &x[..]).collect();
        inputs.extend(attacks.iter().map(|x| &x[..]));
        for rule in [&Median::new(2) as &dyn Aggregator, &TrimmedMean::new(2)] {
            let mut out = [0.0f32; 3];
            aggregate_into(rule, &inputs, &mut out).unwrap();
            for (c, v) in out.iter().enumerate() {
                let lo = honest.iter().map(|x| x[c]).fold(f32::MAX, f32::min);
                let hi = honest.iter().map(|x| x[c]).fold(f32::MIN, f32::max);
                assert!(
                    v.is_finite() && lo <= *v && *v <= hi,
                    "{} gave {v}",
                    rule.name()
                );
            }
        }
    }

    #[test]
    fn more_than_f_non_finite_is_an_error_not_a_nan() {
        let a = [f32::NAN];
        let b = [f32::NAN];
        let c = [1.0f32];
        let mut out = [0.0f32];
        let err = aggregate_into(&Median::new(1), &[&a, &b, &c], &mut out).unwrap_err();
        assert!(
            matches!(err, AggError::NonFiniteResult { coordinate: 0, .. }),
            "{err}"
        );
        let err = aggregate_into(&TrimmedMean::new(1), &[&a, &b, &c], &mut out).unwrap_err();
        assert!(matches!(err, AggError::NonFiniteResult { .. }), "{err}");
    }

    #[test]
    fn mean_refuses_non_finite_inputs_and_names_them() {
        let a = [1.0f64, 2.0];
        let b = [1.0f64, f64::INFINITY];
        let c = [f64::NAN, 2.0];
        let mut out = [0.0f64; 2];
        let err = aggregate_into(&Mean::new(), &[&a, &b, &c], &mut out).unwrap_err();
        assert_eq!(
            err,
            AggError::NonFiniteInputs {
                rule: "mean".into(),
                inputs: vec![1, 2]
            }
        );
        aggregate_into(&Mean::new(), &[&a, &a, &[4.0, 5.0][..]], &mut out).unwrap();
        assert_eq!(out, [2.0, 3.0]);
    }

    #[test]
    fn preconditions_are_checked() {
        assert!(Median::new(1).check(3).is_ok());
        let err = Median::new(1).check(2).unwrap_err();
        assert!(err.to_string().contains("n > 2f"), "{err}");
        assert!(TrimmedMean::new(3).check(6).is_err());
        assert!(Mean::new().check(0).is_err());
        let x = [1.0f32];
        let mut out = [0.0f32];
        assert!(matches!(
            aggregate_into(&Median::new(1), &[&x, &x], &mut out),
            Err(AggError::Precondition { n: 2, f: 1, .. })
        ));
    }

    #[test]
    fn length_mismatch_names_the_input() {
        let a = [1.0f32, 2.0];
        let b = [1.0f32];
        let mut out = [0.0f32; 2];
        assert_eq!(
            aggregate_into(&Median::new(0), &[&a, &b], &mut out),
            Err(AggError::LengthMismatch {
                input: 1,
                len: 1,
                expected: 2
            })
        );
    }
}
