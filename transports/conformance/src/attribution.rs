//! Attribution: every robust report names the ranks whose inputs lay far from the aggregate,
//! and the communicator's health keeps count.

use std::future::Future;
use std::time::Duration;

use byzcoll_aggregators::evidence::SAMPLED;
use byzcoll_aggregators::{Krum, Median};
use byzcoll_runtime::schedule::chunk_range;
use byzcoll_runtime::{Attribution, Policy, Replicas, Transport, OUTLYING_SCORE};

use crate::harness::{comms, run_ranks};

/// Seven ranks tolerating f = 2, of which rank 5 sends its vector times −20 and rank 6 sends
/// 1e30 everywhere: in gather mode (median, then Krum), in sharded mode (r = 1, a vector in
/// several sub-rounds) and in a reduce-scatter, every honest rank's report scores both far
/// above [`OUTLYING_SCORE`] and every honest rank below it; the gather-mode attribution is
/// bitwise the same on every honest rank; Krum leaves both out; and each honest rank's health
/// counts both as outlying in every round, and no honest rank.
pub async fn outlying_ranks_are_named_in_every_report<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    // Longer than the sample: 1024 coordinates are measured.
    let (n, f, d) = (7usize, 2usize, 3000usize);
    // Honest vectors that differ a little, in no fixed order between ranks.
    let honest = move |r: usize| -> Vec<f32> {
        (0..d)
            .map(|j| 1.0 + ((r * 7919 + j * 104_729) % 1000) as f32 / 1000.0)
            .collect()
    };
    let input = move |r: usize| -> Vec<f32> {
        match r {
            5 => honest(5).iter().map(|x| -20.0 * x).collect(),
            6 => vec![1e30; d],
            _ => honest(r),
        }
    };
    let comms = comms(factory(n).await, Duration::from_secs(5));
    let results = run_ranks(comms, move |mut c| async move {
        let me = c.rank();
        let mut reports = Vec::new();
        let mut v = input(me);
        let gather = c
            .robust_all_reduce(&mut v, &Median::new(f), Policy::Gather)
            .await
            .unwrap();
        let mut v = input(me);
        let krum = c
            .robust_all_reduce(&mut v, &Krum::new(f), Policy::Gather)
            .await
            .unwrap();
        // Parts of 1200 bytes: ten sub-rounds of 300 coordinates.
        c.set_sub_round_bytes(1200);
        let mut v = input(me);
        reports.push(
            c.robust_all_reduce(
                &mut v,
                &Median::new(f),
                Policy::Sharded(Replicas::Exactly(1)),
            )
            .await
            .unwrap(),
        );
        let mut shard = vec![0.0f32; chunk_range(d, n, me).len()];
        reports.push(
            c.robust_reduce_scatter(&input(me), &mut shard, &Median::new(f), Replicas::Tolerant)
                .await
                .unwrap(),
        );
        (me, gather, krum, reports, c.health())
    })
    .await;
    let outlying = |a: &Attribution| a.outlying();
    let mut first: Option<String> = None;
    for (me, gather, krum, reports, health) in results {
        if me >= 5 {
            continue;
        }
        let a = gather.attribution.expect("gather mode measures");
        assert_eq!(outlying(&a), [5, 6], "rank {me}: {a:?}");
        assert!(a.ranks.iter().all(|e| e.coordinates == SAMPLED as u64));
        assert!(
            a.ranks[5].extreme == 1.0 && a.ranks[6].extreme == 1.0,
            "{a:?}"
        );
        assert!(a.ranks[..5].iter().all(|e| e.extreme < 0.9), "{a:?}");
        assert!(a.ranks.iter().all(|e| e.selected.is_none()));
        let shown = format!("{a:?}");
        assert_eq!(first.get_or_insert_with(|| shown.clone()), &shown);

        let k = krum.attribution.expect("gather mode measures");
        assert_eq!(outlying(&k), [5, 6], "rank {me}: {k:?}");
        assert_eq!(k.ranks[5].selected, Some(false));
        assert_eq!(k.ranks[6].selected, Some(false));
        assert_eq!(
            k.ranks.iter().filter(|e| e.selected == Some(true)).count(),
            1
        );

        for report in reports {
            let s = report.attribution.expect("sharded mode measures");
            assert_eq!(outlying(&s), [5, 6], "rank {me}: {s:?}");
            assert!(s.ranks.iter().all(|e| e.coordinates > 0), "{s:?}");
        }
        for peer in health {
            let far = peer.rank >= 5;
            assert_eq!(
                peer.outlying,
                if far { 4 } else { 0 },
                "rank {me}: {peer:?}"
            );
            // Krum selects one input: the outliers are never it.
            assert!(!far || peer.not_selected == 1, "rank {me}: {peer:?}");
            let score = peer.score.expect("measured");
            assert_eq!(score > OUTLYING_SCORE, far, "rank {me}: {peer:?}");
        }
    }
}
