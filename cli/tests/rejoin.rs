//! Kill a rank, shrink, restart it, rejoin, under `byzcoll launch --restarts`: the example
//! `rejoin` runs 30 robust rounds on 4 ranks; rank 3 exits at round 7, the launcher starts it
//! again with `BYZCOLL_REJOIN=1`, the others shrink at their next boundary and admit it at one,
//! and the job runs to completion with every rank, each transition a line of its own.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{byzcoll, check_rejoined, example, run_with_limit, tagged, text, REJOIN_FLAGS};

fn launch(restarts: &str) -> (bool, String, String) {
    let mut cmd = Command::new(byzcoll());
    cmd.args(["launch", "-n", "4", "--restarts", restarts, "--"])
        .arg(example("rejoin"))
        .args(REJOIN_FLAGS)
        .env("BYZCOLL_TIMEOUT_MS", "5000")
        // Every input waited for: the test reads each round's exact median and erasures, which
        // a rank late on a loaded machine would change (stragglers are allowed by default).
        .env("BYZCOLL_STRAGGLERS", "0");
    let (out, _) = run_with_limit(&mut cmd, Duration::from_secs(180));
    let (stdout, stderr) = text(&out);
    (out.status.success(), stdout, stderr)
}

#[test]
fn a_killed_rank_restarted_by_the_launcher_rejoins_and_the_job_completes() {
    let (ok, stdout, stderr) = launch("1");
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stderr.contains("rank 3 exited with status 3; starting it again to rejoin"),
        "{stderr}"
    );
    assert!(
        stdout.contains("[3] round 7: exiting (status 3)"),
        "{stdout}"
    );
    // The members drop it at a boundary (the first after its death), then admit it at one
    // (the same or a later one), and every rank ends in a world of four.
    let ranks: Vec<Vec<&str>> = (0..4)
        .map(|r| tagged(&stdout, &format!("[{r}] ")))
        .collect();
    let at = check_rejoined(&ranks);
    for r in 0..3 {
        assert!(
            stdout.contains(&format!("[{r}] boundary 10: kept [0, 1, 2]")),
            "rank {r}:\n{stdout}"
        );
    }
    // While it was away the others' median left it out; once back, it counts again.
    assert!(
        stdout.contains("[0] round 8: ok 2 [world 0 1 2 3] erased [3]")
            || stdout.contains("[0] round 8: ok 2 [world 0 1 2] erased []"),
        "{stdout}"
    );
    for r in 0..4 {
        assert!(
            stdout.contains(&format!(
                "[{r}] round {at}: ok 2.5 [world 0 1 2 3] erased []"
            )),
            "rank {r} in round {at}:\n{stdout}"
        );
    }
}

#[test]
fn without_restarts_a_rank_that_exits_ends_the_job() {
    let (ok, stdout, stderr) = launch("0");
    assert!(!ok, "{stdout}");
    assert!(
        stderr.contains("rank 3 exited with status 3; ending the other ranks"),
        "{stderr}"
    );
    assert!(!stdout.contains("rejoined"), "{stdout}");
}
