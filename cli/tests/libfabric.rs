//! The example job as separate processes over libfabric (`--features libfabric`), with the
//! `tcp;ofi_rxm` and `shm` providers, pinned to loopback.

#![cfg(feature = "libfabric")]

mod common;

use std::process::Command;
use std::time::Duration;

use common::{byzcoll, example, run_with_limit, text};

fn run_over_libfabric(provider: &str, n: usize) -> String {
    let (out, _) = run_with_limit(
        Command::new(byzcoll())
            .args(["launch", "-n", &n.to_string(), "--"])
            .arg(example("tcp_allreduce"))
            .env("BYZCOLL_TRANSPORT", "libfabric")
            .env("FI_PROVIDER", provider)
            .env("FI_TCP_IFACE", "lo")
            .env("FI_NET_IFACE", "lo")
            .env("FI_SOCKETS_IFACE", "lo")
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
        "FI_PROVIDER={provider} n={n}\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains(&format!("[0] OK: {n} ranks over libfabric")),
        "{stdout}"
    );
    stdout
}

#[test]
fn example_runs_over_tcp_rxm_and_shm() {
    for provider in ["tcp;ofi_rxm", "shm"] {
        for n in [2, 3, 7] {
            let out = run_over_libfabric(provider, n);
            if n >= 3 {
                assert!(out.contains("sharded (r = "), "{out}");
            }
        }
    }
}

#[test]
fn libfabric_and_tcp_report_the_same_results() {
    let (tcp, _) = run_with_limit(
        Command::new(byzcoll())
            .args(["launch", "-n", "4", "--"])
            .arg(example("tcp_allreduce"))
            .env("BYZCOLL_STRAGGLERS", "0"),
        Duration::from_secs(120),
    );
    let (tcp, _) = text(&tcp);
    let fabric = run_over_libfabric("tcp;ofi_rxm", 4);
    let results = |s: &str| -> Vec<String> {
        s.lines()
            .filter(|l| l.starts_with("[0] median") || l.starts_with("[0] trimmed"))
            .map(str::to_string)
            .collect()
    };
    assert_eq!(results(&tcp), results(&fabric));
    assert_eq!(results(&tcp).len(), 2);
}

#[test]
fn info_lists_the_providers() {
    let (out, _) = run_with_limit(
        Command::new(byzcoll())
            .arg("info")
            .env("FI_PROVIDER", "shm")
            .env("BYZCOLL_TRANSPORT", "libfabric"),
        Duration::from_secs(10),
    );
    let (stdout, _) = text(&out);
    assert!(stdout.contains("libfabric  yes"), "{stdout}");
    assert!(
        stdout.contains("libfabric: providers with RDM tagged messaging: "),
        "{stdout}"
    );
    assert!(stdout.contains("shm"), "{stdout}");
    assert!(stdout.contains("FI_PROVIDER=shm"), "{stdout}");
}

#[test]
fn a_provider_without_rdm_tagged_messaging_is_refused_by_name() {
    let (out, _) = run_with_limit(
        Command::new(byzcoll())
            .args(["launch", "-n", "2", "--"])
            .arg(example("tcp_allreduce"))
            .env("BYZCOLL_TRANSPORT", "libfabric")
            .env("FI_PROVIDER", "verbs"),
        Duration::from_secs(60),
    );
    let (_, stderr) = text(&out);
    assert_ne!(out.status.code(), Some(0));
    assert!(stderr.contains("verbs"), "{stderr}");
}
