//! The device: context, stream and the per-process cache of compiled kernels.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};

use crate::kernels::{self, ElemKind, Variant};
use crate::GpuError;

/// One CUDA device with a stream and the kernels compiled for it so far.
///
/// Kernels are compiled by NVRTC the first time a (element type, variant) is used and cached
/// for the life of the process (compiling takes 0.1–4 s; launching a cached one, microseconds).
#[derive(Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    sms: u32,
    max_shared_optin: usize,
    modules: Mutex<HashMap<(ElemKind, Variant), Arc<CudaModule>>>,
}

impl Gpu {
    /// Opens device `ordinal` and creates a stream on it.
    ///
    /// # Errors
    /// [`GpuError::NoLibrary`] without a CUDA driver, [`GpuError::Driver`] when the device
    /// cannot be opened (no such device, driver too old, ...).
    pub fn new(ordinal: usize) -> Result<Arc<Gpu>, GpuError> {
        driver_present()?;
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        use cudarc::driver::sys::CUdevice_attribute as A;
        let sms = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let optin = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let stream = ctx.new_stream()?;
        Ok(Arc::new(Gpu {
            ctx,
            stream,
            arch: format!("compute_{major}{minor}"),
            sms: sms.max(1) as u32,
            max_shared_optin: optin.max(0) as usize,
            modules: Mutex::new(HashMap::new()),
        }))
    }

    /// Device 0 if there is a usable one; otherwise why not (for tests and tools that skip
    /// GPU work visibly).
    pub fn probe() -> Result<Arc<Gpu>, GpuError> {
        driver_present()?;
        if CudaContext::device_count()? < 1 {
            return Err(GpuError::NoDevice);
        }
        kernels::nvrtc_present()?;
        Gpu::new(0)
    }

    /// The device a launched rank uses, as the NCCL transport picks it
    /// ([`byzcoll_runtime::bootstrap::local_device`]): its local rank modulo the number of
    /// visible devices.
    ///
    /// # Errors
    /// As [`Gpu::probe`].
    pub fn for_rank(local_rank: Option<usize>, rank: usize) -> Result<Arc<Gpu>, GpuError> {
        driver_present()?;
        let count = usize::try_from(CudaContext::device_count()?).unwrap_or(0);
        if count == 0 {
            return Err(GpuError::NoDevice);
        }
        kernels::nvrtc_present()?;
        Gpu::new(byzcoll_runtime::bootstrap::local_device(
            local_rank, rank, count,
        ))
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every kernel and copy of this crate runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The virtual architecture kernels are compiled for, e.g. `compute_90`.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Streaming multiprocessors.
    pub fn sms(&self) -> u32 {
        self.sms
    }

    /// Largest dynamic shared memory a block may opt in to.
    pub fn max_shared_optin(&self) -> usize {
        self.max_shared_optin
    }

    /// Kernel `name` of `variant` for `elem`, compiling and loading the module on first use.
    pub(crate) fn function(
        &self,
        elem: ElemKind,
        variant: &Variant,
        name: &str,
    ) -> Result<CudaFunction, GpuError> {
        let key = (elem, variant.clone());
        let cached = self
            .modules
            .lock()
            .map_err(|_| GpuError::Poisoned)?
            .get(&key)
            .cloned();
        let module = match cached {
            Some(m) => m,
            None => {
                let started = std::time::Instant::now();
                let ptx = kernels::compiled(elem, variant, &self.arch)?;
                let module = self.ctx.load_module((*ptx).clone())?;
                tracing::debug!(?elem, ?variant, elapsed = ?started.elapsed(), "compiled kernels");
                self.modules
                    .lock()
                    .map_err(|_| GpuError::Poisoned)?
                    .entry(key)
                    .or_insert(module)
                    .clone()
            }
        };
        Ok(module.load_function(name)?)
    }
}

/// Errors unless the CUDA driver library can be loaded (cudarc would panic on first use).
fn driver_present() -> Result<(), GpuError> {
    // SAFETY: only tries to open the library.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(GpuError::NoLibrary {
            library: "the CUDA driver (libcuda.so)",
            hint: "run on a machine with an NVIDIA GPU and its driver",
        })
    }
}
