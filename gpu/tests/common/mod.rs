//! Inputs and comparisons shared by the emulated and the device tests.

#![allow(dead_code)] // each test binary uses a part

use std::io::Write as _;
use std::sync::Arc;

use byzcoll_cuda::Gpu;
use rand::rngs::StdRng;
use rand::Rng;

/// The GPU, or `None` with a visible `SKIPPED` line where there is none.
pub(crate) fn gpu() -> Option<Arc<Gpu>> {
    match Gpu::probe() {
        Ok(gpu) => Some(gpu),
        Err(e) => {
            // Written to the process's stderr, past libtest's capture, so the skip is visible.
            let _ = writeln!(std::io::stderr(), "SKIPPED: no usable GPU ({e})");
            None
        }
    }
}

/// Fresh random vectors (never zeros): a common centre plus noise, so order statistics and
/// distances are all distinct and meaningful.
pub(crate) fn inputs(rng: &mut StdRng, n: usize, d: usize) -> Vec<Vec<f32>> {
    let centre: Vec<f32> = (0..d).map(|_| rng.gen_range(-10.0..10.0)).collect();
    (0..n)
        .map(|_| {
            centre
                .iter()
                .map(|c| c + rng.gen_range(-1.0..1.0))
                .collect()
        })
        .collect()
}

/// Within one f32 ulp of `want`, coordinate by coordinate.
pub(crate) fn assert_close(got: &[f32], want: &[f32], what: &str) {
    for (j, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= w.abs() * 1.2e-7,
            "{what}: coordinate {j}: {g} vs {w}"
        );
    }
}
