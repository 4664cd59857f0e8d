//! Every numeric flag of every subcommand at its extremes: never a panic, and clear errors
//! where the value cannot work.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use byzcoll_cli::npy;
use common::{assert_failed, byzcoll, run_with_limit, text};

/// Values every numeric flag is tried with: the edges of the integer types, negative,
/// beyond u128, non-finite floats, and no number at all.
const EXTREMES: &[&str] = &[
    "0",
    "1",
    "18446744073709551615", // u64::MAX
    "18446744073709551612", // u64::MAX rounded down to a multiple of 4
    "9223372036854775808",  // 2^63
    "4611686018427387904",  // 2^62
    "4294967295",           // u32::MAX
    "-1",
    "340282366920938463463374607431768211456", // 2^128
    "1e308",
    "1e999",
    "-inf",
    "nan",
    "x",
    "",
];

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    /// A directory of its own (tests run in parallel, and each removes its own).
    fn new() -> TempDir {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("byzcoll-cli-extremes-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run(args: &[String]) -> Output {
    run_with_limit(
        Command::new(byzcoll()).args(args).env("BYZCOLL_LOG", "off"),
        Duration::from_secs(30),
    )
    .0
}

/// Runs `args` and checks that it did not panic (status 101 or a "panicked" message) and was
/// not killed by a signal (an abort, e.g. on an allocation failure).
fn no_panic(args: &[String]) -> Output {
    let out = run(args);
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.code().is_some_and(|c| c != 101) && !stderr.contains("panicked"),
        "{args:?}: {:?}\n{stdout}\n{stderr}",
        out.status
    );
    out
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// `base` with `--flag=value` for every extreme value (the `=` form, so `-1` is a value).
fn sweep(base: &[&str], flag: &str, tail: &[&str]) -> usize {
    let mut runs = 0;
    for value in EXTREMES {
        let mut args = strings(base);
        args.push(format!("{flag}={value}"));
        args.extend(strings(tail));
        no_panic(&args);
        runs += 1;
    }
    runs
}

fn input(dir: &TempDir) -> String {
    let path = dir.0.join("in.npy");
    let data: Vec<f32> = (0..15).map(|i| (i % 7) as f32).collect();
    npy::write_f32(&path, &[5, 3], &data).expect("write the input");
    path.to_string_lossy().into_owned()
}

#[test]
fn no_numeric_flag_of_any_subcommand_panics() {
    let start = Instant::now();
    let dir = TempDir::new();
    let input = input(&dir);
    let output = dir.0.join("out.npy").to_string_lossy().into_owned();
    let mut runs = 0;

    // launch: -n and --grace-secs (the valid small values run `true`).
    runs += sweep(&["launch", "--grace-secs", "0"], "--ranks", &["--", "true"]);
    runs += sweep(&["launch", "-n", "1"], "--grace-secs", &["--", "true"]);

    // aggregate: --f for every rule, --m, --tau.
    for rule in [
        "mean",
        "median",
        "trimmed-mean",
        "krum",
        "multi-krum",
        "bulyan",
        "geometric-median",
        "nnm+median",
        "nnm+bulyan",
    ] {
        runs += sweep(
            &["aggregate", "--rule", rule, "-o", &output],
            "--f",
            &[&input],
        );
    }
    runs += sweep(
        &[
            "aggregate",
            "--rule",
            "centered-clipping",
            "--tau",
            "1",
            "-o",
            &output,
        ],
        "--f",
        &[&input],
    );
    runs += sweep(
        &["aggregate", "--rule", "multi-krum", "-o", &output],
        "--m",
        &[&input],
    );
    runs += sweep(
        &[
            "aggregate",
            "--rule",
            "multi-krum",
            "--f",
            "1",
            "-o",
            &output,
        ],
        "--m",
        &[&input],
    );
    runs += sweep(
        &["aggregate", "--rule", "centered-clipping", "-o", &output],
        "--tau",
        &[&input],
    );

    // simulate, data mode: a small world unless the flag under test says otherwise.
    let data = ["simulate", "--ranks", "4", "--d", "8", "--rule", "median"];
    for flag in [
        "--f",
        "--replicas",
        "--timeout-ms",
        "--loss",
        "--delay-us",
        "--crash",
        "--stall",
        "--byzantine",
        "--lying-owners",
        "--seed",
        "--alpha-us",
        "--gbps",
        "--agg-throughput",
        "--sum-throughput",
        "--max-memory-gib",
    ] {
        runs += sweep(&data, flag, &[]);
    }
    runs += sweep(
        &[
            "simulate",
            "--ranks",
            "4",
            "--d",
            "8",
            "--rule",
            "median",
            "--f",
            "1",
            "--byzantine",
            "1",
            "--equivocate",
            "--agreement",
            "enforce",
        ],
        "--equivocate-toward",
        &[],
    );
    runs += sweep(
        &["simulate", "--d", "8", "--rule", "median"],
        "--ranks",
        &[],
    );
    runs += sweep(
        &["simulate", "--ranks", "4", "--rule", "median"],
        "--d",
        &[],
    );
    runs += sweep(
        &[
            "simulate",
            "--ranks",
            "4",
            "--d",
            "8",
            "--rule",
            "multi-krum",
        ],
        "--m",
        &[],
    );
    runs += sweep(
        &[
            "simulate",
            "--ranks",
            "4",
            "--d",
            "8",
            "--rule",
            "centered-clipping",
        ],
        "--tau",
        &[],
    );
    // The numbers inside --crash R@STEP and --stall R:US.
    for value in EXTREMES {
        for spec in [
            format!("--crash=1@{value}"),
            format!("--stall=1:{value}"),
            format!("--stall={value}:1"),
        ] {
            let mut args = strings(&data);
            args.push(spec);
            no_panic(&args);
            runs += 1;
        }
    }

    // Rounds mode: the rounds, the quorum, slow ranks and deaths, and the numbers inside
    // --slow-delay DIST and --deaths K@ROUND.
    let gather = [
        "simulate", "--ranks", "4", "--d", "8", "--rule", "median", "--mode", "gather",
    ];
    runs += sweep(&gather, "--rounds", &[]);
    for flag in ["--stragglers", "--grace-ms", "--grace-factor"] {
        runs += sweep(&gather, flag, &["--rounds", "2"]);
    }
    runs += sweep(&gather, "--slow-ranks", &["--slow-delay", "fixed:1us"]);
    runs += sweep(&gather, "--rejoin", &["--deaths", "1@0", "--rounds", "3"]);
    for value in EXTREMES {
        for spec in [
            format!("--slow-delay=fixed:{value}ms"),
            format!("--slow-delay=lognormal:1ms,{value}"),
            format!("--deaths={value}@0"),
            format!("--deaths=1@{value}"),
        ] {
            let mut args = strings(&gather);
            args.push(spec.clone());
            if spec.starts_with("--slow-delay") {
                args.extend(strings(&["--slow-ranks", "1"]));
            }
            no_panic(&args);
            runs += 1;
        }
    }

    // Audited mode, one round: the audits' own flags and the liars.
    let audited = [
        "simulate", "--ranks", "4", "--d", "256", "--rule", "median", "--f", "1", "--mode",
        "audited", "--rounds", "1",
    ];
    for flag in [
        "--framers",
        "--sub-chunks",
        "--audit-samples",
        "--audit-owners",
        "--seeds",
        "--lying-owners",
    ] {
        runs += sweep(&audited, flag, &[]);
    }
    for value in EXTREMES {
        for spec in [
            format!("--lie-on=sub-chunks:{value}"),
            format!("--lie-on=unwatched:{value}"),
            format!("--lie-on=rounds:{value}"),
        ] {
            let mut args = strings(&audited);
            args.extend([spec, "--lying-owners".into(), "1".into()]);
            no_panic(&args);
            runs += 1;
        }
    }

    // simulate --predict.
    let predict = ["simulate", "--predict", "--ranks", "4", "--bytes", "4096"];
    for flag in [
        "--f",
        "--alpha-us",
        "--gbps",
        "--agg-throughput",
        "--sum-throughput",
        "--max-memory-gib",
    ] {
        runs += sweep(&predict, flag, &[]);
    }
    runs += sweep(
        &["simulate", "--predict", "--ranks", "4", "--rule", "median"],
        "--bytes",
        &[],
    );
    runs += sweep(
        &["simulate", "--predict", "--bytes", "4096"],
        "--ranks",
        &[],
    );
    runs += sweep(
        &["simulate", "--predict", "--ranks", "4"],
        "--bytes",
        &["--f", "1"],
    );

    // info has no numeric flag; the numbers it reads come from the environment.
    for value in EXTREMES {
        let out = run_with_limit(
            Command::new(byzcoll())
                .arg("info")
                .env("BYZCOLL_TIMEOUT_MS", value)
                .env("BYZCOLL_RANK", value)
                .env("BYZCOLL_WORLD_SIZE", value),
            Duration::from_secs(30),
        )
        .0;
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "info with {value:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        runs += 1;
    }
    eprintln!("{runs} runs in {:?}", start.elapsed());
}

/// Runs `args`, which must fail with `code` and a stderr holding every needle.
fn fails(args: &[&str], code: i32, needles: &[&str]) {
    assert_failed(&no_panic(&strings(args)), args, code, needles, false);
}

#[test]
fn byzantine_counts_beyond_n_name_f_and_n() {
    let dir = TempDir::new();
    let input = input(&dir);
    let output = dir.0.join("out.npy").to_string_lossy().into_owned();
    for (rule, f) in [
        ("median", "9223372036854775808"),
        ("median", "5"),
        ("trimmed-mean", "9223372036854775808"),
        ("bulyan", "4611686018427387904"),
        ("multi-krum", "9223372036854775808"),
        ("krum", "18446744073709551615"),
        ("nnm+median", "9223372036854775808"),
        ("mean", "18446744073709551615"),
    ] {
        let args = ["aggregate", "--rule", rule, "--f", f, "-o", &output, &input];
        fails(
            &args,
            1,
            &["byzcoll aggregate:", &format!("f = {f}"), "n = 5"],
        );
        let (_, stderr) = text(&run(&strings(&args)));
        assert!(!stderr.contains("n - f = 9223372036854775816"), "{stderr}");
        assert!(!std::path::Path::new(&output).exists(), "{args:?} wrote");
    }
    // Below n but beyond the rule's own precondition: the rule's message, with n and f.
    fails(
        &[
            "aggregate",
            "--rule",
            "bulyan",
            "--f",
            "1",
            "-o",
            &output,
            &input,
        ],
        1,
        &["n >= 4f + 3", "n = 5, f = 1"],
    );
    fails(
        &[
            "simulate",
            "--ranks",
            "8",
            "--d",
            "8",
            "--rule",
            "median",
            "--f",
            "9223372036854775808",
        ],
        1,
        &["byzcoll simulate:", "f = 9223372036854775808", "n = 8"],
    );
    fails(
        &["simulate", "--predict", "--ranks", "8,4", "--f", "4"],
        1,
        &["f = 4", "n = 4"],
    );
}

#[test]
fn sizes_beyond_the_caps_are_refused() {
    fails(
        &["launch", "-n", "1", "--grace-secs", "3601", "--", "true"],
        2,
        &["--grace-secs", "0..=3600"],
    );
    fails(
        &[
            "simulate",
            "--ranks",
            "4",
            "--rule",
            "median",
            "--d",
            "4294967295",
        ],
        2,
        &["--d", "1..=268435456"],
    );
    fails(
        &["simulate", "--ranks", "1000000", "--rule", "median"],
        1,
        &["n = 1000000", "d = 4096", "2^28"],
    );
    fails(
        &[
            "simulate",
            "--predict",
            "--ranks",
            "4",
            "--bytes",
            "18446744073709551612",
        ],
        2,
        &["--bytes", "1..=1099511627776"],
    );
    fails(
        &[
            "simulate",
            "--predict",
            "--ranks",
            "1000000",
            "--bytes",
            "1099511627776",
        ],
        1,
        &["n = 1000000", "2^62"],
    );
    fails(
        &[
            "simulate",
            "--predict",
            "--ranks",
            "4",
            "--max-memory-gib",
            "65537",
        ],
        2,
        &["--max-memory-gib", "1..=65536"],
    );
    // The largest world --ranks takes, with every byte --max-memory-gib allows: still refused
    // by its estimate (which saturates instead of overflowing), never allocated.
    fails(
        &[
            "simulate",
            "--predict",
            "--ranks",
            "1000000",
            "--bytes",
            "4",
            "--max-memory-gib",
            "65536",
        ],
        1,
        &[
            "--ranks 1000000 with --predict",
            "above the 65536 GiB bound",
        ],
    );
}

/// A malformed job secret (a no-break space pasted into 64 digits, a sign before each digit)
/// is refused by `byzcoll info`, which shows no part of it and does not panic.
#[test]
fn info_refuses_a_malformed_secret_without_showing_it() {
    let digits = "3f8a1c9b0d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a";
    let cases = [
        format!("{}\u{a0}{}", &digits[..30], &digits[32..]),
        "+f".repeat(32),
    ];
    for secret in cases {
        let (out, _) = run_with_limit(
            Command::new(byzcoll())
                .arg("info")
                .env("BYZCOLL_LOG", "off")
                .env("BYZCOLL_SECRET", &secret),
            Duration::from_secs(30),
        );
        let (stdout, stderr) = text(&out);
        let all = format!("{stdout}{stderr}");
        assert!(out.status.success(), "{all}");
        assert!(!all.contains("panicked"), "{all}");
        assert!(all.contains("no usable job secret"), "{all}");
        for piece in [&digits[..8], &digits[40..48], "+f+f+f+f"] {
            assert!(
                !all.contains(piece),
                "info shows {piece:?} of the secret: {all}"
            );
        }
    }
}

/// `byzcoll keygen`: its -n at the extremes, the files it writes (private keys and the secret
/// readable by the user alone), an existing directory refused, and `byzcoll info` reading the
/// per-rank variables it prints, refusing another rank's key file.
#[test]
fn keygen_writes_private_keys_that_info_checks() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new();
    let out = dir.0.join("keys").to_string_lossy().into_owned();
    sweep(&["keygen", "--out", &out], "-n", &[]);
    std::fs::remove_dir_all(&out).expect("-n=1 wrote keys");
    fails(&["keygen", "-n", "65537", "--out", &out], 2, &["65537"]);
    let (ok, _) = run_with_limit(
        Command::new(byzcoll()).args(["keygen", "-n", "3", "--out", &out]),
        Duration::from_secs(30),
    );
    assert!(ok.status.success(), "{:?}", text(&ok));
    let mode = |name: &str| {
        let path = PathBuf::from(&out).join(name);
        std::fs::metadata(path).expect(name).permissions().mode() & 0o777
    };
    assert_eq!(mode(""), 0o700);
    assert_eq!(mode("secret"), 0o600);
    assert_eq!(mode("roster"), 0o644);
    for r in 0..3 {
        assert_eq!(mode(&format!("rank-{r}")), 0o600);
    }
    fails(&["keygen", "-n", "3", "--out", &out], 2, &["cannot create"]);
    let info = |rank: &str, key_file: &str| {
        let (o, _) = run_with_limit(
            Command::new(byzcoll())
                .arg("info")
                .env("BYZCOLL_LOG", "off")
                .env("BYZCOLL_RANK", rank)
                .env("BYZCOLL_WORLD_SIZE", "3")
                .env("BYZCOLL_SECRET_FILE", format!("{out}/secret"))
                .env("BYZCOLL_ROSTER_FILE", format!("{out}/roster"))
                .env("BYZCOLL_KEY_FILE", key_file),
            Duration::from_secs(30),
        );
        let (stdout, stderr) = text(&o);
        format!("{stdout}{stderr}")
    };
    let shown = info("1", &format!("{out}/rank-%r"));
    assert!(shown.contains("identity: per-rank"), "{shown}");
    let shown = info("1", &format!("{out}/rank-2"));
    assert!(
        shown.contains("not the one the roster binds to rank 1"),
        "{shown}"
    );
}
