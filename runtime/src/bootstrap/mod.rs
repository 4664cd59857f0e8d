//! Bootstrap: where this process sits in the job, and the rendezvous store through which
//! transports exchange their addresses.

pub mod auth;
mod env;
mod evidence;
pub mod gate;
pub mod keys;
mod store;

pub use auth::{FrameSecret, Identity, JobAuth, JobSecret, Membership, Roster, PROTOCOL_VERSION};
pub use env::{LaunchEnv, Launcher};
pub use keys::{keygen, Credentials, KeyRoster};
pub use store::{
    connect_with_retry, StoreClient, StoreServer, MAX_KEY, MAX_OPEN_ROUNDS, MAX_POSTS, MAX_VALUE,
    MAX_WORLD,
};

/// The device (GPU) a launched rank uses by default among `count > 0` visible ones: its local
/// rank (its rank, when the launcher gives none) modulo `count`, so the ranks of a node spread
/// over its devices and share them when there are more ranks than devices. The NCCL transport
/// and the CUDA rules both pick this way.
pub fn local_device(local_rank: Option<usize>, rank: crate::Rank, count: usize) -> usize {
    local_rank.unwrap_or(rank) % count.max(1)
}
