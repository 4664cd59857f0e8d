//! byzcoll's runtime core.
//!
//! - [`Transport`] is the plug-in boundary: batched sends and receives of owned buffers, one
//!   outcome per receive, declared [`Capabilities`]. Transports live in their own crates.
//! - [`schedule`] says who sends what to whom, as pure functions of rank and world size.
//! - [`Communicator`] executes schedules over a transport: `barrier`, `broadcast_into`,
//!   `all_gather_into`, `all_to_all_into`, the non-robust `all_reduce`, and
//!   `robust_all_reduce` with a caller-chosen [`Aggregator`](byzcoll_aggregators::Aggregator).
//! - [`bootstrap`] reads the launcher's environment and runs the rendezvous store.
//! - [`mailbox`] is the receive-matching logic transports share; [`pool`] the receive buffers
//!   they reuse.

pub mod bootstrap;
mod comm;
mod config;
mod error;
pub mod mailbox;
pub mod pool;
pub mod progress;
mod robust;
pub mod schedule;
mod transport;
mod types;
pub mod wire;

pub use comm::{Communicator, ReduceOp, RoundStats};
pub use config::Config;
pub use error::{BootstrapError, Error, Fault, Faults, PeerFault, Result, TransportError};
#[cfg(feature = "fault-injection")]
pub use robust::OwnerTamper;
pub use robust::{sum_of_shard_medians, Agreement, AgreementReport, Policy, Replicas, RoundReport};
pub use transport::{Capabilities, RecvOp, RecvOutcome, SendOp, Step, Transport};
pub use types::{MemoryKind, MsgKey, Payload, Rank, Tag};
