//! Byzantine input generators for tests, examples and benchmarks.
//!
//! Each [`Attack`] forges one malicious vector from the honest inputs (an omniscient attacker,
//! as in the literature). Forged vectors are deterministic for a given seed.

use crate::Element;

/// A way to forge a Byzantine input.
#[derive(Debug, Clone, PartialEq)]
pub enum Attack {
    /// The negated honest mean.
    SignFlip,
    /// The honest mean scaled by a huge factor.
    Scale(f64),
    /// The honest mean plus independent Gaussian noise of standard deviation `sigma`.
    Gaussian {
        /// Noise standard deviation.
        sigma: f64,
        /// RNG seed.
        seed: u64,
    },
    /// "A little is enough" (Baruch et al. 2019): `mean - z · std` per coordinate. `z: None`
    /// uses the paper's `z_max` for the given `n` and `f`.
    Alie {
        /// Number of standard deviations; `None` for the paper's choice.
        z: Option<f64>,
        /// World size the attack is tuned for.
        n: usize,
        /// Number of Byzantine inputs.
        f: usize,
    },
    /// Inner-product manipulation (Xie et al. 2020): `-ε · mean`.
    Ipm(f64),
    /// Every value NaN.
    Nan,
    /// Every value `+inf`.
    Inf,
    /// Every value `-inf`.
    NegInf,
    /// A copy of honest input `i`.
    Mimic(usize),
}

impl Attack {
    /// Forges one malicious vector from `honest` (at least one input, all of one length).
    ///
    /// # Panics
    /// If `honest` is empty, or `Mimic(i)` names an input that does not exist.
    pub fn forge<T: Element>(&self, honest: &[&[T]]) -> Vec<T> {
        assert!(
            !honest.is_empty(),
            "an attack needs honest inputs to imitate"
        );
        let d = honest[0].len();
        let mean = || -> Vec<f64> {
            let mut m = vec![0.0f64; d];
            for x in honest {
                for (a, v) in m.iter_mut().zip(x.iter()) {
                    *a += v.to_f64();
                }
            }
            m.iter_mut().for_each(|a| *a /= honest.len() as f64);
            m
        };
        let out = |v: Vec<f64>| v.into_iter().map(T::from_f64).collect();
        match *self {
            Attack::SignFlip => out(mean().into_iter().map(|m| -m).collect()),
            Attack::Scale(k) => out(mean().into_iter().map(|m| k * m).collect()),
            Attack::Gaussian { sigma, seed } => {
                let mut rng = SplitMix64(seed);
                out(mean()
                    .into_iter()
                    .map(|m| m + sigma * rng.normal())
                    .collect())
            }
            Attack::Alie { z, n, f } => {
                let z = z.unwrap_or_else(|| alie_z(n, f));
                let m = mean();
                let k = honest.len() as f64;
                let std: Vec<f64> = (0..d)
                    .map(|j| {
                        let var = honest
                            .iter()
                            .map(|x| (x[j].to_f64() - m[j]).powi(2))
                            .sum::<f64>()
                            / k;
                        var.sqrt()
                    })
                    .collect();
                out(m.iter().zip(&std).map(|(m, s)| m - z * s).collect())
            }
            Attack::Ipm(eps) => out(mean().into_iter().map(|m| -eps * m).collect()),
            Attack::Nan => vec![T::from_f64(f64::NAN); d],
            Attack::Inf => vec![T::from_f64(f64::INFINITY); d],
            Attack::NegInf => vec![T::from_f64(f64::NEG_INFINITY); d],
            Attack::Mimic(i) => honest[i].to_vec(),
        }
    }

    /// Every attack with its customary parameters, for sweeping tests.
    pub fn catalogue(n: usize, f: usize) -> Vec<Attack> {
        vec![
            Attack::SignFlip,
            Attack::Scale(1e6),
            Attack::Gaussian {
                sigma: 100.0,
                seed: 7,
            },
            Attack::Alie { z: None, n, f },
            Attack::Ipm(0.5),
            Attack::Nan,
            Attack::Inf,
            Attack::NegInf,
            Attack::Mimic(0),
        ]
    }
}

/// Baruch et al.'s `z_max`: with `s = ⌊n/2 + 1⌋ - f` supporters needed, `z = Φ⁻¹((n - s)/n)`.
pub fn alie_z(n: usize, f: usize) -> f64 {
    let s = (n / 2 + 1).saturating_sub(f) as f64;
    let p = ((n as f64 - s) / n as f64).clamp(1e-6, 1.0 - 1e-6);
    inverse_normal_cdf(p)
}

/// Φ⁻¹ by Acklam's rational approximation (relative error below 1.2e-9).
fn inverse_normal_cdf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969683028665376e1,
        2.209460984245205e2,
        -2.759285104469687e2,
        1.383_577_518_672_69e2,
        -3.066479806614716e1,
        2.506628277459239,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e1,
        1.615858368580409e2,
        -1.556989798598866e2,
        6.680131188771972e1,
        -1.328068155288572e1,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-3,
        -3.223964580411365e-1,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-3,
        3.224671290700398e-1,
        2.445134137142996,
        3.754408661907416,
    ];
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// A small, seedable generator (SplitMix64) so the crate needs no RNG dependency.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Box–Muller.
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_normal_matches_known_quantiles() {
        assert!((inverse_normal_cdf(0.5)).abs() < 1e-9);
        assert!((inverse_normal_cdf(0.975) - 1.959963984540054).abs() < 1e-8);
        assert!((inverse_normal_cdf(0.01) + 2.326347874040841).abs() < 1e-8);
    }

    #[test]
    fn attacks_forge_what_they_say() {
        let a = [1.0f32, 2.0];
        let b = [3.0f32, 4.0];
        let honest = [&a[..], &b[..]];
        assert_eq!(Attack::SignFlip.forge(&honest), vec![-2.0, -3.0]);
        assert_eq!(Attack::Scale(10.0).forge(&honest), vec![20.0, 30.0]);
        assert_eq!(Attack::Ipm(0.5).forge(&honest), vec![-1.0, -1.5]);
        assert_eq!(Attack::Mimic(1).forge(&honest), b.to_vec());
        assert_eq!(
            Attack::Alie {
                z: Some(1.0),
                n: 4,
                f: 1
            }
            .forge(&honest),
            vec![1.0, 2.0]
        );
        assert!(Attack::Nan.forge(&honest).iter().all(|v: &f32| v.is_nan()));
        let g1: Vec<f32> = Attack::Gaussian {
            sigma: 1.0,
            seed: 3,
        }
        .forge(&honest);
        let g2: Vec<f32> = Attack::Gaussian {
            sigma: 1.0,
            seed: 3,
        }
        .forge(&honest);
        assert_eq!(g1, g2);
        assert_ne!(g1, vec![2.0, 3.0]);
    }
}
