//! UCX transport for byzcoll over the system libucp (Debian: `libucx-dev`).
//!
//! Build with the `ucx` cargo feature; without it this crate only reports, through
//! [`AVAILABLE`], that UCX is not built in. UCX's own variables choose its transports
//! (`UCX_TLS=tcp`, `UCX_TLS=sm`, `UCX_TLS=rc,sm,self` on InfiniBand) and devices
//! (`UCX_NET_DEVICES=lo` keeps TCP traffic on loopback).
//!
//! Layers, in the cudarc style: `byzcoll-ucx-sys` (bindgen), [`safe`] (results and RAII
//! handles), and the [`UcxTransport`] (see its module docs for the message format and the
//! progress).

/// Whether this build includes the UCX transport (the `ucx` cargo feature).
pub const AVAILABLE: bool = cfg!(feature = "ucx");

#[cfg(feature = "ucx")]
mod engine;
#[cfg(feature = "ucx")]
pub mod safe;

#[cfg(feature = "ucx")]
pub use engine::{UcxOptions, UcxTransport, HEADER_WINDOW, MAX_RANKS, SEND_CREDIT, SPIN};

#[cfg(all(test, feature = "ucx"))]
mod tests {
    use super::*;
    use byzcoll_runtime::Transport;

    async fn world(n: usize) -> Vec<Box<dyn Transport>> {
        UcxTransport::local_world(n, UcxOptions::default())
            .expect("UCX world")
            .into_iter()
            .map(|t| Box::new(t) as Box<dyn Transport>)
            .collect()
    }

    byzcoll_conformance::conformance_suite!(world);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sends_are_done_within_the_credit_and_wait_beyond_it() {
        byzcoll_conformance::sends_are_done_within_the_credit(world, SEND_CREDIT).await;
    }
}
