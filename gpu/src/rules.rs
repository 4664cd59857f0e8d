//! [`CudaRule`]: the robust rules on the GPU, on device vectors or as a host [`Aggregator`].

use std::fmt;
use std::sync::{Arc, Mutex};

use byzcoll_aggregators::{
    build, AggError, AggReport, Aggregator, DistanceSelection, Inputs, Output, Params, Structure,
};
use byzcoll_runtime::{Communicator, Error, Policy, RoundReport};
use cudarc::driver::{
    sys::CUdeviceptr, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, DriverError, LaunchConfig,
    PinnedHostSlice, PushKernelArg, ValidAsZeroBits,
};

use crate::kernels::{self, ElemKind, Variant};
use crate::plan::{self, Mode};
use crate::{Gpu, GpuError};

/// An element type the kernels read and write on the device.
pub trait GpuElement: DeviceRepr + ValidAsZeroBits + Copy + Send + Sync + 'static {
    /// Its kernel build.
    const KIND: ElemKind;
}

impl GpuElement for f32 {
    const KIND: ElemKind = ElemKind::F32;
}
impl GpuElement for half::bf16 {
    const KIND: ElemKind = ElemKind::Bf16;
}
impl GpuElement for half::f16 {
    const KIND: ElemKind = ElemKind::F16;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Median,
    Trimmed,
    /// Krum, Multi-Krum: the mean of the selected inputs.
    MeanOfSelected,
    Bulyan,
}

impl Kind {
    /// The kernels of the rule named `name`, if it has any.
    fn of(name: &str) -> Option<Kind> {
        match name {
            "median" => Some(Kind::Median),
            "trimmed-mean" | "trimmed_mean" => Some(Kind::Trimmed),
            "krum" | "multi-krum" => Some(Kind::MeanOfSelected),
            "bulyan" => Some(Kind::Bulyan),
            _ => None,
        }
    }
}

/// "No bad coordinate" in the kernels' `bad` word.
const NONE_BAD: u64 = u64::MAX;

/// A robust rule running on a GPU. See the crate docs for the algorithms.
pub struct CudaRule {
    gpu: Arc<Gpu>,
    /// The CPU rule: name, precondition and (Krum family) the selection from the distance
    /// table. Its `aggregate` is never called here.
    reference: Box<dyn Aggregator>,
    kind: Kind,
    f: usize,
    staging: Mutex<Option<Staging>>,
}

impl fmt::Debug for CudaRule {
    fn fmt(&self, out: &mut fmt::Formatter<'_>) -> fmt::Result {
        out.debug_struct("CudaRule")
            .field("rule", &self.reference.name())
            .field("f", &self.f)
            .finish_non_exhaustive()
    }
}

/// Device and pinned host buffers for host-vector rounds, kept between rounds of one shape.
struct Staging {
    n: usize,
    d: usize,
    host_in: PinnedHostSlice<f32>,
    device_in: CudaSlice<f32>,
    device_out: CudaSlice<f32>,
    host_out: PinnedHostSlice<f32>,
}

impl CudaRule {
    /// The rule `name` (`median`, `trimmed-mean`, `krum`, `multi-krum`, `bulyan`) with
    /// `params`, on `gpu`.
    ///
    /// # Errors
    /// As [`byzcoll_aggregators::build`] for unknown names and bad parameters;
    /// [`AggError::Unsupported`] for a rule with no CUDA implementation.
    pub fn new(gpu: Arc<Gpu>, name: &str, params: &Params) -> Result<Self, AggError> {
        let Some(kind) = Kind::of(name) else {
            // Let the CPU builder reject unknown names with its list of rules first.
            build(name, params)?;
            return Err(AggError::Unsupported {
                rule: name.to_string(),
                what: "CUDA (GPU rules: median, trimmed-mean, krum, multi-krum, bulyan); use the \
                       CPU rule"
                    .to_string(),
            });
        };
        let reference = build(name, params)?;
        Ok(CudaRule {
            gpu,
            f: reference.byzantine(),
            reference,
            kind,
            staging: Mutex::new(None),
        })
    }

    /// The device the rule runs on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The CPU rule it implements (name, precondition, selection).
    #[cfg(feature = "nccl")]
    pub(crate) fn reference(&self) -> &dyn Aggregator {
        &*self.reference
    }

    pub(crate) fn backend(&self, e: impl Into<GpuError>) -> AggError {
        e.into().into_agg(self.reference.name())
    }

    /// Aggregates `inputs`, vectors on the rule's device, into `out` (same length and element
    /// type). The call returns when the result is in `out`.
    ///
    /// # Errors
    /// [`AggError::LengthMismatch`], [`AggError::Precondition`], [`AggError::NonFiniteResult`] /
    /// [`AggError::TooManyNonFiniteInputs`] under the non-finite policy,
    /// [`AggError::Unsupported`] past a size limit (e.g. `n` whose selection columns exceed the
    /// device's shared memory, Bulyan with more than 64 selected inputs),
    /// [`AggError::Backend`] when CUDA fails.
    pub fn aggregate_device<E, V, O>(
        &self,
        inputs: &[V],
        out: &mut O,
    ) -> Result<AggReport, AggError>
    where
        E: GpuElement,
        V: DevicePtr<E>,
        O: DevicePtrMut<E>,
    {
        let d = out.len();
        check_lengths(inputs.iter().map(|x| x.len()), d)?;
        self.reference.check(inputs.len())?;
        let stream = self.gpu.stream();
        let mut guards = Vec::with_capacity(inputs.len() + 1);
        let mut rows = Vec::with_capacity(inputs.len());
        for x in inputs {
            let (ptr, guard) = x.device_ptr(stream);
            rows.push(ptr);
            guards.push(guard);
        }
        let (out_ptr, out_guard) = out.device_ptr_mut(stream);
        let result = self.run::<E>(&rows, out_ptr, d);
        drop(out_guard);
        drop(guards);
        result
    }

    /// The rule on device rows (pointers to `d` values each) into `out`.
    pub(crate) fn run<E: GpuElement>(
        &self,
        rows: &[CUdeviceptr],
        out: CUdeviceptr,
        d: usize,
    ) -> Result<AggReport, AggError> {
        match self.kind {
            Kind::Median => self.coordinate::<E>(Mode::Median, rows, out, d),
            Kind::Trimmed => self.coordinate::<E>(Mode::Trimmed, rows, out, d),
            Kind::MeanOfSelected | Kind::Bulyan => {
                let selection = self.selection()?;
                let table = self.distance_table::<E>(rows, d)?;
                let selected = selection.select(&table, rows.len())?;
                let chosen: Vec<CUdeviceptr> = selected.iter().map(|&i| rows[i]).collect();
                self.finish_rows::<E>(&chosen, out, d)?;
                return Ok(AggReport::selected(selected));
            }
        }
        .map(|()| AggReport::default())
    }

    pub(crate) fn selection(&self) -> Result<&dyn DistanceSelection, AggError> {
        self.reference
            .distance_selection()
            .ok_or_else(|| AggError::Unsupported {
                rule: self.reference.name().to_string(),
                what: "a distance selection".to_string(),
            })
    }

    /// Median or trimmed mean of `rows`.
    fn coordinate<E: GpuElement>(
        &self,
        mode: Mode,
        rows: &[CUdeviceptr],
        out: CUdeviceptr,
        d: usize,
    ) -> Result<(), AggError> {
        let (gpu, stream) = (&self.gpu, self.gpu.stream());
        let n = rows.len();
        let table = stream.clone_htod(rows).map_err(|e| self.backend(e))?;
        let mut bad = stream
            .clone_htod(&[NONE_BAD])
            .map_err(|e| self.backend(e))?;
        let d64 = d as u64;
        if n <= plan::NETWORK_MAX_INPUTS {
            let variant = Variant::Network {
                n,
                mode,
                ranks: plan::ranks(mode, n, self.f),
            };
            let func = gpu
                .function(E::KIND, &variant, "coordinate_network")
                .map_err(|e| self.backend(e))?;
            let cfg = grid(d, plan::COORDINATE_THREADS, gpu.sms(), 8, 0);
            let mut launch = stream.launch_builder(&func);
            launch.arg(&table).arg(&out).arg(&d64).arg(&mut bad);
            // SAFETY: the kernel reads n rows of d elements of E through `table` and writes d
            // elements to `out`, all live device memory of that size (checked by the callers).
            unsafe { launch.launch(cfg) }.map_err(|e| self.backend(e))?;
        } else {
            let shared = plan::select_shared_bytes(n);
            if shared > gpu.max_shared_optin() {
                return Err(AggError::Unsupported {
                    rule: self.reference.name().to_string(),
                    what: format!(
                        "n = {n} inputs on this GPU (selection needs {shared} B of shared memory \
                         per block, the device allows {})",
                        gpu.max_shared_optin()
                    ),
                });
            }
            let func = gpu
                .function(E::KIND, &Variant::Generic, "coordinate_select")
                .map_err(|e| self.backend(e))?;
            use cudarc::driver::sys::CUfunction_attribute as Attr;
            // The function is shared by every rule on this GPU: always the device's limit, so
            // a rule running at the same time never lowers it under another's launch.
            func.set_attribute(
                Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                gpu.max_shared_optin() as i32,
            )
            .map_err(|e| self.backend(e))?;
            let cfg = grid(d, plan::SELECT_THREADS, gpu.sms(), 32, shared as u32);
            let (n32, f32_, mode32) = (n as i32, self.f as i32, mode.code());
            let mut launch = stream.launch_builder(&func);
            launch
                .arg(&table)
                .arg(&out)
                .arg(&d64)
                .arg(&n32)
                .arg(&f32_)
                .arg(&mode32)
                .arg(&mut bad);
            // SAFETY: as above; the dynamic shared memory holds n keys per thread.
            unsafe { launch.launch(cfg) }.map_err(|e| self.backend(e))?;
        }
        self.check_bad(&bad)
    }

    /// Turns the kernels' `bad` word into the non-finite error.
    fn check_bad(&self, bad: &CudaSlice<u64>) -> Result<(), AggError> {
        let bad = self
            .gpu
            .stream()
            .clone_dtoh(bad)
            .map_err(|e| self.backend(e))?;
        match bad.first() {
            Some(&c) if c != NONE_BAD => Err(AggError::NonFiniteResult {
                rule: self.reference.name().to_string(),
                f: self.f,
                coordinate: c as usize,
            }),
            _ => Ok(()),
        }
    }

    /// The `n × n` table of squared distances between `rows`, with the CPU rules' conventions
    /// (`+inf` rows and columns, diagonal included, for inputs holding non-finite values).
    pub(crate) fn distance_table<E: GpuElement>(
        &self,
        rows: &[CUdeviceptr],
        d: usize,
    ) -> Result<Vec<f64>, AggError> {
        let (gpu, stream) = (&self.gpu, self.gpu.stream());
        let n = rows.len();
        let tiles = plan::distance_tiles(n);
        if tiles.len() > 65_535 {
            return Err(AggError::Unsupported {
                rule: self.reference.name().to_string(),
                what: format!("n = {n} inputs (at most 23 000 fit the distance grid)"),
            });
        }
        let splits = plan::distance_splits(d, tiles.len(), gpu.sms());
        let e = |x: DriverError| self.backend(x);
        let table_rows = stream.clone_htod(rows).map_err(e)?;
        let tile_rows: Vec<i32> = tiles.iter().map(|t| t.0).collect();
        let tile_cols: Vec<i32> = tiles.iter().map(|t| t.1).collect();
        let tile_rows = stream.clone_htod(&tile_rows).map_err(e)?;
        let tile_cols = stream.clone_htod(&tile_cols).map_err(e)?;
        let tile = plan::distance_tile(n);
        let variant = kernels::distance_variant(n);
        let partial_len = tiles.len() * splits as usize * tile * tile;
        let mut partial = stream.alloc_zeros::<f64>(partial_len).map_err(e)?;
        let mut flags = stream.alloc_zeros::<u32>(n).map_err(e)?;
        let mut table = stream.alloc_zeros::<f64>(n * n).map_err(e)?;
        let (n32, d64) = (n as i32, d as u64);

        let func = gpu
            .function(E::KIND, &variant, "distance_tiles")
            .map_err(|x| self.backend(x))?;
        let cfg = LaunchConfig {
            grid_dim: (splits, tiles.len() as u32, 1),
            block_dim: (plan::DIST_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(&func);
        launch
            .arg(&table_rows)
            .arg(&n32)
            .arg(&d64)
            .arg(&tile_rows)
            .arg(&tile_cols)
            .arg(&mut partial)
            .arg(&mut flags);
        // SAFETY: `partial` holds tiles × splits × tile² doubles, `flags` n words; rows as above.
        unsafe { launch.launch(cfg) }.map_err(e)?;

        let func = gpu
            .function(E::KIND, &variant, "distance_reduce")
            .map_err(|x| self.backend(x))?;
        let entries = tiles.len() * tile * tile;
        let cfg = grid(entries, plan::COORDINATE_THREADS, gpu.sms(), 8, 0);
        let (splits32, tiles32) = (splits as i32, tiles.len() as i32);
        let mut launch = stream.launch_builder(&func);
        launch
            .arg(&partial)
            .arg(&splits32)
            .arg(&tiles32)
            .arg(&n32)
            .arg(&tile_rows)
            .arg(&tile_cols)
            .arg(&mut table);
        // SAFETY: `table` holds n² doubles; the kernel writes only entries with i, j < n.
        unsafe { launch.launch(cfg) }.map_err(e)?;

        let mut table = stream.clone_dtoh(&table).map_err(e)?;
        let flags = stream.clone_dtoh(&flags).map_err(e)?;
        mark_non_finite(&mut table, &flags);
        Ok(table)
    }

    /// The finish over the selected rows: their mean (Krum, Multi-Krum) or Bulyan's
    /// coordinate phase.
    pub(crate) fn finish_rows<E: GpuElement>(
        &self,
        chosen: &[CUdeviceptr],
        out: CUdeviceptr,
        d: usize,
    ) -> Result<(), AggError> {
        let (gpu, stream) = (&self.gpu, self.gpu.stream());
        let e = |x: DriverError| self.backend(x);
        let m = chosen.len();
        let table = stream.clone_htod(chosen).map_err(e)?;
        let mut bad = stream.clone_htod(&[NONE_BAD]).map_err(e)?;
        let d64 = d as u64;
        let cfg = grid(d, plan::COORDINATE_THREADS, gpu.sms(), 8, 0);
        if self.kind == Kind::Bulyan {
            if m > plan::NETWORK_MAX_INPUTS {
                return Err(AggError::Unsupported {
                    rule: self.reference.name().to_string(),
                    what: format!(
                        "{m} selected inputs on the GPU (at most {})",
                        plan::NETWORK_MAX_INPUTS
                    ),
                });
            }
            let variant = Variant::Network {
                n: m,
                mode: Mode::Median,
                ranks: 0..m,
            };
            let func = gpu
                .function(E::KIND, &variant, "bulyan_network")
                .map_err(|x| self.backend(x))?;
            let beta = (m - 2 * self.f) as i32;
            let mut launch = stream.launch_builder(&func);
            launch
                .arg(&table)
                .arg(&out)
                .arg(&d64)
                .arg(&beta)
                .arg(&mut bad);
            // SAFETY: m rows of d elements in, d elements out.
            unsafe { launch.launch(cfg) }.map_err(e)?;
        } else {
            let func = gpu
                .function(E::KIND, &Variant::Generic, "mean_rows")
                .map_err(|x| self.backend(x))?;
            let m32 = m as i32;
            let mut launch = stream.launch_builder(&func);
            launch
                .arg(&table)
                .arg(&m32)
                .arg(&out)
                .arg(&d64)
                .arg(&mut bad);
            // SAFETY: m rows of d elements in, d elements out.
            unsafe { launch.launch(cfg) }.map_err(e)?;
        }
        self.check_bad(&bad)
    }

    /// Runs `body` on host vectors staged into device memory (one pinned copy, one transfer)
    /// and copies its device output back into `out`. `out` is written only on success.
    fn staged(
        &self,
        inputs: &[&[f32]],
        out: &mut [f32],
        body: impl FnOnce(&[CUdeviceptr], CUdeviceptr, usize) -> Result<AggReport, AggError>,
    ) -> Result<AggReport, AggError> {
        let (n, d) = (inputs.len(), out.len());
        let stream = self.gpu.stream().clone();
        let e = |x: DriverError| self.backend(x);
        let mut slot = self
            .staging
            .lock()
            .map_err(|_| self.backend(GpuError::Poisoned))?;
        if !matches!(&*slot, Some(s) if s.n == n && s.d == d) {
            *slot = None;
            let ctx = self.gpu.context();
            // SAFETY: the pinned buffers are written before they are read (below).
            let (host_in, host_out) = unsafe {
                (
                    ctx.alloc_pinned_with_flags::<f32>((n * d).max(1), 0)
                        .map_err(e)?,
                    ctx.alloc_pinned_with_flags::<f32>(d.max(1), 0).map_err(e)?,
                )
            };
            *slot = Some(Staging {
                n,
                d,
                host_in,
                device_in: stream.alloc_zeros::<f32>((n * d).max(1)).map_err(e)?,
                device_out: stream.alloc_zeros::<f32>(d.max(1)).map_err(e)?,
                host_out,
            });
        }
        let Some(s) = slot.as_mut() else {
            return Err(self.backend(GpuError::Poisoned));
        };
        {
            let staged = s.host_in.as_mut_slice().map_err(e)?;
            for (dst, src) in staged.chunks_exact_mut(d.max(1)).zip(inputs) {
                dst[..d].copy_from_slice(src);
            }
        }
        stream
            .memcpy_htod(&s.host_in, &mut s.device_in)
            .map_err(e)?;
        let report = {
            let (base, _guard_in) = s.device_in.device_ptr(&stream);
            let (out_ptr, _guard_out) = s.device_out.device_ptr_mut(&stream);
            let rows: Vec<CUdeviceptr> = (0..n).map(|i| base + (i * d * 4) as u64).collect();
            body(&rows, out_ptr, d)?
        };
        stream
            .memcpy_dtoh(&s.device_out, &mut s.host_out)
            .map_err(e)?;
        stream.synchronize().map_err(e)?;
        out.copy_from_slice(&s.host_out.as_slice().map_err(e)?[..d]);
        Ok(report)
    }
}

fn check_lengths(lens: impl Iterator<Item = usize>, expected: usize) -> Result<(), AggError> {
    for (input, len) in lens.enumerate() {
        if len != expected {
            return Err(AggError::LengthMismatch {
                input,
                len,
                expected,
            });
        }
    }
    Ok(())
}

/// Marks rows and columns of flagged inputs `+inf`, the diagonal included (the CPU table's
/// convention: a non-finite input is infinitely far from everything, itself too).
pub(crate) fn mark_non_finite(table: &mut [f64], flags: &[u32]) {
    let n = flags.len();
    for i in 0..n {
        for j in 0..n {
            if flags[i] != 0 || flags[j] != 0 {
                table[i * n + j] = f64::INFINITY;
            }
        }
    }
}

fn grid(items: usize, threads: u32, sms: u32, per_sm: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (plan::blocks(items, threads, sms, per_sm), 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared,
    }
}

fn mixed(rule: &str) -> AggError {
    AggError::Unsupported {
        rule: rule.to_string(),
        what: "host vectors other than f32 (host f64, bf16 and f16 are not staged to the \
               GPU; bf16 and f16 already on the device go through robust_all_reduce_device)"
            .to_string(),
    }
}

impl Aggregator for CudaRule {
    fn name(&self) -> &str {
        self.reference.name()
    }

    fn byzantine(&self) -> usize {
        self.f
    }

    fn parameters(&self) -> String {
        self.reference.parameters()
    }

    fn check(&self, n: usize) -> Result<(), AggError> {
        self.reference.check(n)
    }

    fn structure(&self) -> Structure {
        self.reference.structure()
    }

    fn aggregate(&self, inputs: Inputs<'_>, out: Output<'_>) -> Result<AggReport, AggError> {
        match (inputs, out) {
            (Inputs::F32(x), Output::F32(o)) => {
                check_lengths(x.iter().map(|v| v.len()), o.len())?;
                self.reference.check(x.len())?;
                self.staged(x, o, |rows, out, d| self.run::<f32>(rows, out, d))
            }
            _ => Err(mixed(self.name())),
        }
    }

    fn distance_selection(&self) -> Option<&dyn DistanceSelection> {
        self.reference
            .distance_selection()
            .map(|_| self as &dyn DistanceSelection)
    }
}

/// The Krum family's split for sharded schedules: the CPU selection, the finish on the GPU.
impl DistanceSelection for CudaRule {
    fn select(&self, dist: &[f64], n: usize) -> Result<Vec<usize>, AggError> {
        self.selection()?.select(dist, n)
    }

    fn finish(
        &self,
        inputs: Inputs<'_>,
        selected: &[usize],
        out: Output<'_>,
    ) -> Result<(), AggError> {
        match (inputs, out) {
            (Inputs::F32(x), Output::F32(o)) => {
                let chosen = selected
                    .iter()
                    .map(|&i| {
                        x.get(i).copied().ok_or_else(|| {
                            AggError::InvalidSpec(format!("selected input {i} of {}", x.len()))
                        })
                    })
                    .collect::<Result<Vec<&[f32]>, AggError>>()?;
                check_lengths(chosen.iter().map(|v| v.len()), o.len())?;
                self.staged(&chosen, o, |rows, out, d| {
                    self.finish_rows::<f32>(rows, out, d)
                        .map(|()| AggReport::default())
                })
                .map(|_| ())
            }
            _ => Err(mixed(self.name())),
        }
    }
}

/// Whether `rule` (a name [`CudaRule::new`] takes) has CUDA kernels: median, trimmed-mean,
/// krum, multi-krum, bulyan.
pub fn has_kernels(rule: &str) -> bool {
    Kind::of(rule).is_some()
}

/// Whether [`robust_all_reduce_device`] moves `comm`'s device vectors device to device: its
/// transport is NCCL's own (not a communicator split from one), in a build with NCCL.
pub fn device_to_device(comm: &Communicator) -> bool {
    #[cfg(feature = "nccl")]
    return nccl_transport(comm).is_some();
    #[cfg(not(feature = "nccl"))]
    {
        let _ = comm;
        false
    }
}

/// The communicator's transport when it is NCCL's own (not a split of it).
#[cfg(feature = "nccl")]
fn nccl_transport(comm: &Communicator) -> Option<&byzcoll_transport_nccl::NcclTransport> {
    comm.transport()
        .as_any()
        .and_then(|t| t.downcast_ref::<byzcoll_transport_nccl::NcclTransport>())
}

/// The device collectives as methods of the communicator (`use byzcoll_cuda::DeviceCollectives`):
/// what Rust callers, the C ABI's `byzcoll_robust_allreduce_device` and any other binding call.
pub trait DeviceCollectives {
    /// [`robust_all_reduce_device`] on this communicator.
    ///
    /// # Errors
    /// As [`robust_all_reduce_device`].
    fn robust_all_reduce_device<'a, E: GpuElement>(
        &'a mut self,
        buf: &'a mut CudaSlice<E>,
        rule: &'a CudaRule,
        policy: Policy,
    ) -> impl std::future::Future<Output = byzcoll_runtime::Result<RoundReport>> + 'a;
}

impl DeviceCollectives for Communicator {
    fn robust_all_reduce_device<'a, E: GpuElement>(
        &'a mut self,
        buf: &'a mut CudaSlice<E>,
        rule: &'a CudaRule,
        policy: Policy,
    ) -> impl std::future::Future<Output = byzcoll_runtime::Result<RoundReport>> + 'a {
        robust_all_reduce_device(self, buf, rule, policy)
    }
}

/// `Communicator::robust_all_reduce` for a vector on the device, the one entry point for
/// device vectors whatever the transport: every rank's `buf` becomes `rule` applied to all
/// ranks' vectors, moved according to `policy`, with the communicator's numbering, deadline
/// and [`RoundReport`].
///
/// - Over NCCL (a communicator whose transport is NCCL's), the vectors travel device to device
///   and are aggregated where NCCL left them (`robust_all_reduce_nccl`, in gather and sharded
///   modes, for every [`GpuElement`]), under the communicator's agreement policy: the same
///   round core and cross-check as over host transports. A peer that does not take part
///   aborts the NCCL communicator at the deadline, so the report names no faults.
/// - Over a host transport (TCP, UCX, libfabric), an `f32` vector is copied to the host for the
///   transport, aggregated with `rule` on the GPU, and the result copied back; other element
///   types are refused (they travel over NCCL).
///
/// On error `buf` is unchanged.
///
/// # Errors
/// As `robust_all_reduce`; CUDA copy failures as [`AggError::Backend`];
/// [`Error::Unsupported`] for a communicator split from an NCCL one or a non-`f32` vector over
/// a host transport.
pub async fn robust_all_reduce_device<E: GpuElement>(
    comm: &mut Communicator,
    buf: &mut CudaSlice<E>,
    rule: &CudaRule,
    policy: Policy,
) -> byzcoll_runtime::Result<RoundReport> {
    #[cfg(feature = "nccl")]
    if nccl_transport(comm).is_some() {
        let (agreement, timeout) = (comm.agreement(), comm.config().step_timeout);
        // Numbered in the communicator's sequence like any other call.
        let collective = comm.reserve_collective();
        let nccl = nccl_transport(comm)
            .ok_or_else(|| Error::Unsupported("the NCCL transport went away".into()))?;
        let mut report = crate::nccl::robust_all_reduce_nccl(
            nccl, collective, buf, rule, policy, agreement, timeout,
        )
        .await?;
        report.unauthenticated = !comm.is_authenticated();
        report.identity = comm.identity();
        return Ok(report);
    }
    if comm.transport().name() == "nccl" {
        return Err(Error::Unsupported(
            "device vectors over a communicator split from an NCCL one".into(),
        ));
    }
    let Some(buf) = (buf as &mut dyn std::any::Any).downcast_mut::<CudaSlice<f32>>() else {
        return Err(Error::Unsupported(format!(
            "{:?} device vectors over {}: host transports stage f32 vectors only; others \
             travel over NCCL",
            E::KIND,
            comm.transport().name()
        )));
    };
    let stream = rule.gpu().stream().clone();
    let mut host = stream.clone_dtoh(&*buf).map_err(|e| rule.backend(e))?;
    let report = comm.robust_all_reduce(&mut host, rule, policy).await?;
    stream
        .memcpy_htod(&host, buf)
        .and_then(|()| stream.synchronize())
        .map_err(|e| rule.backend(e))?;
    Ok(report)
}
