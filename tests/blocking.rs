//! Blocking communicators (what Python and C run on) over TCP on 127.0.0.1: an abort shuts the
//! aborted rank's connections down at once, whether it was idle or in a call, so a peer's next
//! call names that rank as missing long before its step deadline. The runtime is driven only
//! by calls and by work in the background, so the close must be such work.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use byzcoll::blocking::{BlockingComm, Refused, Runtime};
use byzcoll::bootstrap::{JobAuth, JobSecret, StoreServer};
use byzcoll::{init_with, Error, JobConfig};

/// The step deadline: a peer that waits for it has not seen the abort.
const DEADLINE: Duration = Duration::from_secs(20);

fn auth() -> JobAuth {
    JobAuth::Secret(JobSecret::from_bytes([7; 32]))
}

/// Two ranks joined through a store that `host` runs, each a blocking communicator on its
/// own runtime.
fn pair(host: &tokio::runtime::Runtime) -> Vec<BlockingComm> {
    let server = host
        .block_on(StoreServer::bind("127.0.0.1:0", 2, auth()))
        .unwrap();
    let store = server.local_addr().to_string();
    host.spawn(async move {
        let _server = server;
        std::future::pending::<()>().await
    });
    let joins: Vec<_> = (0..2)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let config = JobConfig::builder(rank, 2)
                    .store(store)
                    .store_hosted(true)
                    .auth(auth())
                    .tcp_listen([127, 0, 0, 1].into())
                    .step_timeout(DEADLINE)
                    .build()
                    .unwrap();
                let runtime = Arc::new(Runtime::new().unwrap());
                let comm = runtime.block_on(init_with(&config)).unwrap();
                BlockingComm::new(runtime, comm)
            })
        })
        .collect();
    joins.into_iter().map(|j| j.join().unwrap()).collect()
}

/// Rank 1's barrier after rank 0 aborted: it fails naming rank 0, in far less than the step
/// deadline.
fn peer_sees_the_abort(peer: &BlockingComm) {
    let started = Instant::now();
    let outcome = peer.run(async |c| c.barrier().await);
    let took = started.elapsed();
    match outcome {
        Err(Refused::Failed(Error::PeerFaults { faults, .. })) => {
            assert_eq!(faults.iter().map(|f| f.rank).collect::<Vec<_>>(), [0]);
        }
        other => panic!("expected rank 0 named missing, got {other:?}"),
    }
    assert!(
        took < DEADLINE / 4,
        "the peer waited {took:?} for the aborted rank"
    );
}

#[test]
fn an_idle_rank_that_aborts_is_missing_at_once() {
    let host = tokio::runtime::Runtime::new().unwrap();
    let comms = pair(&host);
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(|| c.run(async |c| c.barrier().await).unwrap());
        }
    });
    comms[0].abort();
    peer_sees_the_abort(&comms[1]);
}

#[test]
fn a_rank_aborted_in_a_call_is_missing_at_once() {
    let host = tokio::runtime::Runtime::new().unwrap();
    let comms = pair(&host);
    let (aborted, peer) = (&comms[0], &comms[1]);
    std::thread::scope(|s| {
        // Rank 0 waits in a collective that rank 1 does not enter; an abort ends it.
        let call = s.spawn(|| aborted.run(async |c| c.barrier().await));
        std::thread::sleep(Duration::from_millis(200));
        aborted.abort();
        assert!(matches!(call.join().unwrap(), Err(Refused::Aborted)));
    });
    // Rank 0 sent its part of that barrier before the abort: it completes rank 1's.
    peer.run(async |c| c.barrier().await).unwrap();
    peer_sees_the_abort(peer);
}
