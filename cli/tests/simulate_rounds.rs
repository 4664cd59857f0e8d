//! `byzcoll simulate` rounds mode at 1000 ranks: a straggler against the quorum, deaths and a
//! rejoin, and the flags' bad values refused.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::{assert_failed, byzcoll, run_with_limit, text};

fn simulate(args: &[&str]) -> Output {
    let mut cmd = Command::new(byzcoll());
    cmd.arg("simulate").args(args);
    run_with_limit(&mut cmd, Duration::from_secs(300)).0
}

/// Runs every simulation at once (each is one process of one thread).
fn simulate_all(runs: &[&[&str]]) -> Vec<(Output, String)> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = runs
            .iter()
            .map(|args| scope.spawn(move || simulate(args)))
            .collect();
        handles
            .into_iter()
            .zip(runs)
            .map(|(h, args)| {
                let out = h.join().expect("a simulation thread");
                let (stdout, stderr) = text(&out);
                assert!(out.status.success(), "{args:?}\n{stdout}\n{stderr}");
                (out, stdout)
            })
            .collect()
    })
}

/// One row of the rounds table.
#[derive(Debug)]
struct Row {
    time_us: f64,
    slowest_us: f64,
    late: String,
    missing: String,
    dead: usize,
    inputs: usize,
}

/// The rows of the (one) rounds table in `stdout`.
fn rows(stdout: &str) -> Vec<Row> {
    let mut lines = stdout
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("round "));
    lines.next().expect("a rounds table");
    lines
        .take_while(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .map(str::split_whitespace)
        .map(|mut cols| {
            let mut next = || cols.next().expect("a full row").to_string();
            let _round = next();
            let _start = next();
            let time_us = next().parse().expect("time");
            let slowest_us = next().parse().expect("slowest");
            let _bound = next();
            let dead = next().parse().expect("dead");
            let inputs = next().parse().expect("inputs");
            let _check = next();
            Row {
                time_us,
                slowest_us,
                dead,
                inputs,
                late: next(),
                missing: next(),
            }
        })
        .collect()
}

/// The healthy round's time `--check` printed, in microseconds.
fn healthy_us(stdout: &str) -> f64 {
    let (_, after) = stdout
        .split_once("healthy round: ")
        .expect("a healthy round");
    after
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .expect("its time")
}

/// 1000 ranks of 16 coordinates, gather-mode median.
const WORLD: [&str; 10] = [
    "--ranks", "1000", "--d", "16", "--rule", "median", "--mode", "gather", "--seed", "3",
];

fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = WORLD.to_vec();
    args.extend_from_slice(extra);
    args
}

#[test]
fn a_straggler_ten_times_slower_sets_the_pace_only_without_a_quorum() {
    // Rank 0 starts each round 6 ms late: about 9 healthy rounds (687 us at 1000 ranks, most
    // of it the cross-check's 1000 digests per rank), so it takes 10 times as long.
    let quorum = with(&[
        "--f",
        "1",
        "--slow-ranks",
        "1",
        "--slow-delay",
        "fixed:6ms",
        "--stragglers",
        "1",
        "--grace-ms",
        "0.02",
        "--check",
    ]);
    // Every input waited for (the cross-check off: nothing to tell apart, half the work).
    let everyone = with(&[
        "--f",
        "1",
        "--slow-ranks",
        "1",
        "--slow-delay",
        "fixed:6ms",
        "--stragglers",
        "0",
        "--agreement",
        "off",
    ]);
    let outs = simulate_all(&[&quorum, &everyone]);

    let stdout = &outs[0].1;
    let healthy = healthy_us(stdout);
    assert!(6000.0 >= 8.0 * healthy, "{stdout}");
    let row = &rows(stdout)[0];
    assert!(row.time_us <= 1.2 * healthy, "{stdout}");
    assert!(row.slowest_us >= 6000.0, "{stdout}");
    assert_eq!((row.late.as_str(), row.missing.as_str()), ("1[0]", "0"));
    assert_eq!(row.inputs, 999);
    assert!(stdout.contains("gather: s = 1;"), "{stdout}");
    assert!(
        stdout.contains("OK: in every round the honest ranks agree"),
        "{stdout}"
    );

    let stdout = &outs[1].1;
    let row = &rows(stdout)[0];
    assert!(row.time_us >= 6000.0, "{stdout}");
    assert!((row.time_us - row.slowest_us).abs() < 1e-6, "{stdout}");
    assert!(row.time_us <= 6000.0 + healthy, "{stdout}");
    assert_eq!((row.late.as_str(), row.inputs), ("0", 1000), "{stdout}");
}

#[test]
fn dead_ranks_cost_one_deadline_a_round_and_count_again_after_the_rejoin() {
    // Ranks 998 and 999 die at round 0 and rejoin at round 1; every input is waited for
    // (`--stragglers 0`; the cross-check off: nothing to tell apart. The quorum over dead
    // ranks, where they are late and no deadline is waited, is the simulator's own test, at 7
    // to 11 ranks).
    let deaths = with(&[
        "--f",
        "2",
        "--deaths",
        "2@0",
        "--rejoin",
        "1",
        "--rounds",
        "2",
        "--timeout-ms",
        "5",
        "--stragglers",
        "0",
        "--agreement",
        "off",
    ]);
    let outs = simulate_all(&[&deaths]);
    let stdout = &outs[0].1;
    let rows = rows(stdout);
    assert_eq!(rows.len(), 2, "{stdout}");
    let (dead, back) = (&rows[0], &rows[1]);
    assert_eq!((dead.dead, dead.inputs), (2, 998), "{stdout}");
    assert_eq!(
        (dead.missing.as_str(), dead.late.as_str()),
        ("2[998,999]", "0")
    );
    // Missing at the input step's deadline: one deadline, no more.
    assert!(dead.time_us >= 5000.0, "{stdout}");
    assert!(dead.time_us <= 5000.0 + 1.2 * back.time_us, "{stdout}");
    // Back: counted again, in a healthy round's time.
    assert_eq!((back.dead, back.inputs), (0, 1000), "{stdout}");
    assert_eq!((back.late.as_str(), back.missing.as_str()), ("0", "0"));
    assert!(back.time_us < 0.01 * dead.time_us, "{stdout}");
}

/// Runs a simulation that must fail with `code` and a message holding every needle.
fn fails(args: &[&str], code: i32, needles: &[&str]) {
    assert_failed(&simulate(args), args, code, needles, true);
}

#[test]
fn bad_round_flags_are_refused_with_what_is_wrong() {
    // 8 ranks, gather mode unless the case says otherwise.
    let with = |extra: &[&'static str]| {
        let mut args = vec!["--ranks", "8", "--d", "4", "--rule", "median", "--f", "1"];
        if !extra.contains(&"--mode") {
            args.extend_from_slice(&["--mode", "gather"]);
        }
        args.extend_from_slice(extra);
        args
    };
    // Clap's own: out of range, malformed, a flag without the one it needs.
    for (extra, needle) in [
        (&["--rounds", "0"][..], "--rounds"),
        (&["--rounds", "10001"], "10001"),
        (&["--rounds", "18446744073709551616"], "--rounds"),
        (&["--stragglers=-1"], "auto or a number"),
        (&["--stragglers", "some"], "auto or a number"),
        (&["--grace-ms=-1"], "must be >= 0"),
        (&["--grace-ms", "1e300"], "longer than a day"),
        (&["--grace-ms", "nan"], "not a finite number"),
        (&["--grace-factor", "4294967296"], "--grace-factor"),
        (
            &["--slow-ranks", "0", "--slow-delay", "fixed:1ms"],
            "--slow-ranks",
        ),
        (&["--slow-ranks", "1"], "--slow-delay"),
        (&["--slow-delay", "fixed:1ms"], "--slow-ranks"),
        (&["--slow-ranks", "1", "--slow-delay", "fixed:5"], "no unit"),
        (
            &["--slow-ranks", "1", "--slow-delay", "fixed:1e400s"],
            "finite",
        ),
        (
            &["--slow-ranks", "1", "--slow-delay", "exp:2days"],
            "unknown unit",
        ),
        (
            &["--slow-ranks", "1", "--slow-delay", "exp:86401s"],
            "one day",
        ),
        (
            &["--slow-ranks", "1", "--slow-delay", "lognormal:1ms,11"],
            "sigma",
        ),
        (
            &["--slow-ranks", "1", "--slow-delay", "gamma:1ms"],
            "unknown distribution",
        ),
        (&["--deaths", "1"], "K@ROUND"),
        (&["--deaths", "18446744073709551616@0"], "K@ROUND"),
        (&["--rejoin", "1"], "--deaths"),
        (&["--deaths", "1@0", "--rejoin", "4294967296"], "--rejoin"),
    ] {
        fails(&with(extra), 2, &[needle]);
    }
    fails(
        &["--predict", "--ranks", "4", "--rounds", "2"],
        2,
        &["cannot be used with"],
    );
    // The simulator's: values that parse but cannot work, one line each.
    for (extra, needles) in [
        (
            &["--stragglers", "7"][..],
            &["7 stragglers allowed", "too few"][..],
        ),
        (
            &["--stragglers", "8"],
            &["8 stragglers allowed in a world of 8"],
        ),
        (
            &["--stragglers", "1", "--mode", "all"],
            &[
                "1 stragglers allowed in sharded rounds",
                "one owner per shard",
                "--mode gather",
            ],
        ),
        (
            &["--slow-ranks", "9", "--slow-delay", "fixed:1ms"],
            &["9 slow ranks in a world of 8"],
        ),
        (&["--deaths", "0@0"], &["0 ranks dying"]),
        (&["--deaths", "8@0"], &["one rank must live"]),
        (
            &["--deaths", "1@2", "--rounds", "2"],
            &["die at round 2", "rounds 0 to 1 only"],
        ),
        (
            &["--deaths", "1@0", "--rejoin", "3", "--rounds", "3"],
            &["rejoin at round 3"],
        ),
        (
            &["--deaths", "1@1", "--rejoin", "1", "--rounds", "3"],
            &["later round"],
        ),
        (
            &[
                "--deaths",
                "2@0",
                "--slow-ranks",
                "3",
                "--slow-delay",
                "fixed:1ms",
                "--byzantine",
                "4",
            ],
            &["do not fit in 8 ranks"],
        ),
    ] {
        fails(&with(extra), 1, needles);
    }
}
