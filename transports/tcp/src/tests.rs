use std::time::Duration;

use byzcoll_aggregators::Median;
use byzcoll_runtime::{Communicator, Config, Error, Fault, Policy, RecvOp, SendOp, Step};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;
use crate::wire::FrameHeader;
use byzcoll_runtime::bootstrap::{JobAuth, JobSecret};

fn job() -> JobAuth {
    JobAuth::Secret(JobSecret::from_hex(&"5a".repeat(32)).unwrap())
}

/// Every rank's membership for a world at `addrs`.
fn members(addrs: &[SocketAddr]) -> Vec<Membership> {
    let published: Vec<Vec<u8>> = addrs.iter().map(|a| a.to_string().into_bytes()).collect();
    Membership::world(&job(), &published).unwrap()
}

/// Authenticates a raw socket as rank `rank` with `member`'s identity (which may not be
/// rank `rank`'s own), as a peer that then says whatever a test wants.
async fn handshake_as(
    addr: SocketAddr,
    rank: usize,
    to: usize,
    member: &Membership,
) -> Result<TcpStream, HandshakeError> {
    Ok(handshake_with_macs(addr, rank, to, member, false).await?.0)
}

/// As [`handshake_as`], announcing frame MACs or not; also returns the session key.
async fn handshake_with_macs(
    addr: SocketAddr,
    rank: usize,
    to: usize,
    member: &Membership,
    macs: bool,
) -> Result<(TcpStream, [u8; 32]), HandshakeError> {
    let mut s = TcpStream::connect(addr).await?;
    let me = endpoint(member, member.size(), rank, macs);
    let session = auth::initiate(&mut s, me, to as u32).await?;
    Ok((s, session.key()))
}

/// All ranks of a world in this process, over real sockets on 127.0.0.1.
async fn world(n: usize) -> Vec<Box<dyn Transport>> {
    world_with(n, TcpOptions::default()).await
}

/// The same with frame MACs on.
async fn world_with_macs(n: usize) -> Vec<Box<dyn Transport>> {
    let options = TcpOptions {
        frame_mac: true,
        ..TcpOptions::default()
    };
    world_with(n, options).await
}

async fn world_with(n: usize, options: TcpOptions) -> Vec<Box<dyn Transport>> {
    let mut listeners = Vec::new();
    for _ in 0..n {
        listeners.push(TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let members = members(&addrs);
    let tasks: Vec<_> = listeners
        .into_iter()
        .zip(members)
        .enumerate()
        .map(|(r, (l, m))| {
            let (addrs, options) = (addrs.clone(), options.clone());
            tokio::spawn(
                async move { TcpTransport::connect_mesh(r, n, l, &addrs, &m, options).await },
            )
        })
        .collect();
    let mut out: Vec<Box<dyn Transport>> = Vec::new();
    for t in tasks {
        out.push(Box::new(t.await.unwrap().unwrap()));
    }
    out
}

byzcoll_conformance::conformance_suite!(world);

/// The conformance suite again, every frame carrying a MAC.
mod with_frame_macs {
    use super::world_with_macs;
    byzcoll_conformance::conformance_suite!(world_with_macs);
}

/// With frame MACs, a frame whose MAC is right is delivered and one whose payload was altered
/// in the stream is `Malformed`, and the connection is closed (later receives say why).
#[tokio::test]
async fn frame_macs_deliver_genuine_frames_and_refuse_altered_ones() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let addrs = [addr, "127.0.0.1:9".parse().unwrap()];
    let m = members(&addrs);
    let m0 = m[0].clone();
    let options = TcpOptions {
        frame_mac: true,
        ..TcpOptions::default()
    };
    let real = tokio::spawn(async move {
        TcpTransport::connect_mesh(0, 2, listener, &addrs, &m0, options).await
    });
    let (mut fake, session) = handshake_with_macs(addr, 1, 0, &m[1], true).await.unwrap();
    let real = real.await.unwrap().unwrap();
    let mut mac = FrameMac::new(&session, 1, 0);
    let mut frame = |step: u32, payload: &[u8], alter: bool| {
        let h = header(step, 1, payload.len() as u64);
        let mut hasher = mac.begin(&h);
        hasher.update(payload);
        let mut bytes = h.to_vec();
        bytes.extend_from_slice(hasher.finalize().as_bytes());
        bytes.extend_from_slice(payload);
        if alter {
            *bytes.last_mut().unwrap() ^= 1;
        }
        bytes
    };
    let mut sends = frame(0, &[5u8; 40], false);
    sends.extend(frame(1, &[6u8; 40], true));
    fake.write_all(&sends).await.unwrap();
    let timeout = Duration::from_secs(5);
    let got = real.exchange(recv_step(0, 40, timeout)).await.unwrap();
    assert!(
        matches!(&got[0], RecvOutcome::Received(Payload::Host(b)) if b[..] == [5u8; 40]),
        "{}",
        short(&got[0])
    );
    let got = real.exchange(recv_step(1, 40, timeout)).await.unwrap();
    assert_malformed(&got[0], "MAC does not match");
    let started = std::time::Instant::now();
    let got = real.exchange(recv_step(2, 40, timeout)).await.unwrap();
    assert_malformed(&got[0], "the stream was altered");
    assert!(started.elapsed() < Duration::from_secs(1));
}

/// Ranks must agree on frame MACs: a peer that differs is refused by name at setup.
#[tokio::test]
async fn frame_macs_on_one_end_only_are_refused_at_setup() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let addrs = [addr, "127.0.0.1:9".parse().unwrap()];
    let m = members(&addrs);
    let m0 = m[0].clone();
    let options = TcpOptions {
        setup_timeout: Duration::from_millis(500),
        ..TcpOptions::default()
    };
    let real = tokio::spawn(async move {
        TcpTransport::connect_mesh(0, 2, listener, &addrs, &m0, options).await
    });
    let err = handshake_with_macs(addr, 1, 0, &m[1], true)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("frame MACs"), "{err}");
    assert!(real.await.unwrap().is_err());
}

/// Rank 0 is a real transport in a world of two; rank 1 is a raw socket that performed the
/// handshake and will say whatever the test wants.
async fn real_and_fake() -> (TcpTransport, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let addrs = [addr, "127.0.0.1:9".parse().unwrap()];
    let m = members(&addrs);
    let m0 = m[0].clone();
    let real = tokio::spawn(async move {
        TcpTransport::connect_mesh(0, 2, listener, &addrs, &m0, TcpOptions::default()).await
    });
    let fake = handshake_as(addr, 1, 0, &m[1]).await.unwrap();
    (real.await.unwrap().unwrap(), fake)
}

fn recv_step(step: u32, len: usize, timeout: Duration) -> Step {
    Step {
        collective: 0,
        step,
        call: 0,
        sends: vec![],
        recvs: vec![RecvOp {
            peer: 1,
            tag: 0,
            len,
        }],
        deadline: tokio::time::Instant::now() + timeout,
        quorum: None,
    }
}

fn header(step: u32, sender: u32, len: u64) -> [u8; HEADER_LEN] {
    FrameHeader {
        collective: 0,
        step,
        sender,
        tag: 0,
        len,
        call: 0,
    }
    .encode()
}

async fn outcome_after(fake_sends: Vec<u8>, close: bool) -> (RecvOutcome, Duration, TcpTransport) {
    let (real, mut fake) = real_and_fake().await;
    let timeout = Duration::from_millis(800);
    let timed = async {
        let start = tokio::time::Instant::now();
        let outcomes = real.exchange(recv_step(0, 40, timeout)).await;
        (outcomes, start.elapsed())
    };
    let ((outcomes, elapsed), _) = tokio::join!(timed, async {
        fake.write_all(&fake_sends).await.unwrap();
        if close {
            drop(fake);
        } else {
            tokio::time::sleep(timeout * 2).await;
        }
    });
    (outcomes.unwrap().remove(0), elapsed, real)
}

fn assert_malformed(outcome: &RecvOutcome, needle: &str) {
    match outcome {
        RecvOutcome::Malformed(why) => assert!(why.contains(needle), "{why:?} lacks {needle:?}"),
        other => panic!("expected Malformed({needle}), got {other:?}"),
    }
}

#[tokio::test]
async fn truncated_frame_is_malformed() {
    let mut bytes = header(0, 1, 40).to_vec();
    bytes.extend_from_slice(&[7u8; 20]);
    let (outcome, _, _) = outcome_after(bytes, true).await;
    assert_malformed(&outcome, "truncated frame: 20 of 40 bytes");
}

#[tokio::test]
async fn a_length_of_two_to_the_sixty_is_refused_without_allocating() {
    let (outcome, elapsed, real) = outcome_after(header(0, 1, 1 << 60).to_vec(), false).await;
    assert_malformed(&outcome, "exceeds the limit");
    assert!(
        elapsed < Duration::from_millis(800),
        "answered at once, not at the deadline"
    );
    // The connection is distrusted from then on.
    let later = real
        .exchange(recv_step(1, 40, Duration::from_secs(5)))
        .await
        .unwrap();
    assert_malformed(&later[0], "exceeds the limit");
}

#[tokio::test]
async fn a_frame_claiming_another_sender_is_refused() {
    let mut bytes = header(0, 5, 40).to_vec();
    bytes.extend_from_slice(&[0u8; 40]);
    let (outcome, _, _) = outcome_after(bytes, false).await;
    assert_malformed(&outcome, "claims sender 5 on the connection of rank 1");
}

#[tokio::test]
async fn garbage_instead_of_a_header_is_refused() {
    let (outcome, _, _) = outcome_after(
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n.............".to_vec(),
        false,
    )
    .await;
    assert_malformed(&outcome, "bad frame magic");
}

#[tokio::test]
async fn a_wrong_length_is_malformed_and_the_stream_stays_usable() {
    let (real, mut fake) = real_and_fake().await;
    let mut bytes = header(0, 1, 44).to_vec();
    bytes.extend_from_slice(&[1u8; 44]);
    bytes.extend_from_slice(&header(1, 1, 40));
    bytes.extend_from_slice(&[2u8; 40]);
    fake.write_all(&bytes).await.unwrap();
    let first = real
        .exchange(recv_step(0, 40, Duration::from_secs(5)))
        .await
        .unwrap();
    assert_malformed(&first[0], "frame of 44 bytes, expected 40");
    let second = real
        .exchange(recv_step(1, 40, Duration::from_secs(5)))
        .await
        .unwrap();
    assert_eq!(
        second[0],
        RecvOutcome::Received(Payload::Host(vec![2u8; 40].into()))
    );
}

#[tokio::test]
async fn a_silent_peer_is_missing_at_the_deadline() {
    let (outcome, elapsed, _) = outcome_after(Vec::new(), false).await;
    assert_eq!(outcome, RecvOutcome::Missing);
    assert!(
        elapsed >= Duration::from_millis(800) && elapsed < Duration::from_secs(3),
        "{elapsed:?}"
    );
}

#[tokio::test]
async fn a_peer_that_closes_is_missing_before_the_deadline() {
    let (outcome, elapsed, _) = outcome_after(Vec::new(), true).await;
    assert_eq!(outcome, RecvOutcome::Missing);
    assert!(elapsed < Duration::from_millis(800), "{elapsed:?}");
}

/// The attacks of issue #13 on a listener during setup: the old 12-byte hello, garbage, a
/// stranger with another secret or none, an insider claiming a rank it cannot sign for, and
/// 1000 idle connections. All are refused, and the real ranks connect as if nobody were there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_and_impostors_are_refused_and_real_ranks_still_connect() {
    let n = 3;
    let mut listeners = Vec::new();
    for _ in 0..n {
        listeners.push(TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let m = members(&addrs);
    let target = addrs[0];
    let mut l = listeners.into_iter();
    let (m0, a0, l0) = (m[0].clone(), addrs.clone(), l.next().unwrap());
    let rank0 = tokio::spawn(async move {
        TcpTransport::connect_mesh(0, n, l0, &a0, &m0, TcpOptions::default()).await
    });
    let mut idle = Vec::new();
    for _ in 0..1000 {
        idle.push(TcpStream::connect(target).await.unwrap());
    }
    for raw in [&b"BZH1\x03\0\0\0\x01\0\0\0"[..], b"hello there!"] {
        let mut s = TcpStream::connect(target).await.unwrap();
        s.write_all(raw).await.unwrap();
        let code = s.read_u8().await.unwrap();
        assert_ne!(code, 0, "refused with a code");
    }
    let mut stranger = m[1].clone();
    stranger.auth = JobAuth::Secret(JobSecret::from_hex(&"77".repeat(32)).unwrap());
    let err = handshake_as(target, 1, 0, &stranger)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("wrong job secret"), "{err}");
    // Told it is not of this job, and nothing of the job's mode.
    stranger.auth = JobAuth::Unauthenticated;
    let err = handshake_as(target, 1, 0, &stranger)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("not of this job"), "{err}");
    // Rank 2 holds the secret but claims to be rank 1: it cannot sign as rank 1.
    let err = handshake_as(target, 1, 0, &m[2])
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("identity of rank 1"), "{err}");

    let started = std::time::Instant::now();
    let others: Vec<_> = l
        .zip(m.into_iter().skip(1))
        .enumerate()
        .map(|(i, (l, m))| {
            let addrs = addrs.clone();
            tokio::spawn(async move {
                TcpTransport::connect_mesh(i + 1, n, l, &addrs, &m, TcpOptions::default()).await
            })
        })
        .collect();
    let mut ranks: Vec<Box<dyn Transport>> = vec![Box::new(rank0.await.unwrap().unwrap())];
    for o in others {
        ranks.push(Box::new(o.await.unwrap().unwrap()));
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "setup took {took:?} with 1000 idle connections"
    );
    drop(idle);
    let comms: Vec<_> = ranks
        .into_iter()
        .map(|t| Communicator::new(t, Config::default()))
        .collect();
    let results = futures::future::join_all(comms.into_iter().map(|mut c| async move {
        let v = [c.rank() as u32 + 1];
        let mut all = vec![0u32; 3];
        c.all_gather_into(&v, &mut all).await.unwrap();
        all
    }))
    .await;
    for all in results {
        assert_eq!(all, [1, 2, 3], "only the real ranks' values");
    }
}

#[tokio::test]
async fn setup_names_the_ranks_that_did_not_connect() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let addrs = [addr, addr, addr];
    let m = members(&addrs);
    let options = TcpOptions {
        setup_timeout: Duration::from_millis(300),
        ..TcpOptions::default()
    };
    let err = TcpTransport::connect_mesh(0, 3, listener, &addrs, &m[0], options)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("ranks [1, 2] did not connect"), "{err}");
}

/// Three honest ranks and a fourth that sends a frame announcing 2^60 bytes: the honest ranks
/// finish the robust all-reduce with the liar named, within the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn robust_all_reduce_completes_when_one_peer_sends_garbage() {
    let n = 4;
    let mut listeners = Vec::new();
    for _ in 0..n - 1 {
        listeners.push(TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let mut addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    addrs.push("127.0.0.1:9".parse().unwrap());
    let m = members(&addrs);
    let honest: Vec<_> = listeners
        .into_iter()
        .zip(m.clone())
        .enumerate()
        .map(|(r, (l, m))| {
            let addrs = addrs.clone();
            tokio::spawn(async move {
                let t = TcpTransport::connect_mesh(r, n, l, &addrs, &m, TcpOptions::default())
                    .await
                    .unwrap();
                let mut comm = Communicator::new(
                    Box::new(t),
                    Config::with_step_timeout(Duration::from_secs(5)),
                );
                let mut v = vec![r as f32; 100];
                let report = comm
                    .robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
                    .await
                    .unwrap();
                (report, v)
            })
        })
        .collect();
    let mut fakes = Vec::new();
    for addr in &addrs[..n - 1] {
        let mut s = handshake_as(*addr, 3, fakes.len(), &m[3]).await.unwrap();
        s.write_all(
            &FrameHeader {
                collective: 0,
                step: 0,
                sender: 3,
                tag: 0,
                len: 1 << 60,
                call: 0,
            }
            .encode(),
        )
        .await
        .unwrap();
        fakes.push(s);
    }
    for h in honest {
        let (report, v) = h.await.unwrap();
        assert_eq!(report.inputs, 3);
        assert_eq!(report.faults.len(), 1);
        assert_eq!(report.faults[0].rank, 3);
        assert!(matches!(report.faults[0].fault, Fault::Malformed(_)));
        assert_eq!(v, vec![1.0; 100]);
    }
}

/// One message of more than 1 GiB, with no frame cap in the way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vector_of_more_than_one_gib_crosses() {
    let len = (1usize << 30) + 12;
    let mut ranks = world(2).await.into_iter();
    let (a, b) = (ranks.next().unwrap(), ranks.next().unwrap());
    let config = Config::with_step_timeout(Duration::from_secs(120));
    let template: Vec<u8> = (0..4093u32).map(|i| (i * 7 % 251) as u8).collect();
    let root = tokio::spawn(async move {
        let mut c = Communicator::new(a, config);
        let mut buf = Vec::with_capacity(len);
        while buf.len() < len {
            let take = template.len().min(len - buf.len());
            buf.extend_from_slice(&template[..take]);
        }
        c.broadcast_into(0, &mut buf).await.unwrap();
    });
    let mut c = Communicator::new(b, Config::with_step_timeout(Duration::from_secs(120)));
    let mut buf = vec![0xffu8; len];
    c.broadcast_into(0, &mut buf).await.unwrap();
    root.await.unwrap();
    let template: Vec<u8> = (0..4093u32).map(|i| (i * 7 % 251) as u8).collect();
    for (i, chunk) in buf.chunks(template.len()).enumerate() {
        assert!(chunk == &template[..chunk.len()], "chunk {i} differs");
    }
}

/// Frames to one peer that the socket takes at once and frames it does not (4 MiB, more than
/// a loopback socket buffer) interleave over many steps, several per step: a small frame
/// written by its sender must never overtake or cut into a large one still queued for the
/// writer task. Every payload arrives whole, under its own tag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_written_at_once_never_cut_into_queued_ones() {
    let mut ranks = world(2).await.into_iter();
    let (a, b) = (ranks.next().unwrap(), ranks.next().unwrap());
    fn len(step: u32, tag: u32) -> usize {
        if (step + tag).is_multiple_of(3) {
            4 << 20
        } else {
            8 + tag as usize
        }
    }
    let fill = |step: u32, tag: u32| -> Bytes {
        (0..len(step, tag))
            .map(|i| (i as u32 ^ (step * 131 + tag * 17)) as u8)
            .collect::<Vec<u8>>()
            .into()
    };
    let deadline = || tokio::time::Instant::now() + Duration::from_secs(30);
    const STEPS: u32 = 12;
    const TAGS: u32 = 4;
    let sender = tokio::spawn(async move {
        for step in 0..STEPS {
            let sends = (0..TAGS)
                .map(|tag| SendOp {
                    peer: 1,
                    tag,
                    payload: Payload::Host(fill(step, tag)),
                })
                .collect();
            a.exchange(Step {
                collective: 9,
                step,
                call: 0,
                sends,
                recvs: vec![],
                deadline: deadline(),
                quorum: None,
            })
            .await
            .unwrap();
        }
        a
    });
    for step in 0..STEPS {
        let recvs = (0..TAGS)
            .map(|tag| RecvOp {
                peer: 0,
                tag,
                len: len(step, tag),
            })
            .collect();
        let got = b
            .exchange(Step {
                collective: 9,
                step,
                call: 0,
                sends: vec![],
                recvs,
                deadline: deadline(),
                quorum: None,
            })
            .await
            .unwrap();
        for (tag, outcome) in got.into_iter().enumerate() {
            let want = fill(step, tag as u32);
            match outcome {
                RecvOutcome::Received(Payload::Host(b)) => assert!(
                    b == want,
                    "step {step} tag {tag}: {} bytes, first difference at {:?}",
                    b.len(),
                    b.iter().zip(want.iter()).position(|(x, y)| x != y)
                ),
                other => panic!("step {step} tag {tag}: {}", short(&other)),
            }
        }
    }
    drop(sender.await.unwrap());
}

/// An outcome without its payload bytes, for messages about large frames.
fn short(outcome: &RecvOutcome) -> String {
    match outcome {
        RecvOutcome::Received(p) => format!("Received({} bytes)", p.len()),
        other => format!("{other:?}"),
    }
}

/// A stall heals in sharded mode with `2f + 1` owners (versions by digest): rank 2 of 4
/// stalls for three and a half step timeouts before round 3 of 12. The others erase it while
/// it is away and, once it is back, wait for it no more than one round; rank 2 never returns
/// another result than theirs, and ends rounds with theirs again (under `Detect` it stays
/// their straggler, and on a loaded machine a rank fails some rounds loudly: 6 of 10 runs
/// with three busy loops on two cores, before and after the owners' sync waited past the
/// others'), and
/// from two rounds after its return every round of every rank takes a fraction of a timeout
/// again. Under `Detect` and `Off`.
///
/// The half timeout brings rank 2 back in the middle of the others' scatter step, not at its
/// deadline: a stall of exactly three timeouts ends within milliseconds of the others'
/// third deadline, and a rank back just after a deadline that erased it (under a loaded CI
/// machine, once) took four rounds to come back in step, each costing the others a timeout.
/// That edge is not what this test is about. (Under `Detect` the rounds after the first are
/// quorum steps, stragglers being allowed by default: rank 2 is then late rather than
/// missing, and its co-owners' syncs tell it to leave its piece out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_stall_heals_and_the_stalled_rank_comes_back_in_step() {
    use byzcoll_runtime::{Agreement, Replicas};
    let (n, rounds, stall_before) = (4, 12, 3);
    let timeout = Duration::from_millis(300);
    for agreement in [Agreement::Detect, Agreement::Off] {
        let tasks: Vec<_> = world(n)
            .await
            .into_iter()
            .map(|t| {
                let mut c = Communicator::new(t, Config::with_step_timeout(timeout));
                c.set_agreement(agreement);
                tokio::spawn(async move {
                    let mut log = Vec::new();
                    for round in 0..rounds {
                        if c.rank() == 2 && round == stall_before {
                            tokio::time::sleep(timeout * 7 / 2).await;
                        }
                        let mut v = vec![(c.rank() + 1) as f32; 64];
                        let start = std::time::Instant::now();
                        let sharded = Policy::Sharded(Replicas::Tolerant);
                        let r = c.robust_all_reduce(&mut v, &Median::new(1), sharded).await;
                        log.push((start.elapsed(), r.map(|_| v[0].to_bits())));
                    }
                    log
                })
            })
            .collect();
        let mut logs = Vec::new();
        for t in tasks {
            logs.push(t.await.unwrap());
        }
        let mut back = 0;
        for round in 0..rounds {
            // Rank 2, behind its peers since the stall, is their straggler: its pieces come
            // late, its co-owners' syncs have it leave them out, and it ends with their
            // result. On a loaded machine any rank can be late in a round, and under `Detect`
            // (stragglers allowed) a shard whose owners lack different senders' pieces, or a
            // version not sent a straggler in time, fails that round loudly at 4 ranks
            // (`PROTOCOL.md`, "Not covered yet"; seen in CI at rank 0, round 2, and at rank 2
            // under three busy loops on two cores). Never another result.
            let bits: Vec<_> = logs
                .iter()
                .enumerate()
                .filter_map(|(me, log)| match &log[round].1 {
                    Ok(b) => Some(*b),
                    Err(
                        Error::TooManyFaults { .. }
                        | Error::ShardLost { .. }
                        | Error::Disagreement { .. },
                    ) if agreement == Agreement::Detect => None,
                    Err(e) => panic!("{agreement:?} round {round} rank {me}: {e}"),
                })
                .collect();
            assert!(
                bits.iter().all(|&b| b == bits[0]),
                "{agreement:?} round {round}: {bits:?}"
            );
            if round > stall_before && bits.len() == n {
                back += 1;
            }
            // Back: the stall spans three rounds of the others and half of the fourth, in
            // which it returns; two more to catch up.
            if round >= stall_before + 3 + 2 {
                for (me, log) in logs.iter().enumerate() {
                    assert!(
                        log[round].0 < timeout / 2,
                        "{agreement:?} round {round} rank {me} took {:?}",
                        log[round].0
                    );
                }
            }
        }
        // It came back: at least half of the rounds after the stall ended with every rank's
        // result, alike.
        let after = rounds - stall_before - 1;
        assert!(
            back * 2 >= after,
            "{agreement:?}: {back} of {after} rounds after the stall ended well at every rank"
        );
    }
}

/// A step of rank 0 that sends `payload` to rank 1 under `step` and receives nothing, ending
/// at `deadline`.
fn send_step(step: u32, payload: Bytes, deadline: tokio::time::Instant) -> Step {
    Step {
        collective: 7,
        step,
        call: 0,
        sends: vec![SendOp {
            peer: 1,
            tag: 0,
            payload: Payload::Host(payload),
        }],
        recvs: vec![],
        deadline,
        quorum: None,
    }
}

/// A peer that completes the handshake and then never reads (Byzantine, or hung): rank 0 keeps
/// sending it 4 MiB frames, each step ending at a short deadline with its frame still queued.
/// The bytes queued for it never exceed its budget (three steps' worth); once a frame would,
/// the peer fails: its frames are dropped, later sends fail at once with the peer-failure
/// error, its receives are `Missing` at once instead of at their deadline, and it reads the
/// end of the connection after what it was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_reading_fails_within_its_budget() {
    let (real, mut fake) = real_and_fake().await;
    let len = 4 << 20;
    let mut failed_at = None;
    for step in 0..64u32 {
        let payload: Bytes = vec![step as u8; len].into();
        let deadline = tokio::time::Instant::now() + Duration::from_millis(50);
        real.exchange(send_step(step, payload, deadline))
            .await
            .unwrap();
        let (queued, budget) = (real.queued_bytes(1), real.queue_budget());
        assert!(
            queued <= budget,
            "step {step}: {queued} bytes queued, budget {budget}"
        );
        assert!(budget < 4 * len, "three 4 MiB steps' worth: {budget}");
        if real.writers[1].as_ref().unwrap().failure().is_some() {
            failed_at = Some(step);
            break;
        }
    }
    // The socket buffers on loopback hold a few MiB; the queue three frames more.
    let failed_at = failed_at.expect("the peer never failed");
    assert!(failed_at <= 12, "failed only at step {failed_at}");
    assert_eq!(real.queued_bytes(1), 0, "its frames are dropped");

    let started = std::time::Instant::now();
    let key = byzcoll_runtime::MsgKey {
        collective: 7,
        step: 100,
        tag: 0,
    };
    let err = real
        .send(1, key, 0, vec![0u8; len].into(), Duration::from_millis(50))
        .await
        .unwrap_err();
    assert!(
        matches!(err, SendError::Stalled { queued, budget } if queued <= budget),
        "{err}"
    );
    assert!(err.to_string().starts_with("peer failed"), "{err}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    real.exchange(send_step(101, vec![1u8; len].into(), deadline))
        .await
        .unwrap();
    let got = real
        .exchange(recv_step(102, 40, Duration::from_secs(10)))
        .await
        .unwrap();
    assert_eq!(got, vec![RecvOutcome::Missing]);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a failed peer costs no waiting: {:?}",
        started.elapsed()
    );
    // The peer, reading at last, finds the end of the stream after what it was sent.
    let read = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::io::copy(&mut fake, &mut tokio::io::sink()),
    )
    .await
    .expect("the connection was shut down")
    .unwrap_or(0);
    assert!(read as usize <= (failed_at as usize + 1) * (len + HEADER_LEN));
}

/// An honest rank whose peer stops reading stays within the queue's budget over whole robust
/// rounds: rank 3 of 4 hangs after setup (never calls its transport again) while ranks 0 to 2
/// run gather rounds of 4 MiB vectors with a straggler allowed, ending each step at its
/// quorum. Rank 3 is named in every round (late, or missing once its connection failed:
/// within a step timeout of reading nothing, 60 s here, it counts as behind and its unread
/// frames are dropped for skip notices); no round waits for a deadline, and every round's
/// result is the median of the honest inputs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_stops_reading_is_named_and_costs_at_most_its_budget() {
    let (n, rounds, d) = (4, 10, 1 << 20);
    let timeout = Duration::from_secs(60);
    // Long enough for an honest rank's input in a debug build on two cores: the quorum forms
    // as soon as one input is in once rank 3 counts as failed.
    let grace = byzcoll_runtime::Grace {
        min: Duration::from_secs(5),
        factor: 1,
    };
    let mut ranks = world(n).await;
    let hung = ranks.pop().unwrap();
    let tasks: Vec<_> = ranks
        .into_iter()
        .map(|t| {
            let mut config = Config::with_step_timeout(timeout);
            // Off takes no stragglers unless a count is asked for (auto is 0 there).
            config.stragglers = byzcoll_runtime::Stragglers::Exactly(1);
            config.grace = grace;
            config.agreement = byzcoll_runtime::Agreement::Off;
            let mut c = Communicator::new(t, config);
            tokio::spawn(async move {
                let mut log = Vec::new();
                for round in 0..rounds {
                    let mut v = vec![(c.rank() + round) as f32; d];
                    let start = std::time::Instant::now();
                    let me = c.rank();
                    let report = c
                        .robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
                        .await
                        .unwrap_or_else(|e| panic!("rank {me} round {round}: {e:?}"));
                    let tcp = c
                        .transport()
                        .as_any()
                        .and_then(|a| a.downcast_ref::<TcpTransport>())
                        .unwrap();
                    let queued = (tcp.queued_bytes(3), tcp.queue_budget());
                    let faults: Vec<_> = report
                        .faults
                        .iter()
                        .map(|f| (f.rank, f.fault.clone()))
                        .collect();
                    log.push((start.elapsed(), faults, queued, v[0], v[d - 1]));
                }
                // Dropped here, maybe before a slower rank has read this rank's last input (a
                // quorum step does not wait for its sends): the transport finishes them.
                drop(c);
                log
            })
        })
        .collect();
    let mut done = Vec::new();
    for t in tasks {
        done.push(t.await.unwrap());
    }
    for (me, log) in done.iter().enumerate() {
        for (round, (took, faults, (queued, budget), first, last)) in log.iter().enumerate() {
            let median = (1 + round) as f32;
            assert_eq!((*first, *last), (median, median), "rank {me} round {round}");
            assert!(
                queued <= budget && *budget <= 3 * (4 * d + 1024),
                "rank {me} round {round}: {queued} bytes queued for rank 3, budget {budget}"
            );
            assert!(*took < timeout / 4, "rank {me} round {round} took {took:?}");
            assert!(
                faults.iter().all(|(rank, _)| *rank == 3),
                "rank {me} round {round}: {faults:?}"
            );
        }
        let named = |round: usize| {
            log[round]
                .1
                .iter()
                .any(|(r, f)| *r == 3 && matches!(f, Fault::Late | Fault::Missing))
        };
        assert!(
            (0..rounds).all(named),
            "rank {me}: {:?}",
            log.iter().map(|l| &l.1).collect::<Vec<_>>()
        );
    }
    drop(hung);
}

/// A peer that stops reading for less than its budget is not failed: rank 0 leaves two 4 MiB
/// frames queued for a peer that does not read, the peer then reads again, and everything
/// it was sent arrives while later sends go through as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_pauses_within_its_budget_is_not_failed() {
    let (real, mut fake) = real_and_fake().await;
    let len = 4 << 20;
    for step in 0..2u32 {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(50);
        real.exchange(send_step(step, vec![step as u8; len].into(), deadline))
            .await
            .unwrap();
    }
    assert!(real.queued_bytes(1) > 0, "frames wait for the peer");
    let reader = tokio::spawn(async move {
        let mut frames = Vec::new();
        for _ in 0..3 {
            let mut head = [0u8; HEADER_LEN];
            fake.read_exact(&mut head).await.unwrap();
            let header = FrameHeader::decode(&head).unwrap();
            let mut payload = vec![0u8; header.len as usize];
            fake.read_exact(&mut payload).await.unwrap();
            frames.push((header.step, payload.iter().all(|&b| b == header.step as u8)));
        }
        frames
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let started = std::time::Instant::now();
    real.exchange(send_step(2, vec![2u8; len].into(), deadline))
        .await
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(real.writers[1].as_ref().unwrap().failure().is_none());
    assert_eq!(real.queued_bytes(1), 0);
    assert_eq!(reader.await.unwrap(), vec![(0, true), (1, true), (2, true)]);
}

/// Peak resident memory of this process (`VmHWM`), in MiB; `None` where `/proc` has none.
fn peak_rss_mib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

/// The memory a peer that stops reading costs: 64 steps each sending it a fresh 16 MiB frame
/// and ending at a 20 ms deadline. Prints this process's peak resident memory (the queue's
/// budget keeps it near four frames; 64 frames without one); run alone (`cargo test -p
/// byzcoll-transport-tcp --lib -- --ignored --exact
/// tests::peak_memory_with_a_peer_that_stops_reading --nocapture`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run alone"]
async fn peak_memory_with_a_peer_that_stops_reading() {
    let (real, _fake) = real_and_fake().await;
    let before = peak_rss_mib();
    let started = std::time::Instant::now();
    for step in 0..64u32 {
        let payload: Bytes = vec![step as u8 | 1; 16 << 20].into();
        let deadline = tokio::time::Instant::now() + Duration::from_millis(20);
        real.exchange(send_step(step, payload, deadline))
            .await
            .unwrap();
    }
    eprintln!(
        "peak RSS before sending {before:?} MiB, after 64 x 16 MiB to a peer that does not \
         read {:?} MiB ({:?})",
        peak_rss_mib(),
        started.elapsed()
    );
}

/// Two ranks, and rank 0 having ended a step that sends rank 1 far more than loopback's socket
/// buffers take while rank 1 is not reading (a short deadline here; a quorum step does not
/// wait for its sends at all): the payload, most of it still queued in rank 0's writer.
async fn a_step_left_queued() -> (Box<dyn Transport>, Box<dyn Transport>, Bytes) {
    let mut ranks = world(2).await;
    let b = ranks.pop().unwrap();
    let a = ranks.pop().unwrap();
    let payload: Bytes = (0..48 << 20)
        .map(|i| (i % 253) as u8)
        .collect::<Vec<u8>>()
        .into();
    let soon = tokio::time::Instant::now() + Duration::from_millis(20);
    let got = a
        .exchange(send_step(0, payload.clone(), soon))
        .await
        .unwrap();
    assert!(got.is_empty());
    (a, b, payload)
}

/// Rank 1's receive of `len` bytes from rank 0 under `step`, within 30 s.
async fn receive_from_rank_0(b: &dyn Transport, step: u32, len: usize) -> Vec<RecvOutcome> {
    b.exchange(Step {
        collective: 7,
        step,
        call: 0,
        sends: vec![],
        recvs: vec![RecvOp {
            peer: 0,
            tag: 0,
            len,
        }],
        deadline: tokio::time::Instant::now() + Duration::from_secs(30),
        quorum: None,
    })
    .await
    .unwrap()
}

/// That `got` is exactly `payload`, received.
fn assert_received(got: &[RecvOutcome], payload: &Bytes) {
    match got {
        [RecvOutcome::Received(Payload::Host(got))] => assert!(
            got == payload,
            "{} bytes, first difference at {:?}",
            got.len(),
            got.iter().zip(payload.iter()).position(|(x, y)| x != y)
        ),
        other => panic!("{:?}", other.iter().map(short).collect::<Vec<_>>()),
    }
}

/// A rank that ends a step before the socket took its sends and then drops its transport does
/// not cut them short: the frames left queued are written out after the drop, the receiver
/// gets every byte, and then reads the end of the connection (its later receives are
/// `Missing` at once, not at their deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_left_queued_are_flushed_when_the_transport_drops() {
    let (a, b, payload) = a_step_left_queued().await;
    drop(a);
    assert_received(&receive_from_rank_0(&*b, 0, payload.len()).await, &payload);
    let start = std::time::Instant::now();
    let after = receive_from_rank_0(&*b, 1, 4).await;
    assert_eq!(after, vec![RecvOutcome::Missing]);
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}

/// `close` delivers what a step left queued and returns once the peer has closed too (so a
/// process may exit right after it), well before the linger when the peer closes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_delivers_what_is_queued_and_returns_once_the_peer_closes() {
    let (a, b, payload) = a_step_left_queued().await;
    let closing = tokio::spawn(async move {
        let start = std::time::Instant::now();
        a.close().await;
        start.elapsed()
    });
    assert_received(&receive_from_rank_0(&*b, 0, payload.len()).await, &payload);
    // Rank 0 waits for rank 1's end of the connection, not only for its own frames.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!closing.is_finished(), "rank 0 closed before rank 1 did");
    b.close().await;
    let took = closing.await.unwrap();
    let linger = TcpOptions::default().linger;
    assert!(
        took < linger,
        "close took {took:?}, the linger is {linger:?}"
    );
}

/// A peer that falls behind but keeps reading catches up instead of being cut off: rank 0
/// sends rank 1 forty 1 MiB frames in steps that do not wait for their sends (a quorum
/// round's, left behind by a straggler), while rank 1 posts nothing. Past the socket buffers
/// and the budget, rank 0 drops what rank 1 has not read for a skip notice (rank 1 read within
/// the step timeout: it is behind, not gone). When rank 1 comes to those steps, it gets the
/// frames the sockets held, then the dropped ones' receives end at once (`Missing`, no
/// deadline waited), then the frames after the notice arrive as before. With and without
/// frame MACs (the notice takes the dropped frames' numbers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_falls_behind_skips_what_it_did_not_read_and_catches_up() {
    for macs in [false, true] {
        let mut ranks = if macs {
            world_with_macs(2).await
        } else {
            world(2).await
        };
        let behind = ranks.pop().unwrap();
        let ahead = ranks.pop().unwrap();
        let (len, steps) = (1 << 20, 40u32);
        let timeout = Duration::from_secs(20);
        for step in 0..steps {
            let step = Step {
                quorum: Some(byzcoll_runtime::Quorum::every(0)),
                ..send_step(step, vec![step as u8; len].into(), Instant::now() + timeout)
            };
            ahead.exchange(step).await.unwrap();
            let tcp = ahead
                .as_any()
                .and_then(|a| a.downcast_ref::<TcpTransport>())
                .unwrap();
            let (queued, budget) = (tcp.queued_bytes(1), tcp.queue_budget());
            assert!(
                queued <= budget,
                "macs {macs}: {queued} queued, budget {budget}"
            );
            assert!(tcp.writers[1].as_ref().unwrap().failure().is_none());
        }
        // A frame at or below a notice's key (a step sending its tags out of order) is
        // skipped too, never delivered after the notice that covers it.
        let tcp = ahead
            .as_any()
            .and_then(|a| a.downcast_ref::<TcpTransport>())
            .unwrap();
        let first = byzcoll_runtime::MsgKey {
            collective: 7,
            step: 0,
            tag: 0,
        };
        let late = tcp.send(1, first, 0, vec![0u8; 8].into(), timeout).await;
        assert_eq!(late, Err(SendError::Skipped), "macs {macs}");
        let started = std::time::Instant::now();
        let mut outcomes = Vec::new();
        for step in 0..steps {
            let recv = Step {
                collective: 7,
                recvs: vec![RecvOp {
                    peer: 0,
                    tag: 0,
                    len,
                }],
                sends: vec![],
                ..send_step(step, Bytes::new(), Instant::now() + timeout)
            };
            let got = behind.exchange(recv).await.unwrap().pop().unwrap();
            outcomes.push(match got {
                RecvOutcome::Received(p) => {
                    assert!(
                        p.as_host().unwrap().iter().all(|&b| b == step as u8),
                        "macs {macs}: step {step}'s frame"
                    );
                    'r'
                }
                RecvOutcome::Skipped => 's',
                other => panic!("macs {macs}: step {step}: {other:?}"),
            });
        }
        let seen: String = outcomes.iter().collect();
        assert!(
            started.elapsed() < timeout / 4,
            "macs {macs}: no deadline waited: {:?} for {seen}",
            started.elapsed()
        );
        // Frames the sockets held, then skipped ones (a frame the writer had started by a
        // later notice still comes between them), then those after the last notice.
        assert!(seen.starts_with('r'), "macs {macs}: {seen}");
        assert!(
            seen.contains('s'),
            "macs {macs}: nothing was skipped: {seen}"
        );
        assert!(seen.ends_with('r'), "macs {macs}: {seen}");
    }
}

/// A rank paused long enough for the others to run many rounds of large vectors ahead comes
/// back in step instead of being cut off: 4 ranks with a straggler allowed, under `Enforce`
/// and `Detect`, 2 MiB vectors; rank 3 pauses before round 2 until the others have gone 16
/// rounds on (a pause between their rounds). Past the socket buffers and the budget, the others drop what
/// rank 3 has not read for skip notices (it read within the step timeout: behind, not gone).
/// Rank 3 then fails the rounds whose messages were dropped (without waiting a deadline:
/// under `Enforce` it waits for nothing to be passed on once its peers count it a laggard),
/// takes the later ones as before, and ends a round after them with the others' result (every
/// round it ends well has theirs); the others' rounds all succeed and never wait a deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_far_behind_skips_the_rounds_it_missed_and_comes_back_in_step() {
    use byzcoll_runtime::Agreement;
    for agreement in [Agreement::Enforce, Agreement::Detect] {
        far_behind_comes_back(agreement).await;
    }
}

async fn far_behind_comes_back(agreement: byzcoll_runtime::Agreement) {
    use byzcoll_runtime::Stragglers;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (n, rounds, d) = (4, 30, 1 << 19);
    // Rank 3 must stay a peer that fell *behind*, not one gone: its peers fail it only once
    // it has read nothing for a step timeout, and its pause of 16 rounds lasts 10 s and more
    // on a loaded machine (debug build, two cores; under `Detect` the rounds that wait the
    // grace's floor of a second for its check before it counts as a laggard; under `Enforce`
    // a CI run's, with a 10 s timeout: its peers closed its connection and it failed every
    // round from the pause on).
    let timeout = Duration::from_secs(30);
    // Rounds rank 0 has ended: rank 3's pause lasts until the others are 16 rounds (32 MiB)
    // ahead, far past the budget and the socket buffers however loaded the machine is.
    let ended = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = world(n)
        .await
        .into_iter()
        .map(|t| {
            let mut config = Config::with_step_timeout(timeout);
            config.agreement = agreement;
            config.stragglers = Stragglers::Exactly(1);
            // Under `Detect`, long enough that the honest ranks, loaded as they are here
            // (debug build, two cores), are never late to each other (ranks that heard
            // different checks fail the round): only rank 3's pause makes it late. `Enforce`
            // agrees on late inputs whatever their timing.
            config.grace = byzcoll_runtime::Grace {
                min: match agreement {
                    byzcoll_runtime::Agreement::Detect => Duration::from_secs(1),
                    _ => Duration::from_millis(100),
                },
                factor: 1,
            };
            let mut c = Communicator::new(t, config);
            let ended = ended.clone();
            tokio::spawn(async move {
                let me = c.rank();
                let (mut log, mut health) = (Vec::new(), Vec::new());
                for round in 0..rounds {
                    if me == 3 && round == 2 {
                        let paused = std::time::Instant::now();
                        while ended.load(Ordering::Relaxed) < round + 16
                            && paused.elapsed() < Duration::from_secs(120)
                        {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                    let mut v = vec![(me * 7 + round) as f32; d];
                    let start = std::time::Instant::now();
                    let r = c
                        .robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
                        .await;
                    log.push((
                        start.elapsed(),
                        r.map(|_| (v[0].to_bits(), v[d - 1].to_bits())),
                    ));
                    if round + 1 == rounds {
                        health.extend(c.health());
                    }
                    if me == 0 {
                        ended.store(round + 1, Ordering::Relaxed);
                    }
                    if me != 3 {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                c.close().await;
                (log, health)
            })
        })
        .collect();
    let (mut logs, mut healths) = (Vec::new(), Vec::new());
    for t in tasks {
        let (log, health) = t.await.unwrap();
        logs.push(log);
        healths.push(health);
    }
    for round in 0..rounds {
        let want = match &logs[0][round].1 {
            Ok(bits) => *bits,
            Err(e) => panic!("{agreement:?} rank 0 round {round}: {e}"),
        };
        for (me, log) in logs.iter().enumerate().take(3) {
            let (took, got) = &log[round];
            assert_eq!(
                got.as_ref().ok(),
                Some(&want),
                "{agreement:?} rank {me} round {round}: {got:?}"
            );
            assert!(
                *took < timeout / 2,
                "{agreement:?} rank {me} round {round} took {took:?}"
            );
        }
    }
    let straggler: String = logs[3]
        .iter()
        .map(|(_, r)| if r.is_ok() { 'o' } else { 'e' })
        .collect();
    assert!(
        straggler.contains('e'),
        "{agreement:?}: rank 3 skipped nothing: {straggler}"
    );
    // It learns that it fell behind, from the ranks that went on: they are not at fault,
    // and its fault memory does not count them missing for it (a round in which only one
    // of them, at most f, had gone on yet counts that one missing: it could be Byzantine).
    let behind = logs[3]
        .iter()
        .filter(|(_, r)| {
            matches!(r, Err(byzcoll_runtime::Error::FellBehind { skipped_by, .. })
                if !skipped_by.is_empty() && skipped_by.iter().all(|&p| p < 3))
        })
        .count();
    assert!(
        behind > 0,
        "{agreement:?}: no call said it fell behind: {:?}",
        logs[3]
            .iter()
            .map(|(_, r)| r.as_ref().err())
            .collect::<Vec<_>>()
    );
    for peer in &healths[3] {
        assert!(
            peer.missing < behind as u64,
            "{agreement:?}: {behind} rounds behind, rank 3's view of {peer:?}"
        );
    }
    // Back in step after the skipped rounds: a round it ends with the others' result (cut
    // off, as before skip notices, it failed every round from its first failure on). How
    // many rounds it keeps up depends on the load: it may fall behind again.
    let first_skip = straggler.find('e').unwrap_or(rounds);
    let back = (first_skip..rounds).find(|&round| {
        let (got, want) = (&logs[3][round].1, &logs[0][round].1);
        got.is_ok() && got.as_ref().ok() == want.as_ref().ok()
    });
    assert!(
        back.is_some(),
        "{agreement:?}: rank 3 never came back in step: {straggler}"
    );
    for (round, (_, got)) in logs[3].iter().enumerate() {
        if let Ok(bits) = got {
            assert_eq!(
                Some(bits),
                logs[0][round].1.as_ref().ok(),
                "{agreement:?} rank 3 round {round} ({straggler})"
            );
        }
    }
}
