//! The 16-bit element types (`bf16`, `f16`) through the robust all-reduce: two bytes per
//! element on the wire, results bitwise the rule applied locally.

use std::future::Future;
use std::time::Duration;

use byzcoll_aggregators::{aggregate_into, Aggregator, Element, Krum, Median, TrimmedMean};
use byzcoll_runtime::{OwnerTamper, Policy, ReduceOp, Replicas, Transport};
use half::{bf16, f16};

use crate::harness::{comms, run_ranks};

/// Rank `r`'s vector of `d` values of `T`; the last rank (the Byzantine one) sends every value
/// times −`far` (`far` large but finite in `T`).
fn input<T: Element>(r: usize, n: usize, d: usize, far: f64) -> Vec<T> {
    (0..d)
        .map(|j| {
            let v = 1.0 + ((r * 7919 + j * 104_729) % 1000) as f64 / 997.0;
            T::from_f64(if r == n - 1 { -far * v } else { v })
        })
        .collect()
}

fn bits<T: Element>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_f64().to_bits()).collect()
}

/// In `bf16` and in `f16`, for the median, the trimmed mean and Krum (`f = 1`), in gather
/// mode and sharded with one owner per shard and with `2f + 1`, at `n` = 5 and 7 with the
/// last rank Byzantine (a far input, and with `2f + 1` owners also the sign of every value
/// of the results it sends as an owner flipped): every honest rank's result is bitwise the
/// rule applied locally to all ranks' inputs, and Krum names the same selection. The plain
/// all-reduce sums small integers exactly in both types.
pub async fn narrow_types_reduce_bitwise_as_the_local_rule<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    for n in [5usize, 7] {
        for d in [1usize, n + 3, 1000] {
            check::<bf16>(factory(n).await, n, d, 1e30).await;
            check::<f16>(factory(n).await, n, d, 3e4).await;
        }
    }
}

async fn check<T: Element>(transports: Vec<Box<dyn Transport>>, n: usize, d: usize, far: f64) {
    let f = 1;
    let rules = move || -> Vec<Box<dyn Aggregator>> {
        vec![
            Box::new(Median::new(f)),
            Box::new(TrimmedMean::new(f)),
            Box::new(Krum::new(f)),
        ]
    };
    let inputs: Vec<Vec<T>> = (0..n).map(|r| input(r, n, d, far)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(Vec::as_slice).collect();
    let want: Vec<(Vec<T>, Option<Vec<usize>>)> = rules()
        .iter()
        .map(|rule| {
            let mut out = vec![T::from_f64(0.0); d];
            let report = aggregate_into(rule.as_ref(), &refs, &mut out).unwrap();
            (out, report.selected)
        })
        .collect();
    let results = run_ranks(
        comms(transports, Duration::from_secs(20)),
        move |mut c| async move {
            let me = c.rank();
            let mut got = Vec::new();
            for rule in rules() {
                for policy in [
                    Policy::Gather,
                    Policy::Sharded(Replicas::Exactly(1)),
                    Policy::Sharded(Replicas::Tolerant),
                ] {
                    // A lying owner only where the owners' results are median-combined.
                    let lies = me == n - 1 && policy == Policy::Sharded(Replicas::Tolerant);
                    let tamper: Option<OwnerTamper> = lies.then(|| {
                        std::sync::Arc::new(|_s: usize, _dest: usize, honest: &[u8]| {
                            let mut b = honest.to_vec();
                            // Two bytes per element, little-endian: the sign is each pair's
                            // second byte's top bit.
                            for pair in b.chunks_exact_mut(2) {
                                pair[1] ^= 0x80;
                            }
                            b.into()
                        }) as OwnerTamper
                    });
                    c.inject_owner_fault(tamper);
                    let mut v = input::<T>(me, n, d, far);
                    let report = c
                        .robust_all_reduce(&mut v, rule.as_ref(), policy)
                        .await
                        .map_err(|e| format!("{} {policy:?}: {e}", rule.name()));
                    got.push((rule.name().to_string(), policy, v, report));
                }
            }
            // Integers up to 28: every partial sum is exact in both types.
            let mut sum: Vec<T> = (0..d).map(|j| T::from_f64(((me + j) % 5) as f64)).collect();
            c.all_reduce(&mut sum, ReduceOp::Sum).await.unwrap();
            (me, got, sum)
        },
    )
    .await;
    for (me, got, sum) in results {
        let exact: Vec<f64> = (0..d)
            .map(|j| (0..n).map(|r| ((r + j) % 5) as f64).sum())
            .collect();
        assert_eq!(sum.iter().map(|x| x.to_f64()).collect::<Vec<_>>(), exact);
        if me == n - 1 {
            continue;
        }
        for (k, (rule, policy, v, report)) in got.into_iter().enumerate() {
            let (out, selected) = &want[k / 3];
            let report = report.unwrap();
            assert_eq!(
                bits(&v),
                bits(out),
                "{:?} {rule} {policy:?} n={n} d={d} rank {me}",
                T::DTYPE
            );
            if rule == "krum" {
                assert_eq!(&report.selected, selected, "{rule} {policy:?} rank {me}");
                assert_ne!(selected.as_deref(), Some(&[n - 1][..]));
            }
        }
    }
}
