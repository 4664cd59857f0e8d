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
