//! Faulty peers in gather-mode rounds and plain collectives: Byzantine values, a crashed rank,
//! a wrong length, and a silent peer reported at the deadline.

use std::future::Future;
use std::time::Duration;

use byzcoll_aggregators::{Median, TrimmedMean};
use byzcoll_runtime::round::Shape;
use byzcoll_runtime::{
    calls, Error, Fault, Payload, Policy, ReduceOp, SendOp, Step, Transport, DOUBLING_MAX_BYTES,
    RING_PART_BYTES,
};

use crate::harness::{self, comms, reference, run_ranks, vector};

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
    let (n, d) = (4, 10);
    let mut ranks = factory(n).await;
    // Rank 2 speaks the protocol itself: its round's messages, 11 elements instead of 10.
    let liar = ranks.remove(2);
    let timeout = Duration::from_secs(10);
    let honest = comms(ranks, timeout);
    let byzantine = tokio::spawn(async move {
        let payload = Payload::Host(harness::filled(1.0, d + 1).into());
        let step = Step {
            collective: 0,
            step: 0,
            call: calls::robust::<f32>(&Median::new(1), Shape::Gather, None, false, d, None),
            sends: [0, 1, 3]
                .into_iter()
                .map(|peer| SendOp {
                    peer,
                    tag: 0,
                    payload: payload.clone(),
                })
                .collect(),
            recvs: vec![],
            deadline: tokio::time::Instant::now() + timeout,
            quorum: None,
        };
        liar.exchange(step).await.unwrap();
        // Kept alive (silent) until the honest ranks are done.
        tokio::time::sleep(Duration::from_secs(3)).await;
        drop(liar);
    });
    let results = run_ranks(honest, move |mut c| async move {
        let me = c.rank();
        let mut v = vector(me, d);
        let r = c
            .robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
            .await;
        (me, r.map(|report| (report, v)))
    })
    .await;
    byzantine.await.unwrap();
    for (me, r) in results {
        let (report, v) = r.unwrap_or_else(|e| panic!("rank {me}: {e}"));
        assert_eq!(report.inputs, 3);
        assert_eq!(report.faults.len(), 1);
        assert_eq!(report.faults[0].rank, 2);
        assert!(
            matches!(&report.faults[0].fault, Fault::Malformed(why) if why.contains("44")),
            "{:?}",
            report.faults
        );
        let inputs: Vec<Vec<f32>> = [0, 1, 3].iter().map(|&r| vector(r, d)).collect();
        assert_eq!(v, reference(&Median::new(1), &inputs));
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
            let elapsed = start.elapsed();
            // A rank that gave up stays open as long as rank 1: closed, it would be a dead peer
            // to the rank waiting on it, which then rightly stops waiting before its deadline.
            tokio::time::sleep_until(start + timeout * 2).await;
            (me, Some(r), elapsed)
        })
        .await;
        for (me, r, elapsed) in results {
            let Some(r) = r else { continue };
            match r {
                Err(Error::PeerFaults { faults, .. }) => {
                    let named: Vec<usize> = faults.iter().map(|f| f.rank).collect();
                    let waited_on = if d * 4 <= DOUBLING_MAX_BYTES {
                        // Recursive doubling: rank 0 doubles with rank 1, rank 2 (beyond the
                        // power of two) waits on rank 0 for the result, which gave up.
                        [1, 0, 0][me]
                    } else {
                        // The ring: rank 2 waits on rank 1 directly; rank 0 waits on rank 2,
                        // which gave up.
                        (me + n - 1) % n
                    };
                    assert_eq!(named, [waited_on], "rank {me}, d={d}");
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

/// A rank out of step is named, never mixed in (issue #37): every collective call carries a
/// fingerprint of what the caller asked for and of its step id (`Communicator::set_step`).
///
/// - Rank 3 of 4 gives its robust all-reduce another step id: ranks 0 to 2 name it
///   `OutOfStep` as its messages arrive (not at the deadline) and return the median of their
///   own three inputs; rank 3 fails, naming every peer out of step.
/// - Rank 3 skips the call of step 1 and makes the call of step 2: its message lands on the
///   others' call of step 1 (calls are numbered by count), and every rank's barrier fails at
///   once with the other side named out of step, instead of rank 3's input going to the
///   others' previous call.
pub async fn a_rank_out_of_step_is_named_never_mixed_in<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, d) = (4, 64);
    let timeout = Duration::from_secs(5);
    let results = run_ranks(comms(factory(n).await, timeout), move |mut c| async move {
        let me = c.rank();
        c.set_step(Some(if me == 3 { 8 } else { 7 }));
        let mut v = vector(me, d);
        let start = tokio::time::Instant::now();
        let r = c
            .robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
            .await;
        (me, r.map(|report| (report, v)), start.elapsed())
    })
    .await;
    let honest: Vec<Vec<f32>> = (0..3).map(|r| vector(r, d)).collect();
    let want = reference(&Median::new(1), &honest);
    for (me, r, took) in results {
        assert!(took < timeout / 2, "rank {me} waited {took:?}");
        match (me, r) {
            (3, Err(Error::TooManyFaults { faults, .. } | Error::PeerFaults { faults, .. })) => {
                assert!(
                    !faults.is_empty() && faults.iter().all(|f| f.fault == Fault::OutOfStep),
                    "rank 3: {faults:?}"
                );
            }
            (3, Ok((report, _))) => panic!("rank 3 went on out of step: {report:?}"),
            (me, Ok((report, v))) => {
                assert_eq!(v, want, "rank {me}");
                let named: Vec<(usize, Fault)> = report
                    .faults
                    .iter()
                    .map(|f| (f.rank, f.fault.clone()))
                    .collect();
                assert_eq!(named, [(3, Fault::OutOfStep)], "rank {me}");
            }
            (me, Err(e)) => panic!("rank {me}: {e}"),
        }
    }

    let results = run_ranks(comms(factory(n).await, timeout), move |mut c| async move {
        let me = c.rank();
        // Rank 3 skips step 1.
        c.set_step(Some(if me == 3 { 2 } else { 1 }));
        let start = tokio::time::Instant::now();
        let r = c.barrier().await;
        (me, r, start.elapsed())
    })
    .await;
    for (me, r, took) in results {
        assert!(took < timeout / 2, "rank {me} waited {took:?}");
        let Err(Error::PeerFaults { faults, .. }) = r else {
            panic!("rank {me}: {r:?}");
        };
        let named: Vec<usize> = faults.iter().map(|f| f.rank).collect();
        let want: Vec<usize> = match me {
            3 => vec![0, 1, 2],
            _ => vec![3],
        };
        assert_eq!(named, want, "rank {me}: {faults:?}");
        assert!(
            faults.iter().all(|f| f.fault == Fault::OutOfStep),
            "{faults:?}"
        );
    }
}

/// Shrink (issue #36): rank 2 of 4 dies (its transport is dropped); the other three shrink the
/// communicator, agree to keep ranks 0, 1 and 3, renumbered 0, 1, 2, and run a robust
/// all-reduce on it with every input present and no fault.
pub async fn a_shrink_drops_the_dead_and_renumbers<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, d) = (4, 32);
    let timeout = Duration::from_secs(5);
    let mut all = comms(factory(n).await, timeout);
    drop(all.remove(2));
    let results = run_ranks(all, move |mut c| async move {
        let me = c.rank();
        let start = tokio::time::Instant::now();
        let shrunk = c.shrink().await;
        let mut sub = match shrunk {
            Ok(sub) => sub,
            Err(e) => return (me, Err(e), start.elapsed()),
        };
        let mut v = vector(me, d);
        let r = sub
            .robust_all_reduce(&mut v, &Median::new(0), Policy::Gather)
            .await
            .map(|report| (sub.rank(), sub.size(), report, v));
        (me, r, start.elapsed())
    })
    .await;
    let inputs: Vec<Vec<f32>> = [0, 1, 3].iter().map(|&r| vector(r, d)).collect();
    let want = reference(&Median::new(0), &inputs);
    for (me, r, took) in results {
        let (rank, size, report, v) = r.unwrap_or_else(|e| panic!("rank {me}: {e}"));
        assert_eq!((rank, size), ([0, 1, 0, 2][me], 3), "rank {me}");
        assert_eq!(report.inputs, 3, "rank {me}: {report:?}");
        assert!(report.faults.is_empty(), "rank {me}: {report:?}");
        assert_eq!(v, want, "rank {me}");
        // TCP, UCX and the in-process transport see the death at once and wait for nothing;
        // libfabric's connectionless endpoints cannot, and wait one deadline in the liveness
        // exchange and one in the agreement round, never more.
        assert!(
            took < timeout * 5 / 2,
            "rank {me} waited {took:?} for the dead rank"
        );
    }
}

/// A world of one rank, in gather and sharded mode under each agreement: its robust
/// all-reduce returns its own vector with one input and nothing else to say; a vector holding
/// NaN or infinities is named as its own (the rule refuses it), never a panic, whatever the
/// round read after the output overwrote the input.
pub async fn a_world_of_one_returns_its_own_vector<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    use byzcoll_runtime::{Agreement, Replicas};
    for agreement in [Agreement::Off, Agreement::Detect, Agreement::Enforce] {
        for policy in [Policy::Gather, Policy::Sharded(Replicas::Tolerant)] {
            let results = run_ranks(
                comms(factory(1).await, Duration::from_secs(5)),
                move |mut c| async move {
                    c.set_agreement(agreement);
                    // f64: no register kernel names the non-finite inputs, so the round scans them.
                    let mut v: Vec<f64> = (0..9).map(|i| i as f64 - 4.0).collect();
                    let ok = c.robust_all_reduce(&mut v, &Median::new(0), policy).await;
                    let mut bad = vec![1.0f64, f64::NAN, f64::INFINITY, 4.0];
                    let refused = c.robust_all_reduce(&mut bad, &Median::new(0), policy).await;
                    (ok.map(|r| (r, v)), refused)
                },
            )
            .await;
            for (ok, refused) in results {
                let what = format!("{agreement:?} {policy:?}");
                let (report, v) = ok.unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(
                    v,
                    (0..9).map(|i| i as f64 - 4.0).collect::<Vec<_>>(),
                    "{what}"
                );
                assert_eq!(report.inputs, 1, "{what}");
                assert!(report.faults.is_empty(), "{what}: {:?}", report.faults);
                match refused {
                    Ok(report) => assert_eq!(report.non_finite, [0], "{what}"),
                    Err(e) => assert!(
                        matches!(e, Error::Aggregation(_) | Error::ShardLost { .. }),
                        "{what}: {e}"
                    ),
                }
            }
        }
    }
}
