//! byzcoll's runtime: the tokio driver of the protocol core, the transport boundary, bootstrap.
//!
//! - The protocol itself (the sans-IO [`round`], the [`schedule`]s, the round's vocabulary and
//!   the errors) is the `byzcoll-proto` crate, re-exported here: this crate executes it.
//! - [`Transport`] is the plug-in boundary: batched sends and receives of owned buffers, one
//!   outcome per receive, declared [`Capabilities`]. Transports live in their own crates.
//! - [`Communicator`] executes schedules over a transport: `barrier`, `broadcast_into`,
//!   `all_gather_into`, `all_to_all_into`, the non-robust `all_reduce`, and
//!   `robust_all_reduce` with a caller-chosen [`Aggregator`](byzcoll_aggregators::Aggregator).
//! - [`bootstrap`] reads the launcher's environment and runs the rendezvous store.
//! - [`pool`] holds the receive buffers transports reuse and the huge-page payloads the
//!   collectives send. What else transports share (receive matching, the progress engine,
//!   sealed frames) is the `byzcoll-transport-kit` crate.

pub mod bootstrap;
pub mod calls;
mod comm;
mod config;
mod handle;
pub mod pool;
mod robust;
pub mod round;
mod transport;
mod types;

pub use byzcoll_proto::{audit, schedule};
pub use byzcoll_proto::{
    Agreement, AgreementReport, Attribution, BootstrapError, Error, ErrorKind, Fault, Faults,
    Grace, IdentityMode, InputEvidence, MsgKey, PeerFault, Policy, Quorum, Rank, RecvOp, Replicas,
    Result, RoundReport, RoundStats, Stragglers, Tag, TransportError, AUTO_GATHER_MAX_BYTES,
    AUTO_SHARDED_MIN_BYTES, OUTLYING_SCORE, STREAM_BITS, SUB_ROUND_BYTES,
};
pub use byzcoll_proto::{PeerHealth, Symptom, LAGGARD_PROBE, LAGGARD_PROBE_MAX, LAGGARD_ROUNDS};
pub use calls::call_fingerprint;
pub use comm::{Communicator, ReduceOp, DOUBLING_MAX_BYTES, RING_PARTS, RING_PART_BYTES};
pub use config::{
    parse_flag, parse_var, step_timeout_ms, Config, Lookup, OptionError, JOB_RECORD_LEN,
    MAX_PART_BYTES, MAX_STEP_TIMEOUT,
};
pub use handle::{CommHandle, Pending, QUEUED};
#[cfg(feature = "fault-injection")]
pub use robust::OwnerTamper;
pub use round::sum_of_shard_medians;
pub use transport::{Capabilities, RecvOutcome, SendOp, Step, Transport, PIPELINED_STEPS};
pub use types::{MemoryKind, Payload};
