//! The NCCL transport against the real libraries. Every test that needs a GPU skips, saying
//! so on stderr, where the CUDA driver, NCCL or a device is missing (CI has none); on a GPU
//! machine they run at world size 1 (NCCL refuses two ranks on one GPU).

#![cfg(feature = "nccl")]

use std::time::Duration;

use bytes::Bytes;
use byzcoll_aggregators::Median;
use byzcoll_runtime::bootstrap::{JobAuth, JobSecret, StoreClient, StoreServer};
use byzcoll_runtime::{
    Communicator, Config, Payload, Policy, RecvOp, RecvOutcome, ReduceOp, Replicas, SendOp, Step,
    Transport, TransportError,
};
use byzcoll_transport_nccl::{
    unavailable_reason, AbortCause, NcclFailure, NcclOptions, NcclTransport,
};
use tokio::time::Instant;

use std::io::Write as _;

/// `true` when a GPU with NCCL is here; otherwise prints why the calling test is skipped.
fn gpu(test: &str) -> bool {
    match unavailable_reason() {
        Some(why) => {
            // To the process's stderr, past libtest's capture, so the skip is visible.
            let _ = writeln!(std::io::stderr(), "SKIPPED: {test}: {why}");
            false
        }
        None => true,
    }
}

fn step(collective: u64, sends: Vec<SendOp>, recvs: Vec<RecvOp>, timeout: Duration) -> Step {
    Step {
        collective,
        step: 0,
        call: 0,
        sends,
        recvs,
        deadline: Instant::now() + timeout,
        quorum: None,
    }
}

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect::<Vec<u8>>()
        .into()
}

#[tokio::test]
async fn rank_outside_the_world_is_invalid_usage() {
    let store = StoreClient::new(
        "127.0.0.1:1",
        0,
        2,
        Duration::from_millis(10),
        JobAuth::Unauthenticated,
    );
    let r = NcclTransport::from_store(&store, 2, 2, NcclOptions::default()).await;
    assert!(matches!(r, Err(TransportError::InvalidUsage(_))), "{r:?}");
}

#[tokio::test]
async fn without_nccl_every_rank_gets_a_typed_error_naming_the_ranks() {
    let Some(why) = unavailable_reason() else {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: without_nccl_*: this machine has a GPU and NCCL"
        );
        return;
    };
    match NcclTransport::single(NcclOptions::default()).await {
        Err(TransportError::Setup(msg)) => assert!(msg.contains(&why), "{msg}"),
        other => panic!("expected a setup error, got {other:?}"),
    }
    let auth = JobAuth::Secret(JobSecret::generate().unwrap());
    let server = StoreServer::bind("127.0.0.1:0", 2, auth.clone())
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    let join = |rank| {
        let (addr, auth) = (addr.clone(), auth.clone());
        async move {
            let store = StoreClient::new(addr, rank, 2, Duration::from_secs(20), auth);
            NcclTransport::from_store(&store, rank, 2, NcclOptions::default()).await
        }
    };
    let started = std::time::Instant::now();
    let (a, b) = tokio::join!(join(0), join(1));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "ranks waited for each other"
    );
    for r in [a, b] {
        match r {
            Err(TransportError::Setup(msg)) => {
                assert!(msg.contains("rank 0:") && msg.contains("rank 1:"), "{msg}");
                assert!(msg.contains(&why), "{msg}");
            }
            other => panic!("expected a setup error, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_rank_transport_and_its_contract() {
    if !gpu("single_rank_transport_and_its_contract") {
        return;
    }
    let t = NcclTransport::single(NcclOptions::default()).await.unwrap();
    assert_eq!((t.name(), t.rank(), t.size()), ("nccl", 0, 1));
    assert!(!t.capabilities().per_peer_timeout);
    let none = t
        .exchange(step(0, vec![], vec![], Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(none.is_empty());
    let to_nobody = SendOp {
        peer: 1,
        tag: 0,
        payload: Payload::Host(Bytes::from_static(b"x")),
    };
    let r = t
        .exchange(step(1, vec![to_nobody], vec![], Duration::from_secs(5)))
        .await;
    assert!(matches!(r, Err(TransportError::InvalidUsage(_))), "{r:?}");
    // Invalid usage is refused before anything is posted: the transport still works.
    assert!(t
        .exchange(step(2, vec![], vec![], Duration::from_secs(5)))
        .await
        .is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_store_at_world_size_one() {
    if !gpu("from_store_at_world_size_one") {
        return;
    }
    let auth = JobAuth::Secret(JobSecret::generate().unwrap());
    let server = StoreServer::bind("127.0.0.1:0", 1, auth.clone())
        .await
        .unwrap();
    let store = StoreClient::new(
        server.local_addr().to_string(),
        0,
        1,
        Duration::from_secs(20),
        auth,
    );
    let t = NcclTransport::from_store(&store, 0, 1, NcclOptions::default())
        .await
        .unwrap();
    assert_eq!((t.rank(), t.size()), (0, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouped_send_recv_moves_exact_bytes_in_tag_order() {
    if !gpu("grouped_send_recv_moves_exact_bytes_in_tag_order") {
        return;
    }
    let t = NcclTransport::single(NcclOptions::default()).await.unwrap();
    let lens = [0usize, 1, 255, 256, 257, (1 << 20) + 3];
    for round in 0..3u64 {
        // Sends listed by increasing tag, receives in reverse: matching is by tag order.
        let sends: Vec<_> = lens
            .iter()
            .enumerate()
            .map(|(tag, &len)| (tag as u32, pattern(len, round as u8 + tag as u8)))
            .collect();
        let recvs: Vec<_> = lens
            .iter()
            .enumerate()
            .rev()
            .map(|(tag, &len)| (tag as u32, len))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        let out = t
            .loopback(round, sends.clone(), recvs, deadline)
            .await
            .unwrap();
        assert_eq!(out.len(), lens.len());
        for (outcome, (tag, want)) in out.iter().zip(sends.iter().rev()) {
            match outcome {
                RecvOutcome::Received(Payload::Host(got)) => {
                    assert_eq!(got, want, "round {round} tag {tag}")
                }
                other => panic!("round {round} tag {tag}: {other:?}"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmatched_receive_aborts_at_the_deadline_naming_the_rank() {
    if !gpu("an_unmatched_receive_aborts_at_the_deadline_naming_the_rank") {
        return;
    }
    let t = NcclTransport::single(NcclOptions::default()).await.unwrap();
    let started = std::time::Instant::now();
    let deadline = Instant::now() + Duration::from_millis(500);
    let err = t
        .loopback(0, vec![], vec![(0, 64)], deadline)
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(60));
    match NcclFailure::from_transport_error(&err) {
        Some(NcclFailure::StepAborted { ranks, cause, .. }) => {
            assert_eq!(ranks, &[0]);
            // NCCL waits for the missing send (deadline) or may refuse it outright.
            if let AbortCause::Failed(why) = cause {
                eprintln!("NCCL reported the unmatched receive itself: {why}");
            }
        }
        other => panic!("expected an aborted step, got {other:?} from {err}"),
    }
    let later = t
        .exchange(step(1, vec![], vec![], Duration::from_secs(5)))
        .await
        .unwrap_err();
    assert!(
        matches!(
            NcclFailure::from_transport_error(&later),
            Some(NcclFailure::Broken { at: Some((0, 0)) })
        ),
        "{later}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn communicator_collectives_at_world_size_one() {
    if !gpu("communicator_collectives_at_world_size_one") {
        return;
    }
    let t = NcclTransport::single(NcclOptions::default()).await.unwrap();
    let mut comm = Communicator::new(Box::new(t), Config::default());
    comm.barrier().await.unwrap();
    let mut v = vec![1.5f32, -2.0, 3.25];
    comm.all_reduce(&mut v, ReduceOp::Sum).await.unwrap();
    assert_eq!(v, [1.5, -2.0, 3.25]);
    let rule = Median::new(0);
    let report = comm
        .robust_all_reduce(&mut v, &rule, Policy::Gather)
        .await
        .unwrap();
    assert!(report.faults.is_empty());
    assert_eq!(v, [1.5, -2.0, 3.25]);
    comm.robust_all_reduce(&mut v, &rule, Policy::Sharded(Replicas::Exactly(1)))
        .await
        .unwrap();
    assert_eq!(v, [1.5, -2.0, 3.25]);
    comm.barrier().await.unwrap();
}
