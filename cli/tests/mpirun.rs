//! The TCP example started by a real Open MPI `mpirun`, as users launch it: byzcoll reads
//! `OMPI_COMM_WORLD_*` and rank 0 hosts the store at `BYZCOLL_STORE`.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{example, free_port, run_with_limit, text};

#[test]
fn tcp_example_runs_under_mpirun() {
    if Command::new("mpirun").arg("--version").output().is_err() {
        assert!(
            std::env::var_os("BYZCOLL_REQUIRE_MPI").is_none(),
            "BYZCOLL_REQUIRE_MPI is set but mpirun is not installed (apt-get install openmpi-bin)"
        );
        eprintln!(
            "SKIPPED tcp_example_runs_under_mpirun: mpirun not found (apt-get install openmpi-bin)"
        );
        return;
    }
    let store = format!("127.0.0.1:{}", free_port());
    let secret = byzcoll::bootstrap::JobSecret::generate().unwrap().to_hex();
    let (out, _) = run_with_limit(
        Command::new("mpirun")
            .env("BYZCOLL_SECRET", &secret)
            .args(MCA)
            .args(["-n", "3", "-x", "BYZCOLL_SECRET"])
            .arg("-x")
            .arg(format!("BYZCOLL_STORE={store}"))
            .arg(example("tcp_allreduce")),
        Duration::from_secs(120),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("OK: 3 ranks over tcp"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("median        n = 3, f = 1: inside the honest range"),
        "{stdout}"
    );

    // Without a secret the job does not start, and every rank says how to provide one.
    let store = format!("127.0.0.1:{}", free_port());
    let (out, _) = run_with_limit(
        Command::new("mpirun")
            .env_remove("BYZCOLL_SECRET")
            .env_remove("BYZCOLL_SECRET_FILE")
            .env_remove("BYZCOLL_ALLOW_UNAUTHENTICATED")
            .args(MCA)
            .args(["-n", "2"])
            .arg("-x")
            .arg(format!("BYZCOLL_STORE={store}"))
            .arg(example("tcp_allreduce")),
        Duration::from_secs(120),
    );
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("no job secret") && stderr.contains("mpirun -x BYZCOLL_SECRET"),
        "{stdout}\n{stderr}"
    );
}

const MCA: [&str; 11] = [
    "--allow-run-as-root",
    "--oversubscribe",
    "--mca",
    "oob_tcp_if_include",
    "lo",
    "--mca",
    "btl",
    "self,tcp",
    "--mca",
    "btl_tcp_if_include",
    "lo",
];
