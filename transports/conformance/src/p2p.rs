//! The transport contract seen from one pair of ranks: steps matched by key, messages that
//! outlive their sender or arrive early, sends that move while the sender is away, invalid steps
//! refused; and a point-to-point bandwidth measurement.

use std::future::Future;
use std::time::Duration;

use byzcoll_runtime::{RecvOp, RecvOutcome, SendOp, Step, Transport};

use crate::harness::two_ranks;

/// Messages are matched by (collective, step, tag), not by arrival order: a rank that posts
/// tags in the opposite order of the sender still gets each payload under its own tag, and a
/// message for a step that has been retired is dropped rather than delivered to the next.
pub async fn steps_are_matched_by_key_not_arrival_order<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (a, b) = two_ranks(factory).await;
    let deadline = || tokio::time::Instant::now() + Duration::from_secs(10);
    let payload = |s: &str| byzcoll_runtime::Payload::Host(s.as_bytes().to_vec().into());
    let sender = async {
        // Step 0 is sent, but the receiver never posts it: it must not leak into step 1.
        let step0 = Step {
            collective: 0,
            step: 0,
            call: 0,
            sends: vec![SendOp {
                peer: 1,
                tag: 0,
                payload: payload("stale"),
            }],
            recvs: vec![],
            deadline: tokio::time::Instant::now() + Duration::from_millis(200),
            quorum: None,
        };
        a.exchange(step0).await.unwrap();
        let step1 = Step {
            collective: 0,
            step: 1,
            call: 0,
            sends: vec![
                SendOp {
                    peer: 1,
                    tag: 1,
                    payload: payload("one"),
                },
                SendOp {
                    peer: 1,
                    tag: 2,
                    payload: payload("two!"),
                },
            ],
            recvs: vec![],
            deadline: deadline(),
            quorum: None,
        };
        a.exchange(step1).await.unwrap()
    };
    let receiver = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let step1 = Step {
            collective: 0,
            step: 1,
            call: 0,
            sends: vec![],
            recvs: vec![
                RecvOp {
                    peer: 0,
                    tag: 2,
                    len: 4,
                },
                RecvOp {
                    peer: 0,
                    tag: 1,
                    len: 3,
                },
            ],
            deadline: deadline(),
            quorum: None,
        };
        b.exchange(step1).await.unwrap()
    };
    let (_, got) = tokio::join!(sender, receiver);
    assert_eq!(
        got,
        vec![
            RecvOutcome::Received(payload("two!")),
            RecvOutcome::Received(payload("one"))
        ]
    );
}

/// A rank that sends its last messages and shuts down before the receiver has posted them
/// (it finished its part of a collective first) does not take them along: the receiver still
/// gets them, and only what the rank never sent is `Missing`.
pub async fn messages_outlive_their_sender<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (a, b) = two_ranks(factory).await;
    let deadline = |ms| tokio::time::Instant::now() + Duration::from_millis(ms);
    let long: Vec<u8> = (0..600u32).map(|i| (i % 251) as u8).collect();
    let payload = |bytes: &[u8]| byzcoll_runtime::Payload::Host(bytes.to_vec().into());
    let last = Step {
        collective: 3,
        step: 0,
        call: 0,
        sends: vec![
            SendOp {
                peer: 1,
                tag: 0,
                payload: payload(b"last"),
            },
            SendOp {
                peer: 1,
                tag: 1,
                payload: payload(&long),
            },
        ],
        recvs: vec![],
        deadline: deadline(10_000),
        quorum: None,
    };
    // A transport whose sends complete once buffered returns at once, and the sender is gone
    // before the receiver posts; one whose sends wait for the receiver returns when it posts.
    let sender = async move {
        a.exchange(last).await.unwrap();
        drop(a);
    };
    let recv = |step, tags: std::ops::Range<u32>| Step {
        collective: 3,
        step,
        call: 0,
        sends: vec![],
        recvs: tags
            .map(|tag| RecvOp {
                peer: 0,
                tag,
                len: if tag == 0 { 4 } else { long.len() },
            })
            .collect(),
        deadline: deadline(1_000),
        quorum: None,
    };
    let receiver = async {
        // Long enough for the receiver's transport to notice that the sender is gone.
        tokio::time::sleep(Duration::from_millis(300)).await;
        b.exchange(recv(0, 0..2)).await.unwrap()
    };
    let ((), got) = tokio::join!(sender, receiver);
    assert_eq!(
        got,
        vec![
            RecvOutcome::Received(payload(b"last")),
            RecvOutcome::Received(payload(&long))
        ]
    );
    let never = b.exchange(recv(1, 0..1)).await.unwrap();
    assert_eq!(never, vec![RecvOutcome::Missing]);
}

/// Messages that arrive before their step is posted (a transport may take them in ahead) are
/// checked like any other once it is: a wrong length is `Malformed` and named, the right one
/// is delivered, and one for a step the receiver skipped is dropped, not delivered later.
pub async fn early_messages_are_checked_like_any_other<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let (a, b) = two_ranks(factory).await;
    let deadline = || tokio::time::Instant::now() + Duration::from_secs(10);
    let payload = |s: &[u8]| byzcoll_runtime::Payload::Host(s.to_vec().into());
    let step = |step, sends, recvs| Step {
        collective: 4,
        step,
        call: 0,
        sends,
        recvs,
        deadline: deadline(),
        quorum: None,
    };
    let send = |tag, bytes: &[u8]| SendOp {
        peer: 1,
        tag,
        payload: payload(bytes),
    };
    let recv = |tag, len| RecvOp { peer: 0, tag, len };
    let sender = async {
        let steps = [
            (0, vec![send(0, b"ten bytes!"), send(1, b"ok")]),
            (1, vec![send(0, b"skipped")]),
            (2, vec![send(0, b"next")]),
        ];
        for (n, sends) in steps {
            a.exchange(step(n, sends, vec![])).await.unwrap();
        }
    };
    let receiver = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let first = b
            .exchange(step(0, vec![], vec![recv(0, 4), recv(1, 2)]))
            .await
            .unwrap();
        let third = b.exchange(step(2, vec![], vec![recv(0, 4)])).await.unwrap();
        (first, third)
    };
    let ((), (first, third)) = tokio::join!(sender, receiver);
    assert!(
        matches!(&first[0], RecvOutcome::Malformed(why) if why.contains("10")),
        "{:?}",
        first[0]
    );
    assert_eq!(first[1], RecvOutcome::Received(payload(b"ok")));
    assert_eq!(third, vec![RecvOutcome::Received(payload(b"next"))]);
}

/// A send that its step reported done keeps moving while the sender does not call the
/// transport (it computes, say): the receiver, posting later, gets the whole message well
/// within its deadline. (UCX and libfabric report large sends done while the network still
/// moves them, and a task that drove the network hands it back to the progress thread.)
pub async fn sent_messages_move_while_the_sender_is_away<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    use tokio::time::Instant;
    let (a, b) = two_ranks(factory).await;
    let len = 8 << 20;
    let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
    let payload = byzcoll_runtime::Payload::Host(data.into());
    let away = Duration::from_millis(1500);
    let send = Step {
        collective: 5,
        step: 0,
        call: 0,
        sends: vec![SendOp {
            peer: 1,
            tag: 0,
            payload: payload.clone(),
        }],
        recvs: vec![],
        deadline: Instant::now() + Duration::from_secs(30),
        quorum: None,
    };
    let sender = async move {
        a.exchange(send).await.unwrap();
        tokio::time::sleep(away).await; // not calling the transport
        drop(a);
    };
    let receiver = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let start = Instant::now();
        let got = b
            .exchange(Step {
                collective: 5,
                step: 0,
                call: 0,
                sends: vec![],
                recvs: vec![RecvOp {
                    peer: 0,
                    tag: 0,
                    len,
                }],
                deadline: start + Duration::from_secs(1),
                quorum: None,
            })
            .await
            .unwrap();
        (got, start.elapsed())
    };
    let ((), (got, took)) = tokio::join!(sender, receiver);
    assert_eq!(got, vec![RecvOutcome::Received(payload)]);
    assert!(
        took < Duration::from_millis(900),
        "8 MiB took {took:?} to arrive while the sender was away"
    );
}

/// For transports whose progress thread owns the network (UCX, libfabric): a send is done for
/// its step once the thread holds it, within `credit` bytes in flight per peer, so a receiver
/// that has not posted yet does not hold the sender's step; beyond the credit the sender waits
/// (here until its deadline). Everything still arrives. Not part of [`conformance_suite!`]:
/// TCP's sends are done when the socket took them, the local transport's when received.
pub async fn sends_are_done_within_the_credit<F, Fut>(factory: F, credit: usize)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    use tokio::time::Instant;
    let (a, b) = two_ranks(factory).await;
    let big = credit / 2 + 1;
    let payload = |byte: u8| byzcoll_runtime::Payload::Host(vec![byte; big].into());
    let send = |step, byte, wait| Step {
        collective: 0,
        step,
        call: 0,
        sends: vec![SendOp {
            peer: 1,
            tag: 0,
            payload: payload(byte),
        }],
        recvs: vec![],
        deadline: Instant::now() + wait,
        quorum: None,
    };
    // Large enough that the network is not done with it until rank 1 receives it.
    let start = Instant::now();
    a.exchange(send(0, 1, Duration::from_secs(60)))
        .await
        .unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "a send within the credit waited for the receiver"
    );
    let beyond = Duration::from_millis(300);
    let start = Instant::now();
    a.exchange(send(1, 2, beyond)).await.unwrap();
    assert!(
        start.elapsed() >= beyond,
        "a send beyond the credit did not wait"
    );
    for (step, byte) in [(0, 1), (1, 2)] {
        let recv = Step {
            collective: 0,
            step,
            call: 0,
            sends: vec![],
            recvs: vec![RecvOp {
                peer: 0,
                tag: 0,
                len: big,
            }],
            deadline: Instant::now() + Duration::from_secs(60),
            quorum: None,
        };
        let got = b.exchange(recv).await.unwrap();
        assert_eq!(got, vec![RecvOutcome::Received(payload(byte))]);
    }
}

/// Steps that break the contract are errors, not hangs or panics.
pub async fn invalid_steps_are_rejected<F, Fut>(factory: F)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let ranks = factory(2).await;
    let t = &ranks[0];
    let base = || Step {
        collective: 0,
        step: 0,
        call: 0,
        sends: vec![],
        recvs: vec![],
        deadline: tokio::time::Instant::now() + Duration::from_secs(1),
        quorum: None,
    };
    let to_self = Step {
        sends: vec![SendOp {
            peer: 0,
            tag: 0,
            payload: byzcoll_runtime::Payload::Host(Default::default()),
        }],
        ..base()
    };
    let unknown = Step {
        recvs: vec![RecvOp {
            peer: 9,
            tag: 0,
            len: 1,
        }],
        ..base()
    };
    let twice = Step {
        recvs: vec![
            RecvOp {
                peer: 1,
                tag: 0,
                len: 1,
            },
            RecvOp {
                peer: 1,
                tag: 0,
                len: 1,
            },
        ],
        ..base()
    };
    for step in [to_self, unknown, twice] {
        let err = t.exchange(step).await.unwrap_err();
        assert!(
            matches!(err, byzcoll_runtime::TransportError::InvalidUsage(_)),
            "{err}"
        );
    }
}

/// One-way bandwidth from rank 0 to rank 1 of `ranks` (two transports), in windows of 8
/// messages per step as `benches/p2p.rs` does, 4 KiB to 16 MiB, printed to stderr as
/// `BW <label> <size> B: <MiB/s>`. A measurement, not a check: the transports call it from an
/// ignored test (`cargo test --release -p <crate> --features <f> p2p_bandwidth -- --ignored
/// --nocapture`), e.g. for the cost of frame sealing.
///
/// # Panics
/// When an exchange fails or a message is not received.
pub async fn p2p_bandwidth(ranks: Vec<Box<dyn Transport>>, label: &str) {
    const WINDOW: usize = 8;
    let mut step = 0;
    for exp in [12u32, 16, 20, 24] {
        let len = 1usize << exp;
        let payload = byzcoll_runtime::Payload::Host(vec![7u8; len].into());
        let steps = ((1usize << 30) / (len * WINDOW)).clamp(4, 2000);
        let mut run = |n: usize| {
            let mut all = Vec::new();
            for _ in 0..n {
                let mk = |sends, recvs| Step {
                    collective: 0,
                    step,
                    call: 0,
                    sends,
                    recvs,
                    deadline: tokio::time::Instant::now() + Duration::from_secs(60),
                    quorum: None,
                };
                let sends = (0..WINDOW)
                    .map(|t| SendOp {
                        peer: 1,
                        tag: t as u32,
                        payload: payload.clone(),
                    })
                    .collect();
                let recvs = (0..WINDOW)
                    .map(|t| RecvOp {
                        peer: 0,
                        tag: t as u32,
                        len,
                    })
                    .collect();
                all.push((mk(sends, vec![]), mk(vec![], recvs)));
                step += 1;
            }
            all
        };
        for (i, batch) in [run(2), run(steps)].into_iter().enumerate() {
            let start = std::time::Instant::now();
            for (s, r) in batch {
                let (a, b) = tokio::join!(ranks[0].exchange(s), ranks[1].exchange(r));
                a.unwrap();
                assert!(b
                    .unwrap()
                    .iter()
                    .all(|o| matches!(o, RecvOutcome::Received(_))));
            }
            if i == 1 {
                let secs = start.elapsed().as_secs_f64();
                let mib = (steps * WINDOW * len) as f64 / (1 << 20) as f64;
                eprintln!("BW {label} {len:>9} B: {:>8.0} MiB/s", mib / secs);
            }
        }
    }
}
