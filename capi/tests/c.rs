//! The C ABI from C and C++, as its users build it: the header, the library, and a C compiler
//! (no Rust toolchain at link time), and the MPI example under a real `mpirun`.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// `target/<profile>/deps`, where cargo built `libbyzcoll.a` and `libbyzcoll.so` for this test
/// (the crate is also an rlib so that cargo rebuilds them with it; the copies one level up are
/// refreshed only by `cargo build`).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().to_path_buf();
    for lib in ["libbyzcoll.a", "libbyzcoll.so"] {
        assert!(
            dir.join(lib).exists(),
            "{} is missing: cargo builds it with this package",
            dir.join(lib).display()
        );
    }
    dir
}

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn include_dir() -> PathBuf {
    repo().join("capi/include")
}

/// What a program linked with `libbyzcoll.a` needs besides it: the system libraries Rust's
/// standard library uses, and those of the transports when this build has them (cargo unifies
/// the workspace's features, so a `--features ucx,libfabric` test run builds them in).
fn static_link_flags() -> Vec<String> {
    let mut flags = Vec::new();
    for pkg in ["ucx", "libfabric"] {
        if let Ok(out) = Command::new("pkg-config").args(["--libs", pkg]).output() {
            if out.status.success() {
                let libs = String::from_utf8_lossy(&out.stdout).into_owned();
                flags.extend(libs.split_whitespace().map(str::to_string));
            }
        }
    }
    flags.extend(
        [
            "-lpthread",
            "-ldl",
            "-lm",
            "-lrt",
            "-lutil",
            "-lgcc_s",
            "-lc",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    flags
}

fn compile(mut cmd: Command, what: &str) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run the compiler: {e}"));
    assert!(
        out.status.success(),
        "{what} does not compile:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `cmd`, killing it after `limit`. Output goes to files, so a child that writes a lot
/// cannot block on a full pipe while it is waited for.
fn run(cmd: &mut Command, limit: Duration) -> Output {
    let stem = std::env::temp_dir().join(format!(
        "byzcoll-capi-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let (out_path, err_path) = (stem.with_extension("out"), stem.with_extension("err"));
    let mut child = cmd
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            child.kill().ok();
            child.wait().ok();
            panic!(
                "{cmd:?} still running after {limit:?}:\n{}\n{}",
                std::fs::read_to_string(&out_path).unwrap_or_default(),
                std::fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = Output {
        status,
        stdout: std::fs::read(&out_path).unwrap_or_default(),
        stderr: std::fs::read(&err_path).unwrap_or_default(),
    };
    std::fs::remove_file(&out_path).ok();
    std::fs::remove_file(&err_path).ok();
    out
}

fn text(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn every_error_path_from_c_linked_statically_with_cc_alone() {
    let dir = lib_dir();
    let exe = std::env::temp_dir().join(format!("byzcoll-errors-{}", std::process::id()));
    let mut cc = Command::new("cc");
    cc.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(include_dir())
        .arg(repo().join("capi/tests/c/errors.c"))
        .arg(dir.join("libbyzcoll.a"))
        .args(static_link_flags())
        .arg("-o")
        .arg(&exe);
    compile(cc, "capi/tests/c/errors.c");
    let out = run(
        Command::new(&exe).env_remove("BYZCOLL_TRANSPORT"),
        Duration::from_secs(60),
    );
    std::fs::remove_file(&exe).ok();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("checks passed"),
        "{}",
        text(&out)
    );
}

#[test]
fn cxx_program_uses_the_shared_library() {
    let dir = lib_dir();
    let exe = std::env::temp_dir().join(format!("byzcoll-smoke-{}", std::process::id()));
    let mut cxx = Command::new("c++");
    cxx.args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(include_dir())
        .arg(repo().join("capi/tests/c/smoke.cpp"))
        .arg("-L")
        .arg(&dir)
        .arg("-lbyzcoll")
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .arg("-o")
        .arg(&exe);
    compile(cxx, "capi/tests/c/smoke.cpp");
    let mut cmd = Command::new(&exe);
    for (k, _) in std::env::vars() {
        if k.starts_with("OMPI_") || k.starts_with("SLURM_") || k.starts_with("PMI") {
            cmd.env_remove(k);
        }
    }
    let out = run(
        cmd.env("BYZCOLL_RANK", "0")
            .env("BYZCOLL_WORLD_SIZE", "1")
            .env_remove("BYZCOLL_STORE")
            .env_remove("BYZCOLL_TRANSPORT")
            .env_remove("BYZCOLL_AGREEMENT"),
        Duration::from_secs(60),
    );
    std::fs::remove_file(&exe).ok();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("smoke.cpp: byzcoll 0.1.0 OK"),
        "{}",
        text(&out)
    );
}

/// Open MPI on loopback only, as root in CI, more ranks than cores.
const MPIRUN: [&str; 11] = [
    "--allow-run-as-root",
    "--oversubscribe",
    "--mca",
    "oob_tcp_if_include",
    "lo",
    "--mca",
    "btl",
    "self,tcp",
    "--mca",
    "btl_tcp_if_include",
    "lo",
];

/// The MPI example built with `mpicc` against `libbyzcoll.a`, or `None` (and a SKIPPED line)
/// without MPI, unless `BYZCOLL_REQUIRE_MPI` says it must be there.
fn mpi_example() -> Option<PathBuf> {
    if Command::new("mpicc")
        .arg("--showme:version")
        .output()
        .is_err()
    {
        assert!(
            std::env::var_os("BYZCOLL_REQUIRE_MPI").is_none(),
            "BYZCOLL_REQUIRE_MPI is set but mpicc is missing (apt-get install libopenmpi-dev)"
        );
        eprintln!("SKIPPED: mpicc not found (apt-get install libopenmpi-dev)");
        return None;
    }
    let exe = std::env::temp_dir().join(format!("byzcoll-mpi-example-{}", std::process::id()));
    let mut mpicc = Command::new("mpicc");
    mpicc
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(include_dir())
        .arg(repo().join("examples/c/mpi_robust_allreduce.c"))
        .arg(lib_dir().join("libbyzcoll.a"))
        .args(static_link_flags())
        .arg("-o")
        .arg(&exe);
    compile(mpicc, "examples/c/mpi_robust_allreduce.c");
    Some(exe)
}

fn mpirun(exe: &Path, n: usize, args: &[&str]) -> Output {
    let mut cmd = Command::new("mpirun");
    cmd.args(MPIRUN)
        .args(["-n", &n.to_string(), "-x", "BYZCOLL_TCP_ADDR=127.0.0.1"])
        .arg(exe)
        .args(args)
        .env_remove("BYZCOLL_SECRET")
        .env_remove("BYZCOLL_TRANSPORT");
    run(&mut cmd, Duration::from_secs(120))
}

#[test]
fn mpi_example_bootstraps_over_mpi_allgather_and_outvotes_a_byzantine_rank() {
    let Some(exe) = mpi_example() else { return };
    // Four ranks, the last one Byzantine (1e9 everywhere): the honest three get the median of
    // {1, 2, 3, 1e9} = 2.5, while the plain SUM all-reduce is dragged to 1e9.
    let out = mpirun(&exe, 4, &["--byzantine"]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{}", text(&out));
    for r in 0..3 {
        assert!(
            stdout.contains(&format!(
                "rank {r} of 4: median OK (2.5, expected 2.5; 4 inputs, 0 faults); SUM all-reduce 1e+09"
            )),
            "{}",
            text(&out)
        );
    }
    assert!(!stdout.contains("rank 3 of 4"), "{}", text(&out));

    // Three honest ranks: the median of {1, 2, 3}.
    let out = mpirun(&exe, 3, &[]);
    std::fs::remove_file(&exe).ok();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        stdout.matches("median OK (2, expected 2; 3 inputs").count(),
        3,
        "{}",
        text(&out)
    );
}
