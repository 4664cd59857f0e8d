//! The C ABI from C and C++, as its users build it: the header, the library, and a C compiler
//! (no Rust toolchain at link time), and the MPI example under a real `mpirun`.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use byzcoll::BYZCOLL_ABI_VERSION;

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

/// A directory where the loader finds the shared library in `lib_dir()` by its SONAME,
/// `libbyzcoll.so.N`: cargo names it `libbyzcoll.so` only.
fn soname_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("byzcoll-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let link = dir.join(format!("libbyzcoll.so.{BYZCOLL_ABI_VERSION}"));
    std::fs::remove_file(&link).ok();
    std::os::unix::fs::symlink(lib_dir().join("libbyzcoll.so"), &link).unwrap();
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
    let runtime_dir = soname_dir("smoke-lib");
    let exe = std::env::temp_dir().join(format!("byzcoll-smoke-{}", std::process::id()));
    let mut cxx = Command::new("c++");
    cxx.args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(include_dir())
        .arg(repo().join("capi/tests/c/smoke.cpp"))
        .arg("-L")
        .arg(lib_dir())
        .arg("-lbyzcoll")
        .arg(format!("-Wl,-rpath,{}", runtime_dir.display()))
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
    std::fs::remove_dir_all(&runtime_dir).ok();
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

/// Whether `tool` (of the Debian `package`) is here; without it a SKIPPED line, unless
/// `BYZCOLL_REQUIRE_MPI` says that the test command installed it.
fn have(tool: &str, package: &str) -> bool {
    if Command::new(tool).arg("--version").output().is_ok() {
        return true;
    }
    assert!(
        std::env::var_os("BYZCOLL_REQUIRE_MPI").is_none(),
        "BYZCOLL_REQUIRE_MPI is set but {tool} is missing (apt-get install {package})"
    );
    eprintln!("SKIPPED: {tool} not found (apt-get install {package})");
    false
}

/// The MPI example built with `mpicc` against `libbyzcoll.a`, or `None` (and a SKIPPED line)
/// without MPI, unless `BYZCOLL_REQUIRE_MPI` says it must be there.
fn mpi_example() -> Option<PathBuf> {
    if !have("mpicc", "libopenmpi-dev") {
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
    // {1, 2, 3, 1e9} = 2.5 and the report names rank 3 as outlying (its deviation from 2.5 is
    // 2e9 times the median deviation, 0.5), while the plain SUM all-reduce is dragged to 1e9.
    let out = mpirun(&exe, 4, &["--byzantine"]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{}", text(&out));
    for r in 0..3 {
        assert!(
            stdout.contains(&format!(
                "rank {r} of 4: median OK (2.5, expected 2.5; 4 inputs, 0 faults: outlying inputs \
                 from [3]); SUM all-reduce 1e+09; rank 3 outlying (score 2e+09); health: rank 3 \
                 outlying in 1 round(s)"
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

/// `readelf` on `file` with `args`.
fn readelf(args: &[&str], file: &Path) -> String {
    let out = Command::new("readelf")
        .args(args)
        .arg(file)
        .output()
        .unwrap();
    assert!(out.status.success(), "readelf {args:?} {}", file.display());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `mpirun -n 3` of `exe` in an environment of `PATH` alone (no `LD_LIBRARY_PATH`: cargo sets
/// one for its tests), expecting the median of {1, 2, 3} at every rank.
fn runs_alone_under_mpirun(exe: &Path) {
    let mut cmd = Command::new("mpirun");
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .args(MPIRUN)
        .args(["-n", "3", "-x", "BYZCOLL_TCP_ADDR=127.0.0.1"])
        .arg(exe);
    let out = run(&mut cmd, Duration::from_secs(120));
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.matches("median OK (2, expected 2; 3 inputs").count(),
        3,
        "{}",
        text(&out)
    );
}

/// What an HPC user does: `scripts/install-capi.sh PREFIX` (installing this test's build of the
/// libraries), then the MPI example compiled with `mpicc $(pkg-config --cflags --libs byzcoll)`
/// and nothing else, and run under `mpirun` without `LD_LIBRARY_PATH`: the `.pc` file's rpath
/// finds `libbyzcoll.so.N`, the name the library's SONAME gives. Both installed libraries carry
/// no debug info; the static recipe of the script's comment links and runs too.
#[test]
fn installed_tree_builds_an_mpi_program_with_pkg_config_alone_that_runs() {
    let tools = [
        ("mpicc", "libopenmpi-dev"),
        ("mpirun", "openmpi-bin"),
        ("pkg-config", "pkg-config"),
        ("readelf", "binutils"),
        ("objcopy", "binutils"),
        ("strip", "binutils"),
    ];
    if !tools.iter().all(|(tool, package)| have(tool, package)) {
        return;
    }
    let prefix = std::env::temp_dir().join(format!("byzcoll-prefix-{}", std::process::id()));
    std::fs::remove_dir_all(&prefix).ok();
    let out = run(
        Command::new("bash")
            .arg(repo().join("scripts/install-capi.sh"))
            .arg(&prefix)
            .env("BYZCOLL_CAPI_LIB_DIR", lib_dir()),
        Duration::from_secs(300),
    );
    assert!(out.status.success(), "{}", text(&out));

    // libbyzcoll.so -> libbyzcoll.so.N -> libbyzcoll.so.N.MINOR.PATCH, whose SONAME is the
    // middle name; no debug info but in lib/.debug.
    let lib = prefix.join("lib");
    let soname = format!("libbyzcoll.so.{BYZCOLL_ABI_VERSION}");
    let minor_patch = env!("CARGO_PKG_VERSION").split_once('.').unwrap().1;
    let real = format!("{soname}.{minor_patch}");
    assert_eq!(
        std::fs::read_link(lib.join("libbyzcoll.so")).unwrap(),
        Path::new(&soname)
    );
    assert_eq!(
        std::fs::read_link(lib.join(&soname)).unwrap(),
        Path::new(&real)
    );
    let dynamic = readelf(&["-d"], &lib.join(&real));
    assert!(
        dynamic.contains(&format!("Library soname: [{soname}]")),
        "{dynamic}"
    );
    for installed in [lib.join(&real), lib.join("libbyzcoll.a")] {
        assert!(
            !readelf(&["-S", "-W"], &installed).contains(".debug_info"),
            "{} keeps its debug info",
            installed.display()
        );
    }
    let debug = lib.join(".debug").join(format!("{real}.debug"));
    assert!(readelf(&["-S", "-W"], &debug).contains(".debug_info"));

    // Shared: pkg-config's flags alone; the binary asks for libbyzcoll.so.N and names lib/ in
    // its RUNPATH (or RPATH).
    let example = repo().join("examples/c/mpi_robust_allreduce.c");
    let exe = prefix.join("mpi_robust_allreduce");
    let mut mpicc = Command::new("sh");
    mpicc
        .args([
            "-c",
            r#"mpicc -O2 -Wall -Wextra -Werror "$1" $(pkg-config --cflags --libs byzcoll) -o "$2""#,
            "sh",
        ])
        .arg(&example)
        .arg(&exe)
        .env("PKG_CONFIG_PATH", lib.join("pkgconfig"));
    compile(mpicc, "examples/c/mpi_robust_allreduce.c with pkg-config");
    let dynamic = readelf(&["-d"], &exe);
    assert!(
        dynamic.contains(&format!("Shared library: [{soname}]")),
        "{dynamic}"
    );
    assert!(
        dynamic
            .lines()
            .any(|l| l.contains("PATH)") && l.contains(&format!("[{}]", lib.display()))),
        "no RUNPATH or RPATH naming {}:\n{dynamic}",
        lib.display()
    );
    runs_alone_under_mpirun(&exe);

    // Static, as the install script's comment says.
    let exe_static = prefix.join("mpi_robust_allreduce_static");
    let mut mpicc = Command::new("sh");
    mpicc
        .args([
            "-c",
            r#"mpicc -static-libgcc "$1" $(pkg-config --cflags byzcoll) "$2" $(pkg-config --libs-only-l --static byzcoll | sed 's/-lbyzcoll//') -o "$3""#,
            "sh",
        ])
        .arg(&example)
        .arg(lib.join("libbyzcoll.a"))
        .arg(&exe_static)
        .env("PKG_CONFIG_PATH", lib.join("pkgconfig"));
    compile(mpicc, "examples/c/mpi_robust_allreduce.c with libbyzcoll.a");
    runs_alone_under_mpirun(&exe_static);
    std::fs::remove_dir_all(&prefix).ok();
}
