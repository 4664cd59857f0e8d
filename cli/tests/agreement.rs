//! Issue #14's SIGSTOP case as processes over TCP: 4 ranks (median, f = 1, rank `r`
//! contributes `r + 1`: 2.5 with every input, 2 without rank 2's), a 1 s deadline, and rank 2
//! stopped for 3.5 s in the middle of the rounds. The other ranks erase it and return 2; rank 2,
//! resumed, finds every input of those rounds waiting. With the cross-check (the default) it
//! never returns another value than the others as success; without it (`BYZCOLL_AGREEMENT=off`)
//! it does, which shows the test can see the split.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use byzcoll::bootstrap::JobSecret;
use common::{example, free_port, text, wait_at_most};

/// Each rank's lines: round → `Some(value)` for `ok <value>`, `None` for an error.
type Outcomes = Vec<HashMap<usize, Option<f32>>>;

fn run_job(agreement: &str) -> (Outcomes, Vec<String>) {
    run_op(agreement, "all-reduce")
}

fn run_op(agreement: &str, op: &str) -> (Outcomes, Vec<String>) {
    let store = format!("127.0.0.1:{}", free_port());
    let secret = JobSecret::generate().unwrap().to_hex();
    let ranks: Vec<Child> = (0..4)
        .map(|r| {
            Command::new(example("rounds"))
                .args(["--rounds", "12", "--op", op])
                .env("BYZCOLL_LAUNCHER", "byzcoll")
                .env("BYZCOLL_RANK", r.to_string())
                .env("BYZCOLL_WORLD_SIZE", "4")
                .env("BYZCOLL_STORE", &store)
                .env("BYZCOLL_SECRET", &secret)
                .env("BYZCOLL_TIMEOUT_MS", "1000")
                .env("BYZCOLL_AGREEMENT", agreement)
                .env_remove("BYZCOLL_STORE_HOSTED")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(900));
    let pid = ranks[2].id() as i32;
    // SAFETY: signalling a child process of this test by its pid.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    std::thread::sleep(Duration::from_millis(3500));
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let mut outcomes = Vec::new();
    let mut logs = Vec::new();
    for child in ranks {
        let out = wait_at_most(child, Duration::from_secs(90));
        let (stdout, stderr) = text(&out);
        let mut rounds = HashMap::new();
        for line in stdout.lines() {
            let Some(rest) = line.strip_prefix("round ") else {
                continue;
            };
            let (k, what) = rest.split_once(": ").unwrap();
            let value = what
                .strip_prefix("ok ")
                .map(|v| v.split_whitespace().next().unwrap().parse::<f32>().unwrap());
            rounds.insert(k.parse::<usize>().unwrap(), value);
        }
        outcomes.push(rounds);
        logs.push(format!("{stdout}\n{stderr}"));
    }
    (outcomes, logs)
}

/// Rounds in which rank 2 returned `Ok` with another value than a rank that also returned `Ok`.
fn silent_splits(outcomes: &Outcomes) -> Vec<usize> {
    let mut splits: Vec<usize> = outcomes[2]
        .iter()
        .filter_map(|(&k, &v2)| {
            let v2 = v2?;
            let differs = [0, 1, 3].iter().any(|&r| {
                outcomes[r]
                    .get(&k)
                    .copied()
                    .flatten()
                    .is_some_and(|v| v != v2)
            });
            differs.then_some(k)
        })
        .collect();
    splits.sort_unstable();
    splits
}

#[test]
fn a_rank_stopped_past_the_deadline_never_returns_another_result_as_success() {
    let (outcomes, logs) = run_job("detect");
    let splits = silent_splits(&outcomes);
    assert!(
        splits.is_empty(),
        "rounds {splits:?} split silently:\n{}",
        logs.join("\n---\n")
    );
    // The stop did land in some rounds: the others erased rank 2 there, and rank 2, which
    // found every input waiting, saw in the cross-check that they went without its own and
    // aggregated again without it (realignment), returning their result; a round it could not
    // realign fails loudly instead.
    let erased = logs[0].lines().filter(|l| l.contains("erased [2]")).count();
    assert!(erased > 0, "the stop hit no round:\n{}", logs[0]);
    assert!(
        logs[2].contains("own input left out") || logs[2].contains("error"),
        "{}",
        logs[2]
    );

    // Without the cross-check the same stop gives rank 2 another result, presented as success.
    let (outcomes, logs) = run_job("off");
    assert!(
        !silent_splits(&outcomes).is_empty(),
        "expected a silent split under off:\n{}",
        logs.join("\n---\n")
    );
}

#[test]
fn under_enforce_a_rank_stopped_past_the_deadline_returns_the_others_result_or_an_error() {
    let (outcomes, logs) = run_job("enforce");
    // Every rank that returned `Ok` in a round returned the same value, the stopped one
    // included.
    for k in 0..12 {
        let mut values: Vec<u32> = outcomes
            .iter()
            .filter_map(|o| o.get(&k).copied().flatten())
            .map(f32::to_bits)
            .collect();
        values.dedup();
        assert!(
            values.len() <= 1,
            "round {k} split: {values:?}\n{}",
            logs.join("\n---\n")
        );
    }
    // The stop did land in some rounds (the others counted rank 2 at fault there).
    let hit = logs[0].lines().filter(|l| l.contains("erased [2]")).count();
    assert!(hit > 0, "the stop hit no round:\n{}", logs[0]);
    // Where the echo told rank 2 that nobody had its input in time (the others closed the
    // round without it and it found their messages waiting), it left its own input out as
    // they did and returned their result, 2, saying so. (Where its input had reached them
    // before the stop, everyone returned 2.5.)
    for line in logs[2]
        .lines()
        .filter(|l| l.ends_with("(own input left out)"))
    {
        assert!(line.contains(": ok 2 "), "{line}\n{}", logs[2]);
    }
}

/// Rounds in which rank 2 returned `Ok` with a shard of another input set than a rank that
/// also returned `Ok`. Every rank's input is a constant vector, so every coordinate of every
/// shard tells the input set: 2.5 with rank 2's input, 2 without it. (A rank that erased rank 2
/// only after its piece had arrived, in the versions step or the cross-check, computed with
/// it: that is no split.)
fn inconsistent_input_sets(outcomes: &Outcomes) -> Vec<usize> {
    silent_splits(outcomes)
}

#[test]
fn a_rank_stopped_in_a_reduce_scatter_is_told_not_handed_a_shard_of_another_input_set() {
    let (outcomes, logs) = run_op("detect", "reduce-scatter");
    let split = inconsistent_input_sets(&outcomes);
    assert!(
        split.is_empty(),
        "rounds {split:?}: rank 2 returned a shard of another input set as success:\n{}",
        logs.join("\n---\n")
    );
    let erased = logs[0].lines().filter(|l| l.contains("erased [2]")).count();
    assert!(erased > 0, "the stop hit no round:\n{}", logs[0]);
    // The honest ranks agree among themselves: every round they finished has the same value
    // (each rank's shard of the median of 1, 2, 4 or of 1..4).
    for k in 0..12 {
        let values: Vec<f32> = [0, 1, 3]
            .iter()
            .filter_map(|&r| outcomes[r].get(&k).copied().flatten())
            .collect();
        assert!(
            values.windows(2).all(|w| w[0] == w[1]),
            "round {k}: {values:?}"
        );
    }

    // No run without the cross-check here: with 2f + 1 owners per shard, the median of the
    // versions outvotes a late rank's own, so it returns the others' value even under `off`.
    // The split detector is `silent_splits`, which the all-reduce test above sees split
    // under `off`.
}
