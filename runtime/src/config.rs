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

/// The longest step deadline accepted (one day), so that deadline arithmetic cannot overflow.
pub const MAX_STEP_TIMEOUT: Duration = Duration::from_secs(86_400);

impl Config {
    /// The defaults, with `BYZCOLL_TIMEOUT_MS` from `get` when it is set. The process
    /// environment is read by `byzcoll::JobConfig` alone, which calls this.
    ///
    /// # Errors
    /// [`BootstrapError::InvalidVar`] when the variable is not a whole number of milliseconds
    /// from 1 to one day.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, BootstrapError> {
        let mut config = Config::default();
        if let Some(v) = get("BYZCOLL_TIMEOUT_MS") {
            config.step_timeout = v
                .trim()
                .parse()
                .map_err(|e| format!("{e}"))
                .and_then(step_timeout_ms)
                .map_err(|why| BootstrapError::InvalidVar {
                    var: "BYZCOLL_TIMEOUT_MS",
                    value: v.clone(),
                    why,
                })?;
        }
        Ok(config)
    }
}

/// A step deadline of `ms` milliseconds, checked against the one bound (1 ms to
/// [`MAX_STEP_TIMEOUT`]) that every way of setting it applies.
///
/// # Errors
/// What is wrong, for a value outside the bound.
pub fn step_timeout_ms(ms: u64) -> Result<Duration, String> {
    let max = MAX_STEP_TIMEOUT.as_millis();
    if ms == 0 || u128::from(ms) > max {
        return Err(format!(
            "{ms} ms: expected milliseconds, an integer from 1 to {max} (one day)"
        ));
    }
    Ok(Duration::from_millis(ms))
}
