//! Distance-based selection rules: Krum, Multi-Krum, Bulyan.
//!
//! Scores come from one table of pairwise squared distances ([`crate::distance`]). An input
//! holding NaN or infinities is infinitely far from every other, so its score is infinite and it
//! is never selected; when a selection would have to take an infinite score the rule refuses
//! with [`AggError::TooManyNonFiniteInputs`].

use rayon::prelude::*;

use crate::coordinate::{network_blocks, reduce_columns};
use crate::distance::distance_table;
use crate::network;
use crate::{
    check_lengths, AggError, AggReport, Aggregator, DistanceSelection, Element, Inputs, Output,
    Structure,
};

/// Krum scores of the `active` inputs against each other: for each, the sum of its
/// `active.len() - f - 2` smallest squared distances to the other active inputs. An input
/// holding non-finite values scores `+inf` even when that sum is empty (Bulyan's last rounds
/// with `f = 1`), so it is never preferred to a finite one.
fn scores(dist: &[f64], n: usize, active: &[usize], f: usize) -> Vec<f64> {
    let k = active.len().saturating_sub(f + 2);
    active
        .iter()
        .map(|&i| {
            if !is_finite_input(dist, n, i) {
                return f64::INFINITY;
            }
            let mut ds: Vec<f64> = active
                .iter()
                .filter(|&&j| j != i)
                .map(|&j| dist[i * n + j])
                .collect();
            if k == 0 {
                return 0.0;
            }
            ds.select_nth_unstable_by(k - 1, f64::total_cmp);
            ds[..k].iter().sum()
        })
        .collect()
}

/// Positions in `scores` ordered by (score, position): lowest score first, ties to the lowest
/// index (positions follow input order).
fn ranking(scores: &[f64]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(a.cmp(&b)));
    order
}

/// Inputs with non-finite values have an infinite distance to themselves in the table.
fn is_finite_input(dist: &[f64], n: usize, i: usize) -> bool {
    dist[i * n + i] == 0.0
}

fn too_many_non_finite(rule: &str, f: usize, dist: &[f64], n: usize) -> AggError {
    AggError::TooManyNonFiniteInputs {
        rule: rule.to_string(),
        f,
        count: (0..n).filter(|&i| !is_finite_input(dist, n, i)).count(),
    }
}

fn mixed_types(rule: &str) -> AggError {
    AggError::Unsupported {
        rule: rule.to_string(),
        what: "inputs and output of different element types".to_string(),
    }
}

fn krum_precondition(rule: &str, n: usize, f: usize) -> Result<(), AggError> {
    if f.checked_mul(2)
        .and_then(|x| x.checked_add(2))
        .is_some_and(|bound| n > bound)
    {
        Ok(())
    } else {
        Err(AggError::Precondition {
            rule: rule.to_string(),
            requirement: "n > 2f + 2",
            n,
            f,
        })
    }
}

/// Averages the selected inputs coordinate-wise (in `f64`, in `selected` order) into `out`.
fn average_of<T: Element>(inputs: &[&[T]], selected: &[usize], out: &mut [T]) {
    let chosen: Vec<&[T]> = selected.iter().map(|&i| inputs[i]).collect();
    // The selection took finite inputs only; a mean that overflows is written as it is.
    if crate::network::mean_in_order(&chosen, out).is_some() {
        return;
    }
    let scale = 1.0 / selected.len() as f64;
    out.par_chunks_mut(4096).enumerate().for_each(|(b, chunk)| {
        let base = b * 4096;
        let mut acc = vec![0.0f64; chunk.len()];
        for &i in selected {
            for (a, v) in acc.iter_mut().zip(&inputs[i][base..base + chunk.len()]) {
                *a += v.to_f64();
            }
        }
        for (o, a) in chunk.iter_mut().zip(&acc) {
            *o = T::from_f64(a * scale);
        }
    });
}

/// Krum (Blanchard et al. 2017): the input whose `n - f - 2` nearest neighbours are closest
/// (sum of squared distances); ties go to the lowest index. Requires `n > 2f + 2`.
#[derive(Debug, Clone)]
pub struct Krum {
    f: usize,
}

impl Krum {
    /// Krum tolerating `f` Byzantine inputs.
    pub fn new(f: usize) -> Self {
        Krum { f }
    }

    fn run<T: Element>(&self, inputs: &[&[T]], out: &mut [T]) -> Result<AggReport, AggError> {
        check_lengths(inputs, out.len())?;
        self.check(inputs.len())?;
        let dist = distance_table(inputs);
        let selected = self.select(&dist, inputs.len())?;
        self.finish(T::inputs(inputs), &selected, T::output(out))?;
        Ok(AggReport::selected(selected))
    }
}

impl DistanceSelection for Krum {
    fn select(&self, dist: &[f64], n: usize) -> Result<Vec<usize>, AggError> {
        let all: Vec<usize> = (0..n).collect();
        let s = scores(dist, n, &all, self.f);
        let best = ranking(&s)[0];
        if !s[best].is_finite() || !is_finite_input(dist, n, best) {
            return Err(too_many_non_finite(self.name(), self.f, dist, n));
        }
        Ok(vec![best])
    }

    fn finish(
        &self,
        inputs: Inputs<'_>,
        selected: &[usize],
        out: Output<'_>,
    ) -> Result<(), AggError> {
        match (inputs, out) {
            (Inputs::F32(x), Output::F32(o)) => o.copy_from_slice(x[selected[0]]),
            (Inputs::F64(x), Output::F64(o)) => o.copy_from_slice(x[selected[0]]),
            (Inputs::BF16(x), Output::BF16(o)) => o.copy_from_slice(x[selected[0]]),
            (Inputs::F16(x), Output::F16(o)) => o.copy_from_slice(x[selected[0]]),
            _ => return Err(mixed_types(self.name())),
        }
        Ok(())
    }
}

impl Aggregator for Krum {
    fn name(&self) -> &str {
        "krum"
    }
    fn byzantine(&self) -> usize {
        self.f
    }
    fn check(&self, n: usize) -> Result<(), AggError> {
        krum_precondition(self.name(), n, self.f)
    }
    fn structure(&self) -> Structure {
        Structure::Global
    }
    fn distance_selection(&self) -> Option<&dyn DistanceSelection> {
        Some(self)
    }
    fn aggregate(&self, inputs: Inputs<'_>, out: Output<'_>) -> Result<AggReport, AggError> {
        crate::dispatch!(self, inputs, out)
    }
}

/// Multi-Krum: the coordinate-wise average of the `m` inputs with the lowest Krum scores
/// (default `m = n - f`). Requires `n > 2f + 2` and `1 <= m <= n - f`.
///
/// Distances and the average are taken in `f64` (`f32` distances in `f32` runs, see
/// [`crate::distance`]); the average is rounded once to the element type.
#[derive(Debug, Clone)]
pub struct MultiKrum {
    f: usize,
    m: Option<usize>,
}

impl MultiKrum {
    /// Multi-Krum tolerating `f` Byzantine inputs, averaging `m` inputs (`None`: `n - f`).
    pub fn new(f: usize, m: Option<usize>) -> Self {
        MultiKrum { f, m }
    }

    fn m_for(&self, n: usize) -> usize {
        self.m.unwrap_or(n.saturating_sub(self.f))
    }

    fn run<T: Element>(&self, inputs: &[&[T]], out: &mut [T]) -> Result<AggReport, AggError> {
        check_lengths(inputs, out.len())?;
        self.check(inputs.len())?;
        let dist = distance_table(inputs);
        let selected = self.select(&dist, inputs.len())?;
        self.finish(T::inputs(inputs), &selected, T::output(out))?;
        Ok(AggReport::selected(selected))
    }
}

impl DistanceSelection for MultiKrum {
    fn select(&self, dist: &[f64], n: usize) -> Result<Vec<usize>, AggError> {
        let all: Vec<usize> = (0..n).collect();
        let s = scores(dist, n, &all, self.f);
        let mut selected: Vec<usize> = ranking(&s)[..self.m_for(n)].to_vec();
        if selected
            .iter()
            .any(|&i| !s[i].is_finite() || !is_finite_input(dist, n, i))
        {
            return Err(too_many_non_finite(self.name(), self.f, dist, n));
        }
        selected.sort_unstable();
        Ok(selected)
    }

    fn finish(
        &self,
        inputs: Inputs<'_>,
        selected: &[usize],
        out: Output<'_>,
    ) -> Result<(), AggError> {
        match (inputs, out) {
            (Inputs::F32(x), Output::F32(o)) => average_of(x, selected, o),
            (Inputs::F64(x), Output::F64(o)) => average_of(x, selected, o),
            (Inputs::BF16(x), Output::BF16(o)) => average_of(x, selected, o),
            (Inputs::F16(x), Output::F16(o)) => average_of(x, selected, o),
            _ => return Err(mixed_types(self.name())),
        }
        Ok(())
    }
}

impl Aggregator for MultiKrum {
    fn name(&self) -> &str {
        "multi-krum"
    }
    fn byzantine(&self) -> usize {
        self.f
    }
    fn check(&self, n: usize) -> Result<(), AggError> {
        krum_precondition(self.name(), n, self.f)?;
        let m = self.m_for(n);
        if m == 0 || m > n - self.f {
            return Err(AggError::InvalidSpec(format!(
                "multi-krum: m = {m} must be between 1 and n - f = {}",
                n - self.f
            )));
        }
        Ok(())
    }
    fn structure(&self) -> Structure {
        Structure::Global
    }
    fn distance_selection(&self) -> Option<&dyn DistanceSelection> {
        Some(self)
    }
    fn aggregate(&self, inputs: Inputs<'_>, out: Output<'_>) -> Result<AggReport, AggError> {
        crate::dispatch!(self, inputs, out)
    }
}

/// Bulyan (El Mhamdi et al. 2018): select `θ = n - 2f` inputs by Krum one at a time (each
/// selection removes the chosen input and rescores the rest), then per coordinate average the
/// `β = θ - 2f` selected values closest to that coordinate's median of the selection.
/// Requires `n >= 4f + 3`.
///
/// Distances, the median of an even count and the average are taken in `f64`; the result is
/// rounded once to the element type.
#[derive(Debug, Clone)]
pub struct Bulyan {
    f: usize,
}

impl Bulyan {
    /// Bulyan tolerating `f` Byzantine inputs.
    pub fn new(f: usize) -> Self {
        Bulyan { f }
    }

    fn run<T: Element>(&self, inputs: &[&[T]], out: &mut [T]) -> Result<AggReport, AggError> {
        check_lengths(inputs, out.len())?;
        self.check(inputs.len())?;
        let dist = distance_table(inputs);
        let selected = self.select(&dist, inputs.len())?;
        self.finish(T::inputs(inputs), &selected, T::output(out))?;
        Ok(AggReport::selected(selected))
    }

    /// The coordinate-wise phase over the selected inputs.
    fn coordinate_phase<T: Element>(
        &self,
        inputs: &[&[T]],
        selected: &[usize],
        out: &mut [T],
    ) -> Result<(), AggError> {
        let beta = selected.len() - 2 * self.f;
        let chosen: Vec<&[T]> = selected.iter().map(|&i| inputs[i]).collect();
        let m = chosen.len();
        let non_finite = |coordinate| AggError::NonFiniteResult {
            rule: self.name().to_string(),
            f: self.f,
            coordinate,
        };
        if let Some(done) = network::fused(&chosen, out, network::Finish::Nearest { beta }) {
            return done.result.map_err(non_finite);
        }
        if m <= network::MAX_INPUTS {
            // Columns sorted by the sorting network, a tile of coordinates at a time (rows of
            // keys): the same values, in the same order, as sorting each column.
            return network_blocks(&chosen, out, 0..m, |rows, w, chunk| {
                nearest_mean_block(rows, m, w, beta, chunk)
            })
            .map_err(non_finite);
        }
        reduce_columns(&chosen, out, |col| {
            col.sort_unstable();
            let r = T::from_f64(nearest_mean(m, beta, |i| T::from_key(col[i]).to_f64()));
            r.is_finite().then_some(r)
        })
        .map_err(non_finite)
    }
}

/// The mean of the `beta` values nearest the median among `m` sorted values (`v(i)` is the
/// `i`-th smallest): a contiguous run of the sorted values, found by shrinking from whichever
/// end is farther from the median.
#[inline(always)]
pub(crate) fn nearest_mean(m: usize, beta: usize, v: impl Fn(usize) -> f64) -> f64 {
    let median = if m % 2 == 1 {
        v(m / 2)
    } else {
        v(m / 2 - 1) * 0.5 + v(m / 2) * 0.5
    };
    let (mut lo, mut hi) = (0, m);
    while hi - lo > beta {
        if median - v(lo) > v(hi - 1) - median {
            lo += 1;
        } else {
            hi -= 1;
        }
    }
    let sum: f64 = (lo..hi).map(v).sum();
    sum / beta as f64
}

/// Columns [`nearest_mean_columns`] takes at once.
const LANES: usize = network::LANES;

/// [`nearest_mean_columns`] over a block of `m` sorted rows of `width` keys, into `out`
/// (`width` values). Uses AVX2 when the CPU has it (the same operations, so the same bits).
fn nearest_mean_block<T: Element>(
    rows: &[T::Key],
    m: usize,
    width: usize,
    beta: usize,
    out: &mut [T],
) -> Result<(), usize> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { nearest_mean_block_avx2(rows, m, width, beta, out) };
    }
    nearest_mean_block_portable(rows, m, width, beta, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn nearest_mean_block_avx2<T: Element>(
    rows: &[T::Key],
    m: usize,
    width: usize,
    beta: usize,
    out: &mut [T],
) -> Result<(), usize> {
    nearest_mean_block_portable(rows, m, width, beta, out)
}

#[inline(always)]
fn nearest_mean_block_portable<T: Element>(
    rows: &[T::Key],
    m: usize,
    width: usize,
    beta: usize,
    out: &mut [T],
) -> Result<(), usize> {
    for (g, part) in out.chunks_mut(LANES).enumerate() {
        nearest_mean_columns(rows, m, width, g * LANES, beta, part).map_err(|c| g * LANES + c)?;
    }
    Ok(())
}

/// [`network::nearest_mean_lanes`] for columns `first .. first + out.len()` (at most
/// [`LANES`]) of `m` sorted rows of `width` keys, written into `out` as `T`; every column is
/// written, and the offset in `out` of the first result that is not finite is returned.
#[inline(always)]
fn nearest_mean_columns<T: Element>(
    rows: &[T::Key],
    m: usize,
    width: usize,
    first: usize,
    beta: usize,
    out: &mut [T],
) -> Result<(), usize> {
    let means = network::nearest_mean_lanes::<T>(rows, m, width, first, out.len(), beta);
    let mut first_bad = None;
    for (c, (o, mean)) in out.iter_mut().zip(means).enumerate() {
        *o = T::from_f64(mean);
        if !o.is_finite() {
            first_bad = first_bad.or(Some(c));
        }
    }
    first_bad.map_or(Ok(()), Err)
}

impl DistanceSelection for Bulyan {
    fn select(&self, dist: &[f64], n: usize) -> Result<Vec<usize>, AggError> {
        let f = self.f;
        let theta = n - 2 * f;
        let mut active: Vec<usize> = (0..n).collect();
        let mut selected = Vec::with_capacity(theta);
        for _ in 0..theta {
            let s = scores(dist, n, &active, f);
            let pos = ranking(&s)[0];
            if !s[pos].is_finite() || !is_finite_input(dist, n, active[pos]) {
                return Err(too_many_non_finite(self.name(), f, dist, n));
            }
            selected.push(active.remove(pos));
        }
        Ok(selected)
    }

    fn finish(
        &self,
        inputs: Inputs<'_>,
        selected: &[usize],
        out: Output<'_>,
    ) -> Result<(), AggError> {
        match (inputs, out) {
            (Inputs::F32(x), Output::F32(o)) => self.coordinate_phase(x, selected, o),
            (Inputs::F64(x), Output::F64(o)) => self.coordinate_phase(x, selected, o),
            (Inputs::BF16(x), Output::BF16(o)) => self.coordinate_phase(x, selected, o),
            (Inputs::F16(x), Output::F16(o)) => self.coordinate_phase(x, selected, o),
            _ => Err(mixed_types(self.name())),
        }
    }
}

impl Aggregator for Bulyan {
    fn name(&self) -> &str {
        "bulyan"
    }
    fn byzantine(&self) -> usize {
        self.f
    }
    fn check(&self, n: usize) -> Result<(), AggError> {
        if self
            .f
            .checked_mul(4)
            .and_then(|x| x.checked_add(3))
            .is_some_and(|bound| n >= bound)
        {
            Ok(())
        } else {
            Err(AggError::Precondition {
                rule: self.name().to_string(),
                requirement: "n >= 4f + 3",
                n,
                f: self.f,
            })
        }
    }
    fn structure(&self) -> Structure {
        Structure::Global
    }
    fn distance_selection(&self) -> Option<&dyn DistanceSelection> {
        Some(self)
    }
    fn aggregate(&self, inputs: Inputs<'_>, out: Output<'_>) -> Result<AggReport, AggError> {
        crate::dispatch!(self, inputs, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aggregate_into;

    /// The sorting-network finish gives bitwise what sorting each column does.
    #[test]
    fn bulyan_network_finish_is_the_column_sort_finish() {
        let (n, f, d) = (11, 2, 1000);
        let rows: Vec<Vec<f32>> = (0..n)
            .map(|i| {
                (0..d)
                    .map(|j| ((i * 7919 + j * 104_729) % 1009) as f32 * 0.013 - 6.0)
                    .collect()
            })
            .collect();
        let inputs: Vec<&[f32]> = rows.iter().map(|v| &v[..]).collect();
        let bulyan = Bulyan::new(f);
        let selected: Vec<usize> = (0..n - 2 * f).collect();
        let mut got = vec![0.0f32; d];
        bulyan
            .coordinate_phase(&inputs, &selected, &mut got)
            .unwrap();
        let beta = selected.len() - 2 * f;
        for (j, g) in got.iter().enumerate() {
            let mut col: Vec<f32> = selected.iter().map(|&i| rows[i][j]).collect();
            col.sort_by(f32::total_cmp);
            let want = nearest_mean(col.len(), beta, |i| col[i] as f64) as f32;
            assert_eq!(g.to_bits(), want.to_bits(), "coordinate {j}");
        }
    }

    /// The branch-free finish gives bitwise what the shrinking loop gives, on data full of
    /// ties (where the loop's tie rule decides), signed zeros, huge values whose differences
    /// round, and widths that leave partial column groups and partial blocks.
    #[test]
    fn bulyan_columns_finish_is_the_shrinking_loop_on_ties() {
        let mut next = crate::testing::xorshift(0x2545_f491_4f6c_dd1du64);
        for m in 1..=40usize {
            for f in 0..=(m - 1) / 2 {
                let d = [1usize, 15, 17, 533][(m + f) % 4];
                let rows = crate::testing::tie_rows(&mut next, m, d);
                let inputs: Vec<&[f32]> = rows.iter().map(|v| &v[..]).collect();
                let selected: Vec<usize> = (0..m).collect();
                let beta = m - 2 * f;
                let mut got = vec![0.0f32; d];
                let want: Vec<Option<f32>> = (0..d)
                    .map(|j| {
                        let mut col: Vec<f32> = rows.iter().map(|r| r[j]).collect();
                        col.sort_by(f32::total_cmp);
                        let r = nearest_mean(m, beta, |i| col[i] as f64) as f32;
                        r.is_finite().then_some(r)
                    })
                    .collect();
                let result = Bulyan::new(f).coordinate_phase(&inputs, &selected, &mut got);
                match want.iter().position(Option::is_none) {
                    Some(c) => assert!(
                        matches!(result, Err(AggError::NonFiniteResult { coordinate, .. }) if coordinate == c),
                        "m={m} f={f}: {result:?}, want coordinate {c}"
                    ),
                    None => {
                        result.unwrap();
                        for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                            let w = w.unwrap();
                            assert_eq!(g.to_bits(), w.to_bits(), "m={m} f={f} j={j}: {g} vs {w}");
                        }
                    }
                }
            }
        }
    }

    /// Bulyan's last selection rounds with f = 1 score every input 0 (empty neighbour sums):
    /// the one non-finite input must still never be chosen.
    #[test]
    fn bulyan_never_prefers_a_non_finite_input_on_empty_scores() {
        let mut inputs: Vec<Vec<f32>> = (0..7).map(|i| vec![i as f32 * 0.1; 4]).collect();
        inputs[0][2] = f32::NAN;
        let views: Vec<&[f32]> = inputs.iter().map(|v| v.as_slice()).collect();
        let mut out = [0.0f32; 4];
        let report = aggregate_into(&Bulyan::new(1), &views, &mut out).expect("f = 1 NaN input");
        let selected = report.selected.expect("selection");
        assert_eq!(selected.len(), 5);
        assert!(!selected.contains(&0), "selected {selected:?}");
        assert!(out.iter().all(|v| v.is_finite()));
    }
}
