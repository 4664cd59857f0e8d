//! The GPU example as five separate processes sharing this machine's GPU over TCP (`--features
//! cuda`): ranks in their own processes, each aggregating with the CUDA rules on device
//! vectors. Where there is no GPU the example must fail at once, saying why; the test checks
//! that and prints a visible `SKIPPED` line for the GPU part.

#![cfg(feature = "cuda")]

mod common;

use std::io::Write as _;
use std::process::Command;
use std::time::Duration;

use common::{byzcoll, example, run_with_limit, text};

#[test]
fn ranks_in_separate_processes_share_the_gpu_over_tcp() {
    let gpu = byzcoll::cuda::Gpu::probe();
    let (out, _) = run_with_limit(
        Command::new(byzcoll())
            .args(["launch", "-n", "5", "--"])
            .arg(example("gpu_allreduce"))
            // Krum needs n > 2f + 2.
            .args(["--d", "100003", "--rounds", "1", "--byzantine", "1"])
            .env_remove("BYZCOLL_TRANSPORT"),
        Duration::from_secs(300),
    );
    let (stdout, stderr) = text(&out);
    match gpu {
        Ok(_) => {
            assert!(out.status.success(), "{stdout}\n{stderr}");
            assert!(
                stdout.contains("[0] OK: 5 ranks over tcp, device vectors"),
                "{stdout}"
            );
            for (rule, policy) in [("median", "sharded r=1"), ("krum", "sharded r=2f+1")] {
                assert!(
                    stdout
                        .lines()
                        .any(|l| l.starts_with(&format!("[0] {rule} ")) && l.contains(policy)),
                    "no {rule} {policy} line: {stdout}"
                );
            }
        }
        Err(e) => {
            assert!(!out.status.success(), "{stdout}\n{stderr}");
            assert!(
                stderr.contains("gpu_allreduce: ") && stderr.contains("CUDA driver"),
                "the example must say why it cannot run: {stderr}"
            );
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: no usable GPU ({e}); checked only that the example says so"
            );
        }
    }
}
