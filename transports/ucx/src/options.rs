//! The UCX transport's options, parsed from a job's configuration here
//! ([`UcxOptions::from_lookup`]: `byzcoll::JobConfig` reads the `BYZCOLL_*` variables and hands
//! them over), and the one place it reads UCX's own variables (`UCX_TLS`,
//! `UCX_TCP_*_SEG_SIZE`) to choose their defaults.

use byzcoll_runtime::{parse_var, Lookup, OptionError};

/// TCP segment sizes byzcoll sets on its own context (`UCX_TCP_TX_SEG_SIZE` and
/// `UCX_TCP_RX_SEG_SIZE`, 8 and 64 KiB by default) unless the environment sets either.
///
/// With peer failure handling (on by default over TCP, see [`UcxOptions::peer_failure`]) UCX
/// gives up TCP's zero-copy put for rendezvous (`ucx_info -e -u twe` shows no `rma_bw` lane)
/// and moves large messages as active-message fragments of one send segment each: with 8 KiB
/// segments that is a round of UCX work per 8 KiB. Measured with the p2p bench over loopback
/// (interleaved runs): 4 and 16 MiB messages went from 1.5-2.4 GB/s to 3.3-4.8 GB/s, about
/// what `ucx_perftest` (no failure handling, zero-copy put) moves; 64 KiB-1 MiB got faster
/// too. Larger segments (256 KiB / 1 MiB) were no faster for large messages and halved
/// 64 KiB messages, which then go eagerly and arrive before their receive is posted.
const TCP_SEGMENTS: &[(&str, &str)] = &[("TX_SEG_SIZE", "64k"), ("RX_SEG_SIZE", "256k")];

/// The settings for [`Context::with_settings`]: [`TCP_SEGMENTS`] when endpoints handle peer
/// failures and the user chose neither segment size. (Only UCX's TCP transport has settings
/// of these names, checked with `ucx_info -c -a` on UCX 1.13 with InfiniBand built in.)
/// Without failure handling TCP rendezvous uses the zero-copy put, large messages gain
/// nothing from larger segments, and 16 KiB messages measured slower.
pub(crate) fn context_settings(options: &UcxOptions) -> &'static [(&'static str, &'static str)] {
    let user_set = ["UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
    if user_set || !options.peer_failure_handling() {
        &[]
    } else {
        TCP_SEGMENTS
    }
}

/// Settings of the UCX transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxOptions {
    /// Largest message accepted or sent.
    pub max_message_bytes: u64,
    /// Most bytes of idle receive buffers kept for reuse (see [`BufferPool`](byzcoll_transport_kit::pool::BufferPool)).
    pub pool_bytes: usize,
    /// Whether endpoints ask UCX to report peer failures (`BYZCOLL_UCX_PEER_FAILURE`, read by
    /// `byzcoll::JobConfig`). UCX can only do so over transports that support it (TCP,
    /// InfiniBand), not over shared memory, and refuses the endpoint otherwise; so `None` (the
    /// default) means on unless `UCX_TLS` names only shared-memory transports. Without it, a
    /// dead peer is noticed at the step deadline.
    pub peer_failure: Option<bool>,
}

impl Default for UcxOptions {
    fn default() -> Self {
        UcxOptions {
            max_message_bytes: 1 << 40,
            pool_bytes: 256 << 20,
            peer_failure: None,
        }
    }
}

impl UcxOptions {
    /// The variables [`UcxOptions::from_lookup`] reads.
    pub const VARS: &'static [&'static str] = &["BYZCOLL_UCX_PEER_FAILURE", "BYZCOLL_FRAME_MAC"];

    /// The default options with what `get` sets: `BYZCOLL_UCX_PEER_FAILURE` (`on` or `off`,
    /// [`UcxOptions::peer_failure`]); `BYZCOLL_FRAME_MAC` may only say `1` (frames over UCX
    /// are always sealed).
    ///
    /// # Errors
    /// [`OptionError::Invalid`] naming a variable whose value is not one of those;
    /// [`OptionError::Unsupported`] for `BYZCOLL_FRAME_MAC=0`.
    pub fn from_lookup(get: Lookup<'_>) -> Result<Self, OptionError> {
        byzcoll_transport_kit::wire::always_sealed(get, "ucx")?;
        let peer_failure = parse_var(
            get,
            "BYZCOLL_UCX_PEER_FAILURE",
            "expected on or off (or unset: on unless UCX_TLS names only shared-memory transports)",
            |v| match v {
                "on" => Some(true),
                "off" => Some(false),
                _ => None,
            },
        )?;
        Ok(UcxOptions {
            peer_failure,
            ..UcxOptions::default()
        })
    }

    /// Whether endpoints handle peer failures: [`UcxOptions::peer_failure`], or its default.
    pub(crate) fn peer_failure_handling(&self) -> bool {
        if let Some(on) = self.peer_failure {
            return on;
        }
        let Ok(tls) = std::env::var("UCX_TLS") else {
            return true;
        };
        let shared_memory = ["sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self"];
        !tls.trim_start_matches('^')
            .split(',')
            .all(|t| shared_memory.contains(&t.trim()))
    }
}
