//! Run-time configuration of a communicator, and the check that every rank of a job chose the
//! job-wide parts of it alike.

use std::time::Duration;

use crate::{
    Agreement, BootstrapError, Grace, Rank, Stragglers, DOUBLING_MAX_BYTES, RING_PART_BYTES,
    SUB_ROUND_BYTES,
};

/// Settings that apply to every collective of a communicator.
///
/// Every field but [`Config::step_timeout`] is *job-wide*: it sets how many steps a call takes
/// or which steps run, so every rank must choose it alike. A job joined through
/// `byzcoll::init_with` compares them at setup ([`Config::job_record`],
/// [`Config::check_job`]): a rank that differs is a setup error naming the parameter and the
/// ranks, never peers found `Malformed` or missing later.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// How long one step of a collective waits for its peers. A peer whose message has not
    /// arrived by then is `Missing` for that step. Step `i` of a robust round waits `i + 1`
    /// times this (`PROTOCOL.md`, "Step deadlines"). Default 30 s; `BYZCOLL_TIMEOUT_MS`.
    pub step_timeout: Duration,
    /// How robust rounds cross-check their results ([`Agreement::Detect`] by default);
    /// `BYZCOLL_AGREEMENT`. Job-wide.
    pub agreement: Agreement,
    /// The most bytes of the vector one sub-round of a sharded all-reduce of a coordinate-wise
    /// rule covers ([`SUB_ROUND_BYTES`] by default; at least one element is taken whatever
    /// the value); `BYZCOLL_SUB_ROUND_BYTES`. Smaller parts hold less memory and take more
    /// steps. Job-wide.
    pub sub_round_bytes: usize,
    /// The smallest part of a ring step's chunk that `Communicator::all_reduce` sends as a
    /// step of its own ([`RING_PART_BYTES`] by default; at least one element is taken whatever
    /// the value), where the transport allows steps in flight; `BYZCOLL_RING_PART_BYTES`.
    /// Job-wide.
    pub ring_part_bytes: usize,
    /// The largest vector (bytes per rank) `Communicator::all_reduce` reduces by recursive
    /// doubling rather than the ring ([`DOUBLING_MAX_BYTES`] by default; 0: always the ring);
    /// `BYZCOLL_DOUBLING_MAX_BYTES`. Job-wide: every call's fingerprint holds the schedule it
    /// chose, so a rank that chose otherwise is out of step, never mixed in.
    pub doubling_max_bytes: usize,
    /// How many inputs a robust round may go without for their lateness alone (by default
    /// `auto`: up to the rule's `f`, none under `Agreement::Off`; [`Stragglers`]);
    /// `BYZCOLL_STRAGGLERS` (`auto` or a count). Job-wide.
    pub stragglers: Stragglers,
    /// How long a robust round's input steps wait past their quorum ([`Grace::DEFAULT`]).
    pub grace: Grace,
    /// Whether robust rounds measure each input against the aggregate
    /// ([`RoundReport::attribution`](crate::RoundReport::attribution); on by default). This
    /// rank's own choice: it changes nothing on the wire.
    pub attribution: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            step_timeout: Duration::from_secs(30),
            agreement: Agreement::default(),
            sub_round_bytes: SUB_ROUND_BYTES,
            ring_part_bytes: RING_PART_BYTES,
            doubling_max_bytes: DOUBLING_MAX_BYTES,
            stragglers: Stragglers::default(),
            grace: Grace::DEFAULT,
            attribution: true,
        }
    }
}

/// The longest step deadline accepted (one day), so that deadline arithmetic cannot overflow.
pub const MAX_STEP_TIMEOUT: Duration = Duration::from_secs(86_400);

/// The largest sub-round or ring part accepted (1 TiB): past any vector a rank can hold.
pub const MAX_PART_BYTES: u64 = 1 << 40;

/// Length of [`Config::job_record`].
pub const JOB_RECORD_LEN: usize = 4 + 1 + 8 + 8 + 8;

/// [`Config::job_record`]'s stragglers for [`Stragglers::Auto`].
const AUTO: u64 = u64::MAX;

/// What [`Config::job_record`] starts with.
const JOB_MAGIC: &[u8; 4] = b"BZJ1";

/// An 8-byte little-endian field of [`Config::job_record`].
fn le_u64(v: &[u8]) -> u64 {
    let mut le = [0u8; 8];
    le.copy_from_slice(v);
    u64::from_le_bytes(le)
}

impl Config {
    /// The defaults with the step deadline `step_timeout`.
    pub fn with_step_timeout(step_timeout: Duration) -> Self {
        Config {
            step_timeout,
            ..Config::default()
        }
    }

    /// The defaults, with `BYZCOLL_TIMEOUT_MS`, `BYZCOLL_AGREEMENT`, `BYZCOLL_STRAGGLERS`,
    /// `BYZCOLL_SUB_ROUND_BYTES`, `BYZCOLL_RING_PART_BYTES` and `BYZCOLL_DOUBLING_MAX_BYTES`
    /// from `get` where set. The
    /// process environment is read by `byzcoll::JobConfig` alone, which calls this.
    ///
    /// # Errors
    /// [`BootstrapError::InvalidVar`] naming the variable whose value is invalid: a step
    /// timeout that is not a whole number of milliseconds from 1 to one day, an agreement
    /// other than `off`, `detect` or `enforce`, or part sizes outside 1 byte to 1 TiB (0 to
    /// 1 TiB for the doubling bound).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, BootstrapError> {
        let invalid = |var: &'static str, value: &str, why: String| BootstrapError::InvalidVar {
            var,
            value: value.to_string(),
            why,
        };
        let mut config = Config::default();
        if let Some(v) = get("BYZCOLL_TIMEOUT_MS") {
            config.step_timeout = v
                .trim()
                .parse()
                .map_err(|e| format!("{e}"))
                .and_then(step_timeout_ms)
                .map_err(|why| invalid("BYZCOLL_TIMEOUT_MS", &v, why))?;
        }
        if let Some(v) = get("BYZCOLL_STRAGGLERS") {
            config.stragglers =
                Stragglers::parse(&v).map_err(|why| invalid("BYZCOLL_STRAGGLERS", &v, why))?;
        }
        if let Some(v) = get("BYZCOLL_AGREEMENT") {
            config.agreement =
                Agreement::parse(&v).map_err(|why| invalid("BYZCOLL_AGREEMENT", &v, why))?;
        }
        if let Some(v) = get("BYZCOLL_DOUBLING_MAX_BYTES") {
            config.doubling_max_bytes = v
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|&b| b <= MAX_PART_BYTES)
                .and_then(|b| usize::try_from(b).ok())
                .ok_or_else(|| {
                    invalid(
                        "BYZCOLL_DOUBLING_MAX_BYTES",
                        &v,
                        format!("expected bytes from 0 to {MAX_PART_BYTES}"),
                    )
                })?;
        }
        for (var, field) in [
            ("BYZCOLL_SUB_ROUND_BYTES", &mut config.sub_round_bytes),
            ("BYZCOLL_RING_PART_BYTES", &mut config.ring_part_bytes),
        ] {
            if let Some(v) = get(var) {
                *field = v
                    .trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|b| (1..=MAX_PART_BYTES).contains(b))
                    .and_then(|b| usize::try_from(b).ok())
                    .ok_or_else(|| {
                        invalid(
                            var,
                            &v,
                            format!("expected bytes, an integer from 1 to {MAX_PART_BYTES}"),
                        )
                    })?;
            }
        }
        Ok(config)
    }

    /// The job-wide parameters as a fixed-length record that every rank publishes at setup,
    /// for [`Config::check_job`].
    pub fn job_record(&self) -> [u8; JOB_RECORD_LEN] {
        let mut r = [0u8; JOB_RECORD_LEN];
        r[..4].copy_from_slice(JOB_MAGIC);
        r[4] = self.agreement.code();
        r[5..13].copy_from_slice(&(self.sub_round_bytes as u64).to_le_bytes());
        r[13..21].copy_from_slice(&(self.ring_part_bytes as u64).to_le_bytes());
        let stragglers = match self.stragglers {
            Stragglers::Auto => AUTO,
            Stragglers::Exactly(s) => s as u64,
        };
        r[21..29].copy_from_slice(&stragglers.to_le_bytes());
        r
    }

    /// Checks every rank's [`Config::job_record`] (`records[r]` is rank `r`'s) against this
    /// rank's.
    ///
    /// # Errors
    /// [`BootstrapError::JobMismatch`] naming the first parameter the ranks chose differently,
    /// with each value and the ranks that chose it; [`BootstrapError::Store`] for a record
    /// that is not one (another byzcoll, or not a rank of this job).
    pub fn check_job<B: AsRef<[u8]>>(&self, records: &[B]) -> Result<(), BootstrapError> {
        if let Some(r) = records
            .iter()
            .position(|b| b.as_ref().len() != JOB_RECORD_LEN || &b.as_ref()[..4] != JOB_MAGIC)
        {
            return Err(BootstrapError::Store(format!(
                "rank {r} published job parameters in another format: every rank must run the \
                 same byzcoll"
            )));
        }
        // Each parameter: its name, its bytes in the record, and how a value reads.
        type Field = (&'static str, std::ops::Range<usize>, fn(&[u8]) -> String);
        let fields: [Field; 4] = [
            ("agreement (BYZCOLL_AGREEMENT)", 4..5, |v| {
                let code = v.first().copied().unwrap_or_default();
                Agreement::from_code(code)
                    .map_or_else(|| format!("unknown ({code})"), |a| a.name().to_string())
            }),
            ("sub-round bytes (BYZCOLL_SUB_ROUND_BYTES)", 5..13, |v| {
                le_u64(v).to_string()
            }),
            ("ring part bytes (BYZCOLL_RING_PART_BYTES)", 13..21, |v| {
                le_u64(v).to_string()
            }),
            (
                "stragglers allowed (BYZCOLL_STRAGGLERS)",
                21..29,
                |v| match le_u64(v) {
                    AUTO => Stragglers::Auto.name(),
                    s => s.to_string(),
                },
            ),
        ];
        for (name, at, read) in fields {
            let value = |b: &[u8]| read(&b[at.clone()]);
            let mut groups: Vec<(String, Vec<Rank>)> = Vec::new();
            for (rank, b) in records.iter().enumerate() {
                let v = value(b.as_ref());
                match groups.iter_mut().find(|(g, _)| *g == v) {
                    Some((_, ranks)) => ranks.push(rank),
                    None => groups.push((v, vec![rank])),
                }
            }
            if groups.len() > 1 {
                let mine = value(&self.job_record());
                return Err(BootstrapError::JobMismatch {
                    parameter: name,
                    choices: groups
                        .into_iter()
                        .map(|(v, ranks)| {
                            let marker = if v == mine { " (this rank's)" } else { "" };
                            format!("{v}{marker} at ranks {ranks:?}")
                        })
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
        Ok(())
    }
}

/// A job's configuration, one variable at a time: the process environment (read by
/// `byzcoll::JobConfig` alone), a test's table, or what a builder set. Transports parse their own
/// variables through it ([`Config::from_lookup`] parses the communicator's).
pub type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Why a transport refuses the options a job's configuration gives it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OptionError {
    /// A variable holds a value it does not take ([`BootstrapError::InvalidVar`]).
    #[error(transparent)]
    Invalid(#[from] BootstrapError),
    /// A variable is set that this transport cannot honour.
    #[error("{var}: {why}")]
    Unsupported {
        /// The variable.
        var: &'static str,
        /// Why the transport cannot honour it.
        why: String,
    },
}

/// The value of `var` through `parse`: `None` when unset, [`BootstrapError::InvalidVar`] naming
/// `var` and what it takes (`expected`) when `parse` refuses it. The value is trimmed first.
///
/// # Errors
/// As said.
pub fn parse_var<T>(
    get: Lookup<'_>,
    var: &'static str,
    expected: &str,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Result<Option<T>, BootstrapError> {
    match get(var) {
        None => Ok(None),
        Some(v) => parse(v.trim())
            .map(Some)
            .ok_or_else(|| BootstrapError::InvalidVar {
                var,
                value: v,
                why: expected.to_string(),
            }),
    }
}

/// `1` is on and `0` off; anything else is not a flag.
pub fn parse_flag(v: &str) -> Option<bool> {
    match v {
        "1" => Some(true),
        "0" => Some(false),
        _ => None,
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn ranks_that_chose_a_job_wide_parameter_differently_are_named() {
        let base = Config::default();
        let records = |configs: &[&Config]| -> Vec<Vec<u8>> {
            configs.iter().map(|c| c.job_record().to_vec()).collect()
        };
        base.check_job(&records(&[&base, &base, &base])).unwrap();
        // The step timeout is the rank's own: it may differ.
        let slower = Config {
            step_timeout: Duration::from_secs(60),
            ..base.clone()
        };
        base.check_job(&records(&[&base, &slower])).unwrap();
        let enforce = Config {
            agreement: Agreement::Enforce,
            ..base.clone()
        };
        let e = base
            .check_job(&records(&[&base, &enforce, &base, &enforce]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("BYZCOLL_AGREEMENT"), "{e}");
        assert!(e.contains("detect (this rank's) at ranks [0, 2]"), "{e}");
        assert!(e.contains("enforce at ranks [1, 3]"), "{e}");
        let small = Config {
            sub_round_bytes: 1 << 20,
            ..base.clone()
        };
        let e = small
            .check_job(&records(&[&base, &small]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("BYZCOLL_SUB_ROUND_BYTES"), "{e}");
        assert!(e.contains("1048576 (this rank's) at ranks [1]"), "{e}");
        let parts = Config {
            ring_part_bytes: 4096,
            ..base.clone()
        };
        let e = base
            .check_job(&records(&[&parts, &base]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("BYZCOLL_RING_PART_BYTES"), "{e}");
        let with = |stragglers| Config {
            stragglers,
            ..base.clone()
        };
        let (none, one) = (with(Stragglers::Exactly(0)), with(Stragglers::Exactly(1)));
        let e = base
            .check_job(&records(&[&base, &none, &one]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("BYZCOLL_STRAGGLERS"), "{e}");
        assert!(e.contains("auto (this rank's) at ranks [0]"), "{e}");
        assert!(e.contains("0 at ranks [1], 1 at ranks [2]"), "{e}");
        // Something that is not a record is refused, not read.
        let e = base.check_job(&[&b"junk"[..]]).unwrap_err().to_string();
        assert!(e.contains("rank 0"), "{e}");
    }

    #[test]
    fn job_wide_variables_are_read_and_checked() {
        let get = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let c = Config::from_lookup(get(&[
            ("BYZCOLL_AGREEMENT", "enforce"),
            ("BYZCOLL_SUB_ROUND_BYTES", "65536"),
            ("BYZCOLL_RING_PART_BYTES", " 1 "),
        ]))
        .unwrap();
        assert_eq!(c.agreement, Agreement::Enforce);
        assert_eq!((c.sub_round_bytes, c.ring_part_bytes), (65536, 1));
        for (var, bad) in [
            ("BYZCOLL_SUB_ROUND_BYTES", "0"),
            ("BYZCOLL_SUB_ROUND_BYTES", "-1"),
            ("BYZCOLL_RING_PART_BYTES", "1099511627777"),
            ("BYZCOLL_RING_PART_BYTES", "18446744073709551616"),
            ("BYZCOLL_AGREEMENT", "maybe"),
        ] {
            let e = Config::from_lookup(|k| (k == var).then(|| bad.to_string())).unwrap_err();
            assert!(e.to_string().contains(var), "{var}={bad}: {e}");
        }
    }
}
