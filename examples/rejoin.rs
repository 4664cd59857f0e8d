//! A rank dies and comes back. Every rank runs `--rounds` robust rounds (median, `f = 1`) of a
//! vector holding its job rank + 1, `--round-ms` apart; rank `--victim` (default the last) exits
//! with status 3 at round `--kill-at` in its first life. Every `--every` rounds the live ranks reach
//! a boundary: they shrink (the dead leave) and admit whoever knocked (`byzcoll::admit`), and
//! tell the ranks they admitted the round to resume at (a broadcast from the first member: the
//! application's state is the application's to hand over). After the last round they wait up
//! to `--final-wait-ms` for missing ranks to knock, so that a rank restarted late still finishes
//! with them. Under `byzcoll launch --restarts 1` the launcher starts the dead rank again with
//! `BYZCOLL_REJOIN=1`, and its `byzcoll::init_with` knocks and rejoins at the next boundary.
//!
//! Each rank prints one line per round and one per membership event (`cli/tests/rejoin.rs`
//! reads them):
//!
//! ```text
//! round 7: ok 2 [world 0 1 2] erased [3]
//! boundary 10: kept [0, 1, 2]
//! boundary 10: admitted [3] at epoch 1
//! rejoined at round 10 as rank 3 of 4 (epoch 1)
//! done: 30 rounds, world [0, 1, 2, 3]
//! ```
//!
//! ```sh
//! cargo build --release --bins --examples
//! target/release/byzcoll launch -n 4 --restarts 1 -- target/release/examples/rejoin
//! ```

#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::Duration;

use byzcoll::aggregators::Median;
use byzcoll::{Admission, Communicator, JobConfig, Policy};

#[path = "common/flags.rs"]
mod flags;

/// The example's settings, from its flags.
struct Settings {
    rounds: u64,
    every: u64,
    victim: u64,
    kill_at: u64,
    pause: Duration,
    final_wait: Duration,
}

impl Settings {
    fn parse(job: u64) -> Result<Self, String> {
        let f = flags::Flags::parse(&[
            "rounds",
            "every",
            "victim",
            "kill-at",
            "round-ms",
            "final-wait-ms",
        ])?;
        let last = job.saturating_sub(1);
        Ok(Settings {
            rounds: f.number("rounds", 30, 0, 10_000)?,
            every: f.number("every", 5, 1, 10_000)?,
            victim: f.number("victim", last, 0, last)?,
            kill_at: f.number("kill-at", 7, 0, 10_000)?,
            pause: Duration::from_millis(f.number("round-ms", 50, 0, 10_000)?),
            final_wait: Duration::from_millis(f.number("final-wait-ms", 10_000, 0, 600_000)?),
        })
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rejoin: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> byzcoll::Result<()> {
    let config = JobConfig::from_env()?;
    let job = config.launch().size as u64;
    let Settings {
        rounds,
        every,
        victim,
        kill_at,
        pause,
        final_wait,
    } = Settings::parse(job).map_err(byzcoll::Error::InvalidUsage)?;
    let me = config.launch().rank as u64;

    let mut comm = byzcoll::init_with(&config).await?;
    let mut round = 0u64;
    // The boundary this rank was admitted at is behind it: it resumes with that round's work.
    let mut admitted_at = None;
    if config.rejoins() {
        let mut at = [0u64];
        comm.broadcast_into(0, &mut at).await?;
        round = at[0];
        admitted_at = Some(round);
        println!(
            "rejoined at round {round} as rank {} of {} (epoch {})",
            comm.rank(),
            comm.size(),
            comm.epoch()
        );
    }
    loop {
        let at_boundary = round.is_multiple_of(every) || round == rounds;
        if round > 0 && at_boundary && admitted_at != Some(round) {
            let wait = if round == rounds {
                final_wait
            } else {
                Duration::ZERO
            };
            comm = boundary(comm, &config, round, job, wait).await?;
        }
        if round == rounds {
            break;
        }
        if me == victim && round == kill_at && !config.rejoins() {
            println!("round {round}: exiting (status 3)");
            std::process::exit(3);
        }
        let mut v = vec![(me + 1) as f32; 16];
        let line = match comm
            .robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
            .await
        {
            Ok(report) => {
                let world: Vec<String> = comm.job_ranks().iter().map(|r| r.to_string()).collect();
                let erased: Vec<usize> = report
                    .faults
                    .iter()
                    .map(|pf| comm.job_ranks()[pf.rank])
                    .collect();
                format!("ok {} [world {}] erased {erased:?}", v[0], world.join(" "))
            }
            Err(e) => format!("error: {e}"),
        };
        println!("round {round}: {line}");
        round += 1;
        tokio::time::sleep(pause).await;
    }
    println!("done: {rounds} rounds, world {:?}", comm.job_ranks());
    comm.close().await;
    Ok(())
}

/// The members' boundary at `round`: shrink to the live ranks, admit whoever knocked and
/// hand them the round; while the world lacks ranks of the job, try again every 100 ms for
/// about `wait` (a count of tries, the same on every member: each is a collective, so the
/// members must not decide by their own clocks when to stop).
async fn boundary(
    mut comm: Communicator,
    config: &JobConfig,
    round: u64,
    job: u64,
    wait: Duration,
) -> byzcoll::Result<Communicator> {
    let mut comm = comm.shrink().await?;
    println!("boundary {round}: kept {:?}", comm.job_ranks());
    let mut tries = wait.as_millis() / 100;
    loop {
        if let Admission::Admitted {
            comm: grown,
            admitted,
            epoch,
        } = byzcoll::admit(&mut comm, config).await?
        {
            println!("boundary {round}: admitted {admitted:?} at epoch {epoch}");
            comm = *grown;
            let mut at = [round];
            comm.broadcast_into(0, &mut at).await?;
        }
        if comm.size() as u64 == job || tries == 0 {
            return Ok(comm);
        }
        tries -= 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
