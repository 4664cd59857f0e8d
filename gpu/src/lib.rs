//! CUDA robust aggregation for byzcoll.
//!
//! [`CudaRule`] runs the coordinate-wise median and trimmed mean and the Krum family (Krum,
//! Multi-Krum, Bulyan) on an NVIDIA GPU, with the same definitions, preconditions and
//! non-finite policy as the CPU rules in `byzcoll-aggregators`, which stay the reference:
//!
//! - **median / trimmed mean**: one thread per coordinate. For `n ≤ 64` the `n` values sit in
//!   registers and a sorting network (the CPU rules' own comparator list, pruned to the ranks
//!   read, compiled into straight-line code) orders them; for larger `n` each thread finds the
//!   order statistics by radix selection over its column in shared memory (8 passes whatever
//!   the values, so no input can provoke a quadratic worst case). Values are ordered by IEEE
//!   `totalOrder`, so up to `f` NaN or infinities per coordinate are discarded; a coordinate
//!   whose result would not be finite makes the call fail with
//!   [`AggError::NonFiniteResult`], never return NaN. Sums are taken in `f64` in ascending order,
//!   so on the network path `f32` results are bitwise those of the CPU rules.
//! - **Krum family**: the `n × n` table of squared distances is computed tiled like a matrix
//!   product (64 × 64 pair tiles, 4 × 4 pairs per thread, each staged input chunk used by all
//!   pairs of the tile) from differences, never `|a|² + |b|² - 2ab`; float per 32-coordinate
//!   chunk, `f64` across chunks, overflowing chunks redone in `f64`, partial tables added in a
//!   fixed order so every run gives the same table. The selection runs on the host with the CPU
//!   rule's code; the finish (copy, mean of the selected, Bulyan's trimmed phase) on the GPU.
//!
//! Inputs may be `f32`, bf16 or f16 on the device ([`CudaRule::aggregate_device`]), arithmetic
//! in `f32`/`f64`. As an [`Aggregator`](byzcoll_aggregators::Aggregator) over host `f32` vectors (what the TCP, UCX and libfabric
//! transports deliver), a `CudaRule` stages the inputs through pinned memory into one device
//! buffer, so it plugs into `Communicator::robust_all_reduce` in gather and sharded modes;
//! [`robust_all_reduce_device`] does the same for a vector that lives on the device. With the
//! feature `nccl`, `robust_all_reduce_nccl` runs gather and sharded rounds on device vectors
//! over NCCL (or any `DeviceExchange`), aggregating where NCCL left them: it drives the
//! protocol core (`byzcoll_proto::round`, the one implementation of the robust round
//! that the host communicator and the simulator run too) on a device plane, so the schedules,
//! erasures, statistic rounds and the cross-check of `Agreement::Detect` are the host's.
//!
//! Kernels are one CUDA source (`kernels/robust.cu`) compiled by NVRTC at run time for the
//! device's architecture, once per variant per process ([`kernels::compiled`]), and loaded
//! once into each [`Gpu`]'s context. The CUDA libraries are loaded at run
//! time: this crate builds on any machine, and without a driver or NVRTC every entry point
//! returns [`GpuError::NoLibrary`] rather than panicking.
//!
//! Rules without a CUDA implementation (geometric median, centered clipping, NNM, mean) are
//! refused by [`CudaRule::new`] with [`AggError::Unsupported`]: there is no silent fallback to
//! the CPU.

mod device;
pub mod kernels;
#[cfg(feature = "nccl")]
mod nccl;
pub mod plan;
#[cfg(feature = "nccl")]
mod plane;
mod rules;

/// The cudarc this crate is built with: device vectors are its `CudaSlice`s.
pub use cudarc;
pub use device::Gpu;
#[cfg(feature = "nccl")]
pub use nccl::robust_all_reduce_nccl;
pub use rules::{
    device_to_device, has_kernels, robust_all_reduce_device, CudaRule, DeviceCollectives,
    GpuElement,
};

use byzcoll_aggregators::AggError;

/// Why a GPU operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// A CUDA library could not be loaded.
    #[error("{library} could not be loaded: {hint}")]
    NoLibrary {
        /// The library.
        library: &'static str,
        /// How to get it.
        hint: &'static str,
    },
    /// The driver is there but reports no device.
    #[error("the CUDA driver reports no device")]
    NoDevice,
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// NVRTC rejected a kernel variant.
    #[error("NVRTC could not compile {variant}:\n{message}")]
    Compile {
        /// The variant.
        variant: String,
        /// NVRTC's log.
        message: String,
    },
    /// A lock was poisoned by a panic in another thread.
    #[error("a GPU cache lock was poisoned by a panic elsewhere")]
    Poisoned,
}

impl GpuError {
    /// As an aggregation error of `rule`.
    pub fn into_agg(self, rule: &str) -> AggError {
        AggError::Backend {
            rule: rule.to_string(),
            backend: "CUDA",
            message: self.to_string(),
        }
    }
}
