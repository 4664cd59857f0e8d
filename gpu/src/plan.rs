//! Launch geometry: pure arithmetic shared by the CUDA launches and the CPU emulation tests, so
//! both run the kernels over the same grids and tiles.

use byzcoll_aggregators::sorting_network;

/// Largest `n` compiled into a register sorting network; larger inputs use selection.
pub const NETWORK_MAX_INPUTS: usize = 64;

/// Threads per block of the coordinate-wise kernels.
pub const COORDINATE_THREADS: u32 = 256;

/// Threads per block of `coordinate_select` (its columns are strided by this; the kernel's
/// `SELECT_THREADS`).
pub const SELECT_THREADS: u32 = 32;

/// Coordinates per staged chunk and threads per block of the distance kernel (its `CHUNK` and
/// `DIST_THREADS`).
pub const CHUNK: usize = 32;
/// See [`CHUNK`].
pub const DIST_THREADS: u32 = 256;

/// Rows per side of a distance tile (the kernel's `DTILE`): the smallest of 16, 32 and 64 that
/// holds `n`, so small `n` do not compute empty pairs; 64 above.
pub fn distance_tile(n: usize) -> usize {
    match n {
        0..=16 => 16,
        17..=32 => 32,
        _ => 64,
    }
}

/// Median or trimmed mean (the kernels' `MODE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Coordinate-wise median.
    Median,
    /// Coordinate-wise mean of the ranks kept after trimming.
    Trimmed,
}

impl Mode {
    /// The kernels' code for the mode.
    pub fn code(self) -> i32 {
        match self {
            Mode::Median => 0,
            Mode::Trimmed => 1,
        }
    }
}

/// The sorted ranks a coordinate-wise rule reads from `n` values: the middle one or two for a
/// median, `f..n-f` for a trimmed mean.
pub fn ranks(mode: Mode, n: usize, f: usize) -> std::ops::Range<usize> {
    match mode {
        Mode::Median if n.is_multiple_of(2) => n / 2 - 1..n / 2 + 1,
        Mode::Median => n / 2..n / 2 + 1,
        Mode::Trimmed => f..n - f,
    }
}

/// The pruned sorting network for `n` inputs and the ranks read.
pub fn network(n: usize, ranks: std::ops::Range<usize>) -> Vec<(usize, usize)> {
    sorting_network(n, ranks)
}

/// Blocks for a grid-stride kernel over `items` with `threads` per block: enough to fill the
/// device (`blocks_per_sm` resident per SM), no more than the items need, at least one.
pub fn blocks(items: usize, threads: u32, sms: u32, blocks_per_sm: u32) -> u32 {
    let needed = items.div_ceil(threads as usize).max(1);
    let cap = (sms.max(1) * blocks_per_sm) as usize;
    needed.min(cap) as u32
}

/// Dynamic shared memory of `coordinate_select` for `n` inputs: one column of `n` keys per
/// thread.
pub fn select_shared_bytes(n: usize) -> usize {
    n * SELECT_THREADS as usize * 4
}

/// The distance tiles covering the upper triangle of the `n × n` table, as (row block, column
/// block) with row block ≤ column block, for tiles of [`distance_tile`]`(n)` rows.
pub fn distance_tiles(n: usize) -> Vec<(i32, i32)> {
    let b = n.div_ceil(distance_tile(n)) as i32;
    (0..b).flat_map(|i| (i..b).map(move |j| (i, j))).collect()
}

/// Blocks per tile along the coordinates: about four blocks per SM in all, at most one per
/// chunk of coordinates.
pub fn distance_splits(d: usize, tiles: usize, sms: u32) -> u32 {
    let chunks = d.div_ceil(CHUNK).max(1);
    let wanted = (4 * sms.max(1) as usize).div_ceil(tiles.max(1));
    wanted.clamp(1, chunks) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_the_upper_triangle_once() {
        for n in [1, 2, 16, 17, 33, 63, 64, 65, 128, 200] {
            let tiles = distance_tiles(n);
            let tile = distance_tile(n);
            let b = n.div_ceil(tile);
            assert_eq!(tiles.len(), b * (b + 1) / 2, "n = {n}");
            for i in 0..n {
                for j in i..n {
                    let covering = tiles
                        .iter()
                        .filter(|&&(r, c)| i / tile == r as usize && j / tile == c as usize)
                        .count();
                    assert_eq!(covering, 1, "pair ({i}, {j}) of n = {n}");
                }
            }
        }
    }

    #[test]
    fn grids_are_bounded_by_work_and_device() {
        assert_eq!(blocks(0, 256, 132, 8), 1);
        assert_eq!(blocks(1000, 256, 132, 8), 4);
        assert_eq!(blocks(1 << 25, 256, 132, 8), 1056);
        assert_eq!(distance_splits(1, 1, 132), 1);
        assert_eq!(distance_splits(1 << 25, 1, 132), 528);
        assert_eq!(distance_splits(1 << 25, 3, 132), 176);
    }

    #[test]
    fn ranks_are_the_ones_each_rule_reads() {
        assert_eq!(ranks(Mode::Median, 7, 3), 3..4);
        assert_eq!(ranks(Mode::Median, 8, 3), 3..5);
        assert_eq!(ranks(Mode::Trimmed, 8, 3), 3..5);
        assert_eq!(ranks(Mode::Trimmed, 5, 0), 0..5);
    }
}
