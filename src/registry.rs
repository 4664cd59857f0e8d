//! The transports byzcoll knows, by name, built from the enabled cargo features.
//!
//! Adding a transport takes its crate (an implementation of [`crate::Transport`]), an optional
//! dependency and feature in `Cargo.toml`, a `connect` function below and one line in
//! [`TRANSPORTS`]. A transport whose feature is off stays listed, with what enables it, so
//! asking for it is an error that says how to get it, never a switch to another one.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use byzcoll_runtime::bootstrap::StoreClient;

use crate::config::JobConfig;
use crate::{Result, Transport};

/// Joins the job `config` describes: `store` is its rendezvous store, `None` in a world of
/// one.
pub(crate) type Connect = for<'a> fn(&'a JobConfig, Option<&'a StoreClient>) -> Connecting<'a>;

/// A transport being connected.
pub(crate) type Connecting<'a> =
    Pin<Box<dyn Future<Output = Result<Box<dyn Transport>>> + Send + 'a>>;

/// A transport byzcoll knows of, and whether this build has it.
#[derive(Debug, Clone, Copy)]
pub struct TransportInfo {
    /// Name accepted by `BYZCOLL_TRANSPORT` and [`crate::JobConfigBuilder::transport`].
    pub name: &'static str,
    /// Whether this build can use it across processes.
    pub available: bool,
    /// One line on what it is, or on what is missing.
    pub about: &'static str,
    /// How it joins a job; `None` when this build cannot.
    pub(crate) connect: Option<Connect>,
}

impl TransportInfo {
    /// A transport of this build: `available` says whether its system library is there too.
    #[cfg_attr(not(feature = "tcp"), allow(dead_code))]
    const fn built(
        name: &'static str,
        available: bool,
        about: &'static str,
        connect: Connect,
    ) -> Self {
        TransportInfo {
            name,
            available,
            about,
            connect: Some(connect),
        }
    }

    /// A transport this build leaves out: `about` says how to get it.
    const fn missing(name: &'static str, about: &'static str) -> Self {
        TransportInfo {
            name,
            available: false,
            about,
            connect: None,
        }
    }
}

/// One line of [`TRANSPORTS`]: the transport `$name`, built when feature `$feature` is on
/// (then `$available`, `$about` and `$connect`), otherwise listed with `$missing`.
macro_rules! transport {
    ($name:literal, $feature:literal, $available:expr, $about:expr, $connect:path, $missing:literal) => {{
        #[cfg(feature = $feature)]
        let info = TransportInfo::built($name, $available, $about, $connect);
        #[cfg(not(feature = $feature))]
        let info = TransportInfo::missing($name, $missing);
        info
    }};
}

/// Every transport byzcoll knows of.
pub const TRANSPORTS: &[TransportInfo] = &[
    transport!("tcp", "tcp", true,
        "tokio TCP, the embedded default; BYZCOLL_TCP_ADDR picks the address to listen on",
        tcp::connect,
        "not in this build: rebuild with the `tcp` feature (on by default)"),
    TransportInfo::missing("local",
        "ranks as tasks of one process (byzcoll::transports::local); not for separate processes"),
    transport!("ucx", "ucx", byzcoll_transport_ucx::AVAILABLE,
        "UCX over the system libucp; UCX_TLS and UCX_NET_DEVICES choose its transports",
        ucx::connect,
        "not in this build: rebuild with `--features ucx` (needs libucx-dev, pkg-config and libclang-dev)"),
    transport!("libfabric", "libfabric", byzcoll_transport_libfabric::AVAILABLE,
        "libfabric RDM tagged messaging; FI_PROVIDER chooses the provider (tcp;ofi_rxm, shm, verbs, cxi)",
        libfabric::connect,
        "not in this build: rebuild with `--features libfabric` (needs libfabric-dev, pkg-config and libclang-dev)"),
    transport!("nccl", "nccl", byzcoll_transport_nccl::AVAILABLE,
        "NCCL grouped send/recv (one rank per GPU; a deadline aborts the communicator)",
        nccl::connect,
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
pub(crate) fn setup_timeout(comm: &crate::Config) -> Duration {
    comm.step_timeout.max(Duration::from_secs(60))
}

#[cfg(feature = "tcp")]
pub(crate) mod tcp {
    use byzcoll_runtime::bootstrap::{JobAuth, Membership, StoreClient};
    use byzcoll_transport_tcp::{TcpOptions, TcpTransport};

    use super::{setup_timeout, Connecting};
    use crate::config::{JobConfig, Settings};
    use crate::{Transport, TransportError};

    /// The TCP transport's options for `settings`, with `setup` to join.
    pub(crate) fn options(settings: &Settings, setup: std::time::Duration) -> TcpOptions {
        let defaults = TcpOptions::default();
        TcpOptions {
            setup_timeout: setup,
            spin: settings.tcp_spin.unwrap_or(defaults.spin),
            frame_mac: settings.frame_mac.unwrap_or(false),
            ..defaults
        }
    }

    pub(crate) fn connect<'a>(
        config: &'a JobConfig,
        store: Option<&'a StoreClient>,
    ) -> Connecting<'a> {
        Box::pin(async move {
            let settings = config.settings();
            let options = options(settings, setup_timeout(config.comm()));
            let ip = settings.tcp_listen;
            let Some(store) = store else {
                // A world of one: nothing to rendezvous with, and nobody to authenticate.
                let listener =
                    tokio::net::TcpListener::bind((ip.unwrap_or([127, 0, 0, 1].into()), 0))
                        .await
                        .map_err(TransportError::from)?;
                let addr = listener.local_addr().map_err(TransportError::from)?;
                let me = Membership::world(&JobAuth::Unauthenticated, &[Vec::new()])?;
                let t =
                    TcpTransport::connect_mesh(0, 1, listener, &[addr], &me[0], options).await?;
                return Ok(Box::new(t) as Box<dyn Transport>);
            };
            let launch = config.launch();
            let t = TcpTransport::from_store(store, launch.rank, launch.size, ip, options).await?;
            Ok(Box::new(t) as Box<dyn Transport>)
        })
    }
}

#[cfg(feature = "ucx")]
mod ucx {
    use byzcoll_runtime::bootstrap::StoreClient;
    use byzcoll_transport_ucx::{UcxOptions, UcxTransport};

    use super::Connecting;
    use crate::config::JobConfig;
    use crate::{Error, Transport};

    pub(super) fn connect<'a>(
        config: &'a JobConfig,
        store: Option<&'a StoreClient>,
    ) -> Connecting<'a> {
        Box::pin(async move {
            let options = UcxOptions {
                peer_failure: config.settings().ucx_peer_failure,
                ..UcxOptions::default()
            };
            let Some(store) = store else {
                let t = UcxTransport::local_world(1, options)?
                    .pop()
                    .ok_or_else(|| Error::Unsupported("empty UCX world".into()))?;
                return Ok(Box::new(t) as Box<dyn Transport>);
            };
            let launch = config.launch();
            let t = UcxTransport::from_store(store, launch.rank, launch.size, options).await?;
            Ok(Box::new(t) as Box<dyn Transport>)
        })
    }
}

#[cfg(feature = "libfabric")]
mod libfabric {
    use byzcoll_runtime::bootstrap::StoreClient;
    use byzcoll_transport_libfabric::{LibfabricOptions, LibfabricTransport};

    use super::Connecting;
    use crate::config::JobConfig;
    use crate::{Error, Transport};

    pub(super) fn connect<'a>(
        config: &'a JobConfig,
        store: Option<&'a StoreClient>,
    ) -> Connecting<'a> {
        Box::pin(async move {
            let Some(store) = store else {
                let t = LibfabricTransport::local_world(1, LibfabricOptions::default())?
                    .pop()
                    .ok_or_else(|| Error::Unsupported("empty libfabric world".into()))?;
                return Ok(Box::new(t) as Box<dyn Transport>);
            };
            let launch = config.launch();
            let t = LibfabricTransport::from_store(
                store,
                launch.rank,
                launch.size,
                LibfabricOptions::default(),
            )
            .await?;
            tracing::info!(provider = t.provider(), "libfabric transport connected");
            Ok(Box::new(t) as Box<dyn Transport>)
        })
    }
}

#[cfg(feature = "nccl")]
mod nccl {
    use byzcoll_runtime::bootstrap::StoreClient;
    use byzcoll_transport_nccl::{NcclOptions, NcclTransport};

    use super::Connecting;
    use crate::config::JobConfig;
    use crate::{Result, Transport};

    /// This rank's NCCL transport: one GPU per rank, picked by the local rank.
    async fn transport(config: &JobConfig, store: Option<&StoreClient>) -> Result<NcclTransport> {
        let launch = config.launch();
        let options = NcclOptions {
            local_rank: launch.local_rank,
            ..NcclOptions::default()
        };
        let Some(store) = store else {
            return Ok(NcclTransport::single(options).await?);
        };
        let t = NcclTransport::from_store(store, launch.rank, launch.size, options).await?;
        tracing::info!(device = t.device(), "NCCL transport connected");
        Ok(t)
    }

    pub(super) fn connect<'a>(
        config: &'a JobConfig,
        store: Option<&'a StoreClient>,
    ) -> Connecting<'a> {
        Box::pin(async move { Ok(Box::new(transport(config, store).await?) as Box<dyn Transport>) })
    }
}
