//! Robust all-reduce of vectors that live on the GPU, as separate processes:
//!
//! ```sh
//! cargo build --release --features cuda,nccl --examples --bins
//! # Over NCCL, one rank per GPU, vectors device to device (the cross-check reads each back once):
//! sbatch examples/slurm_gpu_nccl.sbatch
//! BYZCOLL_TRANSPORT=nccl target/release/byzcoll launch -n 5 -- target/release/examples/gpu_allreduce
//! # Over TCP (or UCX, libfabric), ranks may share a GPU, f32 vectors staged through the host:
//! target/release/byzcoll launch -n 5 -- target/release/examples/gpu_allreduce
//! ```
//!
//! Options: `--d N` (elements per rank, default 2^24), `--byzantine K` (default up to 2,
//! keeping n > 2K; Krum runs only where n > 2K + 2 and says so otherwise), `--bf16` (bf16 vectors instead of f32; over NCCL only), `--rounds R` (timed
//! rounds, default 5). The highest K ranks attack: the last sends NaN/inf, the others a
//! sign-flipped vector scaled by 1000. For the median, the trimmed mean and Krum, in gather
//! mode and in sharded mode with `2f + 1` and with 1 owner per shard, every honest rank checks
//! its result (inside the honest range at every coordinate; Krum selects honest ranks only;
//! sharded equals gather for the coordinate-wise rules) and rank 0 prints the median time per
//! round. Exits non-zero on any mismatch. Each rank uses GPU `local rank mod visible GPUs`;
//! NCCL allows one rank per GPU, so on a one-GPU machine run it over NCCL with `-n 1`. Both
//! paths are the one call `robust_all_reduce_device(&mut comm, ...)` on the communicator
//! `byzcoll::init` returns, under the communicator's agreement policy (`Detect` unless
//! `BYZCOLL_AGREEMENT` says otherwise) on every transport.

#![allow(clippy::print_stdout)]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use byzcoll::aggregators::{Aggregator as _, Params};
use byzcoll::cuda::{robust_all_reduce_device, CudaRule, Gpu, GpuElement};
use byzcoll::{Communicator, Policy, Replicas};

mod common;
use common::{honest, in_honest_range};

/// The element types the example runs with.
trait Value: GpuElement {
    const NAME: &'static str;
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl Value for f32 {
    const NAME: &'static str = "f32";
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Value for half::bf16 {
    const NAME: &'static str = "bf16";
    fn from_f32(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}

/// Joins the job.
async fn join() -> Result<Communicator, String> {
    byzcoll::init().await.map_err(|e| e.to_string())
}

/// This rank's GPU: NCCL's, or the local rank's.
fn gpu(comm: &Communicator) -> Result<Arc<Gpu>, String> {
    #[cfg(feature = "nccl")]
    if let Some(nccl) = comm
        .transport()
        .as_any()
        .and_then(|t| t.downcast_ref::<byzcoll::transports::nccl::NcclTransport>())
    {
        return Gpu::new(nccl.device()).map_err(|e| e.to_string());
    }
    let job = byzcoll::JobConfig::from_env().map_err(|e| e.to_string())?;
    Gpu::for_rank(job.launch().local_rank, comm.rank()).map_err(|e| e.to_string())
}

/// The command line.
#[derive(clap::Parser)]
struct Args {
    /// Elements per vector.
    #[arg(long, default_value_t = 1 << 24)]
    d: usize,
    /// How many of the highest ranks attack (default: up to 2, keeping n > 2K).
    #[arg(long)]
    byzantine: Option<usize>,
    /// Rounds per configuration (at least 1).
    #[arg(long, default_value_t = 5, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    rounds: usize,
    /// Aggregate bf16 vectors instead of f32.
    #[arg(long)]
    bf16: bool,
}

async fn run<E: Value>(a: &Args, comm: &mut Communicator) -> Result<(), String> {
    let (d, rounds) = (a.d, a.rounds);
    let (me, n) = (comm.rank(), comm.size());
    let k = a.byzantine.unwrap_or(2.min(n.saturating_sub(1) / 2));
    if n <= 2 * k {
        return Err(format!(
            "{k} Byzantine ranks need more than {} ranks",
            2 * k
        ));
    }
    let gpu = gpu(comm)?;
    let stream = gpu.stream().clone();
    let byzantine = me >= n - k;
    let mine: Vec<E> = if !byzantine {
        honest(me, d).into_iter().map(E::from_f32).collect()
    } else if me == n - 1 {
        (0..d)
            .map(|j| E::from_f32([f32::NAN, f32::INFINITY, f32::NEG_INFINITY][j % 3]))
            .collect()
    } else {
        honest(me, d)
            .into_iter()
            .map(|x| E::from_f32(-1000.0 * x))
            .collect()
    };
    // The honest inputs as the ranks hold them (rounded to E), for the range check.
    let all: Vec<Vec<f32>> = (0..n - k)
        .map(|r| {
            honest(r, d)
                .into_iter()
                .map(|x| E::from_f32(x).to_f32())
                .collect()
        })
        .collect();
    let params = Params {
        f: k,
        ..Params::default()
    };
    for name in ["median", "trimmed-mean", "krum"] {
        let rule = CudaRule::new(gpu.clone(), name, &params).map_err(|e| e.to_string())?;
        if let Err(why) = rule.check(n) {
            if me == 0 {
                println!("{name:<13} not run: {why}");
            }
            continue;
        }
        let mut gathered: Option<Vec<f32>> = None;
        for (label, policy) in [
            ("gather", Policy::Gather),
            ("sharded r=2f+1", Policy::Sharded(Replicas::Tolerant)),
            ("sharded r=1", Policy::Sharded(Replicas::Exactly(1))),
        ] {
            let mut times = Vec::with_capacity(rounds);
            let mut result = Vec::new();
            let mut selected = None;
            for _ in 0..rounds {
                let mut buf = stream.clone_htod(&mine).map_err(|e| e.to_string())?;
                stream.synchronize().map_err(|e| e.to_string())?;
                let start = Instant::now();
                selected = robust_all_reduce_device(comm, &mut buf, &rule, policy)
                    .await
                    .map(|report| report.selected)
                    .map_err(|e| format!("{name} {label}: {e}"))?;
                times.push(start.elapsed());
                let host = stream.clone_dtoh(&buf).map_err(|e| e.to_string())?;
                result = host.into_iter().map(E::to_f32).collect();
            }
            times.sort();
            if !byzantine {
                check(name, label, &result, &all, selected.as_deref(), n - k)?;
                match (&gathered, name) {
                    (None, _) => gathered = Some(result.clone()),
                    (Some(g), "median" | "trimmed-mean") if *g != result => {
                        return Err(format!("{name}: {label} differs from gather mode"));
                    }
                    _ => {}
                }
            }
            if me == 0 {
                let t = times[times.len() / 2];
                let bytes = (n * d * std::mem::size_of::<E>()) as f64;
                println!(
                    "{name:<13} {label:<15} n = {n} f = {k} d = {d} {}: {:9.3} ms median of {rounds} ({:6.1} GB/s of all inputs)",
                    E::NAME,
                    t.as_secs_f64() * 1e3,
                    bytes / t.as_secs_f64() / 1e9,
                );
            }
        }
    }
    if me == 0 {
        println!(
            "OK: {n} ranks over {}, device vectors, every honest result checked",
            comm.transport().name()
        );
    }
    Ok(())
}

/// The honest ranks' checks: every coordinate inside the honest range; Krum selects honest
/// ranks only.
fn check(
    name: &str,
    label: &str,
    v: &[f32],
    honest: &[Vec<f32>],
    selected: Option<&[usize]>,
    honest_ranks: usize,
) -> Result<(), String> {
    if let Some(s) = selected {
        if let Some(bad) = s.iter().find(|&&r| r >= honest_ranks) {
            return Err(format!("{name} {label} selected Byzantine rank {bad}"));
        }
    }
    in_honest_range(&format!("{name} {label}"), v, honest)
}

#[tokio::main]
async fn main() -> ExitCode {
    let outcome = async {
        let a = <Args as clap::Parser>::parse();
        let mut comm = join().await?;
        // Every input is waited for: the run compares gather mode's result with sharded
        // mode's bitwise, which an honest input left out of a quorum round for its timing
        // alone would change (every rank makes the same choice).
        comm.set_stragglers(byzcoll::Stragglers::Exactly(0));
        let ran = match a.bf16 {
            true => run::<half::bf16>(&a, &mut comm).await,
            false => run::<f32>(&a, &mut comm).await,
        };
        comm.close().await;
        ran
    }
    .await;
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu_allreduce: {e}");
            ExitCode::FAILURE
        }
    }
}
