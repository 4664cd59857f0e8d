//! libfabric transport for byzcoll over the system libfabric (Debian: `libfabric-dev`).
//!
//! Build with the `libfabric` cargo feature; without it this crate only reports, through
//! [`AVAILABLE`], that libfabric is not built in.
//!
//! Messages are tagged messages on reliable datagram endpoints (`FI_EP_RDM` + `FI_TAGGED`).
//! libfabric's own variables choose the provider: `FI_PROVIDER=shm` (shared memory, one
//! node), `FI_PROVIDER="tcp;ofi_rxm"` (sockets), `verbs;ofi_rxm`, `efa`, `cxi`, ... on HPC
//! fabrics; unset, `fi_getinfo`'s first choice is used. (With libfabric 1.17, `net` loses
//! messages between several endpoints, and `sockets` is slow on few cores.) A provider that
//! cannot give tagged RDM messaging is an error naming what it lacks, never a quiet switch;
//! [`providers`] lists those that can. The socket providers bind the machine's external
//! interface unless told otherwise: `FI_TCP_IFACE=lo FI_NET_IFACE=lo FI_SOCKETS_IFACE=lo`
//! keeps a single-node run on loopback.
//!
//! Layers, in the cudarc style: `byzcoll-libfabric-sys` (bindgen, plus a C shim for the
//! header's `static inline` calls), [`safe`] (results and RAII objects), and the
//! [`LibfabricTransport`] (see its docs for the message format and progress).
//! Memory is registered only where the provider asks for it (`FI_MR_LOCAL`).

// Without the `libfabric` feature the items the crate docs link to do not exist.
#![cfg_attr(not(feature = "libfabric"), allow(rustdoc::broken_intra_doc_links))]

/// Whether this build includes the libfabric transport (the `libfabric` cargo feature).
pub const AVAILABLE: bool = cfg!(feature = "libfabric");

#[cfg(feature = "libfabric")]
mod engine;
#[cfg(feature = "libfabric")]
mod op;
#[cfg(feature = "libfabric")]
pub mod safe;
#[cfg(feature = "libfabric")]
mod setup;

#[cfg(feature = "libfabric")]
pub use byzcoll_transport_kit::progress::SEND_CREDIT;
#[cfg(feature = "libfabric")]
pub use safe::providers;
#[cfg(feature = "libfabric")]
pub use setup::{
    LibfabricOptions, LibfabricTransport, FRAGMENT, HEADER_WINDOW, MAX_PARK, MAX_RANKS,
    PAYLOAD_RETRIES,
};

#[cfg(all(test, feature = "libfabric"))]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use byzcoll_runtime::{Payload, RecvOp, RecvOutcome, SendOp, Step, Transport};
    use std::time::Duration;

    async fn world(n: usize) -> Vec<Box<dyn Transport>> {
        LibfabricTransport::local_world(n, LibfabricOptions::default())
            .expect("libfabric world")
            .into_iter()
            .map(|t| Box::new(t) as Box<dyn Transport>)
            .collect()
    }

    byzcoll_conformance::conformance_suite!(world);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sends_are_done_within_the_credit_and_wait_beyond_it() {
        byzcoll_conformance::sends_are_done_within_the_credit(world, SEND_CREDIT).await;
    }

    fn bytes(len: usize, seed: u8) -> Payload {
        Payload::Host(
            (0..len)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                .collect::<Vec<u8>>()
                .into(),
        )
    }

    fn step(step: u32, sends: Vec<SendOp>, recvs: Vec<RecvOp>) -> Step {
        Step {
            collective: 0,
            step,
            call: 0,
            sends,
            recvs,
            deadline: tokio::time::Instant::now() + Duration::from_secs(10),
            quorum: None,
        }
    }

    /// An outcome in short: `ok LEN` for the payload `bytes(LEN, seed)`, `wrong LEN` for any
    /// other payload, and the outcome itself otherwise.
    fn summary(outcome: &RecvOutcome, seed: u8) -> String {
        match outcome {
            RecvOutcome::Received(p) if *p == bytes(p.len(), seed) => format!("ok {}", p.len()),
            RecvOutcome::Received(p) => format!("wrong {}", p.len()),
            other => format!("{other:?}"),
        }
    }

    /// Rank 0 sends rank 1 one payload per length in `lens` under tags 0.., and rank 1
    /// expects `expect[i]` bytes under tag `i`; returns rank 1's outcomes in short.
    async fn one_way(
        ranks: &[LibfabricTransport],
        n: u32,
        lens: &[usize],
        expect: &[usize],
    ) -> Vec<String> {
        let sends = lens
            .iter()
            .enumerate()
            .map(|(i, &len)| SendOp {
                peer: 1,
                tag: i as u32,
                payload: bytes(len, i as u8),
            })
            .collect();
        let recvs = expect
            .iter()
            .enumerate()
            .map(|(i, &len)| RecvOp {
                peer: 0,
                tag: i as u32,
                len,
            })
            .collect();
        let (sent, got) = tokio::join!(
            ranks[0].exchange(step(n, sends, vec![])),
            ranks[1].exchange(step(n, vec![], recvs))
        );
        assert!(sent.unwrap().is_empty());
        got.unwrap()
            .iter()
            .enumerate()
            .map(|(i, o)| summary(o, i as u8))
            .collect()
    }

    #[test]
    fn the_selected_provider_is_listed() {
        let ranks = LibfabricTransport::local_world(2, LibfabricOptions::default()).unwrap();
        assert_eq!(ranks[0].name(), "libfabric");
        assert!(!ranks[0].provider().is_empty());
        let listed = providers();
        assert!(
            listed.iter().any(|p| p == ranks[0].provider()),
            "{} not in {listed:?}",
            ranks[0].provider()
        );
    }

    /// Payloads of many fragments, of one, and empty ones; then payloads longer or shorter
    /// than their receive: those are `Malformed` with both lengths, drained, and the pair
    /// keeps working afterwards. Sizes cover the providers' eager, segmented and rendezvous
    /// protocols.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_empty_and_wrong_length_payloads() {
        let ranks = LibfabricTransport::local_world(2, LibfabricOptions::default()).unwrap();
        let many = 2 * FRAGMENT + 12345;
        let sizes = [many, 0, 7, 20 << 10, 200 << 10, FRAGMENT];
        let got = one_way(&ranks, 0, &sizes, &sizes).await;
        let want: Vec<String> = sizes.iter().map(|n| format!("ok {n}")).collect();
        assert_eq!(got, want);
        let sent = [many, 100, 20 << 10, 200 << 10, 1 << 20];
        let expect = [many - 8, 200, (20 << 10) - 1, (200 << 10) + 1, 1 << 20];
        let got = one_way(&ranks, 1, &sent, &expect).await;
        let mut want: Vec<String> = sent[..4]
            .iter()
            .zip(&expect)
            .map(|(s, e)| format!("Malformed(\"frame of {s} bytes, expected {e}\")"))
            .collect();
        want.push(format!("ok {}", 1 << 20));
        assert_eq!(got, want);
        let got = one_way(&ranks, 2, &[many, 5], &[many, 5]).await;
        assert_eq!(got, vec![format!("ok {many}"), "ok 5".to_string()]);
    }

    /// More messages per peer than the header window, large and small, some of the wrong
    /// length (drained while the messages around them are delivered): every outcome is right
    /// and in order, and the window keeps being reposted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn more_messages_than_the_header_window() {
        let ranks = LibfabricTransport::local_world(2, LibfabricOptions::default()).unwrap();
        let n = 3 * HEADER_WINDOW + 5;
        let sent: Vec<usize> = (0..n)
            .map(|i| match i % 4 {
                0 => FRAGMENT + 3 * i,
                1 => 0,
                2 => 100 + i,
                _ => (64 << 10) + i,
            })
            .collect();
        let expect: Vec<usize> = sent
            .iter()
            .enumerate()
            .map(|(i, &len)| if i % 7 == 3 { len + 1 } else { len })
            .collect();
        for round in 0..2 {
            let got = one_way(&ranks, round, &sent, &expect).await;
            let want: Vec<String> = sent
                .iter()
                .zip(&expect)
                .map(|(s, e)| {
                    if s == e {
                        format!("ok {s}")
                    } else {
                        format!("Malformed(\"frame of {s} bytes, expected {e}\")")
                    }
                })
                .collect();
            assert_eq!(got, want);
        }
    }

    /// A message for a step the receiver has already retired is drained, large or not, and
    /// the next step is unaffected.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stale_messages_are_drained() {
        let ranks = LibfabricTransport::local_world(2, LibfabricOptions::default()).unwrap();
        // Rank 1 runs step 1 first, so step 0's messages arrive stale.
        let late = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let sends = [FRAGMENT + 1, 1 << 20, 3]
                .iter()
                .enumerate()
                .map(|(i, &len)| SendOp {
                    peer: 1,
                    tag: i as u32,
                    payload: bytes(len, 9),
                })
                .collect();
            let mut s = step(0, sends, vec![]);
            s.deadline = tokio::time::Instant::now() + Duration::from_millis(300);
            ranks[0].exchange(s).await.unwrap();
            let sends = vec![SendOp {
                peer: 1,
                tag: 0,
                payload: bytes(1 << 20, 0),
            }];
            ranks[0].exchange(step(2, sends, vec![])).await.unwrap()
        };
        let early = async {
            let recvs = vec![RecvOp {
                peer: 0,
                tag: 0,
                len: 4,
            }];
            let mut s = step(1, vec![], recvs);
            s.deadline = tokio::time::Instant::now() + Duration::from_millis(50);
            assert_eq!(
                ranks[1].exchange(s).await.unwrap(),
                vec![RecvOutcome::Missing]
            );
            let recvs = vec![RecvOp {
                peer: 0,
                tag: 0,
                len: 1 << 20,
            }];
            ranks[1].exchange(step(2, vec![], recvs)).await.unwrap()
        };
        let (_, got) = tokio::join!(late, early);
        assert_eq!(summary(&got[0], 0), format!("ok {}", 1 << 20));
    }

    /// Ranks that find each other through the rendezvous store, as separate processes do.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ranks_bootstrap_through_the_store() {
        use byzcoll_runtime::bootstrap::{JobAuth, JobSecret, StoreClient, StoreServer};
        let n = 3;
        let auth = JobAuth::Secret(JobSecret::generate().unwrap());
        let server = StoreServer::bind("127.0.0.1:0", n, auth.clone())
            .await
            .unwrap();
        let addr = server.local_addr().to_string();
        let joins = (0..n).map(|rank| {
            let (addr, auth) = (addr.clone(), auth.clone());
            tokio::spawn(async move {
                let store = StoreClient::new(addr, rank, n, Duration::from_secs(10), auth);
                LibfabricTransport::from_store(&store, rank, n, LibfabricOptions::default()).await
            })
        });
        let ranks: Vec<LibfabricTransport> = futures::future::join_all(joins)
            .await
            .into_iter()
            .map(|r| r.unwrap().unwrap())
            .collect();
        let steps = ranks.iter().enumerate().map(|(me, t)| {
            let others = (0..n).filter(move |&p| p != me);
            let sends = others
                .clone()
                .map(|p| SendOp {
                    peer: p,
                    tag: 3,
                    payload: bytes(10 + p, me as u8),
                })
                .collect();
            let recvs = others
                .map(|p| RecvOp {
                    peer: p,
                    tag: 3,
                    len: 10 + me,
                })
                .collect();
            t.exchange(step(0, sends, recvs))
        });
        for (me, got) in futures::future::join_all(steps)
            .await
            .into_iter()
            .enumerate()
        {
            let got: Vec<String> = (0..n)
                .filter(|&p| p != me)
                .zip(got.unwrap())
                .map(|(p, o)| summary(&o, p as u8))
                .collect();
            assert_eq!(got, vec![format!("ok {}", 10 + me); n - 1], "rank {me}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a measurement, not a check"]
    async fn p2p_bandwidth() {
        let world = LibfabricTransport::local_world(2, LibfabricOptions::default()).unwrap();
        let label = world[0].provider().to_string();
        let ranks = world
            .into_iter()
            .map(|t| Box::new(t) as Box<dyn byzcoll_runtime::Transport>)
            .collect();
        byzcoll_conformance::p2p_bandwidth(ranks, &format!("libfabric {label}")).await;
    }

    mod forgery {
        use super::*;
        use crate::safe::{Endpoint, Post};
        use crate::setup::{choose, open, TAGS};
        use bytes::Bytes;
        use byzcoll_libfabric_sys as sys;
        use byzcoll_runtime::MsgKey;
        use byzcoll_transport_kit::tagged::Kind;
        use byzcoll_transport_kit::wire::{FrameHeader, FrameKeys, HEADER_LEN, SEALED_LEN};
        use std::time::Instant;

        const LEN: usize = 1000;

        /// A world of `n` whose endpoint names and frame keys the test knows.
        fn world(n: usize) -> (Vec<LibfabricTransport>, Vec<Bytes>, Vec<FrameKeys>) {
            let keys = FrameKeys::local_world(n).unwrap();
            let (ranks, names) =
                LibfabricTransport::local_world_with(keys.clone(), LibfabricOptions::default())
                    .unwrap();
            (ranks, names, keys)
        }

        /// Sends `messages` (tag, bytes) to the endpoint named `name` from an endpoint of its
        /// own, as a process that learnt the name would, and waits until they are out. The
        /// endpoint is returned to be kept until the world is gone (`shm` maps it).
        fn inject(name: &[u8], messages: &[(u64, Vec<u8>)]) -> Endpoint {
            let mut ep = open(&choose(&LibfabricOptions::default()).unwrap(), 2).unwrap();
            let dest = ep.insert_address(name).unwrap();
            let mut contexts: Vec<Box<sys::fi_context2>> =
                messages.iter().map(|_| Box::default()).collect();
            let mut completions = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(10);
            for ((t, b), c) in messages.iter().zip(&mut contexts) {
                let context = std::ptr::from_mut::<sys::fi_context2>(c).cast();
                loop {
                    // SAFETY: the buffers and contexts outlive the sends, which complete
                    // below; no registration is needed (`FI_MR_LOCAL` providers are not used
                    // by these tests).
                    let posted = unsafe {
                        ep.send(b.as_ptr(), b.len(), std::ptr::null_mut(), dest, *t, context)
                    };
                    match posted.unwrap() {
                        Post::Posted => break,
                        Post::Busy => {
                            assert!(Instant::now() < deadline, "the provider took nothing");
                            ep.read_completions(&mut completions, 16).unwrap();
                        }
                    }
                }
            }
            while completions.len() < messages.len() {
                assert!(Instant::now() < deadline, "injected messages never left");
                ep.read_completions(&mut completions, 16).unwrap();
            }
            assert!(completions.iter().all(|c| c.error.is_none()));
            // Give the receiver's progress thread time to match them before the genuine ones.
            let until = Instant::now() + Duration::from_millis(200);
            while Instant::now() < until {
                ep.read_completions(&mut completions, 16).unwrap();
            }
            ep
        }

        /// Rank 0 sends rank 1 `bytes(LEN, n)` under step `n`; rank 1's outcome in short.
        async fn zero_to_one(ranks: &[LibfabricTransport], n: u32) -> String {
            one_way(ranks, n, &[LEN], &[LEN]).await.remove(0)
        }

        fn header(step: u32) -> FrameHeader {
            FrameHeader::new(
                MsgKey {
                    collective: 0,
                    step,
                    tag: 0,
                },
                0,
                0,
                LEN,
            )
        }

        /// The bytes of `bytes(len, seed)`.
        fn raw(len: usize, seed: u8) -> Vec<u8> {
            (0..len)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                .collect()
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_stranger_knowing_a_name_cannot_speak_as_a_rank_nor_replay() {
            let (ranks, names, keys) = world(2);
            let forged = raw(LEN, 0).iter().map(|b| !b).collect::<Vec<_>>();
            // Well-formed frames on rank 0's tags, sealed with keys of another job; an
            // unsealed 32-byte header (what senders sent before sealing) and an oversized one.
            let strangers = FrameKeys::local_world(2).unwrap();
            let sealed = strangers[0].seal(1, 0, &header(0), &forged).unwrap();
            let _stranger = inject(
                &names[1],
                &[
                    (
                        TAGS.tag(0, Kind::Header, 0),
                        header(0).encode()[..HEADER_LEN].to_vec(),
                    ),
                    (TAGS.tag(0, Kind::Header, 0), vec![7; 4 * SEALED_LEN]),
                    (TAGS.tag(0, Kind::Header, 0), sealed.to_vec()),
                    (TAGS.tag(0, Kind::Payload, 0), forged.clone()),
                ],
            );
            // rank 0's data arrives: the forged headers are dropped, and the forged payload
            // (which matches rank 0's receive first where receives are not directed, as over
            // shm) is refused and received again.
            assert_eq!(zero_to_one(&ranks, 0).await, format!("ok {LEN}"));
            // A recording of rank 0's genuine frame of step 0 (sealing is deterministic),
            // replayed on the tags of its next message: refused.
            let recorded = keys[0].seal(1, 0, &header(0), &raw(LEN, 0)).unwrap();
            let _replayer = inject(
                &names[1],
                &[(TAGS.tag(0, Kind::Header, 1), recorded.to_vec())],
            );
            assert_eq!(zero_to_one(&ranks, 1).await, format!("ok {LEN}"));
            assert_eq!(zero_to_one(&ranks, 2).await, format!("ok {LEN}"));
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn an_insider_cannot_seal_frames_as_another_rank() {
            let (ranks, names, keys) = world(3);
            let forged = raw(LEN, 0).iter().map(|b| !b).collect::<Vec<_>>();
            // Rank 2 knows the job secret and its own X25519 key, not rank 0's: its best
            // forgery of rank 0's frame to rank 1 is sealed with its own pair key.
            let sealed = keys[2].seal(1, 0, &header(0), &forged).unwrap();
            let _insider = inject(
                &names[1],
                &[(TAGS.tag(0, Kind::Header, 0), sealed.to_vec())],
            );
            assert_eq!(zero_to_one(&ranks, 0).await, format!("ok {LEN}"));
            assert_eq!(zero_to_one(&ranks, 1).await, format!("ok {LEN}"));
        }
    }

    /// The memory-registration path (taken where the provider asks for `FI_MR_LOCAL`), forced
    /// on whatever provider is selected.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn registered_buffers_round_trip() {
        let options = LibfabricOptions {
            always_register: true,
            ..LibfabricOptions::default()
        };
        let ranks = LibfabricTransport::local_world(2, options).unwrap();
        let big = FRAGMENT + (2 << 20);
        let got = one_way(&ranks, 0, &[big, 0, 33, 40 << 10], &[big, 0, 32, 40 << 10]).await;
        assert_eq!(
            got,
            vec![
                format!("ok {big}"),
                "ok 0".to_string(),
                "Malformed(\"frame of 33 bytes, expected 32\")".to_string(),
                format!("ok {}", 40 << 10),
            ]
        );
        let got = one_way(&ranks, 1, &[17], &[17]).await;
        assert_eq!(got, vec!["ok 17".to_string()]);
    }
}
