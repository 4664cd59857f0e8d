//! Aggregation-rule benchmark: byzcoll's CPU rules on `n` float32 vectors of length `d`, side by
//! side with numpy/scipy in the same run.
//!
//! ```sh
//! cargo bench --bench aggregators                # n = 4,8,16,32,64, d = 2^22, 1 and all threads
//! cargo bench --bench aggregators -- --n 4,16 --exp 22 --rules median,trimmed-mean,krum \
//!     --threads 1,all --no-anchor
//! ```
//!
//! Options: `--n` the input counts (default `4,8,16,32,64`); `--exp` the vector length
//! `d = 2^exp` (default 22); `--rules` the rules to time (default
//! `mean,median,trimmed-mean,krum,multi-krum`; `mean` is always timed, it is the floor the other
//! rules are compared with); `--threads` the rayon pool sizes, integers or `all` for rayon's
//! default pool (default `1,all`); `--dtypes` the element types (`f32`, `f16`, `bf16`; default
//! `f32`): the same inputs rounded to each, timed after the `f32` rows, their rule shown as
//! `median:bf16` with `vs-mean` still over the `f32` mean, so a row's `vs-mean` over the `f32`
//! row's is its time per element over `f32`'s; `--no-anchor` skips numpy. Bad arguments print clap's message
//! and exit with status 2; `--help` lists the options.
//!
//! For each `n` the inputs are built once (a common N(0, 1) vector plus 0.1 * N(0, 1) noise per
//! input, fixed seed) and dropped before the next `n`; `n = 64, d = 2^22` takes 1 GiB. Each rule
//! is built with `byzcoll::aggregators::build(name, &Params { f, .. })`: `f = (n - 1) / 2` for
//! `median` and `trimmed-mean`, the largest `f` with `n > 2f + 2` for `krum` and `multi-krum`,
//! and for other names the largest `f <= (n - 1) / 2` the rule's own precondition accepts. A rule
//! this build does not know is reported once as `not available`; a rule whose precondition fails
//! for an `n` is reported as `skip`. Timing: one warm-up call, then reps until at least 3 reps
//! and 1 s (at most 20); the median rep is shown.
//!
//! Before the byzcoll part, `benches/anchors/numpy_aggregators.py` runs the same rules with
//! numpy/scipy (single-threaded; same shape and distribution of data, not bitwise the same):
//! `numpy.mean(x, axis=0)`, `numpy.median(x, axis=0)`, `scipy.stats.trim_mean(x, f / n, axis=0)`,
//! and a numpy Krum / Multi-Krum (difference-form pairwise distances, float64 sums).
//!
//! Columns (lines starting with `#` are headers and notes; every other line is one row):
//! - `n`: number of input vectors; `rule`: the rule name; `f`: Byzantine inputs tolerated.
//! - `threads`: the rayon pool size, or `numpy` for the anchor's row (one thread).
//! - `time(ms)`: median time of one aggregation of `n` vectors of length `d` into one.
//! - `GB/s`: input bytes read per second, `n * d * 4 / time / 1e9`.
//! - `vs-numpy`: speed-up over numpy/scipy, `numpy time / byzcoll time` (> 1: byzcoll faster);
//!   `-` without an anchor figure for the same `n`, rule and `f`.
//! - `vs-mean`: `time / time of byzcoll's mean at the same thread count`, i.e. how many times
//!   the memory-bound floor the rule costs.

#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use byzcoll::aggregators::{aggregate_into, build, AggError, Aggregator, Element, Params};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use serde_json::json;

#[path = "common/rows.rs"]
mod rows;

const SEED: u64 = 0x5EED;
const DEFAULT_NS: &[usize] = &[4, 8, 16, 32, 64];
const DEFAULT_RULES: &[&str] = &["mean", "median", "trimmed-mean", "krum", "multi-krum"];
const MIN_REPS: usize = 3;
const MAX_REPS: usize = 20;
const MIN_TIME: Duration = Duration::from_secs(1);
/// Elements generated per RNG stream; fixed, so the data does not depend on the thread count.
const GEN_BLOCK: usize = 1 << 16;

#[derive(clap::Parser)]
#[command(about = "byzcoll's CPU rules against numpy/scipy (see the file's docs)")]
struct Args {
    /// Input counts, comma-separated, each in 1..=65536.
    #[arg(long = "n", value_delimiter = ',', default_values_t = DEFAULT_NS.to_vec(),
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=65536))]
    ns: Vec<usize>,
    /// The vector length is d = 2^exp.
    #[arg(long, default_value_t = 22, value_parser = clap::value_parser!(u32).range(0..=30))]
    exp: u32,
    /// Rules to time (mean is always timed: it is the floor the others are compared with).
    #[arg(long, value_delimiter = ',', default_values_t = DEFAULT_RULES.iter().map(|s| s.to_string()).collect::<Vec<_>>())]
    rules: Vec<String>,
    /// rayon pool sizes: integers >= 1, or `all` for rayon's default pool (`None` here).
    #[arg(long, value_delimiter = ',', default_value = "1,all", value_parser = parse_threads)]
    threads: Vec<Option<usize>>,
    /// Element types: f32, f16, bf16.
    #[arg(long, value_delimiter = ',', default_value = "f32", value_parser = ["f32", "f16", "bf16"])]
    dtypes: Vec<String>,
    /// Skip the numpy/scipy anchor.
    #[arg(long = "no-anchor", action = clap::ArgAction::SetFalse)]
    anchor: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn parse_threads(s: &str) -> Result<Option<usize>, String> {
    match s.trim() {
        "all" => Ok(None),
        t => t
            .parse()
            .ok()
            .filter(|&t| t >= 1)
            .map(Some)
            .ok_or_else(|| format!("`{t}`: expected a thread count >= 1 or `all`")),
    }
}

fn parse_args() -> Result<Args, String> {
    let args: Args = rows::parse_cli()?;
    let d = 1usize << args.exp;
    if let Some(n) = args.ns.iter().find(|n| n.checked_mul(d * 4).is_none()) {
        return Err(format!("n = {n} vectors of 2^{} floats overflow", args.exp));
    }
    Ok(args)
}

/// `f` for `name` at `n` inputs (see the module docs).
fn byzantine_count(name: &str, n: usize) -> usize {
    match name {
        "median" | "trimmed-mean" | "trimmed_mean" => (n - 1) / 2,
        "krum" | "multi-krum" | "multi_krum" => n.saturating_sub(3) / 2,
        _ => {
            let accepts = |f: usize| {
                build(
                    name,
                    &Params {
                        f,
                        ..Params::default()
                    },
                )
                .is_ok_and(|r| r.check(n).is_ok())
            };
            (0..=(n - 1) / 2).rev().find(|&f| accepts(f)).unwrap_or(0)
        }
    }
}

/// Fills `out` with standard normal values (Box-Muller).
fn fill_normal(rng: &mut StdRng, out: &mut [f32]) {
    for pair in out.chunks_mut(2) {
        let u1: f32 = 1.0 - rng.gen::<f32>(); // (0, 1]
        let u2: f32 = rng.gen();
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
        pair[0] = r * c;
        if let Some(v) = pair.get_mut(1) {
            *v = r * s;
        }
    }
}

/// `n` inputs of length `d`, row-major: a common N(0, 1) vector plus 0.1 * N(0, 1) noise.
fn make_inputs(n: usize, d: usize) -> Result<Vec<f32>, String> {
    let seed = |stream: usize, block: usize| {
        SEED ^ ((stream as u64) << 48) ^ (block as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    };
    let mut common = vec![0.0f32; d];
    common
        .par_chunks_mut(GEN_BLOCK)
        .enumerate()
        .for_each(|(b, chunk)| fill_normal(&mut StdRng::seed_from_u64(seed(0, b)), chunk));
    let mut data: Vec<f32> = Vec::new();
    data.try_reserve_exact(n * d).map_err(|_| {
        format!(
            "cannot allocate {:.2} GiB of inputs for n = {n}, d = {d}",
            (n * d * 4) as f64 / (1u64 << 30) as f64
        )
    })?;
    data.resize(n * d, 0.0);
    data.par_chunks_mut(d).enumerate().for_each(|(i, row)| {
        row.par_chunks_mut(GEN_BLOCK)
            .zip(common.par_chunks(GEN_BLOCK))
            .enumerate()
            .for_each(|(b, (chunk, c))| {
                fill_normal(&mut StdRng::seed_from_u64(seed(i + 1, b)), chunk);
                for (v, c) in chunk.iter_mut().zip(c) {
                    *v = c + 0.1 * *v;
                }
            });
    });
    Ok(data)
}

/// Warm-up, then at least `MIN_REPS` reps and `MIN_TIME` (at most `MAX_REPS`); the median rep
/// in seconds.
fn time_rule<T: Element>(
    rule: &dyn Aggregator,
    rows: &[&[T]],
    out: &mut [T],
) -> Result<f64, AggError> {
    aggregate_into(rule, rows, out)?;
    let mut times = Vec::with_capacity(MAX_REPS);
    let start = Instant::now();
    while times.len() < MAX_REPS && (times.len() < MIN_REPS || start.elapsed() < MIN_TIME) {
        let t = Instant::now();
        let report = aggregate_into(rule, rows, std::hint::black_box(&mut *out))?;
        times.push(t.elapsed().as_secs_f64());
        std::hint::black_box(report);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// [`time_rule`] on `rows` rounded to `T`.
fn time_narrow<T: Element>(
    rule: &dyn Aggregator,
    rows: &[&[f32]],
    d: usize,
) -> Result<f64, AggError> {
    let narrow: Vec<Vec<T>> = rows
        .iter()
        .map(|r| r.iter().map(|&x| T::from_f64(f64::from(x))).collect())
        .collect();
    let narrow: Vec<&[T]> = narrow.iter().map(Vec::as_slice).collect();
    let mut out = vec![T::from_f64(0.0); d];
    time_rule(rule, &narrow, &mut out)
}

/// Anchor results: (n, rule) -> (f, seconds).
type AnchorResults = HashMap<(usize, String), (usize, f64)>;

fn parse_result(line: &str) -> Option<((usize, String), (usize, f64))> {
    let mut fields: HashMap<&str, &str> = HashMap::new();
    for kv in line.strip_prefix("RESULT ")?.split_whitespace() {
        let (k, v) = kv.split_once('=')?;
        fields.insert(k, v);
    }
    let n = fields.get("n")?.parse().ok()?;
    let f = fields.get("f")?.parse().ok()?;
    let seconds: f64 = fields.get("seconds")?.parse().ok()?;
    let rule = fields.get("rule")?.to_string();
    (seconds > 0.0).then_some(((n, rule), (f, seconds)))
}

/// Runs the numpy/scipy anchor, echoing its notes; returns its results (empty on failure).
fn run_anchor(args: &Args, rules: &[String]) -> AnchorResults {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/benches/anchors/numpy_aggregators.py"
    );
    let ns: Vec<String> = args.ns.iter().map(|n| n.to_string()).collect();
    println!("# numpy anchor: python3 benches/anchors/numpy_aggregators.py (runs first)");
    let child = Command::new("python3")
        .arg(script)
        .args(["--n", &ns.join(","), "--exp", &args.exp.to_string()])
        .args(["--rules", &rules.join(",")])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            println!(
                "# numpy anchor not run: python3 unavailable ({e}); install python3, then \
                 pip install numpy scipy"
            );
            return AnchorResults::new();
        }
    };
    let mut results = AnchorResults::new();
    if let Some(stdout) = child.stdout.take() {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            match parse_result(&line) {
                Some((key, value)) => {
                    results.insert(key, value);
                }
                None if line.starts_with('#') => println!("{line}"),
                None => println!("# anchor: {line}"),
            }
        }
    }
    match child.wait() {
        Ok(status) if status.success() => {}
        Ok(status) => println!("# numpy anchor failed ({status}); pip install numpy scipy"),
        Err(e) => println!("# numpy anchor failed ({e})"),
    }
    if results.is_empty() {
        println!("# no numpy results: ratios vs numpy are shown as -");
    }
    results
}

struct Pool {
    threads: usize,
    /// `None`: rayon's default pool.
    pool: Option<rayon::ThreadPool>,
}

fn make_pools(threads: &[Option<usize>]) -> Result<Vec<Pool>, String> {
    let mut pools: Vec<Pool> = Vec::new();
    for t in threads {
        let count = t.unwrap_or_else(rayon::current_num_threads);
        if pools.iter().any(|p| p.threads == count) {
            continue;
        }
        let pool = match t {
            None => None,
            Some(k) => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(*k)
                    .build()
                    .map_err(|e| format!("cannot start a pool of {k} threads: {e}"))?,
            ),
        };
        pools.push(Pool {
            threads: count,
            pool,
        });
    }
    Ok(pools)
}

fn header() {
    println!(
        "# {:>4} {:<17} {:>4} {:>7} {:>11} {:>8} {:>8} {:>8}",
        "n", "rule", "f", "threads", "time(ms)", "GB/s", "vs-numpy", "vs-mean"
    );
}

fn row(
    table: &mut rows::Rows,
    (n, rule, f): (usize, &str, usize),
    threads: &str,
    seconds: f64,
    gb: f64,
    cells: [String; 2],
) {
    table.push(
        json!({ "n": n, "rule": rule, "f": f, "threads": threads, "seconds": seconds,
        "gb_per_s": gb / seconds }),
    );
    println!(
        "  {n:>4} {rule:<17} {f:>4} {threads:>7} {:>11.3} {:>8.2} {:>8} {:>8}",
        seconds * 1e3,
        gb / seconds,
        cells[0],
        cells[1]
    );
}

fn run(args: &Args) -> Result<(), String> {
    let pools = make_pools(&args.threads)?;
    // mean first: it is the floor for the vs-mean column.
    let mut rules: Vec<String> = vec!["mean".into()];
    rules.extend(args.rules.iter().filter(|r| *r != "mean").cloned());
    let anchor = if args.anchor {
        run_anchor(args, &rules)
    } else {
        AnchorResults::new()
    };
    let d = 1usize << args.exp;
    let threads: Vec<String> = pools.iter().map(|p| p.threads.to_string()).collect();
    println!(
        "# byzcoll aggregators, d = 2^{} = {d} float32 per input, threads {}, rayon default {}",
        args.exp,
        threads.join(","),
        rayon::current_num_threads()
    );
    let mut available = Vec::new();
    for name in &rules {
        match build(name, &Params::default()) {
            Ok(_) => available.push(name.clone()),
            Err(e) => println!("# {name}: not available in this build ({e})"),
        }
    }
    header();
    let mut table = rows::Rows::new("aggregators", json!({ "d": d, "dtype": "float32" }));
    let bar = rows::progress(
        Some((args.ns.len() * rules.len() * pools.len()) as u64),
        "aggregators",
    );
    for &n in &args.ns {
        let bytes = (n * d * 4) as f64;
        let data = make_inputs(n, d)?;
        let rows: Vec<&[f32]> = data.chunks_exact(d).collect();
        let mut out = vec![0.0f32; d];
        let mut mean_time: Vec<Option<f64>> = vec![None; pools.len()];
        for name in &rules {
            let numpy = anchor.get(&(n, name.clone()));
            if available.contains(name) {
                let f = byzantine_count(name, n);
                let built = build(
                    name,
                    &Params {
                        f,
                        ..Params::default()
                    },
                )
                .and_then(|r| r.check(n).map(|()| r));
                let rule = match built {
                    Ok(r) => r,
                    Err(e) => {
                        println!("# {n:>4} {name:<17} skip: {e}");
                        continue;
                    }
                };
                let f = rule.byzantine();
                for (p, pool) in pools.iter().enumerate() {
                    bar.set_message(format!("n = {n}, {name}, {} thread(s)", pool.threads));
                    bar.inc(1);
                    let timed = match &pool.pool {
                        Some(tp) => tp.install(|| time_rule(rule.as_ref(), &rows, &mut out)),
                        None => time_rule(rule.as_ref(), &rows, &mut out),
                    };
                    let seconds = match timed {
                        Ok(s) => s,
                        Err(e) => {
                            println!("# {n:>4} {name:<17} {} threads: error: {e}", pool.threads);
                            continue;
                        }
                    };
                    if name == "mean" {
                        mean_time[p] = Some(seconds);
                    }
                    let vs_numpy = match numpy {
                        Some(&(nf, ns)) if nf == f => format!("{:.2}", ns / seconds),
                        _ => "-".into(),
                    };
                    let vs_mean = match mean_time[p] {
                        Some(m) => format!("{:.2}", seconds / m),
                        None => "-".into(),
                    };
                    let t = pool.threads.to_string();
                    let what = (n, name.as_str(), f);
                    let cells = [vs_numpy, vs_mean];
                    row(&mut table, what, &t, seconds, bytes / 1e9, cells);
                }
                for dtype in args.dtypes.iter().filter(|t| *t != "f32") {
                    let label = format!("{name}:{dtype}");
                    for (p, pool) in pools.iter().enumerate() {
                        let timed = |rule: &dyn Aggregator| match dtype.as_str() {
                            "f16" => time_narrow::<half::f16>(rule, &rows, d),
                            _ => time_narrow::<half::bf16>(rule, &rows, d),
                        };
                        let timed = match &pool.pool {
                            Some(tp) => tp.install(|| timed(rule.as_ref())),
                            None => timed(rule.as_ref()),
                        };
                        let seconds = match timed {
                            Ok(s) => s,
                            Err(e) => {
                                println!(
                                    "# {n:>4} {label:<17} {} threads: error: {e}",
                                    pool.threads
                                );
                                continue;
                            }
                        };
                        let vs_mean = match mean_time[p] {
                            Some(m) => format!("{:.2}", seconds / m),
                            None => "-".into(),
                        };
                        let t = pool.threads.to_string();
                        let cells = ["-".into(), vs_mean];
                        row(&mut table, (n, &label, f), &t, seconds, bytes / 2e9, cells);
                    }
                }
            }
            if let Some(&(f, seconds)) = numpy {
                row(
                    &mut table,
                    (n, name, f),
                    "numpy",
                    seconds,
                    bytes / 1e9,
                    ["-".into(), "-".into()],
                );
            }
        }
        drop(rows);
        drop(data);
    }
    bar.finish_and_clear();
    table.write();
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("aggregators bench: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("aggregators bench: {e}");
            ExitCode::FAILURE
        }
    }
}
