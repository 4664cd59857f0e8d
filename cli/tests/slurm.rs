//! The example job launched by a real Slurm `srun` (plain and `--mpi=pmi2`), as users run it:
//! byzcoll reads `SLURM_PROCID`/`SLURM_NTASKS` (or `PMI_RANK`/`PMI_SIZE`) and rank 0 hosts the
//! store at `BYZCOLL_STORE`. Needs a running cluster (`scripts/slurm-up.sh` prints its
//! `SLURM_CONF`); skipped with a message otherwise, failed when `BYZCOLL_REQUIRE_SLURM` is set.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{example, free_port, run_with_limit, text};

fn slurm_available() -> bool {
    let up = std::env::var_os("SLURM_CONF").is_some()
        && Command::new("sinfo")
            .arg("-h")
            .output()
            .is_ok_and(|o| o.status.success());
    if !up {
        assert!(
            std::env::var_os("BYZCOLL_REQUIRE_SLURM").is_none(),
            "BYZCOLL_REQUIRE_SLURM is set but no Slurm cluster answers (scripts/slurm-up.sh)"
        );
        eprintln!(
            "SKIPPED: no Slurm cluster (start one with scripts/slurm-up.sh and export SLURM_CONF)"
        );
    }
    up
}

#[test]
fn example_runs_under_srun_and_srun_pmi2() {
    if !slurm_available() {
        return;
    }
    for mpi in [None, Some("--mpi=pmi2")] {
        let store = format!("127.0.0.1:{}", free_port());
        let mut cmd = Command::new("srun");
        cmd.args(["-n", "3", "--overcommit", "--kill-on-bad-exit=1"]);
        if let Some(m) = mpi {
            cmd.arg(m);
        }
        let secret = byzcoll::bootstrap::JobSecret::generate().unwrap().to_hex();
        cmd.env("BYZCOLL_SECRET", &secret)
            .arg(format!("--export=ALL,BYZCOLL_STORE={store},BYZCOLL_SECRET"))
            .arg(example("tcp_allreduce"));
        let (out, _) = run_with_limit(&mut cmd, Duration::from_secs(120));
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{mpi:?}\n{stdout}\n{stderr}");
        assert!(
            stdout.contains("OK: 3 ranks over tcp"),
            "{mpi:?}\n{stdout}\n{stderr}"
        );
    }
}
