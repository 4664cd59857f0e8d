//! byzcoll's protocol core: what a robust collective *is*, with no I/O in it.
//!
//! - [`round`]: the sans-IO robust round ([`round::Round`]): messages and outcomes in; sends,
//!   receives, step timeouts and aggregation requests out. It never reads a clock, never
//!   awaits and never touches a socket, so the tokio driver (`byzcoll-runtime`), the
//!   simulator (virtual time) and the device path (NCCL) execute the same state machine.
//! - [`schedule`]: who sends what to whom, as pure functions of rank and world size.
//! - The round's vocabulary ([`Policy`], [`Replicas`], [`Agreement`], [`RoundReport`]) and the
//!   errors every layer returns ([`Error`], [`TransportError`], [`BootstrapError`]).
//!
//! The crate depends on no async runtime and no crypto stack (keys, MACs, signatures): those
//! are the runtime's. Its only hashes are the protocol's digests (XXH3-128 and BLAKE3).
//!
//! Its tests run every rank's round in one thread under a virtual clock (`tests/harness`:
//! per-link delays, drops and rewrites, staggered starts, bounded stepping), at world sizes
//! 1, 2, 3, 7, 8 and 11; the transport properties are the conformance suite's.

mod attribution;
pub mod audit;
mod error;
mod health;
mod ids;
mod policy;
pub mod round;
pub mod schedule;

pub use attribution::{Attribution, InputEvidence, OUTLYING_SCORE};
pub use error::{
    BootstrapError, Error, ErrorKind, Fault, Faults, PeerFault, Result, TransportError,
};
pub use health::{
    is_probe, Health, PeerHealth, Symptom, LAGGARD_PROBE, LAGGARD_PROBE_MAX, LAGGARD_ROUNDS,
};
pub use ids::{Grace, MsgKey, Quorum, Rank, RecvOp, Tag, STREAM_BITS};
pub use policy::{
    Agreement, AgreementReport, IdentityMode, Policy, Replicas, RoundReport, RoundStats,
    Stragglers, AUTO_GATHER_MAX_BYTES, AUTO_SHARDED_MIN_BYTES, SUB_ROUND_BYTES,
};
