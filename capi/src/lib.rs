//! byzcoll's C ABI (`libbyzcoll.so`, `libbyzcoll.a`, `include/byzcoll.h`, generated from this
//! file by cbindgen).
//!
//! Every function returns a [`byzcoll_status_t`] (or a value that cannot fail), checks its
//! pointers, lengths and enum values before use, and never lets a Rust panic cross the
//! boundary (it becomes `BYZCOLL_INTERNAL`). Messages: [`byzcoll_last_error`] for the calling
//! thread's last failure, [`byzcoll_comm_last_error`] for a communicator's.
#![allow(non_camel_case_types)]

mod abi;
mod buffers;
#[cfg(feature = "cuda")]
mod device;
mod health;
mod report;
mod status;

use std::ffi::{c_char, c_int, c_void, CStr};
use std::net::IpAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use byzcoll_rs::aggregators::{self, Params};
use byzcoll_rs::blocking::{BlockingComm, Refused};
use byzcoll_rs::{Admission, Agreement, Communicator, JobConfig, Policy, ReduceOp, Replicas};

pub use abi::BYZCOLL_ABI_VERSION;
use buffers::{with_buffer, Buffer, DType};
pub use health::{
    byzcoll_comm_health, byzcoll_peer_health_t, BYZCOLL_SYMPTOM_DISAGREEING, BYZCOLL_SYMPTOM_LATE,
    BYZCOLL_SYMPTOM_MALFORMED, BYZCOLL_SYMPTOM_MISSING, BYZCOLL_SYMPTOM_NONE,
};
pub use report::{
    byzcoll_report_t, BYZCOLL_FAULT_LATE, BYZCOLL_FAULT_MALFORMED, BYZCOLL_FAULT_MISSING,
    BYZCOLL_FAULT_OUT_OF_STEP, BYZCOLL_IDENTITY_LOCAL, BYZCOLL_IDENTITY_PER_RANK,
    BYZCOLL_IDENTITY_SHARED_SECRET, BYZCOLL_IDENTITY_UNAUTHENTICATED, BYZCOLL_OUTLYING_SCORE,
};
pub use status::byzcoll_status_t;
use status::{byzcoll_status_t::*, Failure};

/// The version of `byzcoll_config_t` this header describes.
pub const BYZCOLL_CONFIG_VERSION: u32 = 1;

/// Element type `float` (IEEE binary32).
pub const BYZCOLL_FLOAT32: i32 = 0;
/// Element type `double` (IEEE binary64).
pub const BYZCOLL_FLOAT64: i32 = 1;
/// Element type IEEE binary16 (`_Float16`, CUDA's `__half`), 2 bytes: order statistics exact,
/// sums and distances taken in double and rounded once.
pub const BYZCOLL_FLOAT16: i32 = 2;
/// Element type bfloat16 (the top half of a `float`), 2 bytes, as `BYZCOLL_FLOAT16` is taken.
pub const BYZCOLL_BFLOAT16: i32 = 3;

/// Gather every rank's vector at every rank and aggregate there.
pub const BYZCOLL_POLICY_GATHER: i32 = 0;
/// Split the vector into shards aggregated by replicated owners.
pub const BYZCOLL_POLICY_SHARDED: i32 = 1;
/// Gather or sharded with 2f + 1 owners, chosen per call from the world size, the vector's
/// bytes and the rule, alike on every rank; the report's `replicas` says which ran (0:
/// gather). Never sharded with fewer than 2f + 1 owners.
pub const BYZCOLL_POLICY_AUTO: i32 = 2;
/// Sharded with one owner per shard, whose owners are audited after they are bound to their
/// results (`PROTOCOL.md`, "Audited sharding"): a lying owner is convicted by every rank and
/// its shard aggregated again within the round (the report's text names convictions). Needs
/// agreement detect, a coordinate-wise rule, and ranks with identity keys (the TCP transport).
pub const BYZCOLL_POLICY_AUDITED: i32 = 3;

/// Agreement as `BYZCOLL_AGREEMENT` says, else detect (the default).
pub const BYZCOLL_AGREEMENT_FROM_ENV: i32 = 0;
/// No cross-check: honest ranks may end a round with different results, silently.
pub const BYZCOLL_AGREEMENT_OFF: i32 = 1;
/// Every round ends with a cross-check of result digests; a rank out of step gets
/// `BYZCOLL_DISAGREEMENT`, the others the names in their report.
pub const BYZCOLL_AGREEMENT_DETECT: i32 = 2;
/// Gather mode only, with n > 3f: the ranks echo the inputs' digests before aggregating, so
/// that honest ranks aggregate the same inputs and return bitwise the same result (then the
/// cross-check of detect). Refused up front (`BYZCOLL_UNSUPPORTED`, `BYZCOLL_INVALID_ARGUMENT`)
/// where it cannot run.
pub const BYZCOLL_AGREEMENT_ENFORCE: i32 = 3;

/// Element-wise sum (`byzcoll_all_reduce`).
pub const BYZCOLL_SUM: i32 = 0;
/// Element-wise minimum.
pub const BYZCOLL_MIN: i32 = 1;
/// Element-wise maximum.
pub const BYZCOLL_MAX: i32 = 2;

/// Settings of a communicator. Initialise with `BYZCOLL_CONFIG_INIT`, then change fields.
/// `size` and `version` must be this header's: a later library that adds fields will accept
/// the sizes of earlier headers and default the fields they lack.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct byzcoll_config_t {
    /// `sizeof(byzcoll_config_t)` as the caller compiled it.
    pub size: usize,
    /// `BYZCOLL_CONFIG_VERSION` as the caller compiled it.
    pub version: u32,
    /// One of `BYZCOLL_AGREEMENT_*`.
    pub agreement: i32,
    /// How long one step of a collective waits for its peers, in milliseconds; 0:
    /// `BYZCOLL_TIMEOUT_MS`, else 30 000.
    pub step_timeout_ms: u64,
    /// `byzcoll_init_oob` only: the IP address to listen on (a C string); NULL:
    /// `BYZCOLL_TCP_ADDR`, else the address this host's name resolves to.
    pub listen_addr: *const c_char,
}

/// The parameters of a robust rule. Initialise with `BYZCOLL_RULE_PARAMS_INIT`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct byzcoll_rule_params_t {
    /// `sizeof(byzcoll_rule_params_t)` as the caller compiled it.
    pub size: usize,
    /// Number of Byzantine ranks to tolerate.
    pub f: u32,
    /// Multi-Krum: how many inputs to average; 0: n - f.
    pub m: u32,
    /// Centered clipping: the clipping radius (> 0); 0: unset.
    pub tau: f64,
    /// One of `BYZCOLL_POLICY_*`.
    pub policy: i32,
    /// Sharded policy: owners per shard; 0: 2f + 1 (at most n).
    pub replicas: u32,
}

/// What `BYZCOLL_RULE_PARAMS_INIT` (cbindgen.toml's `after_includes`) sets, and what a NULL
/// `params` stands for.
const RULE_PARAMS_INIT: byzcoll_rule_params_t = byzcoll_rule_params_t {
    size: size_of::<byzcoll_rule_params_t>(),
    f: 0,
    m: 0,
    tau: 0.0,
    policy: BYZCOLL_POLICY_GATHER,
    replicas: 0,
};

/// A communicator: one rank's membership in a job. Opaque.
#[derive(Debug)]
pub struct byzcoll_comm_t {
    /// The communicator and its runtime (shared with the communicators made from this one,
    /// `byzcoll_comm_shrink`).
    inner: BlockingComm,
    last_error: Mutex<std::ffi::CString>,
    /// The job configuration it joined with (`byzcoll_init_from_env`; shared with the
    /// communicators made from it), which `byzcoll_comm_admit` rejoins through; `None` for an
    /// out-of-band join, which has no store.
    job: Option<Arc<JobConfig>>,
}

/// The caller's all-gather for `byzcoll_init_oob`: gathers `bytes` bytes from every rank of
/// the group into `recvbuf` (`size * bytes` bytes, rank order), like
/// `MPI_Allgather(sendbuf, bytes, MPI_BYTE, recvbuf, bytes, MPI_BYTE, comm)`. Returns 0 on
/// success.
pub type byzcoll_allgather_fn = Option<
    unsafe extern "C" fn(
        sendbuf: *const c_void,
        recvbuf: *mut c_void,
        bytes: usize,
        ctx: *mut c_void,
    ) -> c_int,
>;

/// Runs `body`, turning a failure into its status (and this thread's last error) and a panic
/// into `BYZCOLL_INTERNAL`.
fn guard(body: impl FnOnce() -> Result<(), Failure>) -> byzcoll_status_t {
    let failure = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => return BYZCOLL_OK,
        Ok(Err(failure)) => failure,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Failure::new(BYZCOLL_INTERNAL, format!("internal error (a bug): {what}"))
        }
    };
    status::set_thread_error(&failure.message);
    failure.status
}

/// As [`guard`], for a call on `comm`: the message is also the communicator's last error.
///
/// # Safety
/// `comm` is null or a live communicator.
unsafe fn guard_comm(
    comm: *mut byzcoll_comm_t,
    body: impl FnOnce(&byzcoll_comm_t) -> Result<(), Failure>,
) -> byzcoll_status_t {
    // SAFETY: the caller passes null or a live communicator.
    let Some(comm) = (unsafe { comm.as_ref() }) else {
        return guard(|| Err(Failure::invalid("comm is NULL")));
    };
    let status = guard(|| body(comm));
    if status != BYZCOLL_OK {
        let message = status::thread_error();
        *comm
            .last_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = message;
    }
    status
}

impl byzcoll_comm_t {
    fn new(runtime: Arc<byzcoll_rs::blocking::Runtime>, comm: Communicator) -> Box<Self> {
        Box::new(byzcoll_comm_t {
            inner: BlockingComm::new(runtime, comm),
            last_error: Mutex::default(),
            job: None,
        })
    }

    /// This communicator, joined with `job`.
    fn with_job(mut self: Box<Self>, job: Option<Arc<JobConfig>>) -> Box<Self> {
        self.job = job;
        self
    }

    /// Runs one collective on the communicator, unless it is or gets aborted.
    fn run<T>(
        &self,
        op: impl AsyncFnOnce(&mut Communicator) -> byzcoll_rs::Result<T>,
    ) -> Result<T, Failure> {
        self.inner.run(op).map_err(refused)
    }
}

/// A call the blocking layer refused, as the C ABI reports it.
fn refused(refused: Refused) -> Failure {
    match refused {
        Refused::Failed(e) => Failure::from(e),
        // Only an abort or a panic closes a communicator before it is finalized.
        Refused::Closed | Refused::Aborted => Failure::aborted(),
        Refused::Panicked(_) => Failure::new(BYZCOLL_INTERNAL, format!("{refused}: finalize it")),
    }
}

fn runtime() -> Result<byzcoll_rs::blocking::Runtime, Failure> {
    byzcoll_rs::blocking::Runtime::new()
        .map_err(|e| Failure::new(BYZCOLL_INTERNAL, format!("cannot start threads: {e}")))
}

/// What the caller's config overrides of the environment's settings (nothing for NULL).
#[derive(Debug, Default)]
struct Overrides {
    step_timeout: Option<Duration>,
    agreement: Option<Agreement>,
    listen: Option<IpAddr>,
}

impl Overrides {
    /// `job` with these overrides.
    fn apply(self, mut job: JobConfig) -> Result<JobConfig, Failure> {
        if let Some(t) = self.step_timeout {
            job = job.with_step_timeout(t)?;
        }
        if let Some(a) = self.agreement {
            job = job.with_agreement(a);
        }
        if let Some(ip) = self.listen {
            job = job.with_tcp_listen(ip)?;
        }
        Ok(job)
    }
}

/// The caller's config: what it overrides of the environment's settings.
///
/// # Safety
/// `config` is null or points to a readable `byzcoll_config_t` of the size it declares.
unsafe fn read_config(config: *const byzcoll_config_t) -> Result<Overrides, Failure> {
    if config.is_null() {
        return Ok(Overrides::default());
    }
    // SAFETY: non-null; the caller passes an initialised config.
    let c = unsafe {
        buffers::read_sized(config, "config", "byzcoll_config_t", "BYZCOLL_CONFIG_INIT")?
    };
    if c.version != BYZCOLL_CONFIG_VERSION {
        return Err(Failure::invalid(format!(
            "config->version is {}, this library knows version {BYZCOLL_CONFIG_VERSION}",
            c.version
        )));
    }
    let agreement = match c.agreement {
        BYZCOLL_AGREEMENT_FROM_ENV => None,
        BYZCOLL_AGREEMENT_OFF => Some(Agreement::Off),
        BYZCOLL_AGREEMENT_DETECT => Some(Agreement::Detect),
        BYZCOLL_AGREEMENT_ENFORCE => Some(Agreement::Enforce),
        other => {
            return Err(Failure::invalid(format!(
                "config->agreement is {other}: expected BYZCOLL_AGREEMENT_FROM_ENV, _OFF, \
                 _DETECT or _ENFORCE"
            )))
        }
    };
    let step_timeout = match c.step_timeout_ms {
        0 => None,
        ms => Some(
            byzcoll_rs::step_timeout_ms(ms)
                .map_err(|why| Failure::invalid(format!("config->step_timeout_ms is {why}")))?,
        ),
    };
    let listen = if c.listen_addr.is_null() {
        None
    } else {
        // SAFETY: the caller passes a NUL-terminated string.
        let text = unsafe { CStr::from_ptr(c.listen_addr) }.to_string_lossy();
        Some(text.parse::<IpAddr>().map_err(|_| {
            Failure::invalid(format!("config->listen_addr {text:?} is not an IP address"))
        })?)
    };
    Ok(Overrides {
        step_timeout,
        agreement,
        listen,
    })
}

/// # Safety
/// `out` is a pointer the caller can write a pointer to.
unsafe fn publish(
    out: *mut *mut byzcoll_comm_t,
    make: impl FnOnce() -> Result<Box<byzcoll_comm_t>, Failure>,
) -> byzcoll_status_t {
    if out.is_null() || !(out as usize).is_multiple_of(align_of::<*mut byzcoll_comm_t>()) {
        return guard(|| {
            Err(Failure::invalid(
                "comm (the output pointer) is NULL or misaligned",
            ))
        });
    }
    // SAFETY: non-null; the caller passes a writable pointer.
    unsafe { out.write(ptr::null_mut()) };
    guard(|| {
        let comm = make()?;
        // SAFETY: as above.
        unsafe { out.write(Box::into_raw(comm)) };
        Ok(())
    })
}

/// Joins the job described by the launcher's environment (`byzcoll launch`, srun, mpirun,
/// torchrun, or `BYZCOLL_RANK`/`BYZCOLL_WORLD_SIZE`), as the Rust `byzcoll::init` does:
/// transport from `BYZCOLL_TRANSPORT` (tcp by default), the job secret from `BYZCOLL_SECRET`.
/// `config` may be NULL for the defaults. On success `*comm` is the new communicator; on
/// failure it is NULL and `byzcoll_last_error()` says why.
///
/// Thread safety: may be called from any thread.
///
/// # Safety
/// `config` is NULL or an initialised `byzcoll_config_t`; `comm` is writable.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_init_from_env(
    config: *const byzcoll_config_t,
    comm: *mut *mut byzcoll_comm_t,
) -> byzcoll_status_t {
    // SAFETY: forwarded from the caller.
    unsafe {
        publish(comm, || {
            // `listen_addr` is byzcoll_init_oob's alone (the header says so).
            let overrides = Overrides {
                listen: None,
                ..read_config(config)?
            };
            let job = overrides.apply(JobConfig::from_env()?)?;
            let runtime = runtime()?;
            let c = runtime.block_on(byzcoll_rs::init_with(&job))?;
            Ok(byzcoll_comm_t::new(Arc::new(runtime), c).with_job(Some(Arc::new(job))))
        })
    }
}

/// Joins a `size`-rank job as rank `rank` through the caller's all-gather (for example
/// `MPI_Allgather` over `MPI_COMM_WORLD`), with no store and no `BYZCOLL_SECRET`: rank 0 draws
/// the job secret and the all-gather hands it out, so the caller's channel must be one only the
/// job's processes share. `allgather` is called twice, on this thread, with `ctx`; it must
/// return (not throw or longjmp). Every rank must call this function together. Connects over
/// TCP. Agreement: `config->agreement`, else `BYZCOLL_AGREEMENT`.
///
/// Thread safety: may be called from any thread (the callback runs on it).
///
/// # Safety
/// `allgather` behaves as documented on `byzcoll_allgather_fn`; `config` is NULL or
/// initialised; `comm` is writable.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_init_oob(
    rank: i32,
    size: i32,
    allgather: byzcoll_allgather_fn,
    ctx: *mut c_void,
    config: *const byzcoll_config_t,
    comm: *mut *mut byzcoll_comm_t,
) -> byzcoll_status_t {
    // SAFETY: forwarded from the caller.
    unsafe {
        publish(comm, || {
            let Some(allgather) = allgather else {
                return Err(Failure::invalid("allgather is NULL"));
            };
            let (Ok(rank), Ok(size)) = (usize::try_from(rank), usize::try_from(size)) else {
                return Err(Failure::invalid(format!(
                    "rank {rank} of size {size}: both must be non-negative"
                )));
            };
            let job = read_config(config)?.apply(JobConfig::for_allgather(rank, size)?)?;
            let runtime = runtime()?;
            let mut gather = |record: &[u8]| -> Result<Vec<u8>, String> {
                let mut all = vec![0u8; record.len() * size];
                // SAFETY: both buffers are valid for the lengths the callback is told.
                let rc = allgather(
                    record.as_ptr().cast(),
                    all.as_mut_ptr().cast(),
                    record.len(),
                    ctx,
                );
                if rc == 0 {
                    Ok(all)
                } else {
                    Err(format!("the allgather callback returned {rc}"))
                }
            };
            let c = runtime.init_with_allgather(&job, &mut gather)?;
            Ok(byzcoll_comm_t::new(Arc::new(runtime), c))
        })
    }
}

/// Closes the communicator's connections and frees it, collectively. NULL is ignored. Where a
/// robust call went on without a late rank (stragglers allowed, the default), it first waits,
/// up to the step timeout, for every live rank to reach its close, so that a rank left behind
/// still gets what it needs. Then what the last calls left in flight is delivered (a call can
/// return before its last sends reached a slower peer): over TCP this waits until the peers
/// have read it and closed too, for at most 10 s. Peers still in a collective with this rank
/// then see it as missing.
///
/// Thread safety: no other call on `comm` may be in progress or follow.
///
/// # Safety
/// `comm` is NULL or a communicator not yet finalized.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_comm_finalize(comm: *mut byzcoll_comm_t) -> byzcoll_status_t {
    if comm.is_null() {
        return BYZCOLL_OK;
    }
    guard(|| {
        // SAFETY: the caller hands over a live communicator.
        let comm = unsafe { Box::from_raw(comm) };
        comm.inner.close();
        Ok(())
    })
}

/// Aborts the communicator: a collective in progress on it (on another thread) returns
/// `BYZCOLL_ABORTED`, its connections close (peers see this rank as missing), and every later
/// call on it returns `BYZCOLL_ABORTED`. It must still be finalized.
///
/// Thread safety: may be called from any thread, also while another thread is in a collective
/// on `comm` (it waits for that collective to return `BYZCOLL_ABORTED`). Not async-signal-safe:
/// do not call it from a signal handler.
///
/// # Safety
/// `comm` is NULL or a live communicator.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_comm_abort(comm: *mut byzcoll_comm_t) -> byzcoll_status_t {
    // SAFETY: forwarded.
    unsafe {
        guard_comm(comm, |comm| {
            comm.inner.abort();
            Ok(())
        })
    }
}

/// This process's rank in `comm`, or -1 when `comm` is NULL.
///
/// Thread safety: any thread.
///
/// # Safety
/// `comm` is NULL or a live communicator.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_comm_rank(comm: *const byzcoll_comm_t) -> i32 {
    // SAFETY: null or live.
    unsafe { comm.as_ref() }.map_or(-1, |c| c.inner.rank() as i32)
}

/// The number of ranks in `comm`, or -1 when `comm` is NULL.
///
/// Thread safety: any thread.
///
/// # Safety
/// `comm` is NULL or a live communicator.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_comm_size(comm: *const byzcoll_comm_t) -> i32 {
    // SAFETY: null or live.
    unsafe { comm.as_ref() }.map_or(-1, |c| c.inner.size() as i32)
}

/// The message of the last failed call on `comm` ("" if none, "comm is NULL" for NULL), copied
/// into this thread's storage: the string stays valid until this thread's next byzcoll call
/// that fails or asks for a message.
///
/// Thread safety: any thread; with calls on `comm` from several threads the message may be
/// another thread's call's.
///
/// # Safety
/// `comm` is NULL or a live communicator.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_comm_last_error(comm: *const byzcoll_comm_t) -> *const c_char {
    // SAFETY: null or live.
    match unsafe { comm.as_ref() } {
        None => c"comm is NULL".as_ptr(),
        Some(c) => {
            let message = c
                .last_error
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            status::set_thread_error_c(message);
            status::thread_error_ptr()
        }
    }
}

/// The message of this thread's last failed byzcoll call ("" if none). Valid until this
/// thread's next failing byzcoll call.
///
/// Thread safety: per thread.
#[no_mangle]
pub extern "C" fn byzcoll_last_error() -> *const c_char {
    status::thread_error_ptr()
}

/// A static description of `status` ("unknown status" for values that are not one).
///
/// Thread safety: any thread.
#[no_mangle]
pub extern "C" fn byzcoll_status_string(status: c_int) -> *const c_char {
    status::describe(status).as_ptr()
}

/// The library's version, e.g. "0.1.0".
///
/// Thread safety: any thread.
#[no_mangle]
pub extern "C" fn byzcoll_version() -> *const c_char {
    static VERSION: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(v) => v,
            Err(_) => c"unknown",
        };
    VERSION.as_ptr()
}

/// Robust all-reduce: every rank contributes `count` elements of `dtype` from `sendbuf` and
/// receives in `recvbuf` the aggregate of every rank's vector under `rule` (a name:
/// "median", "trimmed-mean", "krum", "multi-krum", "bulyan", "geometric-median",
/// "centered-clipping", "mean", or "nnm+" and one of these; there is no default) with
/// `params` (NULL: those of `BYZCOLL_RULE_PARAMS_INIT`, f = 0 and the gather policy). In place
/// when `sendbuf == recvbuf`; the buffers must not otherwise overlap. Peers that were missing
/// or malformed are treated as erasures and named in `report` (which may be NULL); the call
/// fails when more than the rule tolerates were at fault. With agreement detection (the
/// default) a rank whose result the job does not share gets `BYZCOLL_DISAGREEMENT` and must not
/// use `recvbuf`.
///
/// Every rank must call with the same rule, parameters, count and dtype, and make the same
/// sequence of collective calls on the communicator. On failure the report (if any) names the
/// peers at fault when the error knows them, and its other outputs are zero.
///
/// Thread safety: call the collectives of one communicator from one thread at a time, in the
/// same order on every rank (concurrent calls are serialized in an unspecified order, which
/// other ranks cannot follow); different communicators may be used from different threads.
/// Not async-signal-safe, like every function here.
///
/// # Safety
/// `sendbuf` and `recvbuf` are valid for `count` elements; `params` is NULL or initialised;
/// `report` is NULL or initialised with `BYZCOLL_REPORT_INIT` and arrays of its `capacity`.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_robust_allreduce(
    comm: *mut byzcoll_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: i32,
    rule: *const c_char,
    params: *const byzcoll_rule_params_t,
    report: *mut byzcoll_report_t,
) -> byzcoll_status_t {
    // SAFETY: forwarded; every pointer is checked before use.
    unsafe {
        guard_comm(comm, |comm| {
            let mut report = report::Out::new(report)?;
            let (rule, policy) = read_rule(rule, params)?;
            let dtype = DType::parse(dtype)?;
            let buf = Buffer::in_place(sendbuf, recvbuf, count, dtype, "sendbuf", "recvbuf")?;
            report.record(with_buffer!(buf, b => {
                comm.run(async |c| c.robust_all_reduce(b, rule.as_ref(), policy).await)
            }))
        })
    }
}

/// Robust all-reduce of device vectors: as `byzcoll_robust_allreduce`, with `sendbuf` and
/// `recvbuf` in CUDA device memory (cudaMalloc, same device) and the rule run by byzcoll's
/// CUDA kernels ("median", "trimmed-mean", "krum", "multi-krum", "bulyan"). Work queued on
/// `stream` (a `cudaStream_t`; NULL: the default stream) is waited for first; the call returns
/// when `recvbuf` holds the result. It runs the communicator's device entry point: over NCCL
/// the vectors go device to device (`BYZCOLL_FLOAT32`, `_BFLOAT16`, `_FLOAT16`); over a host
/// transport a `BYZCOLL_FLOAT32` vector crosses the network from host memory (other types:
/// `BYZCOLL_UNSUPPORTED`). Without the `cuda` build feature, a CUDA driver or a device:
/// `BYZCOLL_UNSUPPORTED`.
///
/// Thread safety: as `byzcoll_robust_allreduce`.
///
/// # Safety
/// As `byzcoll_robust_allreduce`, for device memory; `stream` is NULL or a live stream of the
/// buffers' device.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn byzcoll_robust_allreduce_device(
    comm: *mut byzcoll_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: i32,
    rule: *const c_char,
    params: *const byzcoll_rule_params_t,
    stream: *mut c_void,
    report: *mut byzcoll_report_t,
) -> byzcoll_status_t {
    // SAFETY: forwarded; every pointer is checked before use.
    unsafe {
        guard_comm(comm, |comm| {
            #[cfg(feature = "cuda")]
            return device::robust_allreduce(
                comm, sendbuf, recvbuf, count, dtype, rule, params, stream, report,
            );
            #[cfg(not(feature = "cuda"))]
            {
                let _ = (
                    comm, sendbuf, recvbuf, count, dtype, rule, params, stream, report,
                );
                Err(Failure::new(
                    BYZCOLL_UNSUPPORTED,
                    "device vectors need libbyzcoll built with the cuda feature \
                     (scripts/install-capi.sh PREFIX cuda)",
                ))
            }
        })
    }
}

/// Non-robust all-reduce (`BYZCOLL_SUM`, `_MIN`, `_MAX`), the baseline MPI and NCCL offer: one
/// faulty rank corrupts every result. In place when `sendbuf == recvbuf`.
///
/// Thread safety: as `byzcoll_robust_allreduce`.
///
/// # Safety
/// `sendbuf` and `recvbuf` are valid for `count` elements.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_all_reduce(
    comm: *mut byzcoll_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: i32,
    op: i32,
) -> byzcoll_status_t {
    // SAFETY: forwarded; every pointer is checked before use.
    unsafe {
        guard_comm(comm, |comm| {
            let op = match op {
                BYZCOLL_SUM => ReduceOp::Sum,
                BYZCOLL_MIN => ReduceOp::Min,
                BYZCOLL_MAX => ReduceOp::Max,
                other => {
                    return Err(Failure::invalid(format!(
                        "op is {other}: expected BYZCOLL_SUM, _MIN or _MAX"
                    )))
                }
            };
            let dtype = DType::parse(dtype)?;
            let buf = Buffer::in_place(sendbuf, recvbuf, count, dtype, "sendbuf", "recvbuf")?;
            with_buffer!(buf, b => comm.run(async |c| c.all_reduce(b, op).await))
        })
    }
}

/// All-gather: `recvbuf` (`size * count` elements) receives every rank's `count` elements of
/// `sendbuf`, in rank order. The buffers must not overlap.
///
/// Thread safety: as `byzcoll_robust_allreduce`.
///
/// # Safety
/// `sendbuf` is valid for `count` elements, `recvbuf` for `size * count`.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_all_gather(
    comm: *mut byzcoll_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: i32,
) -> byzcoll_status_t {
    // SAFETY: forwarded; every pointer is checked before use.
    unsafe {
        guard_comm(comm, |comm| {
            let dtype = DType::parse(dtype)?;
            let total = count.checked_mul(comm.inner.size()).ok_or_else(|| {
                Failure::invalid(format!(
                    "count {count} x {} ranks overflows",
                    comm.inner.size()
                ))
            })?;
            let send_len = buffers::check(sendbuf, count, dtype, "sendbuf")?;
            let recv_len = buffers::check(recvbuf, total, dtype, "recvbuf")?;
            buffers::check_disjoint(sendbuf, send_len, recvbuf, recv_len)?;
            let send = buffers::bytes(sendbuf, count, dtype, "sendbuf")?;
            let recv = buffers::bytes_mut(recvbuf, total, dtype, "recvbuf")?;
            comm.run(async |c| c.all_gather_into(send, recv).await)
        })
    }
}

/// Blocks until every rank of `comm` has entered the barrier (or the step deadline passes:
/// `BYZCOLL_TIMEOUT`).
///
/// Thread safety: as `byzcoll_robust_allreduce`.
///
/// # Safety
/// `comm` is NULL or a live communicator.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_barrier(comm: *mut byzcoll_comm_t) -> byzcoll_status_t {
    // SAFETY: forwarded.
    unsafe { guard_comm(comm, |comm| comm.run(async |c| c.barrier().await)) }
}

/// Shrinks `comm` to the ranks that are alive, like `MPI_Comm_shrink`: every live rank calls
/// it. The live ranks agree, tolerating `f = (size - 1) / 3` Byzantine ranks, on the ranks to
/// keep; on success `*newcomm` is a communicator of them, renumbered in their old order, over
/// the same connections (finalize it as any other, before or after `comm`). A rank the others
/// did not keep gets `BYZCOLL_EXCLUDED` and `*newcomm` is NULL. `comm` stays usable.
///
/// Thread safety: as `byzcoll_robust_allreduce`.
///
/// # Safety
/// `comm` is NULL or a live communicator; `newcomm` is writable.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_comm_shrink(
    comm: *mut byzcoll_comm_t,
    newcomm: *mut *mut byzcoll_comm_t,
) -> byzcoll_status_t {
    // SAFETY: forwarded from the caller.
    unsafe {
        publish(newcomm, || {
            // SAFETY: the caller passes NULL or a live communicator.
            let Some(parent) = comm.as_ref() else {
                return Err(Failure::invalid("comm is NULL"));
            };
            let sub = parent.run(async |c| c.shrink().await)?;
            Ok(byzcoll_comm_t::new(parent.inner.runtime().clone(), sub)
                .with_job(parent.job.clone()))
        })
    }
}

/// Admits the restarted ranks that knocked: a process started with `BYZCOLL_REJOIN=1`
/// (`byzcoll launch --restarts N` starts a failed rank again that way), whose
/// `byzcoll_init_from_env` knocks in the job's store and waits. Every member of `comm` calls
/// this at the same point of its calls, a boundary of the application's choice; the members
/// agree, tolerating `f = (size - 1) / 3` Byzantine members, on whom to admit. On success
/// `*newcomm` is NULL when nobody knocked, else a communicator of the members and the admitted
/// ranks in job-rank order (`byzcoll_comm_job_rank`) at the next epoch (`byzcoll_comm_epoch`),
/// over new connections (finalize it as any other). `comm` stays usable. The admitted rank's
/// state is the application's to hand over (a broadcast from a member, say).
///
/// Thread safety: as `byzcoll_robust_allreduce`.
///
/// # Safety
/// `comm` is NULL or a live communicator; `newcomm` is writable.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_comm_admit(
    comm: *mut byzcoll_comm_t,
    newcomm: *mut *mut byzcoll_comm_t,
) -> byzcoll_status_t {
    if newcomm.is_null() || !(newcomm as usize).is_multiple_of(align_of::<*mut byzcoll_comm_t>()) {
        return guard(|| Err(Failure::invalid("newcomm is NULL or misaligned")));
    }
    // SAFETY: non-null and aligned; the caller passes a writable pointer.
    unsafe { newcomm.write(ptr::null_mut()) };
    // SAFETY: the caller passes NULL or a live communicator.
    unsafe {
        guard_comm(comm, |parent| {
            let Some(job) = parent.job.clone() else {
                return Err(Failure::invalid(
                    "comm was not joined through the job's store (byzcoll_init_from_env): \
                     nothing to admit through",
                ));
            };
            let admission = parent.run(async |c| byzcoll_rs::admit(c, &job).await)?;
            if let Admission::Admitted { comm: grown, .. } = admission {
                let grown =
                    byzcoll_comm_t::new(parent.inner.runtime().clone(), *grown).with_job(Some(job));
                // SAFETY: as above.
                newcomm.write(Box::into_raw(grown));
            }
            Ok(())
        })
    }
}

/// The job rank of `comm`'s rank `rank` (0 to size - 1): the rank it was launched as, which
/// shrinks and admits keep; -1 when `comm` is NULL or `rank` is out of range.
///
/// Thread safety: any thread.
///
/// # Safety
/// `comm` is NULL or a live communicator.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_comm_job_rank(comm: *const byzcoll_comm_t, rank: i32) -> i32 {
    // SAFETY: null or live.
    let Some(c) = (unsafe { comm.as_ref() }) else {
        return -1;
    };
    let Ok(rank) = usize::try_from(rank) else {
        return -1;
    };
    c.inner
        .with_comm(|c| c.job_ranks().get(rank).map_or(-1, |&r| r as i32))
        .unwrap_or(-1)
}

/// The job's membership epoch in `comm`: 0 at the start, one more for each admit that
/// admitted a rank; -1 when `comm` is NULL.
///
/// Thread safety: any thread.
///
/// # Safety
/// `comm` is NULL or a live communicator.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_comm_epoch(comm: *const byzcoll_comm_t) -> i64 {
    // SAFETY: null or live.
    let Some(c) = (unsafe { comm.as_ref() }) else {
        return -1;
    };
    c.inner
        .with_comm(|c| i64::try_from(c.epoch()).unwrap_or(i64::MAX))
        .unwrap_or(-1)
}

/// `byzcoll_comm_set_step`'s value for "no step id".
pub const BYZCOLL_NO_STEP: u64 = u64::MAX;

/// Sets the step id every later collective call on `comm` carries in its fingerprint, until
/// it is set again (`BYZCOLL_NO_STEP`: none), e.g. the training step.
///
/// Every collective call carries a fingerprint of what the caller asked for (operation,
/// lengths, type, rule and parameters, policy) and of this step id. A rank whose call does not
/// match is a `BYZCOLL_FAULT_OUT_OF_STEP` fault at the ranks that receive from it, never a
/// message of another call taken as this one's (robust calls leave it out and name it; other
/// collectives fail). Without a step id, a rank that skips a call and makes the next one with
/// identical arguments is matched by count: its inputs go to the others' previous call. With a
/// step id that differs per call (or per training step), that is an out-of-step fault too.
///
/// Thread safety: as `byzcoll_robust_allreduce`.
///
/// # Safety
/// `comm` is NULL or a live communicator.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_comm_set_step(
    comm: *mut byzcoll_comm_t,
    step: u64,
) -> byzcoll_status_t {
    let step = (step != BYZCOLL_NO_STEP).then_some(step);
    // SAFETY: forwarded.
    unsafe {
        guard_comm(comm, |comm| {
            comm.run(async |c| {
                c.set_step(step);
                Ok(())
            })
        })
    }
}

/// The rule named `name` with `params`, and the policy.
///
/// # Safety
/// `name` is NULL or a C string; `params` is NULL or initialised.
unsafe fn read_rule(
    name: *const c_char,
    params: *const byzcoll_rule_params_t,
) -> Result<(Box<dyn aggregators::Aggregator>, Policy), Failure> {
    // SAFETY: forwarded.
    let (name, spec, policy) = unsafe { read_rule_spec(name, params)? };
    let rule = aggregators::build(&name, &spec)
        .map_err(|e| Failure::invalid(format!("rule {name:?}: {e}")))?;
    Ok((rule, policy))
}

/// The rule's name, parameters and policy, checked.
///
/// # Safety
/// As [`read_rule`].
unsafe fn read_rule_spec(
    name: *const c_char,
    params: *const byzcoll_rule_params_t,
) -> Result<(String, Params, Policy), Failure> {
    if name.is_null() {
        return Err(Failure::invalid(
            "rule is NULL: name one (\"median\", \"trimmed-mean\", \"krum\", ...); there is no default",
        ));
    }
    // SAFETY: the caller passes a NUL-terminated string.
    let name = unsafe { CStr::from_ptr(name) }
        .to_str()
        .map_err(|_| Failure::invalid("rule is not UTF-8"))?;
    let p = if params.is_null() {
        RULE_PARAMS_INIT
    } else {
        // SAFETY: non-null; the caller passes initialised params.
        unsafe {
            buffers::read_sized(
                params,
                "params",
                "byzcoll_rule_params_t",
                "BYZCOLL_RULE_PARAMS_INIT",
            )?
        }
    };
    let tau = if p.tau == 0.0 {
        None
    } else if p.tau.is_finite() && p.tau > 0.0 {
        Some(p.tau)
    } else {
        return Err(Failure::invalid(format!(
            "params->tau is {}: a positive finite radius, or 0 for unset",
            p.tau
        )));
    };
    let spec = Params {
        f: p.f as usize,
        m: (p.m > 0).then_some(p.m as usize),
        tau,
    };
    let policy = match (p.policy, p.replicas) {
        (BYZCOLL_POLICY_GATHER, 0) => Policy::Gather,
        (BYZCOLL_POLICY_GATHER, r) => {
            return Err(Failure::invalid(format!(
                "params->replicas is {r} with the gather policy: replicas are for BYZCOLL_POLICY_SHARDED"
            )))
        }
        (BYZCOLL_POLICY_SHARDED, 0) => Policy::Sharded(Replicas::Tolerant),
        (BYZCOLL_POLICY_SHARDED, r) => Policy::Sharded(Replicas::Exactly(r as usize)),
        (BYZCOLL_POLICY_AUTO, 0) => Policy::Auto,
        (BYZCOLL_POLICY_AUDITED, 0) => Policy::Audited(byzcoll_rs::audit::Audit::default()),
        (BYZCOLL_POLICY_AUTO, r) => {
            return Err(Failure::invalid(format!(
                "params->replicas is {r} with the auto policy: replicas are for BYZCOLL_POLICY_SHARDED"
            )))
        }
        (BYZCOLL_POLICY_AUDITED, r) => {
            return Err(Failure::invalid(format!(
                "params->replicas is {r} with the audited policy: one owner per shard, audited"
            )))
        }
        (other, _) => {
            return Err(Failure::invalid(format!(
                "params->policy is {other}: expected BYZCOLL_POLICY_GATHER, _SHARDED, _AUTO or \
                 _AUDITED"
            )))
        }
    };
    Ok((name.to_string(), spec, policy))
}
