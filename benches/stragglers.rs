//! Stragglers benchmark: how much one slow or malicious rank slows the honest ranks' robust
//! rounds, with every input waited for (`s = 0`) and with quorum rounds (`s = auto`), against
//! the all-healthy round in the same run. `n` ranks in this process over TCP on 127.0.0.1,
//! median (f = 1) in gather mode or `--policy sharded` (3 owners per shard), `--agreement
//! enforce` (the default: honest ranks stay bitwise
//! alike by the echo) or `detect` (the cross-check, realignment and, with `s > 0`, the
//! confirmation step),
//! `--d` elements per rank, `--rounds` rounds per scenario; the honest ranks' median round time
//! is reported, and its ratio to the healthy one.
//!
//! Scenarios (the last rank is the straggler):
//! - `healthy`: every rank calls at once;
//! - `slow10x`: the straggler sleeps 9 healthy rounds before each call (10x slower);
//! - `insider90`: the straggler sends each input at 90 % of the step deadline (the slow-down
//!   attack: without quorum rounds every round lasts most of the deadline).
//!
//! ```sh
//! cargo bench --bench stragglers -- --ranks 8 --d 65536 --rounds 20 --timeout-ms 200
//! ```
//!
//! Each row also counts the honest ranks' rounds that failed (`errors`).

#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::{Duration, Instant};

use byzcoll::aggregators::Median;
use byzcoll::{init_with, Agreement, Fault, Policy, Replicas, Stragglers};
use clap::Parser;
use serde_json::json;

#[path = "common/rows.rs"]
mod rows;
#[path = "common/world.rs"]
mod world;

#[derive(Parser)]
struct Args {
    /// Ranks (in this process).
    #[arg(long, default_value_t = 8)]
    ranks: usize,
    /// Elements per rank.
    #[arg(long, default_value_t = 65536)]
    d: usize,
    /// Rounds per scenario.
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// Step deadline in milliseconds.
    #[arg(long, default_value_t = 200)]
    timeout_ms: u64,
    /// The agreement: `enforce` or `detect` (`off` is refused: nothing would say whether
    /// the honest ranks ended alike).
    #[arg(long, default_value = "enforce", value_parser = parse_agreement)]
    agreement: Agreement,
    /// The schedule: `gather` or `sharded` (`2f + 1` owners per shard; stragglers there
    /// need `--agreement detect`).
    #[arg(long, default_value = "gather", value_parser = parse_policy)]
    policy: Policy,
    /// Ignored (cargo bench passes it).
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Clone, Copy, Debug)]
enum Scenario {
    Healthy,
    Slow10x,
    Insider90,
}

/// What one scenario gave: the honest ranks' median round time, and how many of their
/// rounds named the straggler late.
struct Outcome {
    median: Duration,
    late_rounds: usize,
    errors: usize,
    rounds: usize,
}

fn parse_policy(s: &str) -> Result<Policy, String> {
    match s {
        "gather" => Ok(Policy::Gather),
        "sharded" => Ok(Policy::Sharded(Replicas::Tolerant)),
        other => Err(format!("{other:?}: expected gather or sharded")),
    }
}

fn parse_agreement(s: &str) -> Result<Agreement, String> {
    match Agreement::parse(s)? {
        Agreement::Off => Err("--agreement off: the bench compares agreed rounds".to_string()),
        a => Ok(a),
    }
}

async fn run(
    args: &Args,
    scenario: Scenario,
    stragglers: Stragglers,
    healthy: Duration,
) -> Result<Outcome, String> {
    let n = args.ranks;
    let timeout = Duration::from_millis(args.timeout_ms);
    let (d, rounds, agreement, policy) = (args.d, args.rounds, args.agreement, args.policy);
    let tasks: Vec<_> = world::tcp_job(n, timeout)?
        .into_iter()
        .enumerate()
        .map(|(rank, config)| {
            let config = config.agreement(agreement).build();
            tokio::spawn(async move {
                let mut comm = init_with(&config.map_err(|e| e.to_string())?)
                    .await
                    .map_err(|e| e.to_string())?;
                comm.set_stragglers(stragglers);
                let straggler = rank == n - 1;
                let mut times = Vec::with_capacity(rounds);
                let (mut late, mut errors) = (0, 0);
                let mut v = vec![0f32; d];
                for round in 0..rounds {
                    if straggler {
                        match scenario {
                            Scenario::Healthy => {}
                            Scenario::Slow10x => tokio::time::sleep(healthy * 9).await,
                            Scenario::Insider90 => tokio::time::sleep(timeout * 9 / 10).await,
                        }
                    }
                    v.iter_mut()
                        .enumerate()
                        .for_each(|(i, x)| *x = (rank * 7 + i + round) as f32);
                    let start = Instant::now();
                    let report = comm
                        .robust_all_reduce(&mut v, &Median::new(1), policy)
                        .await;
                    times.push(start.elapsed());
                    match report {
                        // Round 0 is not counted (see below), late or not.
                        Ok(r) => {
                            late += usize::from(
                                round > 0 && r.faults.iter().any(|f| f.fault == Fault::Late),
                            )
                        }
                        Err(_) => errors += usize::from(round > 0),
                    }
                }
                // Stay up a while for the others' last steps (the straggler's later rounds
                // then find its peers gone and fail fast: they are not measured).
                tokio::time::sleep(timeout * 2).await;
                drop(comm);
                Ok::<_, String>((times, late, errors))
            })
        })
        .collect();
    let mut honest = Vec::new();
    let (mut late_rounds, mut failed) = (0, 0);
    for (rank, t) in tasks.into_iter().enumerate() {
        let (times, late, errors) = t.await.map_err(|e| e.to_string())??;
        if rank != n - 1 {
            // The first round of each rank includes connecting the world's last peers (and
            // waits for every rank under Detect: a first collective is no quorum step there).
            honest.extend(times.into_iter().skip(1));
            late_rounds += late;
            failed += errors;
        }
    }
    honest.sort_unstable();
    Ok(Outcome {
        median: honest[honest.len() / 2],
        late_rounds,
        errors: failed,
        rounds: (n - 1) * (rounds - 1),
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.ranks < 4 || args.rounds < 2 {
        eprintln!("--ranks must be at least 4 (median with f = 1 under Enforce) and --rounds 2");
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
        "stragglers",
        json!({ "ranks": args.ranks, "d": args.d, "rounds": args.rounds,
                "timeout_ms": args.timeout_ms, "rule": "median f=1",
                "agreement": args.agreement.name(),
                "policy": format!("{:?}", args.policy) }),
    );
    println!(
        "# {} ranks, d = {}, {} rounds, step deadline {} ms, {:?}, agreement {}; honest ranks' \
         median round time (the first round of each rank not counted)",
        args.ranks,
        args.d,
        args.rounds,
        args.timeout_ms,
        args.policy,
        args.agreement.name()
    );
    println!("scenario    s     round      x healthy  late rounds  errors");
    for (label, stragglers) in [("0", Stragglers::Exactly(0)), ("auto", Stragglers::Auto)] {
        let healthy = match rt.block_on(run(&args, Scenario::Healthy, stragglers, Duration::ZERO)) {
            Ok(o) => o.median,
            Err(e) => {
                eprintln!("healthy, s = {label}: {e}");
                return ExitCode::FAILURE;
            }
        };
        for scenario in [Scenario::Healthy, Scenario::Slow10x, Scenario::Insider90] {
            let o = match rt.block_on(run(&args, scenario, stragglers, healthy)) {
                Ok(o) => o,
                Err(e) => {
                    eprintln!("{scenario:?}, s = {label}: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let ratio = o.median.as_secs_f64() / healthy.as_secs_f64();
            println!(
                "{:<11} {label:<5} {:>9.3} ms {ratio:>9.2}  {:>5}/{:<5}  {}",
                format!("{scenario:?}"),
                o.median.as_secs_f64() * 1e3,
                o.late_rounds,
                o.rounds,
                o.errors
            );
            table.push(json!({
                "scenario": format!("{scenario:?}"), "stragglers": label,
                "median_ms": o.median.as_secs_f64() * 1e3, "ratio_to_healthy": ratio,
                "late_rounds": o.late_rounds, "honest_rounds": o.rounds, "errors": o.errors,
            }));
        }
    }
    table.write();
    ExitCode::SUCCESS
}
