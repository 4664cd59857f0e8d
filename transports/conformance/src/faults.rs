//! Faulty peers in gather-mode rounds and plain collectives: Byzantine values, a crashed rank,
//! a wrong length, and a silent peer reported at the deadline.

use std::future::Future;
use std::time::Duration;

use byzcoll_aggregators::{Median, TrimmedMean};
use byzcoll_runtime::{Error, Fault, Policy, ReduceOp, Transport, RING_PART_BYTES};

use crate::harness::{comms, reference, run_ranks, vector};

/// Seven ranks tolerating f = 2: one sends a sign-flipped vector scaled by 1000, one sends
/// NaN and infinities; then one rank crashes (its transport is dropped) and the others still
/// complete within the deadline with the crashed rank named.
pub async fn robust_all_reduce_survives_byzantine_and_crashed_ranks<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, f, d) = (7usize, 2usize, 257usize);
    let honest =
        move |r: usize| -> Vec<f32> { (0..d).map(|j| 1.0 + 0.01 * (r + j % 5) as f32).collect() };
    let comms = comms(factory(n).await, Duration::from_millis(1500));
    let results = run_ranks(comms, move |mut c| async move {
        let me = c.rank();
        let mut v = match me {
            5 => honest(5).iter().map(|x| -1000.0 * x).collect(),
            6 => (0..d)
                .map(|j| [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][j % 3])
                .collect(),
            _ => honest(me),
        };
        let first = c
            .robust_all_reduce(&mut v, &Median::new(f), Policy::Gather)
            .await
            .map(|report| (report, v));
        // Rank 3 crashes before the second round.
        if me == 3 {
            return (me, first, None);
        }
        let mut w = honest(me);
        let second = c
            .robust_all_reduce(&mut w, &TrimmedMean::new(f), Policy::Gather)
            .await
            .map(|report| (report, w));
        (me, first, Some(second))
    })
    .await;
    let in_honest_range = |v: &[f32]| {
        v.iter().enumerate().all(|(j, x)| {
            let col: Vec<f32> = (0..5).map(|r| honest(r)[j]).collect();
            let lo = col.iter().copied().fold(f32::MAX, f32::min);
            let hi = col.iter().copied().fold(f32::MIN, f32::max);
            x.is_finite() && lo <= *x && *x <= hi
        })
    };
    for (me, first, second) in results {
        if me >= 5 {
            continue;
        }
        let (report, v) = first.unwrap();
        assert_eq!(report.inputs, n);
        assert_eq!(report.non_finite, vec![6]);
        assert!(in_honest_range(&v), "rank {me}: {:?}", &v[..4]);
        if let Some(second) = second {
            let (report, w) = second.unwrap();
            assert_eq!(report.inputs, n - 1, "rank {me}");
            assert_eq!(report.faults.len(), 1, "rank {me}: {:?}", report.faults);
            assert_eq!(report.faults[0].rank, 3);
            assert_eq!(report.faults[0].fault, Fault::Missing);
            assert!(w.iter().all(|x| x.is_finite()));
        }
    }
}

/// A peer whose vector has the wrong length is a per-peer `Malformed` erasure, named in the
/// report, and the round completes for everyone else.
pub async fn wrong_length_is_malformed_and_named<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let n = 4;
    let comms = comms(factory(n).await, Duration::from_secs(10));
    let results = run_ranks(comms, |mut c| async move {
        let me = c.rank();
        let mut v = vector(me, if me == 2 { 11 } else { 10 });
        let r = c
            .robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
            .await;
        (me, r.map(|report| (report, v)))
    })
    .await;
    for (me, r) in results {
        match me {
            2 => {
                // The liar sees everyone else as malformed and too few inputs remain.
                assert!(matches!(r, Err(Error::TooManyFaults { .. })), "{r:?}");
            }
            _ => {
                let (report, v) = r.unwrap();
                assert_eq!(report.inputs, 3);
                assert_eq!(report.faults.len(), 1);
                assert_eq!(report.faults[0].rank, 2);
                assert!(
                    matches!(&report.faults[0].fault, Fault::Malformed(why) if why.contains("44")),
                    "{:?}",
                    report.faults
                );
                let inputs: Vec<Vec<f32>> = [0, 1, 3].iter().map(|&r| vector(r, 10)).collect();
                assert_eq!(v, reference(&Median::new(1), &inputs));
            }
        }
    }
}

/// A peer that never sends is `Missing` once the deadline passes, no sooner than the deadline
/// and not much later; a non-robust collective fails with its rank named. Also with the ring's
/// chunks in four parts and two steps in flight: a step still in flight when the one before it
/// fails neither hangs the call nor delays it past the deadline.
pub async fn missing_peer_is_reported_within_the_deadline<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let n = 3;
    let timeout = Duration::from_millis(400);
    // (elements per rank, bytes per ring part)
    for (d, part_bytes) in [(8usize, RING_PART_BYTES), (3 * 70_000, 64 << 10)] {
        let comms = comms(factory(n).await, timeout);
        let results = run_ranks(comms, move |mut c| async move {
            let me = c.rank();
            if me == 1 {
                // Alive but silent: it keeps its transport open past the others' deadline.
                tokio::time::sleep(timeout * 3).await;
                return (me, None, Duration::ZERO);
            }
            c.set_ring_part_bytes(part_bytes);
            let start = tokio::time::Instant::now();
            let r = c.all_reduce(&mut vec![1.0f32; d], ReduceOp::Sum).await;
            (me, Some(r), start.elapsed())
        })
        .await;
        for (me, r, elapsed) in results {
            let Some(r) = r else { continue };
            match r {
                Err(Error::PeerFaults { faults, .. }) => {
                    // Rank 2 waits on rank 1 directly; rank 0 waits on rank 2, which gave up.
                    let named: Vec<usize> = faults.iter().map(|f| f.rank).collect();
                    assert_eq!(named, [(me + n - 1) % n], "rank {me}, d={d}");
                    assert!(
                        faults.iter().all(|f| f.fault == Fault::Missing),
                        "{faults:?}"
                    );
                }
                other => panic!("rank {me}, d={d}: expected a peer fault, got {other:?}"),
            }
            assert!(elapsed >= timeout, "rank {me} gave up early: {elapsed:?}");
            assert!(elapsed < timeout * 3, "rank {me}, d={d}, took {elapsed:?}");
        }
    }
}
