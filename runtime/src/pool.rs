//! Receive buffers that are used again once the payloads delivered in them are dropped.
//!
//! A fresh large allocation costs a page fault for every 4 KiB page when it is first written,
//! and the allocator gives the pages back to the kernel when it is freed: on loopback and
//! shared memory that costs more than the copy itself (1 MiB receives over UCX shared memory
//! ran at 2 GB/s instead of 10). Transports that receive into buffers they allocate take them
//! from a [`BufferPool`] and deliver them as [`Bytes`] whose owner puts the buffer back into
//! the pool when the last clone is dropped. The pool keeps at most its `limit` in idle
//! buffers (the oldest go first); buffers below [`POOL_MIN`] are plain allocations.

use std::sync::{Arc, Mutex, PoisonError, Weak};

use bytes::Bytes;

/// Buffers smaller than this are not pooled (the allocator reuses small blocks itself).
pub const POOL_MIN: usize = 64 << 10;

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
    buffers: Vec<Vec<u8>>,
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
    /// twice `len` bytes of capacity if there is one, a fresh allocation otherwise.
    pub fn take(&self, len: usize) -> PoolBuf {
        if len < POOL_MIN || self.shared.limit == 0 {
            return PoolBuf {
                buf: Vec::with_capacity(len),
                pool: None,
            };
        }
        let reused = {
            let mut idle = self.shared.idle();
            let best = idle
                .buffers
                .iter()
                .enumerate()
                // Newest first among equal fits: the most recently used buffer is the one
                // most likely still in cache.
                .rev()
                .filter(|(_, b)| b.capacity() >= len && b.capacity() / 2 <= len)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i);
            best.map(|i| {
                let b = idle.buffers.remove(i);
                idle.bytes -= b.capacity();
                b
            })
        };
        PoolBuf {
            buf: reused.unwrap_or_else(|| Vec::with_capacity(len)),
            pool: Some(Arc::downgrade(&self.shared)),
        }
    }

    /// Bytes held in idle buffers.
    pub fn idle_bytes(&self) -> usize {
        self.shared.idle().bytes
    }
}

/// A receive buffer from a [`BufferPool`]: filled through [`PoolBuf::as_mut_ptr`] by a
/// transport, then [`frozen`](PoolBuf::freeze) into the delivered payload.
#[derive(Debug)]
pub struct PoolBuf {
    buf: Vec<u8>,
    pool: Option<Weak<Shared>>,
}

impl PoolBuf {
    /// The start of the buffer's capacity. The pointer stays valid while the `PoolBuf` lives
    /// (moving it does not move the memory).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.buf.as_mut_ptr()
    }

    /// The buffer itself, for readers that fill it as a `bytes::BufMut` (e.g. tokio's
    /// `read_buf`) instead of through [`PoolBuf::as_mut_ptr`]. Growing it is allowed (the pool
    /// takes back whatever capacity it has).
    pub fn vec_mut(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }

    /// The buffer's capacity.
    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// Sets the length of the buffer's contents.
    ///
    /// # Safety
    /// `len` must not exceed the capacity, and the first `len` bytes must have been written.
    pub unsafe fn set_len(&mut self, len: usize) {
        // SAFETY: per this function's contract.
        unsafe { self.buf.set_len(len) };
    }

    /// The contents as `Bytes`; a pooled buffer goes back to its pool when the last clone
    /// is dropped.
    pub fn freeze(mut self) -> Bytes {
        if self.pool.is_none() {
            return Bytes::from(std::mem::take(&mut self.buf));
        }
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for PoolBuf {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        let Some(shared) = self.pool.take().and_then(|p| p.upgrade()) else {
            return;
        };
        let mut buf = std::mem::take(&mut self.buf);
        let cap = buf.capacity();
        if cap == 0 || cap > shared.limit {
            return;
        }
        buf.clear();
        let mut idle = shared.idle();
        while idle.bytes + cap > shared.limit && !idle.buffers.is_empty() {
            let old = idle.buffers.remove(0);
            idle.bytes -= old.capacity();
        }
        idle.bytes += cap;
        idle.buffers.push(buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(pool: &BufferPool, len: usize, byte: u8) -> Bytes {
        let mut b = pool.take(len);
        // SAFETY: the capacity is at least `len`, and all `len` bytes are written first.
        unsafe {
            std::ptr::write_bytes(b.as_mut_ptr(), byte, len);
            b.set_len(len);
        }
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
}
