//! Device vectors a binding's caller owns (feature `cuda`): a raw CUDA pointer from C
//! (`byzcoll_robust_allreduce_device`) or a torch tensor's `data_ptr()` from Python, lent for
//! one blocking call to the communicator's device entry point
//! ([`DeviceCollectives`](crate::cuda::DeviceCollectives)). Over NCCL the vectors go device
//! to device and the CUDA kernels aggregate them, with no host copy.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use byzcoll_aggregators::{AggError, Params};
use byzcoll_cuda::cudarc::driver::{result, sys, CudaSlice, DriverError};
use byzcoll_cuda::{CudaRule, DeviceCollectives, Gpu, GpuElement, GpuError};

use super::{BlockingComm, Refused};
use crate::{Error, Policy, RoundReport};

/// The element types of device vectors: the CUDA rules' own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceType {
    /// `f32`.
    F32,
    /// `bf16`.
    BF16,
    /// IEEE `f16`.
    F16,
}

impl DeviceType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DeviceType::F32 => 4,
            DeviceType::BF16 | DeviceType::F16 => 2,
        }
    }
}

/// What a robust all-reduce of a lent device vector does: the rule by name with its
/// parameters, and how data moves.
#[derive(Debug, Clone)]
pub struct DeviceCall<'a> {
    /// The CUDA rule's name (`median`, `trimmed-mean`, `krum`, `multi-krum`, `bulyan`).
    pub rule: &'a str,
    /// Its parameters.
    pub params: &'a Params,
    /// How data moves.
    pub policy: Policy,
}

fn failed(e: Error) -> Refused {
    Refused::Failed(e)
}

fn invalid(why: impl Into<String>) -> Refused {
    failed(Error::InvalidUsage(why.into()))
}

fn unsupported(why: impl Into<String>) -> Refused {
    failed(Error::Unsupported(why.into()))
}

/// A failed CUDA driver call, as the device error it is ([`crate::ErrorKind::Device`]).
fn driver(rule: &str, what: &str, e: DriverError) -> Refused {
    failed(Error::Aggregation(AggError::Backend {
        rule: rule.to_string(),
        backend: "CUDA",
        message: format!("{what}: {e}"),
    }))
}

fn gpu_error(rule: &str, e: GpuError) -> Refused {
    match e {
        GpuError::NoLibrary { .. } | GpuError::NoDevice => unsupported(e.to_string()),
        e => failed(Error::Aggregation(e.into_agg(rule))),
    }
}

/// The device `p` lives on, or why it is not device memory; and that its allocation holds
/// `bytes` bytes from `p`.
fn device_of(p: *const c_void, bytes: usize, name: &str, rule: &str) -> Result<usize, Refused> {
    let mut ordinal: i32 = -1;
    // SAFETY: the driver is loaded and initialised; it writes one int for this attribute.
    let rc = unsafe {
        sys::cuPointerGetAttribute(
            (&raw mut ordinal).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            p as sys::CUdeviceptr,
        )
    };
    let ordinal = match rc.result() {
        Ok(()) if ordinal >= 0 => ordinal as usize,
        _ => {
            return Err(invalid(format!(
                "{name} ({p:p}) is not memory the CUDA driver knows (cudaMalloc it, or pass host \
                 memory to the host entry point)"
            )))
        }
    };
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: as above; the driver writes the allocation's base and size.
    unsafe { sys::cuMemGetAddressRange_v2(&raw mut base, &raw mut size, p as sys::CUdeviceptr) }
        .result()
        .map_err(|e| driver(rule, &format!("the allocation of {name}"), e))?;
    let end = base.saturating_add(size as sys::CUdeviceptr);
    if (p as sys::CUdeviceptr).saturating_add(bytes as sys::CUdeviceptr) > end {
        return Err(invalid(format!(
            "{name} ({p:p}) + {bytes} bytes runs past its allocation ({size} bytes from {base:#x})"
        )));
    }
    Ok(ordinal)
}

/// One `Gpu` (context, stream, compiled kernels) per device, for the whole process.
fn gpu(ordinal: usize, rule: &str) -> Result<Arc<Gpu>, Refused> {
    static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
    let mut gpus = GPUS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(g) = gpus.get(&ordinal) {
        return Ok(g.clone());
    }
    let g = Gpu::new(ordinal).map_err(|e| gpu_error(rule, e))?;
    gpus.insert(ordinal, g.clone());
    Ok(g)
}

/// A caller's device buffer as a `CudaSlice`, for the length of one call: dropping it waits for
/// the work queued on it (an aborted or failed call may have left kernels writing to it) and
/// gives the memory back to its owner (leaks the slice) rather than freeing it.
struct Borrowed<E: GpuElement>(std::mem::ManuallyDrop<CudaSlice<E>>);

impl<E: GpuElement> Drop for Borrowed<E> {
    fn drop(&mut self) {
        // On success the call has synchronized already and reported any error; on failure it
        // reports its own, and this wait only keeps the buffer from being handed back while
        // kernels still write to it.
        let _ = self.0.stream().synchronize();
        // SAFETY: taken once, here, and never used again.
        unsafe { std::mem::ManuallyDrop::take(&mut self.0) }.leak();
    }
}

/// `buf` (`count` elements of `E` on `gpu`'s device) all-reduced through the communicator's
/// device entry point.
///
/// # Safety
/// `buf` is device memory of `gpu`'s device, valid for `count` elements of `E`, and nothing
/// else uses it during the call.
unsafe fn lent<E: GpuElement>(
    comm: &BlockingComm,
    gpu: &Arc<Gpu>,
    buf: *mut c_void,
    count: usize,
    rule: &CudaRule,
    call: &DeviceCall<'_>,
) -> Result<RoundReport, Refused> {
    // SAFETY: the caller's word; `Borrowed` never frees it.
    let mut borrowed = Borrowed(std::mem::ManuallyDrop::new(unsafe {
        gpu.stream()
            .upgrade_device_ptr::<E>(buf as sys::CUdeviceptr, count)
    }));
    let slice: &mut CudaSlice<E> = &mut borrowed.0;
    let policy = call.policy;
    let report = comm.run(async |c| c.robust_all_reduce_device(slice, rule, policy).await)?;
    gpu.stream()
        .synchronize()
        .map_err(|e| driver(call.rule, "waiting for the result", e))?;
    Ok(report)
}

/// Robust all-reduce of the caller's device vector: `recvbuf` becomes `call.rule` applied to
/// every rank's `sendbuf` (`count` elements of `dtype`, on one device; the same buffer, or two
/// that do not overlap), after the work queued on `stream` (a `CUstream`; null: the default
/// stream). Over NCCL the vectors go device to device; over a host transport an `F32` vector
/// crosses from host memory and other types are refused ([`DeviceCollectives`]).
///
/// # Errors
/// [`Refused::Failed`] with [`Error::InvalidUsage`] for null, overlapping or non-device
/// pointers, or buffers on two devices; [`Error::Unsupported`] where no CUDA driver or device
/// is there; a failed driver call as [`Error::Aggregation`] (kind `Device`); otherwise as the
/// communicator's device entry point.
///
/// # Safety
/// `sendbuf` and `recvbuf` are device memory valid for `count` elements of `dtype` that nothing
/// else uses during the call; `stream` is null or a live stream of their device.
#[allow(clippy::too_many_arguments)]
pub unsafe fn robust_all_reduce_lent(
    comm: &BlockingComm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: DeviceType,
    call: &DeviceCall<'_>,
    stream: *mut c_void,
) -> Result<RoundReport, Refused> {
    let name = call.rule;
    let bytes = count
        .checked_mul(dtype.size())
        .ok_or_else(|| invalid(format!("count {count} is too large")))?;
    for (p, what) in [(sendbuf, "sendbuf"), (recvbuf.cast_const(), "recvbuf")] {
        if p.is_null() {
            return Err(invalid(format!("{what} is NULL")));
        }
    }
    let (s, r) = (sendbuf as usize, recvbuf as usize);
    if s != r && s < r.saturating_add(bytes) && r < s.saturating_add(bytes) {
        return Err(invalid(
            "sendbuf and recvbuf overlap without being the same buffer",
        ));
    }
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(unsupported(
            "the CUDA driver (libcuda.so) could not be loaded: run on a machine with an NVIDIA \
             GPU and its driver",
        ));
    }
    result::init().map_err(|e| match e.0 {
        sys::CUresult::CUDA_ERROR_NO_DEVICE => unsupported("the CUDA driver finds no device here"),
        _ => driver(name, "cuInit", e),
    })?;
    let ordinal = device_of(recvbuf, bytes, "recvbuf", name)?;
    if device_of(sendbuf, bytes, "sendbuf", name)? != ordinal {
        return Err(invalid("sendbuf and recvbuf are on different devices"));
    }
    let gpu = gpu(ordinal, name)?;
    gpu.context()
        .bind_to_thread()
        .map_err(|e| driver(name, "binding the device's context", e))?;
    let rule = CudaRule::new(gpu.clone(), name, call.params).map_err(|e| failed(e.into()))?;
    // SAFETY: `stream` is null (the default stream) or the caller's live stream; the copy is
    // between two device buffers of `bytes` bytes (the caller's word), checked not to overlap.
    unsafe {
        sys::cuStreamSynchronize(stream as sys::CUstream)
            .result()
            .map_err(|e| driver(name, "waiting for the caller's stream", e))?;
        if s != r {
            sys::cuMemcpyDtoD_v2(
                recvbuf as sys::CUdeviceptr,
                sendbuf as sys::CUdeviceptr,
                bytes,
            )
            .result()
            .map_err(|e| driver(name, "copying sendbuf to recvbuf", e))?;
            sys::cuCtxSynchronize()
                .result()
                .map_err(|e| driver(name, "waiting for the copy to recvbuf", e))?;
        }
    }
    // SAFETY: `recvbuf` is the caller's device memory of `bytes` bytes on `gpu`'s device
    // (checked above), the caller's to lend for the call.
    unsafe {
        match dtype {
            DeviceType::F32 => lent::<f32>(comm, &gpu, recvbuf, count, &rule, call),
            DeviceType::BF16 => lent::<half::bf16>(comm, &gpu, recvbuf, count, &rule, call),
            DeviceType::F16 => lent::<half::f16>(comm, &gpu, recvbuf, count, &rule, call),
        }
    }
}
