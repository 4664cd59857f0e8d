//! Attribution: which ranks' inputs lay far from the aggregate, and which the rule set aside
//! ([`RoundReport::attribution`](crate::RoundReport::attribution)).
//!
//! It is evidence for an operator (who to look at), never an accusation: nothing in byzcoll
//! acts on it. An honest rank with unusual data (a different data shard, a larger learning
//! rate) is far too; a careful attacker stays within the honest spread, where the rule bounds
//! what it can do anyway.

use byzcoll_aggregators::evidence::Measure;

use crate::Rank;

/// A score above which an input counts as outlying (in [`Attribution::outlying`], and in the
/// runtime's running count per peer): three times the median deviation of the inputs.
pub const OUTLYING_SCORE: f64 = 3.0;

/// What one rank's measurements say of every rank's input (see the module docs).
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Attribution {
    /// One entry per rank of the communicator, in rank order (this rank's own included).
    pub ranks: Vec<InputEvidence>,
}

/// How far one rank's input lay from the aggregate.
///
/// Measured at a sample of the coordinates this rank aggregated
/// ([`byzcoll_aggregators::evidence`]: every coordinate of a short vector, 1024 of a longer
/// one, chosen from the result, so that no sender knows them when it sends): in gather mode
/// the whole vector, in sharded mode the shards this rank owns.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct InputEvidence {
    /// The rank.
    pub rank: Rank,
    /// Coordinates at which its input was measured: 0 where it did not enter this rank's
    /// aggregation (an erasure), and then every figure below is 0.
    pub coordinates: u64,
    /// The root mean square of its deviation from the aggregate over those coordinates, in
    /// the vector's units (`+inf` where it held NaN or infinities there; never NaN).
    pub deviation: f64,
    /// `deviation` in units of the median deviation of the measured inputs: about 1 for a
    /// typical input, well above [`OUTLYING_SCORE`] for an outlier. With at most `f` of more
    /// than `2f` inputs outlying, the median is an honest input's. 0 where the deviation is
    /// 0; `+inf` where the median deviation is 0 and this one's is not.
    pub score: f64,
    /// The fraction of the measured coordinates at which its value was extreme: at most
    /// `max(f, 1)` of the values (its own included) at or below it, or at or above it, i.e.
    /// what a trimmed mean would have trimmed (a value tied with a kept one counts as kept).
    /// About `2f / n` for honest inputs of similar data; near 1 for a rank that pushes every
    /// coordinate one way. 0 where the round had no more than `2·max(f, 1)` inputs.
    pub extreme: f64,
    /// Selection rules (Krum, Multi-Krum, Bulyan): whether its input was among the selected.
    pub selected: Option<bool>,
    sq_sum: f64,
    extreme_count: u64,
}

impl Attribution {
    /// The attribution of `measure` (by rank), with `selected` the ranks a selection rule
    /// chose.
    pub fn of(measure: &Measure, selected: Option<&[Rank]>) -> Self {
        let ranks = (0..measure.coordinates.len())
            .map(|rank| InputEvidence {
                rank,
                coordinates: measure.coordinates[rank],
                sq_sum: measure.sq_deviation[rank],
                extreme_count: measure.extreme[rank],
                selected: selected.map(|s| s.contains(&rank)),
                ..InputEvidence::default()
            })
            .collect();
        let mut a = Attribution { ranks };
        a.derive();
        a
    }

    /// Adds `other`'s measurements (another part of the same call's vector) to these: the
    /// figures are those of all the coordinates measured in both.
    pub fn merge(&mut self, other: &Attribution) {
        for (a, b) in self.ranks.iter_mut().zip(&other.ranks) {
            a.coordinates += b.coordinates;
            a.sq_sum += b.sq_sum;
            a.extreme_count += b.extreme_count;
            a.selected = match (a.selected, b.selected) {
                (Some(x), Some(y)) => Some(x || y),
                (x, y) => x.or(y),
            };
        }
        self.derive();
    }

    /// The ranks whose [`InputEvidence::score`] exceeds [`OUTLYING_SCORE`], ascending.
    pub fn outlying(&self) -> Vec<Rank> {
        self.ranks
            .iter()
            .filter(|e| e.score > OUTLYING_SCORE)
            .map(|e| e.rank)
            .collect()
    }

    fn derive(&mut self) {
        for e in &mut self.ranks {
            (e.deviation, e.extreme) = match e.coordinates {
                0 => (0.0, 0.0),
                c => (
                    (e.sq_sum / c as f64).sqrt(),
                    e.extreme_count as f64 / c as f64,
                ),
            };
        }
        let mut measured: Vec<f64> = self
            .ranks
            .iter()
            .filter(|e| e.coordinates > 0)
            .map(|e| e.deviation)
            .collect();
        measured.sort_unstable_by(f64::total_cmp);
        let scale = measured
            .get(measured.len().saturating_sub(1) / 2)
            .copied()
            .unwrap_or(0.0);
        for e in &mut self.ranks {
            e.score = if e.deviation == 0.0 {
                0.0
            } else if scale == 0.0 {
                f64::INFINITY
            } else if scale.is_finite() {
                e.deviation / scale
            } else {
                // More than half the inputs were not finite: only those are far.
                if e.deviation.is_finite() {
                    0.0
                } else {
                    f64::INFINITY
                }
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measure(sq: &[f64], coordinates: u64, extreme: &[u64]) -> Measure {
        Measure {
            coordinates: sq
                .iter()
                .map(|s| if s.is_nan() { 0 } else { coordinates })
                .collect(),
            sq_deviation: sq
                .iter()
                .map(|s| if s.is_nan() { 0.0 } else { *s })
                .collect(),
            extreme: extreme.to_vec(),
        }
    }

    #[test]
    fn scores_are_deviations_over_the_median_and_never_nan() {
        // Rank 2 is absent (NaN marks it here), rank 3 far, rank 4 not finite.
        let m = measure(
            &[4.0, 16.0, f64::NAN, 1600.0, f64::INFINITY],
            4,
            &[1, 1, 0, 4, 4],
        );
        let a = Attribution::of(&m, None);
        let dev: Vec<f64> = a.ranks.iter().map(|e| e.deviation).collect();
        assert_eq!(dev, [1.0, 2.0, 0.0, 20.0, f64::INFINITY]);
        // Median of 1, 2, 20, inf (the lower middle): 2.
        let score: Vec<f64> = a.ranks.iter().map(|e| e.score).collect();
        assert_eq!(score, [0.5, 1.0, 0.0, 10.0, f64::INFINITY]);
        assert_eq!(a.outlying(), [3, 4]);
        assert_eq!(a.ranks[3].extreme, 1.0);
        assert_eq!(a.ranks[2].coordinates, 0);
        assert!(a.ranks.iter().all(|e| !e.score.is_nan()));

        let identical = Attribution::of(&measure(&[0.0, 0.0, 9.0], 9, &[0, 0, 9]), None);
        assert_eq!(identical.ranks[2].score, f64::INFINITY);
        assert_eq!(identical.ranks[0].score, 0.0);

        let mostly_bad = Attribution::of(
            &measure(&[1.0, f64::INFINITY, f64::INFINITY], 1, &[0, 0, 0]),
            None,
        );
        let score: Vec<f64> = mostly_bad.ranks.iter().map(|e| e.score).collect();
        assert_eq!(score, [0.0, f64::INFINITY, f64::INFINITY]);
    }

    #[test]
    fn merged_parts_are_the_whole() {
        let a = measure(&[1.0, 4.0, 100.0], 10, &[1, 2, 10]);
        let b = measure(&[3.0, 4.0, 300.0], 30, &[3, 2, 30]);
        let mut whole = a.clone();
        whole.add(&b);
        let mut merged = Attribution::of(&a, Some(&[0]));
        merged.merge(&Attribution::of(&b, Some(&[1])));
        let expected = Attribution::of(&whole, Some(&[0, 1]));
        assert_eq!(merged, expected);
        assert_eq!(merged.ranks[2].deviation, 10f64.sqrt());
        assert_eq!(merged.ranks[2].selected, Some(false));
    }
}
