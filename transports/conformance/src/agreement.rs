//! Agreement under attack: a sender that equivocates, a lone owner that equivocates and a rank
//! that stalls and resumes, under `Off`, `Detect` and `Enforce`, in gather and sharded rounds
//! and in the reduce-scatter.

use std::future::Future;
use std::time::Duration;

use byzcoll_aggregators::Median;
use byzcoll_runtime::round::Shape;
use byzcoll_runtime::schedule::chunk_range;
use byzcoll_runtime::{
    Agreement, Error, OwnerTamper, Payload, Policy, Replicas, RoundReport, SendOp, Step, Transport,
};

use crate::harness::{bits, comms, filled, reference, run_ranks, vector};
use crate::WORLD_SIZES;

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
        // The honest ranks' round, as its fingerprint says.
        let shape = match round {
            Round::Gather => Shape::Gather,
            Round::Sharded => Shape::Sharded(Replicas::Tolerant),
            Round::ReduceScatter => Shape::ReduceScatter(Replicas::Tolerant),
        };
        let step = Step {
            collective: 0,
            step: 0,
            call: byzcoll_runtime::calls::robust::<f32>(
                &Median::new(f),
                shape,
                None,
                false,
                d,
                None,
            ),
            sends,
            recvs: vec![],
            deadline: tokio::time::Instant::now() + timeout,
            quorum: None,
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

/// Equivocation: the last rank sends rank 0 a vector of 1000 and the others a
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

/// Equivocation under `Agreement::Enforce` (n = 7, f = 2): the last rank sends
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

/// A stalled rank under `Agreement::Enforce`, in gather and sharded mode (`r = 3`): rank 2
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

/// A stalled rank: rank 2 of 4 (f = 1, rank `r` contributes `r + 1`) starts its round
/// after the others' deadline. They erase it and return 2; where the transport kept their
/// messages it then finds all four inputs and would return 2.5. Under `Off` it does, with
/// `faults = []`; under `Detect` the cross-check shows it that the others went without its
/// input, and it aggregates again without it (realignment): 2, like them, with its own input
/// `realigned` and `erased_self` (without the inputs, `TooManyFaults`); the others report it
/// erased and unconfirmed.
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
            Ok((report, v)) if me == 2 => {
                assert_eq!(v[0], 2.0);
                assert!(report.erased_self);
                assert_eq!(report.agreement.unwrap().realigned, [2]);
            }
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

/// A stalled rank in a reduce-scatter (4 ranks, f = 1, r = 3): rank 2 starts after the
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
