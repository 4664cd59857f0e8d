//! What the handshake targets share: one current-thread runtime, one job secret, two
//! identities and their roster (made once), and a duplex whose far side holds the fuzz input.

use std::sync::OnceLock;
use std::time::Duration;

use byzcoll_runtime::bootstrap::auth::{Endpoint, HandshakeError, Purpose, Session, STORE};
use byzcoll_runtime::bootstrap::{Identity, JobAuth, JobSecret, Roster};
use tokio::io::{AsyncWriteExt, DuplexStream};
use tokio::runtime::Runtime;

/// The world size of both endpoints.
pub const WORLD: u32 = 2;

pub struct Job {
    pub auth: JobAuth,
    pub ids: Vec<Identity>,
    pub roster: Roster,
    rt: Runtime,
}

pub fn job() -> &'static Job {
    static JOB: OnceLock<Job> = OnceLock::new();
    JOB.get_or_init(|| {
        let auth = JobAuth::Secret(JobSecret::from_hex(&"5a".repeat(32)).expect("64 hex digits"));
        let ids: Vec<Identity> = (0..WORLD)
            .map(|_| Identity::generate().expect("OS randomness"))
            .collect();
        let entries: Vec<([u8; 32], &[u8])> =
            ids.iter().map(|i| (i.public(), &b"addr"[..])).collect();
        let roster = Roster::new(&entries).expect("valid keys");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a tokio runtime");
        Job {
            auth,
            ids,
            roster,
            rt,
        }
    })
}

impl Job {
    /// Rank `rank`'s endpoint for `purpose`: the store's has no identity (and `rank` is
    /// ignored: it is [`STORE`] when `store_side`), a TCP one has its identity and the roster.
    pub fn endpoint(&self, purpose: Purpose, rank: u32, store_side: bool) -> Endpoint<'_> {
        Endpoint {
            auth: &self.auth,
            purpose,
            world: WORLD,
            rank: if store_side { STORE } else { rank },
            identity: match purpose {
                Purpose::Store => None,
                Purpose::Tcp => Some((&self.ids[rank as usize], &self.roster)),
            },
            frame_macs: false,
        }
    }

    /// Runs `side` on one end of a duplex whose other end holds `input` and is shut down, so
    /// every read ends at the input's end. A handshake must neither hang nor succeed: nobody
    /// forges an HMAC tag under the job secret.
    pub fn run<F>(&self, input: &[u8], side: impl FnOnce(DuplexStream) -> F)
    where
        F: std::future::Future<Output = Result<Session, HandshakeError>>,
    {
        self.rt.block_on(async {
            let (mut peer, ours) = tokio::io::duplex(input.len() + 8192);
            peer.write_all(input).await.expect("the duplex has room");
            peer.shutdown().await.expect("shutdown");
            let r = tokio::time::timeout(Duration::from_secs(1), side(ours))
                .await
                .expect("the handshake hung on a closed stream");
            assert!(r.is_err(), "a handshake with fuzzed bytes succeeded");
            drop(peer);
        });
    }
}
