//! The `byzcoll` command: `info` and `launch`.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use byzcoll::bootstrap::LaunchEnv;
use byzcoll::launch::{launch, LaunchOptions};
use byzcoll::{Config, TRANSPORTS};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "byzcoll",
    version,
    about = "Byzantine-robust collective communication"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// List the transports and aggregators in this build and what the environment selects.
    Info,
    /// Start N local ranks of a command with the bootstrap environment set.
    Launch {
        /// Number of ranks.
        #[arg(short = 'n', long = "ranks", value_parser = clap::value_parser!(u32).range(1..=4096))]
        ranks: u32,
        /// Seconds between SIGTERM and SIGKILL when ending ranks after a failure.
        #[arg(long, default_value_t = 5)]
        grace_secs: u64,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true, num_args = 1..)]
        command: Vec<OsString>,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BYZCOLL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Cmd::Info => {
            info();
            ExitCode::SUCCESS
        }
        Cmd::Launch {
            ranks,
            grace_secs,
            command,
        } => {
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("byzcoll launch: cannot start the runtime: {e}");
                    return ExitCode::from(1);
                }
            };
            let options = LaunchOptions {
                ranks: ranks as usize,
                command,
                grace: Duration::from_secs(grace_secs),
                env: Vec::new(),
            };
            match runtime.block_on(launch(options)) {
                Ok(outcome) => ExitCode::from(outcome.exit_code.clamp(0, 255) as u8),
                Err(e) => {
                    eprintln!("byzcoll launch: {e}");
                    ExitCode::from(1)
                }
            }
        }
    }
}

#[allow(clippy::print_stdout)]
fn info() {
    println!("byzcoll {}", env!("CARGO_PKG_VERSION"));
    println!();
    println!("transports:");
    for t in TRANSPORTS {
        let mark = if t.available { "yes" } else { "no " };
        println!("  {:<10} {mark}  {}", t.name, t.about);
    }
    println!();
    println!("aggregators (name, precondition; there is no default):");
    for (name, about) in byzcoll::aggregators::RULES {
        println!("  {name:<13} {about}");
    }
    println!();
    println!("environment:");
    match LaunchEnv::from_env() {
        Ok(env) => {
            println!("  launcher     {}", env.launcher);
            println!("  rank         {} of {}", env.rank, env.size);
            if let Some(l) = env.local_rank {
                println!("  local rank   {l}");
            }
            println!(
                "  store        {}",
                env.store.as_deref().unwrap_or("(none: single rank)")
            );
        }
        Err(e) => println!("  launcher     none usable: {e}"),
    }
    let transport = byzcoll::selected_transport();
    let how = if std::env::var_os("BYZCOLL_TRANSPORT").is_some() {
        "from BYZCOLL_TRANSPORT"
    } else {
        "default; set BYZCOLL_TRANSPORT to change"
    };
    let usable = match TRANSPORTS.iter().find(|t| t.name == transport) {
        Some(t) if t.available => "available",
        Some(_) => "NOT available in this build",
        None => "unknown",
    };
    println!("  transport    {transport} ({how}; {usable})");
    match Config::from_env() {
        Ok(c) => println!("  step timeout {:?} (BYZCOLL_TIMEOUT_MS)", c.step_timeout),
        Err(e) => println!("  step timeout invalid: {e}"),
    }
}
