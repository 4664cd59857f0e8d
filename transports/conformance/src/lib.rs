//! The transport conformance suite: one set of test bodies that every transport runs, with
//! the real transport underneath.
//!
//! A transport crate instantiates it with a factory that builds all ranks of a world in one
//! process:
//!
//! ```ignore
//! async fn world(n: usize) -> Vec<Box<dyn Transport>> { ... }
//! byzcoll_conformance::conformance_suite!(world);
//! ```
//!
//! Every body runs at the world sizes in [`WORLD_SIZES`] unless it needs a particular one.

#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::time::Duration;

use byzcoll_aggregators::{
    aggregate_into, Aggregator, Bulyan, CenteredClipping, GeometricMedian, Krum, Mean, Median,
    MultiKrum, Nnm, TrimmedMean,
};
use byzcoll_runtime::schedule::chunk_range;
use byzcoll_runtime::{
    Agreement, Communicator, Config, Error, Fault, OwnerTamper, Payload, Policy, RecvOp,
    RecvOutcome, ReduceOp, Replicas, RoundReport, SendOp, Step, Transport, RING_PART_BYTES,
};

/// World sizes that break naive schedules.
pub const WORLD_SIZES: [usize; 5] = [1, 2, 3, 7, 8];

/// Instantiates every conformance test for a transport factory
/// `async fn(usize) -> Vec<Box<dyn Transport>>`.
#[macro_export]
macro_rules! conformance_suite {
    ($factory:expr) => {
        $crate::conformance_suite!(@tests $factory;
            collectives_match_reference,
            all_reduce_of_megabyte_chunks_is_exact,
            pipelined_ring_all_reduce_is_exact,
            robust_all_reduce_survives_byzantine_and_crashed_ranks,
            wrong_length_is_malformed_and_named,
            missing_peer_is_reported_within_the_deadline,
            steps_are_matched_by_key_not_arrival_order,
            messages_outlive_their_sender,
            sent_messages_move_while_the_sender_is_away,
            early_messages_are_checked_like_any_other,
            invalid_steps_are_rejected,
            sharded_matches_gather_bitwise,
            sharded_sub_rounds_match_one_round_and_erase_a_dead_peer_once,
            a_peer_one_rank_sees_dead_at_once_costs_no_honest_rank,
            sharded_survives_byzantine_owners_only_with_replication,
            replicated_owners_send_one_version_and_digests,
            a_lone_owner_that_equivocates_never_splits_honest_ranks_silently,
            sharded_krum_family_matches_gather,
            sharded_iterative_rules_match_gather,
            an_equivocating_sender_never_splits_honest_ranks_silently,
            a_stalled_rank_that_resumes_never_returns_another_result_as_success,
            an_equivocating_sender_is_agreed_on_under_enforce,
            a_stalled_rank_that_resumes_under_enforce_is_never_split,
            byzantine_owners_and_senders_are_agreed_on_under_enforce_in_sharded_mode,
            robust_reduce_scatter_gives_each_rank_its_shard_of_the_all_reduce,
            an_equivocating_sender_is_named_in_a_reduce_scatter,
            a_stalled_rank_that_resumes_is_told_in_a_reduce_scatter,
            split_communicators_interleave_with_their_parent,
            a_split_with_an_equivocated_color_is_refused,
            nonblocking_collectives_run_in_start_order,
        );
    };
    (@tests $factory:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::$name($factory).await;
            }
        )*
    };
}

/// Ranks 0 and 1 of a world of two.
async fn two_ranks<F, Fut>(factory: F) -> (Box<dyn Transport>, Box<dyn Transport>)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let mut ranks = factory(2).await.into_iter();
    let a = ranks.next().expect("rank 0");
    let b = ranks.next().expect("rank 1");
    (a, b)
}

/// Rank `r`'s test vector: small integers, so sums are exact in `f32`.
pub fn vector(rank: usize, d: usize) -> Vec<f32> {
    (0..d)
        .map(|j| ((rank * 31 + j * 7) % 101) as f32 - 50.0)
        .collect()
}

fn comms(transports: Vec<Box<dyn Transport>>, timeout: Duration) -> Vec<Communicator> {
    transports
        .into_iter()
        .map(|t| Communicator::new(t, Config::with_step_timeout(timeout)))
        .collect()
}

/// Runs `body` on every rank concurrently and returns the results in rank order.
pub async fn run_ranks<T, F, Fut>(comms: Vec<Communicator>, body: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Communicator) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
{
    let tasks: Vec<_> = comms
        .into_iter()
        .map(|c| tokio::spawn(body.clone()(c)))
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("rank task panicked"));
    }
    out
}

fn reference(rule: &dyn Aggregator, inputs: &[Vec<f32>]) -> Vec<f32> {
    let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
    let mut out = vec![0.0; inputs.first().map_or(0, Vec::len)];
    aggregate_into(rule, &refs, &mut out).unwrap();
    out
}

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

/// Messages are matched by (collective, step, tag), not by arrival order: a rank that posts
/// tags in the opposite order of the sender still gets each payload under its own tag, and a
/// message for a step that has been retired is dropped rather than delivered to the next.
pub async fn steps_are_matched_by_key_not_arrival_order<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (a, b) = two_ranks(factory).await;
    let deadline = || tokio::time::Instant::now() + Duration::from_secs(10);
    let payload = |s: &str| byzcoll_runtime::Payload::Host(s.as_bytes().to_vec().into());
    let sender = async {
        // Step 0 is sent, but the receiver never posts it: it must not leak into step 1.
        let step0 = Step {
            collective: 0,
            step: 0,
            sends: vec![SendOp {
                peer: 1,
                tag: 0,
                payload: payload("stale"),
            }],
            recvs: vec![],
            deadline: tokio::time::Instant::now() + Duration::from_millis(200),
        };
        a.exchange(step0).await.unwrap();
        let step1 = Step {
            collective: 0,
            step: 1,
            sends: vec![
                SendOp {
                    peer: 1,
                    tag: 1,
                    payload: payload("one"),
                },
                SendOp {
                    peer: 1,
                    tag: 2,
                    payload: payload("two!"),
                },
            ],
            recvs: vec![],
            deadline: deadline(),
        };
        a.exchange(step1).await.unwrap()
    };
    let receiver = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let step1 = Step {
            collective: 0,
            step: 1,
            sends: vec![],
            recvs: vec![
                RecvOp {
                    peer: 0,
                    tag: 2,
                    len: 4,
                },
                RecvOp {
                    peer: 0,
                    tag: 1,
                    len: 3,
                },
            ],
            deadline: deadline(),
        };
        b.exchange(step1).await.unwrap()
    };
    let (_, got) = tokio::join!(sender, receiver);
    assert_eq!(
        got,
        vec![
            RecvOutcome::Received(payload("two!")),
            RecvOutcome::Received(payload("one"))
        ]
    );
}

/// A rank that sends its last messages and shuts down before the receiver has posted them
/// (it finished its part of a collective first) does not take them along: the receiver still
/// gets them, and only what the rank never sent is `Missing`.
pub async fn messages_outlive_their_sender<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (a, b) = two_ranks(factory).await;
    let deadline = |ms| tokio::time::Instant::now() + Duration::from_millis(ms);
    let long: Vec<u8> = (0..600u32).map(|i| (i % 251) as u8).collect();
    let payload = |bytes: &[u8]| byzcoll_runtime::Payload::Host(bytes.to_vec().into());
    let last = Step {
        collective: 3,
        step: 0,
        sends: vec![
            SendOp {
                peer: 1,
                tag: 0,
                payload: payload(b"last"),
            },
            SendOp {
                peer: 1,
                tag: 1,
                payload: payload(&long),
            },
        ],
        recvs: vec![],
        deadline: deadline(10_000),
    };
    // A transport whose sends complete once buffered returns at once, and the sender is gone
    // before the receiver posts; one whose sends wait for the receiver returns when it posts.
    let sender = async move {
        a.exchange(last).await.unwrap();
        drop(a);
    };
    let recv = |step, tags: std::ops::Range<u32>| Step {
        collective: 3,
        step,
        sends: vec![],
        recvs: tags
            .map(|tag| RecvOp {
                peer: 0,
                tag,
                len: if tag == 0 { 4 } else { long.len() },
            })
            .collect(),
        deadline: deadline(1_000),
    };
    let receiver = async {
        // Long enough for the receiver's transport to notice that the sender is gone.
        tokio::time::sleep(Duration::from_millis(300)).await;
        b.exchange(recv(0, 0..2)).await.unwrap()
    };
    let ((), got) = tokio::join!(sender, receiver);
    assert_eq!(
        got,
        vec![
            RecvOutcome::Received(payload(b"last")),
            RecvOutcome::Received(payload(&long))
        ]
    );
    let never = b.exchange(recv(1, 0..1)).await.unwrap();
    assert_eq!(never, vec![RecvOutcome::Missing]);
}

/// Messages that arrive before their step is posted (a transport may take them in ahead) are
/// checked like any other once it is: a wrong length is `Malformed` and named, the right one
/// is delivered, and one for a step the receiver skipped is dropped, not delivered later.
pub async fn early_messages_are_checked_like_any_other<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (a, b) = two_ranks(factory).await;
    let deadline = || tokio::time::Instant::now() + Duration::from_secs(10);
    let payload = |s: &[u8]| byzcoll_runtime::Payload::Host(s.to_vec().into());
    let step = |step, sends, recvs| Step {
        collective: 4,
        step,
        sends,
        recvs,
        deadline: deadline(),
    };
    let send = |tag, bytes: &[u8]| SendOp {
        peer: 1,
        tag,
        payload: payload(bytes),
    };
    let recv = |tag, len| RecvOp { peer: 0, tag, len };
    let sender = async {
        let steps = [
            (0, vec![send(0, b"ten bytes!"), send(1, b"ok")]),
            (1, vec![send(0, b"skipped")]),
            (2, vec![send(0, b"next")]),
        ];
        for (n, sends) in steps {
            a.exchange(step(n, sends, vec![])).await.unwrap();
        }
    };
    let receiver = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let first = b
            .exchange(step(0, vec![], vec![recv(0, 4), recv(1, 2)]))
            .await
            .unwrap();
        let third = b.exchange(step(2, vec![], vec![recv(0, 4)])).await.unwrap();
        (first, third)
    };
    let ((), (first, third)) = tokio::join!(sender, receiver);
    assert!(
        matches!(&first[0], RecvOutcome::Malformed(why) if why.contains("10")),
        "{:?}",
        first[0]
    );
    assert_eq!(first[1], RecvOutcome::Received(payload(b"ok")));
    assert_eq!(third, vec![RecvOutcome::Received(payload(b"next"))]);
}

/// A send that its step reported done keeps moving while the sender does not call the
/// transport (it computes, say): the receiver, posting later, gets the whole message well
/// within its deadline. (UCX and libfabric report large sends done while the network still
/// moves them, and a task that drove the network hands it back to the progress thread.)
pub async fn sent_messages_move_while_the_sender_is_away<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    use tokio::time::Instant;
    let (a, b) = two_ranks(factory).await;
    let len = 8 << 20;
    let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
    let payload = byzcoll_runtime::Payload::Host(data.into());
    let away = Duration::from_millis(1500);
    let send = Step {
        collective: 5,
        step: 0,
        sends: vec![SendOp {
            peer: 1,
            tag: 0,
            payload: payload.clone(),
        }],
        recvs: vec![],
        deadline: Instant::now() + Duration::from_secs(30),
    };
    let sender = async move {
        a.exchange(send).await.unwrap();
        tokio::time::sleep(away).await; // not calling the transport
        drop(a);
    };
    let receiver = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let start = Instant::now();
        let got = b
            .exchange(Step {
                collective: 5,
                step: 0,
                sends: vec![],
                recvs: vec![RecvOp {
                    peer: 0,
                    tag: 0,
                    len,
                }],
                deadline: start + Duration::from_secs(1),
            })
            .await
            .unwrap();
        (got, start.elapsed())
    };
    let ((), (got, took)) = tokio::join!(sender, receiver);
    assert_eq!(got, vec![RecvOutcome::Received(payload)]);
    assert!(
        took < Duration::from_millis(900),
        "8 MiB took {took:?} to arrive while the sender was away"
    );
}

/// For transports whose progress thread owns the network (UCX, libfabric): a send is done for
/// its step once the thread holds it, within `credit` bytes in flight per peer, so a receiver
/// that has not posted yet does not hold the sender's step; beyond the credit the sender waits
/// (here until its deadline). Everything still arrives. Not part of [`conformance_suite!`]:
/// TCP's sends are done when the socket took them, the local transport's when received.
pub async fn sends_are_done_within_the_credit<F, Fut>(factory: F, credit: usize)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    use tokio::time::Instant;
    let (a, b) = two_ranks(factory).await;
    let big = credit / 2 + 1;
    let payload = |byte: u8| byzcoll_runtime::Payload::Host(vec![byte; big].into());
    let send = |step, byte, wait| Step {
        collective: 0,
        step,
        sends: vec![SendOp {
            peer: 1,
            tag: 0,
            payload: payload(byte),
        }],
        recvs: vec![],
        deadline: Instant::now() + wait,
    };
    // Large enough that the network is not done with it until rank 1 receives it.
    let start = Instant::now();
    a.exchange(send(0, 1, Duration::from_secs(60)))
        .await
        .unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "a send within the credit waited for the receiver"
    );
    let beyond = Duration::from_millis(300);
    let start = Instant::now();
    a.exchange(send(1, 2, beyond)).await.unwrap();
    assert!(
        start.elapsed() >= beyond,
        "a send beyond the credit did not wait"
    );
    for (step, byte) in [(0, 1), (1, 2)] {
        let recv = Step {
            collective: 0,
            step,
            sends: vec![],
            recvs: vec![RecvOp {
                peer: 0,
                tag: 0,
                len: big,
            }],
            deadline: Instant::now() + Duration::from_secs(60),
        };
        let got = b.exchange(recv).await.unwrap();
        assert_eq!(got, vec![RecvOutcome::Received(payload(byte))]);
    }
}

/// Steps that break the contract are errors, not hangs or panics.
pub async fn invalid_steps_are_rejected<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let ranks = factory(2).await;
    let t = &ranks[0];
    let base = || Step {
        collective: 0,
        step: 0,
        sends: vec![],
        recvs: vec![],
        deadline: tokio::time::Instant::now() + Duration::from_secs(1),
    };
    let to_self = Step {
        sends: vec![SendOp {
            peer: 0,
            tag: 0,
            payload: byzcoll_runtime::Payload::Host(Default::default()),
        }],
        ..base()
    };
    let unknown = Step {
        recvs: vec![RecvOp {
            peer: 9,
            tag: 0,
            len: 1,
        }],
        ..base()
    };
    let twice = Step {
        recvs: vec![
            RecvOp {
                peer: 1,
                tag: 0,
                len: 1,
            },
            RecvOp {
                peer: 1,
                tag: 0,
                len: 1,
            },
        ],
        ..base()
    };
    for step in [to_self, unknown, twice] {
        let err = t.exchange(step).await.unwrap_err();
        assert!(
            matches!(err, byzcoll_runtime::TransportError::InvalidUsage(_)),
            "{err}"
        );
    }
}

/// A sharded all-reduce of a coordinate-wise rule longer than a sub-round runs as sub-rounds
/// (here three, of 1000 elements): bitwise the result of one round and of gather mode, with a
/// Byzantine sender's NaN in the last part named by the rank that owns it there; then, with a
/// rank dead, the others finish in about the time one round takes (the sub-rounds after the
/// first neither wait for it nor send to it) and name it once; and with two dead, the call
/// fails, in about the time of one round too.
pub async fn sharded_sub_rounds_match_one_round_and_erase_a_dead_peer_once<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, d, part) = (4usize, 3000usize, 4000usize);
    let timeout = Duration::from_millis(500);
    let comms = comms(factory(n).await, timeout);
    let results = run_ranks(comms, move |mut c| async move {
        let me = c.rank();
        let input = |me: usize| -> Vec<f32> {
            let mut v = vector(me, d);
            if me == 3 {
                v.iter_mut().for_each(|x| *x *= -1e6);
                v[2500] = f32::NAN;
            }
            v
        };
        let rule = Median::new(1);
        let mut whole = input(me);
        let one = c
            .robust_all_reduce(&mut whole, &rule, Policy::Sharded(Replicas::Exactly(1)))
            .await
            .unwrap();
        c.set_sub_round_bytes(part);
        let mut parts = input(me);
        let three = c
            .robust_all_reduce(&mut parts, &rule, Policy::Sharded(Replicas::Exactly(1)))
            .await
            .unwrap();
        let mut gathered = input(me);
        c.robust_all_reduce(&mut gathered, &rule, Policy::Gather)
            .await
            .unwrap();
        // Rank 3 dies before the next call.
        if me == 3 {
            return (me, one, three, whole, parts, gathered, None);
        }
        let mut v = vector(me, d);
        let started = std::time::Instant::now();
        let without = c
            .robust_all_reduce(&mut v, &rule, Policy::Sharded(Replicas::Tolerant))
            .await
            .map(|report| (report, v, started.elapsed()));
        // Rank 2 dies too: a median of the two left fails (f = 1 needs three), and the
        // sub-rounds after the first, failed, one still wait for neither dead rank.
        if me == 2 {
            return (
                me,
                one,
                three,
                whole,
                parts,
                gathered,
                Some((without, None)),
            );
        }
        let mut v = vector(me, d);
        let started = std::time::Instant::now();
        let failed = c
            .robust_all_reduce(&mut v, &rule, Policy::Sharded(Replicas::Exactly(1)))
            .await
            .map(|_| ())
            .map_err(|e| (e, started.elapsed()));
        (
            me,
            one,
            three,
            whole,
            parts,
            gathered,
            Some((without, Some(failed))),
        )
    })
    .await;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut honest_results = Vec::new();
    for (me, one, three, whole, parts, gathered, without) in results {
        assert_eq!(
            bits(&parts),
            bits(&whole),
            "rank {me}: sub-rounds differ from one round"
        );
        assert_eq!(
            bits(&parts),
            bits(&gathered),
            "rank {me}: sub-rounds differ from gather"
        );
        // Each rank names the senders of the non-finite pieces it owns: rank 3's NaN is in
        // shard 3 of one round (owned by rank 3) and in shard 2 of the last sub-round.
        let want = |owner: usize| if me == owner { vec![3] } else { vec![] };
        assert_eq!(one.non_finite, want(3), "rank {me}, one round");
        assert_eq!(three.non_finite, want(2), "rank {me}, sub-rounds");
        assert!(three.faults.is_empty(), "rank {me}: {:?}", three.faults);
        assert_eq!(
            three.stats.step_times.len(),
            3 * one.stats.step_times.len(),
            "rank {me}: three sub-rounds of the one round's steps"
        );
        let Some((without, failed)) = without else {
            continue;
        };
        let (report, v, took) = without.unwrap();
        assert_eq!(report.faults.len(), 1, "rank {me}: {:?}", report.faults);
        assert_eq!(report.faults[0].rank, 3);
        assert_eq!(report.faults[0].fault, Fault::Missing);
        assert_eq!(report.inputs, n - 1, "rank {me}");
        // The dead rank costs the first sub-round what it costs one round (up to a timeout
        // for its piece, one for the versions step and three for the cross-check where a send
        // to it waits for its receive, as over the in-process transport) and the later
        // sub-rounds nothing: 15 timeouts if each sub-round waited for it again (the bound
        // leaves room for a loaded machine).
        assert!(
            took < timeout * 10,
            "rank {me}: {took:?} for three sub-rounds with a dead peer"
        );
        honest_results.push(bits(&v));
        let Some(failed) = failed else { continue };
        let (e, took) = failed.expect_err("a median of two inputs with f = 1");
        assert!(
            matches!(e, Error::TooManyFaults { .. } | Error::ShardLost { .. }),
            "rank {me}: {e}"
        );
        assert!(
            took < timeout * 10,
            "rank {me}: {took:?} for three failing sub-rounds with two dead peers"
        );
    }
    assert_eq!(honest_results.len(), 3);
    assert!(honest_results.windows(2).all(|w| w[0] == w[1]));
}

/// A transport that sees peer `dead` dead at once, the way a rank whose connection to a dead
/// peer broke sees it: receives from it come back missing without waiting, and nothing is sent
/// to it. The other ranks wait for that peer until the deadline.
#[derive(Debug)]
struct SeesDeadAtOnce {
    inner: Box<dyn Transport>,
    dead: usize,
}

impl Transport for SeesDeadAtOnce {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn capabilities(&self) -> byzcoll_runtime::Capabilities {
        self.inner.capabilities()
    }

    fn exchange(
        &self,
        mut step: Step,
    ) -> futures::future::BoxFuture<'_, Result<Vec<RecvOutcome>, byzcoll_runtime::TransportError>>
    {
        Box::pin(async move {
            let dead = self.dead;
            let recvs = std::mem::take(&mut step.recvs);
            step.recvs = recvs.iter().filter(|r| r.peer != dead).copied().collect();
            step.sends.retain(|s| s.peer != dead);
            let mut outcomes = self.inner.exchange(step).await?.into_iter();
            Ok(recvs
                .iter()
                .map(|r| match r.peer == dead {
                    true => RecvOutcome::Missing,
                    false => outcomes.next().expect("one outcome per receive"),
                })
                .collect())
        })
    }
}

/// A silent peer that one rank sees dead at once and the others only at the deadline leaves
/// that rank ahead of them: a step timeout after the scatter, and a step's deadline after each
/// later step in which their sends to the silent peer are not taken. Every step waits a timeout
/// more than the one before, and a sub-round after one that found a peer at fault waits the
/// last step's deadline more, so the rank ahead never counts an honest rank missing. Three
/// sub-rounds, then one round, of a sharded median with 2f + 1 owners: each honest rank names
/// the silent one, and only it.
pub async fn a_peer_one_rank_sees_dead_at_once_costs_no_honest_rank<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, d, part, silent, ahead) = (4usize, 3000usize, 4000usize, 3usize, 1usize);
    let timeout = Duration::from_millis(300);
    let mut transports = factory(n).await;
    let inner = transports.remove(ahead);
    transports.insert(
        ahead,
        Box::new(SeesDeadAtOnce {
            inner,
            dead: silent,
        }),
    );
    let comms = comms(transports, timeout);
    let results = run_ranks(comms, move |mut c| async move {
        let me = c.rank();
        if me == silent {
            // Alive but silent: it keeps its transport open past every deadline of both calls.
            tokio::time::sleep(timeout * 20).await;
            return (me, Vec::new());
        }
        let rule = Median::new(1);
        let mut outcomes = Vec::new();
        // Sub-rounds first: a call leaves the ranks as far apart as its last step's deadline
        // when a rank's sends to the silent peer wait out each step (`PROTOCOL.md`, "Step
        // deadlines"), and the next call does not wait for that.
        for sub_round_bytes in [part, usize::MAX] {
            c.set_sub_round_bytes(sub_round_bytes);
            let mut v = vector(me, d);
            let report = c
                .robust_all_reduce(&mut v, &rule, Policy::Sharded(Replicas::Tolerant))
                .await;
            outcomes.push(report.map(|r| (r.faults, v)));
        }
        (me, outcomes)
    })
    .await;
    let mut honest = Vec::new();
    for (me, outcomes) in results {
        for (call, outcome) in outcomes.into_iter().enumerate() {
            let (faults, v) = outcome.unwrap_or_else(|e| panic!("rank {me}, call {call}: {e}"));
            let named: Vec<usize> = faults.iter().map(|f| f.rank).collect();
            assert_eq!(named, [silent], "rank {me}, call {call}: {faults:?}");
            assert_eq!(faults[0].fault, Fault::Missing);
            honest.push((call, v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()));
        }
    }
    assert_eq!(honest.len(), 2 * (n - 1));
    for call in 0..2 {
        let bits: Vec<_> = honest.iter().filter(|(c, _)| *c == call).collect();
        assert!(bits.windows(2).all(|w| w[0].1 == w[1].1), "call {call}");
    }
}

/// Sharded mode gives bitwise the gather-mode result for coordinate-wise rules with honest
/// inputs, at world sizes 1, 2, 3, 7, 8, 11, for d below, at and above n and not divisible by
/// n, with r = 1, 2 and 2f + 1; and it holds less memory than gather mode.
pub async fn sharded_matches_gather_bitwise<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    for n in [1usize, 2, 3, 7, 8, 11] {
        for d in [0usize, 1, n.saturating_sub(1), n + 3, 1000, 4099] {
            let comms = comms(factory(n).await, Duration::from_secs(20));
            let results = run_ranks(comms, move |mut c| async move {
                let me = c.rank();
                let f = (n - 1) / 2;
                let rules: [Box<dyn Aggregator>; 3] = [
                    Box::new(Median::new(f)),
                    Box::new(TrimmedMean::new(f)),
                    Box::new(Mean::new()),
                ];
                let mut out = Vec::new();
                for rule in &rules {
                    let mut g = vector(me, d);
                    let gather = c
                        .robust_all_reduce(&mut g, rule.as_ref(), Policy::Gather)
                        .await
                        .unwrap();
                    for replicas in [
                        Replicas::Tolerant,
                        Replicas::Exactly(1),
                        Replicas::Exactly(2.min(n)),
                    ] {
                        let mut v = vector(me, d);
                        let report = c
                            .robust_all_reduce(&mut v, rule.as_ref(), Policy::Sharded(replicas))
                            .await
                            .unwrap();
                        assert!(report.faults.is_empty(), "{:?}", report.faults);
                        let r = report.replicas.unwrap();
                        if d >= 64 {
                            assert!(
                                report.peak_bytes <= 2 * r * d * 4 + 64 * n,
                                "n={n} d={d} r={r}: peak {} bytes",
                                report.peak_bytes
                            );
                            assert!(
                                gather.peak_bytes >= n * d * 4,
                                "gather peak {}",
                                gather.peak_bytes
                            );
                        }
                        out.push((rule.name().to_string(), replicas, v == g, g.clone()));
                    }
                }
                out
            })
            .await;
            for rank_results in &results {
                for (rule, replicas, same, _) in rank_results {
                    assert!(
                        same,
                        "{rule} {replicas:?} n={n} d={d}: sharded differs from gather"
                    );
                }
            }
            // And every rank has the same result.
            for rank_results in &results[1..] {
                for (a, b) in rank_results.iter().zip(&results[0]) {
                    assert_eq!(a.3, b.3, "n={n} d={d}");
                }
            }
        }
    }
}

/// Seven ranks, f = 2, all inputs honest; ranks 5 and 6 lie as shard owners (5 flips signs and
/// scales, 6 equivocates: NaN to some ranks, 1e30 to others). With r = 2f + 1 every honest rank
/// gets exactly the honest result; with r = 1 the shards they own come out corrupted, which is
/// the documented price of trusting owners.
pub async fn sharded_survives_byzantine_owners_only_with_replication<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, f, d) = (7usize, 2usize, 701usize);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| vector(r, d)).collect();
    let honest = reference(&Median::new(f), &inputs);
    let comms = comms(factory(n).await, Duration::from_secs(20));
    let results = run_ranks(comms, move |mut c| async move {
        let me = c.rank();
        let tamper: Option<OwnerTamper> = match me {
            5 => Some(std::sync::Arc::new(
                |_s: usize, _dest: usize, honest: &[u8]| {
                    let v: Vec<f32> = honest
                        .chunks_exact(4)
                        .map(|b| -1000.0 * f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect();
                    v.iter()
                        .flat_map(|x| x.to_le_bytes())
                        .collect::<Vec<u8>>()
                        .into()
                },
            )),
            6 => Some(std::sync::Arc::new(
                |_s: usize, dest: usize, honest: &[u8]| {
                    let x: f32 = if dest.is_multiple_of(2) {
                        f32::NAN
                    } else {
                        1e30
                    };
                    filled(x, honest.len() / 4).into()
                },
            )),
            _ => None,
        };
        c.inject_owner_fault(tamper);
        let mut tolerant = vector(me, d);
        let tolerant_report = c
            .robust_all_reduce(
                &mut tolerant,
                &Median::new(f),
                Policy::Sharded(Replicas::Tolerant),
            )
            .await
            .unwrap();
        // Trusting owners without the cross-check: the corruption goes through.
        c.set_agreement(byzcoll_runtime::Agreement::Off);
        let mut trusting = vector(me, d);
        let trusted = c
            .robust_all_reduce(
                &mut trusting,
                &Median::new(f),
                Policy::Sharded(Replicas::Exactly(1)),
            )
            .await
            .map(|_| trusting)
            .map_err(|e| e.to_string());
        // With it (the default), no honest rank returns a corrupted result as success.
        c.set_agreement(byzcoll_runtime::Agreement::Detect);
        let mut checked = vector(me, d);
        let detected = c
            .robust_all_reduce(
                &mut checked,
                &Median::new(f),
                Policy::Sharded(Replicas::Exactly(1)),
            )
            .await
            .map(|_| checked)
            .map_err(|e| e.to_string());
        (me, (tolerant, tolerant_report), trusted, detected)
    })
    .await;
    for (me, (tolerant, tolerant_report), trusting, detected) in results {
        if me >= 5 {
            continue;
        }
        // Owner 6 sent even and odd ranks different versions: the cross-check names it.
        let found = tolerant_report.agreement.expect("Detect reports");
        assert!(
            found.differing_versions.contains(&6),
            "rank {me}: {found:?}"
        );
        assert!(
            !found.differing_versions.iter().any(|&o| o < 5),
            "rank {me}: {found:?}"
        );
        match detected {
            Err(e) => assert!(
                e.contains("non-finite") || e.contains("disagrees"),
                "rank {me}: {e}"
            ),
            Ok(v) => assert_eq!(
                v, honest,
                "rank {me} returned a corrupted result as success"
            ),
        }
        assert_eq!(
            tolerant, honest,
            "rank {me}: r = 2f + 1 must give the honest result"
        );
        // With r = 1, shard s is owned by rank s alone: shards 5 and 6 are the liars'. Ranks
        // that got NaN refuse the round (never a NaN result); the others get corrupted shards.
        let trusting = match trusting {
            Err(e) => {
                assert!(me % 2 == 0 && e.contains("non-finite"), "rank {me}: {e}");
                continue;
            }
            Ok(v) => {
                assert!(
                    me % 2 == 1,
                    "rank {me} got NaN from rank 6 but returned a result"
                );
                v
            }
        };
        for s in 0..n {
            let range = byzcoll_runtime::schedule::chunk_range(d, n, s);
            let same = trusting[range.clone()] == honest[range];
            assert_eq!(same, s < 5, "rank {me}, shard {s}: r = 1 trusts its owner");
        }
    }
}

/// With `r = 2f + 1` owners per shard the versions go by digest (`PROTOCOL.md`): a taker
/// receives one owner's version and the other owners' digests, so that an honest round moves
/// the pieces of `r` owners but the versions of one. Four ranks, `f = 1`, `r = 3`, shards of
/// 1000 `f32`; then rank 3 lies as an owner, first consistently (its digests match its
/// versions: the takers ask for its version and outvote it), then with versions that do not
/// match the digests it sent (every honest rank asked it for one, and names it).
pub async fn replicated_owners_send_one_version_and_digests<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, f, d) = (4usize, 1usize, 4000usize);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| vector(r, d)).collect();
    let honest = reference(&Median::new(f), &inputs);
    let comms = comms(factory(n).await, Duration::from_secs(20));
    let results = run_ranks(comms, move |mut c| async move {
        let me = c.rank();
        let three = Policy::Sharded(Replicas::Exactly(3));
        let mut outcomes = Vec::new();
        for lie in 0..3 {
            let tamper: Option<OwnerTamper> = match (me, lie) {
                (3, 1) => Some(std::sync::Arc::new(
                    |_s: usize, _d: usize, honest: &[u8]| filled(-1000.0, honest.len() / 4).into(),
                )),
                (3, 2) => {
                    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
                    Some(std::sync::Arc::new(
                        move |_s: usize, _d: usize, honest: &[u8]| {
                            let k = calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            filled(k as f32, honest.len() / 4).into()
                        },
                    ))
                }
                _ => None,
            };
            c.inject_owner_fault(tamper);
            let mut v = vector(me, d);
            let done = c.robust_all_reduce(&mut v, &Median::new(f), three).await;
            outcomes.push(done.map(|report| (report, v)).map_err(|e| e.to_string()));
        }
        (me, outcomes)
    })
    .await;
    let piece = d / n * 4;
    // Three owned shards' pieces from three peers, and one version.
    let floor = (3 * 3 * piece + piece) as u64;
    for (me, outcomes) in results.into_iter().filter(|(me, _)| *me < 3) {
        let reports: Vec<RoundReport> = outcomes
            .into_iter()
            .enumerate()
            .map(|(lie, o)| {
                let (report, v) = o.unwrap_or_else(|e| panic!("rank {me}, lie {lie}: {e}"));
                assert_eq!(bits(&v), bits(&honest), "rank {me}, lie {lie}");
                report
            })
            .collect();
        // Honest: the pieces, one version, and under 2 KiB of digests, requests and checks
        // (every owner's version would be 9 more pieces).
        let got = reports[0].stats.bytes_received;
        assert!(
            (floor..floor + 2048).contains(&got),
            "rank {me}: {got} bytes received, {floor} of pieces and one version"
        );
        assert!(
            reports[0].faults.is_empty(),
            "rank {me}: {:?}",
            reports[0].faults
        );
        // A consistent liar: its versions were asked for and outvoted, nobody is at fault.
        assert!(reports[1].stats.bytes_received > got, "rank {me}");
        assert!(
            reports[1].faults.is_empty(),
            "rank {me}: {:?}",
            reports[1].faults
        );
        // Versions that do not match their digests: the owner is named.
        let named = reports[2].faults.iter().any(|pf| {
            pf.rank == 3
                && matches!(&pf.fault, Fault::Malformed(why) if why.contains("does not match"))
        });
        assert!(named, "rank {me}: {:?}", reports[2].faults);
    }
}

/// The Krum family in sharded mode (distance tables computed on shards, exchanged with the
/// same replication, combined by median and summed) selects the same ranks and gives bitwise
/// the gather-mode result on honest inputs.
pub async fn sharded_krum_family_matches_gather<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    for n in [3usize, 7, 8, 11] {
        for d in [1usize, n + 3, 1000] {
            let comms = comms(factory(n).await, Duration::from_secs(20));
            let results = run_ranks(comms, move |mut c| async move {
                let me = c.rank();
                let fk = (n - 3) / 2;
                let mut rules: Vec<Box<dyn Aggregator>> =
                    vec![Box::new(Krum::new(fk)), Box::new(MultiKrum::new(fk, None))];
                if n >= 7 {
                    rules.push(Box::new(Bulyan::new((n - 3) / 4)));
                }
                let mut out = Vec::new();
                for rule in &rules {
                    let mut g = vector(me, d);
                    let gather = c
                        .robust_all_reduce(&mut g, rule.as_ref(), Policy::Gather)
                        .await
                        .unwrap();
                    for replicas in [Replicas::Tolerant, Replicas::Exactly(1)] {
                        let mut v = vector(me, d);
                        let report = c
                            .robust_all_reduce(&mut v, rule.as_ref(), Policy::Sharded(replicas))
                            .await
                            .unwrap();
                        assert_eq!(
                            report.selected,
                            gather.selected,
                            "{} n={n} d={d}",
                            rule.name()
                        );
                        assert_eq!(v, g, "{} {replicas:?} n={n} d={d}", rule.name());
                    }
                    out.push(g);
                }
                out
            })
            .await;
            for r in &results[1..] {
                assert_eq!(r, &results[0], "n={n} d={d}: ranks disagree");
            }
        }
    }
}

/// The geometric median and centered clipping in sharded mode (one statistic round per step:
/// partial distances to the estimate exchanged with r-fold replication) agree with gather mode
/// to 1e-4 relative (the sums run in another order), on every rank identically; NNM followed by
/// a coordinate-wise rule gives bitwise the gather result, and NNM followed by a rule that needs
/// its own statistics is refused with a typed error instead of a silent fallback.
pub async fn sharded_iterative_rules_match_gather<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    for n in [3usize, 7, 8] {
        for d in [1usize, n + 3, 1000] {
            let comms = comms(factory(n).await, Duration::from_secs(20));
            let results = run_ranks(comms, move |mut c| async move {
                let me = c.rank();
                let f = (n - 1) / 2;
                let rules: [Box<dyn Aggregator>; 2] = [
                    Box::new(GeometricMedian::new(f)),
                    Box::new(CenteredClipping::new(f, 5.0, 3).unwrap()),
                ];
                let mut out = Vec::new();
                for rule in &rules {
                    let mut g = vector(me, d);
                    c.robust_all_reduce(&mut g, rule.as_ref(), Policy::Gather)
                        .await
                        .unwrap();
                    for replicas in [Replicas::Tolerant, Replicas::Exactly(1)] {
                        let mut v = vector(me, d);
                        c.robust_all_reduce(&mut v, rule.as_ref(), Policy::Sharded(replicas))
                            .await
                            .unwrap();
                        for (a, b) in v.iter().zip(&g) {
                            assert!(
                                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                                "{} {replicas:?} n={n} d={d}: {a} vs {b}",
                                rule.name()
                            );
                        }
                        out.push(v);
                    }
                }
                // NNM followed by a coordinate-wise rule shards (one distance-table round);
                // followed by a rule that needs statistics of its own, it is refused.
                let nnm = Nnm::new(f, Box::new(Median::new(f)));
                let mut g = vector(me, d);
                c.robust_all_reduce(&mut g, &nnm, Policy::Gather)
                    .await
                    .unwrap();
                let mut v = vector(me, d);
                c.robust_all_reduce(&mut v, &nnm, Policy::Sharded(Replicas::Tolerant))
                    .await
                    .unwrap();
                assert_eq!(v, g, "nnm+median n={n} d={d}");
                out.push(v);
                let nested = Nnm::new((n - 3) / 2, Box::new(Krum::new((n - 3) / 2)));
                let mut v = vector(me, d);
                let refused = c
                    .robust_all_reduce(&mut v, &nested, Policy::Sharded(Replicas::Tolerant))
                    .await;
                assert!(matches!(refused, Err(Error::Unsupported(_))), "{refused:?}");
                out
            })
            .await;
            for r in &results[1..] {
                assert_eq!(r, &results[0], "n={n} d={d}: ranks disagree");
            }
        }
    }
}

/// One-way bandwidth from rank 0 to rank 1 of `ranks` (two transports), in windows of 8
/// messages per step as `benches/p2p.rs` does, 4 KiB to 16 MiB, printed to stderr as
/// `BW <label> <size> B: <MiB/s>`. A measurement, not a check: the transports call it from an
/// ignored test (`cargo test --release -p <crate> --features <f> p2p_bandwidth -- --ignored
/// --nocapture`), e.g. for the cost of frame sealing.
///
/// # Panics
/// When an exchange fails or a message is not received.
pub async fn p2p_bandwidth(ranks: Vec<Box<dyn Transport>>, label: &str) {
    const WINDOW: usize = 8;
    let mut step = 0;
    for exp in [12u32, 16, 20, 24] {
        let len = 1usize << exp;
        let payload = byzcoll_runtime::Payload::Host(vec![7u8; len].into());
        let steps = ((1usize << 30) / (len * WINDOW)).clamp(4, 2000);
        let mut run = |n: usize| {
            let mut all = Vec::new();
            for _ in 0..n {
                let mk = |sends, recvs| Step {
                    collective: 0,
                    step,
                    sends,
                    recvs,
                    deadline: tokio::time::Instant::now() + Duration::from_secs(60),
                };
                let sends = (0..WINDOW)
                    .map(|t| SendOp {
                        peer: 1,
                        tag: t as u32,
                        payload: payload.clone(),
                    })
                    .collect();
                let recvs = (0..WINDOW)
                    .map(|t| RecvOp {
                        peer: 0,
                        tag: t as u32,
                        len,
                    })
                    .collect();
                all.push((mk(sends, vec![]), mk(vec![], recvs)));
                step += 1;
            }
            all
        };
        for (i, batch) in [run(2), run(steps)].into_iter().enumerate() {
            let start = std::time::Instant::now();
            for (s, r) in batch {
                let (a, b) = tokio::join!(ranks[0].exchange(s), ranks[1].exchange(r));
                a.unwrap();
                assert!(b
                    .unwrap()
                    .iter()
                    .all(|o| matches!(o, RecvOutcome::Received(_))));
            }
            if i == 1 {
                let secs = start.elapsed().as_secs_f64();
                let mib = (steps * WINDOW * len) as f64 / (1 << 20) as f64;
                eprintln!("BW {label} {len:>9} B: {:>8.0} MiB/s", mib / secs);
            }
        }
    }
}

/// Which round [`with_an_equivocator`] plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Round {
    /// A gather-mode all-reduce: the liar sends each rank a whole vector.
    Gather,
    /// A reduce-scatter with `2f + 1` owners per shard: the liar sends each owner of each
    /// shard its piece.
    ReduceScatter,
    /// A sharded all-reduce with `2f + 1` owners per shard: as [`Round::ReduceScatter`].
    Sharded,
}

/// One round of `Median::new(f)` on every rank but the last, which is a raw transport that
/// sends `bytes_for(dest)` in every coordinate of what it sends rank `dest` in the round's
/// first step and says nothing afterwards. Rank `r` contributes `r + 1` in every coordinate;
/// each result is the rank's whole vector (gather) or its shard (reduce-scatter).
async fn with_an_equivocator<F, Fut>(
    factory: F,
    (n, f): (usize, usize),
    round: Round,
    agreement: Agreement,
    bytes_for: fn(usize) -> f32,
) -> Vec<Result<(RoundReport, Vec<f32>), Error>>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let d = 16;
    let mut ranks = factory(n).await;
    let liar = ranks.pop().unwrap();
    let timeout = Duration::from_millis(800);
    let honest = comms(ranks, timeout);
    let byzantine = tokio::spawn(async move {
        let piece = |dest: usize, len: usize| Payload::Host(filled(bytes_for(dest), len).into());
        let sends = match round {
            Round::Gather => (0..n - 1)
                .map(|dest| SendOp {
                    peer: dest,
                    tag: 0,
                    payload: piece(dest, d),
                })
                .collect(),
            Round::ReduceScatter | Round::Sharded => {
                byzcoll_runtime::schedule::sharded::scatter_sends(n - 1, n, 2 * f + 1)
                    .into_iter()
                    .map(|(owner, s)| SendOp {
                        peer: owner,
                        tag: s as u32,
                        payload: piece(owner, chunk_range(d, n, s).len()),
                    })
                    .collect()
            }
        };
        let step = Step {
            collective: 0,
            step: 0,
            sends,
            recvs: vec![],
            deadline: tokio::time::Instant::now() + timeout,
        };
        liar.exchange(step).await.unwrap();
        // Kept alive (silent) until the honest ranks are done.
        tokio::time::sleep(timeout * 4).await;
        drop(liar);
    });
    let results = run_ranks(honest, move |mut c| async move {
        c.set_agreement(agreement);
        let mut v = vec![(c.rank() + 1) as f32; d];
        match round {
            Round::Gather => c
                .robust_all_reduce(&mut v, &Median::new(f), Policy::Gather)
                .await
                .map(|report| (report, v)),
            Round::Sharded => c
                .robust_all_reduce(&mut v, &Median::new(f), Policy::Sharded(Replicas::Tolerant))
                .await
                .map(|report| (report, v)),
            Round::ReduceScatter => {
                let mut out = vec![0.0; chunk_range(d, n, c.rank()).len()];
                c.robust_reduce_scatter(&v, &mut out, &Median::new(f), Replicas::Tolerant)
                    .await
                    .map(|report| (report, out))
            }
        }
    })
    .await;
    byzantine.await.unwrap();
    results
}

/// Issue #14's equivocation: the last rank sends rank 0 a vector of 1000 and the others a
/// vector of -1000 (n = 7, f = 2; honest medians 4 and 3). Without the cross-check rank 0
/// returns another result than the others, all of them `Ok` with `faults = []`. With it
/// (`Detect`, the default) rank 0 gets `Error::Disagreement` and the others, which agree,
/// name rank 0 as disagreeing and the liar as the sender whose inputs differed.
pub async fn an_equivocating_sender_never_splits_honest_ranks_silently<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, f) = (7, 2);
    let split = |dest: usize| if dest == 0 { 1000.0 } else { -1000.0 };
    let off = with_an_equivocator(&factory, (n, f), Round::Gather, Agreement::Off, split).await;
    let values: Vec<f32> = off.iter().map(|r| r.as_ref().unwrap().1[0]).collect();
    assert_eq!(
        values,
        [4.0, 3.0, 3.0, 3.0, 3.0, 3.0],
        "the silent split, under Off"
    );
    assert!(off.iter().all(|r| r.as_ref().unwrap().0.faults.is_empty()));

    let detect =
        with_an_equivocator(&factory, (n, f), Round::Gather, Agreement::Detect, split).await;
    for (me, result) in detect.into_iter().enumerate() {
        match (me, result) {
            (
                0,
                Err(Error::Disagreement {
                    agreeing,
                    differing_inputs,
                    ..
                }),
            ) => {
                assert_eq!(agreeing, [0]);
                assert_eq!(differing_inputs, [n - 1]);
            }
            (0, other) => panic!("rank 0 must be told it is out of step: {other:?}"),
            (_, Ok((report, v))) => {
                assert_eq!(v[0], 3.0, "rank {me}");
                let found = report.agreement.expect("Detect reports");
                assert_eq!(found.disagreeing, [0], "rank {me}");
                assert_eq!(found.unconfirmed, [n - 1], "rank {me}");
                assert_eq!(found.differing_inputs, [n - 1], "rank {me}");
            }
            (_, Err(e)) => panic!("rank {me}: {e}"),
        }
    }
}

/// Five ranks, median `f = 2`, one owner per shard under `Detect`: rank 4 sends the even
/// ranks its honest version of its shard and the odd ranks another, finite one. Ranks 0 and 2
/// (with the liar, whose own result is honest: 3 = n - f agree) return exactly the honest
/// result; ranks 1 and 3 hold a corrupted shard and must be told so with
/// `Error::Disagreement`, never return it as success. The result digest is what tells them
/// (their versions of every other shard match), so this checks that it covers every shard.
pub async fn a_lone_owner_that_equivocates_never_splits_honest_ranks_silently<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, f, d) = (5usize, 2usize, 333usize);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| vector(r, d)).collect();
    let honest = reference(&Median::new(f), &inputs);
    let comms = comms(factory(n).await, Duration::from_secs(20));
    let results = run_ranks(comms, move |mut c| async move {
        let me = c.rank();
        if me == 4 {
            let tamper: OwnerTamper =
                std::sync::Arc::new(|_s, dest: usize, honest: &[u8]| match dest % 2 {
                    0 => honest.to_vec().into(),
                    _ => honest
                        .chunks_exact(4)
                        .flat_map(|b| {
                            (f32::from_le_bytes([b[0], b[1], b[2], b[3]]) + 1.0).to_le_bytes()
                        })
                        .collect::<Vec<u8>>()
                        .into(),
                });
            c.inject_owner_fault(Some(tamper));
        }
        let mut v = vector(me, d);
        let outcome = c
            .robust_all_reduce(
                &mut v,
                &Median::new(f),
                Policy::Sharded(Replicas::Exactly(1)),
            )
            .await;
        (me, outcome.map(|report| (report, v)))
    })
    .await;
    for (me, outcome) in results {
        match (me % 2, outcome) {
            (_, _) if me == 4 => {}
            (0, Ok((report, v))) => {
                assert_eq!(bits(&v), bits(&honest), "rank {me}");
                let found = report.agreement.expect("Detect reports");
                assert_eq!(found.disagreeing, [1, 3], "rank {me}");
            }
            (1, Err(Error::Disagreement { agreeing, .. })) => {
                assert_eq!(agreeing, [1, 3], "rank {me}")
            }
            (_, other) => panic!("rank {me}: {:?}", other.map(|(r, _)| r)),
        }
    }
}

/// The bytes of `elements` copies of `x`.
fn filled(x: f32, elements: usize) -> Vec<u8> {
    std::iter::repeat_n(x.to_le_bytes(), elements)
        .flatten()
        .collect()
}

/// The bits of a result, for bitwise comparisons.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Issue #14's equivocation under `Agreement::Enforce` (n = 7, f = 2): the last rank sends
/// rank 0 a vector of 1000 and the others one of -1000, then stays silent. The echo decides
/// -1000 (what most ranks got) for it on every honest rank, rank 0 recovers that vector from
/// the others, and every honest rank returns `Ok` with bitwise the same result (median 3) and
/// names the liar in `differing_inputs`. When every rank gets another vector there is no
/// majority: every honest rank leaves the liar out alike (median of 1..=6: 3.5). Before that,
/// honest worlds of every size give bitwise the `Detect` result.
pub async fn an_equivocating_sender_is_agreed_on_under_enforce<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    // Honest worlds of every size, empty and short vectors, f = (n - 1)/3: Enforce gives
    // bitwise the Detect result (the same inputs in the same order).
    for n in WORLD_SIZES {
        for d in [0usize, 5] {
            let results = run_ranks(
                comms(factory(n).await, Duration::from_secs(20)),
                move |mut c| async move {
                    let rule = Median::new((n - 1) / 3);
                    let mut detect = vector(c.rank(), d);
                    c.robust_all_reduce(&mut detect, &rule, Policy::Gather)
                        .await
                        .unwrap();
                    c.set_agreement(Agreement::Enforce);
                    let mut enforce = vector(c.rank(), d);
                    let report = c
                        .robust_all_reduce(&mut enforce, &rule, Policy::Gather)
                        .await
                        .unwrap();
                    assert_eq!(bits(&enforce), bits(&detect), "n = {n}, d = {d}");
                    assert_eq!(report.inputs, n, "n = {n}, d = {d}");
                    assert!(report.faults.is_empty() && !report.erased_self);
                    enforce
                },
            )
            .await;
            for r in &results {
                assert_eq!(bits(r), bits(&results[0]), "n = {n}, d = {d}");
            }
        }
    }
    let (n, f) = (7, 2);
    for (split, expected, inputs) in [
        (
            (|dest| if dest == 0 { 1000.0 } else { -1000.0 }) as fn(usize) -> f32,
            3.0,
            n,
        ),
        (|dest| 100.0 * (dest + 1) as f32, 3.5, n - 1),
    ] {
        let results =
            with_an_equivocator(&factory, (n, f), Round::Gather, Agreement::Enforce, split).await;
        let first = bits(&results[0].as_ref().expect("rank 0 completes").1);
        for (me, result) in results.iter().enumerate() {
            let (report, v) = result.as_ref().unwrap_or_else(|e| panic!("rank {me}: {e}"));
            assert_eq!(bits(v), first, "rank {me}: honest ranks agree bitwise");
            assert_eq!(v[0], expected, "rank {me}");
            assert_eq!(report.inputs, inputs, "rank {me}");
            let found = report
                .agreement
                .as_ref()
                .expect("Enforce ends with the cross-check");
            assert!(found.disagreeing.is_empty(), "rank {me}: {found:?}");
            assert_eq!(found.differing_inputs, [n - 1], "rank {me}");
            assert!(report.faults.iter().any(|p| p.rank == n - 1), "rank {me}");
        }
    }
}

/// `Agreement::Enforce` in sharded mode (n = 7, f = 2).
///
/// 1. Honest worlds with `r = 2f + 1` owners per shard give bitwise the `Detect` result.
/// 2. Result equivocation with `r = 3` owners per shard: rank 5 sends every rank 1000 for
///    its shards, and rank 6 sends even ranks 1000 and odd ranks -1000, so shard 5 (owners
///    5, 6, 0) has the median 1000 on even ranks and rank 0's value on odd ones: under
///    `Detect` the honest ranks split (and are told so). Under `Enforce` the echo decides
///    every owner's results alike: every honest rank returns `Ok` with bitwise the same
///    result.
/// 3. Input equivocation with `r = 2f + 1`: the last rank (a raw transport) gives every owner
///    of its shards another piece, then stays silent. Every honest rank returns `Ok` with
///    bitwise the same result and counts the liar at fault.
pub async fn byzantine_owners_and_senders_are_agreed_on_under_enforce_in_sharded_mode<F, Fut>(
    factory: F,
) where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, f, d) = (7usize, 2usize, 701usize);
    let comms_ = comms(factory(n).await, Duration::from_secs(20));
    let results = run_ranks(comms_, move |mut c| async move {
        let me = c.rank();
        let tolerant = Policy::Sharded(Replicas::Tolerant);
        let mut detect = vector(me, d);
        c.robust_all_reduce(&mut detect, &Median::new(f), tolerant)
            .await
            .unwrap();
        c.set_agreement(Agreement::Enforce);
        let mut enforce = vector(me, d);
        let report = c
            .robust_all_reduce(&mut enforce, &Median::new(f), tolerant)
            .await
            .unwrap();
        assert_eq!(bits(&enforce), bits(&detect), "rank {me}: honest world");
        assert!(report.faults.is_empty() && !report.erased_self, "rank {me}");
        let found = report
            .agreement
            .as_ref()
            .expect("Enforce ends with the cross-check");
        assert_eq!(
            found,
            &byzcoll_runtime::AgreementReport::default(),
            "rank {me}: an honest world differs nowhere"
        );
        let tamper: Option<OwnerTamper> = match me {
            5 | 6 => Some(std::sync::Arc::new(
                move |_s: usize, dest: usize, honest: &[u8]| {
                    let x: f32 = if me == 6 && dest % 2 == 1 {
                        -1000.0
                    } else {
                        1000.0
                    };
                    filled(x, honest.len() / 4).into()
                },
            )),
            _ => None,
        };
        c.inject_owner_fault(tamper);
        let three = Policy::Sharded(Replicas::Exactly(3));
        let mut outcomes = Vec::new();
        for agreement in [Agreement::Detect, Agreement::Enforce] {
            c.set_agreement(agreement);
            let mut v = vector(me, d);
            let done = c.robust_all_reduce(&mut v, &Median::new(f), three).await;
            outcomes.push(done.map(|report| (report, v)));
        }
        (me, outcomes)
    })
    .await;
    let honest: Vec<&(usize, Vec<_>)> = results.iter().filter(|(me, _)| *me < 5).collect();
    // Detect: the split is real, and no honest rank is left unaware of it.
    let detect: Vec<&Result<(RoundReport, Vec<f32>), Error>> =
        honest.iter().map(|(_, o)| &o[0]).collect();
    let values: Vec<Vec<u32>> = detect
        .iter()
        .filter_map(|r| r.as_ref().ok().map(|(_, v)| bits(v)))
        .collect();
    assert!(
        values.len() < honest.len() || values.iter().any(|v| v != &values[0]),
        "the owners' equivocation must split the honest ranks under Detect"
    );
    for (me, outcome) in detect.iter().enumerate() {
        if let Ok((report, _)) = outcome {
            let found = report.agreement.as_ref().expect("Detect reports");
            assert!(
                !found.disagreeing.is_empty(),
                "rank {me}: the split is reported"
            );
        }
    }
    // Enforce: every honest rank the same bits, as success.
    let enforce: Vec<&(RoundReport, Vec<f32>)> = honest
        .iter()
        .map(|(me, o)| o[1].as_ref().unwrap_or_else(|e| panic!("rank {me}: {e}")))
        .collect();
    for (me, (report, v)) in enforce.iter().enumerate() {
        assert_eq!(
            bits(v),
            bits(&enforce[0].1),
            "rank {me}: honest ranks agree bitwise"
        );
        let found = report
            .agreement
            .as_ref()
            .expect("Enforce ends with the cross-check");
        // Only the liars may be out of step (rank 5 combines its own honest results).
        assert!(
            found.disagreeing.iter().all(|&r| r >= 5),
            "rank {me}: {found:?}"
        );
    }

    let split = |dest: usize| 100.0 * (dest + 1) as f32;
    let results =
        with_an_equivocator(&factory, (n, f), Round::Sharded, Agreement::Enforce, split).await;
    let first = bits(&results[0].as_ref().expect("rank 0 completes").1);
    for (me, result) in results.iter().enumerate() {
        let (report, v) = result.as_ref().unwrap_or_else(|e| panic!("rank {me}: {e}"));
        assert_eq!(bits(v), first, "rank {me}: honest ranks agree bitwise");
        let found = report
            .agreement
            .as_ref()
            .expect("Enforce ends with the cross-check");
        assert!(found.disagreeing.is_empty(), "rank {me}: {found:?}");
        assert!(report.faults.iter().any(|p| p.rank == n - 1), "rank {me}");
    }
}

/// Issue #14's stall under `Agreement::Enforce`, in gather and sharded mode (`r = 3`): rank 2
/// of 4 starts after the others' deadline. They leave it out alike and return 2. Where the
/// transport kept their messages, the echo tells rank 2 that nobody had its input (gather) or
/// its results (sharded) in time: it leaves them out too and returns bitwise the others'
/// result, with `erased_self`; otherwise it gets an error. Never another value as success.
pub async fn a_stalled_rank_that_resumes_under_enforce_is_never_split<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let keeps_late_messages = factory(1).await[0].name() == "tcp";
    for policy in [Policy::Gather, Policy::Sharded(Replicas::Tolerant)] {
        let results = with_a_stalled_rank(Agreement::Enforce, policy, factory(4).await).await;
        let others = bits(&results[0].as_ref().expect("rank 0").1);
        for (me, result) in results.iter().enumerate() {
            match result {
                Ok((report, v)) => {
                    assert_eq!(bits(v), others, "{policy:?} rank {me}");
                    assert_eq!(v[0], 2.0, "{policy:?} rank {me}");
                    if policy == Policy::Gather || me != 2 {
                        assert_eq!(report.inputs, 3, "{policy:?} rank {me}");
                    }
                    assert_eq!(report.erased_self, me == 2, "{policy:?} rank {me}");
                }
                Err(
                    Error::Disagreement { .. }
                    | Error::TooManyFaults { .. }
                    | Error::ShardLost { .. },
                ) if me == 2 && !keeps_late_messages => {}
                Err(e) => panic!("{policy:?} rank {me}: {e}"),
            }
        }
    }
}

/// One round of `Median::new(1)` over 4 ranks (rank `r` contributes `r + 1`, step timeout
/// 400 ms) in which rank 2 starts three timeouts late.
async fn with_a_stalled_rank(
    agreement: Agreement,
    policy: Policy,
    transports: Vec<Box<dyn Transport>>,
) -> Vec<Result<(RoundReport, Vec<f32>), Error>> {
    let timeout = Duration::from_millis(400);
    run_ranks(comms(transports, timeout), move |mut c| async move {
        c.set_agreement(agreement);
        if c.rank() == 2 {
            tokio::time::sleep(timeout * 3).await;
        }
        let mut v = vec![(c.rank() + 1) as f32; 8];
        let result = c
            .robust_all_reduce(&mut v, &Median::new(1), policy)
            .await
            .map(|report| (report, v));
        // The others stay up (as processes would) while rank 2 catches up.
        if c.rank() != 2 {
            tokio::time::sleep(timeout * 5).await;
        }
        result
    })
    .await
}

/// Issue #14's stall: rank 2 of 4 (f = 1, rank `r` contributes `r + 1`) starts its round
/// after the others' deadline. They erase it and return 2; where the transport kept their
/// messages it then finds all four inputs and would return 2.5. Under `Off` it does, with
/// `faults = []`; under `Detect` it gets `Error::Disagreement` (or, without the inputs,
/// `TooManyFaults`), and the others report it erased and unconfirmed.
pub async fn a_stalled_rank_that_resumes_never_returns_another_result_as_success<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let run = |agreement, transports| with_a_stalled_rank(agreement, Policy::Gather, transports);
    let keeps_late_messages = factory(1).await[0].name() == "tcp";
    // Transports that keep messages for a late receiver (TCP, UCX, libfabric) give rank 2
    // all four inputs; the in-process one drops sends at the sender's deadline, and rank 2
    // then has too few.
    let off = run(Agreement::Off, factory(4).await).await;
    match &off[2] {
        Ok((report, v)) => assert_eq!((v[0], report.faults.len()), (2.5, 0), "the silent split"),
        Err(e) => assert!(!keeps_late_messages, "{e}"),
    }
    assert_eq!(off[0].as_ref().unwrap().1[0], 2.0);

    let detect = run(Agreement::Detect, factory(4).await).await;
    for (me, result) in detect.into_iter().enumerate() {
        match result {
            Err(Error::Disagreement { agreeing, .. }) if me == 2 => assert_eq!(agreeing, [2]),
            Err(Error::TooManyFaults { .. }) if me == 2 && !keeps_late_messages => {}
            Ok((report, v)) if me != 2 => {
                assert_eq!(v[0], 2.0);
                assert_eq!(report.faults.len(), 1);
                assert_eq!(report.faults[0].rank, 2);
                assert_eq!(report.agreement.unwrap().unconfirmed, [2]);
            }
            other => panic!("rank {me}: {other:?}"),
        }
    }
}

/// `robust_reduce_scatter` gives every rank bitwise its own shard of the sharded all-reduce
/// (and of the gather-mode one, for coordinate-wise rules) at every world size, for vectors
/// shorter than the world and not divisible by it, with r = 1, 2 and 2f + 1, for
/// coordinate-wise rules and the Krum family; a wrong output length is refused on every rank
/// before any data moves.
pub async fn robust_reduce_scatter_gives_each_rank_its_shard_of_the_all_reduce<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    for n in WORLD_SIZES {
        for d in [0usize, 1, n + 3, 1000] {
            let comms = comms(factory(n).await, Duration::from_secs(20));
            run_ranks(comms, move |mut c| async move {
                let me = c.rank();
                let f = (n - 1) / 2;
                let mut rules: Vec<Box<dyn Aggregator>> =
                    vec![Box::new(Median::new(f)), Box::new(TrimmedMean::new(f))];
                if n >= 5 {
                    rules.push(Box::new(Krum::new((n - 3) / 2)));
                }
                let shard = chunk_range(d, n, me);
                let mut wrong = vec![0.0f32; shard.len() + 1];
                let refused = c
                    .robust_reduce_scatter(
                        &vector(me, d),
                        &mut wrong,
                        &Median::new(f),
                        Replicas::Tolerant,
                    )
                    .await;
                assert!(
                    matches!(refused, Err(Error::InvalidUsage(_))),
                    "{refused:?}"
                );
                for rule in &rules {
                    for replicas in [
                        Replicas::Tolerant,
                        Replicas::Exactly(1),
                        Replicas::Exactly(2.min(n)),
                    ] {
                        let mut all = vector(me, d);
                        c.robust_all_reduce(&mut all, rule.as_ref(), Policy::Sharded(replicas))
                            .await
                            .unwrap();
                        let mut out = vec![f32::NAN; shard.len()];
                        let report = c
                            .robust_reduce_scatter(
                                &vector(me, d),
                                &mut out,
                                rule.as_ref(),
                                replicas,
                            )
                            .await
                            .unwrap();
                        let what = format!("{} {replicas:?} n={n} d={d} rank {me}", rule.name());
                        assert_eq!(out, all[shard.clone()], "{what}");
                        assert!(report.faults.is_empty(), "{what}: {:?}", report.faults);
                        let found = report.agreement.expect("Detect is the default");
                        assert_eq!(found, byzcoll_runtime::AgreementReport::default(), "{what}");
                        let krum = rule.name().starts_with("krum");
                        if krum {
                            assert!(report.selected.is_some(), "{what}");
                        }
                        // Phase 1, the distance tables for Krum, phase 3 (with r > 1 owners
                        // the versions go by digest: the requests and the resends follow),
                        // the cross-check.
                        let stats = &report.stats;
                        let r = report.replicas.unwrap();
                        let steps = 3 + usize::from(krum) + if r > 1 { 2 } else { 0 };
                        assert_eq!(stats.step_times.len(), steps, "{what}");
                        let scattered: usize =
                            byzcoll_runtime::schedule::sharded::scatter_sends(me, n, r)
                                .into_iter()
                                .map(|(_, s)| chunk_range(d, n, s).len() * 4)
                                .sum();
                        assert!(stats.bytes_sent >= scattered as u64, "{what}: {stats:?}");
                        assert_eq!(stats.bytes_received > 0, n > 1, "{what}: {stats:?}");
                    }
                }
            })
            .await;
        }
    }
}

/// A sender that gives owners of one shard different pieces (the last of 7 ranks, f = 2,
/// r = 2f + 1: rank 0 gets 1000, the other owners -1000) cannot move any rank's shard: the
/// owners' versions are combined by their median, every honest rank gets 3 (the honest median)
/// and, under `Detect`, the report names the liar among the senders whose inputs differed.
pub async fn an_equivocating_sender_is_named_in_a_reduce_scatter<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, f) = (7, 2);
    let split = |dest: usize| if dest == 0 { 1000.0 } else { -1000.0 };
    let detect = with_an_equivocator(
        &factory,
        (n, f),
        Round::ReduceScatter,
        Agreement::Detect,
        split,
    )
    .await;
    for (me, result) in detect.into_iter().enumerate() {
        let (report, shard) = result.unwrap_or_else(|e| panic!("rank {me}: {e}"));
        assert!(shard.iter().all(|&x| x == 3.0), "rank {me}: {shard:?}");
        let found = report.agreement.expect("Detect reports");
        assert!(found.disagreeing.is_empty(), "rank {me}: {found:?}");
        assert_eq!(found.unconfirmed, [n - 1], "rank {me}: {found:?}");
        // Co-owners with rank 0 see the split; a rank that shares no shard with rank 0 that the
        // liar sent differently may not, but every rank here co-owns one with it (r = 5 of 7).
        assert_eq!(found.differing_inputs, [n - 1], "rank {me}: {found:?}");
    }
}

/// Issue #14's stall in a reduce-scatter (4 ranks, f = 1, r = 3): rank 2 starts after the
/// others' deadline; they erase it and finish. Where the transport kept their messages rank 2
/// then finds every input, which is not the input set the others used: it gets
/// `Error::Disagreement`, never its shard presented as success. Elsewhere it lacks inputs and
/// gets another typed error; the others report it erased and unconfirmed.
pub async fn a_stalled_rank_that_resumes_is_told_in_a_reduce_scatter<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let timeout = Duration::from_millis(400);
    let keeps_late_messages = factory(1).await[0].name() == "tcp";
    let comms = comms(factory(4).await, timeout);
    let results = run_ranks(comms, move |mut c| async move {
        if c.rank() == 2 {
            tokio::time::sleep(timeout * 4).await;
        }
        let v = vec![(c.rank() + 1) as f32; 8];
        let mut out = vec![0.0f32; 2];
        let result = c
            .robust_reduce_scatter(&v, &mut out, &Median::new(1), Replicas::Tolerant)
            .await
            .map(|report| (report, out));
        if c.rank() != 2 {
            tokio::time::sleep(timeout * 6).await;
        }
        result
    })
    .await;
    for (me, result) in results.into_iter().enumerate() {
        match result {
            Err(Error::Disagreement { agreeing, .. }) if me == 2 => assert_eq!(agreeing, [2]),
            Err(Error::TooManyFaults { .. } | Error::ShardLost { .. })
                if me == 2 && !keeps_late_messages => {}
            Ok((report, v)) if me != 2 => {
                assert_eq!(v, [2.0, 2.0], "rank {me}");
                assert!(report.faults.iter().all(|f| f.rank == 2), "rank {me}");
                assert!(!report.faults.is_empty(), "rank {me}");
                assert_eq!(report.agreement.unwrap().unconfirmed, [2], "rank {me}");
            }
            other => panic!("rank {me}: {other:?}"),
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
            let step = Step {
                collective,
                step: 0,
                sends,
                recvs: vec![],
                deadline: tokio::time::Instant::now() + timeout,
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
