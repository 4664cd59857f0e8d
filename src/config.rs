//! [`JobConfig`]: everything [`crate::init_with`] needs to join a job, validated in one place,
//! from the environment ([`JobConfig::from_env`]) or from code ([`JobConfig::builder`]).

use std::net::IpAddr;
use std::time::Duration;

use std::sync::Arc;

use byzcoll_runtime::bootstrap::keys::{self, KeyRoster};
use byzcoll_runtime::bootstrap::{Identity, JobAuth, LaunchEnv, Launcher, StoreClient, MAX_WORLD};
pub use byzcoll_runtime::MAX_STEP_TIMEOUT;

use byzcoll_runtime::{parse_flag, parse_var, Lookup};

use crate::registry::{self, Chosen, TransportInfo};
use crate::{Agreement, BootstrapError, Config, Error, Rank, Result};

/// The transport a job uses when nothing names one.
pub const DEFAULT_TRANSPORT: &str = "tcp";

/// The process environment: the one place the library reads it.
fn process_env(var: &str) -> Option<String> {
    std::env::var(var).ok()
}

/// How the ranks of a job find each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Bootstrap {
    /// Through the rendezvous store (`BYZCOLL_STORE`, or the launcher's), authenticated by
    /// the job's secret.
    Store,
    /// Through the caller's all-gather ([`crate::init_with_allgather`]): no store and no
    /// secret to set; rank 0 draws the secret and the all-gather hands it out. TCP only.
    AllGather,
}

/// How this rank joins a job and how its collectives behave: rank and world, the rendezvous
/// store and the job's authentication, the transport (there is no fallback to another one),
/// the step deadline, the agreement policy and the TCP options.
///
/// The job-wide parameters (marked below) decide which steps a collective takes: the ranks
/// compare them at setup, and a rank that chose one differently fails to join, naming it
/// ([`BootstrapError::JobMismatch`]).
///
/// A `JobConfig` is always valid: it is made only by [`JobConfig::from_env`] or
/// [`JobConfigBuilder::build`], which check every value and say which one is wrong. Each
/// `BYZCOLL_*` variable is read here and nowhere else (the launcher's own variables are read
/// by [`LaunchEnv`], the secret by [`JobAuth`], both called from here); an invalid value is
/// an error naming the variable, never a silent default.
///
/// | variable | meaning | default |
/// |---|---|---|
/// | `BYZCOLL_RANK`, `BYZCOLL_WORLD_SIZE`, `BYZCOLL_LOCAL_RANK`, `BYZCOLL_STORE` | who and where (or Slurm's, Open MPI's, PMI's, torchrun's variables) | a world of one |
/// | `BYZCOLL_SECRET` / `BYZCOLL_SECRET_FILE` | the job secret (64 hex digits) | required when the world is larger than one |
/// | `BYZCOLL_ALLOW_UNAUTHENTICATED=1` | run without a secret (insecure; every report says so) | off |
/// | `BYZCOLL_TRANSPORT` | `tcp`, `ucx`, `libfabric`, `nccl` | `tcp` |
/// | `BYZCOLL_TIMEOUT_MS` | step deadline, 1 ms to one day | 30 000 |
/// | `BYZCOLL_AGREEMENT` | `off`, `detect`, `enforce` (job-wide) | `detect` |
/// | `BYZCOLL_SUB_ROUND_BYTES` | most bytes one sub-round of a sharded all-reduce covers, 1 B to 1 TiB (job-wide) | 4 MiB |
/// | `BYZCOLL_RING_PART_BYTES` | smallest part of a ring step sent as a step of its own, 1 B to 1 TiB (job-wide) | the runtime's |
/// | `BYZCOLL_DOUBLING_MAX_BYTES` | largest all-reduce (bytes per rank) done by recursive doubling rather than the ring, 0 B to 1 TiB (job-wide) | 64 KiB |
/// | `BYZCOLL_STORE_HOSTED` | `1`: the launcher hosts the store, rank 0 does not; `0`: rank 0 does | `0` |
/// | `BYZCOLL_REJOIN` | `1`: this process restarts a rank that died, and [`crate::init_with`] rejoins the members' world ([`crate::rejoin`]); `0`: it starts with the job | `0` |
///
/// The transport parses its own options, read here and handed over ([`TransportInfo::vars`]
/// lists them; setting one of another transport's is an error):
///
/// | variable | transport | meaning | default |
/// |---|---|---|---|
/// | `BYZCOLL_TCP_ADDR` | tcp | IP address TCP listens on | the host name's address |
/// | `BYZCOLL_TCP_SPIN_US` | tcp | how long a waiting TCP exchange polls before sleeping, at most 1 s | the transport's |
/// | `BYZCOLL_FRAME_MAC` | tcp, ucx, libfabric | `1`: TCP frames carry MACs; `0`: not (UCX and libfabric always seal theirs, and refuse `0`) | `0` |
/// | `BYZCOLL_UCX_PEER_FAILURE` | ucx | `on`/`off`: UCX endpoints report dead peers | on unless `UCX_TLS` is shared memory only |
#[derive(Debug, Clone)]
pub struct JobConfig {
    launch: LaunchEnv,
    bootstrap: Bootstrap,
    auth: Option<JobAuth>,
    /// This rank's key and the roster, for the all-gather join (which learns the job secret
    /// from the gather, so `auth` stays `None` there).
    rank_key: Option<(Arc<KeyRoster>, Identity)>,
    settings: Settings,
}

/// The settings that do not depend on who this rank is (shared with
/// [`crate::init_with_allgather`], which learns rank and secret from the caller).
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) transport: &'static TransportInfo,
    /// The transport with the options the configuration chose for it.
    pub(crate) chosen: Chosen,
    pub(crate) comm: Config,
    pub(crate) store_hosted: bool,
    pub(crate) rejoins: bool,
}

impl JobConfig {
    /// Starts a configuration for rank `rank` of `size`, with every other setting at its
    /// default.
    pub fn builder(rank: Rank, size: usize) -> JobConfigBuilder {
        JobConfigBuilder {
            rank,
            size,
            local_rank: None,
            store: None,
            auth: None,
            transport: DEFAULT_TRANSPORT.to_string(),
            step_timeout: Config::default().step_timeout,
            agreement: Agreement::default(),
            sub_round_bytes: None,
            ring_part_bytes: None,
            transport_vars: Vec::new(),
            store_hosted: false,
            rejoins: false,
        }
    }

    /// Reads the process environment (see the table on [`JobConfig`]).
    ///
    /// # Errors
    /// [`Error::Bootstrap`] naming the variable whose value is invalid, or saying what is
    /// missing (a store address or a secret for a world larger than one);
    /// [`Error::Unsupported`] for a transport that is unknown or not in this build.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(process_env)
    }

    /// Rank `rank` of a `size`-rank job joined through the caller's all-gather
    /// ([`crate::init_with_allgather`]), with every setting that does not depend on who
    /// this rank is read from the process environment as [`JobConfig::from_env`] reads it
    /// (the launcher's variables and the secret are not: the caller says who, and rank 0
    /// draws the secret).
    ///
    /// # Errors
    /// As [`JobConfig::from_env`]; [`Error::Unsupported`] when `BYZCOLL_TRANSPORT` names a
    /// transport other than TCP (this path connects over TCP only, and does not switch
    /// silently).
    pub fn for_allgather(rank: Rank, size: usize) -> Result<Self> {
        Self::for_allgather_from_lookup(rank, size, process_env)
    }

    /// As [`JobConfig::for_allgather`], reading variables through `get`.
    ///
    /// # Errors
    /// As [`JobConfig::for_allgather`].
    pub fn for_allgather_from_lookup(
        rank: Rank,
        size: usize,
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        let config = JobConfig {
            launch: LaunchEnv {
                launcher: Launcher::Code,
                rank,
                size,
                local_rank: None,
                store: None,
            },
            bootstrap: Bootstrap::AllGather,
            auth: None,
            rank_key: keys::rank_key_from_lookup(&get, rank)?,
            settings: Settings::from_lookup(&get)?,
        };
        config.check()?;
        Ok(config)
    }

    /// This configuration with the step deadline `timeout` (1 ms to [`MAX_STEP_TIMEOUT`]).
    ///
    /// # Errors
    /// [`Error::InvalidUsage`] outside that range.
    pub fn with_step_timeout(mut self, timeout: Duration) -> Result<Self> {
        self.settings.comm.step_timeout = timeout;
        self.check()?;
        Ok(self)
    }

    /// This configuration with the agreement policy `agreement`.
    pub fn with_agreement(mut self, agreement: Agreement) -> Self {
        self.settings.comm.agreement = agreement;
        self
    }

    /// This configuration with TCP listening on `ip`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the transport is not TCP.
    #[cfg_attr(not(feature = "tcp"), allow(unused_mut))]
    pub fn with_tcp_listen(mut self, ip: IpAddr) -> Result<Self> {
        #[cfg(feature = "tcp")]
        if let Some(tcp) = self.settings.chosen.tcp() {
            tcp.listen = Some(ip);
            return Ok(self);
        }
        Err(Error::Unsupported(format!(
            "listening on {ip}: an option of TCP, and the transport is {}",
            self.settings.transport.name
        )))
    }

    /// How the ranks find each other.
    pub fn bootstrap(&self) -> Bootstrap {
        self.bootstrap
    }

    /// As [`JobConfig::from_env`], reading variables through `get` (for tests and embedders
    /// with their own configuration source).
    ///
    /// # Errors
    /// As [`JobConfig::from_env`].
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let launch = LaunchEnv::from_lookup(&get)?;
        let settings = Settings::from_lookup(&get)?;
        let auth = if launch.size > 1 {
            Some(JobAuth::from_lookup(&get)?.with_rank_keys(&get, launch.rank)?)
        } else {
            None
        };
        let config = JobConfig {
            launch,
            bootstrap: Bootstrap::Store,
            auth,
            rank_key: None,
            settings,
        };
        config.check()?;
        Ok(config)
    }

    /// Rank, world size, local rank and store address.
    pub fn launch(&self) -> &LaunchEnv {
        &self.launch
    }

    /// A client of the job's rendezvous store as this rank, each request waiting as long as a
    /// setup may ([`registry::setup_timeout`]); `None` without a store address or the job's
    /// authentication (a world of one, an all-gather join).
    pub(crate) fn store_client(&self) -> Option<StoreClient> {
        Some(StoreClient::new(
            self.launch.store.clone()?,
            self.launch.rank,
            self.launch.size,
            registry::setup_timeout(&self.settings.comm),
            self.auth.clone()?,
        ))
    }

    /// The job's authentication; `None` in a world of one, which connects to nobody.
    pub fn auth(&self) -> Option<&JobAuth> {
        self.auth.as_ref()
    }

    /// This rank's per-rank key and the roster, for the all-gather join (set by
    /// `BYZCOLL_ROSTER_FILE` with `BYZCOLL_KEY_FILE` or `BYZCOLL_KEY`).
    pub(crate) fn rank_key(&self) -> Option<&(Arc<KeyRoster>, Identity)> {
        self.rank_key.as_ref()
    }

    /// The transport's name and description.
    pub fn transport(&self) -> &'static TransportInfo {
        self.settings.transport
    }

    /// The communicator's settings (the step deadline).
    pub fn comm(&self) -> &Config {
        &self.settings.comm
    }

    /// How robust rounds cross-check their results.
    pub fn agreement(&self) -> Agreement {
        self.settings.comm.agreement
    }

    /// Whether the launcher hosts the rendezvous store (so rank 0 does not).
    pub fn store_hosted(&self) -> bool {
        self.settings.store_hosted
    }

    /// Whether this process restarts a rank that died: [`crate::init_with`] then rejoins the
    /// members' world ([`crate::rejoin`]) rather than starting the job's.
    pub fn rejoins(&self) -> bool {
        self.settings.rejoins
    }

    /// The transport with the options the configuration chose for it.
    pub(crate) fn chosen(&self) -> &Chosen {
        &self.settings.chosen
    }

    /// The checks that involve more than one value.
    fn check(&self) -> Result<()> {
        let l = &self.launch;
        if l.size == 0 || l.size > MAX_WORLD || l.rank >= l.size {
            return Err(Error::InvalidUsage(format!(
                "rank {} of a world of {}: need 0 <= rank < size <= {MAX_WORLD}",
                l.rank, l.size
            )));
        }
        if self.bootstrap == Bootstrap::AllGather && self.settings.transport.name != "tcp" {
            return Err(Error::Unsupported(format!(
                "BYZCOLL_TRANSPORT={}: a world joined through the caller's all-gather connects \
                 over TCP only; unset BYZCOLL_TRANSPORT, or join with byzcoll::init",
                self.settings.transport.name
            )));
        }
        if l.size > 1 && self.bootstrap == Bootstrap::Store {
            if l.store.is_none() {
                return Err(Error::InvalidUsage(format!(
                    "a world of {} ranks needs a rendezvous store address (BYZCOLL_STORE, or \
                     MASTER_ADDR and MASTER_PORT)",
                    l.size
                )));
            }
            if self.auth.is_none() {
                return Err(BootstrapError::NoSecret.into());
            }
        }
        self.settings.check()
    }
}

impl Settings {
    pub(crate) fn from_lookup(get: Lookup<'_>) -> Result<Self> {
        let transport_name = get("BYZCOLL_TRANSPORT").unwrap_or_else(|| DEFAULT_TRANSPORT.into());
        let transport = registry::find(&transport_name).ok_or_else(|| {
            Error::Unsupported(format!(
                "BYZCOLL_TRANSPORT={transport_name:?} is not a transport byzcoll knows; known: {}",
                registry::names()
            ))
        })?;
        let comm = Config::from_lookup(get)?;
        let store_hosted = parse_var(
            get,
            "BYZCOLL_STORE_HOSTED",
            "expected 1 (the launcher hosts the store) or 0 (rank 0 does)",
            parse_flag,
        )?
        .unwrap_or(false);
        let rejoins = parse_var(
            get,
            "BYZCOLL_REJOIN",
            "expected 1 (this process restarts a rank, and rejoins) or 0",
            parse_flag,
        )?
        .unwrap_or(false);
        // Name the variable when the transport is what refuses a value.
        let chosen = transport.choose(get).map_err(|e| match e {
            Error::Unsupported(why) => {
                Error::Unsupported(format!("BYZCOLL_TRANSPORT={transport_name}: {why}"))
            }
            other => other,
        })?;
        let settings = Settings {
            transport,
            chosen,
            comm,
            store_hosted,
            rejoins,
        };
        settings.check()?;
        Ok(settings)
    }

    fn check(&self) -> Result<()> {
        if self.comm.step_timeout.is_zero() || self.comm.step_timeout > MAX_STEP_TIMEOUT {
            return Err(Error::InvalidUsage(format!(
                "step timeout {:?}: between 1 ms and one day",
                self.comm.step_timeout
            )));
        }
        for (what, bytes) in [
            ("sub-round bytes", self.comm.sub_round_bytes),
            ("ring part bytes", self.comm.ring_part_bytes),
        ] {
            if bytes == 0 || bytes as u64 > byzcoll_runtime::MAX_PART_BYTES {
                return Err(Error::InvalidUsage(format!(
                    "{what} {bytes}: between 1 and {} (1 TiB)",
                    byzcoll_runtime::MAX_PART_BYTES
                )));
            }
        }
        Ok(())
    }
}

/// Builds a [`JobConfig`] in code; every setter takes the value as is and
/// [`build`](JobConfigBuilder::build) checks them all.
#[derive(Debug, Clone)]
pub struct JobConfigBuilder {
    rank: Rank,
    size: usize,
    local_rank: Option<usize>,
    store: Option<String>,
    auth: Option<JobAuth>,
    transport: String,
    step_timeout: Duration,
    agreement: Agreement,
    sub_round_bytes: Option<usize>,
    ring_part_bytes: Option<usize>,
    /// The transport options set, as the variables they stand for (the transport parses
    /// them as it parses the environment's).
    transport_vars: Vec<(&'static str, String)>,
    store_hosted: bool,
    rejoins: bool,
}

impl JobConfigBuilder {
    /// `host:port` of the rendezvous store (required for a world larger than one).
    pub fn store(mut self, address: impl Into<String>) -> Self {
        self.store = Some(address.into());
        self
    }

    /// This rank's index among the ranks of its node (NCCL picks the GPU by it).
    pub fn local_rank(mut self, local_rank: usize) -> Self {
        self.local_rank = Some(local_rank);
        self
    }

    /// The job's authentication: [`JobAuth::Secret`], or the explicit
    /// [`JobAuth::Unauthenticated`] (required for a world larger than one).
    pub fn auth(mut self, auth: JobAuth) -> Self {
        self.auth = Some(auth);
        self
    }

    /// The transport by name (see [`crate::TRANSPORTS`]); default `tcp`.
    pub fn transport(mut self, name: impl Into<String>) -> Self {
        self.transport = name.into();
        self
    }

    /// How long one step waits for its peers (1 ms to one day); default 30 s. Step `i` of a
    /// robust round waits `i + 1` times this (`PROTOCOL.md`, "Step deadlines").
    pub fn step_timeout(mut self, timeout: Duration) -> Self {
        self.step_timeout = timeout;
        self
    }

    /// How robust rounds cross-check their results; default [`Agreement::Detect`].
    pub fn agreement(mut self, agreement: Agreement) -> Self {
        self.agreement = agreement;
        self
    }

    /// The most bytes one sub-round of a sharded all-reduce covers
    /// ([`Config::sub_round_bytes`], a job-wide parameter the ranks compare at setup).
    pub fn sub_round_bytes(mut self, bytes: usize) -> Self {
        self.sub_round_bytes = Some(bytes);
        self
    }

    /// The smallest part of a ring step's chunk sent as a step of its own
    /// ([`Config::ring_part_bytes`], a job-wide parameter the ranks compare at setup).
    pub fn ring_part_bytes(mut self, bytes: usize) -> Self {
        self.ring_part_bytes = Some(bytes);
        self
    }

    /// The transport option `var`, as if the environment set it to `value`; the transport
    /// checks it in [`build`](JobConfigBuilder::build).
    fn transport_var(mut self, var: &'static str, value: String) -> Self {
        self.transport_vars.retain(|(v, _)| *v != var);
        self.transport_vars.push((var, value));
        self
    }

    /// The IP address the TCP transport listens on (`BYZCOLL_TCP_ADDR`).
    pub fn tcp_listen(self, ip: IpAddr) -> Self {
        self.transport_var("BYZCOLL_TCP_ADDR", ip.to_string())
    }

    /// How long a waiting TCP exchange polls before sleeping, at most 1 s, in whole
    /// microseconds rounded up (`BYZCOLL_TCP_SPIN_US`).
    pub fn tcp_spin(self, spin: Duration) -> Self {
        let us = spin.as_nanos().div_ceil(1000);
        self.transport_var("BYZCOLL_TCP_SPIN_US", us.to_string())
    }

    /// Whether TCP frames carry MACs (UCX and libfabric always seal theirs, and refuse
    /// `false`) (`BYZCOLL_FRAME_MAC`).
    pub fn frame_mac(self, on: bool) -> Self {
        self.transport_var("BYZCOLL_FRAME_MAC", u8::from(on).to_string())
    }

    /// Whether UCX endpoints ask UCX to report dead peers (default: on unless `UCX_TLS`
    /// names only shared-memory transports, which cannot) (`BYZCOLL_UCX_PEER_FAILURE`).
    pub fn ucx_peer_failure(self, on: bool) -> Self {
        let value = if on { "on" } else { "off" };
        self.transport_var("BYZCOLL_UCX_PEER_FAILURE", value.into())
    }

    /// The launcher hosts the rendezvous store, so rank 0 does not.
    pub fn store_hosted(mut self, hosted: bool) -> Self {
        self.store_hosted = hosted;
        self
    }

    /// This process restarts a rank that died: [`crate::init_with`] rejoins the members'
    /// world ([`crate::rejoin`]).
    pub fn rejoins(mut self, rejoins: bool) -> Self {
        self.rejoins = rejoins;
        self
    }

    /// Checks every value and their combination.
    ///
    /// # Errors
    /// [`Error::InvalidUsage`] for a rank outside the world, a world above the largest
    /// supported, a step timeout of zero or above one day, or a world larger than one without
    /// a store; [`Error::Bootstrap`] for such a world without [`auth`](JobConfigBuilder::auth),
    /// or a transport option the transport refuses (a TCP spin above 1 s), naming the
    /// variable it stands for; [`Error::Unsupported`] for a transport that is unknown or not
    /// in this build, or an option the transport does not have.
    pub fn build(self) -> Result<JobConfig> {
        let transport = registry::find(&self.transport).ok_or_else(|| {
            Error::Unsupported(format!(
                "transport {:?} is not one byzcoll knows; known: {}",
                self.transport,
                registry::names()
            ))
        })?;
        let vars = &self.transport_vars;
        // The builder's own transport options stand for their `BYZCOLL_*` variables; the
        // libraries' variables the transports choose defaults by (`UCX_TLS`, `FI_PROVIDER`,
        // ...) are the process's, which the libraries read themselves too.
        let get = |var: &str| match var.starts_with("BYZCOLL_") {
            true => vars
                .iter()
                .find(|(v, _)| *v == var)
                .map(|(_, value)| value.clone()),
            false => process_env(var),
        };
        let chosen = transport.choose(&get)?;
        let config = JobConfig {
            launch: LaunchEnv {
                launcher: Launcher::Code,
                rank: self.rank,
                size: self.size,
                local_rank: self.local_rank,
                store: self.store,
            },
            bootstrap: Bootstrap::Store,
            auth: self.auth,
            rank_key: None,
            settings: Settings {
                transport,
                chosen,
                comm: {
                    let mut comm = Config::default();
                    comm.step_timeout = self.step_timeout;
                    comm.agreement = self.agreement;
                    if let Some(b) = self.sub_round_bytes {
                        comm.sub_round_bytes = b;
                    }
                    if let Some(b) = self.ring_part_bytes {
                        comm.ring_part_bytes = b;
                    }
                    comm
                },
                store_hosted: self.store_hosted,
                rejoins: self.rejoins,
            },
        };
        config.check()?;
        Ok(config)
    }
}

/// What `byzcoll info` shows of the process environment, read here like everything else.
#[derive(Debug)]
#[non_exhaustive]
pub struct EnvReport {
    /// The launcher's variables, or why they cannot be used.
    pub launch: std::result::Result<LaunchEnv, BootstrapError>,
    /// `BYZCOLL_TRANSPORT`, when set.
    pub transport_var: Option<String>,
    /// The job's authentication, or why none is usable.
    pub auth: std::result::Result<JobAuth, BootstrapError>,
    /// The whole configuration, or its first error.
    pub config: Result<JobConfig>,
    /// The `UCX_` variables that are set, sorted (UCX reads them itself).
    pub ucx_vars: Vec<(String, String)>,
    /// `FI_PROVIDER`, when set (libfabric reads it itself).
    pub fi_provider: Option<String>,
}

impl EnvReport {
    /// Reads the process environment.
    pub fn read() -> Self {
        let mut ucx_vars: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| k.starts_with("UCX_"))
            .collect();
        ucx_vars.sort();
        EnvReport {
            launch: LaunchEnv::from_lookup(process_env),
            transport_var: process_env("BYZCOLL_TRANSPORT"),
            auth: JobAuth::from_lookup(process_env).and_then(|a| {
                let rank = process_env("BYZCOLL_RANK").and_then(|r| r.trim().parse().ok());
                a.with_rank_keys(process_env, rank.unwrap_or(0))
            }),
            config: JobConfig::from_env(),
            ucx_vars,
            fi_provider: process_env("FI_PROVIDER"),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::collections::HashMap;

    use super::*;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    const WORLD: [(&str, &str); 4] = [
        ("BYZCOLL_RANK", "1"),
        ("BYZCOLL_WORLD_SIZE", "4"),
        ("BYZCOLL_STORE", "127.0.0.1:29500"),
        ("BYZCOLL_ALLOW_UNAUTHENTICATED", "1"),
    ];

    fn with(extra: &[(&'static str, &'static str)]) -> Result<JobConfig> {
        let mut vars = WORLD.to_vec();
        vars.extend_from_slice(extra);
        JobConfig::from_lookup(lookup(&vars))
    }

    /// The variable an error names, for an invalid value.
    fn named(e: Error) -> &'static str {
        match e {
            Error::Bootstrap(BootstrapError::InvalidVar { var, .. }) => var,
            other => panic!("expected an invalid variable, got {other}"),
        }
    }

    #[test]
    fn defaults_from_a_launcher_environment() {
        let c = with(&[]).unwrap();
        assert_eq!((c.launch().rank, c.launch().size), (1, 4));
        assert_eq!(c.transport().name, "tcp");
        assert_eq!(c.comm().step_timeout, Duration::from_secs(30));
        assert_eq!(c.agreement(), Agreement::Detect);
        assert!(!c.store_hosted());
        assert!(!c.auth().unwrap().is_authenticated());
    }

    #[test]
    fn every_value_is_read() {
        let c = with(&[
            ("BYZCOLL_TIMEOUT_MS", "250"),
            ("BYZCOLL_AGREEMENT", "off"),
            ("BYZCOLL_TCP_ADDR", "127.0.0.2"),
            ("BYZCOLL_TCP_SPIN_US", "1000000"),
            ("BYZCOLL_FRAME_MAC", "1"),
            ("BYZCOLL_STORE_HOSTED", "1"),
            ("BYZCOLL_REJOIN", "1"),
        ])
        .unwrap();
        assert!(c.rejoins());
        assert_eq!(c.comm().step_timeout, Duration::from_millis(250));
        assert_eq!(c.agreement(), Agreement::Off);
        let mut chosen = c.chosen().clone();
        let s = chosen.tcp().unwrap();
        assert_eq!(s.listen, Some([127, 0, 0, 2].into()));
        assert_eq!(s.spin, Some(Duration::from_secs(1)));
        assert_eq!(s.frame_mac, Some(true));
        assert!(c.store_hosted());
    }

    /// Every variable, at values just past what it accepts, is an error naming it.
    #[test]
    fn an_invalid_value_names_its_variable() {
        let cases: [(&str, &[&str]); 8] = [
            (
                "BYZCOLL_TIMEOUT_MS",
                &["0", "-1", "1.5", "", "86400001", "18446744073709551616"],
            ),
            ("BYZCOLL_AGREEMENT", &["", "Detect!", "on"]),
            ("BYZCOLL_TCP_ADDR", &["localhost", "127.0.0.1:80", ""]),
            (
                "BYZCOLL_TCP_SPIN_US",
                &["-1", "1000001", "x", "18446744073709551616"],
            ),
            ("BYZCOLL_FRAME_MAC", &["yes", "2", ""]),
            ("BYZCOLL_STORE_HOSTED", &["true", "2", ""]),
            ("BYZCOLL_REJOIN", &["yes", "2", ""]),
            ("BYZCOLL_WORLD_SIZE", &["0", "x", "-4"]),
        ];
        for (var, values) in cases {
            for value in values {
                let e = with(&[(var, value)]).unwrap_err();
                let shown = e.to_string();
                assert_eq!(named(e), var, "{var}={value:?}: {shown}");
            }
        }
        // A transport's own options are checked by that transport, when it is the one chosen.
        if registry::find("ucx").is_some_and(|t| t.available) {
            for value in ["ON", "yes", "1", ""] {
                let var = "BYZCOLL_UCX_PEER_FAILURE";
                let e = with(&[("BYZCOLL_TRANSPORT", "ucx"), (var, value)]).unwrap_err();
                let shown = e.to_string();
                assert_eq!(named(e), var, "{var}={value:?}: {shown}");
            }
        }
    }

    #[test]
    fn transports_are_checked_up_front() {
        let e = with(&[("BYZCOLL_TRANSPORT", "carrier-pigeon")]).unwrap_err();
        assert!(
            matches!(&e, Error::Unsupported(m) if m.contains("BYZCOLL_TRANSPORT=\"carrier-pigeon\"") && m.contains("tcp")),
            "{e}"
        );
        #[cfg(not(feature = "nccl"))]
        {
            let e = with(&[("BYZCOLL_TRANSPORT", "nccl")]).unwrap_err();
            assert!(
                matches!(&e, Error::Unsupported(m) if m.starts_with("BYZCOLL_TRANSPORT=nccl: not in this build")),
                "{e}"
            );
        }
        let e = with(&[("BYZCOLL_TRANSPORT", "local")]).unwrap_err();
        assert!(matches!(&e, Error::Unsupported(_)), "{e}");
    }

    #[test]
    fn options_of_another_transport_are_refused() {
        for (var, value) in [
            ("BYZCOLL_FRAME_MAC", "1"),
            ("BYZCOLL_TCP_SPIN_US", "10"),
            ("BYZCOLL_TCP_ADDR", "127.0.0.1"),
        ] {
            let e = JobConfig::builder(0, 1)
                .transport("nccl")
                .frame_mac(var == "BYZCOLL_FRAME_MAC")
                .build();
            assert!(matches!(e, Err(Error::Unsupported(_))), "{var}={value}");
        }
        let e = with(&[
            ("BYZCOLL_TRANSPORT", "local"),
            ("BYZCOLL_TCP_SPIN_US", "10"),
        ])
        .unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        // Whether or not this build has the transport whose option it is.
        let e = with(&[("BYZCOLL_UCX_PEER_FAILURE", "on")]).unwrap_err();
        assert!(
            matches!(&e, Error::Unsupported(m) if m.contains("BYZCOLL_UCX_PEER_FAILURE is an option of ucx, and the transport is tcp")),
            "{e}"
        );
        if registry::find("ucx").is_some_and(|t| t.available) {
            let e = with(&[("BYZCOLL_TRANSPORT", "ucx"), ("BYZCOLL_FRAME_MAC", "0")]).unwrap_err();
            assert!(
                matches!(&e, Error::Unsupported(m) if m.contains("always sealed")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_world_needs_a_store_and_a_secret() {
        let e = JobConfig::from_lookup(lookup(&[
            ("BYZCOLL_RANK", "0"),
            ("BYZCOLL_WORLD_SIZE", "2"),
            ("BYZCOLL_STORE", "127.0.0.1:1"),
        ]))
        .unwrap_err();
        assert!(
            matches!(e, Error::Bootstrap(BootstrapError::NoSecret)),
            "{e}"
        );
        let e = JobConfig::builder(0, 2)
            .auth(JobAuth::Unauthenticated)
            .build()
            .unwrap_err();
        assert!(
            matches!(&e, Error::InvalidUsage(m) if m.contains("store")),
            "{e}"
        );
        let e = JobConfig::builder(0, 2)
            .store("127.0.0.1:1")
            .build()
            .unwrap_err();
        assert!(
            matches!(e, Error::Bootstrap(BootstrapError::NoSecret)),
            "{e}"
        );
        // A world of one connects to nobody: no store and no secret are needed.
        let c = JobConfig::from_lookup(lookup(&[
            ("BYZCOLL_RANK", "0"),
            ("BYZCOLL_WORLD_SIZE", "1"),
        ]))
        .unwrap();
        assert_eq!(c.launch().size, 1);
        assert!(c.auth().is_none());
    }

    #[test]
    fn an_allgather_job_reads_the_settings_but_not_who_or_the_secret() {
        // The launcher's variables and the secret are the caller's business on this path.
        let c = JobConfig::for_allgather_from_lookup(
            2,
            4,
            lookup(&[
                ("BYZCOLL_RANK", "0"),
                ("BYZCOLL_WORLD_SIZE", "9"),
                ("BYZCOLL_TIMEOUT_MS", "250"),
                ("BYZCOLL_AGREEMENT", "off"),
            ]),
        )
        .unwrap();
        assert_eq!((c.launch().rank, c.launch().size), (2, 4));
        assert_eq!(c.bootstrap(), Bootstrap::AllGather);
        assert!(c.auth().is_none());
        assert_eq!(c.comm().step_timeout, Duration::from_millis(250));
        assert_eq!(c.agreement(), Agreement::Off);
        // Overrides are checked as the variables are.
        let c = c.with_step_timeout(Duration::from_secs(2)).unwrap();
        assert_eq!(c.comm().step_timeout, Duration::from_secs(2));
        for bad in [Duration::ZERO, MAX_STEP_TIMEOUT + Duration::from_millis(1)] {
            let e = c.clone().with_step_timeout(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidUsage(_)), "{e}");
        }
        for (rank, size) in [(4, 4), (0, 0), (0, MAX_WORLD + 1)] {
            let e = JobConfig::for_allgather_from_lookup(rank, size, lookup(&[])).unwrap_err();
            assert!(matches!(e, Error::InvalidUsage(_)), "{rank} of {size}: {e}");
        }
        // This path connects over TCP only, and says so rather than switching.
        if registry::find("ucx").is_some_and(|t| t.available) {
            let e =
                JobConfig::for_allgather_from_lookup(0, 2, lookup(&[("BYZCOLL_TRANSPORT", "ucx")]))
                    .unwrap_err();
            assert!(
                matches!(&e, Error::Unsupported(m) if m.contains("TCP only")),
                "{e}"
            );
        }
    }

    #[test]
    fn the_builder_checks_what_from_env_checks() {
        let ok = JobConfig::builder(3, 4)
            .store("127.0.0.1:29500")
            .auth(JobAuth::Unauthenticated)
            .step_timeout(Duration::from_millis(5))
            .agreement(Agreement::Off)
            .tcp_listen([127, 0, 0, 1].into())
            .tcp_spin(Duration::from_micros(50))
            .frame_mac(true)
            .build()
            .unwrap();
        assert_eq!(ok.launch().rank, 3);
        assert_eq!(ok.comm().step_timeout, Duration::from_millis(5));
        for bad in [
            JobConfig::builder(4, 4),
            JobConfig::builder(0, 0),
            JobConfig::builder(0, MAX_WORLD + 1),
            JobConfig::builder(0, 1).step_timeout(Duration::ZERO),
            JobConfig::builder(0, 1).step_timeout(MAX_STEP_TIMEOUT + Duration::from_millis(1)),
        ] {
            let shown = format!("{bad:?}");
            assert!(
                matches!(bad.build(), Err(Error::InvalidUsage(_))),
                "{shown}"
            );
        }
        // A transport option is checked by the transport, as the variable it stands for.
        let spin = JobConfig::builder(0, 1).tcp_spin(Duration::from_secs(2));
        assert_eq!(named(spin.build().unwrap_err()), "BYZCOLL_TCP_SPIN_US");
        let c = JobConfig::builder(0, 1)
            .tcp_spin(Duration::from_nanos(1500))
            .build()
            .unwrap();
        let mut chosen = c.chosen().clone();
        assert_eq!(
            chosen.tcp().unwrap().spin,
            Some(Duration::from_micros(2)),
            "a spin is never rounded down to none"
        );
        assert!(matches!(
            JobConfig::builder(0, 1).transport("nope").build(),
            Err(Error::Unsupported(_))
        ));
        assert_eq!(
            named(with(&[("BYZCOLL_AGREEMENT", "x")]).unwrap_err()),
            "BYZCOLL_AGREEMENT"
        );
    }
}
