//! Nearest-neighbour mixing (Allouah et al. 2023) as a pre-aggregation step.

use crate::coordinate::precondition;
use crate::distance::distance_table;
use crate::{
    check_lengths, AggError, AggReport, Aggregator, DistanceMixing, Element, Inputs, Output,
    Structure,
};

/// `nnm+RULE`: replace each input by the mean of its `n - f` nearest inputs (itself included,
/// ties to the lower index), then apply `RULE`. Inputs holding NaN or infinities are left as
/// they are, for `RULE`'s own non-finite policy, and are never anyone's neighbour.
/// Requires `n > 2f` and `RULE`'s precondition.
///
/// Each mixed input is a mean taken in `f64` and rounded to the element type before `RULE`
/// runs; for the 16-bit types that is a rounding of its own, before `RULE`'s.
#[derive(Debug)]
pub struct Nnm {
    f: usize,
    inner: Box<dyn Aggregator>,
    name: String,
}

impl Nnm {
    /// Mixing tolerating `f` Byzantine inputs, followed by `inner`.
    pub fn new(f: usize, inner: Box<dyn Aggregator>) -> Self {
        let name = format!("nnm+{}", inner.name());
        Nnm { f, inner, name }
    }

    fn run<T: Element>(&self, inputs: &[&[T]], out: &mut [T]) -> Result<AggReport, AggError> {
        check_lengths(inputs, out.len())?;
        self.check(inputs.len())?;
        let n = inputs.len();
        let dist = distance_table(inputs);
        let mixed = crate::mix(inputs, &self.neighbours(&dist, n)?);
        let refs: Vec<&[T]> = mixed.iter().map(Vec::as_slice).collect();
        self.inner.aggregate(T::inputs(&refs), T::output(out))
    }
}

impl DistanceMixing for Nnm {
    fn neighbours(&self, dist: &[f64], n: usize) -> Result<Vec<Option<Vec<usize>>>, AggError> {
        let keep = n - self.f;
        let finite = |i: usize| dist[i * n + i] == 0.0;
        (0..n)
            .map(|i| {
                if !finite(i) {
                    return Ok(None);
                }
                let d = |j: usize| if j == i { 0.0 } else { dist[i * n + j] };
                let mut order: Vec<usize> = (0..n).collect();
                order.sort_by(|&a, &b| d(a).total_cmp(&d(b)).then(a.cmp(&b)));
                order.truncate(keep);
                if order.iter().any(|&j| !finite(j)) {
                    return Err(AggError::TooManyNonFiniteInputs {
                        rule: self.name.clone(),
                        f: self.f,
                        count: (0..n).filter(|&j| !finite(j)).count(),
                    });
                }
                Ok(Some(order))
            })
            .collect()
    }

    fn inner(&self) -> &dyn Aggregator {
        self.inner.as_ref()
    }
}

impl Aggregator for Nnm {
    fn name(&self) -> &str {
        &self.name
    }
    fn byzantine(&self) -> usize {
        self.f
    }
    fn check(&self, n: usize) -> Result<(), AggError> {
        precondition(&self.name, n, self.f)?;
        self.inner.check(n)
    }
    fn structure(&self) -> Structure {
        Structure::Global
    }
    fn distance_mixing(&self) -> Option<&dyn DistanceMixing> {
        Some(self)
    }
    fn aggregate(&self, inputs: Inputs<'_>, out: Output<'_>) -> Result<AggReport, AggError> {
        crate::dispatch!(self, inputs, out)
    }
}
