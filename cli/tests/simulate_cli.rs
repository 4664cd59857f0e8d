//! `byzcoll simulate`: data mode checked against the gather-mode reference, timing
//! predictions, and clear errors.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::{assert_failed, byzcoll, run_with_limit, text};

fn simulate(args: &[&str]) -> Output {
    let mut cmd = Command::new(byzcoll());
    cmd.arg("simulate").args(args);
    run_with_limit(&mut cmd, Duration::from_secs(120)).0
}

/// Runs a simulation that must fail with `code` and one line on stderr holding every needle.
fn fails(args: &[&str], code: i32, needles: &[&str]) {
    assert_failed(&simulate(args), args, code, needles, true);
}

#[test]
fn data_mode_matches_the_reference() {
    let out = simulate(&[
        "--ranks", "64", "--d", "4096", "--rule", "median", "--f", "3", "--mode", "all", "--check",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
    for needle in [
        "n = 64, d = 4096",
        "gather",
        "sharded r=1",
        "sharded r=7",
        "ring SUM",
        "OK: results match the gather-mode reference",
    ] {
        assert!(stdout.contains(needle), "{needle:?} not in\n{stdout}");
    }
    assert_eq!(stdout.matches("exact").count(), 4, "{stdout}");
}

#[test]
fn faults_within_f_still_pass_the_check() {
    let out = simulate(&[
        "--ranks",
        "32",
        "--d",
        "300",
        "--rule",
        "trimmed-mean",
        "--f",
        "3",
        "--mode",
        "gather",
        "--byzantine",
        "2",
        "--attack",
        "alie",
        "--crash",
        "5",
        "--stall",
        "7:10",
        "--loss",
        "0.001",
        "--delay-us",
        "3",
        "--timeout-ms",
        "1",
        "--seed",
        "9",
        "--check",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("in honest range"), "{stdout}");
    assert!(stdout.contains("OK: results match"), "{stdout}");
}

#[test]
fn lying_owners_beat_one_replica_but_not_2f_plus_1() {
    let out = simulate(&[
        "--ranks",
        "11",
        "--d",
        "100",
        "--rule",
        "median",
        "--f",
        "2",
        "--mode",
        "sharded",
        "--lying-owners",
        "2",
        "--lie",
        "equivocate",
        // What replication alone does; the cross-check's part is the next test's.
        "--agreement",
        "off",
        "--check",
    ]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    let line = |name: &str| {
        stdout
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no {name} line in\n{stdout}"))
            .to_string()
    };
    // Equivocating owners give each rank other garbage: the honest ranks end apart, which
    // --check reports before the range.
    assert!(line("sharded r=1").ends_with("SPLIT"), "{stdout}");
    assert!(line("sharded r=5").ends_with("exact"), "{stdout}");
    assert!(
        stderr.contains("FAIL: sharded r=1: honest ranks completed with"),
        "{stderr}"
    );
    assert!(!stdout.contains("OK:"), "{stdout}");
}

#[test]
fn check_reports_a_silent_split_and_detect_prevents_it() {
    // Two Byzantine ranks send every peer another vector: gather-mode results differ. Every
    // input is waited for (with stragglers allowed, Detect's move to the common inputs leaves
    // the forged ones out: `sim/tests/data_mode.rs`).
    let args = |agreement: &'static str| {
        [
            "--stragglers",
            "0",
            "--ranks",
            "7",
            "--d",
            "50",
            "--rule",
            "median",
            "--f",
            "2",
            "--mode",
            "gather",
            "--byzantine",
            "2",
            "--equivocate",
            "--agreement",
            agreement,
            "--check",
        ]
    };
    let out = simulate(&args("off"));
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stdout.contains("SPLIT"), "{stdout}");
    assert!(stderr.contains("reported no difference"), "{stderr}");
    // Under detect every honest rank is told (here: all out of step, none silently apart).
    let out = simulate(&args("detect"));
    let (stdout, stderr) = text(&out);
    assert!(!stdout.contains("SPLIT"), "{stdout}");
    assert!(stderr.contains("disagrees"), "{stderr}");
    // Under enforce every honest rank completes with bitwise the same result, which --check
    // requires, inside the honest range.
    let out = simulate(&args("enforce"));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("OK: results match"), "{stdout}");
    let gather = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("gather"))
        .unwrap_or_else(|| panic!("no gather line in\n{stdout}"));
    assert!(gather.ends_with("in honest range"), "{stdout}");
}

#[test]
fn equivocation_toward_one_rank_is_recovered_under_enforce() {
    let args = |toward: &'static str| {
        [
            "--ranks",
            "7",
            "--d",
            "50",
            "--rule",
            "median",
            "--f",
            "2",
            "--mode",
            "gather",
            "--byzantine",
            "2",
            "--equivocate",
            "--equivocate-toward",
            toward,
            "--agreement",
            "enforce",
            "--check",
        ]
    };
    let out = simulate(&args("0"));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("OK: results match"), "{stdout}");
    let out = simulate(&args("7"));
    let (stdout, stderr) = text(&out);
    assert_ne!(out.status.code(), Some(0), "{stdout}");
    assert!(
        stderr.contains("equivocation victim rank 7 does not exist"),
        "{stderr}"
    );
}

#[test]
fn enforce_runs_in_sharded_mode_and_is_refused_where_it_cannot_run() {
    // Sharded mode with equivocating liars: --check requires every honest rank's bits alike.
    let out = simulate(&[
        "--ranks",
        "7",
        "--d",
        "50",
        "--f",
        "2",
        "--mode",
        "sharded",
        "--rule",
        "median",
        "--byzantine",
        "2",
        "--equivocate",
        "--agreement",
        "enforce",
        "--check",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("OK: results match"), "{stdout}");
    assert!(stdout.contains("sharded"), "{stdout}");
    // n <= 3f: the precondition, up front.
    let out = simulate(&[
        "--ranks",
        "6",
        "--f",
        "2",
        "--mode",
        "gather",
        "--rule",
        "median",
        "--agreement",
        "enforce",
    ]);
    let (stdout, stderr) = text(&out);
    assert_ne!(out.status.code(), Some(0), "{stdout}");
    assert!(stderr.contains("n > 3f"), "{stderr}");
}

#[test]
fn predict_prints_the_table() {
    let out = simulate(&[
        "--predict",
        "--preset",
        "infiniband",
        "--ranks",
        "64",
        "--f",
        "3",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[0].contains("infiniband") && lines[0].contains("200 Gb/s"),
        "{stdout}"
    );
    for col in ["network", "n", "bytes", "algorithm", "time", "vs ring"] {
        assert!(lines[1].contains(col), "{}", lines[1]);
    }
    // 1 MiB to 1 GiB by 4: six sizes, four algorithms each.
    assert_eq!(lines.len(), 2 + 6 * 4, "{stdout}");
    for size in ["1 MiB", "4 MiB", "16 MiB", "64 MiB", "256 MiB", "1 GiB"] {
        assert_eq!(
            lines
                .iter()
                .filter(|l| l.contains(&format!(" {size} ")))
                .count(),
            4,
            "{size}\n{stdout}"
        );
    }
    for l in lines.iter().filter(|l| l.contains("ring SUM")) {
        assert!(l.ends_with("1.00x"), "{l}");
    }
    assert!(lines.iter().any(|l| l.contains("sharded r=7")), "{stdout}");
}

#[test]
fn bad_arguments_are_clap_errors() {
    fails(&["--ranks", "8", "--d", "16"], 2, &["--rule"]);
    fails(
        &["--ranks", "8", "--rule", "median", "--loss", "1.5"],
        2,
        &["--loss", "probability"],
    );
    fails(
        &["--ranks", "8", "--rule", "median", "--attack", "nope"],
        2,
        &["signflip"],
    );
    fails(
        &["--ranks", "8", "--rule", "median", "--stall", "3"],
        2,
        &["RANK:MICROSECONDS"],
    );
    fails(&["--ranks", "0", "--rule", "median"], 2, &["--ranks"]);
    fails(
        &["--predict", "--ranks", "64", "--loss", "0.1"],
        2,
        &["--loss", "--predict"],
    );
    fails(
        &["--ranks", "8", "--rule", "median", "--preset", "ethernet"],
        2,
        &["infiniband"],
    );
}

#[test]
fn semantic_errors_exit_1_with_one_line() {
    fails(
        &["--ranks", "6", "--rule", "median", "--f", "3"],
        1,
        &["byzcoll simulate:", "n > 2f", "n = 6, f = 3"],
    );
    fails(
        &["--ranks", "8", "--rule", "average"],
        1,
        &["unknown rule `average`"],
    );
    fails(
        &["--ranks", "8", "--rule", "median", "--crash", "9"],
        1,
        &["crashed rank 9 does not exist"],
    );
    fails(
        &["--predict", "--ranks", "4", "--f", "3"],
        1,
        &["2f+1 = 7", "n = 4"],
    );
}

/// Runs `byzcoll simulate ARGS` in an address space of `limit_mib` MiB (`ulimit -v`), so that
/// an allocation of gigabytes aborts it instead of taking the machine's memory.
fn simulate_within(limit_mib: u64, args: &[&str]) -> (Output, Duration) {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!(
            "ulimit -v {} && exec \"$0\" simulate \"$@\"",
            limit_mib * 1024
        ))
        .arg(byzcoll())
        .args(args);
    run_with_limit(&mut cmd, Duration::from_secs(60))
}

#[test]
fn runs_above_the_memory_bound_are_refused_before_allocating() {
    let cases: &[(&[&str], &[&str])] = &[
        // O(n^2) posted messages: about 171 GiB.
        (
            &["--predict", "--ranks", "20000"],
            &[
                "--ranks 20000 with --predict needs about 171 GiB",
                "above the 4 GiB bound",
                "lower --ranks, or raise --max-memory-gib",
            ],
        ),
        // Every world is checked before the first runs.
        (
            &["--predict", "--ranks", "8,20000", "--bytes", "4096"],
            &["--ranks 20000 with --predict"],
        ),
        // O(r n^3) distance tables of sharded Krum.
        (
            &["--predict", "--ranks", "1000", "--rule", "krum", "--f", "1"],
            &["distance statistics", "coordinate-wise --rule"],
        ),
        // 1 GiB of inputs, held five times over by --mode all at n = 1.
        (
            &["--ranks", "1", "--d", "268435456", "--rule", "median"],
            &[
                "--ranks 1 --d 268435456 --mode all needs about 5.0 GiB",
                "lower --d or --ranks, or run one --mode",
            ],
        ),
        (
            &[
                "--ranks",
                "1",
                "--d",
                "268435456",
                "--rule",
                "median",
                "--mode",
                "gather",
                "--max-memory-gib",
                "2",
            ],
            &["needs about 3.0 GiB", "above the 2 GiB bound", "lower --d"],
        ),
        // 20 equivocators sending each of 63 peers its own 16 MiB vector.
        (
            &[
                "--ranks",
                "64",
                "--d",
                "4194304",
                "--rule",
                "median",
                "--f",
                "20",
                "--byzantine",
                "20",
                "--equivocate",
                "--mode",
                "gather",
            ],
            &["forged per destination", "lower --byzantine"],
        ),
    ];
    for (args, needles) in cases {
        let (out, took) = simulate_within(1024, args);
        let (stdout, stderr) = text(&out);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{args:?} (killed by a signal when None: it allocated)\n{stdout}\n{stderr}"
        );
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stdout.is_empty(), "{args:?}: {stdout}");
        for needle in ["byzcoll simulate:", "of memory"]
            .iter()
            .chain(needles.iter())
        {
            assert!(
                stderr.contains(needle),
                "{args:?}: {needle:?} not in\n{stderr}"
            );
        }
        assert!(took < Duration::from_secs(10), "{args:?} took {took:?}");
    }
    // What fits runs, under the smallest bound too.
    for args in [
        &[
            "--predict",
            "--ranks",
            "8,64",
            "--bytes",
            "4096",
            "--max-memory-gib",
            "1",
        ][..],
        &[
            "--ranks",
            "8",
            "--d",
            "64",
            "--rule",
            "median",
            "--check",
            "--max-memory-gib",
            "1",
        ],
    ] {
        let out = simulate(args);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{args:?}\n{stdout}\n{stderr}");
    }
}

#[test]
fn too_many_faults_fail_clearly() {
    // n = 7, f = 3: one crashed rank leaves 6 inputs, and 6 > 2·3 does not hold.
    let out = simulate(&[
        "--ranks", "7", "--d", "64", "--rule", "median", "--f", "3", "--mode", "gather", "--crash",
        "6", "--check",
    ]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stdout.contains("FAILED"), "{stdout}");
    assert!(
        stderr.contains("FAIL: gather: rank 0: failed: median needs n > 2f but has n = 6, f = 3")
            && stderr.contains("rank 6: missing (nothing by the deadline"),
        "{stderr}"
    );
}

#[test]
fn dtype_sets_the_element_width_in_every_mode() {
    // 6 bytes are three bf16 elements but no whole number of float32.
    let out = simulate(&[
        "--predict",
        "--ranks",
        "4",
        "--bytes",
        "6",
        "--dtype",
        "bf16",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    fails(
        &["--predict", "--ranks", "4", "--bytes", "6"],
        1,
        &["whole number", "F32"],
    );
    // Data mode runs the rule in the narrow type, checked against its gather reference in
    // it, under faults too; f64 is timed only.
    for dtype in ["bf16", "f16"] {
        for faults in [&[][..], &["--byzantine", "2", "--attack", "alie"][..]] {
            let mut args = vec![
                "--ranks",
                "8",
                "--d",
                "1000",
                "--rule",
                "trimmed-mean",
                "--f",
                "2",
                "--mode",
                "all",
                "--check",
                "--dtype",
                dtype,
            ];
            args.extend_from_slice(faults);
            let out = simulate(&args);
            let (stdout, stderr) = text(&out);
            assert!(out.status.success(), "{args:?}\n{stdout}\n{stderr}");
            assert!(
                stdout.contains("OK: results match the gather-mode reference"),
                "{args:?}\n{stdout}"
            );
        }
    }
    fails(
        &["--ranks", "8", "--rule", "median", "--dtype", "f64"],
        1,
        &["--dtype f64", "--predict"],
    );
    fails(
        &["--ranks", "8", "--rule", "median", "--dtype", "f8"],
        2,
        &["--dtype"],
    );
}

#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let mut child = Command::new(byzcoll())
        .args([
            "simulate", "--ranks", "8", "--d", "64", "--rule", "median", "--f", "2", "--check",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The reader goes away before the first line: `| head -0`.
    drop(child.stdout.take());
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(status.signal(), Some(libc::SIGPIPE), "{status:?}\n{stderr}");
}

#[test]
fn audited_mode_convicts_every_liar_in_time_and_refutes_every_framer_over_seeds() {
    // Two owners lying on 8 of 64 sub-chunks where they were not asked the round before, one
    // framer; the odds predict conviction within 3 rounds at 8 samples per audit.
    let args = [
        "--mode",
        "audited",
        "--ranks",
        "8",
        "--d",
        "512",
        "--rule",
        "median",
        "--f",
        "3",
        "--lying-owners",
        "2",
        "--lie-on",
        "unwatched:8",
        "--lie",
        "nan",
        "--framers",
        "1",
        "--audit-samples",
        "8",
        "--rounds",
        "6",
        "--seeds",
        "3",
        "--seed",
        "40",
        "--check",
    ];
    let out = simulate(&args);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
    for needle in [
        "audited rounds: n = 8, d = 512 (shards of 64 elements in 64 sub-chunks), rule median",
        "each rank audits 7 owners, 8 sub-chunks each",
        "2 lying owners (on 8 sub-chunks its auditors did not ask for before, nan), 1 framers",
        "seeds 40 to 42",
        "OK: every liar convicted within its predicted rounds (6 of 6 liars had a prediction \
         within the rounds run)",
    ] {
        assert!(stdout.contains(needle), "{needle:?} not in\n{stdout}");
    }
    let seeds: Vec<&str> = stdout.lines().filter(|l| l.starts_with("seed ")).collect();
    assert_eq!(seeds.len(), 3, "{stdout}");
    for line in seeds {
        for needle in [
            "liar 6 convicted in round",
            "liar 7 convicted in round",
            "predicted by round 3",
            "honest owners convicted: 0",
            "forged proofs refuted: 6, standing: 0",
            "rounds with split verdicts: 0",
        ] {
            assert!(line.contains(needle), "{needle:?} not in {line}");
        }
    }
    // Rounds are printed for one seed only.
    assert!(!stdout.contains("round 1:"), "{stdout}");
    let one = simulate(&args[..args.len() - 5]);
    let (stdout, _) = text(&one);
    assert!(one.status.success(), "{stdout}");
    assert_eq!(stdout.matches("  round ").count(), 6, "{stdout}");
}

#[test]
fn audited_mode_refuses_what_it_does_not_model_in_one_line() {
    let world = [
        "--mode", "audited", "--ranks", "8", "--d", "512", "--rule", "median", "--f", "3",
    ];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        world.iter().chain(extra).copied().collect()
    };
    fails(&with(&["--loss", "0.1"]), 1, &["does not model --loss"]);
    fails(
        &with(&["--agreement", "enforce"]),
        1,
        &["audited rounds run under detect"],
    );
    fails(&with(&["--dtype", "bf16"]), 1, &["carries f32"]);
    fails(
        &with(&["--byzantine", "1"]),
        1,
        &["--lying-owners and --framers"],
    );
    fails(
        &[
            "--mode", "audited", "--ranks", "8", "--d", "500", "--rule", "median", "--f", "3",
        ],
        1,
        &["must be a multiple of 8 and at least 512"],
    );
    fails(
        &with(&["--audit-samples", "65"]),
        1,
        &["more than the 64 sub-chunks"],
    );
    fails(
        &with(&["--audit-owners", "8"]),
        1,
        &["at most the 7 other owners"],
    );
    fails(
        &with(&["--lying-owners", "3", "--framers", "1"]),
        1,
        &["4 Byzantine ranks (liars and framers) but f = 3"],
    );
    fails(
        &with(&["--lying-owners", "9"]),
        1,
        &["more ranks than n = 8"],
    );
    fails(
        &[
            "--mode", "audited", "--ranks", "8", "--d", "512", "--rule", "krum", "--f", "1",
        ],
        1,
        &["coordinate-wise"],
    );
    fails(
        &with(&["--lying-owners", "1", "--lie", "equivocate"]),
        1,
        &["cannot equivocate"],
    );
    fails(
        &with(&["--lying-owners", "1", "--lie-on", "sub-chunks:65"]),
        1,
        &["1 to 64"],
    );
    fails(
        &[
            "--ranks",
            "8",
            "--rule",
            "median",
            "--f",
            "3",
            "--framers",
            "1",
        ],
        1,
        &["--framers applies to --mode audited"],
    );
    fails(
        &with(&["--lie-on", "sometimes"]),
        2,
        &["everywhere, sub-chunks:L, rounds:Q or unwatched:L"],
    );
}
