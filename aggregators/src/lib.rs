//! Aggregation rules for byzcoll's robust collectives.
//!
//! An [`Aggregator`] turns `n` input vectors of length `d` into one output vector. Every rule
//! states how many Byzantine inputs `f` it tolerates and the precondition on `n` that makes the
//! guarantee hold; [`Aggregator::check`] verifies it before any data moves, and
//! [`Aggregator::aggregate`] verifies it again against the inputs that actually arrived.
//!
//! There is no default rule: callers name one ([`by_name`]) or construct it. The non-robust
//! [`Mean`] exists for comparison and must be asked for explicitly.
//!
//! # Non-finite inputs
//! Coordinate-wise rules order values by IEEE-754 `totalOrder`
//! (`-NaN < -inf < finite < +inf < +NaN`), so NaN and infinities are extreme values: with at most
//! `f` non-finite values in a coordinate they are discarded by the median or trimmed away. When
//! more than `f` are present and one would reach the output, the rule returns
//! [`AggError::NonFiniteResult`] instead of a NaN. [`Mean`] refuses non-finite inputs with
//! [`AggError::NonFiniteInputs`].
//!
//! ```
//! use byzcoll_aggregators::{aggregate_into, Median};
//! let a = [1.0f32, 2.0];
//! let b = [2.0f32, f32::NAN];
//! let c = [3.0f32, 4.0];
//! let mut out = [0.0f32; 2];
//! aggregate_into(&Median::new(1), &[&a, &b, &c], &mut out).unwrap();
//! assert_eq!(out, [2.0, 4.0]);
//! ```

/// Calls `$self.run` with the typed slices, or reports mixed element types.
#[macro_export]
#[doc(hidden)]
macro_rules! dispatch {
    ($self:ident, $inputs:ident, $out:ident) => {
        match ($inputs, $out) {
            ($crate::Inputs::F32(x), $crate::Output::F32(o)) => $self.run(x, o),
            ($crate::Inputs::F64(x), $crate::Output::F64(o)) => $self.run(x, o),
            ($crate::Inputs::BF16(x), $crate::Output::BF16(o)) => $self.run(x, o),
            ($crate::Inputs::F16(x), $crate::Output::F16(o)) => $self.run(x, o),
            _ => Err($crate::AggError::Unsupported {
                rule: $self.name().to_string(),
                what: "inputs and output of different element types".to_string(),
            }),
        }
    };
}

pub mod attacks;
mod coordinate;
pub mod distance;
mod element;
pub mod evidence;
mod geometric;
mod krum;
mod network;
mod nnm;

use std::fmt;

pub use coordinate::{Mean, Median, TrimmedMean};
pub use element::{DType, Element};
pub use geometric::{CenteredClipping, GeometricMedian};

/// Building blocks of [`DistanceIteration`] rules, for schedules that run them on shards.
pub mod iteration {
    pub use crate::geometric::{distances_to, sq_distances_to, step_into};
}
pub use krum::{Bulyan, Krum, MultiKrum};
pub use nnm::Nnm;

/// Helpers the unit tests share.
#[cfg(test)]
pub(crate) mod testing {
    /// A xorshift64 generator from `seed` (non-zero): reproducible test data without a crate.
    pub(crate) fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        }
    }

    /// `m` rows of `d` values, three in four of them from a small palette: ties, signed zeros,
    /// huge values whose differences round, a subnormal.
    pub(crate) fn tie_rows(next: &mut impl FnMut() -> u64, m: usize, d: usize) -> Vec<Vec<f32>> {
        let palette = [-0.0f32, 0.0, 1.0, -1.0, 2.5, 3.0e38, -3.0e38, 1.0e-40, 7.0];
        (0..m)
            .map(|_| {
                (0..d)
                    .map(|_| match next() % 4 {
                        0 => (next() % 1000) as f32 * 0.37 - 100.0,
                        _ => palette[(next() % palette.len() as u64) as usize],
                    })
                    .collect()
            })
            .collect()
    }

    /// The register paths this CPU has (`false`: AVX2, `true`: AVX-512); `None`, after a
    /// visible SKIPPED line, where it has neither.
    pub(crate) fn register_paths() -> Option<Vec<bool>> {
        #[cfg(target_arch = "x86_64")]
        {
            let paths: Vec<bool> = [false, true]
                .into_iter()
                .filter(|&wide| match wide {
                    true => std::arch::is_x86_feature_detected!("avx512f"),
                    false => std::arch::is_x86_feature_detected!("avx2"),
                })
                .collect();
            if !paths.is_empty() {
                return Some(paths);
            }
        }
        eprintln!("SKIPPED: this CPU has neither AVX2 nor AVX-512");
        None
    }
}

/// Values [`first_non_finite`] checks at once, without stopping between them.
const FINITE_RUN: usize = 1024;

/// The index of the first NaN or infinity in `x`, if any. Runs of values are checked without
/// an exit per value, so the compiler checks many lanes at once (a `position`/`all` loop stops
/// after every value and checked about one per cycle: in the sharded round's finiteness
/// checks, a fifth of its CPU time); only a run that holds one is searched value by value.
pub fn first_non_finite<T: Element>(x: &[T]) -> Option<usize> {
    x.chunks(FINITE_RUN).enumerate().find_map(|(k, run)| {
        match run.iter().fold(true, |ok, v| ok & v.is_finite()) {
            true => None,
            false => run
                .iter()
                .position(|v| !v.is_finite())
                .map(|i| k * FINITE_RUN + i),
        }
    })
}

/// Whether every value of `x` is finite ([`first_non_finite`] finds none).
pub fn all_finite<T: Element>(x: &[T]) -> bool {
    first_non_finite(x).is_none()
}

/// Batcher's merge-exchange sorting network for `n` wires as `(lo, hi)` compare-exchange pairs
/// in execution order, pruned to the comparators that can influence the output positions
/// `needed` (after the network, those positions hold the values of those ranks). The CPU rules
/// run it across blocks of coordinates; the CUDA kernels compile it into straight-line code.
pub fn sorting_network(n: usize, needed: std::ops::Range<usize>) -> Vec<(usize, usize)> {
    network::pruned(n, needed)
}

/// Borrowed input vectors, one slice per input, all of the same length.
///
/// Non-exhaustive: device-memory inputs (CUDA) will be added as further variants; a rule that
/// cannot read a variant returns [`AggError::Unsupported`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Inputs<'a> {
    /// `f32` vectors in host memory.
    F32(&'a [&'a [f32]]),
    /// `f64` vectors in host memory.
    F64(&'a [&'a [f64]]),
    /// bfloat16 vectors in host memory.
    BF16(&'a [&'a [half::bf16]]),
    /// IEEE-754 binary16 vectors in host memory.
    F16(&'a [&'a [half::f16]]),
}

impl Inputs<'_> {
    /// Number of input vectors.
    pub fn count(&self) -> usize {
        match self {
            Inputs::F32(x) => x.len(),
            Inputs::F64(x) => x.len(),
            Inputs::BF16(x) => x.len(),
            Inputs::F16(x) => x.len(),
        }
    }
}

/// The caller's output buffer, of the same element type and length as the inputs.
#[derive(Debug)]
#[non_exhaustive]
pub enum Output<'a> {
    /// `f32` output in host memory.
    F32(&'a mut [f32]),
    /// `f64` output in host memory.
    F64(&'a mut [f64]),
    /// bfloat16 output in host memory.
    BF16(&'a mut [half::bf16]),
    /// IEEE-754 binary16 output in host memory.
    F16(&'a mut [half::f16]),
}

/// How a rule's output depends on its inputs; schedules use it to decide what they must exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Structure {
    /// Output coordinate `j` depends only on coordinate `j` of the inputs (median, trimmed mean,
    /// mean): shards can be aggregated independently.
    CoordinateWise,
    /// The output depends on global statistics of whole vectors (pairwise distances, norms), as
    /// in Krum or the geometric median.
    Global,
}

/// What a rule tells about its inputs besides the output.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AggReport {
    /// For selection rules (Krum, Multi-Krum, Bulyan): the indices of the inputs that were
    /// selected, so callers can see who was excluded. `None` for rules that select per
    /// coordinate.
    pub selected: Option<Vec<usize>>,
    /// The inputs (ascending indices) that hold a NaN or an infinity, where the rule found them
    /// while reading its inputs; `None` where it did not look. Callers that must name such
    /// inputs use it to spare a pass of their own over every input.
    pub non_finite: Option<Vec<usize>>,
}

impl AggReport {
    /// A report that lists the selected inputs.
    pub fn selected(indices: Vec<usize>) -> Self {
        AggReport {
            selected: Some(indices),
            non_finite: None,
        }
    }

    /// A report that names the inputs holding NaN or infinities (`indices` ascending).
    pub fn non_finite(indices: Vec<usize>) -> Self {
        AggReport {
            selected: None,
            non_finite: Some(indices),
        }
    }
}

/// Why an aggregation could not produce a trustworthy result.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum AggError {
    /// The rule's guarantee does not hold for this many inputs: configure a smaller `f`, or
    /// make sure more ranks take part.
    #[error("{rule} needs {requirement} but has n = {n}, f = {f}")]
    Precondition {
        /// Rule name.
        rule: String,
        /// The condition, e.g. `n > 2f`.
        requirement: &'static str,
        /// Inputs available.
        n: usize,
        /// Byzantine inputs tolerated.
        f: usize,
    },
    /// An input's length differs from the output's: a caller bug (the runtime rejects peers'
    /// wrong-length vectors before they get here).
    #[error("input {input} has length {len}, expected {expected}")]
    LengthMismatch {
        /// Index of the offending input.
        input: usize,
        /// Its length.
        len: usize,
        /// The output's length.
        expected: usize,
    },
    /// A non-robust rule was given NaN or infinite values; these inputs are named so the
    /// caller can exclude them or switch to a robust rule.
    #[error("{rule} refuses non-finite values from inputs {inputs:?}")]
    NonFiniteInputs {
        /// Rule name.
        rule: String,
        /// Indices of the inputs holding NaN or infinities.
        inputs: Vec<usize>,
    },
    /// More than `f` inputs were non-finite at a coordinate, so the result there would be NaN
    /// or infinite; the rule refuses to return it.
    #[error("{rule}: more than f = {f} inputs are non-finite at coordinate {coordinate}")]
    NonFiniteResult {
        /// Rule name.
        rule: String,
        /// Byzantine inputs tolerated.
        f: usize,
        /// First coordinate affected.
        coordinate: usize,
    },
    /// More inputs hold NaN or infinities than the rule can exclude, so any selection would
    /// include one; the rule refuses rather than return a non-finite result.
    #[error("{rule}: {count} inputs hold non-finite values, more than f = {f} allows")]
    TooManyNonFiniteInputs {
        /// Rule name.
        rule: String,
        /// Byzantine inputs tolerated.
        f: usize,
        /// Inputs holding NaN or infinities.
        count: usize,
    },
    /// A parameter is out of range or a rule name is not known.
    #[error("invalid aggregator specification: {0}")]
    InvalidSpec(String),
    /// The device or library that runs the rule (e.g. the CUDA driver or NVRTC) failed; the
    /// output is not written.
    #[error("{rule}: {backend} failed: {message}")]
    Backend {
        /// Rule name.
        rule: String,
        /// What failed, e.g. `CUDA`.
        backend: &'static str,
        /// The backend's message.
        message: String,
    },
    /// The rule cannot read this kind of input (element type or memory kind).
    #[error("{rule} does not support {what}")]
    Unsupported {
        /// Rule name.
        rule: String,
        /// What is missing.
        what: String,
    },
}

/// A rule that aggregates `n` vectors into one.
///
/// Implementations must be deterministic: every honest rank that aggregates the same inputs in
/// the same order gets bitwise the same output.
pub trait Aggregator: Send + Sync + fmt::Debug {
    /// The rule's name as accepted by [`by_name`], e.g. `median`.
    fn name(&self) -> &str;

    /// The number `f` of Byzantine inputs the rule is configured to tolerate.
    fn byzantine(&self) -> usize;

    /// The rule's parameters as text (`f` and the rest), the same for the same rule wherever
    /// it runs (a CPU rule and its GPU counterpart alike): part of a collective call's
    /// fingerprint, so ranks that chose different parameters are out of step, not mixed.
    fn parameters(&self) -> String {
        format!("{self:?}")
    }

    /// Checks the rule's precondition for `n` inputs (e.g. `n > 2f`).
    ///
    /// # Errors
    /// [`AggError::Precondition`] naming the requirement.
    fn check(&self, n: usize) -> Result<(), AggError>;

    /// Whether the output is coordinate-wise or needs global statistics.
    fn structure(&self) -> Structure;

    /// Aggregates `inputs` into `out`.
    ///
    /// # Errors
    /// [`AggError::Precondition`] when there are too few inputs, [`AggError::LengthMismatch`]
    /// when lengths differ, [`AggError::NonFiniteInputs`] / [`AggError::NonFiniteResult`] under
    /// the non-finite policy in the crate docs, [`AggError::Unsupported`] for an input kind the
    /// rule cannot read.
    fn aggregate(&self, inputs: Inputs<'_>, out: Output<'_>) -> Result<AggReport, AggError>;

    /// For rules whose output is a per-coordinate function of a set of inputs selected from
    /// pairwise distances (Krum, Multi-Krum, Bulyan): that decomposition, which lets a sharded
    /// schedule combine distance tables computed on shards. `None` for other rules.
    fn distance_selection(&self) -> Option<&dyn DistanceSelection> {
        None
    }

    /// For rules that move an estimate by steps whose coefficients depend only on the
    /// distances from each input to the estimate (geometric median, centered clipping): that
    /// decomposition, which lets a sharded schedule run the steps on shards. `None` for others.
    fn distance_iteration(&self) -> Option<&dyn DistanceIteration> {
        None
    }

    /// For pre-aggregation by mixing (NNM): each input is replaced by the mean of neighbours
    /// chosen from pairwise distances, then an inner rule runs. `None` for other rules.
    fn distance_mixing(&self) -> Option<&dyn DistanceMixing> {
        None
    }
}

/// Mixing chosen from the `n × n` table of pairwise squared distances, followed by an inner
/// rule. Mixing is coordinate-wise once the neighbour sets are known.
pub trait DistanceMixing: Send + Sync {
    /// For each input, the inputs whose mean replaces it (`None`: the input stays as it is,
    /// for the inner rule's non-finite policy).
    ///
    /// # Errors
    /// [`AggError::TooManyNonFiniteInputs`] when a neighbour set would include a non-finite
    /// input.
    fn neighbours(&self, dist: &[f64], n: usize) -> Result<Vec<Option<Vec<usize>>>, AggError>;

    /// The rule applied to the mixed inputs.
    fn inner(&self) -> &dyn Aggregator;
}

/// Replaces each input by the mean of its neighbours (coordinate-wise, in `f64`); inputs
/// without a neighbour set are copied.
pub fn mix<T: Element>(inputs: &[&[T]], neighbours: &[Option<Vec<usize>>]) -> Vec<Vec<T>> {
    use rayon::prelude::*;
    neighbours
        .par_iter()
        .enumerate()
        .map(|(i, near)| match near {
            None => inputs[i].to_vec(),
            Some(near) => {
                let mut acc = vec![0.0f64; inputs[i].len()];
                for &j in near {
                    for (a, v) in acc.iter_mut().zip(inputs[j]) {
                        *a += v.to_f64();
                    }
                }
                let k = near.len() as f64;
                acc.iter().map(|a| T::from_f64(a / k)).collect()
            }
        })
        .collect()
}

/// A rule that starts from the coordinate-wise median `z` and repeats
/// `z ← a·z + Σ_i w_i·x_i`, where `(a, w)` depend only on the distances `‖x_i − z‖`.
/// Every step is coordinate-wise once the distances are known, so shards can take it
/// independently after exchanging their partial squared distances.
pub trait DistanceIteration: Send + Sync {
    /// Most steps taken.
    fn max_steps(&self) -> usize;

    /// Stop once a step moved `z` by at most this fraction of `‖z‖` (`None`: take every step).
    fn tolerance(&self) -> Option<f64>;

    /// The step's coefficients `(a, w)` from the distances (`+inf` for inputs that hold
    /// non-finite values or are missing: they must get weight zero).
    fn coefficients(&self, distances: &[f64]) -> (f64, Vec<f64>);
}

/// A rule split into a selection made from the `n × n` table of pairwise squared distances
/// ([`distance::pairwise_sq_distances`]) and a per-coordinate finish over the selected inputs.
/// `finish` applied shard by shard gives the shards of the whole-vector result.
pub trait DistanceSelection: Send + Sync {
    /// The selected input indices, from the distance table (row-major, `+inf` rows for inputs
    /// holding non-finite values).
    ///
    /// # Errors
    /// [`AggError::TooManyNonFiniteInputs`] when the selection would take a non-finite input.
    fn select(&self, dist: &[f64], n: usize) -> Result<Vec<usize>, AggError>;

    /// Computes the output (or a shard of it) from the inputs (or the same shard of each) and
    /// the selection.
    ///
    /// # Errors
    /// [`AggError::NonFiniteResult`] when a coordinate's result would not be finite.
    fn finish(
        &self,
        inputs: Inputs<'_>,
        selected: &[usize],
        out: Output<'_>,
    ) -> Result<(), AggError>;
}

/// Typed convenience wrapper around [`Aggregator::aggregate`].
///
/// # Errors
/// As [`Aggregator::aggregate`].
pub fn aggregate_into<T: Element>(
    rule: &(impl Aggregator + ?Sized),
    inputs: &[&[T]],
    out: &mut [T],
) -> Result<AggReport, AggError> {
    rule.aggregate(T::inputs(inputs), T::output(out))
}

/// The rule names [`build`] accepts, with a one-line description. Any rule may be prefixed with
/// `nnm+` for nearest-neighbour mixing.
pub const RULES: &[(&str, &str)] = &[
    ("mean", "arithmetic mean; NOT robust, for comparison only"),
    ("median", "coordinate-wise median; n > 2f"),
    (
        "trimmed-mean",
        "coordinate-wise mean after dropping the f smallest and f largest; n > 2f",
    ),
    (
        "krum",
        "the input closest to its n-f-2 nearest neighbours; n > 2f+2",
    ),
    (
        "multi-krum",
        "mean of the m inputs with the best Krum scores (m = n-f); n > 2f+2",
    ),
    (
        "bulyan",
        "n-2f inputs chosen by Krum, then a trimmed mean around the median; n >= 4f+3",
    ),
    (
        "geometric-median",
        "smoothed Weiszfeld from the coordinate-wise median; n > 2f",
    ),
    (
        "centered-clipping",
        "3 clipped steps of radius tau (--tau) from the median; n > 2f",
    ),
    (
        "nnm+RULE",
        "nearest-neighbour mixing of n-f neighbours, then RULE; n > 2f",
    ),
];
/// Parameters of a rule, as given on a command line or in a config file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Params {
    /// Number of Byzantine inputs to tolerate.
    pub f: usize,
    /// Multi-Krum: how many inputs to average (default `n - f`).
    pub m: Option<usize>,
    /// Centered clipping: the clipping radius.
    pub tau: Option<f64>,
}

/// Builds a rule from its name (see [`RULES`]) and parameters.
///
/// # Errors
/// [`AggError::InvalidSpec`] for an unknown name (the message lists the known ones) or a
/// missing or invalid parameter.
pub fn build(name: &str, params: &Params) -> Result<Box<dyn Aggregator>, AggError> {
    let f = params.f;
    let refuse = |what: &str| {
        Err(AggError::InvalidSpec(format!(
            "{what} does not apply to `{name}`"
        )))
    };
    if params.m.is_some() && name != "multi-krum" && name != "nnm+multi-krum" {
        return refuse("m (the number of inputs Multi-Krum averages)");
    }
    if params.tau.is_some() && !name.ends_with("centered-clipping") {
        return refuse("tau (the clipping radius)");
    }
    if let Some(inner) = name.strip_prefix("nnm+") {
        if inner.starts_with("nnm+") {
            return Err(AggError::InvalidSpec(
                "nnm+ may be applied only once".into(),
            ));
        }
        return Ok(Box::new(Nnm::new(f, build(inner, params)?)));
    }
    Ok(match name {
        "mean" => Box::new(Mean::new()),
        "median" => Box::new(Median::new(f)),
        "trimmed-mean" | "trimmed_mean" => Box::new(TrimmedMean::new(f)),
        "krum" => Box::new(Krum::new(f)),
        "multi-krum" => Box::new(MultiKrum::new(f, params.m)),
        "bulyan" => Box::new(Bulyan::new(f)),
        "geometric-median" => Box::new(GeometricMedian::new(f)),
        "centered-clipping" => {
            let tau = params.tau.ok_or_else(|| {
                AggError::InvalidSpec("centered-clipping needs tau, the clipping radius".into())
            })?;
            Box::new(CenteredClipping::new(
                f,
                tau,
                CenteredClipping::DEFAULT_ITERATIONS,
            )?)
        }
        other => {
            return Err(AggError::InvalidSpec(format!(
                "unknown rule `{other}`; known rules: {}",
                RULES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            )))
        }
    })
}

/// Builds a rule from its name and the number `f` of Byzantine inputs to tolerate, with
/// default values for other parameters.
///
/// # Errors
/// As [`build`].
pub fn by_name(name: &str, f: usize) -> Result<Box<dyn Aggregator>, AggError> {
    build(
        name,
        &Params {
            f,
            ..Params::default()
        },
    )
}

fn check_lengths<T>(inputs: &[&[T]], expected: usize) -> Result<(), AggError> {
    match inputs.iter().position(|x| x.len() != expected) {
        Some(input) => Err(AggError::LengthMismatch {
            input,
            len: inputs[input].len(),
            expected,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_non_finite_is_the_first_position() {
        fn check<T: Element>(bad: [T; 3], good: T) {
            assert_eq!(first_non_finite::<T>(&[]), None);
            for len in [
                1,
                7,
                FINITE_RUN - 1,
                FINITE_RUN,
                FINITE_RUN + 1,
                3 * FINITE_RUN + 5,
            ] {
                let clean = vec![good; len];
                assert_eq!(first_non_finite(&clean), None);
                assert!(all_finite(&clean));
                for at in [0, len / 2, len - 1] {
                    for (b, later) in bad.iter().zip([1, 2, 0]) {
                        let mut x = clean.clone();
                        x[at] = *b;
                        // A second non-finite value later on never hides the first.
                        if at + 1 < len {
                            x[len - 1] = bad[later];
                        }
                        assert_eq!(first_non_finite(&x), Some(at), "len {len} at {at}");
                        assert!(!all_finite(&x));
                    }
                }
            }
        }
        check([f32::NAN, f32::INFINITY, f32::NEG_INFINITY], -3.5f32);
        check([f64::NAN, f64::INFINITY, f64::NEG_INFINITY], f64::MAX);
    }

    #[test]
    fn by_name_knows_every_listed_rule_and_rejects_others() {
        let params = Params {
            f: 1,
            tau: Some(1.0),
            ..Params::default()
        };
        for (name, _) in RULES {
            let name = name.replace("RULE", "median");
            let params = if name == "centered-clipping" {
                params.clone()
            } else {
                Params {
                    tau: None,
                    ..params.clone()
                }
            };
            assert_eq!(build(&name, &params).unwrap().name(), name);
        }
        assert!(build("centered-clipping", &Params::default()).is_err());
        assert!(build(
            "median",
            &Params {
                m: Some(2),
                ..Params::default()
            }
        )
        .is_err());
        assert!(build("nnm+nnm+median", &Params::default()).is_err());
        let err = by_name("average", 1).unwrap_err();
        assert!(
            err.to_string().contains("known rules: mean, median"),
            "{err}"
        );
    }
}
