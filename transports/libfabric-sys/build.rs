//! When the `libfabric` feature is on: finds the installed libfabric with pkg-config, compiles
//! the C shim over its `static inline` calls, and generates bindings against its headers. Does
//! nothing otherwise.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=shim.c");
    #[cfg(feature = "libfabric")]
    generate();
}

#[cfg(feature = "libfabric")]
fn generate() {
    let fabric = match pkg_config::Config::new()
        .atleast_version("1.10")
        .probe("libfabric")
    {
        Ok(lib) => lib,
        Err(e) => panic!(
            "the `libfabric` feature needs the libfabric development files (Debian: apt-get \
             install libfabric-dev pkg-config libclang-dev; libfabric-bin for fi_info): {e}"
        ),
    };

    let mut shim = cc::Build::new();
    shim.file("shim.c").include(".").warnings(true);
    for path in &fabric.include_paths {
        shim.include(path);
    }
    shim.compile("byzcoll_fi_shim");
    // The shim calls into libfabric: link it after the shim's archive.
    for lib in &fabric.libs {
        println!("cargo:rustc-link-lib={lib}");
    }

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("fi_.*")
        .allowlist_function("byzcoll_fi_.*")
        .allowlist_type("fi_.*")
        .allowlist_type("fid_.*")
        .allowlist_var("FI_.*")
        // The static inline originals are not linkable; the shim's functions replace them.
        .blocklist_function("fi_(fabric|domain|endpoint|av_open|cq_open|ep_bind|enable|getname|av_insert|tsend|trecv|cq_read|cq_readerr|cq_strerror|close|cancel|mr_reg|mr_desc|control|trywait)")
        .generate_inline_functions(false)
        .default_enum_style(bindgen::EnumVariation::ModuleConsts)
        // The headers' anonymous enums (libfabric's own error codes, address formats,
        // protocols, classes, options, ...) become plain constants, like the `#define`s beside
        // them; bindgen matches an anonymous enum by the names of its items.
        .constified_enum(
            "FI_ETRUNC|FI_PATH_MAX|FI_ADDR_STR|FI_PROTO_UNSPEC|FI_TC_UNSPEC|FI_CLASS_UNSPEC\
             |FI_GETFIDFLAG|FI_NOTIFY|FI_OPT_ENDPOINT|FI_OPT_MIN_MULTI_RECV|FI_HMEM_P2P_ENABLED",
        )
        .derive_default(true)
        .layout_tests(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for path in &fabric.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder
        .generate()
        .expect("bindgen could not process <rdma/fabric.h> and friends");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("cannot write the libfabric bindings");
}
