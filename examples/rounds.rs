//! Repeated robust rounds, one line per round on every rank: rank `r` contributes `r + 1` in
//! every coordinate, the rule is the median with `f = 1`, and each line says what the rank got
//! (`ok <value>` with the ranks it erased and those the cross-check could not confirm, or the
//! error); `--rounds N` of them (10 unless given). With `--op reduce-scatter` each round is a
//! `robust_reduce_scatter` (2f + 1
//! owners per shard) and the value is the first of the rank's own shard. `cli/tests/agreement.rs`
//! stops one rank with SIGSTOP in the middle to check that no rank presents another result as
//! success.
//!
//! ```sh
//! cargo build --release --bins --examples
//! BYZCOLL_TIMEOUT_MS=1000 target/release/byzcoll launch -n 4 -- target/release/examples/rounds --rounds 20
//! ```

#![allow(clippy::print_stdout)]

#[path = "common/flags.rs"]
mod flags;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use byzcoll::aggregators::Median;
use byzcoll::{Policy, Replicas};

#[tokio::main]
async fn main() -> ExitCode {
    let flags = flags::Flags::parse(&["rounds", "op"]);
    let rounds = flags.and_then(|f| {
        let rounds = f.number("rounds", 10, 0, 10_000)?;
        match f.word("op") {
            None | Some("all-reduce") => Ok((rounds, false)),
            Some("reduce-scatter") => Ok((rounds, true)),
            Some(other) => Err(format!(
                "--op {other:?}: expected all-reduce or reduce-scatter"
            )),
        }
    });
    let (rounds, scatter) = match rounds {
        Ok(r) => r,
        Err(e) => {
            eprintln!("rounds: {e}");
            return ExitCode::from(2);
        }
    };
    let mut comm = match byzcoll::init().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rounds: {e}");
            return ExitCode::FAILURE;
        }
    };
    let me = comm.rank();
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
