//! `scripts/deps.sh`, which decides what the test command installs, against fake roots: it must
//! look for the artefacts the build really uses, and not be fooled by decoys that resemble them
//! (a fresh machine once had `libclang-cpp.so` and no `libclang.so`, and bindgen failed).

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

const EVERYTHING: [&str; 11] = [
    "openmpi-bin",
    "libopenmpi-dev",
    "procps",
    "pkg-config",
    "libucx-dev",
    "ucx-utils",
    "libfabric-dev",
    "libfabric-bin",
    "libclang-dev",
    "g++",
    "binutils",
];

fn multiarch() -> String {
    let out = Command::new("gcc")
        .arg("-print-multiarch")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

struct Root(PathBuf);

impl Root {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("byzcoll-deps-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Root(dir)
    }

    fn file(&self, path: &str, contents: &str) -> &Self {
        let p = self.0.join(path.trim_start_matches('/'));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, contents).unwrap();
        self
    }

    fn command(&self, name: &str) -> &Self {
        use std::os::unix::fs::PermissionsExt;
        self.file(&format!("/usr/bin/{name}"), "#!/bin/sh\n");
        let p = self.0.join("usr/bin").join(name);
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
        self
    }

    fn pc(&self, module: &str) -> &Self {
        self.file(
            &format!("/usr/lib/{}/pkgconfig/{module}.pc", multiarch()),
            &format!("prefix=/usr\nincludedir=${{prefix}}/include\nName: {module}\nDescription: decoy\nVersion: 1\nCflags: -I${{includedir}}\n"),
        )
    }

    fn missing(&self) -> Vec<String> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/deps.sh");
        let out = Command::new("bash")
            .arg(script)
            .arg(&self.0)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The fake roots' `.pc` files are read by the real pkg-config.
fn have_pkg_config() -> bool {
    let have = Command::new("pkg-config").arg("--version").output().is_ok();
    if !have {
        eprintln!("SKIPPED: pkg-config is not installed here (scripts/test.sh installs it first)");
    }
    have
}

#[test]
fn an_empty_machine_needs_everything() {
    if !have_pkg_config() {
        return;
    }
    assert_eq!(Root::new("empty").missing(), EVERYTHING);
}

#[test]
fn decoys_that_resemble_the_artefacts_do_not_count() {
    if !have_pkg_config() {
        return;
    }
    let m = multiarch();
    let root = Root::new("decoys");
    root.command("mpirun")
        .command("mpicc") // the wrapper without the headers it compiles against
        .command("pgrep")
        .command("pkg-config")
        .command("ucx_info")
        .command("fi_info")
        .command("c++")
        .command("readelf")
        .command("objcopy")
        .command("strip")
        // libclang-cpp is not the libclang bindgen loads; a versioned libclang without the
        // development link is not found either.
        .file("/usr/lib/llvm-14/lib/libclang-cpp.so.14", "")
        .file(&format!("/usr/lib/{m}/libclang-cpp.so.14"), "")
        // A .pc file whose header is missing (a half-removed package), and one whose header
        // is there.
        .pc("ucx")
        .pc("libfabric")
        .file("/usr/include/rdma/fabric.h", "")
        // mpi.h of another MPI, where Open MPI's mpicc does not look.
        .file("/usr/include/mpich/mpi.h", "");
    assert_eq!(
        root.missing(),
        ["libopenmpi-dev", "libucx-dev", "libclang-dev"]
    );

    // The real artefacts satisfy it.
    root.file("/usr/lib/llvm-14/lib/libclang.so", "")
        .file("/usr/include/ucp/api/ucp.h", "")
        .file(&format!("/usr/lib/{m}/openmpi/include/mpi.h"), "");
    assert_eq!(root.missing(), Vec::<String>::new());
}

#[test]
fn this_machine_has_what_the_test_command_installed() {
    if std::env::var_os("BYZCOLL_REQUIRE_MPI").is_none() {
        eprintln!("SKIPPED: outside scripts/test.sh nothing was installed");
        return;
    }
    assert_eq!(missing_here(), Vec::<String>::new());
}

fn missing_here() -> Vec<String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/deps.sh");
    let out = Command::new("bash").arg(script).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}
