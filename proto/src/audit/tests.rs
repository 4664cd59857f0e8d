//! The evidence against real Ed25519 keys: honest owners are never convicted, liars always are
//! on a sub-chunk they lied on, and every way of forging a proof is refuted.

#![allow(clippy::unwrap_used)]

use byzcoll_aggregators::{by_name, DType};
use ed25519_dalek::{Signer as _, SigningKey, Verifier as _, VerifyingKey};

use super::*;

struct Key(SigningKey);

impl Signer for Key {
    fn sign(&self, message: &[u8]) -> Signature {
        self.0.sign(message).to_bytes()
    }
}

struct Keys(Vec<VerifyingKey>);

impl Verifier for Keys {
    fn verify(&self, rank: Rank, message: &[u8], signature: &Signature) -> bool {
        self.0.get(rank).is_some_and(|k| {
            k.verify(message, &ed25519_dalek::Signature::from_bytes(signature))
                .is_ok()
        })
    }
}

const N: usize = 5;
const D: usize = 5 * 37; // 37 elements per shard: sub-chunks of 2 and 3 elements
const M: usize = 16;
const CALL: CallId = CallId {
    job: [7; 32],
    collective: 42,
};

fn keys() -> (Vec<Key>, Keys) {
    let signing: Vec<SigningKey> = (0..N as u8)
        .map(|r| SigningKey::from_bytes(&[r + 1; 32]))
        .collect();
    let public = Keys(signing.iter().map(SigningKey::verifying_key).collect());
    (signing.into_iter().map(Key).collect(), public)
}

fn expect() -> Expect {
    Expect {
        n: N,
        d: D,
        elem: 4,
        m: M,
    }
}

/// Rank `p`'s piece of shard `s`: distinct values, one outlier rank.
fn piece(p: usize, s: usize) -> Vec<f32> {
    let len = expect().shard_len(s);
    (0..len)
        .map(|i| match p {
            4 => 1e6,
            _ => (p * 100 + s * 10) as f32 + i as f32 * 0.25,
        })
        .collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn median() -> Box<dyn Aggregator> {
    by_name("median", 1).unwrap()
}

/// Owner `o`'s signed claim for shard `o` over every rank's piece, its result `result` (the
/// true median where `lie` is `None`; otherwise with element `lie` changed).
fn claim(keys: &[Key], o: usize, lie: Option<usize>) -> (OwnerClaim, Vec<Vec<u8>>, Vec<u8>) {
    let pieces: Vec<Vec<u8>> = (0..N).map(|p| bytes(&piece(p, o))).collect();
    let signed: Vec<SignedPiece> = (0..N)
        .map(|p| SignedPiece::sign(&keys[p], &CALL, p, o, &pieces[p], 4, M))
        .collect();
    let views: Vec<&[u8]> = pieces.iter().map(Vec::as_slice).collect();
    let mut result = replay(&*median(), DType::F32, &views).unwrap();
    if let Some(e) = lie {
        result[e * 4] ^= 0x01;
    }
    let c = OwnerClaim::sign(&keys[o], &CALL, o, o, &result, 4, M, signed);
    (c, pieces, result)
}

fn accuse(c: &OwnerClaim, pieces: &[Vec<u8>], result: &[u8], j: usize) -> Accusation {
    let r = sub_range(expect().shard_len(c.shard), M, j);
    let cut = |b: &[u8]| b[r.start * 4..r.end * 4].to_vec();
    Accusation {
        claim: c.clone(),
        sub: j,
        result: cut(result),
        inputs: c.inputs.iter().map(|p| cut(&pieces[p.sender])).collect(),
    }
}

fn verdict(a: &Accusation, public: &Keys) -> Result<Lie, Refuted> {
    let rule = median();
    a.verify(public, &CALL, &expect(), |inputs| {
        replay(&*rule, DType::F32, inputs)
    })
}

#[test]
fn an_honest_owner_is_never_convicted() {
    let (keys, public) = keys();
    for o in 0..N {
        let (c, pieces, result) = claim(&keys, o, None);
        assert_eq!(c.check(&public, &CALL, N, M), None);
        for j in 0..M {
            let a = accuse(&c, &pieces, &result, j);
            assert_eq!(
                verdict(&a, &public),
                Err(Refuted::Agrees),
                "owner {o} sub {j}"
            );
        }
    }
}

#[test]
fn a_lie_is_proven_on_its_sub_chunk_and_only_there() {
    let (keys, public) = keys();
    let lied = 20;
    let (c, pieces, result) = claim(&keys, 2, Some(lied));
    let at = (0..M)
        .find(|&j| sub_range(expect().shard_len(2), M, j).contains(&lied))
        .unwrap();
    for j in 0..M {
        let v = verdict(&accuse(&c, &pieces, &result, j), &public);
        if j == at {
            let want = Lie {
                owner: 2,
                shard: 2,
                sub: j,
                proof: Proof::Differs { element: lied },
            };
            assert_eq!(v, Ok(want));
        } else {
            assert_eq!(v, Err(Refuted::Agrees), "sub {j}");
        }
    }
}

#[test]
fn every_way_of_framing_an_honest_owner_is_refuted() {
    let (keys, public) = keys();
    let (c, pieces, result) = claim(&keys, 1, None);
    let honest = accuse(&c, &pieces, &result, 3);
    // Another result than the one the owner committed to.
    let mut a = honest.clone();
    a.result[0] ^= 1;
    assert_eq!(
        verdict(&a, &public),
        Err(Refuted::Bytes("the owner's result".into()))
    );
    // An input's bytes changed.
    let mut a = honest.clone();
    a.inputs[4][0] ^= 1;
    assert_eq!(
        verdict(&a, &public),
        Err(Refuted::Bytes("rank 4's input".into()))
    );
    // An input swapped for another piece its sender signed (it equivocated): the owner's
    // signature covers the inputs it used.
    let mut a = honest.clone();
    let other = bytes(&vec![-5.0; expect().shard_len(1)]);
    a.claim.inputs[4] = SignedPiece::sign(&keys[4], &CALL, 4, 1, &other, 4, M);
    a.inputs[4] = other[..a.inputs[4].len()].to_vec();
    assert_eq!(verdict(&a, &public), Err(Refuted::OwnerSignature));
    // An input left out, or the result's leaves changed.
    let mut a = honest.clone();
    a.claim.inputs.remove(0);
    a.inputs.remove(0);
    assert_eq!(verdict(&a, &public), Err(Refuted::OwnerSignature));
    let mut a = honest.clone();
    a.claim.result[3] = leaf(3, &a.result[..4]);
    assert_eq!(verdict(&a, &public), Err(Refuted::OwnerSignature));
    // A claim the accuser signed itself in the owner's name.
    let mut a = honest.clone();
    a.claim = OwnerClaim::sign(
        &keys[0],
        &CALL,
        1,
        1,
        &result,
        4,
        M,
        honest.claim.inputs.clone(),
    );
    assert_eq!(verdict(&a, &public), Err(Refuted::OwnerSignature));
    // The owner's genuine claim from another call.
    let other_call = CallId {
        collective: 43,
        ..CALL
    };
    assert_eq!(
        honest.verify(&public, &other_call, &expect(), |_| unreachable!()),
        Err(Refuted::OwnerSignature)
    );
    // The honest accusation itself proves nothing.
    assert_eq!(verdict(&honest, &public), Err(Refuted::Agrees));
}

#[test]
fn an_owner_cannot_sign_for_its_senders() {
    let (keys, public) = keys();
    let (c, pieces, _) = claim(&keys, 3, None);
    // The owner makes up rank 0's input and signs the claim over it.
    let mut inputs = c.inputs.clone();
    inputs[0] = SignedPiece::sign(&keys[3], &CALL, 0, 3, &pieces[0], 4, M);
    let forged = OwnerClaim::sign(&keys[3], &CALL, 3, 3, &pieces[1], 4, M, inputs);
    assert_eq!(
        forged.check(&public, &CALL, N, M),
        Some(Refuted::InputSignature(0))
    );
    // A piece checked against its sender's commitment, as an owner does before aggregating.
    let p = &c.inputs[2];
    assert!(p.matches(&pieces[2], 4));
    let mut changed = pieces[2].clone();
    changed[7] ^= 0x80;
    assert!(!p.matches(&changed, 4));
}

#[test]
fn accusations_round_trip_and_bad_bytes_are_malformed_without_panic() {
    let (keys, _) = keys();
    let (c, pieces, result) = claim(&keys, 0, Some(3));
    let a = accuse(&c, &pieces, &result, 1);
    let wire = a.encode(&expect());
    assert_eq!(Accusation::decode(&wire, &expect()).unwrap(), a);
    // Every truncation, and a byte more.
    for k in 0..wire.len() {
        assert!(matches!(
            Accusation::decode(&wire[..k], &expect()),
            Err(Refuted::Malformed(_))
        ));
    }
    let mut longer = wire.clone();
    longer.push(0);
    assert!(matches!(
        Accusation::decode(&longer, &expect()),
        Err(Refuted::Malformed(_))
    ));
    // Indices past the world and a presence byte other than 0 or 1.
    let presence = 24 + 64 + 32 * M + expect().sub_bytes(0, 1);
    for (at, v) in [(0, N as u64), (8, u64::MAX), (16, M as u64), (presence, 2)] {
        let mut bad = wire.clone();
        if at == presence {
            bad[at] = v as u8;
        } else {
            bad[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        assert!(matches!(
            Accusation::decode(&bad, &expect()),
            Err(Refuted::Malformed(_))
        ));
    }
}

#[test]
fn a_sub_chunk_replays_bitwise_as_the_whole_shard_aggregates() {
    // Audits rely on it: a coordinate-wise rule's output on a sub-chunk is that sub-chunk of
    // its output on the whole shard, in every element type.
    let len = 1000;
    for name in ["median", "trimmed-mean", "mean"] {
        let rule = by_name(name, 1).unwrap();
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let e = dtype.size();
            let inputs: Vec<Vec<u8>> = (0..7u32)
                .map(|p| {
                    (0..len * e)
                        .map(|i| {
                            ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(p * 97) >> 13)
                                as u8
                                & 0x3f
                        })
                        .collect()
                })
                .collect();
            let views: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
            let whole = replay(&*rule, dtype, &views).unwrap();
            for j in 0..M {
                let r = sub_range(len, M, j);
                let cut: Vec<&[u8]> = views.iter().map(|v| &v[r.start * e..r.end * e]).collect();
                let part = replay(&*rule, dtype, &cut).unwrap();
                assert_eq!(
                    part,
                    whole[r.start * e..r.end * e],
                    "{name} {dtype:?} sub {j}"
                );
            }
        }
    }
}

#[test]
fn the_escape_probability_matches_its_derivation_and_a_monte_carlo() {
    let audit = Audit::default();
    // Lying on every coordinate: any audit catches it. At 8 ranks every other rank audits
    // every owner; at 64 and 1024 a few owners each meet the target.
    assert_eq!(audit.owners_per_rank(8, 2), 7);
    assert_eq!(audit.escape_probability(8, 2, 1.0, 1), 0.0);
    for (n, f) in [(64, 21), (1024, 341), (1024, 1)] {
        let k = audit.owners_per_rank(n, f);
        assert!(
            audit.escape_probability(n, f, 1.0, 1) <= AUDIT_TARGET,
            "{n} {f}"
        );
        let fewer = Audit {
            owners: Some(k - 1),
            ..audit
        };
        assert!(
            fewer.escape_probability(n, f, 1.0, 1) > AUDIT_TARGET,
            "{n} {f}"
        );
        assert!(k < n / 2, "{n} {f}: {k}");
    }
    // One audited owner per rank, one sample, a lie on a quarter of the sub-chunks:
    // (1 − 1/7 · 1/4)^(6·2).
    let one = Audit {
        sub_chunks: 16,
        owners: Some(1),
        samples: 1,
    };
    let p = one.escape_probability(8, 2, 0.25, 2);
    assert!((p - (1.0 - 1.0 / 28.0f64).powi(12)).abs() < 1e-12, "{p}");
    // A Monte Carlo of the same audits (a fixed xorshift, 200 000 rounds) agrees within 1 %.
    let audit = Audit {
        sub_chunks: 16,
        owners: Some(2),
        samples: 3,
    };
    let (n, honest, lied) = (8usize, 5usize, 2usize);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |k: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % k as u64) as usize
    };
    let trials = 200_000;
    let mut escaped = 0;
    for _ in 0..trials {
        // The liar is owner 0 and lies on sub-chunks 0..lied; the auditors are ranks 1..=honest.
        let caught = (0..honest).any(|_| {
            let mut owners: Vec<usize> = (1..n).collect();
            let mut chosen = Vec::new();
            for _ in 0..2 {
                chosen.push(owners.swap_remove(next(owners.len())));
            }
            // An auditor is not the liar; the others' owners are 1..n relabelled with 0.
            let picked_liar = chosen.contains(&(n - 1));
            let mut subs: Vec<usize> = (0..audit.sub_chunks).collect();
            let hit = (0..audit.samples).any(|_| subs.swap_remove(next(subs.len())) < lied);
            picked_liar && hit
        });
        escaped += usize::from(!caught);
    }
    let measured = escaped as f64 / f64::from(trials);
    let derived = audit.escape_probability(n, n - honest, lied as f64 / 16.0, 1);
    assert!(
        (measured - derived).abs() < 0.01,
        "measured {measured}, derived {derived}"
    );
}

#[test]
fn what_an_owner_signs_and_no_honest_owner_would_is_proven_too() {
    let (keys, public) = keys();
    let (c, pieces, result) = claim(&keys, 2, None);
    // An input whose signature its sender never made, in a claim the owner signed over it.
    let mut inputs = c.inputs.clone();
    inputs[1].signature[5] ^= 1;
    let unsigned = OwnerClaim::sign(&keys[2], &CALL, 2, 2, &result, 4, M, inputs);
    let v = verdict(&accuse(&unsigned, &pieces, &result, 0), &public);
    assert_eq!(v.map(|l| l.proof), Ok(Proof::UnsignedInput { sender: 1 }));
    // The same change made by an accuser breaks the owner's signature instead: no framing.
    let mut a = accuse(&c, &pieces, &result, 0);
    a.claim.inputs[1].signature[5] ^= 1;
    assert_eq!(verdict(&a, &public), Err(Refuted::OwnerSignature));
    // Too few inputs for the rule (f = 1 needs three): an honest owner sends no result.
    let few = c.inputs[..2].to_vec();
    let short = OwnerClaim::sign(&keys[2], &CALL, 2, 2, &result, 4, M, few);
    let v = verdict(&accuse(&short, &pieces, &result, 0), &public);
    assert!(
        matches!(
            v.as_ref().map(|l| &l.proof),
            Ok(Proof::CannotAggregate { .. })
        ),
        "{v:?}"
    );
    // An owner is accused on its own shard only.
    let mut other = accuse(&c, &pieces, &result, 0);
    other.claim.owner = 3;
    assert!(matches!(
        verdict(&other, &public),
        Err(Refuted::Malformed(_))
    ));
}
