//! Sorting networks applied across a block of coordinates at once.
//!
//! For `n` up to [`MAX_INPUTS`], a block of coordinates is held as `n` rows of total-order keys
//! (row `i` = input `i`'s values for the block), and Batcher's merge-exchange network (Knuth,
//! TAOCP 5.2.2, Algorithm M; valid for any `n`) is run as a sequence of row-wise compare-exchange
//! steps: `(lo, hi) = (min(lo, hi), max(lo, hi))` element by element, which the compiler turns
//! into SIMD min/max. Comparators that cannot affect the rows a rule reads (the middle one or two
//! for a median, the untrimmed band for a trimmed mean) are pruned.
//!
//! That network in memory is bound by its two stores per comparator. `f32` inputs on a CPU with
//! AVX2 therefore take another path for `n <= 32`: 8 columns at a time, up to 16 inputs are
//! sorted completely by `merge_exchange(16)` in registers (columns padded with the largest key,
//! which sorts after every real key); 17 to 32 inputs are sorted as two such halves whose rows
//! are then merged in memory by Batcher's odd-even merge, pruned like the others. Every path
//! leaves the same keys in the rows a rule reads (ties are indistinguishable), so results are
//! bitwise the same on every CPU.
//!
//! The median and the trimmed mean of up to 16 `f32` inputs skip the rows altogether
//! ([`fused`]): a network specialised for `n` sorts 8 (AVX2) or 16 (AVX-512) coordinates in
//! registers and the rule's finish runs there too, so only the result is stored, and each
//! input's next line is prefetched. One core, `d = 2^22`: the median of 16 inputs went from
//! 35 ms to 11-13 ms, under numpy's `mean` of the same data (15 ms).

use crate::Element;

/// Largest `n` handled by networks; larger inputs use selection.
pub(crate) const MAX_INPUTS: usize = 64;

/// Batcher's merge-exchange comparators for `n` wires, in execution order.
fn merge_exchange(n: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    if n < 2 {
        return out;
    }
    let t = usize::BITS - (n - 1).leading_zeros();
    let mut p = 1usize << (t - 1);
    while p > 0 {
        let (mut q, mut r, mut d) = (1usize << (t - 1), 0usize, p);
        loop {
            for i in 0..n - d {
                if i & p == r {
                    out.push((i, i + d));
                }
            }
            if q == p {
                break;
            }
            d = q - p;
            q >>= 1;
            r = p;
        }
        p >>= 1;
    }
    out
}

/// The comparators of the `n`-wire network that can influence wires `needed` (a range of
/// output positions).
pub(crate) fn pruned(n: usize, needed: std::ops::Range<usize>) -> Vec<(usize, usize)> {
    prune(&merge_exchange(n), n, needed)
}

/// The comparators of `all` (on `n` wires) that can influence wires `needed`.
fn prune(all: &[(usize, usize)], n: usize, needed: std::ops::Range<usize>) -> Vec<(usize, usize)> {
    let mut live = vec![false; n];
    live[needed].iter_mut().for_each(|l| *l = true);
    let mut kept: Vec<(usize, usize)> = Vec::with_capacity(all.len());
    for &(a, b) in all.iter().rev() {
        if live[a] || live[b] {
            live[a] = true;
            live[b] = true;
            kept.push((a, b));
        }
    }
    kept.reverse();
    kept
}

/// Batcher's odd-even merge of the sorted halves `0..n/2` and `n/2..n` (`n` a power of two).
fn odd_even_merge(n: usize) -> Vec<(usize, usize)> {
    fn merge(lo: usize, hi: usize, r: usize, out: &mut Vec<(usize, usize)>) {
        let step = r * 2;
        if step < hi - lo {
            merge(lo, hi, step, out);
            merge(lo + r, hi, step, out);
            out.extend((lo + r..hi - r).step_by(step).map(|i| (i, i + r)));
        } else {
            out.push((lo, lo + r));
        }
    }
    let mut out = Vec::new();
    if n >= 2 {
        merge(0, n - 1, 1, &mut out);
    }
    out
}

/// How a block of `n` inputs gets sorted for the rows `needed`: the comparators of the
/// `n`-wire network in memory, and, for the register path of `f32` inputs with
/// `16 < n <= 32`, those of the merge of the two register-sorted halves of 32 padded wires.
#[derive(Debug)]
pub(crate) struct Plan {
    comparators: Vec<(usize, usize)>,
    merge: Vec<(usize, usize)>,
}

impl Plan {
    pub(crate) fn new(n: usize, needed: std::ops::Range<usize>) -> Self {
        Plan {
            comparators: pruned(n, needed.clone()),
            merge: if (17..=32).contains(&n) {
                prune(&odd_even_merge(32), 32, needed)
            } else {
                Vec::new()
            },
        }
    }
}

/// Fills `rows` with the total-order keys of `inputs[i][base..base + width]` (row `i` per input)
/// and sorts every column with `comparators`. Uses AVX2 min/max when the CPU has it.
pub(crate) fn sort_block<T: Element>(
    inputs: &[&[T]],
    base: usize,
    width: usize,
    rows: &mut Vec<T::Key>,
    plan: &Plan,
) {
    let comparators = &plan.comparators[..];
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        let n = inputs.len();
        if n <= avx2_f32::INPUTS && std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() {
            // More than 16 inputs: two halves of 16 (the second padded) sorted in registers,
            // then merged in memory.
            let wires = if n <= 16 { n } else { 32 };
            rows.resize(wires * width, T::Key::default());
            let bits: Vec<&[u32]> = inputs.iter().map(|x| bytemuck::cast_slice(x)).collect();
            if let Ok(keys) = bytemuck::try_cast_slice_mut::<T::Key, i32>(rows) {
                // SAFETY: the CPU supports AVX2, checked just above.
                unsafe { avx2_f32::sort_block(&bits, base, width, keys, &plan.merge) };
                return;
            }
        }
        // SAFETY: the CPU supports AVX2, checked just above.
        unsafe { sort_block_avx2(inputs, base, width, rows, comparators) };
        return;
    }
    sort_block_portable(inputs, base, width, rows, comparators);
}

/// What a fused block ([`fused`]) makes of each sorted column of `n` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finish {
    /// The middle value (odd `n`), or the mean of the two middle values taken in `f64` as
    /// `lo * 0.5 + hi * 0.5` (even `n`).
    Median,
    /// The mean of the values ranked `f..n - f`, summed in `f64` in ascending order and
    /// multiplied by `1 / (n - 2f)`.
    Trimmed {
        /// Values dropped at each end.
        f: usize,
    },
    /// Bulyan's coordinate finish on finite values: the mean of the `beta` values nearest the
    /// median ([`nearest_mean_lanes`]), from the sorted keys spilled to an L1-resident block.
    Nearest {
        /// Values averaged, `1..=n`.
        beta: usize,
    },
}

/// Columns [`nearest_mean_lanes`] takes at once.
pub(crate) const LANES: usize = 16;

/// The mean of the `beta` values nearest the median, for columns `first .. first + cols` (at
/// most [`LANES`]; the other lanes hold nothing meaningful) of `m` sorted rows of `width` keys
/// (row-major; row `i` holds the `i`-th smallest keys): bitwise what
/// [`crate::krum::nearest_mean`]'s shrinking loop gives on each column of finite values, in
/// `f64` (with NaN the count below may differ from the loop; Bulyan finishes finite inputs).
///
/// Branch-free across the columns: the shrinking loop takes `k = m - beta` steps and removes
/// the low end exactly when `median - v(lo) > v(m - 1 - r) - median`, `r` being the number of
/// high ends removed so far. Both sides only shrink as their index moves inwards (`v` is
/// sorted and rounding is monotone), so the steps are a merge of two non-increasing sequences
/// that prefers the high side on ties, and the number of low ends removed is the number of
/// `i < k` with `median - v(i) > v(m - k + i) - median`. The window's values are then added in
/// ascending order from `-0.0`, as `Sum` for `f64` does, and divided by `beta`.
#[inline(always)]
pub(crate) fn nearest_mean_lanes<T: Element>(
    rows: &[T::Key],
    m: usize,
    width: usize,
    first: usize,
    cols: usize,
    beta: usize,
) -> [f64; LANES] {
    let k = m - beta;
    // Row `i`'s values in these columns, in f64 (unused lanes hold 0).
    let v = |i: usize| -> [f64; LANES] {
        let mut x = [0.0f64; LANES];
        let row = &rows[i * width + first..i * width + first + cols];
        for (x, &key) in x.iter_mut().zip(row) {
            *x = T::from_key(key).to_f64();
        }
        x
    };
    let median: [f64; LANES] = if m % 2 == 1 {
        v(m / 2)
    } else {
        let (a, b) = (v(m / 2 - 1), v(m / 2));
        std::array::from_fn(|c| a[c] * 0.5 + b[c] * 0.5)
    };
    let mut lo = [0u64; LANES];
    for i in 0..k {
        let (low, high) = (v(i), v(m - k + i));
        for c in 0..LANES {
            lo[c] += u64::from(median[c] - low[c] > high[c] - median[c]);
        }
    }
    let mut sum = [-0.0f64; LANES];
    for i in 0..m {
        let vi = v(i);
        let i = i as u64;
        for c in 0..LANES {
            let inside = lo[c] <= i && i < lo[c] + beta as u64;
            sum[c] = if inside { sum[c] + vi[c] } else { sum[c] };
        }
    }
    sum.map(|s| s / beta as f64)
}

/// Coordinates per rayon task of the fused path (no scratch: only the rayon granularity).
const FUSED_BLOCK: usize = 8192;

/// What [`fused`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Fused {
    /// `Err(c)`: coordinate `c`, the first, has a non-finite result.
    pub(crate) result: Result<(), usize>,
    /// The inputs (ascending indices) holding a NaN or an infinity. The register kernels keep
    /// the largest and smallest key of the columns they sort (the first and last sorted rows:
    /// two instructions per group of columns); only a block where either is not finite is read
    /// again to tell which inputs.
    pub(crate) non_finite: Vec<usize>,
}

/// The total-order keys ([`Element::key`], as `i32`) of `-f32::MAX` and `f32::MAX`: a key
/// outside them is a NaN's or an infinity's.
#[cfg(target_arch = "x86_64")]
const FINITE_KEYS: (i32, i32) = (0x8080_0000u32 as i32, 0x7f7f_ffff);

/// How far ahead (elements) the register paths prefetch each input's next line into L1, with
/// at most [`L1_STREAMS`] inputs: the hardware prefetcher alone keeps up to 16 interleaved
/// streams poorly fed. Measured: 256 (1 KiB) beat 128 and 512 by a third at `n = 16`,
/// `d = 2^22` on one core.
const AHEAD: usize = 256;

/// With more inputs than this, the lines prefetched [`AHEAD`] would fill L1 (32 inputs × 1 KiB
/// is all of a 32 KiB L1, and rows `d` apart share its sets), evicting each other before they
/// are read; those paths prefetch [`AHEAD_L2`] elements ahead into L2 instead. Measured on one
/// core of an AMD EPYC (AVX-512), `n = 32`, `d = 2^22`, rows of one allocation, both versions
/// timed alike in one process under load: the mean 47-70 → 30-36 ms, the median 64-88 →
/// 50-80 ms, bitwise the same results.
const L1_STREAMS: usize = 16;

/// How far ahead (elements) the paths with more than [`L1_STREAMS`] inputs prefetch into L2.
const AHEAD_L2: usize = 512;

/// `finish` of every coordinate's sorted column straight into `out`, for `f32` inputs, at most
/// 16 of them with AVX2 or 32 with AVX-512: each group of 8 (16) coordinates is loaded, sorted
/// in registers by a network specialised for `n` (padding wires are constants, so every
/// comparator that touches one folds away, and so does every comparator no finished row
/// depends on) and finished there, so no sorted row is stored. Bitwise what sorting the column
/// and finishing it in scalar code gives. `None` where the path does not apply (other types,
/// more inputs, no AVX2): the caller sorts blocks in memory. While it reads the inputs it also
/// finds those holding a NaN or infinity ([`Fused::non_finite`]), so that callers need no
/// pass of their own over cold memory to name them.
pub(crate) fn fused<T: Element>(inputs: &[&[T]], out: &mut [T], finish: Finish) -> Option<Fused> {
    #[cfg(target_arch = "x86_64")]
    {
        let (bits, out, wide) = f32_rows(inputs, out)?;
        let n = bits.len();
        let finish_ok = match finish {
            Finish::Trimmed { f } => 2 * f < n,
            Finish::Nearest { beta } => (1..=n).contains(&beta),
            Finish::Median => true,
        };
        (n >= 1 && n <= if wide { 32 } else { 16 } && finish_ok)
            .then(|| fused_on(&bits, out, finish, wide))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (inputs, out, finish);
        None
    }
}

/// `inputs` and `out` as `f32` bits and values, and whether AVX-512 is there, when they are
/// `f32` and the CPU has AVX2 (what the register paths need); `None` otherwise.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::type_complexity)]
fn f32_rows<'a, T: Element>(
    inputs: &[&'a [T]],
    out: &'a mut [T],
) -> Option<(Vec<&'a [u32]>, &'a mut [f32], bool)> {
    if std::any::TypeId::of::<T>() != std::any::TypeId::of::<f32>()
        || !std::arch::is_x86_feature_detected!("avx2")
    {
        return None;
    }
    let bits = inputs.iter().map(|x| bytemuck::cast_slice(x)).collect();
    let out = bytemuck::try_cast_slice_mut(out).ok()?;
    Some((bits, out, std::arch::is_x86_feature_detected!("avx512f")))
}

/// Runs `block(at, chunk)` on the rayon blocks of `out` (each starting at coordinate `at`);
/// the first non-finite coordinate any of them names, over all blocks.
#[cfg(target_arch = "x86_64")]
fn first_bad_in_blocks(
    out: &mut [f32],
    block: impl Fn(usize, &mut [f32]) -> Result<(), usize> + Sync,
) -> Result<(), usize> {
    use rayon::prelude::*;
    let first_bad = out
        .par_chunks_mut(FUSED_BLOCK)
        .enumerate()
        .filter_map(|(b, chunk)| {
            let at = b * FUSED_BLOCK;
            block(at, chunk).err().map(|c| at + c)
        })
        .min();
    first_bad.map_or(Ok(()), Err)
}

/// Asks for `row`'s line [`AHEAD`] elements past `at` into L1, or, where the path reads more
/// than [`L1_STREAMS`] `inputs`, [`AHEAD_L2`] elements past it into L2; nothing past the end.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(row: &[u32], at: usize, inputs: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
    let to_l2 = inputs > L1_STREAMS;
    let ahead = if to_l2 { AHEAD_L2 } else { AHEAD };
    if let Some(line) = row.get(at + ahead) {
        let line = std::ptr::from_ref(line).cast();
        // SAFETY: a prefetch of an address inside `row` (it never faults anyway).
        unsafe {
            match to_l2 {
                true => _mm_prefetch::<_MM_HINT_T1>(line),
                false => _mm_prefetch::<_MM_HINT_T0>(line),
            }
        }
    }
}

/// The mean of `inputs` in their order, `f32` inputs on a CPU with AVX2: each coordinate's
/// values summed in `f64` in input order and multiplied by `1 / n`, in registers, 16 (AVX-512)
/// or 8 (AVX2) coordinates at a time, each input's next line prefetched; bitwise the scalar
/// `acc += x as f64` loop. `None` where the path does not apply; `Some(Err(c))`: coordinate
/// `c`, the first, is not finite.
pub(crate) fn mean_in_order<T: Element>(
    inputs: &[&[T]],
    out: &mut [T],
) -> Option<Result<(), usize>> {
    #[cfg(target_arch = "x86_64")]
    {
        let (bits, out, wide) = f32_rows(inputs, out)?;
        (!bits.is_empty()).then(|| mean_on(&bits, out, wide))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (inputs, out);
        None
    }
}

/// [`mean_in_order`] on `f32` bits with AVX-512 (`wide`) or AVX2, which the CPU must have.
#[cfg(target_arch = "x86_64")]
fn mean_on(bits: &[&[u32]], out: &mut [f32], wide: bool) -> Result<(), usize> {
    first_bad_in_blocks(out, |at, chunk| {
        // SAFETY: the CPU supports the path's instructions (the caller's guarantee).
        unsafe {
            match wide {
                true => avx512_f32::mean_in_order(bits, at, chunk),
                false => avx2_f32::mean_in_order(bits, at, chunk),
            }
        }
    })
}

/// [`fused`] on `f32` bits with AVX-512 (`wide`) or AVX2, which the CPU must have.
#[cfg(target_arch = "x86_64")]
fn fused_on(bits: &[&[u32]], out: &mut [f32], finish: Finish, wide: bool) -> Fused {
    use rayon::prelude::*;
    // Per block: its first non-finite result, and whether some input value in it is not finite.
    let blocks: Vec<(Option<usize>, bool)> = out
        .par_chunks_mut(FUSED_BLOCK)
        .enumerate()
        .map(|(b, chunk)| {
            let at = b * FUSED_BLOCK;
            // SAFETY: the CPU supports the path's instructions (the caller's guarantee).
            let (done, suspect) = unsafe {
                match wide {
                    true => avx512_f32::fused(bits, at, chunk, finish),
                    false => avx2_f32::fused(bits, at, chunk, finish),
                }
            };
            (done.err().map(|c| at + c), suspect)
        })
        .collect();
    let result = blocks
        .iter()
        .filter_map(|&(bad, _)| bad)
        .min()
        .map_or(Ok(()), Err);
    let suspects: Vec<std::ops::Range<usize>> = blocks
        .iter()
        .enumerate()
        .filter(|&(_, &(_, suspect))| suspect)
        .map(|(b, _)| b * FUSED_BLOCK..((b + 1) * FUSED_BLOCK).min(out.len()))
        .collect();
    let non_finite = match suspects.is_empty() {
        true => Vec::new(),
        false => (0..bits.len())
            .into_par_iter()
            .filter(|&i| {
                let row: &[f32] = bytemuck::cast_slice(bits[i]);
                suspects.iter().any(|r| !crate::all_finite(&row[r.clone()]))
            })
            .collect(),
    };
    Fused { result, non_finite }
}

/// `merge_exchange(16)` as `$cs!(a, b)` statements, spelled out so that the compiler sees
/// every index and keeps the 16 rows in registers (a test checks it against
/// [`merge_exchange`]).
macro_rules! merge_exchange_16 {
    ($cs:ident) => {
        $cs!(0, 8);
        $cs!(1, 9);
        $cs!(2, 10);
        $cs!(3, 11);
        $cs!(4, 12);
        $cs!(5, 13);
        $cs!(6, 14);
        $cs!(7, 15);
        $cs!(0, 4);
        $cs!(1, 5);
        $cs!(2, 6);
        $cs!(3, 7);
        $cs!(8, 12);
        $cs!(9, 13);
        $cs!(10, 14);
        $cs!(11, 15);
        $cs!(4, 8);
        $cs!(5, 9);
        $cs!(6, 10);
        $cs!(7, 11);
        $cs!(0, 2);
        $cs!(1, 3);
        $cs!(4, 6);
        $cs!(5, 7);
        $cs!(8, 10);
        $cs!(9, 11);
        $cs!(12, 14);
        $cs!(13, 15);
        $cs!(2, 8);
        $cs!(3, 9);
        $cs!(6, 12);
        $cs!(7, 13);
        $cs!(2, 4);
        $cs!(3, 5);
        $cs!(6, 8);
        $cs!(7, 9);
        $cs!(10, 12);
        $cs!(11, 13);
        $cs!(0, 1);
        $cs!(2, 3);
        $cs!(4, 5);
        $cs!(6, 7);
        $cs!(8, 9);
        $cs!(10, 11);
        $cs!(12, 13);
        $cs!(14, 15);
        $cs!(1, 8);
        $cs!(3, 10);
        $cs!(5, 12);
        $cs!(7, 14);
        $cs!(1, 4);
        $cs!(3, 6);
        $cs!(5, 8);
        $cs!(7, 10);
        $cs!(9, 12);
        $cs!(11, 14);
        $cs!(1, 2);
        $cs!(3, 4);
        $cs!(5, 6);
        $cs!(7, 8);
        $cs!(9, 10);
        $cs!(11, 12);
        $cs!(13, 14);
    };
}

/// `$m!(i)` for `i` in `0..16`, with literal indices.
macro_rules! each_of_16 {
    ($m:ident) => {
        $m!(0);
        $m!(1);
        $m!(2);
        $m!(3);
        $m!(4);
        $m!(5);
        $m!(6);
        $m!(7);
        $m!(8);
        $m!(9);
        $m!(10);
        $m!(11);
        $m!(12);
        $m!(13);
        $m!(14);
        $m!(15);
    };
}

/// Batcher's odd-even merge of two sorted halves of 32 wires ([`odd_even_merge`]`(32)`) as
/// `$cs!(a, b)` statements (a test checks it against [`odd_even_merge`]).
macro_rules! odd_even_merge_32 {
    ($cs:ident) => {
        $cs!(0, 16);
        $cs!(8, 24);
        $cs!(8, 16);
        $cs!(4, 20);
        $cs!(12, 28);
        $cs!(12, 20);
        $cs!(4, 8);
        $cs!(12, 16);
        $cs!(20, 24);
        $cs!(2, 18);
        $cs!(10, 26);
        $cs!(10, 18);
        $cs!(6, 22);
        $cs!(14, 30);
        $cs!(14, 22);
        $cs!(6, 10);
        $cs!(14, 18);
        $cs!(22, 26);
        $cs!(2, 4);
        $cs!(6, 8);
        $cs!(10, 12);
        $cs!(14, 16);
        $cs!(18, 20);
        $cs!(22, 24);
        $cs!(26, 28);
        $cs!(1, 17);
        $cs!(9, 25);
        $cs!(9, 17);
        $cs!(5, 21);
        $cs!(13, 29);
        $cs!(13, 21);
        $cs!(5, 9);
        $cs!(13, 17);
        $cs!(21, 25);
        $cs!(3, 19);
        $cs!(11, 27);
        $cs!(11, 19);
        $cs!(7, 23);
        $cs!(15, 31);
        $cs!(15, 23);
        $cs!(7, 11);
        $cs!(15, 19);
        $cs!(23, 27);
        $cs!(3, 5);
        $cs!(7, 9);
        $cs!(11, 13);
        $cs!(15, 17);
        $cs!(19, 21);
        $cs!(23, 25);
        $cs!(27, 29);
        $cs!(1, 2);
        $cs!(3, 4);
        $cs!(5, 6);
        $cs!(7, 8);
        $cs!(9, 10);
        $cs!(11, 12);
        $cs!(13, 14);
        $cs!(15, 16);
        $cs!(17, 18);
        $cs!(19, 20);
        $cs!(21, 22);
        $cs!(23, 24);
        $cs!(25, 26);
        $cs!(27, 28);
        $cs!(29, 30);
    };
}

/// `$m!(i)` for `i` in `0..32`, with literal indices.
macro_rules! each_of_32 {
    ($m:ident) => {
        each_of_16!($m);
        $m!(16);
        $m!(17);
        $m!(18);
        $m!(19);
        $m!(20);
        $m!(21);
        $m!(22);
        $m!(23);
        $m!(24);
        $m!(25);
        $m!(26);
        $m!(27);
        $m!(28);
        $m!(29);
        $m!(30);
        $m!(31);
    };
}

/// `f32` blocks of at most 16 inputs, sorted in AVX2 registers: the memory network's two
/// stores per comparator, not its min/max, bound its speed.
#[cfg(target_arch = "x86_64")]
mod avx2_f32 {
    use std::arch::x86_64::{
        __m256, __m256i, _mm256_add_pd, _mm256_and_si256, _mm256_castps256_ps128,
        _mm256_castps_si256, _mm256_castsi256_ps, _mm256_cmpeq_epi32, _mm256_cmpgt_epi32,
        _mm256_cvtpd_ps, _mm256_cvtps_pd, _mm256_extractf128_ps, _mm256_max_epi32,
        _mm256_min_epi32, _mm256_movemask_ps, _mm256_mul_pd, _mm256_or_si256, _mm256_set1_epi32,
        _mm256_set1_pd, _mm256_set_m128, _mm256_setzero_pd, _mm256_srai_epi32, _mm256_srli_epi32,
        _mm256_xor_si256,
    };

    use super::FINITE_KEYS;

    /// Largest `n` taken.
    pub(super) const INPUTS: usize = 32;

    /// Sorts every column of the first 16 inputs completely (so whatever rows a rule reads
    /// are in place) with the 16-wire network in registers, 8 columns at a time: each column's
    /// keys (`f32` total-order keys, as [`crate::Element::key`] makes them) are padded with
    /// `i32::MAX`, the largest key, which sorts after every real key (ties are
    /// indistinguishable), so rows `0..n` end up exactly the sorted column. With more than 16
    /// inputs the others are sorted the same way into rows `16..32` (padded to 16 rows with
    /// the largest key) and the halves merged by `merge` (comparators on 32 wires). `rows`:
    /// `n` rows of `width` keys, or 32 rows when `n > 16`.
    #[target_feature(enable = "avx2")]
    pub(super) fn sort_block(
        inputs: &[&[u32]],
        base: usize,
        width: usize,
        rows: &mut [i32],
        merge: &[(usize, usize)],
    ) {
        let (low, high) = inputs.split_at(inputs.len().min(16));
        sort_block_16(low, base, width, rows);
        if !high.is_empty() {
            sort_block_16(high, base, width, &mut rows[16 * width..]);
            // Pad the second half to 16 rows with the largest key.
            let filled = 16 * width + high.len() * width;
            rows[filled..32 * width].fill(i32::MAX);
            super::apply(rows, width, merge);
        }
    }

    macro_rules! sort_block_with {
        ($name:ident, $wires:literal, $network:ident, $each:ident) => {
            #[target_feature(enable = "avx2")]
            fn $name(inputs: &[&[u32]], base: usize, width: usize, rows: &mut [i32]) {
                let n = inputs.len();
                let top = _mm256_set1_epi32(i32::MAX);
                let mut start = 0;
                while start < width {
                    let lanes = (width - start).min(8);
                    let load = |i: usize| -> __m256i {
                        let mut bits = [0u32; 8];
                        let src = &inputs[i][base + start..base + start + lanes];
                        match <&[u32; 8]>::try_from(src) {
                            Ok(full) => bits = *full,
                            Err(_) => bits[..lanes].copy_from_slice(src),
                        }
                        let b: __m256i = bytemuck::cast(bits);
                        // The key of `crate::Element::key` for `f32`: flip the magnitude bits
                        // of negative values.
                        _mm256_xor_si256(b, _mm256_srli_epi32::<1>(_mm256_srai_epi32::<31>(b)))
                    };
                    let mut v = [top; $wires];
                    macro_rules! load {
                        ($i:literal) => {
                            if $i < n {
                                v[$i] = load($i);
                            }
                        };
                    }
                    $each!(load);
                    macro_rules! cs {
                        ($a:literal, $b:literal) => {
                            let (x, y) = (v[$a], v[$b]);
                            v[$a] = _mm256_min_epi32(x, y);
                            v[$b] = _mm256_max_epi32(x, y);
                        };
                    }
                    $network!(cs);
                    macro_rules! store {
                        ($i:literal) => {
                            if $i < n {
                                let keys: [i32; 8] = bytemuck::cast(v[$i]);
                                let at = $i * width + start;
                                let dst = &mut rows[at..at + lanes];
                                match <&mut [i32; 8]>::try_from(&mut *dst) {
                                    Ok(full) => *full = keys,
                                    Err(_) => dst.copy_from_slice(&keys[..lanes]),
                                }
                            }
                        };
                    }
                    $each!(store);
                    start += lanes;
                }
            }
        };
    }

    sort_block_with!(sort_block_16, 16, merge_exchange_16, each_of_16);

    /// [`super::fused`] on `out.len()` coordinates from `base`, `n = inputs.len()` in `1..=16`
    /// (and `2f < n`): the offset in `out` of the first non-finite result, and whether some
    /// input value read is not finite.
    #[target_feature(enable = "avx2")]
    pub(super) fn fused(
        inputs: &[&[u32]],
        base: usize,
        out: &mut [f32],
        finish: super::Finish,
    ) -> (Result<(), usize>, bool) {
        macro_rules! by_n {
            ($($n:literal)*) => {
                match inputs.len() {
                    $($n => fused_n::<$n>(inputs, base, out, finish),)*
                    other => unreachable!("the fused path takes 1..=16 inputs, not {other}"),
                }
            };
        }
        by_n!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
    }

    /// The `f32` bits of total-order keys (the key map is its own inverse).
    macro_rules! bits_of {
        ($k:expr) => {{
            let k = $k;
            _mm256_castsi256_ps(_mm256_xor_si256(
                k,
                _mm256_srli_epi32::<1>(_mm256_srai_epi32::<31>(k)),
            ))
        }};
    }

    /// The two `f64` halves of 8 `f32` lanes (lanes 0..4, 4..8).
    macro_rules! widen {
        ($x:expr) => {{
            let x: __m256 = $x;
            (
                _mm256_cvtps_pd(_mm256_castps256_ps128(x)),
                _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x)),
            )
        }};
    }

    /// `lanes` (at most 8) elements of `row` from `at` as the bits of 8 lanes (the rest 0).
    macro_rules! load8 {
        ($row:expr, $at:expr, $lanes:expr) => {{
            let mut bits = [0u32; 8];
            let src = &$row[$at..$at + $lanes];
            match <&[u32; 8]>::try_from(src) {
                Ok(full) => bits = *full,
                Err(_) => bits[..$lanes].copy_from_slice(src),
            }
            bytemuck::cast::<_, __m256i>(bits)
        }};
    }

    /// Stores the first `lanes` lanes of `result` at `out[start..]`; the offset in `out` of
    /// the first of them that is not finite.
    macro_rules! store8 {
        ($result:expr, $out:expr, $start:expr, $lanes:expr) => {{
            let (result, start, lanes) = ($result, $start, $lanes);
            let exponent = _mm256_set1_epi32(0x7f80_0000);
            let as_bits = _mm256_castps_si256(result);
            let bad = _mm256_cmpeq_epi32(_mm256_and_si256(as_bits, exponent), exponent);
            let bad = (_mm256_movemask_ps(_mm256_castsi256_ps(bad)) as u32) & ((1u32 << lanes) - 1);
            let values: [f32; 8] = bytemuck::cast(result);
            let dst = &mut $out[start..start + lanes];
            match <&mut [f32; 8]>::try_from(&mut *dst) {
                Ok(full) => *full = values,
                Err(_) => dst.copy_from_slice(&values[..lanes]),
            }
            (bad != 0).then(|| start + bad.trailing_zeros() as usize)
        }};
    }

    /// [`super::mean_in_order`] on `out.len()` coordinates from `base`: the offset in `out`
    /// of the first non-finite result.
    #[target_feature(enable = "avx2")]
    pub(super) fn mean_in_order(
        inputs: &[&[u32]],
        base: usize,
        out: &mut [f32],
    ) -> Result<(), usize> {
        let width = out.len();
        let scale = _mm256_set1_pd(1.0 / inputs.len() as f64);
        // Every coordinate is written, the first non-finite one remembered.
        let mut first_bad = None;
        let mut start = 0;
        while start < width {
            let lanes = (width - start).min(8);
            let at = base + start;
            let (mut a0, mut a1) = (_mm256_setzero_pd(), _mm256_setzero_pd());
            for row in inputs {
                if at.is_multiple_of(16) {
                    super::prefetch_ahead(row, at, inputs.len());
                }
                let (x0, x1) = widen!(_mm256_castsi256_ps(load8!(row, at, lanes)));
                a0 = _mm256_add_pd(a0, x0);
                a1 = _mm256_add_pd(a1, x1);
            }
            let result = _mm256_set_m128(
                _mm256_cvtpd_ps(_mm256_mul_pd(a1, scale)),
                _mm256_cvtpd_ps(_mm256_mul_pd(a0, scale)),
            );
            let bad = store8!(result, out, start, lanes);
            first_bad = first_bad.or(bad);
            start += lanes;
        }
        first_bad.map_or(Ok(()), Err)
    }

    #[target_feature(enable = "avx2")]
    fn fused_n<const N: usize>(
        inputs: &[&[u32]],
        base: usize,
        out: &mut [f32],
        finish: super::Finish,
    ) -> (Result<(), usize>, bool) {
        let width = out.len();
        let top = _mm256_set1_epi32(i32::MAX);
        // The largest and smallest key of every column sorted, per lane.
        let (mut largest, mut smallest) = (_mm256_set1_epi32(i32::MIN), top);
        let half = _mm256_set1_pd(0.5);
        let (lo_rank, hi_rank, scale) = match finish {
            super::Finish::Median | super::Finish::Nearest { .. } => (0, 0, 0.0),
            super::Finish::Trimmed { f } => (f, N - f, 1.0 / (N - 2 * f) as f64),
        };
        let scale = _mm256_set1_pd(scale);
        // Every coordinate is written, the first non-finite one remembered.
        let mut first_bad = None;
        let mut start = 0;
        while start < width {
            let lanes = (width - start).min(8);
            if (base + start).is_multiple_of(16) {
                // Once per line.
                inputs
                    .iter()
                    .for_each(|row| super::prefetch_ahead(row, base + start, N));
            }
            let mut v = [top; 16];
            macro_rules! load {
                ($i:literal) => {
                    if $i < N {
                        let b = load8!(inputs[$i], base + start, lanes);
                        v[$i] =
                            _mm256_xor_si256(b, _mm256_srli_epi32::<1>(_mm256_srai_epi32::<31>(b)));
                    }
                };
            }
            each_of_16!(load);
            macro_rules! cs {
                ($a:literal, $b:literal) => {
                    let (x, y) = (v[$a], v[$b]);
                    v[$a] = _mm256_min_epi32(x, y);
                    v[$b] = _mm256_max_epi32(x, y);
                };
            }
            merge_exchange_16!(cs);
            largest = _mm256_max_epi32(largest, v[N - 1]);
            smallest = _mm256_min_epi32(smallest, v[0]);
            let result = match finish {
                super::Finish::Median if N % 2 == 1 => bits_of!(v[N / 2]),
                super::Finish::Median => {
                    let (l0, l1) = widen!(bits_of!(v[N / 2 - 1]));
                    let (h0, h1) = widen!(bits_of!(v[N / 2]));
                    // Rounded to nearest as `as f32` does.
                    _mm256_set_m128(
                        _mm256_cvtpd_ps(_mm256_add_pd(
                            _mm256_mul_pd(l1, half),
                            _mm256_mul_pd(h1, half),
                        )),
                        _mm256_cvtpd_ps(_mm256_add_pd(
                            _mm256_mul_pd(l0, half),
                            _mm256_mul_pd(h0, half),
                        )),
                    )
                }
                super::Finish::Trimmed { .. } => {
                    let (mut a0, mut a1) = (_mm256_setzero_pd(), _mm256_setzero_pd());
                    macro_rules! add {
                        ($i:literal) => {
                            if $i < N && $i >= lo_rank && $i < hi_rank {
                                let (x0, x1) = widen!(bits_of!(v[$i]));
                                a0 = _mm256_add_pd(a0, x0);
                                a1 = _mm256_add_pd(a1, x1);
                            }
                        };
                    }
                    each_of_16!(add);
                    _mm256_set_m128(
                        _mm256_cvtpd_ps(_mm256_mul_pd(a1, scale)),
                        _mm256_cvtpd_ps(_mm256_mul_pd(a0, scale)),
                    )
                }
                super::Finish::Nearest { beta } => {
                    let mut rows = [0i32; 8 * 16];
                    macro_rules! spill {
                        ($i:literal) => {
                            if $i < N {
                                rows[$i * 8..$i * 8 + 8]
                                    .copy_from_slice(&bytemuck::cast::<__m256i, [i32; 8]>(v[$i]));
                            }
                        };
                    }
                    each_of_16!(spill);
                    let means = super::nearest_mean_lanes::<f32>(&rows, N, 8, 0, 8, beta);
                    bytemuck::cast::<[f32; 8], __m256>(std::array::from_fn(|c| means[c] as f32))
                }
            };
            let bad = store8!(result, out, start, lanes);
            first_bad = first_bad.or(bad);
            start += lanes;
        }
        // Infinities and NaNs have the keys beyond those of `f32::MAX` and `-f32::MAX`.
        let above = _mm256_cmpgt_epi32(largest, _mm256_set1_epi32(FINITE_KEYS.1));
        let below = _mm256_cmpgt_epi32(_mm256_set1_epi32(FINITE_KEYS.0), smallest);
        let outside = _mm256_castsi256_ps(_mm256_or_si256(above, below));
        let suspect = _mm256_movemask_ps(outside) != 0;
        (first_bad.map_or(Ok(()), Err), suspect)
    }
}

/// The fused path with AVX-512: 16 coordinates at a time, so each input's group is one whole
/// cache line, read once (with 8 lanes, the 16 inputs' lines at one offset compete for the
/// same L1 set and a line is often evicted before its second half is read), and the 16 wires
/// stay in the 32 registers.
#[cfg(target_arch = "x86_64")]
mod avx512_f32 {
    use super::FINITE_KEYS;
    use std::arch::x86_64::{
        __m512, __m512i, _mm256_castpd_ps, _mm256_castps_pd, _mm512_add_pd, _mm512_and_si512,
        _mm512_castpd256_pd512, _mm512_castpd_ps, _mm512_castps512_ps256, _mm512_castps_pd,
        _mm512_castps_si512, _mm512_castsi512_ps, _mm512_cmpeq_epi32_mask, _mm512_cmpgt_epi32_mask,
        _mm512_cmplt_epi32_mask, _mm512_cvtpd_ps, _mm512_cvtps_pd, _mm512_extractf64x4_pd,
        _mm512_insertf64x4, _mm512_loadu_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_epi32,
        _mm512_max_epi32, _mm512_min_epi32, _mm512_mul_pd, _mm512_set1_epi32, _mm512_set1_pd,
        _mm512_setzero_pd, _mm512_srai_epi32, _mm512_srli_epi32, _mm512_storeu_si512,
        _mm512_xor_si512,
    };

    /// [`super::fused`] on `out.len()` coordinates from `base` (`n = inputs.len()` in
    /// `1..=32`, `2f < n`): the offset in `out` of the first non-finite result, and whether
    /// some input value read is not finite.
    #[target_feature(enable = "avx512f")]
    pub(super) fn fused(
        inputs: &[&[u32]],
        base: usize,
        out: &mut [f32],
        finish: super::Finish,
    ) -> (Result<(), usize>, bool) {
        macro_rules! by_n {
            ($($n:literal)* ; $($m:literal)*) => {
                match inputs.len() {
                    $($n => fused_n::<$n>(inputs, base, out, finish),)*
                    $($m => fused_n32::<$m>(inputs, base, out, finish),)*
                    other => unreachable!("the fused path takes 1..=32 inputs, not {other}"),
                }
            };
        }
        by_n!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16;
              17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32)
    }

    /// The 32 wires sorted: each half of 16 by `merge_exchange(16)`, then the halves merged
    /// by Batcher's odd-even merge (`$cs!(a, b)` on literal indices throughout).
    macro_rules! two_halves_merged {
        ($cs:ident) => {
            merge_exchange_16!($cs);
            macro_rules! cs_high {
                ($a:literal, $b:literal) => {
                    $cs!($a + 16, $b + 16);
                };
            }
            merge_exchange_16!(cs_high);
            odd_even_merge_32!($cs);
        };
    }

    /// Keys from `f32` bits and back (the map is its own inverse).
    macro_rules! flip {
        ($k:expr) => {{
            let k: __m512i = $k;
            _mm512_xor_si512(k, _mm512_srli_epi32::<1>(_mm512_srai_epi32::<31>(k)))
        }};
    }

    /// The two `f64` halves (lanes 0..8, 8..16) of 16 `f32` lanes given as keys.
    macro_rules! widen {
        ($k:expr) => {{
            let x: __m512 = _mm512_castsi512_ps(flip!($k));
            (
                _mm512_cvtps_pd(_mm512_castps512_ps256(x)),
                _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                    _mm512_castps_pd(x),
                ))),
            )
        }};
    }

    /// 16 `f32` lanes from two `f64` halves, each rounded to nearest as `as f32` does.
    macro_rules! narrow {
        ($lo:expr, $hi:expr) => {{
            let lo = _mm512_cvtpd_ps($lo);
            let hi = _mm512_cvtpd_ps($hi);
            _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
                _mm256_castps_pd(hi),
            ))
        }};
    }

    /// The mask of the first `lanes` (at most 16) lanes.
    fn lanes_mask(lanes: usize) -> u16 {
        if lanes == 16 {
            u16::MAX
        } else {
            (1u16 << lanes) - 1
        }
    }

    /// `lanes` (at most 16, `mask` their mask) elements of `row` from `at`, as bits; the
    /// masked-off lanes are 0.
    macro_rules! load16 {
        ($row:expr, $at:expr, $mask:expr, $lanes:expr) => {{
            let src = &$row[$at..$at + $lanes];
            // SAFETY: the mask covers exactly the elements of `src`.
            unsafe { _mm512_maskz_loadu_epi32($mask, src.as_ptr().cast()) }
        }};
    }

    /// Stores the `lanes` masked lanes of `result` at `out[start..]`; the offset in `out` of
    /// the first of them that is not finite.
    macro_rules! store16 {
        ($result:expr, $out:expr, $start:expr, $mask:expr, $lanes:expr) => {{
            let (result, start, mask) = ($result, $start, $mask);
            let exponent = _mm512_set1_epi32(0x7f80_0000);
            let bad = _mm512_cmpeq_epi32_mask(
                _mm512_and_si512(_mm512_castps_si512(result), exponent),
                exponent,
            ) & mask;
            let dst = &mut $out[start..start + $lanes];
            // SAFETY: the mask covers exactly the elements of `dst`.
            unsafe { _mm512_mask_storeu_ps(dst.as_mut_ptr(), mask, result) };
            (bad != 0).then(|| start + bad.trailing_zeros() as usize)
        }};
    }

    /// [`super::mean_in_order`] on `out.len()` coordinates from `base`: the offset in `out`
    /// of the first non-finite result.
    #[target_feature(enable = "avx512f")]
    pub(super) fn mean_in_order(
        inputs: &[&[u32]],
        base: usize,
        out: &mut [f32],
    ) -> Result<(), usize> {
        let width = out.len();
        let scale = _mm512_set1_pd(1.0 / inputs.len() as f64);
        // Every coordinate is written, the first non-finite one remembered.
        let mut first_bad = None;
        let mut start = 0;
        while start < width {
            let lanes = (width - start).min(16);
            let mask = lanes_mask(lanes);
            let at = base + start;
            let (mut a0, mut a1) = (_mm512_setzero_pd(), _mm512_setzero_pd());
            for row in inputs {
                super::prefetch_ahead(row, at, inputs.len());
                let x: __m512 = _mm512_castsi512_ps(load16!(row, at, mask, lanes));
                a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
                a1 = _mm512_add_pd(
                    a1,
                    _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                        _mm512_castps_pd(x),
                    ))),
                );
            }
            let result = narrow!(_mm512_mul_pd(a0, scale), _mm512_mul_pd(a1, scale));
            first_bad = first_bad.or(store16!(result, out, start, mask, lanes));
            start += lanes;
        }
        first_bad.map_or(Ok(()), Err)
    }

    /// `fused_n::<N>` for `N` up to `$wires` (16: the network in registers; 32: two halves of
    /// 16 sorted so, then Batcher's odd-even merge, also in registers).
    macro_rules! fused_with {
        ($name:ident, $wires:literal, $each:ident, $sort:ident) => {
            #[target_feature(enable = "avx512f")]
            fn $name<const N: usize>(
                inputs: &[&[u32]],
                base: usize,
                out: &mut [f32],
                finish: super::Finish,
            ) -> (Result<(), usize>, bool) {
                let width = out.len();
                let top = _mm512_set1_epi32(i32::MAX);
                // The largest and smallest key of every column sorted, per lane.
                let (mut largest, mut smallest) = (_mm512_set1_epi32(i32::MIN), top);
                let half = _mm512_set1_pd(0.5);
                let (lo_rank, hi_rank, scale) = match finish {
                    super::Finish::Median | super::Finish::Nearest { .. } => (0, 0, 0.0),
                    super::Finish::Trimmed { f } => (f, N - f, 1.0 / (N - 2 * f) as f64),
                };
                let scale = _mm512_set1_pd(scale);
                // Every coordinate is written, the first non-finite one remembered.
                let mut first_bad = None;
                let mut start = 0;
                while start < width {
                    let lanes = (width - start).min(16);
                    let mask = lanes_mask(lanes);
                    let at = base + start;
                    let mut v = [top; $wires];
                    macro_rules! load {
                        ($i:literal) => {
                            if $i < N {
                                super::prefetch_ahead(inputs[$i], at, N);
                                v[$i] = flip!(load16!(inputs[$i], at, mask, lanes));
                            }
                        };
                    }
                    $each!(load);
                    macro_rules! cs {
                        ($a:expr, $b:expr) => {
                            let (x, y) = (v[$a], v[$b]);
                            v[$a] = _mm512_min_epi32(x, y);
                            v[$b] = _mm512_max_epi32(x, y);
                        };
                    }
                    $sort!(cs);
                    largest = _mm512_max_epi32(largest, v[N - 1]);
                    smallest = _mm512_min_epi32(smallest, v[0]);
                    let result: __m512 = match finish {
                        super::Finish::Median if N % 2 == 1 => _mm512_castsi512_ps(flip!(v[N / 2])),
                        super::Finish::Median => {
                            let (l0, l1) = widen!(v[N / 2 - 1]);
                            let (h0, h1) = widen!(v[N / 2]);
                            narrow!(
                                _mm512_add_pd(_mm512_mul_pd(l0, half), _mm512_mul_pd(h0, half)),
                                _mm512_add_pd(_mm512_mul_pd(l1, half), _mm512_mul_pd(h1, half))
                            )
                        }
                        super::Finish::Trimmed { .. } => {
                            let (mut a0, mut a1) = (_mm512_setzero_pd(), _mm512_setzero_pd());
                            macro_rules! add {
                                ($i:literal) => {
                                    if $i < N && $i >= lo_rank && $i < hi_rank {
                                        let (x0, x1) = widen!(v[$i]);
                                        a0 = _mm512_add_pd(a0, x0);
                                        a1 = _mm512_add_pd(a1, x1);
                                    }
                                };
                            }
                            $each!(add);
                            narrow!(_mm512_mul_pd(a0, scale), _mm512_mul_pd(a1, scale))
                        }
                        super::Finish::Nearest { beta } => {
                            let mut rows = [0i32; 16 * $wires];
                            macro_rules! spill {
                                ($i:literal) => {
                                    if $i < N {
                                        let dst = &mut rows[$i * 16..$i * 16 + 16];
                                        // SAFETY: `dst` holds exactly 16 `i32`.
                                        unsafe {
                                            _mm512_storeu_si512(dst.as_mut_ptr().cast(), v[$i])
                                        };
                                    }
                                };
                            }
                            $each!(spill);
                            let means = super::nearest_mean_lanes::<f32>(&rows, N, 16, 0, 16, beta);
                            let means: [f32; 16] = std::array::from_fn(|c| means[c] as f32);
                            // SAFETY: `means` holds exactly 16 `f32`.
                            unsafe { _mm512_loadu_ps(means.as_ptr()) }
                        }
                    };
                    first_bad = first_bad.or(store16!(result, out, start, mask, lanes));
                    start += lanes;
                }
                // Infinities and NaNs have the keys beyond those of `f32::MAX` and
                // `-f32::MAX`.
                let above = _mm512_cmpgt_epi32_mask(largest, _mm512_set1_epi32(FINITE_KEYS.1));
                let below = _mm512_cmplt_epi32_mask(smallest, _mm512_set1_epi32(FINITE_KEYS.0));
                let suspect = (above | below) != 0;
                (first_bad.map_or(Ok(()), Err), suspect)
            }
        };
    }

    fused_with!(fused_n, 16, each_of_16, merge_exchange_16);
    fused_with!(fused_n32, 32, each_of_32, two_halves_merged);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sort_block_avx2<T: Element>(
    inputs: &[&[T]],
    base: usize,
    width: usize,
    rows: &mut Vec<T::Key>,
    comparators: &[(usize, usize)],
) {
    sort_block_portable(inputs, base, width, rows, comparators);
}

#[inline(always)]
fn sort_block_portable<T: Element>(
    inputs: &[&[T]],
    base: usize,
    width: usize,
    rows: &mut Vec<T::Key>,
    comparators: &[(usize, usize)],
) {
    rows.resize(inputs.len() * width, T::Key::default());
    for (row, x) in rows.chunks_exact_mut(width).zip(inputs) {
        for (k, v) in row.iter_mut().zip(&x[base..base + width]) {
            *k = v.key();
        }
    }
    apply(rows, width, comparators);
}

/// Runs `comparators` over `rows` (`n` rows of `width` keys, row-major).
#[inline(always)]
pub(crate) fn apply<K: Ord + Copy>(rows: &mut [K], width: usize, comparators: &[(usize, usize)]) {
    for &(a, b) in comparators {
        // a < b always: split so both rows can be borrowed.
        let (head, tail) = rows.split_at_mut(b * width);
        let lo = &mut head[a * width..(a + 1) * width];
        let hi = &mut tail[..width];
        for (x, y) in lo.iter_mut().zip(hi.iter_mut()) {
            let (p, q) = (*x, *y);
            *x = p.min(q);
            *y = p.max(q);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn networks_sort_every_zero_one_input() {
        // The 0-1 principle: a comparator network sorts everything iff it sorts all 0/1 inputs.
        for n in 1..=12usize {
            let net = merge_exchange(n);
            for bits in 0u32..(1 << n) {
                let mut v: Vec<u8> = (0..n).map(|i| ((bits >> i) & 1) as u8).collect();
                apply(&mut v, 1, &net);
                assert!(v.windows(2).all(|w| w[0] <= w[1]), "n={n} bits={bits:b}");
            }
        }
    }

    /// Both fused paths (AVX2 and AVX-512, where the CPU has them) against sorting each
    /// column and finishing it in scalar code: bitwise the same results, the same first
    /// non-finite coordinate and exactly the inputs holding NaN or infinities, for every `n`
    /// they take, tails of every length and several rayon blocks, with NaN, infinities, signed
    /// zeros and the largest finite values in some of the inputs (and none in the others).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fused_paths_give_bitwise_the_sorted_column_finish() {
        let Some(paths) = crate::testing::register_paths() else {
            return;
        };
        let specials = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            3e38,
            f32::MAX,
            -f32::MAX,
        ];
        let mut next = crate::testing::xorshift(0x9e37_79b9_7f4a_7c15u64);
        for n in 1..=32usize {
            for d in [
                1,
                5,
                8,
                15,
                16,
                17,
                33,
                FUSED_BLOCK + 3,
                2 * FUSED_BLOCK + 21,
            ] {
                for special_rate in [0, 40] {
                    let rows: Vec<Vec<f32>> = (0..n)
                        .map(|_| {
                            // One input in three has no special values at all.
                            let rate = match next() % 3 {
                                0 => 0,
                                _ => special_rate,
                            };
                            (0..d)
                                .map(|_| match next() % 1000 < rate {
                                    true => specials[(next() % 8) as usize],
                                    false => (next() % 2001) as f32 * 0.37 - 370.0,
                                })
                                .collect()
                        })
                        .collect();
                    let want_non_finite: Vec<usize> = (0..n)
                        .filter(|&i| rows[i].iter().any(|v| !v.is_finite()))
                        .collect();
                    let bits: Vec<&[u32]> = rows.iter().map(|r| bytemuck::cast_slice(r)).collect();
                    let columns: Vec<Vec<f32>> = (0..d)
                        .map(|c| {
                            let mut col: Vec<f32> = rows.iter().map(|r| r[c]).collect();
                            col.sort_by(f32::total_cmp);
                            col
                        })
                        .collect();
                    let mut finishes = vec![Finish::Median];
                    for f in [0, (n - 1) / 4, (n - 1) / 2] {
                        finishes.push(Finish::Trimmed { f });
                    }
                    for finish in finishes {
                        let want: Vec<f32> = columns
                            .iter()
                            .map(|col| match finish {
                                Finish::Median if n % 2 == 1 => col[n / 2],
                                Finish::Median => {
                                    (col[n / 2 - 1] as f64 * 0.5 + col[n / 2] as f64 * 0.5) as f32
                                }
                                Finish::Trimmed { f } => {
                                    let sum =
                                        col[f..n - f].iter().fold(0.0f64, |a, &v| a + v as f64);
                                    (sum * (1.0 / (n - 2 * f) as f64)) as f32
                                }
                                Finish::Nearest { .. } => unreachable!("tested on its own"),
                            })
                            .collect();
                        let first_bad = want.iter().position(|v| !v.is_finite());
                        // AVX2 takes at most 16 inputs.
                        for &wide in paths.iter().filter(|&&wide| wide || n <= 16) {
                            let mut out = vec![0.0f32; d];
                            let got = fused_on(&bits, &mut out, finish, wide);
                            let what =
                                format!("wide {wide} n {n} d {d} {finish:?} rate {special_rate}");
                            assert_eq!(got.non_finite, want_non_finite, "{what}");
                            let got = got.result;
                            match first_bad {
                                Some(c) => assert_eq!(got, Err(c), "{what}"),
                                None => {
                                    assert_eq!(got, Ok(()), "{what}");
                                    let as_bits = |v: &[f32]| {
                                        v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                                    };
                                    assert_eq!(as_bits(&out), as_bits(&want), "{what}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Bulyan's finish on both register paths against the shrinking loop, bitwise: every `n`
    /// and `beta`, data full of ties, signed zeros, huge values whose differences round and
    /// subnormals (Bulyan only ever finishes finite inputs), tails and several rayon blocks.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fused_nearest_mean_is_the_shrinking_loop() {
        let Some(paths) = crate::testing::register_paths() else {
            return;
        };
        let mut next = crate::testing::xorshift(0x2545_f491_4f6c_dd1du64);
        for n in 1..=32usize {
            for beta in 1..=n {
                let d = [1usize, 15, 17, 33, FUSED_BLOCK + 9][(n + beta) % 5];
                let rows = crate::testing::tie_rows(&mut next, n, d);
                let bits: Vec<&[u32]> = rows.iter().map(|r| bytemuck::cast_slice(r)).collect();
                let want: Vec<f32> = (0..d)
                    .map(|c| {
                        let mut col: Vec<f32> = rows.iter().map(|r| r[c]).collect();
                        col.sort_by(f32::total_cmp);
                        crate::krum::nearest_mean(n, beta, |i| col[i] as f64) as f32
                    })
                    .collect();
                let first_bad = want.iter().position(|v| !v.is_finite());
                for &wide in paths.iter().filter(|&&wide| wide || n <= 16) {
                    let mut out = vec![0.0f32; d];
                    let got = fused_on(&bits, &mut out, Finish::Nearest { beta }, wide);
                    let what = format!("wide {wide} n {n} beta {beta} d {d}");
                    assert_eq!(got.result, first_bad.map_or(Ok(()), Err), "{what}");
                    let as_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(as_bits(&out), as_bits(&want), "{what}");
                }
            }
        }
    }

    /// Both in-order mean paths against the scalar `acc += x as f64` loop: bitwise, every
    /// coordinate written, and the first non-finite coordinate named, for counts past the
    /// sorting paths' 32, tails of every length and several rayon blocks.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn mean_paths_give_bitwise_the_scalar_sum() {
        let Some(paths) = crate::testing::register_paths() else {
            return;
        };
        let mut next = crate::testing::xorshift(0x2545_f491_4f6c_dd1du64);
        for n in [1usize, 2, 3, 10, 16, 33, 47] {
            for d in [1, 7, 16, 17, 31, FUSED_BLOCK + 9, 2 * FUSED_BLOCK + 30] {
                for poisoned in [false, true] {
                    let rows: Vec<Vec<f32>> = (0..n)
                        .map(|_| {
                            (0..d)
                                .map(|_| match poisoned && next().is_multiple_of(500) {
                                    true => f32::INFINITY,
                                    false => (next() % 100_001) as f32 * 1.3e-3 - 65.0,
                                })
                                .collect()
                        })
                        .collect();
                    let bits: Vec<&[u32]> = rows.iter().map(|r| bytemuck::cast_slice(r)).collect();
                    let want: Vec<f32> = (0..d)
                        .map(|c| {
                            let sum = rows.iter().fold(0.0f64, |a, r| a + r[c] as f64);
                            (sum * (1.0 / n as f64)) as f32
                        })
                        .collect();
                    let first_bad = want.iter().position(|v| !v.is_finite());
                    for &wide in &paths {
                        let mut out = vec![0.0f32; d];
                        let got = mean_on(&bits, &mut out, wide);
                        let what = format!("wide {wide} n {n} d {d} poisoned {poisoned}");
                        assert_eq!(got, first_bad.map_or(Ok(()), Err), "{what}");
                        let as_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(as_bits(&out), as_bits(&want), "{what}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_spelled_out_merge_is_odd_even_merge_32() {
        let mut spelled = Vec::new();
        macro_rules! cs {
            ($a:literal, $b:literal) => {
                spelled.push(($a, $b));
            };
        }
        odd_even_merge_32!(cs);
        assert_eq!(spelled, odd_even_merge(32));
    }

    #[test]
    fn the_spelled_out_network_is_merge_exchange_16() {
        let mut spelled = Vec::new();
        macro_rules! cs {
            ($a:literal, $b:literal) => {
                spelled.push(($a, $b));
            };
        }
        merge_exchange_16!(cs);
        assert_eq!(spelled, merge_exchange(16));
    }

    #[test]
    fn odd_even_merge_merges_every_zero_one_pair_of_sorted_halves() {
        // The 0-1 principle restricted to sorted halves: a halves' content is its count of 0s.
        let net = odd_even_merge(32);
        for zeros_low in 0..=16 {
            for zeros_high in 0..=16 {
                let mut v: Vec<u8> = (0..16)
                    .map(|i| u8::from(i >= zeros_low))
                    .chain((0..16).map(|i| u8::from(i >= zeros_high)))
                    .collect();
                apply(&mut v, 1, &net);
                assert!(
                    v.windows(2).all(|w| w[0] <= w[1]),
                    "{zeros_low} {zeros_high}"
                );
            }
        }
    }

    #[test]
    fn pruned_networks_still_place_the_needed_wires() {
        for n in [1usize, 2, 3, 7, 16, 33, 64] {
            let mid = n / 2;
            let net = pruned(n, mid.saturating_sub(1)..mid + 1);
            assert!(net.len() <= merge_exchange(n).len());
            for seed in 0..50u64 {
                let v: Vec<i64> = (0..n as u64)
                    .map(|i| ((i * 7919 + seed * 104_729) % 1009) as i64)
                    .collect();
                let mut got = v.clone();
                apply(&mut got, 1, &net);
                let mut want = v;
                want.sort_unstable();
                assert_eq!(got[mid], want[mid], "n={n}");
                if mid > 0 {
                    assert_eq!(got[mid - 1], want[mid - 1], "n={n}");
                }
            }
        }
    }
}
