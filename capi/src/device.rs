//! Device vectors (feature `cuda`): the caller's CUDA buffers through the CUDA rules.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use byzcoll_rs::cuda::cudarc::driver::{result, sys, CudaSlice, DriverError};
use byzcoll_rs::cuda::{CudaRule, DeviceCollectives, Gpu, GpuElement, GpuError};
use byzcoll_rs::Policy;

use crate::buffers::DType;
use crate::report;
use crate::status::{byzcoll_status_t::*, Failure};
use crate::{byzcoll_comm_t, byzcoll_report_t, byzcoll_rule_params_t};

fn driver(what: &str, e: DriverError) -> Failure {
    Failure::new(BYZCOLL_DEVICE, format!("{what}: {e}"))
}

fn gpu_error(e: GpuError) -> Failure {
    match e {
        GpuError::NoLibrary { .. } | GpuError::NoDevice => {
            Failure::new(BYZCOLL_UNSUPPORTED, e.to_string())
        }
        e => Failure::new(BYZCOLL_DEVICE, e.to_string()),
    }
}

/// The device `p` lives on, or why it is not device memory; and that its allocation holds
/// `bytes` bytes from `p`.
fn device_of(p: *const c_void, bytes: usize, name: &str) -> Result<usize, Failure> {
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
            return Err(Failure::invalid(format!(
                "{name} ({p:p}) is not memory the CUDA driver knows (cudaMalloc it, or use \
                 byzcoll_robust_allreduce for host memory)"
            )))
        }
    };
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: as above; the driver writes the allocation's base and size.
    unsafe { sys::cuMemGetAddressRange_v2(&raw mut base, &raw mut size, p as sys::CUdeviceptr) }
        .result()
        .map_err(|e| driver(&format!("the allocation of {name}"), e))?;
    let end = base.saturating_add(size as sys::CUdeviceptr);
    if (p as sys::CUdeviceptr).saturating_add(bytes as sys::CUdeviceptr) > end {
        return Err(Failure::invalid(format!(
            "{name} ({p:p}) + {bytes} bytes runs past its allocation ({size} bytes from {base:#x})"
        )));
    }
    Ok(ordinal)
}

/// One `Gpu` (context, stream, compiled kernels) per device, for the whole process.
fn gpu(ordinal: usize) -> Result<Arc<Gpu>, Failure> {
    static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
    let mut gpus = GPUS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(g) = gpus.get(&ordinal) {
        return Ok(g.clone());
    }
    let g = Gpu::new(ordinal).map_err(gpu_error)?;
    gpus.insert(ordinal, g.clone());
    Ok(g)
}

/// A caller's device buffer as a `CudaSlice`, for the length of one call: dropping it waits for
/// the work queued on it (an aborted or failed call may have left kernels writing to it) and
/// gives the memory back to its owner (leaks the slice) rather than freeing it.
struct Borrowed<E: GpuElement>(Option<CudaSlice<E>>);

impl<E: GpuElement> Drop for Borrowed<E> {
    fn drop(&mut self) {
        if let Some(slice) = self.0.take() {
            // On success the call has synchronized already and reported any error; on
            // failure it reports its own, and this wait only keeps the buffer from being
            // handed back while kernels still write to it.
            let _ = slice.stream().synchronize();
            slice.leak();
        }
    }
}

/// `recvbuf` (`count` elements of `E` on `gpu`'s device) all-reduced with `rule` through the
/// communicator's device entry point ([`DeviceCollectives`]).
///
/// # Safety
/// `recvbuf` is device memory of `gpu`'s device, valid for `count` elements of `E`, and
/// nothing else uses it during the call.
unsafe fn all_reduce<E: GpuElement>(
    comm: &byzcoll_comm_t,
    gpu: &Arc<Gpu>,
    recvbuf: *mut c_void,
    count: usize,
    rule: &CudaRule,
    policy: Policy,
) -> Result<byzcoll_rs::RoundReport, Failure> {
    // SAFETY: the caller's word; `Borrowed` never frees it.
    let mut buf = Borrowed(Some(unsafe {
        gpu.stream()
            .upgrade_device_ptr::<E>(recvbuf as sys::CUdeviceptr, count)
    }));
    let slice = buf
        .0
        .as_mut()
        .ok_or_else(|| Failure::new(BYZCOLL_INTERNAL, "the device buffer went away"))?;
    let report = comm.run(async |c| c.robust_all_reduce_device(slice, rule, policy).await)?;
    gpu.stream()
        .synchronize()
        .map_err(|e| driver("waiting for the result in recvbuf", e))?;
    Ok(report)
}

/// See `byzcoll_robust_allreduce_device`: checks the caller's pointers, then calls the
/// communicator's device entry point ([`DeviceCollectives::robust_all_reduce_device`]).
///
/// # Safety
/// As `byzcoll_robust_allreduce_device`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn robust_allreduce(
    comm: &byzcoll_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: i32,
    rule: *const std::ffi::c_char,
    params: *const byzcoll_rule_params_t,
    stream: *mut c_void,
    report: *mut byzcoll_report_t,
) -> Result<(), Failure> {
    // SAFETY: forwarded.
    let mut report = unsafe { report::Out::new(report)? };
    // SAFETY: forwarded.
    let (name, spec, policy): (String, _, Policy) = unsafe { crate::read_rule_spec(rule, params)? };
    let dtype = DType::parse(dtype)?;
    if let DType::F64 = dtype {
        return Err(Failure::new(
            BYZCOLL_UNSUPPORTED,
            "device vectors are BYZCOLL_FLOAT32, BYZCOLL_BFLOAT16 or BYZCOLL_FLOAT16 (the CUDA \
             rules' element types)",
        ));
    }
    let bytes = count
        .checked_mul(dtype.size())
        .ok_or_else(|| Failure::invalid(format!("count {count} is too large")))?;
    for (p, what) in [(sendbuf, "sendbuf"), (recvbuf.cast_const(), "recvbuf")] {
        if p.is_null() {
            return Err(Failure::invalid(format!("{what} is NULL")));
        }
    }
    let (s, r) = (sendbuf as usize, recvbuf as usize);
    if s != r && s < r.saturating_add(bytes) && r < s.saturating_add(bytes) {
        return Err(Failure::invalid(
            "sendbuf and recvbuf overlap without being the same buffer",
        ));
    }
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(Failure::new(
            BYZCOLL_UNSUPPORTED,
            "the CUDA driver (libcuda.so) could not be loaded: run on a machine with an NVIDIA \
             GPU and its driver",
        ));
    }
    result::init().map_err(|e| match e.0 {
        sys::CUresult::CUDA_ERROR_NO_DEVICE => {
            Failure::new(BYZCOLL_UNSUPPORTED, "the CUDA driver finds no device here")
        }
        _ => driver("cuInit", e),
    })?;
    let ordinal = device_of(recvbuf, bytes, "recvbuf")?;
    if device_of(sendbuf, bytes, "sendbuf")? != ordinal {
        return Err(Failure::invalid(
            "sendbuf and recvbuf are on different devices",
        ));
    }
    let gpu = gpu(ordinal)?;
    gpu.context()
        .bind_to_thread()
        .map_err(|e| driver("binding the device's context", e))?;
    let rule = CudaRule::new(gpu.clone(), &name, &spec)
        .map_err(|e| Failure::from(byzcoll_rs::Error::from(e)))?;
    // SAFETY: `stream` is NULL (the default stream) or the caller's live stream; the copy is
    // between two device buffers of `bytes` bytes (the caller's word), checked not to overlap.
    unsafe {
        sys::cuStreamSynchronize(stream as sys::CUstream)
            .result()
            .map_err(|e| driver("waiting for the caller's stream", e))?;
        if s != r {
            sys::cuMemcpyDtoD_v2(
                recvbuf as sys::CUdeviceptr,
                sendbuf as sys::CUdeviceptr,
                bytes,
            )
            .result()
            .map_err(|e| driver("copying sendbuf to recvbuf", e))?;
            sys::cuCtxSynchronize()
                .result()
                .map_err(|e| driver("waiting for the copy to recvbuf", e))?;
        }
    }
    // SAFETY: `recvbuf` is the caller's device memory of `bytes` bytes on `gpu`'s device
    // (checked above), the caller's to lend for the call.
    let round = unsafe {
        match dtype {
            DType::F32 => all_reduce::<f32>(comm, &gpu, recvbuf, count, &rule, policy),
            DType::BF16 => all_reduce::<half::bf16>(comm, &gpu, recvbuf, count, &rule, policy),
            DType::F16 => all_reduce::<half::f16>(comm, &gpu, recvbuf, count, &rule, policy),
            DType::F64 => Err(Failure::new(BYZCOLL_UNSUPPORTED, "f64 device vectors")),
        }
    };
    report.record(round)
}
