//! The cross-check of [`Agreement::Detect`](crate::Agreement): what each rank tells the
//! others about its round (digests of its result and of the inputs it used) and how a rank
//! reads the others' messages.

use bytes::Bytes;

use crate::{AgreementReport, Error, Rank};

/// A digest in the cross-check: of a result (BLAKE3, 32 bytes), or of an input (XXH3-128 in
/// the first 16 bytes). Inputs only say which sender's vectors differed between ranks (a
/// difference a Byzantine sender hides behind a crafted collision still shows in the results'
/// BLAKE3 digests), and XXH3 hashes them several times faster.
pub type Digest = [u8; 32];

/// The digest of an input as the cross-check carries it (XXH3-128 of its bytes, unseeded, in
/// little-endian order).
pub fn input_digest<T: bytemuck::Pod>(v: &[T]) -> Digest {
    let mut d = [0u8; 32];
    d[..16]
        .copy_from_slice(&twox_hash::XxHash3_128::oneshot(bytemuck::cast_slice(v)).to_le_bytes());
    d
}

/// Whether two digests of the cross-check name one input (their XXH3-128 halves are equal);
/// `false` where either is missing.
pub(super) fn same_input(a: Option<Digest>, b: Option<Digest>) -> bool {
    matches!((a, b), (Some(a), Some(b)) if a[..16] == b[..16])
}

/// The commitment to an input under [`Agreement::Enforce`](crate::Agreement): BLAKE3 of its
/// bytes (hashed across threads past 1 MiB).
pub fn commitment<T: bytemuck::Pod>(v: &[T]) -> Digest {
    blake3_of(bytemuck::cast_slice(v))
}

/// BLAKE3 of `bytes`, hashed across rayon's threads past 1 MiB (a rank with idle cores hashes
/// a 64 MiB vector several times faster).
fn blake3_of(bytes: &[u8]) -> Digest {
    let mut hasher = blake3::Hasher::new();
    if bytes.len() > 1 << 20 {
        hasher.update_rayon(bytes);
    } else {
        hasher.update(bytes);
    }
    hasher.finalize().into()
}

/// What a rank aggregated, as digests (XXH3-128, [`input_digest`]): each rank's vector in
/// gather mode; in sharded mode with `r` owners per shard, each sender's piece of each shard
/// this rank owns (`r · n`, in the order of [`sharded::owned`](crate::schedule::sharded::owned); with `r = 1`, where no
/// co-owner compares them, a zero digest for each piece that arrived) and each owner's version of
/// each shard (`n · r`, in the order of [`sharded::owners`](crate::schedule::sharded::owners);
/// BLAKE3, which the result digest reuses). `None`: not received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seen {
    pub(crate) r: usize,
    /// The number of steps the round took (not sent).
    pub(crate) steps: u32,
    pub(crate) inputs: Vec<Option<Digest>>,
    pub(crate) pieces: Vec<Option<Digest>>,
    pub(crate) versions: Vec<Option<Digest>>,
}

impl Seen {
    pub(crate) fn new(n: usize, r: usize) -> Self {
        Seen {
            r,
            steps: 1,
            inputs: vec![None; n],
            pieces: vec![None; r * n],
            versions: vec![None; n * r],
        }
    }

    /// The digest of the senders whose piece of some owned shard this rank went without: what
    /// the ranks of a reduce-scatter compare, since each holds a different shard.
    pub(crate) fn erased_inputs_digest(&self, n: usize) -> Digest {
        let mut hasher = blake3::Hasher::new();
        for j in 0..n {
            if self.pieces.chunks_exact(n).any(|shard| shard[j].is_none()) {
                hasher.update(&(j as u64).to_le_bytes());
            }
        }
        hasher.finalize().into()
    }
}

/// One rank's cross-check. Each peer gets the part it can compare (`PROTOCOL.md`, "Agreement"),
/// so that a rank sends `O(r² n)` bytes in all rather than `O(r n²)`. Wire, from `a` to `b`:
/// `status u8` (1: a result), the result's BLAKE3 digest (32 bytes), then, each digest as
/// `present u8` and 16 bytes:
/// - gather mode (`r = 0`): every rank's input as `a` used it (`n`);
/// - for each shard both own, in ascending order: each sender's piece of it (`n` each);
/// - when `a` and `b` are neighbours on the ring (`b = a ± 1 mod n`): every owner's version of
///   every shard as `a` received it (`n · r`).
///
/// Where the recovery step follows, the round appends `a`'s commitment to its own input
/// (`Round::post_check`, `OWN_LEN`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Check {
    pub(crate) result: Option<Digest>,
    pub(crate) seen: Seen,
}

/// What rank `a`'s check to rank `b` carries besides the result (and what `b`'s to `a` does).
struct Parts {
    inputs: bool,
    /// Shards both own, ascending.
    shared: Vec<usize>,
    versions: bool,
}

impl Parts {
    fn between(a: Rank, b: Rank, n: usize, r: usize) -> Self {
        use crate::schedule::sharded::owned;
        let mut shared: Vec<usize> = owned(a, n, r)
            .filter(|s| owned(b, n, r).any(|t| t == *s))
            .collect();
        shared.sort_unstable();
        Parts {
            inputs: r == 0,
            shared,
            versions: r > 0 && (b == (a + 1) % n || a == (b + 1) % n),
        }
    }

    fn digests(&self, n: usize, r: usize) -> usize {
        usize::from(self.inputs) * n + self.shared.len() * n + usize::from(self.versions) * n * r
    }
}

impl Check {
    /// The length of rank `a`'s check to rank `b` (the same as `b`'s to `a`).
    pub(crate) fn len_between(a: Rank, b: Rank, n: usize, r: usize) -> usize {
        33 + 17 * Parts::between(a, b, n, r).digests(n, r)
    }

    /// This check (of rank `me`) as rank `to` gets it.
    #[cfg(test)]
    pub(crate) fn encode_for(&self, me: Rank, to: Rank) -> Bytes {
        let (n, r) = (self.seen.inputs.len(), self.seen.r);
        self.encode_parts(me, &Parts::between(me, to, n, r))
    }

    /// This check (of rank `me`) with `parts`.
    fn encode_parts(&self, me: Rank, parts: &Parts) -> Bytes {
        let seen = &self.seen;
        let (n, r) = (seen.inputs.len(), seen.r);
        let mut out = Vec::with_capacity(33 + 17 * parts.digests(n, r));
        out.push(u8::from(self.result.is_some()));
        out.extend_from_slice(&self.result.unwrap_or([0; 32]));
        let mut put = |d: &Option<Digest>| {
            out.push(u8::from(d.is_some()));
            out.extend_from_slice(&d.unwrap_or([0; 32])[..16]);
        };
        if parts.inputs {
            seen.inputs.iter().for_each(&mut put);
        }
        for &s in &parts.shared {
            let i = super::owned_index(me, s, n);
            seen.pieces[i * n..(i + 1) * n].iter().for_each(&mut put);
        }
        if parts.versions {
            seen.versions.iter().for_each(&mut put);
        }
        out.into()
    }

    /// This check (of rank `me`) as every rank gets it, by rank (empty at `me`). Ranks that
    /// get only the common part (every rank in gather mode) share one buffer.
    pub(crate) fn encode_for_all(&self, me: Rank) -> Vec<Bytes> {
        let (n, r) = (self.seen.inputs.len(), self.seen.r);
        let mut common: Option<Bytes> = None;
        (0..n)
            .map(|to| {
                if to == me {
                    return Bytes::new();
                }
                let parts = Parts::between(me, to, n, r);
                if parts.shared.is_empty() && !parts.versions {
                    common
                        .get_or_insert_with(|| self.encode_parts(me, &parts))
                        .clone()
                } else {
                    self.encode_parts(me, &parts)
                }
            })
            .collect()
    }

    /// Rank `from`'s check as rank `me` got it, with what it did not carry as `None`; `None`
    /// for a message that is not such a check (counted unconfirmed).
    pub(crate) fn decode_from(b: &[u8], from: Rank, me: Rank, n: usize, r: usize) -> Option<Self> {
        let parts = Parts::between(from, me, n, r);
        if b.len() != 33 + 17 * parts.digests(n, r) || b[0] > 1 {
            return None;
        }
        let digest = |bytes: &[u8]| {
            let mut d = [0u8; 32];
            d[..bytes.len()].copy_from_slice(bytes);
            d
        };
        let mut all = Vec::with_capacity(parts.digests(n, r));
        for chunk in b[33..].chunks_exact(17) {
            all.push(match chunk[0] {
                0 => None,
                1 => Some(digest(&chunk[1..])),
                _ => return None,
            });
        }
        let mut seen = Seen::new(n, r);
        let mut next = all.into_iter();
        if parts.inputs {
            seen.inputs = next.by_ref().take(n).collect();
        }
        for &s in &parts.shared {
            let k = super::owned_index(from, s, n);
            for (slot, d) in seen.pieces[k * n..(k + 1) * n]
                .iter_mut()
                .zip(next.by_ref())
            {
                *slot = d;
            }
        }
        if parts.versions {
            seen.versions = next.collect();
        }
        Some(Check {
            result: (b[0] == 1).then(|| digest(&b[1..33])),
            seen,
        })
    }
}

/// Reads the others' checks against this rank's (`same[p]`: rank `p` sent bytewise this
/// rank's check; otherwise `theirs[p]` is its check, `None` when it did not come or was not
/// one): the differences, or [`Error::Disagreement`] when fewer than `n − f` ranks (this one
/// included) hold this rank's result.
pub(crate) fn evaluate(
    me: Rank,
    n: usize,
    f: usize,
    mine: &Check,
    theirs: &[Option<Check>],
    same: &[bool],
) -> Result<AgreementReport, Error> {
    use crate::schedule::{direct_peers, sharded};
    let r = mine.seen.r;
    let mut found = AgreementReport::default();
    let mut agreeing = vec![me];
    for p in direct_peers(me, n) {
        if same[p] {
            agreeing.push(p);
            continue;
        }
        match theirs[p].as_ref().and_then(|c| c.result) {
            None => found.unconfirmed.push(p),
            Some(res) if Some(res) != mine.result => found.disagreeing.push(p),
            Some(_) => agreeing.push(p),
        }
    }
    // The check carries 16 bytes of each digest (the first: XXH3-128's whole, BLAKE3's
    // start), so a digest is compared on those.
    let differ = |a: Option<Digest>, b: Option<Digest>| matches!((a, b), (Some(a), Some(b)) if a[..16] != b[..16]);
    let mut differing_inputs: Vec<Rank> = Vec::new();
    for c in theirs.iter().flatten() {
        for j in 0..n {
            if differ(c.seen.inputs[j], mine.seen.inputs[j]) {
                differing_inputs.push(j);
            }
        }
    }
    if r == 0 {
        differing_inputs.sort_unstable();
        differing_inputs.dedup();
    }
    if r > 0 {
        // Co-owners compare the pieces each sender gave them of the shards both own, and
        // every rank compares the versions each owner sent it with those others got.
        let mine_owned: Vec<usize> = sharded::owned(me, n, r).collect();
        for (p, theirs) in theirs.iter().enumerate() {
            let Some(c) = theirs else { continue };
            for (k, s) in sharded::owned(p, n, r).enumerate() {
                let Some(i) = mine_owned.iter().position(|&t| t == s) else {
                    continue;
                };
                for j in 0..n {
                    if differ(c.seen.pieces[k * n + j], mine.seen.pieces[i * n + j]) {
                        differing_inputs.push(j);
                    }
                }
            }
            for (idx, (&a, &b)) in c.seen.versions.iter().zip(&mine.seen.versions).enumerate() {
                if differ(a, b) {
                    let (s, k) = (idx / r, idx % r);
                    found.differing_versions.push((s + k) % n);
                }
            }
        }
        differing_inputs.sort_unstable();
        differing_inputs.dedup();
        found.differing_versions.sort_unstable();
        found.differing_versions.dedup();
    }
    found.differing_inputs = differing_inputs;
    agreeing.sort_unstable();
    if agreeing.len() < n.saturating_sub(f) {
        return Err(Error::Disagreement {
            agreeing,
            disagreeing: found.disagreeing,
            unconfirmed: found.unconfirmed,
            differing_inputs: found.differing_inputs,
        });
    }
    Ok(found)
}

/// The digest of a result as the cross-check compares it (BLAKE3 of its bytes).
pub fn result_digest<T: bytemuck::Pod>(v: &[T]) -> Digest {
    blake3_of(bytemuck::cast_slice(v))
}

/// The digest of a sharded all-reduce's result (outside `Enforce`), as the cross-check
/// compares it: BLAKE3 of the shards' digests (each BLAKE3 of the shard's bytes, shards
/// ascending), so that ranks that hashed a shard's version to check it need not hash the
/// output again. Two results with one digest have the same shards unless BLAKE3 collides.
pub(crate) fn result_digest_of_shards<'d>(shards: impl Iterator<Item = &'d Digest>) -> Digest {
    let mut hasher = blake3::Hasher::new_derive_key("byzcoll sharded result v1");
    for d in shards {
        hasher.update(d);
    }
    hasher.finalize().into()
}

#[cfg(test)]
mod cross_check_tests {
    use super::*;

    fn digest(x: u8) -> Option<Digest> {
        Some(input_digest(&[x]))
    }

    /// The wire carries XXH3-128 as the reference implementation computes it (the values are
    /// the C library's, through Python's `xxhash.xxh3_128_intdigest`): ranks built with
    /// different hash crates must still compare equal inputs as equal. The lengths reach the
    /// short-input, mid-size and long (striped, SIMD) paths.
    #[test]
    fn input_digests_are_the_reference_xxh3_128() {
        let le = |x: u128| {
            let mut d = [0u8; 32];
            d[..16].copy_from_slice(&x.to_le_bytes());
            d
        };
        assert_eq!(
            input_digest::<u8>(&[]),
            le(0x99aa06d3014798d86001c324468d497f)
        );
        assert_eq!(
            input_digest(&[1.0f32, -2.5, 3.25, 0.0]),
            le(0x13558d844927ee9829f3b3319e63eaed)
        );
        let long: Vec<u8> = (0..10240).map(|i| (i % 256) as u8).collect();
        assert_eq!(input_digest(&long), le(0x1cb22534d0d96975c03d2231ab9348f3));
    }

    #[test]
    fn each_peer_gets_what_it_can_compare_and_malformed_checks_are_unconfirmed() {
        let (n, r) = (7, 3);
        let mut seen = Seen::new(n, r);
        for (i, d) in seen.pieces.iter_mut().enumerate() {
            *d = digest(i as u8);
        }
        for (i, d) in seen.versions.iter_mut().enumerate() {
            *d = digest(100 + i as u8);
        }
        let check = Check {
            result: Some([9; 32]),
            seen: seen.clone(),
        };
        // Rank 2 owns shards 2, 1, 0 and rank 3 owns 3, 2, 1: they share 1 and 2, and are
        // neighbours on the ring.
        let to3 = check.encode_for(2, 3);
        assert_eq!(to3.len(), Check::len_between(2, 3, n, r));
        assert_eq!(to3.len(), 33 + 17 * (2 * n + n * r));
        let got = Check::decode_from(&to3, 2, 3, n, r).unwrap();
        assert_eq!(got.result, Some([9; 32]));
        assert_eq!(got.seen.versions, seen.versions);
        for (k, s) in crate::schedule::sharded::owned(2, n, r).enumerate() {
            let shared = s == 1 || s == 2;
            for j in 0..n {
                let expected = if shared { seen.pieces[k * n + j] } else { None };
                assert_eq!(
                    got.seen.pieces[k * n + j],
                    expected,
                    "shard {s}, sender {j}"
                );
            }
        }
        // Rank 5 (shards 5, 4, 3) shares nothing with rank 2 and is not its neighbour.
        let to5 = check.encode_for(2, 5);
        assert_eq!(to5.len(), 33);
        let got = Check::decode_from(&to5, 2, 5, n, r).unwrap();
        assert_eq!(got.seen, Seen::new(n, r));
        // Lengths are symmetric, so each side knows what to wait for.
        for a in 0..n {
            for b in 0..n {
                assert_eq!(
                    Check::len_between(a, b, n, r),
                    Check::len_between(b, a, n, r)
                );
            }
        }
        // A bad status or flag, another length: not a cross-check.
        let mut bad = to3.to_vec();
        bad[0] = 2;
        assert_eq!(Check::decode_from(&bad, 2, 3, n, r), None);
        let mut bad = to3.to_vec();
        bad[33] = 7;
        assert_eq!(Check::decode_from(&bad, 2, 3, n, r), None);
        assert_eq!(Check::decode_from(&to3, 2, 5, n, r), None);
        // Gather mode: every rank's input digest to every peer.
        let mut seen = Seen::new(n, 0);
        seen.inputs[1] = digest(1);
        let gather = Check { result: None, seen };
        let bytes = gather.encode_for(0, 4);
        assert_eq!(bytes.len(), 33 + 17 * n);
        assert_eq!(Check::decode_from(&bytes, 0, 4, n, 0), Some(gather));
    }

    #[test]
    fn a_rank_sends_linear_bytes_in_the_world_size() {
        // n = 1024, r = 3: about 240 KiB per rank in all (it was 120 MiB with every digest
        // to every peer).
        let (n, r) = (1024, 3);
        let total: usize = (1..n).map(|p| Check::len_between(0, p, n, r)).sum();
        assert_eq!(total, 33 * (n - 1) + 17 * n * (r * (r - 1) + 2 * r));
        assert!(total < 256 << 10, "{total}");
    }
}
