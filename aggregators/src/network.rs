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
//!
//! `bf16` and `f16` take the same kernels (AVX-512 F, BW and VL; or AVX2, with F16C for
//! `f16`, for up to 16 inputs): their 16-bit keys, sign-extended, sort in the 32-bit lanes, and a value is widened to `f32` (exactly) only where
//! a finish adds it. An `f64` result is narrowed to `f32` rounded to odd and then to 16 bits
//! to nearest, which is rounding it once ([`Element::from_f64`]); a middle value is its own
//! key's 16 bits. So the results are bitwise those of the portable paths.

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

/// The total-order keys of `-bf16::MAX` and `bf16::MAX` as the 16-bit kernels hold them
/// (the 16-bit key sign-extended): a key outside them is a NaN's or an infinity's.
#[cfg(target_arch = "x86_64")]
const BF16_FINITE_KEYS: (i32, i32) = (0x8080u16 as i16 as i32, 0x7f7f);

/// As [`BF16_FINITE_KEYS`] for `f16`.
#[cfg(target_arch = "x86_64")]
const F16_FINITE_KEYS: (i32, i32) = (0x8400u16 as i16 as i32, 0x7bff);

/// `finish` of every coordinate's sorted column straight into `out`, for `f32` inputs (at
/// most 16 of them with AVX2 or 32 with AVX-512) and `bf16` or `f16` inputs (likewise, with
/// AVX-512 BW and VL besides, and F16C for `f16` with AVX2): each group of 8 (16) coordinates is loaded, sorted in registers by a
/// network specialised for `n` (padding wires are constants, so every comparator that touches
/// one folds away, and so does every comparator no finished row depends on) and finished
/// there, so no sorted row is stored. The 16-bit types are sorted on their own keys in 32-bit
/// lanes and widened to `f32` (exactly) only where a finish adds; each `f64` result is rounded
/// once as [`Element::from_f64`] does. Bitwise what sorting the column and finishing it in
/// scalar code gives. `None` where the path does not apply (other types, more inputs, the CPU
/// lacks the instructions, Bulyan's finish of 16-bit types): the caller sorts blocks in memory.
/// While it reads the inputs it also finds those holding a NaN or infinity
/// ([`Fused::non_finite`]), so that callers need no pass of their own over cold memory to name
/// them.
pub(crate) fn fused<T: Element>(inputs: &[&[T]], out: &mut [T], finish: Finish) -> Option<Fused> {
    #[cfg(target_arch = "x86_64")]
    {
        let kernels = Kernels::for_type::<T>()?;
        kernels
            .take(inputs.len(), finish)
            .then(|| fused_on(inputs, out, finish, kernels))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (inputs, out, finish);
        None
    }
}

/// The register kernels for one element type. A value is made only where the CPU has the
/// instructions its kernels need ([`Kernels::for_type`]), so holding one is what makes calling
/// them sound.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernels {
    /// `f32` in 8 lanes (AVX2).
    Avx2F32,
    /// `f32` in 16 lanes (AVX-512F).
    Avx512F32,
    /// `bf16` in 8 lanes of 32 bits (AVX2).
    Avx2Bf16,
    /// `f16` in 8 lanes of 32 bits (AVX2, F16C).
    Avx2F16,
    /// `bf16` in 16 lanes of 32 bits (AVX-512F, BW, VL).
    Avx512Bf16,
    /// `f16` in 16 lanes of 32 bits (AVX-512F, BW, VL).
    Avx512F16,
}

#[cfg(target_arch = "x86_64")]
impl Kernels {
    /// The kernels this CPU runs for `T`, the fastest first (features detected once, then
    /// cached loads).
    fn usable<T: Element>() -> Vec<Self> {
        use crate::DType;
        use std::arch::is_x86_feature_detected as has;
        let avx2 = has!("avx2");
        let avx512_16 = has!("avx512f") && has!("avx512bw") && has!("avx512vl");
        let candidates = match T::DTYPE {
            DType::F32 => [
                (Kernels::Avx512F32, avx2 && has!("avx512f")),
                (Kernels::Avx2F32, avx2),
            ],
            DType::BF16 => [(Kernels::Avx512Bf16, avx512_16), (Kernels::Avx2Bf16, avx2)],
            DType::F16 => [
                (Kernels::Avx512F16, avx512_16),
                (Kernels::Avx2F16, avx2 && has!("f16c")),
            ],
            DType::F64 => return Vec::new(),
        };
        candidates
            .into_iter()
            .filter_map(|(kernels, runs)| runs.then_some(kernels))
            .collect()
    }

    /// The fastest kernels this CPU runs for `T`, if any.
    fn for_type<T: Element>() -> Option<Self> {
        Self::usable::<T>().first().copied()
    }

    /// Whether these kernels take `n` inputs for `finish`.
    fn take(self, n: usize, finish: Finish) -> bool {
        let finish_ok = match finish {
            Finish::Trimmed { f } => 2 * f < n,
            Finish::Nearest { beta } => self.f32_lanes() && (1..=n).contains(&beta),
            Finish::Median => true,
        };
        n >= 1 && n <= self.max_inputs() && finish_ok
    }

    /// Most inputs the fused kernels sort.
    fn max_inputs(self) -> usize {
        match self {
            Kernels::Avx2F32 | Kernels::Avx2Bf16 | Kernels::Avx2F16 => 16,
            Kernels::Avx512F32 | Kernels::Avx512Bf16 | Kernels::Avx512F16 => 32,
        }
    }

    /// Whether the elements are `f32` (the only type Bulyan's finish runs in registers).
    fn f32_lanes(self) -> bool {
        matches!(self, Kernels::Avx2F32 | Kernels::Avx512F32)
    }

    /// [`fused`] on `out.len()` coordinates from `base`: the offset in `out` of the first
    /// non-finite result, and whether some input value read is not finite.
    fn fused<T: Element>(
        self,
        inputs: &[&[T]],
        base: usize,
        out: &mut [T],
        finish: Finish,
    ) -> (Result<(), usize>, bool) {
        use bytemuck::cast_slice_mut as bits_mut;
        // SAFETY: `self` exists only where the CPU has the kernel's instructions, and names
        // `T`'s kernel, so the casts are to `T`'s own bits.
        unsafe {
            match self {
                Kernels::Avx2F32 => avx2_f32::fused(&bits(inputs), base, bits_mut(out), finish),
                Kernels::Avx512F32 => avx512_f32::fused(&bits(inputs), base, bits_mut(out), finish),
                Kernels::Avx2Bf16 => {
                    avx2_f32::fused_bf16(&bits(inputs), base, bits_mut(out), finish)
                }
                Kernels::Avx2F16 => avx2_f32::fused_f16(&bits(inputs), base, bits_mut(out), finish),
                Kernels::Avx512Bf16 => {
                    avx512_f32::fused_bf16(&bits(inputs), base, bits_mut(out), finish)
                }
                Kernels::Avx512F16 => {
                    avx512_f32::fused_f16(&bits(inputs), base, bits_mut(out), finish)
                }
            }
        }
    }

    /// [`mean_in_order`] on `out.len()` coordinates from `base`: the offset in `out` of the
    /// first non-finite result.
    fn mean<T: Element>(self, inputs: &[&[T]], base: usize, out: &mut [T]) -> Result<(), usize> {
        use bytemuck::cast_slice_mut as bits_mut;
        // SAFETY: as in `Kernels::fused`.
        unsafe {
            match self {
                Kernels::Avx2F32 => avx2_f32::mean_in_order(&bits(inputs), base, bits_mut(out)),
                Kernels::Avx512F32 => avx512_f32::mean_in_order(&bits(inputs), base, bits_mut(out)),
                Kernels::Avx2Bf16 => {
                    avx2_f32::mean_in_order_bf16(&bits(inputs), base, bits_mut(out))
                }
                Kernels::Avx2F16 => avx2_f32::mean_in_order_f16(&bits(inputs), base, bits_mut(out)),
                Kernels::Avx512Bf16 => {
                    avx512_f32::mean_in_order_bf16(&bits(inputs), base, bits_mut(out))
                }
                Kernels::Avx512F16 => {
                    avx512_f32::mean_in_order_f16(&bits(inputs), base, bits_mut(out))
                }
            }
        }
    }
}

/// The inputs as the bits of their elements (`B` of `T`'s size).
#[cfg(target_arch = "x86_64")]
fn bits<'a, T: Element, B: bytemuck::Pod>(inputs: &[&'a [T]]) -> Vec<&'a [B]> {
    inputs.iter().map(|x| bytemuck::cast_slice(x)).collect()
}

/// Runs `block(at, chunk)` on the rayon blocks of `out` (each starting at coordinate `at`);
/// the first non-finite coordinate any of them names, over all blocks.
#[cfg(target_arch = "x86_64")]
fn first_bad_in_blocks<T: Element>(
    out: &mut [T],
    block: impl Fn(usize, &mut [T]) -> Result<(), usize> + Sync,
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
fn prefetch_ahead<B>(row: &[B], at: usize, inputs: usize) {
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

/// The mean of `inputs` in their order, `f32`, `bf16` and `f16` inputs on a CPU with AVX2
/// (and F16C for `f16`): each coordinate's values summed in `f64` in input
/// order and multiplied by `1 / n`, in registers, 16 (AVX-512) or 8 (AVX2) coordinates at a
/// time, each input's next line prefetched, and rounded once as [`Element::from_f64`] does;
/// bitwise the scalar `acc += x.to_f64()` loop. `None` where the path does not apply;
/// `Some(Err(c))`: coordinate `c`, the first, is not finite.
pub(crate) fn mean_in_order<T: Element>(
    inputs: &[&[T]],
    out: &mut [T],
) -> Option<Result<(), usize>> {
    #[cfg(target_arch = "x86_64")]
    {
        let kernels = Kernels::for_type::<T>()?;
        (!inputs.is_empty()).then(|| mean_on(inputs, out, kernels))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (inputs, out);
        None
    }
}

/// [`mean_in_order`] with `kernels`.
#[cfg(target_arch = "x86_64")]
fn mean_on<T: Element>(inputs: &[&[T]], out: &mut [T], kernels: Kernels) -> Result<(), usize> {
    first_bad_in_blocks(out, |at, chunk| kernels.mean(inputs, at, chunk))
}

/// [`fused`] into a fresh output by each of the kernels this CPU runs for `T` that take
/// `inputs` and `finish` (the dispatch picks one; the tests check them all).
#[cfg(test)]
pub(crate) fn fused_by_every_kernel<T: Element>(
    inputs: &[&[T]],
    finish: Finish,
    zero: T,
) -> Vec<(String, Fused, Vec<T>)> {
    let d = inputs.first().map_or(0, |x| x.len());
    #[cfg(target_arch = "x86_64")]
    {
        Kernels::usable::<T>()
            .into_iter()
            .filter(|k| k.take(inputs.len(), finish))
            .map(|k| {
                let mut out = vec![zero; d];
                let done = fused_on(inputs, &mut out, finish, k);
                (format!("{k:?}"), done, out)
            })
            .collect()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (inputs, finish, zero, d);
        Vec::new()
    }
}

/// [`mean_in_order`] as [`fused_by_every_kernel`].
#[cfg(test)]
pub(crate) fn mean_by_every_kernel<T: Element>(
    inputs: &[&[T]],
    zero: T,
) -> Vec<(String, Result<(), usize>, Vec<T>)> {
    let d = inputs.first().map_or(0, |x| x.len());
    #[cfg(target_arch = "x86_64")]
    {
        Kernels::usable::<T>()
            .into_iter()
            .map(|k| {
                let mut out = vec![zero; d];
                let done = mean_on(inputs, &mut out, k);
                (format!("{k:?}"), done, out)
            })
            .collect()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (inputs, zero, d);
        Vec::new()
    }
}

/// [`fused`] with `kernels`.
#[cfg(target_arch = "x86_64")]
fn fused_on<T: Element>(inputs: &[&[T]], out: &mut [T], finish: Finish, kernels: Kernels) -> Fused {
    use rayon::prelude::*;
    // Per block: its first non-finite result, and whether some input value in it is not finite.
    let blocks: Vec<(Option<usize>, bool)> = out
        .par_chunks_mut(FUSED_BLOCK)
        .enumerate()
        .map(|(b, chunk)| {
            let at = b * FUSED_BLOCK;
            let (done, suspect) = kernels.fused(inputs, at, chunk, finish);
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
        false => (0..inputs.len())
            .into_par_iter()
            .filter(|&i| {
                suspects
                    .iter()
                    .any(|r| !crate::all_finite(&inputs[i][r.clone()]))
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
/// stores per comparator, not its min/max, bound its speed. Also the fused and mean kernels
/// of the 16-bit types in 8 lanes of 32 bits.
#[cfg(target_arch = "x86_64")]
mod avx2_f32;

/// The fused path with AVX-512: 16 coordinates at a time, so each input's group is one whole
/// cache line, read once (with 8 lanes, the 16 inputs' lines at one offset compete for the
/// same L1 set and a line is often evicted before its second half is read), and the 16 wires
/// stay in the 32 registers. The 16-bit types' kernels take the same shape, in 32-bit lanes.
#[cfg(target_arch = "x86_64")]
mod avx512_f32;

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
mod tests;
