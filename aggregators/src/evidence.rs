//! Evidence of which inputs lay far from an aggregate: the measurements behind a round's
//! attribution (`RoundReport::attribution` in `byzcoll-proto`).
//!
//! [`measure`] compares each input with the result a rule made of them, at a sample of
//! coordinates chosen from the result itself (so a sender cannot know them before it sends):
//! every coordinate up to [`SAMPLED`] of them, [`SAMPLED`] in [`BLOCK`]-long runs, one run at
//! a random offset in each of `SAMPLED / BLOCK` equal strata, beyond. At each sampled
//! coordinate it adds each input's squared deviation from the result (in `f64`; `+inf` where
//! the input or the result is not finite there, never NaN) and counts whether the input was
//! *extreme*: at most `k = max(f, 1)` of the present values (itself included) at or below it,
//! or at or above it, where more than `2k` are present. That is the value a trimmed mean of
//! `k` would have trimmed, except that a value tied with a kept one counts as kept, so that
//! identical inputs are never extreme.
//!
//! Everything is a pure function of the inputs and the result, summed in coordinate order:
//! ranks that measure the same inputs against the same result get the same bits.

use crate::Element;

/// The most coordinates [`measure`] samples of one vector.
pub const SAMPLED: usize = 1024;

/// The length of one sampled run of coordinates.
pub const BLOCK: usize = 32;

/// Sums over the sampled coordinates, per input (the order of [`measure`]'s `inputs`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measure {
    /// Coordinates at which each input was measured (0: it was not present).
    pub coordinates: Vec<u64>,
    /// The sum of its squared deviations from the result (`+inf` once one was not finite).
    pub sq_deviation: Vec<f64>,
    /// The coordinates at which it was extreme.
    pub extreme: Vec<u64>,
}

impl Measure {
    /// An empty measure of `n` inputs.
    pub fn new(n: usize) -> Self {
        Measure {
            coordinates: vec![0; n],
            sq_deviation: vec![0.0; n],
            extreme: vec![0; n],
        }
    }

    /// Adds `other`'s sums to these (another shard or another part of the same vector).
    pub fn add(&mut self, other: &Measure) {
        for (a, b) in self.coordinates.iter_mut().zip(&other.coordinates) {
            *a += b;
        }
        for (a, b) in self.sq_deviation.iter_mut().zip(&other.sq_deviation) {
            *a += b;
        }
        for (a, b) in self.extreme.iter_mut().zip(&other.extreme) {
            *a += b;
        }
    }
}

/// The sampled runs of a vector of `len` elements (see the module docs), seeded by `seed`.
fn runs(len: usize, seed: u64) -> Vec<std::ops::Range<usize>> {
    if len <= SAMPLED {
        return std::iter::once(0..len).collect();
    }
    let strata = SAMPLED / BLOCK;
    let mut state = seed;
    (0..strata)
        .map(|k| {
            let start = k * len / strata;
            let end = (k + 1) * len / strata;
            // `end - start >= len / strata > BLOCK`, since `len > SAMPLED`.
            let slack = (end - start - BLOCK) as u64;
            let offset = (splitmix64(&mut state) % (slack + 1)) as usize;
            start + offset..start + offset + BLOCK
        })
        .collect()
}

/// One step of SplitMix64: a well-mixed 64-bit value from a counter (sampling, not secrecy).
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A seed drawn from `result`: its length and the bits of up to 64 evenly spaced elements.
fn seed_of<T: Element>(result: &[T]) -> u64 {
    let mut state = result.len() as u64;
    let step = result.len().div_ceil(64).max(1);
    for v in result.iter().step_by(step) {
        let bits: &[u8] = bytemuck::bytes_of(v);
        let mut word = [0u8; 8];
        word[..bits.len().min(8)].copy_from_slice(&bits[..bits.len().min(8)]);
        state ^= u64::from_le_bytes(word);
        splitmix64(&mut state);
    }
    state
}

/// Measures `inputs` (`None`: not present) against `result`, which a rule tolerating `f`
/// Byzantine inputs made of the present ones (see the module docs). Every present input has
/// `result.len()` elements.
///
/// # Panics
/// Where a present input's length is not the result's (a caller's bug).
pub fn measure<T: Element>(inputs: &[Option<&[T]>], result: &[T], f: usize) -> Measure {
    let n = inputs.len();
    let mut m = Measure::new(n);
    let present: Vec<(usize, &[T])> = inputs
        .iter()
        .enumerate()
        .filter_map(|(p, x)| x.map(|x| (p, x)))
        .collect();
    for (_, x) in &present {
        assert_eq!(x.len(), result.len(), "an input of another length");
    }
    let runs = runs(result.len(), seed_of(result));
    let sampled: u64 = runs.iter().map(|r| r.len() as u64).sum();
    let k = f.max(1);
    let mut keys: Vec<T::Key> = Vec::with_capacity(present.len());
    for &(p, x) in &present {
        m.coordinates[p] = sampled;
        let mut sum = 0.0f64;
        for run in &runs {
            for (&a, &b) in x[run.clone()].iter().zip(&result[run.clone()]) {
                let diff = a.to_f64() - b.to_f64();
                sum += diff * diff;
            }
        }
        // A NaN or an infinity anywhere (or squares past f64's range) is infinitely far.
        m.sq_deviation[p] = if sum.is_finite() { sum } else { f64::INFINITY };
    }
    if present.len() > 2 * k {
        let count = present.len();
        for j in runs.into_iter().flatten() {
            keys.clear();
            keys.extend(present.iter().map(|(_, x)| x[j].key()));
            keys.sort_unstable();
            // At most `k` values at or below `key` exactly when `key` is below the `k+1`-th
            // smallest; likewise from above.
            let (low, high) = (keys[k], keys[count - 1 - k]);
            for &(p, x) in &present {
                let key = x[j].key();
                m.extreme[p] += u64::from(key < low || key > high);
            }
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_inputs_are_neither_far_nor_extreme() {
        let x = vec![1.5f32; 100];
        let m = measure(&[Some(&x[..]), Some(&x), Some(&x), Some(&x)], &x, 1);
        assert_eq!(m.coordinates, vec![100; 4]);
        assert_eq!(m.sq_deviation, vec![0.0; 4]);
        assert_eq!(m.extreme, vec![0; 4]);
    }

    #[test]
    fn an_outlier_is_far_and_extreme_and_an_absent_input_is_unmeasured() {
        let d = 10_000;
        let mut next = crate::testing::xorshift(42);
        let honest: Vec<Vec<f32>> = (0..4)
            .map(|_| {
                (0..d)
                    .map(|_| 1.0 + (next() % 1000) as f32 / 1000.0)
                    .collect()
            })
            .collect();
        let liar: Vec<f32> = honest[0].iter().map(|v| v * -20.0).collect();
        let result = honest[1].clone();
        let inputs = [
            Some(&honest[0][..]),
            Some(&honest[1][..]),
            None,
            Some(&liar[..]),
            Some(&honest[2][..]),
            Some(&honest[3][..]),
        ];
        let m = measure(&inputs, &result, 1);
        assert_eq!(m.coordinates[2], 0);
        assert_eq!(m.coordinates[0], SAMPLED as u64);
        let rms = |p: usize| (m.sq_deviation[p] / m.coordinates[p] as f64).sqrt();
        assert!(rms(3) > 50.0 * rms(0), "{m:?}");
        // The liar is below every honest value at every coordinate; each honest input is
        // the highest of the five about one coordinate in four.
        assert_eq!(m.extreme[3], SAMPLED as u64, "{m:?}");
        for p in [0, 1, 4, 5] {
            let share = m.extreme[p] as f64 / SAMPLED as f64;
            assert!((0.15..0.35).contains(&share), "{p}: {m:?}");
        }
        assert_eq!(m.extreme[2], 0);
    }

    #[test]
    fn non_finite_inputs_measure_infinite_never_nan() {
        let x = vec![1.0f64; 8];
        let mut y = x.clone();
        y[3] = f64::NAN;
        let m = measure(&[Some(&x[..]), Some(&y), Some(&x)], &x, 1);
        assert_eq!(m.sq_deviation[1], f64::INFINITY);
        assert_eq!(m.sq_deviation[0], 0.0);
    }

    #[test]
    fn the_sample_is_fixed_by_the_result_and_stays_in_bounds() {
        let len = 1_000_003;
        let a = runs(len, 7);
        assert_eq!(a, runs(len, 7));
        assert_ne!(a, runs(len, 8));
        assert_eq!(a.iter().map(|r| r.len()).sum::<usize>(), SAMPLED);
        assert!(a.windows(2).all(|w| w[0].end <= w[1].start));
        assert!(a.last().unwrap().end <= len);
        assert_eq!(runs(SAMPLED + 1, 0).len(), SAMPLED / BLOCK);
        assert_eq!(runs(5, 0), std::iter::once(0..5).collect::<Vec<_>>());
    }
}
