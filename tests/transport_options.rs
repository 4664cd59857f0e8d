//! Each transport option of the job's configuration reaches the transport in a job of more than
//! one rank, not only in a world of one (the two take different branches of the registry).
//! TCP always; UCX with feature `ucx` (over TCP or shared memory on this machine,
//! `UCX_NET_DEVICES=lo`).

mod common;

use std::time::Duration;

use byzcoll::bootstrap::{JobAuth, JobSecret};
use byzcoll::transports::tcp::TcpTransport;
use byzcoll::{init_with, Communicator, JobConfig};
use common::free_port;

/// The two ranks of a job built from `configure` in this process.
async fn pair(configure: impl Fn(usize) -> JobConfig) -> Vec<Communicator> {
    let joins: Vec<_> = (0..2)
        .map(|rank| {
            let config = configure(rank);
            tokio::spawn(async move { init_with(&config).await })
        })
        .collect();
    let mut comms = Vec::new();
    for join in joins {
        comms.push(join.await.expect("rank task").expect("init_with"));
    }
    comms
}

/// The job's transport, as the type it is.
fn transport_of<T: 'static>(comm: &Communicator) -> &T {
    comm.transport()
        .as_any()
        .and_then(|t| t.downcast_ref::<T>())
        .expect("the job's transport is of the expected type")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_options_reach_a_multi_rank_job() {
    let store = format!("127.0.0.1:{}", free_port());
    let secret = JobSecret::generate().expect("secret");
    // 127.0.0.3: on loopback, and not the address a rank would pick by itself.
    let listen: std::net::IpAddr = [127, 0, 0, 3].into();
    let comms = pair(|rank| {
        JobConfig::builder(rank, 2)
            .store(store.clone())
            .auth(JobAuth::Secret(secret.clone()))
            .tcp_listen(listen)
            .tcp_spin(Duration::from_micros(7))
            .frame_mac(true)
            .build()
            .expect("config")
    })
    .await;
    for comm in &comms {
        let tcp: &TcpTransport = transport_of(comm);
        let options = tcp.options();
        assert_eq!(
            options.spin,
            Duration::from_micros(7),
            "rank {}",
            comm.rank()
        );
        assert!(options.frame_mac, "rank {}", comm.rank());
        assert_eq!(
            tcp.listening().map(|a| a.ip()),
            Some(listen),
            "rank {}",
            comm.rank()
        );
    }
}

#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_peer_failure_reaches_a_multi_rank_job() {
    use byzcoll::transports::ucx::UcxTransport;
    let store = format!("127.0.0.1:{}", free_port());
    let secret = JobSecret::generate().expect("secret");
    for on in [false, true] {
        // UCX refuses peer-failure handling over shared memory; `on` runs over TCP only.
        if on && std::env::var("UCX_TLS").is_ok_and(|t| !t.contains("tcp")) {
            eprintln!("UCX_TLS has no tcp: peer-failure handling on is not tried");
            continue;
        }
        let store = if on {
            format!("127.0.0.1:{}", free_port())
        } else {
            store.clone()
        };
        let comms = pair(|rank| {
            JobConfig::builder(rank, 2)
                .store(store.clone())
                .auth(JobAuth::Secret(secret.clone()))
                .transport("ucx")
                .step_timeout(Duration::from_secs(10))
                .ucx_peer_failure(on)
                .build()
                .expect("config")
        })
        .await;
        for comm in &comms {
            let ucx: &UcxTransport = transport_of(comm);
            assert_eq!(
                ucx.options().peer_failure,
                Some(on),
                "rank {}: BYZCOLL_UCX_PEER_FAILURE={on} was not passed to UCX",
                comm.rank()
            );
        }
    }
}
