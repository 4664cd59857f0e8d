//! The Rust half of the Python overhead benchmark (`python/bench/overhead.sh` runs both in one
//! go): the timing loop of `python/bench/overhead.py`, call for call. Every rep enters a
//! barrier, times one `robust_all_reduce` (median, f = 1, gather), and takes the slowest rank's
//! time (a MAX all-reduce); rank 0 prints the median over the reps in ms.
//!
//! ```sh
//! cargo build --release --bins --examples
//! target/release/byzcoll launch -n 4 -- target/release/examples/overhead --reps 15
//! ```

#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::Instant;

use byzcoll::aggregators::Median;
use byzcoll::{Policy, ReduceOp};
use clap::Parser;

#[derive(Parser)]
struct Args {
    /// Timed calls per size (after one warm-up): ten times as many at 4 KiB, at most 5 at 64 MiB.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    reps: u32,
}

async fn run(args: Args) -> byzcoll::Result<()> {
    let mut comm = byzcoll::init().await?;
    let me = comm.rank();
    if me == 0 {
        println!(
            "# {} ranks, median f = 1, gather, from Rust\n{:>10} {:>10}",
            comm.size(),
            "bytes",
            "rust ms"
        );
    }
    for bytes in [4096usize, 1 << 20, 64 << 20] {
        let reps = match bytes {
            b if b <= 64 << 10 => args.reps.saturating_mul(10),
            b if b < 64 << 20 => args.reps,
            _ => args.reps.min(5),
        };
        let mut x = vec![me as f32; bytes / 4];
        let mut times = Vec::new();
        for i in 0..=reps {
            comm.barrier().await?;
            let t0 = Instant::now();
            comm.robust_all_reduce(&mut x, &Median::new(1), Policy::Gather)
                .await?;
            let mut t = [t0.elapsed().as_secs_f64()];
            comm.all_reduce(&mut t, ReduceOp::Max).await?;
            if i > 0 {
                times.push(t[0]);
            }
        }
        times.sort_by(f64::total_cmp);
        let median = if times.len() % 2 == 1 {
            times[times.len() / 2]
        } else {
            (times[times.len() / 2 - 1] + times[times.len() / 2]) / 2.0
        };
        if me == 0 {
            println!("{bytes:>10} {:>10.3}", median * 1e3);
        }
    }
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("overhead: {e}");
            ExitCode::FAILURE
        }
    }
}
