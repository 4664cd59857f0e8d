//! NCCL transport for byzcoll, through cudarc's `nccl` module (loaded at run time).
//!
//! Build with the `nccl` cargo feature; without it this crate only reports, through
//! [`AVAILABLE`], that NCCL is not built in. With it the crate still builds on a machine
//! without CUDA: the driver and `libnccl.so` are opened when a transport is created, and
//! their absence is a [`TransportError::Setup`](byzcoll_runtime::TransportError::Setup)
//! that says what is missing (`unavailable_reason` tells in advance), never a panic.
//!
//! # Design
//! - **Rendezvous.** Rank 0 creates the 128-byte `ncclUniqueId`; it travels through the
//!   bootstrap store's all-gather, in which every rank also says whether it can run NCCL at
//!   all, so a rank without a GPU makes every rank fail at once, naming it
//!   (`NcclTransport::from_store`). Each rank then joins a **non-blocking** communicator
//!   (`ncclCommInitRankConfig` with `blocking = 0`) on its device, so that joining and every
//!   later step can be timed out: NCCL calls return at once and completion is polled.
//! - **Steps.** The runtime's [`Step`](byzcoll_runtime::Step) becomes one NCCL group: host
//!   payloads are copied into one device buffer, every `ncclSend`/`ncclRecv` (bytes, exact
//!   counts from `RecvOp::len`) is posted between `ncclGroupStart` and `ncclGroupEnd` on the
//!   transport's own CUDA stream, and an event recorded after the group is polled from the
//!   async executor (a few yields, then 1 ms sleeps; the executor never blocks on the GPU).
//!   Received device bytes are copied back into one host buffer and handed out as
//!   `Bytes` slices.
//! - **Matching without tags.** NCCL has no tags: between two ranks, the n-th send matches
//!   the n-th receive. This holds because every rank posts the same sequence of steps (the
//!   runtime's contract), each step completes before the next is posted, and within a step
//!   both sides post one pair's operations sorted by tag.
//!
//! # Honest limits
//! - **No per-peer timeout** (`Capabilities::per_peer_timeout` is `false`). An NCCL
//!   operation cannot be withdrawn: if a step has not completed by its deadline (or NCCL
//!   reports a peer failure first), the communicator is aborted (`ncclCommAbort`), the step
//!   fails with
//!   [`TransportError::Aborted`](byzcoll_runtime::TransportError::Aborted) whose `ranks` are
//!   the ranks with open operations (its cause is an `NcclFailure::StepAborted`) — all of them, because NCCL cannot say which one did not take part —
//!   and every later exchange fails at once with `NcclFailure::Broken`. A robust round
//!   over NCCL therefore does not survive a silent peer the way it does over TCP, UCX or
//!   libfabric: it ends with an error and the caller must build a new transport (and
//!   communicator) without that peer.
//! - **What a Byzantine peer can do.** Lengths are right by construction: NCCL moves
//!   exactly the posted count into a buffer this rank allocated from its own `RecvOp::len`,
//!   so a peer cannot make this rank allocate anything it chose. It can send garbage bytes
//!   of the right length (the robust aggregators deal with values). It can also break the
//!   protocol — send a different count, skip or add a message, never send — which NCCL
//!   does not report as a malformed message: the step hangs or fails and ends in the abort
//!   above. So there is no `Malformed` outcome from this transport, and a protocol-level
//!   Byzantine peer costs the whole communicator, not just its contribution.
//! - **Host payloads only.** The runtime's `Payload` is host memory today, so every step is
//!   copied to the device and back; copies to and from pageable memory are synchronous and
//!   run on the calling executor thread.
//! - **One rank per GPU.** NCCL refuses two ranks on one device. On a one-GPU machine use
//!   `NcclTransport::single` (world size 1); multi-rank tests on one GPU need several
//!   processes over another transport.
//! - **Cancellation.** Dropping an exchange cannot withdraw its operations; its device
//!   buffers are kept until the stream is past them (the next exchange waits for that under
//!   its own deadline, aborting if it does not come). The operations still complete when the
//!   peers post theirs, so the pairwise order stays intact.

/// Whether this build has the NCCL transport (cargo feature `nccl`).
pub const AVAILABLE: bool = cfg!(feature = "nccl");

// Pure logic (no NCCL calls), compiled and unit-tested with and without the feature.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
mod failure;
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
mod plan;
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
mod setup;

#[cfg(feature = "nccl")]
mod ffi;
#[cfg(feature = "nccl")]
mod transport;

#[cfg(feature = "nccl")]
pub use failure::{AbortCause, NcclFailure};
#[cfg(feature = "nccl")]
pub use transport::{
    unavailable_reason, DeviceExchange, DeviceReceived, DeviceSend, NcclOptions, NcclTransport,
    POLL, SPIN,
};
