//! Raw FFI bindings to UCX's UCP API, generated at build time against the installed
//! `<ucp/api/ucp.h>` (Debian 12: libucx-dev 1.13). Everything here is `unsafe`; use the
//! `byzcoll-transport-ucx` crate's safe layer instead.
//!
//! The crate is empty unless its `ucx` feature is on, so a default build of the workspace needs
//! no UCX. The header's `static inline` functions and pointer-status macros are provided as
//! Rust functions below.

#![cfg(feature = "ucx")]
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

/// `ucp_init` is a `static inline` wrapper in the header: it passes the API version the
/// caller was compiled against.
///
/// # Safety
/// As `ucp_init_version`: `params` must be valid, `config` null or from `ucp_config_read`,
/// `context_p` writable.
pub unsafe fn ucp_init(
    params: *const ucp_params_t,
    config: *const ucp_config_t,
    context_p: *mut ucp_context_h,
) -> ucs_status_t::Type {
    ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, params, config, context_p)
}

/// `UCS_PTR_IS_ERR`: the pointer encodes an error status.
pub fn ucs_ptr_is_err(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize) >= (ucs_status_t::UCS_ERR_LAST as isize as usize)
}

/// `UCS_PTR_IS_PTR`: the pointer is a real request handle.
pub fn ucs_ptr_is_ptr(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize).wrapping_sub(1) < (ucs_status_t::UCS_ERR_LAST as isize as usize).wrapping_sub(1)
}

/// `UCS_PTR_RAW_STATUS`: the status encoded in a non-request pointer (`UCS_OK` for null).
pub fn ucs_ptr_raw_status(ptr: ucs_status_ptr_t) -> ucs_status_t::Type {
    ptr as isize as ucs_status_t::Type
}
