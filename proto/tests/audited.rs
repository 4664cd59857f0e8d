//! Audited sharding (`PROTOCOL.md`, "Audited sharding") under the deterministic harness,
//! with real Ed25519 keys: honest worlds convict nobody and return the reference; an owner that
//! lies is convicted by every rank and its shard aggregated again, so every rank still returns
//! the reference; a forged proof is refuted and its sender named; rounds the audit cannot run
//! are refused up front.

#![allow(missing_docs, clippy::unwrap_used)]

mod harness;

use std::time::Duration;

use bytes::Bytes;
use byzcoll_aggregators::{aggregate_into, by_name, DType, Median};
use byzcoll_proto::audit::{Audit, CallId, Signature, Signer, Verifier};
use byzcoll_proto::round::{sign_pieces, AuditCtx, Carry, Round, Shape};
use byzcoll_proto::{Agreement, Error, Rank, Replicas};
use ed25519_dalek::{Signer as _, SigningKey, VerifyingKey};
use harness::{input, run_rounds, spec, Ended, Fate, TestPlane};

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
            k.verify_strict(message, &ed25519_dalek::Signature::from_bytes(signature))
                .is_ok()
        })
    }
}

const CALL: CallId = CallId {
    job: [5; 32],
    collective: 9,
};

fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn reference(inputs: &[Vec<f32>], rule: &Median) -> Vec<f32> {
    let refs: Vec<&[f32]> = inputs.iter().map(|v| &v[..]).collect();
    let mut out = vec![0f32; inputs[0].len()];
    aggregate_into(rule, &refs, &mut out).unwrap();
    out
}

/// One audited round of the median over `n` ranks of `d` elements; `liars` add 1.0 to their
/// results; `net` decides each message's fate.
fn audited(
    n: usize,
    d: usize,
    audit: Audit,
    liars: &[Rank],
    agreement: Agreement,
    net: &harness::Network<'_>,
) -> (Vec<Ended>, Vec<f32>) {
    let f = (n - 1) / 3;
    let rule = Median::new(f);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
    let keys: Vec<Key> = (0..n)
        .map(|r| Key(SigningKey::from_bytes(&[r as u8 + 1; 32])))
        .collect();
    let public = Keys(keys.iter().map(|k| k.0.verifying_key()).collect());
    let own: Vec<_> = (0..n)
        .map(|r| {
            sign_pieces(
                &keys[r],
                &CALL,
                r,
                n,
                &bytes_of(&inputs[r]),
                4,
                audit.sub_chunks,
            )
        })
        .collect();
    let planes = (0..n)
        .map(|r| {
            let p = TestPlane::new(r, n, inputs[r].clone());
            match liars.contains(&r) {
                true => p.lying(1.0),
                false => p,
            }
        })
        .collect();
    let make = |r: Rank| {
        let ctx = AuditCtx {
            audit,
            call: CALL,
            dtype: DType::F32,
            signer: &keys[r],
            verifier: &public,
            own: own[r].clone(),
            seed: [r as u8 + 100; 32],
        };
        Round::audited(
            spec(r, n, d, Shape::Sharded(Replicas::Exactly(1)), agreement),
            &rule,
            &Carry::default(),
            ctx,
        )
    };
    let ended = run_rounds(make, planes, &vec![Duration::ZERO; n], net);
    (ended, reference(&inputs, &rule))
}

/// `b` with its last byte changed, on time: a message a Byzantine rank forged.
fn last_byte_flipped(b: &Bytes) -> Fate {
    let mut forged = b.to_vec();
    if let Some(last) = forged.last_mut() {
        *last ^= 0x01;
    }
    Fate::Rewritten(Duration::from_micros(10), forged.into())
}

fn on_time(_: Rank, _: Rank, _: u32, _: u32, _: &Bytes) -> Fate {
    Fate::After(Duration::from_micros(10))
}

#[test]
fn honest_owners_are_audited_and_never_convicted() {
    for n in [1, 2, 3, 7, 8] {
        let d = 3 * n * 64 + 5;
        let (ended, want) = audited(n, d, Audit::default(), &[], Agreement::Detect, &on_time);
        for (r, e) in ended.iter().enumerate() {
            let report = e.result.as_ref().unwrap();
            let audit = report.audit.as_ref().unwrap();
            assert_eq!(bits(&e.output), bits(&want), "n {n} rank {r}");
            assert!(
                audit.convicted.is_empty() && audit.refused.is_empty(),
                "{audit:?}"
            );
            assert!(audit.false_accusers.is_empty() && report.faults.is_empty());
            // At 8 ranks and fewer, every rank audits every other owner.
            assert_eq!(audit.audited.len(), n - 1, "n {n} rank {r}");
        }
    }
}

#[test]
fn vectors_shorter_than_the_sub_chunks_or_the_world_are_audited_too() {
    // Empty shards and sub-chunks: nothing to replay there, and nothing goes wrong.
    for (n, d) in [(7, 0), (7, 3), (3, 5), (8, 64)] {
        let (ended, want) = audited(n, d, Audit::default(), &[], Agreement::Detect, &on_time);
        for (r, e) in ended.iter().enumerate() {
            let report = e
                .result
                .as_ref()
                .unwrap_or_else(|e| panic!("n {n} d {d} rank {r}: {e}"));
            assert_eq!(bits(&e.output), bits(&want), "n {n} d {d} rank {r}");
            assert!(report.audit.as_ref().unwrap().convicted.is_empty());
        }
    }
    // A liar is convicted even where its shard has fewer elements than sub-chunks: the
    // auditors ask only for sub-chunks with elements.
    let (ended, want) = audited(
        7,
        7 * 5,
        Audit::default(),
        &[3],
        Agreement::Detect,
        &on_time,
    );
    for e in &ended {
        let audit = e.result.as_ref().unwrap().audit.as_ref().unwrap();
        assert_eq!(bits(&e.output), bits(&want));
        let owners: Vec<Rank> = audit.convicted.iter().map(|l| l.owner).collect();
        assert_eq!(owners, vec![3]);
        assert!(audit
            .audited
            .iter()
            .all(|(_, subs)| subs.iter().all(|&j| j < 5)));
    }
}

#[test]
fn a_lying_owner_is_convicted_everywhere_and_its_shard_aggregated_again() {
    let n = 7;
    let d = n * 64 * 2;
    let (ended, want) = audited(n, d, Audit::default(), &[2], Agreement::Detect, &on_time);
    for (r, e) in ended.iter().enumerate() {
        let report = e
            .result
            .as_ref()
            .unwrap_or_else(|e| panic!("rank {r}: {e}"));
        let audit = report.audit.as_ref().unwrap();
        assert_eq!(
            bits(&e.output),
            bits(&want),
            "rank {r} returns the true median"
        );
        let owners: Vec<Rank> = audit.convicted.iter().map(|l| l.owner).collect();
        assert_eq!(owners, vec![2], "rank {r}");
        assert_eq!(audit.recomputed, vec![2], "rank {r}");
        assert!(audit.false_accusers.is_empty(), "rank {r}: {audit:?}");
    }
}

#[test]
fn a_lie_on_one_element_is_caught_where_every_sub_chunk_is_replayed() {
    // Every sub-chunk replayed: the audit is a full replication of each shard, and a lie on
    // any element is certain to be seen. (The odds of sparser audits: `Audit::escape_probability`.)
    let n = 4;
    let d = n * 16;
    let audit = Audit {
        sub_chunks: 16,
        samples: 16,
        owners: None,
    };
    let (ended, want) = audited(n, d, audit, &[1], Agreement::Detect, &on_time);
    for e in &ended {
        let audit = e.result.as_ref().unwrap().audit.as_ref().unwrap();
        assert_eq!(audit.convicted.len(), 1);
        assert_eq!(bits(&e.output), bits(&want));
    }
}

#[test]
fn a_forged_proof_is_refuted_and_its_sender_named() {
    // Owner 2 lies; rank 5's proofs reach the others with one byte of an input changed (as if
    // rank 5 forged them). The others' proofs convict owner 2; rank 5's are refuted.
    let n = 7;
    let d = n * 64;
    // Steps: scatter 0, versions 1, requests 2, audit data 3, verdicts 4, proofs 5.
    let net = |from: Rank, _to: Rank, step: u32, _tag: u32, b: &Bytes| match from == 5 && step == 5
    {
        true => last_byte_flipped(b),
        false => Fate::After(Duration::from_micros(10)),
    };
    let (ended, want) = audited(n, d, Audit::default(), &[2], Agreement::Detect, &net);
    for (r, e) in ended.iter().enumerate() {
        if r == 5 {
            continue;
        }
        let report = e
            .result
            .as_ref()
            .unwrap_or_else(|e| panic!("rank {r}: {e}"));
        let audit = report.audit.as_ref().unwrap();
        assert_eq!(bits(&e.output), bits(&want), "rank {r}");
        assert_eq!(audit.convicted.len(), 1, "rank {r}");
        let named: Vec<Rank> = audit.false_accusers.iter().map(|(a, _)| *a).collect();
        assert_eq!(named, vec![5], "rank {r}: {audit:?}");
        assert!(report.faults.iter().any(|f| f.rank == 5), "rank {r}");
    }
}

#[test]
fn rounds_the_audit_cannot_run_are_refused_up_front() {
    let n = 4;
    let d = n * 64;
    let (ended, _) = audited(n, d, Audit::default(), &[], Agreement::Enforce, &on_time);
    for e in &ended {
        match &e.result {
            Err(Error::InvalidUsage(why)) => assert!(why.contains("Detect"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
    let bad = Audit {
        sub_chunks: 4,
        samples: 5,
        owners: None,
    };
    let (ended, _) = audited(n, d, bad, &[], Agreement::Detect, &on_time);
    assert!(ended
        .iter()
        .all(|e| matches!(&e.result, Err(Error::InvalidUsage(_)))));
    // A rule that is not coordinate-wise cannot be replayed on a sub-chunk.
    let krum = by_name("krum", 0).unwrap();
    let keys = Key(SigningKey::from_bytes(&[1; 32]));
    let public = Keys(vec![keys.0.verifying_key()]);
    let round: Round<'_, Bytes> = Round::audited(
        spec(
            0,
            1,
            64,
            Shape::Sharded(Replicas::Exactly(1)),
            Agreement::Detect,
        ),
        &*krum,
        &Carry::default(),
        AuditCtx {
            audit: Audit::default(),
            call: CALL,
            dtype: DType::F32,
            signer: &keys,
            verifier: &public,
            own: sign_pieces(&keys, &CALL, 0, 1, &[0; 256], 4, 64),
            seed: [0; 32],
        },
    );
    assert!(round.has_failed());
}

#[test]
fn a_result_the_owner_did_not_sign_is_not_taken() {
    // Owner 2's result reaches rank 0 changed (an owner that signs one result and sends
    // another): rank 0 does not take it, and the shard is lost there, loudly; the others take
    // the signed one.
    let n = 4;
    let d = n * 64;
    let net = |from: Rank, to: Rank, step: u32, tag: u32, b: &Bytes| {
        if from == 2 && to == 0 && step == 1 && tag == 2 {
            let mut other = b.to_vec();
            other[0] ^= 0x40;
            return Fate::Rewritten(Duration::from_micros(10), other.into());
        }
        Fate::After(Duration::from_micros(10))
    };
    let (ended, want) = audited(n, d, Audit::default(), &[], Agreement::Detect, &net);
    match &ended[0].result {
        Err(Error::ShardLost {
            shard: 2, faults, ..
        }) => {
            assert!(faults.iter().any(|f| f.rank == 2), "{faults:?}");
        }
        other => panic!("{other:?}"),
    }
    for (r, e) in ended.iter().enumerate().skip(1) {
        let report = e.result.as_ref().unwrap();
        assert_eq!(bits(&e.output), bits(&want), "rank {r}: {report:?}");
        // Rank 0 walked the audit's steps like everyone: nobody counts it at fault.
        assert!(
            report.faults.iter().all(|f| f.rank != 0),
            "rank {r}: {report:?}"
        );
    }
}

#[test]
fn a_liar_that_will_not_be_audited_has_its_shard_aggregated_again() {
    // Owner 2 lies, then withholds or spoils its audit data (step 3): no proof can be made,
    // so the auditors say so in their verdicts and every rank aggregates shard 2 again from
    // every rank's piece. The lie never reaches a result.
    let n = 7;
    let d = n * 64;
    for spoil in [false, true] {
        let net = move |from: Rank, _to: Rank, step: u32, _tag: u32, b: &Bytes| match (
            from == 2 && step == 3,
            spoil,
        ) {
            (true, false) => Fate::Dropped,
            (true, true) => last_byte_flipped(b),
            (false, _) => Fate::After(Duration::from_micros(10)),
        };
        let (ended, want) = audited(n, d, Audit::default(), &[2], Agreement::Detect, &net);
        for (r, e) in ended.iter().enumerate() {
            if r == 2 {
                continue;
            }
            let report = e
                .result
                .as_ref()
                .unwrap_or_else(|e| panic!("rank {r}: {e}"));
            let audit = report.audit.as_ref().unwrap();
            assert_eq!(bits(&e.output), bits(&want), "spoil {spoil} rank {r}");
            assert_eq!(
                audit.recomputed,
                vec![2],
                "spoil {spoil} rank {r}: {audit:?}"
            );
            assert_eq!(audit.refused, vec![2], "spoil {spoil} rank {r}: {audit:?}");
        }
    }
}
