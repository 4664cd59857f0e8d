//! The TCP example started by a real Open MPI `mpirun`, as users launch it: byzcoll reads
//! `OMPI_COMM_WORLD_*` and rank 0 hosts the store at `BYZCOLL_STORE`.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{
    check_rejoined, example, free_port, run_with_limit, tagged, text, wait_at_most, REJOIN_FLAGS,
};

/// Whether `mpirun` is here; a visible skip otherwise (unless `BYZCOLL_REQUIRE_MPI` is set).
fn have_mpirun(test: &str) -> bool {
    if Command::new("mpirun").arg("--version").output().is_ok() {
        return true;
    }
    assert!(
        std::env::var_os("BYZCOLL_REQUIRE_MPI").is_none(),
        "BYZCOLL_REQUIRE_MPI is set but mpirun is not installed (apt-get install openmpi-bin)"
    );
    eprintln!("SKIPPED {test}: mpirun not found (apt-get install openmpi-bin)");
    false
}

#[test]
fn tcp_example_runs_under_mpirun() {
    if !have_mpirun("tcp_example_runs_under_mpirun") {
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

/// Kill a rank, shrink, restart it, rejoin, in a job `mpirun` started: the example `rejoin`
/// on 4 ranks, rank 3 exiting at round 7. Open MPI keeps the others running
/// (`orte_enable_recovery`) but does not start a process again (its `orte_max_restarts` does
/// nothing in 4.1), so the test starts rank 3 again beside the job, as a user's script would,
/// with `BYZCOLL_REJOIN=1` and the job's store and secret: the others shrink, admit it at a
/// boundary, and every rank ends the 30 rounds in a world of four.
#[test]
fn a_rank_killed_under_mpirun_rejoins_when_started_again() {
    if !have_mpirun("a_rank_killed_under_mpirun_rejoins_when_started_again") {
        return;
    }
    let store = format!("127.0.0.1:{}", free_port());
    let secret = byzcoll::bootstrap::JobSecret::generate().unwrap().to_hex();
    let flags = REJOIN_FLAGS;
    let mut mpirun = Command::new("mpirun")
        .env("BYZCOLL_SECRET", &secret)
        .args(MCA)
        .args(["--tag-output", "--mca", "orte_enable_recovery", "1"])
        .args(["-n", "4", "-x", "BYZCOLL_SECRET", "-x"])
        .arg(format!("BYZCOLL_STORE={store}"))
        .args(["-x", "BYZCOLL_TIMEOUT_MS=5000"])
        // Every input waited for, as the launcher's rejoin test: check_rejoined reads exact
        // rounds (stragglers are allowed by default). Job-wide: rank 3 says it again below.
        .args(["-x", "BYZCOLL_STRAGGLERS=0"])
        .arg(example("rejoin"))
        .args(flags)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn mpirun");
    // Its lines as they come; the rank's exit is the cue to start it again.
    let (exited, cue) = mpsc::channel();
    let stdout = BufReader::new(mpirun.stdout.take().expect("piped"));
    let lines = std::thread::spawn(move || {
        let mut all = String::new();
        for line in stdout.lines().map_while(Result::ok) {
            if line.contains("[1,3]<stdout>:round 7: exiting (status 3)") {
                let _ = exited.send(());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let mut stderr = mpirun.stderr.take().expect("piped");
    let errors = std::thread::spawn(move || {
        let mut all = String::new();
        let _ = stderr.read_to_string(&mut all);
        all
    });
    let started = Instant::now();
    if cue.recv_timeout(Duration::from_secs(60)).is_err() {
        let _ = mpirun.kill();
        panic!(
            "rank 3 never exited:\n{}\n{}",
            lines.join().unwrap(),
            errors.join().unwrap()
        );
    }
    let again = Command::new(example("rejoin"))
        .env("BYZCOLL_SECRET", &secret)
        .env("BYZCOLL_STORE", &store)
        .env("BYZCOLL_RANK", "3")
        .env("BYZCOLL_WORLD_SIZE", "4")
        .env("BYZCOLL_REJOIN", "1")
        .env("BYZCOLL_TIMEOUT_MS", "5000")
        .env("BYZCOLL_STRAGGLERS", "0")
        .args(flags)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rank 3 again");
    let again = wait_at_most(again, Duration::from_secs(120));
    while mpirun.try_wait().expect("wait").is_none() {
        if started.elapsed() > Duration::from_secs(150) {
            let _ = mpirun.kill();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (job, job_err) = (lines.join().unwrap(), errors.join().unwrap());
    let (rank3, rank3_err) = text(&again);
    assert!(
        again.status.success(),
        "{rank3}\n{rank3_err}\n{job}\n{job_err}"
    );
    let mut ranks: Vec<Vec<&str>> = (0..3)
        .map(|r| tagged(&job, &format!("[1,{r}]<stdout>:")))
        .collect();
    // Rank 3's first life under mpirun, its second beside it.
    let mut three = tagged(&job, "[1,3]<stdout>:");
    three.extend(rank3.lines());
    ranks.push(three);
    check_rejoined(&ranks);
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
