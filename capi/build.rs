//! Gives the shared library the SONAME `libbyzcoll.so.N` (N: `BYZCOLL_ABI_VERSION`), so that a
//! program linked against it asks the loader for the ABI it was built with.

include!("src/abi.rs");

fn main() {
    println!("cargo:rerun-if-changed=src/abi.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libbyzcoll.so.{BYZCOLL_ABI_VERSION}");
    }
}
