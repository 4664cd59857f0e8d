//! The attacks of issue #13, run as an attacker on the same host would, against byzcoll's own
//! processes on 127.0.0.1: strangers running byzcoll's binary with a wrong secret or none, an
//! insider registering as another rank, and a flood of store connections. Each test asserts
//! the outcome: refused, named, and the real job's result exact.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::TcpStream as StdTcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use std::sync::Arc;

use byzcoll::bootstrap::{
    Credentials, Identity, JobAuth, JobSecret, KeyRoster, StoreClient, StoreServer,
};
use common::{example, free_port, run_with_limit, text};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The tests that measure this process's memory, descriptors and CPU run one at a time.
static MEASURED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `tcp_allreduce` as rank `rank` of `world` with the store at `store`, authenticated as
/// `auth` says: `Some(hex)` a secret, `None` the explicit opt-out.
fn rank(rank: usize, world: usize, store: &str, auth: Option<&str>) -> Command {
    let mut cmd = Command::new(example("tcp_allreduce"));
    cmd.env("BYZCOLL_LAUNCHER", "byzcoll")
        .env("BYZCOLL_RANK", rank.to_string())
        .env("BYZCOLL_WORLD_SIZE", world.to_string())
        .env("BYZCOLL_STORE", store)
        .env("BYZCOLL_LOG", "warn")
        .env("BYZCOLL_TIMEOUT_MS", "20000")
        // Every input waited for: the tests read rank 0's lines of exact results, which a
        // round that went without a late input (allowed by default) leaves out.
        .env("BYZCOLL_STRAGGLERS", "0")
        .env_remove("BYZCOLL_STORE_HOSTED")
        .env_remove("BYZCOLL_SECRET")
        .env_remove("BYZCOLL_SECRET_FILE")
        .env_remove("BYZCOLL_ALLOW_UNAUTHENTICATED");
    match auth {
        Some(hex) => cmd.env("BYZCOLL_SECRET", hex),
        None => cmd.env("BYZCOLL_ALLOW_UNAUTHENTICATED", "1"),
    };
    cmd
}

fn spawn(cmd: &mut Command) -> Child {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn")
}

/// Waits (at most 20 s) until something listens at `addr`.
fn wait_listening(addr: &str) {
    let start = Instant::now();
    while StdTcpStream::connect(addr).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "nothing listens at {addr}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn finish(child: Child, limit: Duration) -> (bool, String, String) {
    let start = Instant::now();
    let mut child = child;
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            let (o, e) = text(&out);
            panic!("rank exceeded {limit:?}\n{o}\n{e}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    let (o, e) = text(&out);
    (out.status.success(), o, e)
}

#[test]
fn strangers_running_byzcoll_are_refused_and_the_job_result_is_exact() {
    let store = format!("127.0.0.1:{}", free_port());
    let secret = JobSecret::generate().unwrap().to_hex();
    let wrong = JobSecret::generate().unwrap().to_hex();
    let rank0 = spawn(&mut rank(0, 4, &store, Some(&secret)));
    wait_listening(&store);
    // Strangers claim ranks 1 to 3 before the real ones start: with another job's secret,
    // and without any.
    for (r, auth) in [
        (1, Some(wrong.as_str())),
        (2, None),
        (3, Some(wrong.as_str())),
    ] {
        let (out, _) = run_with_limit(&mut rank(r, 4, &store, auth), Duration::from_secs(30));
        let (stdout, stderr) = text(&out);
        assert!(
            !out.status.success(),
            "stranger {r} joined:\n{stdout}\n{stderr}"
        );
        // Told that it is not of this job, and nothing about the job.
        assert!(
            stderr.contains("not of this job"),
            "stranger {r}:\n{stderr}"
        );
        assert!(
            !stderr.contains("ranks, this job"),
            "stranger {r}:\n{stderr}"
        );
    }
    let real: Vec<Child> = (1..4)
        .map(|r| spawn(&mut rank(r, 4, &store, Some(&secret))))
        .collect();
    for (r, child) in real.into_iter().enumerate() {
        let (ok, stdout, stderr) = finish(child, Duration::from_secs(60));
        assert!(ok, "real rank {}:\n{stdout}\n{stderr}", r + 1);
    }
    let (ok, stdout, stderr) = finish(rank0, Duration::from_secs(60));
    assert!(ok, "rank 0:\n{stdout}\n{stderr}");
    assert!(stdout.contains("OK: 4 ranks over tcp"), "{stdout}");
    assert!(
        stdout.contains("median        n = 4, f = 1: inside the honest range"),
        "{stdout}"
    );
    // Refusals are logged, naming where they came from, but at most one line per source
    // address every 10 s: the strangers all came from 127.0.0.1, so one line says so.
    let refusals: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("refused a connection"))
        .collect();
    assert_eq!(refusals.len(), 1, "{stderr}");
    assert!(
        refusals.iter().all(|l| l.contains("127.0.0.1:")),
        "{stderr}"
    );
}

#[test]
fn an_insider_registering_as_another_rank_is_a_setup_error_naming_it() {
    let store = format!("127.0.0.1:{}", free_port());
    let secret = JobSecret::generate().unwrap().to_hex();
    let rank0 = spawn(&mut rank(0, 3, &store, Some(&secret)));
    wait_listening(&store);
    let real = spawn(&mut rank(1, 3, &store, Some(&secret)));
    std::thread::sleep(Duration::from_millis(200));
    // A process holding the secret (a Byzantine rank) registers as rank 1 a second time.
    let (out, _) = run_with_limit(
        &mut rank(1, 3, &store, Some(&secret)),
        Duration::from_secs(30),
    );
    // Every process of the round fails. Rank 0 hosts the store, so it always gets the answer
    // naming rank 1; the others get it too unless rank 0 exited before the store wrote it to
    // them, and then they see the store gone.
    let named_or_gone =
        |e: &str| e.contains("rank 1 registered twice") || e.contains("rendezvous store");
    let (_, stderr) = text(&out);
    assert!(!out.status.success(), "the impostor joined");
    assert!(named_or_gone(&stderr), "impostor:\n{stderr}");
    let (ok, stdout, stderr) = finish(rank0, Duration::from_secs(30));
    assert!(!ok, "rank 0 went on with an impostor:\n{stdout}");
    assert!(
        stderr.contains("rank 1 registered twice"),
        "rank 0:\n{stderr}"
    );
    let (ok, stdout, stderr) = finish(real, Duration::from_secs(30));
    assert!(!ok, "rank 1 went on with an impostor:\n{stdout}");
    assert!(named_or_gone(&stderr), "rank 1:\n{stderr}");
}

/// The Sybil attack of issue #37 under per-rank keys (`byzcoll keygen`): an insider holding
/// the job secret, the public roster and its own key (rank 3's) tries to register a second
/// process as the late rank 2, before the real rank 2 starts: once with the secret alone (as
/// in the shared-secret attack, where the impostor took rank 2's place and the honest ranks
/// returned 501 instead of 2.5), once through the public API with a roster forged to bind
/// rank 2 to its own key. The store refuses both; the real rank 2 then joins and every result
/// is exact.
#[test]
fn a_sybil_with_the_secret_and_its_own_key_cannot_claim_another_rank() {
    let dir = std::env::temp_dir().join(format!("byzcoll-sybil-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (out, _) = run_with_limit(
        Command::new(common::byzcoll())
            .args(["keygen", "-n", "4", "--out"])
            .arg(&dir),
        Duration::from_secs(30),
    );
    assert!(out.status.success(), "{:?}", text(&out));
    let secret = std::fs::read_to_string(dir.join("secret")).unwrap();
    let secret = secret.trim().to_string();
    let store = format!("127.0.0.1:{}", free_port());
    let keyed = |r: usize| {
        let mut cmd = rank(r, 4, &store, Some(&secret));
        cmd.env("BYZCOLL_ROSTER_FILE", dir.join("roster"))
            .env("BYZCOLL_KEY_FILE", dir.join("rank-%r"));
        cmd
    };
    let rank0 = spawn(&mut keyed(0));
    wait_listening(&store);
    let honest: Vec<Child> = [1, 3].iter().map(|&r| spawn(&mut keyed(r))).collect();

    // 1. A process with the secret alone claims rank 2.
    let (out, _) = run_with_limit(
        &mut rank(2, 4, &store, Some(&secret)),
        Duration::from_secs(30),
    );
    let (stdout, stderr) = text(&out);
    assert!(
        !out.status.success(),
        "the impostor joined:\n{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("requires per-rank keys"),
        "impostor:\n{stderr}"
    );

    // 2. The insider forges a roster binding rank 2 to its own key (rank 3's) and asks the
    // store as rank 2, with the public API.
    let roster_text = std::fs::read_to_string(dir.join("roster")).unwrap();
    let own_key = std::fs::read_to_string(dir.join("rank-3")).unwrap();
    let own = Identity::from_hex(&own_key).unwrap();
    let real = KeyRoster::parse(&roster_text).unwrap();
    let forged: Vec<[u8; 32]> = (0..4)
        .map(|r| match r {
            2 => own.public(),
            r => *real.key(r).unwrap().as_bytes(),
        })
        .collect();
    let forged = Arc::new(KeyRoster::new(&forged).unwrap());
    let creds = Credentials::rank(JobSecret::from_hex(&secret).unwrap(), forged, 2, own).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = StoreClient::new(
        store.clone(),
        2,
        4,
        Duration::from_secs(10),
        JobAuth::PerRank(creds),
    );
    let err = rt
        .block_on(client.all_gather("byzcoll/job", b"x"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("another key roster"), "{err}");

    // The real rank 2 joins; the job completes with exact results and says how ranks proved
    // who they are.
    let real2 = spawn(&mut keyed(2));
    for (r, child) in honest.into_iter().chain([real2]).enumerate() {
        let (ok, stdout, stderr) = finish(child, Duration::from_secs(60));
        assert!(ok, "honest process {r}:\n{stdout}\n{stderr}");
    }
    let (ok, stdout, stderr) = finish(rank0, Duration::from_secs(60));
    assert!(ok, "rank 0:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("OK: 4 ranks over tcp, d = 4096, identity: per-rank"),
        "{stdout}"
    );
    assert!(
        stdout.contains("median        n = 4, f = 1: inside the honest range; 4 inputs"),
        "{stdout}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn cpu_time() -> Duration {
    // SAFETY: getrusage writes into the struct we pass and has no other preconditions.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let t = |tv: libc::timeval| Duration::new(tv.tv_sec as u64, tv.tv_usec as u32 * 1000);
    t(usage.ru_utime) + t(usage.ru_stime)
}

fn secret() -> JobAuth {
    JobAuth::Secret(JobSecret::generate().unwrap())
}

/// A round of `world` ranks through the store at `addr`, each rank publishing its number.
async fn real_round(addr: &str, world: usize, auth: &JobAuth) -> Duration {
    let start = Instant::now();
    let joins: Vec<_> = (0..world)
        .map(|r| {
            let c = StoreClient::new(addr, r, world, Duration::from_secs(10), auth.clone());
            tokio::spawn(async move { c.all_gather("round", &[r as u8]).await })
        })
        .collect();
    for j in joins {
        let got = j.await.unwrap().unwrap();
        assert_eq!(got.iter().map(|b| b[0]).collect::<Vec<_>>(), [0, 1, 2, 3]);
    }
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_requests_claiming_huge_worlds_allocate_nothing() {
    let _one = MEASURED.lock().await;
    let auth = secret();
    let server = StoreServer::bind("127.0.0.1:0", 4, auth.clone())
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    let before = rss_bytes();
    for i in 0..80u32 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        // Half in protocol 1's format (which pinned 32 MiB each), half as version-2 hellos.
        let mut req = Vec::new();
        if i % 2 == 0 {
            req.extend_from_slice(b"BZS1");
            req.extend_from_slice(&0u32.to_le_bytes()); // rank
            req.extend_from_slice(&(1u32 << 20).to_le_bytes()); // world
        } else {
            req.extend_from_slice(b"BZHS\x02\x00\x01\x00"); // version 2, store, flags
            req.extend_from_slice(&(1u32 << 20).to_le_bytes()); // world
            req.extend_from_slice(&0u32.to_le_bytes()); // rank
        }
        req.extend_from_slice(&[0u8; 72]);
        s.write_all(&req).await.unwrap();
        if i % 2 == 1 {
            // A version-2 hello is refused only once the peer fails to prove the secret, so
            // that a stranger learns nothing of the job: the store sends its nonce, then
            // refuses the forged tag.
            assert_eq!(s.read_u8().await.unwrap(), 0);
            let mut nonce = [0u8; 32];
            s.read_exact(&mut nonce).await.unwrap();
            s.write_all(&[0u8; 28]).await.unwrap();
        }
        assert_ne!(s.read_u8().await.unwrap(), 0, "request {i} was not refused");
    }
    let grown = rss_bytes().saturating_sub(before);
    assert!(
        grown < 16 << 20,
        "80 requests grew the store by {grown} bytes"
    );
    assert!(real_round(&addr, 4, &auth).await < Duration::from_secs(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_joins_and_idle_connections_leave_descriptors_and_cpu_at_baseline() {
    let _one = MEASURED.lock().await;
    let auth = secret();
    let server = StoreServer::bind("127.0.0.1:0", 4, auth.clone())
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    let baseline = open_fds();
    let flood = Instant::now();
    for _ in 0..20_000 {
        let s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        drop(s);
        assert!(
            flood.elapsed() < Duration::from_secs(60),
            "flood took too long"
        );
    }
    let mut idle = Vec::new();
    for _ in 0..1000 {
        idle.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    let took = real_round(&addr, 4, &auth).await;
    assert!(
        took < Duration::from_secs(2),
        "a real round took {took:?} behind 1000 idle connections"
    );
    drop(idle);
    // The store lets go of every descriptor (within a second), and then idles.
    let settle = Instant::now();
    while open_fds() > baseline + 8 {
        assert!(
            settle.elapsed() < Duration::from_secs(5),
            "{} descriptors open, {baseline} before",
            open_fds()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cpu = cpu_time();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let used = cpu_time() - cpu;
    assert!(
        used < Duration::from_millis(250),
        "{used:?} of CPU in 0.5 s idle"
    );
}
