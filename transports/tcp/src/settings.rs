//! What a job's configuration chooses of the TCP transport, parsed here: the variables are
//! read by `byzcoll::JobConfig` (the one reader of the process environment), which hands
//! them over through a [`Lookup`].

use std::net::IpAddr;
use std::time::Duration;

use byzcoll_runtime::{parse_flag, parse_var, Lookup, OptionError};

use crate::TcpOptions;

/// Longest [`TcpSettings::spin`]: beyond it, polling costs more CPU than any wakeup saves.
pub const MAX_SPIN: Duration = Duration::from_secs(1);

/// The TCP transport's share of a job's configuration.
///
/// | variable | meaning | default |
/// |---|---|---|
/// | `BYZCOLL_TCP_ADDR` | IP address to listen on | the host name's address |
/// | `BYZCOLL_TCP_SPIN_US` | how long a waiting exchange polls before sleeping, 0 to 1 000 000 µs | [`TcpOptions::spin`] |
/// | `BYZCOLL_FRAME_MAC` | `1`: frames carry MACs ([`TcpOptions::frame_mac`]); `0`: not | `0` |
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TcpSettings {
    /// The address to listen on; `None`: the address the host name resolves to.
    pub listen: Option<IpAddr>,
    /// How long a waiting exchange polls; `None`: the transport's default.
    pub spin: Option<Duration>,
    /// Whether frames carry MACs; `None`: they do not.
    pub frame_mac: Option<bool>,
}

impl TcpSettings {
    /// The variables [`TcpSettings::from_lookup`] reads.
    pub const VARS: &'static [&'static str] = &[
        "BYZCOLL_TCP_ADDR",
        "BYZCOLL_TCP_SPIN_US",
        "BYZCOLL_FRAME_MAC",
    ];

    /// Parses the variables of [`TcpSettings::VARS`] that `get` has.
    ///
    /// # Errors
    /// [`OptionError::Invalid`] naming the variable whose value is not an IP address, a whole
    /// number of microseconds from 0 to 1 000 000, or a flag.
    pub fn from_lookup(get: Lookup<'_>) -> Result<Self, OptionError> {
        let listen = parse_var(get, "BYZCOLL_TCP_ADDR", "expected an IP address", |v| {
            v.parse::<IpAddr>().ok()
        })?;
        let max_us = MAX_SPIN.as_micros();
        let spin = parse_var(
            get,
            "BYZCOLL_TCP_SPIN_US",
            &format!("expected microseconds, an integer from 0 to {max_us}"),
            |v| {
                v.parse::<u64>()
                    .ok()
                    .filter(|&us| u128::from(us) <= max_us)
                    .map(Duration::from_micros)
            },
        )?;
        let frame_mac = parse_var(
            get,
            "BYZCOLL_FRAME_MAC",
            "expected 1 (frames carry MACs) or 0",
            parse_flag,
        )?;
        Ok(TcpSettings {
            listen,
            spin,
            frame_mac,
        })
    }

    /// The transport's options with these settings, and `setup_timeout` to join.
    pub fn options(&self, setup_timeout: Duration) -> TcpOptions {
        let defaults = TcpOptions::default();
        TcpOptions {
            setup_timeout,
            spin: self.spin.unwrap_or(defaults.spin),
            frame_mac: self.frame_mac.unwrap_or(defaults.frame_mac),
            ..defaults
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::collections::BTreeSet;
    use std::sync::Mutex;

    use super::*;

    #[test]
    fn reads_exactly_its_variables_and_names_a_bad_one() {
        let asked = Mutex::new(BTreeSet::new());
        let get = |var: &str| -> Option<String> {
            asked.lock().unwrap().insert(var.to_string());
            match var {
                "BYZCOLL_TCP_ADDR" => Some("127.0.0.2".into()),
                "BYZCOLL_TCP_SPIN_US" => Some(" 1000000 ".into()),
                "BYZCOLL_FRAME_MAC" => Some("1".into()),
                _ => None,
            }
        };
        let s = TcpSettings::from_lookup(&get).unwrap();
        assert_eq!(s.listen, Some([127, 0, 0, 2].into()));
        assert_eq!(s.spin, Some(MAX_SPIN));
        assert!(s.options(Duration::from_secs(3)).frame_mac);
        let expected: BTreeSet<String> = TcpSettings::VARS.iter().map(|v| v.to_string()).collect();
        assert_eq!(*asked.lock().unwrap(), expected);
        for (var, value) in [
            ("BYZCOLL_TCP_SPIN_US", "1000001"),
            ("BYZCOLL_TCP_SPIN_US", "-1"),
            ("BYZCOLL_TCP_ADDR", "localhost"),
            ("BYZCOLL_FRAME_MAC", "yes"),
        ] {
            let get = |v: &str| (v == var).then(|| value.to_string());
            let e = TcpSettings::from_lookup(&get).unwrap_err();
            assert!(e.to_string().contains(var), "{var}={value}: {e}");
        }
    }
}
