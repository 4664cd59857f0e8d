//! Repeated robust rounds, one line per round on every rank: rank `r` contributes `r + 1` in
//! every coordinate, the rule is the median with `f = 1`, and each line says what the rank got
//! (`ok <value>` with the ranks it erased and those the cross-check could not confirm, or the
//! error). With `ROUNDS_OP=reduce-scatter` each round is a `robust_reduce_scatter` (2f + 1
//! owners per shard) and the value is the first of the rank's own shard. `cli/tests/agreement.rs`
//! stops one rank with SIGSTOP in the middle to check that no rank presents another result as
//! success.
//!
//! ```sh
//! cargo build --release --bins --examples
//! ROUNDS=20 BYZCOLL_TIMEOUT_MS=1000 target/release/byzcoll launch -n 4 -- target/release/examples/rounds
//! ```

#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::{Duration, Instant};

use byzcoll::aggregators::Median;
use byzcoll::{Policy, Replicas};

#[tokio::main]
async fn main() -> ExitCode {
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&r| r <= 10_000)
        .unwrap_or(10);
    let mut comm = match byzcoll::init().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rounds: {e}");
            return ExitCode::FAILURE;
        }
    };
    let me = comm.rank();
    let scatter = match std::env::var("ROUNDS_OP").as_deref() {
        Err(_) | Ok("all-reduce") => false,
        Ok("reduce-scatter") => true,
        Ok(other) => {
            eprintln!("rounds: ROUNDS_OP={other:?}: expected all-reduce or reduce-scatter");
            return ExitCode::FAILURE;
        }
    };
    let n = comm.size();
    for k in 0..rounds {
        let mut v = vec![(me + 1) as f32; 16];
        let start = Instant::now();
        let result = if scatter {
            let mut shard = vec![0.0f32; byzcoll::schedule::chunk_range(16, n, me).len()];
            let input = v.clone();
            let r = comm
                .robust_reduce_scatter(&input, &mut shard, &Median::new(1), Replicas::Tolerant)
                .await;
            v = shard;
            r
        } else {
            comm.robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
                .await
        };
        let took = start.elapsed().as_millis();
        let line = match result {
            Ok(report) => {
                // The inputs the round went without: its faults, and under `Detect` the inputs
                // it left out to end with the others' result (`realigned`; its own is said
                // apart).
                let me = comm.rank();
                let agreement = report.agreement.unwrap_or_default();
                let mut erased: Vec<usize> = report.faults.iter().map(|f| f.rank).collect();
                erased.extend(agreement.realigned.iter().filter(|&&r| r != me));
                erased.sort_unstable();
                erased.dedup();
                let unconfirmed = agreement.unconfirmed;
                let own = if report.erased_self {
                    " (own input left out)"
                } else {
                    ""
                };
                format!(
                    "round {k}: ok {} erased {erased:?} unconfirmed {unconfirmed:?}{own} in {took} ms",
                    v[0]
                )
            }
            Err(e) => format!("round {k}: error {e} in {took} ms"),
        };
        println!("{line}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A rank that fell behind may not have read this rank's last inputs yet: close, which
    // writes them out and waits for the others to close too (bounded), before exiting.
    comm.close().await;
    ExitCode::SUCCESS
}
