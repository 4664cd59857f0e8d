//! Setup benchmark: the time from nothing to a connected TCP world of `n` ranks, median of
//! `--reps` worlds, for each `--ranks`:
//! - in this process: rendezvous store, identity keys, every pair's authenticated handshake;
//! - `--processes`: `byzcoll launch` of `n` copies of this binary (given the hidden
//!   `--launched-rank`), each `byzcoll::init()`, one barrier, exit (what a job pays before its
//!   first collective, process start included).
//!
//! Per-rank keys (the default of `byzcoll launch`), the shared secret alone and (in one process)
//! no authentication (the explicit opt-out) alternate, and each is printed with its ratio to
//! the shared secret; `--unauthenticated` runs only the latter.
//!
//! ```sh
//! cargo bench --bench setup -- --ranks 4,8 --reps 15
//! cargo bench --bench setup -- --ranks 4,8 --reps 15 --processes
//! ```

#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::{Duration, Instant};

use std::sync::Arc;

use byzcoll::bootstrap::{keygen, Credentials, JobAuth, JobSecret, StoreClient, StoreServer};
use byzcoll::transports::tcp::{TcpOptions, TcpTransport};
use serde_json::json;

#[path = "common/rows.rs"]
mod rows;

/// How a world's ranks prove who they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    PerRank,
    SharedSecret,
    Unauthenticated,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::PerRank => "per-rank",
            Mode::SharedSecret => "shared-secret",
            Mode::Unauthenticated => "unauthenticated",
        }
    }

    /// The store's authentication and each rank's; per-rank keys are made here, inside the
    /// timed setup.
    fn auths(self, n: usize) -> Result<(JobAuth, Vec<JobAuth>), String> {
        let e = |e: byzcoll::BootstrapError| e.to_string();
        Ok(match self {
            Mode::Unauthenticated => (JobAuth::Unauthenticated, vec![JobAuth::Unauthenticated; n]),
            Mode::SharedSecret => {
                let auth = JobAuth::Secret(JobSecret::generate().map_err(e)?);
                (auth.clone(), vec![auth; n])
            }
            Mode::PerRank => {
                let secret = JobSecret::generate().map_err(e)?;
                let (ids, roster) = keygen(n).map_err(e)?;
                let roster = Arc::new(roster);
                let ranks = ids
                    .into_iter()
                    .enumerate()
                    .map(|(r, id)| {
                        Credentials::rank(secret.clone(), roster.clone(), r, id)
                            .map(JobAuth::PerRank)
                            .map_err(e)
                    })
                    .collect::<Result<_, _>>()?;
                (JobAuth::PerRank(Credentials::host(secret, roster)), ranks)
            }
        })
    }
}

async fn one_world(n: usize, mode: Mode) -> Result<Duration, String> {
    let start = Instant::now();
    let (host, auths) = mode.auths(n)?;
    let server = StoreServer::bind("127.0.0.1:0", n, host)
        .await
        .map_err(|e| e.to_string())?;
    let addr = server.local_addr().to_string();
    let ranks: Vec<_> = auths
        .into_iter()
        .enumerate()
        .map(|(r, auth)| {
            let store = StoreClient::new(addr.clone(), r, n, Duration::from_secs(30), auth);
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
fn one_launch(n: usize, mode: Mode) -> Result<Duration, String> {
    use byzcoll_cli::launch::{launch, LaunchIdentity, LaunchOptions};
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
            command: vec![exe.into_os_string(), "--launched-rank".into()],
            grace: Duration::from_secs(5),
            env: Vec::new(),
            identity: match mode {
                Mode::PerRank => LaunchIdentity::PerRank,
                _ => LaunchIdentity::SharedSecret,
            },
            restarts: 0,
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
    /// Set by `--processes` on its ranks' command lines, never by hand: this process is one of
    /// the launched ranks (join the world, one barrier, exit). A process is a rank iff it is
    /// given this flag.
    #[arg(long, hide = true)]
    launched_rank: bool,
}

fn main() -> ExitCode {
    let Args {
        ranks,
        reps,
        processes,
        unauthenticated,
        launched_rank,
        ..
    } = <Args as clap::Parser>::parse();
    if launched_rank {
        return rank_main();
    }
    // The modes alternate, so all see the same machine; `byzcoll launch` always hands out a
    // secret.
    let modes: Vec<Mode> = if processes {
        vec![Mode::PerRank, Mode::SharedSecret]
    } else if unauthenticated {
        vec![Mode::Unauthenticated]
    } else {
        vec![Mode::PerRank, Mode::SharedSecret, Mode::Unauthenticated]
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
            for (&mode, times) in modes.iter().zip(&mut times) {
                let one = if processes {
                    one_launch(n, mode)
                } else {
                    rt.block_on(one_world(n, mode))
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
        for (&mode, times) in modes.iter().zip(&mut times) {
            times.sort_by(f64::total_cmp);
            let median = times[times.len() / 2];
            medians.push((mode, median));
            let mode = mode.name();
            let (min, max) = (times[0], times[times.len() - 1]);
            println!(
                "ranks {n:>3}  {mode:<15}  median {median:>8.2}  min {min:>8.2}  max {max:>8.2}"
            );
            table.push(
                json!({ "ranks": n, "mode": mode, "median_ms": median, "min_ms": min,
                "max_ms": max }),
            );
        }
        if let Some(&(_, shared)) = medians.iter().find(|(m, _)| *m == Mode::SharedSecret) {
            for &(mode, t) in medians.iter().filter(|(m, _)| *m != Mode::SharedSecret) {
                println!(
                    "ranks {n:>3}  {} / shared-secret = {:.2}",
                    mode.name(),
                    t / shared
                );
            }
        }
    }
    table.write();
    ExitCode::SUCCESS
}
