//! Issue #36's goals for ranks that die or stop, as processes over TCP: 4 ranks of the
//! `rounds` example (median, f = 1, rank `r` contributes `r + 1`: 2.5 with every input, 2
//! without rank 2's), one line per round with its time.
//! - A rank SIGKILLed between rounds: its sockets close with it, so no round of the others
//!   waits any deadline for it, the one that finds it gone included.
//! - A rank SIGSTOPped for ten deadlines with stragglers allowed, under `Enforce` and under
//!   `Detect`: no round of the others waits more than a grace for it, and once it resumes it
//!   returns their result, round by round (under `Detect` it realigns: the cross-check shows
//!   that they went without its input). It finds every round's messages waiting, so it
//!   catches up as fast as it can aggregate. The first round waits for every rank (they
//!   start apart).

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use byzcoll::bootstrap::JobSecret;
use common::{example, free_port, wait_at_most};

/// One rank's rounds: round → (`Some(value)` for `ok <value>`, `None` for an error, the
/// ranks whose inputs the round went without (the rank itself where it reports its own
/// input left out), milliseconds).
type Rounds = HashMap<usize, (Option<f32>, Vec<usize>, u64)>;

/// The median of the inputs `r + 1` of the 4 ranks but `erased`: what a round that went
/// without them returns. A loaded machine may make any rank a straggler for a round.
fn median_without(erased: &[usize]) -> f32 {
    let kept: Vec<f32> = (0..4usize)
        .filter(|r| !erased.contains(r))
        .map(|r| (r + 1) as f32)
        .collect();
    let m = kept.len();
    if m % 2 == 1 {
        kept[m / 2]
    } else {
        (kept[m / 2 - 1] + kept[m / 2]) / 2.0
    }
}

/// Starts 4 ranks of the `rounds` example for `rounds` rounds with `env` on top of a fresh job.
fn start(env: &[(&str, &str)], rounds: usize) -> Vec<Child> {
    let store = format!("127.0.0.1:{}", free_port());
    let secret = JobSecret::generate().unwrap().to_hex();
    (0..4)
        .map(|r| {
            let mut cmd = Command::new(example("rounds"));
            cmd.args(["--rounds", &rounds.to_string()])
                .env("BYZCOLL_LAUNCHER", "byzcoll")
                .env("BYZCOLL_RANK", r.to_string())
                .env("BYZCOLL_WORLD_SIZE", "4")
                .env("BYZCOLL_STORE", &store)
                .env("BYZCOLL_SECRET", &secret)
                .env_remove("BYZCOLL_STORE_HOSTED")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                cmd.env(k, v);
            }
            cmd.spawn().unwrap()
        })
        .collect()
}

/// Reads a rank's lines on a thread of its own, so that the test can wait for one of them
/// while the rank runs, and the rank never blocks on a full pipe.
fn lines(stdout: ChildStdout) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits (at most 60 s) for the line of `round` on `rx`, keeping the lines read.
fn wait_for_round(rx: &mpsc::Receiver<String>, round: usize, seen: &mut Vec<String>) {
    let prefix = format!("round {round}:");
    let end = Instant::now() + Duration::from_secs(60);
    while Instant::now() < end {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(50)) {
            let done = line.starts_with(&prefix);
            seen.push(line);
            if done {
                return;
            }
        }
    }
    panic!("no line for round {round}: {seen:?}");
}

/// Waits (at most 90 s each) for the ranks to exit, and parses their rounds.
fn finish(ranks: Vec<Child>, mut outs: Vec<(mpsc::Receiver<String>, Vec<String>)>) -> Vec<Rounds> {
    let mut all = Vec::new();
    for (me, (child, (rx, mut seen))) in ranks.into_iter().zip(outs.drain(..)).enumerate() {
        let out = wait_at_most(child, Duration::from_secs(90));
        seen.extend(rx.iter());
        let mut rounds = Rounds::new();
        for line in &seen {
            let Some(rest) = line.strip_prefix("round ") else {
                continue;
            };
            let (k, what) = rest.split_once(": ").unwrap();
            let value = what
                .strip_prefix("ok ")
                .map(|v| v.split_whitespace().next().unwrap().parse::<f32>().unwrap());
            let mut erased: Vec<usize> = what
                .split_once("erased [")
                .map(|(_, e)| e.split(']').next().unwrap_or(""))
                .unwrap_or_default()
                .split(',')
                .filter_map(|r| r.trim().parse().ok())
                .collect();
            if what.contains("own input left out") {
                erased.push(me);
            }
            let ms = what
                .rsplit_once(" in ")
                .and_then(|(_, t)| t.strip_suffix(" ms"))
                .unwrap_or_else(|| panic!("no time in {line:?}"))
                .parse::<u64>()
                .unwrap();
            rounds.insert(k.parse::<usize>().unwrap(), (value, erased, ms));
        }
        eprintln!(
            "{}\n{}",
            seen.join("\n"),
            String::from_utf8_lossy(&out.stderr)
        );
        all.push(rounds);
    }
    all
}

/// Starts the job, waits for rank 2's line of `round`, signals it with `signal`, and (for
/// SIGSTOP) resumes it after `stop`.
fn run(
    env: &[(&str, &str)],
    rounds: usize,
    round: usize,
    signal: i32,
    stop: Duration,
) -> Vec<Rounds> {
    let mut ranks = start(env, rounds);
    let mut outs: Vec<_> = ranks
        .iter_mut()
        .map(|c| (lines(c.stdout.take().unwrap()), Vec::new()))
        .collect();
    let (rx, seen) = &mut outs[2];
    wait_for_round(rx, round, seen);
    let pid = ranks[2].id() as i32;
    // SAFETY: signalling a child process of this test by its pid.
    unsafe { libc::kill(pid, signal) };
    if signal == libc::SIGSTOP {
        std::thread::sleep(stop);
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
    }
    finish(ranks, outs)
}

/// Every round of ranks 0, 1 and 3, in order: `(round, value, whether rank 2 was erased)`,
/// each checked to have succeeded within half a deadline (`timeout` ms) with the median of
/// the inputs it reports it kept.
fn the_others_rounds(outcomes: &[Rounds], rounds: usize, timeout: u64) -> Vec<(usize, f32, bool)> {
    let mut seen = Vec::new();
    for me in [0, 1, 3] {
        for k in 0..rounds {
            let (value, erased, ms) = outcomes[me]
                .get(&k)
                .unwrap_or_else(|| panic!("rank {me} has no round {k}"))
                .clone();
            let value = value.unwrap_or_else(|| panic!("rank {me} round {k} failed"));
            assert!(
                ms < timeout / 2,
                "rank {me} round {k} took {ms} ms (deadline {timeout} ms)"
            );
            assert_eq!(
                value,
                median_without(&erased),
                "rank {me} round {k} (went without {erased:?})"
            );
            seen.push((k, value, erased.contains(&2)));
        }
    }
    seen
}

#[test]
fn a_killed_rank_costs_no_deadline_after_it_is_gone() {
    let timeout = 2000;
    let t = timeout.to_string();
    let rounds = 12;
    // Every input waited for while rank 2 lives (stragglers are allowed by default, and on a
    // loaded machine a live rank 2 can be late, and erased, before the kill).
    let env = [
        ("BYZCOLL_TIMEOUT_MS", t.as_str()),
        ("BYZCOLL_STRAGGLERS", "0"),
    ];
    let outcomes = run(&env, rounds, 2, libc::SIGKILL, Duration::ZERO);
    let mut gone_from = None;
    for (k, _, erased) in the_others_rounds(&outcomes, rounds, timeout) {
        if erased {
            gone_from = Some(gone_from.map_or(k, |g: usize| g.min(k)));
        }
    }
    let gone_from = gone_from.expect("the kill landed in no round");
    assert!(
        gone_from >= 3,
        "rank 2 erased in round {gone_from}, before the kill"
    );
}

#[test]
fn a_rank_stopped_for_ten_deadlines_sets_no_pace_and_is_never_split() {
    stopped_for_ten_deadlines("enforce");
}

/// The same under `Detect`: the resumed rank aggregates the inputs waiting for it, its own
/// among them, and realigns to the others' result (they went without its input).
#[test]
fn under_detect_a_rank_stopped_for_ten_deadlines_realigns_to_the_others() {
    stopped_for_ten_deadlines("detect");
}

fn stopped_for_ten_deadlines(agreement: &str) {
    let timeout = 500;
    let t = timeout.to_string();
    // 200 ms apart: the others are still at it when rank 2 resumes.
    let rounds = 40;
    let env = [
        ("BYZCOLL_TIMEOUT_MS", t.as_str()),
        ("BYZCOLL_STRAGGLERS", "auto"),
        ("BYZCOLL_AGREEMENT", agreement),
    ];
    let outcomes = run(
        &env,
        rounds,
        2,
        libc::SIGSTOP,
        Duration::from_millis(10 * timeout),
    );
    let mut erased_rounds = 0;
    for (_, _, erased) in the_others_rounds(&outcomes, rounds, timeout) {
        erased_rounds += usize::from(erased);
    }
    assert!(erased_rounds > 0, "the stop landed in no round");
    // Rank 2 resumes about 25 rounds behind and, paced like the others, stays behind; each of
    // its rounds returns the job's result, made without its input.
    for k in 0..rounds {
        assert!(
            matches!(outcomes[2].get(&k), Some((Some(_), _, _))),
            "rank 2 round {k}: {:?}",
            outcomes[2].get(&k)
        );
    }
    // Rank 2, resumed, returns the others' result or an error, round by round.
    for (k, (value, _, _)) in &outcomes[2] {
        let Some(v2) = value else { continue };
        for me in [0, 1, 3] {
            if let Some((Some(v), _, _)) = outcomes[me].get(k) {
                assert_eq!(v, v2, "round {k}: rank 2 returned {v2}, rank {me} {v}");
            }
        }
    }
}
