//! Raw FFI bindings to libfabric, generated at build time against the installed
//! `<rdma/fabric.h>`, `<rdma/fi_domain.h>`, `<rdma/fi_endpoint.h>`, `<rdma/fi_tagged.h>`,
//! `<rdma/fi_cm.h>` and `<rdma/fi_errno.h>` (Debian 12: libfabric-dev 1.17). Everything here
//! is `unsafe`; use the `byzcoll-transport-libfabric` crate's safe layer instead.
//!
//! The crate is empty unless its `libfabric` feature is on, so a default build of the
//! workspace needs no libfabric.
//!
//! Most of libfabric's API (`fi_fabric`, `fi_endpoint`, `fi_tsend`, `fi_cq_read`, `fi_close`,
//! ...) is `static inline` in the headers: each call dispatches through the provider's ops
//! table. Those are not symbols of `libfabric.so`, so a small C shim (`shim.c`) compiles them
//! into real functions, bound here as `byzcoll_fi_*` with the same arguments. Function-like
//! macros that the transport needs are provided as Rust items below.

#![cfg(feature = "libfabric")]
#![allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    dead_code,
    missing_debug_implementations,
    clippy::all,
    rust_2018_idioms,
    unsafe_op_in_unsafe_fn
)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// `FI_ADDR_UNSPEC`: no particular peer (`(uint64_t) -1`).
pub const FI_ADDR_UNSPEC: fi_addr_t = u64::MAX;

/// `FI_ADDR_NOTAVAIL`: the address vector could not resolve an address (`(uint64_t) -1`).
pub const FI_ADDR_NOTAVAIL: fi_addr_t = u64::MAX;
