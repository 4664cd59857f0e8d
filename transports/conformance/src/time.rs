//! Faults in time: stragglers do not set the pace of the others.

use std::future::Future;
use std::time::{Duration, Instant};

use byzcoll_aggregators::Median;
use byzcoll_runtime::{
    Agreement, Error, Fault, PeerFault, PeerHealth, Policy, RecvOutcome, Replicas, RoundReport,
    Step, Stragglers, Symptom, Transport,
};

use crate::harness::{comms, passed_to_inner, reference, run_ranks};

/// A straggler does not set the pace: after a barrier (under `Detect` a communicator's first collective
/// waits for every rank), rank 3 of 4 (f = 1, stragglers `auto`: s = 1, since the median
/// keeps `n - s = 3 > 2f`, and in sharded mode 3 owners per shard keep `f + 1` alike versions
/// in time) calls its robust all-reduce 1.5 s after the others, under a 10 s step timeout, in
/// gather mode (`Detect`, `Enforce`) and sharded with `2f + 1` owners (`Detect`: the owners'
/// sync has it leave its own late piece out as its co-owners did). The others end their round long before it arrives, name it
/// late, and return the median of their inputs 1, 2 and 3. The straggler never returns
/// another result as success: under `Enforce` the echo tells it that nobody had its input in
/// time, and (where the transport kept the others' messages for it) it leaves its input out
/// as they did and returns bitwise their result, with `erased_self`; under `Detect` the
/// cross-check shows it that the others went without its input, and it aggregates again
/// without it (its input `realigned`), with the same outcome.
pub async fn a_straggler_does_not_set_the_pace<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let delay = Duration::from_millis(1500);
    let sharded = Policy::Sharded(Replicas::Tolerant);
    {
        for (policy, agreement) in [
            (Policy::Gather, Agreement::Detect),
            (Policy::Gather, Agreement::Enforce),
            (sharded, Agreement::Detect),
        ] {
            let results = with_a_straggler(agreement, policy, delay, factory(4).await).await;
            for (me, (result, took, health)) in results.iter().enumerate().take(3) {
                let (report, v) = result
                    .as_ref()
                    .unwrap_or_else(|e| panic!("{policy:?} {agreement:?} rank {me}: {e}"));
                assert!(
                    *took < delay / 2,
                    "{policy:?} {agreement:?} rank {me} waited {took:?} for the straggler (steps: {:?})",
                    report.stats.step_times
                );
                assert!(
                    v.iter().all(|&x| x == 2.0),
                    "{policy:?} {agreement:?} {v:?}"
                );
                let late = PeerFault {
                    rank: 3,
                    fault: Fault::Late,
                };
                assert_eq!(report.faults, [late], "{policy:?} {agreement:?} rank {me}");
                assert_eq!(report.stragglers, 1, "{policy:?} {agreement:?} rank {me}");
                // Fault memory: the straggler is late one round in a row, the others fine.
                for peer in health {
                    match peer.rank {
                        3 => assert_eq!(peer.streak, Some((Symptom::Late, 1)), "rank {me}"),
                        _ => assert!(peer.is_healthy(), "rank {me}: {peer:?}"),
                    }
                }
            }
            match &results[3].0 {
                Ok((report, v)) => {
                    assert!(
                        v.iter().all(|&x| x == 2.0),
                        "{policy:?} {agreement:?} {v:?}"
                    );
                    assert!(report.erased_self, "{policy:?} {agreement:?}");
                    if agreement == Agreement::Detect && policy == Policy::Gather {
                        let found = report.agreement.as_ref().expect("a cross-check");
                        assert_eq!(found.realigned, [3], "{found:?}");
                    }
                }
                Err(
                    Error::Disagreement { .. }
                    | Error::TooManyFaults { .. }
                    | Error::ShardLost { .. },
                ) => {}
                Err(e) => panic!("{policy:?} {agreement:?} the straggler: {e}"),
            }
        }
    }
    // Sharded rounds under `Enforce` do not end steps early (the echo of the owners' versions
    // waits for every owner): `auto` is none there, and asking for some is refused rather
    // than silently waited out.
    let results = run_ranks(
        comms(factory(4).await, Duration::from_secs(10)),
        move |mut c| async move {
            let mut v = vec![1.0f32; 8];
            c.set_agreement(Agreement::Enforce);
            c.set_stragglers(Stragglers::Auto);
            let auto = c.robust_all_reduce(&mut v, &Median::new(1), sharded).await;
            c.set_stragglers(Stragglers::Exactly(1));
            let one = c.robust_all_reduce(&mut v, &Median::new(1), sharded).await;
            (auto, one)
        },
    )
    .await;
    for (me, (auto, one)) in results.into_iter().enumerate() {
        let auto = auto.unwrap_or_else(|e| panic!("rank {me}: {e}"));
        assert_eq!((auto.stragglers, auto.faults.len()), (0, 0), "rank {me}");
        assert!(
            matches!(one, Err(Error::Unsupported(_))),
            "rank {me}: {one:?}"
        );
    }
}

/// A rank silent after its input sets no pace: rank 3 of 4 sends its input of a robust round
/// in time and then nothing (a Byzantine rank that withholds its check and its confirmation,
/// or an honest one stopped between steps), and stays up. Under `Detect` with stragglers
/// `auto`, after a barrier (a communicator's first collective waits for every rank), the
/// others wait for its check and its confirmation a grace (200 ms here) past the other two
/// peers', not the step timeout (10 s), and return the median of all four inputs, naming it
/// unconfirmed. Before, each of those steps waited the timeout (here, until rank 3 closed,
/// 4 s on).
pub async fn a_rank_silent_after_its_input_sets_no_pace<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (n, d) = (4, 8);
    let stays_up = Duration::from_secs(4);
    let mut transports = factory(n).await;
    let inner = transports.pop().unwrap();
    transports.push(Box::new(SilentAfterItsInput {
        inner,
        first: std::sync::Mutex::new(None),
    }));
    let results = run_ranks(
        comms(transports, Duration::from_secs(10)),
        move |mut c| async move {
            c.set_agreement(Agreement::Detect);
            c.set_stragglers(Stragglers::Auto);
            // A grace no honest input misses on a loaded machine (libfabric's TCP provider
            // here takes tens of ms a step): a round with a late input waits for every peer's
            // check in time, as before (`PROTOCOL.md`, "Not covered yet").
            let mut config = c.config().clone();
            config.grace.min = Duration::from_millis(200);
            c.set_config(config);
            c.barrier().await.expect("the barrier");
            let started = Instant::now();
            let mut v = vec![(c.rank() + 1) as f32; d];
            let result = c
                .robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
                .await
                .map(|report| (report, v));
            let took = started.elapsed();
            if c.rank() == n - 1 {
                tokio::time::sleep(stays_up).await;
            }
            (result, took)
        },
    )
    .await;
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| vec![(r + 1) as f32; d]).collect();
    let want = reference(&Median::new(1), &inputs);
    for (me, (result, took)) in results.iter().enumerate().take(n - 1) {
        let (report, v) = result.as_ref().unwrap_or_else(|e| panic!("rank {me}: {e}"));
        assert!(
            *took < stays_up / 2,
            "rank {me} waited {took:?} for the silent rank (steps: {:?})",
            report.stats.step_times
        );
        assert_eq!(v, &want, "rank {me}");
        assert_eq!(report.inputs, n, "rank {me}");
        assert!(report.faults.is_empty(), "rank {me}: {:?}", report.faults);
        let found = report.agreement.as_ref().expect("a cross-check");
        assert_eq!(found.unconfirmed, [n - 1], "rank {me}: {found:?}");
    }
}

/// Rank 3's transport in [`a_rank_silent_after_its_input_sets_no_pace`]: from the second
/// collective on (the first is the barrier), it sends nothing after a collective's first
/// step, and its receives there come back missing at once.
#[derive(Debug)]
struct SilentAfterItsInput {
    inner: Box<dyn Transport>,
    /// The first collective's number.
    first: std::sync::Mutex<Option<u64>>,
}

impl Transport for SilentAfterItsInput {
    passed_to_inner!();

    fn exchange(
        &self,
        step: Step,
    ) -> futures::future::BoxFuture<'_, Result<Vec<RecvOutcome>, byzcoll_runtime::TransportError>>
    {
        let first = *self.first.lock().unwrap().get_or_insert(step.collective);
        if step.collective != first && step.step > 0 {
            let missing = vec![RecvOutcome::Missing; step.recvs.len()];
            return Box::pin(async move { Ok(missing) });
        }
        self.inner.exchange(step)
    }
}

type Outcome = (
    Result<(RoundReport, Vec<f32>), Error>,
    Duration,
    Vec<PeerHealth>,
);

/// Ranks 0 to 3 of 4 (rank `r` contributes `r + 1`) run one median round with stragglers
/// `auto`, rank 3 starting `delay` after the others; each rank's result and how long its
/// call took, and the peers' health after it.
async fn with_a_straggler(
    agreement: Agreement,
    policy: Policy,
    delay: Duration,
    transports: Vec<Box<dyn Transport>>,
) -> Vec<Outcome> {
    run_ranks(
        comms(transports, Duration::from_secs(10)),
        move |mut c| async move {
            c.set_agreement(agreement);
            c.set_stragglers(Stragglers::Auto);
            // Under Detect a communicator's first collective waits for every rank (they start apart,
            // and none has been seen late yet): the straggler is late in the second.
            c.barrier().await.expect("the barrier");
            if c.rank() == 3 {
                tokio::time::sleep(delay).await;
            }
            let started = Instant::now();
            let mut v = vec![(c.rank() + 1) as f32; 8];
            let result = c
                .robust_all_reduce(&mut v, &Median::new(1), policy)
                .await
                .map(|report| (report, v));
            let took = started.elapsed();
            // The others stay up (as processes would) while the straggler catches up.
            if c.rank() != 3 {
                tokio::time::sleep(delay * 2).await;
            }
            (result, took, c.health())
        },
    )
    .await
}

/// A rank left behind is not cut off when the others finish: rank 3 of 4 (stragglers `auto`,
/// `s = 1`) calls the job's last robust round 1 s after the others, which end it without
/// its input and close at once. `Communicator::close` is collective where a call ran a quorum
/// step: each fast rank waits in it until rank 3 has closed too, so rank 3 still finds their
/// messages for the round (and their connections) and returns their result, its own input
/// left out as they did, rather than naming them missing.
pub async fn closing_waits_for_a_rank_left_behind<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let delay = Duration::from_millis(1000);
    for agreement in [Agreement::Detect, Agreement::Enforce] {
        let results = run_ranks(
            comms(factory(4).await, Duration::from_secs(10)),
            move |mut c| async move {
                c.set_agreement(agreement);
                c.set_stragglers(Stragglers::Auto);
                let mut v = vec![(c.rank() + 1) as f32; 8];
                // Under Detect a communicator's first collective waits for everyone.
                let first = c
                    .robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
                    .await;
                first.expect("the first round waits for every rank");
                if c.rank() == 3 {
                    tokio::time::sleep(delay).await;
                }
                let mut v = vec![(c.rank() + 1) as f32; 8];
                let last = c
                    .robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
                    .await
                    .map(|report| (report, v));
                let closing = Instant::now();
                c.close().await;
                (last, closing.elapsed())
            },
        )
        .await;
        for (me, (last, closing)) in results.iter().enumerate() {
            let (report, v) = last
                .as_ref()
                .unwrap_or_else(|e| panic!("{agreement:?} rank {me}: {e}"));
            assert!(
                v.iter().all(|&x| x == 2.0),
                "{agreement:?} rank {me}: {v:?}"
            );
            match me {
                3 => assert!(report.erased_self, "{agreement:?}: {report:?}"),
                _ => {
                    assert_eq!(report.stragglers, 1, "{agreement:?} rank {me}");
                    assert!(
                        *closing >= delay / 2,
                        "{agreement:?} rank {me} closed after {closing:?}, before rank 3 was done"
                    );
                }
            }
        }
    }
}

/// A rank paused while the others run many quorum rounds ahead comes back in step, whatever
/// the transport does with the messages it has not read (TCP and the in-process transport drop
/// them for skip notices past a budget; UCX and libfabric keep them in the library): 4 ranks,
/// stragglers allowed (`s = 1`), under `Enforce` and `Detect`, 2 MiB vectors; rank 3 pauses
/// before its round 2 until the others have gone 10 rounds on (20 MiB to it from each). The
/// others' rounds all succeed alike and never wait a deadline; rank 3 never returns another
/// result as success (a round it ends well has the others' result for that round), every call
/// it makes ends (with the others' result or a typed error), and it ends a round after its
/// pause with the others' result.
pub async fn a_rank_far_behind_comes_back_in_step<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    for agreement in [Agreement::Enforce, Agreement::Detect] {
        far_behind(agreement, factory(4).await).await;
    }
}

async fn far_behind(agreement: Agreement, transports: Vec<Box<dyn Transport>>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let (rounds, ahead, d) = (18, 10, 1 << 19);
    let timeout = Duration::from_secs(10);
    // Rounds rank 0 has ended: rank 3 waits on it, between the others' rounds.
    let ended = Arc::new(AtomicUsize::new(0));
    let transports = transports
        .into_iter()
        .map(|t| {
            let mut config = byzcoll_runtime::Config::with_step_timeout(timeout);
            config.agreement = agreement;
            config.stragglers = Stragglers::Exactly(1);
            // Under `Detect`, long enough that the honest ranks, loaded as they may be (a
            // debug build on two cores), are never late to each other, as ranks that heard
            // different checks fail the round: only rank 3's pause makes it late (it is a
            // laggard after two rounds, and the grace does not wait for a laggard).
            // `Enforce` agrees on late inputs whatever their timing.
            config.grace = byzcoll_runtime::Grace {
                min: match agreement {
                    Agreement::Detect => Duration::from_secs(1),
                    _ => Duration::from_millis(100),
                },
                factor: 1,
            };
            byzcoll_runtime::Communicator::new(t, config)
        })
        .collect();
    let logs = run_ranks(transports, move |mut c| {
        let ended = ended.clone();
        async move {
            let me = c.rank();
            let mut log = Vec::new();
            for round in 0..rounds {
                if me == 3 && round == 2 {
                    let paused = Instant::now();
                    while ended.load(Ordering::Relaxed) < round + ahead
                        && paused.elapsed() < Duration::from_secs(120)
                    {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    assert!(
                        ended.load(Ordering::Relaxed) >= round + ahead,
                        "{agreement:?}: the others did not get {ahead} rounds ahead in {:?}",
                        paused.elapsed()
                    );
                }
                let mut v = vec![(me * 7 + round) as f32; d];
                let started = Instant::now();
                let r = c
                    .robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
                    .await;
                log.push((started.elapsed(), r.map(|_| (v[0], v[d - 1]))));
                if me == 0 {
                    ended.store(round + 1, Ordering::Relaxed);
                }
                // Rounds apart, as a training step's computation keeps them (rank 3 too,
                // once caught up: back to back it would be early every round).
                if me != 3 || ended.load(Ordering::Relaxed) <= round + 1 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            c.close().await;
            log
        }
    })
    .await;
    for round in 0..rounds {
        let want = logs[0][round]
            .1
            .as_ref()
            .unwrap_or_else(|e| panic!("{agreement:?} rank 0 round {round}: {e}"));
        for (me, log) in logs.iter().enumerate().take(3) {
            let (took, got) = &log[round];
            assert_eq!(
                got.as_ref().ok(),
                Some(want),
                "{agreement:?} rank {me} round {round}: {got:?}"
            );
            assert!(
                *took < timeout / 2,
                "{agreement:?} rank {me} round {round} took {took:?}"
            );
        }
        match &logs[3][round].1 {
            Ok(got) => assert_eq!(got, want, "{agreement:?} rank 3 round {round}: a split"),
            Err(
                Error::FellBehind { .. } | Error::Disagreement { .. } | Error::TooManyFaults { .. },
            ) => {}
            Err(e) => panic!("{agreement:?} rank 3 round {round}: {e}"),
        }
    }
    let outcomes: String = logs[3]
        .iter()
        .map(|(_, r)| if r.is_ok() { 'o' } else { 'e' })
        .collect();
    assert!(
        outcomes[3..].contains('o'),
        "{agreement:?}: rank 3 never came back in step: {outcomes}"
    );
}
