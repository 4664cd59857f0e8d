//! The `byzcoll._byzcoll` extension module: a communicator over the Rust runtime, robust
//! all-reduce in place on the caller's array (zero copy, the GIL released while the ranks
//! talk), reports, and an exception hierarchy mirroring `byzcoll::Error`. The Python package
//! (`pysrc/byzcoll`) wraps it: torch tensors, mpi4py bootstrap, type stubs.

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};

use byzcoll::aggregators::{self, Aggregator, Params};
use byzcoll::blocking::{BlockingComm, BoxFuture as CallFuture, Refused};
use byzcoll::{
    Admission, Communicator, Fault, JobConfig, Policy, ReduceOp, Replicas, RoundReport, Stragglers,
    Symptom,
};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

create_exception!(
    _byzcoll,
    Error,
    PyException,
    "Base class of byzcoll's errors."
);
create_exception!(
    _byzcoll,
    InvalidUsage,
    Error,
    "The call broke a contract (array, rule, parameters): fix the calling code."
);
create_exception!(
    _byzcoll,
    PreconditionError,
    Error,
    "The rule's precondition does not hold for this world (e.g. median needs n > 2f)."
);
create_exception!(
    _byzcoll,
    TooManyFaults,
    Error,
    "More peers were at fault this round than the rule tolerates; `faults` names them."
);
create_exception!(
    _byzcoll,
    DisagreementError,
    Error,
    "This rank's result is not the one the job holds (agreement detection): do not use it."
);
create_exception!(
    _byzcoll,
    ExcludedError,
    Error,
    "The other ranks shrank the communicator without this rank; `kept` lists the ranks kept."
);
create_exception!(
    _byzcoll,
    FellBehindError,
    Error,
    "This rank fell behind its peers, which went on without it: the call has no result here; \
     `skipped_by` lists them (not at fault). Later calls take part as usual."
);
create_exception!(
    _byzcoll,
    TransportError,
    Error,
    "The transport failed, or a peer failed a non-robust collective."
);
create_exception!(
    _byzcoll,
    BootstrapError,
    Error,
    "Joining the job failed: launcher environment, secret, rendezvous or authentication."
);
create_exception!(
    _byzcoll,
    UnsupportedError,
    Error,
    "Not available in this build or with this transport; the message says how to get it."
);

fn faults_list(faults: &[byzcoll::PeerFault]) -> Vec<(usize, String, String)> {
    faults
        .iter()
        .map(|f| match &f.fault {
            Fault::Missing => (f.rank, "missing".to_string(), f.to_string()),
            Fault::Late => (f.rank, "late".to_string(), f.to_string()),
            Fault::Malformed(_) => (f.rank, "malformed".to_string(), f.to_string()),
            Fault::OutOfStep => (f.rank, "out-of-step".to_string(), f.to_string()),
        })
        .collect()
}

/// A Rust error as the matching Python exception, with its structured fields as attributes.
fn to_py(py: Python<'_>, e: byzcoll::Error) -> PyErr {
    use byzcoll::Error as E;
    use byzcoll::ErrorKind as K;
    let message = e.to_string();
    // One table for every binding (`Error::kind`); a timeout is a transport error here, a
    // missing secret a bootstrap error, a failed device the base class.
    let err = match e.kind() {
        K::InvalidUsage => InvalidUsage::new_err(message),
        K::Precondition => PreconditionError::new_err(message),
        K::TooManyFaults => TooManyFaults::new_err(message),
        K::Disagreement => DisagreementError::new_err(message),
        K::Excluded => ExcludedError::new_err(message),
        K::FellBehind => FellBehindError::new_err(message),
        K::Timeout | K::Transport => TransportError::new_err(message),
        K::Unauthenticated | K::Bootstrap => BootstrapError::new_err(message),
        K::Unsupported => UnsupportedError::new_err(message),
        _ => Error::new_err(message),
    };
    let faults = e.faults().to_vec();
    let value = err.value(py);
    if let E::Excluded { kept } = &e {
        let _ = value.setattr("kept", kept.clone());
    }
    if let E::FellBehind { skipped_by, .. } = &e {
        let _ = value.setattr("skipped_by", skipped_by.clone());
    }
    let _ = value.setattr("faults", faults_list(&faults));
    if let E::Disagreement {
        agreeing,
        disagreeing,
        unconfirmed,
        differing_inputs,
    } = &e
    {
        let _ = value.setattr("agreeing", agreeing.clone());
        let _ = value.setattr("disagreeing", disagreeing.clone());
        let _ = value.setattr("unconfirmed", unconfirmed.clone());
        let _ = value.setattr("differing_inputs", differing_inputs.clone());
    }
    err
}

/// What happened in one robust round.
#[pyclass(frozen, module = "byzcoll", name = "Report")]
struct Report {
    /// Vectors that entered this rank's aggregation (its own included).
    #[pyo3(get)]
    inputs: usize,
    /// Peers treated as erasures: `(rank, "missing" | "malformed" | "late" | "out-of-step",
    /// reason)`.
    #[pyo3(get)]
    faults: Vec<(usize, String, String)>,
    /// Ranks whose vector held NaN or infinities.
    #[pyo3(get)]
    non_finite: Vec<usize>,
    /// Selection rules: the ranks whose vectors were selected.
    #[pyo3(get)]
    selected: Option<Vec<usize>>,
    /// Owners per shard (None for the gather policy).
    #[pyo3(get)]
    replicas: Option<usize>,
    /// The job runs without authentication.
    #[pyo3(get)]
    unauthenticated: bool,
    /// How the ranks proved who they are: "per-rank" (a key each, bound by a roster: a rank
    /// can claim only its own), "shared-secret" (a process holding the job secret could claim
    /// another rank), "unauthenticated", or "local" (no peers to authenticate).
    #[pyo3(get)]
    identity: &'static str,
    /// This rank's own input (gather), or its own result for an owned shard (sharded), is not
    /// in the result: it did not reach the other ranks in time (under agreement "enforce"
    /// they agreed so; under "detect" their cross-checks said so), and this rank left it out
    /// as they did.
    #[pyo3(get)]
    erased_self: bool,
    /// Ranks that dropped some of this round's messages to this rank because it fell behind
    /// them: their erasures in `faults` are this rank's lateness, not theirs.
    #[pyo3(get)]
    skipped_by: Vec<usize>,
    /// The inputs the round could go without for their lateness alone (0: every input was
    /// waited for until the deadline); see `Communicator.set_stragglers`.
    #[pyo3(get)]
    stragglers: usize,
    /// The agreement cross-check's findings (None when agreement is off): a dict of rank lists
    /// `disagreeing`, `unconfirmed`, `differing_inputs`, `differing_versions`, `realigned`
    /// (inputs this rank held but left out to take the result the others hold), `recovered`
    /// (inputs late here that others passed on).
    agreement: Option<[Vec<usize>; 6]>,
    /// Peak bytes the collective held at once.
    #[pyo3(get)]
    peak_bytes: usize,
    /// Payload bytes this rank sent in the round (each destination counted).
    #[pyo3(get)]
    bytes_sent: u64,
    /// Payload bytes this rank received in the round.
    #[pyo3(get)]
    bytes_received: u64,
    /// Each step's time in microseconds, in order (the cross-check last).
    #[pyo3(get)]
    step_times_us: Vec<u64>,
    /// Per rank, in rank order (see `attribution`).
    attribution: Option<Vec<byzcoll::InputEvidence>>,
    /// The ranks whose score exceeds `OUTLYING_SCORE`.
    #[pyo3(get)]
    outlying: Vec<usize>,
    /// What the audits of an audited round found (see `audit`).
    audit: Option<byzcoll::audit::AuditReport>,
    /// Bytes copied between CUDA tensors and pinned host memory for this call, both ways
    /// (see `staged_bytes`); noted by the Python layer that staged them.
    staged: AtomicU64,
}

#[pymethods]
impl Report {
    #[getter]
    fn agreement<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(a) = &self.agreement else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        for (k, v) in [
            "disagreeing",
            "unconfirmed",
            "differing_inputs",
            "differing_versions",
            "realigned",
            "recovered",
        ]
        .iter()
        .zip(a)
        {
            d.set_item(k, v.clone())?;
        }
        Ok(Some(d))
    }

    /// How far each rank's input lay from the aggregate, in rank order (None where the round
    /// was not measured): a list of dicts with `rank`, `coordinates` (how many were measured:
    /// 0 for an erased input), `deviation` (root mean square deviation from the aggregate),
    /// `score` (deviation in median deviations: about 1 typical, above `OUTLYING_SCORE`
    /// outlying), `extreme` (the share of coordinates where its value was among the `f` lowest
    /// or highest) and `selected` (selection rules: whether it was chosen). Evidence for an
    /// operator, never acted on by byzcoll.
    #[getter]
    fn attribution<'py>(&self, py: Python<'py>) -> PyResult<Option<Vec<Bound<'py, PyDict>>>> {
        let Some(ranks) = &self.attribution else {
            return Ok(None);
        };
        ranks
            .iter()
            .map(|e| {
                let d = PyDict::new(py);
                d.set_item("rank", e.rank)?;
                d.set_item("coordinates", e.coordinates)?;
                d.set_item("deviation", e.deviation)?;
                d.set_item("score", e.score)?;
                d.set_item("extreme", e.extreme)?;
                d.set_item("selected", e.selected)?;
                Ok(d)
            })
            .collect::<PyResult<_>>()
            .map(Some)
    }

    /// What the audits found in a round of policy "audited" (None in any other round): a
    /// dict of `audited` (a list of `(owner, [sub-chunks])` this rank replayed), `convicted`
    /// (dicts of `owner`, `shard`, `sub`, `proof` (what its signed claim proves) and `element`
    /// (where its result differs, or None): owners proven to have lied, by a proof every honest
    /// rank checks alike), `recomputed` (shards aggregated again from every
    /// rank's piece because their owner was convicted), `refused` (owners that did not let
    /// this rank replay) and `false_accusers` (`(rank, why)`: accusations that did not stand).
    #[getter]
    fn audit<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(a) = &self.audit else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("audited", a.audited.clone())?;
        let convicted = a
            .convicted
            .iter()
            .map(|l| {
                let c = PyDict::new(py);
                c.set_item("owner", l.owner)?;
                c.set_item("shard", l.shard)?;
                c.set_item("sub", l.sub)?;
                let element = match l.proof {
                    byzcoll::audit::Proof::Differs { element } => Some(element),
                    _ => None,
                };
                c.set_item("element", element)?;
                c.set_item("proof", l.proof.to_string())?;
                Ok(c)
            })
            .collect::<PyResult<Vec<_>>>()?;
        d.set_item("convicted", convicted)?;
        d.set_item("recomputed", a.recomputed.clone())?;
        d.set_item("refused", a.refused.clone())?;
        d.set_item("false_accusers", a.false_accusers.clone())?;
        Ok(Some(d))
    }

    /// Bytes this call copied between CUDA tensors and pinned host memory, both ways added (a
    /// CUDA tensor is staged through the host: `2 * x.nbytes` for `robust_all_reduce`); 0 for
    /// host memory.
    #[getter]
    fn staged_bytes(&self) -> u64 {
        self.staged.load(Ordering::Relaxed)
    }

    /// Adds `bytes` to `staged_bytes` (the Python layer's staging; not for applications).
    fn _note_staged(&self, bytes: u64) {
        self.staged.fetch_add(bytes, Ordering::Relaxed);
    }

    fn __repr__(&self) -> String {
        format!(
            "Report(inputs={}, faults={:?}, non_finite={:?}, selected={:?}, replicas={:?}, \
             unauthenticated={}, identity={:?}, agreement={:?}, outlying={:?})",
            self.inputs,
            self.faults,
            self.non_finite,
            self.selected,
            self.replicas,
            self.unauthenticated,
            self.identity,
            self.agreement,
            self.outlying
        )
    }
}

impl From<RoundReport> for Report {
    fn from(r: RoundReport) -> Self {
        let outlying = r
            .attribution
            .as_ref()
            .map_or_else(Vec::new, |a| a.outlying());
        let attribution = r.attribution.map(|a| a.ranks);
        Report {
            attribution,
            outlying,
            staged: AtomicU64::new(0),
            audit: r.audit,
            inputs: r.inputs,
            faults: faults_list(&r.faults),
            non_finite: r.non_finite,
            selected: r.selected,
            replicas: r.replicas,
            unauthenticated: r.unauthenticated,
            identity: r.identity.name(),
            erased_self: r.erased_self,
            skipped_by: r.skipped_by,
            stragglers: r.stragglers,
            agreement: r.agreement.map(|a| {
                [
                    a.disagreeing,
                    a.unconfirmed,
                    a.differing_inputs,
                    a.differing_versions,
                    a.realigned,
                    a.recovered,
                ]
            }),
            peak_bytes: r.peak_bytes,
            bytes_sent: r.stats.bytes_sent,
            bytes_received: r.stats.bytes_received,
            step_times_us: r
                .stats
                .step_times
                .iter()
                .map(|t| u64::try_from(t.as_micros()).unwrap_or(u64::MAX))
                .collect(),
        }
    }
}

/// A C-contiguous float32, float64, float16 or bfloat16 array, found through
/// `__array_interface__`.
#[derive(Clone, Copy)]
struct Array {
    /// The data's address and its length in elements.
    ptr: usize,
    len: usize,
    dtype: Dtype,
}

/// The element types the module takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Dtype {
    F32,
    F64,
    F16,
    BF16,
}

impl Dtype {
    fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F64 => 8,
            Dtype::F16 | Dtype::BF16 => 2,
        }
    }
}

impl Array {
    /// The bytes the array spans, as an address range.
    fn span(&self) -> std::ops::Range<usize> {
        self.ptr..self.ptr + self.len * self.dtype.size()
    }
}

/// `$body` with `$T` the Rust element type of `$dtype` (a [`Dtype`]).
macro_rules! with_element {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            Dtype::F32 => {
                type $T = f32;
                $body
            }
            Dtype::F64 => {
                type $T = f64;
                $body
            }
            Dtype::F16 => {
                type $T = half::f16;
                $body
            }
            Dtype::BF16 => {
                type $T = half::bf16;
                $body
            }
        }
    };
}

/// `x`'s data as an [`Array`]; `writable`: the result is written into it.
fn array(x: &Bound<'_, PyAny>, writable: bool) -> PyResult<Array> {
    let iface = x.getattr("__array_interface__").map_err(|_| {
        PyTypeError::new_err(
            "expected a numpy array or a torch CPU tensor (something with __array_interface__)",
        )
    })?;
    let get = |k: &str| iface.get_item(k);
    let data: (usize, bool) = get("data")?.extract()?;
    let shape: Vec<usize> = get("shape")?.extract()?;
    let typestr: String = get("typestr")?.extract()?;
    if data.1 && writable {
        return Err(InvalidUsage::new_err(
            "the array is read-only: the result is written into it",
        ));
    }
    if iface.contains("mask")? && !get("mask")?.is_none() {
        return Err(InvalidUsage::new_err("masked arrays are not supported"));
    }
    let len = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| InvalidUsage::new_err("the array's shape overflows"))?;
    // `bfloat16` is what `byzcoll._array` says of a torch bfloat16 tensor's 16-bit words
    // (numpy has no bfloat16; no numpy array says it).
    let dtype = match typestr.as_str() {
        "<f4" | "=f4" => Dtype::F32,
        "<f8" | "=f8" => Dtype::F64,
        "<f2" | "=f2" => Dtype::F16,
        "bfloat16" => Dtype::BF16,
        other => {
            return Err(InvalidUsage::new_err(format!(
                "dtype {other}: byzcoll takes float32, float64, float16 or bfloat16"
            )))
        }
    };
    let item = dtype.size();
    if let Ok(strides) = get("strides") {
        if !strides.is_none() {
            let strides: Vec<isize> = strides.extract()?;
            let mut expect = item as isize;
            for (s, d) in strides.iter().zip(&shape).rev() {
                if *d > 1 && *s != expect {
                    return Err(InvalidUsage::new_err(
                        "the array is not C-contiguous: pass numpy.ascontiguousarray(x) and copy \
                         the result back",
                    ));
                }
                expect *= *d as isize;
            }
        }
    }
    if len > 0 && (data.0 == 0 || data.0 % item != 0) {
        return Err(InvalidUsage::new_err(
            "the array's data pointer is unusable",
        ));
    }
    Ok(Array {
        ptr: data.0,
        len,
        dtype,
    })
}

/// One rank's membership in a job. Create with `byzcoll.init()` or `byzcoll.init_mpi4py()`.
#[pyclass(module = "byzcoll", name = "Communicator")]
struct PyCommunicator {
    /// The communicator and its runtime (shared with the communicators made from this one,
    /// `shrink`); dropped by `Drop` alone.
    inner: ManuallyDrop<BlockingComm>,
    /// The job configuration it joined with (`init`; kept by the communicators made from it),
    /// which `admit` admits through; `None` for an all-gather join, which has no store.
    job: Option<std::sync::Arc<JobConfig>>,
    /// Whether its device vectors go device to device (its transport is NCCL's own), found
    /// once when it was made: asking the communicator would wait for the calls made before.
    device_to_device: bool,
}

impl Drop for PyCommunicator {
    /// Drops the communicator, and the runtime with the last one, with the GIL released:
    /// dropping a runtime waits for its blocking threads, and a started call's callback runs
    /// on one of them and takes the GIL (it completes a torch future, say). Dropped with the
    /// GIL held, the last communicator of a process group deadlocked with the callback of its
    /// last `allreduce` (`test_torchft_contract_...`, about one run in four).
    fn drop(&mut self) {
        // SAFETY: `inner` is taken once, here, and never used again.
        let inner = unsafe { ManuallyDrop::take(&mut self.inner) };
        Python::attach(|py| py.detach(move || drop(inner)));
    }
}

impl PyCommunicator {
    fn new(runtime: std::sync::Arc<byzcoll::blocking::Runtime>, comm: Communicator) -> Self {
        PyCommunicator {
            device_to_device: byzcoll::cuda::device_to_device(&comm),
            inner: ManuallyDrop::new(BlockingComm::new(runtime, comm)),
            job: None,
        }
    }

    /// This communicator, joined with `job`.
    fn with_job(mut self, job: Option<std::sync::Arc<JobConfig>>) -> Self {
        self.job = job;
        self
    }

    /// Runs a collective with the GIL released, on the calling thread, which drives the
    /// transport's tasks meanwhile (`BlockingComm::run`; as a spawned task, `run_task`, a
    /// call from Python took 12-48 us more in a noisy probe). `op` gets the communicator and
    /// gives it back.
    fn run<T, F>(&self, py: Python<'_>, op: F) -> PyResult<T>
    where
        T: Send + 'static,
        F: for<'a> FnOnce(&'a mut Communicator) -> CallFuture<'a, byzcoll::Result<T>>
            + Send
            + 'static,
    {
        py.detach(|| self.inner.run(async move |c| op(c).await))
            .map_err(|refused| refused_to_py(py, refused))
    }

    /// `op` on the communicator, here and now (no collective).
    fn with_comm<T>(&self, op: impl FnOnce(&mut Communicator) -> T) -> PyResult<T> {
        self.inner
            .with_comm(op)
            .map_err(|refused| Python::attach(|py| refused_to_py(py, refused)))
    }
}

/// A device vector's element type by its Python name.
fn device_type(name: &str) -> PyResult<byzcoll::blocking::device::DeviceType> {
    use byzcoll::blocking::device::DeviceType;
    match name {
        "float32" => Ok(DeviceType::F32),
        "bfloat16" => Ok(DeviceType::BF16),
        "float16" => Ok(DeviceType::F16),
        other => Err(InvalidUsage::new_err(format!(
            "device vectors of {other}: the CUDA rules take float32, bfloat16 or float16"
        ))),
    }
}

/// What a started call does with its outcome: calls `done(report, None)` or
/// `done(None, exception)` on a thread of byzcoll's, under the interpreter's lock, then
/// releases `kept` (the caller's array, kept alive for the call) there. (`done` itself, which
/// may hold the caller's tensor, is released after the lock; pyo3 defers that release to the
/// next time a thread holds it.)
fn call_back(
    done: Py<PyAny>,
    kept: Option<Py<PyAny>>,
) -> impl FnOnce(Result<RoundReport, Refused>) + Send + 'static {
    move |result| {
        Python::attach(|py| {
            let args = match result.map(|report| Py::new(py, Report::from(report))) {
                Ok(Ok(report)) => (report.into_any(), py.None()),
                // The report could not be made (out of memory): the call still completes, with
                // that error, so that nothing waits for it for ever.
                Ok(Err(e)) => (py.None(), e.into_value(py).into_any()),
                Err(refused) => (
                    py.None(),
                    refused_to_py(py, refused).into_value(py).into_any(),
                ),
            };
            if let Err(e) = done.call1(py, args) {
                e.write_unraisable(py, None);
            }
            drop(kept);
        });
    }
}

/// A refused call as the Python exception: the collective's own error, or `InvalidUsage` for a
/// closed communicator (Python has no abort), `Error` for a panic.
fn refused_to_py(py: Python<'_>, refused: Refused) -> PyErr {
    match refused {
        Refused::Failed(e) => to_py(py, e),
        Refused::Closed | Refused::Aborted => InvalidUsage::new_err(refused.to_string()),
        Refused::Panicked(_) => Error::new_err(refused.to_string()),
    }
}

/// A plain all-reduce's operation by its Python name.
fn reduce_op(name: &str) -> PyResult<ReduceOp> {
    match name {
        "sum" => Ok(ReduceOp::Sum),
        "min" => Ok(ReduceOp::Min),
        "max" => Ok(ReduceOp::Max),
        other => Err(InvalidUsage::new_err(format!(
            "op {other:?}: expected \"sum\", \"min\" or \"max\""
        ))),
    }
}

fn runtime() -> PyResult<byzcoll::blocking::Runtime> {
    byzcoll::blocking::Runtime::new()
        .map_err(|e| Error::new_err(format!("cannot start threads: {e}")))
}

fn rule(name: &str, f: usize, m: Option<usize>, tau: Option<f64>) -> PyResult<Box<dyn Aggregator>> {
    aggregators::build(name, &Params { f, m, tau })
        .map_err(|e| InvalidUsage::new_err(e.to_string()))
}

fn policy(name: &str, replicas: Option<usize>) -> PyResult<Policy> {
    match (name, replicas) {
        ("gather", None) => Ok(Policy::Gather),
        ("gather", Some(_)) => Err(InvalidUsage::new_err(
            "replicas apply to policy=\"sharded\" only",
        )),
        ("sharded", None) => Ok(Policy::Sharded(Replicas::Tolerant)),
        ("sharded", Some(r)) => Ok(Policy::Sharded(Replicas::Exactly(r))),
        ("auto", None) => Ok(Policy::Auto),
        ("audited", None) => Ok(Policy::Audited(byzcoll::audit::Audit::default())),
        ("auto" | "audited", Some(_)) => Err(InvalidUsage::new_err(
            "replicas apply to policy=\"sharded\" only",
        )),
        (other, _) => Err(InvalidUsage::new_err(format!(
            "policy {other:?}: expected \"gather\", \"sharded\", \"auto\" or \"audited\""
        ))),
    }
}

#[pymethods]
impl PyCommunicator {
    /// This process's rank.
    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    /// The number of ranks.
    #[getter]
    fn size(&self) -> usize {
        self.inner.size()
    }

    /// The transport's name (`tcp`, `ucx`, `libfabric`, `nccl`, `local`).
    #[getter]
    fn transport(&self) -> PyResult<String> {
        self.with_comm(|c| c.transport().name().to_string())
    }

    /// The agreement policy's name: "off", "detect" or "enforce" (after the calls made before).
    #[getter]
    fn agreement(&self) -> PyResult<&'static str> {
        self.with_comm(|c| c.agreement().name())
    }

    /// Whether `_robust_all_reduce_device` moves a device vector aggregated by `rule` device to
    /// device: over NCCL's own transport (not a communicator split from one), by a rule with
    /// CUDA kernels. Elsewhere a CUDA tensor is staged through host memory. Answered at once,
    /// without waiting for the calls made before (the DDP hook asks for every bucket).
    fn _device_to_device(&self, rule: &str) -> bool {
        self.device_to_device && byzcoll::cuda::has_kernels(rule)
    }

    /// Robust all-reduce in place of a vector in CUDA device memory: `count` elements of
    /// `dtype` (`"float32"`, `"bfloat16"`, `"float16"`) at `ptr`, after the work queued on
    /// `stream` (a `cudaStream_t` as an integer; 0: the default stream), aggregated by the CUDA
    /// kernels through the communicator's device entry point: over NCCL device to device, with
    /// no host copy. The caller keeps the memory alive and untouched during the call (what
    /// `Communicator.robust_all_reduce` does with a CUDA tensor over NCCL). Returns a `Report`.
    #[pyo3(signature = (ptr, count, dtype, rule, f, stream, *, policy="gather", replicas=None, m=None, tau=None))]
    #[allow(clippy::too_many_arguments)]
    fn _robust_all_reduce_device(
        &self,
        py: Python<'_>,
        ptr: usize,
        count: usize,
        dtype: &str,
        rule: &str,
        f: usize,
        stream: usize,
        policy: &str,
        replicas: Option<usize>,
        m: Option<usize>,
        tau: Option<f64>,
    ) -> PyResult<Report> {
        use byzcoll::blocking::device::{robust_all_reduce_lent, DeviceCall};
        let dtype = device_type(dtype)?;
        let params = Params { f, m, tau };
        let call = DeviceCall {
            rule,
            params: &params,
            policy: crate::policy(policy, replicas)?,
        };
        let inner = &self.inner;
        let report = py.detach(|| {
            // SAFETY: the caller's word (the Python wrapper holds the tensor and passes its
            // data pointer, element count and stream); the pointers are checked before use.
            unsafe {
                robust_all_reduce_lent(
                    inner,
                    ptr as *const std::ffi::c_void,
                    ptr as *mut std::ffi::c_void,
                    count,
                    dtype,
                    &call,
                    stream as *mut std::ffi::c_void,
                )
            }
        });
        report
            .map(Report::from)
            .map_err(|refused| refused_to_py(py, refused))
    }

    /// Robust all-reduce in place: `x` (a writable, C-contiguous float32, float64, float16 or
    /// bfloat16 array) is replaced by the robust aggregate of every rank's `x` under `rule` (no
    /// default) tolerating `f` Byzantine ranks. Returns a `Report`.
    #[pyo3(signature = (x, rule, f, *, policy="gather", replicas=None, m=None, tau=None))]
    #[allow(clippy::too_many_arguments)]
    fn robust_all_reduce(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        rule: &str,
        f: usize,
        policy: &str,
        replicas: Option<usize>,
        m: Option<usize>,
        tau: Option<f64>,
    ) -> PyResult<Report> {
        let rule = crate::rule(rule, f, m, tau)?;
        let policy = crate::policy(policy, replicas)?;
        // `x` stays referenced (and so alive) on this stack frame until the task is done.
        let Array { ptr, len, dtype } = array(x, true)?;
        let report = with_element!(dtype, T => self.run(py, move |c| {
            Box::pin(async move {
                // SAFETY: `x` is a live, writable, contiguous array of `len` elements of `T`.
                let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut T, len) };
                c.robust_all_reduce(buf, rule.as_ref(), policy).await
            })
        }))?;
        Ok(report.into())
    }

    /// Starts `robust_all_reduce(x, ...)` after the calls made before it and returns at once:
    /// the calls of a communicator run in the order they are made, whichever way they are
    /// made. `done(report, error)` is called once it has run, on a thread of byzcoll's, with
    /// the Report and None, or None and the exception; `x` is kept alive until then and must
    /// not be touched meanwhile. (What `byzcoll.torch.robust_all_reduce_async` runs on.)
    #[pyo3(signature = (x, rule, f, done, *, policy="gather", replicas=None, m=None, tau=None))]
    #[allow(clippy::too_many_arguments)]
    fn _start_robust_all_reduce(
        &self,
        x: &Bound<'_, PyAny>,
        rule: &str,
        f: usize,
        done: Py<PyAny>,
        policy: &str,
        replicas: Option<usize>,
        m: Option<usize>,
        tau: Option<f64>,
    ) -> PyResult<()> {
        let rule = crate::rule(rule, f, m, tau)?;
        let policy = crate::policy(policy, replicas)?;
        let finish = call_back(done, Some(x.clone().unbind()));
        let Array { ptr, len, dtype } = array(x, true)?;
        with_element!(dtype, T => self.inner.start(
            move |c| {
                Box::pin(async move {
                    // SAFETY: `x` is a live, writable, contiguous array of `len` elements of
                    // `T`, kept alive until `done` has run.
                    let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut T, len) };
                    c.robust_all_reduce(buf, rule.as_ref(), policy).await
                })
            },
            finish,
        ));
        Ok(())
    }

    /// Starts `_robust_all_reduce_device(ptr, ...)` after the calls made before it: the
    /// checks, the wait for the work queued on `stream` and the rule's making happen now (a
    /// refusal raises here); the round runs in its turn, and `done(report, error)` is called
    /// as for `_start_robust_all_reduce` once the result is on the device. The caller keeps the
    /// memory alive and untouched until then (what `byzcoll.torch`'s DDP hook does with a CUDA
    /// bucket over NCCL).
    #[pyo3(signature = (ptr, count, dtype, rule, f, stream, done, *, policy="gather", replicas=None, m=None, tau=None))]
    #[allow(clippy::too_many_arguments)]
    fn _start_robust_all_reduce_device(
        &self,
        py: Python<'_>,
        ptr: usize,
        count: usize,
        dtype: &str,
        rule: &str,
        f: usize,
        stream: usize,
        done: Py<PyAny>,
        policy: &str,
        replicas: Option<usize>,
        m: Option<usize>,
        tau: Option<f64>,
    ) -> PyResult<()> {
        use byzcoll::blocking::device::{start_robust_all_reduce_lent, DeviceCall};
        let dtype = device_type(dtype)?;
        let params = Params { f, m, tau };
        let call = DeviceCall {
            rule,
            params: &params,
            policy: crate::policy(policy, replicas)?,
        };
        let inner = &self.inner;
        let finish = call_back(done, None);
        py.detach(|| {
            // SAFETY: the caller's word (the Python wrapper holds the tensor until `done` has
            // run and passes its data pointer, element count and stream); the pointers are
            // checked before use.
            unsafe {
                start_robust_all_reduce_lent(
                    inner,
                    ptr as *mut std::ffi::c_void,
                    count,
                    dtype,
                    &call,
                    stream as *mut std::ffi::c_void,
                    finish,
                )
            }
        })
        .map_err(|refused| refused_to_py(py, refused))
    }

    /// Robust reduce-scatter: `input` (every rank's whole vector, float32, float64, float16 or
    /// bfloat16, C-contiguous) is cut into `size` shards, and `output` (writable, this rank's shard in
    /// length: `len(input) // size`, one more for the first `len(input) % size` ranks) becomes
    /// `rule` applied to every rank's shard `rank`. The sharded schedule with `replicas` owners
    /// per shard (default 2f + 1). Returns a `Report`.
    #[pyo3(signature = (input, output, rule, f, *, replicas=None, m=None, tau=None))]
    #[allow(clippy::too_many_arguments)]
    fn robust_reduce_scatter(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
        rule: &str,
        f: usize,
        replicas: Option<usize>,
        m: Option<usize>,
        tau: Option<f64>,
    ) -> PyResult<Report> {
        let rule = crate::rule(rule, f, m, tau)?;
        let replicas = replicas.map_or(Replicas::Tolerant, Replicas::Exactly);
        let (inp, out) = (array(input, false)?, array(output, true)?);
        let (a, b) = (inp.span(), out.span());
        if a.start < b.end && b.start < a.end {
            return Err(InvalidUsage::new_err(
                "input and output overlap: the output must be a buffer of its own",
            ));
        }
        // Both stay referenced (and so alive) on this stack frame until the task is done.
        if inp.dtype != out.dtype {
            return Err(InvalidUsage::new_err(
                "input and output must have the same dtype",
            ));
        }
        let report = with_element!(inp.dtype, T => self.run(py, move |c| {
            Box::pin(async move {
                // SAFETY: live, contiguous arrays of `T` of `inp.len` and `out.len` elements
                // that do not overlap; the output is writable.
                let (input, output) = unsafe {
                    (
                        std::slice::from_raw_parts(inp.ptr as *const T, inp.len),
                        std::slice::from_raw_parts_mut(out.ptr as *mut T, out.len),
                    )
                };
                c.robust_reduce_scatter(input, output, rule.as_ref(), replicas)
                    .await
            })
        }))?;
        Ok(report.into())
    }

    /// Non-robust all-reduce in place (`op` "sum", "min" or "max"), the baseline MPI and NCCL
    /// offer: one faulty rank corrupts every result.
    #[pyo3(signature = (x, op="sum"))]
    fn all_reduce(&self, py: Python<'_>, x: &Bound<'_, PyAny>, op: &str) -> PyResult<()> {
        let op = reduce_op(op)?;
        let Array { ptr, len, dtype } = array(x, true)?;
        with_element!(dtype, T => self.run(py, move |c| {
            Box::pin(async move {
                // SAFETY: as in robust_all_reduce.
                let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut T, len) };
                c.all_reduce(buf, op).await
            })
        }))
    }

    /// Starts `all_reduce(x, op)` after the calls made before it and returns at once;
    /// `done(error)` is called once it has run, on a thread of byzcoll's, with None or the
    /// exception, and `x` is kept alive until then. (What the `byzcoll` torch process group's
    /// `allreduce` runs on.)
    fn _start_all_reduce(&self, x: &Bound<'_, PyAny>, op: &str, done: Py<PyAny>) -> PyResult<()> {
        let op = reduce_op(op)?;
        let kept = x.clone().unbind();
        let finish = move |result: Result<(), Refused>| {
            Python::attach(|py| {
                let error = match result {
                    Ok(()) => py.None(),
                    Err(refused) => refused_to_py(py, refused).into_value(py).into_any(),
                };
                if let Err(e) = done.call1(py, (error,)) {
                    e.write_unraisable(py, None);
                }
                // The array is released with the interpreter's lock held.
                drop(kept);
            });
        };
        let Array { ptr, len, dtype } = array(x, true)?;
        with_element!(dtype, T => self.inner.start(
            move |c| {
                Box::pin(async move {
                    // SAFETY: `x` is a live, writable, contiguous array of `len` elements of
                    // `T`, kept alive until `done` has run.
                    let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut T, len) };
                    c.all_reduce(buf, op).await
                })
            },
            finish,
        ));
        Ok(())
    }

    /// How many inputs a robust round (gather policy) may go without for their lateness
    /// alone: `"auto"` (the largest the rule allows with `f` Byzantine inputs among the rest),
    /// a count (0: wait for every input until the deadline), or `"default"` (the same as
    /// `"auto"`, the default; none under agreement off). Every rank must choose alike. Late inputs are faults of kind `"late"` in the report.
    fn set_stragglers(&self, stragglers: &Bound<'_, PyAny>) -> PyResult<()> {
        let s = if let Ok(text) = stragglers.extract::<String>() {
            Stragglers::parse(&text).map_err(InvalidUsage::new_err)?
        } else if let Ok(count) = stragglers.extract::<usize>() {
            Stragglers::Exactly(count)
        } else {
            return Err(InvalidUsage::new_err(
                "stragglers: \"auto\" or a count of ranks (0 or more)",
            ));
        };
        self.with_comm(|c| c.set_stragglers(s))
    }

    /// Sets the step id every later collective call carries in its fingerprint (None: no
    /// step id), e.g. the training step. A rank whose call does not match the others' is a
    /// fault of kind `"out-of-step"`, never a message of another call taken as this one's.
    #[pyo3(signature = (step))]
    fn set_step(&self, step: Option<u64>) -> PyResult<()> {
        self.with_comm(|c| c.set_step(step))
    }

    /// What this rank has seen of each other rank in its robust rounds, in rank order: a list
    /// of dicts with `rank`, `streak` (None, or `(symptom, rounds)` with symptom one of
    /// `"late"`, `"missing"`, `"malformed"`, `"disagreeing"`: what it did in the last round
    /// and how many rounds in a row), the counts `late`, `missing`, `malformed`,
    /// `disagreeing`, `outlying` (rounds whose attribution scored its input above
    /// `OUTLYING_SCORE`) and `not_selected` (selection rules), and `score` (a running
    /// attribution score, None until measured). This rank's own observations only: evidence,
    /// not an accusation.
    fn health<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let peers = self.with_comm(|c| c.health())?;
        peers
            .into_iter()
            .map(|p| {
                let d = PyDict::new(py);
                d.set_item("rank", p.rank)?;
                let streak = p.streak.map(|(symptom, rounds)| {
                    let name = match symptom {
                        Symptom::Late => "late",
                        Symptom::Missing => "missing",
                        Symptom::Malformed => "malformed",
                        Symptom::Disagreeing => "disagreeing",
                        _ => "other",
                    };
                    (name, rounds)
                });
                d.set_item("streak", streak)?;
                d.set_item("late", p.late)?;
                d.set_item("missing", p.missing)?;
                d.set_item("malformed", p.malformed)?;
                d.set_item("disagreeing", p.disagreeing)?;
                d.set_item("outlying", p.outlying)?;
                d.set_item("score", p.score)?;
                d.set_item("not_selected", p.not_selected)?;
                d.set_item("convicted", p.convicted)?;
                Ok(d)
            })
            .collect()
    }

    /// Shrinks the communicator to the ranks that are alive (every live rank calls it), like
    /// MPI_Comm_shrink: the live ranks agree, tolerating f = (n - 1) / 3 Byzantine ranks, on
    /// the ranks to keep, and each gets a new communicator of them, renumbered in their old
    /// order. A rank the others did not keep gets ExcludedError (its `kept` attribute lists
    /// them). This communicator stays usable.
    fn shrink(&self, py: Python<'_>) -> PyResult<PyCommunicator> {
        let sub = self.run(py, |c| {
            Box::pin(async move {
                let r = c.shrink().await;
                r
            })
        })?;
        Ok(PyCommunicator::new(self.inner.runtime().clone(), sub).with_job(self.job.clone()))
    }

    /// Admits the restarted ranks that knocked (a process started with BYZCOLL_REJOIN=1, as
    /// `byzcoll launch --restarts` starts one, whose `byzcoll.init()` knocks and waits): every
    /// member calls it at the same point of its calls, a boundary of the application's choice.
    /// The members agree, tolerating f = (n - 1) / 3 Byzantine members, on whom to admit.
    /// Returns None when nobody knocked, else `(communicator, admitted, epoch)`: the new
    /// communicator of the members and the admitted job ranks, in job-rank order (`job_ranks`),
    /// at the new `epoch`. This communicator stays usable. A communicator joined through
    /// `init_with_allgather` has no store to admit through (InvalidUsage).
    #[allow(clippy::type_complexity)]
    fn admit(&self, py: Python<'_>) -> PyResult<Option<(PyCommunicator, Vec<usize>, u64)>> {
        let Some(job) = self.job.clone() else {
            return Err(InvalidUsage::new_err(
                "admit: this communicator was not joined through the job's store (byzcoll.init)",
            ));
        };
        let config = job.clone();
        let admission = self.run(py, move |c| {
            Box::pin(async move {
                let r = byzcoll::admit(c, &config).await;
                r
            })
        })?;
        match admission {
            Admission::Nobody => Ok(None),
            Admission::Admitted {
                comm,
                admitted,
                epoch,
            } => {
                let comm =
                    PyCommunicator::new(self.inner.runtime().clone(), *comm).with_job(Some(job));
                Ok(Some((comm, admitted, epoch)))
            }
            other => Err(PyRuntimeError::new_err(format!(
                "admit: an outcome this module does not know: {other:?}"
            ))),
        }
    }

    /// Each rank's rank in the job, in this communicator's rank order (0..n at the start; a
    /// shrink keeps its members', an admit gives the members' and the admitted ranks').
    #[getter]
    fn job_ranks(&self) -> PyResult<Vec<usize>> {
        self.with_comm(|c| c.job_ranks().to_vec())
    }

    /// The job's membership epoch: 0 at the start, one more for each admit that admitted a rank.
    #[getter]
    fn epoch(&self) -> PyResult<u64> {
        self.with_comm(|c| c.epoch())
    }

    /// Blocks until every rank has entered the barrier.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |c| {
            Box::pin(async move {
                let r = c.barrier().await;
                r
            })
        })
    }

    /// Closes the connections, collectively; later calls raise InvalidUsage. Where a robust
    /// call went on without a late rank, first waits (up to the step timeout) for every live
    /// rank to reach its close; then what the last calls left in flight is delivered (over
    /// TCP, until the peers have read it and closed too, for at most 10 s).
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.close());
    }

    fn __repr__(&self) -> String {
        format!(
            "Communicator(rank={}, size={})",
            self.inner.rank(),
            self.inner.size()
        )
    }
}

/// Joins the job the launcher's environment describes (byzcoll launch, torchrun, mpirun,
/// srun, or BYZCOLL_RANK / BYZCOLL_WORLD_SIZE), as the Rust `byzcoll::init` does.
#[pyfunction]
fn init(py: Python<'_>) -> PyResult<PyCommunicator> {
    let rt = runtime()?;
    let job = JobConfig::from_env().map_err(|e| to_py(py, e))?;
    let comm = py
        .detach(|| rt.block_on(byzcoll::init_with(&job)))
        .map_err(|e| to_py(py, e))?;
    Ok(PyCommunicator::new(std::sync::Arc::new(rt), comm).with_job(Some(std::sync::Arc::new(job))))
}

/// Joins a `size`-rank job as `rank` through `allgather(record: bytes) -> list[bytes]`, which
/// must return every rank's record in rank order (mpi4py: `comm.allgather`). No store and no
/// BYZCOLL_SECRET: rank 0 draws the job secret and the all-gather hands it out.
#[pyfunction]
#[pyo3(signature = (rank, size, allgather, listen=None, timeout_ms=None))]
fn init_with_allgather(
    py: Python<'_>,
    rank: usize,
    size: usize,
    allgather: Bound<'_, PyAny>,
    listen: Option<&str>,
    timeout_ms: Option<u64>,
) -> PyResult<PyCommunicator> {
    let rt = runtime()?;
    let mut config = JobConfig::for_allgather(rank, size).map_err(|e| to_py(py, e))?;
    if let Some(s) = listen {
        let ip = s
            .parse()
            .map_err(|_| InvalidUsage::new_err(format!("listen {s:?} is not an IP address")))?;
        config = config.with_tcp_listen(ip).map_err(|e| to_py(py, e))?;
    }
    if let Some(ms) = timeout_ms {
        let timeout = byzcoll::step_timeout_ms(ms)
            .map_err(|why| InvalidUsage::new_err(format!("timeout_ms: {why}")))?;
        config = config
            .with_step_timeout(timeout)
            .map_err(|e| to_py(py, e))?;
    }
    let mut gather = |record: &[u8]| -> Result<Vec<u8>, String> {
        let out = allgather
            .call1((PyBytes::new(py, record),))
            .map_err(|e| e.to_string())?;
        let parts: Vec<Vec<u8>> = out
            .extract()
            .map_err(|e| format!("allgather returned something else than a list of bytes: {e}"))?;
        Ok(parts.concat())
    };
    let comm = rt
        .init_with_allgather(&config, &mut gather)
        .map_err(|e| to_py(py, e))?;
    Ok(PyCommunicator::new(std::sync::Arc::new(rt), comm))
}

/// The rules byzcoll knows: `(name, what it needs)`.
#[pyfunction]
fn rules() -> Vec<(&'static str, &'static str)> {
    aggregators::RULES.to_vec()
}

#[pymodule]
fn _byzcoll(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyCommunicator>()?;
    m.add_class::<Report>()?;
    m.add("OUTLYING_SCORE", byzcoll::OUTLYING_SCORE)?;
    m.add_function(wrap_pyfunction!(init, m)?)?;
    m.add_function(wrap_pyfunction!(init_with_allgather, m)?)?;
    m.add_function(wrap_pyfunction!(rules, m)?)?;
    m.add("Error", py.get_type::<Error>())?;
    m.add("InvalidUsage", py.get_type::<InvalidUsage>())?;
    m.add("PreconditionError", py.get_type::<PreconditionError>())?;
    m.add("TooManyFaults", py.get_type::<TooManyFaults>())?;
    m.add("DisagreementError", py.get_type::<DisagreementError>())?;
    m.add("TransportError", py.get_type::<TransportError>())?;
    m.add("ExcludedError", py.get_type::<ExcludedError>())?;
    m.add("FellBehindError", py.get_type::<FellBehindError>())?;
    m.add("BootstrapError", py.get_type::<BootstrapError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
