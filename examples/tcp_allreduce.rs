//! The quickstart's scenario as separate processes over TCP, bootstrapped from the launcher's
//! environment (`byzcoll launch`, mpirun, srun or torchrun):
//!
//! ```sh
//! cargo build --release --examples --bins
//! target/release/byzcoll launch -n 4 -- target/release/examples/tcp_allreduce
//! ```
//!
//! The highest `--byzantine K` ranks attack (default: up to 2, keeping n > 2K): the last one
//! sends NaN/inf, the others a sign-flipped vector scaled by 1000. Every honest rank checks
//! `all_reduce` (SUM), `all_gather` and the robust median and trimmed mean in gather and
//! sharded mode, and exits non-zero on any mismatch. It runs over whichever transport
//! `BYZCOLL_TRANSPORT` selects (TCP by default).

#![allow(clippy::print_stdout)]

use std::process::ExitCode;

use byzcoll::aggregators::{Median, TrimmedMean};
use byzcoll::{Fault, Policy, ReduceOp, Replicas, Stragglers};

mod common;
use common::{honest, in_honest_range};

/// The command line.
#[derive(clap::Parser)]
struct Args {
    /// Elements per vector.
    #[arg(long, default_value_t = 4096, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1 << 28))]
    d: usize,
    /// How many of the highest ranks attack (default: up to 2, keeping n > 2K).
    #[arg(long)]
    byzantine: Option<usize>,
}

async fn run(args: Args) -> Result<(), String> {
    let d = args.d;
    let mut comm = byzcoll::init().await.map_err(|e| e.to_string())?;
    let (me, n) = (comm.rank(), comm.size());
    let k = args.byzantine.unwrap_or(2.min((n - 1) / 2));
    if n <= 2 * k {
        return Err(format!(
            "{k} Byzantine ranks need more than {} ranks",
            2 * k
        ));
    }
    let byzantine = me >= n - k;
    let all: Vec<Vec<f32>> = (0..n).map(|r| honest(r, d)).collect();

    // Non-robust collectives first, all ranks honest.
    let mut sum = honest(me, d);
    comm.all_reduce(&mut sum, ReduceOp::Sum)
        .await
        .map_err(|e| e.to_string())?;
    let want: Vec<f32> = (0..d).map(|j| all.iter().map(|x| x[j]).sum()).collect();
    let worst = sum
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    if worst > 1e-4 * n as f32 {
        return Err(format!("all_reduce SUM is off by {worst}"));
    }
    let mut gathered = vec![0.0f32; n * d];
    comm.all_gather_into(&honest(me, d), &mut gathered)
        .await
        .map_err(|e| e.to_string())?;
    if gathered != all.concat() {
        return Err("all_gather returned the wrong data".into());
    }

    let mine = if !byzantine {
        honest(me, d)
    } else if me == n - 1 {
        (0..d)
            .map(|j| [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][j % 3])
            .collect()
    } else {
        honest(me, d).iter().map(|x| -1000.0 * x).collect()
    };
    for (name, rule) in [
        (
            "median",
            Box::new(Median::new(k)) as Box<dyn byzcoll::aggregators::Aggregator>,
        ),
        ("trimmed-mean", Box::new(TrimmedMean::new(k))),
    ] {
        let mut v = mine.clone();
        let report = comm
            .robust_all_reduce(&mut v, rule.as_ref(), Policy::Gather)
            .await
            .map_err(|e| format!("{name}: {e}"))?;
        // Sharded mode (2f + 1 owners per shard) must give bitwise the gather-mode result
        // where gather mode had every input. It runs here with every input waited for
        // (`s = 0`, a job-wide setting every rank changes alike): with stragglers allowed it
        // may go without a piece late at one of its owners, which the report of a rank that
        // does not own that shard cannot show.
        let mut w = mine.clone();
        let stragglers = comm.config().stragglers;
        comm.set_stragglers(Stragglers::Exactly(0));
        let sharded = comm
            .robust_all_reduce(&mut w, rule.as_ref(), Policy::Sharded(Replicas::Tolerant))
            .await;
        comm.set_stragglers(stragglers);
        sharded.map_err(|e| format!("{name} sharded: {e}"))?;
        if byzantine {
            continue;
        }
        in_honest_range(name, &v, &all[..n - k])?;
        // Gather mode may go on without a late input (stragglers are allowed by default):
        // the results are comparable where nothing was late.
        let late = report.erased_self
            || report.faults.iter().any(|f| f.fault == Fault::Late)
            || report
                .agreement
                .as_ref()
                .is_some_and(|a| !a.realigned.is_empty());
        if late {
            println!("{name:<13} rank {me}: gather mode went without a late input; not compared with sharded mode");
            continue;
        }
        if w != v {
            return Err(format!("{name}: sharded mode differs from gather mode"));
        }
        if me == 0 {
            println!(
                "{name:<13} n = {n}, f = {k}: inside the honest range; {} inputs, non-finite from ranks {:?}; sharded (r = {}) == gather",
                report.inputs,
                report.non_finite,
                2 * k + 1
            );
        }
    }
    comm.barrier().await.map_err(|e| e.to_string())?;
    if me == 0 {
        println!(
            "OK: {n} ranks over {}, d = {d}, identity: {}",
            comm.transport().name(),
            comm.identity()
        );
    }
    // What the last calls left in flight reaches every peer before this process exits.
    comm.close().await;
    Ok(())
}

// One collective at a time: on a current-thread runtime the frames are read on the thread that
// awaits them (the README's "Which runtime").
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    // byzcoll's warnings (refused connections, an unauthenticated job) on stderr; BYZCOLL_LOG
    // (e.g. `info`, `byzcoll=debug`) for more.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BYZCOLL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = <Args as clap::Parser>::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tcp_allreduce: {e}");
            ExitCode::FAILURE
        }
    }
}
