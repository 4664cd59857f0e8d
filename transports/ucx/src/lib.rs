//! UCX transport for byzcoll over the system libucp (Debian: `libucx-dev`).
//!
//! Build with the `ucx` cargo feature; without it this crate only reports, through
//! [`AVAILABLE`], that UCX is not built in. UCX's own variables choose its transports
//! (`UCX_TLS=tcp`, `UCX_TLS=sm`, `UCX_TLS=rc,sm,self` on InfiniBand) and devices
//! (`UCX_NET_DEVICES=lo` keeps TCP traffic on loopback).
//!
//! Layers, in the cudarc style: `byzcoll-ucx-sys` (bindgen), [`safe`] (results and RAII
//! handles), and the [`UcxTransport`] (see its module docs for the message format and the
//! progress).

// Without the `ucx` feature the items the crate docs link to do not exist.
#![cfg_attr(not(feature = "ucx"), allow(rustdoc::broken_intra_doc_links))]

/// Whether this build includes the UCX transport (the `ucx` cargo feature).
pub const AVAILABLE: bool = cfg!(feature = "ucx");

#[cfg(feature = "ucx")]
mod engine;
#[cfg(feature = "ucx")]
mod options;
#[cfg(feature = "ucx")]
pub mod safe;

#[cfg(feature = "ucx")]
pub use engine::{UcxTransport, HEADER_WINDOW, MAX_RANKS, PAYLOAD_RETRIES, SEND_CREDIT, SPIN};
#[cfg(feature = "ucx")]
pub use options::UcxOptions;

#[cfg(all(test, feature = "ucx"))]
mod tests {
    use super::*;
    use byzcoll_runtime::Transport;

    /// The options a job would get from this environment: the suite runs under `UCX_TLS=tcp`
    /// and under `UCX_TLS=sm`, where peer failure handling must be off.
    fn options() -> UcxOptions {
        UcxOptions::from_lookup(&|v| std::env::var(v).ok()).expect("UCX options")
    }

    async fn world(n: usize) -> Vec<Box<dyn Transport>> {
        UcxTransport::local_world(n, options())
            .expect("UCX world")
            .into_iter()
            .map(|t| Box::new(t) as Box<dyn Transport>)
            .collect()
    }

    byzcoll_conformance::conformance_suite!(world);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sends_are_done_within_the_credit_and_wait_beyond_it() {
        byzcoll_conformance::sends_are_done_within_the_credit(world, SEND_CREDIT).await;
    }

    /// Ranks that find each other (worker addresses and frame keys) through the rendezvous
    /// store, as separate processes do, authenticated or not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ranks_bootstrap_through_the_store() {
        #![allow(clippy::unwrap_used)]
        use byzcoll_runtime::bootstrap::{JobAuth, JobSecret, StoreClient, StoreServer};
        use byzcoll_runtime::{Payload, RecvOp, RecvOutcome, SendOp, Step};
        use std::time::Duration;
        let n = 3;
        for auth in [
            JobAuth::Secret(JobSecret::generate().unwrap()),
            JobAuth::Unauthenticated,
        ] {
            let server = StoreServer::bind("127.0.0.1:0", n, auth.clone())
                .await
                .unwrap();
            let addr = server.local_addr().to_string();
            let joins = (0..n).map(|rank| {
                let (addr, auth) = (addr.clone(), auth.clone());
                // Not spawned: a rank's UCX context and worker stay on this task's thread
                // while it awaits the store (they are not `Send`).
                async move {
                    let store = StoreClient::new(addr, rank, n, Duration::from_secs(10), auth);
                    UcxTransport::from_store(&store, rank, n, options()).await
                }
            });
            let ranks: Vec<UcxTransport> = futures::future::join_all(joins)
                .await
                .into_iter()
                .map(Result::unwrap)
                .collect();
            let steps = ranks.iter().enumerate().map(|(me, t)| {
                let others = (0..n).filter(move |&p| p != me);
                let sends = others
                    .clone()
                    .map(|p| SendOp {
                        peer: p,
                        tag: 3,
                        payload: Payload::Host(vec![me as u8; 10 + p].into()),
                    })
                    .collect();
                let recvs = others
                    .map(|p| RecvOp {
                        peer: p,
                        tag: 3,
                        len: 10 + me,
                    })
                    .collect();
                t.exchange(Step {
                    collective: 0,
                    step: 0,
                    call: 0,
                    sends,
                    recvs,
                    deadline: tokio::time::Instant::now() + Duration::from_secs(10),
                    quorum: None,
                })
            });
            for (me, got) in futures::future::join_all(steps)
                .await
                .into_iter()
                .enumerate()
            {
                for (p, o) in (0..n).filter(|&p| p != me).zip(got.unwrap()) {
                    match o {
                        RecvOutcome::Received(Payload::Host(b)) => {
                            assert_eq!(&b[..], &vec![p as u8; 10 + me][..], "rank {me} from {p}");
                        }
                        other => panic!("rank {me} from {p}: {other:?}"),
                    }
                }
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a measurement, not a check"]
    async fn p2p_bandwidth() {
        let ranks = UcxTransport::local_world(2, options())
            .unwrap()
            .into_iter()
            .map(|t| Box::new(t) as Box<dyn byzcoll_runtime::Transport>)
            .collect();
        let label = options().tls.unwrap_or_default();
        byzcoll_conformance::p2p_bandwidth(ranks, &format!("ucx {label}")).await;
    }

    mod forgery {
        #![allow(clippy::unwrap_used)]

        use super::*;
        use crate::engine::TAGS;
        use crate::options::context_settings;
        use crate::safe::{Context, Poll, Worker};
        use bytes::Bytes;
        use byzcoll_runtime::{MsgKey, Payload, RecvOp, RecvOutcome, SendOp, Step};
        use byzcoll_transport_kit::tagged::Kind;
        use byzcoll_transport_kit::wire::{FrameHeader, FrameKeys, HEADER_LEN, SEALED_LEN};
        use std::time::{Duration, Instant};

        const LEN: usize = 1000;

        fn parts() -> (Context, Worker, Bytes) {
            let context = Context::with_settings(context_settings(&options())).unwrap();
            let worker = context.worker().unwrap();
            let address = Bytes::from(worker.address().unwrap());
            (context, worker, address)
        }

        /// A world of `n` whose worker addresses and frame keys the test knows.
        fn world(n: usize) -> (Vec<UcxTransport>, Vec<Bytes>, Vec<FrameKeys>) {
            let parts: Vec<_> = (0..n).map(|_| parts()).collect();
            let addresses: Vec<Bytes> = parts.iter().map(|p| p.2.clone()).collect();
            let keys = FrameKeys::local_world(n).unwrap();
            let ranks =
                UcxTransport::local_world_of(parts, &addresses, keys.clone(), options()).unwrap();
            (ranks, addresses, keys)
        }

        /// Sends `messages` (tag, bytes) to the worker at `address` from an endpoint of its
        /// own, as a process that learnt the address would, and waits until they are out.
        fn inject(address: &[u8], messages: &[(u64, Vec<u8>)]) {
            let (_context, worker, _) = parts();
            let ep = worker.connect(address, 0, None).unwrap();
            let requests: Vec<_> = messages
                .iter()
                // SAFETY: the buffers outlive the requests, which complete below.
                .map(|(t, b)| unsafe { ep.send(b.as_ptr(), b.len(), *t) }.unwrap())
                .collect();
            let deadline = Instant::now() + Duration::from_secs(10);
            while requests.iter().any(|r| r.poll() == Poll::Pending) {
                assert!(Instant::now() < deadline, "injected messages never left");
                worker.progress();
            }
            // Give the receiver's progress thread time to match them before the genuine ones.
            let until = Instant::now() + Duration::from_millis(200);
            while Instant::now() < until {
                worker.progress();
            }
            let close = ep.close(false);
            let deadline = Instant::now() + Duration::from_secs(2);
            while close.poll() == Poll::Pending && Instant::now() < deadline {
                worker.progress();
            }
        }

        fn genuine(seed: u8) -> Vec<u8> {
            (0..LEN).map(|i| (i as u8).wrapping_add(seed)).collect()
        }

        /// Rank 0 sends rank 1 `genuine(step)` under step `step`; rank 1's outcome.
        async fn zero_to_one(ranks: &[UcxTransport], step: u32) -> RecvOutcome {
            let mk = |sends, recvs| Step {
                collective: 0,
                step,
                call: 0,
                sends,
                recvs,
                deadline: tokio::time::Instant::now() + Duration::from_secs(3),
                quorum: None,
            };
            let send = SendOp {
                peer: 1,
                tag: 0,
                payload: Payload::Host(genuine(step as u8).into()),
            };
            let recv = RecvOp {
                peer: 0,
                tag: 0,
                len: LEN,
            };
            let (sent, got) = tokio::join!(
                ranks[0].exchange(mk(vec![send], vec![])),
                ranks[1].exchange(mk(vec![], vec![recv]))
            );
            sent.unwrap();
            got.unwrap().remove(0)
        }

        fn forged_header() -> FrameHeader {
            FrameHeader::new(
                MsgKey {
                    collective: 0,
                    step: 0,
                    tag: 0,
                },
                0,
                0,
                LEN,
            )
        }

        fn assert_genuine(outcome: &RecvOutcome, seed: u8, forged: &[u8]) {
            match outcome {
                RecvOutcome::Received(Payload::Host(got)) => {
                    assert_ne!(&got[..], forged, "the forged payload was delivered");
                    assert_eq!(&got[..], &genuine(seed)[..]);
                }
                other => panic!("expected rank 0's payload, got {other:?}"),
            }
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_stranger_knowing_an_address_cannot_speak_as_a_rank_nor_replay() {
            let (ranks, addresses, keys) = world(2);
            let forged = vec![0xEE; LEN];
            // Well-formed frames on rank 0's tags, sealed with keys of another job; an
            // unsealed 32-byte header (what senders sent before sealing) and an oversized one.
            let strangers = FrameKeys::local_world(2).unwrap();
            let sealed = strangers[0].seal(1, 0, &forged_header(), &forged).unwrap();
            inject(
                &addresses[1],
                &[
                    (
                        TAGS.tag(0, Kind::Header, 0),
                        forged_header().encode()[..HEADER_LEN].to_vec(),
                    ),
                    (TAGS.tag(0, Kind::Header, 0), vec![7; 4 * SEALED_LEN]),
                    (TAGS.tag(0, Kind::Header, 0), sealed.to_vec()),
                    (TAGS.tag(0, Kind::Payload, 0), forged.clone()),
                ],
            );
            // The genuine frame still arrives (the forged payload that matched its receive
            // first was refused and received again), and the pair keeps working.
            assert_genuine(&zero_to_one(&ranks, 0).await, 0, &forged);
            // A recording of rank 0's genuine frame of step 0 (sealing is deterministic),
            // replayed on the tags of its next message: refused, step 1 gets its own.
            let recorded = keys[0].seal(1, 0, &forged_header(), &genuine(0)).unwrap();
            inject(
                &addresses[1],
                &[
                    (TAGS.tag(0, Kind::Header, 1), recorded.to_vec()),
                    (TAGS.tag(0, Kind::Payload, 1), genuine(0)),
                ],
            );
            assert_genuine(&zero_to_one(&ranks, 1).await, 1, &genuine(0));
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn an_insider_cannot_seal_frames_as_another_rank() {
            let (ranks, addresses, keys) = world(3);
            let forged = vec![0xEE; LEN];
            // Rank 2 knows the job secret and its own X25519 key, not rank 0's: its best
            // forgery of rank 0's frame to rank 1 is sealed with its own pair key.
            let sealed = keys[2].seal(1, 0, &forged_header(), &forged).unwrap();
            inject(
                &addresses[1],
                &[
                    (TAGS.tag(0, Kind::Header, 0), sealed.to_vec()),
                    (TAGS.tag(0, Kind::Payload, 0), forged.clone()),
                ],
            );
            assert_genuine(&zero_to_one(&ranks, 0).await, 0, &forged);
            assert_genuine(&zero_to_one(&ranks, 1).await, 1, &forged);
        }
    }
}
