//! Sealed frames (UCX, libfabric).
//!
//! Tag-matched transports cannot tell which endpoint a message came from: whoever learns a
//! worker address or endpoint name can send messages with any rank's tags. So there every
//! header travels sealed ([`SEALED_LEN`] bytes, [`FrameKeys::seal`]):
//!
//! ```text
//! header (32) | payload tag (16) | MAC (32)
//! payload tag = GMAC(payload key[sender -> receiver], nonce = seq (u64 LE) | 0 (u32), payload)
//! MAC = BLAKE3-keyed(key[sender -> receiver], "byzcoll-v3 frame" | seq (u64 LE) | header | payload tag)
//! ```
//!
//! `seq` is the per-pair sequence number of the message (the one in its tags), so a recorded
//! frame cannot be replayed into another position; the header binds collective, step, tag,
//! sender and length. The pair key ([`byzcoll_runtime::bootstrap::JobAuth::derive_pair_key`]) mixes the
//! job secret with the X25519 secret of the two ranks, whose public keys are published with
//! the addresses through the authenticated store: a stranger lacks the job secret, and a rank
//! of the job (a Byzantine insider) lacks the other pair's X25519 secret, so neither can seal
//! a frame as another rank. The receiver opens the header ([`FrameKeys::open`]) before it
//! claims anything, and checks the payload against the sealed tag
//! ([`FrameKeys::payload_matches`]) before it delivers it.
//!
//! The payload tag is GMAC (AES-256-GCM with the payload as associated data and nothing to
//! encrypt; NIST SP 800-38D), from `aws-lc-rs`, under a key derived from the pair key
//! (BLAKE3 `derive_key`, context [`PAYLOAD_KEY_CONTEXT`]). It only has to be unforgeable by
//! whoever lacks that key, and it runs at about four times BLAKE3's speed on one core
//! (VAES/VPCLMULQDQ): every payload is tagged at both ends, which on shared memory costs
//! more than moving it. Its nonce is the pair's sequence number, which a sender never reuses
//! under one key: the keys of a pair are fresh with every transport (a new X25519 secret),
//! each direction has its own, and `seq` only grows.

use std::sync::Arc;

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use byzcoll_runtime::bootstrap::{FrameSecret, JobAuth, JobSecret};
use byzcoll_runtime::{parse_flag, parse_var, Lookup, OptionError, Rank};

use super::{FrameHeader, HEADER_LEN};

/// Length of a payload tag (GMAC).
pub const PAYLOAD_TAG_LEN: usize = 16;
/// Length of the seal after the header: the payload tag and the MAC.
pub const SEAL_LEN: usize = PAYLOAD_TAG_LEN + 32;
/// Length of a sealed header (see the module docs).
pub const SEALED_LEN: usize = HEADER_LEN + SEAL_LEN;
/// The BLAKE3 `derive_key` context of a pair's payload key, derived from the pair key.
pub const PAYLOAD_KEY_CONTEXT: &str = "byzcoll-v3 frame payload key";
const FRAME_LABEL: &[u8] = b"byzcoll-v3 frame";

/// The keys of one ordered pair of ranks: the MAC key of sealed headers and the payload key.
struct PairKey {
    mac_key: [u8; 32],
    payload: LessSafeKey,
}

impl PairKey {
    fn new(mac_key: [u8; 32]) -> Result<Self, String> {
        let derived = blake3::derive_key(PAYLOAD_KEY_CONTEXT, &mac_key);
        let payload = UnboundKey::new(&AES_256_GCM, &derived)
            .map_err(|_| "the AES-256-GCM payload key was refused".to_string())?;
        Ok(PairKey {
            mac_key,
            payload: LessSafeKey::new(payload),
        })
    }

    /// The nonce of message `seq`: unique per key, since a sender seals each `seq` once.
    fn nonce(seq: u64) -> Nonce {
        let mut n = [0u8; NONCE_LEN];
        n[..8].copy_from_slice(&seq.to_le_bytes());
        Nonce::assume_unique_for_key(n)
    }

    /// GMAC of `payload` as message `seq`. `None` only past GCM's length limit (2^61 bytes).
    fn payload_tag(&self, seq: u64, payload: &[u8]) -> Option<[u8; PAYLOAD_TAG_LEN]> {
        let tag = self
            .payload
            .seal_in_place_separate_tag(Self::nonce(seq), Aad::from(payload), &mut [])
            .ok()?;
        tag.as_ref().try_into().ok()
    }

    /// Whether `tag` is the GMAC of `payload` as message `seq` (the library compares in
    /// constant time).
    fn payload_matches(&self, seq: u64, payload: &[u8], tag: &[u8; PAYLOAD_TAG_LEN]) -> bool {
        let mut t = *tag;
        self.payload
            .open_in_place(Self::nonce(seq), Aad::from(payload), &mut t)
            .is_ok()
    }

    fn mac(&self, seq: u64, header: &[u8], payload_tag: &[u8]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.mac_key);
        h.update(FRAME_LABEL);
        h.update(&seq.to_le_bytes());
        h.update(header);
        h.update(payload_tag);
        h.finalize()
    }
}

/// A rank's frame keys, one per ordered pair it is part of: `send[r]` seals frames to rank
/// `r`, `recv[r]` opens frames from it. `Debug` shows no key.
#[derive(Clone)]
pub struct FrameKeys {
    me: Rank,
    send: Arc<[PairKey]>,
    recv: Arc<[PairKey]>,
}

impl std::fmt::Debug for FrameKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FrameKeys(rank {} of {})", self.me, self.send.len())
    }
}

/// Why a sealed header was not opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unsealed {
    /// The MAC does not verify under the pair's key: the frame is not the claimed sender's
    /// (forged, replayed into another position, or corrupted). It cannot be attributed to
    /// the sender, so the receiver drops it rather than blame the sender.
    Forged,
    /// The MAC verifies, but the sender sealed a header that is not acceptable.
    Invalid(String),
}

/// An opened header: authentic, for the sequence number it was opened with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    /// The header.
    pub header: FrameHeader,
    seq: u64,
    payload_tag: [u8; PAYLOAD_TAG_LEN],
}

impl FrameKeys {
    /// Rank `me`'s keys from its X25519 secret and every rank's public key (`publics[r]`, as
    /// published through the store), under the job's `auth`.
    ///
    /// # Errors
    /// Naming the rank whose public key is a low-order point.
    pub fn new(
        auth: &JobAuth,
        me: Rank,
        secret: &FrameSecret,
        publics: &[[u8; 32]],
    ) -> Result<Self, String> {
        let mut send = Vec::with_capacity(publics.len());
        let mut recv = Vec::with_capacity(publics.len());
        for (peer, public) in publics.iter().enumerate() {
            let shared = secret
                .shared(public)
                .ok_or_else(|| format!("rank {peer} published an unusable frame key"))?;
            send.push(PairKey::new(auth.derive_pair_key(
                &shared,
                me as u32,
                peer as u32,
            ))?);
            recv.push(PairKey::new(auth.derive_pair_key(
                &shared,
                peer as u32,
                me as u32,
            ))?);
        }
        Ok(FrameKeys {
            me,
            send: send.into(),
            recv: recv.into(),
        })
    }

    /// The keys of every rank of a world that lives in this process: fresh X25519 keys and
    /// a fresh job secret.
    ///
    /// # Errors
    /// When the OS has no randomness to give.
    pub fn local_world(size: usize) -> Result<Vec<Self>, String> {
        let auth = JobAuth::Secret(JobSecret::generate().map_err(|e| e.to_string())?);
        let secrets = (0..size)
            .map(|_| FrameSecret::generate().map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        let publics: Vec<[u8; 32]> = secrets.iter().map(FrameSecret::public).collect();
        secrets
            .iter()
            .enumerate()
            .map(|(rank, s)| Self::new(&auth, rank, s, &publics))
            .collect()
    }

    /// The sealed header of message `seq` to rank `to` (see the module docs). Each `seq` must
    /// be sealed once: it is the payload tag's nonce.
    ///
    /// # Errors
    /// When the payload is too long to tag (over 2^61 bytes).
    pub fn seal(
        &self,
        to: Rank,
        seq: u64,
        header: &FrameHeader,
        payload: &[u8],
    ) -> Result<[u8; SEALED_LEN], String> {
        let key = &self.send[to];
        let tag = key
            .payload_tag(seq, payload)
            .ok_or_else(|| format!("a payload of {} bytes is too long to tag", payload.len()))?;
        let mut b = [0u8; SEALED_LEN];
        b[..HEADER_LEN].copy_from_slice(&header.encode());
        b[HEADER_LEN..HEADER_LEN + PAYLOAD_TAG_LEN].copy_from_slice(&tag);
        let mac = key.mac(seq, &b[..HEADER_LEN], &tag);
        b[HEADER_LEN + PAYLOAD_TAG_LEN..].copy_from_slice(mac.as_bytes());
        Ok(b)
    }

    /// Opens the sealed header of message `seq` from rank `from`: verifies its MAC (in
    /// constant time), then the magic and that the header names `from` as its sender.
    ///
    /// # Errors
    /// [`Unsealed::Forged`] when the MAC does not verify; [`Unsealed::Invalid`] for an
    /// authentic header with a bad magic or another sender.
    pub fn open(&self, from: Rank, seq: u64, b: &[u8; SEALED_LEN]) -> Result<Opened, Unsealed> {
        let (header, rest) = b.split_at(HEADER_LEN);
        let (payload_tag, mac) = rest.split_at(PAYLOAD_TAG_LEN);
        let mut tag = [0u8; 32];
        tag.copy_from_slice(mac);
        if self.recv[from].mac(seq, header, payload_tag) != blake3::Hash::from(tag) {
            return Err(Unsealed::Forged);
        }
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(header);
        let header = FrameHeader::decode(&h).map_err(Unsealed::Invalid)?;
        if header.sender as usize != from {
            return Err(Unsealed::Invalid(format!(
                "frame claims sender {} on rank {from}'s tags",
                header.sender
            )));
        }
        let mut t = [0u8; PAYLOAD_TAG_LEN];
        t.copy_from_slice(payload_tag);
        Ok(Opened {
            header,
            seq,
            payload_tag: t,
        })
    }

    /// Whether `payload` is the payload the sender sealed in `opened` (a header these keys
    /// opened): its tag is checked in constant time.
    pub fn payload_matches(&self, opened: &Opened, payload: &[u8]) -> bool {
        self.recv[opened.header.sender as usize].payload_matches(
            opened.seq,
            payload,
            &opened.payload_tag,
        )
    }
}

/// What a rank publishes through the store for a tag-matched transport: its X25519 public
/// key, its Ed25519 identity key (what audited rounds check its signatures with), then its
/// transport address.
pub fn publish(secret: &FrameSecret, identity: &[u8; 32], address: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(64 + address.len());
    v.extend_from_slice(&secret.public());
    v.extend_from_slice(identity);
    v.extend_from_slice(address);
    v
}

/// Splits what a rank published ([`publish`]) into its frame key, its identity key and its
/// address.
///
/// # Errors
/// When it is too short to hold the keys.
#[allow(clippy::type_complexity)]
pub fn published(value: &[u8]) -> Result<([u8; 32], [u8; 32], &[u8]), String> {
    if value.len() < 64 {
        return Err(format!(
            "{} bytes published, expected two 32-byte keys and an address",
            value.len()
        ));
    }
    let mut key = [0u8; 32];
    key.copy_from_slice(&value[..32]);
    let mut identity = [0u8; 32];
    identity.copy_from_slice(&value[32..64]);
    Ok((key, identity, &value[64..]))
}

/// `BYZCOLL_FRAME_MAC` for a transport whose frames are always sealed (`name`): `1` says what
/// is true anyway, `0` asks for what it cannot do.
///
/// # Errors
/// [`OptionError::Unsupported`] for `0`; [`OptionError::Invalid`] for a value that is not a
/// flag.
pub fn always_sealed(get: Lookup<'_>, name: &str) -> Result<(), OptionError> {
    const VAR: &str = "BYZCOLL_FRAME_MAC";
    match parse_var(get, VAR, "expected 1 (frames carry MACs) or 0", parse_flag)? {
        Some(false) => Err(OptionError::Unsupported {
            var: VAR,
            why: format!(
                "0: frames over {name} are always sealed (its tag matching cannot tell senders \
                 apart otherwise)"
            ),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(sender: u32, len: u64) -> FrameHeader {
        FrameHeader {
            collective: 3,
            step: 4,
            sender,
            tag: 5,
            len,
            call: 6,
        }
    }

    #[test]
    fn sealed_frames_open_only_for_their_pair_position_and_payload() {
        let keys = FrameKeys::local_world(3).unwrap();
        let payload = b"genuine payload";
        let sealed = keys[0].seal(1, 7, &header(0, 15), payload).unwrap();
        let opened = keys[1].open(0, 7, &sealed).unwrap();
        assert_eq!(opened.header, header(0, 15));
        assert!(keys[1].payload_matches(&opened, payload));
        assert!(!keys[1].payload_matches(&opened, b"forged  payload"));
        // Another position, another receiver, another claimed sender: forged.
        assert_eq!(keys[1].open(0, 8, &sealed), Err(Unsealed::Forged));
        assert_eq!(keys[2].open(0, 7, &sealed), Err(Unsealed::Forged));
        assert_eq!(keys[1].open(2, 7, &sealed), Err(Unsealed::Forged));
        // Any flipped bit: forged.
        for i in [0, 5, 13, 17, 21, 25, HEADER_LEN + 3, SEALED_LEN - 1] {
            let mut b = sealed;
            b[i] ^= 1;
            assert_eq!(keys[1].open(0, 7, &b), Err(Unsealed::Forged), "byte {i}");
        }
        // An insider (rank 2) sealing with its own key, claiming sender 0: forged.
        let insider = keys[2].seal(1, 7, &header(0, 15), payload).unwrap();
        assert_eq!(keys[1].open(0, 7, &insider), Err(Unsealed::Forged));
        // Its honest frame names sender 2: opened as rank 2's, not as rank 0's.
        let own = keys[2].seal(1, 7, &header(0, 15), payload).unwrap();
        assert!(matches!(
            keys[1].open(2, 7, &own),
            Err(Unsealed::Invalid(_))
        ));
        // Keys of another job (another secret) do not open it.
        let other = FrameKeys::local_world(3).unwrap();
        assert_eq!(other[1].open(0, 7, &sealed), Err(Unsealed::Forged));
    }

    #[test]
    fn payload_tags_bind_every_byte_the_position_and_the_pair() {
        let keys = FrameKeys::local_world(3).unwrap();
        let payload: Vec<u8> = (0..70_001u32).map(|i| (i * 7 % 251) as u8).collect();
        let len = payload.len() as u64;
        let sealed = keys[0].seal(1, 7, &header(0, len), &payload).unwrap();
        let opened = keys[1].open(0, 7, &sealed).unwrap();
        assert!(keys[1].payload_matches(&opened, &payload));
        // Any flipped bit of the payload, a shorter or a longer one: refused.
        for i in [0, 1, 4095, 4096, 35_000, 65_536, payload.len() - 1] {
            let mut p = payload.clone();
            p[i] ^= 0x80;
            assert!(!keys[1].payload_matches(&opened, &p), "byte {i}");
        }
        assert!(!keys[1].payload_matches(&opened, &payload[..payload.len() - 1]));
        let mut longer = payload.clone();
        longer.push(0);
        assert!(!keys[1].payload_matches(&opened, &longer));
        // The same payload as another message of the pair gets another tag (the nonce is the
        // sequence number), and another pair's keys do not accept it.
        let again = keys[0].seal(1, 8, &header(0, len), &payload).unwrap();
        assert_ne!(
            sealed[HEADER_LEN..HEADER_LEN + PAYLOAD_TAG_LEN],
            again[HEADER_LEN..HEADER_LEN + PAYLOAD_TAG_LEN]
        );
        assert!(!keys[2].payload_matches(&opened, &payload));
        // An empty payload is tagged too.
        let empty = keys[0].seal(1, 9, &header(0, 0), &[]).unwrap();
        let opened = keys[1].open(0, 9, &empty).unwrap();
        assert!(keys[1].payload_matches(&opened, &[]));
        assert!(!keys[1].payload_matches(&opened, &[0]));
    }

    #[test]
    fn unauthenticated_jobs_still_need_the_pair_secret_and_low_order_keys_are_refused() {
        let secrets: Vec<FrameSecret> = (0..2).map(|_| FrameSecret::generate().unwrap()).collect();
        let publics: Vec<[u8; 32]> = secrets.iter().map(FrameSecret::public).collect();
        let auth = JobAuth::Unauthenticated;
        let a = FrameKeys::new(&auth, 0, &secrets[0], &publics).unwrap();
        let b = FrameKeys::new(&auth, 1, &secrets[1], &publics).unwrap();
        let sealed = a.seal(1, 0, &header(0, 1), b"x").unwrap();
        assert!(b.open(0, 0, &sealed).is_ok());
        let stranger = FrameSecret::generate().unwrap();
        let s = FrameKeys::new(&auth, 0, &stranger, &publics).unwrap();
        assert_eq!(
            b.open(0, 0, &s.seal(1, 0, &header(0, 1), b"x").unwrap()),
            Err(Unsealed::Forged)
        );
        let mut low = publics;
        low[1] = [0; 32];
        assert!(FrameKeys::new(&auth, 0, &secrets[0], &low)
            .unwrap_err()
            .contains("rank 1"));
        let v = publish(&secrets[0], &[7; 32], b"addr");
        assert_eq!(
            published(&v).unwrap(),
            (secrets[0].public(), [7; 32], &b"addr"[..])
        );
        assert!(published(&[0; 63]).is_err());
    }
}
