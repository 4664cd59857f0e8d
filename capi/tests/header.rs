//! The checked-in `include/byzcoll.h` is exactly what cbindgen generates from the sources, made
//! C89: a stale header fails here. `BYZCOLL_BLESS=1` writes it instead. And the header compiles
//! as C89 and as C++11, pedantically.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// cbindgen's output with what it cannot be told to leave out of C89: the comma after an
/// enum's last enumerator, and the `//` comments it writes after `#endif` and the closing brace
/// of `extern "C"` (`cpp_compat`).
fn c89(generated: &str) -> String {
    let lines: Vec<&str> = generated.lines().collect();
    let mut out = String::with_capacity(generated.len());
    for (i, line) in lines.iter().enumerate() {
        let closes_list = lines
            .get(i + 1)
            .is_some_and(|next| next.trim_start().starts_with('}'));
        match line.split_once("//") {
            Some((code, comment)) if line.starts_with("#endif") || line.starts_with('}') => {
                out.push_str(&format!("{code}/* {} */", comment.trim()));
            }
            _ if closes_list && line.ends_with(',') => out.push_str(&line[..line.len() - 1]),
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[test]
fn checked_in_header_is_current() {
    let config = cbindgen::Config::from_file(crate_dir().join("cbindgen.toml")).unwrap();
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir())
        .with_config(config)
        .generate()
        .expect("cbindgen parses the C ABI")
        .write(&mut generated);
    let generated = c89(&String::from_utf8(generated).unwrap());
    let path = crate_dir().join("include/byzcoll.h");
    if std::env::var_os("BYZCOLL_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "capi/include/byzcoll.h is stale: regenerate it with \
         `BYZCOLL_BLESS=1 cargo test -p byzcoll-capi --test header` and commit it"
    );
}

/// Every declaration and initialiser of the header, in C89 (declarations before statements).
const USES_THE_HEADER: &str = r#"#include <byzcoll.h>

int main(void) {
    byzcoll_config_t config = BYZCOLL_CONFIG_INIT;
    byzcoll_rule_params_t params = BYZCOLL_RULE_PARAMS_INIT;
    byzcoll_report_t report = BYZCOLL_REPORT_INIT;
    byzcoll_comm_t *comm = NULL;
    byzcoll_status_t st;
    uint64_t step = BYZCOLL_NO_STEP;
    st = byzcoll_init_from_env(&config, &comm);
    if (st == BYZCOLL_OK)
        st = byzcoll_robust_allreduce(comm, NULL, NULL, 0, BYZCOLL_FLOAT32, "median", &params,
                                      &report);
    if (st == BYZCOLL_OK) st = byzcoll_comm_set_step(comm, step);
    return (int)st + (int)byzcoll_comm_finalize(comm) + (int)BYZCOLL_ABI_VERSION;
}
"#;

/// Compiles `USES_THE_HEADER` with `compiler` and `flags`, or says SKIPPED without it.
fn compiles(compiler: &str, file: &str, flags: &[&str]) {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("byzcoll-header-{}-{compiler}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = dir.join(file);
    std::fs::write(&source, USES_THE_HEADER).unwrap();
    let out = Command::new(compiler)
        .args(flags)
        .args([
            "-fsyntax-only",
            "-pedantic-errors",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-I",
        ])
        .arg(crate_dir().join("include"))
        .arg(&source)
        .output();
    std::fs::remove_dir_all(&dir).ok();
    let Ok(out) = out else {
        eprintln!("SKIPPED: {compiler} not found (apt-get install g++)");
        return;
    };
    assert!(
        out.status.success(),
        "byzcoll.h does not compile with {compiler} {flags:?}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn header_is_c89() {
    compiles("cc", "uses.c", &["-std=c89"]);
}

#[test]
fn header_is_cxx11() {
    compiles("c++", "uses.cpp", &["-std=c++11"]);
}
