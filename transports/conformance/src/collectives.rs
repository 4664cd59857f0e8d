//! Collectives with honest ranks: every collective against its reference, large and pipelined
//! ring all-reduces, communicators split from a parent, and collectives started without
//! blocking.

use std::future::Future;
use std::time::Duration;

use byzcoll_aggregators::{Aggregator, Mean, Median, TrimmedMean};
use byzcoll_runtime::{
    Error, Payload, Policy, ReduceOp, Replicas, SendOp, Step, Transport, RING_PART_BYTES,
};

use crate::harness::{comms, reference, run_ranks, vector};
use crate::WORLD_SIZES;

/// Every collective gives the result computed directly from all ranks' inputs, at every
/// world size, including vectors shorter than the world.
pub async fn collectives_match_reference<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    for n in WORLD_SIZES {
        for d in [0usize, 1, n + 3, 1000] {
            let comms = comms(factory(n).await, Duration::from_secs(20));
            let results = run_ranks(comms, move |mut c| async move {
                let (me, n) = (c.rank(), c.size());
                c.barrier().await.unwrap();

                let mut b = if me == n - 1 {
                    vector(me, d)
                } else {
                    vec![0.0; d]
                };
                c.broadcast_into(n - 1, &mut b).await.unwrap();

                let mut gathered = vec![0.0f32; n * d];
                c.all_gather_into(&vector(me, d), &mut gathered)
                    .await
                    .unwrap();

                let send: Vec<u32> = (0..n * 2).map(|i| (me * 1000 + i) as u32).collect();
                let mut a2a = vec![0u32; n * 2];
                c.all_to_all_into(&send, &mut a2a).await.unwrap();

                let mut sum = vector(me, d);
                c.all_reduce(&mut sum, ReduceOp::Sum).await.unwrap();
                let mut max = vector(me, d);
                c.all_reduce(&mut max, ReduceOp::Max).await.unwrap();

                let f = (n - 1) / 2;
                let mut robust = Vec::new();
                let rules: [Box<dyn Aggregator>; 3] = [
                    Box::new(Median::new(f)),
                    Box::new(TrimmedMean::new(f)),
                    Box::new(Mean::new()),
                ];
                for rule in &rules {
                    let mut v = vector(me, d);
                    let report = c
                        .robust_all_reduce(&mut v, rule.as_ref(), Policy::Gather)
                        .await
                        .unwrap();
                    assert_eq!(report.inputs, n);
                    assert!(report.faults.is_empty() && report.non_finite.is_empty());
                    robust.push(v);
                }
                (me, b, gathered, a2a, sum, max, robust)
            })
            .await;

            let inputs: Vec<Vec<f32>> = (0..n).map(|r| vector(r, d)).collect();
            let f = (n - 1) / 2;
            let want_robust = [
                reference(&Median::new(f), &inputs),
                reference(&TrimmedMean::new(f), &inputs),
                reference(&Mean::new(), &inputs),
            ];
            let want_sum: Vec<f32> = (0..d).map(|j| inputs.iter().map(|x| x[j]).sum()).collect();
            let want_max: Vec<f32> = (0..d)
                .map(|j| inputs.iter().map(|x| x[j]).fold(f32::MIN, f32::max))
                .collect();
            for (me, b, gathered, a2a, sum, max, robust) in results {
                assert_eq!(b, vector(n - 1, d), "broadcast n={n} d={d} rank {me}");
                assert_eq!(
                    gathered,
                    inputs.concat(),
                    "all_gather n={n} d={d} rank {me}"
                );
                let want_a2a: Vec<u32> = (0..n)
                    .flat_map(|p| (0..2).map(move |i| (p * 1000 + me * 2 + i) as u32))
                    .collect();
                assert_eq!(a2a, want_a2a, "all_to_all n={n} rank {me}");
                assert_eq!(sum, want_sum, "all_reduce sum n={n} d={d} rank {me}");
                assert_eq!(max, want_max, "all_reduce max n={n} d={d} rank {me}");
                assert_eq!(robust, want_robust, "robust n={n} d={d} rank {me}");
            }
        }
    }
}

/// `all_reduce` of vectors whose ring chunks are past 1 MiB (the size from which messages and
/// receive buffers are on huge pages): sum and max equal the reference exactly, on every rank,
/// with a sum again after the max (buffers reused).
pub async fn all_reduce_of_megabyte_chunks_is_exact<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, d) = (4usize, (1usize << 20) + 5);
    let comms = comms(factory(n).await, Duration::from_secs(60));
    let results = run_ranks(comms, move |mut c| async move {
        let me = c.rank();
        let mut out = Vec::new();
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Sum] {
            let mut v = vector(me, d);
            c.all_reduce(&mut v, op).await.unwrap();
            out.push(v);
        }
        (me, out)
    })
    .await;
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| vector(r, d)).collect();
    let sum: Vec<f32> = (0..d).map(|j| inputs.iter().map(|x| x[j]).sum()).collect();
    let max: Vec<f32> = (0..d)
        .map(|j| inputs.iter().map(|x| x[j]).fold(f32::MIN, f32::max))
        .collect();
    for (me, out) in results {
        assert!(out[0] == sum && out[2] == sum, "sum at rank {me}");
        assert!(out[1] == max, "max at rank {me}");
    }
}

/// `all_reduce` whose ring chunks are sent in parts, with steps in flight where the transport
/// allows it. At the default part size, chunks of 2.2 MiB split unevenly go in two parts;
/// with 64 KiB parts ([`Communicator::set_ring_part_bytes`]), chunks of 300 KB in four, and
/// chunks of 140 KB in two, one rank's chunk a part longer than the others'. Every rank gets
/// the exact sum, max and min, and each call runs one step per part and ring step.
///
/// [`Communicator::set_ring_part_bytes`]: byzcoll_runtime::Communicator::set_ring_part_bytes
pub async fn pipelined_ring_all_reduce_is_exact<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let n = 3usize;
    // (elements per rank, bytes per part, parts per ring step where steps may overlap, ops)
    let cases = [
        (
            3 * 575_000 + 1,
            RING_PART_BYTES,
            2usize,
            &[ReduceOp::Sum][..],
        ),
        (
            3 * 75_000 + 2,
            64 << 10,
            4,
            &[ReduceOp::Sum, ReduceOp::Max][..],
        ),
        (3 * 35_000 + 1, 64 << 10, 2, &[ReduceOp::Min][..]),
    ];
    let comms = comms(factory(n).await, Duration::from_secs(60));
    let results = run_ranks(comms, move |mut c| async move {
        let me = c.rank();
        let overlaps = c.transport().capabilities().steps_in_flight > 1;
        let mut out = Vec::new();
        for (d, part_bytes, parts, ops) in cases {
            c.set_ring_part_bytes(part_bytes);
            for &op in ops {
                let mut v = vector(me, d);
                c.all_reduce(&mut v, op).await.unwrap();
                let steps = c.take_stats().step_times.len();
                let want = 2 * (n - 1) * if overlaps { parts } else { 1 };
                assert_eq!(steps, want, "steps of d={d} at rank {me}");
                out.push(v);
            }
        }
        (me, out)
    })
    .await;
    for (me, out) in results {
        let mut out = out.into_iter();
        for (d, _, _, ops) in cases {
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| vector(r, d)).collect();
            let column = |j: usize| inputs.iter().map(move |x| x[j]);
            for &op in ops {
                let want: Vec<f32> = match op {
                    ReduceOp::Sum => (0..d).map(|j| column(j).sum()).collect(),
                    ReduceOp::Max => (0..d).map(|j| column(j).fold(f32::MIN, f32::max)).collect(),
                    _ => (0..d).map(|j| column(j).fold(f32::MAX, f32::min)).collect(),
                };
                assert!(out.next().unwrap() == want, "{op:?} of d={d} at rank {me}");
            }
        }
    }
}

/// `split` makes communicators of subsets over the same transport: by color (`rank % 2`, and
/// no color for the last rank of worlds of three and more), ordered by key (reversed ranks).
/// Their collectives and the parent's, called in turns, each give their reference result:
/// every communicator has its own stream of collective numbers, so a call on one never takes
/// or drops a message of another. A communicator split again from a split one gets yet
/// another stream.
pub async fn split_communicators_interleave_with_their_parent<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    for n in WORLD_SIZES {
        let comms = comms(factory(n).await, Duration::from_secs(20));
        run_ranks(comms, move |mut parent| async move {
            let me = parent.rank();
            let outside = n >= 3 && me == n - 1;
            let color = (!outside).then_some((me % 2) as u32);
            let sub = parent.split(color, (n - me) as u32).await.unwrap();
            let Some(mut sub) = sub else {
                assert!(outside, "rank {me} of {n} has a color");
                // Rank n - 1 keeps using the parent in turn with the others.
                for round in 0..3 {
                    let mut v = vector(me + round, 64);
                    parent.all_reduce(&mut v, ReduceOp::Sum).await.unwrap();
                }
                return;
            };
            let members: Vec<usize> = (0..n)
                .filter(|&r| !(n >= 3 && r == n - 1) && r % 2 == me % 2)
                .rev()
                .collect();
            assert_eq!(sub.size(), members.len(), "rank {me} of {n}");
            assert_eq!(
                members[sub.rank()],
                me,
                "rank {me} of {n}: keys order the ranks"
            );
            let mut nested = sub.split(Some(0), 0).await.unwrap().expect("one color");
            assert_eq!((nested.rank(), nested.size()), (sub.rank(), sub.size()));
            for round in 0..3 {
                let mut v = vector(me + round, 64);
                sub.all_reduce(&mut v, ReduceOp::Sum).await.unwrap();
                let expect: Vec<f32> = (0..64)
                    .map(|j| members.iter().map(|&r| vector(r + round, 64)[j]).sum())
                    .collect();
                assert_eq!(v, expect, "sub, rank {me} of {n}, round {round}");

                let mut w = vector(me + round, 64);
                parent.all_reduce(&mut w, ReduceOp::Sum).await.unwrap();
                let expect: Vec<f32> = (0..64)
                    .map(|j| (0..n).map(|r| vector(r + round, 64)[j]).sum())
                    .collect();
                assert_eq!(w, expect, "parent, rank {me} of {n}, round {round}");

                let m = members.len();
                let mut x = vector(me, 16);
                let report = nested
                    .robust_all_reduce(&mut x, &Median::new((m - 1) / 2), Policy::Gather)
                    .await
                    .unwrap();
                let inputs: Vec<Vec<f32>> = members.iter().map(|&r| vector(r, 16)).collect();
                assert_eq!(
                    x,
                    reference(&Median::new((m - 1) / 2), &inputs),
                    "nested, rank {me}"
                );
                assert!(report.faults.is_empty(), "{:?}", report.faults);
            }
        })
        .await;
    }
}

/// A rank that tells rank 0 another color than the others (the last of 4, a raw transport)
/// cannot split the honest ranks into communicators that disagree on their members: the
/// digests of the gathered tables differ, and every honest rank gets `Error::Disagreement`.
pub async fn a_split_with_an_equivocated_color_is_refused<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let n = 4;
    let mut ranks = factory(n).await;
    let liar = ranks.pop().unwrap();
    let timeout = Duration::from_millis(800);
    let honest = comms(ranks, timeout);
    let byzantine = tokio::spawn(async move {
        // Split's records are (color + 1, key, stream) as u64s, then a 32-byte digest.
        let record = |dest: usize| {
            let color: u64 = if dest == 0 { 1 } else { 2 };
            let words = [color, 0u64, 0u64];
            Payload::Host(bytemuck::cast_slice::<u64, u8>(&words).to_vec().into())
        };
        for (collective, payload) in [(0u64, None), (1, Some(vec![0u8; 32]))] {
            let sends = (0..n - 1)
                .map(|dest| SendOp {
                    peer: dest,
                    tag: 0,
                    payload: payload
                        .clone()
                        .map_or_else(|| record(dest), |p| Payload::Host(p.into())),
                })
                .collect();
            // The split's two all-gathers: 24-byte records, then 32-byte digests.
            let block = if collective == 0 { 24 } else { 32 };
            let step = Step {
                collective,
                step: 0,
                call: byzcoll_runtime::calls::all_gather(block, block * n, None),
                sends,
                recvs: vec![],
                deadline: tokio::time::Instant::now() + timeout,
                quorum: None,
            };
            liar.exchange(step).await.unwrap();
        }
        tokio::time::sleep(timeout * 4).await;
        drop(liar);
    });
    let results = run_ranks(honest, move |mut c| async move {
        c.split(Some(0), 0).await.map(|sub| sub.map(|s| s.size()))
    })
    .await;
    byzantine.await.unwrap();
    for (me, result) in results.into_iter().enumerate() {
        match result {
            Err(Error::Disagreement { disagreeing, .. }) => {
                let expect: Vec<usize> = if me == 0 { vec![1, 2, 3] } else { vec![0, 3] };
                assert_eq!(disagreeing, expect, "rank {me}");
            }
            other => panic!("rank {me}: a split with an equivocated color gave {other:?}"),
        }
    }
}

/// Collectives started through a `CommHandle` run in the order they were started and give
/// the results of the blocking calls, however their results are awaited: here in reverse
/// order, and one not at all (it runs all the same, or the blocking barrier after `finish`
/// would not meet the other ranks').
pub async fn nonblocking_collectives_run_in_start_order<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    for n in WORLD_SIZES {
        let comms = comms(factory(n).await, Duration::from_secs(20));
        run_ranks(comms, move |c| async move {
            let me = c.rank();
            let f = (n - 1) / 2;
            let handle = c.into_handle();
            assert_eq!((handle.rank(), handle.size()), (me, n));
            let rule: std::sync::Arc<dyn Aggregator> = std::sync::Arc::new(Median::new(f));
            let first = handle
                .robust_all_reduce(vector(me, 100), rule.clone(), Policy::Gather)
                .await;
            let sum = handle.all_reduce(vector(me + 1, 100), ReduceOp::Sum).await;
            let dropped = handle.all_reduce(vector(me, 10), ReduceOp::Max).await;
            drop(dropped);
            let barrier = handle.barrier().await;
            let sharded = handle
                .robust_all_reduce(
                    vector(me + 2, 100),
                    rule.clone(),
                    Policy::Sharded(Replicas::Tolerant),
                )
                .await;
            let (v, report) = sharded.await.unwrap().unwrap();
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| vector(r + 2, 100)).collect();
            assert_eq!(
                v,
                reference(rule.as_ref(), &inputs),
                "sharded, rank {me} of {n}"
            );
            assert!(report.faults.is_empty());
            barrier.await.unwrap().unwrap();
            let s = sum.await.unwrap().unwrap();
            let expect: Vec<f32> = (0..100)
                .map(|j| (0..n).map(|r| vector(r + 1, 100)[j]).sum())
                .collect();
            assert_eq!(s, expect, "sum, rank {me} of {n}");
            let (v, _) = first.await.unwrap().unwrap();
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| vector(r, 100)).collect();
            assert_eq!(
                v,
                reference(rule.as_ref(), &inputs),
                "gather, rank {me} of {n}"
            );
            let mut c = handle.finish().await.unwrap();
            c.barrier().await.unwrap();
        })
        .await;
    }
}

/// The non-robust all-reduce on both sides of its schedule crossover (recursive doubling up to
/// [`byzcoll_runtime::DOUBLING_MAX_BYTES`], the ring above): every world from 1 to 9 ranks (a
/// power of two or not), lengths 0, 1, `n - 1`, `n + 1` and the crossover ± 1 element, sum,
/// min and max exact and the same on every rank.
pub async fn all_reduce_is_exact_across_the_doubling_crossover<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let cross = byzcoll_runtime::DOUBLING_MAX_BYTES / 4;
    for n in 1..=9usize {
        let lens = [
            0,
            1,
            n.saturating_sub(1),
            n + 1,
            cross - 1,
            cross,
            cross + 1,
        ];
        let results = run_ranks(
            comms(factory(n).await, Duration::from_secs(20)),
            move |mut c| async move {
                let me = c.rank();
                let mut out = Vec::new();
                for d in lens {
                    for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max] {
                        let mut v: Vec<f32> = (0..d).map(|j| ((me * 7 + j) % 13) as f32).collect();
                        c.all_reduce(&mut v, op).await.unwrap();
                        out.push(v);
                    }
                }
                out
            },
        )
        .await;
        let mut k = 0;
        for d in lens {
            for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max] {
                let want: Vec<f32> = (0..d)
                    .map(|j| {
                        let xs = (0..n).map(|r| ((r * 7 + j) % 13) as f32);
                        match op {
                            ReduceOp::Sum => xs.sum(),
                            ReduceOp::Min => xs.fold(f32::INFINITY, f32::min),
                            _ => xs.fold(f32::NEG_INFINITY, f32::max),
                        }
                    })
                    .collect();
                for (me, r) in results.iter().enumerate() {
                    assert_eq!(r[k], want, "n = {n}, d = {d}, {op:?}, rank {me}");
                }
                k += 1;
            }
        }
    }
}
