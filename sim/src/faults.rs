//! Injected faults: what the network and the ranks do wrong.

use std::fmt;
use std::str::FromStr;

use byzcoll_aggregators::attacks::Attack;
use byzcoll_proto::Rank;
use rand::Rng;

use crate::predict::format_time;
use crate::SimError;

/// Network and crash faults. Random choices come from the scenario's seed, drawn in event
/// order, so a run is reproducible.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Faults {
    /// Probability that a message is lost (it still occupies the sender's NIC). A lost message
    /// is `Missing` at the receiver's deadline.
    pub loss: f64,
    /// Each message gets an extra latency drawn uniformly from `[0, max_delay]` seconds; the
    /// messages one step sends one peer (back to back, on one connection that delivers them
    /// in order) share one draw.
    pub max_delay: f64,
    /// Ranks that stop sending (and stop taking part) from some step on.
    pub crashes: Vec<Crash>,
    /// Ranks that start late.
    pub stalls: Vec<Stall>,
    /// Ranks that start every round late by a random delay ([`Slow`]).
    pub slow: Option<Slow>,
    /// Ranks that die at a round and may come back at a later one ([`Deaths`]).
    pub deaths: Option<Deaths>,
}

impl Faults {
    /// Checks probabilities, delays and ranks against a world of `n`.
    ///
    /// # Errors
    /// [`SimError::InvalidConfig`] naming the bad value.
    pub fn validate(&self, n: usize) -> Result<(), SimError> {
        if !(0.0..=1.0).contains(&self.loss) {
            return Err(SimError::InvalidConfig(format!(
                "loss probability {} is not in [0, 1]",
                self.loss
            )));
        }
        if !(self.max_delay.is_finite() && self.max_delay >= 0.0) {
            return Err(SimError::InvalidConfig(format!(
                "message delay {} s must be finite and >= 0",
                self.max_delay
            )));
        }
        for c in &self.crashes {
            check_rank("crashed", c.rank, n)?;
        }
        for s in &self.stalls {
            check_rank("stalled", s.rank, n)?;
            if !(s.delay.is_finite() && s.delay >= 0.0) {
                return Err(SimError::InvalidConfig(format!(
                    "stall of rank {} by {} s must be finite and >= 0",
                    s.rank, s.delay
                )));
            }
        }
        if let Some(slow) = &self.slow {
            slow.delay.validate()?;
            if slow.ranks == 0 || slow.ranks > n {
                return Err(SimError::InvalidConfig(format!(
                    "{} slow ranks in a world of {n}: need 1 to {n}",
                    slow.ranks
                )));
            }
        }
        if let Some(deaths) = &self.deaths {
            if deaths.ranks == 0 || deaths.ranks >= n {
                return Err(SimError::InvalidConfig(format!(
                    "{} ranks dying in a world of {n}: need 1 to {} (one rank must live)",
                    deaths.ranks,
                    n.saturating_sub(1)
                )));
            }
            if let Some(back) = deaths.rejoin {
                if back <= deaths.at {
                    return Err(SimError::InvalidConfig(format!(
                        "ranks that die at round {} cannot rejoin at round {back}: rejoin at a \
                         later round",
                        deaths.at
                    )));
                }
            }
        }
        Ok(())
    }

    /// Whether `rank` crashes at some step.
    pub fn crashed(&self, rank: Rank) -> bool {
        self.crashes.iter().any(|c| c.rank == rank)
    }
}

fn check_rank(what: &str, rank: Rank, n: usize) -> Result<(), SimError> {
    if rank < n {
        Ok(())
    } else {
        Err(SimError::InvalidConfig(format!(
            "{what} rank {rank} does not exist in a world of {n} (ranks are 0..{n})"
        )))
    }
}

/// A rank that sends nothing from step `from_step` on (0: it never takes part).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Crash {
    /// The rank.
    pub rank: Rank,
    /// The first step it does not take part in.
    pub from_step: usize,
}

impl FromStr for Crash {
    type Err = SimError;

    /// `R` (crashed from the start) or `R@S` (from step `S` on).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || SimError::InvalidConfig(format!("crash `{s}`: expected RANK or RANK@STEP"));
        let (rank, step) = match s.split_once('@') {
            Some((r, st)) => (r, Some(st)),
            None => (s, None),
        };
        Ok(Crash {
            rank: rank.trim().parse().map_err(|_| bad())?,
            from_step: match step {
                Some(st) => st.trim().parse().map_err(|_| bad())?,
                None => 0,
            },
        })
    }
}

/// A rank that starts the collective `delay` seconds late.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stall {
    /// The rank.
    pub rank: Rank,
    /// How late it starts, in seconds.
    pub delay: f64,
}

impl FromStr for Stall {
    type Err = SimError;

    /// `R:US`: rank `R` starts `US` microseconds late.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            SimError::InvalidConfig(format!(
                "stall `{s}`: expected RANK:MICROSECONDS, e.g. 3:250"
            ))
        };
        let (rank, us) = s.split_once(':').ok_or_else(bad)?;
        let us: f64 = us.trim().parse().map_err(|_| bad())?;
        if !(us.is_finite() && us >= 0.0) {
            return Err(bad());
        }
        Ok(Stall {
            rank: rank.trim().parse().map_err(|_| bad())?,
            delay: us * 1e-6,
        })
    }
}

/// The longest delay a distribution gives (one day, as the runtime's longest step deadline):
/// larger draws are cut to it.
pub const MAX_DELAY: f64 = 86_400.0;

/// The largest `sigma` of [`Delay::LogNormal`].
pub const MAX_SIGMA: f64 = 10.0;

/// A distribution of delays in seconds, drawn from the scenario's seed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Delay {
    /// Always this long.
    Fixed(f64),
    /// Exponential with this mean.
    Exp(f64),
    /// Log-normal: `median · exp(sigma · z)` for a standard normal `z`.
    LogNormal {
        /// The median delay, in seconds.
        median: f64,
        /// The spread of its logarithm, `0..=`[`MAX_SIGMA`].
        sigma: f64,
    },
}

impl Delay {
    /// Checks that every parameter is finite, at least 0 and at most [`MAX_DELAY`] (or
    /// [`MAX_SIGMA`]).
    ///
    /// # Errors
    /// [`SimError::InvalidConfig`] naming the bad value.
    pub fn validate(&self) -> Result<(), SimError> {
        let time = match *self {
            Delay::Fixed(t) | Delay::Exp(t) => t,
            Delay::LogNormal { median, sigma } => {
                if !(0.0..=MAX_SIGMA).contains(&sigma) {
                    return Err(SimError::InvalidConfig(format!(
                        "log-normal sigma {sigma} is not in [0, {MAX_SIGMA}]"
                    )));
                }
                median
            }
        };
        if (0.0..=MAX_DELAY).contains(&time) {
            Ok(())
        } else {
            Err(SimError::InvalidConfig(format!(
                "delay {time} s is not in [0, {MAX_DELAY}] s (one day)"
            )))
        }
    }

    /// One draw, in seconds, cut to [`MAX_DELAY`].
    pub(crate) fn sample(&self, rng: &mut impl Rng) -> f64 {
        let v = match *self {
            Delay::Fixed(t) => t,
            // 1 - u is in (0, 1]: the logarithm is finite.
            Delay::Exp(mean) => -mean * (1.0 - rng.gen::<f64>()).ln(),
            Delay::LogNormal { median, sigma } => {
                // Box-Muller.
                let (u, v) = (1.0 - rng.gen::<f64>(), rng.gen::<f64>());
                let z = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
                median * (sigma * z).exp()
            }
        };
        v.min(MAX_DELAY)
    }
}

impl fmt::Display for Delay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Delay::Fixed(t) => write!(f, "fixed {}", format_time(t)),
            Delay::Exp(mean) => write!(f, "exponential, mean {}", format_time(mean)),
            Delay::LogNormal { median, sigma } => {
                write!(
                    f,
                    "log-normal, median {}, sigma {sigma}",
                    format_time(median)
                )
            }
        }
    }
}

impl FromStr for Delay {
    type Err = SimError;

    /// `fixed:T`, `exp:MEAN` or `lognormal:MEDIAN,SIGMA`, times with a unit (`ns`, `us`, `ms`
    /// or `s`): `fixed:5ms`, `exp:500us`, `lognormal:2ms,0.5`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |why: String| {
            SimError::InvalidConfig(format!(
                "delay `{s}`: {why}; expected fixed:T, exp:MEAN or lognormal:MEDIAN,SIGMA with \
                 times such as 5ms, 250us, 1.5s"
            ))
        };
        let (kind, args) = s
            .split_once(':')
            .ok_or_else(|| bad("no distribution".into()))?;
        let delay = match kind.trim().to_ascii_lowercase().as_str() {
            "fixed" => Delay::Fixed(parse_time(args).map_err(bad)?),
            "exp" => Delay::Exp(parse_time(args).map_err(bad)?),
            "lognormal" => {
                let (median, sigma) = args
                    .split_once(',')
                    .ok_or_else(|| bad("lognormal needs MEDIAN,SIGMA".into()))?;
                let sigma: f64 = sigma
                    .trim()
                    .parse()
                    .map_err(|_| bad(format!("sigma `{sigma}` is not a number")))?;
                Delay::LogNormal {
                    median: parse_time(median).map_err(bad)?,
                    sigma,
                }
            }
            other => return Err(bad(format!("unknown distribution `{other}`"))),
        };
        delay.validate().map_err(|e| match e {
            SimError::InvalidConfig(why) => bad(why),
            other => other,
        })?;
        Ok(delay)
    }
}

/// `5ms`, `250us`, `1.5s`, `800ns`: seconds, finite and at least 0.
fn parse_time(s: &str) -> Result<f64, String> {
    let s = s.trim();
    let number = s.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let unit = &s[number.len()..];
    if unit.is_empty() {
        return Err(format!("time `{s}` has no unit (ns, us, ms or s)"));
    }
    let scale = match unit {
        "ns" => 1e-9,
        "us" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        _ => {
            return Err(format!(
                "time `{s}`: unknown unit `{unit}` (ns, us, ms or s)"
            ))
        }
    };
    let v: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("time `{s}`: `{}` is not a number", number.trim()))?;
    let v = v * scale;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("time `{s}` must be finite and at least 0"))
    }
}

/// Slow ranks (stragglers): the first `ranks` ranks start every round a delay late, drawn
/// per rank and round from `delay` (a slow computation before each call, as a rank whose
/// gradients take longer). Each starts a round when it has finished the one before plus its
/// delay, so a rank slower than the rounds falls further behind.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slow {
    /// How many ranks (ranks `0..ranks`).
    pub ranks: usize,
    /// Their delay before each round.
    pub delay: Delay,
}

/// Ranks that die: `ranks` ranks (the last honest ones, just below the Byzantine ones) stop at
/// round `at`, silently (no peer sees a connection close: a node or a link gone), and with
/// `rejoin` start answering again at that round, present when it starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deaths {
    /// How many ranks die.
    pub ranks: usize,
    /// The first round they take no part in.
    pub at: usize,
    /// The round they come back at, if any.
    pub rejoin: Option<usize>,
}

impl Deaths {
    /// Whether the dying ranks are dead in `round`.
    pub fn dead_in(&self, round: usize) -> bool {
        round >= self.at && self.rejoin.is_none_or(|back| round < back)
    }
}

impl FromStr for Deaths {
    type Err = SimError;

    /// `K@ROUND`: `K` ranks die at round `ROUND` (without a rejoin).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            SimError::InvalidConfig(format!(
                "deaths `{s}`: expected K@ROUND (K ranks die at round ROUND), e.g. 2@1"
            ))
        };
        let (k, at) = s.split_once('@').ok_or_else(bad)?;
        Ok(Deaths {
            ranks: k.trim().parse().map_err(|_| bad())?,
            at: at.trim().parse().map_err(|_| bad())?,
            rejoin: None,
        })
    }
}

/// What a lying shard owner sends instead of its result in sharded mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lie {
    /// The negated honest result, to everyone.
    SignFlip,
    /// All NaN, to everyone.
    Nan,
    /// Different garbage to every destination (equivocation): rank `q` receives values of
    /// magnitude `1e9·(q+1)` with alternating signs.
    Equivocate,
}

impl Lie {
    /// Every lie, for listings.
    pub const ALL: [Lie; 3] = [Lie::SignFlip, Lie::Nan, Lie::Equivocate];

    /// The name [`FromStr`] accepts.
    pub fn name(&self) -> &'static str {
        match self {
            Lie::SignFlip => "signflip",
            Lie::Nan => "nan",
            Lie::Equivocate => "equivocate",
        }
    }

    /// The lie sent for `honest` to rank `dest`.
    pub(crate) fn forge(&self, honest: &[f32], dest: Rank) -> Vec<f32> {
        match self {
            Lie::SignFlip => honest.iter().map(|v| -v).collect(),
            Lie::Nan => vec![f32::NAN; honest.len()],
            Lie::Equivocate => {
                let magnitude = 1e9 * (dest as f32 + 1.0);
                let v = if dest.is_multiple_of(2) {
                    magnitude
                } else {
                    -magnitude
                };
                vec![v; honest.len()]
            }
        }
    }
}

impl fmt::Display for Lie {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Lie {
    type Err = SimError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Lie::ALL
            .into_iter()
            .find(|l| l.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                SimError::InvalidConfig(format!(
                    "unknown lie `{s}`; known: signflip, nan, equivocate"
                ))
            })
    }
}

/// The Byzantine ranks: the last `byzantine_inputs` ranks contribute vectors forged by
/// `attack` (from the honest inputs, as an omniscient attacker), and in sharded mode the last
/// `lying_owners` ranks send `lie` instead of their shard results. Both sets count towards the
/// same `f`: a rank in either is not honest.
#[derive(Debug, Clone, PartialEq)]
pub struct Adversary {
    /// How many ranks (the last ones) contribute forged inputs.
    pub byzantine_inputs: usize,
    /// How they forge them.
    pub attack: Attack,
    /// How many ranks (the last ones) lie about their shard results.
    pub lying_owners: usize,
    /// What they send instead.
    pub lie: Lie,
    /// Whether the ranks that forge inputs also equivocate: each destination (each peer in
    /// gather mode, each owner of a shard in sharded mode) gets a different vector.
    pub equivocate_inputs: bool,
    /// With `equivocate_inputs`: only this rank gets another vector, every other destination
    /// the same one (a split that a majority decides under `Agreement::Enforce`, and that
    /// leaves the victim out of step under `Detect`). `None`: each destination another.
    pub equivocation_victim: Option<Rank>,
}

impl Default for Adversary {
    fn default() -> Self {
        Adversary {
            byzantine_inputs: 0,
            attack: Attack::SignFlip,
            lying_owners: 0,
            lie: Lie::SignFlip,
            equivocate_inputs: false,
            equivocation_victim: None,
        }
    }
}

impl Adversary {
    /// Whether `rank` forges its input in a world of `n`.
    pub fn forges_input(&self, rank: Rank, n: usize) -> bool {
        rank + self.byzantine_inputs >= n
    }

    /// Whether `rank` sends different inputs to different ranks in a world of `n`.
    pub fn equivocates_inputs(&self, rank: Rank, n: usize) -> bool {
        self.equivocate_inputs && self.forges_input(rank, n)
    }

    /// Which of the equivocators' vectors rank `dest` gets: its own, or one of two around
    /// [`Adversary::equivocation_victim`].
    pub(crate) fn equivocation_key(&self, dest: Rank) -> Rank {
        match self.equivocation_victim {
            Some(victim) => usize::from(dest == victim),
            None => dest,
        }
    }

    /// Whether `rank` lies as a shard owner in a world of `n`.
    pub fn lies_as_owner(&self, rank: Rank, n: usize) -> bool {
        rank + self.lying_owners >= n
    }

    /// Checks the counts against a world of `n`.
    ///
    /// # Errors
    /// [`SimError::InvalidConfig`] when there would be no honest input to imitate or more
    /// liars than ranks.
    pub fn validate(&self, n: usize) -> Result<(), SimError> {
        if self.byzantine_inputs >= n && self.byzantine_inputs > 0 {
            return Err(SimError::InvalidConfig(format!(
                "{} Byzantine ranks in a world of {n}: attacks need at least one honest input",
                self.byzantine_inputs
            )));
        }
        if self.lying_owners > n {
            return Err(SimError::InvalidConfig(format!(
                "{} lying owners in a world of {n}",
                self.lying_owners
            )));
        }
        if let Some(victim) = self.equivocation_victim {
            check_rank("equivocation victim", victim, n)?;
            if !self.equivocate_inputs {
                return Err(SimError::InvalidConfig(
                    "an equivocation victim without equivocating ranks".into(),
                ));
            }
        }
        Ok(())
    }
}

/// The attack names [`attack_by_name`] accepts, with what they forge.
pub const ATTACKS: &[(&str, &str)] = &[
    ("signflip", "the negated honest mean"),
    ("scale", "the honest mean times 1e6"),
    ("gaussian", "the honest mean plus N(0, 100^2) noise"),
    ("alie", "a little is enough: mean - z_max * std"),
    ("ipm", "inner-product manipulation: -0.5 * mean"),
    ("nan", "every value NaN"),
    ("inf", "every value +inf"),
    ("neginf", "every value -inf"),
    ("mimic", "a copy of rank 0's input"),
];

/// An [`Attack`] by name (see [`ATTACKS`]), tuned for a world of `n` with `f` Byzantine ranks;
/// `seed` seeds the random ones.
///
/// # Errors
/// [`SimError::InvalidConfig`] for an unknown name, listing the known ones.
pub fn attack_by_name(name: &str, n: usize, f: usize, seed: u64) -> Result<Attack, SimError> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "signflip" | "sign-flip" => Attack::SignFlip,
        "scale" => Attack::Scale(1e6),
        "gaussian" => Attack::Gaussian { sigma: 100.0, seed },
        "alie" => Attack::Alie { z: None, n, f },
        "ipm" => Attack::Ipm(0.5),
        "nan" => Attack::Nan,
        "inf" => Attack::Inf,
        "neginf" | "-inf" => Attack::NegInf,
        "mimic" => Attack::Mimic(0),
        _ => {
            return Err(SimError::InvalidConfig(format!(
                "unknown attack `{name}`; known attacks: {}",
                ATTACKS
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", ")
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_specs_parse() {
        assert_eq!(
            "3".parse::<Crash>().unwrap(),
            Crash {
                rank: 3,
                from_step: 0
            }
        );
        assert_eq!(
            "3@2".parse::<Crash>().unwrap(),
            Crash {
                rank: 3,
                from_step: 2
            }
        );
        assert!("x".parse::<Crash>().is_err());
        let s: Stall = "5:250".parse().unwrap();
        assert_eq!(s.rank, 5);
        assert!((s.delay - 250e-6).abs() < 1e-15);
        assert!("5".parse::<Stall>().is_err());
        assert!("5:-1".parse::<Stall>().is_err());
        assert_eq!("NaN".parse::<Lie>().unwrap(), Lie::Nan);
        assert_eq!("fixed:5ms".parse::<Delay>().unwrap(), Delay::Fixed(5e-3));
        assert_eq!("exp:250us".parse::<Delay>().unwrap(), Delay::Exp(250e-6));
        assert_eq!(
            "lognormal:2ms,0.5".parse::<Delay>().unwrap(),
            Delay::LogNormal {
                median: 2e-3,
                sigma: 0.5
            }
        );
        for bad in [
            "5ms",
            "fixed:5",
            "fixed:5d",
            "fixed:1e5",
            "fixed:-1ms",
            "fixed:1e400s",
            "fixed:86401s",
            "exp:NaNms",
            "lognormal:1ms",
            "lognormal:1ms,11",
            "lognormal:1ms,-1",
            "gamma:1ms",
        ] {
            let e = bad.parse::<Delay>().unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("fixed:T"), "{bad}: {e}");
        }
        assert_eq!(
            "2@1".parse::<Deaths>().unwrap(),
            Deaths {
                ranks: 2,
                at: 1,
                rejoin: None
            }
        );
        assert!("2".parse::<Deaths>().is_err() && "x@1".parse::<Deaths>().is_err());
        assert!(attack_by_name("alie", 8, 1, 0).is_ok());
        let e = attack_by_name("nope", 8, 1, 0).unwrap_err().to_string();
        assert!(e.contains("signflip, scale"), "{e}");
    }

    #[test]
    fn delays_are_drawn_within_their_bounds_and_from_the_seed() {
        use rand::SeedableRng;
        let draw = |d: Delay, seed| {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            (0..2000).map(|_| d.sample(&mut rng)).collect::<Vec<f64>>()
        };
        let exp = draw(Delay::Exp(1e-3), 7);
        assert_eq!(exp, draw(Delay::Exp(1e-3), 7));
        assert!(exp.iter().all(|&v| v.is_finite() && v >= 0.0));
        let mean = exp.iter().sum::<f64>() / exp.len() as f64;
        assert!((mean - 1e-3).abs() < 1e-4, "{mean}");
        let mut log = draw(
            Delay::LogNormal {
                median: 2e-3,
                sigma: 0.5,
            },
            7,
        );
        log.sort_by(f64::total_cmp);
        let median = log[log.len() / 2];
        assert!((median / 2e-3 - 1.0).abs() < 0.1, "{median}");
        // The widest spread is cut to a day.
        let wide = draw(
            Delay::LogNormal {
                median: MAX_DELAY,
                sigma: MAX_SIGMA,
            },
            1,
        );
        assert!(wide.iter().all(|&v| (0.0..=MAX_DELAY).contains(&v)));
        assert!(draw(Delay::Fixed(3e-3), 0).iter().all(|&v| v == 3e-3));
    }

    #[test]
    fn deaths_last_until_the_rejoin() {
        let d = Deaths {
            ranks: 2,
            at: 1,
            rejoin: Some(3),
        };
        let dead: Vec<bool> = (0..5).map(|r| d.dead_in(r)).collect();
        assert_eq!(dead, [false, true, true, false, false]);
        assert!(Deaths { rejoin: None, ..d }.dead_in(100));
        let bad = Faults {
            deaths: Some(Deaths {
                rejoin: Some(1),
                ..d
            }),
            ..Faults::default()
        };
        assert!(bad
            .validate(8)
            .unwrap_err()
            .to_string()
            .contains("later round"));
    }

    #[test]
    fn the_last_ranks_are_byzantine() {
        let a = Adversary {
            byzantine_inputs: 2,
            lying_owners: 1,
            ..Adversary::default()
        };
        assert!(!a.forges_input(5, 8));
        assert!(a.forges_input(6, 8) && a.forges_input(7, 8));
        assert!(!a.lies_as_owner(6, 8) && a.lies_as_owner(7, 8));
        assert!(Adversary {
            byzantine_inputs: 8,
            ..Adversary::default()
        }
        .validate(8)
        .is_err());
    }
}
