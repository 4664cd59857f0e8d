//! The `byzcoll` command: `info`, `launch`, `aggregate` and `simulate`.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use byzcoll::aggregators::{aggregate_into, AggError, AggReport, Aggregator, Element, Params};
use byzcoll::Attribution;
use byzcoll::{DEFAULT_TRANSPORT, TRANSPORTS};
use byzcoll_cli::launch::{launch, LaunchIdentity, LaunchOptions};
use byzcoll_cli::npy::{self, MappedData};
use clap::{Args, Parser, Subcommand, ValueEnum};

mod simulate;

use simulate::{simulate, SimulateArgs};

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
        /// Seconds between SIGTERM and SIGKILL when ending ranks after a failure or a signal to
        /// the launcher: 0 to 3600 (0: SIGKILL right after SIGTERM).
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(0..=MAX_GRACE_SECS))]
        grace_secs: u64,
        /// How the ranks prove who they are: `per-rank` gives each rank a key of its own (a
        /// rank cannot claim another's rank), `shared-secret` only the job secret (an insider
        /// can; reports say so).
        #[arg(long, value_enum, default_value = "per-rank")]
        identity: IdentityArg,
        /// How many times in all a rank that fails (exits non-zero or is killed) is started
        /// again rather than ending the job: 0 to 1000. A restarted rank gets BYZCOLL_REJOIN=1
        /// and rejoins at the others' next byzcoll::admit (the program calls it at a boundary
        /// of its choice).
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1000))]
        restarts: u32,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true, num_args = 1..)]
        command: Vec<OsString>,
    },
    /// Write per-rank keys for launchers other than `byzcoll launch` (mpirun, srun, torchrun):
    /// DIR/rank-R (rank R's private key, mode 600: give each rank only its own), DIR/roster
    /// (every rank's public key: give it to every rank) and DIR/secret (the job secret, mode
    /// 600). Then set BYZCOLL_SECRET_FILE=DIR/secret BYZCOLL_ROSTER_FILE=DIR/roster
    /// BYZCOLL_KEY_FILE=DIR/rank-%r for every rank.
    Keygen {
        /// Number of ranks: 1 to 65536.
        #[arg(short = 'n', long = "ranks", value_parser = clap::value_parser!(u32).range(1..=MAX_KEYGEN_RANKS))]
        ranks: u32,
        /// The directory to create (it must not exist yet).
        #[arg(long = "out", value_name = "DIR")]
        out: PathBuf,
    },
    /// Aggregate the rows of an (n, d) .npy matrix with a robust rule; write the (d,) result.
    Aggregate(AggregateArgs),
    /// Run the collective schedules on a simulated cluster in virtual time (no sockets).
    Simulate(Box<SimulateArgs>),
}

#[derive(Debug, Args)]
struct AggregateArgs {
    /// Aggregation rule (`byzcoll info` lists them); there is no default.
    #[arg(long)]
    rule: String,
    /// Number of Byzantine inputs (rows) to tolerate: below n, the input's rows (each rule
    /// needs more, see `byzcoll info`).
    #[arg(short = 'f', long = "f", value_name = "F", default_value_t = 0)]
    f: usize,
    /// Multi-Krum: how many inputs to average, 1 to n - f (default n - f).
    #[arg(long = "m", value_name = "M")]
    m: Option<usize>,
    /// Centered clipping: the clipping radius, finite and > 0.
    #[arg(long, value_name = "T")]
    tau: Option<f64>,
    /// Input: a C-order float32, float64 or float16 .npy file of shape (n, d), one input vector
    /// per row; or uint16 ('<u2') words holding bfloat16 bits, with `--dtype bf16`.
    #[arg(value_name = "INPUT.npy")]
    input: PathBuf,
    /// The input's element type; the file's dtype must be it. Needed for bf16, which NumPy
    /// keeps as uint16 ('<u2') words: without it such a file is refused, never guessed at.
    #[arg(long, value_enum, value_name = "DTYPE")]
    dtype: Option<DTypeArg>,
    /// Output: the aggregate as a .npy file of shape (d,), in the input's dtype (bf16 as
    /// uint16 words).
    #[arg(short = 'o', long = "output", value_name = "OUTPUT.npy")]
    output: PathBuf,
    /// Print a report on stdout.
    #[arg(long, value_enum, value_name = "FORMAT")]
    report: Option<ReportFormat>,
    /// Where to aggregate: the CPU rules (the reference) or the CUDA kernels (builds with
    /// `--features cuda`; float32 input; median, trimmed-mean, krum, multi-krum, bulyan).
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
}

/// `byzcoll aggregate --dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DTypeArg {
    /// float32 ('<f4').
    F32,
    /// float64 ('<f8').
    F64,
    /// IEEE half precision ('<f2').
    F16,
    /// bfloat16, stored as uint16 ('<u2') words.
    Bf16,
}

impl DTypeArg {
    /// As given on the command line.
    fn flag(self) -> &'static str {
        match self {
            DTypeArg::F32 => "f32",
            DTypeArg::F64 => "f64",
            DTypeArg::F16 => "f16",
            DTypeArg::Bf16 => "bf16",
        }
    }

    /// The `.npy` dtype that holds this type.
    fn npy_name(self) -> &'static str {
        match self {
            DTypeArg::F32 => "float32",
            DTypeArg::F64 => "float64",
            DTypeArg::F16 => "float16",
            DTypeArg::Bf16 => "uint16",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Device {
    /// The CPU rules.
    Cpu,
    /// The CUDA kernels on GPU 0.
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ReportFormat {
    /// One JSON object: {"rule", "n", "d", "dtype", "selected", "outlying", "attribution"}
    /// (per row: "deviation", "score", "extreme"; null for a figure that is not finite).
    Json,
}

/// The longest `--grace-secs`: an hour.
const MAX_GRACE_SECS: u64 = 3600;
/// The most ranks `byzcoll keygen` writes keys for.
const MAX_KEYGEN_RANKS: i64 = 65536;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum IdentityArg {
    /// A key per rank.
    PerRank,
    /// The job secret alone.
    SharedSecret,
}

/// What `byzcoll keygen` says it wrote, and how to use it.
#[allow(clippy::print_stdout)]
fn print_keygen_usage(ranks: u32, out: &Path) {
    let d = out.display();
    println!(
        "wrote keys for {ranks} ranks to {d}; for every rank set\n  \
         BYZCOLL_SECRET_FILE={d}/secret BYZCOLL_ROSTER_FILE={d}/roster \
         BYZCOLL_KEY_FILE={d}/rank-%r\nand give each rank's host only its own rank-R files (a \
         rank that can read another's key can claim its rank)"
    );
}

/// `byzcoll keygen`: a fresh directory (mode 700) with the job secret, the roster and one
/// private key file per rank (mode 600, created so, never widened).
fn write_keys(ranks: usize, out: &Path) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let (ids, roster) = byzcoll::bootstrap::keygen(ranks).map_err(|e| e.to_string())?;
    let secret = byzcoll::bootstrap::JobSecret::generate().map_err(|e| e.to_string())?;
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(out)
        .map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    let write = |name: &str, text: &str, mode: u32| {
        let path = out.join(name);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))
    };
    write("secret", &format!("{}\n", secret.to_hex()), 0o600)?;
    write("roster", &roster.to_text(), 0o644)?;
    for (r, id) in ids.iter().enumerate() {
        write(&format!("rank-{r}"), &format!("{}\n", id.to_hex()), 0o600)?;
    }
    Ok(())
}

/// For commands that only print (`simulate`, `info`): output piped into a reader that stops
/// early (`| head`) ends the process quietly, as other Unix tools do, instead of a panic from
/// the next print. Not for commands that use sockets, where a write to a closed peer must stay
/// an error rather than a signal.
fn quiet_on_a_closed_pipe() {
    // SAFETY: setting a standard disposition; no handler of ours is involved.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
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
            quiet_on_a_closed_pipe();
            info();
            ExitCode::SUCCESS
        }
        Cmd::Simulate(args) => {
            quiet_on_a_closed_pipe();
            match simulate(&args) {
                Ok(code) => code,
                Err(e) => {
                    let msg = e.split_whitespace().collect::<Vec<_>>().join(" ");
                    eprintln!("byzcoll simulate: {msg}");
                    ExitCode::from(1)
                }
            }
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
        Cmd::Keygen { ranks, out } => match write_keys(ranks as usize, &out) {
            Ok(()) => {
                print_keygen_usage(ranks, &out);
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("byzcoll keygen: {e}");
                ExitCode::from(2)
            }
        },
        Cmd::Launch {
            ranks,
            grace_secs,
            identity,
            restarts,
            command,
        } => {
            // A current-thread runtime, driven by `block_on` on the main thread: the ranks are
            // forked by the thread that lives as long as the launcher, which their
            // PR_SET_PDEATHSIG (fired when the forking *thread* ends) needs; see cli/src/launch.rs.
            let runtime = match tokio::runtime::Builder::new_current_thread()
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
                identity: match identity {
                    IdentityArg::PerRank => LaunchIdentity::PerRank,
                    IdentityArg::SharedSecret => LaunchIdentity::SharedSecret,
                },
                restarts,
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
    let rule = match args.device {
        Device::Cpu => {
            byzcoll::aggregators::build(&args.rule, &params).map_err(|e| e.to_string())?
        }
        Device::Cuda => cuda_rule(&args.rule, &params)?,
    };
    // The rows are read where the page cache holds them; a file that cannot be viewed in
    // place (a big-endian host, a misaligned header) is read into memory and converted.
    let mapped = npy::map(&args.input).map_err(|e| e.to_string())?;
    let converted;
    let data = match mapped.data() {
        Some(data) => data,
        None => {
            converted = npy::read(&args.input).map_err(|e| e.to_string())?;
            converted.view()
        }
    };
    let at = |e: &dyn std::fmt::Display| format!("{}: {e}", args.input.display());
    let (n, d) = mapped.matrix_dims().map_err(|e| at(&e))?;
    if d == 0 {
        return Err(at(&format_args!(
            "shape ({n}, 0) has d = 0 coordinates: nothing to aggregate"
        )));
    }
    check_f(args.f, n).map_err(|e| at(&e))?;
    if let Some(want) = args.dtype {
        if mapped.dtype_name() != want.npy_name() {
            return Err(at(&format_args!(
                "dtype is {}, but --dtype {} needs {}",
                mapped.dtype_name(),
                want.flag(),
                want.npy_name()
            )));
        }
    }
    let dtype = match data {
        MappedData::F32(_) => "float32",
        MappedData::F64(_) => "float64",
        MappedData::F16(_) => "float16",
        MappedData::U16(_) if args.dtype == Some(DTypeArg::Bf16) => "bfloat16",
        MappedData::U16(_) => {
            return Err(at(
                &"dtype uint16 holds raw 16-bit words: pass --dtype bf16 to read \
                 them as bfloat16 bits",
            ))
        }
    };
    rule.check(n).map_err(|e| at(&e))?;
    let (report, attribution) = match data {
        MappedData::F32(data) => {
            let (out, report, attribution) =
                aggregate_rows(rule.as_ref(), data, d).map_err(|e| at(&e))?;
            npy::write_f32(&args.output, &[d], &out)
                .map(|()| (report, attribution))
                .map_err(|e| e.to_string())?
        }
        MappedData::F64(data) => {
            let (out, report, attribution) =
                aggregate_rows(rule.as_ref(), data, d).map_err(|e| at(&e))?;
            npy::write_f64(&args.output, &[d], &out)
                .map(|()| (report, attribution))
                .map_err(|e| e.to_string())?
        }
        MappedData::F16(data) => {
            let (out, report, attribution) =
                aggregate_rows(rule.as_ref(), data, d).map_err(|e| at(&e))?;
            npy::write_f16(&args.output, &[d], &out)
                .map(|()| (report, attribution))
                .map_err(|e| e.to_string())?
        }
        MappedData::U16(words) => {
            let data = npy::bf16_words(words);
            let (out, report, attribution) =
                aggregate_rows(rule.as_ref(), data, d).map_err(|e| at(&e))?;
            let bits: Vec<u16> = out.iter().map(|v| v.to_bits()).collect();
            npy::write_u16(&args.output, &[d], &bits)
                .map(|()| (report, attribution))
                .map_err(|e| e.to_string())?
        }
    };
    if args.report == Some(ReportFormat::Json) {
        println!(
            "{}",
            json_report(rule.name(), n, d, dtype, &report, &attribution)
        );
    }
    Ok(())
}

/// `f < n`, checked before any rule computes with `f` (the rules' preconditions, e.g.
/// `n > 2f`, are evaluated in `usize` and would overflow for an `f` near `usize::MAX`). With
/// `f < n`, where `n` counts rows in memory or simulated ranks (at most 1e6), `4f + 3` fits.
/// `f = 0` with `n = 0` is left to the rule, which names what it needs.
fn check_f(f: usize, n: usize) -> Result<(), String> {
    if f >= n && f > 0 {
        Err(format!(
            "f = {f} Byzantine inputs need more inputs than that, but n = {n} (f must be below n)"
        ))
    } else {
        Ok(())
    }
}

#[cfg(feature = "cuda")]
fn cuda_rule(name: &str, params: &Params) -> Result<Box<dyn Aggregator>, String> {
    let gpu = byzcoll::cuda::Gpu::probe().map_err(|e| format!("--device cuda: {e}"))?;
    let rule = byzcoll::cuda::CudaRule::new(gpu, name, params).map_err(|e| e.to_string())?;
    Ok(Box::new(rule))
}

#[cfg(not(feature = "cuda"))]
fn cuda_rule(_name: &str, _params: &Params) -> Result<Box<dyn Aggregator>, String> {
    Err("--device cuda: not in this build: rebuild with `--features cuda`".into())
}

/// Aggregates the `n` rows of the row-major `data` (`n * d` elements, `d > 0`).
fn aggregate_rows<T: Element>(
    rule: &dyn Aggregator,
    data: &[T],
    d: usize,
) -> Result<(Vec<T>, AggReport, Attribution), AggError> {
    let rows: Vec<&[T]> = data.chunks_exact(d).collect();
    let mut out = vec![T::from_f64(0.0); d];
    let report = aggregate_into(rule, &rows, &mut out)?;
    let present: Vec<Option<&[T]>> = rows.iter().map(|r| Some(*r)).collect();
    let measured = byzcoll::aggregators::evidence::measure(&present, &out, rule.byzantine());
    let attribution = Attribution::of(&measured, report.selected.as_deref());
    Ok((out, report, attribution))
}

/// `{"rule":"median","n":5,"d":1000,"dtype":"float32","selected":null,"outlying":[4],
/// "attribution":[{"deviation":0.5,"score":1.0,"extreme":0.25},...]}`, written by hand.
fn json_report(
    rule: &str,
    n: usize,
    d: usize,
    dtype: &str,
    report: &AggReport,
    attribution: &Attribution,
) -> String {
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
    s.push_str(",\"outlying\":[");
    for (k, r) in attribution.outlying().iter().enumerate() {
        if k > 0 {
            s.push(',');
        }
        let _ = write!(s, "{r}");
    }
    s.push_str("],\"attribution\":[");
    // JSON has no infinity: a figure that is not finite is null.
    let number = |x: f64| match x.is_finite() {
        true => format!("{x:?}"),
        false => "null".to_string(),
    };
    for (k, e) in attribution.ranks.iter().enumerate() {
        if k > 0 {
            s.push(',');
        }
        let _ = write!(
            s,
            "{{\"deviation\":{},\"score\":{},\"extreme\":{}}}",
            number(e.deviation),
            number(e.score),
            number(e.extreme)
        );
    }
    s.push_str("]}");
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
    let env = byzcoll::EnvReport::read();
    match &env.launch {
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
    let transport = env
        .transport_var
        .clone()
        .unwrap_or_else(|| DEFAULT_TRANSPORT.to_string());
    let how = if env.transport_var.is_some() {
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
    let auth = match &env.auth {
        Ok(a) if a.credentials().is_some() => "authenticated, identity: per-rank (job secret \
             and this rank's key bound by BYZCOLL_ROSTER_FILE): a rank can claim only its own \
             rank"
            .to_string(),
        Ok(a) if a.is_authenticated() => "authenticated, identity: shared-secret (job secret \
             set by BYZCOLL_SECRET or BYZCOLL_SECRET_FILE): strangers are kept out, but a \
             process holding the secret can claim any rank; `byzcoll keygen` makes per-rank keys"
            .to_string(),
        Ok(_) => "UNAUTHENTICATED (BYZCOLL_ALLOW_UNAUTHENTICATED=1): any local process can \
                  join a multi-rank job"
            .to_string(),
        Err(e) => format!("no usable job secret ({e}); `byzcoll launch` sets one"),
    };
    println!("  membership   {auth}");
    match &env.config {
        Ok(c) => println!(
            "  settings     valid: step timeout {:?}, agreement {:?}",
            c.comm().step_timeout,
            c.agreement()
        ),
        Err(e) => println!("  settings     INVALID: {e}"),
    }
    ucx_info(&env);
    libfabric_info(&env);
    gpu_info();
    nccl_info();
}

#[cfg(feature = "nccl")]
#[allow(clippy::print_stdout)]
fn nccl_info() {
    match byzcoll::transports::nccl::unavailable_reason() {
        None => println!("nccl: usable on this machine (one rank per GPU)"),
        Some(why) => println!("nccl: not usable on this machine: {why}"),
    }
}

#[cfg(not(feature = "nccl"))]
#[allow(clippy::print_stdout)]
fn nccl_info() {
    println!("nccl: not in this build (rebuild with `--features nccl`)");
}

#[cfg(feature = "cuda")]
#[allow(clippy::print_stdout)]
fn gpu_info() {
    println!();
    match byzcoll::cuda::Gpu::probe() {
        Ok(gpu) => println!(
            "gpu: {} ({}, {} SMs); CUDA rules: median, trimmed-mean, krum, multi-krum, bulyan",
            gpu.context()
                .name()
                .unwrap_or_else(|e| format!("name unknown: {e}")),
            gpu.arch(),
            gpu.sms()
        ),
        Err(e) => println!("gpu: none usable: {e}"),
    }
}

#[cfg(not(feature = "cuda"))]
#[allow(clippy::print_stdout)]
fn gpu_info() {
    println!();
    println!("gpu: CUDA rules not in this build (rebuild with `--features cuda`)");
}

#[cfg(feature = "libfabric")]
#[allow(clippy::print_stdout)]
fn libfabric_info(env: &byzcoll::EnvReport) {
    println!();
    let providers = byzcoll::transports::libfabric::providers();
    println!(
        "libfabric: providers with RDM tagged messaging: {}",
        if providers.is_empty() {
            "(none)".to_string()
        } else {
            providers.join(", ")
        }
    );
    match &env.fi_provider {
        Some(p) => println!("  FI_PROVIDER={p}"),
        None => println!("  (FI_PROVIDER unset: libfabric picks the first provider that fits)"),
    }
}

#[cfg(not(feature = "libfabric"))]
fn libfabric_info(_: &byzcoll::EnvReport) {}

#[cfg(feature = "ucx")]
#[allow(clippy::print_stdout)]
fn ucx_info(env: &byzcoll::EnvReport) {
    println!();
    println!("ucx: libucp {}", byzcoll::transports::ucx::safe::version());
    if env.ucx_vars.is_empty() {
        println!("  (no UCX_ variables set: UCX picks transports itself; set UCX_TLS and UCX_NET_DEVICES)");
    }
    for (k, v) in &env.ucx_vars {
        println!("  {k}={v}");
    }
}

#[cfg(not(feature = "ucx"))]
fn ucx_info(_: &byzcoll::EnvReport) {}
