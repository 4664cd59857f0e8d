//! Audited sharding (`Policy::Audited`, `PROTOCOL.md`, "Audited sharding") over the real
//! transport, with the identity keys its membership holds: honest worlds of every size return
//! the gather-mode result and convict nobody; a lying owner is convicted by every rank, and
//! its shard aggregated again, so every rank still returns the honest result.

use std::future::Future;
use std::time::Duration;

use byzcoll_aggregators::Median;
use byzcoll_runtime::audit::Audit;
use byzcoll_runtime::{Communicator, OwnerTamper, Policy, RoundReport, Transport};

use crate::harness::{bits, comms, reference, run_ranks, vector};
use crate::WORLD_SIZES;

/// This rank's audited median of its test vector of `d` elements, tolerating `f`: the report
/// and the result.
async fn audited_round(
    c: &mut Communicator,
    d: usize,
    f: usize,
) -> (byzcoll_runtime::Result<RoundReport>, Vec<f32>) {
    let mut v = vector(c.rank(), d);
    let report = c
        .robust_all_reduce(&mut v, &Median::new(f), Policy::Audited(Audit::default()))
        .await;
    (report, v)
}

/// At every world size, with a vector of three sub-rounds: every rank returns the gather-mode
/// median bitwise, audited every other owner (8 ranks and fewer), and convicted nobody. Every
/// transport of the suite keeps the membership its ranks were set up with.
pub async fn audited_rounds_of_honest_owners_match_gather<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    for n in WORLD_SIZES {
        let f = (n - 1) / 3;
        let d = 2 * 1000 + 3 * n;
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| vector(r, d)).collect();
        let want = bits(&reference(&Median::new(f), &inputs));
        let comms = comms(factory(n).await, Duration::from_secs(20));
        assert!(
            comms.iter().all(|c| c.transport().membership().is_some()),
            "a transport without the job's membership cannot audit"
        );
        let results = run_ranks(comms, move |mut c| async move {
            c.set_sub_round_bytes(4000);
            audited_round(&mut c, d, f).await
        })
        .await;
        for (r, (report, v)) in results.into_iter().enumerate() {
            let report = report.unwrap_or_else(|e| panic!("n {n} rank {r}: {e}"));
            assert_eq!(bits(&v), want, "n {n} rank {r}");
            let audit = report.audit.unwrap();
            assert!(
                audit.convicted.is_empty() && audit.refused.is_empty(),
                "{audit:?}"
            );
            // Sub-rounds of 4000 bytes, each auditing every other owner.
            let parts = (4 * d).div_ceil(4000);
            assert_eq!(
                audit.audited.len(),
                parts * (n - 1),
                "n {n} rank {r}: {audit:?}"
            );
        }
    }
}

/// Seven ranks, f = 2; rank 5 lies as a shard owner (its result's signs flipped and scaled,
/// alike to every taker, and signed so). Every rank convicts it, aggregates its shard again
/// from every rank's piece, and returns the honest median bitwise: the price of the lie is
/// its conviction, not a wrong result.
pub async fn an_audited_owner_that_lies_is_convicted_and_its_shard_recomputed<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, f, d) = (7usize, 2usize, 7 * 64 * 3 + 5);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| vector(r, d)).collect();
    let honest = bits(&reference(&Median::new(f), &inputs));
    let comms = comms(factory(n).await, Duration::from_secs(20));
    let results = run_ranks(comms, move |mut c| async move {
        if c.rank() == 5 {
            let lie: OwnerTamper = std::sync::Arc::new(|_s: usize, _dest: usize, b: &[u8]| {
                b.chunks_exact(4)
                    .flat_map(|x| {
                        (-1000.0 * f32::from_le_bytes([x[0], x[1], x[2], x[3]])).to_le_bytes()
                    })
                    .collect::<Vec<u8>>()
                    .into()
            });
            c.inject_owner_fault(Some(lie));
        }
        audited_round(&mut c, d, f).await
    })
    .await;
    for (r, (report, v)) in results.into_iter().enumerate() {
        let report = report.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(bits(&v), honest, "rank {r} returns the honest median");
        let audit = report.audit.unwrap();
        let convicted: Vec<usize> = audit.convicted.iter().map(|l| l.owner).collect();
        assert_eq!(convicted, vec![5], "rank {r}: {audit:?}");
        assert_eq!(audit.recomputed, vec![5], "rank {r}");
        assert!(audit.false_accusers.is_empty(), "rank {r}: {audit:?}");
    }
}

/// After a round that convicts owner 5 (as above), a shrink ejects it: the other six ranks
/// keep each other and renumber, rank 5 learns it was excluded, and the six go on auditing:
/// their communicator's roster is the parent's renumbered as they are, so an audited round of
/// theirs returns the gather-mode median of their six vectors bitwise and convicts nobody.
pub async fn a_convicted_owner_is_ejected_by_a_shrink<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, f, d) = (7usize, 2usize, 7 * 64);
    let comms = comms(factory(n).await, Duration::from_secs(20));
    let results = run_ranks(comms, move |mut c| async move {
        if c.rank() == 5 {
            let lie: OwnerTamper = std::sync::Arc::new(|_s: usize, _dest: usize, b: &[u8]| {
                b.iter().map(|x| x ^ 0x40).collect::<Vec<u8>>().into()
            });
            c.inject_owner_fault(Some(lie));
        }
        audited_round(&mut c, d, f).await.0.unwrap();
        let convicted: Vec<usize> = c
            .health()
            .iter()
            .filter(|p| p.convicted > 0)
            .map(|p| p.rank)
            .collect();
        let shrunk = c.shrink().await;
        let after = match shrunk {
            Ok(mut s) => {
                let mut v = vector(s.rank(), d);
                let audited = s
                    .robust_all_reduce(&mut v, &Median::new(1), Policy::Audited(Audit::default()))
                    .await;
                Ok((
                    s.size(),
                    audited.map(|r| (r, bits(&v))).map_err(|e| e.to_string()),
                ))
            }
            Err(e) => Err(e.to_string()),
        };
        (c.rank(), convicted, after)
    })
    .await;
    let six: Vec<Vec<f32>> = (0..6).map(|r| vector(r, d)).collect();
    let want = bits(&reference(&Median::new(1), &six));
    for (r, convicted, after) in results {
        if r == 5 {
            assert!(
                after.is_err_and(|e| e.contains("without this rank")),
                "rank 5"
            );
            continue;
        }
        assert_eq!(convicted, vec![5], "rank {r}");
        let (size, audited) = after.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(size, 6, "rank {r}");
        let (report, got) = audited.unwrap_or_else(|e| panic!("rank {r} after the shrink: {e}"));
        assert_eq!(got, want, "rank {r}: the six's median");
        let audit = report.audit.unwrap();
        assert!(
            audit.convicted.is_empty() && audit.refused.is_empty() && !audit.audited.is_empty(),
            "rank {r}: {audit:?}"
        );
    }
}

/// Seven ranks, f = 2; owner 2 lies, and rank 5 sends forged proofs (one byte of each changed,
/// as a rank framing the owner it accuses would): every other rank refutes rank 5's proofs
/// and names it a false accuser, still convicts owner 2 on the honest ranks' proofs, and
/// returns the honest median. A forgery never convicts.
pub async fn a_forged_proof_is_refuted_and_the_liar_still_convicted<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, f, d) = (7usize, 2usize, 7 * 64 * 2);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| vector(r, d)).collect();
    let honest = bits(&reference(&Median::new(f), &inputs));
    let comms = comms(factory(n).await, Duration::from_secs(20));
    let results = run_ranks(comms, move |mut c| async move {
        match c.rank() {
            2 => {
                let lie: OwnerTamper = std::sync::Arc::new(|_s: usize, _d: usize, b: &[u8]| {
                    b.iter().map(|x| x ^ 0x01).collect::<Vec<u8>>().into()
                });
                c.inject_owner_fault(Some(lie));
            }
            5 => {
                let forge: OwnerTamper = std::sync::Arc::new(|_t: usize, _d: usize, b: &[u8]| {
                    let mut v = b.to_vec();
                    if let Some(last) = v.last_mut() {
                        *last ^= 0x01;
                    }
                    v.into()
                });
                c.inject_step_fault("audit_proofs", Some(forge));
            }
            _ => {}
        }
        audited_round(&mut c, d, f).await
    })
    .await;
    for (r, (report, v)) in results.into_iter().enumerate() {
        if r == 5 {
            continue;
        }
        let report = report.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(bits(&v), honest, "rank {r}");
        let audit = report.audit.unwrap();
        let convicted: Vec<usize> = audit.convicted.iter().map(|l| l.owner).collect();
        assert_eq!(convicted, vec![2], "rank {r}: {audit:?}");
        let accusers: Vec<usize> = audit.false_accusers.iter().map(|(a, _)| *a).collect();
        assert_eq!(accusers, vec![5], "rank {r}: {audit:?}");
    }
}
