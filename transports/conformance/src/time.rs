//! Faults in time: stragglers do not set the pace of the others.

use std::future::Future;
use std::time::{Duration, Instant};

use byzcoll_aggregators::Median;
use byzcoll_runtime::{
    Agreement, Error, Fault, PeerFault, PeerHealth, Policy, Replicas, RoundReport, Stragglers,
    Symptom, Transport,
};

use crate::harness::{comms, run_ranks};

/// A straggler does not set the pace: after a barrier (under `Detect` a communicator's first collective
/// waits for every rank), rank 3 of 4 (f = 1, stragglers `auto`: s = 1, since the median
/// keeps `n - s = 3 > 2f`) calls its gather-mode robust all-reduce 1.5 s after the others, under a 10 s step timeout. The others end their round long before it arrives, name it
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
    let policy = Policy::Gather;
    {
        for agreement in [Agreement::Detect, Agreement::Enforce] {
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
                    if agreement == Agreement::Detect {
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
    // Sharded rounds do not end steps early yet: `auto` is none there, and asking for some
    // is refused rather than silently waited out.
    let results = run_ranks(
        comms(factory(4).await, Duration::from_secs(10)),
        |mut c| async move {
            let mut v = vec![1.0f32; 8];
            let sharded = Policy::Sharded(Replicas::Tolerant);
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
