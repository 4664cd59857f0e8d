//! Point-to-point latency and bandwidth of byzcoll's transports, side by side with
//! `ucx_perftest` on the same `UCX_TLS` and `fi_pingpong` on the same libfabric provider, in one
//! run.
//!
//! ```sh
//! cargo bench --features ucx,libfabric --bench p2p       # 8 B .. 64 MiB
//! cargo bench --features ucx --bench p2p -- --max-exp 22 --no-anchor
//! cargo bench --features ucx,libfabric --bench p2p -- --only ucx-sm,fi-shm --window 1
//! cargo bench --features ucx,libfabric --bench p2p -- --max-exp 3 --multi-thread
//! ```
//!
//! The ranks run on a current-thread tokio runtime (`--multi-thread`: the multi-threaded one).
//! They are copies of this binary that `byzcoll_cli::launch` starts with the launcher's command
//! line plus the hidden `--rank-results` and `--rank-label`.
//!
//! Two ranks on 127.0.0.1 (UCX pinned with `UCX_NET_DEVICES=lo`). Latency: ping-pong of 8-byte
//! messages, reported one way (half the round trip). Bandwidth: rank 0 sends windows of 8
//! messages (8 tags in one step; `--window`) to rank 1, which acknowledges the last window;
//! MiB/s of payload. Each message of a window lands in its own receive buffer, so a window of 8
//! touches 8× the memory of `ucx_perftest`, which reuses one buffer: `--window 1` is the
//! like-for-like footprint. `--only` picks configurations by label (tcp, ucx-tcp, ucx-sm, fi-tcp,
//! fi-shm; the matching anchor runs with each). Configurations: byzcoll TCP; byzcoll UCX with
//! `UCX_TLS=tcp` and `UCX_TLS=sm` (when built with `--features ucx`). The anchor is `ucx_perftest -t tag_lat` / `-t tag_bw`
//! with the same `UCX_TLS` and message size; the ratio column is byzcoll / ucx_perftest
//! bandwidth.

#![allow(clippy::print_stdout)]

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use byzcoll::{Communicator, RecvOp, SendOp, Transport};
use byzcoll_cli::launch::{launch, LaunchOptions};
use serde_json::json;

#[path = "common/rows.rs"]
mod rows;

/// The command line (bad values are refused with clap's message and status 2).
#[derive(clap::Parser)]
struct Args {
    /// Smallest message: 2^min-exp bytes.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=28))]
    min_exp: u32,
    /// Largest message: 2^max-exp bytes.
    #[arg(long, default_value_t = 26, value_parser = clap::value_parser!(u32).range(0..=28))]
    max_exp: u32,
    /// Skip ucx_perftest and fi_pingpong.
    #[arg(long = "no-anchor", action = clap::ArgAction::SetFalse)]
    anchor: bool,
    /// Run the ranks on tokio's multi-threaded runtime (two workers) instead of a
    /// current-thread one, where the awaiting task reads its frames itself.
    #[arg(long)]
    multi_thread: bool,
    /// Messages per step in the bandwidth test.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=64))]
    window: u32,
    /// Which configurations to run, comma-separated (`tcp,ucx-sm,...`; all when absent).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Print each `ucx_perftest` client's exit status and full output on stderr.
    #[arg(long)]
    debug: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
    /// Set by the launcher on its ranks' command lines, never by hand: the file rank 0 appends
    /// its results to. A process is one of the launched ranks iff it is given this flag.
    #[arg(long, hide = true, value_name = "PATH")]
    rank_results: Option<PathBuf>,
    /// Set by the launcher with `--rank-results`: the configuration (`tcp`, `ucx-sm`, ...) that
    /// labels the results (default: the transport's name).
    #[arg(long, hide = true, value_name = "LABEL", requires = "rank_results")]
    rank_label: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let args: Args = rows::parse_cli()?;
    if args.min_exp > args.max_exp {
        return Err(format!(
            "--min-exp {} is above --max-exp {}",
            args.min_exp, args.max_exp
        ));
    }
    Ok(args)
}

/// Keys for raw steps, far above what the communicator's own collectives use.
struct Keys(u64);

impl Keys {
    fn step(&mut self, sends: Vec<SendOp>, recvs: Vec<RecvOp>) -> byzcoll::Step {
        self.0 += 1;
        byzcoll::Step {
            collective: self.0,
            step: 0,
            call: 0,
            sends,
            recvs,
            deadline: tokio::time::Instant::now() + Duration::from_secs(60),
            quorum: None,
        }
    }
}

async fn exchange(t: &dyn Transport, keys: &mut Keys, sends: Vec<SendOp>, recvs: Vec<RecvOp>) {
    let outcomes = t.exchange(keys.step(sends, recvs)).await.expect("exchange");
    for o in outcomes {
        assert!(
            matches!(o, byzcoll::RecvOutcome::Received(_)),
            "benchmark message lost: {o:?}"
        );
    }
}

fn send(peer: usize, tag: u32, payload: &Bytes) -> SendOp {
    SendOp {
        peer,
        tag,
        payload: byzcoll::Payload::Host(payload.clone()),
    }
}

fn recv(peer: usize, tag: u32, len: usize) -> RecvOp {
    RecvOp { peer, tag, len }
}

/// One-way latency of `size`-byte messages in microseconds.
async fn latency(t: &dyn Transport, keys: &mut Keys, size: usize, iters: usize) -> f64 {
    let me = t.rank();
    let payload = Bytes::from(vec![1u8; size]);
    let mut elapsed = Duration::ZERO;
    for i in 0..iters + iters / 10 {
        let start = Instant::now();
        if me == 0 {
            exchange(t, keys, vec![send(1, 0, &payload)], vec![]).await;
            exchange(t, keys, vec![], vec![recv(1, 0, size)]).await;
        } else {
            exchange(t, keys, vec![], vec![recv(0, 0, size)]).await;
            exchange(t, keys, vec![send(0, 0, &payload)], vec![]).await;
        }
        if i >= iters / 10 {
            elapsed += start.elapsed();
        }
    }
    elapsed.as_secs_f64() * 1e6 / iters as f64 / 2.0
}

/// Bandwidth of `size`-byte messages in MiB/s, measured at rank 0 up to the acknowledgement.
async fn bandwidth(
    t: &dyn Transport,
    keys: &mut Keys,
    size: usize,
    window: u32,
    windows: usize,
) -> f64 {
    let me = t.rank();
    // Where the collectives' own messages live (huge pages from 1 MiB); see byzcoll_transport_kit::pool.
    let payload = byzcoll_transport_kit::pool::payload_from(&vec![7u8; size]);
    let ack = Bytes::from_static(b"k");
    // Warm-up window.
    let run = async |keys: &mut Keys, n: usize| {
        for _ in 0..n {
            if me == 0 {
                let sends = (0..window).map(|tag| send(1, tag, &payload)).collect();
                exchange(t, keys, sends, vec![]).await;
            } else {
                let recvs = (0..window).map(|tag| recv(0, tag, size)).collect();
                exchange(t, keys, vec![], recvs).await;
            }
        }
        if me == 0 {
            exchange(t, keys, vec![], vec![recv(1, 0, 1)]).await;
        } else {
            exchange(t, keys, vec![send(0, 0, &ack)], vec![]).await;
        }
    };
    run(keys, 1).await;
    let start = Instant::now();
    run(keys, windows).await;
    let secs = start.elapsed().as_secs_f64();
    (size * window as usize * windows) as f64 / secs / (1 << 20) as f64
}

/// One launched rank: measures, and rank 0 appends the results to `results`.
async fn worker(args: &Args, results: &Path) -> Result<(), String> {
    let mut comm: Communicator = byzcoll::init().await.map_err(|e| e.to_string())?;
    comm.barrier().await.map_err(|e| e.to_string())?;
    let label = args
        .rank_label
        .as_deref()
        .unwrap_or_else(|| comm.transport().name());
    let t = comm.transport();
    let mut keys = Keys(1 << 40);
    let mut lines = Vec::new();
    let lat = latency(t, &mut keys, 8, 2000).await;
    lines.push(format!("{label} lat 8 {lat:.3}"));
    for exp in (args.min_exp..=args.max_exp).step_by(2) {
        let size = 1usize << exp;
        let window = args.window;
        // At least 1 GiB and 100 messages (ucx_perftest's count at 16 MiB and above).
        let windows = ((1usize << 30) / (size * window as usize))
            .max(100usize.div_ceil(window as usize))
            .clamp(4, 2000);
        let bw = bandwidth(t, &mut keys, size, window, windows).await;
        lines.push(format!("{label} bw {size} {bw:.1}"));
    }
    if t.rank() == 0 {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(results)
            .map_err(|e| e.to_string())?;
        for l in lines {
            writeln!(f, "{l}").map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// Runs `ucx_perftest` (server and client on 127.0.0.1) and returns the "Final:" row's
/// (average latency in µs, overall bandwidth in MiB/s); `debug`: prints the client's status
/// and output on stderr.
fn perftest(tls: &str, test: &str, size: usize, debug: bool) -> Option<(f64, f64)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .ok()?
        .port()
        .to_string();
    let iters = ((256usize << 20) / size.max(1))
        .clamp(100, 100_000)
        .to_string();
    let env = [
        ("UCX_TLS", tls),
        ("UCX_NET_DEVICES", "lo"),
        ("UCX_LOG_LEVEL", "error"),
    ];
    let mut server = Command::new("ucx_perftest")
        .args(["-p", &port])
        .envs(env)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new("timeout")
        .args([
            "60",
            "ucx_perftest",
            "127.0.0.1",
            "-p",
            &port,
            "-t",
            test,
            "-s",
            &size.to_string(),
            "-n",
            &iters,
            "-f",
        ])
        .envs(env)
        .stderr(Stdio::null())
        .output();
    let _ = server.kill();
    let _ = server.wait();
    let out = out.ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if debug {
        eprintln!("ucx_perftest {test} {size}: {}\n{text}", out.status);
    }
    // The last row of numbers: iterations, overhead p50/average/overall (µs), bandwidth
    // average/overall (MB/s, which ucx_perftest means as MiB/s), message rate average/overall.
    let cols: Vec<f64> = text
        .lines()
        .filter_map(|l| {
            let cols: Option<Vec<f64>> = l
                .trim_start_matches("Final:")
                .split_whitespace()
                .map(|c| c.parse().ok())
                .collect();
            cols.filter(|c| c.len() >= 8)
        })
        .next_back()?;
    Some((cols[2], cols[5]))
}

/// Runs `fi_pingpong` (server and client on 127.0.0.1) with `provider` and returns
/// (µs per transfer, MiB/s).
fn pingpong(provider: &str, size: usize) -> Option<(f64, f64)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .ok()?
        .port()
        .to_string();
    let iters = ((64usize << 20) / size.max(1))
        .clamp(20, 10_000)
        .to_string();
    let size_s = size.to_string();
    let env = [("FI_TCP_IFACE", "lo"), ("FI_NET_IFACE", "lo")];
    let common = ["-p", provider, "-e", "rdm", "-S", &size_s, "-I", &iters];
    let mut server = Command::new("fi_pingpong")
        .args(common)
        .args(["-B", &port])
        .envs(env)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new("timeout")
        .arg("60")
        .arg("fi_pingpong")
        .args(common)
        .args(["-P", &port, "127.0.0.1"])
        .envs(env)
        .stderr(Stdio::null())
        .output();
    let _ = server.kill();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&out.ok()?.stdout).into_owned();
    // Columns: bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec (MB = 10^6 bytes).
    let line = text.lines().rfind(|l| !l.trim().is_empty())?;
    let cols: Vec<&str> = line.split_whitespace().collect();
    let mbps: f64 = cols.get(5)?.parse().ok()?;
    let usec: f64 = cols.get(6)?.parse().ok()?;
    Some((usec, mbps * 1e6 / (1 << 20) as f64))
}

fn parse_row(line: &str) -> Option<(String, String, usize, f64)> {
    let mut it = line.split_whitespace();
    Some((
        it.next()?.to_string(),
        it.next()?.to_string(),
        it.next()?.parse().ok()?,
        it.next()?.parse().ok()?,
    ))
}

fn print_table(rows: &[(String, String, usize, f64)], args: &Args) {
    let mut table = rows::Rows::new(
        "p2p",
        json!({ "latency": "us, one way", "bandwidth": "MiB/s" }),
    );
    for (label, kind, size, value) in rows {
        table.push(json!({ "config": label, "kind": kind, "bytes": size, "value": value }));
    }
    table.write();
    let get = |label: &str, kind: &str, size: usize| {
        rows.iter()
            .find(|r| r.0 == label && r.1 == kind && r.2 == size)
            .map(|r| r.3)
    };
    let cell = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    };
    // (byzcoll configuration, anchor on the same library and settings)
    let pairs = [
        ("ucx-tcp", "perftest-tcp"),
        ("ucx-sm", "perftest-sm"),
        ("fi-tcp", "pingpong-tcp"),
        ("fi-shm", "pingpong-shm"),
    ];
    let mut header = format!("{:>10} {:>9}", "bytes", "tcp");
    for (ours, anchor) in pairs {
        header += &format!(" {ours:>9} {anchor:>13} {:>6}", "ratio");
    }
    println!();
    println!("{header}");
    let line = |kind: &str, size: usize| {
        let mut l = format!("{size:>10} {:>9}", cell(get("tcp", kind, size)));
        for (ours, anchor) in pairs {
            let (a, b) = (get(ours, kind, size), get(anchor, kind, size));
            l += &format!(" {:>9} {:>13} {:>6}", cell(a), cell(b), ratio(a, b));
        }
        l
    };
    println!("{}   <- one-way latency, us", line("lat", 8));
    for exp in (args.min_exp..=args.max_exp).step_by(2) {
        println!("{}", line("bw", 1usize << exp));
    }
    println!(
        "(bandwidth in MiB/s; ratio = byzcoll / the anchor on the same library and settings: \
         ucx_perftest tag_lat/tag_bw, fi_pingpong rdm)"
    );
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("p2p bench: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(results) = &args.rank_results {
        let runtime = rows::runtime(args.multi_thread);
        return match runtime.block_on(worker(&args, results)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("p2p bench: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let runtime = rows::runtime(true);
    let mut configs: Vec<(&str, Vec<(String, String)>)> = vec![("tcp", vec![])];
    if available("ucx") {
        for tls in ["tcp", "sm"] {
            configs.push((
                if tls == "tcp" { "ucx-tcp" } else { "ucx-sm" },
                vec![
                    ("BYZCOLL_TRANSPORT".into(), "ucx".into()),
                    ("UCX_TLS".into(), format!("{tls},self")),
                    ("UCX_NET_DEVICES".into(), "lo".into()),
                    ("UCX_LOG_LEVEL".into(), "error".into()),
                ],
            ));
        }
    } else {
        println!("# built without --features ucx: no UCX rows");
    }
    if available("libfabric") {
        for (label, provider) in [("fi-tcp", "tcp;ofi_rxm"), ("fi-shm", "shm")] {
            configs.push((
                label,
                vec![
                    ("BYZCOLL_TRANSPORT".into(), "libfabric".into()),
                    ("FI_PROVIDER".into(), provider.into()),
                    ("FI_TCP_IFACE".into(), "lo".into()),
                    ("FI_NET_IFACE".into(), "lo".into()),
                ],
            ));
        }
    } else {
        println!("# built without --features libfabric: no libfabric rows");
    }
    let results = std::env::temp_dir().join(format!("byzcoll-p2p-{}.txt", std::process::id()));
    let _ = std::fs::remove_file(&results);
    let exe = std::env::current_exe().expect("current exe");
    let wanted = |label: &str| args.only.is_empty() || args.only.iter().any(|o| o == label);
    println!(
        "# two ranks on 127.0.0.1; latency one-way (µs), bandwidth MiB/s, window {}",
        args.window
    );
    for (label, env) in configs.iter().filter(|(label, _)| wanted(label)) {
        let mut env = env.clone();
        env.push(("BYZCOLL_TIMEOUT_MS".into(), "120000".into()));
        let mut command = vec![exe.clone().into_os_string()];
        command.extend(std::env::args_os().skip(1));
        command.extend([
            "--rank-results".into(),
            results.as_os_str().to_owned(),
            "--rank-label".into(),
            (*label).into(),
        ]);
        let outcome = runtime.block_on(launch(LaunchOptions {
            ranks: 2,
            command,
            grace: Duration::from_secs(5),
            env,
            identity: Default::default(),
            restarts: 0,
        }));
        match outcome {
            Ok(o) if o.exit_code == 0 => {}
            Ok(o) => return ExitCode::from(o.exit_code.clamp(1, 255) as u8),
            Err(e) => {
                eprintln!("p2p bench: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let mut rows: Vec<(String, String, usize, f64)> = std::fs::read_to_string(&results)
        .unwrap_or_default()
        .lines()
        .filter_map(parse_row)
        .collect();
    let _ = std::fs::remove_file(&results);
    if args.anchor && available("ucx") {
        for tls in ["tcp", "sm"] {
            let tls_full = format!("{tls},self");
            let label = format!("perftest-{tls}");
            if !wanted(&format!("ucx-{tls}")) {
                continue;
            }
            match perftest(&tls_full, "tag_lat", 8, args.debug) {
                Some((lat, _)) => rows.push((label.clone(), "lat".into(), 8, lat)),
                None => println!("# ucx_perftest not available (apt-get install ucx-utils)"),
            }
            for exp in (args.min_exp..=args.max_exp).step_by(2) {
                let size = 1usize << exp;
                if let Some((_, bw)) = perftest(&tls_full, "tag_bw", size, args.debug) {
                    rows.push((label.clone(), "bw".into(), size, bw));
                }
            }
        }
    }
    if args.anchor && available("libfabric") {
        for (label, provider) in [("pingpong-tcp", "tcp;ofi_rxm"), ("pingpong-shm", "shm")] {
            if !wanted(&label.replace("pingpong", "fi")) {
                continue;
            }
            if let Some(lat) = pingpong(provider, 8) {
                rows.push((label.into(), "lat".into(), 8, lat.0));
            } else {
                println!("# fi_pingpong not available (apt-get install libfabric-bin)");
            }
            // fi_pingpong's largest message is 6 MiB.
            for exp in (args.min_exp..=args.max_exp.min(22)).step_by(2) {
                let size = 1usize << exp;
                if let Some((_, bw)) = pingpong(provider, size) {
                    rows.push((label.into(), "bw".into(), size, bw));
                }
            }
        }
    }
    print_table(&rows, &args);
    ExitCode::SUCCESS
}

/// Whether this build has the transport `name` and its system library.
fn available(name: &str) -> bool {
    byzcoll::TRANSPORTS
        .iter()
        .any(|t| t.name == name && t.available)
}
