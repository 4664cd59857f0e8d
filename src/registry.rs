//! The transports byzcoll knows, by name, built from the enabled cargo features.
//!
//! Adding a transport takes its crate (an implementation of [`crate::Transport`] whose options
//! parse themselves from a [`Lookup`]), an optional dependency and feature in `Cargo.toml`, a
//! variant of [`Chosen`] with its `connect` below, and one line in [`TRANSPORTS`]. A transport
//! whose feature is off stays listed, with what enables it and the variables it takes, so
//! asking for it (or setting one of its options for another transport) is an error that says
//! so, never a switch to another one.

use std::time::Duration;

use byzcoll_runtime::bootstrap::{LaunchEnv, StoreClient};
use byzcoll_runtime::{Lookup, OptionError};

use crate::{Config, Error, Result, Transport};

/// Parses a transport's options from a job's configuration.
type Parse = fn(Lookup<'_>) -> std::result::Result<Chosen, OptionError>;

/// A transport byzcoll knows of, and whether this build has it.
#[derive(Debug, Clone, Copy)]
pub struct TransportInfo {
    /// Name accepted by `BYZCOLL_TRANSPORT` and [`crate::JobConfigBuilder::transport`].
    pub name: &'static str,
    /// Whether this build can use it across processes.
    pub available: bool,
    /// One line on what it is, or on what is missing.
    pub about: &'static str,
    /// The `BYZCOLL_*` variables that are its options (known even when this build lacks it).
    pub vars: &'static [&'static str],
    /// How its options are parsed; `None` when this build cannot use it.
    parse: Option<Parse>,
}

impl TransportInfo {
    /// A transport of this build: `available` says whether its system library is there too.
    #[cfg_attr(not(feature = "tcp"), allow(dead_code))]
    const fn built(
        name: &'static str,
        available: bool,
        about: &'static str,
        vars: &'static [&'static str],
        parse: Parse,
    ) -> Self {
        TransportInfo {
            name,
            available,
            about,
            vars,
            parse: Some(parse),
        }
    }

    /// A transport this build leaves out: `about` says how to get it.
    const fn missing(
        name: &'static str,
        about: &'static str,
        vars: &'static [&'static str],
    ) -> Self {
        TransportInfo {
            name,
            available: false,
            about,
            vars,
            parse: None,
        }
    }

    /// This transport with the options `get` sets.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when this build cannot use it, when `get` sets an option of
    /// another transport that this one lacks, or an option value this one cannot honour;
    /// [`Error::Bootstrap`] naming a variable whose value is invalid.
    pub(crate) fn choose(&self, get: Lookup<'_>) -> Result<Chosen> {
        let foreign = TRANSPORTS.iter().flat_map(|t| t.vars.iter());
        for var in foreign.filter(|v| !self.vars.contains(v)) {
            if get(var).is_some() {
                let owners: Vec<&str> = TRANSPORTS
                    .iter()
                    .filter(|t| t.vars.contains(var))
                    .map(|t| t.name)
                    .collect();
                return Err(Error::Unsupported(format!(
                    "{var} is an option of {}, and the transport is {}; unset it",
                    owners.join(", "),
                    self.name
                )));
            }
        }
        let parse = match self.parse {
            Some(parse) if self.available => parse,
            _ => return Err(Error::Unsupported(self.about.to_string())),
        };
        parse(get).map_err(|e| match e {
            OptionError::Invalid(e) => Error::Bootstrap(e),
            other => Error::Unsupported(other.to_string()),
        })
    }
}

/// A transport of this build, with the options a job's configuration chose for it.
#[derive(Debug, Clone)]
pub(crate) enum Chosen {
    #[cfg(feature = "tcp")]
    Tcp(byzcoll_transport_tcp::TcpSettings),
    #[cfg(feature = "ucx")]
    Ucx(byzcoll_transport_ucx::UcxOptions),
    #[cfg(feature = "libfabric")]
    Libfabric(byzcoll_transport_libfabric::LibfabricOptions),
    #[cfg(feature = "nccl")]
    Nccl,
}

impl Chosen {
    /// The TCP settings, when TCP is the transport.
    #[cfg(feature = "tcp")]
    pub(crate) fn tcp(&mut self) -> Option<&mut byzcoll_transport_tcp::TcpSettings> {
        match self {
            Chosen::Tcp(s) => Some(s),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// Joins the job `launch` describes with these options: `store` is its rendezvous store,
    /// `None` in a world of one.
    pub(crate) async fn connect(
        &self,
        launch: &LaunchEnv,
        comm: &Config,
        store: Option<&StoreClient>,
    ) -> Result<Box<dyn Transport>> {
        // Unused without any transport feature, where this enum has no variant.
        let _ = (launch, comm, store);
        // By place, so that a build without transports (an empty enum) needs no arm.
        match *self {
            #[cfg(feature = "tcp")]
            Chosen::Tcp(ref s) => tcp::connect(s, launch, comm, store).await,
            #[cfg(feature = "ucx")]
            Chosen::Ucx(ref o) => ucx::connect(o, launch, store).await,
            #[cfg(feature = "libfabric")]
            Chosen::Libfabric(ref o) => libfabric::connect(o, launch, store).await,
            #[cfg(feature = "nccl")]
            Chosen::Nccl => nccl::connect(launch, store).await,
        }
    }
}

/// One line of [`TRANSPORTS`]: the transport `$name` taking the variables `$vars`, built when
/// feature `$feature` is on (then `$available`, `$about` and `$parse`), otherwise listed with
/// `$missing`.
macro_rules! transport {
    ($name:literal, $feature:literal, $vars:expr, $available:expr, $about:expr, $parse:expr, $missing:literal) => {{
        #[cfg(feature = $feature)]
        let info = TransportInfo::built($name, $available, $about, $vars, $parse);
        #[cfg(not(feature = $feature))]
        let info = TransportInfo::missing($name, $missing, $vars);
        info
    }};
}

/// Every transport byzcoll knows of.
pub const TRANSPORTS: &[TransportInfo] = &[
    transport!("tcp", "tcp", &["BYZCOLL_TCP_ADDR", "BYZCOLL_TCP_SPIN_US", "BYZCOLL_FRAME_MAC"], true,
        "tokio TCP, the embedded default; BYZCOLL_TCP_ADDR picks the address to listen on",
        |get| Ok(Chosen::Tcp(byzcoll_transport_tcp::TcpSettings::from_lookup(get)?)),
        "not in this build: rebuild with the `tcp` feature (on by default)"),
    TransportInfo::missing("local",
        "ranks as tasks of one process (byzcoll::transports::local); not for separate processes",
        &[]),
    transport!("ucx", "ucx", &["BYZCOLL_UCX_PEER_FAILURE", "BYZCOLL_FRAME_MAC"],
        byzcoll_transport_ucx::AVAILABLE,
        "UCX over the system libucp; UCX_TLS and UCX_NET_DEVICES choose its transports",
        |get| Ok(Chosen::Ucx(byzcoll_transport_ucx::UcxOptions::from_lookup(get)?)),
        "not in this build: rebuild with `--features ucx` (needs libucx-dev, pkg-config and libclang-dev)"),
    transport!("libfabric", "libfabric", &["BYZCOLL_FRAME_MAC"],
        byzcoll_transport_libfabric::AVAILABLE,
        "libfabric RDM tagged messaging; FI_PROVIDER chooses the provider (tcp;ofi_rxm, shm, verbs, cxi)",
        |get| Ok(Chosen::Libfabric(byzcoll_transport_libfabric::LibfabricOptions::from_lookup(get)?)),
        "not in this build: rebuild with `--features libfabric` (needs libfabric-dev, pkg-config and libclang-dev)"),
    transport!("nccl", "nccl", &[], byzcoll_transport_nccl::AVAILABLE,
        "NCCL grouped send/recv (one rank per GPU; a deadline aborts the communicator)",
        |_| Ok(Chosen::Nccl),
        "not in this build: rebuild with `--features nccl` (NCCL and the CUDA driver are loaded at run time)"),
];

/// The transport called `name`.
pub(crate) fn find(name: &str) -> Option<&'static TransportInfo> {
    TRANSPORTS.iter().find(|t| t.name == name)
}

/// Every name, for messages.
pub(crate) fn names() -> String {
    TRANSPORTS
        .iter()
        .map(|t| t.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// How long joining may take: as long as a step, and at least a minute (ranks start at
/// different times).
pub(crate) fn setup_timeout(comm: &Config) -> Duration {
    comm.step_timeout.max(Duration::from_secs(60))
}

#[cfg(feature = "tcp")]
mod tcp {
    use byzcoll_runtime::bootstrap::{JobAuth, LaunchEnv, Membership, StoreClient};
    use byzcoll_transport_tcp::{TcpSettings, TcpTransport};

    use super::setup_timeout;
    use crate::{Config, Result, Transport, TransportError};

    pub(super) async fn connect(
        settings: &TcpSettings,
        launch: &LaunchEnv,
        comm: &Config,
        store: Option<&StoreClient>,
    ) -> Result<Box<dyn Transport>> {
        let options = settings.options(setup_timeout(comm));
        let ip = settings.listen;
        let Some(store) = store else {
            // A world of one: nothing to rendezvous with, and nobody to authenticate.
            let listener = tokio::net::TcpListener::bind((ip.unwrap_or([127, 0, 0, 1].into()), 0))
                .await
                .map_err(TransportError::from)?;
            let addr = listener.local_addr().map_err(TransportError::from)?;
            let me = Membership::world(&JobAuth::Unauthenticated, &[Vec::new()])?;
            let t = TcpTransport::connect_mesh(0, 1, listener, &[addr], &me[0], options).await?;
            return Ok(Box::new(t));
        };
        let t = TcpTransport::from_store(store, launch.rank, launch.size, ip, options).await?;
        Ok(Box::new(t))
    }
}

#[cfg(feature = "ucx")]
mod ucx {
    use byzcoll_runtime::bootstrap::{LaunchEnv, StoreClient};
    use byzcoll_transport_ucx::{UcxOptions, UcxTransport};

    use crate::{Error, Result, Transport};

    pub(super) async fn connect(
        options: &UcxOptions,
        launch: &LaunchEnv,
        store: Option<&StoreClient>,
    ) -> Result<Box<dyn Transport>> {
        let options = options.clone();
        let Some(store) = store else {
            let t = UcxTransport::local_world(1, options)?
                .pop()
                .ok_or_else(|| Error::Unsupported("empty UCX world".into()))?;
            return Ok(Box::new(t));
        };
        let t = UcxTransport::from_store(store, launch.rank, launch.size, options).await?;
        Ok(Box::new(t))
    }
}

#[cfg(feature = "libfabric")]
mod libfabric {
    use byzcoll_runtime::bootstrap::{LaunchEnv, StoreClient};
    use byzcoll_transport_libfabric::{LibfabricOptions, LibfabricTransport};

    use crate::{Error, Result, Transport};

    pub(super) async fn connect(
        options: &LibfabricOptions,
        launch: &LaunchEnv,
        store: Option<&StoreClient>,
    ) -> Result<Box<dyn Transport>> {
        let options = options.clone();
        let Some(store) = store else {
            let t = LibfabricTransport::local_world(1, options)?
                .pop()
                .ok_or_else(|| Error::Unsupported("empty libfabric world".into()))?;
            return Ok(Box::new(t));
        };
        let t = LibfabricTransport::from_store(store, launch.rank, launch.size, options).await?;
        tracing::info!(provider = t.provider(), "libfabric transport connected");
        Ok(Box::new(t))
    }
}

#[cfg(feature = "nccl")]
mod nccl {
    use byzcoll_runtime::bootstrap::{LaunchEnv, StoreClient};
    use byzcoll_transport_nccl::{NcclOptions, NcclTransport};

    use crate::{Result, Transport};

    /// This rank's NCCL transport: one GPU per rank, picked by the local rank.
    pub(super) async fn connect(
        launch: &LaunchEnv,
        store: Option<&StoreClient>,
    ) -> Result<Box<dyn Transport>> {
        let options = NcclOptions {
            local_rank: launch.local_rank,
            ..NcclOptions::default()
        };
        let Some(store) = store else {
            return Ok(Box::new(NcclTransport::single(options).await?));
        };
        let t = NcclTransport::from_store(store, launch.rank, launch.size, options).await?;
        tracing::info!(device = t.device(), "NCCL transport connected");
        Ok(Box::new(t))
    }
}

#[cfg(test)]
mod tests {
    /// The registry lists, for each transport of this build, exactly the variables its crate
    /// parses (the list is what refuses them for other transports).
    #[test]
    fn each_transport_lists_the_variables_its_crate_reads() {
        let vars = |name| super::find(name).map(|t| t.vars);
        #[cfg(feature = "tcp")]
        assert_eq!(vars("tcp"), Some(byzcoll_transport_tcp::TcpSettings::VARS));
        #[cfg(feature = "ucx")]
        assert_eq!(vars("ucx"), Some(byzcoll_transport_ucx::UcxOptions::VARS));
        #[cfg(feature = "libfabric")]
        assert_eq!(
            vars("libfabric"),
            Some(byzcoll_transport_libfabric::LibfabricOptions::VARS)
        );
        assert_eq!(vars("nccl"), Some(&[][..]));
        assert_eq!(vars("local"), Some(&[][..]));
    }
}
