//! Setup benchmark: the time from nothing to a connected TCP world of `n` ranks, median of
//! `--reps` worlds, for each `--ranks`:
//! - in this process: rendezvous store, identity keys, every pair's authenticated handshake;
//! - `--processes`: `byzcoll launch` of `n` copies of this binary, each `byzcoll::init()`,
//!   one barrier, exit (what a job pays before its first collective, process start included).
//!
//! In one process, authenticated and unauthenticated (the explicit opt-out) worlds alternate and
//! both are printed with their ratio; `--unauthenticated` runs only the latter.
//!
//! ```sh
//! cargo bench --bench setup -- --ranks 4,8 --reps 15
//! cargo bench --bench setup -- --ranks 4,8 --reps 15 --processes
//! ```

#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::{Duration, Instant};

use byzcoll::bootstrap::{JobAuth, JobSecret, StoreClient, StoreServer};
use byzcoll::transports::tcp::{TcpOptions, TcpTransport};
use serde_json::json;

#[path = "common/rows.rs"]
mod rows;

async fn one_world(n: usize, auth: &JobAuth) -> Result<Duration, String> {
    let start = Instant::now();
    let server = StoreServer::bind("127.0.0.1:0", n, auth.clone())
        .await
        .map_err(|e| e.to_string())?;
    let addr = server.local_addr().to_string();
    let ranks: Vec<_> = (0..n)
        .map(|r| {
            let store = StoreClient::new(addr.clone(), r, n, Duration::from_secs(30), auth.clone());
            tokio::spawn(async move {
                TcpTransport::from_store(&store, r, n, None, TcpOptions::default()).await
            })
        })
        .collect();
    let mut world = Vec::with_capacity(n);
    for r in ranks {
        world.push(
            r.await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?,
        );
    }
    let took = start.elapsed();
    drop(world);
    Ok(took)
}

/// One launched rank: join the world, one barrier.
fn rank_main() -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("setup bench rank: {e}");
            return ExitCode::FAILURE;
        }
    };
    let joined = rt.block_on(async {
        let mut comm = byzcoll::init().await?;
        comm.barrier().await
    });
    match joined {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("setup bench rank: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `byzcoll launch` of `n` ranks of this binary, timed to the last rank's exit.
fn one_launch(n: usize) -> Result<Duration, String> {
    use byzcoll_cli::launch::{launch, LaunchOptions};
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // Ranks are spawned from the thread running the launch (see `byzcoll_cli::launch`).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let outcome = rt
        .block_on(launch(LaunchOptions {
            ranks: n,
            command: vec![exe.into_os_string()],
            grace: Duration::from_secs(5),
            env: Vec::new(),
        }))
        .map_err(|e| e.to_string())?;
    if outcome.exit_code != 0 {
        return Err(format!("the job exited with {}", outcome.exit_code));
    }
    Ok(start.elapsed())
}

/// The command line (bad values are refused with clap's message and status 2).
#[derive(clap::Parser)]
struct Args {
    /// World sizes, comma-separated, each in 1..=256.
    #[arg(long, value_delimiter = ',', default_value = "4,8",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
    ranks: Vec<usize>,
    /// Worlds per size and mode.
    #[arg(long, default_value_t = 15,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1000))]
    reps: usize,
    /// Time `byzcoll launch` of processes instead of worlds in this process.
    #[arg(long)]
    processes: bool,
    /// Only unauthenticated worlds (in this process).
    #[arg(long)]
    unauthenticated: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> ExitCode {
    if std::env::var_os("BYZCOLL_RANK").is_some() {
        return rank_main();
    }
    let Args {
        ranks,
        reps,
        processes,
        unauthenticated,
        ..
    } = <Args as clap::Parser>::parse();
    let secret = match JobSecret::generate() {
        Ok(s) => JobAuth::Secret(s),
        Err(e) => {
            eprintln!("setup bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    // In one process, authenticated and unauthenticated worlds alternate, so both see the same
    // machine; as processes, `byzcoll launch` always hands out a secret.
    let modes: Vec<JobAuth> = if processes {
        vec![secret]
    } else if unauthenticated {
        vec![JobAuth::Unauthenticated]
    } else {
        vec![secret, JobAuth::Unauthenticated]
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("setup bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "# TCP world setup{} ({reps} worlds each, modes alternating; median, min, max in ms)",
        if processes {
            " as processes (launch, init, barrier, exit)"
        } else {
            " in one process"
        },
    );
    let mut table = rows::Rows::new("setup", json!({ "reps": reps, "processes": processes }));
    for n in ranks {
        let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(reps); modes.len()];
        for _ in 0..reps {
            for (auth, times) in modes.iter().zip(&mut times) {
                let one = if processes {
                    one_launch(n)
                } else {
                    rt.block_on(one_world(n, auth))
                };
                match one {
                    Ok(t) => times.push(t.as_secs_f64() * 1e3),
                    Err(e) => {
                        eprintln!("setup bench: {n} ranks: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
        }
        let mut medians = Vec::new();
        for (auth, times) in modes.iter().zip(&mut times) {
            times.sort_by(f64::total_cmp);
            let median = times[times.len() / 2];
            medians.push(median);
            let mode = if auth.is_authenticated() {
                "authenticated"
            } else {
                "unauthenticated"
            };
            let (min, max) = (times[0], times[times.len() - 1]);
            println!(
                "ranks {n:>3}  {mode:<15}  median {median:>8.2}  min {min:>8.2}  max {max:>8.2}"
            );
            table.push(
                json!({ "ranks": n, "mode": mode, "median_ms": median, "min_ms": min,
                "max_ms": max }),
            );
        }
        if let [a, u] = medians[..] {
            println!(
                "ranks {n:>3}  authenticated / unauthenticated = {:.2}",
                a / u
            );
        }
    }
    table.write();
    ExitCode::SUCCESS
}
