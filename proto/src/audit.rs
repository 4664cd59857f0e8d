//! Audited sharding's evidence (issue #40; `PROTOCOL.md`, "Audited sharding"): what the ranks
//! of a sharded round with one owner per shard sign, what an auditor replays, and the proof
//! that convicts an owner that lied, checked the same way by every rank.
//!
//! An owner that aggregates its shard alone can lie about the result. Audits make the lie
//! provable after the fact, at the cost of replaying a few *sub-chunks* (a shard cut into
//! [`Audit::sub_chunks`] element-aligned parts) instead of replicating the shard:
//!
//! 1. A sender commits to each piece it sends: one BLAKE3 hash per sub-chunk (the piece's
//!    *leaves*), and signs the hash of the leaves ([`SignedPiece`]). The owner checks the
//!    piece it received against the leaves and the signature before it aggregates it.
//! 2. The owner commits to its result the same way and signs it together with the list of
//!    the inputs it used ([`OwnerClaim`]), before any rank has chosen what to audit.
//! 3. An auditor picks sub-chunks with randomness the owner cannot know in advance, gets the
//!    claim and the inputs' bytes of those sub-chunks, and replays the rule on them (a
//!    coordinate-wise rule's output on a sub-chunk depends on that sub-chunk of the inputs
//!    alone, and byzcoll's rules are bitwise deterministic).
//! 4. A replay that differs is an [`Accusation`]: the owner's signed claim, the senders'
//!    signed pieces, the sub-chunk's bytes. Any rank checks it with [`Accusation::verify`]
//!    and the ranks' public keys, and reaches the same verdict: signatures cannot be forged
//!    and the replay is exact, so a true accusation convicts and a false one is refuted (no
//!    rank can frame an honest owner, whatever it sends).
//!
//! This module holds the sans-IO parts: the commitments, the signed statements, the proof and
//! its wire form (decoded against the sizes the round expects, never sizes the sender
//! claims), and the detection probabilities of [`Audit`]. Signing and verifying go through
//! [`Signer`] and [`Verifier`], which the runtime implements with the ranks' Ed25519 identity
//! keys: this crate holds no crypto stack.

use std::ops::Range;

use byzcoll_aggregators::{aggregate_into, Aggregator, DType, Element};

use crate::round::Digest;
use crate::schedule::chunk_range;
use crate::Rank;

/// An Ed25519 signature (64 bytes).
pub type Signature = [u8; 64];

/// Signs the audit's statements with this rank's identity key.
pub trait Signer: Send + Sync {
    /// The signature of `message`.
    fn sign(&self, message: &[u8]) -> Signature;
}

/// Checks the statements of any rank of the job against its public key.
pub trait Verifier: Send + Sync {
    /// Whether `signature` is `rank`'s over `message` (`false` for a rank the job lacks).
    fn verify(&self, rank: Rank, message: &[u8], signature: &Signature) -> bool;
}

/// The call a statement belongs to: a signature made for one call never counts for another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallId {
    /// What names the job and its membership (the roster digest every pair of ranks compared
    /// in the handshake), so that a rank key used in two jobs signs nothing valid across them.
    pub job: Digest,
    /// The collective's number in the communicator's sequence.
    pub collective: u64,
}

/// How a round audits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Audit {
    /// The parts each piece and each result is cut into for commitments; an audit replays
    /// whole sub-chunks.
    pub sub_chunks: usize,
    /// How many sub-chunks of an audited owner's shard an auditor replays.
    pub samples: usize,
    /// How many owners each rank audits per round (at most `n − 1`); `None`: the fewest that
    /// catch an owner lying on every coordinate in its first round with probability at least
    /// `1 − AUDIT_TARGET` ([`Audit::owners_per_rank`]).
    pub owners: Option<usize>,
}

/// The default audit's bound on the chance that an owner lying on every coordinate of its
/// shard goes uncaught in a round.
pub const AUDIT_TARGET: f64 = 1e-6;

impl Default for Audit {
    /// 64 sub-chunks, one replayed per audit, and as many audits as [`AUDIT_TARGET`] needs.
    fn default() -> Self {
        Audit {
            sub_chunks: 64,
            samples: 1,
            owners: None,
        }
    }
}

impl Audit {
    /// The owners a rank of `n` audits per round with `f` Byzantine ranks: [`Audit::owners`]
    /// (at most `n − 1`), or the fewest `k` for which an owner lying on every coordinate
    /// escapes the `n − f` honest ranks with probability `(1 − k/(n−1))^(n−f)` at most
    /// [`AUDIT_TARGET`] (`n − 1`, every other owner, where no fewer do: 8 ranks).
    pub fn owners_per_rank(&self, n: usize, f: usize) -> usize {
        let others = n.saturating_sub(1);
        match self.owners {
            Some(k) => k.min(others),
            None => (1..=others)
                .find(|&k| {
                    let audited = k as f64 / others as f64;
                    (1.0 - audited).powf(n.saturating_sub(f) as f64) <= AUDIT_TARGET
                })
                .unwrap_or(others),
        }
    }

    /// The probability that an owner lying on a fraction `p` of its sub-chunks (chosen by it,
    /// before the audits) goes uncaught for `rounds` rounds in a world of `n` with `f`
    /// Byzantine ranks, itself one of them. Each of the `n − f` honest ranks audits it with
    /// probability `k / (n − 1)` ([`Audit::owners_per_rank`]) and then replays `s` distinct
    /// sub-chunks of `m`, which all miss the `ℓ = ⌈p·m⌉` lied ones with probability
    /// `C(m − ℓ, s) / C(m, s)`; ranks choose independently, and so do rounds:
    /// `(1 − k/(n−1) · (1 − C(m−ℓ, s)/C(m, s)))^((n − f) · rounds)`.
    pub fn escape_probability(&self, n: usize, f: usize, p: f64, rounds: u32) -> f64 {
        if n < 2 {
            return 1.0;
        }
        let m = self.sub_chunks.max(1);
        let s = self.samples.clamp(1, m);
        let lied = ((p.clamp(0.0, 1.0) * m as f64).ceil() as usize).min(m);
        // C(m − ℓ, s) / C(m, s) = Π_{i<s} (m − ℓ − i) / (m − i).
        let miss = (0..s)
            .map(|i| (m.saturating_sub(lied + i)) as f64 / (m - i) as f64)
            .product::<f64>();
        let audited = self.owners_per_rank(n, f) as f64 / (n - 1) as f64;
        let per_rank = 1.0 - audited * (1.0 - miss);
        per_rank.powf(n.saturating_sub(f) as f64 * f64::from(rounds))
    }

    /// The bytes a rank receives per round for its audits, as a fraction of the vector's:
    /// each audit replays `s` sub-chunks of the `n` inputs of a shard of `d / n` elements,
    /// `s / m` of the vector, besides the leaves (32 bytes per sub-chunk of each input and of
    /// the result: `32·m·(n + 1)` bytes per audit).
    pub fn traffic(&self, n: usize, f: usize) -> f64 {
        let m = self.sub_chunks.max(1);
        self.owners_per_rank(n, f) as f64 * self.samples.min(m) as f64 / m as f64
    }
}

/// What the audits of a round found, on this rank ([`RoundReport::audit`](crate::RoundReport)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditReport {
    /// The owners this rank audited, each with the sub-chunks it replayed.
    pub audited: Vec<(Rank, Vec<usize>)>,
    /// Owners proven to have lied (by this rank's audits or by accusations it checked),
    /// ascending by owner.
    pub convicted: Vec<Lie>,
    /// The shards this rank aggregated again from every rank's piece because their owner was
    /// convicted: their part of the result is the true aggregate, not the owner's.
    pub recomputed: Vec<usize>,
    /// Owners this rank audited that did not let it replay (no audit data, a claim whose
    /// signatures or leaves do not hold): a fault this rank saw and cannot prove.
    pub refused: Vec<Rank>,
    /// Ranks that sent this rank an accusation that does not stand, with why.
    pub false_accusers: Vec<(Rank, String)>,
}

/// The elements of sub-chunk `j` of a vector of `elements` cut into `m` parts.
pub fn sub_range(elements: usize, m: usize, j: usize) -> Range<usize> {
    chunk_range(elements, m, j)
}

/// The leaves' BLAKE3 derive-key context.
const LEAF: &str = "byzcoll-audit-v1 leaf";
const ROOT: &[u8] = b"byzcoll-audit-v1 root\0";
const INPUTS: &[u8] = b"byzcoll-audit-v1 inputs\0";
const PIECE: &[u8] = b"byzcoll-audit-v1 piece\0";
const RESULT: &[u8] = b"byzcoll-audit-v1 result\0";

/// The leaf of sub-chunk `j`: BLAKE3 in derive-key mode (context `"byzcoll-audit-v1 leaf"`) of its bytes, then
/// its index. The bytes come first so that they start on BLAKE3's chunk boundaries and hash at
/// the SIMD width of many chunks at once: behind a 30-byte prefix, the first kilobyte of every
/// leaf went through the one-block-at-a-time path, a fifth of an audited round's CPU at 8 ranks
/// (`docs/bench/PROFILE.md`). The index has a fixed length, so the input stays unambiguous.
pub fn leaf(j: usize, bytes: &[u8]) -> Digest {
    static KEYED: std::sync::LazyLock<blake3::Hasher> =
        std::sync::LazyLock::new(|| blake3::Hasher::new_derive_key(LEAF));
    let mut h = KEYED.clone();
    h.update(bytes);
    h.update(&(j as u64).to_le_bytes());
    h.finalize().into()
}

/// The leaves of a vector's bytes (`elem` bytes per element) cut into `m` sub-chunks.
///
/// # Panics
/// If `bytes` is not a whole number of elements or `m` is 0.
pub fn leaves(bytes: &[u8], elem: usize, m: usize) -> Vec<Digest> {
    assert!(
        elem > 0 && bytes.len().is_multiple_of(elem),
        "whole elements"
    );
    let elements = bytes.len() / elem;
    (0..m)
        .map(|j| {
            let r = sub_range(elements, m, j);
            leaf(j, &bytes[r.start * elem..r.end * elem])
        })
        .collect()
}

/// The commitment to a list of leaves: BLAKE3 of their count and the leaves.
pub fn root(leaves: &[Digest]) -> Digest {
    let mut h = blake3::Hasher::new();
    h.update(ROOT);
    h.update(&(leaves.len() as u64).to_le_bytes());
    for l in leaves {
        h.update(l);
    }
    h.finalize().into()
}

fn statement(
    domain: &[u8],
    call: &CallId,
    rank: Rank,
    shard: usize,
    digests: &[&Digest],
) -> Vec<u8> {
    let mut m = Vec::with_capacity(domain.len() + 56 + 32 * digests.len());
    m.extend_from_slice(domain);
    m.extend_from_slice(&call.job);
    m.extend_from_slice(&call.collective.to_le_bytes());
    m.extend_from_slice(&(rank as u64).to_le_bytes());
    m.extend_from_slice(&(shard as u64).to_le_bytes());
    for d in digests {
        m.extend_from_slice(*d);
    }
    m
}

/// A sender's signed commitment to the piece of shard `shard` it sent the shard's owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedPiece {
    /// The sender.
    pub sender: Rank,
    /// The piece's leaves ([`leaves`]).
    pub leaves: Vec<Digest>,
    /// The sender's signature over (call, sender, shard, [`root`] of the leaves).
    pub signature: Signature,
}

impl SignedPiece {
    /// Commits `sender`'s piece `bytes` of shard `shard`.
    pub fn sign(
        signer: &dyn Signer,
        call: &CallId,
        sender: Rank,
        shard: usize,
        bytes: &[u8],
        elem: usize,
        m: usize,
    ) -> Self {
        let leaves = leaves(bytes, elem, m);
        let signature = signer.sign(&Self::statement(call, sender, shard, &leaves));
        SignedPiece {
            sender,
            leaves,
            signature,
        }
    }

    fn statement(call: &CallId, sender: Rank, shard: usize, leaves: &[Digest]) -> Vec<u8> {
        statement(PIECE, call, sender, shard, &[&root(leaves)])
    }

    /// Whether the signature is the sender's for this piece of `shard` in `call`.
    pub fn signed(&self, verifier: &dyn Verifier, call: &CallId, shard: usize) -> bool {
        verifier.verify(
            self.sender,
            &Self::statement(call, self.sender, shard, &self.leaves),
            &self.signature,
        )
    }

    /// Whether `bytes` (the piece, `elem` bytes per element) is what the sender committed to:
    /// what an owner checks before it aggregates a piece.
    pub fn matches(&self, bytes: &[u8], elem: usize) -> bool {
        !self.leaves.is_empty() && leaves(bytes, elem, self.leaves.len()) == self.leaves
    }

    /// The wire form that travels with the piece: the signature, then the leaves
    /// (`64 + 32·m` bytes, [`SignedPiece::len`]).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(Self::len(self.leaves.len()));
        out.extend_from_slice(&self.signature);
        self.leaves.iter().for_each(|l| out.extend_from_slice(l));
        out
    }

    /// The length of the wire form with `m` leaves.
    pub fn len(m: usize) -> usize {
        64 + 32 * m
    }

    /// `sender`'s signed piece from its wire form with `m` leaves (`None`: not that length).
    pub fn decode(sender: Rank, bytes: &[u8], m: usize) -> Option<Self> {
        if bytes.len() != Self::len(m) {
            return None;
        }
        let mut r = Reader(bytes);
        Some(SignedPiece {
            sender,
            signature: r.signature().ok()?,
            leaves: r.leaves(m).ok()?,
        })
    }
}

/// An owner's signed claim: its result for a shard, committed by leaves, and the signed pieces
/// of the inputs it aggregated (ascending by sender).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerClaim {
    /// The owner.
    pub owner: Rank,
    /// The shard.
    pub shard: usize,
    /// The leaves of its result for the shard.
    pub result: Vec<Digest>,
    /// The inputs it aggregated, ascending by sender.
    pub inputs: Vec<SignedPiece>,
    /// The owner's signature over (call, owner, shard, root of the result's leaves, the
    /// commitment to the inputs: their senders and the roots of their leaves).
    pub signature: Signature,
}

impl OwnerClaim {
    /// `owner`'s claim that `result` (bytes, `elem` per element) is its aggregate of `inputs`.
    #[allow(clippy::too_many_arguments)]
    pub fn sign(
        signer: &dyn Signer,
        call: &CallId,
        owner: Rank,
        shard: usize,
        result: &[u8],
        elem: usize,
        m: usize,
        inputs: Vec<SignedPiece>,
    ) -> Self {
        let result = leaves(result, elem, m);
        let signature = signer.sign(&Self::statement(call, owner, shard, &result, &inputs));
        OwnerClaim {
            owner,
            shard,
            result,
            inputs,
            signature,
        }
    }

    fn statement(
        call: &CallId,
        owner: Rank,
        shard: usize,
        result: &[Digest],
        inputs: &[SignedPiece],
    ) -> Vec<u8> {
        let inputs = Self::inputs_digest(inputs);
        statement(RESULT, call, owner, shard, &[&root(result), &inputs])
    }

    /// Whether `signature` is `owner`'s claim over a result with `result` leaves and inputs
    /// committed as `inputs` ([`OwnerClaim::inputs_digest`]): what a taker checks of the
    /// result it received, before it takes it, so that an owner is bound to the result it
    /// sent (not only to one it signed).
    #[allow(clippy::too_many_arguments)]
    pub fn signed_over(
        verifier: &dyn Verifier,
        call: &CallId,
        owner: Rank,
        shard: usize,
        result: &[Digest],
        inputs: &Digest,
        signature: &Signature,
    ) -> bool {
        let message = statement(RESULT, call, owner, shard, &[&root(result), inputs]);
        verifier.verify(owner, &message, signature)
    }

    /// The commitment to an input set the claim's signature covers: the senders, ascending,
    /// the roots of their leaves and their signatures (so that an owner answers for every
    /// signature it hands an auditor: one that does not hold is the owner's proven lie).
    pub fn inputs_digest(inputs: &[SignedPiece]) -> Digest {
        let mut h = blake3::Hasher::new();
        h.update(INPUTS);
        h.update(&(inputs.len() as u64).to_le_bytes());
        for p in inputs {
            h.update(&(p.sender as u64).to_le_bytes());
            h.update(&root(&p.leaves));
            h.update(&p.signature);
        }
        h.finalize().into()
    }

    /// What an owner sends its auditor of sub-chunks `subs` ([`Expect::slot_len`] per rank):
    /// for each rank, whether the owner aggregated its piece, the piece's signature and
    /// leaves, and its bytes of each sub-chunk asked for (`sub_chunk(sender, j)`).
    pub fn audit_data(
        &self,
        expect: &Expect,
        subs: &[usize],
        mut sub_chunk: impl FnMut(Rank, usize) -> Vec<u8>,
    ) -> Vec<u8> {
        let slot = expect.slot_len(self.shard, subs);
        let mut out = Vec::with_capacity(expect.n * slot);
        for rank in 0..expect.n {
            match self.inputs.iter().find(|p| p.sender == rank) {
                Some(p) => {
                    out.push(1);
                    out.extend_from_slice(&p.encode());
                    for &j in subs {
                        let b = sub_chunk(rank, j);
                        debug_assert_eq!(b.len(), expect.sub_bytes(self.shard, j));
                        out.extend_from_slice(&b);
                    }
                }
                None => out.resize(out.len() + slot, 0),
            }
        }
        out
    }

    /// Reads [`OwnerClaim::audit_data`] of `owner`'s shard `shard` for sub-chunks `subs`: the
    /// inputs it claims (ascending) and each one's bytes of each sub-chunk. The claim still
    /// needs its signature and result leaves ([`OwnerClaim::check`]).
    ///
    /// # Errors
    /// [`Refuted::Malformed`] for a length or presence byte that is not the form's.
    #[allow(clippy::type_complexity)]
    pub fn read_audit_data(
        bytes: &[u8],
        expect: &Expect,
        shard: usize,
        subs: &[usize],
    ) -> Result<(Vec<SignedPiece>, Vec<Vec<Vec<u8>>>), Refuted> {
        let slot = expect.slot_len(shard, subs);
        if bytes.len() != expect.n * slot {
            return Err(Refuted::Malformed(format!(
                "{} bytes of audit data, expected {}",
                bytes.len(),
                expect.n * slot
            )));
        }
        let mut r = Reader(bytes);
        let (mut inputs, mut chunks) = (Vec::new(), Vec::new());
        for sender in 0..expect.n {
            let present = r.take(1)?[0];
            let piece = r.take(SignedPiece::len(expect.m))?;
            let mut mine = Vec::with_capacity(subs.len());
            for &j in subs {
                mine.push(r.take(expect.sub_bytes(shard, j))?.to_vec());
            }
            match present {
                0 => {}
                1 => {
                    inputs.push(
                        SignedPiece::decode(sender, piece, expect.m)
                            .expect("the length is checked"),
                    );
                    chunks.push(mine);
                }
                other => {
                    return Err(Refuted::Malformed(format!(
                        "presence byte {other} for rank {sender}"
                    )))
                }
            }
        }
        Ok((inputs, chunks))
    }

    /// Why the claim does not stand as `owner`'s for `shard` of `call` over `n` ranks with
    /// `m` sub-chunks: a bad owner signature, inputs out of order or from unknown ranks, or an
    /// input signature that is not its sender's. `None`: it stands.
    pub fn check(
        &self,
        verifier: &dyn Verifier,
        call: &CallId,
        n: usize,
        m: usize,
    ) -> Option<Refuted> {
        if self.owner >= n || self.result.len() != m {
            return Some(Refuted::Malformed("the claim's owner or leaves".into()));
        }
        if !verifier.verify(
            self.owner,
            &Self::statement(call, self.owner, self.shard, &self.result, &self.inputs),
            &self.signature,
        ) {
            return Some(Refuted::OwnerSignature);
        }
        let mut last = None;
        for p in &self.inputs {
            if p.sender >= n || last.is_some_and(|l| p.sender <= l) || p.leaves.len() != m {
                return Some(Refuted::Malformed(format!(
                    "input of rank {} out of order, unknown or with {} leaves",
                    p.sender,
                    p.leaves.len()
                )));
            }
            last = Some(p.sender);
            // The owner signed over this piece, but only its sender's signature shows that
            // the sender committed to it.
            if !p.signed(verifier, call, self.shard) {
                return Some(Refuted::InputSignature(p.sender));
            }
        }
        None
    }
}

/// Why an accusation does not convict.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refuted {
    /// The bytes are not an accusation of the expected sizes.
    #[error("malformed accusation: {0}")]
    Malformed(String),
    /// The claim does not carry the accused owner's signature.
    #[error("the claim is not signed by the accused owner")]
    OwnerSignature,
    /// An input's commitment is not signed by its sender.
    #[error("the input of rank {0} is not signed by rank {0}")]
    InputSignature(Rank),
    /// A sub-chunk's bytes are not what their leaf commits to.
    #[error("the bytes of {0} do not match their commitment")]
    Bytes(String),
    /// The replay could not run (the rule's precondition, its error).
    #[error("the replay failed: {0}")]
    Replay(String),
    /// The replay gives the owner's result: it did not lie on this sub-chunk.
    #[error("the replay agrees with the owner's result")]
    Agrees,
}

/// A proven lie of owner `owner` about its shard, found on sub-chunk `sub`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lie {
    /// The owner that lied.
    pub owner: Rank,
    /// The shard.
    pub shard: usize,
    /// The sub-chunk replayed.
    pub sub: usize,
    /// What the owner signed that an honest owner never does.
    pub proof: Proof,
}

/// What a signed claim proves against its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Proof {
    /// Its result differs from the replay of its inputs, first at this element of the shard.
    Differs {
        /// The element of the shard.
        element: usize,
    },
    /// It claims an input its sender did not sign (an honest owner checks each piece's
    /// signature before it aggregates it).
    UnsignedInput {
        /// The sender whose signature does not hold.
        sender: Rank,
    },
    /// The rule cannot aggregate the inputs it claims (too few for its precondition, say):
    /// an honest owner that cannot aggregate sends no result and signs no claim.
    CannotAggregate {
        /// The rule's error.
        why: String,
    },
}

impl std::fmt::Display for Proof {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Proof::Differs { element } => {
                write!(f, "its result differs from the replay at element {element}")
            }
            Proof::UnsignedInput { sender } => {
                write!(f, "it claims an input rank {sender} did not sign")
            }
            Proof::CannotAggregate { why } => {
                write!(f, "the rule cannot aggregate the inputs it claims: {why}")
            }
        }
    }
}

/// What every rank expects of an accusation in a round: its world, the shard's length and the
/// element size, and how commitments are cut. Decoding reads no length from the bytes that
/// these do not bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expect {
    /// The world size.
    pub n: usize,
    /// The elements of each shard, by shard (`chunk_range(d, n, s).len()`).
    pub d: usize,
    /// Bytes per element.
    pub elem: usize,
    /// Sub-chunks per shard.
    pub m: usize,
}

impl Expect {
    /// The elements of shard `s`.
    pub fn shard_len(&self, s: usize) -> usize {
        chunk_range(self.d, self.n, s).len()
    }

    /// The bytes of sub-chunk `j` of shard `s`.
    pub fn sub_bytes(&self, s: usize, j: usize) -> usize {
        sub_range(self.shard_len(s), self.m, j).len() * self.elem
    }

    /// The bytes of one rank's slot in what an owner sends an auditor of sub-chunks `subs` of
    /// its shard `s`, and in an accusation: presence, signature, leaves, sub-chunks.
    pub fn slot_len(&self, s: usize, subs: &[usize]) -> usize {
        1 + 64 + 32 * self.m + subs.iter().map(|&j| self.sub_bytes(s, j)).sum::<usize>()
    }

    /// The bytes of an accusation of sub-chunk `j` of shard `s` ([`Accusation::encode`]).
    pub fn accusation_len(&self, s: usize, j: usize) -> usize {
        24 + 64 + 32 * self.m + self.sub_bytes(s, j) + self.n * self.slot_len(s, &[j])
    }
}

/// The proof that an owner lied: its claim, and sub-chunk `sub` of its result and of every
/// input it claims to have aggregated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accusation {
    /// The owner's signed claim (with the senders' signed pieces).
    pub claim: OwnerClaim,
    /// The sub-chunk replayed.
    pub sub: usize,
    /// Sub-chunk `sub` of the owner's result.
    pub result: Vec<u8>,
    /// Sub-chunk `sub` of each input, in the claim's order.
    pub inputs: Vec<Vec<u8>>,
}

impl Accusation {
    /// The verdict on this accusation in `call`, any rank's alike: the lie it proves, or why
    /// it proves none. `replay` runs the round's rule over the inputs' bytes (in the claim's
    /// order) and returns the output's bytes ([`replay`]).
    ///
    /// # Errors
    /// [`Refuted`]: a signature that is not its rank's, bytes that are not what their leaves
    /// commit to, a replay that cannot run or that agrees with the owner.
    pub fn verify(
        &self,
        verifier: &dyn Verifier,
        call: &CallId,
        expect: &Expect,
        replay: impl FnOnce(&[&[u8]]) -> Result<Vec<u8>, String>,
    ) -> Result<Lie, Refuted> {
        let (claim, j) = (&self.claim, self.sub);
        // One owner per shard: owner `o` owns shard `o`.
        if claim.shard != claim.owner
            || claim.shard >= expect.n
            || j >= expect.m
            || self.inputs.len() != claim.inputs.len()
        {
            return Err(Refuted::Malformed(
                "owner, shard, sub-chunk or input count".into(),
            ));
        }
        let lie = |proof| Lie {
            owner: claim.owner,
            shard: claim.shard,
            sub: j,
            proof,
        };
        // The owner's signature covers its result, the inputs and their signatures: what
        // follows is what the owner itself vouched for.
        match claim.check(verifier, call, expect.n, expect.m) {
            None => {}
            Some(Refuted::InputSignature(sender)) => {
                return Ok(lie(Proof::UnsignedInput { sender }))
            }
            Some(why) => return Err(why),
        }
        let want = expect.sub_bytes(claim.shard, j);
        if self.result.len() != want || leaf(j, &self.result) != claim.result[j] {
            return Err(Refuted::Bytes("the owner's result".into()));
        }
        for (p, bytes) in claim.inputs.iter().zip(&self.inputs) {
            if bytes.len() != want || leaf(j, bytes) != p.leaves[j] {
                return Err(Refuted::Bytes(format!("rank {}'s input", p.sender)));
            }
        }
        let inputs: Vec<&[u8]> = self.inputs.iter().map(Vec::as_slice).collect();
        let replayed = match replay(&inputs) {
            Ok(r) => r,
            Err(why) => return Ok(lie(Proof::CannotAggregate { why })),
        };
        if replayed.len() != want {
            return Err(Refuted::Replay(format!(
                "{} bytes replayed for {want}",
                replayed.len()
            )));
        }
        let first = (0..want)
            .step_by(expect.elem.max(1))
            .find(|&b| replayed[b..b + expect.elem] != self.result[b..b + expect.elem]);
        match first {
            None => Err(Refuted::Agrees),
            Some(b) => Ok(lie(Proof::Differs {
                element: sub_range(expect.shard_len(claim.shard), expect.m, j).start
                    + b / expect.elem,
            })),
        }
    }

    /// The accusation's wire form, of a length every rank knows from the shard and the
    /// sub-chunk ([`Expect::accusation_len`]): owner, shard and sub-chunk (u64 each), the
    /// owner's signature and result leaves and sub-chunk, then one slot per rank of the world:
    /// a presence byte (1: the owner aggregated that rank's piece), the sender's signature,
    /// its leaves and its sub-chunk (all zero where absent).
    pub fn encode(&self, expect: &Expect) -> Vec<u8> {
        let c = &self.claim;
        let mut out = Vec::with_capacity(expect.accusation_len(c.shard, self.sub));
        for v in [c.owner, c.shard, self.sub] {
            out.extend_from_slice(&(v as u64).to_le_bytes());
        }
        out.extend_from_slice(&c.signature);
        c.result.iter().for_each(|l| out.extend_from_slice(l));
        out.extend_from_slice(&self.result);
        let want = self.result.len();
        for rank in 0..expect.n {
            match c.inputs.iter().position(|p| p.sender == rank) {
                Some(k) => {
                    let p = &c.inputs[k];
                    out.push(1);
                    out.extend_from_slice(&p.signature);
                    p.leaves.iter().for_each(|l| out.extend_from_slice(l));
                    out.extend_from_slice(&self.inputs[k]);
                }
                None => out.resize(out.len() + 1 + 64 + 32 * expect.m + want, 0),
            }
        }
        out
    }

    /// Reads an accusation's wire form, its length checked against `expect` before anything
    /// is read (a shard, sub-chunk or owner outside the world, a presence byte other than 0
    /// or 1, bytes short or left over: [`Refuted::Malformed`]).
    ///
    /// # Errors
    /// [`Refuted::Malformed`].
    pub fn decode(bytes: &[u8], expect: &Expect) -> Result<Self, Refuted> {
        let mut r = Reader(bytes);
        let owner = r.index(expect.n, "owner")?;
        let shard = r.index(expect.n, "shard")?;
        let sub = r.index(expect.m, "sub-chunk")?;
        if bytes.len() != expect.accusation_len(shard, sub) {
            return Err(Refuted::Malformed(format!(
                "{} bytes, expected {}",
                bytes.len(),
                expect.accusation_len(shard, sub)
            )));
        }
        let want = expect.sub_bytes(shard, sub);
        let signature = r.signature()?;
        let result_leaves = r.leaves(expect.m)?;
        let result = r.take(want)?.to_vec();
        let mut inputs = Vec::new();
        let mut subs = Vec::new();
        for sender in 0..expect.n {
            let present = r.take(1)?[0];
            let signature = r.signature()?;
            let leaves = r.leaves(expect.m)?;
            let sub_bytes = r.take(want)?;
            match present {
                0 => {}
                1 => {
                    subs.push(sub_bytes.to_vec());
                    inputs.push(SignedPiece {
                        sender,
                        leaves,
                        signature,
                    });
                }
                other => {
                    return Err(Refuted::Malformed(format!(
                        "presence byte {other} for rank {sender}"
                    )))
                }
            }
        }
        Ok(Accusation {
            claim: OwnerClaim {
                owner,
                shard,
                result: result_leaves,
                inputs,
                signature,
            },
            sub,
            result,
            inputs: subs,
        })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, k: usize) -> Result<&'a [u8], Refuted> {
        if self.0.len() < k {
            return Err(Refuted::Malformed(format!(
                "{} bytes where {k} more were expected",
                self.0.len()
            )));
        }
        let (head, rest) = self.0.split_at(k);
        self.0 = rest;
        Ok(head)
    }

    fn index(&mut self, bound: usize, what: &str) -> Result<usize, Refuted> {
        let v = u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes"));
        usize::try_from(v)
            .ok()
            .filter(|&v| v < bound)
            .ok_or_else(|| Refuted::Malformed(format!("{what} {v}, expected below {bound}")))
    }

    fn signature(&mut self) -> Result<Signature, Refuted> {
        Ok(self.take(64)?.try_into().expect("64 bytes"))
    }

    fn leaves(&mut self, m: usize) -> Result<Vec<Digest>, Refuted> {
        (0..m)
            .map(|_| Ok(self.take(32)?.try_into().expect("32 bytes")))
            .collect()
    }
}

/// The replay of a coordinate-wise `rule` over inputs given as bytes of `dtype` elements (the
/// [`Accusation::verify`] replay on the host): the output's bytes.
///
/// # Errors
/// The rule's, or inputs that are not whole elements of one length.
pub fn replay(rule: &dyn Aggregator, dtype: DType, inputs: &[&[u8]]) -> Result<Vec<u8>, String> {
    match dtype {
        DType::F32 => replay_as::<f32>(rule, inputs),
        DType::F64 => replay_as::<f64>(rule, inputs),
        DType::BF16 => replay_as::<half::bf16>(rule, inputs),
        DType::F16 => replay_as::<half::f16>(rule, inputs),
    }
}

fn replay_as<T: Element>(rule: &dyn Aggregator, inputs: &[&[u8]]) -> Result<Vec<u8>, String> {
    let size = std::mem::size_of::<T>();
    let len = inputs.first().map_or(0, |b| b.len());
    if inputs
        .iter()
        .any(|b| b.len() != len || !b.len().is_multiple_of(size))
    {
        return Err("inputs of different lengths or not whole elements".into());
    }
    // Copied: the bytes need not be aligned for `T`.
    let owned: Vec<Vec<T>> = inputs
        .iter()
        .map(|b| bytemuck::pod_collect_to_vec(b))
        .collect();
    let views: Vec<&[T]> = owned.iter().map(Vec::as_slice).collect();
    let mut out = vec![T::zeroed(); len / size];
    aggregate_into(rule, &views, &mut out).map_err(|e| e.to_string())?;
    Ok(bytemuck::cast_slice(&out).to_vec())
}

#[cfg(test)]
mod tests;
