//! Ranks that choose a job-wide parameter differently fail to join, each naming the parameter
//! and the ranks, instead of finding each other's messages malformed or missing later.

mod common;

use std::time::Duration;

use byzcoll::bootstrap::{JobAuth, JobSecret};
use byzcoll::{init_with, Agreement, BootstrapError, Error, JobConfig};
use common::free_port;

/// What `init_with` gives each rank of a job whose rank `r` is configured by `configure`.
async fn join(
    size: usize,
    configure: impl Fn(usize) -> byzcoll::JobConfigBuilder,
) -> Vec<byzcoll::Result<byzcoll::Communicator>> {
    let store = format!("127.0.0.1:{}", free_port());
    let secret = JobSecret::generate().expect("secret");
    let joins: Vec<_> = (0..size)
        .map(|rank| {
            let config = configure(rank)
                .store(store.clone())
                .auth(JobAuth::Secret(secret.clone()))
                .tcp_listen([127, 0, 0, 1].into())
                .step_timeout(Duration::from_secs(10))
                .build()
                .expect("config");
            tokio::spawn(async move { init_with(&config).await })
        })
        .collect();
    let mut out = Vec::new();
    for join in joins {
        out.push(join.await.expect("rank task"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_with_another_agreement_policy_is_named_at_setup() {
    let results = join(3, |rank| {
        let agreement = if rank == 1 {
            Agreement::Off
        } else {
            Agreement::Detect
        };
        JobConfig::builder(rank, 3).agreement(agreement)
    })
    .await;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Err(Error::Bootstrap(BootstrapError::JobMismatch { parameter, choices })) => {
                assert!(
                    parameter.contains("BYZCOLL_AGREEMENT"),
                    "rank {rank}: {parameter}"
                );
                assert!(choices.contains("detect"), "rank {rank}: {choices}");
                assert!(choices.contains("off"), "rank {rank}: {choices}");
                assert!(choices.contains("ranks [0, 2]"), "rank {rank}: {choices}");
                assert!(choices.contains("ranks [1]"), "rank {rank}: {choices}");
            }
            other => panic!("rank {rank}: expected a job mismatch, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_with_another_sub_round_size_is_named_and_alike_ranks_join() {
    let results = join(2, |rank| {
        JobConfig::builder(rank, 2).sub_round_bytes(if rank == 0 { 1 << 20 } else { 1 << 22 })
    })
    .await;
    for r in results {
        let e = r.expect_err("ranks that differ must not join");
        assert!(e.to_string().contains("BYZCOLL_SUB_ROUND_BYTES"), "{e}");
    }
    // The same values join, and the communicator runs with them.
    let results = join(2, |rank| {
        JobConfig::builder(rank, 2)
            .sub_round_bytes(1 << 20)
            .agreement(Agreement::Off)
    })
    .await;
    for r in results {
        let comm = r.expect("alike ranks join");
        assert_eq!(comm.config().sub_round_bytes, 1 << 20);
        assert_eq!(comm.agreement(), Agreement::Off);
    }
}
