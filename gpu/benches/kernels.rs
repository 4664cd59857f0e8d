//! GPU benchmark of the CUDA rules against their PyTorch equivalents (issue #7).
//!
//! ```text
//! LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib cargo bench -p byzcoll-cuda \
//!     --bench kernels -- --n 8,16,32,64,128 --exp 25 --rules median,trimmed-mean,krum
//! ```
//!
//! For each `n` the `n` inputs of `d = 2^exp` floats are generated on the device by a hash of
//! the flat index (`value` below; `benches/anchors/torch_aggregators.py` generates bitwise the
//! same data with torch integer ops), then:
//!
//! - **copy**: a device-to-device copy of the `n·d` floats, timed with events after warm-up.
//!   Its bytes moved (read + write) per second is the measured memory bandwidth; the **read
//!   bound** of a rule is the time to move the `n·d·4` input bytes at that rate (half the copy's
//!   time), and `bound` in the table is `read bound / rule time`.
//! - **rules**: each [`CudaRule`] call timed with device events around the whole call after
//!   warm-up (median of `--iters`), data already on the device. A call includes its small
//!   transfers (row table, status word) and its final synchronisation; Krum's also includes the
//!   copy of the `n × n` distance table to the host and the host-side selection. `wall` is the
//!   host's clock around the same call. cudarc's cross-stream event tracking is switched off
//!   (everything here runs on the rule's one stream) unless `--event-tracking`.
//! - **torch**: the anchor script, run once before the Rust measurements (so both never hold
//!   GPU memory at once), times `torch.median(x, dim=0)`, the sort-based trimmed mean and a
//!   `torch.cdist` Krum on the same data with CUDA events.
//! - **checks** at one `n`: the generated values agree with the host formula (device and torch
//!   samples), the CUDA median agrees with torch's (the CUDA median of an even `n` is the midpoint
//!   of the two middle values, `torch.median` the lower one: both are compared), the trimmed
//!   means and Krum's selections are compared, and input 0 is set to NaN on a range of
//!   coordinates: the CUDA median stays finite there, `torch.median` returns NaN.
//!
//! `f = n / 4` for every rule (Krum needs `n > 2f + 2`). Without a usable GPU the benchmark
//! prints `SKIPPED: <reason>` and exits 0; `--self-check` prints the data formula's values
//! (compare with `python3 benches/anchors/torch_aggregators.py --self-check`) and compiles the
//! generator kernel with NVRTC when it is present, without a GPU.

// A benchmark's report is its output.
#![allow(clippy::print_stdout)]

use std::error::Error;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::Instant;

use byzcoll_aggregators::Params;
use byzcoll_cuda::{CudaRule, Gpu};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaFunction, CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{self, CompileOptions};
use serde_json::Value as Json;

type BoxError = Box<dyn Error>;

const SEED: u32 = 0x5EED;
const MUL1: u32 = 0x7FEB_352D;
const MUL2: u32 = 0x3184_8BAB;

/// Indices and index ranges `--self-check` prints; the Python script prints the same.
const SAMPLE_INDICES: [u64; 11] = [
    0,
    1,
    2,
    12345,
    (1 << 25) - 1,
    1 << 25,
    16 * (1 << 25) - 1,
    (1 << 32) - 1,
    1 << 32,
    (1 << 32) + 7,
    (1 << 40) + 3,
];
const BIT_SUM_RANGES: [(u64, u64); 2] = [(0, 1 << 20), ((1 << 32) - (1 << 19), 1 << 20)];

/// The generator kernel: the formula of [`value`], one thread per element, grid-stride.
const GENERATOR: &str = r#"
__device__ __forceinline__ unsigned int mix(unsigned int x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x31848babu;
    x ^= x >> 16;
    return x;
}

extern "C" __global__ void fill_hash(float* out, unsigned long long base, unsigned long long len) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         k < len; k += stride) {
        unsigned long long i = base + k;
        unsigned int h = mix((unsigned int)i ^ mix((unsigned int)(i >> 32) ^ 0x5eedu));
        out[k] = (float)(h >> 8) * 1.1920928955078125e-7f - 1.0f;
    }
}
"#;

fn mix(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(MUL1);
    x ^= x >> 15;
    x = x.wrapping_mul(MUL2);
    x ^ (x >> 16)
}

/// The generated value at flat index `i = row * d + col`: uniform on `[-1, 1)` in steps of
/// 2^-23, exact in `f32`.
fn value(i: u64) -> f32 {
    let h = mix(i as u32 ^ mix((i >> 32) as u32 ^ SEED));
    (h >> 8) as f32 * (1.0 / (1u32 << 23) as f32) - 1.0
}

struct Args {
    ns: Vec<usize>,
    exp: u32,
    rules: Vec<String>,
    iters: usize,
    warmup: usize,
    torch: bool,
    python: String,
    script: Option<PathBuf>,
    check_n: Option<usize>,
    out: Option<PathBuf>,
    event_tracking: bool,
    self_check: bool,
}

const USAGE: &str = "kernels [--n 8,16,32,64,128] [--exp 25] [--rules median,trimmed-mean,krum] \
[--iters 10] [--warmup 2] [--no-torch] [--python python3] [--torch-script PATH] [--check-n N] \
[--out FILE] [--event-tracking] [--self-check]";

fn parse_args() -> Result<Args, BoxError> {
    let mut args = Args {
        ns: vec![8, 16, 32, 64, 128],
        exp: 25,
        rules: ["median", "trimmed-mean", "krum"]
            .map(String::from)
            .to_vec(),
        iters: 10,
        warmup: 2,
        torch: true,
        python: "python3".into(),
        script: None,
        check_n: None,
        out: None,
        event_tracking: false,
        self_check: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let (key, inline) = match arg.split_once('=') {
            Some((k, v)) => (k.to_string(), Some(v.to_string())),
            None => (arg.clone(), None),
        };
        let mut value = || -> Result<String, BoxError> {
            inline
                .clone()
                .or_else(|| it.next())
                .ok_or_else(|| format!("{key} needs a value\nusage: {USAGE}").into())
        };
        match key.as_str() {
            // Passed by `cargo bench` to every bench target.
            "--bench" => {}
            "--n" => {
                args.ns = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--exp" => args.exp = value()?.parse()?,
            "--rules" => args.rules = value()?.split(',').map(String::from).collect(),
            "--iters" => args.iters = value()?.parse()?,
            "--warmup" => args.warmup = value()?.parse()?,
            "--no-torch" => args.torch = false,
            "--python" => args.python = value()?,
            "--torch-script" => args.script = Some(value()?.into()),
            "--check-n" => args.check_n = Some(value()?.parse()?),
            "--out" => args.out = Some(value()?.into()),
            "--event-tracking" => args.event_tracking = true,
            "--self-check" => args.self_check = true,
            "--help" | "-h" => return Err(format!("usage: {USAGE}").into()),
            other => return Err(format!("unknown argument {other}\nusage: {USAGE}").into()),
        }
    }
    if args.ns.is_empty()
        || args.ns.contains(&0)
        || args.iters == 0
        || !(4..=34).contains(&args.exp)
    {
        return Err(format!("need n >= 1, --iters >= 1, 4 <= --exp <= 34\nusage: {USAGE}").into());
    }
    Ok(args)
}

fn main() -> ExitCode {
    match parse_args().and_then(run) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), BoxError> {
    if args.self_check {
        return self_check();
    }
    let gpu = match Gpu::probe() {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("SKIPPED: {e}");
            return Ok(());
        }
    };
    let d = 1usize << args.exp;
    let check_n = args.check_n.unwrap_or(if args.ns.contains(&16) {
        16
    } else {
        args.ns[0]
    });
    let check_start = d / 2 + 1;
    let check_count = 4096.min(d - check_start);

    let mut report = String::new();
    let ctx = gpu.context().clone();
    writeln!(
        report,
        "# byzcoll-cuda kernels vs PyTorch\n\ndevice: {} ({}, {} SMs); d = 2^{} float32; f = n / 4; \
         {} warm-up calls, median of {} timed calls",
        ctx.name()?,
        gpu.arch(),
        gpu.sms(),
        args.exp,
        args.warmup,
        args.iters
    )?;

    let torch = if args.torch {
        run_torch(&args, check_n, check_start, check_count)
    } else {
        Err("disabled by --no-torch".to_string())
    };
    match &torch {
        Ok(t) => writeln!(
            report,
            "torch: {} on {}",
            t.get("torch").and_then(Json::as_str).unwrap_or("?"),
            t.get("device").and_then(Json::as_str).unwrap_or("?")
        )?,
        Err(why) => writeln!(report, "torch: not available ({why})")?,
    }
    print!("{report}");

    if !args.event_tracking {
        // SAFETY: every buffer and kernel of this process lives on the one stream `gpu.stream()`,
        // so cudarc's cross-stream events have nothing to order.
        unsafe { ctx.disable_event_tracking() };
    }
    let generator = compile_generator(gpu.arch())?;
    let generator = ctx.load_module(generator)?.load_function("fill_hash")?;

    let mut copies = Vec::new();
    let mut rows = Vec::new();
    let mut checks = String::new();
    for &n in &args.ns {
        let bench = Bench {
            gpu: &gpu,
            n,
            d,
            args: &args,
        };
        println!(
            "# n = {n}: generating {:.2} GiB",
            bench.bytes() / (1u64 << 30) as f64
        );
        let mut data = bench.stream().alloc_zeros::<f32>(n * d)?;
        bench.generate(&generator, &mut data)?;
        let bad_samples = bench.check_samples(&data)?;
        if bad_samples > 0 {
            return Err(format!(
                "the device generator disagrees with the host formula at {bad_samples} samples"
            )
            .into());
        }
        let copy_ms = bench.copy_ms(&data)?;
        let bound_ms = copy_ms / 2.0;
        println!(
            "# n = {n}: d2d copy {copy_ms:.3} ms = {:.0} GB/s read+write; read bound {bound_ms:.3} ms",
            2.0 * bench.bytes() / copy_ms / 1e6
        );
        copies.push(CopyTiming {
            n,
            bytes: bench.bytes(),
            copy_ms,
            bound_ms,
        });
        for rule in &args.rules {
            let Some(timing) = bench.time_rule(rule, &data)? else {
                continue;
            };
            let torch_ms = torch.as_ref().ok().and_then(|t| torch_ms(t, n, rule));
            println!(
                "# n = {n}: {rule} {:.3} ms (torch {})",
                timing.event_ms,
                torch_ms.map_or("—".into(), |t| format!("{t:.3} ms"))
            );
            rows.push(Row {
                n,
                rule: rule.clone(),
                f: n / 4,
                ms: timing.event_ms,
                wall_ms: timing.wall_ms,
                gbps: bench.bytes() / timing.event_ms / 1e6,
                bound: bound_ms / timing.event_ms,
                torch_ms,
            });
        }
        if n == check_n {
            let reference = torch
                .as_ref()
                .ok()
                .and_then(|t| t.get("check"))
                .filter(|c| !matches!(c, Json::Null));
            checks = bench.checks(&mut data, reference, check_start, check_count)?;
        }
    }

    let table = render(&copies, &rows, &checks);
    println!("\n{table}");
    let path = args.out.clone().unwrap_or_else(default_out);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&path, format!("{report}\n{table}"))?;
    println!("written to {}", path.display());
    Ok(())
}

struct Bench<'a> {
    gpu: &'a Arc<Gpu>,
    n: usize,
    d: usize,
    args: &'a Args,
}

struct Timing {
    event_ms: f64,
    wall_ms: f64,
}

struct CopyTiming {
    n: usize,
    /// Input bytes `n·d·4` (the copy moves twice as many).
    bytes: f64,
    copy_ms: f64,
    bound_ms: f64,
}

struct Row {
    n: usize,
    rule: String,
    f: usize,
    ms: f64,
    wall_ms: f64,
    gbps: f64,
    bound: f64,
    torch_ms: Option<f64>,
}

impl Bench<'_> {
    fn stream(&self) -> &Arc<cudarc::driver::CudaStream> {
        self.gpu.stream()
    }

    /// Input bytes, `n·d·4`.
    fn bytes(&self) -> f64 {
        (self.n * self.d * 4) as f64
    }

    fn params(&self) -> Params {
        Params {
            f: self.n / 4,
            ..Params::default()
        }
    }

    fn generate(&self, func: &CudaFunction, data: &mut CudaSlice<f32>) -> Result<(), BoxError> {
        let (base, len) = (0u64, data.len() as u64);
        let cfg = LaunchConfig {
            grid_dim: (self.gpu.sms() * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream().launch_builder(func);
        launch.arg(data).arg(&base).arg(&len);
        // SAFETY: `fill_hash` writes `len` floats to `data`, which holds `len`.
        unsafe { launch.launch(cfg) }?;
        self.stream().synchronize()?;
        Ok(())
    }

    /// How many sampled device values differ from the host formula.
    fn check_samples(&self, data: &CudaSlice<f32>) -> Result<usize, BoxError> {
        let len = data.len() as u64;
        let mut bad = 0;
        for i in [0, 1, len / 3, (len / 2 + 7).min(len - 1), len - 1] {
            let got = self
                .stream()
                .clone_dtoh(&data.slice(i as usize..i as usize + 1))?;
            if got.first().map(|v| v.to_bits()) != Some(value(i).to_bits()) {
                bad += 1;
            }
        }
        Ok(bad)
    }

    /// Median event time of a copy of all `n·d` floats.
    fn copy_ms(&self, data: &CudaSlice<f32>) -> Result<f64, BoxError> {
        let stream = self.stream();
        let mut dst = stream.alloc_zeros::<f32>(data.len())?;
        self.timed(|| Ok(stream.memcpy_dtod(data, &mut dst)?))
            .map(|t| t.event_ms)
    }

    /// Warm-up calls, then the median event and wall times of `--iters` calls of `op`.
    fn timed(&self, mut op: impl FnMut() -> Result<(), BoxError>) -> Result<Timing, BoxError> {
        let (stream, ctx) = (self.stream(), self.gpu.context());
        for _ in 0..self.args.warmup {
            op()?;
        }
        stream.synchronize()?;
        let mut events = Vec::new();
        let mut walls = Vec::new();
        for _ in 0..self.args.iters {
            let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            let clock = Instant::now();
            start.record(stream)?;
            op()?;
            end.record(stream)?;
            end.synchronize()?;
            walls.push(clock.elapsed().as_secs_f64() * 1e3);
            events.push(f64::from(start.elapsed_ms(&end)?));
        }
        Ok(Timing {
            event_ms: median(&mut events),
            wall_ms: median(&mut walls),
        })
    }

    fn views<'a>(&self, data: &'a CudaSlice<f32>) -> Vec<CudaView<'a, f32>> {
        (0..self.n)
            .map(|r| data.slice(r * self.d..(r + 1) * self.d))
            .collect()
    }

    /// Times `rule` at this `n`, or `None` (with a note) when the rule refuses it.
    fn time_rule(&self, rule: &str, data: &CudaSlice<f32>) -> Result<Option<Timing>, BoxError> {
        let cuda = CudaRule::new(self.gpu.clone(), rule, &self.params())?;
        let inputs = self.views(data);
        let mut out = self.stream().alloc_zeros::<f32>(self.d)?;
        if let Err(e) = cuda.aggregate_device::<f32, _, _>(&inputs, &mut out) {
            println!("# n = {}: {rule} not timed: {e}", self.n);
            return Ok(None);
        }
        self.timed(|| {
            cuda.aggregate_device::<f32, _, _>(&inputs, &mut out)?;
            Ok(())
        })
        .map(Some)
    }

    /// `rule` on the device data; the result over `[start, start + count)` and the report's
    /// selection.
    fn result_slice(
        &self,
        rule: &str,
        data: &CudaSlice<f32>,
        start: usize,
        count: usize,
    ) -> Result<(Vec<f32>, Option<Vec<usize>>), BoxError> {
        let cuda = CudaRule::new(self.gpu.clone(), rule, &self.params())?;
        let mut out = self.stream().alloc_zeros::<f32>(self.d)?;
        let report = cuda.aggregate_device::<f32, _, _>(&self.views(data), &mut out)?;
        let values = self.stream().clone_dtoh(&out.slice(start..start + count))?;
        Ok((values, report.selected))
    }

    /// The result checks against torch (when it ran) and the NaN check; `data` ends with input
    /// 0 set to NaN on the checked range.
    fn checks(
        &self,
        data: &mut CudaSlice<f32>,
        reference: Option<&Json>,
        start: usize,
        count: usize,
    ) -> Result<String, BoxError> {
        let (n, f) = (self.n, self.n / 4);
        let mut s = String::new();
        writeln!(
            s,
            "## Checks at n = {n}, f = {f}, coordinates [{start}, {})\n",
            start + count
        )?;
        let (median, _) = self.result_slice("median", data, start, count)?;
        let (trimmed, _) = self.result_slice("trimmed-mean", data, start, count)?;
        let krum = if n > 2 * f + 2 {
            self.result_slice("krum", data, 0, 1)?.1
        } else {
            None
        };
        match reference {
            None => writeln!(s, "- torch results: not available")?,
            Some(r) => {
                let samples = r
                    .get("samples")
                    .and_then(Json::as_array)
                    .map_or(&[][..], Vec::as_slice);
                let same = samples
                    .iter()
                    .filter(|p| {
                        let p = p.as_array().map_or(&[][..], Vec::as_slice);
                        let (i, v) = (
                            p.first().and_then(Json::as_f64),
                            p.get(1).and_then(Json::as_f64),
                        );
                        matches!((i, v), (Some(i), Some(v)) if f64::from(value(i as u64)) == v)
                    })
                    .count();
                writeln!(
                    s,
                    "- data: {same} of {} torch-generated samples equal the host formula bitwise",
                    samples.len()
                )?;
                let diff = |key: &str, ours: &[f32]| -> String {
                    let theirs = r
                        .get(key)
                        .and_then(Json::as_array)
                        .map_or(&[][..], Vec::as_slice);
                    if theirs.len() != ours.len() {
                        return format!("— (torch gave {} values)", theirs.len());
                    }
                    let max = ours
                        .iter()
                        .zip(theirs)
                        .map(|(a, b)| b.as_f64().map_or(f64::NAN, |b| (f64::from(*a) - b).abs()))
                        .fold(0.0f64, |m, x| {
                            if x.is_nan() || m.is_nan() {
                                f64::NAN
                            } else {
                                m.max(x)
                            }
                        });
                    format!("{max:.3e}")
                };
                writeln!(
                    s,
                    "- median: max |byzcoll − midpoint of the two middle values (torch sort)| = {}; \
                     max |byzcoll − torch.median| = {} (torch.median returns the lower middle \
                     value for even n)",
                    diff("median_mid", &median),
                    diff("median_lower", &median)
                )?;
                writeln!(
                    s,
                    "- trimmed mean: max |byzcoll − torch sort-based| = {} (byzcoll sums in f64, \
                     torch in f32)",
                    diff("trimmed_mean", &trimmed)
                )?;
                let theirs = r.get("krum_selected").and_then(Json::as_f64);
                writeln!(
                    s,
                    "- Krum selected: byzcoll {:?}, torch (cdist) {}",
                    krum,
                    theirs.map_or("—".into(), |t| format!("{t}"))
                )?;
            }
        }
        let nan = vec![f32::NAN; count];
        self.stream()
            .memcpy_htod(&nan, &mut data.slice_mut(start..start + count))?;
        let cuda = match self.result_slice("median", data, start, count) {
            Ok((values, _)) => format!(
                "byzcoll median finite on {} of {count} coordinates",
                values.iter().filter(|v| v.is_finite()).count()
            ),
            Err(e) => format!("byzcoll median failed: {e}"),
        };
        let theirs = reference
            .and_then(|r| r.get("nan_row0_median_nan"))
            .and_then(Json::as_f64)
            .map_or("torch: —".into(), |c| {
                format!("torch.median NaN on {c} of {count}")
            });
        writeln!(s, "- input 0 NaN on the range: {cuda}; {theirs}")?;
        Ok(s)
    }
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    let m = xs.len() / 2;
    if xs.len() % 2 == 1 {
        xs[m]
    } else {
        0.5 * (xs[m - 1] + xs[m])
    }
}

fn compile_generator(arch: &str) -> Result<nvrtc::Ptx, BoxError> {
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}")],
        name: Some("bench_generator.cu".into()),
        ..Default::default()
    };
    nvrtc::compile_ptx_with_opts(GENERATOR, opts)
        .map_err(|e| format!("NVRTC could not compile the data generator: {e:?}").into())
}

fn self_check() -> Result<(), BoxError> {
    println!("# byzcoll bench data formula (Rust host)");
    for i in SAMPLE_INDICES {
        let v = value(i);
        println!("value[{i}] = {} bits={:08x}", fmt_g9(v), v.to_bits());
    }
    for (start, len) in BIT_SUM_RANGES {
        let sum: u64 = (start..start + len)
            .map(|i| u64::from(value(i).to_bits()))
            .sum();
        println!("bitsum[{start}..{}) = {sum}", start + len);
    }
    // SAFETY: only tries to open the library.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        compile_generator("compute_90")?;
        println!("# generator kernel compiles with NVRTC for compute_90");
    } else {
        println!("# NVRTC not found: generator kernel not compiled");
    }
    Ok(())
}

/// `v` as Python's `f"{v:.9g}"` prints it.
fn fmt_g9(v: f32) -> String {
    let v = f64::from(v);
    if v == 0.0 {
        return "0".into();
    }
    let exp = v.abs().log10().floor() as i32;
    let s = if (-5..9).contains(&exp) {
        format!("{:.*}", (8 - exp).max(0) as usize, v)
    } else {
        format!("{v:.8e}")
    };
    if s.contains('.') && !s.contains('e') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Runs the torch anchor once for every `n`; its JSON, or why there is none.
fn run_torch(
    args: &Args,
    check_n: usize,
    check_start: usize,
    check_count: usize,
) -> Result<Json, String> {
    let script = args
        .script
        .clone()
        .or_else(find_script)
        .ok_or("benches/anchors/torch_aggregators.py not found (--torch-script)")?;
    let ns: Vec<String> = args.ns.iter().map(usize::to_string).collect();
    println!(
        "# running {} {} (torch timings)",
        args.python,
        script.display()
    );
    let output = Command::new(&args.python)
        .arg(&script)
        .args(["--n", &ns.join(",")])
        .args(["--exp", &args.exp.to_string()])
        .args(["--rules", &args.rules.join(",")])
        .args(["--iters", &args.iters.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(["--check-n", &check_n.to_string()])
        .args(["--check-start", &check_start.to_string()])
        .args(["--check-count", &check_count.to_string()])
        .arg("--json")
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("{}: {e}", args.python))?;
    if !output.status.success() {
        return Err(format!("the torch script exited with {}", output.status));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or("the torch script printed no JSON")?;
    let json = serde_json::from_str::<Json>(line).map_err(|e| e.to_string())?;
    match json.get("available") {
        Some(Json::Bool(true)) => Ok(json),
        _ => Err(json
            .get("reason")
            .and_then(Json::as_str)
            .unwrap_or("the torch script reported it cannot run")
            .to_string()),
    }
}

fn find_script() -> Option<PathBuf> {
    const REL: &str = "benches/anchors/torch_aggregators.py";
    let mut candidates = vec![PathBuf::from(REL), PathBuf::from("..").join(REL)];
    candidates.push(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(REL),
    );
    candidates.into_iter().find(|p| p.is_file())
}

fn torch_ms(torch: &Json, n: usize, rule: &str) -> Option<f64> {
    torch
        .get("results")?
        .as_array()?
        .iter()
        .find(|r| {
            r.get("n").and_then(Json::as_f64) == Some(n as f64)
                && r.get("rule").and_then(Json::as_str) == Some(rule)
        })?
        .get("ms")?
        .as_f64()
}

/// The target directory this binary was built in (`<target>/<profile>/deps/`), else `target/`.
fn default_out() -> PathBuf {
    let built_in = || {
        let exe = std::env::current_exe().ok()?;
        let deps = exe.parent()?;
        (deps.file_name()? == "deps").then(|| deps.parent()?.parent().map(PathBuf::from))?
    };
    let target = built_in().unwrap_or_else(|| PathBuf::from("target"));
    target.join("byzcoll-bench").join("kernels.md")
}

fn render(copies: &[CopyTiming], rows: &[Row], checks: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "## Copy bandwidth (read bound = n·d·4 bytes at the copy's read+write rate = copy time / 2)\n\n\
         | n | d2d copy ms | GB/s read+write | read bound ms |\n| --- | --- | --- | --- |"
    );
    for c in copies {
        let _ = writeln!(
            s,
            "| {} | {:.3} | {:.0} | {:.3} |",
            c.n,
            c.copy_ms,
            2.0 * c.bytes / c.copy_ms / 1e6,
            c.bound_ms
        );
    }
    let _ = writeln!(
        s,
        "\n## Rules (device events around the whole call; Krum includes its host-side selection)\n\n\
         | n | rule | f | byzcoll ms | wall ms | GB/s of input | fraction of read bound | torch ms | × torch |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    for r in rows {
        let (torch, ratio) = match r.torch_ms {
            Some(t) => (format!("{t:.3}"), format!("{:.1}×", t / r.ms)),
            None => ("—".into(), "—".into()),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.3} | {:.3} | {:.0} | {:.0}% | {torch} | {ratio} |",
            r.n,
            r.rule,
            r.f,
            r.ms,
            r.wall_ms,
            r.gbps,
            100.0 * r.bound
        );
    }
    let _ = writeln!(s, "\n## Goals (issue #7)\n");
    for line in goals(rows) {
        let _ = writeln!(s, "- {line}");
    }
    if !checks.is_empty() {
        let _ = writeln!(s, "\n{checks}");
    }
    s
}

fn goals(rows: &[Row]) -> Vec<String> {
    let coordinate = |r: &&Row| r.rule == "median" || r.rule == "trimmed-mean";
    let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
    let mut out = Vec::new();
    let small: Vec<&Row> = rows
        .iter()
        .filter(coordinate)
        .filter(|r| r.n <= 32)
        .collect();
    if let Some(worst) = small.iter().min_by(|a, b| a.bound.total_cmp(&b.bound)) {
        out.push(format!(
            "median and trimmed mean ≥ 90% of the read bound for n ≤ 32: {} (worst {:.0}%, {} at n = {})",
            verdict(worst.bound >= 0.9),
            100.0 * worst.bound,
            worst.rule,
            worst.n
        ));
    }
    for r in rows.iter().filter(coordinate).filter(|r| r.n == 16) {
        out.push(format!(
            "{} ≤ 0.55 ms at n = 16: {} ({:.3} ms)",
            r.rule,
            verdict(r.ms <= 0.55),
            r.ms
        ));
    }
    for r in rows.iter().filter(coordinate).filter(|r| r.n == 64) {
        out.push(match r.torch_ms {
            Some(t) => format!(
                "{} ≥ 40× torch at n = 64: {} ({:.1}×)",
                r.rule,
                verdict(t / r.ms >= 40.0),
                t / r.ms
            ),
            None => format!("{} ≥ 40× torch at n = 64: not measured (no torch)", r.rule),
        });
    }
    for r in rows.iter().filter(|r| r.rule == "krum") {
        out.push(format!(
            "Krum ≤ 3× the read bound at n = {}: {} ({:.2}× the bound)",
            r.n,
            verdict(r.bound >= 1.0 / 3.0),
            1.0 / r.bound
        ));
    }
    out
}
