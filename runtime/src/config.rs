//! Run-time configuration of a communicator.

use std::time::Duration;

use crate::BootstrapError;

/// Settings that apply to every collective of a communicator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// How long one step of a collective waits for its peers. A peer whose message has not
    /// arrived by then is `Missing` for that step. Step `i` of a robust round waits `i + 1`
    /// times this (`PROTOCOL.md`, "Step deadlines"). Default 30 s; `BYZCOLL_TIMEOUT_MS`.
    pub step_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            step_timeout: Duration::from_secs(30),
        }
    }
}

impl Config {
    /// The defaults, overridden by `BYZCOLL_TIMEOUT_MS` when it is set.
    ///
    /// # Errors
    /// [`BootstrapError::InvalidVar`] when the variable is not a whole number of milliseconds
    /// from 1 to one day (86 400 000).
    pub fn from_env() -> Result<Self, BootstrapError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// As [`Config::from_env`], reading variables through `get`.
    ///
    /// # Errors
    /// As [`Config::from_env`].
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, BootstrapError> {
        let mut config = Config::default();
        if let Some(v) = get("BYZCOLL_TIMEOUT_MS") {
            let ms: u64 = v
                .trim()
                .parse()
                .ok()
                .filter(|ms| (1..=86_400_000).contains(ms))
                .ok_or_else(|| BootstrapError::InvalidVar {
                    var: "BYZCOLL_TIMEOUT_MS",
                    value: v.clone(),
                    why: "expected milliseconds, an integer from 1 to 86400000 (one day)".into(),
                })?;
            config.step_timeout = Duration::from_millis(ms);
        }
        Ok(config)
    }
}
