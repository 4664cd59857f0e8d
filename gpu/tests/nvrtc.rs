//! Every kernel variant compiles with NVRTC for Hopper (sm_90), with no GPU needed: a kernel
//! that does not compile fails here, in CI, not on a user's cluster.
//!
//! NVRTC comes from the CUDA toolkit or the `nvidia-cuda-nvrtc` wheel (`scripts/test.sh`
//! installs it). Without it the test says so and skips, unless `BYZCOLL_REQUIRE_NVRTC=1`
//! (set by the test script), where a missing NVRTC is a failure.

use std::io::Write as _;

use byzcoll_cuda::kernels::{self, Variant};

/// NVRTC runs once per variant per process: the second request is the first one's PTX.
#[test]
fn compiled_kernels_are_cached_per_process() {
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        let _ = writeln!(std::io::stderr(), "SKIPPED: NVRTC (libnvrtc.so) not found");
        return;
    }
    let variant = kernels::distance_variant(5);
    let first = kernels::compiled(kernels::ElemKind::F16, &variant, "compute_90").expect("PTX");
    let again = kernels::compiled(kernels::ElemKind::F16, &variant, "compute_90").expect("PTX");
    assert!(std::sync::Arc::ptr_eq(&first, &again));
    let other = kernels::compiled(kernels::ElemKind::F32, &variant, "compute_90").expect("PTX");
    assert!(!std::sync::Arc::ptr_eq(&first, &other));
    assert!(first.to_src().contains(".entry distance_tiles"));
}

#[test]
fn every_kernel_variant_compiles_for_sm_90() {
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        assert!(
            std::env::var("BYZCOLL_REQUIRE_NVRTC").as_deref() != Ok("1"),
            "BYZCOLL_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)"
        );
        // Past libtest's capture, so the skip is visible.
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: NVRTC (libnvrtc.so) not found; CUDA kernels were not compiled"
        );
        return;
    }
    let catalogue = kernels::catalogue();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let chunks: Vec<_> = catalogue
        .chunks(catalogue.len().div_ceil(threads))
        .collect();
    let failures: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = chunks
            .iter()
            .map(|chunk| {
                s.spawn(move || {
                    let mut failed = Vec::new();
                    for (elem, variant) in chunk.iter() {
                        match kernels::compile(*elem, variant, "sm_90") {
                            Ok(ptx) => {
                                let text = ptx.to_src();
                                let entries: &[&str] = match variant {
                                    Variant::Generic | Variant::Distance { .. } => &[
                                        "coordinate_select",
                                        "mean_rows",
                                        "distance_tiles",
                                        "distance_reduce",
                                    ],
                                    Variant::Network { .. } => {
                                        &["coordinate_network", "bulyan_network"]
                                    }
                                };
                                for entry in entries {
                                    if !text.contains(&format!(".entry {entry}")) {
                                        failed.push(format!("{elem:?} {variant:?}: no {entry}"));
                                    }
                                }
                            }
                            Err(e) => failed.push(e.to_string()),
                        }
                    }
                    failed
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("compile thread"))
            .collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    eprintln!("compiled {} kernel variants for sm_90", catalogue.len());
}
