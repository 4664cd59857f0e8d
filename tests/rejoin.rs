//! A restarted rank rejoins. Four ranks over TCP, through a store the test hosts (as `byzcoll
//! launch` does); rank 3 dies, the others shrink, a fresh process of rank 3 knocks
//! (`byzcoll::rejoin`) and the members admit it (`byzcoll::admit`) at a boundary of theirs;
//! then the four agree on robust rounds again. Under the shared secret and under per-rank
//! keys (the restarted rank proves rank 3's key again).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use byzcoll::aggregators::{aggregate_into, Median};
use byzcoll::bootstrap::{keygen, Credentials, JobAuth, JobSecret, StoreServer};
use byzcoll::{admit, init_with, rejoin, Admission, Error, JobConfig, PeerHealth, Policy, Rank};

const N: usize = 4;
const D: usize = 64;

fn input(r: Rank) -> Vec<f32> {
    (0..D)
        .map(|i| ((r * 37 + i * 11) % 53) as f32 - 20.0)
        .collect()
}

fn median_of(ranks: &[Rank]) -> Vec<f32> {
    let inputs: Vec<Vec<f32>> = ranks.iter().map(|&r| input(r)).collect();
    let refs: Vec<&[f32]> = inputs.iter().map(|v| &v[..]).collect();
    let mut out = vec![0.0; D];
    aggregate_into(&Median::new(1), &refs, &mut out).unwrap();
    out
}

/// What one rank ends with: its job ranks, epoch and the first robust result of the grown
/// world.
type Ended = (Vec<Rank>, u64, Vec<f32>);

async fn kill_shrink_restart_rejoin(
    auth_of: Arc<dyn Fn(Rank) -> JobAuth + Send + Sync>,
    host: JobAuth,
) {
    let server = StoreServer::bind("127.0.0.1:0", N, host).await.unwrap();
    let store = server.local_addr().to_string();
    let config = {
        let store = store.clone();
        move |r: Rank| {
            JobConfig::builder(r, N)
                .store(store.clone())
                .store_hosted(true)
                .auth(auth_of(r))
                .tcp_listen([127, 0, 0, 1].into())
                .step_timeout(Duration::from_secs(2))
                .build()
                .unwrap()
        }
    };
    let joins: Vec<_> = (0..N)
        .map(|r| {
            let c = config(r);
            tokio::spawn(async move { init_with(&c).await })
        })
        .collect();
    let mut comms = Vec::new();
    for j in joins {
        comms.push(j.await.unwrap().unwrap());
    }
    // Rank 3 dies: its connections close.
    drop(comms.pop());
    let restarted = {
        let c = config(3);
        tokio::spawn(async move {
            let mut comm = rejoin(&c, Duration::from_secs(60)).await?;
            let mut v = input(3);
            comm.robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
                .await?;
            Ok::<Ended, Error>((comm.job_ranks().to_vec(), comm.epoch(), v))
        })
    };
    let members: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(r, mut comm)| {
            let c = config(r);
            tokio::spawn(async move {
                let mut v = input(r);
                let report = comm
                    .robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
                    .await?;
                assert!(
                    report.faults.iter().any(|pf| pf.rank == 3),
                    "rank {r}: {:?}",
                    report.faults
                );
                let mut small = comm.shrink().await?;
                assert_eq!(small.job_ranks(), [0, 1, 2], "rank {r}");
                // The members' boundary: admit whoever knocked, every 50 ms until rank 3 has.
                let mut grown = None;
                for _ in 0..400 {
                    match admit(&mut small, &c).await? {
                        Admission::Nobody => tokio::time::sleep(Duration::from_millis(50)).await,
                        Admission::Admitted {
                            comm,
                            admitted,
                            epoch,
                        } => {
                            assert_eq!((admitted, epoch), (vec![3], 1), "rank {r}");
                            grown = Some(comm);
                            break;
                        }
                        other => panic!("rank {r}: {other:?}"),
                    }
                }
                let mut comm = *grown.expect("rank 3 was admitted");
                // What each member had seen of the others carries over (same job ranks, same
                // numbers here); the restarted rank starts with nothing counted.
                let (before, after) = (small.health(), comm.health());
                assert!(
                    before.iter().all(|p| p.score.is_some()),
                    "rank {r}: the members' rounds measured each other: {before:?}"
                );
                for p in &before {
                    assert!(after.contains(p), "rank {r}: {p:?} not in {after:?}");
                }
                let fresh = after
                    .iter()
                    .find(|p| p.rank == 3)
                    .expect("rank 3 is a peer");
                let mut never_seen = PeerHealth::default();
                never_seen.rank = 3;
                assert_eq!(fresh, &never_seen, "rank {r}");
                let mut v = input(r);
                let report = comm
                    .robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
                    .await?;
                assert!(report.faults.is_empty(), "rank {r}: {:?}", report.faults);
                Ok::<Ended, Error>((comm.job_ranks().to_vec(), comm.epoch(), v))
            })
        })
        .collect();
    let want = median_of(&[0, 1, 2, 3]);
    for (r, m) in members.into_iter().enumerate() {
        let (ranks, epoch, v) = m.await.unwrap().unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!((ranks, epoch), (vec![0, 1, 2, 3], 1), "rank {r}");
        assert_eq!(v, want, "rank {r}");
    }
    let (ranks, epoch, v) = restarted.await.unwrap().unwrap();
    assert_eq!((ranks, epoch), (vec![0, 1, 2, 3], 1), "the restarted rank");
    assert_eq!(v, want, "the restarted rank");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_rank_rejoins_under_the_shared_secret() {
    let secret = JobSecret::generate().unwrap();
    let auth = JobAuth::Secret(secret);
    let each = auth.clone();
    kill_shrink_restart_rejoin(Arc::new(move |_| each.clone()), auth).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_rank_rejoins_under_per_rank_keys() {
    let secret = JobSecret::generate().unwrap();
    let (ids, roster) = keygen(N).unwrap();
    let roster = Arc::new(roster);
    let host = JobAuth::PerRank(Credentials::host(secret.clone(), roster.clone()));
    let auth_of = move |r: Rank| {
        JobAuth::PerRank(
            Credentials::rank(secret.clone(), roster.clone(), r, ids[r].clone()).unwrap(),
        )
    };
    kill_shrink_restart_rejoin(Arc::new(auth_of), host).await;
}

/// Nobody knocked: `admit` changes nothing, and a knock nobody answers times out, naming the
/// way in.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_a_knock_nobody_is_admitted_and_an_unanswered_knock_times_out() {
    let auth = JobAuth::Secret(JobSecret::generate().unwrap());
    let server = StoreServer::bind("127.0.0.1:0", 2, auth.clone())
        .await
        .unwrap();
    let store = server.local_addr().to_string();
    let config = |r: Rank| {
        JobConfig::builder(r, 2)
            .store(store.clone())
            .store_hosted(true)
            .auth(auth.clone())
            .tcp_listen([127, 0, 0, 1].into())
            .step_timeout(Duration::from_secs(2))
            .build()
            .unwrap()
    };
    let joins: Vec<_> = (0..2)
        .map(|r| {
            let c = config(r);
            tokio::spawn(async move {
                let mut comm = init_with(&c).await.unwrap();
                matches!(admit(&mut comm, &c).await.unwrap(), Admission::Nobody)
            })
        })
        .collect();
    for j in joins {
        assert!(j.await.unwrap());
    }
    let err = rejoin(&config(1), Duration::from_millis(300))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("byzcoll::admit"), "{err}");
}
