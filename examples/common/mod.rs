//! What the multi-process examples share: the honest ranks' vectors and the check that a
//! robust result stayed among them.

/// Rank `rank`'s honest vector of `d` elements: a common signal plus a small per-rank offset.
pub(crate) fn honest(rank: usize, d: usize) -> Vec<f32> {
    (0..d)
        .map(|j| 1.0 + 0.1 * (j as f32 * 0.01).sin() + 0.01 * rank as f32)
        .collect()
}

/// Checks that every coordinate of `v` is finite and lies within the honest inputs' range.
pub(crate) fn in_honest_range(name: &str, v: &[f32], honest: &[Vec<f32>]) -> Result<(), String> {
    for (j, x) in v.iter().enumerate() {
        let lo = honest.iter().map(|h| h[j]).fold(f32::INFINITY, f32::min);
        let hi = honest
            .iter()
            .map(|h| h[j])
            .fold(f32::NEG_INFINITY, f32::max);
        if !(x.is_finite() && lo <= *x && *x <= hi) {
            return Err(format!(
                "{name}: coordinate {j} = {x} is outside [{lo}, {hi}]"
            ));
        }
    }
    Ok(())
}
