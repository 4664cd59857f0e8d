//! Collective benchmark over each byzcoll transport on loopback (TCP, and UCX and libfabric
//! where this build has them), printed in nccl-tests columns, side by side with Open MPI
//! (mpi4py + numpy) in the same run when those are installed.
//!
//! ```sh
//! cargo bench --bench collectives                       # 4 ranks, d = 2^16 .. 2^24 float32
//! cargo bench --bench collectives -- --ranks 4 --min-exp 16 --max-exp 24 --no-anchor
//! cargo bench --features ucx,libfabric --bench collectives -- --transports tcp,ucx,libfabric
//! cargo bench --bench collectives -- --transports tcp,tcp+mac,tcp+off   # frame MACs, agreement off
//! cargo bench --bench collectives -- --transports tcp+off,tcp,tcp+enforce  # agreement cost
//! cargo bench --bench collectives -- --transports tcp,tcp+mt   # ranks on a multi-threaded runtime
//! UCX_TLS=sm,self FI_PROVIDER=shm cargo bench --features ucx,libfabric --bench collectives -- --mpi-btl vader
//! ```
//!
//! Without the hidden `--rank-results` flag the binary is the launcher: for each transport of
//! `--transports` (default: `tcp` and every other transport in `byzcoll::TRANSPORTS` that this
//! build has, except `nccl`, which needs one GPU per rank) it starts `--ranks` copies of itself
//! through `byzcoll_cli::launch` with `BYZCOLL_TRANSPORT` set and its own command line plus
//! `--rank-results`, `--rank-label` and `--rank-runtime`, then runs the MPI anchor. A transport
//! this build lacks is an error naming the cargo feature. UCX and libfabric stay on loopback:
//! the caller's `UCX_TLS`, `UCX_NET_DEVICES`, `FI_PROVIDER` and `FI_*_IFACE` are honoured, and
//! where unset the ranks get `UCX_TLS=tcp,self UCX_NET_DEVICES=lo` and
//! `FI_PROVIDER='tcp;ofi_rxm'` with `FI_TCP_IFACE`, `FI_NET_IFACE`, `FI_SOCKETS_IFACE` and
//! `FI_UDP_IFACE` set to `lo`. Each rank runs on a current-thread tokio runtime (the `+mt`
//! variant: the multi-threaded one). Each rep is timed as the slowest rank's time (an all-reduce MAX
//! of the per-rank times) after a barrier, after three untimed calls; the table shows the
//! median of at least seven reps.
//!
//! Columns: `size` is bytes per rank (`all_gather`: bytes gathered per rank, as nccl-tests
//! prints it). `algbw = size / time`. `busbw` is nccl-tests' bus bandwidth: `algbw * 2(n-1)/n`
//! for `all_reduce`, `algbw * (n-1)/n` for `all_gather`, and for gather-mode
//! `robust_all_reduce` `algbw * (n-1)` and sharded mode `algbw * 2r(n-1)/n`, the
//! bytes each rank actually receives. `rss(MiB)` is the largest peak resident set of any rank
//! while the collective ran (input buffers included). The ratio table has one column per
//! transport: byzcoll's time over that transport divided by Open MPI's time in the same run.
//! Its memory lines give the sharded r = 1 peak RSS over the vector's bytes twice: the whole
//! process, and above the rank's resident set once it has connected and before it allocates
//! any vector (the program, its libraries and the runtime's threads).

#![allow(clippy::print_stdout)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use byzcoll::aggregators::Median;
use byzcoll::audit::Audit;
use byzcoll::{Communicator, Policy, ReduceOp, Replicas, TRANSPORTS};
use byzcoll_cli::launch::{launch, LaunchOptions};
use serde_json::json;

#[path = "common/rows.rs"]
mod rows;

struct Args {
    ranks: usize,
    /// The byzcoll collectives to run (all when empty).
    collectives: Vec<Collective>,
    min_exp: u32,
    max_exp: u32,
    anchor: bool,
    transports: Vec<&'static str>,
    /// Open MPI's byte transfer layer for the anchor: `tcp` (loopback) or `vader` (shared
    /// memory, the fair comparison for UCX_TLS=sm / FI_PROVIDER=shm).
    mpi_btl: &'static str,
    sub_round_bytes: Option<usize>,
    /// The median's `f` (`--f`; `None`: the most the world allows).
    f: Option<usize>,
    /// `--bf16`: the robust rows again on `bf16` vectors of the same length.
    bf16: bool,
    /// Set when this process is one of the launched ranks.
    rank: Option<RankArgs>,
}

/// What the launcher tells one of its ranks, on the rank's command line.
struct RankArgs {
    /// The file rank 0 appends its results to.
    results: PathBuf,
    /// The transport spec (`tcp+mt`, ...) that labels the rows; `None`: the transport's name.
    label: Option<String>,
    runtime: RankRuntime,
}

/// The tokio runtime a rank runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum RankRuntime {
    /// The task awaiting a collective also runs the transport's tasks.
    CurrentThread,
    /// The `+mt` variant: every frame crosses from a worker to the caller.
    MultiThread,
}

/// The transports run when `--transports` is not given: every one this build has across
/// processes, except NCCL (one rank per GPU; not a loopback benchmark).
fn default_transports() -> Vec<&'static str> {
    TRANSPORTS
        .iter()
        .filter(|t| t.available && t.name != "nccl")
        .map(|t| t.name)
        .collect()
}

/// Parses `--transports a,b,c`: each name must be a transport this build has; one it lacks is
/// an error that says which feature to build with. A name may carry variants: `+mac` (TCP
/// frame MACs, `BYZCOLL_FRAME_MAC=1`), `+off` and `+enforce` (`BYZCOLL_AGREEMENT`), `+ring`
/// (`all_reduce` by the ring at every size, `BYZCOLL_DOUBLING_MAX_BYTES=0`), `+quorum`
/// (stragglers `auto`, the default, `BYZCOLL_STRAGGLERS=auto`), `+s0` (every input waited
/// for, `BYZCOLL_STRAGGLERS=0`: what `Detect` did by default before), e.g.
/// `tcp,tcp+mac,tcp+off` compares them in one run. Under `+enforce` the robust rows are gather
/// mode only, with `f = (n − 1)/3` (Enforce needs `n > 3f`).
fn parse_transports(list: &str) -> Result<Vec<&'static str>, String> {
    let mut chosen: Vec<&'static str> = Vec::new();
    for spec in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let mut parts = spec.split('+');
        let name = parts.next().unwrap_or_default();
        let info = TRANSPORTS.iter().find(|t| t.name == name).ok_or_else(|| {
            let known: Vec<&str> = TRANSPORTS.iter().map(|t| t.name).collect();
            format!(
                "--transports: unknown transport {name:?}; known: {}",
                known.join(", ")
            )
        })?;
        if !info.available {
            return Err(format!("--transports {name}: {}", info.about));
        }
        for variant in parts {
            match variant {
                "mac" if name == "tcp" => {}
                "off" | "enforce" | "ring" | "mt" | "quorum" | "s0" => {}
                _ => {
                    return Err(format!(
                        "--transports {spec}: unknown variant {variant:?} (tcp+mac, NAME+off, \
                         NAME+enforce, NAME+ring, NAME+mt, NAME+quorum, NAME+s0)"
                    ))
                }
            }
        }
        if !chosen.contains(&spec) {
            chosen.push(Box::leak(spec.to_string().into_boxed_str()));
        }
    }
    if chosen.is_empty() {
        return Err("--transports needs at least one transport, e.g. tcp,ucx,libfabric".into());
    }
    Ok(chosen)
}

/// The environment one transport's ranks get: `BYZCOLL_TRANSPORT` (and the variants' library
/// settings), and loopback defaults for the UCX and libfabric settings the caller left unset.
fn transport_env(spec: &str) -> Vec<(String, String)> {
    let mut parts = spec.split('+');
    let name = parts.next().unwrap_or_default();
    let defaults: &[(&str, &str)] = match name {
        "ucx" => &[("UCX_TLS", "tcp,self"), ("UCX_NET_DEVICES", "lo")],
        "libfabric" => &[
            ("FI_PROVIDER", "tcp;ofi_rxm"),
            ("FI_TCP_IFACE", "lo"),
            ("FI_NET_IFACE", "lo"),
            ("FI_SOCKETS_IFACE", "lo"),
            ("FI_UDP_IFACE", "lo"),
        ],
        _ => &[],
    };
    let mut env = vec![("BYZCOLL_TRANSPORT".to_string(), name.to_string())];
    for variant in parts {
        match variant {
            "mac" => env.push(("BYZCOLL_FRAME_MAC".into(), "1".into())),
            "off" => env.push(("BYZCOLL_AGREEMENT".into(), "off".into())),
            "enforce" => env.push(("BYZCOLL_AGREEMENT".into(), "enforce".into())),
            "ring" => env.push(("BYZCOLL_DOUBLING_MAX_BYTES".into(), "0".into())),
            "quorum" => env.push(("BYZCOLL_STRAGGLERS".into(), "auto".into())),
            "s0" => env.push(("BYZCOLL_STRAGGLERS".into(), "0".into())),
            // `mt` is the bench's own: see `rank_runtime`.
            _ => {}
        }
    }
    env.extend(
        defaults
            .iter()
            // The caller's own UCX/libfabric settings win over the loopback defaults.
            .filter(|(k, _)| std::env::var_os(k).is_none())
            .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    env
}

/// The runtime one transport spec's ranks run on: the multi-threaded one under `+mt`.
fn rank_runtime(spec: &str) -> RankRuntime {
    if spec.split('+').skip(1).any(|v| v == "mt") {
        RankRuntime::MultiThread
    } else {
        RankRuntime::CurrentThread
    }
}

/// The transport's own settings as the ranks see them, for the table header.
fn transport_settings(name: &str) -> String {
    let vars: &[&str] = match name {
        "ucx" => &["UCX_TLS", "UCX_NET_DEVICES"],
        "libfabric" => &["FI_PROVIDER", "FI_TCP_IFACE"],
        _ => &[],
    };
    vars.iter()
        // What the libraries will read: the caller's values or the launcher's defaults.
        .filter_map(|v| std::env::var(v).ok().map(|x| format!(" {v}={x}")))
        .collect()
}

/// The byzcoll collectives the bench can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Collective {
    #[value(name = "all_reduce")]
    AllReduce,
    #[value(name = "all_gather")]
    AllGather,
    Gather,
    Sharded1,
    Sharded,
    Audited,
}

/// The command line (the launcher's ranks get the same one).
#[derive(clap::Parser)]
struct Cli {
    /// Ranks per transport run.
    #[arg(long, default_value_t = 4,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(2..=256))]
    ranks: usize,
    /// Smallest size: 2^min-exp float32 per rank.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(0..=28))]
    min_exp: u32,
    /// Largest size: 2^max-exp float32 per rank (every second exponent between).
    #[arg(long, default_value_t = 24, value_parser = clap::value_parser!(u32).range(0..=28))]
    max_exp: u32,
    /// Transports, comma-separated, each with optional variants: `tcp`, `tcp+mac`, `tcp+off`,
    /// `NAME+enforce`, `NAME+ring` (no recursive doubling), `NAME+mt` (the ranks on tokio's
    /// multi-threaded runtime instead of a current-thread one), `ucx`, `libfabric` (default:
    /// every transport of this build but nccl).
    #[arg(long)]
    transports: Option<String>,
    /// Open MPI's byte transfer layer for the anchor.
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "vader"])]
    mpi_btl: String,
    /// byzcoll collectives to run, comma-separated (default: all): `all_reduce`,
    /// `all_gather`, `gather` (robust, gather mode), `sharded1` (r = 1), `sharded`
    /// (r = 2f+1), `audited` (r = 1 with audits, `Policy::Audited`). Running one alone measures its peak RSS without the receive buffers that
    /// the others left idle in the transport's pool.
    #[arg(long, value_delimiter = ',', value_enum)]
    collectives: Vec<Collective>,
    /// Skip the Open MPI anchor.
    #[arg(long = "no-anchor", action = clap::ArgAction::SetFalse)]
    anchor: bool,
    /// Bytes per sub-round of the sharded median (`Communicator::set_sub_round_bytes`;
    /// default: the library's `SUB_ROUND_BYTES`).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    sub_round_bytes: Option<usize>,
    /// Byzantine ranks the median tolerates (default: the most the world allows, `(n − 1)/2`,
    /// or `(n − 1)/3` under Enforce). A smaller `f` means `2f + 1` owners per shard, fewer
    /// than `n`: where sharded mode sends fewer bytes than gather.
    #[arg(long)]
    f: Option<usize>,
    /// Also runs each robust collective on `bf16` vectors of the same length (half the
    /// bytes), in rows labelled `bf16`, beside the `float32` ones.
    #[arg(long)]
    bf16: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
    /// Set by the launcher on its ranks' command lines, never by hand: the file rank 0 appends
    /// its results to. A process is one of the launched ranks iff it is given this flag.
    #[arg(long, hide = true, value_name = "PATH")]
    rank_results: Option<PathBuf>,
    /// Set by the launcher with `--rank-results`: the transport spec that labels the rows.
    #[arg(long, hide = true, value_name = "SPEC", requires = "rank_results")]
    rank_label: Option<String>,
    /// Set by the launcher with `--rank-results`: the rank's tokio runtime.
    #[arg(long, hide = true, value_enum, requires = "rank_results")]
    rank_runtime: Option<RankRuntime>,
}

fn parse_args() -> Result<Args, String> {
    let cli: Cli = rows::parse_cli()?;
    if cli.min_exp > cli.max_exp {
        return Err(format!(
            "--min-exp {} is above --max-exp {}",
            cli.min_exp, cli.max_exp
        ));
    }
    Ok(Args {
        ranks: cli.ranks,
        collectives: cli.collectives,
        min_exp: cli.min_exp,
        max_exp: cli.max_exp,
        anchor: cli.anchor,
        transports: match &cli.transports {
            Some(list) => parse_transports(list)?,
            None => default_transports(),
        },
        mpi_btl: if cli.mpi_btl == "vader" {
            "vader"
        } else {
            "tcp"
        },
        sub_round_bytes: cli.sub_round_bytes,
        f: cli.f,
        bf16: cli.bf16,
        rank: cli.rank_results.map(|results| RankArgs {
            results,
            label: cli.rank_label,
            runtime: cli.rank_runtime.unwrap_or(RankRuntime::CurrentThread),
        }),
    })
}

/// Timed reps for a size: at least 7 (a median that up to 3 slow reps cannot move), more for
/// small sizes. The MPI anchor counts alike (`anchors/mpi_collectives.py`).
fn reps_for(bytes: usize) -> usize {
    (((64usize << 20) / bytes.max(1)).clamp(7, 20)) | 1
}

/// Untimed calls before the timed reps, alike in the MPI anchor. The transports' buffer pools
/// grow to what a collective of this size keeps in flight over the first calls; a fresh
/// buffer costs its first touch, which on a VM can take tens of milliseconds
/// (`docs/bench/PROFILE.md`, item 13).
const WARM_UP: usize = 3;

/// Times `op` over `reps` reps as the slowest rank's time, and measures the largest peak RSS
/// of any rank while it ran (Linux: the high-water mark is reset through
/// `/proc/self/clear_refs` first). Returns (median seconds, peak RSS in MiB). `refill` runs
/// before each rep, untimed: an in-place collective needs its input back, and Open MPI's
/// out-of-place calls it is compared with copy nothing.
async fn time_op<S, F>(
    comm: &mut Communicator,
    reps: usize,
    state: &mut S,
    mut refill: impl FnMut(&mut S),
    mut op: F,
) -> (f64, f64)
where
    F: AsyncFnMut(&mut Communicator, &mut S),
{
    // Hand freed heap back to the OS first, or the reset high-water mark would include what
    // earlier collectives left in the allocator.
    // SAFETY: malloc_trim only releases free memory; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    for _ in 0..WARM_UP {
        refill(state);
        op(comm, state).await;
    }
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        refill(state);
        comm.barrier().await.expect("barrier");
        let t = Instant::now();
        op(comm, state).await;
        let mut slowest = [t.elapsed().as_secs_f64()];
        comm.all_reduce(&mut slowest, ReduceOp::Max)
            .await
            .expect("max");
        times.push(slowest[0]);
    }
    let mut rss = [peak_rss_mib()];
    comm.all_reduce(&mut rss, ReduceOp::Max).await.expect("max");
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], rss[0])
}

/// This process's peak resident set (VmHWM) in MiB, or NaN where /proc is unavailable.
fn peak_rss_mib() -> f64 {
    status_mib("VmHWM:")
}

/// The `/proc/self/status` field `field` (a size in KiB) in MiB, or NaN where it is missing.
fn status_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kib| kib / 1024.0)
}

/// The label of the results-file line that carries the idle rank's resident set.
const IDLE: &str = "idle";

/// Where rank 0 reports one transport's results: the table on stdout and the results file the
/// launcher named for this transport, for the ratio table.
struct Report<'a> {
    /// The results file (`--rank-results`).
    results: &'a Path,
    /// The label of the table's transport column.
    transport: &'a str,
    /// The world size.
    n: usize,
}

impl Report<'_> {
    /// Prints one table row, labelled with the transport, and records it.
    #[allow(clippy::too_many_arguments)]
    fn row(
        &self,
        size: usize,
        count: usize,
        ty: &str,
        redop: &str,
        (seconds, rss): (f64, f64),
        bus_factor: f64,
        label: &str,
    ) {
        let algbw = size as f64 / seconds / 1e9;
        let per_rank = if label == "all_gather" {
            size / 4 / self.n
        } else {
            count
        };
        self.record(per_rank, seconds, rss, label);
        let transport = self.transport;
        println!(
            "{size:>12} {count:>10} {:>6} {redop:>7} {:>12.1} {algbw:>8.3} {:>8.3} {rss:>9.1}   {transport:<9} {label}",
            ty,
            seconds * 1e6,
            algbw * bus_factor
        );
    }

    /// Appends `elements-per-rank seconds rss label` to the results file.
    fn record(&self, per_rank: usize, seconds: f64, rss: f64, label: &str) {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(self.results)
        {
            let _ = writeln!(f, "{per_rank} {seconds} {rss} {label}");
        }
    }
}

async fn worker(args: &Args, rank: &RankArgs) -> Result<(), String> {
    let mut comm = byzcoll::init().await.map_err(|e| e.to_string())?;
    if let Some(bytes) = args.sub_round_bytes {
        comm.set_sub_round_bytes(bytes);
    }
    let (me, n) = (comm.rank(), comm.size());
    let report = Report {
        results: &rank.results,
        transport: rank
            .label
            .as_deref()
            .unwrap_or_else(|| comm.transport().name()),
        n,
    };
    // The largest resident set of a connected rank before any vector is allocated: what the
    // second memory line of the ratio table leaves out.
    let mut idle = [status_mib("VmRSS:")];
    comm.all_reduce(&mut idle, ReduceOp::Max)
        .await
        .map_err(|e| e.to_string())?;
    if me == 0 {
        report.record(0, 0.0, idle[0], IDLE);
    }
    let nf = n as f64;
    let enforce = comm.agreement() == byzcoll::Agreement::Enforce;
    let most = if enforce { (n - 1) / 3 } else { (n - 1) / 2 };
    let f = match args.f {
        Some(f) if f > most => {
            return Err(format!("--f {f}: at most {most} with {n} ranks"));
        }
        Some(f) => f,
        None => most,
    };
    let median = Median::new(f);
    if me == 0 {
        println!(
            "# byzcoll over {}{} on loopback, {n} ranks, median f = {f}, agreement {:?}",
            report.transport,
            transport_settings(comm.transport().name()),
            comm.agreement()
        );
        println!(
            "{:>12} {:>10} {:>6} {:>7} {:>12} {:>8} {:>8} {:>9}   {:<9} collective",
            "size", "count", "type", "redop", "time(us)", "algbw", "busbw", "rss(MiB)", "transport"
        );
    }
    for exp in (args.min_exp..=args.max_exp).step_by(2) {
        let d = 1usize << exp;
        let bytes = d * 4;
        let reps = reps_for(bytes);
        let input: Vec<f32> = (0..d).map(|j| (me * 7 + j % 13) as f32).collect();
        // The collectives work in place: before each rep the input is copied, untimed, into
        // one buffer allocated here (as Open MPI's out-of-place Allreduce writes into the
        // caller's `out`), rather than timing a fresh allocation and its page faults.
        let mut v = input.clone();
        let refill = |v: &mut Vec<f32>| v.copy_from_slice(&input);

        let runs = |c: Collective| args.collectives.is_empty() || args.collectives.contains(&c);
        if runs(Collective::AllReduce) {
            let t = time_op(
                &mut comm,
                reps,
                &mut v,
                refill,
                async |c: &mut Communicator, v: &mut Vec<f32>| {
                    c.all_reduce(v, ReduceOp::Sum).await.expect("all_reduce");
                },
            )
            .await;
            if me == 0 {
                report.row(
                    bytes,
                    d,
                    "float",
                    "sum",
                    t,
                    2.0 * (nf - 1.0) / nf,
                    "all_reduce",
                );
            }
        }

        if runs(Collective::AllGather) {
            let mut gathered = vec![0.0f32; n * d];
            let t = time_op(
                &mut comm,
                reps,
                &mut gathered,
                |_| {},
                async |c: &mut Communicator, gathered: &mut Vec<f32>| {
                    c.all_gather_into(&input, gathered)
                        .await
                        .expect("all_gather");
                },
            )
            .await;
            if me == 0 {
                report.row(
                    bytes * n,
                    d * n,
                    "float",
                    "none",
                    t,
                    (nf - 1.0) / nf,
                    "all_gather",
                );
            }
        }

        for (collective, policy, label, received) in [
            (
                Collective::Gather,
                Policy::Gather,
                "robust_all_reduce gather".to_string(),
                nf - 1.0,
            ),
            (
                Collective::Sharded1,
                Policy::Sharded(Replicas::Exactly(1)),
                "robust_all_reduce sharded r=1".to_string(),
                2.0 * (nf - 1.0) / nf,
            ),
            (
                Collective::Sharded,
                Policy::Sharded(Replicas::Tolerant),
                format!("robust_all_reduce sharded r={}", 2 * f + 1),
                2.0 * (2 * f + 1) as f64 * (nf - 1.0) / nf,
            ),
            (
                Collective::Audited,
                Policy::Audited(Audit::default()),
                "robust_all_reduce audited r=1".to_string(),
                2.0 * (nf - 1.0) / nf + Audit::default().traffic(n, f),
            ),
        ] {
            if !runs(collective) || (enforce && policy != Policy::Gather) {
                continue;
            }
            let t = time_op(
                &mut comm,
                reps,
                &mut v,
                refill,
                async |c: &mut Communicator, v: &mut Vec<f32>| {
                    c.robust_all_reduce(v, &median, policy)
                        .await
                        .expect("robust_all_reduce");
                },
            )
            .await;
            if me == 0 {
                report.row(bytes, d, "float", "median", t, received, &label);
            }
            if !args.bf16 {
                continue;
            }
            let input16: Vec<half::bf16> = input.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let mut v16 = input16.clone();
            let t = time_op(
                &mut comm,
                reps,
                &mut v16,
                |v: &mut Vec<half::bf16>| v.copy_from_slice(&input16),
                async |c: &mut Communicator, v: &mut Vec<half::bf16>| {
                    c.robust_all_reduce(v, &median, policy)
                        .await
                        .expect("robust_all_reduce bf16");
                },
            )
            .await;
            if me == 0 {
                let label = format!("{label} bf16");
                report.row(bytes / 2, d, "bf16", "median", t, received, &label);
            }
        }
    }
    Ok(())
}

/// Runs the MPI anchor and returns its rows as (elements per rank, seconds, label).
fn run_anchor(args: &Args) -> Vec<(usize, f64, String)> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/benches/anchors/mpi_collectives.py"
    );
    let spinner = rows::progress(None, "Open MPI anchor");
    let output = std::process::Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "--mca",
            "oob_tcp_if_include",
            "lo",
            "--mca",
            "btl",
            &format!("self,{}", args.mpi_btl),
            "--mca",
            "btl_tcp_if_include",
            "lo",
            "-n",
            &args.ranks.to_string(),
            "python3",
            script,
            "--btl",
            args.mpi_btl,
            "--min-exp",
            &args.min_exp.to_string(),
            "--max-exp",
            &args.max_exp.to_string(),
        ])
        .stderr(std::process::Stdio::inherit())
        .output();
    spinner.finish_and_clear();
    let output = match output {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        Ok(o) => {
            println!(
                "# MPI anchor failed ({}); is mpi4py installed? pip install mpi4py numpy",
                o.status
            );
            return Vec::new();
        }
        Err(e) => {
            println!("# MPI anchor not run: mpirun unavailable ({e}); apt-get install openmpi-bin");
            return Vec::new();
        }
    };
    let mut header = true;
    for line in output.lines() {
        if header && !line.starts_with('#') {
            header = false;
            println!(
                "{:>12} {:>10} {:>6} {:>7} {:>12} {:>8} {:>8} {:>9}   collective",
                "size", "count", "type", "redop", "time(us)", "algbw", "busbw", "rss(MiB)"
            );
        }
        println!("{line}");
    }
    output
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let t: Vec<&str> = l.split_whitespace().collect();
            let count: usize = t.get(1)?.parse().ok()?;
            let micros: f64 = t.get(4)?.parse().ok()?;
            let label = t.get(8..)?.join(" ");
            let per_rank = if label == "MPI Allgather" {
                count / args.ranks
            } else {
                count
            };
            Some((per_rank, micros / 1e6, label))
        })
        .collect()
}

/// One byzcoll result: (transport, elements per rank, seconds, peak RSS MiB, label).
type Ours = (&'static str, usize, f64, f64, String);

/// Prints, per size and comparison, byzcoll's time over each transport divided by Open MPI's.
fn print_ratios(
    transports: &[&'static str],
    mpi_btl: &str,
    (ranks, f): (usize, Option<usize>),
    ours: &[Ours],
    anchor: &[(usize, f64, String)],
) {
    let owners = 2 * f.unwrap_or((ranks - 1) / 2) + 1;
    let tolerant = format!("robust_all_reduce sharded r={owners}");
    let pairs: Vec<(&str, &str, String)> = vec![
        (
            "all_reduce",
            "MPI Allreduce",
            "all_reduce / Allreduce SUM".into(),
        ),
        (
            "all_gather",
            "MPI Allgather",
            "all_gather / Allgather".into(),
        ),
        (
            "robust_all_reduce gather",
            "MPI Allgather + numpy.median",
            "gather median / Allgather+median".into(),
        ),
        (
            "robust_all_reduce sharded r=1",
            "MPI Allgather + numpy.median",
            "sharded r=1 median / Allgather+median".into(),
        ),
        (
            &tolerant,
            "MPI Allgather + numpy.median",
            format!("sharded r={} median / Allgather+median", owners),
        ),
        (
            "robust_all_reduce sharded r=1",
            "MPI Allreduce",
            "sharded r=1 median / Allreduce SUM".into(),
        ),
        (
            &tolerant,
            "MPI Allreduce",
            format!("sharded r={} median / Allreduce SUM", owners),
        ),
        (
            "robust_all_reduce audited r=1",
            "MPI Allreduce",
            "audited median / Allreduce SUM".into(),
        ),
    ];
    let mut sizes: Vec<usize> = ours.iter().filter(|r| r.4 != IDLE).map(|r| r.1).collect();
    sizes.sort_unstable();
    sizes.dedup();
    println!();
    println!(
        "# time ratio byzcoll over each transport / Open MPI (btl {}), same run \
         (< 1: byzcoll faster)",
        mpi_btl
    );
    print!("{:>12}   {:<40}", "bytes/rank", "byzcoll / Open MPI");
    for t in transports {
        print!(" {t:>10}");
    }
    println!();
    for d in sizes {
        for (ours_label, mpi_label, what) in &pairs {
            let Some(mpi) = anchor
                .iter()
                .find(|(e, _, l)| *e == d && l == mpi_label)
                .map(|r| r.1)
            else {
                continue;
            };
            print!("{:>12}   {what:<40}", d * 4);
            for t in transports {
                let cell = ours
                    .iter()
                    .find(|(tr, e, _, _, l)| tr == t && *e == d && l == ours_label)
                    .map_or("-".to_string(), |r| format!("{:.2}", r.2 / mpi));
                print!(" {cell:>10}");
            }
            println!();
        }
        // The price of the audits: byzcoll against itself, same run.
        print!("{:>12}   {:<40}", d * 4, "audited / sharded r=1 median");
        for t in transports {
            let time = |label: &str| {
                ours.iter()
                    .find(|(tr, e, _, _, l)| tr == t && *e == d && l == label)
                    .map(|r| r.2)
            };
            let cell = match (
                time("robust_all_reduce audited r=1"),
                time("robust_all_reduce sharded r=1"),
            ) {
                (Some(a), Some(r1)) => format!("{:.2}", a / r1),
                _ => "-".to_string(),
            };
            print!(" {cell:>10}");
        }
        println!();
        // Memory against the vector: the goal is 3x (input, output, working shards). Only a
        // collective run alone (`--collectives sharded1`) is measured without the buffers the
        // others left idle.
        for (what, above_idle) in [
            ("sharded r=1 peak RSS / vector bytes", false),
            ("  the same, above the idle rank", true),
        ] {
            print!("{:>12}   {what:<40}", d * 4);
            for t in transports {
                let idle = match above_idle {
                    true => idle_mib(ours, t),
                    false => 0.0,
                };
                let cell = ours
                    .iter()
                    .find(|(tr, e, _, _, l)| {
                        tr == t && *e == d && l == "robust_all_reduce sharded r=1"
                    })
                    .map_or("-".to_string(), |r| {
                        format!("{:.2}", (r.3 - idle) / (d * 4) as f64 * (1 << 20) as f64)
                    });
                print!(" {cell:>10}");
            }
            println!();
        }
    }
}

/// The resident set (MiB) of the largest idle rank over `transport` (NaN if not recorded).
fn idle_mib(ours: &[Ours], transport: &str) -> f64 {
    ours.iter()
        .find(|(tr, _, _, _, l)| *tr == transport && l == IDLE)
        .map_or(f64::NAN, |r| r.3)
}

/// Runs the byzcoll ranks over one transport and returns its rows, or the exit code of a
/// failed run.
fn run_transport(
    runtime: &tokio::runtime::Runtime,
    args: &Args,
    transport: &'static str,
) -> Result<Vec<Ours>, u8> {
    let results = std::env::temp_dir().join(format!(
        "byzcoll-bench-{}-{transport}.txt",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&results);
    let exe = std::env::current_exe().expect("current exe");
    let mut command = vec![exe.into_os_string()];
    command.extend(std::env::args_os().skip(1));
    let runtime_flag = clap::ValueEnum::to_possible_value(&rank_runtime(transport))
        .expect("RankRuntime skips no variant");
    command.extend([
        "--rank-results".into(),
        results.as_os_str().to_owned(),
        "--rank-label".into(),
        transport.into(),
        "--rank-runtime".into(),
        runtime_flag.get_name().into(),
    ]);
    let mut env = transport_env(transport);
    env.push(("BYZCOLL_TIMEOUT_MS".into(), "120000".into()));
    println!();
    let spinner = rows::progress(None, transport);
    spinner.set_message(format!("{} ranks", args.ranks));
    let outcome = runtime.block_on(launch(LaunchOptions {
        ranks: args.ranks,
        command,
        grace: Duration::from_secs(5),
        env,
        identity: Default::default(),
        restarts: 0,
    }));
    spinner.finish_and_clear();
    let failed = match outcome {
        Ok(o) if o.exit_code == 0 => None,
        Ok(o) => Some(o.exit_code.clamp(1, 255) as u8),
        Err(e) => {
            eprintln!("collectives bench: {transport}: {e}");
            Some(1)
        }
    };
    let ours = std::fs::read_to_string(&results)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut it = l.splitn(4, ' ');
            let d = it.next()?.parse().ok()?;
            let secs = it.next()?.parse().ok()?;
            let rss = it.next()?.parse().unwrap_or(f64::NAN);
            Some((transport, d, secs, rss, it.next()?.to_string()))
        })
        .collect();
    let _ = std::fs::remove_file(&results);
    match failed {
        None => Ok(ours),
        Some(code) => {
            println!("# byzcoll over {transport} failed (exit {code}); see the ranks' stderr");
            Err(code)
        }
    }
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("collectives bench: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(rank) = &args.rank {
        let runtime = rows::runtime(rank.runtime == RankRuntime::MultiThread);
        return match runtime.block_on(worker(&args, rank)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("collectives bench: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let runtime = rows::runtime(true);
    // A transport that fails does not stop the others; the bench still exits with its code.
    let mut ours = Vec::new();
    let mut first_failure = None;
    for &transport in &args.transports {
        match run_transport(&runtime, &args, transport) {
            Ok(rows) => ours.extend(rows),
            Err(code) => {
                first_failure.get_or_insert(code);
            }
        }
    }
    let anchor = if args.anchor {
        println!();
        run_anchor(&args)
    } else {
        Vec::new()
    };
    if !anchor.is_empty() && !ours.is_empty() {
        print_ratios(
            &args.transports,
            args.mpi_btl,
            (args.ranks, args.f),
            &ours,
            &anchor,
        );
    }
    let mut table = rows::Rows::new(
        "collectives",
        json!({ "ranks": args.ranks, "dtype": "float32", "mpi_btl": args.mpi_btl }),
    );
    for (transport, d, secs, rss, label) in ours.iter().filter(|r| r.4 != IDLE) {
        table.push(
            json!({ "who": "byzcoll", "transport": transport, "collective": label,
            "bytes_per_rank": d * 4, "seconds": secs, "peak_rss_mib": rss,
            "idle_rss_mib": idle_mib(&ours, transport) }),
        );
    }
    for (d, secs, label) in &anchor {
        table.push(
            json!({ "who": "Open MPI", "transport": args.mpi_btl, "collective": label,
            "bytes_per_rank": d * 4, "seconds": secs }),
        );
    }
    table.write();
    match first_failure {
        None => ExitCode::SUCCESS,
        Some(code) => ExitCode::from(code),
    }
}
