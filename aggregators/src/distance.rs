//! Pairwise squared Euclidean distances, computed from differences (never with the
//! `|a|² + |b|² - 2<a,b>` shortcut, which cancels catastrophically on nearly equal vectors)
//! and accumulated in `f64`.
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

/// `Σ (a_j - b_j)²` in `f64`.
#[inline]
pub(crate) fn sq_dist<T: Element>(a: &[T], b: &[T]) -> f64 {
    let mut acc = [0.0f64; 4];
    let (ca, ra) = a.split_at(a.len() - a.len() % 4);
    let (cb, rb) = b.split_at(ca.len());
    for (x, y) in ca.chunks_exact(4).zip(cb.chunks_exact(4)) {
        for k in 0..4 {
            let d = x[k].to_f64() - y[k].to_f64();
            acc[k] += d * d;
        }
    }
    for (x, y) in ra.iter().zip(rb) {
        let d = x.to_f64() - y.to_f64();
        acc[0] += d * d;
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3])
}

/// Whether every value of each input is finite.
pub(crate) fn finite_inputs<T: Element>(inputs: &[&[T]]) -> Vec<bool> {
    inputs
        .par_iter()
        .map(|x| x.iter().all(|v| v.is_finite()))
        .collect()
}

/// The `n × n` table of squared distances (row-major). Distances involving an input with a
/// non-finite value are `+inf` (such an input is infinitely far from everything, itself
/// included), so distance-based rules never select it.
pub(crate) fn pairwise_sq_distances<T: Element>(inputs: &[&[T]], finite: &[bool]) -> Vec<f64> {
    let n = inputs.len();
    let d = inputs.first().map_or(0, |x| x.len());
    let chunk = d.div_ceil(CHUNKS).max(1);
    let partials: Vec<Vec<f64>> = (0..d.div_ceil(chunk))
        .into_par_iter()
        .map(|c| {
            let mut table = vec![0.0f64; n * n];
            let end = d.min((c + 1) * chunk);
            let mut start = c * chunk;
            while start < end {
                let stop = end.min(start + TILE);
                for i in 0..n {
                    if !finite[i] {
                        continue;
                    }
                    let a = &inputs[i][start..stop];
                    for j in i + 1..n {
                        if finite[j] {
                            table[i * n + j] += sq_dist(a, &inputs[j][start..stop]);
                        }
                    }
                }
                start = stop;
            }
            table
        })
        .collect();
    let mut table = vec![0.0f64; n * n];
    for p in &partials {
        for (t, v) in table.iter_mut().zip(p) {
            *t += v;
        }
    }
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
    table
}

#[cfg(test)]
mod tests {
    use super::*;

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
