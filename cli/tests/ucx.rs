//! The example job as separate processes over UCX (`--features ucx`), with UCX's TCP and
//! shared-memory transports, pinned to loopback.

#![cfg(feature = "ucx")]

mod common;

use std::process::Command;
use std::time::Duration;

use common::{byzcoll, example, run_with_limit, text};

fn run_over_ucx(tls: &str, n: usize) -> String {
    let (out, _) = run_with_limit(
        Command::new(byzcoll())
            .args(["launch", "-n", &n.to_string(), "--"])
            .arg(example("tcp_allreduce"))
            .env("BYZCOLL_TRANSPORT", "ucx")
            .env("UCX_TLS", tls)
            .env("UCX_NET_DEVICES", "lo")
            .env("UCX_LOG_LEVEL", "error")
            .env("BYZCOLL_TIMEOUT_MS", "20000")
            // Every input waited for: the lines compared are those of rounds that went
            // without none (stragglers are allowed by default, and on a loaded machine a
            // late input leaves a round's line out).
            .env("BYZCOLL_STRAGGLERS", "0"),
        Duration::from_secs(120),
    );
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success(),
        "UCX_TLS={tls} n={n}\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains(&format!("[0] OK: {n} ranks over ucx")),
        "{stdout}"
    );
    stdout
}

#[test]
fn example_runs_over_ucx_tcp_and_shared_memory() {
    for tls in ["tcp,self", "sm,self"] {
        for n in [2, 3, 7] {
            let out = run_over_ucx(tls, n);
            if n >= 3 {
                assert!(out.contains("sharded (r = "), "{out}");
            }
        }
    }
}

#[test]
fn ucx_and_tcp_report_the_same_results() {
    let (tcp, _) = run_with_limit(
        Command::new(byzcoll())
            .args(["launch", "-n", "4", "--"])
            .arg(example("tcp_allreduce"))
            .env("BYZCOLL_STRAGGLERS", "0"),
        Duration::from_secs(120),
    );
    let (tcp, _) = text(&tcp);
    let ucx = run_over_ucx("tcp,self", 4);
    let strip = |s: &str| -> Vec<String> {
        s.lines()
            .filter(|l| l.starts_with("[0] median") || l.starts_with("[0] trimmed"))
            .map(str::to_string)
            .collect()
    };
    assert_eq!(strip(&tcp), strip(&ucx));
    assert_eq!(strip(&tcp).len(), 2);
}

#[test]
fn info_reports_ucx_and_its_variables() {
    let (out, _) = run_with_limit(
        Command::new(byzcoll())
            .arg("info")
            .env("UCX_TLS", "sm,self")
            .env("BYZCOLL_TRANSPORT", "ucx"),
        Duration::from_secs(10),
    );
    let (stdout, _) = text(&out);
    assert!(stdout.contains("ucx        yes"), "{stdout}");
    assert!(stdout.contains("ucx: libucp 1."), "{stdout}");
    assert!(stdout.contains("UCX_TLS=sm,self"), "{stdout}");
    assert!(
        stdout.contains("transport    ucx (from BYZCOLL_TRANSPORT; available)"),
        "{stdout}"
    );
}
