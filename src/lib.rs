//! byzcoll: Byzantine-robust collective communication.
//!
//! Every rank contributes a vector and every honest rank gets back a robust aggregate
//! (coordinate-wise median, trimmed mean, ...) even when some ranks send garbage, lie, crash or
//! stall. This facade re-exports the runtime, the aggregators and the transports, and wires
//! them together from the launcher's environment:
//!
//! ```no_run
//! use byzcoll::aggregators::Median;
//! use byzcoll::Policy;
//!
//! #[tokio::main]
//! async fn main() -> Result<(), byzcoll::Error> {
//!     // Rank, world size and store address come from byzcoll launch, srun, mpirun or torchrun.
//!     let mut comm = byzcoll::init().await?;
//!     let mut grad = vec![comm.rank() as f32; 1 << 20];
//!     let report = comm
//!         .robust_all_reduce(&mut grad, &Median::new(1), Policy::Gather)
//!         .await?;
//!     if !report.faults.is_empty() {
//!         eprintln!("treated as erasures: {:?}", report.faults);
//!     }
//!     Ok(())
//! }
//! ```

pub mod launch;
pub mod npy;
mod oob;

pub use oob::{init_with_allgather, AllGather, MAX_OOB_WORLD};

use std::net::IpAddr;
use std::time::Duration;

pub use byzcoll_aggregators as aggregators;
/// CUDA aggregation rules (feature `cuda`).
#[cfg(feature = "cuda")]
pub use byzcoll_cuda as cuda;
pub use byzcoll_runtime::{
    bootstrap, mailbox, pool, schedule, Agreement, AgreementReport, BootstrapError, Capabilities,
    Communicator, Config, Error, Fault, Payload, PeerFault, Policy, Rank, RecvOp, RecvOutcome,
    ReduceOp, Replicas, Result, RoundReport, SendOp, Step, Transport, TransportError,
};

/// The transports, re-exported.
pub mod transports {
    pub use byzcoll_transport_libfabric as libfabric;
    pub use byzcoll_transport_local as local;
    pub use byzcoll_transport_nccl as nccl;
    pub use byzcoll_transport_tcp as tcp;
    pub use byzcoll_transport_ucx as ucx;
}

use byzcoll_runtime::bootstrap::{JobAuth, LaunchEnv, Membership, StoreClient, StoreServer};
use byzcoll_transport_tcp::{TcpOptions, TcpTransport};

/// A transport byzcoll knows of, and whether this build has it.
#[derive(Debug, Clone, Copy)]
pub struct TransportInfo {
    /// Name accepted by `BYZCOLL_TRANSPORT`.
    pub name: &'static str,
    /// Whether this build can use it across processes.
    pub available: bool,
    /// One line on what it is, or on what is missing.
    pub about: &'static str,
}

/// Every transport byzcoll knows of.
pub const TRANSPORTS: &[TransportInfo] = &[
    TransportInfo {
        name: "tcp",
        available: true,
        about: "tokio TCP, the embedded default; BYZCOLL_TCP_ADDR picks the address to listen on",
    },
    TransportInfo {
        name: "local",
        available: false,
        about:
            "ranks as tasks of one process (byzcoll::transports::local); not for separate processes",
    },
    TransportInfo {
        name: "ucx",
        available: byzcoll_transport_ucx::AVAILABLE,
        about: if byzcoll_transport_ucx::AVAILABLE {
            "UCX over the system libucp; UCX_TLS and UCX_NET_DEVICES choose its transports"
        } else {
            UCX_MISSING
        },
    },
    TransportInfo {
        name: "libfabric",
        available: byzcoll_transport_libfabric::AVAILABLE,
        about: if byzcoll_transport_libfabric::AVAILABLE {
            "libfabric RDM tagged messaging; FI_PROVIDER chooses the provider (tcp;ofi_rxm, shm, verbs, cxi)"
        } else {
            LIBFABRIC_MISSING
        },
    },
    TransportInfo {
        name: "nccl",
        available: byzcoll_transport_nccl::AVAILABLE,
        about: if byzcoll_transport_nccl::AVAILABLE {
            "NCCL grouped send/recv (one rank per GPU; a deadline aborts the communicator)"
        } else {
            NCCL_MISSING
        },
    },
];

/// The transport the environment selects: `BYZCOLL_TRANSPORT`, or `tcp` when it is unset.
pub fn selected_transport() -> String {
    std::env::var("BYZCOLL_TRANSPORT").unwrap_or_else(|_| "tcp".to_string())
}

/// Creates a communicator from the environment: the launcher's rank and world size
/// ([`bootstrap::LaunchEnv`]), [`Config::from_env`], the transport named by
/// `BYZCOLL_TRANSPORT` (default `tcp`), and the rendezvous store at `BYZCOLL_STORE` or
/// `MASTER_ADDR:MASTER_PORT`, which rank 0 hosts unless `BYZCOLL_STORE_HOSTED=1` says the
/// launcher does.
///
/// # Errors
/// [`Error::Bootstrap`] when the environment is incomplete or the store cannot be reached;
/// [`Error::Unsupported`] when the selected transport is not available in this build (there is
/// no fallback to another transport); [`Error::Transport`] when connecting fails.
pub async fn init() -> Result<Communicator> {
    let env = LaunchEnv::from_env()?;
    let config = Config::from_env()?;
    let agreement = env_agreement()?;
    let transport = selected_transport();
    let info = TRANSPORTS
        .iter()
        .find(|t| t.name == transport)
        .ok_or_else(|| {
            Error::Unsupported(format!(
                "BYZCOLL_TRANSPORT={transport:?} is not a transport byzcoll knows; known: {}",
                TRANSPORTS
                    .iter()
                    .map(|t| t.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
    let frame_mac = env_frame_mac()?;
    match (info.name, frame_mac) {
        (_, None) | ("tcp", _) | ("ucx" | "libfabric", Some(true)) => {}
        ("ucx" | "libfabric", Some(false)) => {
            return Err(Error::Unsupported(format!(
                "BYZCOLL_FRAME_MAC=0: frames over {transport} are always sealed (its tag \
                 matching cannot tell senders apart otherwise)"
            )))
        }
        (_, Some(_)) => {
            return Err(Error::Unsupported(format!(
                "BYZCOLL_FRAME_MAC: frame MACs are a TCP option, and {transport} has none; unset it"
            )))
        }
    }
    if !info.available {
        return Err(Error::Unsupported(format!(
            "BYZCOLL_TRANSPORT={transport}: {}",
            info.about
        )));
    }
    let ip = env_tcp_addr()?;
    let tcp_spin = env_tcp_spin()?;
    tracing::info!(
        launcher = %env.launcher,
        rank = env.rank,
        size = env.size,
        transport = %transport,
        "byzcoll: initialising"
    );
    let mut comm = match info.name {
        "ucx" => connect_ucx(&env, config).await,
        "libfabric" => connect_libfabric(&env, config).await,
        "nccl" => connect_nccl(&env, config).await,
        _ => connect_tcp(&env, config, ip, tcp_spin, frame_mac.unwrap_or(false)).await,
    }?;
    comm.set_agreement(agreement);
    Ok(comm)
}

/// `BYZCOLL_AGREEMENT`: how robust rounds cross-check their results ([`Agreement::Detect`] when
/// unset).
///
/// # Errors
/// [`Error::Bootstrap`] naming the variable when its value is not one of the policies.
pub fn env_agreement() -> Result<Agreement> {
    match std::env::var("BYZCOLL_AGREEMENT") {
        Err(_) => Ok(Agreement::default()),
        Ok(v) => Agreement::parse(&v).map_err(|why| {
            Error::Bootstrap(BootstrapError::InvalidVar {
                var: "BYZCOLL_AGREEMENT",
                value: v.clone(),
                why,
            })
        }),
    }
}

/// `BYZCOLL_FRAME_MAC`: `Some(true)` for 1, `Some(false)` for 0, `None` when unset.
fn env_frame_mac() -> Result<Option<bool>> {
    match std::env::var("BYZCOLL_FRAME_MAC") {
        Err(_) => Ok(None),
        Ok(v) => match v.trim() {
            "1" => Ok(Some(true)),
            "0" => Ok(Some(false)),
            _ => Err(Error::Bootstrap(BootstrapError::InvalidVar {
                var: "BYZCOLL_FRAME_MAC",
                value: v.clone(),
                why: "expected 1 (frames carry MACs) or 0".into(),
            })),
        },
    }
}

/// `BYZCOLL_TCP_ADDR`: the IP address the TCP transport listens on.
fn env_tcp_addr() -> Result<Option<IpAddr>> {
    match std::env::var("BYZCOLL_TCP_ADDR") {
        Err(_) => Ok(None),
        Ok(v) => v.parse::<IpAddr>().map(Some).map_err(|_| {
            Error::Bootstrap(BootstrapError::InvalidVar {
                var: "BYZCOLL_TCP_ADDR",
                value: v.clone(),
                why: "expected an IP address".into(),
            })
        }),
    }
}

/// `BYZCOLL_TCP_SPIN_US`: how long a waiting task polls its TCP exchange before sleeping.
fn env_tcp_spin() -> Result<Option<Duration>> {
    match std::env::var("BYZCOLL_TCP_SPIN_US") {
        Err(_) => Ok(None),
        Ok(v) => v
            .parse::<u64>()
            .map(|us| Some(Duration::from_micros(us)))
            .map_err(|_| {
                Error::Bootstrap(BootstrapError::InvalidVar {
                    var: "BYZCOLL_TCP_SPIN_US",
                    value: v.clone(),
                    why: "expected microseconds (a non-negative integer)".into(),
                })
            }),
    }
}

/// The rendezvous store for a world larger than one, authenticated by the job secret
/// ([`JobAuth::from_env`]): hosted here when this is rank 0 and the launcher does not host
/// it, and a client for it.
async fn rendezvous(
    env: &LaunchEnv,
    timeout: Duration,
) -> Result<Option<(StoreClient, Option<StoreServer>)>> {
    let Some(store_addr) = env.store.clone() else {
        return Ok(None);
    };
    let auth = JobAuth::from_env()?;
    if !auth.is_authenticated() {
        tracing::warn!(
            rank = env.rank,
            "byzcoll: running UNAUTHENTICATED (BYZCOLL_ALLOW_UNAUTHENTICATED=1): any process \
             that reaches this job's ports can join it as a rank and set the result"
        );
    }
    let hosted_elsewhere = std::env::var("BYZCOLL_STORE_HOSTED").is_ok_and(|v| v == "1");
    let server = if env.rank == 0 && !hosted_elsewhere {
        Some(
            StoreServer::bind(&store_addr, env.size, auth.clone())
                .await
                .map_err(|e| {
                    BootstrapError::Store(format!(
                        "rank 0 cannot host the store at {store_addr}: {e}"
                    ))
                })?,
        )
    } else {
        None
    };
    Ok(Some((
        StoreClient::new(store_addr, env.rank, env.size, timeout, auth),
        server,
    )))
}

/// A communicator over `transport` that keeps `server` alive and whose reports say whether
/// `store`'s job is authenticated.
fn communicator(
    transport: Box<dyn Transport>,
    config: Config,
    store: &StoreClient,
    server: Option<StoreServer>,
) -> Communicator {
    let mut comm = Communicator::new(transport, config);
    if !store.auth().is_authenticated() {
        comm.mark_unauthenticated();
    }
    if let Some(server) = server {
        comm.keep_alive(server);
    }
    comm
}

/// The TCP transport's options for a communicator with `config`: setup may take as long as a
/// step, and at least a minute (ranks start at different times); `spin` (`BYZCOLL_TCP_SPIN_US`)
/// when given.
fn tcp_options(config: &Config, spin: Option<Duration>, frame_mac: bool) -> TcpOptions {
    let defaults = TcpOptions::default();
    TcpOptions {
        setup_timeout: config.step_timeout.max(Duration::from_secs(60)),
        spin: spin.unwrap_or(defaults.spin),
        frame_mac,
        ..defaults
    }
}

async fn connect_tcp(
    env: &LaunchEnv,
    config: Config,
    ip: Option<IpAddr>,
    spin: Option<Duration>,
    frame_mac: bool,
) -> Result<Communicator> {
    let options = tcp_options(&config, spin, frame_mac);
    let Some((store, server)) = rendezvous(env, options.setup_timeout).await? else {
        // A world of one: nothing to rendezvous with.
        let listener = tokio::net::TcpListener::bind((ip.unwrap_or([127, 0, 0, 1].into()), 0))
            .await
            .map_err(TransportError::from)?;
        let addr = listener.local_addr().map_err(TransportError::from)?;
        // Nobody to authenticate: no connection is ever made.
        let me = Membership::world(&JobAuth::Unauthenticated, &[Vec::new()])?;
        let t = TcpTransport::connect_mesh(0, 1, listener, &[addr], &me[0], options).await?;
        return Ok(Communicator::new(Box::new(t), config));
    };
    let t = TcpTransport::from_store(&store, env.rank, env.size, ip, options).await?;
    Ok(communicator(Box::new(t), config, &store, server))
}

#[cfg(feature = "ucx")]
async fn connect_ucx(env: &LaunchEnv, config: Config) -> Result<Communicator> {
    use byzcoll_transport_ucx::{UcxOptions, UcxTransport};
    let timeout = config.step_timeout.max(Duration::from_secs(60));
    let Some((store, server)) = rendezvous(env, timeout).await? else {
        let mut world = UcxTransport::local_world(1, UcxOptions::default())?;
        let t = world
            .pop()
            .ok_or_else(|| Error::Unsupported("empty UCX world".into()))?;
        return Ok(Communicator::new(Box::new(t), config));
    };
    let t = UcxTransport::from_store(&store, env.rank, env.size, UcxOptions::default()).await?;
    Ok(communicator(Box::new(t), config, &store, server))
}

#[cfg(not(feature = "ucx"))]
async fn connect_ucx(_env: &LaunchEnv, _config: Config) -> Result<Communicator> {
    Err(Error::Unsupported(format!(
        "BYZCOLL_TRANSPORT=ucx: {UCX_MISSING}"
    )))
}

#[cfg(feature = "libfabric")]
async fn connect_libfabric(env: &LaunchEnv, config: Config) -> Result<Communicator> {
    use byzcoll_transport_libfabric::{LibfabricOptions, LibfabricTransport};
    let timeout = config.step_timeout.max(Duration::from_secs(60));
    let Some((store, server)) = rendezvous(env, timeout).await? else {
        let mut world = LibfabricTransport::local_world(1, LibfabricOptions::default())?;
        let t = world
            .pop()
            .ok_or_else(|| Error::Unsupported("empty libfabric world".into()))?;
        return Ok(Communicator::new(Box::new(t), config));
    };
    let t = LibfabricTransport::from_store(&store, env.rank, env.size, LibfabricOptions::default())
        .await?;
    tracing::info!(provider = t.provider(), "libfabric transport connected");
    Ok(communicator(Box::new(t), config, &store, server))
}

#[cfg(not(feature = "libfabric"))]
async fn connect_libfabric(_env: &LaunchEnv, _config: Config) -> Result<Communicator> {
    Err(Error::Unsupported(format!(
        "BYZCOLL_TRANSPORT=libfabric: {LIBFABRIC_MISSING}"
    )))
}

#[cfg(feature = "nccl")]
async fn connect_nccl(env: &LaunchEnv, config: Config) -> Result<Communicator> {
    let world = nccl_world(env).await?;
    let mut comm = Communicator::new(Box::new(world.transport), config);
    if world.unauthenticated {
        comm.mark_unauthenticated();
    }
    if let Some(server) = world.store {
        comm.keep_alive(server);
    }
    Ok(comm)
}

/// An NCCL transport joined from the launcher's environment, for the device-vector robust
/// all-reduce (`byzcoll::cuda::robust_all_reduce_nccl`), which needs the transport itself
/// rather than a [`Communicator`].
#[cfg(feature = "nccl")]
#[derive(Debug)]
pub struct NcclWorld {
    /// This rank's transport (one GPU per rank, picked by the local rank).
    pub transport: byzcoll_transport_nccl::NcclTransport,
    /// Rank 0's rendezvous store, kept while the world lives.
    store: Option<StoreServer>,
    /// The job runs with `BYZCOLL_ALLOW_UNAUTHENTICATED=1`.
    pub unauthenticated: bool,
}

/// Joins the NCCL world the launcher describes (as [`init`] does with `BYZCOLL_TRANSPORT=nccl`,
/// but returning the transport itself): rank, world size and local rank from the environment,
/// the unique id shared through the store at `BYZCOLL_STORE` or `MASTER_ADDR:MASTER_PORT`, one
/// GPU per rank. A world of one needs no store.
///
/// # Errors
/// [`Error::Bootstrap`] for an incomplete environment or an unreachable store;
/// [`Error::Transport`] when NCCL, the driver or a GPU is missing on any rank (every rank fails,
/// naming which), or the communicator is not complete in time.
#[cfg(feature = "nccl")]
pub async fn init_nccl() -> Result<NcclWorld> {
    nccl_world(&LaunchEnv::from_env()?).await
}

#[cfg(feature = "nccl")]
async fn nccl_world(env: &LaunchEnv) -> Result<NcclWorld> {
    use byzcoll_transport_nccl::{NcclOptions, NcclTransport};
    let options = NcclOptions {
        local_rank: env.local_rank,
        ..NcclOptions::default()
    };
    let Some((store, server)) = rendezvous(env, options.init_timeout).await? else {
        let transport = NcclTransport::single(options).await?;
        return Ok(NcclWorld {
            transport,
            store: None,
            unauthenticated: false,
        });
    };
    let transport = NcclTransport::from_store(&store, env.rank, env.size, options).await?;
    tracing::info!(device = transport.device(), "NCCL transport connected");
    Ok(NcclWorld {
        transport,
        store: server,
        unauthenticated: !store.auth().is_authenticated(),
    })
}

#[cfg(not(feature = "nccl"))]
async fn connect_nccl(_env: &LaunchEnv, _config: Config) -> Result<Communicator> {
    Err(Error::Unsupported(format!(
        "BYZCOLL_TRANSPORT=nccl: {NCCL_MISSING}"
    )))
}

const NCCL_MISSING: &str = "not in this build: rebuild with `--features nccl` (NCCL and the CUDA \
                            driver are loaded at run time)";

const LIBFABRIC_MISSING: &str = "not in this build: rebuild with `--features libfabric` (needs \
                                 libfabric-dev, pkg-config and libclang-dev)";

const UCX_MISSING: &str = "not in this build: rebuild with `--features ucx` (needs libucx-dev, \
                           pkg-config and libclang-dev)";

/// The README's code blocks, compiled as doc tests so the embedding example cannot rot.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
