//! What the `byzcoll` command is built on, apart from the library itself: the local launcher
//! ([`launch`], behind `byzcoll launch`) and the `.npy` reader and writer ([`npy`], behind
//! `byzcoll aggregate`).
//!
//! Embedders depend on the `byzcoll` crate, which compiles none of this; the benches and the
//! multi-process tests use the launcher to start their ranks.

pub mod launch;
pub mod npy;
