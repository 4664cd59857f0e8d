//! NCCL transport for byzcoll (skeleton: being written).

/// Whether this build has the NCCL transport (cargo feature `nccl`).
pub const AVAILABLE: bool = cfg!(feature = "nccl");
