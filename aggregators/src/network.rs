//! Sorting networks applied across a block of coordinates at once.
//!
//! For `n` up to [`MAX_INPUTS`], a block of coordinates is held as `n` rows of total-order keys
//! (row `i` = input `i`'s values for the block), and Batcher's merge-exchange network (Knuth,
//! TAOCP 5.2.2, Algorithm M; valid for any `n`) is run as a sequence of row-wise compare-exchange
//! steps: `(lo, hi) = (min(lo, hi), max(lo, hi))` element by element, which the compiler turns
//! into SIMD min/max. Comparators that cannot affect the rows a rule reads (the middle one or two
//! for a median, the untrimmed band for a trimmed mean) are pruned.

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
    let all = merge_exchange(n);
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

/// Fills `rows` with the total-order keys of `inputs[i][base..base + width]` (row `i` per input)
/// and sorts every column with `comparators`. Uses AVX2 min/max when the CPU has it.
pub(crate) fn sort_block<T: Element>(
    inputs: &[&[T]],
    base: usize,
    width: usize,
    rows: &mut Vec<T::Key>,
    comparators: &[(usize, usize)],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        unsafe { sort_block_avx2(inputs, base, width, rows, comparators) };
        return;
    }
    sort_block_portable(inputs, base, width, rows, comparators);
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
