//! Compiles the CUDA kernels as C++ under the CPU emulation in `emu.h`.

fn main() {
    println!("cargo:rerun-if-changed=emu.h");
    println!("cargo:rerun-if-changed=emu.cpp");
    println!("cargo:rerun-if-changed=../kernels/robust.cu");
    cc::Build::new()
        .cpp(true)
        .file("emu.cpp")
        .std("c++20")
        .flag_if_supported("-Wno-unknown-pragmas")
        .flag_if_supported("-Wno-vla")
        // Each tile-size instantiation uses only the distance kernels.
        .flag_if_supported("-Wno-unused-function")
        .flag("-pthread")
        .compile("byzcoll_cuda_emu");
    println!("cargo:rustc-link-lib=stdc++");
    println!("cargo:rustc-link-lib=pthread");
}
