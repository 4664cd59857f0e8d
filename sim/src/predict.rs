//! Timing predictions: gather vs sharded vs ring SUM over a sweep of sizes.

use std::fmt::Write as _;

use byzcoll_aggregators::Aggregator;

use crate::{Agreement, Algorithm, Scenario, SimError};

/// One predicted completion time.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// Label of the network (a preset's name).
    pub network: String,
    /// World size.
    pub n: usize,
    /// Bytes per rank's vector (float32).
    pub bytes: u64,
    /// The algorithm.
    pub algorithm: Algorithm,
    /// Predicted completion time, in seconds.
    pub time: f64,
    /// `time` over ring SUM's time for the same `n` and size.
    pub vs_ring: f64,
}

/// Vector sizes of the sweep: 1 MiB to 1 GiB by factors of 4.
pub fn sweep_sizes() -> Vec<u64> {
    (0..6).map(|k| (1u64 << 20) << (2 * k)).collect()
}

/// Predicts gather, sharded `r = 1`, sharded `r = 2f + 1` (when different) and ring SUM for
/// `n` ranks contributing `bytes` of `base`'s [`Scenario::dtype`] each on its network and
/// computation,
/// without faults or deadlines, the robust rounds with `base`'s cross-check (its extra
/// all-to-all step of `O(n)`-byte messages is what
/// [`Agreement::Detect`](byzcoll_proto::Agreement) costs).
///
/// # Errors
/// [`SimError::InvalidConfig`] when `bytes` is not a positive multiple of the element size or
/// `2f + 1 > n`,
/// and the errors of [`Scenario::run_timing`].
pub fn predict(
    label: &str,
    base: &Scenario,
    n: usize,
    bytes: u64,
    f: usize,
    rule: Option<&dyn Aggregator>,
) -> Result<Vec<Prediction>, SimError> {
    let elem = base.dtype.size() as u64;
    if bytes == 0 || !bytes.is_multiple_of(elem) {
        return Err(SimError::InvalidConfig(format!(
            "{bytes} bytes is not a positive whole number of {:?}",
            base.dtype
        )));
    }
    match f.checked_mul(2).and_then(|x| x.checked_add(1)) {
        Some(r) if r <= n => {}
        Some(r) => {
            return Err(SimError::InvalidConfig(format!(
                "sharded r = 2f+1 = {r} needs at least that many ranks, have n = {n}"
            )))
        }
        None => {
            return Err(SimError::InvalidConfig(format!(
                "sharded r = 2f+1 with f = {f} exceeds any world, have n = {n}"
            )))
        }
    }
    let d = usize::try_from(bytes / elem)
        .map_err(|_| SimError::InvalidConfig(format!("{bytes} bytes is too large")))?;
    let mut scenario = Scenario::new(n, base.network);
    scenario.compute = base.compute;
    scenario.dtype = base.dtype;
    scenario.timeout = f64::INFINITY;
    scenario.agreement = base.agreement;
    let enforce = base.agreement == Agreement::Enforce;
    // Enforce's echo runs f relay steps: without a rule, time a median of this f.
    let median = match (rule, enforce) {
        (None, true) => {
            Some(byzcoll_aggregators::by_name("median", f).map_err(SimError::Precondition)?)
        }
        _ => None,
    };
    let rule = rule.or(median.as_deref());
    let mut algorithms = vec![Algorithm::Gather, Algorithm::Sharded { replicas: 1 }];
    if f > 0 {
        algorithms.push(Algorithm::tolerant(n, f));
    }
    algorithms.push(Algorithm::RingSum);
    let times = algorithms
        .iter()
        .map(|&a| scenario.run_timing(a, d, rule).map(|run| run.time))
        .collect::<Result<Vec<f64>, SimError>>()?;
    let ring = times.last().copied().unwrap_or(0.0);
    Ok(algorithms
        .into_iter()
        .zip(times)
        .map(|(algorithm, time)| Prediction {
            network: label.to_string(),
            n,
            bytes,
            algorithm,
            time,
            vs_ring: if ring > 0.0 { time / ring } else { 1.0 },
        })
        .collect())
}

/// `1 MiB`, `256 KiB`, `3 B`, ...: binary units when exact.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes;
    let mut unit = 0;
    while unit + 1 < UNITS.len() && v >= 1024 && v.is_multiple_of(1024) {
        v /= 1024;
        unit += 1;
    }
    format!("{v} {}", UNITS[unit])
}

/// Seconds with a unit that keeps three or four significant digits: `12.5 us`, `3.20 ms`.
pub fn format_time(seconds: f64) -> String {
    let (v, unit) = if seconds >= 1.0 {
        (seconds, "s")
    } else if seconds >= 1e-3 {
        (seconds * 1e3, "ms")
    } else if seconds >= 1e-6 {
        (seconds * 1e6, "us")
    } else {
        (seconds * 1e9, "ns")
    };
    let digits = if v >= 100.0 {
        1
    } else if v >= 10.0 {
        2
    } else {
        3
    };
    format!("{v:.digits$} {unit}")
}

/// `2.00x`, `0.125x`, `0.0013x`: about three significant digits.
fn format_ratio(r: f64) -> String {
    if r >= 10.0 {
        format!("{r:.1}x")
    } else if r >= 1.0 {
        format!("{r:.2}x")
    } else if r >= 0.1 {
        format!("{r:.3}x")
    } else if r >= 0.01 {
        format!("{r:.4}x")
    } else {
        format!("{r:.1e}x")
    }
}

/// The predictions as an aligned text table: network, n, bytes, algorithm, predicted time,
/// ratio to ring SUM.
pub fn prediction_table(rows: &[Prediction]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<11} {:>6} {:>8}  {:<14} {:>12} {:>9}",
        "network", "n", "bytes", "algorithm", "time", "vs ring"
    );
    for p in rows {
        let _ = writeln!(
            out,
            "{:<11} {:>6} {:>8}  {:<14} {:>12} {:>9}",
            p.network,
            p.n,
            format_bytes(p.bytes),
            p.algorithm.to_string(),
            format_time(p.time),
            format_ratio(p.vs_ring)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(format_bytes(1 << 20), "1 MiB");
        assert_eq!(format_bytes(1 << 30), "1 GiB");
        assert_eq!(format_bytes(1000), "1000 B");
        assert_eq!(format_time(0.0125), "12.50 ms");
        assert_eq!(format_time(2.5e-6), "2.500 us");
        assert_eq!(format_ratio(1.0), "1.00x");
        assert_eq!(format_ratio(0.125), "0.125x");
        assert_eq!(format_ratio(0.0013), "1.3e-3x");
        assert_eq!(sweep_sizes().len(), 6);
        assert_eq!(sweep_sizes()[5], 1 << 30);
    }
}
