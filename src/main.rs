//! The `byzcoll` command: `info`, `launch` and `aggregate`.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use byzcoll::aggregators::{aggregate_into, AggError, AggReport, Aggregator, Element, Params};
use byzcoll::bootstrap::LaunchEnv;
use byzcoll::launch::{launch, LaunchOptions};
use byzcoll::npy::{self, Array};
use byzcoll::{Config, TRANSPORTS};
use clap::{Args, Parser, Subcommand, ValueEnum};

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
    /// Aggregate the rows of an (n, d) .npy matrix with a robust rule; write the (d,) result.
    Aggregate(AggregateArgs),
}

#[derive(Debug, Args)]
struct AggregateArgs {
    /// Aggregation rule (`byzcoll info` lists them); there is no default.
    #[arg(long)]
    rule: String,
    /// Number of Byzantine inputs (rows) to tolerate.
    #[arg(short = 'f', long = "f", value_name = "F", default_value_t = 0)]
    f: usize,
    /// Multi-Krum: how many inputs to average (default n - f).
    #[arg(long = "m", value_name = "M")]
    m: Option<usize>,
    /// Centered clipping: the clipping radius.
    #[arg(long, value_name = "T")]
    tau: Option<f64>,
    /// Input: a C-order float32 or float64 .npy file of shape (n, d), one input vector per row.
    #[arg(value_name = "INPUT.npy")]
    input: PathBuf,
    /// Output: the aggregate as a .npy file of shape (d,), in the input's dtype.
    #[arg(short = 'o', long = "output", value_name = "OUTPUT.npy")]
    output: PathBuf,
    /// Print a report on stdout.
    #[arg(long, value_enum, value_name = "FORMAT")]
    report: Option<ReportFormat>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ReportFormat {
    /// One JSON object: {"rule", "n", "d", "dtype", "selected"}.
    Json,
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
        Cmd::Aggregate(args) => match aggregate(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                // One line, whatever the underlying error's text holds.
                let msg = e.split_whitespace().collect::<Vec<_>>().join(" ");
                eprintln!("byzcoll aggregate: {msg}");
                ExitCode::from(1)
            }
        },
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

/// `byzcoll aggregate`: reads the (n, d) matrix, aggregates its rows in place (borrowed row
/// slices of the file's buffer, no copy), writes the (d,) result in the same dtype.
#[allow(clippy::print_stdout)]
fn aggregate(args: &AggregateArgs) -> Result<(), String> {
    let params = Params {
        f: args.f,
        m: args.m,
        tau: args.tau,
    };
    let rule = byzcoll::aggregators::build(&args.rule, &params).map_err(|e| e.to_string())?;
    let input = npy::read(&args.input).map_err(|e| e.to_string())?;
    let at = |e: &dyn std::fmt::Display| format!("{}: {e}", args.input.display());
    let (n, d) = input.matrix_dims().map_err(|e| at(&e))?;
    if d == 0 {
        return Err(at(&format_args!(
            "shape ({n}, 0) has d = 0 coordinates: nothing to aggregate"
        )));
    }
    rule.check(n).map_err(|e| at(&e))?;
    let report = match &input {
        Array::F32 { data, .. } => {
            let (out, report) = aggregate_rows(rule.as_ref(), data, d).map_err(|e| at(&e))?;
            npy::write_f32(&args.output, &[d], &out)
                .map(|()| report)
                .map_err(|e| e.to_string())?
        }
        Array::F64 { data, .. } => {
            let (out, report) = aggregate_rows(rule.as_ref(), data, d).map_err(|e| at(&e))?;
            npy::write_f64(&args.output, &[d], &out)
                .map(|()| report)
                .map_err(|e| e.to_string())?
        }
    };
    if args.report == Some(ReportFormat::Json) {
        println!(
            "{}",
            json_report(rule.name(), n, d, input.dtype_name(), &report)
        );
    }
    Ok(())
}

/// Aggregates the `n` rows of the row-major `data` (`n * d` elements, `d > 0`).
fn aggregate_rows<T: Element>(
    rule: &dyn Aggregator,
    data: &[T],
    d: usize,
) -> Result<(Vec<T>, AggReport), AggError> {
    let rows: Vec<&[T]> = data.chunks_exact(d).collect();
    let mut out = vec![T::from_f64(0.0); d];
    let report = aggregate_into(rule, &rows, &mut out)?;
    Ok((out, report))
}

/// `{"rule":"median","n":5,"d":1000,"dtype":"float32","selected":null}`, written by hand.
fn json_report(rule: &str, n: usize, d: usize, dtype: &str, report: &AggReport) -> String {
    let mut s = String::from("{\"rule\":");
    json_string(&mut s, rule);
    let _ = write!(s, ",\"n\":{n},\"d\":{d},\"dtype\":");
    json_string(&mut s, dtype);
    s.push_str(",\"selected\":");
    match &report.selected {
        Some(indices) => {
            s.push('[');
            for (k, i) in indices.iter().enumerate() {
                if k > 0 {
                    s.push(',');
                }
                let _ = write!(s, "{i}");
            }
            s.push(']');
        }
        None => s.push_str("null"),
    }
    s.push('}');
    s
}

fn json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
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
