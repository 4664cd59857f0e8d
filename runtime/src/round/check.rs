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

/// The digest of an input as the cross-check carries it (XXH3-128 of its bytes).
pub fn input_digest<T: bytemuck::Pod>(v: &[T]) -> Digest {
    let mut d = [0u8; 32];
    d[..16].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(bytemuck::cast_slice(v)).to_le_bytes());
    d
}

/// The commitment to an input under [`Agreement::Enforce`](crate::Agreement): BLAKE3 of its
/// bytes (hashed across threads past 1 MiB).
pub fn commitment<T: bytemuck::Pod>(v: &[T]) -> Digest {
    let bytes: &[u8] = bytemuck::cast_slice(v);
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
/// this rank owns (`r · n`, in the order of [`sharded::owned`](crate::schedule::sharded::owned)) and each owner's version of
/// each shard (`n · r`, in the order of [`sharded::owners`](crate::schedule::sharded::owners)). `None`: not received.
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

/// One rank's cross-check message. Wire: `status u8` (1: a result), the result's BLAKE3
/// digest (32 bytes), then every digest of [`Seen`] as `present u8` and 16 bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Check {
    pub(crate) result: Option<Digest>,
    pub(crate) seen: Seen,
}

impl Check {
    pub(crate) fn len(n: usize, r: usize) -> usize {
        33 + 17 * (n + 2 * r * n)
    }

    pub(crate) fn encode(&self) -> Bytes {
        let seen = &self.seen;
        let n = seen.inputs.len();
        let mut out = Vec::with_capacity(Self::len(n, seen.r));
        out.push(u8::from(self.result.is_some()));
        out.extend_from_slice(&self.result.unwrap_or([0; 32]));
        for d in seen.inputs.iter().chain(&seen.pieces).chain(&seen.versions) {
            out.push(u8::from(d.is_some()));
            out.extend_from_slice(&d.unwrap_or([0; 32])[..16]);
        }
        out.into()
    }

    /// `None` for a message that is not a cross-check of a world of `n` with `r` owners per
    /// shard (counted unconfirmed).
    pub(crate) fn decode(b: &[u8], n: usize, r: usize) -> Option<Self> {
        if b.len() != Self::len(n, r) || b[0] > 1 {
            return None;
        }
        let digest = |bytes: &[u8]| {
            let mut d = [0u8; 32];
            d[..bytes.len()].copy_from_slice(bytes);
            d
        };
        let mut all = Vec::with_capacity(n + 2 * r * n);
        for chunk in b[33..].chunks_exact(17) {
            all.push(match chunk[0] {
                0 => None,
                1 => Some(digest(&chunk[1..])),
                _ => return None,
            });
        }
        let versions = all.split_off(n + r * n);
        let pieces = all.split_off(n);
        Some(Check {
            result: (b[0] == 1).then(|| digest(&b[1..33])),
            seen: Seen {
                r,
                steps: 1,
                inputs: all,
                pieces,
                versions,
            },
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
    let differ =
        |a: Option<Digest>, b: Option<Digest>| matches!((a, b), (Some(a), Some(b)) if a != b);
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
    blake3::hash(bytemuck::cast_slice(v)).into()
}

#[cfg(test)]
mod cross_check_tests {
    use super::*;

    #[test]
    fn checks_round_trip_and_malformed_ones_are_unconfirmed() {
        let (n, r) = (5, 3);
        let mut seen = Seen::new(n, r);
        seen.inputs[1] = Some(input_digest(&[1.0f32, 2.0]));
        seen.pieces[4] = Some(input_digest(&[3u8]));
        seen.versions[n * r - 1] = Some(input_digest(&[4u8]));
        let check = Check {
            result: Some([9; 32]),
            seen,
        };
        let bytes = check.encode();
        assert_eq!(bytes.len(), Check::len(n, r));
        assert_eq!(Check::decode(&bytes, n, r), Some(check.clone()));
        // Another world or replication, a bad status or flag: not a cross-check.
        assert_eq!(Check::decode(&bytes, n, r - 1), None);
        let mut bad = bytes.to_vec();
        bad[0] = 2;
        assert_eq!(Check::decode(&bad, n, r), None);
        let mut bad = bytes.to_vec();
        bad[33] = 7;
        assert_eq!(Check::decode(&bad, n, r), None);
        let none = Check {
            result: None,
            seen: Seen::new(n, 0),
        };
        assert_eq!(Check::decode(&none.encode(), n, 0), Some(none));
    }
}
