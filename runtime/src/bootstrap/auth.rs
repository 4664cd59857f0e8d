//! Membership authentication: the job secret, the identity keys, and the challenge–response
//! handshake every store request and every TCP connection starts with. The wire format and the
//! order of the checks are in `PROTOCOL.md` at the repository root.
//!
//! - [`JobAuth`] is the job's shared secret ([`JobSecret`], 32 bytes from the OS CSPRNG), or
//!   the explicit, logged opt-out [`JobAuth::Unauthenticated`]. A process without either does
//!   not join a multi-rank job ([`BootstrapError::NoSecret`]).
//! - [`Identity`] is a rank's Ed25519 key, made at start and registered once through the
//!   store; [`Roster`] is the table of every rank's key, whose digest each pair of ranks
//!   compares, so a store that hands out different tables is caught.
//! - [`initiate`] and [`respond`] run the handshake (HMAC-SHA256, tags compared in constant
//!   time). The responder computes no keyed value before the initiator has proven the secret.

use std::fmt;
use std::io;
use std::sync::Arc;

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::keys::{hex, parse_hex32, read_private_hex, Credentials, KeyRoster};
use crate::{BootstrapError, Rank};

/// The version of byzcoll's wire protocol (store, handshake, frames).
pub const PROTOCOL_VERSION: u16 = 2;
/// Magic of a handshake's first message.
pub const HELLO_MAGIC: [u8; 4] = *b"BZHS";
/// Magics of protocol version 1's store request and TCP hello, recognised only to name the
/// version in the refusal.
pub const V1_MAGICS: [[u8; 4]; 2] = [*b"BZS1", *b"BZH1"];
/// Length of the first message.
pub const HELLO_LEN: usize = 4 + 2 + 1 + 1 + 4 + 4 + 4 + 32 + 32;
/// `to` in a hello addressed to the store rather than to a rank.
pub const STORE: u32 = u32::MAX;

const NONCE_LEN: usize = 32;
const TAG_LEN: usize = 32;
const SIG_LEN: usize = 64;
const FLAG_UNAUTHENTICATED: u8 = 1;
const FLAG_FRAME_MACS: u8 = 2;
const FLAG_PER_RANK: u8 = 4;

type HmacSha256 = Hmac<Sha256>;

/// A job's shared secret. Its `Debug` output does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct JobSecret([u8; 32]);

impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobSecret(..)")
    }
}

impl JobSecret {
    /// 32 fresh bytes from the operating system's CSPRNG.
    ///
    /// # Errors
    /// When the OS has no randomness to give (never on Linux after boot).
    pub fn generate() -> Result<Self, BootstrapError> {
        let mut b = [0u8; 32];
        getrandom::getrandom(&mut b)
            .map_err(|e| BootstrapError::Auth(format!("no randomness from the OS: {e}")))?;
        Ok(JobSecret(b))
    }

    /// A secret from 32 bytes the caller drew from a CSPRNG (or received from a rank that did,
    /// over a channel it trusts).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        JobSecret(bytes)
    }

    /// The secret's 32 bytes, to hand to the job's other ranks over a trusted channel.
    pub fn to_bytes(&self) -> [u8; 32] {
        self.0
    }

    /// The secret as 64 lowercase hex digits, the form `BYZCOLL_SECRET` takes.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses 64 hex digits (surrounding whitespace ignored).
    ///
    /// # Errors
    /// A description of what is wrong, without echoing the value.
    pub fn from_hex(s: &str) -> Result<Self, String> {
        parse_hex32(s).map(JobSecret)
    }
}

/// How this process proves it belongs to the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobAuth {
    /// Every store request and connection is authenticated with the job's secret. An
    /// insider (a process holding it) can register as another rank: a job that must hold
    /// against insiders uses [`JobAuth::PerRank`].
    Secret(JobSecret),
    /// The job's secret, and per-rank keys bound to ranks by a public roster
    /// ([`Credentials`]): every store request and connection also proves the key of the rank
    /// it claims, so a process can act only as the rank whose key it holds.
    PerRank(Credentials),
    /// No authentication: any process that reaches a port can join. Chosen only with
    /// `BYZCOLL_ALLOW_UNAUTHENTICATED=1`; logged as a warning and shown in every round report.
    Unauthenticated,
}

impl JobAuth {
    /// Reads `BYZCOLL_SECRET` (64 hex digits), `BYZCOLL_SECRET_FILE` (a file holding them, a
    /// regular file owned by this user with no group or other permissions) or
    /// `BYZCOLL_ALLOW_UNAUTHENTICATED=1` through `get` (the process environment is read by
    /// `byzcoll::JobConfig` alone, which calls this).
    ///
    /// # Errors
    /// [`BootstrapError::NoSecret`] when none of the variables is set;
    /// [`BootstrapError::InvalidVar`] for a malformed secret, an unreadable or too open secret
    /// file, both `BYZCOLL_SECRET` and `BYZCOLL_SECRET_FILE`, a secret together with the
    /// opt-out, or an opt-out other than `1`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, BootstrapError> {
        let secret = get("BYZCOLL_SECRET");
        let file = get("BYZCOLL_SECRET_FILE");
        let opt_out = get("BYZCOLL_ALLOW_UNAUTHENTICATED");
        if let Some(v) = &opt_out {
            if v.trim() != "1" {
                return Err(BootstrapError::InvalidVar {
                    var: "BYZCOLL_ALLOW_UNAUTHENTICATED",
                    value: v.clone(),
                    why: "the only accepted value is 1".into(),
                });
            }
        }
        let auth = match (secret, file) {
            (Some(_), Some(_)) => {
                return Err(BootstrapError::InvalidVar {
                    var: "BYZCOLL_SECRET_FILE",
                    value: "(set)".into(),
                    why: "BYZCOLL_SECRET is set too: set only one".into(),
                })
            }
            (Some(hex), None) => JobAuth::Secret(JobSecret::from_hex(&hex).map_err(|why| {
                BootstrapError::InvalidVar {
                    var: "BYZCOLL_SECRET",
                    value: "(hidden)".into(),
                    why,
                }
            })?),
            (None, Some(path)) => JobAuth::Secret(read_secret_file(&path)?),
            (None, None) if opt_out.is_some() => return Ok(JobAuth::Unauthenticated),
            (None, None) => return Err(BootstrapError::NoSecret),
        };
        if opt_out.is_some() {
            return Err(BootstrapError::InvalidVar {
                var: "BYZCOLL_ALLOW_UNAUTHENTICATED",
                value: "1".into(),
                why: "a job secret is set too: unset one of them".into(),
            });
        }
        Ok(auth)
    }

    /// This authentication with the per-rank keys that `get` names for rank `rank`
    /// ([`Credentials::from_lookup`]: `BYZCOLL_ROSTER_FILE` with `BYZCOLL_KEY_FILE` or
    /// `BYZCOLL_KEY`); itself when none is set.
    ///
    /// # Errors
    /// As [`Credentials::from_lookup`]; [`BootstrapError::InvalidVar`] when keys are set in an
    /// unauthenticated job (they need the job secret too).
    pub fn with_rank_keys(
        self,
        get: impl Fn(&str) -> Option<String>,
        rank: crate::Rank,
    ) -> Result<Self, BootstrapError> {
        match self {
            JobAuth::Secret(secret) => Ok(match Credentials::from_lookup(get, &secret, rank)? {
                Some(c) => JobAuth::PerRank(c),
                None => JobAuth::Secret(secret),
            }),
            JobAuth::Unauthenticated
                if ["BYZCOLL_ROSTER_FILE", "BYZCOLL_KEY_FILE", "BYZCOLL_KEY"]
                    .iter()
                    .any(|v| get(v).is_some()) =>
            {
                Err(BootstrapError::InvalidVar {
                    var: "BYZCOLL_ROSTER_FILE",
                    value: "(set)".into(),
                    why: "per-rank keys need a job secret too (BYZCOLL_SECRET or \
                          BYZCOLL_SECRET_FILE), not BYZCOLL_ALLOW_UNAUTHENTICATED"
                        .into(),
                })
            }
            other => Ok(other),
        }
    }

    /// Whether connections are authenticated.
    pub fn is_authenticated(&self) -> bool {
        !matches!(self, JobAuth::Unauthenticated)
    }

    /// How ranks prove who they are under this authentication.
    pub fn mode(&self) -> crate::IdentityMode {
        match self {
            JobAuth::Secret(_) => crate::IdentityMode::SharedSecret,
            JobAuth::PerRank(_) => crate::IdentityMode::PerRank,
            JobAuth::Unauthenticated => crate::IdentityMode::Unauthenticated,
        }
    }

    /// The per-rank keys, when the job has them.
    pub fn credentials(&self) -> Option<&Credentials> {
        match self {
            JobAuth::PerRank(c) => Some(c),
            _ => None,
        }
    }

    /// The identity a transport of this process registers: its own key under per-rank keys,
    /// else a fresh one.
    ///
    /// # Errors
    /// Per-rank keys without a key of this process's own (a store host that is not a rank);
    /// an OS without randomness.
    pub fn identity(&self) -> Result<Identity, BootstrapError> {
        match self {
            JobAuth::PerRank(c) => c.own().cloned().ok_or_else(|| {
                BootstrapError::Auth("per-rank keys, but this process holds no rank's key".into())
            }),
            _ => Identity::generate(),
        }
    }

    /// This job's authentication for a world of `members` (its ranks, ascending) renumbered
    /// `0..members.len()` in that order, as a rejoined communicator's transport sees it: under
    /// per-rank keys the roster of the members' keys, this process's key at its new rank;
    /// otherwise as it is.
    ///
    /// # Errors
    /// [`BootstrapError::Auth`] when `members` is not ascending, names a rank outside the
    /// roster, or (under per-rank keys) does not hold this process's rank.
    pub fn among(&self, members: &[Rank]) -> Result<JobAuth, BootstrapError> {
        if members.is_empty() || members.windows(2).any(|w| w[0] >= w[1]) {
            return Err(BootstrapError::Auth(format!(
                "members {members:?}: expected ranks in ascending order"
            )));
        }
        let JobAuth::PerRank(c) = self else {
            return Ok(self.clone());
        };
        let keys = members
            .iter()
            .map(|&r| c.roster.key(r).map(|k| k.to_bytes()))
            .collect::<Option<Vec<[u8; 32]>>>()
            .ok_or_else(|| {
                BootstrapError::Auth(format!(
                    "members {members:?}: not all in the key roster of {} ranks",
                    c.roster.len()
                ))
            })?;
        let roster = Arc::new(KeyRoster::new(&keys).map_err(BootstrapError::Auth)?);
        let own = match &c.own {
            Some((rank, key)) => {
                let at = members.iter().position(|r| r == rank).ok_or_else(|| {
                    BootstrapError::Auth(format!("rank {rank} is not among {members:?}"))
                })?;
                Some((at, key.clone()))
            }
            None => None,
        };
        Ok(JobAuth::PerRank(Credentials {
            secret: c.secret.clone(),
            roster,
            own,
        }))
    }

    fn key(&self) -> [u8; 32] {
        match self {
            JobAuth::Secret(s) => s.0,
            JobAuth::PerRank(c) => c.secret.0,
            JobAuth::Unauthenticated => [0; 32],
        }
    }

    /// The key that authenticates frames from rank `from` to rank `to` on the tag-matched
    /// transports (UCX, libfabric; see `byzcoll_transport_kit::wire::FrameKeys`): keyed BLAKE3 under the job
    /// secret (zeros for [`JobAuth::Unauthenticated`], so the code path is the same) over a
    /// label, `shared` (the X25519 secret of the two ranks' [`FrameSecret`]s) and the ordered
    /// pair. Without the secret a stranger cannot compute it; without one of the two X25519
    /// private keys neither can another rank of the job. The secret itself stays private.
    pub fn derive_pair_key(&self, shared: &[u8; 32], from: u32, to: u32) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&self.key());
        h.update(b"byzcoll-v2 frame key");
        h.update(shared);
        h.update(&from.to_le_bytes());
        h.update(&to.to_le_bytes());
        *h.finalize().as_bytes()
    }

    fn flags(&self) -> u8 {
        match self {
            JobAuth::Secret(_) => 0,
            JobAuth::PerRank(_) => FLAG_PER_RANK,
            JobAuth::Unauthenticated => FLAG_UNAUTHENTICATED,
        }
    }
}

fn read_secret_file(path: &str) -> Result<JobSecret, BootstrapError> {
    read_private_hex("BYZCOLL_SECRET_FILE", path).map(JobSecret)
}

/// A rank's Ed25519 identity key, made at start. Its `Debug` output shows only the public key.
#[derive(Clone)]
pub struct Identity(pub(super) SigningKey);

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Identity({})", hex(&self.public()[..8]))
    }
}

impl Identity {
    /// A fresh key from the OS CSPRNG.
    ///
    /// # Errors
    /// When the OS has no randomness to give.
    pub fn generate() -> Result<Self, BootstrapError> {
        let mut seed = [0u8; 32];
        getrandom::getrandom(&mut seed)
            .map_err(|e| BootstrapError::Auth(format!("no randomness from the OS: {e}")))?;
        Ok(Identity(SigningKey::from_bytes(&seed)))
    }

    /// The public key, as registered in the store.
    pub fn public(&self) -> [u8; 32] {
        self.0.verifying_key().to_bytes()
    }
}

/// A rank's X25519 key for frame authentication on the tag-matched transports, made fresh by
/// each transport instance (from the OS CSPRNG) and published with its address through the
/// (authenticated) store. Its `Debug` output shows only the public key.
#[derive(Clone)]
pub struct FrameSecret(x25519_dalek::StaticSecret);

impl fmt::Debug for FrameSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FrameSecret({})", hex(&self.public()[..8]))
    }
}

impl FrameSecret {
    /// A fresh key from the OS CSPRNG.
    ///
    /// # Errors
    /// When the OS has no randomness to give.
    pub fn generate() -> Result<Self, BootstrapError> {
        let mut b = [0u8; 32];
        getrandom::getrandom(&mut b)
            .map_err(|e| BootstrapError::Auth(format!("no randomness from the OS: {e}")))?;
        Ok(FrameSecret(x25519_dalek::StaticSecret::from(b)))
    }

    /// The public key, as published with the transport address.
    pub fn public(&self) -> [u8; 32] {
        x25519_dalek::PublicKey::from(&self.0).to_bytes()
    }

    /// The X25519 secret shared with the holder of `peer`'s key, or `None` when `peer` is a
    /// low-order point (the result would not depend on this side's key, so anyone could
    /// compute it).
    pub fn shared(&self, peer: &[u8; 32]) -> Option<[u8; 32]> {
        let s = self.0.diffie_hellman(&x25519_dalek::PublicKey::from(*peer));
        s.was_contributory().then(|| s.to_bytes())
    }
}

/// Every rank's public identity key, as the store handed them out, and their digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roster {
    keys: Vec<VerifyingKey>,
    digest: [u8; 32],
}

impl Roster {
    /// The roster of `entries[r]` = (rank `r`'s public key, the rest of what it published);
    /// the digest covers all of it, so ranks that compare digests compare addresses too.
    ///
    /// # Errors
    /// [`BootstrapError::Auth`] naming the first rank whose key is not a valid Ed25519 point.
    pub fn new(entries: &[([u8; 32], &[u8])]) -> Result<Self, BootstrapError> {
        let mut h = Sha256::new();
        h.update(b"byzcoll-v2 roster");
        h.update((entries.len() as u64).to_le_bytes());
        let mut keys = Vec::with_capacity(entries.len());
        for (rank, (key, rest)) in entries.iter().enumerate() {
            h.update(key);
            h.update((rest.len() as u64).to_le_bytes());
            h.update(rest);
            keys.push(VerifyingKey::from_bytes(key).map_err(|_| {
                BootstrapError::Auth(format!("rank {rank} registered an invalid identity key"))
            })?);
        }
        Ok(Roster {
            keys,
            digest: h.finalize().into(),
        })
    }

    /// The digest every pair of ranks compares.
    pub fn digest(&self) -> [u8; 32] {
        self.digest
    }

    /// The roster of a communicator of `members` (ranks here, in their new order; each
    /// below this roster's size) on `stream`, made from this one by a split or a shrink:
    /// rank `i` there holds the key of rank `members[i]` here. Its digest covers this
    /// roster's, the stream and the members, so that a statement signed for one
    /// communicator counts in no other (not this one, nor another of the same members).
    ///
    /// # Panics
    /// If a member is not a rank of this roster.
    pub fn subset(&self, members: &[usize], stream: u64) -> Roster {
        let mut h = Sha256::new();
        h.update(b"byzcoll-v2 sub-roster");
        h.update(self.digest);
        h.update(stream.to_le_bytes());
        h.update((members.len() as u64).to_le_bytes());
        for &m in members {
            h.update((m as u64).to_le_bytes());
        }
        Roster {
            keys: members.iter().map(|&m| self.keys[m]).collect(),
            digest: h.finalize().into(),
        }
    }

    pub(super) fn key(&self, rank: usize) -> Option<&VerifyingKey> {
        self.keys.get(rank)
    }
}

/// What a rank needs to authenticate its transport connections: the job's secret, its own
/// identity, and the roster of every rank's key.
#[derive(Debug, Clone)]
pub struct Membership {
    /// The job secret or the opt-out.
    pub auth: JobAuth,
    /// This rank's identity key.
    pub identity: Identity,
    /// Every rank's public key, as registered through the store.
    pub roster: Roster,
}

impl Membership {
    /// This rank's membership of a communicator of `members` on `stream` made from this one
    /// ([`Roster::subset`]): the same secret and identity, the members' keys renumbered.
    ///
    /// # Panics
    /// If a member is not a rank of the roster.
    pub fn subset(&self, members: &[usize], stream: u64) -> Membership {
        Membership {
            auth: self.auth.clone(),
            identity: self.identity.clone(),
            roster: self.roster.subset(members, stream),
        }
    }

    /// The membership of the rank holding `identity`, from `entries[r]` = (rank `r`'s
    /// registered key, the rest of what it published). Under per-rank keys every registered
    /// key must be the one the roster binds to its rank.
    ///
    /// # Errors
    /// [`BootstrapError::Auth`] naming the first rank whose key is invalid or, under per-rank
    /// keys, not its roster key (an impostor registered for it, or the store swapped it), or
    /// a table of another size than the roster.
    pub fn new(
        auth: JobAuth,
        identity: Identity,
        entries: &[([u8; 32], &[u8])],
    ) -> Result<Self, BootstrapError> {
        if let Some(c) = auth.credentials() {
            let pinned = c.roster();
            if entries.len() != pinned.len() {
                return Err(BootstrapError::Auth(format!(
                    "{} ranks registered, the key roster has {}",
                    entries.len(),
                    pinned.len()
                )));
            }
            if let Some(r) = (0..entries.len())
                .find(|&r| pinned.key(r).map(VerifyingKey::as_bytes) != Some(&entries[r].0))
            {
                return Err(BootstrapError::Auth(format!(
                    "rank {r} registered a key that is not its key in the roster: an impostor \
                     claims rank {r}"
                )));
            }
        }
        Ok(Membership {
            auth,
            identity,
            roster: Roster::new(entries)?,
        })
    }

    /// Memberships for every rank of a world whose ranks live in this process (tests,
    /// in-process worlds): fresh identities, and one roster over them and `published[r]`
    /// (what rank `r` would have published with its key, e.g. its address).
    ///
    /// # Errors
    /// When the OS has no randomness to give.
    pub fn world(auth: &JobAuth, published: &[Vec<u8>]) -> Result<Vec<Self>, BootstrapError> {
        let ids = published
            .iter()
            .map(|_| Identity::generate())
            .collect::<Result<Vec<_>, _>>()?;
        let entries: Vec<([u8; 32], &[u8])> = ids
            .iter()
            .zip(published)
            .map(|(id, p)| (id.public(), &p[..]))
            .collect();
        let roster = Roster::new(&entries)?;
        Ok(ids
            .into_iter()
            .map(|identity| Membership {
                auth: auth.clone(),
                identity,
                roster: roster.clone(),
            })
            .collect())
    }

    /// The roster's size.
    pub fn size(&self) -> usize {
        self.roster.keys.len()
    }
}

/// What a connection is for; part of what both sides authenticate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Purpose {
    /// A request to the rendezvous store.
    Store = 1,
    /// A TCP transport connection between two ranks.
    Tcp = 2,
}

/// Why a handshake refused, as the refusal code on the wire says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Refusal {
    /// Not a byzcoll handshake at all.
    NotByzcoll = 1,
    /// Another protocol version.
    Version = 2,
    /// Not of this job: wrong secret, world size, purpose or authentication mode.
    OtherJob = 3,
    /// A rank this side does not expect on this connection.
    Rank = 4,
    /// The identity signature or the roster digest does not match.
    Identity = 5,
}

impl Refusal {
    fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            1 => Refusal::NotByzcoll,
            2 => Refusal::Version,
            3 => Refusal::OtherJob,
            4 => Refusal::Rank,
            5 => Refusal::Identity,
            _ => return None,
        })
    }
}

/// A failed handshake.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The connection failed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// This side refused the peer (and told it so): log it with the peer's address.
    #[error("refused: {why}")]
    Rejected {
        /// The refusal code sent.
        code: Refusal,
        /// What was wrong.
        why: String,
    },
    /// The peer refused this side.
    #[error("the peer refused: {0}")]
    Refused(String),
}

/// One side's part in a handshake.
#[derive(Debug, Clone, Copy)]
pub struct Endpoint<'a> {
    /// The job's secret or the opt-out.
    pub auth: &'a JobAuth,
    /// What the connection is for.
    pub purpose: Purpose,
    /// The world size this side was started with.
    pub world: u32,
    /// This side's rank (the store's is [`STORE`]).
    pub rank: u32,
    /// This rank's identity and the roster to check the peer's against (TCP), or `None`
    /// (store requests, made before the roster exists).
    pub identity: Option<(&'a Identity, &'a Roster)>,
    /// Data frames on the connection will carry MACs (TCP's `frame_mac` option); both ends
    /// must agree.
    pub frame_macs: bool,
}

impl Endpoint<'_> {
    fn flags(&self) -> u8 {
        self.auth.flags() | if self.frame_macs { FLAG_FRAME_MACS } else { 0 }
    }

    /// The roster digest this side sends: the transport's table (TCP), else the per-rank key
    /// roster (store requests under per-rank keys), else zeros.
    fn digest(&self) -> [u8; 32] {
        match (self.identity, self.auth.credentials()) {
            (Some((_, roster)), _) => roster.digest(),
            (None, Some(c)) => c.roster().digest(),
            (None, None) => [0; 32],
        }
    }

    /// Whether the initiator signs the transcript with its identity key: on TCP
    /// connections, and on every connection under per-rank keys.
    fn proves_identity(&self) -> bool {
        self.identity.is_some() || self.auth.credentials().is_some()
    }

    fn signer(&self) -> Option<&Identity> {
        match self.identity {
            Some((id, _)) => Some(id),
            None => self.auth.credentials().and_then(Credentials::own),
        }
    }
}

/// What an authenticated connection knows. `Debug` shows no key.
pub struct Session {
    /// The peer's rank (the store: [`STORE`]).
    pub peer: u32,
    /// The world size both sides agree on.
    pub world: u32,
    key: [u8; 32],
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("peer", &self.peer)
            .field("world", &self.world)
            .field("key", &"(hidden)")
            .finish()
    }
}

impl Session {
    /// HMAC-SHA256 of `label` and `parts` under the session key.
    pub fn mac(&self, label: &[u8], parts: &[&[u8]]) -> [u8; 32] {
        let mut m = keyed(&self.key, label);
        for p in parts {
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }

    /// Checks `tag` against [`Session::mac`] of the same input, in constant time.
    pub fn verify(&self, label: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
        let mut m = keyed(&self.key, label);
        for p in parts {
            m.update(p);
        }
        m.verify_slice(tag).is_ok()
    }

    /// The session key, for transports that authenticate frames with it.
    pub fn key(&self) -> [u8; 32] {
        self.key
    }
}

fn keyed(key: &[u8; 32], label: &[u8]) -> HmacSha256 {
    let mut m = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    m.update(label);
    m
}

struct Hello {
    version: u16,
    purpose: u8,
    flags: u8,
    world: u32,
    from: u32,
    to: u32,
    digest: [u8; 32],
    nonce: [u8; NONCE_LEN],
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6] = self.purpose;
        b[7] = self.flags;
        b[8..12].copy_from_slice(&self.world.to_le_bytes());
        b[12..16].copy_from_slice(&self.from.to_le_bytes());
        b[16..20].copy_from_slice(&self.to.to_le_bytes());
        b[20..52].copy_from_slice(&self.digest);
        b[52..84].copy_from_slice(&self.nonce);
        b
    }

    fn decode(b: &[u8; HELLO_LEN]) -> Self {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut digest = [0u8; 32];
        digest.copy_from_slice(&b[20..52]);
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[52..84]);
        Hello {
            version: u16::from_le_bytes([b[4], b[5]]),
            purpose: b[6],
            flags: b[7],
            world: u32_at(8),
            from: u32_at(12),
            to: u32_at(16),
            digest,
            nonce,
        }
    }
}

fn nonce() -> io::Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut n).map_err(|e| io::Error::other(e.to_string()))?;
    Ok(n)
}

/// The handshake transcript: the first message and the responder's nonce.
fn transcript(hello: &[u8; HELLO_LEN], nonce_r: &[u8; NONCE_LEN]) -> Vec<u8> {
    let mut t = Vec::with_capacity(HELLO_LEN + NONCE_LEN);
    t.extend_from_slice(hello);
    t.extend_from_slice(nonce_r);
    t
}

fn tag(auth: &JobAuth, label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    let mut m = keyed(&auth.key(), label);
    for p in parts {
        m.update(p);
    }
    m
}

const INITIATOR: &[u8] = b"byzcoll-v2 initiator";
const RESPONDER: &[u8] = b"byzcoll-v2 responder";
const SESSION: &[u8] = b"byzcoll-v2 session";
const INITIATOR_ID: &[u8] = b"byzcoll-v2 initiator identity";
const RESPONDER_ID: &[u8] = b"byzcoll-v2 responder identity";

fn signed(label: &[u8], t: &[u8]) -> Vec<u8> {
    let mut m = label.to_vec();
    m.extend_from_slice(t);
    m
}

async fn refuse<S: AsyncWrite + Unpin>(
    stream: &mut S,
    code: Refusal,
    why: String,
) -> HandshakeError {
    let msg = &why.as_bytes()[..why.len().min(1024)];
    let mut out = vec![code as u8];
    out.extend_from_slice(&(msg.len() as u16).to_le_bytes());
    out.extend_from_slice(msg);
    let _ = stream.write_all(&out).await;
    HandshakeError::Rejected { code, why }
}

async fn read_status<S: AsyncRead + Unpin>(stream: &mut S) -> Result<(), HandshakeError> {
    let status = stream.read_u8().await?;
    if status == 0 {
        return Ok(());
    }
    let len = stream.read_u16_le().await? as usize;
    if len > 1024 {
        return Err(HandshakeError::Refused(format!(
            "refusal code {status} with a {len}-byte message"
        )));
    }
    let mut msg = vec![0u8; len];
    stream.read_exact(&mut msg).await?;
    let msg = String::from_utf8_lossy(&msg).into_owned();
    Err(HandshakeError::Refused(match Refusal::from_code(status) {
        Some(_) => msg,
        None => format!("unknown refusal code {status}: {msg}"),
    }))
}

/// Runs the initiator's side of the handshake with the peer `to` (a rank, or [`STORE`]).
///
/// # Errors
/// [`HandshakeError::Refused`] with the peer's reason; [`HandshakeError::Rejected`] when the
/// peer fails to prove the secret or its identity; [`HandshakeError::Io`].
///
/// # Cancel safety
/// Not cancel safe: the stream is left mid-handshake.
pub async fn initiate<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    me: Endpoint<'_>,
    to: u32,
) -> Result<Session, HandshakeError> {
    let hello = Hello {
        version: PROTOCOL_VERSION,
        purpose: me.purpose as u8,
        flags: me.flags(),
        world: me.world,
        from: me.rank,
        to,
        digest: me.digest(),
        nonce: nonce()?,
    }
    .encode();
    stream.write_all(&hello).await?;
    read_status(stream).await?;
    let mut nonce_r = [0u8; NONCE_LEN];
    stream.read_exact(&mut nonce_r).await?;
    let t = transcript(&hello, &nonce_r);
    let tag_i: [u8; TAG_LEN] = tag(me.auth, INITIATOR, &[&t])
        .finalize()
        .into_bytes()
        .into();
    let mut msg3 = tag_i.to_vec();
    if me.proves_identity() {
        let id = me.signer().ok_or_else(|| HandshakeError::Rejected {
            code: Refusal::Identity,
            why: "per-rank keys, but this process holds no rank's key".into(),
        })?;
        msg3.extend_from_slice(&id.0.sign(&signed(INITIATOR_ID, &t)).to_bytes());
    }
    stream.write_all(&msg3).await?;
    read_status(stream).await?;
    let mut tag_r = [0u8; TAG_LEN];
    stream.read_exact(&mut tag_r).await?;
    let wrong_job = || HandshakeError::Rejected {
        code: Refusal::OtherJob,
        why: "the peer did not prove the job secret".into(),
    };
    tag(me.auth, RESPONDER, &[&t, &tag_i])
        .verify_slice(&tag_r)
        .map_err(|_| wrong_job())?;
    if let Some((_, roster)) = me.identity {
        let mut sig = [0u8; SIG_LEN];
        stream.read_exact(&mut sig).await?;
        let key = roster.key(to as usize).ok_or_else(wrong_job)?;
        key.verify(&signed(RESPONDER_ID, &t), &Signature::from_bytes(&sig))
            .map_err(|_| HandshakeError::Rejected {
                code: Refusal::Identity,
                why: format!("the listener did not prove the identity of rank {to}"),
            })?;
    }
    Ok(Session {
        peer: to,
        world: me.world,
        key: tag(me.auth, SESSION, &[&t, &tag_i])
            .finalize()
            .into_bytes()
            .into(),
    })
}

/// Runs the responder's side: checks the first message against `me` (version, purpose,
/// authentication mode, world size, that it is addressed to this side, and `accept(from)`),
/// then the initiator's proof of the secret, then (TCP) its identity signature and roster
/// digest, refusing with a code and a reason at the first failed check.
///
/// # Errors
/// [`HandshakeError::Rejected`] with what was wrong (the peer was told); [`HandshakeError::Io`].
///
/// # Cancel safety
/// Not cancel safe: the stream is left mid-handshake.
pub async fn respond<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    me: Endpoint<'_>,
    accept: impl Fn(u32) -> Result<(), String>,
) -> Result<Session, HandshakeError> {
    let mut hello = [0u8; HELLO_LEN];
    stream.read_exact(&mut hello[..4]).await?;
    if V1_MAGICS.iter().any(|m| hello[..4] == *m) {
        let why = format!("protocol version 1, this side {PROTOCOL_VERSION}");
        return Err(refuse(stream, Refusal::Version, why).await);
    }
    if hello[..4] != HELLO_MAGIC {
        let why = "not a byzcoll handshake".to_string();
        return Err(refuse(stream, Refusal::NotByzcoll, why).await);
    }
    stream.read_exact(&mut hello[4..]).await?;
    let h = Hello::decode(&hello);
    if h.version != PROTOCOL_VERSION {
        let why = format!(
            "protocol version {}, this side {PROTOCOL_VERSION}",
            h.version
        );
        return Err(refuse(stream, Refusal::Version, why).await);
    }
    // What is wrong with the first message is told only to a peer that then proves the
    // secret (a member with another setting): a stranger learns nothing of the job, not its
    // world size, authentication mode or ranks.
    let mismatch = check_hello(&h, &me, &accept);
    let nonce_r = nonce()?;
    let mut msg2 = vec![0u8];
    msg2.extend_from_slice(&nonce_r);
    stream.write_all(&msg2).await?;
    let t = transcript(&hello, &nonce_r);
    let mut tag_i = [0u8; TAG_LEN];
    stream.read_exact(&mut tag_i).await?;
    // The initiator's signature follows on TCP connections and under per-rank keys: read
    // before any refusal, so that the refusal is not lost to a reset over unread bytes.
    let mut sig = [0u8; SIG_LEN];
    if h.purpose == Purpose::Tcp as u8 || h.flags & FLAG_PER_RANK != 0 {
        stream.read_exact(&mut sig).await?;
    }
    if tag(me.auth, INITIATOR, &[&t]).verify_slice(&tag_i).is_err() {
        let told = "not of this job: wrong job secret, another authentication mode, or a stranger";
        let _ = refuse(stream, Refusal::OtherJob, told.to_string()).await;
        // The log says more than the peer was told.
        let why = match mismatch {
            Err((_, why)) => format!("wrong job secret ({why})"),
            Ok(()) => "wrong job secret: a process of another job, or a stranger".into(),
        };
        return Err(HandshakeError::Rejected {
            code: Refusal::OtherJob,
            why,
        });
    }
    if let Err((code, why)) = mismatch {
        return Err(refuse(stream, code, why).await);
    }
    let mut msg4 = vec![0u8];
    msg4.extend_from_slice(
        &tag(me.auth, RESPONDER, &[&t, &tag_i])
            .finalize()
            .into_bytes(),
    );
    if me.proves_identity() {
        if h.digest != me.digest() {
            let why = match me.identity {
                Some(_) => format!(
                    "rank {} holds another membership table than rank {}: the store handed out \
                     different tables",
                    h.from, me.rank
                ),
                None => format!(
                    "rank {} holds another key roster than {} (BYZCOLL_ROSTER_FILE from another \
                     keygen?)",
                    h.from,
                    show_rank(me.rank)
                ),
            };
            return Err(refuse(stream, Refusal::Identity, why).await);
        }
        let key = match (me.identity, me.auth.credentials()) {
            (Some((_, roster)), _) => roster.key(h.from as usize),
            (None, Some(c)) => c.roster().key(h.from as usize),
            (None, None) => None,
        };
        let verified = key.is_some_and(|k| {
            k.verify(&signed(INITIATOR_ID, &t), &Signature::from_bytes(&sig))
                .is_ok()
        });
        if !verified {
            let why = format!(
                "did not prove the identity of rank {}: it does not hold that rank's key",
                h.from
            );
            return Err(refuse(stream, Refusal::Identity, why).await);
        }
        if let Some((id, _)) = me.identity {
            msg4.extend_from_slice(&id.0.sign(&signed(RESPONDER_ID, &t)).to_bytes());
        }
    }
    stream.write_all(&msg4).await?;
    Ok(Session {
        peer: h.from,
        world: h.world,
        key: tag(me.auth, SESSION, &[&t, &tag_i])
            .finalize()
            .into_bytes()
            .into(),
    })
}

/// Every check of the first message but its version: purpose, flags, world size, ranks.
fn check_hello(
    h: &Hello,
    me: &Endpoint<'_>,
    accept: &impl Fn(u32) -> Result<(), String>,
) -> Result<(), (Refusal, String)> {
    if h.purpose != me.purpose as u8 {
        return Err((
            Refusal::OtherJob,
            format!(
                "a connection for purpose {}, expected {:?}",
                h.purpose, me.purpose
            ),
        ));
    }
    let known = FLAG_UNAUTHENTICATED | FLAG_FRAME_MACS | FLAG_PER_RANK;
    if h.flags & !known != 0 {
        return Err((Refusal::OtherJob, format!("unknown flags {:#04x}", h.flags)));
    }
    if (h.flags ^ me.flags()) & FLAG_FRAME_MACS != 0 {
        return Err((
            Refusal::OtherJob,
            "frame MACs (BYZCOLL_FRAME_MAC) are on at one end only".into(),
        ));
    }
    if (h.flags ^ me.flags()) & FLAG_PER_RANK != 0 {
        let why = if h.flags & FLAG_PER_RANK != 0 {
            "the peer proves a per-rank key (BYZCOLL_ROSTER_FILE) and this side does not"
        } else {
            "this side requires per-rank keys (BYZCOLL_ROSTER_FILE) and the peer has none"
        };
        return Err((Refusal::OtherJob, why.into()));
    }
    if h.flags != me.flags() {
        let why = if h.flags & FLAG_UNAUTHENTICATED != 0 {
            "the peer runs unauthenticated (BYZCOLL_ALLOW_UNAUTHENTICATED=1) and this job does not"
        } else {
            "this side runs unauthenticated (BYZCOLL_ALLOW_UNAUTHENTICATED=1) and the peer does not"
        };
        return Err((Refusal::OtherJob, why.into()));
    }
    if h.world != me.world {
        return Err((
            Refusal::OtherJob,
            format!("a world of {} ranks, this job has {}", h.world, me.world),
        ));
    }
    if h.to != me.rank || h.from >= me.world {
        return Err((
            Refusal::Rank,
            format!(
                "rank {} of {} addressing {}, this side is {}",
                h.from,
                h.world,
                show_rank(h.to),
                show_rank(me.rank)
            ),
        ));
    }
    accept(h.from).map_err(|why| (Refusal::Rank, why))
}

fn show_rank(r: u32) -> String {
    if r == STORE {
        "the store".into()
    } else {
        format!("rank {r}")
    }
}

#[cfg(test)]
mod tests;
