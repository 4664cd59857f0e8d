//! Generates bindings against the installed UCX headers, found with pkg-config, when the `ucx`
//! feature is on; does nothing otherwise.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    #[cfg(feature = "ucx")]
    generate();
}

#[cfg(feature = "ucx")]
fn generate() {
    let ucx = match pkg_config::Config::new()
        .atleast_version("1.10")
        .probe("ucx")
    {
        Ok(lib) => lib,
        Err(e) => panic!(
            "the `ucx` feature needs the UCX development files (Debian: apt-get install \
             libucx-dev pkg-config libclang-dev): {e}"
        ),
    };
    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_status_t")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        .default_enum_style(bindgen::EnumVariation::ModuleConsts)
        .derive_default(true)
        .layout_tests(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for path in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder
        .generate()
        .expect("bindgen could not process <ucp/api/ucp.h>");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("cannot write the UCX bindings");
}
