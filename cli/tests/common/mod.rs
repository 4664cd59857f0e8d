//! Helpers shared by the multi-process tests.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// The `byzcoll` binary cargo built for these tests.
pub(crate) fn byzcoll() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_byzcoll"))
}

/// An example binary built next to it (`cargo test` builds examples).
pub(crate) fn example(name: &str) -> PathBuf {
    let path = byzcoll()
        .parent()
        .expect("target dir")
        .join("examples")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo test --workspace` (which builds examples) or `cargo build --examples`",
        path.display()
    );
    path
}

/// Runs `cmd` with a hard time limit, so a hang fails the test instead of stalling CI.
/// Waits for a child started with piped output, killing it once `limit` has passed, and gives
/// its output.
pub(crate) fn wait_at_most(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

pub(crate) fn run_with_limit(cmd: &mut Command, limit: Duration) -> (Output, Duration) {
    let start = Instant::now();
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "command exceeded {limit:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    (out, start.elapsed())
}

/// stdout and stderr of `out` as text.
pub(crate) fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts that `out`, the run of `args`, exited with `code` and that its stderr holds every
/// needle; with `one_line`, an exit 1 must also print exactly one line on stderr and nothing
/// on stdout.
pub(crate) fn assert_failed(
    out: &Output,
    args: &[&str],
    code: i32,
    needles: &[&str],
    one_line: bool,
) {
    let (stdout, stderr) = text(out);
    assert_eq!(
        out.status.code(),
        Some(code),
        "{args:?}\n{stdout}\n{stderr}"
    );
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "{args:?}: {needle:?} not in\n{stderr}"
        );
    }
    if one_line && code == 1 {
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stdout.is_empty(), "{args:?}: {stdout}");
    }
}

/// A port on 127.0.0.1 that was free a moment ago, drawn below the kernel's ephemeral range
/// (`ip_local_port_range`): a launcher started between the pick and the bind (`srun`, `mpirun`)
/// opens its own sockets on ephemeral ports, and one of them once took the store's port, so
/// the ranks spoke to `srun` instead of rank 0.
pub(crate) fn free_port() -> u16 {
    use std::hash::{BuildHasher, RandomState};
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    const LOWEST: u16 = 10_000;
    if ephemeral_start > LOWEST + 1_000 {
        let span = u64::from(ephemeral_start - LOWEST);
        let random = RandomState::new();
        for attempt in 0..200u64 {
            let port = LOWEST + (random.hash_one(attempt) % span) as u16;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind")
        .port()
}

/// The lines of `out` that start with `prefix` (a launcher's rank tag), without it.
pub(crate) fn tagged<'a>(out: &'a str, prefix: &str) -> Vec<&'a str> {
    out.lines().filter_map(|l| l.strip_prefix(prefix)).collect()
}

/// The flags of `examples/rejoin` that [`check_rejoined`] expects: 30 rounds, a boundary
/// every 5, rank 3 exiting at round 7, 20 ms between rounds, and up to 30 s at the end for a
/// rank restarted late.
pub(crate) const REJOIN_FLAGS: [&str; 10] = [
    "--rounds",
    "30",
    "--every",
    "5",
    "--kill-at",
    "7",
    "--round-ms",
    "20",
    "--final-wait-ms",
    "30000",
];

/// Checks the transitions `examples/rejoin` ([`REJOIN_FLAGS`]) printed on 4 ranks whose rank 3 died
/// and came back (`lines[r]`: rank `r`'s lines, both lives of rank 3 included): each survivor
/// dropped it at a boundary (`kept [0, 1, 2]`) and admitted it at one, the same on every
/// survivor, where rank 3 says it rejoined, and every rank ended the 30 rounds in a world of
/// four. Returns the boundary it was admitted at.
pub(crate) fn check_rejoined(lines: &[Vec<&str>]) -> u64 {
    let all = |r: usize| lines[r].join("\n");
    let admitted = |r: usize| {
        lines[r]
            .iter()
            .find(|l| l.starts_with("boundary ") && l.contains("admitted [3] at epoch 1"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|round| round.trim_end_matches(':').parse::<u64>().ok())
    };
    let at = admitted(0).unwrap_or_else(|| panic!("rank 3 never admitted:\n{}", all(0)));
    for (r, rank) in lines.iter().enumerate().take(3) {
        assert!(
            rank.iter()
                .any(|l| l.starts_with("boundary ") && l.ends_with("kept [0, 1, 2]")),
            "rank {r} never dropped rank 3:\n{}",
            all(r)
        );
        assert_eq!(admitted(r), Some(at), "rank {r}:\n{}", all(r));
    }
    assert!(
        lines[3].contains(&format!("rejoined at round {at} as rank 3 of 4 (epoch 1)").as_str()),
        "{}",
        all(3)
    );
    for (r, rank) in lines.iter().enumerate() {
        assert!(
            rank.contains(&"done: 30 rounds, world [0, 1, 2, 3]"),
            "rank {r}:\n{}",
            all(r)
        );
    }
    at
}
