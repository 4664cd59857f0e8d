//! Collective benchmark over TCP on 127.0.0.1, printed in nccl-tests columns, side by side with
//! Open MPI (mpi4py + numpy) in the same run when those are installed.
//!
//! ```sh
//! cargo bench --bench collectives                       # 4 ranks, d = 2^16 .. 2^24 float32
//! cargo bench --bench collectives -- --ranks 4 --min-exp 16 --max-exp 24 --no-anchor
//! ```
//!
//! Without `BYZCOLL_RANK` in its environment the binary is the launcher: it starts `--ranks`
//! copies of itself through `byzcoll::launch`, then the MPI anchor. Each rep is timed as the
//! slowest rank's time (an all-reduce MAX of the per-rank times) after a barrier; the table
//! shows the median of the reps.
//!
//! Columns: `size` is bytes per rank (`all_gather`: bytes gathered per rank, as nccl-tests
//! prints it). `algbw = size / time`. `busbw` is nccl-tests' bus bandwidth: `algbw * 2(n-1)/n`
//! for `all_reduce`, `algbw * (n-1)/n` for `all_gather`, and for gather-mode
//! gather-mode `robust_all_reduce` `algbw * (n-1)` and sharded mode `algbw * 2r(n-1)/n`, the
//! bytes each rank actually receives. `rss(MiB)` is the largest peak resident set of any rank
//! while the collective ran (input buffers included).

#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::{Duration, Instant};

use byzcoll::aggregators::Median;
use byzcoll::launch::{launch, LaunchOptions};
use byzcoll::{Communicator, Policy, ReduceOp, Replicas};

struct Args {
    ranks: usize,
    min_exp: u32,
    max_exp: u32,
    anchor: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        ranks: 4,
        min_exp: 16,
        max_exp: 24,
        anchor: true,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let value = |i: usize| -> Result<u64, String> {
            argv.get(i + 1)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("{} needs a number", argv[i]))
        };
        match argv[i].as_str() {
            "--ranks" => args.ranks = value(i)? as usize,
            "--min-exp" => args.min_exp = value(i)? as u32,
            "--max-exp" => args.max_exp = value(i)? as u32,
            "--no-anchor" => {
                args.anchor = false;
                i += 1;
                continue;
            }
            // cargo bench passes --bench; anything else is a mistake.
            "--bench" => {
                i += 1;
                continue;
            }
            other => return Err(format!("unknown argument {other}")),
        }
        i += 2;
    }
    if args.ranks < 2 || args.min_exp > args.max_exp || args.max_exp > 28 {
        return Err("need --ranks >= 2 and --min-exp <= --max-exp <= 28".into());
    }
    Ok(args)
}

fn reps_for(bytes: usize) -> usize {
    (((64usize << 20) / bytes.max(1)).clamp(3, 20)) | 1
}

/// Times `op` over `reps` reps as the slowest rank's time, and measures the largest peak RSS
/// of any rank while it ran (Linux: the high-water mark is reset through
/// `/proc/self/clear_refs` first). Returns (median seconds, peak RSS in MiB).
async fn time_op<F>(comm: &mut Communicator, reps: usize, mut op: F) -> (f64, f64)
where
    F: AsyncFnMut(&mut Communicator),
{
    // Hand freed heap back to the OS first, or the reset high-water mark would include what
    // earlier collectives left in the allocator.
    // SAFETY: malloc_trim only releases free memory; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    op(comm).await; // warm-up
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        comm.barrier().await.expect("barrier");
        let t = Instant::now();
        op(comm).await;
        let mut slowest = [t.elapsed().as_secs_f64()];
        comm.all_reduce(&mut slowest, ReduceOp::Max)
            .await
            .expect("max");
        times.push(slowest[0]);
    }
    let mut rss = [peak_rss_mib()];
    comm.all_reduce(&mut rss, ReduceOp::Max).await.expect("max");
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], rss[0])
}

/// This process's peak resident set (VmHWM) in MiB, or NaN where /proc is unavailable.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kib| kib / 1024.0)
}

/// Prints one table row; rank 0 also appends `elements-per-rank seconds label` to the results
/// file the launcher named, for the ratio table.
fn row(
    size: usize,
    count: usize,
    redop: &str,
    (seconds, rss): (f64, f64),
    bus_factor: f64,
    label: &str,
) {
    let algbw = size as f64 / seconds / 1e9;
    if let Some(path) = std::env::var_os("BYZCOLL_BENCH_RESULTS") {
        use std::io::Write;
        let per_rank = if label == "all_gather" {
            size / 4 / ranks()
        } else {
            count
        };
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
        {
            let _ = writeln!(f, "{per_rank} {seconds} {rss} {label}");
        }
    }
    println!(
        "{size:>12} {count:>10} {:>6} {redop:>7} {:>12.1} {algbw:>8.3} {:>8.3} {rss:>9.1}   {label}",
        "float",
        seconds * 1e6,
        algbw * bus_factor
    );
}

fn ranks() -> usize {
    std::env::var("BYZCOLL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

async fn worker(args: &Args) -> Result<(), String> {
    let mut comm = byzcoll::init().await.map_err(|e| e.to_string())?;
    let (me, n) = (comm.rank(), comm.size());
    let nf = n as f64;
    let f = (n - 1) / 2;
    let median = Median::new(f);
    if me == 0 {
        println!(
            "# byzcoll over {} on 127.0.0.1, {n} ranks, median f = {f}",
            comm.transport().name()
        );
        println!(
            "{:>12} {:>10} {:>6} {:>7} {:>12} {:>8} {:>8} {:>9}   collective",
            "size", "count", "type", "redop", "time(us)", "algbw", "busbw", "rss(MiB)"
        );
    }
    for exp in (args.min_exp..=args.max_exp).step_by(2) {
        let d = 1usize << exp;
        let bytes = d * 4;
        let reps = reps_for(bytes);
        let input: Vec<f32> = (0..d).map(|j| (me * 7 + j % 13) as f32).collect();

        let t = time_op(&mut comm, reps, async |c: &mut Communicator| {
            let mut v = input.clone();
            c.all_reduce(&mut v, ReduceOp::Sum)
                .await
                .expect("all_reduce");
        })
        .await;
        if me == 0 {
            row(bytes, d, "sum", t, 2.0 * (nf - 1.0) / nf, "all_reduce");
        }

        let mut gathered = vec![0.0f32; n * d];
        let t = time_op(&mut comm, reps, async |c: &mut Communicator| {
            c.all_gather_into(&input, &mut gathered)
                .await
                .expect("all_gather");
        })
        .await;
        if me == 0 {
            row(bytes * n, d * n, "none", t, (nf - 1.0) / nf, "all_gather");
        }
        drop(gathered);

        for (policy, label, received) in [
            (
                Policy::Gather,
                "robust_all_reduce gather".to_string(),
                nf - 1.0,
            ),
            (
                Policy::Sharded(Replicas::Exactly(1)),
                "robust_all_reduce sharded r=1".to_string(),
                2.0 * (nf - 1.0) / nf,
            ),
            (
                Policy::Sharded(Replicas::Tolerant),
                format!("robust_all_reduce sharded r={}", 2 * f + 1),
                2.0 * (2 * f + 1) as f64 * (nf - 1.0) / nf,
            ),
        ] {
            let t = time_op(&mut comm, reps, async |c: &mut Communicator| {
                let mut v = input.clone();
                c.robust_all_reduce(&mut v, &median, policy)
                    .await
                    .expect("robust_all_reduce");
            })
            .await;
            if me == 0 {
                row(bytes, d, "median", t, received, &label);
            }
        }
    }
    Ok(())
}

/// Runs the MPI anchor and returns its rows as (elements per rank, seconds, label).
fn run_anchor(args: &Args) -> Vec<(usize, f64, String)> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/benches/anchors/mpi_collectives.py"
    );
    let output = std::process::Command::new("mpirun")
        .args([
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
            "-n",
            &args.ranks.to_string(),
            "python3",
            script,
            "--min-exp",
            &args.min_exp.to_string(),
            "--max-exp",
            &args.max_exp.to_string(),
        ])
        .stderr(std::process::Stdio::inherit())
        .output();
    let output = match output {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        Ok(o) => {
            println!(
                "# MPI anchor failed ({}); is mpi4py installed? pip install mpi4py numpy",
                o.status
            );
            return Vec::new();
        }
        Err(e) => {
            println!("# MPI anchor not run: mpirun unavailable ({e}); apt-get install openmpi-bin");
            return Vec::new();
        }
    };
    print!("{output}");
    output
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let t: Vec<&str> = l.split_whitespace().collect();
            let count: usize = t.get(1)?.parse().ok()?;
            let micros: f64 = t.get(4)?.parse().ok()?;
            let label = t.get(8..)?.join(" ");
            let per_rank = if label == "MPI Allgather" {
                count / args.ranks
            } else {
                count
            };
            Some((per_rank, micros / 1e6, label))
        })
        .collect()
}

fn print_ratios(ours: &[(usize, f64, String)], anchor: &[(usize, f64, String)]) {
    let pairs = [
        ("all_reduce", "MPI Allreduce"),
        ("all_gather", "MPI Allgather"),
        ("robust_all_reduce gather", "MPI Allgather + numpy.median"),
        (
            "robust_all_reduce sharded r=1",
            "MPI Allgather + numpy.median",
        ),
        ("robust_all_reduce sharded r=1", "MPI Allreduce"),
    ];
    let find = |rows: &[(usize, f64, String)], d: usize, label: &str| {
        rows.iter()
            .find(|(e, _, l)| *e == d && l == label)
            .map(|r| r.1)
    };
    let mut sizes: Vec<usize> = ours.iter().map(|r| r.0).collect();
    sizes.dedup();
    println!();
    println!("# time ratio byzcoll / Open MPI, same run (< 1: byzcoll faster)");
    println!(
        "{:>12} {:>12} {:>12} {:>18} {:>18} {:>18}",
        "bytes/rank",
        "all_reduce",
        "all_gather",
        "gather-median",
        "sharded1-median",
        "sharded1-median"
    );
    println!(
        "{:>12} {:>12} {:>12} {:>18} {:>18} {:>18}",
        "", "/Allreduce", "/Allgather", "/Allgather+median", "/Allgather+median", "/Allreduce SUM"
    );
    for d in sizes {
        let cells: Vec<String> = pairs
            .iter()
            .map(|(a, b)| match (find(ours, d, a), find(anchor, d, b)) {
                (Some(x), Some(y)) => format!("{:.2}", x / y),
                _ => "-".into(),
            })
            .collect();
        println!(
            "{:>12} {:>12} {:>12} {:>18} {:>18} {:>18}",
            d * 4,
            cells[0],
            cells[1],
            cells[2],
            cells[3],
            cells[4]
        );
    }
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("collectives bench: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    if std::env::var_os("BYZCOLL_RANK").is_some() {
        return match runtime.block_on(worker(&args)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("collectives bench: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let results = std::env::temp_dir().join(format!("byzcoll-bench-{}.txt", std::process::id()));
    let _ = std::fs::remove_file(&results);
    let exe = std::env::current_exe().expect("current exe");
    let mut command = vec![exe.into_os_string()];
    command.extend(std::env::args_os().skip(1));
    let outcome = runtime.block_on(launch(LaunchOptions {
        ranks: args.ranks,
        command,
        grace: Duration::from_secs(5),
        env: vec![
            ("BYZCOLL_TIMEOUT_MS".into(), "120000".into()),
            (
                "BYZCOLL_BENCH_RESULTS".into(),
                results.to_string_lossy().into_owned(),
            ),
        ],
    }));
    match outcome {
        Ok(o) if o.exit_code == 0 => {}
        Ok(o) => return ExitCode::from(o.exit_code.clamp(1, 255) as u8),
        Err(e) => {
            eprintln!("collectives bench: {e}");
            return ExitCode::FAILURE;
        }
    }
    let ours: Vec<(usize, f64, String)> = std::fs::read_to_string(&results)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut it = l.splitn(4, ' ');
            let d = it.next()?.parse().ok()?;
            let secs = it.next()?.parse().ok()?;
            let _rss = it.next()?;
            Some((d, secs, it.next()?.to_string()))
        })
        .collect();
    let _ = std::fs::remove_file(&results);
    if args.anchor {
        let anchor = run_anchor(&args);
        if !anchor.is_empty() {
            print_ratios(&ours, &anchor);
        }
    }
    ExitCode::SUCCESS
}
