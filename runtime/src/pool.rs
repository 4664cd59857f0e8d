//! Receive buffers that are used again once the payloads delivered in them are dropped.
//!
//! A fresh large allocation costs a page fault for every 4 KiB page when it is first written,
//! and the allocator gives the pages back to the kernel when it is freed: on loopback and
//! shared memory that costs more than the copy itself (1 MiB receives over UCX shared memory
//! ran at 2 GB/s instead of 10). Transports that receive into buffers they allocate take them
//! from a [`BufferPool`] and deliver them as [`Bytes`] whose owner puts the buffer back into
//! the pool when the last clone is dropped. The pool keeps at most its `limit` in idle
//! buffers (the newest are reused first, the oldest are freed first); buffers below
//! [`POOL_MIN`] are plain allocations.
//!
//! Buffers of [`HUGE_MIN`] bytes and more are anonymous mappings on 2 MiB boundaries, at
//! least one whole 2 MiB page long (longer ones end on the next 4 KiB page: their tail past
//! the last whole huge page stays on small pages rather than doubling the memory of a
//! 2 MiB + 1 byte message), and advised for transparent huge pages (`MADV_HUGEPAGE`; Linux
//! honours it unless THP is `never`). Copies between processes (UCX shared memory's
//! `process_vm_readv`, libfabric's shm) pin and walk every page of both buffers: on huge
//! pages a 1-4 MiB message moved at 11-14 GB/s instead of 8-10 in the p2p bench over UCX
//! shared memory, when sender and receiver both used them (only the receiver: no gain).
//! [`payload_from`] puts outgoing data of [`POOL_MIN`] bytes and more in a pooled buffer (such a
//! huge-page one from [`HUGE_MIN`]), from a small process-wide send pool ([`SEND_POOL_BYTES`]
//! idle at most).
//!
//! Every buffer is initialised memory (zeroed when new), so readers may fill it as a slice.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use bytes::Bytes;

/// Buffers smaller than this are not pooled (the allocator reuses small blocks itself).
pub const POOL_MIN: usize = 64 << 10;

/// Buffers of at least this many bytes are on 2 MiB huge pages (see the module docs).
pub const HUGE_MIN: usize = 1 << 20;

const HUGE_PAGE: usize = 2 << 20;
const SMALL_PAGE: usize = 4 << 10;

/// Anonymous memory starting on a 2 MiB boundary, at least 2 MiB long (then whole 4 KiB
/// pages), advised for transparent huge pages. Zeroed when mapped.
#[derive(Debug)]
struct HugeRegion {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the region is plain memory owned by this value alone.
unsafe impl Send for HugeRegion {}
// SAFETY: as above; shared access is read-only through `&self`.
unsafe impl Sync for HugeRegion {}

impl HugeRegion {
    /// `None` when the length overflows or the kernel refuses the mapping.
    fn new(len: usize) -> Option<Self> {
        let len = if len <= HUGE_PAGE {
            HUGE_PAGE
        } else {
            len.checked_next_multiple_of(SMALL_PAGE)?
        };
        let span = len.checked_add(HUGE_PAGE)?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let start = raw as usize;
        let aligned = start.next_multiple_of(HUGE_PAGE);
        let (head, tail) = (aligned - start, start + span - (aligned + len));
        // SAFETY: the head and tail lie inside the mapping just made and are not used; the
        // advice only concerns the kept range. A failed unmap leaves the bytes mapped
        // (leaked), a failed advice leaves normal pages: neither is unsound.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((aligned + len) as *mut libc::c_void, tail);
            }
            libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        Some(HugeRegion {
            ptr: NonNull::new(aligned as *mut u8)?,
            len,
        })
    }
}

impl Drop for HugeRegion {
    fn drop(&mut self) {
        // SAFETY: the range was mapped by `new` and nothing borrows it any more.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// The memory of a buffer: all of it initialised.
#[derive(Debug)]
enum Memory {
    /// Length equals capacity (zeroed when allocated).
    Heap(Vec<u8>),
    Huge(HugeRegion),
}

impl Memory {
    fn new(len: usize) -> Self {
        if len >= HUGE_MIN {
            if let Some(region) = HugeRegion::new(len) {
                return Memory::Huge(region);
            }
        }
        // calloc: large blocks come as zero pages from the kernel, without a memset.
        Memory::Heap(vec![0; len])
    }

    fn capacity(&self) -> usize {
        match self {
            Memory::Heap(v) => v.len(),
            Memory::Huge(r) => r.len,
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            Memory::Heap(v) => v,
            // SAFETY: the region is `len` initialised bytes (zeroed by the kernel, then only
            // ever written with bytes), borrowed with `self`.
            Memory::Huge(r) => unsafe { std::slice::from_raw_parts(r.ptr.as_ptr(), r.len) },
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Memory::Heap(v) => v,
            // SAFETY: as in `as_slice`, borrowed mutably with `self`.
            Memory::Huge(r) => unsafe { std::slice::from_raw_parts_mut(r.ptr.as_ptr(), r.len) },
        }
    }
}

/// A bounded set of idle receive buffers; see the module docs. Cloning shares the pool.
#[derive(Debug, Clone)]
pub struct BufferPool {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    idle: Mutex<Idle>,
    limit: usize,
}

#[derive(Debug, Default)]
struct Idle {
    /// Oldest first.
    buffers: Vec<Memory>,
    bytes: usize,
}

impl Shared {
    fn idle(&self) -> std::sync::MutexGuard<'_, Idle> {
        // Every update is a push or a remove plus a counter: a panic cannot leave it torn.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl BufferPool {
    /// A pool that keeps at most `limit` bytes of idle buffers (0: none, every buffer is a
    /// fresh allocation).
    pub fn new(limit: usize) -> Self {
        BufferPool {
            shared: Arc::new(Shared {
                idle: Mutex::new(Idle::default()),
                limit,
            }),
        }
    }

    /// An empty buffer with room for `len` bytes: an idle one of at least `len` and at most
    /// twice `len` bytes of capacity if there is one (or one huge-page buffer), a fresh
    /// allocation otherwise.
    pub fn take(&self, len: usize) -> PoolBuf {
        if len < POOL_MIN || self.shared.limit == 0 {
            return PoolBuf {
                mem: Memory::new(len),
                len: 0,
                pool: None,
            };
        }
        let fits = |m: &Memory| m.capacity() >= len && m.capacity() / 2 <= len;
        let reused = {
            let mut idle = self.shared.idle();
            let best = idle
                .buffers
                .iter()
                .enumerate()
                // Newest first among equal fits: the most recently used buffer is the one
                // most likely still in cache.
                .rev()
                .filter(|(_, b)| fits(b))
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i);
            best.map(|i| {
                let b = idle.buffers.remove(i);
                idle.bytes -= b.capacity();
                b
            })
        };
        PoolBuf {
            mem: reused.unwrap_or_else(|| Memory::new(len)),
            len: 0,
            pool: Some(Arc::downgrade(&self.shared)),
        }
    }

    /// Bytes held in idle buffers.
    pub fn idle_bytes(&self) -> usize {
        self.shared.idle().bytes
    }
}

/// Idle bytes the process-wide send pool of [`payload_from`] keeps at most. A fresh mapping per
/// send was zeroed by the kernel on first touch and unmapped after the send: 28-31 % of the
/// ring all-reduce's CPU time in the profile (`docs/bench/PROFILE.md`). The limit is small
/// because an idle buffer stays resident: enough for a ring's chunks and a sharded round's
/// pieces at tens of MiB per rank (an unbounded pool once raised the bench's peak memory by
/// 80 MiB per rank).
pub const SEND_POOL_BYTES: usize = 64 << 20;

/// The pool [`payload_from`] takes its buffers from.
fn send_pool() -> &'static BufferPool {
    static POOL: std::sync::OnceLock<BufferPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| BufferPool::new(SEND_POOL_BYTES))
}

/// `data` copied into a buffer from the process-wide send pool from [`POOL_MIN`] bytes (on
/// huge pages from [`HUGE_MIN`]), to which it returns when the payload's last clone is
/// dropped; a plain copy below. What the collectives send is made this way.
pub fn payload_from(data: &[u8]) -> Bytes {
    if data.len() < POOL_MIN {
        return Bytes::copy_from_slice(data);
    }
    payload_with(data.len(), |buf| buf.copy_from_slice(data))
}

/// A payload of `len` bytes that `fill` writes, in the same memory as [`payload_from`]'s: so a
/// sender can compute straight into the wire buffer instead of computing, then copying. `fill`
/// gets exactly `len` initialised bytes (zeroes or older contents) and must write all of them.
/// From [`HUGE_MIN`] bytes the buffer starts on a 2 MiB boundary, so it can be viewed as any
/// element type (unless the kernel refused the mapping: see [`PoolBuf::as_mut_slice`]).
///
/// From [`POOL_MIN`] bytes the buffer comes from the send pool, so that a sender of pieces
/// below a huge page (a sharded round's at 8 ranks and 16 MiB: 512 KiB) neither zeroes a
/// fresh allocation nor faults its pages in on every send.
pub fn payload_with(len: usize, fill: impl FnOnce(&mut [u8])) -> Bytes {
    if len < POOL_MIN {
        let mut v = vec![0u8; len];
        fill(&mut v);
        return Bytes::from(v);
    }
    let mut buf = send_pool().take(len);
    fill(&mut buf.as_mut_slice()[..len]);
    buf.set_len(len);
    buf.freeze()
}

/// A buffer from a [`BufferPool`]: filled through [`PoolBuf::as_mut_ptr`] or
/// [`PoolBuf::as_mut_slice`] by a transport, then [`frozen`](PoolBuf::freeze) into the
/// delivered payload.
#[derive(Debug)]
pub struct PoolBuf {
    mem: Memory,
    /// Bytes of contents.
    len: usize,
    pool: Option<Weak<Shared>>,
}

impl PoolBuf {
    /// The start of the buffer's capacity. The pointer stays valid while the `PoolBuf` lives
    /// (moving it does not move the memory).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.mem.as_mut_slice().as_mut_ptr()
    }

    /// The whole capacity, for readers that fill a slice (initialised: zeroes or old bytes).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.mem.as_mut_slice()
    }

    /// The buffer's capacity.
    pub fn capacity(&self) -> usize {
        self.mem.capacity()
    }

    /// Sets the length of the contents: the first `len` bytes, which the caller has written.
    ///
    /// # Panics
    /// If `len` exceeds the capacity.
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.capacity(),
            "{len} bytes in a buffer of {}",
            self.capacity()
        );
        self.len = len;
    }

    /// The contents as `Bytes`; a pooled buffer goes back to its pool when the last clone
    /// is dropped.
    pub fn freeze(mut self) -> Bytes {
        if self.pool.is_none() {
            if let Memory::Heap(v) = &mut self.mem {
                let mut v = std::mem::take(v);
                v.truncate(self.len);
                return Bytes::from(v);
            }
        }
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for PoolBuf {
    fn as_ref(&self) -> &[u8] {
        &self.mem.as_slice()[..self.len]
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        let Some(shared) = self.pool.take().and_then(|p| p.upgrade()) else {
            return;
        };
        let mem = std::mem::replace(&mut self.mem, Memory::Heap(Vec::new()));
        let cap = mem.capacity();
        if cap == 0 || cap > shared.limit {
            return;
        }
        let mut idle = shared.idle();
        while idle.bytes + cap > shared.limit && !idle.buffers.is_empty() {
            let old = idle.buffers.remove(0);
            idle.bytes -= old.capacity();
        }
        idle.bytes += cap;
        idle.buffers.push(mem);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(pool: &BufferPool, len: usize, byte: u8) -> Bytes {
        let mut b = pool.take(len);
        b.as_mut_slice()[..len].fill(byte);
        b.set_len(len);
        b.freeze()
    }

    #[test]
    fn dropped_payloads_return_their_buffer_and_the_limit_holds() {
        let pool = BufferPool::new(3 * POOL_MIN);
        let a = filled(&pool, POOL_MIN, 1);
        let ptr = a.as_ptr();
        assert_eq!(&a[..3], &[1, 1, 1]);
        let a2 = a.clone();
        drop(a);
        assert_eq!(pool.idle_bytes(), 0, "a clone is still alive");
        drop(a2);
        assert_eq!(pool.idle_bytes(), POOL_MIN);
        let b = filled(&pool, POOL_MIN, 2);
        assert_eq!(b.as_ptr(), ptr, "the idle buffer is used again");
        assert_eq!(b.len(), POOL_MIN);
        let many: Vec<Bytes> = (0..5).map(|i| filled(&pool, POOL_MIN, i)).collect();
        drop(many);
        drop(b);
        assert!(pool.idle_bytes() <= 3 * POOL_MIN);
    }

    #[test]
    fn the_most_recently_returned_buffer_is_reused_first() {
        let pool = BufferPool::new(4 * POOL_MIN);
        let (a, b) = (filled(&pool, POOL_MIN, 1), filled(&pool, POOL_MIN, 2));
        let newest = b.as_ptr();
        drop(a);
        drop(b);
        assert_eq!(filled(&pool, POOL_MIN, 3).as_ptr(), newest);
    }

    #[test]
    fn small_and_unpooled_buffers_are_plain_and_a_dropped_pool_is_fine() {
        let pool = BufferPool::new(1 << 20);
        let small = filled(&pool, 10, 3);
        assert_eq!(&small[..], &[3; 10]);
        drop(small);
        assert_eq!(pool.idle_bytes(), 0);
        let big = filled(&pool, POOL_MIN * 4, 4);
        drop(pool);
        assert_eq!(big[POOL_MIN], 4);
        drop(big);
        let none = BufferPool::new(0);
        drop(filled(&none, POOL_MIN, 5));
        assert_eq!(none.idle_bytes(), 0);
    }

    /// The `VmFlags` of the mapping that holds `addr`, from /proc/self/smaps.
    fn vm_flags(addr: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = range.split_once('-') {
                if let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                {
                    inside = (lo..hi).contains(&addr);
                    continue;
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return Some(flags.to_string());
                }
            }
        }
        None
    }

    #[test]
    fn large_buffers_are_whole_advised_huge_pages_zeroed_and_reused() {
        let pool = BufferPool::new(16 << 20);
        let mut b = pool.take(HUGE_MIN + 1);
        assert_eq!(b.capacity(), HUGE_PAGE, "at least one whole huge page");
        let ptr = b.as_mut_ptr() as usize;
        assert_eq!(ptr % HUGE_PAGE, 0, "on a 2 MiB boundary");
        assert!(b.as_mut_slice().iter().all(|&x| x == 0), "zeroed when new");
        let flags = vm_flags(ptr).expect("the buffer's mapping in /proc/self/smaps");
        assert!(
            flags.split_whitespace().any(|f| f == "hg"),
            "advised MADV_HUGEPAGE: {flags}"
        );
        b.as_mut_slice()[..HUGE_MIN + 1].fill(9);
        b.set_len(HUGE_MIN + 1);
        let payload = b.freeze();
        assert_eq!(payload.len(), HUGE_MIN + 1);
        assert!(payload.iter().all(|&x| x == 9));
        drop(payload);
        assert_eq!(pool.idle_bytes(), HUGE_PAGE);
        assert_eq!(pool.take(HUGE_MIN).as_mut_ptr() as usize, ptr, "used again");
        let bigger = pool.take((3 << 20) + 1);
        assert_eq!(
            bigger.capacity(),
            (3 << 20) + SMALL_PAGE,
            "past the first huge page, to the next 4 KiB page"
        );
        assert!(
            pool.take(POOL_MIN).capacity() < HUGE_PAGE,
            "a huge page is not handed out for a small receive"
        );
    }

    #[test]
    fn payloads_from_data_hold_the_data() {
        let small: Vec<u8> = (0..100u8).collect();
        assert_eq!(&payload_from(&small)[..], &small[..]);
        // Pooled below a huge page: a reused buffer holds the new data, not the old.
        for byte in [7u8, 8] {
            let mid = vec![byte; POOL_MIN * 3 + 5];
            assert_eq!(&payload_from(&mid)[..], &mid[..]);
        }
        let large: Vec<u8> = (0..3 << 20).map(|i: usize| (i % 251) as u8).collect();
        let p = payload_from(&large);
        assert_eq!(&p[..], &large[..]);
        assert_eq!(p.as_ptr() as usize % HUGE_PAGE, 0);
        // Sent and dropped, its buffer serves a later payload of a similar size (other tests
        // share the process-wide pool, so which buffer is not checked here; the contents are).
        drop(p);
        let other: Vec<u8> = (0..3 << 20).map(|i: usize| (i % 13) as u8).collect();
        assert_eq!(&payload_from(&other)[..], &other[..]);
        assert!(send_pool().idle_bytes() <= SEND_POOL_BYTES);
    }

    #[test]
    fn payloads_filled_in_place_hold_what_was_written() {
        for len in [0, 100, HUGE_MIN - 1, HUGE_MIN, 3 << 20] {
            let p = payload_with(len, |b| {
                assert_eq!(b.len(), len);
                b.iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x = (i % 241) as u8);
            });
            assert_eq!(p.len(), len);
            assert!(p.iter().enumerate().all(|(i, &x)| x == (i % 241) as u8));
        }
        let typed = crate::types::fill_bytes::<f64>(300_000, |v| {
            v.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = i as f64 * 0.5);
        });
        let back: &[f64] = bytemuck::cast_slice(&typed);
        assert!(back.iter().enumerate().all(|(i, &x)| x == i as f64 * 0.5));
    }
}
