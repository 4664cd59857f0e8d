//! Device vectors a binding's caller owns (feature `cuda`): a raw CUDA pointer from C
//! (`byzcoll_robust_allreduce_device`) or a torch tensor's `data_ptr()` from Python, lent for
//! one blocking call to the communicator's device entry point
//! ([`DeviceCollectives`](crate::cuda::DeviceCollectives)). Over NCCL the vectors go device
//! to device and the CUDA kernels aggregate them, with no host copy.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use byzcoll_aggregators::{AggError, Aggregator, Params};
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
fn driver_error(rule: &str, what: &str, e: DriverError) -> Error {
    Error::Aggregation(AggError::Backend {
        rule: rule.to_string(),
        backend: "CUDA",
        message: format!("{what}: {e}"),
    })
}

fn driver(rule: &str, what: &str, e: DriverError) -> Refused {
    failed(driver_error(rule, what, e))
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

/// `buf` (`count` elements of `E` on `gpu`'s device) as a borrowed slice.
///
/// # Safety
/// `buf` is device memory of `gpu`'s device, valid for `count` elements of `E`, and nothing
/// else uses it while the slice lives.
unsafe fn borrow<E: GpuElement>(gpu: &Gpu, buf: *mut c_void, count: usize) -> Borrowed<E> {
    // SAFETY: the caller's word; `Borrowed` never frees it.
    Borrowed(std::mem::ManuallyDrop::new(unsafe {
        gpu.stream()
            .upgrade_device_ptr::<E>(buf as sys::CUdeviceptr, count)
    }))
}

/// The lent vector's round on the communicator `c`, then the wait for the result on the GPU.
async fn lent_round<E: GpuElement>(
    c: &mut crate::Communicator,
    gpu: &Gpu,
    borrowed: &mut Borrowed<E>,
    rule: &CudaRule,
    policy: Policy,
) -> crate::Result<RoundReport> {
    let report = c
        .robust_all_reduce_device(&mut borrowed.0, rule, policy)
        .await?;
    gpu.stream()
        .synchronize()
        .map_err(|e| driver_error(rule.name(), "waiting for the result", e))?;
    Ok(report)
}

/// What [`robust_all_reduce_lent`] and [`start_robust_all_reduce_lent`] check and do before
/// the call: the pointers, the devices, the caller's stream waited for, `sendbuf` copied to
/// `recvbuf`. Returns the device's [`Gpu`] and the rule made for it.
///
/// # Safety
/// As [`robust_all_reduce_lent`].
unsafe fn prepare(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: DeviceType,
    call: &DeviceCall<'_>,
    stream: *mut c_void,
) -> Result<(Arc<Gpu>, CudaRule), Refused> {
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
    Ok((gpu, rule))
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
    // SAFETY: the caller's word, passed on.
    let (gpu, rule) = unsafe { prepare(sendbuf, recvbuf, count, dtype, call, stream)? };
    let policy = call.policy;
    macro_rules! run {
        ($e:ty) => {{
            // SAFETY: `recvbuf` is the caller's device memory of `count` elements on `gpu`'s
            // device (checked in `prepare`), the caller's to lend for the call.
            let mut borrowed = unsafe { borrow::<$e>(&gpu, recvbuf, count) };
            comm.run(async |c| lent_round(c, &gpu, &mut borrowed, &rule, policy).await)
        }};
    }
    match dtype {
        DeviceType::F32 => run!(f32),
        DeviceType::BF16 => run!(half::bf16),
        DeviceType::F16 => run!(half::f16),
    }
}

/// [`robust_all_reduce_lent`] of one buffer in place, started after the calls made before it
/// ([`BlockingComm::start`]): the checks, the wait for the work queued on `stream` and the
/// rule's making happen now, on the calling thread (a refusal is returned here, and `done` is
/// not called); the round runs in its turn, and `done` gets its outcome once the result is on
/// the device. What an asynchronous binding (Python's DDP hook) runs on.
///
/// # Errors
/// As [`robust_all_reduce_lent`], for what is checked before the call starts.
///
/// # Safety
/// `buf` is device memory valid for `count` elements of `dtype` that nothing else uses until
/// `done` has been called; `stream` is null or a live stream of its device.
#[allow(clippy::too_many_arguments)]
pub unsafe fn start_robust_all_reduce_lent(
    comm: &BlockingComm,
    buf: *mut c_void,
    count: usize,
    dtype: DeviceType,
    call: &DeviceCall<'_>,
    stream: *mut c_void,
    done: impl FnOnce(Result<RoundReport, Refused>) + Send + 'static,
) -> Result<(), Refused> {
    // SAFETY: the caller's word, passed on.
    let (gpu, rule) = unsafe { prepare(buf, buf, count, dtype, call, stream)? };
    let policy = call.policy;
    macro_rules! start {
        ($e:ty) => {{
            // SAFETY: `buf` is the caller's device memory of `count` elements on `gpu`'s
            // device (checked in `prepare`), the caller's to lend until `done` is called.
            let mut borrowed = unsafe { borrow::<$e>(&gpu, buf, count) };
            comm.start(
                move |c| {
                    Box::pin(async move { lent_round(c, &gpu, &mut borrowed, &rule, policy).await })
                },
                done,
            )
        }};
    }
    match dtype {
        DeviceType::F32 => start!(f32),
        DeviceType::BF16 => start!(half::bf16),
        DeviceType::F16 => start!(half::f16),
    }
    Ok(())
}
