//! byzcoll's runtime core.
//!
//! - [`Transport`] is the plug-in boundary: batched sends and receives of owned buffers, one
//!   outcome per receive, declared [`Capabilities`]. Transports live in their own crates.
//! - [`schedule`] says who sends what to whom, as pure functions of rank and world size.
//! - [`Communicator`] executes schedules over a transport: `barrier`, `broadcast_into`,
//!   `all_gather_into`, `all_to_all_into`, the non-robust `all_reduce`, and
//!   `robust_all_reduce` with a caller-chosen [`Aggregator`](byzcoll_aggregators::Aggregator).
//! - [`bootstrap`] reads the launcher's environment and runs the rendezvous store.
//! - [`pool`] holds the receive buffers transports reuse and the huge-page payloads the
//!   collectives send. What else transports share (receive matching, the progress engine,
//!   sealed frames) is the `byzcoll-transport-kit` crate.

pub mod bootstrap;
mod comm;
mod config;
mod error;
mod handle;
pub mod pool;
mod robust;
pub mod round;
pub mod schedule;
mod transport;
mod types;

pub use comm::{Communicator, ReduceOp, RoundStats, RING_PARTS, RING_PART_BYTES};
pub use config::Config;
pub use error::{BootstrapError, Error, Fault, Faults, PeerFault, Result, TransportError};
pub use handle::{CommHandle, Pending, QUEUED};
#[cfg(feature = "fault-injection")]
pub use robust::OwnerTamper;
pub use robust::{Agreement, AgreementReport, Policy, Replicas, RoundReport, SUB_ROUND_BYTES};
pub use round::sum_of_shard_medians;
pub use transport::{Capabilities, RecvOp, RecvOutcome, SendOp, Step, Transport, PIPELINED_STEPS};
pub use types::{MemoryKind, MsgKey, Payload, Rank, Tag, STREAM_BITS};
