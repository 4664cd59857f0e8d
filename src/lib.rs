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
//! // One collective at a time: a current-thread runtime reads the frames on the thread that
//! // awaits them (the README's "Which runtime").
//! #[tokio::main(flavor = "current_thread")]
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

pub mod blocking;
mod config;
#[cfg(feature = "tcp")]
mod oob;
mod registry;
mod rejoin;

pub use config::{
    Bootstrap, EnvReport, JobConfig, JobConfigBuilder, DEFAULT_TRANSPORT, MAX_STEP_TIMEOUT,
};
#[cfg(feature = "tcp")]
pub use oob::{init_with_allgather, AllGather, MAX_OOB_WORLD};
pub use registry::{TransportInfo, TRANSPORTS};
pub use rejoin::{admit, rejoin, Admission};

pub use byzcoll_aggregators as aggregators;
/// CUDA aggregation rules (feature `cuda`).
#[cfg(feature = "cuda")]
pub use byzcoll_cuda as cuda;
pub use byzcoll_runtime::{
    audit, bootstrap, schedule, step_timeout_ms, Agreement, AgreementReport, Attribution,
    BootstrapError, Capabilities, CommHandle, Communicator, Config, Error, ErrorKind, Fault, Grace,
    IdentityMode, InputEvidence, MemoryKind, Payload, PeerFault, PeerHealth, Pending, Policy,
    Quorum, Rank, RecvOp, RecvOutcome, ReduceOp, Replicas, Result, RoundReport, RoundStats, SendOp,
    Step, Stragglers, Symptom, Transport, TransportError, AUTO_GATHER_MAX_BYTES,
    AUTO_SHARDED_MIN_BYTES, LAGGARD_PROBE, LAGGARD_PROBE_MAX, LAGGARD_ROUNDS, OUTLYING_SCORE,
};

/// The transports of this build, re-exported.
pub mod transports {
    #[cfg(feature = "libfabric")]
    pub use byzcoll_transport_libfabric as libfabric;
    pub use byzcoll_transport_local as local;
    #[cfg(feature = "nccl")]
    pub use byzcoll_transport_nccl as nccl;
    #[cfg(feature = "tcp")]
    pub use byzcoll_transport_tcp as tcp;
    #[cfg(feature = "ucx")]
    pub use byzcoll_transport_ucx as ucx;
}

use byzcoll_runtime::bootstrap::{StoreClient, StoreServer};

/// Creates a communicator from the environment: [`JobConfig::from_env`], then [`init_with`].
///
/// # Errors
/// As [`JobConfig::from_env`] and [`init_with`].
pub async fn init() -> Result<Communicator> {
    init_with(&JobConfig::from_env()?).await
}

/// Creates the communicator `config` describes: joins the rendezvous store (which rank 0
/// hosts unless the launcher does), connects the transport it names, and sets its agreement
/// policy. A configuration that [`rejoins`](JobConfig::rejoins) (a restarted rank) rejoins the
/// members' world instead ([`rejoin`], waiting as long as a setup may take: a step timeout,
/// and at least a minute).
///
/// # Errors
/// [`Error::Bootstrap`] when the store cannot be reached or the membership check fails;
/// [`Error::Transport`] when connecting fails.
pub async fn init_with(config: &JobConfig) -> Result<Communicator> {
    let launch = config.launch();
    let transport = config.transport();
    tracing::info!(
        launcher = %launch.launcher,
        rank = launch.rank,
        size = launch.size,
        transport = transport.name,
        "byzcoll: initialising"
    );
    if config.bootstrap() != Bootstrap::Store {
        return Err(Error::InvalidUsage(
            "init_with takes a configuration made by JobConfig::from_env or the builder; one \
             made by JobConfig::for_allgather joins through init_with_allgather"
                .into(),
        ));
    }
    if config.rejoins() {
        return rejoin(config, registry::setup_timeout(config.comm())).await;
    }
    let rendezvous = rendezvous(config).await?;
    let store = rendezvous.as_ref().map(|(client, _)| client);
    if let Some(store) = store {
        // Before any transport connects: a rank that chose a job-wide parameter differently
        // fails here, naming it, rather than as peers found malformed later.
        let records = store
            .all_gather("byzcoll/job", &config.comm().job_record())
            .await?;
        config.comm().check_job(&records)?;
    }
    let t = config
        .chosen()
        .connect(launch, config.comm(), store)
        .await?;
    let mut comm = Communicator::new(t, config.comm().clone());
    if let Some((store, server)) = rendezvous {
        comm.set_identity(store.auth().mode());
        if let Some(server) = server {
            comm.keep_alive(server);
        }
    }
    Ok(comm)
}

/// The rendezvous store for a world larger than one, authenticated by the job's secret:
/// hosted here when this is rank 0 and the launcher does not host it, and a client for it.
async fn rendezvous(config: &JobConfig) -> Result<Option<(StoreClient, Option<StoreServer>)>> {
    let launch = config.launch();
    let Some(client) = config.store_client() else {
        return Ok(None);
    };
    let (store_addr, auth) = (client.addr(), client.auth());
    if !auth.is_authenticated() {
        tracing::warn!(
            rank = launch.rank,
            "byzcoll: running UNAUTHENTICATED (BYZCOLL_ALLOW_UNAUTHENTICATED=1): any process \
             that reaches this job's ports can join it as a rank and set the result"
        );
    }
    let server = if launch.rank == 0 && !config.store_hosted() {
        Some(
            StoreServer::bind(store_addr, launch.size, auth.clone())
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
    Ok(Some((client, server)))
}

/// The README's code blocks, compiled as doc tests so the embedding example cannot rot.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
