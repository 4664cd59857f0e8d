//! The UCX transport's options, parsed from a job's configuration here
//! ([`UcxOptions::from_lookup`]: `byzcoll::JobConfig` reads the `BYZCOLL_*` variables and hands
//! them over). UCX's own variables (`UCX_TLS`, `UCX_TCP_*_SEG_SIZE`) come through the same
//! lookup: UCX reads them itself, and the transport only looks at them to choose its defaults.

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
    if options.segments_set || !options.peer_failure_handling() {
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
    /// default) means on unless [`UcxOptions::tls`] names only shared-memory transports. Without it, a
    /// dead peer is noticed at the step deadline.
    pub peer_failure: Option<bool>,
    /// `UCX_TLS` as the job's configuration read it: UCX chooses its transports by it, and
    /// [`UcxOptions::peer_failure`]'s default follows it. `None`: unset.
    pub tls: Option<String>,
    /// Whether `UCX_TCP_TX_SEG_SIZE` or `UCX_TCP_RX_SEG_SIZE` is set: then the segment sizes
    /// are the user's, not the transport's (see the note on `TCP_SEGMENTS`).
    pub segments_set: bool,
}

impl Default for UcxOptions {
    fn default() -> Self {
        UcxOptions {
            max_message_bytes: 1 << 40,
            pool_bytes: 256 << 20,
            peer_failure: None,
            tls: None,
            segments_set: false,
        }
    }
}

impl UcxOptions {
    /// The variables [`UcxOptions::from_lookup`] reads.
    pub const VARS: &'static [&'static str] = &["BYZCOLL_UCX_PEER_FAILURE", "BYZCOLL_FRAME_MAC"];

    /// The default options with what `get` sets: `BYZCOLL_UCX_PEER_FAILURE` (`on` or `off`,
    /// [`UcxOptions::peer_failure`]); `BYZCOLL_FRAME_MAC` may only say `1` (frames over UCX
    /// are always sealed); and what the transport needs to know of UCX's own variables
    /// ([`UcxOptions::tls`], [`UcxOptions::segments_set`]).
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
            tls: get("UCX_TLS"),
            segments_set: ["UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"]
                .iter()
                .any(|v| get(v).is_some()),
            ..UcxOptions::default()
        })
    }

    /// Whether endpoints handle peer failures: [`UcxOptions::peer_failure`], or its default.
    pub(crate) fn peer_failure_handling(&self) -> bool {
        if let Some(on) = self.peer_failure {
            return on;
        }
        let Some(tls) = &self.tls else {
            return true;
        };
        // `^a,b`: every transport but those, network ones among them.
        if tls.trim_start().starts_with('^') {
            return true;
        }
        let shared_memory = ["sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self"];
        !tls.split(',').all(|t| shared_memory.contains(&t.trim()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn options(vars: &[(&str, &str)]) -> UcxOptions {
        UcxOptions::from_lookup(&|k| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        })
        .unwrap()
    }

    #[test]
    fn peer_failure_follows_ucx_tls_unless_chosen() {
        assert!(options(&[]).peer_failure_handling());
        assert!(options(&[("UCX_TLS", "tcp,self")]).peer_failure_handling());
        assert!(!options(&[("UCX_TLS", "sm,self")]).peer_failure_handling());
        assert!(!options(&[("UCX_TLS", "sm, cma")]).peer_failure_handling());
        // Every transport but those named: network ones among them.
        assert!(options(&[("UCX_TLS", "^posix,cma")]).peer_failure_handling());
        let chosen = [("UCX_TLS", "sm,self"), ("BYZCOLL_UCX_PEER_FAILURE", "on")];
        assert!(options(&chosen).peer_failure_handling());
        let off = [("BYZCOLL_UCX_PEER_FAILURE", "off")];
        assert!(!options(&off).peer_failure_handling());
    }

    #[test]
    fn segment_sizes_are_the_user_s_once_either_is_set() {
        assert_eq!(context_settings(&options(&[])), TCP_SEGMENTS);
        for var in ["UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"] {
            let o = options(&[(var, "16k")]);
            assert!(o.segments_set);
            assert!(context_settings(&o).is_empty());
        }
        let off = [("BYZCOLL_UCX_PEER_FAILURE", "off")];
        assert!(context_settings(&options(&off)).is_empty());
    }
}
