//! Runs byzcoll's CUDA kernels (`gpu/kernels/robust.cu`) on the CPU.
//!
//! **An emulation, named as such**: `emu.h` maps the CUDA grid onto CPU threads (blocks one
//! after another, a block's threads as OS threads meeting at a barrier when the kernel
//! synchronises) and compiles the very same kernel source as C++. It exists so the kernels'
//! arithmetic, order statistics, non-finite handling and tiling are tested against the CPU rules
//! on machines without a GPU (CI). It says nothing about speed, and nothing about memory-model
//! details a real GPU might expose; the GPU tests in `byzcoll-cuda` cover those where a GPU is.
//!
//! Each function takes the launch geometry the real launch would use, so grid-stride loops and
//! tile edges are exercised as on the device.

use std::ffi::c_void;

/// Element codes of the kernels' `ELEM` macro.
pub mod elem {
    /// `float`.
    pub const F32: i32 = 0;
    /// bfloat16, as raw `u16` bits.
    pub const BF16: i32 = 1;
    /// IEEE half, as raw `u16` bits.
    pub const F16: i32 = 2;
}

/// "No bad coordinate" in the kernels' `bad` output.
pub const NONE_BAD: u64 = u64::MAX;

extern "C" {
    fn byzcoll_emu_coordinate_network(
        elem: i32,
        rows: *const *const c_void,
        out: *mut c_void,
        d: u64,
        n: i32,
        mode: i32,
        lo: i32,
        hi: i32,
        pairs: *const u32,
        count: usize,
        bad: *mut u64,
        grid: u32,
        block: u32,
    ) -> i32;
    fn byzcoll_emu_bulyan_network(
        elem: i32,
        rows: *const *const c_void,
        out: *mut c_void,
        d: u64,
        n: i32,
        beta: i32,
        pairs: *const u32,
        count: usize,
        bad: *mut u64,
        grid: u32,
        block: u32,
    ) -> i32;
    fn byzcoll_emu_coordinate_select(
        elem: i32,
        rows: *const *const c_void,
        out: *mut c_void,
        d: u64,
        n: i32,
        f: i32,
        mode: i32,
        bad: *mut u64,
        grid: u32,
        block: u32,
        shared: usize,
    ) -> i32;
    fn byzcoll_emu_mean_rows(
        elem: i32,
        rows: *const *const c_void,
        m: i32,
        out: *mut c_void,
        d: u64,
        bad: *mut u64,
        grid: u32,
        block: u32,
    ) -> i32;
    fn byzcoll_emu_distance(
        elem: i32,
        tile: i32,
        rows: *const *const c_void,
        n: i32,
        d: u64,
        tile_rows: *const i32,
        tile_cols: *const i32,
        tiles: i32,
        splits: u32,
        partial: *mut f64,
        flags: *mut u32,
        table: *mut f64,
        reduce_grid: u32,
        reduce_block: u32,
    ) -> i32;
}

/// Checks the element size against its code and every row's length against `d`, and returns
/// the row pointers.
fn row_pointers<T>(elem: i32, rows: &[&[T]], d: usize) -> Vec<*const c_void> {
    let size = if elem == elem::F32 { 4 } else { 2 };
    assert_eq!(
        std::mem::size_of::<T>(),
        size,
        "element code {elem} needs {size}-byte values"
    );
    assert!(
        rows.iter().all(|r| r.len() == d),
        "every row must have length {d}"
    );
    rows.iter().map(|r| r.as_ptr().cast()).collect()
}

fn int(v: usize) -> i32 {
    i32::try_from(v).expect("emulated sizes fit in i32")
}

/// A launch's grid and block size.
#[derive(Debug, Clone, Copy)]
pub struct Grid {
    /// Blocks.
    pub blocks: u32,
    /// Threads per block.
    pub threads: u32,
}

/// A comparator network as the kernels take it: `a0, b0, a1, b1, ...`.
fn flat_pairs(network: &[(usize, usize)]) -> Vec<u32> {
    network
        .iter()
        .flat_map(|&(a, b)| [a as u32, b as u32])
        .collect()
}

/// `coordinate_network` (median when `mode == 0`, trimmed mean of ranks `lo..hi` when 1) with
/// `network`'s compare-exchanges; returns the first bad coordinate or [`NONE_BAD`].
#[allow(clippy::too_many_arguments)]
pub fn coordinate_network<T: Copy>(
    elem: i32,
    rows: &[&[T]],
    out: &mut [T],
    network: &[(usize, usize)],
    mode: i32,
    ranks: std::ops::Range<usize>,
    grid: Grid,
) -> u64 {
    let ptrs = row_pointers(elem, rows, out.len());
    let pairs = flat_pairs(network);
    let mut bad = NONE_BAD;
    // SAFETY: every row holds out.len() values of the element size; pointers outlive the call.
    let rc = unsafe {
        byzcoll_emu_coordinate_network(
            elem,
            ptrs.as_ptr(),
            out.as_mut_ptr().cast(),
            out.len() as u64,
            int(rows.len()),
            mode,
            int(ranks.start),
            int(ranks.end),
            pairs.as_ptr(),
            network.len(),
            &mut bad,
            grid.blocks,
            grid.threads,
        )
    };
    assert_eq!(rc, 0, "unknown element code {elem}");
    bad
}

/// `bulyan_network` over the selected `rows` (all sorted by `network`), averaging `beta`.
pub fn bulyan_network<T: Copy>(
    elem: i32,
    rows: &[&[T]],
    out: &mut [T],
    network: &[(usize, usize)],
    beta: usize,
    grid: Grid,
) -> u64 {
    let ptrs = row_pointers(elem, rows, out.len());
    let pairs = flat_pairs(network);
    let mut bad = NONE_BAD;
    // SAFETY: as in coordinate_network.
    let rc = unsafe {
        byzcoll_emu_bulyan_network(
            elem,
            ptrs.as_ptr(),
            out.as_mut_ptr().cast(),
            out.len() as u64,
            int(rows.len()),
            int(beta),
            pairs.as_ptr(),
            network.len(),
            &mut bad,
            grid.blocks,
            grid.threads,
        )
    };
    assert_eq!(rc, 0, "unknown element code {elem}");
    bad
}

/// `coordinate_select` for any `n` (radix selection in per-thread shared-memory columns).
pub fn coordinate_select<T: Copy>(
    elem: i32,
    rows: &[&[T]],
    out: &mut [T],
    f: usize,
    mode: i32,
    grid: Grid,
    shared_bytes: usize,
) -> u64 {
    let ptrs = row_pointers(elem, rows, out.len());
    let mut bad = NONE_BAD;
    // SAFETY: as in coordinate_network; the shared buffer has `shared_bytes`.
    let rc = unsafe {
        byzcoll_emu_coordinate_select(
            elem,
            ptrs.as_ptr(),
            out.as_mut_ptr().cast(),
            out.len() as u64,
            int(rows.len()),
            int(f),
            mode,
            &mut bad,
            grid.blocks,
            grid.threads,
            shared_bytes,
        )
    };
    assert_eq!(rc, 0, "unknown element code {elem}");
    bad
}

/// `mean_rows` over `rows` in order.
pub fn mean_rows<T: Copy>(elem: i32, rows: &[&[T]], out: &mut [T], grid: Grid) -> u64 {
    let ptrs = row_pointers(elem, rows, out.len());
    let mut bad = NONE_BAD;
    // SAFETY: as in coordinate_network.
    let rc = unsafe {
        byzcoll_emu_mean_rows(
            elem,
            ptrs.as_ptr(),
            int(rows.len()),
            out.as_mut_ptr().cast(),
            out.len() as u64,
            &mut bad,
            grid.blocks,
            grid.threads,
        )
    };
    assert_eq!(rc, 0, "unknown element code {elem}");
    bad
}

/// The distance kernels' outputs.
#[derive(Debug, Clone)]
pub struct Distances {
    /// The `n × n` table of squared distances as the kernels leave it (diagonal zero, rows of
    /// non-finite inputs not yet marked).
    pub table: Vec<f64>,
    /// Per input: non-zero when a non-finite value was seen.
    pub flags: Vec<u32>,
}

/// `distance_tiles` with tiles of `tile` rows (16, 32 or 64) over the upper-triangle `tiles`
/// (row block, column block) with `splits` blocks per tile, then `distance_reduce`.
#[allow(clippy::too_many_arguments)]
pub fn distances<T: Copy>(
    elem: i32,
    tile: usize,
    rows: &[&[T]],
    d: usize,
    tiles: &[(i32, i32)],
    splits: u32,
    reduce: Grid,
) -> Distances {
    let ptrs = row_pointers(elem, rows, d);
    let n = rows.len();
    let tile_rows: Vec<i32> = tiles.iter().map(|t| t.0).collect();
    let tile_cols: Vec<i32> = tiles.iter().map(|t| t.1).collect();
    let mut partial = vec![0.0f64; tiles.len() * splits as usize * tile * tile];
    let mut flags = vec![0u32; n];
    let mut table = vec![0.0f64; n * n];
    // SAFETY: buffers are sized as the kernels index them (tiles × splits × tile², n, n²).
    let rc = unsafe {
        byzcoll_emu_distance(
            elem,
            int(tile),
            ptrs.as_ptr(),
            int(n),
            d as u64,
            tile_rows.as_ptr(),
            tile_cols.as_ptr(),
            int(tiles.len()),
            splits,
            partial.as_mut_ptr(),
            flags.as_mut_ptr(),
            table.as_mut_ptr(),
            reduce.blocks,
            reduce.threads,
        )
    };
    assert_eq!(rc, 0, "unknown element code {elem} or tile {tile}");
    Distances { table, flags }
}
