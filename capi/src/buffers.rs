//! Turning the caller's pointers into slices, after checking everything a pointer and a count
//! can get wrong.

use std::ffi::c_void;

use crate::status::Failure;
use crate::{BYZCOLL_BFLOAT16, BYZCOLL_FLOAT16, BYZCOLL_FLOAT32, BYZCOLL_FLOAT64};

#[derive(Debug, Clone, Copy)]
pub(crate) enum DType {
    F32,
    F64,
    F16,
    BF16,
}

impl DType {
    pub(crate) fn parse(dtype: i32) -> Result<Self, Failure> {
        match dtype {
            BYZCOLL_FLOAT32 => Ok(DType::F32),
            BYZCOLL_FLOAT64 => Ok(DType::F64),
            BYZCOLL_FLOAT16 => Ok(DType::F16),
            BYZCOLL_BFLOAT16 => Ok(DType::BF16),
            other => Err(Failure::invalid(format!(
                "dtype is {other}: expected BYZCOLL_FLOAT32, _FLOAT64, _FLOAT16 or _BFLOAT16"
            ))),
        }
    }

    pub(crate) fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

/// The caller's receive buffer, holding the send buffer's contents.
pub(crate) enum Buffer<'a> {
    F32(&'a mut [f32]),
    F64(&'a mut [f64]),
    F16(&'a mut [half::f16]),
    BF16(&'a mut [half::bf16]),
}

/// `$body` with `$b` the slice of whichever element type the [`Buffer`] `$buf` holds.
macro_rules! with_buffer {
    ($buf:expr, $b:ident => $body:expr) => {
        match $buf {
            $crate::buffers::Buffer::F32($b) => $body,
            $crate::buffers::Buffer::F64($b) => $body,
            $crate::buffers::Buffer::F16($b) => $body,
            $crate::buffers::Buffer::BF16($b) => $body,
        }
    };
}
pub(crate) use with_buffer;

pub(crate) fn check_aligned<T>(p: *const T, name: &str) -> Result<(), Failure> {
    if p.is_null() {
        return Err(Failure::invalid(format!("{name} is NULL")));
    }
    if !(p as usize).is_multiple_of(align_of::<T>()) {
        return Err(Failure::invalid(format!(
            "{name} ({p:p}) is not aligned to {} bytes",
            align_of::<T>()
        )));
    }
    Ok(())
}

/// Reads the caller's versioned struct at `p`, whose first field is its size in bytes: it must
/// be this library's `T` (`init` names the macro that sets it).
///
/// # Safety
/// `p` is non-null and points to at least that first field, and to a whole `T` when the size
/// it declares is `T`'s.
pub(crate) unsafe fn read_sized<T: Copy>(
    p: *const T,
    name: &str,
    type_name: &str,
    init: &str,
) -> Result<T, Failure> {
    check_aligned(p, name)?;
    // SAFETY: non-null and aligned; every such struct starts with its `size: usize` (repr(C)).
    let declared = unsafe { p.cast::<usize>().read() };
    if declared != size_of::<T>() {
        return Err(Failure::invalid(format!(
            "{name}->size is {declared}, this library's {type_name} has {} bytes: initialise it \
             with {init} from this library's byzcoll.h",
            size_of::<T>()
        )));
    }
    // SAFETY: the caller declared the whole struct.
    Ok(unsafe { p.read() })
}

/// Checks `p` for `count` elements of `dtype` and returns the byte length.
pub(crate) fn check(
    p: *const c_void,
    count: usize,
    dtype: DType,
    name: &str,
) -> Result<usize, Failure> {
    let bytes = count
        .checked_mul(dtype.size())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| Failure::invalid(format!("{name}: count {count} is too large")))?;
    if p.is_null() {
        return Err(Failure::invalid(format!("{name} is NULL")));
    }
    if !(p as usize).is_multiple_of(dtype.size()) {
        return Err(Failure::invalid(format!(
            "{name} ({p:p}) is not aligned to its {}-byte elements",
            dtype.size()
        )));
    }
    if (p as usize).checked_add(bytes).is_none() {
        return Err(Failure::invalid(format!(
            "{name} ({p:p}) + {bytes} bytes wraps around the address space"
        )));
    }
    Ok(bytes)
}

/// `count` elements of `dtype` at `p`, as bytes.
///
/// # Safety
/// `p` is valid for reads of `count` elements for `'a`.
pub(crate) unsafe fn bytes<'a>(
    p: *const c_void,
    count: usize,
    dtype: DType,
    name: &str,
) -> Result<&'a [u8], Failure> {
    let len = check(p, count, dtype, name)?;
    // SAFETY: checked non-null and in range; the caller vouches for validity.
    Ok(unsafe { std::slice::from_raw_parts(p.cast(), len) })
}

/// `count` elements of `dtype` at `p`, as writable bytes.
///
/// # Safety
/// `p` is valid for reads and writes of `count` elements for `'a`, and nothing else
/// accesses them meanwhile.
pub(crate) unsafe fn bytes_mut<'a>(
    p: *mut c_void,
    count: usize,
    dtype: DType,
    name: &str,
) -> Result<&'a mut [u8], Failure> {
    let len = check(p, count, dtype, name)?;
    // SAFETY: as above, exclusive.
    Ok(unsafe { std::slice::from_raw_parts_mut(p.cast(), len) })
}

/// Refuses overlapping `[a, a + a_len)` and `[b, b + b_len)`, checked on addresses before any
/// slice over them exists.
pub(crate) fn check_disjoint(
    a: *const c_void,
    a_len: usize,
    b: *const c_void,
    b_len: usize,
) -> Result<(), Failure> {
    let (a0, b0) = (a as usize, b as usize);
    let (a1, b1) = (a0.saturating_add(a_len), b0.saturating_add(b_len));
    if a0 < b1 && b0 < a1 {
        return Err(Failure::invalid(
            "sendbuf and recvbuf overlap: pass the same pointer for in place, or separate buffers",
        ));
    }
    Ok(())
}

impl<'a> Buffer<'a> {
    /// `recv`, holding `send`'s `count` elements (copied unless `send == recv`).
    ///
    /// # Safety
    /// `send` is valid for reads and `recv` for reads and writes of `count` elements for `'a`.
    pub(crate) unsafe fn in_place(
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
        send_name: &str,
        recv_name: &str,
    ) -> Result<Self, Failure> {
        let len = check(recv, count, dtype, recv_name)?;
        if send != recv.cast_const() {
            check(send, count, dtype, send_name)?;
            check_disjoint(send, len, recv, len)?;
        }
        // SAFETY: forwarded; checked above, and disjoint unless identical.
        let out = unsafe { bytes_mut(recv, count, dtype, recv_name)? };
        if send != recv.cast_const() {
            // SAFETY: forwarded; disjoint from `out`.
            let input = unsafe { bytes(send, count, dtype, send_name)? };
            out.copy_from_slice(input);
        }
        let (p, n) = (out.as_mut_ptr(), count);
        // SAFETY: aligned (checked) and valid for `count` elements of the type.
        Ok(unsafe {
            match dtype {
                DType::F32 => Buffer::F32(std::slice::from_raw_parts_mut(p.cast(), n)),
                DType::F64 => Buffer::F64(std::slice::from_raw_parts_mut(p.cast(), n)),
                DType::F16 => Buffer::F16(std::slice::from_raw_parts_mut(p.cast(), n)),
                DType::BF16 => Buffer::BF16(std::slice::from_raw_parts_mut(p.cast(), n)),
            }
        })
    }
}
