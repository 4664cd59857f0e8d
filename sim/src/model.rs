//! The cost model: links, NICs and local computation.

use std::fmt;
use std::str::FromStr;

use crate::SimError;

/// The α–β network: a message of `B` bytes takes `α + B/β` on an idle path; every rank has one
/// NIC that sends one message at a time at `injection_bandwidth` and receives one message at a
/// time at the same rate, first come (by head arrival) first served. The fabric between NICs
/// is not modelled: full bisection, no congestion, no packet-level effects.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Network {
    /// Latency `α` of every message, in seconds.
    pub alpha: f64,
    /// Bandwidth `β` of one message's path, in bytes per second.
    pub link_bandwidth: f64,
    /// Bandwidth of each rank's NIC, in bytes per second, shared by all the messages it sends
    /// (and, separately, by all the messages it receives).
    pub injection_bandwidth: f64,
}

impl Network {
    /// A network whose links and NICs all run at `gbps` gigabits per second, with latency
    /// `alpha_us` microseconds.
    pub fn new(alpha_us: f64, gbps: f64) -> Network {
        let bandwidth = gbps * 1e9 / 8.0;
        Network {
            alpha: alpha_us * 1e-6,
            link_bandwidth: bandwidth,
            injection_bandwidth: bandwidth,
        }
    }

    /// The network of a [`Preset`].
    pub fn preset(preset: Preset) -> Network {
        match preset {
            Preset::Infiniband => Network::new(2.0, 200.0),
            Preset::Slingshot => Network::new(2.5, 200.0),
        }
    }

    /// Checks that latency and bandwidths are usable numbers.
    ///
    /// # Errors
    /// [`SimError::InvalidConfig`] naming the bad value.
    pub fn validate(&self) -> Result<(), SimError> {
        if !(self.alpha.is_finite() && self.alpha >= 0.0) {
            return Err(SimError::InvalidConfig(format!(
                "latency alpha = {} s must be finite and >= 0",
                self.alpha
            )));
        }
        for (what, v) in [
            ("link bandwidth", self.link_bandwidth),
            ("injection bandwidth", self.injection_bandwidth),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(SimError::InvalidConfig(format!(
                    "{what} = {v} B/s must be finite and > 0"
                )));
            }
        }
        Ok(())
    }
}

/// Named interconnects for [`Network::preset`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// HDR InfiniBand: 200 Gb/s, α = 2 µs.
    Infiniband,
    /// HPE Slingshot: 200 Gb/s, α = 2.5 µs.
    Slingshot,
}

impl Preset {
    /// Every preset, for listings.
    pub const ALL: [Preset; 2] = [Preset::Infiniband, Preset::Slingshot];

    /// The preset's name as [`FromStr`] accepts it.
    pub fn name(&self) -> &'static str {
        match self {
            Preset::Infiniband => "infiniband",
            Preset::Slingshot => "slingshot",
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = SimError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Preset::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                SimError::InvalidConfig(format!(
                    "unknown network preset `{s}`; known presets: infiniband, slingshot"
                ))
            })
    }
}

/// Local computation rates; `None` makes that computation free (the default), so only the
/// network is timed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Compute {
    /// Bytes of input per second the robust rule reads (e.g. `4.5e9` for a median): gather
    /// mode charges `inputs · d` of them, a shard owner `inputs · |shard|` per owned shard, and
    /// the combine `versions · |shard|` per shard when there is more than one version.
    pub rule_throughput: Option<f64>,
    /// Bytes of input per second a SUM reads (ring reduce steps: both operands).
    pub sum_throughput: Option<f64>,
}

impl Compute {
    /// Checks that the throughputs are usable numbers.
    ///
    /// # Errors
    /// [`SimError::InvalidConfig`] naming the bad value.
    pub fn validate(&self) -> Result<(), SimError> {
        for (what, v) in [
            ("rule throughput", self.rule_throughput),
            ("sum throughput", self.sum_throughput),
        ] {
            if let Some(v) = v {
                if !(v.is_finite() && v > 0.0) {
                    return Err(SimError::InvalidConfig(format!(
                        "{what} = {v} B/s must be finite and > 0"
                    )));
                }
            }
        }
        Ok(())
    }
}
