//! Iterative rules that start from the coordinate-wise median: the geometric median (smoothed
//! Weiszfeld) and centered clipping.
//!
//! An input holding NaN or infinities is infinitely far from any estimate: it gets weight zero
//! (geometric median) or is clipped to nothing (centered clipping). Every sum runs over inputs
//! in index order, so results are bitwise reproducible.

use rayon::prelude::*;

use crate::coordinate::precondition;
use crate::distance::finite_inputs;
use crate::{
    check_lengths, AggError, AggReport, Aggregator, DistanceIteration, Element, Inputs, Median,
    Output, Structure,
};

const BLOCK: usize = 4096;

/// The coordinate-wise median as the starting point, in `f64`.
fn median_start<T: Element>(inputs: &[&[T]]) -> Result<Vec<f64>, AggError> {
    let mut m = vec![T::zeroed(); inputs.first().map_or(0, |x| x.len())];
    Median::new((inputs.len() - 1) / 2).run(inputs, &mut m)?;
    Ok(m.iter().map(|v| v.to_f64()).collect())
}

/// `‖x - z‖` for each input (`+inf` for non-finite inputs).
pub fn distances_to<T: Element>(inputs: &[&[T]], finite: &[bool], z: &[f64]) -> Vec<f64> {
    sq_distances_to(inputs, finite, z)
        .into_iter()
        .map(f64::sqrt)
        .collect()
}

/// `‖x - z‖²` for each input (`+inf` for non-finite inputs), each summed in coordinate order.
pub fn sq_distances_to<T: Element>(inputs: &[&[T]], finite: &[bool], z: &[f64]) -> Vec<f64> {
    inputs
        .par_iter()
        .zip(finite)
        .map(|(x, &ok)| {
            if !ok {
                return f64::INFINITY;
            }
            x.iter()
                .zip(z)
                .map(|(a, b)| {
                    let d = a.to_f64() - b;
                    d * d
                })
                .sum::<f64>()
        })
        .collect()
}

/// `Σ_i w_i x_i` per coordinate, over inputs with non-zero weight, in index order.
fn weighted_sum<T: Element>(inputs: &[&[T]], weights: &[f64], out: &mut [f64]) {
    out.par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(b, chunk)| {
            let base = b * BLOCK;
            let len = chunk.len();
            chunk.fill(0.0);
            for (x, &w) in inputs.iter().zip(weights) {
                if w != 0.0 {
                    for (o, v) in chunk.iter_mut().zip(&x[base..base + len]) {
                        *o += w * v.to_f64();
                    }
                }
            }
        });
}

fn norm(v: impl Iterator<Item = f64>) -> f64 {
    v.map(|x| x * x).sum::<f64>().sqrt()
}

fn write_out<T: Element>(rule: &str, f: usize, z: &[f64], out: &mut [T]) -> Result<(), AggError> {
    for (j, (o, v)) in out.iter_mut().zip(z).enumerate() {
        *o = T::from_f64(*v);
        if !o.is_finite() {
            return Err(AggError::NonFiniteResult {
                rule: rule.to_string(),
                f,
                coordinate: j,
            });
        }
    }
    Ok(())
}

fn check_non_finite(rule: &str, f: usize, finite: &[bool]) -> Result<(), AggError> {
    let count = finite.iter().filter(|x| !**x).count();
    if count > f {
        Err(AggError::TooManyNonFiniteInputs {
            rule: rule.to_string(),
            f,
            count,
        })
    } else {
        Ok(())
    }
}

/// Runs a [`DistanceIteration`] from the coordinate-wise median over whole vectors.
fn iterate<T: Element>(
    rule: &dyn DistanceIteration,
    name: &str,
    f: usize,
    inputs: &[&[T]],
    out: &mut [T],
) -> Result<AggReport, AggError> {
    let finite = finite_inputs(inputs);
    check_non_finite(name, f, &finite)?;
    let mut z = median_start(inputs)?;
    let mut next = vec![0.0f64; z.len()];
    for _ in 0..rule.max_steps() {
        let (a, w) = rule.coefficients(&distances_to(inputs, &finite, &z));
        step_into(inputs, a, &w, &z, &mut next);
        let change = norm(next.iter().zip(&z).map(|(p, q)| p - q));
        let size = norm(z.iter().copied());
        std::mem::swap(&mut z, &mut next);
        if rule
            .tolerance()
            .is_some_and(|tol| change <= tol * size.max(f64::MIN_POSITIVE))
        {
            break;
        }
    }
    write_out(name, f, &z, out)?;
    Ok(AggReport::default())
}

/// `next = a·z + Σ_i w_i·x_i`, inputs with zero weight skipped, in index order.
pub fn step_into<T: Element>(inputs: &[&[T]], a: f64, w: &[f64], z: &[f64], next: &mut [f64]) {
    weighted_sum(inputs, w, next);
    if a != 0.0 {
        next.par_iter_mut().zip(z).for_each(|(n, z)| *n += a * z);
    }
}

/// Geometric median by smoothed Weiszfeld iterations (Pillutla et al., RFA): `ν = 1e-6`, at
/// most 100 iterations, stopping when the relative change is below `1e-7`, starting from the
/// coordinate-wise median. Requires `n > 2f`.
///
/// The iterations run in `f64` and the result is rounded once to the element type; the start
/// is the median in the element type (for an even `n` and a 16-bit type, the mean of the two
/// middle values rounded to it).
#[derive(Debug, Clone)]
pub struct GeometricMedian {
    f: usize,
}

impl GeometricMedian {
    /// Smoothing `ν`.
    pub const NU: f64 = 1e-6;
    /// Iteration cap.
    pub const MAX_ITERATIONS: usize = 100;
    /// Relative-change stopping threshold.
    pub const TOLERANCE: f64 = 1e-7;

    /// The geometric median tolerating `f` Byzantine inputs.
    pub fn new(f: usize) -> Self {
        GeometricMedian { f }
    }

    fn run<T: Element>(&self, inputs: &[&[T]], out: &mut [T]) -> Result<AggReport, AggError> {
        check_lengths(inputs, out.len())?;
        self.check(inputs.len())?;
        iterate(self, self.name(), self.f, inputs, out)
    }
}

impl DistanceIteration for GeometricMedian {
    fn max_steps(&self) -> usize {
        Self::MAX_ITERATIONS
    }

    fn tolerance(&self) -> Option<f64> {
        Some(Self::TOLERANCE)
    }

    fn coefficients(&self, distances: &[f64]) -> (f64, Vec<f64>) {
        let raw: Vec<f64> = distances
            .iter()
            .map(|&d| {
                if d.is_finite() {
                    1.0 / d.max(Self::NU)
                } else {
                    0.0
                }
            })
            .collect();
        let total: f64 = raw.iter().sum();
        (0.0, raw.into_iter().map(|w| w / total).collect())
    }
}

impl Aggregator for GeometricMedian {
    fn name(&self) -> &str {
        "geometric-median"
    }
    fn byzantine(&self) -> usize {
        self.f
    }
    fn check(&self, n: usize) -> Result<(), AggError> {
        precondition(self.name(), n, self.f)
    }
    fn structure(&self) -> Structure {
        Structure::Global
    }
    fn distance_iteration(&self) -> Option<&dyn DistanceIteration> {
        Some(self)
    }
    fn aggregate(&self, inputs: Inputs<'_>, out: Output<'_>) -> Result<AggReport, AggError> {
        crate::dispatch!(self, inputs, out)
    }
}

/// Centered clipping (Karimireddy et al. 2021): `v ← v + (1/n) Σ clip(x_i - v, τ)` with
/// `clip(u, τ) = u · min(1, τ / ‖u‖)`, `L` iterations (default 3), starting from the
/// coordinate-wise median. Requires `n > 2f` and a finite `τ > 0`.
///
/// Rounding as for [`GeometricMedian`]: steps in `f64`, the result rounded once, from the
/// median in the element type.
#[derive(Debug, Clone)]
pub struct CenteredClipping {
    f: usize,
    tau: f64,
    iterations: usize,
}

impl CenteredClipping {
    /// Default number of iterations `L`.
    pub const DEFAULT_ITERATIONS: usize = 3;

    /// Centered clipping with radius `tau` and `iterations` steps.
    ///
    /// # Errors
    /// [`AggError::InvalidSpec`] unless `tau` is finite and positive.
    pub fn new(f: usize, tau: f64, iterations: usize) -> Result<Self, AggError> {
        if !(tau.is_finite() && tau > 0.0) {
            return Err(AggError::InvalidSpec(format!(
                "centered-clipping: tau = {tau} must be finite and positive"
            )));
        }
        Ok(CenteredClipping { f, tau, iterations })
    }

    fn run<T: Element>(&self, inputs: &[&[T]], out: &mut [T]) -> Result<AggReport, AggError> {
        check_lengths(inputs, out.len())?;
        self.check(inputs.len())?;
        iterate(self, self.name(), self.f, inputs, out)
    }
}

impl DistanceIteration for CenteredClipping {
    fn max_steps(&self) -> usize {
        self.iterations
    }

    fn tolerance(&self) -> Option<f64> {
        None
    }

    fn coefficients(&self, distances: &[f64]) -> (f64, Vec<f64>) {
        // v + Σ c_i (x_i − v) = (1 − Σ c_i)·v + Σ c_i·x_i, with c_i = min(1, τ/d_i) / n.
        let n = distances.len() as f64;
        let c: Vec<f64> = distances
            .iter()
            .map(|&d| {
                if !d.is_finite() {
                    0.0
                } else if d <= self.tau {
                    1.0 / n
                } else {
                    self.tau / d / n
                }
            })
            .collect();
        (1.0 - c.iter().sum::<f64>(), c)
    }
}

impl Aggregator for CenteredClipping {
    fn name(&self) -> &str {
        "centered-clipping"
    }
    fn byzantine(&self) -> usize {
        self.f
    }
    fn check(&self, n: usize) -> Result<(), AggError> {
        precondition(self.name(), n, self.f)
    }
    fn structure(&self) -> Structure {
        Structure::Global
    }
    fn distance_iteration(&self) -> Option<&dyn DistanceIteration> {
        Some(self)
    }
    fn aggregate(&self, inputs: Inputs<'_>, out: Output<'_>) -> Result<AggReport, AggError> {
        crate::dispatch!(self, inputs, out)
    }
}
