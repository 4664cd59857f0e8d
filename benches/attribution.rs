//! Attribution benchmark: what measuring each input against the aggregate
//! (`RoundReport::attribution`, on by default) costs a robust round, against the same round
//! with it off (`Communicator::set_attribution(false)`) in the same run. `n` ranks in this
//! process over TCP on 127.0.0.1, median (f = 1), gather and sharded r = 1, at each `--sizes`
//! (bytes of `f32` per rank); rounds alternate on and off so that drift hits both alike. The
//! ranks' median round time of each is reported, and the ratio on / off.
//!
//! ```sh
//! cargo bench --bench attribution -- --ranks 4 --sizes 1048576,67108864 --rounds 9
//! ```

#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::{Duration, Instant};

use byzcoll::aggregators::Median;
use byzcoll::{init_with, Policy, Replicas};
use clap::Parser;
use serde_json::json;

#[path = "common/rows.rs"]
mod rows;
#[path = "common/world.rs"]
mod world;

#[derive(Parser)]
struct Args {
    /// Ranks (in this process).
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// Bytes per rank (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1048576,67108864")]
    sizes: Vec<usize>,
    /// Rounds with attribution and as many without, per size and policy.
    #[arg(long, default_value_t = 9)]
    rounds: usize,
    /// Ignored (cargo bench passes it).
    #[arg(long, hide = true)]
    bench: bool,
}

/// The ranks' median round time with attribution on and off.
async fn run(n: usize, d: usize, rounds: usize, policy: Policy) -> Result<[Duration; 2], String> {
    let configs = world::tcp_job(n, Duration::from_secs(60))?;
    let tasks: Vec<_> = configs
        .into_iter()
        .enumerate()
        .map(|(rank, config)| {
            let config = config.build();
            tokio::spawn(async move {
                let mut comm = init_with(&config.map_err(|e| e.to_string())?)
                    .await
                    .map_err(|e| e.to_string())?;
                let mut v = vec![0f32; d];
                let mut times = [Vec::new(), Vec::new()];
                // One round to connect, unmeasured; then on and off in turn.
                for round in 0..=2 * rounds {
                    let on = round % 2 == 1;
                    comm.set_attribution(on);
                    v.iter_mut()
                        .enumerate()
                        .for_each(|(i, x)| *x = ((rank * 7919 + i * 31 + round) % 1000) as f32);
                    let start = Instant::now();
                    let report = comm
                        .robust_all_reduce(&mut v, &Median::new(1), policy)
                        .await
                        .map_err(|e| e.to_string())?;
                    let took = start.elapsed();
                    if round > 0 {
                        if report.attribution.is_some() != on {
                            return Err(format!("attribution {on} gave {report:?}"));
                        }
                        times[usize::from(!on)].push(took);
                    }
                }
                Ok::<_, String>(times)
            })
        })
        .collect();
    let mut all = [Vec::new(), Vec::new()];
    for t in tasks {
        let [on, off] = t.await.map_err(|e| e.to_string())??;
        all[0].extend(on);
        all[1].extend(off);
    }
    Ok(all.map(|mut t| {
        t.sort_unstable();
        t[t.len() / 2]
    }))
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.ranks < 3 || args.rounds == 0 || args.sizes.iter().any(|&s| !(4..=1 << 30).contains(&s))
    {
        eprintln!("--ranks must be at least 3 (median with f = 1), --rounds at least 1, --sizes within 4 B..1 GiB");
        return ExitCode::FAILURE;
    }
    let rt = match world::runtime() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let mut table = rows::Rows::new(
        "attribution",
        json!({ "ranks": args.ranks, "rounds": args.rounds, "rule": "median f=1", "transport": "tcp" }),
    );
    println!(
        "# {} ranks over TCP, median f = 1, {} rounds each; ranks' median round time",
        args.ranks, args.rounds
    );
    println!("bytes/rank  policy       attribution on   off            on / off");
    for &bytes in &args.sizes {
        for (label, policy) in [
            ("gather", Policy::Gather),
            ("sharded r=1", Policy::Sharded(Replicas::Exactly(1))),
        ] {
            let [on, off] = match rt.block_on(run(args.ranks, bytes / 4, args.rounds, policy)) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("{bytes} B, {label}: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let ratio = on.as_secs_f64() / off.as_secs_f64();
            println!(
                "{bytes:<11} {label:<12} {:>12.3} ms {:>10.3} ms {ratio:>10.3}",
                on.as_secs_f64() * 1e3,
                off.as_secs_f64() * 1e3
            );
            table.push(json!({
                "bytes": bytes, "policy": label, "on_ms": on.as_secs_f64() * 1e3,
                "off_ms": off.as_secs_f64() * 1e3, "ratio": ratio,
            }));
        }
    }
    table.write();
    ExitCode::SUCCESS
}
